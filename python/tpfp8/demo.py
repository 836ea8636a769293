"""Train a tensor-parallel transformer MLP block in FP8 and in high precision, side by side.

The block is Megatron's: column-parallel fc1 -> GELU -> row-parallel fc2, with sequence
parallelism, learning to imitate a fixed random teacher block on synthetic tokens. Both runs
start from the same weights and see the same data; the demo prints the loss every few steps,
the final loss gap and tokens/s of each, and writes a PNG of the two loss curves.

  python -m tpfp8.demo                    # 2 ranks: NCCL on GPUs, gloo otherwise
  python -m tpfp8.demo --steps 400 --hidden 1024 --recipe current --tp 2
  python -m tpfp8.demo --debug-config debug.json   # with precision-debugging rules

Run directly, it starts itself under torchrun with --tp ranks.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import tpfp8


def parse_args(argv=None):
    """The demo's options (see --help)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (ffn is 4x)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (split over ranks)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--recipe", choices=("delayed", "current"), default="delayed",
                   help="FP8 scaling recipe")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=20, help="print the loss every N steps")
    p.add_argument("--debug-config", default=None,
                   help="tpfp8.debug rules (JSON/YAML path) applied to the FP8 run")
    p.add_argument("--out", default="demo_out", help="folder for the PNG and JSON results")
    return p.parse_args(argv)


def relaunch_under_torchrun(args) -> int:
    """Runs this demo again under torchrun with --tp ranks; returns its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.tp}", "-m", "tpfp8.demo"] + sys.argv[1:]
    return subprocess.call(cmd)


class Block(nn.Module):
    """y = fc2(gelu(fc1(x))), fc1 column-parallel, fc2 row-parallel, sequence parallel."""

    def __init__(self, hidden, group, device):
        super().__init__()
        kw = {"tp_group": group, "sequence_parallel": True, "device": device}
        self.fc1 = tpfp8.Linear(hidden, 4 * hidden, parallel_mode="column", name="block.fc1",
                                **kw)
        self.fc2 = tpfp8.Linear(4 * hidden, hidden, parallel_mode="row", name="block.fc2", **kw)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def progress(step, total, loss, rank):
    """A one-line progress bar on a terminal (logs get the periodic loss lines instead)."""
    if rank == 0 and sys.stderr.isatty():
        done = int(30 * step / total)
        sys.stderr.write(f"\r  [{'#' * done}{'.' * (30 - done)}] {step}/{total} "
                         f"loss {loss:.4f}")
        sys.stderr.flush()


def train(args, fp8, group, device, recipe):
    """One training run; returns (the loss of every step, tokens per second)."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.Tanh()).to(device)
    model = Block(args.hidden, group, device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rank, tp = dist.get_rank(), dist.get_world_size()
    losses, start = [], None
    for step in range(1, args.steps + 1):
        if step == 2:  # the first step builds GEMM plans: time the rest
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(args.seq, args.batch, args.hidden, device=device, generator=g)
        with torch.no_grad():
            target = teacher(x)
        local = tpfp8.parallel.split_sequence(x, group)
        with tpfp8.fp8_autocast(enabled=fp8, recipe=recipe):
            out = model(local)
        loss = nn.functional.mse_loss(out.float(), tpfp8.parallel.split_sequence(target, group))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if fp8:
            tpfp8.debug.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(float(total) / tp)
        progress(step, args.steps, losses[-1], rank)
        if rank == 0 and step % args.log_every == 0:
            if sys.stderr.isatty():
                sys.stderr.write("\n")
            print(f"  step {step:5d}  loss {losses[-1]:.5f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start if start else float("nan")
    tokens_per_s = (args.steps - 1) * args.seq * args.batch / elapsed
    return losses, tokens_per_s


def plot(path, curves):
    """Writes the loss curves {name: losses} to a PNG (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (MSE to the teacher)")
    ax.set_yscale("log")
    ax.set_title("tpfp8 demo: tensor-parallel MLP block")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    """Entry point: both runs on every rank; rank 0 prints the comparison and writes files."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return relaunch_under_torchrun(args)
    cuda = torch.cuda.is_available() and tpfp8.with_cuda()
    world = int(os.environ["WORLD_SIZE"])
    # NCCL takes one GPU per rank; ranks sharing a GPU (or no GPU) use gloo.
    backend = "nccl" if cuda and torch.cuda.device_count() >= world else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(list(range(world)))
    if args.seq % world:
        raise ValueError(f"--seq {args.seq} must be divisible by the {world} ranks")
    recipe = tpfp8.DelayedScaling() if args.recipe == "delayed" else tpfp8.CurrentScaling()
    rank = dist.get_rank()
    if rank == 0:
        print(f"tpfp8 demo: {world} ranks ({backend}, {device.type}), hidden {args.hidden}, "
              f"seq {args.seq} x batch {args.batch}, {args.steps} steps, recipe {args.recipe}")
    results = {}
    for name, fp8 in (("high precision", False), (f"FP8 ({args.recipe})", True)):
        if rank == 0:
            print(f"{name}:", flush=True)
        if fp8 and args.debug_config:
            tpfp8.debug.initialize(args.debug_config, log_dir=args.out)
        results[name] = train(args, fp8, group, device, recipe)
        tpfp8.debug.shutdown()
    if rank == 0:
        (hp_name, (hp, hp_tps)), (fp8_name, (f8, f8_tps)) = results.items()
        tail = max(1, len(hp) // 10)
        hp_final, f8_final = sum(hp[-tail:]) / tail, sum(f8[-tail:]) / tail
        gap = (f8_final - hp_final) / hp_final
        print(f"\nfinal loss (mean of the last {tail} steps): high precision {hp_final:.5f}, "
              f"FP8 {f8_final:.5f}, gap {gap:+.2%}")
        print(f"tokens/s: high precision {hp_tps:,.0f}, FP8 {f8_tps:,.0f} "
              f"({f8_tps / hp_tps:.2f}x)")
        os.makedirs(args.out, exist_ok=True)
        plot(os.path.join(args.out, "demo_loss.png"), {hp_name: hp, fp8_name: f8})
        summary = {"hp_final": hp_final, "fp8_final": f8_final, "gap": gap,
                   "hp_tokens_per_s": hp_tps, "fp8_tokens_per_s": f8_tps, "args": vars(args)}
        with open(os.path.join(args.out, "demo.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"DEMO RESULT {json.dumps({'gap': gap})}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
