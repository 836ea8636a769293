"""Forward+backward time of an MLP block (fc1 hidden -> 4*hidden, exact erf GELU, fc2 4*hidden
-> hidden, with biases) under torch.compile: tpfp8 (delayed and current scaling) eager,
torch.compile(model) and torch.compile(model, mode="reduce-overhead"), beside bf16 nn.Linear
eager and compiled (both modes) and torchao's float8 training (tensorwise and rowwise)
compiled. Also each of bf16 and tpfp8 with the whole step captured in one CUDA graph
(torch.cuda.graph, as TransformerEngine's make_graphed_callables or a training loop graphed by
hand): the step's GPU work without the host's time between kernels. Every speed-up is against
the FASTEST of the bf16 variants at that size, its CUDA graphs included.

  python bench/compile.py                               # hidden 1024, 4096, 8192; 8192 tokens
  python bench/compile.py --hidden 4096 --cases tpfp8,bf16
  python bench/compile.py --device cpu --hidden 64 --tokens 128 --reps 2   # smoke run
  python bench/compile.py --hidden 1024 --cases tpfp8 --profile reduce-overhead
  python bench/compile.py --hidden 4096 --energy 2     # + joules per step, 2 s of steps a case

Every model is a copy of one bf16 model (bf16 parameters, as bench/linear.py holds them: fp32
master weights live in the optimizer; bf16 activations and gradients). The tpfp8 models are
tpfp8.swap_linear of it (the "fused" ones: a tpfp8.MLP, whose fc2 takes the GELU written
straight to FP8 by one kernel and hands fc1 its gradient in FP8), the torchao ones
torchao.float8.convert_to_float8_training of it.
A step is gradients set to None, then forward and backward of one [tokens, hidden] bf16 input
(requires_grad, so dx is computed as for a block inside a model) against a fixed random output
gradient. For tpfp8 the step runs inside `with tpfp8.fp8_autocast(recipe=...)`, opened OUTSIDE
the compiled callable and closed at the end of every step, backward included (its exit makes
the delayed-scaling update; tpfp8's backward runs in FP8 whether or not it is inside).
reduce-overhead steps start with torch.compiler.cudagraph_mark_step_begin(). A graphed step is
that step, warmed up on a side stream and captured; replays run the update too, so the amax
histories roll as eager's do.

Each case is compiled and warmed up first (--warmup untimed steps: compilation and CUDA-graph
recording; the first step's wall time is reported), then timed as bench/linear.py times its
steady state: the mean of --reps back-to-back steps (CUDA events), best of --rounds rounds that
visit every case in turn. On a GPU each timed window follows --settle seconds of the same
case's untimed steps: the card's clocks fall within a fraction of a second of load, and a
window that starts on an idle card's clocks flatters the faster case. A case that raises
anywhere is reported as "failed: <reason>" (the traceback goes to stderr) and the run goes on.
Also reported per case: graph breaks and CUDA-graph skips counted by dynamo/inductor while it
compiled (TORCH_LOGS=graph_breaks, perf_hints prints their reasons), the relative error of its
output against bf16 eager (an FP8 path shows a few %, a silent fall-back to high precision well
under 1 %), and for delayed scaling whether the amax histories rolled (the autocast exit's
update reached the module).
With --energy, each case also runs for that many seconds with the GPU's energy counter read
around it: joules per step and mean power. The H200 here runs these steps at its 700 W cap,
with its clocks lowered, so a step's energy is the figure that holds between runs.
"""
import contextlib
import copy
import gc
import os
import sys
import time
import traceback
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_energy_argument, device_name,  # noqa: E402
                    energy_per_call, gemm_autotune, graphed, make_parser, parse_shapes,
                    print_table, pyplot, save_json, settle_applied, time_ms)

import tpfp8  # noqa: E402

HIDDEN = [1024, 4096, 8192]
TOKENS = 8192

# (name, family, variant, mode): None = eager, "default" = torch.compile(model),
# "reduce-overhead" = torch.compile(model, mode="reduce-overhead"); "graph" / "default graph" =
# the whole eager / torch.compile(model) step (fp8_autocast's exit included) captured in one
# CUDA graph (torch.cuda.graph) and replayed: the GPU's work with no host time between kernels.
CASES = [
    ("bf16 eager", "bf16", None, None),
    ("bf16 compile", "bf16", None, "default"),
    ("bf16 compile reduce-overhead", "bf16", None, "reduce-overhead"),
    ("bf16 cuda graph", "bf16", None, "graph"),
    ("bf16 compile cuda graph", "bf16", None, "default graph"),
    ("tpfp8 delayed eager", "tpfp8", "delayed", None),
    ("tpfp8 delayed compile", "tpfp8", "delayed", "default"),
    ("tpfp8 delayed compile reduce-overhead", "tpfp8", "delayed", "reduce-overhead"),
    ("tpfp8 delayed cuda graph", "tpfp8", "delayed", "graph"),
    ("tpfp8 current eager", "tpfp8", "current", None),
    ("tpfp8 current compile", "tpfp8", "current", "default"),
    ("tpfp8 current compile reduce-overhead", "tpfp8", "current", "reduce-overhead"),
    ("tpfp8 fused delayed eager", "tpfp8 fused", "delayed", None),
    ("tpfp8 fused delayed compile", "tpfp8 fused", "delayed", "default"),
    ("tpfp8 fused delayed compile reduce-overhead", "tpfp8 fused", "delayed", "reduce-overhead"),
    ("tpfp8 fused delayed cuda graph", "tpfp8 fused", "delayed", "graph"),
    ("tpfp8 fused delayed compile cuda graph", "tpfp8 fused", "delayed", "default graph"),
    ("tpfp8 fused current compile", "tpfp8 fused", "current", "default"),
    ("tpfp8 fused current cuda graph", "tpfp8 fused", "current", "graph"),
    ("torchao tensorwise compile", "torchao", "tensorwise", "default"),
    ("torchao tensorwise compile cuda graph", "torchao", "tensorwise", "default graph"),
    ("torchao rowwise compile", "torchao", "rowwise", "default"),
]
BF16 = tuple(c[0] for c in CASES if c[1] == "bf16")
# The families built by a block's fused(): its arguments for each (bench/block.py's layer has
# a second form, its residual adds folded into the layers).
FUSED_FORMS = {"tpfp8 fused": {}, "tpfp8 fused, residual folded": {"fold_residual": True}}
GRAPHED = ("graph", "default graph")  # the modes that capture the whole step
COMPILED = ("default", "reduce-overhead", "default graph")
CUDA_ONLY = ("reduce-overhead",) + GRAPHED


class Skip(Exception):
    """A case that cannot run here (reported as 'skipped: <reason>')."""


class MLP(nn.Module):
    """fc1 -> GELU (exact, erf: nn.functional.gelu's default, as tpfp8.demo's block) -> fc2."""

    def __init__(self, hidden, device):
        super().__init__()
        kw = {"device": device, "dtype": torch.bfloat16}
        self.fc1 = nn.Linear(hidden, 4 * hidden, **kw)
        self.fc2 = nn.Linear(4 * hidden, hidden, **kw)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))

    def fused(self) -> nn.Module:
        """The same MLP as tpfp8's fused module, tpfp8.MLP (fc2 takes GELU's output straight
        as FP8, and hands fc1 its gradient in FP8), with these parameters."""
        w = self.fc1.weight
        mlp = tpfp8.MLP(self.fc1.in_features, self.fc1.out_features, activation="gelu",
                        device=w.device, dtype=w.dtype)
        for mine, theirs in ((mlp.fc1, self.fc1), (mlp.fc2, self.fc2)):
            mine.load_state_dict(theirs.state_dict(), strict=False)
        return mlp


def short(exc, limit=90):
    """'Type: first line of the message', cut to `limit` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def torchao_float8():
    try:
        import torchao  # noqa: F401
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as exc:  # ImportError, or a torchao that breaks on this torch
        if isinstance(exc, ImportError) and getattr(exc, "name", "") in ("torchao", None):
            raise Skip("torchao not installed")
        raise Skip(f"torchao import failed ({short(exc, 60)})")
    return Float8LinearConfig, convert_to_float8_training


def torchao_version():
    try:
        import torchao
        return getattr(torchao, "__version__", "?")
    except Exception:
        return None


def build(case, reference, device):
    """(model to call, module holding the parameters, recipe or None) for a case."""
    name, family, variant, mode = case
    cuda = device.startswith("cuda")
    if mode in CUDA_ONLY and not cuda:
        raise Skip("needs CUDA")
    if family == "torchao" and not cuda:
        raise Skip("needs CUDA")
    model = copy.deepcopy(reference)
    recipe = None
    if family.startswith("tpfp8"):
        if family in FUSED_FORMS and not hasattr(reference, "fused"):
            raise Skip("this block has no fused form")
        model = (reference.fused(**FUSED_FORMS[family]) if family in FUSED_FORMS
                 else tpfp8.swap_linear(model))
        recipe = tpfp8.DelayedScaling() if variant == "delayed" else tpfp8.CurrentScaling()
    elif family == "torchao":
        config_cls, convert = torchao_float8()
        if variant == "rowwise":
            if not hasattr(config_cls, "from_recipe_name"):
                raise Skip("this torchao has no Float8LinearConfig.from_recipe_name")
            config = config_cls.from_recipe_name("rowwise")
        else:
            config = config_cls()  # the default: tensorwise dynamic scaling
        model = convert(model, config=config)
    fn = model
    if mode in ("default", "default graph"):  # (the graph is captured in run_size)
        fn = torch.compile(model)
    elif mode == "reduce-overhead":
        fn = torch.compile(model, mode="reduce-overhead")
    return fn, model, recipe


def make_step(fn, model, recipe, x, dy, mark_step):
    """One training step of the block; returns the output (for the accuracy check)."""
    grads_of = [x] + list(model.parameters())

    def run():
        for t in grads_of:
            t.grad = None
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        ctx = tpfp8.fp8_autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with ctx:  # opened and closed around every whole step, outside the compiled callable
            y = fn(x)
            y.backward(dy)
        return y
    return run


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compile_counters():
    from torch._dynamo.utils import counters
    breaks = counters["graph_break"]
    return {"graph_breaks": int(sum(breaks.values())),
            "graph_break_reasons": [f"{n}x {r[:300]}" for r, n in breaks.most_common(3)],
            "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}


def scales_updated(model):
    """For delayed scaling: did the amax histories roll (the autocast exit's update ran)?"""
    layers = [m for m in model.modules() if isinstance(m, tpfp8.Linear)]
    if not layers:
        return "?"
    try:
        state = layers[0].fp8_state
        if state is None:
            return "no FP8 state"
        history = state["forward"]["amax_history"]
        return "yes" if bool((history[1:] != 0).any()) else "NO"
    except Exception as exc:  # the module's internals may change
        return f"? ({short(exc, 40)})"


def fail(r, name, exc, where):
    r["status"] = f"failed: {short(exc)}"
    r["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
    print(f"  {name}: FAILED while {where}: {short(exc, 200)}", file=sys.stderr, flush=True)
    traceback.print_exc(limit=-8, file=sys.stderr)
    sys.stderr.flush()


def run_size(tokens, hidden, args, cases, factory=None):
    """Every case of one size: `factory(hidden, device)` makes the bf16 block (default the
    MLP), called on a [tokens, hidden] input. Returns the size's results."""
    device = args.device
    torch._dynamo.reset()  # each size compiles afresh (and stays under the recompile limit)
    torch.manual_seed(0)
    reference = (factory or MLP)(hidden, device)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    from torch._dynamo.utils import counters

    results, live = {}, {}
    for case in cases:
        name, family, variant, mode = case
        r = results[name] = {"family": family, "variant": variant,
                             "mode": mode or "eager", "status": "ok", "ms": None}
        try:
            fn, model, recipe = build(case, reference, device)
        except Skip as exc:
            r["status"] = f"skipped: {exc}"
            print(f"  {name}: skipped ({exc})", flush=True)
            continue
        except Exception as exc:
            fail(r, name, exc, "building")
            continue
        graph = mode in GRAPHED
        # A captured step gets a leaf of its own: a leaf's gradient node is shared by the steps
        # of every case and keeps the stream of the last (reduce-overhead's), on which a capture
        # cannot wait.
        x_in = x.detach().clone().requires_grad_() if graph else x
        step = make_step(fn, model, recipe, x_in, dy, mode == "reduce-overhead")
        counters.clear()
        try:
            sync(device)
            t0 = time.perf_counter()
            if graph:
                step = graphed(step)  # its first step: warm-up and capture
            else:
                step()
            sync(device)
            r["first_step_s"] = time.perf_counter() - t0
            for _ in range(max(args.warmup - 1, 0)):
                step()
            sync(device)
            if mode in COMPILED:
                r.update(compile_counters())
        except Exception as exc:
            fail(r, name, exc, "compiling / warming up")
            del fn, model, step
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        extra = "" if "graph_breaks" not in r else (f", {r['graph_breaks']} graph breaks, "
                                         f"{r['cudagraph_skips']} cudagraph skips")
        print(f"  {name}: first step {r['first_step_s']:.1f} s{extra}", flush=True)
        live[name] = (step, model)

    # Steady state: best of --rounds rounds, each visiting every live case in turn.
    for rnd in range(args.rounds):
        for name, (step, _) in list(live.items()):
            try:
                ms = time_ms(step, device, args.reps, warmup=1, pipelined=True,
                             settle_s=args.settle)
            except Exception as exc:
                fail(results[name], name, exc, f"timing (round {rnd + 1})")
                del live[name]
                continue
            prev = results[name]["ms"]
            results[name]["ms"] = ms if prev is None else min(prev, ms)
        print(f"  round {rnd + 1}/{args.rounds} done", flush=True)

    if args.energy:
        measured = 0
        for name, (step, _) in live.items():
            got = energy_per_call(step, device, args.energy)
            if got:
                results[name]["joules_per_step"], results[name]["watts"] = got
                measured += 1
        print(f"  energy measured for {measured} of {len(live)} cases"
              + ("" if measured else " (no energy counter on this device)"), flush=True)

    if args.profile:
        for name in [n for n in live if any(k in n for k in args.profile.split(","))]:
            profile_case(name, live[name][0], device, args.out, hidden)

    # One more step each: its output against bf16 eager's, and delayed scaling's state.
    ref_y = None
    for name in ["bf16 eager"] + [n for n in live if n != "bf16 eager"]:
        if name not in live:
            continue
        step, model = live[name]
        r = results[name]
        y = None
        try:
            y = step().detach().float()
            if name == "bf16 eager":
                ref_y = y.clone()
            if ref_y is not None:
                r["rel_err_vs_bf16_eager"] = float((y - ref_y).norm() / ref_y.norm())
            if r["family"].startswith("tpfp8") and r["variant"] == "delayed":
                r["scales_updated"] = scales_updated(model)
        except Exception as exc:
            fail(r, name, exc, "checking the output")
            r["ms"] = None
        del y

    bf16_ms = {n: results[n]["ms"] for n in BF16 if n in results and results[n]["ms"]}
    baseline = min(bf16_ms, key=bf16_ms.get) if bf16_ms else None
    base_ms = bf16_ms[baseline] if baseline else None
    base_j = results[baseline].get("joules_per_step") if baseline else None
    for r in results.values():
        r["speedup_vs_faster_bf16"] = (base_ms / r["ms"]) if (base_ms and r["ms"]) else None
        if base_j and r.get("joules_per_step"):
            r["energy_saving_vs_faster_bf16"] = base_j / r["joules_per_step"]
    del live, reference, x, dy, ref_y
    gc.collect()
    torch._dynamo.reset()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"tokens": tokens, "hidden": hidden, "baseline": baseline, "baseline_ms": base_ms,
            "cases": results}


def profile_case(name, step, device, out, hidden, steps=5):
    """torch.profiler over `steps` steps of a case: its kernels by GPU time, and the host's
    wall time per step beside the GPU's busy time (which of the two bounds the step)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
        sync(device)
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    text = (f"profile of '{name}' at hidden {hidden}: host {host_ms:.3f} ms/step to issue, GPU "
            f"busy {busy_us / 1e3 / steps:.3f} ms/step\n" + idle_report(prof, steps) +
            kinds_report(prof, steps) + sync_report(step, device) +
            events.table(sort_by="self_device_time_total" if len(activities) > 1
                         else "self_cpu_time_total", row_limit=30))
    print(text, flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"profile_{hidden}_{name.replace(' ', '_')}.txt"), "w") as f:
        f.write(text)


def idle_report(prof, steps, top=8):
    """Where the GPU waited between kernels over the profiled steps: the total per step, and
    the longest gaps with the kernels on either side and the host calls that block (syncs,
    copies to the host, cudaMalloc/cudaFree) -- wall time above GPU busy time is spent here."""
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if len(kernels) < 2:
        return ""
    gaps = []
    end, before = kernels[0].time_range.end, kernels[0].name
    for k in kernels[1:]:
        if k.time_range.start > end:
            gaps.append((k.time_range.start - end, before, k.name))
        if k.time_range.end > end:
            end, before = k.time_range.end, k.name
    blocking = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and any(
                w in e.name for w in ("Synchronize", "cudaMemcpy", "cudaFree", "cudaMalloc")):
            blocking[e.name] = blocking.get(e.name, 0) + 1
    lines = [f"GPU idle between kernels: {sum(g[0] for g in gaps) / 1e3 / steps:.3f} ms/step "
             f"({len(gaps)} gaps); blocking host calls: "
             f"{', '.join(f'{n} x{c}' for n, c in sorted(blocking.items())) or 'none'}"]
    for us, a, b in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {us:8.1f} us  after {a[:60]}  before {b[:60]}")
    return "\n".join(lines) + "\n"


# Kernel kinds by name, first match wins: (kind, substrings of the kernel's name).
KERNEL_KINDS = [
    ("attention", ("sdpa", "fmha", "flash", "cudnn")),
    ("GEMM", ("nvjet", "gemm", "cutlass", "sm90_xmma")),
    ("tpfp8", ("tpfp8",)),
    ("compiler-generated", ("triton_",)),
    ("memset / copy", ("Memset", "Memcpy", "copy_kernel", "multi_tensor_apply")),
]


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, from its name (KERNEL_KINDS); "other" when none matches."""
    return next((kind for kind, keys in KERNEL_KINDS if any(k in name for k in keys)), "other")


def kinds_report(prof, steps):
    """GPU time per step by kind of kernel, with the kernels a step launches. Compare kinds
    between cases, not a profile's busy time with timed steps: a few profiled steps after an
    idle moment run at clocks that a sustained run at the card's power cap does not keep."""
    per_kind, launches = {}, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(e.name)
            per_kind[kind] = per_kind.get(kind, 0) + e.time_range.elapsed_us()
            launches += 1
    if not per_kind:
        return ""
    return (f"GPU time by kind, us/step ({launches / steps:.0f} kernels a step): " +
            ", ".join(f"{kind} {us / steps:.1f}" for kind, us in
                      sorted(per_kind.items(), key=lambda t: -t[1])) + "\n")


def sync_report(step, device):
    """Host-device synchronisations one step makes (torch's sync debug mode)."""
    if not device.startswith("cuda"):
        return ""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            sync(device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    messages = sorted({str(w.message).splitlines()[0][:120] for w in syncs})
    return (f"synchronising calls in one step: {len(syncs)}\n" +
            "".join(f"  {m}\n" for m in messages[:5]))


def cell(r):
    if r["status"] != "ok":
        return r["status"]
    return f"{r['speedup_vs_faster_bf16']:.2f}x ({r['ms']:.3f} ms)" if r["speedup_vs_faster_bf16"] \
        else f"{r['ms']:.3f} ms"


def save_plot(path, results, names, dev, xlabel="tokens x hidden (MLP hidden -> 4*hidden -> "
              "hidden)", title="MLP block fwd+bwd under torch.compile"):
    """Grouped bars: one group per size, one bar per case, speed-up vs the faster bf16."""
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{r['tokens']}x{r['hidden']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(8, 2.8 * len(labels)), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        values = [r["cases"][name]["speedup_vs_faster_bf16"] or float("nan") for r in results]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speed-up vs fastest bf16 (eager / compiled / CUDA graphs)")
    ax.set_title(f"{title} on {dev}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    parser = make_parser(__doc__, "comma-separated TOKENSxHIDDEN list (overrides --tokens and "
                                  "--hidden)")
    parser.add_argument("--hidden", default=",".join(map(str, HIDDEN)),
                        help=f"comma-separated hidden sizes (default {HIDDEN}); FP8 needs "
                             f"multiples of 16")
    parser.add_argument("--tokens", type=int, default=TOKENS,
                        help=f"tokens per step (default {TOKENS})")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all cases; the steady state is each one's best")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps per case before timing (compilation, CUDA-graph "
                             "recording)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated substrings: run only the cases whose name holds "
                             "one (bf16 cases are always run: they are the baseline)")
    add_energy_argument(parser)
    parser.add_argument("--profile", default=None,
                        help="comma-separated substrings: after timing, print (and save in --out) "
                             "a torch.profiler table of 5 steps of each matching case, with the "
                             "GPU's idle gaps between kernels, its time by kind of kernel and the "
                             "step's synchronising calls")
    args = parser.parse_args(argv)
    sizes = parse_shapes(args.shapes) or [(args.tokens, int(h)) for h in args.hidden.split(",")]
    cases = CASES
    if args.cases:
        keys = [k.strip() for k in args.cases.split(",") if k.strip()]
        cases = [c for c in CASES if c[0] in BF16 or any(k in c[0] for k in keys)]
    # Every case compiles the same MLP.forward code; per-size resets keep the count low, this
    # keeps dynamo from silently falling back to eager if a case recompiles a few times.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    dev = device_name(args.device)
    ao = torchao_version()
    print(f"torch {torch.__version__}, torchao {ao or 'not installed'}, {dev}, tpfp8 GEMM "
          f"autotune: {gemm_autotune()}", flush=True)
    results = []
    for i, (tokens, hidden) in enumerate(sizes):
        print(f"[{i + 1}/{len(sizes)}] tokens={tokens} hidden={hidden} ffn={4 * hidden} ...",
              flush=True)
        results.append(run_size(tokens, hidden, args, cases))

    names = [c[0] for c in cases]
    print(f"\nMLP block (fc1 {'/'.join(str(r['hidden']) for r in results)} -> 4x, exact GELU, "
          f"fc2; bias; bf16) forward+backward on {dev}: speed-up vs the fastest bf16 variant "
          f"(eager, compiled, CUDA graphs) at that size, ms per step in brackets; "
          f"steady state of back-to-back steps")
    print_table(["case"] + [f"{r['tokens']}x{r['hidden']}" for r in results],
                [[n] + [cell(r["cases"][n]) for r in results] for n in names])

    print_details(results, names)
    for r in results:
        r["ffn"] = 4 * r["hidden"]
    save_json(os.path.join(args.out, "compile.json"),
              {"device": dev, "torch": torch.__version__, "torchao": ao,
               "gemm_autotune": gemm_autotune(),
               "gelu": "exact (erf)", "dtype": "bf16 activations, parameters and gradients",
               "reps": args.reps, "rounds": args.rounds, "warmup": args.warmup,
               "settle_s": settle_applied(args),
               "results": results})
    plotted = [n for n in names if any(r["cases"][n]["speedup_vs_faster_bf16"] for r in results)]
    save_plot(os.path.join(args.out, "compile.png"), results, plotted, dev)


def print_details(results, names):
    """The per-case details table (compilation, graph breaks, accuracy, state update, energy)."""
    print("\nDetails: first step (compilation) time, graph breaks and CUDA-graph skips while "
          "compiling, relative error of the output vs bf16 eager, delayed-scaling update seen; "
          "with --energy, joules per step, mean power and the fastest bf16 variant's joules per "
          "step over the case's")
    rows = []
    for r in results:
        for n in names:
            c = r["cases"][n]
            ok = c["status"] == "ok"
            rows.append([f"{r['tokens']}x{r['hidden']}", n,
                         f"{c['ms']:.3f}" if ok and c["ms"] else "-",
                         f"{c['speedup_vs_faster_bf16']:.2f}x"
                         if ok and c["speedup_vs_faster_bf16"] else "-",
                         f"{c['first_step_s']:.1f}" if "first_step_s" in c else "-",
                         c.get("graph_breaks", "-"), c.get("cudagraph_skips", "-"),
                         f"{c['rel_err_vs_bf16_eager']:.2%}"
                         if "rel_err_vs_bf16_eager" in c else "-",
                         c.get("scales_updated", "-"),
                         f"{c['joules_per_step']:.3f}" if "joules_per_step" in c else "-",
                         f"{c['watts']:.0f}" if "watts" in c else "-",
                         f"{c['energy_saving_vs_faster_bf16']:.2f}x"
                         if "energy_saving_vs_faster_bf16" in c else "-",
                         "ok" if ok else c["status"]])
    print_table(["size", "case", "ms", "vs fastest bf16", "first step s", "graph breaks",
                 "cudagraph skips", "rel err", "scales updated", "J/step", "W",
                 "bf16 J / J", "status"], rows)


if __name__ == "__main__":
    main()
