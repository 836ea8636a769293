"""The fused modules (tpfp8.LayerNormLinear, RMSNormLinear, LayerNormMLP, MLP): equal, bit for bit,
to the unfused composition of the same recipe -- our norm / activation op in high precision,
then tpfp8.Linear -- in outputs, every gradient and the FP8 state; close to an fp64 emulation;
TransformerEngine's parameter names; clear errors that leave the state alone; torch.compile
whole; activation checkpointing; debugging; save_original_input. (Tensor parallelism:
tp_worker.py.)"""
import copy

import pytest
import torch
from torch import nn

import tpfp8
from tpfp8 import ops

import fp8_oracle
from conftest import capture_step, fp8_tight, requires_gpu, state_of
from test_compile import assert_one_graph, compiled_twin, with_main_grad

DELAYED, CURRENT = tpfp8.DelayedScaling(), tpfp8.CurrentScaling()
RECIPES = {"high precision": None, "delayed": DELAYED, "current": CURRENT}


class _Norm(torch.autograd.Function):
    """Our norm in high precision (tpfp8.ops.norm_cast) with its backward op: the unfused
    reference's first step."""

    @staticmethod
    def forward(ctx, x, gamma, beta, rms_norm, eps):
        x2 = x.reshape(-1, x.shape[-1])
        r = ops.norm_cast(x2, gamma, beta, rms_norm=rms_norm, eps=eps, out=True, rowwise=False,
                          columnwise=False, stats=True)
        ctx.save_for_backward(x2, gamma, r.mean, r.rstd)
        ctx.rms_norm = rms_norm
        return r.out.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, gamma, mean, rstd = ctx.saved_tensors
        dx, dgamma, dbeta = torch.ops.tpfp8.norm_backward(dy.reshape(x.shape).contiguous(), x,
                                                          mean, rstd, gamma, ctx.rms_norm)
        return dx.view(dy.shape), dgamma, (None if ctx.rms_norm else dbeta), None, None


class _Activation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, activation):
        ctx.save_for_backward(h)
        ctx.activation = activation
        return ops.activation_cast(h, torch.ones(1, device=h.device), activation,
                                   rowwise=False, columnwise=False, high_precision=True).out

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        dx = ops.activation_backward_cast(dy.contiguous(), h, torch.ones(1, device=h.device),
                                          ctx.activation, rowwise=False, columnwise=False,
                                          high_precision=True).out
        return dx, None


class NormThenLinear(nn.Module):
    """The unfused composition of a LayerNormLinear: the same parameters, as two steps."""

    def __init__(self, fused):
        super().__init__()
        self.fused = fused
        self.linear = tpfp8.Linear(fused.in_features, fused.out_features,
                                   bias=fused.bias is not None, device=fused.weight.device,
                                   save_original_input=fused.save_original_input)
        self.linear.weight, self.linear.bias = fused.weight, fused.bias

    def forward(self, x):
        f = self.fused
        return self.linear(_Norm.apply(x, f.layer_norm_weight, f.layer_norm_bias,
                                       f.normalization == "RMSNorm", f.eps))


def make_norm_linear(normalization, device, bias=True, k=64, n=48, **kw):
    torch.manual_seed(0)
    fused = tpfp8.LayerNormLinear(k, n, bias=bias, normalization=normalization, device=device,
                                  **kw)
    with torch.no_grad():  # (not the initial 1 and 0: every term of the norm shows)
        fused.layer_norm_weight.uniform_(0.5, 1.5)
        if fused.layer_norm_bias is not None:
            fused.layer_norm_bias.uniform_(-0.5, 0.5)
    return fused, NormThenLinear(copy.deepcopy(fused))


def train_step(model, x, recipe, outputs=lambda y: y, params=None):
    """One forward and backward; what it computed and the gradients of `params` (the model's
    parameters unless given)."""
    params = list(model.parameters() if params is None else params)
    x = x.clone().requires_grad_(True)
    with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = outputs(model(x))
    (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).square().sum().backward()
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return [y.detach(), x.grad] + grads


def assert_same(got, want, what=""):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None and b is None) or torch.equal(a, b), f"{what} item {i}"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_linear_equals_norm_then_linear(device, recipe, normalization, dtype):
    fused, ref = make_norm_linear(normalization, device)
    fused, ref = fused.to(dtype), ref.to(dtype)
    x = torch.randn(2, 40, 64, device=device, dtype=dtype) * 3 + 1
    for i in range(3):  # (delayed scaling: the scales move between steps)
        got = train_step(fused, x * (i + 1), RECIPES[recipe])
        want = train_step(ref, x * (i + 1), RECIPES[recipe])
        assert_same(got, want, f"step {i}")
        assert_same(state_of(fused), state_of(ref.linear), f"FP8 state, step {i}")


@pytest.mark.parametrize("recipe", ["high precision", "current"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_save_original_input_equals_norm_then_linear(device, recipe, normalization):
    """With save_original_input the layer keeps the normalized input in high precision and
    casts it again in backward, as the composition's Linear does with the norm's output.
    (Delayed scaling refuses it: the scale moves between forward and backward.)"""
    fused, ref = make_norm_linear(normalization, device, save_original_input=True)
    assert ref.linear.save_original_input
    x = torch.randn(2, 40, 64, device=device) * 3 + 1
    for i in range(2):
        got = train_step(fused, x * (i + 1), RECIPES[recipe])
        want = train_step(ref, x * (i + 1), RECIPES[recipe])
        assert_same(got, want, f"step {i}")


@pytest.mark.parametrize("save_original_input", [False, True])
def test_what_backward_keeps_of_the_normalized_input(device, save_original_input):
    """In FP8 the layer keeps the normalized input for wgrad as its column-wise FP8 codes,
    written by the norm's kernel (the high-precision normalized tensor is never kept); with
    save_original_input, that tensor in high precision instead (cast again in backward). The
    input x itself is kept either way, for the norm's backward."""
    rows, k = 80, 64
    layer = tpfp8.LayerNormLinear(k, 48, save_original_input=save_original_input,
                                  device=device)
    x = torch.randn(rows, k, device=device, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with tpfp8.fp8_autocast(recipe=CURRENT):
            layer(x)
    codes, full = (torch.uint8, (k, rows)), (torch.float32, (rows, k))
    assert saved.count(codes) == (0 if save_original_input else 1), saved
    assert saved.count(full) == (2 if save_original_input else 1), saved


def mlp_and_composition(device, activation, bias=True, dtype=torch.float32, norm="RMSNorm"):
    """A LayerNormMLP (norm=None: a tpfp8.MLP) and the same parameters as its composition:
    (norm then) Linear, our activation op, Linear."""
    torch.manual_seed(0)
    if norm is None:
        mlp = tpfp8.MLP(64, 32, activation=activation, device=device, bias=bias).to(dtype)
        fc1 = tpfp8.Linear(64, mlp.fc1.out_features, device=device, bias=bias).to(dtype)
        fc1.load_state_dict(mlp.fc1.state_dict())
    else:
        mlp = tpfp8.LayerNormMLP(64, 32, activation=activation, normalization=norm,
                                 device=device, bias=bias).to(dtype)
        fc1 = NormThenLinear(copy.deepcopy(mlp.fc1))
    fc2 = tpfp8.Linear(32, 64, device=device, bias=bias).to(dtype)
    fc2.load_state_dict(mlp.fc2.state_dict())

    def ref(x):
        return fc2(_Activation.apply(fc1(x), activation))
    return mlp, ref, list(fc1.parameters()) + list(fc2.parameters()), fc2


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("norm", ["RMSNorm", None], ids=["LayerNormMLP", "MLP"])
def test_mlp_equals_its_composition(device, recipe, activation, bias, norm):
    """fp32, where the activation's FP8 codes (cast from its fp32 value) equal the cast of its
    high-precision output; and so do fc1's gradient codes handed over in FP8 and the cast of
    the high-precision gradient, and (bias=True) their column sums, fc1's bias gradient."""
    mlp, ref, ref_params, fc2 = mlp_and_composition(device, activation, bias, norm=norm)
    x = torch.randn(48, 64, device=device)
    for i in range(3):
        got = train_step(mlp, x * (i + 1), RECIPES[recipe])
        want = train_step(ref, x * (i + 1), RECIPES[recipe], params=ref_params)
        assert_same(got, want, f"step {i}")
        assert_same(state_of(mlp.fc2), state_of(fc2), f"fc2 FP8 state, step {i}")


class _BackwardCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The linear_backward calls made under it, as (handoff given, FP8 dy taken)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.tpfp8.linear_backward.default:
            schema = [a.name for a in func._schema.arguments]
            named = dict(zip(schema, args), **(kwargs or {}))
            self.calls.append((bool(named.get("handoff_rowwise")),
                               named.get("dy_scale_inv") is not None))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias, debug, recipe, handed", [
    (False, None, "delayed", True), (False, None, "current", True),
    (True, None, "delayed", True), (True, None, "current", True),
    (False, "fc2", "delayed", False), (False, "fc1", "delayed", False),
    (True, "fc1", "current", False), (False, None, "high precision", False)])
@pytest.mark.parametrize("norm", ["RMSNorm", None], ids=["LayerNormMLP", "MLP"])
def test_mlp_backward_hands_fc1_its_gradient_in_fp8(bias, debug, recipe, handed, norm):
    """fc2's backward casts fc1's gradient in the activation backward's pass (with its column
    sums, fc1's bias gradient, where fc1 has a bias), and fc1's backward takes it; not when
    either layer is debugged (fc1's debug quantizer needs its gradient's high-precision values)
    or outside FP8."""
    mlp, *_ = mlp_and_composition("cpu", "swiglu", bias, norm=norm)
    if debug:
        getattr(mlp, debug).name = "probe"
        tpfp8.debug.initialize([{"layers": "probe", "features": {"log_stats": {}}}])
    try:
        x = torch.randn(48, 64, requires_grad=True)
        with tpfp8.fp8_autocast(enabled=recipe != "high precision", recipe=RECIPES[recipe]):
            y = mlp(x)
        with _BackwardCalls() as seen:
            y.square().sum().backward()
        assert seen.calls == [(handed, False), (False, handed)]
        assert not debug or tpfp8.debug.records()
    finally:
        if debug:
            tpfp8.debug.shutdown()


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_bf16_mlp_handoff_is_as_close_to_fp64_as_the_composition(recipe):
    """In bf16 the handed-over codes are cast from the fp32 gradient, the composition's from
    its bf16 rounding: not the same bytes, and no less accurate against fp64 (the same
    parameters, in fp64, without FP8)."""
    mlp, ref, ref_params, _ = mlp_and_composition("cpu", "swiglu", False, torch.bfloat16)
    named = {n: t.detach().double().requires_grad_(True) for n, t in mlp.named_parameters()}
    p = list(named.values())  # (mlp.parameters()' order)
    norm_weight, w1, w2 = (named[n] for n in ("fc1.layer_norm_weight", "fc1.weight",
                                              "fc2.weight"))

    def exact(x):
        h = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + mlp.fc1.eps) * norm_weight
        gate, up = (h @ w1.T).chunk(2, -1)
        return (nn.functional.silu(gate) * up) @ w2.T
    x = torch.randn(48, 64) * 2
    got = train_step(mlp, x.bfloat16(), RECIPES[recipe])
    want = train_step(ref, x.bfloat16(), RECIPES[recipe], params=ref_params)
    truth = train_step(exact, x.double(), None, params=p)
    for i, (g, w, t) in enumerate(zip(got, want, truth)):
        err_got = float((g.double() - t).norm() / t.norm())
        err_want = float((w.double() - t).norm() / t.norm())
        # (E5M2 gradients: 2 mantissa bits, ~10 % relative error in dx either way)
        assert err_got < 0.25 and err_got <= 1.25 * err_want + 1e-3, (i, err_got, err_want)


@requires_gpu
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_gpu_whole_step_in_one_cuda_graph_equals_eager(recipe, activation):
    """A training step of a bf16 LayerNormMLP, fp8_autocast's exit (the delayed-scaling
    update) included, captured in one CUDA graph (bench/compile.py's "cuda graph" cases):
    each replay on a new input equals an eager step bit for bit, FP8 state included."""
    torch.manual_seed(0)
    graphed = tpfp8.LayerNormMLP(256, 512, activation=activation, normalization="RMSNorm",
                                 device="cuda").to(torch.bfloat16)
    eager = copy.deepcopy(graphed)
    static_x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)

    def step(model, x):
        with tpfp8.fp8_autocast(recipe=RECIPES[recipe]):
            y = model(x)
        y.backward(dy)
        return y
    graph, static_y = capture_step(lambda: step(graphed, static_x),
                                   lambda: step(eager, static_x.detach().clone().requires_grad_()),
                                   [static_x, *graphed.parameters()])
    for i in range(3):
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16) * (i + 1)
        static_x.data.copy_(x)
        graph.replay()
        for p in eager.parameters():
            p.grad = None
        x = x.requires_grad_()
        want_y = step(eager, x)
        assert_same([static_y, static_x.grad, *[p.grad for p in graphed.parameters()]],
                     [want_y, x.grad, *[p.grad for p in eager.parameters()]], f"replay {i}")
        for g, e in ((graphed.fc1, eager.fc1), (graphed.fc2, eager.fc2)):
            assert_same(state_of(g), state_of(e), f"FP8 state, replay {i}")


def test_norm_linear_is_close_to_an_fp64_emulation(device):
    """Current scaling: quantize(norm(x)) and quantize(W) as the oracle encodes them, the GEMM
    in fp64. (The norm itself in fp64: a code may land on the other side of a rounding
    boundary, hence a tolerance of a few FP8 steps' worth in the sum.)"""
    fused, _ = make_norm_linear("LayerNorm", device)
    x = torch.randn(64, 64, device=device) * 2
    with tpfp8.fp8_autocast(recipe=CURRENT):
        y = fused(x)
    x64 = x.double().cpu()
    ln = torch.nn.functional.layer_norm(
        x64, (64,), fused.layer_norm_weight.double().cpu(), fused.layer_norm_bias.double().cpu(),
        fused.eps)
    w64 = fused.weight.double().cpu()

    def fq(t, fmt="e4m3"):
        return fp8_oracle.fake_quant(t, fp8_oracle.current_scale(t, fmt), fmt)
    want = fq(ln) @ fq(w64).T + fused.bias.double().cpu()
    err = (y.double().cpu() - want).abs().max() / want.abs().max()
    assert err < 2e-2, err


class _FakeQuant(torch.autograd.Function):
    """fp64 emulation of a current-scaling cast: forward, the tensor's FP8 values (`fmt`);
    backward, the gradient as it comes (the GEMMs take the codes as they are)."""

    @staticmethod
    def forward(ctx, t, fmt):
        return fp8_oracle.fake_quant(t, fp8_oracle.current_scale(t, fmt), fmt)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _FakeQuantGrad(torch.autograd.Function):
    """The output gradient's cast: identity forward, the gradient's E5M2 values backward."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return fp8_oracle.fake_quant(grad, fp8_oracle.current_scale(grad, "e5m2"), "e5m2")


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_linear_step_is_close_to_an_fp64_emulation(device, normalization):
    """Current scaling, forward and backward, against fp64: the norm, its input's and the
    weight's E4M3 values, the output gradient's E5M2 values (the bias gradient from the
    gradient itself), the GEMMs and the norm's backward in fp64. Only the rounding of a code
    whose fp32 and fp64 inputs fall on two sides of a boundary can differ (none here: 1e-7 on
    the CPU), and the GPU's FP8 GEMMs accumulate with ~14 bits (fp8_tight)."""
    fused, _ = make_norm_linear(normalization, device)
    x = torch.randn(64, 64, device=device) * 2 + 0.5
    dy = torch.randn(64, 48, device=device)
    xg = x.clone().requires_grad_(True)
    with tpfp8.fp8_autocast(recipe=CURRENT):
        y = fused(xg)
    y.backward(dy)
    got = [y.detach(), xg.grad] + [p.grad for p in fused.parameters()]

    p64 = [p.detach().double().cpu().requires_grad_(True) for p in fused.parameters()]
    named = dict(zip([n for n, _ in fused.named_parameters()], p64))
    x64 = x.double().cpu().requires_grad_(True)
    if normalization == "LayerNorm":
        ln = nn.functional.layer_norm(x64, (64,), named["layer_norm_weight"],
                                      named["layer_norm_bias"], fused.eps)
    else:
        ln = nn.functional.rms_norm(x64, (64,), named["layer_norm_weight"], fused.eps)
    mm = _FakeQuant.apply(ln, "e4m3") @ _FakeQuant.apply(named["weight"], "e4m3").T
    y64 = _FakeQuantGrad.apply(mm) + named["bias"]
    y64.backward(dy.double().cpu())
    want = [y64.detach(), x64.grad] + [p.grad for p in p64]
    names = ["y", "dx"] + list(named)
    for name, a, b in zip(names, got, want):
        err = float((a.double().cpu() - b).norm() / b.norm())
        assert err < fp8_tight(device), (name, err)


def test_return_layernorm_output_gets_its_gradient(device):
    """The normalized input returned beside y (a residual after the norm) carries gradient to
    x and the norm's parameters, as the composition's does."""
    fused, ref = make_norm_linear("LayerNorm", device, return_layernorm_output=True)
    x = torch.randn(32, 64, device=device)

    def both(out):
        y, normalized = out
        return torch.cat([y, normalized], dim=-1)
    for recipe in RECIPES.values():
        got = train_step(fused, x, recipe, both)
        want = train_step(lambda t: (ref(t), _Norm.apply(
            t, ref.fused.layer_norm_weight, ref.fused.layer_norm_bias, False, ref.fused.eps)),
            x, recipe, both, params=ref.parameters())
        assert torch.equal(got[0], want[0])
        for a, b in zip(got[1:], want[1:]):  # (two sums into one gradient: order may differ)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mlp", [False, True])
def test_only_the_returned_norm_output_takes_gradient(device, mlp):
    """Backward from the returned norm output alone (y unused, so no gradient comes for it):
    x and the norm's parameters get the norm's gradient; the Linears' weight gradients are
    zero, as for a zero gradient of y."""
    torch.manual_seed(0)
    if mlp:
        fused = tpfp8.LayerNormMLP(64, 128, device=device, return_layernorm_output=True)
        linear_weights = [fused.fc1_weight, fused.fc2_weight]
    else:
        fused = make_norm_linear("LayerNorm", device, return_layernorm_output=True)[0]
        linear_weights = [fused.weight]
    with torch.no_grad():
        fused.layer_norm_weight.uniform_(0.5, 1.5)
        fused.layer_norm_bias.uniform_(-0.5, 0.5)
    norm_params = [fused.layer_norm_weight, fused.layer_norm_bias]
    twins = [p.detach().clone().requires_grad_(True) for p in norm_params]
    x = torch.randn(32, 64, device=device)
    for recipe in RECIPES.values():
        got = train_step(fused, x, recipe, lambda out: out[1], norm_params + linear_weights)
        want = train_step(lambda t: _Norm.apply(t, *twins, False, 1e-5), x, recipe,
                          params=twins)
        assert_same(got[:4], want)
        for grad in got[4:]:
            assert torch.equal(grad, torch.zeros_like(grad))


def test_outputs_in_order_y_bias_norm(device):
    fused, _ = make_norm_linear("RMSNorm", device, return_bias=True,
                                return_layernorm_output=True)
    y, bias, normalized = fused(torch.randn(4, 64, device=device))
    assert y.shape == (4, 48) and bias is fused.bias and normalized.shape == (4, 64)


def test_rms_norm_linear_and_te_parameter_names():
    layer = tpfp8.RMSNormLinear(32, 16, eps=1e-6)
    assert layer.normalization == "RMSNorm" and layer.layer_norm_bias is None
    assert set(layer.state_dict()) == {"weight", "bias", "layer_norm_weight", "_extra_state"}
    mlp = tpfp8.LayerNormMLP(32, 64)
    assert set(mlp.state_dict()) == {
        "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight",
        "fc2_bias", "fc1._extra_state", "fc2._extra_state"}
    swiglu = tpfp8.LayerNormMLP(32, 64, activation="swiglu", bias=False)
    assert swiglu.state_dict()["fc1_weight"].shape == (128, 32)
    plain = tpfp8.MLP(32, 64, activation="swiglu")
    assert set(plain.state_dict()) == {"fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias",
                                       "fc1._extra_state", "fc2._extra_state"}
    assert isinstance(plain.fc1, tpfp8.Linear) and plain.fc1.weight.shape == (128, 32)
    # The same names as attributes: the parameters themselves, None where there is none.
    for module in (mlp, swiglu, plain):
        state = module.state_dict()
        for name in ("layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias",
                     "fc2_weight", "fc2_bias"):
            if name in state:
                assert isinstance(getattr(module, name), nn.Parameter)
                assert getattr(module, name).data_ptr() == state[name].data_ptr()
    assert swiglu.fc1_bias is None and swiglu.fc2_weight is swiglu.fc2.weight
    assert not hasattr(plain, "layer_norm_weight")
    with pytest.raises(AttributeError, match="fc1_weight is fc1.weight, read-only"):
        mlp.fc1_weight = nn.Parameter(torch.zeros(64, 32))


@pytest.mark.parametrize("cls", [tpfp8.LayerNormMLP, tpfp8.MLP])
def test_mlp_state_dict_round_trip_keeps_fp8_state(cls):
    torch.manual_seed(0)
    mlp = cls(32, 64, activation="swiglu")
    with tpfp8.fp8_autocast(recipe=DELAYED):
        mlp(torch.randn(16, 32)).sum().backward()
    other = cls(32, 64, activation="swiglu")
    other.load_state_dict(mlp.state_dict())
    x = torch.randn(16, 32)
    with tpfp8.fp8_autocast(recipe=DELAYED):
        assert torch.equal(other(x), mlp(x))


@pytest.mark.parametrize("cls, kw", [
    (tpfp8.LayerNormMLP, {}), (tpfp8.LayerNormMLP, {"normalization": "RMSNorm", "bias": False}),
    (tpfp8.MLP, {"activation": "swiglu"})])
def test_mlp_full_state_dict_round_trip_by_te_names(cls, kw):
    """full_state_dict / load_full_state_dict on the MLPs, as on a Linear, keyed as
    state_dict: a second module loaded from the first's holds the same parameters."""
    torch.manual_seed(0)
    mlp, other = cls(32, 64, **kw), cls(32, 64, **kw)
    with torch.no_grad():
        for p in mlp.parameters():
            p.uniform_(-1, 1)
    full = mlp.full_state_dict()
    params = {k: v for k, v in mlp.state_dict().items() if not k.endswith("_extra_state")}
    assert set(full) == set(params)
    assert all(torch.equal(full[k], v) and full[k].data_ptr() != v.data_ptr()
               for k, v in params.items())
    other.load_full_state_dict(full)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), mlp.parameters()))


@pytest.mark.parametrize("kw, change, message", [
    ({}, lambda s: s.update(fc2_weight=torch.ones(32, 63)), r"fc2_weight has shape \(32, 63\)"),
    ({}, lambda s: s.pop("fc2_bias"), r"missing keys \['fc2_bias'\]"),
    ({}, lambda s: s.pop("layer_norm_weight"), r"missing keys \['layer_norm_weight'\]"),
    ({}, lambda s: s.update(layer_norm_weight=torch.ones(31)), "layer_norm_weight has shape"),
    ({}, lambda s: s.update({"fc1.weight": s.pop("fc1_weight")}),
     r"unknown keys \['fc1.weight'\], missing keys \['fc1_weight'\]"),
    ({}, lambda s: s.update({"fc1._extra_state": None, "fc2._extra_state": b""}),
     r"unknown keys \['fc2._extra_state'\].*load_state_dict loads it"),
    ({"normalization": "RMSNorm"}, lambda s: s.update(layer_norm_bias=torch.zeros(32)),
     r"unknown keys \['layer_norm_bias'\]; LayerNormMLP takes \['fc1_bias', 'fc1_weight', "
     r"'fc2_bias', 'fc2_weight', 'layer_norm_weight'\]"),
    ({"bias": False}, lambda s: s.update(fc1_bias=torch.zeros(64)), r"unknown keys \['fc1_bias'\]"),
    ({}, lambda s: s.update(fc2_bias=torch.zeros(32, device="meta")), "fc2_bias is a meta tensor"),
    ({}, lambda s: s.update(fc2_bias=[0.0] * 32), "fc2_bias is a list; give a tensor"),
])
def test_mlp_load_full_state_dict_checks_every_key_and_shape_before_copying(kw, change, message):
    """Every key the module has, and no other; fc2's bad tensor is found before fc1's good ones
    are copied."""
    mlp = tpfp8.LayerNormMLP(32, 64, **kw)
    state = {k: v + 1 for k, v in mlp.full_state_dict().items()}
    change(state)
    before = {k: t.clone() for k, t in mlp.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        mlp.load_full_state_dict(state)
    assert all(torch.equal(t, before[k]) for k, t in mlp.state_dict().items())


@pytest.mark.parametrize("bad, message", [
    (lambda: tpfp8.LayerNormLinear(32, 16, normalization="BatchNorm"), "normalization must be"),
    (lambda: tpfp8.LayerNormLinear(32, 16, eps=-1.0), "eps must be a finite number >= 0"),
    (lambda: tpfp8.LayerNormLinear(32, 16, eps=float("nan")), "eps must be a finite number"),
    (lambda: tpfp8.RMSNormLinear(32, 16, eps=float("inf")), "eps must be a finite number"),
    (lambda: tpfp8.LayerNormMLP(32, 64, eps="1e-5"), "eps must be a finite number"),
    (lambda: tpfp8.RMSNormLinear(32, 16, normalization="LayerNorm"), "RMSNorm"),
    (lambda: tpfp8.LayerNormMLP(32, 64, activation="relu"), "activation must be"),
    (lambda: tpfp8.MLP(32, 64, activation="relu"), "activation must be"),
    (lambda: tpfp8.LayerNormMLP(32, 64, sequence_parallel=True), "needs set_parallel_mode=True"),
])
def test_bad_settings_are_value_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


@pytest.mark.parametrize("make, name, value", [
    (lambda: tpfp8.LayerNormLinear(32, 16), "normalization", "RMSNorm"),
    (lambda: tpfp8.ActivationLinear(32, 16), "activation", "swiglu")])
def test_the_norm_and_the_activation_are_fixed_after_construction(make, name, value):
    """Set afterwards they changed the repr and nothing else: refused, as in_features is."""
    layer = make()
    with pytest.raises(AttributeError, match=f"{name} is fixed"):
        setattr(layer, name, value)
    setattr(layer, name, getattr(layer, name))  # the same value is fine
    layer.eps = 1e-3 if name == "normalization" else None  # (read at every call: settable)


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_mlps_settings_are_its_layers(recipe):
    """LayerNormMLP's eps, normalization and return_layernorm_output are fc1's, its activation
    fc2's (MLP's too), as TransformerEngine's attributes of those names: set afterwards they
    act as at construction (a copy of them used to be ignored: return_layernorm_output set later
    returned an empty or gradient-less tensor, eps changed nothing)."""
    torch.manual_seed(0)
    mlp = tpfp8.LayerNormMLP(64, 32, activation="swiglu")
    assert (mlp.eps, mlp.normalization, mlp.activation) == (1e-5, "LayerNorm", "swiglu")
    assert tpfp8.MLP(64, 32, activation="gelu").activation == "gelu"
    want = tpfp8.LayerNormMLP(64, 32, eps=0.5, activation="swiglu",
                              return_layernorm_output=True)
    want.load_state_dict(mlp.state_dict())
    mlp.eps, mlp.return_layernorm_output = 0.5, True
    assert mlp.fc1.eps == 0.5 and mlp.fc1.return_layernorm_output
    x = torch.randn(16, 64)

    def both(out):
        y, normalized = out
        assert normalized.requires_grad
        return torch.cat([y, normalized], dim=-1)
    for got, expected in zip(train_step(mlp, x, RECIPES[recipe], both),
                             train_step(want, x, RECIPES[recipe], both)):
        assert_same(got, expected)
    for name, value in (("normalization", "RMSNorm"), ("activation", "gelu")):
        with pytest.raises(AttributeError, match=f"{name} is fixed"):
            setattr(mlp, name, value)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("cls", [tpfp8.MLP, tpfp8.LayerNormMLP])
def test_an_mlp_backward_runs_only_what_is_asked_for(cls, recipe):
    """backward(inputs=...) asking for fc2's weight alone writes fc2's main_grad and leaves
    fc1's (and x) alone; asking for x alone leaves both main_grads, as nn.Linear leaves
    weight.grad. Each asked-for gradient is the full backward's."""
    torch.manual_seed(0)
    mlp = cls(64, 32, activation="swiglu", fuse_wgrad_accumulation=True)
    x = torch.randn(16, 64, requires_grad=True)
    with tpfp8.fp8_autocast(enabled=recipe != "high precision", recipe=RECIPES[recipe]):
        y = mlp(x, is_first_microbatch=True)
    dy = torch.randn_like(y)
    y.backward(dy, retain_graph=True)
    full = [x.grad.clone(), mlp.fc1.weight.main_grad.clone(), mlp.fc2.weight.main_grad.clone()]
    for main_grad in (mlp.fc1.weight.main_grad, mlp.fc2.weight.main_grad):
        main_grad.fill_(7.0)
    x.grad = None
    y.backward(dy, inputs=[mlp.fc2.weight], retain_graph=True)  # (overwrites: first micro-batch)
    assert x.grad is None and torch.equal(mlp.fc2.weight.main_grad, full[2])
    assert bool((mlp.fc1.weight.main_grad == 7.0).all())
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, full[0]) and bool((mlp.fc1.weight.main_grad == 7.0).all())
    assert torch.equal(mlp.fc2.weight.main_grad, full[2])


@pytest.mark.parametrize("cls", [tpfp8.MLP, tpfp8.LayerNormMLP])
def test_an_mlp_built_on_meta_initialises_with_reset_parameters(cls):
    """The deferred-initialisation recipe (meta, to_empty, reset_parameters) gives the
    parameters the constructor gives, as for tpfp8.Linear."""
    torch.manual_seed(0)
    want = cls(64, 32, activation="swiglu")
    mlp = cls(64, 32, activation="swiglu", device="meta").to_empty(device="cpu")
    torch.manual_seed(0)
    mlp.reset_parameters()
    for (name, got), expected in zip(mlp.state_dict().items(), want.state_dict().values()):
        if torch.is_tensor(got) and got.numel():
            assert torch.equal(got, expected), name


@pytest.mark.parametrize("cls", [tpfp8.MLP, tpfp8.LayerNormMLP])
@pytest.mark.parametrize("layer", ["fc1", "fc2"])
def test_return_bias_on_an_mlp_layer_is_refused(cls, layer):
    """The op adds both biases itself: with return_bias set on fc1 or fc2 the bias was dropped
    and the output silently wrong."""
    mlp = cls(32, 64)
    getattr(mlp, layer).return_bias = True
    with pytest.raises(ValueError, match="set return_bias=False on fc1 and fc2"):
        mlp(torch.randn(4, 32))
    getattr(mlp, layer).return_bias = False
    mlp(torch.randn(4, 32))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("cls", [tpfp8.Linear, tpfp8.LayerNormLinear, tpfp8.ActivationLinear,
                                 tpfp8.MLP, tpfp8.LayerNormMLP])
def test_a_bias_that_alone_needs_a_gradient_gets_it_in_fp8(cls, recipe):
    """Frozen weights (and norm), an input needing no gradient, a trainable bias (BitFit; the
    first layer of such a model): FP8's backward asked the gradient's cast for no output and
    raised. The first layer's bias gets the gradient it gets with the weight trainable."""
    def bias_grads(freeze):
        torch.manual_seed(0)
        module = cls(32, 32)
        for name, p in module.named_parameters():
            p.requires_grad_(not freeze or name.endswith("bias") and "layer_norm" not in name)
        with tpfp8.fp8_autocast(recipe=RECIPES[recipe]):
            y = module(torch.randn(16, 32))
        y.backward(torch.randn_like(y))
        return {n: p.grad for n, p in module.named_parameters() if n.endswith("bias") and
                "layer_norm" not in n}
    frozen, trained = bias_grads(True), bias_grads(False)
    assert frozen.keys() == trained.keys() and frozen
    for name in frozen:
        assert torch.isfinite(frozen[name]).all()
        assert torch.allclose(frozen[name], trained[name], rtol=0.05, atol=0.05), name
    last = "fc2.bias" if "fc2.bias" in frozen else "bias"
    assert torch.equal(frozen[last], trained[last])  # (the same dy, summed by the same kernel)


@pytest.mark.parametrize("cls", [tpfp8.MLP, tpfp8.LayerNormMLP])
def test_double_backward_of_an_mlp_is_refused_by_its_name(cls):
    mlp = cls(32, 64)
    x = torch.randn(4, 32, requires_grad=True)
    y = mlp(x)
    with pytest.raises(RuntimeError, match="MLP and LayerNormMLP do not support double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("cls", [tpfp8.MLP, tpfp8.LayerNormMLP])
def test_fc1_weight_gradient_without_an_input_gradient(cls, activation, recipe):
    """An input needing no gradient (the first layer; a LayerNormMLP's norm frozen): fc2 hands
    fc1 its gradient column-wise only, and fc1 took the row-wise placeholder's 0 rows for the
    gradient's, so its weight gradient came out zero, silently. It is the same as with the
    input's gradient asked for."""
    def grads(x_needs_grad):
        torch.manual_seed(0)
        mlp = cls(32, 64, activation=activation)
        for name, p in mlp.named_parameters():
            p.requires_grad_("layer_norm" not in name)
        x = torch.randn(16, 32, requires_grad=x_needs_grad)
        with tpfp8.fp8_autocast(recipe=RECIPES[recipe]):
            y = mlp(x)
        y.backward(torch.randn_like(y))
        return {n: p.grad for n, p in mlp.named_parameters() if p.requires_grad}
    without, with_dx = grads(False), grads(True)
    assert without["fc1.weight"].abs().sum() > 0
    for name in without:
        assert torch.equal(without[name], with_dx[name]), name


def test_an_mlp_shows_its_layers_by_their_public_names():
    assert "(fc1): Linear(in_features=32, out_features=128" in repr(
        tpfp8.MLP(32, 64, activation="swiglu"))


def test_row_parallel_norm_is_refused():
    with pytest.raises(ValueError, match="row-parallel"):
        tpfp8.LayerNormLinear(32, 16, parallel_mode="row", tp_group=object())


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_bad_input_is_a_value_error_and_changes_nothing(recipe):
    fused, _ = make_norm_linear("LayerNorm", "cpu")
    with tpfp8.fp8_autocast(recipe=RECIPES[recipe]):
        fused(torch.randn(8, 64)).sum().backward()
    before = state_of(fused)
    with tpfp8.fp8_autocast(recipe=RECIPES[recipe]):
        with pytest.raises(ValueError, match=r"in_features=64"):
            fused(torch.randn(8, 32))
    assert_same(state_of(fused), before)


def test_norm_kernel_limits_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of 16 and at most 16384"):
        tpfp8.LayerNormLinear(24, 16)(torch.randn(4, 24))


def test_swiglu_mlp_input_width_error():
    mlp = tpfp8.LayerNormMLP(32, 64, activation="swiglu")
    with pytest.raises(ValueError, match=r"2 x in_features=128"):
        mlp.fc2(torch.randn(4, 64))


def test_meta_device_gives_shapes():
    mlp = tpfp8.LayerNormMLP(32, 64, activation="swiglu", device="meta",
                             return_layernorm_output=True)
    y, normalized = mlp(torch.randn(2, 5, 32, device="meta"))
    assert y.shape == (2, 5, 32) and normalized.shape == (2, 5, 32)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_activation_checkpoint_equals_plain_step(recipe, use_reentrant, bias):
    torch.manual_seed(0)
    mlp = tpfp8.LayerNormMLP(32, 64, activation="gelu", bias=bias)
    twin = copy.deepcopy(mlp)
    x = torch.randn(16, 32)
    for i in range(2):
        got = train_step(lambda t: torch.utils.checkpoint.checkpoint(
            mlp, t, use_reentrant=use_reentrant), x * (i + 1), RECIPES[recipe],
            params=mlp.parameters())
        want = train_step(twin, x * (i + 1), RECIPES[recipe])
        assert_same(got, want, f"step {i}")


class FusedBlock(nn.Module):
    """RMSNormLinear then LayerNormMLP (or without its norm, tpfp8.MLP; SwiGLU); without the
    MLP's biases its backward hands fc1 an FP8 gradient."""

    def __init__(self, device, mlp_bias=True, mlp_class=tpfp8.LayerNormMLP, **kw):
        super().__init__()
        self.attn_in = tpfp8.RMSNormLinear(32, 48, device=device, name="qkv", **kw)
        self.mlp = mlp_class(48, 64, activation="swiglu", device=device, name="mlp",
                             bias=mlp_bias, fuse_wgrad_accumulation=kw.get(
                                 "fuse_wgrad_accumulation", False))

    def forward(self, x, is_first_microbatch=None):
        return self.mlp(self.attn_in(x, is_first_microbatch), is_first_microbatch)


COMPILE_CONFIGS = {
    "high precision": (None, {}, None),
    "delayed": (DELAYED, {}, None),
    "current": (CURRENT, {}, None),
    "delayed weight cache + main_grad": (DELAYED, {"fuse_wgrad_accumulation": True},
                                         (True, False, False)),
    "current save_original_input": (CURRENT, {"save_original_input": True}, None),
    "delayed handoff": (DELAYED, {"mlp_bias": False}, None),
    "current handoff + main_grad": (CURRENT, {"mlp_bias": False,
                                              "fuse_wgrad_accumulation": True}, None),
    "MLP delayed": (DELAYED, {"mlp_class": tpfp8.MLP}, None),
    "MLP current handoff": (CURRENT, {"mlp_class": tpfp8.MLP, "mlp_bias": False}, None),
}


@pytest.mark.parametrize("name", COMPILE_CONFIGS)
def test_compiled_fused_modules_equal_eager_with_no_graph_break(device, name):
    recipe, options, firsts = COMPILE_CONFIGS[name]
    torch.manual_seed(0)
    eager = with_main_grad(FusedBlock(device, **options))
    _, compiled = compiled_twin(eager)
    x = torch.randn(16, 32, device=device)
    assert_one_graph(eager, x, recipe, firsts and firsts[0])

    def step(m, t, first):
        out = train_step(lambda u: m(u, first), t, recipe, params=m.parameters())
        out += [getattr(p, "main_grad", None) for p in m.parameters()]
        return out + [b.clone() for b in m.buffers()]
    for i in range(3):
        first = firsts and firsts[i]
        got = step(compiled, x * (i + 1), first)
        want = step(eager, x * (i + 1), first)
        assert_same(got[:2], want[:2], f"step {i}")
        assert_same(got[2:], [g for g in want[2:]], f"step {i}")


def test_debug_runs_the_norm_in_high_precision_and_reports(device):
    """Debugging takes the unfused path (the normalized values, then the cast), which is
    what the composition computes."""
    tpfp8.debug.initialize([{"layers": "probe", "features": {"log_stats": {}}}])
    try:
        fused, ref = make_norm_linear("LayerNorm", device, name="probe")
        ref.linear.name = "probe"
        x = torch.randn(16, 64, device=device)
        got = train_step(fused, x, DELAYED)
        want = train_step(ref, x, DELAYED)
        assert_same(got, want)
        assert tpfp8.debug.records()
    finally:
        tpfp8.debug.shutdown()


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_swap_fused_converts_sequential_pairs(norm):
    torch.manual_seed(0)
    norm_layer = nn.LayerNorm(64) if norm == "LayerNorm" else nn.RMSNorm(64, eps=1e-6)
    model = nn.Sequential(norm_layer, nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64),
                          nn.GELU(approximate="tanh"), nn.Linear(64, 32))
    with torch.no_grad():
        norm_layer.weight.uniform_(0.5, 1.5)
    plain = tpfp8.swap_linear(copy.deepcopy(model))
    fused = tpfp8.swap_fused(model)
    kinds = [type(m) for m in fused]
    assert kinds == [nn.Identity, tpfp8.LayerNormLinear, nn.Identity, tpfp8.ActivationLinear,
                     nn.GELU, nn.Linear]  # (tanh GELU is not ours to fuse)
    fused = tpfp8.swap_linear(fused)  # (the rest)
    assert fused[1].normalization == norm and fused[1].layer_norm_weight is norm_layer.weight
    x = torch.randn(32, 64)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    for recipe in (DELAYED, CURRENT):  # FP8: the same casts up to a code at a rounding edge
        with tpfp8.fp8_autocast(recipe=recipe):
            got, want = fused(x), plain(x)
        assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("width", [100, 32768])
def test_swap_fused_leaves_norms_the_kernel_cannot_take(width):
    """A norm whose width is not a multiple of 16, or is above 16384, stays torch's: fusing it
    would turn a model that runs into one that raises at its first forward."""
    x = torch.randn(2, width)
    for norm in (nn.LayerNorm(width), nn.RMSNorm(width)):
        model = nn.Sequential(norm, nn.Linear(width, 16))
        want = model(x)
        tpfp8.swap_fused(model)
        assert [type(m) for m in model] == [type(norm), nn.Linear]
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("width", [100, 32768])
def test_norm_modules_refuse_widths_the_kernel_cannot_take(width):
    """At construction, with the rule and its remedy, not at the first forward."""
    for make in (lambda: tpfp8.LayerNormLinear(width, 16, device="meta"),
                 lambda: tpfp8.RMSNormLinear(width, 16, device="meta"),
                 lambda: tpfp8.LayerNormMLP(width, 64, device="meta")):
        with pytest.raises(ValueError, match=rf"multiple of 16 and at most 16384, got {width}"):
            make()


class _Block(nn.Module):
    """A pre-norm MLP block and an attention-style input: the norm's output feeds fc1 alone
    (fusable), attn_norm's feeds q and k (not), and a residual path."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = (nn.RMSNorm(64, eps=1e-6), nn.Linear(64, 128),
                                                   nn.GELU(), nn.Linear(128, 64))
        self.attn_norm, self.q, self.k = nn.LayerNorm(64), nn.Linear(64, 32), nn.Linear(64, 32)

    def forward(self, x):
        h = self.attn_norm(x)
        x = x + torch.cat([self.q(h), self.k(h)], -1)
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class _Branching(nn.Module):
    """Not provable: the norm called twice, and a forward that branches on values."""

    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        y = self.a(self.norm(x))
        if float(y.sum()) > 0:  # (fx cannot trace a branch on a value)
            return self.b(self.norm(y))
        return y


class _CallsTheNormToo(nn.Module):
    """A Sequential's norm -> Linear, the norm also called directly (by this forward)."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64))

    def forward(self, x):
        return self.seq(x) + self.seq[0](x)


class _CallsAChildsNorm(nn.Module):
    """A traced pair inside `block`, whose norm this parent also calls."""

    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(x) + self.block.norm(x).sum()


class _ReadsTheNormsWeight(nn.Module):
    """norm -> fc, the forward also reading the norm's weight (its dtype)."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(64), nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(self.norm(x.to(self.norm.weight.dtype)))


@pytest.mark.parametrize("make", [_CallsTheNormToo, _CallsAChildsNorm, _ReadsTheNormsWeight])
def test_swap_fused_leaves_a_norm_called_from_elsewhere(make):
    """A norm that another forward also calls, or whose weight it reads, stays a norm: fused,
    its slot became an Identity, and that other call returned its input, silently (or the
    read raised)."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(8, 64)
    want = model(x)
    tpfp8.swap_fused(model)
    torch.testing.assert_close(model(x), want)
    assert not any(type(m) is nn.Identity and name.endswith(("0", "norm"))
                   for name, m in model.named_modules())


def test_swap_fused_keeps_the_mode_and_fp8_state_of_what_it_replaces():
    """A trained tpfp8.Linear's delayed-scaling state (scales, histories, recipe) goes to the
    fused layer, whose input is the same tensor, and an eval model stays in eval. (It used to
    start again from scales of 1, in training mode.) The next FP8 step is the unfused model's
    within FP8 error (torch's LayerNorm rounds differently from the fused kernel), with the
    same update schedule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), tpfp8.Linear(64, 32))
    for _ in range(3):
        train_step(model, torch.randn(8, 64) * 50, DELAYED)
    model.eval()
    plain = copy.deepcopy(model)
    tpfp8.swap_fused(model)
    assert type(model[1]) is tpfp8.LayerNormLinear
    assert not any(m.training for m in model.modules())
    assert torch.equal(model[1].get_extra_state(), plain[1].get_extra_state())
    x = torch.randn(8, 64) * 50
    got, want = train_step(model, x, DELAYED)[0], train_step(plain, x, DELAYED)[0]
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert torch.equal(model[1].fp8_scale, plain[1].fp8_scale)


def test_swap_fused_follows_traced_data_flow():
    """Outside nn.Sequential the traced forward decides: norm -> fc1 and GELU -> fc2 are fused
    (each output used by that Linear alone); the norm feeding q and k, a module that cannot
    be traced, and a Linear shared between two places are left alone."""
    torch.manual_seed(0)
    shared = nn.Linear(64, 64)
    model = nn.ModuleDict({"block": _Block(), "branching": _Branching(),
                           "twice": nn.Sequential(nn.LayerNorm(64), shared),
                           "again": nn.Sequential(shared)})
    with torch.no_grad():
        model["block"].norm.weight.uniform_(0.5, 1.5)
    plain = tpfp8.swap_linear(copy.deepcopy(model))
    tpfp8.swap_fused(model)
    block = model["block"]
    assert type(block.norm) is nn.Identity and type(block.act) is nn.Identity
    assert type(block.fc1) is tpfp8.LayerNormLinear and block.fc1.normalization == "RMSNorm"
    assert type(block.fc2) is tpfp8.ActivationLinear
    assert type(block.attn_norm) is nn.LayerNorm and type(block.q) is nn.Linear
    assert type(model["branching"].norm) is nn.LayerNorm
    assert type(model["twice"][0]) is nn.LayerNorm and model["twice"][1] is shared
    fused = tpfp8.swap_linear(model)
    x = torch.randn(8, 64)
    torch.testing.assert_close(fused["block"](x), plain["block"](x), rtol=1e-5, atol=1e-5)
    with tpfp8.fp8_autocast(recipe=DELAYED):
        got, want = fused["block"](x), plain["block"](x)
    assert float((got - want).norm() / want.norm()) < 2e-2
