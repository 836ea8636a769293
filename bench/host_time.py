"""Host (CPU) time per call of tpfp8.Linear beside torch.nn.Linear, at a size where the GPU
work is negligible, so what is timed is what the host spends issuing it -- the cost that
decides small and mid-size layers. Parts are timed separately: the forward alone, forward +
backward (a training step: gradients set to None first), the step under torch.autocast (bf16,
fp32 layers: mixed-precision training as Hugging Face's Trainer runs it), the step with the
weight gradient accumulated into weight.main_grad (fuse_wgrad_accumulation), fp8_autocast's enter
and exit, and the forward op called alone. The ratios to nn.Linear are also taken from paired
rounds (both timed back to back), the measure to compare across runs on a noisy host.

  python bench/host_time.py              # on the GPU
  python bench/host_time.py --profile    # plus a torch.profiler table of one FP8 step
"""
import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpfp8  # noqa: E402

_MANY = 64  # the layers whose delayed-scaling update is timed together, as a model's step does
_MANY_UPDATE = f"delayed-scaling update ({_MANY} modules)"


def timed(fn, n, device):
    """Wall time of n calls of fn; the GPU is waited for before and after only."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def per_call_us(fn, device, n=2000, rounds=5):
    """Best-of-rounds mean wall time per call."""
    for _ in range(100):
        fn()
    return min(timed(fn, n, device) for _ in range(rounds)) / n * 1e6


def paired_ratio(base, fn, device, n=300, rounds=15):
    """fn's host time over base's, each round timing both back to back (in alternating
    order), so that both see the same state of a noisy host: (median, lowest, highest) of the
    rounds' ratios."""
    for _ in range(100):
        base()
        fn()
    ratios = []
    for r in range(rounds):
        first, second = (base, fn) if r % 2 == 0 else (fn, base)
        times = {first: timed(first, n, device), second: timed(second, n, device)}
        ratios.append(times[fn] / times[base])
    ratios.sort()
    return ratios[len(ratios) // 2], ratios[0], ratios[-1]


def cases(device, size):
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    ref = nn.Linear(size, size, bias=False, device=device, dtype=torch.bfloat16)
    ours = tpfp8.Linear(size, size, bias=False, device=device, dtype=torch.bfloat16)
    ref32 = nn.Linear(size, size, device=device)  # (fp32, with bias: under torch.autocast)
    ours32 = tpfp8.Linear(size, size, device=device)
    fused = tpfp8.Linear(size, size, bias=False, device=device, dtype=torch.bfloat16,
                         fuse_wgrad_accumulation=True)
    fused.weight.main_grad = torch.zeros_like(fused.weight, dtype=torch.float32)
    delayed, current = tpfp8.DelayedScaling(), tpfp8.CurrentScaling()

    def clear_grads():
        # As a training step (and bench/linear.py) does: backward stores the gradients
        # instead of adding them to last step's.
        x.grad = None
        for mod in (ref, ours, ref32, ours32, fused):
            for p in mod.parameters():
                p.grad = None

    def fp8(recipe, backward, mod=ours, autocast=False):
        def run():
            if backward:
                clear_grads()
            with mixed_precision(device, autocast), tpfp8.fp8_autocast(recipe=recipe):
                y = mod(x)
            if backward:
                y.backward(dy)
        return run

    def step(mod, autocast=False):
        def run():
            clear_grads()
            with mixed_precision(device, autocast):
                y = mod(x)
            y.backward(dy)
        return run

    def empty_autocast():
        with tpfp8.fp8_autocast(recipe=delayed):
            pass

    # (The op alone has no autograd: it refuses inputs that require grad.)
    x_data, weight = x.detach(), ours.weight.detach()

    def op_call(*state, scaling=0):  # the forward op alone, no autograd
        return torch.ops.tpfp8.linear_forward(x_data, weight, None, *state, None, None, None,
                                              None, scaling, 0, 1, 0.0, 0, False, 0, False, "",
                                              [], False, False)

    return {
        "nn.Linear fwd": lambda: ref(x),
        "nn.Linear fwd+bwd": step(ref),
        "tpfp8 high precision fwd": lambda: ours(x),
        "tpfp8 high precision fwd+bwd": step(ours),
        "linear_forward op high precision": lambda: op_call(None, None),
        "fp8_autocast enter+exit": empty_autocast,
        "tpfp8 delayed fwd": fp8(delayed, False),
        "tpfp8 delayed fwd+bwd": fp8(delayed, True),
        "tpfp8 current fwd": fp8(current, False),
        "tpfp8 current fwd+bwd": fp8(current, True),
        AUTOCAST_BASE: step(ref32, autocast=True),
        AUTOCAST_CASE: fp8(delayed, True, ours32, autocast=True),
        MAIN_GRAD_CASE: fp8(delayed, True, fused),
    }


AUTOCAST_BASE = "nn.Linear fwd+bwd, torch.autocast"
AUTOCAST_CASE = "tpfp8 delayed fwd+bwd, torch.autocast"
MAIN_GRAD_CASE = "tpfp8 delayed fwd+bwd, main_grad fusion"


def mixed_precision(device, on):
    """torch.autocast in bf16 for the device where `on`, else nothing."""
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=on)


def primitives(device, size):
    """Host cost of the pieces a step is made of: an allocation, a torch GEMM, tpfp8's cast
    and GEMM ops, the delayed-scaling update (of one module, and of `_MANY` at once), and the
    Linear's forward op alone."""
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    u8, u8_t = (torch.empty(size, size, device=device, dtype=torch.uint8) for _ in range(2))
    one, amax = torch.ones(1, device=device), torch.zeros(1, device=device)
    ours = tpfp8.Linear(size, size, bias=False, device=device, dtype=torch.bfloat16)
    many = [tpfp8.Linear(size, size, bias=False, device=device, dtype=torch.bfloat16)
            for _ in range(_MANY)]
    with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling()):
        for layer in [ours] + many:
            layer(x)
    state = (ours.fp8_scale, ours.fp8_amax_history)
    forward_op = torch.ops.tpfp8.linear_forward
    weight = ours.weight.detach()  # (the op alone has no autograd: it refuses grad inputs)
    gemm = torch.ops.tpfp8.gemm
    return {
        "torch.empty": lambda: torch.empty(size, size, device=device),
        "torch.mm bf16": lambda: torch.mm(x, x),
        "tpfp8 cast_transpose op": lambda: torch.ops.tpfp8.cast_transpose(
            x, one, u8, u8_t, amax, one, 0),  # (outputs apart: the op refuses overlap)
        "tpfp8 FP8 gemm op": lambda: gemm(u8, u8, x, one, one, 3, 3, None, False, True, False,
                                          False),
        "delayed-scaling update (1 module)": lambda: tpfp8.scaling.update([ours]),
        _MANY_UPDATE: lambda: tpfp8.scaling.update(many),
        "linear_forward op FP8 (no grad)": lambda: forward_op(
            x, weight, None, *state, None, None, None, None, 1, 0, 1, 0.0, 0, False, 0,
            False, "", [], False, False),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=64, help="M = K = N of the layer")
    parser.add_argument("--profile", action="store_true", help="profile one delayed FP8 step")
    args = parser.parse_args(argv)
    results = {}
    for name, fn in cases(args.device, args.size).items():
        results[name] = per_call_us(fn, args.device)
        print(f"{name:40s} {results[name]:8.1f} us", flush=True)
    print("-- pieces", flush=True)
    for name, fn in primitives(args.device, args.size).items():
        results[name] = per_call_us(fn, args.device)
        print(f"{name:40s} {results[name]:8.1f} us", flush=True)
    per_module = results[_MANY_UPDATE] / _MANY
    print(f"delayed-scaling update: {per_module:.2f} us a module ({_MANY} modules at once)")
    base = results["nn.Linear fwd+bwd"]
    for name in ("tpfp8 delayed fwd+bwd", "tpfp8 current fwd+bwd", MAIN_GRAD_CASE):
        print(f"{name} / nn.Linear fwd+bwd: {results[name] / base:.2f}x host time")
    print(f"{AUTOCAST_CASE} / {AUTOCAST_BASE}: "
          f"{results[AUTOCAST_CASE] / results[AUTOCAST_BASE]:.2f}x host time")
    steps = cases(args.device, args.size)
    for base, name in (("nn.Linear fwd+bwd", "tpfp8 delayed fwd+bwd"),
                       ("nn.Linear fwd+bwd", "tpfp8 current fwd+bwd"),
                       ("nn.Linear fwd+bwd", MAIN_GRAD_CASE),
                       (AUTOCAST_BASE, AUTOCAST_CASE)):
        median, low, high = paired_ratio(steps[base], steps[name], args.device)
        print(f"{name} / {base}, paired rounds: {median:.2f}x host time "
              f"(median; {low:.2f}-{high:.2f})", flush=True)
    if args.profile:
        run = cases(args.device, args.size)["tpfp8 delayed fwd+bwd"]
        for _ in range(20):
            run()
        with torch.profiler.profile() as prof:
            for _ in range(20):
                run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
