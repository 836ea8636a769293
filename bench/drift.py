"""Does a sustained training step slow down as the card heats? The other benchmarks visit
their cases in a fixed order (bf16 first) and keep each case's best round. If the card got
slower over a run, the cases listed first would meet a cooler card, and that order would
favour bf16. This script runs one bf16 MLP step back to back for --seconds: fc1 -> GELU
(tanh) -> fc2, 4x hidden, no biases, fwd+bwd (bench/compile.py's block is the same with biases
and exact GELU). It times blocks of 10 steps with CUDA events and reads the temperature, SM
clock and power after each block (nvidia-smi; the GPU idles while it answers, ~20 % of the run
on the H200). It prints the step time in windows of the run, and saves every block to JSON and
a plot of step time and temperature against time to PNG.

  python bench/drift.py                  # 75 s at hidden 4096, 8192 tokens
  python bench/drift.py --seconds 300
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, print_table, pyplot, save_json, time_ms  # noqa: E402

_BLOCK = 10  # steps timed together: one event pair per block keeps the GPU queue full
_WINDOWS_S = (0, 5, 15, 30, 45, 60)


def card_state(device: str):
    """(temperature C, SM clock MHz, power W) from nvidia-smi, or None where there is none."""
    if not device.startswith("cuda"):
        return None
    query = "--query-gpu=temperature.gpu,clocks.sm,power.draw"
    index = str(torch.device(device).index or 0)
    try:
        out = subprocess.run(["nvidia-smi", "-i", index, query, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        temp, clock, power = (float(v) for v in out.strip().split(","))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return temp, clock, power


def mlp_step(tokens: int, hidden: int, device: str):
    """A bf16 MLP training step's closure (weights' and input's gradients)."""
    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    def randn(*shape, grad=True):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_(grad)
    x, dy = randn(tokens, hidden), randn(tokens, hidden, grad=False)
    w1, w2 = randn(4 * hidden, hidden), randn(hidden, 4 * hidden)

    def step():
        y = F.linear(F.gelu(F.linear(x, w1), approximate="tanh"), w2)
        y.backward(dy)
    return step


def windows(blocks, seconds: float):
    """Table rows: each window's block count, median and min step time, temperature range."""
    edges = [w for w in _WINDOWS_S if w < seconds] + [float("inf")]
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [b for b in blocks if lo <= b["t_s"] < hi]
        if not inside:
            continue
        ms = [b["ms"] for b in inside]
        temps = [b["temp_c"] for b in inside if b["temp_c"] is not None]
        clocks = [b["sm_mhz"] for b in inside if b["sm_mhz"] is not None]
        span = f"{lo:g}-{hi:g} s" if hi != float("inf") else f"{lo:g} s-end"
        rows.append([span, len(inside), f"{statistics.median(ms):.3f}", f"{min(ms):.3f}",
                     f"{min(temps):g}-{max(temps):g}" if temps else "-",
                     f"{statistics.median(clocks):g}" if clocks else "-"])
    return rows


def save_plot(path: str, blocks) -> None:
    plt = pyplot()
    if plt is None:
        return
    t = [b["t_s"] for b in blocks]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [b["ms"] for b in blocks], ".", markersize=3, label="step (ms)")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("bf16 MLP step, ms (10-step blocks)")
    temps = [b["temp_c"] for b in blocks]
    if all(v is not None for v in temps):
        twin = ax.twinx()
        twin.plot(t, temps, color="tab:red", linewidth=0.6, alpha=0.6, label="temperature (C)")
        twin.set_ylabel("temperature, C")
    ax.set_title("Step time over a sustained run")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to run on (default: cuda when present, else cpu)")
    parser.add_argument("--shape", default="8192x4096", help="TOKENSxHIDDEN of the MLP")
    parser.add_argument("--seconds", type=float, default=75.0,
                        help="how long to run steps back to back")
    parser.add_argument("--out", default="bench/out", help="folder for the JSON and PNG results")
    args = parser.parse_args(argv)
    try:
        tokens, hidden = (int(v) for v in args.shape.split("x"))
    except ValueError:
        parser.error(f"--shape {args.shape!r}: expected TOKENSxHIDDEN, e.g. 8192x4096")
    if tokens <= 0 or hidden <= 0 or args.seconds <= 0:
        parser.error("--shape's sizes and --seconds must be positive")
    print(f"torch {torch.__version__}, {device_name(args.device)}; MLP {tokens}x{hidden}, "
          f"{args.seconds:g} s", flush=True)
    step = mlp_step(tokens, hidden, args.device)
    print("idle card (temperature C, SM MHz, W):", card_state(args.device), flush=True)
    for _ in range(3):
        step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    blocks, t0, next_report = [], time.perf_counter(), 10.0
    while time.perf_counter() - t0 < args.seconds:
        ms = time_ms(step, args.device, _BLOCK, warmup=0, pipelined=True)
        state = card_state(args.device) or (None, None, None)
        blocks.append({"t_s": round(time.perf_counter() - t0, 2), "ms": ms,
                       "temp_c": state[0], "sm_mhz": state[1], "power_w": state[2]})
        if blocks[-1]["t_s"] >= next_report:
            print(f"  {blocks[-1]['t_s']:.0f} s: {len(blocks)} blocks", flush=True)
            next_report += 10.0
    print_table(["window", "blocks", "median ms", "min ms", "temperature C", "SM MHz"],
                windows(blocks, args.seconds))
    save_json(os.path.join(args.out, "drift.json"),
              {"device": device_name(args.device), "torch": torch.__version__,
               "tokens": tokens, "hidden": hidden, "steps_per_block": _BLOCK, "blocks": blocks})
    save_plot(os.path.join(args.out, "drift.png"), blocks)


if __name__ == "__main__":
    main()
