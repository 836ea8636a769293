"""Train a Llama-style decoder on real text in high precision and in FP8, side by side.

The model (byte and position embeddings, pre-norm layers of RMSNorm, causal self-attention and
a SwiGLU MLP, an untied LM head) learns to predict the next byte of the Python standard
library's own sources, which every machine has. Both runs start from the same weights, see the
same batches and use the same AdamW; they differ only in the FP8 run's tpfp8.fp8_autocast
around forward and backward, in which every Linear of the layers (tpfp8.swap_linear; the
256-way LM head stays in high precision) computes in FP8. The demo shows a progress bar, then
tokens/s of both runs (steady state: the first 10 % of steps are not timed) and their ratio,
the final loss of each (mean of the last 10 % of steps) and the gap, and writes the loss
curves (demo_loss.png, with matplotlib) and the numbers (demo.json) to --out.

On a GPU the default model is one where FP8 pays: 4 layers of hidden 4096, FFN 14336 and 32
heads (1 B parameters), 4 sequences of 2048 bytes a step, in bf16. On the CPU, where FP8 is
emulated by the reference kernels (exact, not fast), it is tiny: well under a minute.

With --tp N (default: 2 when two GPUs are visible, else 1) the demo starts itself under
torchrun with N ranks (NCCL with a GPU each, else gloo) and splits the layers Megatron-style:
qkv and gate/up column-parallel (the heads and the FFN split across ranks), o and down
row-parallel, sequence-parallel in between.

  python -m tpfp8.demo                          # the GPU or CPU defaults above
  python -m tpfp8.demo --recipe current --steps 200
  python -m tpfp8.demo --tp 2                   # 2 GPUs (or 2 gloo ranks on the CPU)
  python -m tpfp8.demo --debug-config debug.json   # precision-debugging rules, FP8 run
"""
import argparse
import copy
import datetime
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import tpfp8
from tpfp8.parallel import group_rank, split_sequence

VOCAB = 256  # byte values
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRESETS = {  # what an option left unset takes on a GPU / on the CPU
    "cuda": {"steps": 500, "hidden": 4096, "ffn": 14336, "heads": 32, "layers": 4,
             "seq": 2048, "batch": 4, "lr": 3e-4, "dtype": "bf16"},
    "cpu": {"steps": 100, "hidden": 64, "ffn": 224, "heads": 4, "layers": 2, "seq": 64,
            "batch": 8, "lr": 1e-2, "dtype": "fp32"},
}
HELP = {"steps": "training steps per run", "hidden": "model width",
        "ffn": "SwiGLU MLP width", "heads": "attention heads", "layers": "decoder layers",
        "seq": "bytes per sequence", "batch": "sequences per step",
        "lr": "AdamW's learning rate after warm-up (the first 10 %% of steps), decaying to a "
              "tenth of it (cosine)",
        "dtype": "parameters and activations"}


def parse_args(argv=None):
    """The demo's options (see --help); sizes left unset are filled in by resolve()."""
    p = argparse.ArgumentParser(prog="python -m tpfp8.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, what in HELP.items():
        gpu, cpu = PRESETS["cuda"][name], PRESETS["cpu"][name]
        kind = {"lr": float, "dtype": str}.get(name, int)
        p.add_argument(f"--{name}", type=kind, default=None,
                       choices=tuple(DTYPES) if name == "dtype" else None,
                       help=f"{what} (default: {gpu} on a GPU, {cpu} on the CPU)")
    p.add_argument("--recipe", choices=("delayed", "current"), default="delayed",
                   help="FP8 scaling recipe (default: delayed)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel ranks (default: 2 when 2 GPUs are visible, else 1)")
    p.add_argument("--data-mb", type=float, default=32,
                   help="read at most this many MB of the standard library (default: 32)")
    p.add_argument("--seed", type=int, default=0, help="weights and batches (default: 0)")
    p.add_argument("--fused", action="store_true",
                   help="FP8 run with tpfp8's fused modules (RMSNormLinear for norm + qkv, "
                        "LayerNormMLP for norm + SwiGLU MLP), split as the Linears under --tp")
    p.add_argument("--debug-config", default=None,
                   help="tpfp8.debug rules (JSON/YAML path) applied to the FP8 run")
    p.add_argument("--out", default="demo_out",
                   help="folder for demo_loss.png and demo.json (default: demo_out)")
    return p.parse_args(argv)


def resolve(args, cuda: bool):
    """Fills the options left unset from the GPU or CPU preset; checks the sizes."""
    for name, value in PRESETS["cuda" if cuda else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tp is None:
        args.tp = 2 if cuda and torch.cuda.device_count() >= 2 else 1
    per_rank = 16 * args.tp  # FP8 GEMMs need feature sizes (per rank) that are multiples of 16
    for what, value, divisor in (("--hidden", args.hidden, per_rank),
                                 ("--ffn", args.ffn, per_rank),
                                 ("--hidden", args.hidden, args.heads),
                                 ("--heads", args.heads, args.tp),
                                 ("--seq", args.seq, args.tp)):
        if value % divisor:
            raise SystemExit(f"{what} {value} must be a multiple of {divisor} "
                             f"(--heads {args.heads}, --tp {args.tp})")
    return args


# -- data -----------------------------------------------------------------------------------

def stdlib_sources():
    """The paths of the standard library's .py files (without site-packages), sorted."""
    for folder, dirs, files in os.walk(os.path.dirname(os.__file__)):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))


def stdlib_bytes(max_mb: float) -> torch.Tensor:
    """The first max_mb MB of the standard library's sources, one file after the other:
    uint8 [n]."""
    limit, chunks, size = int(max_mb * 2**20), [], 0
    for path in stdlib_sources():
        if size >= limit:
            break
        with open(path, "rb") as f:
            chunks.append(f.read())
        size += len(chunks[-1])
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


def batches(data: torch.Tensor, args):
    """(inputs, targets) of every step: random windows of data (on its device), int64
    [seq, batch] each, the same for every run and every rank of a seed."""
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(data) - args.seq - 1, (args.steps, 1, args.batch),
                           generator=g).to(data.device)
    offsets = torch.arange(args.seq + 1, device=data.device)[:, None]
    for s in starts:
        windows = data[s + offsets].long()
        yield windows[:-1], windows[1:]


# -- model ----------------------------------------------------------------------------------

class Parts:
    """Makes the model's parts on one device and dtype. Linears are bias-free nn.Linear on one
    device (swapped for tpfp8.Linear later), sequence-parallel tpfp8.Linear in the given
    parallel mode under tensor parallelism (high precision outside fp8_autocast)."""

    def __init__(self, group, device, dtype):
        self.group, self.kw = group, {"device": device, "dtype": dtype}

    def linear(self, in_features, out_features, mode):
        if self.group is None:
            return nn.Linear(in_features, out_features, bias=False, **self.kw)
        return tpfp8.Linear(in_features, out_features, bias=False, parallel_mode=mode,
                            tp_group=self.group, sequence_parallel=True, **self.kw)

    def norm(self, hidden):
        return nn.RMSNorm(hidden, **self.kw)

    def embedding(self, rows, hidden):
        return nn.Embedding(rows, hidden, **self.kw)


class Attention(nn.Module):
    """Causal multi-head self-attention. qkv's output features are grouped by head (q, k, v
    of head 0, then of head 1, ...), so a column split gives each rank whole heads."""

    def __init__(self, hidden, heads, parts):
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv = parts.linear(hidden, 3 * hidden, "column")
        self.o = parts.linear(hidden, hidden, "row")

    def forward(self, x):  # [seq(/tp), batch, hidden] -> the same
        qkv = self.qkv(x).unflatten(-1, (-1, 3, self.head_dim))  # [seq, batch, heads, 3, d]
        q, k, v = qkv.permute(3, 1, 2, 0, 4)  # [batch, heads, seq, d] each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.permute(2, 0, 1, 3).flatten(2))


class MLP(nn.Module):
    """down(silu(gate) * up); gate_up's output features alternate gate, up."""

    def __init__(self, hidden, ffn, parts):
        super().__init__()
        self.gate_up = parts.linear(hidden, 2 * ffn, "column")
        self.down = parts.linear(ffn, hidden, "row")

    def forward(self, x):
        gate, up = self.gate_up(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.down(F.silu(gate) * up)


class Layer(nn.Module):
    """x + attention(norm(x)), then + mlp(norm(.))."""

    def __init__(self, args, parts):
        super().__init__()
        self.attn_norm, self.mlp_norm = parts.norm(args.hidden), parts.norm(args.hidden)
        self.attn = Attention(args.hidden, args.heads, parts)
        self.mlp = MLP(args.hidden, args.ffn, parts)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Bytes [seq(/tp), batch] (positions first .. first + seq) -> logits [.., .., 256]."""

    def __init__(self, args, parts):
        super().__init__()
        self.embed = parts.embedding(VOCAB, args.hidden)
        self.pos = parts.embedding(args.seq, args.hidden)
        self.layers = nn.ModuleList(Layer(args, parts) for _ in range(args.layers))
        self.norm = parts.norm(args.hidden)
        self.lm_head = nn.Linear(args.hidden, VOCAB, bias=False, **parts.kw)

    def forward(self, tokens, first=0):
        x = self.embed(tokens) + self.pos.weight[first:first + len(tokens), None]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model(args, group, device) -> nn.Module:
    """The high-precision model, initialised from args.seed (the same on every rank; a
    tensor-parallel rank holds the slices of the single-device weights)."""
    torch.manual_seed(args.seed)
    model = Decoder(args, Parts(group, device, DTYPES[args.dtype]))
    for name, module in model.named_modules():
        if isinstance(module, tpfp8.Linear):
            module.name = name  # what --debug-config's "layers" regexes match
    return model


def fp8_copy(model: nn.Module) -> nn.Module:
    """A copy of model whose layers' Linears are tpfp8.Linear (the LM head stays)."""
    return tpfp8.swap_linear(copy.deepcopy(model), filter_fn=lambda _, name: name != "lm_head")


def fused_copy(model: nn.Module) -> nn.Module:
    """fp8_copy with tpfp8's fused modules: each layer's attention norm and qkv become one
    RMSNormLinear, its MLP norm and MLP one LayerNormMLP (SwiGLU: gate_up's alternating gate,
    up rows regrouped as [gate | up]); the same weights. Under tensor parallelism each rank
    regroups its own rows (its slice of gate_up alternates gate, up too): qkv column-parallel,
    the MLP column fc1 -> row fc2, sequence parallel, as the model's Linears."""
    fused = fp8_copy(model)
    for layer in fused.layers:
        norm, qkv = layer.attn_norm, layer.attn.qkv
        kw = {"device": qkv.weight.device, "dtype": qkv.weight.dtype, "bias": False}
        tp = {"tp_group": qkv.tp_group, "sequence_parallel": qkv.sequence_parallel}
        split = qkv.parallel_mode is not None
        new_qkv = tpfp8.RMSNormLinear(
            qkv.in_features, qkv.out_features, eps=_eps(norm),
            parallel_mode=qkv.parallel_mode, **tp, **kw)
        mlp = tpfp8.LayerNormMLP(layer.mlp.gate_up.in_features,
                                 layer.mlp.down.in_features,
                                 eps=_eps(layer.mlp_norm), normalization="RMSNorm",
                                 activation="swiglu", set_parallel_mode=split, **tp, **kw)
        with torch.no_grad():
            new_qkv.weight.copy_(qkv.weight)
            new_qkv.layer_norm_weight.copy_(norm.weight)
            gate_up = layer.mlp.gate_up.weight
            mlp.fc1.weight.copy_(torch.cat([gate_up[0::2], gate_up[1::2]]))
            mlp.fc1.layer_norm_weight.copy_(layer.mlp_norm.weight)
            mlp.fc2.weight.copy_(layer.mlp.down.weight)
        layer.attn.qkv, layer.attn_norm = new_qkv, nn.Identity()
        layer.mlp, layer.mlp_norm = mlp, nn.Identity()
    return fused


def _eps(norm: nn.RMSNorm) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps


# -- training -------------------------------------------------------------------------------

def lr_at(step: int, args) -> float:
    """Linear warm-up over the first 10 % of steps, then cosine decay to 10 % of --lr."""
    warmup = max(1, args.steps // 10)
    if step <= warmup:
        return args.lr * step / warmup
    done = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


def step_loss(model, inputs, targets, group) -> torch.Tensor:
    """This rank's part of the mean next-byte cross entropy (the parts sum to the mean)."""
    tokens, labels = split_sequence(inputs, group), split_sequence(targets, group)
    logits = model(tokens, group_rank(group) * len(tokens))
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    return loss / targets.numel()


def reduced_inside(model) -> set:
    """The replicated parameters whose gradients the modules sum over the group themselves:
    the norm weights of fused modules under sequence parallelism (each rank normalized its
    rows; backward all-reduces their gradients)."""
    return {p for m in model.modules()
            if isinstance(m, tpfp8.LayerNormLinear) and m.sequence_parallel
            for p in (m.layer_norm_weight, m.layer_norm_bias) if p is not None}


def tp_sharded(model) -> set:
    """The parameters that tensor parallelism splits: the weights of the parallel Linears
    (the model has no biases). Not read from the weights' tensor_model_parallel attribute:
    copy.deepcopy of a Parameter drops its attributes."""
    return {m.weight for m in model.modules()
            if isinstance(m, tpfp8.Linear) and m.parallel_mode is not None}


def sync_replicated_grads(params, group) -> None:
    """Sums the gradients of the parameters every rank holds whole (embeddings, norms, LM
    head): under sequence parallelism each saw only its part of the sequence."""
    for p in params:
        dist.all_reduce(p.grad, group=group)


class Progress:
    """tqdm's bar where tqdm is installed, else a one-line counter (rank 0 only)."""

    def __init__(self, total, label, show):
        self.total, self.label, self.show, self.n = total, label, show, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=label, unit="step", disable=not show)

    def update(self, loss):
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update()
        elif self.show:
            end = "\n" if self.n == self.total else ""
            print(f"\r{self.label}: {self.n}/{self.total} loss {loss:.4f}", end=end,
                  file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def synchronize(device) -> float:
    """The time, once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def train(model, data, args, fp8: bool, group, label: str):
    """One run; returns (the loss of every step, tokens/s after the first 10 % of steps)."""
    device = data.device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    recipe = tpfp8.DelayedScaling() if args.recipe == "delayed" else tpfp8.CurrentScaling()
    sharded = tp_sharded(model)
    summed = reduced_inside(model)
    replicated = [p for p in model.parameters() if p not in sharded and p not in summed]
    untimed = max(1, args.steps // 10)  # GEMM plans, allocator: not the steady state
    bar = Progress(args.steps, label, group_rank(group) == 0)
    losses, start = [], None
    for step, (inputs, targets) in enumerate(batches(data, args), 1):
        if step == untimed + 1:
            start = synchronize(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        with tpfp8.fp8_autocast(enabled=fp8, recipe=recipe):
            loss = step_loss(model, inputs, targets, group)
            loss.backward()
        if group is not None:
            sync_replicated_grads(replicated, group)
            loss = loss.detach()
            dist.all_reduce(loss, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fp8:
            tpfp8.debug.step()
        losses.append(loss.detach())
        if step == 1 or step % 10 == 0 or step == args.steps:  # reading it waits for the GPU
            shown = float(losses[-1])
        bar.update(shown)
    elapsed = synchronize(device) - start
    bar.close()
    tokens_per_s = (args.steps - untimed) * args.seq * args.batch / elapsed
    return torch.stack(losses).float().tolist(), tokens_per_s


# -- the two runs and their report ----------------------------------------------------------

def parameters(model, group) -> int:
    """The model's parameter count (the full sizes under tensor parallelism)."""
    tp, sharded = dist.get_world_size(group) if group is not None else 1, tp_sharded(model)
    return sum(p.numel() * (tp if p in sharded else 1) for p in model.parameters())


def device_name(device) -> str:
    """The GPU's name, or "CPU"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def describe(args, model, data, group, device, backend) -> str:
    """The header line: model, data, steps and where it runs."""
    where = device_name(device)
    if group is not None:
        where = f"{args.tp} ranks ({backend}, {where})"
    return (f"tpfp8 demo: a {parameters(model, group) / 1e6:,.1f} M-parameter decoder "
            f"({args.layers} layers, hidden {args.hidden}, FFN {args.ffn}, {args.heads} heads, "
            f"{args.dtype}) on {len(data) / 2**20:.1f} MB of the standard library's sources, "
            f"{args.batch} x {args.seq} bytes a step, {args.steps} steps, FP8 recipe "
            f"{args.recipe}, on {where}")


def fp8_linears(model) -> dict:
    """How many Linears compute in FP8 and how many of them hold delayed-scaling state."""
    layers = [m for m in model.modules() if isinstance(m, tpfp8.Linear)]
    return {"fp8_linears": len(layers),
            "fp8_linears_with_state": sum(m.fp8_state is not None for m in layers)}


def summarize(args, runs: dict, model, device) -> dict:
    """The numbers of both runs: final losses (mean of the last 10 % of steps), their relative
    gap, tokens/s and their ratio, every step's loss."""
    (hp, hp_tps), (f8, f8_tps) = runs.values()
    tail = max(1, args.steps // 10)
    hp_final, f8_final = sum(hp[-tail:]) / tail, sum(f8[-tail:]) / tail
    return {"labels": list(runs), "hp_final": hp_final, "fp8_final": f8_final,
            "gap": (f8_final - hp_final) / hp_final, "final_over_steps": tail,
            "hp_tokens_per_s": hp_tps, "fp8_tokens_per_s": f8_tps, "speedup": f8_tps / hp_tps,
            "timed_steps": args.steps - max(1, args.steps // 10), "hp_losses": hp,
            "fp8_losses": f8, **fp8_linears(model), "device": device_name(device),
            "args": vars(args)}


def report(s: dict, device) -> None:
    """Prints the comparison."""
    hp, f8 = s["labels"]
    state = (f" ({s['fp8_linears_with_state']} with delayed-scaling state)"
             if s["args"]["recipe"] == "delayed" else "")
    print(f"{s['fp8_linears']} Linears computed in FP8{state}; the LM head in "
          f"{s['args']['dtype']}")
    print(f"tokens/s over the last {s['timed_steps']} steps: {hp} "
          f"{s['hp_tokens_per_s']:,.0f}, {f8} {s['fp8_tokens_per_s']:,.0f}: "
          f"{s['speedup']:.2f}x")
    if device.type == "cpu":
        print("  (on the CPU the reference kernels emulate FP8 exactly, slowly: run it on a "
              "Hopper GPU for FP8's speed)")
    print(f"final loss (nats/byte, mean of the last {s['final_over_steps']} steps): {hp} "
          f"{s['hp_final']:.4f}, {f8} {s['fp8_final']:.4f}: gap {100 * s['gap']:+.2f} %")


def plot(path, s: dict) -> None:
    """Writes both loss curves to a PNG (says so and skips it without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses, tps in zip(s["labels"], (s["hp_losses"], s["fp8_losses"]),
                                  (s["hp_tokens_per_s"], s["fp8_tokens_per_s"])):
        ax.plot(range(1, len(losses) + 1), losses, label=f"{label}: {tps:,.0f} tokens/s")
    ax.set_xlabel("step")
    ax.set_ylabel("next-byte cross entropy (nats)")
    ax.set_title(f"tpfp8 demo on {s['device']}: FP8 at {s['speedup']:.2f}x the tokens/s, "
                 f"final loss gap {100 * s['gap']:+.2f} %", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def write(args, s: dict) -> None:
    """demo.json and demo_loss.png in --out."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "demo.json"), "w") as f:
        json.dump(s, f, indent=1)
    plot(os.path.join(args.out, "demo_loss.png"), s)


def run(args, group, device, backend="") -> dict:
    """Both runs on this rank; rank 0 prints the comparison and writes the files. Returns the
    numbers (summarize())."""
    rank0 = group_rank(group) == 0
    data = stdlib_bytes(args.data_mb).to(device)
    model = build_model(args, group, device)
    # The same weights, made before either run trains.
    fp8_model = fused_copy(model) if args.fused else fp8_copy(model)
    if rank0:
        print(describe(args, model, data, group, device, backend), flush=True)
    hp_label = args.dtype
    fp8_label = f"FP8 ({args.recipe}{', fused modules' if args.fused else ''})"
    runs = {hp_label: train(model, data, args, False, group, hp_label)}
    del model
    if args.debug_config:
        tpfp8.debug.initialize(args.debug_config, log_dir=args.out)
    try:
        runs[fp8_label] = train(fp8_model, data, args, True, group, fp8_label)
    finally:
        tpfp8.debug.shutdown()
    summary = summarize(args, runs, fp8_model, device)
    if rank0:
        report(summary, device)
        write(args, summary)
    return summary


def relaunch_under_torchrun(argv, tp: int) -> int:
    """Runs the demo again under torchrun with tp ranks; returns its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={tp}", "-m", "tpfp8.demo", *argv, "--tp", str(tp)]
    return subprocess.call(cmd)


def init_distributed(args, cuda: bool):
    """(group, device, backend) of this torchrun rank: NCCL with a GPU per rank, else gloo
    (ranks sharing a GPU, or the CPU)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp} but torchrun started {world} ranks")
    backend = "nccl" if cuda and torch.cuda.device_count() >= world else "gloo"
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    return dist.new_group(list(range(world))), device, backend


def main(argv=None) -> int:
    """Entry point: one rank runs here; --tp N > 1 starts N ranks under torchrun."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cuda = torch.cuda.is_available() and tpfp8.with_cuda()
    args = resolve(parse_args(argv), cuda)
    if args.tp == 1:
        run(args, None, torch.device("cuda" if cuda else "cpu"))
        return 0
    if "RANK" not in os.environ:
        return relaunch_under_torchrun(argv, args.tp)
    group, device, backend = init_distributed(args, cuda)
    try:
        run(args, group, device, backend)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
