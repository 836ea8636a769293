"""Tensor-parallel MLP block (column fc1 -> GELU -> row fc2, sequence parallel): communication
bytes per step, FP8 vs bf16, and (under torchrun) step time against the bf16 Megatron-style
baseline -- the same layers and collectives outside fp8_autocast.

  python bench/tp.py                                   # bytes per step for TP = 2, 4, 8
  torchrun --nproc_per_node=2 bench/tp.py --time       # step times on this machine's ranks
  torchrun --nproc_per_node=2 bench/tp.py --time --device cpu --hidden 64 --seq 32 --reps 2
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, make_parser, print_table, save_json, time_ms  # noqa: E402

import tpfp8  # noqa: E402


def bytes_per_step(seq, batch, hidden, tp, fp8):
    """Bytes each rank receives per training step of one MLP block with sequence parallelism.
    Gathers (fc1 input in forward and again for wgrad, fc2's dy) move FP8 codes under FP8;
    reduce-scatters (fc2 output, fc1 dx) stay in bf16."""
    tokens = seq * batch
    gathered = 2 * tokens * hidden  # fc1 x (forward), fc1 x (backward re-gather)
    gathered += tokens * hidden     # fc2 dy (backward)
    reduced = 2 * tokens * hidden   # fc2 y (forward), fc1 dx (backward)
    share = (tp - 1) / tp           # what a rank receives of a gathered / reduced tensor
    return share * (gathered * (1 if fp8 else 2) + reduced * 2)


def bytes_table(args):
    rows, results = [], []
    for tp in (2, 4, 8):
        fp8 = bytes_per_step(args.seq, args.batch, args.hidden, tp, True)
        bf16 = bytes_per_step(args.seq, args.batch, args.hidden, tp, False)
        results.append({"tp": tp, "fp8_bytes": fp8, "bf16_bytes": bf16})
        rows.append([tp, f"{fp8 / 2**20:.1f}", f"{bf16 / 2**20:.1f}", f"{fp8 / bf16:.0%}"])
    print(f"\nMLP block, sequence parallel, seq={args.seq} batch={args.batch} "
          f"hidden={args.hidden} ffn={4 * args.hidden}: MiB received per rank per step")
    print_table(["TP", "FP8", "bf16", "FP8/bf16"], rows)
    save_json(os.path.join(args.out, "tp_bytes.json"), {"results": results})


def time_steps(args):
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=60))
    rank, tp = dist.get_rank(), dist.get_world_size()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    group = dist.new_group(list(range(tp)))
    kw = {"tp_group": group, "sequence_parallel": True, "device": device}
    fc1 = tpfp8.Linear(args.hidden, 4 * args.hidden, parallel_mode="column", **kw)
    fc2 = tpfp8.Linear(4 * args.hidden, args.hidden, parallel_mode="row", **kw)
    x = torch.randn(args.seq // tp, args.batch, args.hidden, device=device,
                    dtype=torch.bfloat16, requires_grad=True)

    def step(fp8):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not fp8):
            with tpfp8.fp8_autocast(enabled=fp8):
                y = fc2(torch.nn.functional.gelu(fc1(x)))
        y.float().sum().backward()

    times = {name: time_ms(lambda: step(fp8), device, args.reps, pipelined=True)
             for name, fp8 in (("bf16 (Megatron-style)", False), ("tpfp8 FP8", True))}
    if rank == 0:
        base = times["bf16 (Megatron-style)"]
        print(f"\nMLP block step on {tp} ranks of {device_name(device)}")
        print_table(["", "ms", "speed-up"],
                    [[k, f"{v:.3f}", f"{base / v:.2f}x"] for k, v in times.items()])
        save_json(os.path.join(args.out, f"tp_time_{tp}.json"), {"tp": tp, "ms": times})
    dist.destroy_process_group()


def main(argv=None):
    # (No --settle: ranks settling for a time would run different counts of collectives.)
    parser = make_parser(__doc__, "unused", settle=False)
    parser.add_argument("--time", action="store_true", help="time steps (run under torchrun)")
    parser.add_argument("--seq", type=int, default=8192, help="sequence length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=8192)
    args = parser.parse_args(argv)
    if args.time:
        time_steps(args)
    else:
        bytes_table(args)


if __name__ == "__main__":
    main()
