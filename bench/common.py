"""Timing, tables, JSON and plots shared by the benchmarks in bench/."""
import argparse
import ctypes
import functools
import json
import math
import os
import statistics
import sys
import time

import torch


def make_parser(doc: str, shapes_help: str, settle: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: --device, --reps, --out, --shapes, and --settle
    where its timings take it (`settle`)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to run on (default: cuda when present, else cpu)")
    parser.add_argument("--reps", type=int, default=50, help="timed repetitions per case")
    parser.add_argument("--out", default="bench/out", help="folder for the JSON and PNG results")
    parser.add_argument("--shapes", default=None, help=shapes_help)
    if settle:
        add_settle_argument(parser)
    return parser


def parse_shapes(text):
    """'4096x4096,128x64' -> [(4096, 4096), (128, 64)]; None -> None."""
    if not text:
        return None
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def time_ms(fn, device: str, reps: int, warmup: int = 5, pipelined: bool = False,
            settle_s: float = 0.0) -> float:
    """Milliseconds per fn() after `warmup` untimed runs: the median of `reps` runs timed one
    by one (each waits for the GPU), or with `pipelined` the mean of `reps` back-to-back runs
    timed together -- the steady state of a training loop, where the CPU queues the next step
    while the GPU works. `settle_s`: on a GPU, untimed back-to-back runs for that long first
    (settle)."""
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        settle(fn, settle_s)
    if pipelined and device.startswith("cuda"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    times = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def settle(fn, seconds: float) -> None:
    """Runs fn() back to back for `seconds` on the current CUDA device, waiting on the oldest
    call whenever three are queued, so that a timing that follows starts at the clocks of
    sustained work. The H200 runs at its 700 W cap:
    after an idle moment its SM clock is 1980 MHz and falls to about 1500 MHz within 0.2 s of
    load, so the first steps run up to ~10 % faster (forty-third session). A short timed window
    holds more of them for a faster step than for a slower one, which flatters the faster."""
    if seconds <= 0:
        return
    queued = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        queued.append(torch.cuda.Event())
        queued[-1].record()
        if len(queued) > 2:
            queued.pop(0).synchronize()


def seconds_arg(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def settle_applied(args) -> float:
    """The --settle seconds a run applies: none off the GPU (time_ms settles CUDA only)."""
    return args.settle if args.device.startswith("cuda") else 0.0


def add_settle_argument(parser: argparse.ArgumentParser, default: float = 0.5) -> None:
    """--settle SECONDS: untimed back-to-back steps before each timed window (settle)."""
    parser.add_argument("--settle", type=seconds_arg, default=default, metavar="SECONDS",
                        help="on a GPU, run each case untimed for this long right before each "
                             "of its timed windows, so that every case is timed at the clocks "
                             f"of sustained work, not an idle card's (default {default}; 0: off)")


def graphed(fn, warmup: int = 3):
    """`fn` captured in a CUDA graph after `warmup` calls on a side stream: a callable that
    replays it and returns what the captured call returned (its static output). The callable
    keeps `fn` alive, and with it what `fn` holds: the graph writes a model's buffers (tpfp8's
    FP8 scales and amax histories), which a caller keeping only the replay would otherwise free
    under the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    replay.step = fn
    return replay


class EnergyCounter:
    """The GPU's total energy counter (NVML, read through the driver's libnvidia-ml: no pynvml
    needed), in joules; `read()` is None where there is none (CPU, no driver, an old GPU).
    One per device: `energy_counter(device)`."""

    def __init__(self, device: str):
        self._lib = self._handle = None
        if not device.startswith("cuda"):
            return
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            index = torch.cuda._get_nvml_device_index(torch.device(device))
            if (lib.nvmlInit_v2() == 0 and
                    lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0):
                self._lib, self._handle = lib, handle
        except Exception:  # no library, no symbol, no device: no counter
            pass

    def read(self):
        if self._lib is None:
            return None
        mj = ctypes.c_ulonglong()
        status = self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(mj))
        return mj.value / 1e3 if status == 0 else None


@functools.lru_cache(maxsize=None)
def energy_counter(device: str) -> EnergyCounter:
    """The device's EnergyCounter, made (and NVML initialised) once."""
    return EnergyCounter(device)


def add_energy_argument(parser: argparse.ArgumentParser) -> None:
    """--energy SECONDS: also measure each case's joules per call (energy_per_call)."""
    parser.add_argument("--energy", type=float, default=0.0, metavar="SECONDS",
                        help="after timing, run each case for this long and report its energy "
                             "per step and mean power from the GPU's energy counter (0: off)")


def energy_per_call(fn, device: str, seconds: float):
    """(joules per fn() call, mean watts) over back-to-back calls for at least `seconds` (the
    counter advances in steps of milliseconds to tens of them, so windows of seconds), or None
    where the GPU's energy cannot be read. Under a power cap a step's time follows its energy,
    so this is the figure that holds between runs when clocks do not."""
    counter = energy_counter(device)
    if counter.read() is None:
        return None
    torch.cuda.synchronize()
    calls, elapsed, t0, e0 = 0, 0.0, time.perf_counter(), counter.read()
    while elapsed < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    joules = counter.read() - e0
    return joules / calls, joules / elapsed


def gemm_autotune() -> str:
    """How tpfp8 picks its cuBLASLt GEMM configurations in this process (README, "GEMM"):
    TPFP8_GEMM_AUTOTUNE unset times the heuristic's list, "search" sweeps every one."""
    return os.environ.get("TPFP8_GEMM_AUTOTUNE", "heuristic's list (default)")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({os.cpu_count()} cores)"


def print_table(headers, rows) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    def line(r):
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print(line(r))
    sys.stdout.flush()


def save_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (said once) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return None
    return plt


def save_bar_plot(path, labels, series: dict, ylabel: str, title: str) -> None:
    """Grouped bars, one group per label, one bar per series; skipped without matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
