"""A block's skip connection folded into the layers (``residual=``): the forward GEMM's epilogue
adds it before the output's one rounding, and ``x + LayerNormMLP(x)`` (``residual=x``) adds the
output's gradient to x's in the norm backward's own pass -- each held to the separate add it
replaces."""
import copy

import pytest
import torch
from torch import nn

import tpfp8
from conftest import fp8_tight, state_of
from test_compile import assert_one_graph, compiled_twin
from test_fused_modules import RECIPES, assert_same

DTYPES = [torch.float32, torch.bfloat16]


def linear_loss(y):
    """A loss whose gradient does not depend on y (a fixed pattern): the two ways of adding the
    residual, whose outputs may differ in the last bit, then get the same dy."""
    pattern = torch.linspace(-1, 1, y.numel(), device=y.device).view(y.shape)
    return (y * pattern.to(y.dtype)).sum()


def run(model, x, recipe, residual=None, add_after=False):
    """One forward and backward: the output, then the gradients of x, the residual and the
    model's parameters. `residual` is given to the layer, or with `add_after` added to its
    output (the unfused reference); "x" stands for the input itself; None: no residual."""
    x = x.clone().requires_grad_(True)
    r = x if residual == "x" else residual
    if r is not None and r is not x:
        r = r.clone().requires_grad_(True)
    with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        if r is None:
            y = model(x)
        else:
            y = model(x) + r if add_after else model(x, residual=r)
    linear_loss(y).backward()
    grads = [x.grad, None if r is None or r is x else r.grad]
    grads += [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), grads


def assert_forward_close(fused, separate, device, *terms):
    """A forward's output with the residual in the GEMM against the separate add: rounded
    once (assert_rounded_once) on the CPU. On the GPU the two GEMMs (with and without C) may
    run different cuBLASLt kernels, whose sums differ by their accumulation order: normwise, to
    the GEMM's bound (conftest.fp8_tight) and the output's rounding."""
    if device == "cpu":
        assert_rounded_once(fused, separate, *terms)
        return
    err = float((fused.double() - separate.double()).norm() / separate.double().norm())
    assert err <= fp8_tight(device) + torch.finfo(fused.dtype).eps, err


def assert_rounded_once(fused, separate, *terms):
    """`fused` rounds the exact sum of `terms` once, `separate` rounds the first term, then the
    sum: they differ by at most half a unit in the last place of that term and of each result
    (a unit is at most eps times the value), whatever cancels. (An FP8 GEMM that writes fp32
    adds the bias after it: a bias term then adds its rounding too.)"""
    eps = torch.finfo(fused.dtype).eps
    bound = eps * (sum(t.double().abs() for t in terms) + separate.double().abs()
                   + fused.double().abs()) + torch.finfo(fused.dtype).tiny
    assert bool(((fused.double() - separate.double()).abs() <= bound).all())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_residual_is_the_separate_add_rounded_once(device, recipe, dtype, bias):
    torch.manual_seed(0)
    fused = tpfp8.Linear(64, 48, bias=bias, device=device).to(dtype)
    separate = copy.deepcopy(fused)
    x = torch.randn(2, 24, 64, device=device, dtype=dtype)
    residual = torch.randn(2, 24, 48, device=device, dtype=dtype) * 4
    for step in range(3):  # (delayed scaling: the scales move between steps)
        y, grads = run(fused, x * (step + 1), RECIPES[recipe], residual)
        want_y, want_grads = run(separate, x * (step + 1), RECIPES[recipe], residual, True)
        plain = run(copy.deepcopy(separate), x * (step + 1), RECIPES[recipe])[0]
        assert_forward_close(y, want_y, device, plain, residual,
                             *([fused.bias.detach()] if bias else []))
        assert_same(grads, want_grads, f"step {step}")  # (the residual's is dy itself)
        assert_same(state_of(fused), state_of(separate), f"FP8 state, step {step}")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm,activation", [("RMSNorm", "swiglu"), ("LayerNorm", "gelu")])
def test_pre_norm_mlp_with_residual_x_folds_both_adds(device, recipe, dtype, norm, activation):
    """x + LayerNormMLP(x): the output as the separate add rounded once, every parameter's
    gradient bit for bit, and x's gradient too in fp32 (the norm backward's fp32 dx plus dy,
    rounded once, is what autograd's add of the two fp32 gradients gives); in bf16 x's is the
    sum rounded once instead of twice."""
    torch.manual_seed(0)
    fused = tpfp8.LayerNormMLP(64, 32, normalization=norm, activation=activation,
                               device=device).to(dtype)
    with torch.no_grad():
        fused.layer_norm_weight.uniform_(0.5, 1.5)
    separate = copy.deepcopy(fused)
    x = torch.randn(48, 64, device=device, dtype=dtype)
    for step in range(3):
        y, grads = run(fused, x * (step + 1), RECIPES[recipe], "x")
        want_y, want_grads = run(separate, x * (step + 1), RECIPES[recipe], "x", True)
        plain = run(copy.deepcopy(separate), x * (step + 1), RECIPES[recipe])
        assert_forward_close(y, want_y, device, plain[0], x * (step + 1),
                             fused.fc2.bias.detach())
        if dtype == torch.float32:
            assert torch.equal(grads[0], want_grads[0])
        else:  # (the norm's own dx, then dy, the residual path's)
            dy = torch.linspace(-1, 1, y.numel(), device=device).view(y.shape).to(dtype)
            assert_rounded_once(grads[0], want_grads[0], plain[1][0], dy)
        assert_same(grads[1:], want_grads[1:], f"step {step}")
        assert_same(state_of(fused.fc1) + state_of(fused.fc2),
                    state_of(separate.fc1) + state_of(separate.fc2), f"FP8 state, step {step}")


class _Adds(torch.utils._python_dispatch.TorchDispatchMode):
    """How many aten add kernels run under it (the autograd engine's sums of two gradients
    among them)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_folded_skip_connection_runs_no_add_kernel(recipe):
    """residual=x on a LayerNormMLP runs neither add of x + mlp(x): not the forward's (the GEMM
    adds it) nor backward's sum of x's two gradients (the norm backward adds dy). Given some
    other tensor, the residual's gradient is the output's, handed over: no kernel either."""
    torch.manual_seed(0)
    mlp = tpfp8.LayerNormMLP(64, 32, activation="swiglu", bias=False).bfloat16()
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    counts = []
    for residual, add_after in (("x", False), ("x", True), (x.clone(), False)):
        adds = _Adds()
        with adds:
            run(mlp, x, RECIPES[recipe], residual, add_after)
        counts.append(adds.count)
    assert counts[1] == counts[0] + 2 and counts[2] == counts[0], counts


class ResidualBlock(nn.Module):
    """A pre-norm transformer block's skeleton: x + proj(norm-linear(x)), then + MLP(.)."""

    def __init__(self, device):
        super().__init__()
        self.attn_in = tpfp8.RMSNormLinear(32, 48, device=device)
        self.proj = tpfp8.Linear(48, 32, device=device)
        self.mlp = tpfp8.LayerNormMLP(32, 64, normalization="RMSNorm", activation="swiglu",
                                      device=device, bias=False)

    def forward(self, x, is_first_microbatch=None):
        h = self.proj(self.attn_in(x, is_first_microbatch), is_first_microbatch, residual=x)
        return self.mlp(h, is_first_microbatch, residual=h)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_residual_block_equals_eager_with_no_graph_break(device, recipe, dtype):
    """(In bf16 the folded sum of x's gradients, rounded once, differs from autograd's add:
    the compiled backward folds it too.)"""
    torch.manual_seed(0)
    eager = ResidualBlock(device).to(dtype)
    _, compiled = compiled_twin(eager)
    x = torch.randn(16, 32, device=device, dtype=dtype)
    assert_one_graph(eager, x, RECIPES[recipe], None)
    for step in range(3):
        got = run(compiled, x * (step + 1), RECIPES[recipe])
        want = run(eager, x * (step + 1), RECIPES[recipe])
        assert torch.equal(got[0], want[0])
        assert_same(got[1], want[1], f"step {step}")
        assert_same([b.clone() for b in compiled.buffers()], [b for b in eager.buffers()])


def test_inference_gives_the_training_forward():
    torch.manual_seed(0)
    lin = tpfp8.Linear(64, 48)
    mlp = tpfp8.LayerNormMLP(48, 32)
    x, r = torch.randn(8, 64), torch.randn(8, 48)
    for recipe in (None, tpfp8.CurrentScaling()):
        with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            h = lin(x, residual=r)
            want = mlp(h, residual=h)
            for mode in (torch.no_grad, torch.inference_mode):
                with mode():
                    got_h = lin(x, residual=r)
                    assert torch.equal(got_h, h)
                    assert torch.equal(mlp(got_h, residual=got_h), want)


@pytest.mark.parametrize("make", [lambda: tpfp8.Linear(64, 48),
                                  lambda: tpfp8.LayerNormMLP(48, 32, activation="swiglu")],
                         ids=["Linear", "LayerNormMLP"])
@pytest.mark.parametrize("bad,error,message", [
    (torch.zeros(8, 40), ValueError, r"residual is added to the output, so it must be Float of "
                                     r"the output's shape \[8, 48\]"),
    (torch.zeros(8, 48, dtype=torch.bfloat16), ValueError, "must be Float"),
    ([0.0] * 48, TypeError, "residual must be a tensor"),
])
def test_a_bad_residual_is_refused_and_changes_nothing(make, bad, error, message):
    layer = make()
    width = 64 if isinstance(layer, tpfp8.Linear) else 48
    x = torch.randn(8, width)
    with tpfp8.fp8_autocast():
        layer(x).sum().backward()
    layers = [layer] if isinstance(layer, tpfp8.Linear) else [layer.fc1, layer.fc2]
    before = [state_of(m) for m in layers]
    with tpfp8.fp8_autocast():
        with pytest.raises(error, match=message):
            layer(x, residual=bad)
    assert_same(sum([state_of(m) for m in layers], []), sum(before, []))


def test_meta_device_checks_the_residual_shape():
    lin = tpfp8.Linear(64, 48, device="meta")
    assert lin(torch.randn(3, 8, 64, device="meta"),
               residual=torch.randn(3, 8, 48, device="meta")).shape == (3, 8, 48)
    with pytest.raises(ValueError, match=r"output's shape \[3, 8, 48\]"):
        lin(torch.randn(3, 8, 64, device="meta"), residual=torch.randn(3, 48, device="meta"))


def test_calls_with_a_residual_leave_the_call_template_alone():
    """A residual call runs the full path (a template repeats calls without one), and the
    calls around it still match a fresh layer's."""
    torch.manual_seed(0)
    lin = tpfp8.Linear(64, 48)
    twin = copy.deepcopy(lin)
    x, r = torch.randn(8, 64), torch.randn(8, 48)
    with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
        for _ in range(3):
            plain = lin(x)  # (the second call on runs the template)
        with_residual = lin(x, residual=r)
        again = lin(x)
        assert torch.equal(plain, twin(x)) and torch.equal(again, plain)
        assert torch.equal(with_residual, twin(x, residual=r))
        assert not torch.equal(with_residual, plain)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("make", [
    lambda: tpfp8.Linear(64, 64, fuse_wgrad_accumulation=True),
    lambda: tpfp8.LayerNormMLP(64, 32, fuse_wgrad_accumulation=True)],
    ids=["Linear", "LayerNormMLP"])
def test_the_residual_gradient_alone_leaves_the_layer_alone(recipe, make):
    """torch.autograd.grad(loss, [r]) -- with create_graph too -- runs none of the layer's
    backward, as with a separate add: no weight gradient into main_grad, no gradient amax
    recorded, no double-backward refusal; the residual gets the output's gradient."""
    torch.manual_seed(0)
    layer = make()
    params = [p for p in layer.parameters() if p.dim() == 2]
    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    x = torch.randn(16, 64, requires_grad=True)
    r = torch.randn(16, 64, requires_grad=True)
    modules = [layer] if isinstance(layer, tpfp8.Linear) else [layer.fc1, layer.fc2]
    with tpfp8.fp8_autocast(enabled=RECIPES[recipe] is not None, recipe=RECIPES[recipe]):
        y = layer(x, residual=r)
    before = sum([state_of(m) for m in modules], [])
    for create_graph in (False, True):
        (grad,) = torch.autograd.grad(linear_loss(y), [r], retain_graph=True,
                                      create_graph=create_graph)
        assert torch.equal(grad, torch.linspace(-1, 1, y.numel()).view(y.shape))
    assert all(not p.main_grad.any() for p in params)
    assert_same(sum([state_of(m) for m in modules], []), before)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("make", [lambda: tpfp8.LayerNormLinear(64, 64),
                                  lambda: tpfp8.LayerNormMLP(64, 32)],
                         ids=["LayerNormLinear", "LayerNormMLP"])
def test_a_weight_gradient_alone_of_a_folded_block(recipe, make):
    """A pre-norm block with residual=x asked for a weight's gradient alone (a zero-bubble
    pipeline's weight pass, backward(inputs=[w])): the weight gets the full backward's
    gradient, and the skip connection's gradient, which only dx would take, is not added (its
    backward used to refuse it once x's gradient was no longer computed)."""
    torch.manual_seed(0)
    layer = make()
    weight = layer.weight if isinstance(layer, tpfp8.Linear) else layer.fc1.weight
    x = torch.randn(16, 64, requires_grad=True)
    with tpfp8.fp8_autocast(enabled=RECIPES[recipe] is not None, recipe=RECIPES[recipe]):
        y = layer(x, residual=x)
    (alone,) = torch.autograd.grad(linear_loss(y), [weight], retain_graph=True)
    (full, _) = torch.autograd.grad(linear_loss(y), [weight, x])
    assert torch.equal(alone, full)


def test_a_residual_off_16_byte_alignment_gives_the_aligned_result(device):
    """(An offset view, as a slice of a larger tensor is: on the GPU the layer copies it first,
    as FP8 cuBLASLt kernels want aligned matrices.)"""
    torch.manual_seed(0)
    lin = tpfp8.Linear(64, 48, device=device).bfloat16()
    x = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    flat = torch.randn(8 * 48 + 1, device=device, dtype=torch.bfloat16)
    shifted = flat[1:].view(8, 48)
    assert shifted.data_ptr() % 16 != 0
    with tpfp8.fp8_autocast():
        assert torch.equal(lin(x, residual=shifted), lin(x, residual=shifted.clone()))


def test_a_meta_tensor_beside_real_ones_is_refused():
    """The meta kernels do not run the native ops' device checks: a meta residual or dx_add
    beside CPU tensors must not silently write nothing."""
    a, b = torch.randn(4, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\)"):
        tpfp8.ops.gemm(a, b, out_dtype=torch.float32,
                       residual=torch.empty(4, 5, device="meta"))
    x, gamma = torch.randn(4, 16), torch.ones(16)
    norm = tpfp8.ops.norm_cast(x, gamma, None, torch.ones(1), rms_norm=True, out=True,
                               rowwise=False, columnwise=False, stats=True)
    with pytest.raises(ValueError, match="several devices"):
        tpfp8.ops.norm_backward(torch.randn(4, 16), x, None, norm.rstd, gamma, True,
                                dx_add=torch.empty(4, 16, device="meta"))
