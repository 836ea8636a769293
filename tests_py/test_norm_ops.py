"""tpfp8.ops.norm_cast / norm_cast_current / norm_backward: the CPU op against a float64 norm and
the FP8 oracle, the GPU op against the CPU op (bytes equal), and the argument errors. (opcheck of
the three ops: tests_py/test_op_registration.py.)"""
import numpy as np
import pytest
import torch

from conftest import requires_gpu
from fp8_oracle import MAX, encode
from tpfp8 import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORMS = ["layernorm", "rmsnorm"]
SHAPES = [(1, 16), (17, 48), (40, 1040), (64, 4096)]
# The bound on |y - y64| in units of the output dtype's epsilon (1 for the final rounding, the
# rest for fp32 arithmetic and x - mean losing x's low bits).
EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def sample(shape, dtype, seed=0):
    """Rows with their own offset and spread, so LayerNorm's centering matters."""
    g = torch.Generator().manual_seed(seed)
    rows = shape[0]
    offset = torch.randn(rows, 1, generator=g) * 3
    spread = torch.exp2(torch.randn(rows, 1, generator=g) * 2)
    return (offset + spread * torch.randn(shape, generator=g)).to(dtype)


def weights(hidden, seed):
    g = torch.Generator().manual_seed(seed)
    return 1 + 0.5 * torch.randn(hidden, generator=g), 0.5 * torch.randn(hidden, generator=g)


def norm64(x, gamma, beta, rms, eps=1e-5):
    """(y, mean, rstd) in float64."""
    x = x.double()
    mean = torch.zeros(x.shape[0], dtype=torch.float64) if rms else x.mean(1)
    var = ((x - mean[:, None]) ** 2).mean(1)
    rstd = 1 / torch.sqrt(var + eps)
    y = (x - mean[:, None]) * rstd[:, None] * gamma.double()
    return (y if rms else y + beta.double()), mean, rstd


def run(x, norm, current, fmt="e4m3", scale=2.0, **kw):
    gamma, beta = weights(x.shape[1], x.shape[1])
    gamma, beta = gamma.to(x.device), beta.to(x.device)
    rms = norm == "rmsnorm"
    b = None if rms else beta
    if current:
        return ops.norm_cast_current(x, gamma, b, fmt, rms_norm=rms, **kw)
    s = torch.tensor([scale], device=x.device)
    return ops.norm_cast(x, gamma, b, s, fmt, rms_norm=rms, **kw)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_cpu_matches_fp64_norm_and_fp8_oracle(shape, dtype, norm, current):
    x = sample(shape, dtype, seed=shape[0] + shape[1])
    fmt = "e5m2" if current else "e4m3"
    r = run(x, norm, current, fmt)
    gamma, beta = weights(shape[1], shape[1])
    y64, mean64, rstd64 = norm64(x, gamma, beta, norm == "rmsnorm")
    # x - mean in fp32 loses the bits of x below mean's ulp: that error, times rstd * gamma.
    cancel = 2.0 ** -22 * (mean64.abs() * rstd64)[:, None] * gamma.double().abs()
    tol = 2 * EPS[dtype] * y64.abs() + 1e-6 + cancel
    assert ((r.out.double() - y64).abs() <= tol).all()
    torch.testing.assert_close(r.rstd.double(), rstd64, rtol=2e-6, atol=0)
    if norm == "layernorm":
        torch.testing.assert_close(r.mean.double(), mean64, rtol=1e-6, atol=1e-6)
    else:
        assert r.mean is None
    # The FP8 part is exact: the codes of the rounded output times the scale, in fp32.
    amax = np.float32(r.out.float().abs().max())
    assert r.amax.item() == amax
    scale = np.float32(MAX[fmt]) / amax if current else np.float32(2.0)
    want = encode(r.out.float().numpy() * scale, fmt)
    np.testing.assert_array_equal(r.rowwise.numpy(), want)
    np.testing.assert_array_equal(r.columnwise.numpy(), want.T)
    assert r.scale_inv.item() == np.float32(1.0) / scale


def test_outputs_are_optional_and_fold_into_amax():
    x = sample((8, 32), torch.bfloat16)
    full = run(x, "layernorm", False)
    amax = torch.tensor([1e6])
    part = run(x, "layernorm", False, out=False, columnwise=False, stats=False, amax=amax)
    assert part.out is None and part.columnwise is None and part.mean is None
    assert torch.equal(part.rowwise, full.rowwise) and amax.item() == 1e6
    plain = run(x, "rmsnorm", False, rowwise=False, columnwise=False)
    assert plain.rowwise is None and plain.mean is None and plain.rstd is not None


def test_nan_and_inf_rows_propagate():
    x = sample((4, 32), torch.float32)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    r = run(x, "layernorm", False)
    assert torch.isnan(r.out[1]).all() and torch.isnan(r.out[2]).all()
    assert torch.isfinite(r.out[[0, 3]]).all()
    assert (r.rowwise[1] == 0x7F).all() and torch.isnan(r.amax).all()


def as_bytes(t):
    return None if t is None else t.contiguous().view(torch.uint8).cpu()


@requires_gpu
@pytest.mark.parametrize("shape", [(1, 16), (17, 1040), (100, 3072), (256, 4096), (33, 8192),
                                   (2200, 8192), (4224, 8192), (20, 16384), (4500, 6160)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_gpu_bytes_equal_cpu(shape, dtype, norm, current):
    x = sample(shape, dtype, seed=7)
    if shape[0] > 8:
        x[5, 1] = float("nan")
    cpu = run(x, norm, current)
    gpu = run(x.cuda(), norm, current)
    for name in cpu._fields:
        a, b = as_bytes(getattr(cpu, name)), as_bytes(getattr(gpu, name))
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("norm", NORMS)
def test_backward_matches_autograd(device, norm):
    x = sample((24, 64), torch.float32, seed=3).double()
    gamma, beta = (w.double() for w in weights(64, 5))
    rms = norm == "rmsnorm"
    dy = torch.randn(24, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    xr, gr, br = (t.clone().requires_grad_(True) for t in (x, gamma, beta))
    y, _, _ = norm64(xr, gr, br, rms)
    y.backward(dy)
    r = run(x.float().to(device), norm, False, rowwise=False, columnwise=False)
    dx, dgamma, dbeta = ops.norm_backward(dy.float().to(device), x.float().to(device), r.mean,
                                          r.rstd, gamma.float().to(device), rms_norm=rms)
    torch.testing.assert_close(dx.double().cpu(), xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dgamma.double().cpu(), gr.grad, rtol=1e-4, atol=1e-4)
    if rms:
        assert dbeta is None
    else:
        torch.testing.assert_close(dbeta.double().cpu(), br.grad, rtol=1e-4, atol=1e-4)


def backward_inputs(shape, dtype, norm, device, seed=4):
    x = sample(shape, dtype, seed=seed)
    rms = norm == "rmsnorm"
    r = run(x, norm, False, rowwise=False, columnwise=False)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    gamma, _ = weights(shape[1], seed)
    mean = None if r.mean is None else r.mean.to(device)
    return dy.to(device), x.to(device), mean, r.rstd.to(device), gamma.to(device), rms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_backward_repeats_bit_for_bit(device, dtype, norm):
    # 2100 rows: 132 bands of 16 rows, the last short, summed in all 8 groups.
    args = backward_inputs((2100, 256), dtype, norm, device)
    first = ops.norm_backward(*args)
    for _ in range(2):
        again = ops.norm_backward(*args)
        for a, b in zip(first, again):
            assert (a is None and b is None) or torch.equal(as_bytes(a), as_bytes(b))
    assert first[0].dtype == dtype and first[1].dtype == torch.float32


@pytest.mark.parametrize("norm", NORMS)
def test_backward_of_no_rows(device, norm):
    dy, x, mean, rstd, gamma, rms = backward_inputs((0, 64), torch.bfloat16, norm, device)
    dx, dgamma, dbeta = ops.norm_backward(dy, x, mean, rstd, gamma.bfloat16(), rms_norm=rms)
    assert dx.shape == (0, 64) and dx.dtype == torch.bfloat16
    assert dgamma.dtype == torch.bfloat16 and torch.equal(as_bytes(dgamma), as_bytes(
        torch.zeros(64, dtype=torch.bfloat16)))
    assert dbeta is None if rms else torch.equal(as_bytes(dbeta), as_bytes(dgamma))


def test_backward_of_a_dy_in_another_dtype_reads_both_in_fp32(device):
    dy, x, mean, rstd, gamma, _ = backward_inputs((24, 64), torch.bfloat16, "layernorm", device)
    mixed = ops.norm_backward(dy.float(), x, mean, rstd, gamma)
    fp32 = ops.norm_backward(dy.float(), x.float(), mean, rstd, gamma)
    assert mixed[0].dtype == torch.bfloat16
    assert torch.equal(mixed[0], fp32[0].bfloat16())
    assert torch.equal(mixed[1], fp32[1]) and torch.equal(mixed[2], fp32[2])


def skip_gradient(shape, dtype, device, seed=9):
    """A gradient reaching x past the norm (dx_add): values that change every dx's bits."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_backward_adds_dx_add_before_its_one_rounding(device, dtype, norm):
    """dx_add is added to the fp32 dx, then rounded once: the kernel run in fp32 (the same
    fp32 dx, written unrounded), plus dx_add in fp32, rounded to dtype, bit for bit; dgamma
    and dbeta as without it."""
    dy, x, mean, rstd, gamma, rms = backward_inputs((300, 1040), dtype, norm, device)
    add = skip_gradient(x.shape, dtype, device)
    got = ops.norm_backward(dy, x, mean, rstd, gamma, rms, dx_add=add)
    fp32 = ops.norm_backward(dy.float(), x.float(), mean, rstd, gamma, rms)
    assert torch.equal(as_bytes(got[0]), as_bytes((fp32[0] + add.float()).to(dtype)))
    plain = ops.norm_backward(dy, x, mean, rstd, gamma, rms)
    for a, b in zip(got[1:], plain[1:]):
        assert (a is None and b is None) or torch.equal(as_bytes(a), as_bytes(b))
    assert not torch.equal(got[0], plain[0])


@requires_gpu
@pytest.mark.parametrize("shape", [(1, 16), (17, 1040), (2100, 256), (300, 4096), (33, 8192),
                                   (20, 16384), (0, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dx_add", [False, True])
def test_backward_gpu_bytes_equal_cpu(shape, dtype, norm, dx_add):
    cpu_args = backward_inputs(shape, dtype, norm, "cpu")
    add = skip_gradient(shape, dtype, "cpu") if dx_add else None
    cpu = ops.norm_backward(*cpu_args, dx_add=add)
    gpu_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cpu_args]
    gpu = ops.norm_backward(*gpu_args, dx_add=None if add is None else add.cuda())
    for name, a, b in zip(("dx", "dgamma", "dbeta"), cpu, gpu):
        assert (a is None and b is None) or torch.equal(as_bytes(a), as_bytes(b)), name


@requires_gpu
def test_backward_gpu_dx_add_off_the_16_byte_path_equals_cpu():
    """A dx_add 16-byte aligned or not (an offset view, made contiguous as it is): both the
    vector and the element path of the kernel."""
    cpu_args = backward_inputs((64, 1040), torch.bfloat16, "rmsnorm", "cpu")
    add = skip_gradient((64 * 1040 + 1,), torch.bfloat16, "cpu")[1:].view(64, 1040)
    cpu = ops.norm_backward(*cpu_args, dx_add=add)
    gpu_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cpu_args]
    storage = add.cuda().view(-1)
    shifted = torch.empty(storage.numel() + 1, dtype=storage.dtype, device="cuda")[1:]
    shifted.copy_(storage)
    gpu = ops.norm_backward(*gpu_args, dx_add=shifted.view(64, 1040))
    assert torch.equal(as_bytes(cpu[0]), as_bytes(gpu[0]))


def test_bad_dx_add_is_a_clear_error():
    dy, x, mean, rstd, gamma, rms = backward_inputs((24, 64), torch.bfloat16, "layernorm", "cpu")
    for bad in (torch.zeros(24, 64), torch.zeros(24, 48, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match=r"dx_add must be BFloat16 of x's shape \[24, 64\]"):
            ops.norm_backward(dy, x, mean, rstd, gamma, rms, dx_add=bad)


def test_bad_inputs_raise_clear_errors_and_change_nothing():
    x = sample((4, 32), torch.float32)
    gamma, beta = weights(32, 0)
    s = torch.tensor([1.0])
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.norm_cast(sample((4, 24), torch.float32), gamma[:24], None, s)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.norm_cast(torch.zeros(2, 16400), torch.ones(16400), None, s)
    with pytest.raises(ValueError, match="RMSNorm has no beta"):
        ops.norm_cast(x, gamma, beta, s, rms_norm=True)
    with pytest.raises(ValueError, match=r"gamma must be 1-D \[hidden=32\]"):
        ops.norm_cast(x, gamma[:16], None, s)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        ops.norm_cast(x, gamma, None, s, eps=-1.0)
    with pytest.raises(ValueError, match="must be 2-D"):
        ops.norm_cast(x.view(2, 2, 32), gamma, None, s)
    amax = torch.tensor([5.0])
    rowwise = torch.full((4, 32), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match="columnwise must be"):
        torch.ops.tpfp8.norm_cast(x, gamma, None, False, 1e-5, s, None, rowwise,
                                  torch.empty(4, 32, dtype=torch.uint8), amax, None, None,
                                  None, 0)
    assert amax.item() == 5.0 and (rowwise == 7).all()
    with pytest.raises(ValueError, match="needs the mean"):
        ops.norm_backward(x, x, None, torch.ones(4), gamma, rms_norm=False)
    with pytest.raises(ValueError, match="norm_backward needs hidden"):
        ops.norm_backward(x[:, :24], x[:, :24], None, torch.ones(4), gamma[:24], rms_norm=True)
