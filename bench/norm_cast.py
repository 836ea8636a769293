"""Fused norm -> FP8 cast bandwidth: tpfp8's norm_cast vs torch's norm then tpfp8's
cast_transpose vs torch.compile of norm + cast, against a device-to-device copy.

For bf16 x [M, H] (LayerNorm and RMSNorm, delayed scaling, E4M3), every method produces the
same outputs: the bf16 normalized output, FP8 row-wise + column-wise codes, the amax, and the
per-row mean / rstd. GB/s counts the bytes a fused pass must move, the same for every method:
x read (2 B) + out (2 B) + FP8 row and column (2 B) per element, and 4 or 8 B per row of stats;
the unfused methods really move more. "% copy" divides by a bf16 copy's GB/s (read + written)
measured in the same run. Inputs rotate across buffers so the L2 does not serve repeats.

  python bench/norm_cast.py                          # hidden 2048/4096/8192 x 8192 rows, GPU
  python bench/norm_cast.py --device cpu --quick     # smoke test of the CPU reference
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_name, make_parser, parse_shapes, print_table,  # noqa: E402
                    save_bar_plot, save_json, settle_applied, time_ms)

import tpfp8  # noqa: E402,F401

GPU_SHAPES = [(8192, 2048), (8192, 4096), (8192, 8192)]
CPU_SHAPES = [(64, 256), (128, 1024)]
QUICK_SHAPES = [(32, 256)]
NORMS = ("layernorm", "rmsnorm")
FUSED, TORCH_THEN_CAST, COMPILED, COPY = ("tpfp8 norm_cast", "torch norm + cast_transpose",
                                          "torch.compile norm + cast", "copy")


def make_cases(m, h, norm, device, copies, with_compile):
    rms = norm == "rmsnorm"
    xs = [torch.randn(m, h, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    gamma = torch.randn(h, device=device)
    beta = None if rms else torch.randn(h, device=device)
    scale = torch.tensor([2.0], device=device)
    out = torch.empty_like(xs[0])
    row = torch.empty(m, h, dtype=torch.uint8, device=device)
    col = torch.empty(h, m, dtype=torch.uint8, device=device)
    amax, scale_inv = torch.zeros(1, device=device), torch.empty(1, device=device)
    mean = None if rms else torch.empty(m, device=device)
    rstd = torch.empty(m, device=device)
    dst = torch.empty_like(xs[0])
    it = {"i": 0}

    def nxt():
        it["i"] = (it["i"] + 1) % copies
        return xs[it["i"]]

    def fused():
        torch.ops.tpfp8.norm_cast(nxt(), gamma, beta, rms, 1e-5, scale, out, row, col, amax,
                                  scale_inv, mean, rstd, 0)

    def torch_norm(x):
        """(y, mean, rstd) as torch computes them, in fp32 then rounded to x's dtype."""
        xf = x.float()
        mu = None if rms else xf.mean(1, keepdim=True)
        centred = xf if rms else xf - mu
        r = torch.rsqrt(centred.pow(2).mean(1, keepdim=True) + 1e-5)
        y = centred * r * gamma
        return (y if rms else y + beta).to(x.dtype), mu, r

    def torch_then_cast():
        x = nxt()
        if rms:
            y = torch.nn.functional.rms_norm(x, (h,), gamma.to(x.dtype), 1e-5)
            r = torch.rsqrt(x.float().pow(2).mean(1) + 1e-5)  # rstd, which rms_norm does not give
        else:
            y, _, r = torch.ops.aten.native_layer_norm(x, (h,), gamma.to(x.dtype),
                                                       beta.to(x.dtype), 1e-5)
        torch.ops.tpfp8.cast_transpose(y, scale, row, col, amax, scale_inv, 0)
        return r

    def norm_and_cast(x):
        y, mu, r = torch_norm(x)
        a = y.abs().max().float()
        q = (y.float() * scale).to(torch.float8_e4m3fn)
        return y, q, q.t().contiguous(), a, mu, r

    compiled = torch.compile(norm_and_cast) if with_compile else None

    def copy():
        dst.copy_(nxt())

    cases = {FUSED: fused, TORCH_THEN_CAST: torch_then_cast, COPY: copy}
    if compiled is not None:
        cases[COMPILED] = lambda: compiled(nxt())
    return cases


def _cell(r, name):
    return f"{r[name]['GBps']:.0f} ({r[name]['vs_copy']:.0%})" if name in r else "-"


def main(argv=None):
    parser = make_parser(__doc__, "comma-separated MxH list (default: 8192 rows x hidden "
                                  "2048/4096/8192 on GPU, small ones on CPU)")
    parser.add_argument("--quick", action="store_true",
                        help="one small shape, few repetitions, no torch.compile (smoke test)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile case")
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    default = QUICK_SHAPES if args.quick else GPU_SHAPES if gpu else CPU_SHAPES
    shapes = parse_shapes(args.shapes) or default
    reps = 3 if args.quick else args.reps if gpu else min(args.reps, 5)
    with_compile = not (args.quick or args.no_compile)

    results, rows = [], []
    for i, (m, h) in enumerate(shapes):
        for norm in NORMS:
            print(f"[{i + 1}/{len(shapes)}] {norm} {m}x{h} ...", flush=True)
            copies = max(2, min(8, (256 << 20) // (m * h * 2)))  # > L2 worth of inputs
            cases = make_cases(m, h, norm, args.device, copies, with_compile)
            stats = 4 if norm == "rmsnorm" else 8
            nbytes = m * h * 6 + m * stats
            copy_bytes = m * h * 4
            r = {"m": m, "hidden": h, "norm": norm}
            for name, fn in cases.items():
                ms = time_ms(fn, args.device, reps, warmup=2 if args.quick else 5,
                             pipelined=True, settle_s=args.settle)
                moved = copy_bytes if name == COPY else nbytes
                r[name] = {"ms": ms, "GBps": moved / ms / 1e6}
            copy_gbps = r[COPY]["GBps"]
            for name in cases:
                r[name]["vs_copy"] = r[name]["GBps"] / copy_gbps
            results.append(r)
            rows.append([f"{norm} {m}x{h}", f"{r[FUSED]['ms']:.4f}", _cell(r, FUSED),
                         _cell(r, TORCH_THEN_CAST), _cell(r, COMPILED), f"{copy_gbps:.0f}",
                         f"{r[TORCH_THEN_CAST]['ms'] / r[FUSED]['ms']:.2f}x"])
            del cases

    dev = device_name(args.device)
    print(f"\nnorm -> FP8 E4M3 row+col + bf16 out + stats, bf16 input, on {dev} "
          "(GB/s of a fused pass's bytes, % of a copy's GB/s)")
    print_table(["norm M x H", "fused ms", FUSED, TORCH_THEN_CAST, COMPILED, "copy GB/s",
                 "speed-up vs unfused"], rows)
    save_json(os.path.join(args.out, "norm_cast.json"),
              {"device": dev, "settle_s": settle_applied(args), "results": results})
    labels = [f"{r['norm'][:3]} {r['m']}x{r['hidden']}" for r in results]
    names = [n for n in (FUSED, TORCH_THEN_CAST, COMPILED, COPY) if n in results[0]]
    save_bar_plot(os.path.join(args.out, "norm_cast.png"), labels,
                  {n: [r[n]["GBps"] for r in results] for n in names},
                  "GB/s (fused pass's bytes)", f"bf16 norm -> FP8 cast on {dev}")


if __name__ == "__main__":
    main()
