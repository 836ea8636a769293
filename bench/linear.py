"""Forward+backward time of tpfp8.Linear (delayed and current scaling) beside bf16 nn.Linear
and a torch-native FP8 linear (torch casts + torch._scaled_mm), plus the activation memory
each keeps for backward.

  python bench/linear.py                       # the issue's shapes, bf16 inputs and weights
  python bench/linear.py --shapes 4096x4096x4096
  python bench/linear.py --device cpu --shapes 64x64x64 --reps 2   # smoke run of the script

A step is what a training loop does per layer: gradients set to None, forward, backward.
Each step is timed three ways: back to back (the steady state, the headline: best of --rounds
rounds over all methods), one at a time (each waited for), and replayed from a CUDA graph of
the step (GPU only: no host time at all, so the graphed ratio is what the GPU work alone
gives; where it beats the eager ratio, the host is what limits the eager step). On a GPU each
timed window follows --settle seconds of the same step, so that every method is timed at the
clocks of sustained work (bench/common.settle).
"""
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_name, graphed, make_parser, parse_shapes,  # noqa: E402
                    print_table, save_bar_plot, save_json, settle_applied, time_ms)

import tpfp8  # noqa: E402

SHAPES = [(2048, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 16384),
          (16384, 16384, 4096)]


def _to_fp8(t, dtype):
    amax = t.abs().max().float()
    scale = torch.finfo(dtype).max / amax.clamp_min(1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()


class TorchNativeFp8Linear(torch.autograd.Function):
    """The baseline users write by hand: current scaling with torch ops, _scaled_mm GEMMs."""

    @staticmethod
    def forward(ctx, x, w):
        e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
        x8, sx = _to_fp8(x, e4m3)
        w8, sw = _to_fp8(w, e4m3)
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype,
                             use_fast_accum=True)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.e5m2 = e5m2
        return y

    @staticmethod
    def backward(ctx, dy):
        x8, sx, w8, sw = ctx.saved_tensors
        dy8, sdy = _to_fp8(dy, ctx.e5m2)
        dx = torch._scaled_mm(dy8, w8.t().contiguous().t(), scale_a=sdy, scale_b=sw,
                              out_dtype=dy.dtype)
        dw = torch._scaled_mm(dy8.t().contiguous(), x8.t().contiguous().t(), scale_a=sdy,
                              scale_b=sx, out_dtype=dy.dtype)
        return dx, dw


def make_cases(m, k, n, device):
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    # Every method holds bf16 parameters, as the bf16 baseline does (fp32 master weights live
    # in the optimizer); gradients come out in bf16 for all of them.
    ours = tpfp8.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    bf16 = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    w_native = nn.Parameter(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02)

    grads_of = [x, ours.weight, bf16.weight, w_native]

    def step(fn):
        def run():
            # A training step starts without gradients (optimizer.zero_grad()'s default), so
            # backward stores dx and dW rather than adding them into last step's (two extra
            # element-wise passes that belong to no layer: 64 us of 0.6 ms at 4096^3).
            for t in grads_of:
                t.grad = None
            y = fn()
            y.backward(dy)
            return y
        return run

    def in_fp8(recipe):
        def run():
            with tpfp8.fp8_autocast(recipe=recipe):
                return ours(x)
        return run

    cases = {
        "bf16 nn.Linear": step(lambda: bf16(x)),
        "tpfp8 delayed": step(in_fp8(tpfp8.DelayedScaling())),
        "tpfp8 current": step(in_fp8(tpfp8.CurrentScaling())),
    }
    if device.startswith("cuda") and hasattr(torch, "_scaled_mm"):
        cases["torch-native fp8"] = step(lambda: TorchNativeFp8Linear.apply(x, w_native))
    def fp8_forward(recipe):
        def run(inp):
            with tpfp8.fp8_autocast(recipe=recipe):
                return ours(inp)
        return run

    forwards = {"bf16 nn.Linear": bf16, "tpfp8 delayed": fp8_forward(tpfp8.DelayedScaling()),
                "tpfp8 current": fp8_forward(tpfp8.CurrentScaling())}
    return cases, forwards


def saved_bytes(forward, m, k, device):
    """Bytes a forward keeps alive for backward once its input is dropped, output excluded."""
    if not device.startswith("cuda"):
        return float("nan")
    # x is made by an op, as activations are: a leaf would be kept alive by its own
    # gradient-accumulation node whatever the layer saves.
    source = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    x = source.clone()
    y = forward(x)
    del x
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return kept


def measure(cases, device, reps, rounds, settle_s):
    """Each case's step time, three ways (module docstring), and its speed-ups over bf16. The
    steady state is the best of `rounds` rounds that each visit every case in turn, so a spell
    of host noise (the small shapes are host-bound) does not fall on one method alone. Each
    timed window follows `settle_s` seconds of the same step (common.settle)."""
    r = {name: {"ms": float("inf")} for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            r[name]["ms"] = min(r[name]["ms"], time_ms(fn, device, reps, pipelined=True,
                                                       settle_s=settle_s))
    for name, fn in cases.items():
        r[name]["sync_ms"] = time_ms(fn, device, reps, settle_s=settle_s)
        if device.startswith("cuda"):
            r[name]["graph_ms"] = time_ms(graphed(fn), device, reps, pipelined=True,
                                          settle_s=settle_s)
    for kind in ("", "sync_", "graph_"):
        base = r["bf16 nn.Linear"].get(kind + "ms", float("nan"))
        for name in cases:
            r[name][kind + "speedup_vs_bf16"] = base / r[name].get(kind + "ms", float("nan"))
    return r


def profile(cases, device):
    """GPU kernel times of 10 steps of each tpfp8 case (where a step's time goes)."""
    for name in ("tpfp8 delayed", "tpfp8 current"):
        fn = cases[name]
        for _ in range(3):
            fn()
        acts = [torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else []
        with torch.profiler.profile(activities=acts or None) as prof:
            for _ in range(10):
                fn()
        print(f"{name}, 10 steps:")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12,
                                        max_name_column_width=60))


def main(argv=None):
    parser = make_parser(__doc__, "comma-separated MxKxN list")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all methods; the steady state is each one's best")
    parser.add_argument("--profile", action="store_true",
                        help="print the GPU kernel times of the tpfp8 steps instead of timing")
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes) or SHAPES
    results, rows = [], []
    for i, (m, k, n) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] M={m} K={k} N={n} ...", flush=True)
        cases, forwards = make_cases(m, k, n, args.device)
        if args.profile:  # a profiled process times differently: profile, don't time
            profile(cases, args.device)
            continue
        r = {"m": m, "k": k, "n": n,
             **measure(cases, args.device, args.reps, args.rounds, args.settle)}
        base = r["bf16 nn.Linear"]["ms"]
        for name, fwd in forwards.items():
            r[name]["saved_bytes"] = saved_bytes(fwd, m, k, args.device)
        # tpfp8 also keeps the column-wise FP8 weight (N*K bytes) for dgrad; the rest is x's.
        x_bytes = r["tpfp8 delayed"]["saved_bytes"] - n * k
        mem = x_bytes / r["bf16 nn.Linear"]["saved_bytes"]
        r["x_saved_vs_bf16"] = mem
        results.append(r)
        native = r.get("torch-native fp8", {}).get("speedup_vs_bf16", float("nan"))
        rows.append([f"{m}x{k}x{n}", f"{base:.3f}", f"{r['tpfp8 delayed']['speedup_vs_bf16']:.2f}x",
                     f"{r['tpfp8 current']['speedup_vs_bf16']:.2f}x", f"{native:.2f}x",
                     f"{mem:.0%}", f"{r['tpfp8 delayed']['sync_speedup_vs_bf16']:.2f}x",
                     f"{r['tpfp8 current']['sync_speedup_vs_bf16']:.2f}x",
                     f"{r['tpfp8 delayed']['graph_speedup_vs_bf16']:.2f}x",
                     f"{r['tpfp8 current']['graph_speedup_vs_bf16']:.2f}x"])
        del cases, forwards
    if not results:
        return
    dev = device_name(args.device)
    print(f"\nLinear forward+backward, bf16 input, on {dev} (speed-up = bf16 time / time; "
          f"steady state of back-to-back steps; each step alone, waited for; CUDA-graph replays "
          f"of the step against graphed bf16)")
    print_table(["MxKxN", "bf16 ms", "tpfp8 delayed", "tpfp8 current", "torch-native fp8",
                 "saved x vs bf16", "delayed, 1 step", "current, 1 step", "delayed, graphed",
                 "current, graphed"], rows)
    save_json(os.path.join(args.out, "linear.json"),
              {"device": dev, "settle_s": settle_applied(args), "results": results})
    labels = [f"{r['m']}x{r['k']}x{r['n']}" for r in results]
    names = [n for n in ("tpfp8 delayed", "tpfp8 current", "torch-native fp8") if n in results[0]]
    save_bar_plot(os.path.join(args.out, "linear.png"), labels,
                  {n: [r[n]["speedup_vs_bf16"] for r in results] for n in names},
                  "speed-up vs bf16 nn.Linear", f"Linear fwd+bwd on {dev}")


if __name__ == "__main__":
    main()
