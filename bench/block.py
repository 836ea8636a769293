"""Forward+backward time of one Llama-style decoder layer (RMSNorm, attention with rotary
embeddings, grouped-query causal SDPA, SwiGLU MLP; no biases; bf16) with every Linear in FP8:
tpfp8 (delayed and current scaling; eager and torch.compile) beside bf16 nn.Linear eager and
compiled and torchao's float8 training (tensorwise and rowwise) compiled -- the model-level view
of bench/compile.py's MLP, where the casts around the Linears (norm, activation) count.

  python bench/block.py                      # Llama-3-8B-like and Llama-3.2-1B-like layers
  python bench/block.py --sizes 8b --cases tpfp8,torchao
  python bench/block.py --device cpu --sizes tiny --reps 2 --rounds 1 --warmup 1   # smoke run

Sizes (hidden / FFN / heads / KV heads): 8b = 4096 / 14336 / 32 / 8, 1b = 2048 / 8192 / 32 / 8,
tiny = 64 / 128 / 4 / 2 (smoke runs). Each step is --batch sequences of --seq tokens (default
2 x 4096 = 8192 tokens). Timing, compilation, error and state checks as bench/compile.py (it
runs the cases); speed-ups are against the fastest of bf16 eager, compiled, compiled with
CUDA graphs (reduce-overhead) and the whole step in one CUDA graph (eager or compiled).
"""
import copy
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile as cases_runner  # noqa: E402  (bench/compile.py)
import tpfp8  # noqa: E402
from common import (add_energy_argument, device_name,  # noqa: E402
                    gemm_autotune, make_parser, print_table, save_json, settle_applied)

SIZES = {"8b": (4096, 14336, 32, 8), "1b": (2048, 8192, 32, 8), "tiny": (64, 128, 4, 2)}
# CUDA graphs (reduce-overhead, the whole step) for the bf16 baseline, the fused delayed layer
# and torchao only: the 8B layer is GPU-bound, the 1B one about as host-bound as GPU-bound.
CASES = [c for c in cases_runner.CASES if c[3] not in cases_runner.CUDA_ONLY
         or c[1] == "bf16" or c[0].startswith(("tpfp8 fused delayed compile", "torchao"))]
# The fused layer's best case again with its skip connections folded into the layers
# (`residual=`): over 5 processes on the H200 it ran 0.9 % slower than the adds apart
# (forty-third session), so the adds apart are the main form and this one is measured beside.
CASES.append(("tpfp8 fused delayed compile reduce-overhead, residual folded",
              "tpfp8 fused, residual folded", "delayed", "reduce-overhead"))


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then + SwiGLU MLP(norm(.)), on [batch * seq, hidden] rows."""

    def __init__(self, hidden, ffn, heads, kv_heads, seq, device):
        super().__init__()
        kw = {"device": device, "dtype": torch.bfloat16}
        self.heads, self.kv_heads, self.seq, self.head_dim = heads, kv_heads, seq, hidden // heads
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5, **kw)
        self.q_proj = nn.Linear(hidden, hidden, bias=False, **kw)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **kw)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **kw)
        self.o_proj = nn.Linear(hidden, hidden, bias=False, **kw)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5, **kw)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, **kw)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, **kw)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, **kw)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, self.head_dim, 2, device=device) /
                                       self.head_dim))
        angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().to(torch.bfloat16), persistent=False)
        self.register_buffer("sin", angles.sin().to(torch.bfloat16), persistent=False)

    def rotary(self, t):
        half = t.shape[-1] // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * self.cos + rotated * self.sin

    def heads_of(self, t, n):
        return t.view(-1, self.seq, n, self.head_dim).transpose(1, 2)

    def forward(self, x):
        rows, hidden = x.shape
        a = self.attn_norm(x)
        q = self.rotary(self.heads_of(self.q_proj(a), self.heads))
        k = self.rotary(self.heads_of(self.k_proj(a), self.kv_heads))
        v = self.heads_of(self.v_proj(a), self.kv_heads)
        repeat = self.heads // self.kv_heads  # (grouped-query attention)
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(rows, hidden))
        m = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def fused(self, fold_residual: bool = False) -> nn.Module:
        return FusedDecoderLayer(self, fold_residual)


class FusedDecoderLayer(DecoderLayer):
    """The same layer with tpfp8's fused modules and these parameters: RMSNormLinear for the
    attention's norm and its q, k, v projections (one weight), LayerNormMLP (RMSNorm,
    SwiGLU) for the MLP; o_proj a tpfp8.Linear. The skip connections are separate adds, as in
    DecoderLayer; with `fold_residual` they are the layers' `residual`: o_proj's and fc2's
    GEMMs add them, and the MLP's norm backward adds the output's gradient to x's."""

    def __init__(self, layer: DecoderLayer, fold_residual: bool = False):
        nn.Module.__init__(self)
        self.fold_residual = fold_residual
        self.heads, self.kv_heads = layer.heads, layer.kv_heads
        self.seq, self.head_dim = layer.seq, layer.head_dim
        hidden, ffn = layer.q_proj.in_features, layer.gate_proj.out_features
        kw = {"device": layer.q_proj.weight.device, "dtype": torch.bfloat16, "bias": False}
        projections = [layer.q_proj, layer.k_proj, layer.v_proj]
        self.qkv = tpfp8.RMSNormLinear(hidden, sum(p.out_features for p in projections),
                                       eps=layer.attn_norm.eps, **kw)
        self.split = [p.out_features for p in projections]
        self.o_proj = tpfp8.swap_linear(copy.deepcopy(layer.o_proj))
        self.mlp = tpfp8.LayerNormMLP(hidden, ffn, eps=layer.mlp_norm.eps,
                                      normalization="RMSNorm", activation="swiglu", **kw)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([p.weight for p in projections]))
            self.qkv.layer_norm_weight.copy_(layer.attn_norm.weight)
            self.mlp.fc1.weight.copy_(torch.cat([layer.gate_proj.weight, layer.up_proj.weight]))
            self.mlp.fc1.layer_norm_weight.copy_(layer.mlp_norm.weight)
            self.mlp.fc2.weight.copy_(layer.down_proj.weight)
        self.register_buffer("cos", layer.cos, persistent=False)
        self.register_buffer("sin", layer.sin, persistent=False)

    def forward(self, x):
        rows, hidden = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = self.rotary(self.heads_of(q, self.heads))
        k = self.rotary(self.heads_of(k, self.kv_heads))
        v = self.heads_of(v, self.kv_heads)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(rows, hidden)
        if not self.fold_residual:
            x = x + self.o_proj(o)
            return x + self.mlp(x)
        x = self.o_proj(o, residual=x)
        return self.mlp(x, residual=x)


def main(argv=None):
    parser = make_parser(__doc__, "unused (see --sizes)")
    parser.add_argument("--sizes", default="8b,1b", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all cases; the steady state is each one's best")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps per case before timing (compilation)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated substrings: only the cases whose name holds one "
                             "(bf16 cases always run: they are the baseline)")
    add_energy_argument(parser)
    parser.add_argument("--profile", default=None,
                        help="comma-separated substrings: a torch.profiler table of the matching "
                             "cases after timing, with the GPU's idle gaps, its time by kind of "
                             "kernel and the step's syncs")
    parser.set_defaults(reps=20)
    args = parser.parse_args(argv)
    cases = CASES
    if args.cases:
        keys = [k.strip() for k in args.cases.split(",") if k.strip()]
        cases = [c for c in CASES if c[0] in cases_runner.BF16 or any(k in c[0] for k in keys)]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    dev = device_name(args.device)
    print(f"torch {torch.__version__}, torchao {cases_runner.torchao_version() or 'not installed'}"
          f", {dev}, tpfp8 GEMM autotune: {gemm_autotune()}", flush=True)
    tokens = args.batch * args.seq
    results = []
    for name in args.sizes.split(","):
        hidden, ffn, heads, kv_heads = SIZES[name]
        print(f"[{name}] {tokens} tokens, hidden {hidden}, FFN {ffn}, {heads} heads "
              f"({kv_heads} KV) ...", flush=True)

        def factory(h, device, shape=(hidden, ffn, heads, kv_heads)):
            return DecoderLayer(*shape, args.seq, device)
        r = cases_runner.run_size(tokens, hidden, args, cases, factory)
        r.update(size=name, ffn=ffn, heads=heads, kv_heads=kv_heads, seq=args.seq)
        results.append(r)

    names = [c[0] for c in cases]
    print(f"\nLlama-style decoder layer forward+backward on {dev} ({tokens} tokens): speed-up "
          f"vs the fastest bf16 variant, ms per step in brackets")
    print_table(["case"] + [r["size"] for r in results],
                [[n] + [cases_runner.cell(r["cases"][n]) for r in results] for n in names])
    cases_runner.print_details(results, names)
    save_json(os.path.join(args.out, "block.json"),
              {"device": dev, "torch": torch.__version__,
               "torchao": cases_runner.torchao_version(), "gemm_autotune": gemm_autotune(),
               "batch": args.batch, "seq": args.seq,
               "reps": args.reps, "rounds": args.rounds, "warmup": args.warmup,
               "settle_s": settle_applied(args),
               "fused_forms": cases_runner.FUSED_FORMS, "results": results})
    plotted = [n for n in names if any(r["cases"][n]["speedup_vs_faster_bf16"] for r in results)]
    cases_runner.save_plot(os.path.join(args.out, "block.png"), results, plotted, dev,
                           xlabel="tokens x hidden", title="Llama-style decoder layer fwd+bwd")


if __name__ == "__main__":
    main()
