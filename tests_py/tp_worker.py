"""Tensor-parallel checks, run by every rank under torchrun (launched from test_tp.py).

For each configuration -- {column, row} x {sequence parallel off, on} x {high precision,
delayed, current} x {save_original_input off, on} x {bias, no bias} -- a tensor-parallel layer
and a single-device layer built with the same seed run the same steps on the same full data,
and each rank checks its part of the outputs and gradients against:
  (a) a float64 emulation of the tensor-parallel computation that quantizes with the very
      scales each rank used (only the summation order differs): <= 1e-5 relative;
  (b) the single-device run: <= 1e-5 where every scale is provably the same on every rank
      (high precision; delayed scaling with sequence parallelism, whose amaxes are all
      reduced over the group), else within FP8 error (<= 0.15: each run is within E4M3's
      2^-4 / E5M2's 2^-3 relative rounding of the exact result, and per-rank scales of a
      sharded weight legitimately differ from the full weight's).
Also: the FP8 sequence gather sends uint8 codes whose bytes and scale_inv equal the
single-device cast of the full tensor, with an outlier on the last rank only; and a bf16 smoke
run of every mode. Prints "TP OK <n> checks" and exits 0 when everything holds.

  torchrun --nproc_per_node=2 tests_py/tp_worker.py   (TP_DEVICE=cuda to run on the GPU)
"""
import copy
import datetime
import functools
import itertools
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_oracle import current_scale as cur_scale  # noqa: E402
from fp8_oracle import fake_quant as fq  # noqa: E402
from fp8_oracle import pending_scale  # noqa: E402

import tpfp8  # noqa: E402
from tpfp8 import _C  # noqa: E402
from tpfp8 import parallel as P  # noqa: E402

DEVICE = os.environ.get("TP_DEVICE", "cpu")
# On the GPU, cuBLASLt's FP8 GEMMs accumulate with ~14 mantissa bits between fp32 promotions
# (tests_py/test_gemm.py), so FP8 results sit ~1e-4 from any exact emulation there.
FP8_TIGHT = 1e-5 if DEVICE == "cpu" else 1e-3
S, B, K, N = 8, 2, 64, 128  # sequence, batch, in_features, out_features (full sizes)
checks = 0


def fwd_state(lin):
    """The layer's forward delayed-scaling state (scale, scale_inv, amax_history)."""
    return lin.fp8_state["forward"]


def bwd_state(lin):
    """The layer's backward (output gradient) delayed-scaling state."""
    return lin.fp8_state["backward"]


def pending_grad_scale(layer, fmt):
    """The gradient scale this step's backward will use: the pending amax (the last
    backward's; all-reduced over the amax group, under sequence parallelism) rolled in at this
    step's fp8_autocast exit."""
    state = dict(bwd_state(layer))
    if layer.sequence_parallel:
        history = state["amax_history"] = state["amax_history"].clone()
        dist.all_reduce(history[0], op=dist.ReduceOp.MAX, group=layer.tp_group)
    return float(pending_scale(state, fmt))


def rel(a, b):
    a = torch.as_tensor(a).detach().double().cpu()
    b = torch.as_tensor(b).detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def expect(value, bound, what):
    global checks
    checks += 1
    if not value <= bound:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: {value:.3e} > {bound:.1e}")


# ---- float64 emulation ----------------------------------------------------------------

def gathered_scalars(v):
    """Every rank's value of a python float, in rank order."""
    t = torch.tensor([float(v)], dtype=torch.float64, device=DEVICE)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(o) for o in out]


def emulate(mode, recipe, layer, x, dy, w_full, b_full, high=()):
    """Full (all-rank) y, dx, dW, db of the TP computation with each rank's scales; the GEMMs
    named in `high` (debug's disable_fp8_gemm) in high precision."""
    tp, r = dist.get_world_size(), dist.get_rank()
    # On the CPU, where the oracle's fake quantization lives.
    x, dy, w_full = x.cpu(), dy.cpu(), w_full.cpu()
    b_full = b_full.cpu() if b_full is not None else None
    x2, dy2 = x.reshape(-1, K).double(), dy.reshape(-1, N).double()
    if recipe is None:
        y = x2 @ w_full.double().T + (b_full.double() if b_full is not None else 0)
        return y, dy2 @ w_full.double(), dy2.T @ x2, dy2.sum(0)
    fwd, grad = "e4m3", "e5m2"
    w_parts = w_full.chunk(tp, dim=0 if mode == "column" else 1)
    x_parts = x2.chunk(tp, dim=1) if mode == "row" else [x2] * tp
    dy_parts = dy2.chunk(tp, dim=1) if mode == "column" else [dy2] * tp
    if isinstance(recipe, tpfp8.DelayedScaling):  # scales 1 until the first update
        fwd_scales = fwd_state(layer)["scale"].tolist() if layer.fp8_state else [1.0, 1.0]
        sx, sw = (gathered_scalars(v) for v in fwd_scales)
        sdy = gathered_scalars(pending_grad_scale(layer, grad) if layer.fp8_state else 1.0)
    else:
        sx = gathered_scalars(cur_scale(x_parts[r], fwd))
        sw = gathered_scalars(cur_scale(w_parts[r], fwd))
        sdy = gathered_scalars(cur_scale(dy_parts[r], grad))
    q = {"x": [fq(x_parts[i], sx[i], fwd) for i in range(tp)],
         "w": [fq(w_parts[i], sw[i], fwd) for i in range(tp)],
         "dy": [fq(dy_parts[i], sdy[i], grad) for i in range(tp)]}
    hp = {"x": [p.double() for p in x_parts], "w": [p.double() for p in w_parts],
          "dy": [p.double() for p in dy_parts]}

    def src(gemm):
        return hp if gemm in high else q

    f, d, g = src("fprop"), src("dgrad"), src("wgrad")
    db = dy2.sum(0)
    if mode == "column":
        y = torch.cat([f["x"][i] @ f["w"][i].T for i in range(tp)], dim=1)
        dx = sum(d["dy"][i] @ d["w"][i] for i in range(tp))
        dw = torch.cat([g["dy"][i].T @ g["x"][i] for i in range(tp)], dim=0)
    else:
        y = sum(f["x"][i] @ f["w"][i].T for i in range(tp))
        dx = torch.cat([d["dy"][i] @ d["w"][i] for i in range(tp)], dim=1)
        dw = torch.cat([g["dy"][i].T @ g["x"][i] for i in range(tp)], dim=1)
    if b_full is not None:
        y = y + b_full.double()
    return y, dx, dw, db


# ---- one configuration ----------------------------------------------------------------

def local_view(mode, sp, group, full_x, full_dy):
    """This rank's input and output gradient, as the TP layer sees them."""
    x = full_x.chunk(dist.get_world_size(), dim=2)[dist.get_rank()] if mode == "row" else full_x
    dy = full_dy.chunk(dist.get_world_size(), dim=2)[dist.get_rank()] if mode == "column" \
        else full_dy
    if sp and mode == "column":
        x = P.split_sequence(x, group)
    if sp and mode == "row":
        dy = P.split_sequence(dy, group)
    return x.detach().clone(), dy.contiguous()


def full_of(t, mode, sp, group, what):
    """This rank's piece of x-grad / y / dW / db, assembled to the full tensor."""
    if what in ("y", "dx") and sp and ((mode == "row") == (what == "y")):
        t = P.gather_sequence(t.contiguous(), group)
    dims = {("column", "y"): 2, ("row", "dx"): 2, ("column", "dw"): 0, ("row", "dw"): 1,
            ("column", "db"): 0}
    dim = dims.get((mode, what))
    return t if dim is None else P.unshard(t, dim, group)


def run_config(mode, sp, recipe, save_orig, bias, group, dtype=torch.float32, steps=3):
    kw = {"bias": bias, "device": DEVICE, "dtype": dtype, "save_original_input": save_orig}
    torch.manual_seed(1)
    single = tpfp8.Linear(K, N, **kw)
    torch.manual_seed(1)
    layer = tpfp8.Linear(K, N, parallel_mode=mode, tp_group=group, sequence_parallel=sp, **kw)
    exact_scales = recipe is None or (isinstance(recipe, tpfp8.DelayedScaling) and sp)
    full = layer.full_state_dict()  # the shards are slices of the single-device layer
    global checks
    checks += 1
    assert torch.equal(full["weight"], single.weight), "TP init differs from single-device"
    assert not bias or torch.equal(full["bias"], single.bias), "TP bias init differs"
    for step in range(steps):
        torch.manual_seed(100 + step)
        full_x = torch.randn(S, B, K, device=DEVICE).to(dtype)
        full_dy = (torch.randn(S, B, N, device=DEVICE) * 1e-2).to(dtype)
        if step == steps - 1 and recipe is not None:  # an outlier on the last rank's rows
            full_x[-1, -1, -1] = 40.0
        ctx = tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe)
        # The emulation reads the scales this step will use, so it runs before the step.
        emu = emulate(mode, recipe, layer, full_x, full_dy, single.weight.detach(),
                      single.bias.detach() if bias else None) if dtype == torch.float32 else None
        x, dy = local_view(mode, sp, group, full_x, full_dy)
        x.requires_grad_(True)
        with ctx:
            y = layer(x)
        y.backward(dy)
        xs = full_x.detach().clone().requires_grad_(True)
        with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            ys = single(xs)
        ys.backward(full_dy)
        got = {"y": full_of(y.detach(), mode, sp, group, "y"),
               "dx": full_of(x.grad, mode, sp, group, "dx"),
               "dw": full_of(layer.weight.grad, mode, sp, group, "dw")}
        want = {"y": ys.detach(), "dx": xs.grad, "dw": single.weight.grad}
        if bias:
            got["db"] = full_of(layer.bias.grad, mode, sp, group, "db")
            want["db"] = single.bias.grad
        name = f"{mode} sp={sp} {type(recipe).__name__} save={save_orig} bias={bias} " \
               f"step={step} {dtype}"
        for i, key in enumerate(("y", "dx", "dw", "db")):
            if key not in got:
                continue
            if dtype != torch.float32:
                expect(rel(got[key], want[key]), 0.15, f"{name} bf16 {key} vs single")
                continue
            tight = 1e-5 if recipe is None else FP8_TIGHT
            expect(rel(got[key], emu[i].reshape(got[key].shape)), tight,
                   f"{name} {key} vs emulation")
            bound = tight if exact_scales else 0.15
            expect(rel(got[key], want[key]), bound, f"{name} {key} vs single-device")
        for p in list(layer.parameters()) + list(single.parameters()):
            p.grad = None


def check_fp8_gather(group):
    """The sequence gather sends uint8 codes equal to the single-device cast of the full
    tensor, with the same scale_inv bits, also with an outlier on the last rank only."""
    tp, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(7)
    full = torch.randn(4 * tp, K, device=DEVICE).bfloat16()
    full[-1, 3] = 300.0  # only the last rank sees it
    codes, scale_inv = _C.all_gather_fp8(full.chunk(tp)[r].contiguous(), _C.Fp8Format.E4M3,
                                         group.group_name)
    scale = torch.tensor([448.0], device=DEVICE) / full.float().abs().max()
    ref = tpfp8.ops.quantize(full, scale, "e4m3")
    global checks
    checks += 1
    assert codes.dtype == torch.uint8 and codes.shape == full.shape, "FP8 gather sends uint8"
    assert torch.equal(codes, ref.rowwise), f"rank {r}: gathered bytes differ"
    assert torch.equal(scale_inv, ref.scale_inv), f"rank {r}: scale_inv differs"
    # A NaN on the last rank only: every rank casts with the unit scale of a non-finite amax
    # (the amax goes into the all-reduce as Inf; MAX over a NaN depends on the backend and on
    # the order), so the gathered bytes decode alike everywhere.
    full[-1, 3] = float("nan")
    codes, scale_inv = _C.all_gather_fp8(full.chunk(tp)[r].contiguous(), _C.Fp8Format.E4M3,
                                         group.group_name)
    ref = tpfp8.ops.quantize(full, torch.ones(1, device=DEVICE), "e4m3")
    checks += 1
    assert torch.equal(codes, ref.rowwise), f"rank {r}: bytes with a NaN on one rank differ"
    assert float(scale_inv) == 1.0, f"rank {r}: scale_inv {float(scale_inv)} with a NaN amax"


def check_errors(group):
    """Bad configurations fail with a clear ValueError before any collective (no hang)."""
    tp = dist.get_world_size()
    cases = [
        (lambda: tpfp8.Linear(K, N, parallel_mode="column"), "needs tp_group"),
        (lambda: tpfp8.Linear(K, N, parallel_mode="diagonal", tp_group=group), "parallel_mode"),
        (lambda: tpfp8.Linear(K, N, sequence_parallel=True), "sequence_parallel"),
    ]
    if tp > 1:  # sizes a group of one divides; a group that misses ranks
        first_only = dist.new_group([0])  # every rank takes part in making it

        def amax_group_too_small():
            layer = tpfp8.Linear(K, N, parallel_mode="column", tp_group=group,
                                 sequence_parallel=True, device=DEVICE)
            with tpfp8.fp8_autocast(amax_group=first_only):
                layer(torch.randn(S // tp, B, K, device=DEVICE))

        cases += [  # (rank 0 is in the too small group; the others are refused as outside it)
            (amax_group_too_small, "must contain the layer's tp_group" if dist.get_rank() == 0
             else "is not in the group"),
            (lambda: tpfp8.Linear(K, N + 1, parallel_mode="column", tp_group=group), "divisible"),
            (lambda: tpfp8.Linear(K + 1, N, parallel_mode="row", tp_group=group), "divisible"),
            (lambda: tpfp8.Linear(K, N, parallel_mode="row", tp_group=group,
                                  sequence_parallel=True, device=DEVICE)(
                torch.randn(S * tp + 1, K // tp, device=DEVICE)), "sequence length"),
        ]
    expect_errors([(make, ValueError, message) for make, message in cases])


def expect_errors(cases) -> None:
    """Each (make, exception type, message): make() raises that type, its text holding it."""
    global checks
    for make, kind, message in cases:
        try:
            make()
        except kind as e:
            assert message in str(e), f"unclear error: {e}"
            checks += 1
        else:
            raise AssertionError(f"no error for a case expecting '{message}'")


def check_parallel_arguments_refused(group):
    """Refused with a clear error on every rank, before any collective (each was accepted and
    failed later: an AttributeError, a negative size, a shape mismatch differing by rank, or a
    wrong shape returned): a tp_group that is no process group, one this rank is not in, a
    SwiGLU MLP whose hidden size the group does not divide in each half, a 1-D input under
    sequence parallelism, an fp8_autocast amax_group this rank is not in (a layer without
    tensor parallelism ran, and the exit failed on that rank alone, its update lost)."""
    tp = dist.get_world_size()
    first_only = dist.new_group([0])  # (every rank takes part in making it)

    def outside_amax_group():
        layer = tpfp8.Linear(K, N, device=DEVICE)
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(), amax_group=first_only):
            layer(torch.randn(S, K, device=DEVICE))
    cases = [(lambda: tpfp8.Linear(K, N, parallel_mode="column", tp_group=[0]), TypeError,
              "must be a torch.distributed ProcessGroup"),
             (lambda: tpfp8.Linear(K, N, parallel_mode="column", tp_group=group,
                                   sequence_parallel=True, device=DEVICE)(
                 torch.randn(K, device=DEVICE)), ValueError, "needs [sequence, ..., features]")]
    if dist.get_rank() != 0:
        cases.append((lambda: tpfp8.Linear(K, N, parallel_mode="row", tp_group=first_only),
                      ValueError, "is not in the group"))
        cases.append((outside_amax_group, ValueError, "amax_group=...): this rank"))
    if tp > 1:
        ffn = 2 * tp + 1  # (no half divisible by the group; at tp 2, 2 * ffn is)
        cases.append((lambda: tpfp8.MLP(K, ffn, activation="swiglu", set_parallel_mode=True,
                                        tp_group=group), ValueError, "ffn_hidden_size"))
    expect_errors(cases)


def check_double_backward_refused(group):
    """A tensor-parallel layer refuses double backward clearly on every rank (its collectives
    are not differentiable), before any collective of the backward runs."""
    global checks
    for mode in ("column", "row"):
        layer = tpfp8.Linear(K, N, parallel_mode=mode, tp_group=group, device=DEVICE)
        k_local = K // dist.get_world_size() if mode == "row" else K
        x = torch.randn(S, k_local, device=DEVICE, requires_grad=True)
        try:
            torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
        except RuntimeError as e:
            assert "tensor parallelism" in str(e), f"unclear error: {e}"
            checks += 1
        else:
            raise AssertionError(f"{mode}: double backward was not refused")


def check_quantize_after_gather(group):
    """The debug quantizer's path (gather high precision, quantize the gathered tensor; taken
    by any layer a debug rule matches, here one with no feature) gives the fast path's results
    bit for bit under current scaling, save_original_input or not."""
    global checks
    for save_orig in (False, True):
        results = []
        for after_gather in (False, True):
            torch.manual_seed(3)
            layer = tpfp8.Linear(K, N, parallel_mode="column", tp_group=group,
                                 sequence_parallel=True, save_original_input=save_orig,
                                 device=DEVICE, name="gathered")
            if after_gather:
                tpfp8.debug.initialize([{"layers": "gathered", "features": {}}])
            torch.manual_seed(4)
            full_x = torch.randn(S, B, K, device=DEVICE)
            x = P.split_sequence(full_x, group).requires_grad_(True)
            with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
                y = layer(x)
            y.backward(torch.ones_like(y))
            tpfp8.debug.shutdown()
            results.append((y.detach(), x.grad, layer.weight.grad))
        for a, b in zip(*results):
            checks += 1
            assert torch.equal(a, b), f"quantize-after-gather differs (save={save_orig})"


def check_debug_keeps_bias_grad(group):
    """Debugging changes no result, db included: under row-parallel SP the debugged layer
    gathers dy in high precision and casts the whole tensor, yet its db is still this rank's
    rows summed by the kernel that fuses the sum into the fast path's cast, then all-reduced."""
    global checks
    for mode, sp in itertools.product(("column", "row"), (False, True)):
        results = []
        for debugged in (False, True):
            if debugged:
                tpfp8.debug.initialize([{"layers": "biased", "features": {}}])
            torch.manual_seed(10)
            layer = tpfp8.Linear(K, N, parallel_mode=mode, tp_group=group, sequence_parallel=sp,
                                 device=DEVICE, name="biased")
            torch.manual_seed(11)
            full_x = torch.randn(S, B, K, device=DEVICE)
            full_dy = torch.randn(S, B, N, device=DEVICE) * 1e-2
            got = step_tp(layer, mode, sp, group, full_x, full_dy, tpfp8.CurrentScaling())
            tpfp8.debug.shutdown()
            results.append((*got, full_of(layer.bias.grad, mode, sp, group, "db")))
        for key, a, b in zip(("y", "dx", "dw", "db"), *results):
            checks += 1
            assert torch.equal(a, b), f"debugging changed {key} ({mode}, sp={sp})"


def check_deepcopy(group):
    """copy.deepcopy of a tensor-parallel layer after FP8 steps: the copy shares the process
    groups (a ProcessGroup cannot be copied), keeps the weight's tensor-parallel attributes,
    owns its FP8 state, and steps as the original."""
    global checks
    recipe = tpfp8.DelayedScaling(amax_history_len=4)
    for mode, sp in itertools.product(("column", "row"), (False, True)):
        torch.manual_seed(8)
        layer = tpfp8.Linear(K, N, parallel_mode=mode, tp_group=group, sequence_parallel=sp,
                             device=DEVICE)
        full_x, full_dy = torch.randn(S, B, K, device=DEVICE), torch.randn(S, B, N, device=DEVICE)
        step_tp(layer, mode, sp, group, full_x, full_dy, recipe)
        twin = copy.deepcopy(layer)
        assert twin.tp_group is group
        checks += 1  # the layout optimizers and checkpointers read, kept on the copy
        assert (twin.weight.tensor_model_parallel, twin.weight.partition_dim) == \
            (True, 0 if mode == "column" else 1)
        own, other = fwd_state(twin)["amax_history"], fwd_state(layer)["amax_history"]
        assert own.data_ptr() != other.data_ptr()
        for a, b in zip(step_tp(layer, mode, sp, group, full_x, full_dy, recipe),
                        step_tp(twin, mode, sp, group, full_x, full_dy, recipe)):
            checks += 1
            assert torch.equal(a, b), f"deepcopy of a {mode} layer (sp={sp}) steps differently"
        assert twin.fp8_state["amax_group"] is layer.fp8_state["amax_group"]  # set by the forward
        checks += 1
        assert torch.equal(fwd_state(layer)["amax_history"], fwd_state(twin)["amax_history"])


def check_checkpoint(group):
    """torch.utils.checkpoint (reentrant) of a tensor-parallel layer, backward after
    fp8_autocast's exit (its collectives run again in the recompute, with the forward's
    scales) gives the un-checkpointed steps bit for bit, delayed-scaling state included."""
    global checks
    recipe = tpfp8.DelayedScaling(amax_history_len=4)
    for mode, sp in itertools.product(("column", "row"), (False, True)):
        layers = []
        for _ in range(2):
            torch.manual_seed(9)
            layers.append(tpfp8.Linear(K, N, parallel_mode=mode, tp_group=group,
                                       sequence_parallel=sp, device=DEVICE))
        for _ in range(2):
            full_x = torch.randn(S, B, K, device=DEVICE)
            full_dy = torch.randn(S, B, N, device=DEVICE)
            plain = step_tp(layers[0], mode, sp, group, full_x, full_dy, recipe)
            # Plain torch.utils.checkpoint, as Hugging Face calls it (reentrant).
            ckpt = step_tp(layers[1], mode, sp, group, full_x, full_dy, recipe,
                           functools.partial(torch.utils.checkpoint.checkpoint,
                                             use_reentrant=True))
            for a, b in zip(plain, ckpt):
                checks += 1
                assert torch.equal(a, b), f"checkpointed {mode} layer (sp={sp}) differs"
        checks += 1
        histories = [fwd_state(layer)["amax_history"] for layer in layers]
        assert torch.equal(*histories)


def step_tp(layer, mode, sp, group, full_x, full_dy, recipe, wrap=None):
    """One forward + backward of a TP layer (called through `wrap(layer, x)` if given) on the
    full data; returns full (y, dx, dW)."""
    x, dy = local_view(mode, sp, group, full_x, full_dy)
    x.requires_grad_(True)
    layer.weight.grad = None
    with tpfp8.fp8_autocast(recipe=recipe):
        y = layer(x) if wrap is None else wrap(layer, x)
    y.backward(dy)
    return (full_of(y.detach(), mode, sp, group, "y"), full_of(x.grad, mode, sp, group, "dx"),
            full_of(layer.weight.grad, mode, sp, group, "dw"))


def check_debug_disable_fp8_gemm(group):
    """For every subset of GEMMs run in high precision, column/row, SP off/on: the TP run
    equals an emulation doing exactly those GEMMs in high precision."""
    recipe = tpfp8.CurrentScaling()
    gemms = ("fprop", "dgrad", "wgrad")
    for mode, sp in itertools.product(("column", "row"), (False, True)):
        for n in range(4):
            for high in itertools.combinations(gemms, n):
                tpfp8.debug.initialize([{"layers": "tp", "features": {
                    "disable_fp8_gemm": {"gemms": list(high)}}}] if high else [])
                torch.manual_seed(5)
                layer = tpfp8.Linear(K, N, bias=False, parallel_mode=mode, tp_group=group,
                                     sequence_parallel=sp, device=DEVICE, name="tp")
                w_full = layer.full_state_dict()["weight"]
                torch.manual_seed(6)
                full_x = torch.randn(S, B, K, device=DEVICE)
                full_dy = torch.randn(S, B, N, device=DEVICE) * 1e-2
                want = emulate(mode, recipe, layer, full_x, full_dy, w_full, None, high=high)
                got = step_tp(layer, mode, sp, group, full_x, full_dy, recipe)
                for key, g, w in zip(("y", "dx", "dw"), got, want):
                    tight = 1e-5 if len(high) == 3 else FP8_TIGHT
                    expect(rel(g, w.reshape(g.shape)), tight,
                           f"disable_fp8_gemm={high} {mode} sp={sp} {key}")
    tpfp8.debug.shutdown()


def check_debug_seed_case(group):
    """The seed case: column-parallel, sequence parallel, every statistic logged -- with
    current scaling and save_original_input (the seed's own), and with delayed scaling (which
    refuses save_original_input; its first step casts with the fresh scale, 1). Debugging
    changes no result; the wgrad activation statistics are of the gathered tensor (all rows)
    and equal fp64 statistics of the whole tensor's FP8 values; a sharded weight's statistics
    equal the single-device ones."""
    global checks
    torch.manual_seed(8)
    full_x = torch.randn(S, B, K, device=DEVICE)
    full_dy = torch.randn(S, B, N, device=DEVICE) * 1e-2
    x2 = full_x.reshape(-1, K)

    def make(save_orig=False):
        torch.manual_seed(9)
        return tpfp8.Linear(K, N, parallel_mode="column", tp_group=group,
                            sequence_parallel=True, save_original_input=save_orig,
                            device=DEVICE, name="seed.fc1")

    for recipe, save_orig, scale in (
            (tpfp8.CurrentScaling(), True, 448.0 / x2.abs().max()),
            (tpfp8.DelayedScaling(amax_history_len=4), False, torch.tensor(1.0))):
        what = f"seed case, {_recipe_name(recipe)}"
        tpfp8.debug.shutdown()
        plain = step_tp(make(save_orig), "column", True, group, full_x, full_dy, recipe)
        tpfp8.debug.initialize([{"layers": "seed", "features": {"log_stats": {}}}])
        debugged = step_tp(make(save_orig), "column", True, group, full_x, full_dy, recipe)
        for a, b in zip(plain, debugged):
            checks += 1
            assert torch.equal(a, b), f"{what}: debugging changed a result"
        rec = {(r["gemm"], r["tensor"]): r for r in tpfp8.debug.records()}
        act = rec[("wgrad", "activation")]
        q = tpfp8.ops.quantize(x2, scale.reshape(1).to(DEVICE), "e4m3")
        used = tpfp8.ops.dequantize(q.rowwise, q.scale_inv, "e4m3").double()
        checks += 1
        assert act["shape"] == [S * B, K], f"{what}: wgrad activation stats of {act['shape']}"
        want = {"amax": used.abs().max(), "min": used.min(), "max": used.max(),
                "mean": used.mean(), "std": used.std(unbiased=False),
                "l1_norm": used.abs().sum(), "l2_norm": used.norm()}
        for key, value in want.items():
            expect(abs(act[key] - float(value)) / max(abs(float(value)), 1e-30), 1e-6,
                   f"{what}: wgrad activation {key}")
    # Sharded weight: with fprop in high precision its statistics are the full weight's.
    tpfp8.debug.initialize([{"layers": "seed", "features": {
        "log_stats": {"tensors": ["weight"], "gemms": ["fprop"]},
        "disable_fp8_gemm": {"gemms": ["fprop"]}}}])
    layer = make(save_orig=True)
    step_tp(layer, "column", True, group, full_x, full_dy, tpfp8.CurrentScaling())
    (w_rec,) = tpfp8.debug.records()
    w = layer.full_state_dict()["weight"].double()
    checks += 1
    assert w_rec["shape"] == [N, K]
    for key, value in {"amax": w.abs().max(), "mean": w.mean(), "std": w.std(unbiased=False),
                       "l2_norm": w.norm()}.items():
        expect(abs(w_rec[key] - float(value)) / abs(float(value)), 1e-6, f"weight stats {key}")
    tpfp8.debug.shutdown()


def check_nan_step(group):
    """A NaN in one rank's shard of the input (column, sequence parallel, delayed scaling)
    is dropped on every rank alike: afterwards each rank's forward state equals that of the
    run without the bad step (MAX over a NaN is backend- and order-dependent, so NaN goes
    into the all-reduce as Inf). Also with the NaN in the gradient of a row layer."""
    recipe = tpfp8.DelayedScaling(amax_history_len=8)
    global checks
    for mode in ("column", "row"):
        states = []
        for bad in (False, True):
            torch.manual_seed(11)
            layer = tpfp8.Linear(K, N, parallel_mode=mode, tp_group=group,
                                 sequence_parallel=True, device=DEVICE)
            for step in range(4):
                torch.manual_seed(200 + step)
                full_x = torch.randn(S, B, K, device=DEVICE) * (step + 1)
                full_dy = torch.randn(S, B, N, device=DEVICE)
                if bad and step == 1:
                    step_bad = full_x if mode == "column" else full_dy
                    step_bad = step_bad.clone()
                    step_bad[-1, 0, 0] = float("nan")  # in the last rank's rows only
                    args = (step_bad, full_dy) if mode == "column" else (full_x, step_bad)
                    step_tp(layer, mode, True, group, *args, recipe)
                step_tp(layer, mode, True, group, full_x, full_dy, recipe)
            # The last backward's amax is pending (this rank's own) until an exit rolls it in.
            with torch.no_grad(), tpfp8.fp8_autocast(recipe=recipe):
                layer(local_view(mode, True, group, full_x, full_dy)[0])
            state = layer.fp8_state
            states.append({d: {k: v.clone() for k, v in state[d].items()}
                           for d in ("forward", "backward")})
        bad_dir = "forward" if mode == "column" else "backward"
        for key in ("scale", "scale_inv", "amax_history"):
            got, want = states[1][bad_dir][key], states[0][bad_dir][key]
            got = got[..., 0] if bad_dir == "forward" else got  # the input's column
            want = want[..., 0] if bad_dir == "forward" else want
            checks += 1
            assert torch.equal(got, want), f"{mode}: NaN step left a trace in {bad_dir} {key}"
            checks += 1
            assert len(set(gathered_scalars(float(got.sum())))) == 1, f"ranks differ: {key}"


def check_sharded_records_identical(group):
    """Debug records of a sharded tensor are the same on every rank: a column layer's weight
    under current scaling has a scale per rank; scale_inv reports the largest, scale_inv_min
    the smallest."""
    tpfp8.debug.initialize([{"layers": "shard", "features": {
        "log_stats": {"tensors": ["weight", "gradient"], "gemms": ["fprop", "dgrad"]}}}])
    torch.manual_seed(12)
    layer = tpfp8.Linear(K, N, parallel_mode="column", tp_group=group, device=DEVICE,
                         name="shard")
    with torch.no_grad():
        layer.weight[0, 0] = 1.0 + dist.get_rank()  # a different amax, so scale, per rank
    full_x = torch.randn(S, B, K, device=DEVICE)
    full_dy = torch.randn(S, B, N, device=DEVICE)
    step_tp(layer, "column", False, group, full_x, full_dy, tpfp8.CurrentScaling())
    records = tpfp8.debug.records()
    tpfp8.debug.shutdown()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    global checks
    checks += 1
    assert all(r == everyone[0] for r in everyone), "debug records differ between ranks"
    w = [r for r in records if r["tensor"] == "weight"][0]
    checks += 1
    several = dist.get_world_size() > 1  # (one rank: one scale)
    assert (w["scale_inv"] > w["scale_inv_min"]) == several, "per-rank scales not reported"


class _ParallelMLP(torch.nn.Module):
    """Column-parallel fc1 -> GELU -> row-parallel fc2, sequence parallel: Megatron's MLP."""

    def __init__(self, group):
        super().__init__()
        kw = {"tp_group": group, "sequence_parallel": True, "device": DEVICE}
        self.fc1 = tpfp8.Linear(K, N, parallel_mode="column", **kw)
        self.fc2 = tpfp8.Linear(N, K, parallel_mode="row", **kw)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def check_ops_with_a_group(group):
    """opcheck of the Linear's forward under sequence parallelism over this group -- column
    (the input gathered, in FP8 or, with debugging, in high precision) and row (the output
    reduce-scattered) -- so that the fake kernel's gathered and scattered shapes are checked
    against the op (test_op_registration.py checks every op without a group)."""
    from torch.library import opcheck
    global checks
    tp = dist.get_world_size()
    rows, delayed = S * B // tp, int(_C.Scaling.DELAYED)
    column, row = int(_C.ParallelMode.COLUMN), int(_C.ParallelMode.ROW)
    g = torch.Generator().manual_seed(71)
    for mode, debug in ((column, []), (column, [0, 0, 0, -1, -1, -1, -1]), (row, [])):
        k = K // tp if mode == row else K
        n = N // tp if mode == column else N
        x = torch.randn(rows * (tp if mode == row else 1), k, generator=g).to(DEVICE)
        w = torch.randn(n, k, generator=g).to(DEVICE)
        scale = torch.tensor([1.0, 2.0, 4.0], device=DEVICE)
        args = (x, w, None, scale, torch.zeros(2, 8, device=DEVICE), None, None, None, None,
                delayed, 0, 1, 0.0, 0, False, mode, True, group.group_name, debug, True, True)
        opcheck(torch.ops.tpfp8.linear_forward.default, args)  # (raises on any failure)
        checks += 1


def check_compiled_matches_eager(group):
    """torch.compile(fullgraph=True) of a sequence-parallel MLP traces with no graph break
    (the group travels by name) and equals eager bit for bit, state included, both recipes."""
    global checks
    tp, r = dist.get_world_size(), dist.get_rank()
    for recipe in (tpfp8.DelayedScaling(), tpfp8.CurrentScaling()):
        torch.manual_seed(31)
        eager = _ParallelMLP(group)
        compiled_model = copy.deepcopy(eager)
        x = torch.randn(S, B, K, device=DEVICE).chunk(tp)[r].contiguous()
        with tpfp8.fp8_autocast(recipe=recipe):
            explained = torch._dynamo.explain(copy.deepcopy(eager))(x)
        checks += 1
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
        for step in range(3):
            got, want = (_mlp_step(m, x * (step + 1), recipe) for m in (compiled, eager))
            got += [t for t in compiled_model.buffers()] + [p.grad for p in
                                                            compiled_model.parameters()]
            want += [t for t in eager.buffers()] + [p.grad for p in eager.parameters()]
            checks += 1
            assert all(torch.equal(a, b) for a, b in zip(got, want)), \
                f"{_recipe_name(recipe)} step {step}: compiled differs from eager"
        torch._dynamo.reset()


def check_fused_mlp_matches_single_rank(group):
    """LayerNormMLP(set_parallel_mode=True) -- RMSNorm (with SwiGLU) or LayerNorm (with GELU)
    on this rank's rows (sequence parallel) or on the whole input, FP8-gathered; column fc1
    (for SwiGLU holding [gate_r | up_r]); the activation; row fc2 -- against the same MLP on one
    rank: y, dx and every gradient, the norm's weight and bias gradients summed over the group.
    Without biases, fc2 hands fc1 its gradient in FP8 (the
    handoff), on each rank its own columns. Bounds as (b) in the module docstring. The same
    for tpfp8.MLP (no norm: fc1 gathers its input itself). The split MLP loads the single-rank
    one's full_state_dict (each rank its slices), and its own full_state_dict gathers it back.

    The output gradient is a fixed tensor, not a function of y: on the GPU, fc2's partial sums
    reduced across ranks move y by ~1e-4 (another summation order, 14-bit FP8 accumulation), and
    an output gradient made from y would carry that into backward's E5M2 cast, where it flips the
    rounding of an element now and then (2^-3 each: ~1e-2 in dx; the same 1e-4 nudge of the
    input does that on one rank alone). That is the loss's chain, not the layer's."""
    tp, r = dist.get_world_size(), dist.get_rank()
    recipes = (None, tpfp8.DelayedScaling(amax_history_len=4), tpfp8.CurrentScaling())
    layers = (("RMSNorm", "swiglu"), (None, "swiglu"), ("LayerNorm", "gelu"), (None, "gelu"))
    for (norm, act), sp, recipe, bias in itertools.product(layers, (False, True), recipes,
                                                            (True, False)):
        torch.manual_seed(51)
        cls = tpfp8.LayerNormMLP if norm else tpfp8.MLP
        kw = {"activation": act, "device": DEVICE, "bias": bias}
        if norm:
            kw["normalization"] = norm
        full = cls(K, N, **kw)
        split = cls(K, N, set_parallel_mode=True, tp_group=group, sequence_parallel=sp, **kw)
        if norm:
            with torch.no_grad():
                full.fc1.layer_norm_weight.uniform_(0.5, 1.5)
                if full.fc1.layer_norm_bias is not None:
                    full.fc1.layer_norm_bias.uniform_(-0.5, 0.5)
        split.load_full_state_dict(full.full_state_dict())  # (each rank its slices)
        gathered, want = split.full_state_dict(), full.full_state_dict()
        assert set(gathered) == set(want), (sorted(gathered), sorted(want))
        for key, value in want.items():
            expect(0.0 if torch.equal(gathered[key], value) else 1.0, 0.0,
                   f"{cls.__name__} {act} full_state_dict {key} gathered")
        x = torch.randn(S * B, K, device=DEVICE)
        dy = torch.randn(S * B, K, device=DEVICE)
        exact = recipe is None or (sp and isinstance(recipe, tpfp8.DelayedScaling))
        bound = FP8_TIGHT if exact else 0.15  # (the GPU's GEMMs: summation order, ~1e-4)
        what = f"{cls.__name__} {act} sp={sp} bias={bias} {_recipe_name(recipe)}"
        mine = (lambda t: t.chunk(tp)[r]) if sp else (lambda t: t)  # this rank's rows, or all
        # The input moves each step, so delayed scaling's scales do. Without a norm it shrinks:
        # grown, its products would pass the scales of the step before and saturate, which each
        # rank's own amax of its shard does differently (FP8 range, not the layer).
        for step, factor in enumerate((1.0, 2.0 if norm else 0.5)):
            want = _mlp_step(full, x * factor, recipe, enabled=recipe is not None, dy=dy)
            got = _mlp_step(split, mine(x) * factor, recipe, enabled=recipe is not None,
                            dy=mine(dy))
            if sp:
                got = [P.unshard(t.contiguous(), 0, group) for t in got]
            expect(rel(got[0], want[0]), bound, f"{what} y, step {step}")
            expect(rel(got[1], want[1]), bound, f"{what} dx, step {step}")
            pairs = ((split.fc1._unshard(split.fc1.weight.grad, 0), full.fc1.weight.grad),
                     (split.fc2._unshard(split.fc2.weight.grad, 1), full.fc2.weight.grad))
            if norm:
                pairs += ((split.fc1.layer_norm_weight.grad, full.fc1.layer_norm_weight.grad),)
            if norm == "LayerNorm":
                pairs += ((split.fc1.layer_norm_bias.grad, full.fc1.layer_norm_bias.grad),)
            if bias:
                pairs += ((split.fc1._unshard(split.fc1.bias.grad, 0), full.fc1.bias.grad),
                          (split.fc2.bias.grad, full.fc2.bias.grad))
            for i, (a, b) in enumerate(pairs):
                expect(rel(a, b), bound, f"{what} gradient {i}, step {step}")
            for p in list(full.parameters()) + list(split.parameters()):
                p.grad = None


def check_residual_mlp_matches_single_rank(group):
    """x + LayerNormMLP(x) with residual=x, set_parallel_mode=True: the row-parallel fc2 adds
    the residual after its reduction (all-reduce, or reduce-scatter to this rank's rows), and
    the column-parallel fc1's norm backward adds the output's gradient to dx (after dgrad's
    reduction, on this rank's rows under SP) -- against the same call on one rank: y, dx and
    the weights' gradients. Bounds as check_fused_mlp_matches_single_rank's."""
    tp, r = dist.get_world_size(), dist.get_rank()
    recipes = (None, tpfp8.DelayedScaling(amax_history_len=4), tpfp8.CurrentScaling())
    for sp, recipe in itertools.product((False, True), recipes):
        torch.manual_seed(53)
        kw = {"activation": "swiglu", "device": DEVICE, "bias": False, "normalization": "RMSNorm"}
        full = tpfp8.LayerNormMLP(K, N, **kw)
        split = tpfp8.LayerNormMLP(K, N, set_parallel_mode=True, tp_group=group,
                                   sequence_parallel=sp, **kw)
        for one, part in ((full.fc1, split.fc1), (full.fc2, split.fc2)):
            part.load_full_state_dict(one.full_state_dict())
        x = torch.randn(S * B, K, device=DEVICE)
        dy = torch.randn(S * B, K, device=DEVICE)
        exact = recipe is None or (sp and isinstance(recipe, tpfp8.DelayedScaling))
        bound = FP8_TIGHT if exact else 0.15
        what = f"residual MLP sp={sp} {_recipe_name(recipe)}"
        mine = (lambda t: t.chunk(tp)[r]) if sp else (lambda t: t)
        for step, factor in enumerate((1.0, 2.0)):
            want = _mlp_step(full, x * factor, recipe, recipe is not None, dy, residual=True)
            got = _mlp_step(split, mine(x) * factor, recipe, recipe is not None, mine(dy),
                            residual=True)
            if sp:
                got = [P.unshard(t.contiguous(), 0, group) for t in got]
            expect(rel(got[0], want[0]), bound, f"{what} y, step {step}")
            expect(rel(got[1], want[1]), bound, f"{what} dx, step {step}")
            pairs = ((split.fc1._unshard(split.fc1.weight.grad, 0), full.fc1.weight.grad),
                     (split.fc2._unshard(split.fc2.weight.grad, 1), full.fc2.weight.grad),
                     (split.fc1.layer_norm_weight.grad, full.fc1.layer_norm_weight.grad))
            for i, (a, b) in enumerate(pairs):
                expect(rel(a, b), bound, f"{what} gradient {i}, step {step}")
            for p in list(full.parameters()) + list(split.parameters()):
                p.grad = None


def check_norm_linear_matches_single_rank(group):
    """Column-parallel LayerNormLinear / RMSNormLinear -- the norm on this rank's rows and its
    FP8 output gathered (sequence parallel), or on the whole input -- also returning the norm
    output, against the same layer on one rank: y, the norm output, dx and every gradient; the
    norm's weight and bias gradients are summed over the group, so each rank holds the whole
    of them. Bounds as (b) in the module docstring; fixed output gradients
    (check_fused_mlp_matches_single_rank says why)."""
    tp, r = dist.get_world_size(), dist.get_rank()
    recipes = (None, tpfp8.DelayedScaling(amax_history_len=4), tpfp8.CurrentScaling())
    for norm, sp, recipe, ret in itertools.product(("LayerNorm", "RMSNorm"), (False, True),
                                                   recipes, (False, True)):
        torch.manual_seed(61)
        kw = {"normalization": norm, "return_layernorm_output": ret, "device": DEVICE}
        full = tpfp8.LayerNormLinear(K, N, **kw)
        split = tpfp8.LayerNormLinear(K, N, parallel_mode="column", tp_group=group,
                                      sequence_parallel=sp, **kw)
        with torch.no_grad():
            full.layer_norm_weight.uniform_(0.5, 1.5)
            if full.layer_norm_bias is not None:
                full.layer_norm_bias.uniform_(-0.5, 0.5)
        split.load_full_state_dict(full.full_state_dict())
        x, dy, dz = (torch.randn(S * B, n, device=DEVICE) for n in (K, N, K))
        exact = recipe is None or (sp and isinstance(recipe, tpfp8.DelayedScaling))
        bound = FP8_TIGHT if exact else 0.15
        what = f"{norm}Linear sp={sp} return_layernorm_output={ret} {_recipe_name(recipe)}"
        rows = (lambda t: t.chunk(tp)[r]) if sp else (lambda t: t)  # this rank's rows, or all

        def cols(t, dim=1):  # this rank's output features
            return t.chunk(tp, dim)[r]
        for step, factor in enumerate((1.0, 2.0)):
            want = _norm_linear_step(full, x * factor, recipe, dy, dz if ret else None)
            got = _norm_linear_step(split, rows(x) * factor, recipe, cols(dy),
                                    rows(dz) if ret else None)
            pairs = [("y", got[0], cols(want[0])), ("dx", got[1], rows(want[1])),
                     ("weight grad", split.weight.grad, cols(full.weight.grad, 0)),
                     ("bias grad", split.bias.grad, cols(full.bias.grad, 0)),
                     ("norm weight grad", split.layer_norm_weight.grad,
                      full.layer_norm_weight.grad)]
            if norm == "LayerNorm":
                pairs.append(("norm bias grad", split.layer_norm_bias.grad,
                              full.layer_norm_bias.grad))
            if ret:
                pairs.append(("norm output", got[2], rows(want[2])))
            for name, a, b in pairs:
                expect(rel(a, b), bound, f"{what} {name}, step {step}")
            for p in list(full.parameters()) + list(split.parameters()):
                p.grad = None


def _norm_linear_step(layer, x, recipe, dy, dz=None):
    """(y, dx), and the norm output where the layer returns it (its gradient dz)."""
    x = x.clone().requires_grad_(True)
    with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        out = layer(x)
    outs, grads = ([out], [dy]) if dz is None else (list(out), [dy, dz])
    torch.autograd.backward(outs, grads)
    return [outs[0].detach(), x.grad] + [t.detach() for t in outs[1:]]


def check_ddp_casts_with_rank0_state(group):
    """Under DistributedDataParallel the FP8 state is buffers, broadcast from rank 0 at every
    forward: each step's casts use the same scales on every rank, whatever each rank's data."""
    torch.manual_seed(41)
    model = torch.nn.Sequential(tpfp8.Linear(K, N, device=DEVICE), torch.nn.GELU(),
                                tpfp8.Linear(N, K, device=DEVICE))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    seen = []  # the state as the first layer's forward finds it (after DDP's broadcast)
    model[0].register_forward_pre_hook(
        lambda layer, args: seen.append([b.clone() for b in layer.buffers()]))
    torch.manual_seed(300 + dist.get_rank())  # each rank its own data
    for _ in range(3):
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=8)):
            loss = ddp(torch.randn(S, K, device=DEVICE)).square().mean()
        loss.backward()
    global checks
    for step, state in enumerate(seen):
        for buffer in state:
            checks += 1
            assert len(set(gathered_scalars(float(buffer.double().sum())))) == 1, \
                f"DDP ranks cast with different state at step {step}"
    checks += 1
    assert float(seen[-1][2].sum()) > 0, "no amax recorded: the check saw no state"


def _mlp_step(model, x, recipe, enabled=True, dy=None, residual=False):
    """(y, dx) of one step; the output gradient dy, or 2y (of y.square().sum()) without one;
    with `residual`, y = x + model(x) (residual=x)."""
    x = x.clone().requires_grad_(True)
    with tpfp8.fp8_autocast(enabled=enabled, recipe=recipe):
        y = model(x, residual=x) if residual else model(x)
    y.backward(2 * y.detach() if dy is None else dy)
    return [y.detach(), x.grad]


def _recipe_name(recipe) -> str:
    return "high precision" if recipe is None else type(recipe).__name__


def _cases():
    """Every check of a run, in the order the ranks run them: (name, function of the group)."""
    cases = [(fn.__name__.removeprefix("check_"), fn) for fn in (
        check_errors, check_fp8_gather, check_quantize_after_gather, check_debug_seed_case,
        check_debug_keeps_bias_grad,
        check_debug_disable_fp8_gemm, check_deepcopy, check_checkpoint, check_nan_step,
        check_sharded_records_identical, check_double_backward_refused,
        check_parallel_arguments_refused,
        check_ops_with_a_group, check_compiled_matches_eager, check_fused_mlp_matches_single_rank,
        check_residual_mlp_matches_single_rank, check_norm_linear_matches_single_rank,
        check_ddp_casts_with_rank0_state)]
    recipes = [None, tpfp8.DelayedScaling(amax_history_len=4), tpfp8.CurrentScaling()]
    for mode, sp, recipe, save_orig, bias in itertools.product(
            ("column", "row"), (False, True), recipes, (False, True), (True, False)):
        if save_orig and isinstance(recipe, tpfp8.DelayedScaling):
            continue  # refused by design (the scale moves between forward and backward)
        name = f"{mode} sp={sp} {_recipe_name(recipe)} save_original_input={save_orig} bias={bias}"
        cases.append((name, lambda g, a=(mode, sp, recipe, save_orig, bias): run_config(*a, g)))
    for mode, sp, recipe in itertools.product(("column", "row"), (False, True), recipes):
        cases.append((f"{mode} sp={sp} {_recipe_name(recipe)} bf16", lambda g, a=(
            mode, sp, recipe): run_config(*a, False, True, g, dtype=torch.bfloat16, steps=1)))
    return cases


CASE_NAMES = [name for name, _ in _cases()]


def _record(path, results) -> None:
    """This rank's results so far (TP_RESULTS: pytest reports each case on its own)."""
    if path:
        with open(f"{path}.rank{dist.get_rank()}", "w") as f:
            json.dump(results, f)


def main():
    backend = os.environ.get("TP_BACKEND", "gloo")
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(list(range(dist.get_world_size())))
    path, results = os.environ.get("TP_RESULTS"), {}
    for name, case in _cases():
        try:
            case(group)
        except Exception as e:  # recorded, then fatal: the ranks' collectives are out of step
            results[name] = f"failed on rank {dist.get_rank()}: {type(e).__name__}: {e}"
            _record(path, results)
            raise
        results[name] = "passed"
        _record(path, results)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"TP OK {checks} checks on {dist.get_world_size()} ranks ({backend}, {DEVICE})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
