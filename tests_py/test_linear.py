"""tpfp8.Linear on one device: against nn.Linear outside FP8, against an independent float64
emulation of the FP8 casts inside it, delayed-scaling bookkeeping, caches, errors, training."""
import copy
import dataclasses
import io

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import tpfp8
from conftest import capture_step, fp8_tight, make, requires_gpu, state_of
from fp8_oracle import current_scale, fake_quant, pending_scale

RECIPES = {"delayed": tpfp8.DelayedScaling, "current": tpfp8.CurrentScaling}


def fwd_state(lin):
    """The layer's forward delayed-scaling state (scale, scale_inv, amax_history)."""
    return lin.fp8_state["forward"]


def bwd_state(lin):
    """The layer's backward (output gradient) delayed-scaling state."""
    return lin.fp8_state["backward"]


def rel(a, b):
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).norm() / b.norm())


def run(module, x, dy, ctx=None, **kw):
    """Forward + backward; returns (y, dx, dW, db) as detached copies."""
    x = x.detach().clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    if ctx is None:
        y = module(x, **kw)
    else:
        with ctx:
            y = module(x, **kw)
    y.backward(dy)
    db = module.bias.grad.clone() if module.bias is not None else None
    return y.detach(), x.grad.clone(), module.weight.grad.clone(), db


# ---- outside fp8_autocast: exactly nn.Linear ------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_matches_nn_linear_fp32(bias):
    lin, ref = make(bias=bias)
    x, dy = torch.randn(3, 7, 32), torch.randn(3, 7, 48)
    for got, want in zip(run(lin, x, dy), run(ref, x, dy)):
        if want is not None:
            assert rel(got, want) <= 1e-6


def test_matches_nn_linear_bf16_within_rounding():
    lin, ref = make()
    lin, ref = lin.bfloat16(), ref.bfloat16()
    x, dy = torch.randn(33, 32).bfloat16(), torch.randn(33, 48).bfloat16()
    for got, want in zip(run(lin, x, dy), run(ref, x, dy)):
        assert rel(got, want) <= 2 ** -7  # one bf16 rounding of the output each side


def test_follows_torch_autocast():
    lin, ref = make()
    x, dy = torch.randn(16, 32), torch.randn(16, 48).bfloat16()
    def ctx():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    got, want = run(lin, x, dy, ctx()), run(ref, x, dy, ctx())
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    for g, w in zip(got, want):
        assert rel(g, w) <= 2 ** -7


# ---- inside fp8_autocast: an independent float64 emulation -----------------------------

def emulate(x, w, b, dy, sx, sw, sdy, fwd, grad):
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    qx, qw, qdy = fake_quant(x2, sx, fwd), fake_quant(w, sw, fwd), fake_quant(dy2, sdy, grad)
    y = qx @ qw.T + (b.detach().double() if b is not None else 0)
    db = dy2.double().sum(0) if b is not None else None
    return (y.reshape(*x.shape[:-1], -1), (qdy @ qw).reshape(x.shape), qdy.T @ qx, db)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_matches_float64_emulation(device, recipe_name, fmt, bias):
    lin = make(bias=bias, seed=3)[0].to(device)
    recipe = RECIPES[recipe_name](fp8_format=fmt)
    fwd, grad = "e4m3", ("e5m2" if fmt == "hybrid" else "e4m3")
    w = lin.weight.detach().cpu()
    b = lin.bias.detach().cpu() if bias else None
    for step in range(3):  # delayed scaling: scales from earlier steps, not 1
        x, dy = torch.randn(2, 9, 32), torch.randn(2, 9, 48) * 1e-3
        if recipe_name == "delayed":  # the scales the step will use (1 before the first)
            sx, sw = (float(v) for v in fwd_state(lin)["scale"]) if lin.fp8_state else (1.0, 1.0)
            sdy = float(pending_scale(bwd_state(lin), grad)) if lin.fp8_state else 1.0
        else:
            sx, sw, sdy = current_scale(x, fwd), current_scale(w, fwd), current_scale(dy, grad)
        got = [g if g is None else g.cpu()
               for g in run(lin, x.to(device), dy.to(device), tpfp8.fp8_autocast(recipe=recipe))]
        want = emulate(x, w, b, dy, sx, sw, sdy, fwd, grad)
        exact = x.double() @ w.double().T
        for g, wnt in zip(got, want):
            if wnt is not None:
                assert rel(g, wnt) <= fp8_tight(device)
        if recipe_name == "current" or step > 0:  # delayed: scale 1 until the first update
            assert rel(got[0] - (b if bias else 0), exact) <= 0.1  # gross errors


def test_fp8_bf16_activations_within_output_rounding():
    lin, _ = make(seed=4)  # fp32 weights (the master copy), bf16 activations
    x, dy = torch.randn(32, 32).bfloat16(), torch.randn(32, 48).bfloat16()
    got = run(lin, x, dy, tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()))
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    want = emulate(x.float(), lin.weight, lin.bias, dy.float(), current_scale(x, "e4m3"),
                   current_scale(lin.weight, "e4m3"), current_scale(dy, "e5m2"), "e4m3", "e5m2")
    # y: bf16 rounding of the bias (fused in the epilogue) and of the output; dx: of the output
    for g, w, tol in zip(got, want, (2 ** -7, 2 ** -8, 1e-5, 1e-6)):
        assert rel(g, w) <= tol


def test_delayed_scaling_history_and_scale_follow_the_formula():
    lin, _ = make(seed=5)
    recipe = tpfp8.DelayedScaling(amax_history_len=4, margin=1)
    amaxes = []
    for step in range(6):
        x = torch.randn(16, 32) * (10.0 ** (step % 3 - 1))
        amaxes.append(float(x.abs().max()))
        with tpfp8.fp8_autocast(recipe=recipe):
            lin(x)
        hist = fwd_state(lin)["amax_history"][:, 0]
        window = amaxes[-4:]
        want_hist = [0.0] + list(reversed(window))[: 3]
        assert hist.tolist() == pytest.approx(want_hist + [0.0] * (4 - len(want_hist)), rel=0)
        want_scale = np.float32(448.0) / np.float32(max(window)) * np.float32(0.5)
        assert float(fwd_state(lin)["scale"][0]) == want_scale
        assert float(fwd_state(lin)["scale_inv"][0]) == np.float32(1.0) / want_scale


def test_backward_amax_is_applied_at_the_next_fp8_autocast_exit():
    # One update mechanism for both directions: backward folds its amax into the pending
    # row; the next step's fp8_autocast exit rolls it in, before that step's backward.
    lin, _ = make(seed=6)
    x, dy = torch.randn(16, 32), torch.randn(16, 48) * 3
    recipe = tpfp8.DelayedScaling()
    run(lin, x, dy, tpfp8.fp8_autocast(recipe=recipe))
    amax = np.float32(dy.abs().max())
    assert float(bwd_state(lin)["amax_history"][0, 0]) == amax
    assert float(bwd_state(lin)["scale"][0]) == 1.0
    with tpfp8.fp8_autocast(recipe=recipe):
        lin(x)
    assert float(bwd_state(lin)["scale"][0]) == np.float32(57344.0) / amax
    assert float(bwd_state(lin)["amax_history"][0, 0]) == 0.0
    assert float(bwd_state(lin)["amax_history"][1, 0]) == amax


def test_a_layer_an_inner_block_ran_under_another_recipe_is_updated_by_that_one():
    """The outer block's exit updates a layer that an inner fp8_autocast block switched to its
    own recipe (another history length and format) by the inner recipe, not the outer."""
    outer = tpfp8.DelayedScaling(amax_history_len=16)  # (hybrid: E5M2 gradients)
    inner = tpfp8.DelayedScaling(fp8_format="e4m3", amax_history_len=4)
    a, b = make(seed=8)[0], make(seed=9)[0]
    x, dy = torch.randn(16, 32), torch.randn(16, 48) * 3
    with tpfp8.fp8_autocast(recipe=outer):
        a(x)
        b(x)
        with tpfp8.fp8_autocast(recipe=inner):
            y = b(x)
        y.backward(dy)
    assert a.fp8_state["recipe"] == outer and b.fp8_state["recipe"] == inner
    assert b.fp8_amax_history.shape == (2, 4) and a.fp8_amax_history.shape == (2, 16)
    amax = np.float32(dy.abs().max())
    assert float(bwd_state(b)["amax_history"][1, 0]) == amax
    assert float(bwd_state(b)["scale"][0]) == np.float32(448.0) / amax


def test_a_layer_run_in_nested_blocks_is_updated_once_at_the_outer_exit():
    """A layer run in an fp8_autocast block and in one nested in it is updated once a step,
    at the outermost exit, as if both calls ran in one block (the inner exit used to update it
    too: an empty history row, and a checkpointed call's recompute then refused)."""
    recipe = tpfp8.DelayedScaling(amax_history_len=4)
    nested, flat = make(seed=8)[0], make(seed=8)[0]
    for _ in range(2):
        x = torch.randn(16, 32)
        with tpfp8.fp8_autocast(recipe=recipe):
            h = nested(x)[:, :32]
            with tpfp8.fp8_autocast(recipe=recipe):
                y = nested(h)
        y.sum().backward()
        with tpfp8.fp8_autocast(recipe=recipe):
            y = flat(flat(x)[:, :32])
        y.sum().backward()
        for a, b in zip(state_of(nested), state_of(flat), strict=True):
            assert torch.equal(a, b)
    x = torch.randn(16, 32, requires_grad=True)
    with tpfp8.fp8_autocast(recipe=recipe):
        h = torch.utils.checkpoint.checkpoint(nested, x, use_reentrant=False)[:, :32]
        with tpfp8.fp8_autocast(recipe=recipe):
            y = nested(h)
    y.sum().backward()
    assert x.grad is not None


def test_save_original_input_is_bit_identical_with_current_scaling():
    x, dy = torch.randn(4, 16, 32), torch.randn(4, 16, 48)
    def ctx():
        return tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling())
    plain = run(make(seed=7)[0], x, dy, ctx())
    saved = run(make(seed=7, save_original_input=True)[0], x, dy, ctx())
    for a, b in zip(plain, saved):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", [tpfp8.DelayedScaling(), tpfp8.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_bias_grad_is_the_column_sum_fused_into_the_gradient_cast(device, recipe):
    """In FP8, db comes out of dy's cast: its fixed-order column sums, the same bytes on every
    run and device (the CPU op's)."""
    lin = make(seed=21)[0].to(device)
    x, dy = torch.randn(3, 50, 32), torch.randn(3, 50, 48)
    got = run(lin, x.to(device), dy.to(device), tpfp8.fp8_autocast(recipe=recipe))[3]
    want = torch.empty(48)
    tpfp8.ops.cast_transpose(dy.reshape(-1, 48), torch.ones(1), "e5m2", dbias=want)
    assert torch.equal(got.cpu(), want)


def test_wgrad_pads_token_count_internally():
    lin, _ = make(seed=8)
    x, dy = torch.randn(13, 32), torch.randn(13, 48)  # 13 tokens: not a multiple of 16
    got = run(lin, x, dy, tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()))
    want = emulate(x, lin.weight, lin.bias, dy, current_scale(x, "e4m3"),
                   current_scale(lin.weight, "e4m3"), current_scale(dy, "e5m2"), "e4m3", "e5m2")
    assert rel(got[2], want[2]) <= 1e-5


def test_weight_cache_matches_uncached():
    lin, _ = make(seed=9)
    def ctx():
        return tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling())
    xs = [torch.randn(16, 32) for _ in range(3)]
    dy = torch.randn(16, 48)
    plain = [run(lin, x, dy, ctx()) for x in xs]
    cached = [run(lin, x, dy, ctx(), is_first_microbatch=(i == 0)) for i, x in enumerate(xs)]
    for a, b in zip(plain, cached):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_main_grad_accumulates_over_microbatches():
    lin, _ = make(seed=10, fuse_wgrad_accumulation=True)
    def ctx():
        return tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling())
    plain, _ = make(seed=10)
    total = torch.zeros_like(lin.weight)
    for i in range(4):
        x, dy = torch.randn(16, 32), torch.randn(16, 48)
        xg = x.clone().requires_grad_(True)
        with ctx():
            y = lin(xg, is_first_microbatch=(i == 0))
        y.backward(dy)
        assert lin.weight.grad is None
        total += run(plain, x, dy, ctx(), is_first_microbatch=(i == 0))[2]
    assert rel(lin.weight.main_grad, total) <= 1e-6


@pytest.mark.parametrize("recipe", [None, tpfp8.DelayedScaling(), tpfp8.CurrentScaling()])
def test_a_backward_asking_for_the_input_alone_leaves_main_grad(recipe):
    """torch.autograd.grad(loss, x) (or backward(inputs=[x])) leaves main_grad as it was, as
    nn.Linear leaves weight.grad (it used to run the weight-gradient GEMM into main_grad
    anyway), and x's gradient is the full backward's."""
    lin = make(seed=10, fuse_wgrad_accumulation=True)[0]
    x, dy = torch.randn(16, 32, requires_grad=True), torch.randn(16, 48)
    for first in (True, False):
        with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = lin(x, is_first_microbatch=first)
        before = lin.weight.main_grad.clone()
        (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
        assert torch.equal(lin.weight.main_grad, before)
        y.backward(dy, inputs=[x], retain_graph=True)
        assert torch.equal(lin.weight.main_grad, before)
        y.backward(dy)
        assert torch.equal(x.grad, 2 * dx)
        x.grad = None


def test_fp8_state_is_float32_under_any_default_dtype():
    """Hugging Face builds a bf16 model under torch.set_default_dtype(bf16): a layer made
    there keeps its FP8 state and weight cache in float32 (the kernels' dtype) and trains (its
    state used to take the default dtype, and the first FP8 call raised)."""
    for default in (torch.bfloat16, torch.float64):
        torch.set_default_dtype(default)
        try:
            lin = tpfp8.Linear(32, 16, dtype=torch.bfloat16)
            for recipe in (tpfp8.DelayedScaling(), tpfp8.CurrentScaling()):
                with tpfp8.fp8_autocast(recipe=recipe):
                    lin(torch.randn(8, 32, dtype=torch.bfloat16), is_first_microbatch=True)
        finally:
            torch.set_default_dtype(torch.float32)
        assert {t.dtype for t in lin.buffers()} == {torch.float32, torch.uint8}, default
        assert lin.get_extra_state().dtype == torch.float32


def test_a_replaced_main_grad_receives_the_next_gradient():
    """Nothing about a call is cached between calls: a main_grad the user replaced (an
    optimizer's new bucket) receives the next gradient, the old one keeps its own."""
    lin, _ = make(seed=12, fuse_wgrad_accumulation=True)
    x, dy = torch.randn(16, 32), torch.randn(16, 48)

    def step(**kw):
        with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
            y = lin(x, **kw)
        y.backward(dy)

    step()
    step()
    old = lin.weight.main_grad
    lin.weight.main_grad = torch.zeros_like(old)
    step()
    assert torch.equal(lin.weight.main_grad * 2, old)  # one gradient here, two in the old one
    step(is_first_microbatch=True)  # overwrites
    assert torch.equal(lin.weight.main_grad * 2, old)


def test_module_cast_keeps_fp8_state_and_drops_weight_cache():
    """.to()/.half()/.cuda() carry the delayed-scaling state along, in fp32, and drop the FP8
    weight cache (made from the parameters as they were before)."""
    lin, _ = make(seed=13)
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    for _ in range(3):
        run(lin, x, dy, tpfp8.fp8_autocast(), is_first_microbatch=True)
    before = state_of(lin)
    lin.to(torch.bfloat16)
    assert fwd_state(lin)["scale"].dtype == bwd_state(lin)["amax_history"].dtype == torch.float32
    for a, b in zip(before, state_of(lin)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="is_first_microbatch=True"):
        with tpfp8.fp8_autocast():
            lin(x.bfloat16(), is_first_microbatch=False)
    with tpfp8.fp8_autocast():
        lin(x.bfloat16(), is_first_microbatch=True)  # refills it
        lin(x.bfloat16(), is_first_microbatch=False)


def test_deepcopy_and_pickle_after_fp8_steps():
    """copy.deepcopy (EMA copies, AveragedModel) and torch.save of the whole module work after
    FP8 steps; a copy owns its state and steps from it exactly as the original does."""
    lin, _ = make(seed=16)
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    for _ in range(2):
        run(lin, x, dy, tpfp8.fp8_autocast())
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    before = state_of(lin)
    for twin in (copy.deepcopy(lin), torch.load(buf, weights_only=False)):
        own, other = fwd_state(twin)["amax_history"], fwd_state(lin)["amax_history"]
        assert own.data_ptr() != other.data_ptr()
        for a, b in zip(before, state_of(twin)):
            assert torch.equal(a, b)
        got = run(twin, x, dy, tpfp8.fp8_autocast())
        assert all(torch.equal(a, b) for a, b in zip(before, state_of(lin)))  # not the original
        assert not all(torch.equal(a, b) for a, b in zip(before, state_of(twin)))
        twin_state = state_of(twin)
    want = run(lin, x, dy, tpfp8.fp8_autocast())
    for u, v in zip(want, got):
        assert torch.equal(u, v)
    for a, b in zip(state_of(lin), twin_state):
        assert torch.equal(a, b)


def test_state_dict_loads_with_weights_only():
    """A checkpoint of the FP8 state holds tensors and plain values: torch.load's default
    (weights_only=True) reads it, and the state comes back exactly."""
    lin, _ = make(seed=19)
    recipe = tpfp8.DelayedScaling(margin=1, amax_history_len=8, amax_compute_algo="most_recent")
    for _ in range(3):
        run(lin, torch.randn(16, 32), torch.randn(16, 48), tpfp8.fp8_autocast(recipe=recipe))
    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    fresh, _ = make(seed=20)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.fp8_state["recipe"] == recipe
    for a, b in zip(state_of(lin), state_of(fresh)):
        assert torch.equal(a, b)
    # Checkpoints written before the tensor layout: a dict, its recipe a dict or (older still)
    # the DelayedScaling itself.
    for saved_recipe in (dataclasses.asdict(recipe), recipe):
        old_style = lin.state_dict()
        old_style["_extra_state"] = {d: lin.fp8_state[d] for d in ("forward", "backward")}
        old_style["_extra_state"]["recipe"] = saved_recipe
        fresh, _ = make(seed=20)
        fresh.load_state_dict(old_style)
        assert fresh.fp8_state["recipe"] == recipe
        for a, b in zip(state_of(lin), state_of(fresh)):
            assert torch.equal(a, b)


def test_module_move_keeps_weight_cache_when_nothing_changed_and_moves_main_grad():
    """A .to() that changes nothing keeps the FP8 weight cache; a move takes main_grad along,
    as nn.Module does .grad."""
    lin, _ = make(seed=18, fuse_wgrad_accumulation=True)
    x = torch.randn(16, 32)
    with tpfp8.fp8_autocast():
        lin(x, is_first_microbatch=True).sum().backward()
    lin.to("cpu")  # the same device and dtype: nothing was made from other parameters
    with tpfp8.fp8_autocast():
        lin(x, is_first_microbatch=False)
    lin.to("meta")  # another device (the only other one a CPU has): new Parameter objects
    assert lin.weight.main_grad.device.type == fwd_state(lin)["scale"].device.type == "meta"
    assert lin.weight.main_grad.dtype == torch.float32
    with tpfp8.fp8_autocast(), pytest.raises(ValueError, match="is_first_microbatch=True"):
        lin(x.to("meta"), is_first_microbatch=False)  # the cache went with the old parameters
    plain, _ = make(seed=18)
    plain.to("meta")  # no main_grad: none appears
    assert getattr(plain.weight, "main_grad", None) is None


def test_a_failed_move_leaves_the_fp8_state_where_it_was():
    """A .to() that raises (no such device here; out of memory on a GPU) keeps the layer's FP8
    state and weight cache: the next step and state_dict() are as if it was never called (the
    state was left None before, and every later call failed)."""
    lin, _ = make(seed=19)
    twin, _ = make(seed=19)
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    for layer in (lin, twin):
        run(layer, x, dy, tpfp8.fp8_autocast())
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    with pytest.raises((RuntimeError, AssertionError)):
        lin.to("cuda:99")
    after = lin.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for layer in (lin, twin):
        run(layer, x, dy, tpfp8.fp8_autocast())
    for a, b in zip(state_of(lin), state_of(twin)):
        assert torch.equal(a, b)


@requires_gpu
def test_fp8_state_loaded_on_cpu_follows_module_to_gpu():
    """load_state_dict on the CPU, then .cuda(): the loaded scales and histories are used and
    updated on the GPU (they were silently reset before), step for step as on the CPU."""
    src, _ = make(seed=14)
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    for _ in range(3):
        run(src, x, dy, tpfp8.fp8_autocast())
    dst, _ = make(seed=15)
    dst.load_state_dict(src.state_dict())
    dst.cuda()
    for a, b in zip(state_of(src), state_of(dst)):
        assert b.is_cuda and torch.equal(a, b.cpu())
    for _ in range(2):
        run(src, x, dy, tpfp8.fp8_autocast())
        run(dst, x.cuda(), dy.cuda(), tpfp8.fp8_autocast())
    for a, b in zip(state_of(src), state_of(dst)):
        assert torch.equal(a, b.cpu())


def check_no_tokens(device, recipe):
    """Zero tokens, as nn.Linear takes them: empty outputs and dx, zero dW and db, main_grad
    overwritten with zeros or left as it is, delayed-scaling state still finite."""
    lin, ref = make(seed=17)
    fused, _ = make(seed=17, fuse_wgrad_accumulation=True)
    lin, ref, fused = lin.to(device), ref.to(device), fused.to(device)
    for shape in [(0, 32), (3, 0, 32)]:
        x = torch.randn(*shape, device=device)
        ctx = tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe)
        got = run(lin, x, torch.randn(*shape[:-1], 48, device=device), ctx)
        want = run(ref, x, torch.randn(*shape[:-1], 48, device=device))
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w)
        for first, value in ((True, 0.0), (False, 1.0)):
            fused.weight.main_grad = torch.ones(48, 32, device=device)
            with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
                y = fused(x.clone().requires_grad_(True), is_first_microbatch=first)
            y.sum().backward()
            assert torch.equal(fused.weight.main_grad, torch.full_like(fused.weight, value))
    state = lin.fp8_state
    assert state is None or all(bool(torch.isfinite(state[d]["scale"]).all())
                                for d in ("forward", "backward"))


@pytest.mark.parametrize("recipe", [None, tpfp8.DelayedScaling(), tpfp8.CurrentScaling()],
                         ids=["high precision", "delayed", "current"])
def test_no_tokens(device, recipe):
    check_no_tokens(device, recipe)


def test_swap_linear_and_state_dict():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 32)
    want = model(x)
    tpfp8.swap_linear(model, filter_fn=lambda m, name: name != "2")
    assert isinstance(model[0], tpfp8.Linear) and type(model[2]) is nn.Linear
    assert rel(model(x).detach(), want.detach()) <= 1e-6
    fresh = tpfp8.Linear(32, 64)
    fresh.load_state_dict(nn.Linear(32, 64).state_dict())  # plain checkpoints load


def test_swap_linear_keeps_the_hooks_of_what_it_replaces():
    """Forward, pre-forward and backward hooks on a swapped nn.Linear keep running (they were
    dropped, silently changing a hooked model's output), and their handles still remove them;
    a forward replaced on the instance (accelerate's hooks) is not kept, with a warning."""
    model = nn.Sequential(nn.Linear(32, 16))
    seen = []
    handles = [model[0].register_forward_hook(lambda m, i, o: o * 2),
               model[0].register_forward_pre_hook(lambda m, i: seen.append("pre")),
               model[0].register_full_backward_hook(lambda m, gi, go: seen.append("bwd"))]
    x = torch.randn(4, 32, requires_grad=True)
    want = model(x)
    old = model[0]
    tpfp8.swap_linear(model)
    assert not old._forward_hooks and not old._forward_pre_hooks  # (moved, not shared)
    y = model(x)
    y.sum().backward()
    torch.testing.assert_close(y, want)  # (tpfp8's GEMM: rounded apart from torch's)
    assert seen == ["pre", "pre", "bwd"]
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(model(x), want / 2)
    assert seen == ["pre", "pre", "bwd"]
    patched = nn.Linear(32, 16)
    patched.forward = lambda t: t
    with pytest.warns(UserWarning, match="forward replaced on the instance"):
        tpfp8.swap_linear(nn.Sequential(patched))


def test_swap_linear_keeps_a_tied_layer_one_layer_and_the_training_mode():
    """A Linear at two places (tied) becomes one tpfp8.Linear at both, with one FP8 state (it
    became two layers sharing the parameters, each scaling alone); eval mode stays eval."""
    torch.manual_seed(13)
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.GELU(), shared, nn.Linear(32, 16)).eval()
    tpfp8.swap_linear(model)
    assert isinstance(model[0], tpfp8.Linear) and model[0] is model[2]
    assert model[0].name == "0" and not model[0].training and not model[3].training
    assert len([m for m in model.modules() if isinstance(m, tpfp8.Linear)]) == 2
    model = nn.Sequential(shared, shared)
    tpfp8.swap_linear(model, filter_fn=lambda m, name: name != "0")  # refused at its first place
    assert model[0] is model[1] is shared


@pytest.mark.parametrize("state, message", [
    ({"weight": torch.ones(32), "bias": torch.ones(1)}, r"weight has shape \(32,\)"),
    ({"weight": torch.ones(48, 32), "bias": torch.ones(47)}, r"bias has shape \(47,\)"),
    ({"weight": torch.ones(48, 32)}, "the layer has a bias, the state none"),
    ({"weight": torch.ones(48, 32), "bias": torch.ones(48), "layer_norm_weight": torch.ones(31)},
     "layer_norm_weight has shape"),
    ({"wieght": torch.ones(48, 32), "bias": torch.ones(48)}, r"unknown keys \['wieght'\]"),
    ({"weight": torch.ones(48, 32), "bias": torch.ones(48), "_extra_state": b""},
     "the FP8 state is no part of a full state dict"),
    ({"weight": torch.ones(48, 32, device="meta"), "bias": torch.ones(48)}, "a meta tensor"),
])
def test_load_full_state_dict_checks_every_key_and_shape_before_copying(state, message):
    """A wrong shape was broadcast into the parameter, or failed after the weight was copied;
    a missing bias kept the old one; a misspelt key was ignored."""
    layer = tpfp8.LayerNormLinear(32, 48)
    before = {k: t.clone() for k, t in layer.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        layer.load_full_state_dict(state)
    assert all(torch.equal(t, before[k]) for k, t in layer.state_dict().items())
    layer.load_full_state_dict(layer.full_state_dict())  # (its own round trip)


def test_rms_norm_linear_refuses_a_layer_norm_bias_in_a_full_state_dict():
    layer = tpfp8.RMSNormLinear(32, 48)
    state = {**layer.full_state_dict(), "layer_norm_bias": torch.zeros(32)}
    with pytest.raises(ValueError, match=r"has no layer_norm_bias \(RMSNorm\), the state has"):
        layer.load_full_state_dict(state)


def test_sequence_helpers_without_a_group_return_their_input():
    """group=None is no tensor parallelism for every helper (split_sequence's was; gathering
    called the default group's collective)."""
    x = torch.randn(4, 3)
    for gathered in (tpfp8.parallel.gather_sequence(x, None), tpfp8.parallel.unshard(x, 0, None),
                     tpfp8.parallel.split_sequence(x, None)):
        assert torch.equal(gathered, x)


def test_is_an_nn_linear_and_swap_leaves_it_alone():
    lin = tpfp8.Linear(32, 16, bias=False)
    assert isinstance(lin, nn.Linear) and (lin.in_features, lin.out_features) == (32, 16)
    assert lin.bias is None and lin.weight.shape == (16, 32)
    model = nn.Sequential(lin)
    assert tpfp8.swap_linear(model)[0] is lin  # already tpfp8: not wrapped again


def test_peft_lora_wraps_and_trains_a_swapped_model():
    peft = pytest.importorskip("peft", reason="peft not installed")
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    tpfp8.swap_linear(model)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    base = lora.base_model.model
    assert isinstance(base[0].base_layer, tpfp8.Linear)
    frozen = base[0].base_layer.weight.detach().clone()
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(trainable, lr=0.1)
    x, target = torch.randn(64, 32), torch.randn(64, 16)
    losses = []
    for _ in range(5):
        with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
            loss = nn.functional.mse_loss(lora(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert torch.equal(base[0].base_layer.weight, frozen)  # the FP8 base layer stays frozen


# ---- errors leave the state untouched --------------------------------------------------

@pytest.mark.parametrize("call,message", [
    (lambda lin: lin(torch.randn(4, 31)), r"in_features=32"),
    (lambda lin: lin(torch.randint(0, 3, (4, 32))), "float32, bfloat16 or float16"),
    (lambda lin: lin(torch.randn(4, 32, device="meta")), "is on meta"),
    (lambda lin: lin(torch.randn(4, 32).double()), "float32, bfloat16 or float16"),
    (lambda lin: lin(torch.randn(4, 32), is_first_microbatch=False), "is_first_microbatch=True"),
])
def test_bad_input_raises_and_keeps_state(call, message):
    lin, _ = make(seed=12)
    with tpfp8.fp8_autocast():
        lin(torch.randn(4, 32))  # make delayed-scaling state
    before = state_of(lin)
    with pytest.raises(ValueError, match=message):
        with tpfp8.fp8_autocast():
            call(lin)
    for a, b in zip(before, state_of(lin)):
        assert torch.equal(a, b)


def test_fp8_rejects_unaligned_features_and_delayed_save_original():
    lin = tpfp8.Linear(24, 48)
    lin(torch.randn(2, 24))  # fine outside FP8
    with pytest.raises(ValueError, match="multiples of 16, got 24"):
        with tpfp8.fp8_autocast():
            lin(torch.randn(2, 24))
    lin2 = tpfp8.Linear(32, 48, save_original_input=True)
    with pytest.raises(ValueError, match="cannot be used with delayed scaling"):
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling()):
            lin2(torch.randn(2, 32))


@pytest.mark.parametrize("make_recipe,message", [
    (lambda: tpfp8.DelayedScaling(margin=0.5), "margin"),
    (lambda: tpfp8.DelayedScaling(fp8_format="e5m2"), "fp8_format"),
    (lambda: tpfp8.DelayedScaling(amax_history_len=0), "amax_history_len"),
    (lambda: tpfp8.DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
    (lambda: tpfp8.CurrentScaling(amax_epsilon=-1.0), "amax_epsilon"),
])
def test_invalid_recipes(make_recipe, message):
    with pytest.raises(ValueError, match=message):
        make_recipe()


# ---- training parity -----------------------------------------------------------------

def train(recipe, steps=300, seed=0):
    """3-layer MLP on labels from a fixed random teacher; mean loss of the last 20 steps."""
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    model = tpfp8.swap_linear(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64),
                                            nn.GELU(), nn.Linear(64, 16)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32)
        with torch.no_grad():
            labels = teacher(x).argmax(-1)
        if recipe is None:
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                logits = model(x)
        else:
            with tpfp8.fp8_autocast(recipe=recipe):
                logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return float(np.mean(losses[-20:])), losses[0]


@pytest.mark.parametrize("recipe", [tpfp8.DelayedScaling(amax_history_len=16),
                                    tpfp8.CurrentScaling()], ids=["delayed", "current"])
def test_training_parity_with_bf16(device, recipe):
    with torch.device(device):
        bf16_final, first = train(None)
        fp8_final, _ = train(recipe)
    assert bf16_final < 0.5 * first  # it learned
    assert abs(fp8_final - bf16_final) <= 0.03 * bf16_final


# ---- GPU only --------------------------------------------------------------------------

def _step(lin, x, dy, recipe):
    with tpfp8.fp8_autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    return y


@requires_gpu
@pytest.mark.parametrize("recipe", [tpfp8.DelayedScaling(amax_history_len=8),
                                    tpfp8.CurrentScaling()], ids=["delayed", "current"])
def test_gpu_forward_backward_never_syncs(recipe):
    lin = make(k=256, n=512, seed=14)[0].cuda()
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    dy = torch.randn(64, 512, device="cuda")
    _step(lin, x, dy, recipe)  # warm-up: GEMM plans and workspaces are made here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _step(lin, x, dy, recipe)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_gpu
def test_gpu_cuda_graph_capture_with_delayed_scaling():
    recipe = tpfp8.DelayedScaling(amax_history_len=8)
    graphed, eager = make(k=256, n=512, seed=15)[0].cuda(), make(k=256, n=512, seed=15)[0].cuda()
    xs = [torch.randn(64, 256, device="cuda") for _ in range(4)]
    dy = torch.randn(64, 512, device="cuda")
    static_x = torch.zeros(64, 256, device="cuda", requires_grad=True)
    graph, static_y = capture_step(
        lambda: _step(graphed, static_x, dy, recipe),
        lambda: _step(eager, static_x.detach().clone().requires_grad_(), dy, recipe),
        [graphed.weight, static_x])
    for x in xs:
        static_x.data.copy_(x)
        graph.replay()
        eager.weight.grad = None
        want = _step(eager, x.clone().requires_grad_(), dy, recipe)
        torch.cuda.synchronize()
        assert rel(static_y, want) <= 1e-6
        assert rel(graphed.weight.grad, eager.weight.grad) <= 1e-6
        assert torch.equal(fwd_state(graphed)["scale"], fwd_state(eager)["scale"])
        assert torch.equal(bwd_state(graphed)["amax_history"], bwd_state(eager)["amax_history"])


def test_inference_under_no_grad_matches_training_forward():
    lin, _ = make(seed=16)
    x = torch.randn(16, 32)
    with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
        with torch.no_grad():
            y_infer = lin(x)  # no column-wise data is made: nothing will run backward
        y_train = lin(x.requires_grad_())
    assert not y_infer.requires_grad
    assert torch.equal(y_infer, y_train.detach())


def test_return_bias_and_high_precision_main_grad():
    lin, ref = make(seed=19, return_bias=True, fuse_wgrad_accumulation=True)
    x, dy = torch.randn(8, 32), torch.randn(8, 48)
    y, bias = lin(x)
    assert bias is lin.bias
    assert rel(y + bias, ref(x)) <= 1e-6
    y.backward(dy)
    ref(x).backward(dy)
    assert lin.weight.grad is None
    assert rel(lin.weight.main_grad, ref.weight.grad) <= 1e-6


def test_main_grad_under_torch_autocast_lands_on_the_parameter():
    """torch.autocast gives the GEMM a bf16 copy of the weight; the fp32 main_grad still
    belongs to (and receives the gradient of) the parameter."""
    lin, ref = make(seed=20, fuse_wgrad_accumulation=True)
    x, dy = torch.randn(8, 32), torch.randn(8, 48)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        y.backward(dy.to(y.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = ref(x)
    y_ref.backward(dy.to(y_ref.dtype))
    assert lin.weight.grad is None
    # nn.Linear's dW is rounded to bf16 before it lands in the fp32 .grad; main_grad is not.
    assert rel(lin.weight.main_grad, 2 * ref.weight.grad) <= 2.0 ** -8


def test_one_update_launch_for_all_modules():
    def update_calls(prof):
        return sum(e.name == "tpfp8::delayed_scaling_update_many" for e in prof.events())

    torch.manual_seed(20)
    layers = nn.Sequential(*[tpfp8.Linear(32, 32) for _ in range(5)])
    x = torch.randn(16, 32)
    with torch.profiler.profile() as fwd:
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=4)):
            hidden = [x]
            for layer in layers:
                hidden.append(layer(hidden[-1]))
    assert update_calls(fwd) == 1  # 5 modules x (input, weight, gradient) in one launch
    for layer, inp in zip(layers, hidden):
        want = np.float32(448.0) / np.float32(inp.detach().abs().max())
        assert float(fwd_state(layer)["scale"][0]) == want
        assert float(fwd_state(layer)["amax_history"][1, 0]) == np.float32(inp.detach().abs().max())
    with torch.profiler.profile() as bwd:
        hidden[-1].sum().backward()
    assert update_calls(bwd) == 0  # backward only folds the gradients' amaxes
    with torch.profiler.profile() as nxt:
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=4)):
            layers(x)
    assert update_calls(nxt) == 1  # the next step's exit rolls them in, with its own
    grads = [bwd_state(layer) for layer in layers]
    assert all(float(m["amax_history"][1, 0]) > 0 and float(m["amax_history"][0, 0]) == 0
               for m in grads)
    assert all(float(m["scale"][0]) == np.float32(57344.0) / m["amax_history"][1, 0].numpy()
               for m in grads)


def test_one_module_alternates_recipes():
    """Delayed, then current, then delayed again on the same module: each call uses its own
    recipe's scales and the delayed state carries on where it stopped."""
    torch.manual_seed(23)
    lin = tpfp8.Linear(32, 16)
    x = torch.randn(8, 32)
    delayed, current = tpfp8.DelayedScaling(amax_history_len=4), tpfp8.CurrentScaling()
    with tpfp8.fp8_autocast(recipe=delayed):
        lin(x).sum().backward()
    scale_after_first = fwd_state(lin)["scale"].clone()
    with tpfp8.fp8_autocast(recipe=current):
        y_current = lin(x)
    y_current.sum().backward()
    assert torch.equal(fwd_state(lin)["scale"], scale_after_first)  # current leaves it alone
    want = np.float32(448.0) / np.float32(x.abs().max())
    with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=4)):
        y_delayed = lin(x)
    assert float(fwd_state(lin)["scale"][0]) == want
    assert torch.equal(y_delayed, y_current)  # the same scale as current scaling's now




def _swap_buffer(lin):  # as FSDP-style code moves buffers: past nn.Module.__setattr__
    lin._buffers["fp8_amax_history"] = lin._buffers["fp8_amax_history"].clone()


def _new_storage(lin):  # the same tensor object, other memory
    lin.fp8_scale.data = lin.fp8_scale.clone()
    lin.fp8_grad_amax_history.set_(lin.fp8_grad_amax_history.clone())


def _reload(lin):  # in place, the same tensors
    lin.load_state_dict(lin.state_dict())


@pytest.mark.parametrize("change", [_swap_buffer, _new_storage, _reload])
def test_the_update_follows_state_changed_between_steps(change):
    """fp8_autocast's exit plans the update of a set of layers once; state replaced or moved
    in memory between steps, by any route, is what the next update rolls: the layers end
    bit-identical to twins that ran the same steps untouched."""
    torch.manual_seed(24)
    changed = nn.Sequential(*[tpfp8.Linear(32, 32) for _ in range(3)])
    twin = copy.deepcopy(changed)
    x = torch.randn(8, 32)
    recipe = tpfp8.DelayedScaling(amax_history_len=4)
    for step in range(4):
        if step == 2:
            for layer in changed:
                change(layer)
        for model in (changed, twin):
            with tpfp8.fp8_autocast(recipe=recipe):
                y = model(x)
            y.sum().backward()
    for a, b in zip(changed, twin):
        assert a._fp8_updates == b._fp8_updates == 4
        for mine, theirs in zip(a._state(), b._state()):
            assert torch.equal(mine, theirs)
    assert float(fwd_state(changed[0])["scale"][0]) != 1.0


def test_the_update_of_sets_that_vary_between_steps():
    """The same layers in another order, or two sets starting with the same layer: each set gets
    its own plan (the first layer keeps a few) and every step updates exactly the layers that
    ran, as each layer stepped alone would be."""
    torch.manual_seed(25)
    layers = [tpfp8.Linear(32, 32) for _ in range(3)]
    alone = copy.deepcopy(layers)
    x, recipe = torch.randn(8, 32), tpfp8.DelayedScaling(amax_history_len=4)
    for order in [(0, 1, 2), (0, 2, 1), (0, 1), (0, 1, 2), (0, 2, 1), (0, 1)]:
        with tpfp8.fp8_autocast(recipe=recipe):
            for i in order:
                layers[i](x).sum().backward()
        for i in order:
            with tpfp8.fp8_autocast(recipe=recipe):
                alone[i](x).sum().backward()
    for mine, theirs in zip(layers, alone):
        assert mine._fp8_updates == theirs._fp8_updates
        for a, b in zip(mine._state(), theirs._state()):
            assert torch.equal(a, b)
    assert len(layers[0].__dict__[tpfp8.scaling.PLANS]) == 3


def test_the_update_of_new_layers_in_place_of_deleted_ones():
    """New layers may take the ids of deleted ones (a plan's key): each model still updates
    its own state."""
    x, recipe = torch.randn(8, 32), tpfp8.DelayedScaling(amax_history_len=4)
    for seed in range(4):
        torch.manual_seed(seed)
        model = nn.Sequential(*[tpfp8.Linear(32, 32) for _ in range(2)])
        with tpfp8.fp8_autocast(recipe=recipe):
            model(x)
        want = np.float32(448.0) / np.float32(x.abs().max())
        assert float(fwd_state(model[0])["scale"][0]) == want
        del model


def test_a_delayed_update_refuses_state_moved_under_it():
    scale, scale_inv = torch.ones(3), torch.ones(3)
    history, grad_history = torch.zeros(2, 4), torch.zeros(1, 4)
    history[:, 0] = 2.0  # (tensor-major: the newest amax of the input and the weight)
    update = tpfp8._C.DelayedUpdate([scale], [scale_inv], [history], [grad_history],
                                    [448.0, 448.0, 57344.0], 0, True, "")
    assert update.unchanged()
    history.set_(history.clone())
    assert not update.unchanged()
    with pytest.raises(RuntimeError, match="storage or shape changed"):
        update.run()
    assert torch.equal(scale, torch.ones(3))  # untouched
    update = tpfp8._C.DelayedUpdate([scale], [scale_inv], [history], [grad_history],
                                    [448.0, 448.0, 57344.0], 0, True, "")
    update.run()
    assert scale.tolist() == [224.0, 224.0, 1.0]


@pytest.mark.parametrize("move", [lambda t: setattr(t, "data", t.view(torch.int32)),
                                  lambda t: t.as_strided_((3,), (2,))],
                         ids=["other dtype", "other strides"])
def test_a_delayed_update_refuses_state_reinterpreted_in_place(move):
    scale = torch.ones(6)[:3]  # (room for the strides below)
    update = tpfp8._C.DelayedUpdate([scale], [torch.ones(3)], [torch.zeros(2, 4)],
                                    [torch.zeros(1, 4)], [448.0, 448.0, 57344.0], 0, True, "")
    move(scale)
    assert not update.unchanged()


class _Doubled(nn.Module):
    def forward(self, t):
        return 2 * t


@pytest.mark.parametrize("names", [("weight", "bias"), ("layer_norm_weight", "layer_norm_bias")])
def test_parametrized_parameters_are_the_ones_used(device, names):
    """torch.nn.utils.parametrize moves a parameter out of the module's dict (as weight_norm and
    FSDP1 do): the layer computes with the parametrized values, and the gradient reaches the
    original, as for a layer holding those values directly."""
    torch.manual_seed(0)
    layer = tpfp8.LayerNormLinear(32, 16, device=device)
    plain = copy.deepcopy(layer)
    for name in names:
        parametrize.register_parametrization(layer, name, _Doubled())
        setattr(plain, name, nn.Parameter(2 * getattr(plain, name).detach()))
    x = torch.randn(8, 32, device=device)
    for recipe in (None, tpfp8.DelayedScaling(), tpfp8.CurrentScaling()):
        for module in (layer, plain):
            module.zero_grad(set_to_none=True)
        with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y, want = layer(x), plain(x)
        assert torch.equal(y, want)
        y.square().sum().backward()
        want.square().sum().backward()
        for name in names:
            original = getattr(layer.parametrizations, name).original
            assert torch.equal(original.grad, 2 * getattr(plain, name).grad), name
