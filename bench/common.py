"""Timing, tables, JSON and plots shared by the benchmarks in bench/."""
import argparse
import json
import os
import statistics
import sys
import time

import torch


def make_parser(doc: str, shapes_help: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --device, --reps, --out, --shapes."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to run on (default: cuda when present, else cpu)")
    parser.add_argument("--reps", type=int, default=50, help="timed repetitions per case")
    parser.add_argument("--out", default="bench/out", help="folder for the JSON and PNG results")
    parser.add_argument("--shapes", default=None, help=shapes_help)
    return parser


def parse_shapes(text):
    """'4096x4096,128x64' -> [(4096, 4096), (128, 64)]; None -> None."""
    if not text:
        return None
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def time_ms(fn, device: str, reps: int, warmup: int = 5, pipelined: bool = False) -> float:
    """Milliseconds per fn() after `warmup` untimed runs: the median of `reps` runs timed one
    by one (each waits for the GPU), or with `pipelined` the mean of `reps` back-to-back runs
    timed together -- the steady state of a training loop, where the CPU queues the next step
    while the GPU works."""
    for _ in range(warmup):
        fn()
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


def graphed(fn, warmup: int = 3):
    """`fn` captured in a CUDA graph after `warmup` calls on a side stream: a callable that
    replays it and returns what the captured call returned (its static output)."""
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
    return replay


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


def save_bar_plot(path, labels, series: dict, ylabel: str, title: str) -> None:
    """Grouped bars, one group per label, one bar per series; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
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
