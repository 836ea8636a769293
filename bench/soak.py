"""Soak test (not CI): many FP8 training steps with a NaN injected every so often.

For each recipe, two copies of a small MLP (fc1 -> GELU -> fc2, tpfp8.Linear) train on the same
data in lockstep: the *faulty* run gets a NaN in its input every --every steps, and skips the
optimizer step when its loss is not finite (what GradScaler does); the *clean* run never sees
those steps. Every --every steps it prints the process RSS and the GPU memory (both should stay
flat), and at the step after each NaN whether the faulty run's FP8 state and loss are back to
the clean run's. Delayed scaling drops, per tensor, a step whose amax is NaN or Inf, so the
scales of the tensors the NaN reached (inputs, gradients) continue as in the clean run. The
weights were finite on the NaN step, so their amaxes entered their histories one step before
the clean run's did: the faulty run's weight scale can differ for a step, and from then on
the two runs differ by rounding, a difference that grows slowly (the gradient scales follow
it most: 2e-3 after 9 000 steps on an H200). So the checks at the step after each NaN: fc1's
input scale (the tensor the NaN hit) equals the clean run's bit for bit, and no scale or loss
differs by more than 1e-2 (a scale frozen by the NaN, the bug this guards against, is off by
10x and more). Current scaling keeps no state: there the loss must match bit for bit.

  python bench/soak.py                        # 10 000 steps, NaN every 1 000, both recipes
  python bench/soak.py --steps 2000 --device cpu --hidden 64
Writes soak.json (and soak.png with matplotlib) under --out.
"""
import argparse
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import tpfp8  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def gpu_mib(device) -> float:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def make_model(hidden, device):
    torch.manual_seed(0)
    return nn.Sequential(tpfp8.Linear(hidden, 4 * hidden, device=device), nn.GELU(),
                         tpfp8.Linear(4 * hidden, hidden, device=device))


def scales(model):
    """Every layer's delayed-scaling scales, forward then backward (empty under current
    scaling). Histories are not compared: the weight's rolled on the NaN step too."""
    out = []
    for m in model:
        state = m.fp8_state if isinstance(m, tpfp8.Linear) else None
        if state is not None:
            out += [state[d][k].clone() for d in ("forward", "backward")
                    for k in ("scale", "scale_inv")]
    return out


def first_scale(scale_list):
    """fc1's input scale, or None under current scaling."""
    return float(scale_list[0][0]) if scale_list else None


def batch(step, tokens, hidden, device, teacher):
    g = torch.Generator(device=device).manual_seed(step)
    x = torch.randn(tokens, hidden, device=device, generator=g)
    return x, x @ teacher


def train_step(model, opt, x, target, recipe) -> float:
    with tpfp8.fp8_autocast(recipe=recipe):
        y = model(x)
    loss = nn.functional.mse_loss(y.float(), target)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    value = loss.item()
    if value == value and abs(value) != float("inf"):  # skip a non-finite step's update
        opt.step()
    return value


def soak(recipe_name, args, device):
    recipe = tpfp8.DelayedScaling() if recipe_name == "delayed" else tpfp8.CurrentScaling()
    torch.manual_seed(1)
    teacher = torch.randn(args.hidden, args.hidden, device=device) / args.hidden ** 0.5
    clean, faulty = make_model(args.hidden, device), make_model(args.hidden, device)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (clean, faulty)]
    rows, after_nan, start = [], [], time.perf_counter()
    for step in range(args.steps):
        x, target = batch(step, args.tokens, args.hidden, device, teacher)
        if (step + 1) % args.every == 0:  # the faulty run alone sees a NaN step
            bad = x.clone()
            bad[0, 0] = float("nan")
            train_step(faulty, opts[1], bad, target, recipe)
        loss_clean = train_step(clean, opts[0], x, target, recipe)
        loss_faulty = train_step(faulty, opts[1], x, target, recipe)
        if step > 0 and step % args.every == 0:  # the step after a NaN
            s_clean, s_faulty = scales(clean), scales(faulty)
            diff = max([float(((f - c) / c).abs().max()) for c, f in zip(s_clean, s_faulty)],
                       default=0.0)
            after_nan.append({"step": step, "scale_rel_diff": diff,
                              "fc1_input_scale_equal":
                                  first_scale(s_clean) == first_scale(s_faulty),
                              "loss_rel_diff": abs(loss_faulty - loss_clean) / abs(loss_clean),
                              "fc1_input_scale_clean": first_scale(s_clean),
                              "fc1_input_scale_faulty": first_scale(s_faulty)})
        if (step + 1) % args.every == 0 or step == 0:
            rows.append({"step": step + 1, "rss_mib": rss_mib(), "gpu_mib": gpu_mib(device),
                         "loss": loss_clean, "elapsed_s": time.perf_counter() - start})
            last = after_nan[-1] if after_nan else {}
            print(f"[{recipe_name}] step {step + 1:6d}/{args.steps}  loss {loss_clean:.4f}  "
                  f"RSS {rows[-1]['rss_mib']:.1f} MiB  GPU {rows[-1]['gpu_mib']:.1f} MiB  "
                  f"after last NaN: scale diff {last.get('scale_rel_diff', float('nan')):.1e}, "
                  f"loss diff {last.get('loss_rel_diff', float('nan')):.1e}  "
                  f"({rows[-1]['elapsed_s']:.0f} s)", flush=True)
    return {"rows": rows, "after_nan": after_nan}


def plot(results, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in results.items():
        steps = [r["step"] for r in res["rows"]]
        axes[0].plot(steps, [r["rss_mib"] for r in res["rows"]], marker="o", label=f"{name} RSS")
        axes[0].plot(steps, [r["gpu_mib"] for r in res["rows"]], marker="x",
                     label=f"{name} GPU allocated")
        if res["after_nan"] and res["after_nan"][0]["fc1_input_scale_clean"] is not None:
            nan_steps = [a["step"] for a in res["after_nan"]]
            axes[1].plot(nan_steps, [a["fc1_input_scale_clean"] for a in res["after_nan"]],
                         marker="o", label=f"{name} clean run")
            axes[1].plot(nan_steps, [a["fc1_input_scale_faulty"] for a in res["after_nan"]],
                         marker="x", linestyle="--", label=f"{name} run with NaN steps")
    axes[0].set(xlabel="step", ylabel="MiB", title="memory (flat = no leak)")
    axes[1].set(xlabel="step after a NaN", ylabel="fc1 input scale",
                title="delayed scaling after each NaN step")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10000, help="training steps per run")
    parser.add_argument("--every", type=int, default=1000, help="a NaN step every N steps")
    parser.add_argument("--hidden", type=int, default=1024, help="model width")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per step")
    parser.add_argument("--recipes", default="delayed,current", help="comma-separated")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench/results", help="folder for soak.json/png")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results = {name: soak(name, args, device) for name in args.recipes.split(",")}
    print("\n| recipe | RSS first -> last MiB | GPU first -> last MiB | NaN steps | "
          "fc1 input scale == clean | max scale diff after NaN | max loss diff after NaN |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for name, res in results.items():
        first, last = res["rows"][0], res["rows"][-1]
        scale_diff = max((a["scale_rel_diff"] for a in res["after_nan"]), default=0.0)
        loss_diff = max((a["loss_rel_diff"] for a in res["after_nan"]), default=0.0)
        n = len(res["after_nan"])
        print(f"| {name} | {first['rss_mib']:.1f} -> {last['rss_mib']:.1f} | "
              f"{first['gpu_mib']:.1f} -> {last['gpu_mib']:.1f} | {n} | "
              f"{sum(a['fc1_input_scale_equal'] for a in res['after_nan'])}/{n} | "
              f"{scale_diff:.1e} | {loss_diff:.1e} |")
        exact = name == "current"
        hit = all(a["fc1_input_scale_equal"] for a in res["after_nan"])
        ok &= hit and scale_diff < 1e-2 and (loss_diff == 0.0 if exact else loss_diff < 1e-2)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "soak.png"))
    print("soak OK" if ok else "soak: a run did not return to the clean run after a NaN")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
