"""Fused activation + FP8 cast (tpfp8.ops.activation_*) vs torch's activation then tpfp8's
cast_transpose, eager and under torch.compile, and a device copy.

The MLP block's shapes: act(x) of [rows, n] (GELU: x [rows, n]; SwiGLU: x [rows, 2n]) cast to
FP8 row-wise + column-wise (forward, E4M3), and dx = dy * act'(x) of x's shape (backward,
E5M2), bf16 in. GB/s counts the bytes the fused op must move, the same for every method:
forward reads x and writes the two FP8 copies of act(x); backward reads dy and x and writes the
two FP8 copies of dx. The unfused methods move more (act(x) or dx written and read back in
bf16), which is what fusing saves. "% copy" is against a bf16 device copy measured in the same
run (GB/s read + written). Delayed scaling is one pass; current scaling adds an amax pass that
reads the inputs again (fused) or the bf16 result again (unfused).

Inputs rotate across buffers so L2 does not serve repeated calls; times are back-to-back
calls (the steady state of a training loop).

  python bench/activation_cast.py --out bench/results   # n = 4096, 8192, 14336 x 8192 rows
  python bench/activation_cast.py --device cpu --quick  # smoke test of the CPU reference
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_name, make_parser, parse_shapes, print_table,  # noqa: E402
                    save_bar_plot, save_json, settle_applied, time_ms)

import tpfp8  # noqa: E402,F401

GPU_SHAPES = [(8192, 4096), (8192, 8192), (8192, 14336)]  # rows x n
QUICK_SHAPES = [(64, 64), (96, 128)]
ACTIVATIONS = {"gelu": 0, "swiglu": 1}
E4M3, E5M2 = 0, 1
_cast = torch.ops.tpfp8


def torch_forward(x, activation):
    if activation == "gelu":
        return F.gelu(x)
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def torch_backward(dy, x, activation):
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(dy, x)
    a, b = x.chunk(2, dim=-1)
    s = torch.sigmoid(a)
    return torch.cat([dy * b * s * (1 + a * (1 - s)), dy * a * s], dim=-1)


def make_cases(rows, n, activation, backward, device, copies, compile_):
    width = 2 * n if activation == "swiglu" else n
    cols = width if backward else n  # of the FP8 result
    xs = [torch.randn(rows, width, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    dys = [torch.randn(rows, n, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    scale = torch.tensor([2.0], device=device)
    amax = torch.zeros(1, device=device)
    scale_inv = torch.empty(1, device=device)
    row = torch.empty(rows, cols, dtype=torch.uint8, device=device)
    col = torch.empty(cols, rows, dtype=torch.uint8, device=device)
    code, fmt = ACTIVATIONS[activation], E5M2 if backward else E4M3
    it = {"i": 0}

    def nxt():
        it["i"] = (it["i"] + 1) % copies
        return xs[it["i"]], dys[it["i"]]

    def fused():
        x, dy = nxt()
        if backward:
            _cast.activation_backward_cast(dy, x, scale, row, col, None, amax, scale_inv, code,
                                           fmt)
        else:
            _cast.activation_cast(x, scale, row, col, None, amax, scale_inv, code, fmt)

    def fused_current():
        x, dy = nxt()
        amax.zero_()
        if backward:
            _cast.activation_backward_amax(dy, x, amax, code)
            _cast.activation_backward_cast_current(dy, x, amax, 0.0, row, col, None, scale_inv,
                                                   code, fmt)
        else:
            _cast.activation_amax(x, amax, code)
            _cast.activation_cast_current(x, amax, 0.0, row, col, None, scale_inv, code, fmt)

    def unfused_step(x, dy):
        y = torch_backward(dy, x, activation) if backward else torch_forward(x, activation)
        _cast.cast_transpose(y, scale, row, col, amax, scale_inv, fmt)

    def unfused_current_step(x, dy):
        y = torch_backward(dy, x, activation) if backward else torch_forward(x, activation)
        a = torch.zeros(1, device=x.device)
        _cast.amax(y, a)
        _cast.cast_transpose_current(y, a, 0.0, row, col, scale_inv, fmt)

    compiled = torch.compile(unfused_step, fullgraph=True) if compile_ else None
    cases = {
        "fused": fused,
        "fused current": fused_current,
        "torch act + cast_transpose": lambda: unfused_step(*nxt()),
        "torch act + cast current": lambda: unfused_current_step(*nxt()),
    }
    if compiled:
        cases["compiled act + cast_transpose"] = lambda: compiled(*nxt())
    dst = torch.empty(rows, width, device=device, dtype=torch.bfloat16)
    cases["copy"] = lambda: dst.copy_(nxt()[0])
    in_bytes = 2 * rows * (width + (n if backward else 0))
    return cases, in_bytes + 2 * rows * cols, 4 * rows * width


def main(argv=None):
    parser = make_parser(__doc__, "comma-separated ROWSxN list (default: 8192 rows x n = 4096, "
                                  "8192, 14336; with --quick small ones)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, few repetitions, no torch.compile: a smoke test")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile case")
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes) or (QUICK_SHAPES if args.quick else GPU_SHAPES)
    reps = 3 if args.quick else args.reps
    compile_ = not (args.quick or args.no_compile)

    results, rows_out = [], []
    configs = [(a, b) for a in ACTIVATIONS for b in (False, True)]
    for i, (rows, n) in enumerate(shapes):
        for activation, backward in configs:
            direction = "bwd" if backward else "fwd"
            print(f"[{i + 1}/{len(shapes)}] {rows}x{n} {activation} {direction} ...", flush=True)
            width = 2 * n if activation == "swiglu" else n
            copies = max(2, min(8, (256 << 20) // (rows * width * 2)))  # > L2 worth of inputs
            cases, nbytes, copy_bytes = make_cases(rows, n, activation, backward, args.device,
                                                   copies, compile_)
            r = {"rows": rows, "n": n, "activation": activation, "direction": direction,
                 "bytes": nbytes}
            for name, fn in cases.items():
                try:
                    ms = time_ms(fn, args.device, reps, pipelined=True, settle_s=args.settle)
                except Exception as exc:  # (a compile failure must not lose the other rows)
                    print(f"  {name} failed: {type(exc).__name__}: {exc}", flush=True)
                    r[name] = {"ms": float("nan"), "GBps": float("nan"), "error": str(exc)}
                    continue
                moved = copy_bytes if name == "copy" else nbytes
                r[name] = {"ms": ms, "GBps": moved / ms / 1e6}
            copy_gbps = r["copy"]["GBps"]
            for name in cases:
                r[name]["vs_copy"] = r[name]["GBps"] / copy_gbps
            results.append(r)
            base = r["torch act + cast_transpose"]["ms"]
            rows_out.append(
                [f"{rows}x{n}", activation, direction]
                + [f"{r[name]['GBps']:.4g} ({r[name]['vs_copy']:.0%})" for name in cases
                   if name != "copy"]
                + [f"{copy_gbps:.0f}", f"{base / r['fused']['ms']:.2f}x",
                   f"{r['torch act + cast current']['ms'] / r['fused current']['ms']:.2f}x"])
            del cases

    dev = device_name(args.device)
    names = [k for k in results[0] if isinstance(results[0][k], dict) and k != "copy"]
    print(f"\nactivation + FP8 cast (bf16 in, row + column-wise FP8 out) on {dev}: GB/s of the "
          "fused op's bytes (% of a device copy)")
    print_table(["rows x n", "act", "dir"] + names + ["copy GB/s", "fused speed-up",
                                                      "fused current speed-up"], rows_out)
    save_json(os.path.join(args.out, "activation_cast.json"),
              {"device": dev, "reps": reps, "settle_s": settle_applied(args), "results": results})
    labels = [f"{r['activation']} {r['direction']}\n{r['rows']}x{r['n']}" for r in results]
    save_bar_plot(os.path.join(args.out, "activation_cast.png"), labels,
                  {name: [r[name]["vs_copy"] * 100 for r in results] for name in names},
                  "% of device copy bandwidth", f"activation + FP8 cast on {dev}")


if __name__ == "__main__":
    main()
