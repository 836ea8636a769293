"""The fused activation casts (tpfp8.ops.activation_*): the CPU op against an fp64 emulation
(torch float64 GELU / SwiGLU and their autograd gradients, then the FP8 oracle's encode), the
GPU op against the CPU op (bytes equal), torch.library.opcheck of every op, and the errors."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

from conftest import requires_gpu
from fp8_oracle import MAX, encode
from tpfp8 import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACTIVATIONS = ["gelu", "swiglu"]
# Relative precision of each dtype's rounding (fp32: a few ulp of the fp32 math).
RTOL = {torch.float32: 2e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def sample(shape, dtype, seed, specials=False):
    """Random values of a few magnitudes; with `specials`, inf, NaN and zeros mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 3, shape, generator=g))
    if specials:
        flat = x.view(-1)
        values = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40])
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] = values[torch.arange(idx.numel()) % values.numel()]
    return x.to(dtype)


def act64(x, activation):
    x = x.double()
    if activation == "gelu":
        return F.gelu(x)
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def reference(x, activation, grad=None):
    """act(x) or, with grad, dx = grad * act'(x), in float64 through torch's autograd."""
    if grad is None:
        return act64(x, activation)
    x64 = x.double().requires_grad_(True)
    act64(x64, activation).backward(grad.double())
    return x64.grad


def fp8_codes(ref, scale, fmt):
    """The oracle's codes of the fp64 result rounded to fp32 and scaled in fp32."""
    return encode(ref.float().numpy() * np.float32(scale), fmt)


def check_codes(got, want):
    """Equal codes except where the fp32 result and the fp64 one round to neighbouring codes
    (a value within a few fp32 ulp of a rounding boundary): rare, and one step apart."""
    got, want = got.numpy().astype(int), want.astype(int)
    differ = got != want
    assert differ.mean() <= 2e-3, f"{differ.sum()} of {differ.size} codes differ"
    assert np.all(np.abs((got & 0x7F) - (want & 0x7F))[differ] == 1)


def run(activation, x, grad, scale, fmt, current, high_precision=True):
    hp = {"high_precision": high_precision}
    if grad is None:
        if current:
            return ops.activation_cast_current(x, activation, fmt, **hp)
        return ops.activation_cast(x, scale, activation, fmt, **hp)
    if current:
        return ops.activation_backward_cast_current(grad, x, activation, fmt, **hp)
    return ops.activation_backward_cast(grad, x, scale, activation, fmt, **hp)


@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_matches_fp64_emulation(activation, dtype, backward, current):
    rows, n = 67, 48
    width = 2 * n if activation == "swiglu" else n
    x = sample((rows, width), dtype, seed=rows + width)
    grad = sample((rows, n), dtype, seed=3) if backward else None
    fmt = "e5m2" if backward else "e4m3"
    scale = torch.tensor([5.5])
    q = run(activation, x, grad, scale, fmt, current)
    ref = reference(x, activation, grad)
    # The high-precision result: the fp64 value rounded to the dtype, up to the fp32 math's
    # few ulp (absolute near the derivatives' roots, relative to the factors' size).
    atol = 1e-6 * (float(grad.abs().max()) * float(x.abs().max()) if backward else 1.0)
    torch.testing.assert_close(q.out.double(), ref, rtol=RTOL[dtype], atol=atol)
    want_amax = ref.abs().max().item()
    assert q.amax.item() == pytest.approx(want_amax, rel=1e-6)
    if current:
        s = np.float32(MAX[fmt]) / np.float32(q.amax.item())
        assert q.scale_inv.item() == np.float32(1.0) / s
    else:
        s = np.float32(5.5)
        assert q.scale_inv.item() == np.float32(1.0) / s
    check_codes(q.rowwise, fp8_codes(ref, s, fmt))
    assert torch.equal(q.columnwise, q.rowwise.t())


def test_outputs_are_optional_and_amax_folds():
    x = sample((32, 64), torch.bfloat16, seed=1)
    full = ops.activation_cast(x, torch.tensor([2.0]), "swiglu", high_precision=True)
    only_col = ops.activation_cast(x, torch.tensor([2.0]), "swiglu", rowwise=False)
    assert only_col.rowwise is None and only_col.out is None
    assert torch.equal(only_col.columnwise, full.columnwise)
    big = torch.tensor([1e4])
    q = ops.activation_cast(x, torch.tensor([2.0]), "swiglu", amax=big)
    assert q.amax is big and big.item() == 1e4
    assert ops.activation_amax(x, "swiglu").item() == full.amax.item()


def test_nan_propagates_into_amax_and_codes():
    x = sample((16, 32), torch.float32, seed=2)
    x[3, 5] = float("nan")
    q = ops.activation_cast(x, torch.tensor([1.0]), "gelu")
    assert torch.isnan(q.amax).item() and q.rowwise[3, 5].item() == 0x7F


# ---------------------------------------------------------------------------------------------
# GPU == CPU, byte for byte.

def both_devices(fn, *tensors):
    cpu = fn(*tensors)
    gpu = fn(*(t.cuda() for t in tensors))
    return cpu, gpu


def assert_same(cpu, gpu):
    for name, a, b in zip(cpu._fields, cpu, gpu):
        if a is None:
            assert b is None, name
        else:
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                               b.cpu().view(torch.uint8) if b.dtype != torch.uint8 else b.cpu()), \
                name


def assert_gpu_equals_cpu(activation, x, grad, backward, current, high_precision=True):
    """The op on x (and grad, backward) gives the same bytes on the GPU as on the CPU."""
    scale = torch.tensor([3.0])
    fmt = "e5m2" if backward else "e4m3"

    def call(x, grad, scale):
        return run(activation, x, grad if backward else None, scale, fmt, current, high_precision)
    assert_same(*both_devices(call, x, grad, scale))


@requires_gpu
# (16, 64), (32, 96): a partial tile on the vector paths, row- and column-wise (a per-rank
# fused MLP's shape under tensor parallelism).
@pytest.mark.parametrize("shape", [(1, 16), (17, 32), (16, 64), (32, 96), (129, 160), (300, 512),
                                   (2050, 1024)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
@pytest.mark.parametrize("high_precision", [True, False], ids=["with_out", "fp8_only"])
def test_gpu_equals_cpu_bytes(shape, dtype, activation, backward, current, high_precision):
    rows, n = shape
    width = 2 * n if activation == "swiglu" else n
    x = sample((rows, width), dtype, seed=rows, specials=True)
    grad = sample((rows, n), dtype, seed=n, specials=True)
    assert_gpu_equals_cpu(activation, x, grad, backward, current, high_precision)


@requires_gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_gpu_equals_cpu_bytes_for_every_bf16_input(activation, backward, current):
    """bf16 activations look most inputs up in tables (activation_cast.cu): each of the 2^16
    bf16 values of x (SwiGLU: of the gate a), in order (segments of 8 wholly inside or outside
    the table) and shuffled (beside values outside it), gives the CPU's bytes."""
    every = (torch.arange(1 << 16) - (1 << 15)).to(torch.int16).view(torch.bfloat16)
    shuffled = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(5))]
    x = torch.cat([every, shuffled]).view(512, 256)
    if activation == "swiglu":
        x = torch.cat([x, sample((512, 256), torch.bfloat16, seed=9)], dim=1)  # [a | b]
    grad = sample((512, 256), torch.bfloat16, seed=8)
    assert_gpu_equals_cpu(activation, x, grad, backward, current)


# ---------------------------------------------------------------------------------------------
# Registration and errors.

def activation_op_samples(device):
    """(op, arguments) for each fused activation op (also used by test_op_registration.py)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 64, generator=g) * 3).bfloat16().to(device)
    dy = torch.randn(32, 32, generator=g).bfloat16().to(device)

    def f32(v):
        return torch.tensor([v], dtype=torch.float32, device=device)

    def u8(*shape):
        return torch.empty(*shape, dtype=torch.uint8, device=device)

    def hp(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device=device)
    return {
        "activation_cast": (x, f32(2.0), u8(32, 64), u8(64, 32), hp(32, 64), f32(0.0), f32(0.0),
                            0, 0),
        "activation_cast swiglu": (x, f32(2.0), u8(32, 32), None, None, None, f32(0.0), 1, 0),
        "activation_cast_current": (x, f32(7.0), 0.0, u8(32, 32), u8(32, 32), hp(32, 32),
                                    f32(0.0), 1, 0),
        "activation_amax": (x, f32(0.0), 0),
        "activation_backward_cast": (dy, x, f32(2.0), u8(32, 64), u8(64, 32), hp(32, 64),
                                     f32(0.0), f32(0.0), 1, 1),
        "activation_backward_cast_current": (dy, x[:, :32].contiguous(), f32(7.0), 1e-6,
                                             u8(32, 32), u8(32, 32), None, f32(0.0), 0, 1),
        "activation_backward_amax": (dy, x, f32(0.0), 1),
    }


@pytest.mark.parametrize("case", list(activation_op_samples("cpu")))
def test_opcheck(device, case):
    op = getattr(torch.ops.tpfp8, case.split()[0]).default
    opcheck(op, activation_op_samples(device)[case])


X = torch.zeros(8, 32)
BAD_CALLS = [
    (lambda: ops.activation_cast(torch.zeros(8, 33), torch.ones(1), "swiglu"), "must be even"),
    (lambda: ops.activation_cast(torch.zeros(8, 40), torch.ones(1)), "multiple of 16"),
    (lambda: ops.activation_backward_cast(torch.zeros(8, 20), torch.zeros(8, 40),
                                          torch.ones(1), "swiglu"), "multiple of 16"),
    (lambda: ops.activation_cast(X, torch.ones(1), "relu"), "activation must be one of"),
    (lambda: torch.ops.tpfp8.activation_cast(X, torch.ones(1), None, None, torch.empty(8, 32),
                                             None, None, 7, 0), "activation must be 0"),
    (lambda: ops.activation_backward_cast(torch.zeros(8, 32), X, torch.ones(1), "swiglu"),
     "grad must be the gradient"),
    (lambda: ops.activation_backward_cast(torch.zeros(8, 32).bfloat16(), X, torch.ones(1)),
     "grad must have input's dtype"),
    (lambda: ops.activation_cast(X, torch.ones(1), rowwise=False, columnwise=False),
     "at least one of"),
    (lambda: ops.activation_cast_current(X, amax=torch.ones(1), epsilon=-1.0), "epsilon"),
]


@pytest.mark.parametrize("call, message", BAD_CALLS)
def test_bad_input_raises_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_rejected_call_leaves_buffers_untouched():
    x = sample((8, 64), torch.float32, seed=4)
    row = torch.full((8, 64), 7, dtype=torch.uint8)
    amax, scale_inv = torch.tensor([1.5]), torch.tensor([2.5])
    with pytest.raises(ValueError, match="columnwise must be"):  # of the wrong shape
        torch.ops.tpfp8.activation_cast(x, torch.ones(1), row, row.clone(), None, amax,
                                        scale_inv, 0, 0)
    assert torch.all(row == 7) and amax.item() == 1.5 and scale_inv.item() == 2.5
