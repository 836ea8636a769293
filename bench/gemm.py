"""FP8 GEMM throughput: tpfp8.ops.gemm (cuBLASLt) vs torch._scaled_mm vs bf16 torch.matmul.

All three compute D[M, N] = A[M, K] . B[N, K]^T with bf16 output; the FP8 runs share the same
E4M3 bytes and tensorwise scales. TFLOP/s = 2*M*N*K / time.

  python bench/gemm.py
  python bench/gemm.py --shapes 4096x4096x4096   # MxKxN
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_name, make_parser, parse_shapes, print_table,  # noqa: E402
                    save_bar_plot, save_json, settle_applied, time_ms)

from tpfp8 import ops  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 16384), (16384, 16384, 4096),
          (2048, 1024, 1024)]


def make_cases(m, k, n, device):
    a_hp = torch.randn(m, k, device=device)
    b_hp = torch.randn(n, k, device=device)
    scale = torch.tensor([64.0], device=device)
    qa, qb = ops.quantize(a_hp, scale, "e4m3"), ops.quantize(b_hp, scale, "e4m3")
    a8 = qa.rowwise.view(torch.float8_e4m3fn)
    b8 = qb.rowwise.view(torch.float8_e4m3fn)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    a16, b16 = a_hp.bfloat16(), b_hp.bfloat16()
    cases = {
        "tpfp8 fast-acc": lambda: ops.gemm(a8, b8, out=out, a_scale_inv=qa.scale_inv,
                                           b_scale_inv=qb.scale_inv, fast_accum=True),
        "tpfp8 split-acc": lambda: ops.gemm(a8, b8, out=out, a_scale_inv=qa.scale_inv,
                                            b_scale_inv=qb.scale_inv, fast_accum=False),
        "bf16 matmul": lambda: torch.matmul(a16, b16.t()),
    }
    if hasattr(torch, "_scaled_mm") and device.startswith("cuda"):
        cases["_scaled_mm fast-acc"] = lambda: torch._scaled_mm(
            a8, b8.t(), scale_a=qa.scale_inv, scale_b=qb.scale_inv, out_dtype=torch.bfloat16,
            use_fast_accum=True)
    return cases


def main(argv=None):
    parser = make_parser(__doc__, "comma-separated MxKxN list")
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda"):
        parser.error("the GEMM benchmark needs a CUDA device (the CPU reference is a test oracle, "
                     "not a fast path)")
    shapes = parse_shapes(args.shapes) or SHAPES
    results, rows = [], []
    for i, (m, k, n) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] M={m} K={k} N={n} ...", flush=True)
        cases = make_cases(m, k, n, args.device)
        r = {"m": m, "k": k, "n": n}
        for name, fn in cases.items():
            ms = time_ms(fn, args.device, args.reps, warmup=10, settle_s=args.settle)
            r[name] = {"ms": ms, "tflops": 2 * m * n * k / ms / 1e9}
        ours = r["tpfp8 fast-acc"]["tflops"]
        ref = r.get("_scaled_mm fast-acc", {}).get("tflops", float("nan"))
        r["vs_scaled_mm"] = ours / ref
        r["vs_bf16"] = ours / r["bf16 matmul"]["tflops"]
        results.append(r)
        rows.append([f"{m}x{k}x{n}", f"{ours:.0f}", f"{r['tpfp8 split-acc']['tflops']:.0f}",
                     f"{ref:.0f}", f"{r['bf16 matmul']['tflops']:.0f}",
                     f"{r['vs_scaled_mm']:.3f}x", f"{r['vs_bf16']:.2f}x"])
        del cases
    dev = device_name(args.device)
    print(f"\nGEMM TFLOP/s, E4M3 x E4M3 -> bf16, on {dev}")
    print_table(["MxKxN", "tpfp8 fast", "tpfp8 split", "_scaled_mm fast", "bf16 matmul",
                 "tpfp8/_scaled_mm", "tpfp8/bf16"], rows)
    save_json(os.path.join(args.out, "gemm.json"),
              {"device": dev, "settle_s": settle_applied(args), "results": results})
    labels = [f"{r['m']}x{r['k']}x{r['n']}" for r in results]
    save_bar_plot(os.path.join(args.out, "gemm.png"), labels,
                  {n: [r[n]["tflops"] if n in r else 0 for r in results]
                   for n in ("tpfp8 fast-acc", "_scaled_mm fast-acc", "bf16 matmul")},
                  "TFLOP/s", f"GEMM throughput on {dev}")


if __name__ == "__main__":
    main()
