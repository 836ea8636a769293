"""Cast-transpose bandwidth: tpfp8 vs a torch-native cast-transpose vs a plain copy.

For bf16 [M, K] inputs, each method reads 2 bytes and writes 2 bytes per element (FP8 row-wise
+ column-wise; the copy writes the same bf16 bytes back). GB/s counts bytes read + written.
Inputs rotate across several buffers so the 60 MB L2 does not serve repeated runs.

GB/s is the device's throughput: back-to-back calls, total time / calls. The "1 call" ratio
times each call alone (median), which also counts the host's time to issue it while the GPU
waits: a Python torch.ops call costs a few microseconds more than Tensor.copy_.

  python bench/cast.py                 # the issue's shapes on the GPU
  python bench/cast.py --device cpu    # small shapes, CPU reference
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_name, make_parser, parse_shapes, print_table,  # noqa: E402
                    save_bar_plot, save_json, settle_applied, time_ms)

import tpfp8  # noqa: E402,F401

GPU_SHAPES = [(4096, 4096), (8192, 8192), (16384, 4096), (16384, 16384)]
CPU_SHAPES = [(256, 256), (512, 1024)]


def make_cases(m, k, device, copies):
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    scale = torch.tensor([2.0], device=device)
    row = torch.empty(m, k, dtype=torch.uint8, device=device)
    col = torch.empty(k, m, dtype=torch.uint8, device=device)
    amax = torch.zeros(1, device=device)
    scale_inv = torch.empty(1, device=device)
    dst = torch.empty_like(xs[0])
    it = {"i": 0}

    def nxt():
        it["i"] = (it["i"] + 1) % copies
        return xs[it["i"]]

    def ours():
        torch.ops.tpfp8.cast_transpose(nxt(), scale, row, col, amax, scale_inv, 0)

    def torch_native():
        x = nxt()
        a = x.abs().max().float()
        q = (x.float() * scale).to(torch.float8_e4m3fn)
        return a, q, q.t().contiguous()

    def copy():
        dst.copy_(nxt())

    return {"tpfp8 cast_transpose": ours, "torch-native": torch_native, "copy": copy}


def main(argv=None):
    args = make_parser(__doc__, "comma-separated MxK list (default: the issue's GPU shapes, "
                                "or small ones on CPU)").parse_args(argv)
    default = GPU_SHAPES if args.device.startswith("cuda") else CPU_SHAPES
    shapes = parse_shapes(args.shapes) or default
    reps = args.reps if args.device.startswith("cuda") else min(args.reps, 5)

    results, rows = [], []
    for i, (m, k) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] {m}x{k} ...", flush=True)
        copies = max(2, min(8, (256 << 20) // (m * k * 2)))  # > L2 worth of inputs
        cases = make_cases(m, k, args.device, copies)
        nbytes = m * k * 4  # 2 B read + 2 B written per element, for every method
        r = {"m": m, "k": k}
        for name, fn in cases.items():
            ms = time_ms(fn, args.device, reps, pipelined=True, settle_s=args.settle)
            single = time_ms(fn, args.device, reps, settle_s=args.settle)
            r[name] = {"ms": ms, "GBps": nbytes / ms / 1e6, "single_call_ms": single}
        ours, copy = r["tpfp8 cast_transpose"], r["copy"]
        r["vs_copy"] = ours["GBps"] / copy["GBps"]
        r["vs_copy_single_call"] = copy["single_call_ms"] / ours["single_call_ms"]
        r["vs_torch"] = ours["GBps"] / r["torch-native"]["GBps"]
        results.append(r)
        rows.append([f"{m}x{k}", f"{ours['ms']:.4f}", f"{ours['GBps']:.0f}",
                     f"{r['torch-native']['GBps']:.0f}", f"{copy['GBps']:.0f}",
                     f"{r['vs_copy']:.1%}", f"{r['vs_torch']:.1f}x",
                     f"{r['vs_copy_single_call']:.1%}"])
        del cases

    dev = device_name(args.device)
    print(f"\ncast_transpose bf16 -> FP8 E4M3 row+col, on {dev} (GB/s = bytes read + written)")
    print_table(["M x K", "tpfp8 ms", "tpfp8 GB/s", "torch GB/s", "copy GB/s", "tpfp8/copy",
                 "tpfp8/torch", "tpfp8/copy, 1 call"], rows)
    save_json(os.path.join(args.out, "cast.json"),
              {"device": dev, "settle_s": settle_applied(args), "results": results})
    labels = [f"{r['m']}x{r['k']}" for r in results]
    save_bar_plot(os.path.join(args.out, "cast.png"), labels,
                  {n: [r[n]["GBps"] for r in results]
                   for n in ("tpfp8 cast_transpose", "torch-native", "copy")},
                  "GB/s (read + written)", f"bf16 cast-transpose on {dev}")


if __name__ == "__main__":
    main()
