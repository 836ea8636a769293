"""The modules' eager calls of their ops (tpfp8._C.EagerOp): the same op as torch.ops.tpfp8.linear
and mlp, with their arguments converted with less host time. The results are those of torch.ops
bit for bit, and every call that __torch_function__ must see (a torch-function mode, a tensor
subclass overriding it) still goes through torch.ops."""
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tpfp8

RECIPES = [None, tpfp8.DelayedScaling(), tpfp8.CurrentScaling()]
RECIPE_IDS = ["high precision", "delayed", "current"]


class Recording(TorchFunctionMode):
    """Records the functions __torch_function__ sees, and runs them."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class Traced(torch.Tensor):
    """A tensor subclass whose __torch_function__ records what it sees."""

    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def _modules(device):
    torch.manual_seed(0)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    return {"Linear": tpfp8.Linear(64, 32, **bf16),
            "LayerNormMLP": tpfp8.LayerNormMLP(64, 128, **bf16)}


def _step(module, x, recipe):
    """One training step: (output, input gradient, parameter gradients, FP8 state after it)."""
    x = x.detach().requires_grad_()
    with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x)
    y.float().square().sum().backward()
    state = [b.clone() for name, b in module.named_buffers() if b is not None]
    return [y, x.grad, *(p.grad for p in module.parameters()), *state]


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_eager_calls_equal_the_calls_through_torch_ops(device, name, recipe):
    """A torch-function mode sends the call through torch.ops: the same op, the same bytes."""
    module = _modules(device)[name]
    twin = copy.deepcopy(module)
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    for _ in range(2):  # (the second step uses the first's delayed-scaling update)
        eager = _step(module, x, recipe)
        with Recording() as mode:
            traced = _step(twin, x, recipe)
        assert torch.ops.tpfp8.linear in mode.seen or torch.ops.tpfp8.mlp in mode.seen
        for a, b in zip(eager, traced, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name,op", [("Linear", "linear"), ("LayerNormMLP", "mlp")])
def test_a_torch_function_mode_sees_the_op(device, name, op):
    module = _modules(device)[name]
    with Recording() as mode, tpfp8.fp8_autocast():
        module(torch.randn(16, 64, device=device, dtype=torch.bfloat16))
    assert getattr(torch.ops.tpfp8, op) in mode.seen


def test_a_tensor_subclass_overriding_torch_function_sees_the_op(device):
    lin = _modules(device)["Linear"]
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    Traced.seen.clear()
    with tpfp8.fp8_autocast():
        y = lin(x.as_subclass(Traced))
        want = lin(x)
    assert torch.ops.tpfp8.linear in Traced.seen
    assert torch.equal(y.as_subclass(torch.Tensor), want)


def test_parameters_take_the_eager_path(device):
    """nn.Parameter disables __torch_function__: a parameter as input needs no torch.ops."""
    lin = _modules(device)["Linear"]
    x = torch.nn.Parameter(torch.randn(16, 64, device=device, dtype=torch.bfloat16))
    with tpfp8.fp8_autocast():
        y = lin(x)
    y.sum().backward()
    assert x.grad is not None and y.shape == (16, 32)


def test_bad_calls_are_refused_as_torch_ops_refuses_them():
    op = tpfp8._C.EagerOp("tpfp8::linear", torch.ops.tpfp8.linear)
    x, w = torch.randn(4, 32), torch.randn(32, 32)
    with pytest.raises(TypeError, match="at most 31 arguments"):
        op(x, w, *([None] * 40))
    with pytest.raises(TypeError, match="missing argument 'scale'"):
        op(x, w, None)
    values = (0, 0, 1, 0.0, 0, False, 0, False, "", [], False, True, True, True)
    torch.testing.assert_close(op(x, w, *([None] * 9), *values)[0], x @ w.t())
    with pytest.raises(TypeError, match="argument 'weight' must be Tensor, got str"):
        op(x, "w", *([None] * 9), *values)
    with pytest.raises(TypeError, match="argument 'scaling' is out of int64's range"):
        op(x, w, *([None] * 9), 2**64, *values[1:])
    with pytest.raises(TypeError, match="argument 'group_name' must be str, got NoneType"):
        op(x, w, *([None] * 9), *values[:8], None, *values[9:])
    with pytest.raises(RuntimeError, match="tpfp8::nothing"):
        tpfp8._C.EagerOp("tpfp8::nothing", torch.ops.tpfp8.linear)
