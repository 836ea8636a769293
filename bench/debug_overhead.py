"""Cost of having tpfp8.debug initialised when no rule matches a layer: forward+backward time
of tpfp8.Linear with debugging off and with a rule for another layer, in one run.

  python bench/debug_overhead.py                    # 4096 x 4096 x 4096, bf16 input, GPU
  python bench/debug_overhead.py --device cpu --shapes 64x64x64 --reps 5
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (device_name, make_parser, parse_shapes, print_table,  # noqa: E402
                    save_json, settle_applied, time_ms)

import tpfp8  # noqa: E402


def main(argv=None):
    parser = make_parser(__doc__, "comma-separated MxKxN list")
    parser.set_defaults(reps=200)
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes) or [(4096, 4096, 4096), (2048, 1024, 1024)]
    rows, results = [], []
    for m, k, n in shapes:
        layer = tpfp8.Linear(k, n, device=args.device, name="model.fc1")
        x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=args.device, dtype=torch.bfloat16)

        def step():
            with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling()):
                y = layer(x)
            y.backward(dy)

        # Interleave the two settings so clock drift affects both alike.
        off, on = [], []
        for _ in range(5):
            tpfp8.debug.shutdown()
            off.append(time_ms(step, args.device, args.reps, pipelined=True,
                               settle_s=args.settle))
            tpfp8.debug.initialize([{"layers": "attention", "features": {"log_stats": {}}}])
            on.append(time_ms(step, args.device, args.reps, pipelined=True,
                              settle_s=args.settle))
        tpfp8.debug.shutdown()
        t_off, t_on = min(off), min(on)
        results.append({"m": m, "k": k, "n": n, "off_ms": t_off, "on_ms": t_on})
        rows.append([f"{m}x{k}x{n}", f"{t_off:.3f}", f"{t_on:.3f}", f"{t_on / t_off - 1:+.1%}"])
    dev = device_name(args.device)
    print(f"\ntpfp8.Linear fwd+bwd with tpfp8.debug initialised, no matching rule, on {dev}")
    print_table(["MxKxN", "debug off ms", "debug on ms", "overhead"], rows)
    save_json(os.path.join(args.out, "debug_overhead.json"),
              {"device": dev, "settle_s": settle_applied(args), "results": results})


if __name__ == "__main__":
    main()
