"""Can a memory-bound kernel share the GPU with an FP8 GEMM? The GEMM planned for fewer SMs
(torch's SM carve-out, which sets cuBLASLt's SM count target) runs on the current stream, and a
kernel moving GELU backward's bytes on a second stream beside it; against the two in turn with
every SM for the GEMM. Torch only: it asks whether the hardware allows the overlap at all
before tpfp8 would build on it (bench/RESULTS.md, twenty-second session).

The GEMM is the MLP's fc2 weight gradient at hidden 4096 (D[4096, 16384] over K = 8192 tokens,
E4M3, bf16 out). The second kernel reads two and writes one [8192, 16384] bf16 tensor (768 MB):
  add            x + y: little arithmetic per byte
  gelu_backward  aten's exact (erf) GELU backward: ALU-heavy, as tpfp8's activation kernels
Times are the steady state (back-to-back calls timed together), best of --rounds; "saved" is
the in-turn time with every SM for the GEMM minus the time of the two at once.

  python bench/sm_share.py
  python bench/sm_share.py --carveouts 0,8,12,16 --kernels add
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_name, make_parser, print_table, save_bar_plot,  # noqa: E402
                    save_json, settle_applied, time_ms)

TOKENS, HIDDEN, FFN = 8192, 4096, 16384


def companions(device):
    """The memory-bound kernels, each a callable, on [TOKENS, FFN] bf16 tensors."""
    x = torch.randn(TOKENS, FFN, device=device, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    out = torch.empty_like(x)
    return {
        "add": lambda: torch.add(x, y, out=out),
        "gelu_backward": lambda: torch.ops.aten.gelu_backward.grad_input(y, x, grad_input=out),
    }


def fc2_wgrad(device):
    one = torch.ones((), device=device)
    a = torch.randn(HIDDEN, TOKENS, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(FFN, TOKENS, device=device).to(torch.float8_e4m3fn).t()
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def at_once(gemm, kernel, side):
    """The GEMM queued first on the current stream, the kernel on `side` forked before it."""
    def run():
        forked = torch.cuda.Event()
        forked.record()
        gemm()
        with torch.cuda.stream(side):
            side.wait_event(forked)
            kernel()
        torch.cuda.current_stream().wait_stream(side)
    return run


def best_ms(fn, device, reps, rounds, settle_s):
    return min(time_ms(fn, device, reps, warmup=3, pipelined=True, settle_s=settle_s)
               for _ in range(rounds))


def measure(name, kernel, gemm, side, carveouts, args):
    """One companion kernel at every carve-out (0 first: the baseline of "saved")."""
    def timed(fn):
        return best_ms(fn, args.device, args.reps, args.rounds, args.settle) * 1e3
    alone, results = timed(kernel), []
    for c in carveouts:
        torch._C._set_sm_carveout_experimental(c if c else None)
        r = {"kernel": name, "carveout": c, "kernel_alone_us": alone, "gemm_us": timed(gemm),
             "in_turn_us": timed(lambda: (gemm(), kernel())),
             "at_once_us": timed(at_once(gemm, kernel, side))}
        r["saved_us"] = (results[0] if results else r)["in_turn_us"] - r["at_once_us"]
        results.append(r)
        print(f"{name}, {c} SMs left out: GEMM {r['gemm_us']:.1f} us, in turn "
              f"{r['in_turn_us']:.1f}, at once {r['at_once_us']:.1f}", flush=True)
    return results


def main(argv=None):
    parser = make_parser(__doc__, "unused (the shapes are the MLP's at hidden 4096)")
    parser.add_argument("--carveouts", default="0,8,12,16,24,32",
                        help="comma-separated SM counts left out of the GEMM; 0 (every SM, the "
                             "baseline) is always run (default 0,8,12,16,24,32)")
    parser.add_argument("--kernels", default="add,gelu_backward",
                        help="comma-separated companion kernels: add, gelu_backward")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case, best kept")
    parser.set_defaults(reps=20)
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda") or not hasattr(torch._C,
                                                         "_set_sm_carveout_experimental"):
        sys.exit("sm_share.py needs a CUDA device and a torch with the SM carve-out "
                 "(torch._C._set_sm_carveout_experimental, torch >= 2.7)")
    carveouts = [0] + [c for c in (int(v) for v in args.carveouts.split(",")) if c != 0]
    wanted = args.kernels.split(",")
    gemm, side = fc2_wgrad(args.device), torch.cuda.Stream()
    results = []
    try:
        for name, kernel in companions(args.device).items():
            if name in wanted:
                results += measure(name, kernel, gemm, side, carveouts, args)
    finally:
        torch._C._set_sm_carveout_experimental(None)
    report(results, device_name(args.device), args.out, settle_applied(args))


def report(results, dev, out, settle_s):
    print(f"\nfc2's weight gradient (FP8 {HIDDEN}x{FFN}, K {TOKENS}) beside a memory-bound "
          f"kernel, us, on {dev}")
    print_table(["kernel", "SMs left out", "kernel alone", "GEMM alone", "in turn", "at once",
                 "saved"],
                [[r["kernel"], r["carveout"], f"{r['kernel_alone_us']:.1f}",
                  f"{r['gemm_us']:.1f}", f"{r['in_turn_us']:.1f}", f"{r['at_once_us']:.1f}",
                  f"{r['saved_us']:+.1f}"] for r in results])
    save_json(os.path.join(out, "sm_share.json"),
              {"device": dev, "settle_s": settle_s, "results": results})
    save_bar_plot(os.path.join(out, "sm_share.png"),
                  [f"{r['kernel']} -{r['carveout']}" for r in results],
                  {"in turn": [r["in_turn_us"] for r in results],
                   "at once": [r["at_once_us"] for r in results]},
                  "us per pair", f"FP8 GEMM with a memory-bound kernel beside it, {dev}")


if __name__ == "__main__":
    main()
