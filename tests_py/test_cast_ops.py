"""tpfp8.ops on CPU against the NumPy/float64 oracle, on GPU against the CPU op (bytes equal),
and the argument errors."""
import numpy as np
import pytest
import torch

from conftest import requires_gpu
from fp8_oracle import MAX, code_values, encode
from tpfp8 import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMATS = ["e4m3", "e5m2"]
SHAPES = [(1, 1), (1, 4097), (17, 33), (127, 129), (256, 512)]


def sample(shape, dtype, seed=0):
    """Random values over many magnitudes with inf, NaN, zeros and subnormals mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 600.0])
    if flat.numel():
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] = specials[torch.arange(idx.numel()) % specials.numel()]
    return x.to(dtype)


def oracle_cast(x, scale, fmt):
    with np.errstate(over="ignore"):  # overflow to inf saturates, as in the kernels
        v32 = x.float().numpy() * np.float32(scale)  # fp32 product, as the kernels form it
    return encode(v32, fmt)


def oracle_amax(x):
    a = np.abs(x.float().numpy().astype(np.float64))
    return np.nan if np.isnan(a).any() else (a.max() if a.size else 0.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_transpose_cpu_matches_oracle(shape, dtype, fmt):
    x = sample(shape, dtype, seed=shape[0] * 1000 + shape[1])
    scale = torch.tensor([0.37])
    q = ops.cast_transpose(x, scale, fmt)
    want = oracle_cast(x, 0.37, fmt)
    np.testing.assert_array_equal(q.rowwise.numpy(), want)
    np.testing.assert_array_equal(q.columnwise.numpy(), want.T)
    np.testing.assert_equal(q.amax.item(), np.float32(oracle_amax(x)))
    assert q.scale_inv.item() == np.float32(1.0) / np.float32(0.37)
    r = ops.quantize(x, scale, fmt)
    assert torch.equal(r.rowwise, q.rowwise)


def test_quantize_folds_into_existing_amax_and_is_saturating():
    x = torch.tensor([[1.0, -1000.0], [3.0, 4.0]])
    amax = torch.tensor([5000.0])
    q = ops.quantize(x, torch.tensor([1.0]), "e4m3", amax=amax)
    assert amax.item() == 5000.0 and q.amax is amax
    assert q.rowwise[0, 1].item() == 0xFE  # -448: saturated, not NaN
    assert ops.cast_transpose(x, torch.tensor([1.0]), rowwise=False).rowwise is None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_cpu_matches_oracle(fmt, dtype):
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    out = ops.dequantize(codes, torch.tensor([0.75]), fmt, dtype)
    want = torch.from_numpy((code_values(fmt) * 0.75).astype(np.float32)).reshape(16, 16)
    torch.testing.assert_close(out, want.to(dtype), equal_nan=True, rtol=0, atol=0)


def test_amax_and_transpose_cpu():
    x = sample((33, 65), torch.bfloat16, seed=3)
    x[torch.isnan(x)] = 1.0
    assert ops.amax(x).item() == np.float32(oracle_amax(x))
    codes = torch.randint(0, 256, (37, 19), dtype=torch.uint8)
    assert torch.equal(ops.transpose_fp8(codes), codes.t())
    assert torch.equal(ops.transpose_fp8(codes.view(torch.float8_e4m3fn)), codes.t())


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
def test_delayed_scaling_update_cpu(algo, margin):
    g = torch.Generator().manual_seed(1)
    hist = torch.rand(8, 5, generator=g) * 10
    hist[:, 1] = 0.0  # all-zero column keeps its scale
    hist[0, 2] = float("inf")  # a bad step: dropped (no roll, scale kept)
    hist[5, 3] = float("nan")  # an older bad entry (an old checkpoint): ignored by the max
    scale = torch.arange(1.0, 6.0)
    scale_inv = 1.0 / scale
    fp8_max = torch.tensor([MAX["e4m3"], MAX["e5m2"]] * 2 + [MAX["e4m3"]])
    h0, s0 = hist.clone(), scale.clone()
    ops.delayed_scaling_update(hist, scale, scale_inv, fp8_max, margin, algo)
    finite = h0.masked_fill(h0.isnan(), 0.0)
    amax = finite.max(0).values if algo == "max" else h0[0]
    want = torch.where(torch.isfinite(amax) & (amax > 0), fp8_max / amax * 2.0 ** -margin, s0)
    assert torch.equal(scale, want)
    assert torch.equal(scale_inv, 1.0 / want)
    rolled = [0, 1, 3, 4]
    torch.testing.assert_close(hist[1:, rolled], h0[:-1, rolled], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(hist[1:, 2], h0[1:, 2]) and torch.all(hist[0] == 0)


def oracle_current_scale(amax, fmt, epsilon=0.0):
    """Current scaling's fp32 scale from an amax, written from its definition."""
    a = np.float32(amax)
    if not (np.isfinite(a) and a > 0):
        return np.float32(1.0)
    with np.errstate(over="ignore"):
        s = np.float32(MAX[fmt]) / max(a, np.float32(epsilon))
    return min(s, np.finfo(np.float32).max)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("amax", [None, 0.0, float("inf"), float("nan"), 1e-45, 3e-3])
def test_cast_transpose_current_cpu_matches_oracle(dtype, fmt, amax):
    x = sample((17, 33), dtype, seed=7)
    x[~torch.isfinite(x)] = 3.0
    a = float(np.float32(oracle_amax(x))) if amax is None else amax
    eps = 1e-2 if amax == 3e-3 else 0.0  # epsilon wins over a smaller amax
    q = ops.cast_transpose_current(x, torch.tensor([a]), fmt, epsilon=eps)
    scale = oracle_current_scale(a, fmt, eps)
    np.testing.assert_array_equal(q.rowwise.numpy(), oracle_cast(x, scale, fmt))
    np.testing.assert_array_equal(q.columnwise.numpy(), oracle_cast(x, scale, fmt).T)
    assert q.scale_inv.item() == np.float32(1.0) / scale


# ---- dbias: the column sums of a cast, in the fixed order of kernels/cast.h -----------------

DBIAS_SHAPES = [(0, 16), (1, 1), (17, 33), (127, 129), (128, 64), (300, 70), (1157, 24)]


def oracle_dbias(x):
    """cast.h's order of additions written in NumPy float32: rows of tile t are
    128 t + 16 p + q; lane sums over p, pair sums of lanes, tile sums, then 8 groups of tiles.
    (Zero rows padding the last tile change no sum: no running sum is ever -0.)"""
    v = x.float().numpy()
    rows, cols = v.shape
    tiles = -(-rows // 128)
    padded = np.zeros((tiles * 128, cols), np.float32)
    padded[:rows] = v
    by_lane = padded.reshape(tiles, 8, 16, cols)
    with np.errstate(invalid="ignore", over="ignore"):
        lanes = np.zeros((tiles, 16, cols), np.float32)
        for p in range(8):
            lanes += by_lane[:, p]
        partial = np.zeros((tiles, cols), np.float32)
        for w in range(8):
            partial += lanes[:, 2 * w] + lanes[:, 2 * w + 1]
        out = np.zeros(cols, np.float32)
        for j in range(8):
            group = np.zeros(cols, np.float32)
            for t in range(j, tiles, 8):
                group += partial[t]
            out += group
    out[np.isnan(out)] = np.float32("nan")  # the canonical quiet NaN
    return torch.from_numpy(out)


def finite_sample(shape, dtype, seed):
    x = sample(shape, dtype, seed)
    x[~torch.isfinite(x)] = 1.0
    return x


@pytest.mark.parametrize("shape", DBIAS_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dbias_cpu_is_the_fixed_order_column_sum(shape, dtype):
    x = finite_sample(shape, dtype, seed=shape[0] + 7 * shape[1])
    db = torch.full((shape[1],), -1.0)
    q = ops.cast_transpose(x, torch.tensor([0.5]), "e5m2", dbias=db)
    assert torch.equal(db.view(torch.int32), oracle_dbias(x).view(torch.int32))
    exact = x.double().sum(0)
    depth = 8 + 1 + 8 + (-(-shape[0] // 128) + 7) // 8 + 8 + 1  # additions per element, at most
    assert torch.all((db.double() - exact).abs() <= depth * 2.0 ** -24 * x.double().abs().sum(0))
    plain = ops.cast_transpose(x, torch.tensor([0.5]), "e5m2")
    for a, b in zip(q, plain):
        assert torch.equal(a, b)  # the sums change nothing else
    # Current scaling sums the same way; bf16 / fp16 outputs are the fp32 sums rounded.
    for out_dtype in DTYPES:
        db2 = torch.empty(shape[1], dtype=out_dtype)
        ops.cast_transpose_current(x, ops.amax(x), "e4m3", dbias=db2)
        assert torch.equal(db2, db.to(out_dtype))


def test_dbias_cpu_specials():
    x = finite_sample((300, 8), torch.float32, seed=2)
    x[17, 0] = float("inf")
    x[18, 1], x[290, 1] = float("inf"), -float("inf")  # inf - inf in the tile reduction
    x[5, 2] = float("nan")
    x[:, 3] = -0.0
    db = torch.empty(8)
    ops.cast_transpose(x, torch.ones(1), "e4m3", dbias=db)
    assert db[0] == float("inf")
    assert db.view(torch.int32)[1:3].tolist() == [0x7FC00000] * 2
    assert db.view(torch.int32)[3] == 0
    assert torch.equal(db.view(torch.int32), oracle_dbias(x).view(torch.int32))


def many_state(n_modules, per_module, history_len, seed):
    g = torch.Generator().manual_seed(seed)
    hist = [torch.rand(per_module, history_len, generator=g) * 10 for _ in range(n_modules)]
    hist[0][0] = 0.0  # an all-zero history keeps its scale
    hist[-1][0, 1] = float("inf")
    scales = [torch.rand(per_module, generator=g) + 0.5 for _ in range(n_modules)]
    return hist, scales, [torch.empty(per_module) for _ in range(n_modules)]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_update_many_equals_one_batched_update(algo):
    # 70 modules x 2 tensors: more than one launch's worth (96 tensors).
    hist, scales, scale_invs = many_state(70, 2, 6, seed=3)
    fp8_max = [MAX["e4m3"], MAX["e5m2"]] * 70
    want_hist = torch.cat(hist).t().contiguous()
    want_scale, want_inv = torch.cat(scales), torch.empty(140)
    ops.delayed_scaling_update(want_hist, want_scale, want_inv, torch.tensor(fp8_max), 2, algo)
    ops.delayed_scaling_update_many(hist, scales, scale_invs, fp8_max, 2, algo)
    assert torch.equal(torch.cat(hist).t(), want_hist)
    assert torch.equal(torch.cat(scales), want_scale)
    assert torch.equal(torch.cat(scale_invs), want_inv)


ERRORS = [
    (lambda: ops.quantize(torch.zeros(4, dtype=torch.float32), torch.ones(1)), "must be 2-D"),
    (lambda: ops.quantize(torch.zeros(4, 4, dtype=torch.int32), torch.ones(1)),
     "float32, bfloat16 or float16"),
    (lambda: ops.quantize(torch.zeros(4, 8).t(), torch.ones(1)), "contiguous"),
    (lambda: ops.quantize(torch.zeros(4, 4), torch.ones(2)), "one-element float32"),
    (lambda: ops.quantize(torch.zeros(4, 4), torch.ones(1),
                          out=torch.empty(4, 5, dtype=torch.uint8)),
     "out must be Byte of shape"),
    (lambda: ops.quantize(torch.zeros(4, 4), torch.ones(1), "e3m4"), "unknown FP8 format"),
    (lambda: ops.dequantize(torch.zeros(4, dtype=torch.int16), torch.ones(1)), "torch.uint8"),
    (lambda: ops.dequantize(torch.zeros(4, dtype=torch.int8), torch.ones(1)), "torch.uint8"),
    (lambda: ops.dequantize(torch.zeros(4, 4, dtype=torch.float8_e5m2), torch.ones(1), "e4m3"),
     "holds E5M2 codes, but format E4M3"),
    (lambda: ops.gemm(torch.zeros(16, 16, dtype=torch.float8_e4m3fn),
                      torch.zeros(16, 16, dtype=torch.float8_e5m2), a_scale_inv=torch.ones(1),
                      b_scale_inv=torch.ones(1), b_format="e4m3"),
     "holds E5M2 codes, but format E4M3"),
    (lambda: ops.delayed_scaling_update(torch.zeros(4, 2), torch.ones(3), torch.ones(2),
                                        torch.ones(2)), "scale must be Float of shape"),
    (lambda: ops.delayed_scaling_update(torch.zeros(4, 2), torch.ones(2), torch.ones(2),
                                        torch.ones(2), amax_compute_algo="mean"),
     "amax_compute_algo"),
    (lambda: ops.delayed_scaling_update_many([torch.zeros(2, 4)], [torch.ones(2)], [],
                                             [448.0, 448.0]), "one scale and scale_inv"),
    (lambda: ops.delayed_scaling_update_many([torch.zeros(2, 4)], [torch.ones(2)],
                                             [torch.ones(2)], [448.0]), "one value per tensor"),
    (lambda: ops.delayed_scaling_update_many([torch.zeros(2, 4), torch.zeros(1, 5)],
                                             [torch.ones(2), torch.ones(1)],
                                             [torch.ones(2), torch.ones(1)], [448.0] * 3),
     "must be float32 \\[num_tensors, 4\\]"),
    (lambda: ops.cast_transpose_current(torch.zeros(4, 4), torch.ones(2)), "one-element float32"),
    (lambda: ops.cast_transpose_current(torch.zeros(4, 4), torch.ones(1), epsilon=-1.0),
     "epsilon must be >= 0"),
    (lambda: ops.cast_transpose(torch.zeros(4, 6), torch.ones(1), dbias=torch.empty(4)),
     "dbias must be Float of shape \\[6\\]"),
    (lambda: ops.cast_transpose_current(torch.zeros(4, 6), torch.ones(1),
                                        dbias=torch.empty(6, dtype=torch.int32)),
     "dbias must be float32, bfloat16 or float16"),
    (lambda: ops.delayed_scaling_update_many([torch.zeros(2, 4), torch.zeros(1, 4)],
                                             [torch.ones(3), torch.ones(3)],
                                             [torch.ones(3), torch.ones(3)], [448.0] * 3,
                                             scale_offsets=[0]),
     "scale_offsets needs one offset per history \\(2\\), got 1"),
]


def test_delayed_scaling_update_many_with_scale_offsets():
    """Slots of shared scale tensors (a layer's [3]: forward tensors 0-1, gradient 2) update as
    whole tensors would."""
    grad = many_state(1, 1, 6, seed=5)[0][0]
    fwd = torch.rand(2, 6, generator=torch.Generator().manual_seed(6)) * 10
    scale, scale_inv = torch.tensor([1.0, 2.0, 3.0]), torch.empty(3)
    want_scale, want_inv = scale.clone(), torch.empty(3)
    fp8_max = [448.0, 448.0, 57344.0]
    ops.delayed_scaling_update_many([fwd.clone(), grad.clone()], [want_scale[:2], want_scale[2:]],
                                    [want_inv[:2], want_inv[2:]], fp8_max)
    ops.delayed_scaling_update_many([fwd, grad], [scale, scale], [scale_inv, scale_inv], fp8_max,
                                    scale_offsets=[0, 2])
    assert torch.equal(scale, want_scale) and torch.equal(scale_inv, want_inv)


@pytest.mark.parametrize("call,message", ERRORS)
def test_bad_input_raises_clear_error(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_rejected_call_leaves_buffers_untouched():
    amax, scale_inv = torch.tensor([7.0]), torch.tensor([3.0])
    with pytest.raises(ValueError, match="out must be"):
        ops.quantize(torch.zeros(4, 4), torch.ones(1), out=torch.empty(4, 5, dtype=torch.uint8),
                     amax=amax, scale_inv=scale_inv)
    assert amax.item() == 7.0 and scale_inv.item() == 3.0


def test_buffers_that_share_memory_are_refused_and_left_untouched():
    """An output over the input or over another output: the kernels would read bytes they
    had overwritten, or keep one of two results (a transpose into its own input came back
    half transposed; amax and scale_inv in one slot lost the amax). Parts of one buffer that
    do not overlap are fine."""
    codes = torch.arange(16, dtype=torch.uint8).view(4, 4)
    with pytest.raises(ValueError, match="input and out share memory"):
        ops.transpose_fp8(codes, out=codes)
    assert torch.equal(codes, torch.arange(16, dtype=torch.uint8).view(4, 4))
    x, both_ = torch.randn(4, 4), torch.zeros(4, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="rowwise and columnwise share memory"):
        torch.ops.tpfp8.cast_transpose(x, torch.ones(1), both_, both_, None, None, 0, None)
    assert not both_.any()
    slot = torch.tensor([5.0])
    with pytest.raises(ValueError, match="amax and scale_inv share memory"):
        ops.quantize(x, torch.ones(1), amax=slot, scale_inv=slot)
    assert slot.item() == 5.0
    pair = torch.zeros(2)
    ops.quantize(x * 100, torch.tensor([2.0]), amax=pair[:1], scale_inv=pair[1:])
    assert pair.tolist() == [float(x.abs().max() * 100), 0.5]


def test_a_float8_tensor_is_decoded_as_its_own_format():
    """dequantize of a float8_e5m2 tensor decodes E5M2 (it used to take the default E4M3: 3.0
    came back 2.5), as torch's own conversion does; a contrary format is refused."""
    for dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
        x = torch.tensor([[3.0, -0.5, 96.0, 0.0]]).to(dtype)
        assert torch.equal(ops.dequantize(x, torch.ones(1)), x.float())


# ---- GPU: the CUDA op gives the CPU op's bytes -------------------------------------------

GPU_SHAPES = SHAPES + [(160, 136), (16, 8), (48, 4104), (4000, 4000), (4096, 4096), (4096, 4104),
                      (8191, 129)]


def both(fn, *tensors):
    cpu = fn(*tensors)
    gpu = fn(*(t.cuda() for t in tensors))
    return cpu, gpu


def assert_same_bytes(gpu, cpu):
    assert gpu.dtype == cpu.dtype and gpu.shape == cpu.shape
    assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))


@requires_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_cast_ops_equal_cpu_bytes(shape, dtype, fmt):
    x = sample(shape, dtype, seed=shape[0] + shape[1])
    scale = torch.tensor([1.37])
    cpu, gpu = both(lambda a, s: ops.cast_transpose(a, s, fmt), x, scale)
    for c, g in zip(cpu, gpu):
        assert_same_bytes(g, c)
    cpu, gpu = both(lambda a, s: ops.quantize(a, s, fmt), x, scale)
    assert_same_bytes(gpu.rowwise, cpu.rowwise)
    assert_same_bytes(gpu.amax, cpu.amax)
    cpu, gpu = both(lambda q, si: ops.dequantize(q, si, fmt, dtype), cpu.rowwise, cpu.scale_inv)
    assert_same_bytes(gpu, cpu)
    cpu, gpu = both(ops.transpose_fp8, ops.quantize(x, scale, fmt).rowwise)
    assert_same_bytes(gpu, cpu)
    cpu, gpu = both(ops.amax, x)
    assert_same_bytes(gpu, cpu)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_cast_transpose_current_equals_cpu_bytes(dtype, fmt):
    for shape in GPU_SHAPES:
        x = sample(shape, dtype, seed=shape[0])
        amax = ops.amax(x)  # NaN in the sample: scale 1, as the rule says
        for a in (amax, torch.tensor([2.5e-3]), torch.tensor([1e-45])):
            cpu, gpu = both(lambda t, m: ops.cast_transpose_current(t, m, fmt, epsilon=1e-6),
                            x, a)
            for c, g in zip(cpu, gpu):
                assert_same_bytes(g, c)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dbias_equals_cpu_bytes(dtype):
    """The fused column sums: the CPU op's bytes, the same every run, with either scaling and
    any choice of FP8 outputs (vector and element-wise paths, ragged and empty shapes)."""
    for shape in GPU_SHAPES + DBIAS_SHAPES:
        for x in (sample(shape, dtype, seed=shape[1]), finite_sample(shape, dtype, seed=3)):
            want = torch.empty(shape[1])
            ops.cast_transpose(x, torch.tensor([1.37]), "e5m2", dbias=want)
            xg, scale = x.cuda(), torch.tensor([1.37], device="cuda")
            for rowwise, columnwise in ((True, True), (True, False), (False, True)):
                for _ in range(2):
                    got = torch.empty(shape[1], device="cuda")
                    ops.cast_transpose(xg, scale, "e5m2", rowwise=rowwise,
                                       columnwise=columnwise, dbias=got)
                    assert_same_bytes(got, want)
            # A 16-bit dbias is torch's rounding of the same fp32 sums (CUDA's and the CPU's
            # roundings write NaN differently: compare with the device's own).
            got = torch.empty(shape[1], device="cuda", dtype=torch.bfloat16)
            ops.cast_transpose_current(xg, ops.amax(xg), "e4m3", dbias=got)
            assert_same_bytes(got, want.cuda().bfloat16().cpu())


@requires_gpu
def test_gpu_delayed_scaling_update_many_equals_cpu():
    hist, scales, scale_invs = many_state(70, 2, 1024, seed=4)
    gpu = [[t.cuda() for t in ts] for ts in (hist, scales, scale_invs)]
    fp8_max = [MAX["e4m3"], MAX["e5m2"]] * 70
    ops.delayed_scaling_update_many(hist, scales, scale_invs, fp8_max, 1)
    ops.delayed_scaling_update_many(*gpu, fp8_max, 1)
    for cpu_list, gpu_list in zip((hist, scales, scale_invs), gpu):
        for c, g in zip(cpu_list, gpu_list):
            assert_same_bytes(g, c)


@requires_gpu
def test_gpu_delayed_scaling_update_equals_cpu():
    g = torch.Generator().manual_seed(2)
    exponents = torch.randint(-20, 20, (1024, 33), generator=g)
    hist = torch.rand(1024, 33, generator=g) * torch.exp2(exponents)
    hist[:, 3] = 0.0
    args = [hist, torch.rand(33, generator=g) + 0.5, torch.empty(33), torch.full((33,), 448.0)]
    gpu_args = [a.cuda() for a in args]
    ops.delayed_scaling_update(*args, margin=1)
    ops.delayed_scaling_update(*gpu_args, margin=1)
    for c, gg in zip(args, gpu_args):
        assert_same_bytes(gg, c)


def _opcheck_cases():
    x = sample((16, 32), torch.bfloat16, seed=5)
    x[torch.isnan(x) | torch.isinf(x)] = 1.0
    def one(v=0.0):
        return torch.full((1,), v)
    codes = torch.randint(0, 126, (16, 32), dtype=torch.uint8)
    return [
        (torch.ops.tpfp8.quantize.default,
         (x, one(2.0), torch.empty(16, 32, dtype=torch.uint8), one(), one(), 0)),
        (torch.ops.tpfp8.cast_transpose.default,
         (x, one(2.0), torch.empty(16, 32, dtype=torch.uint8),
          torch.empty(32, 16, dtype=torch.uint8), one(), one(), 1)),
        (torch.ops.tpfp8.cast_transpose_current.default,
         (x, one(3.0), 0.0, torch.empty(16, 32, dtype=torch.uint8),
          torch.empty(32, 16, dtype=torch.uint8), one(), 0)),
        (torch.ops.tpfp8.cast_transpose.default,
         (x, one(2.0), None, torch.empty(32, 16, dtype=torch.uint8), one(), one(), 1,
          torch.empty(32))),
        (torch.ops.tpfp8.cast_transpose_current.default,
         (x, one(3.0), 0.0, torch.empty(16, 32, dtype=torch.uint8), None, one(), 0,
          torch.empty(32, dtype=torch.bfloat16))),
        (torch.ops.tpfp8.transpose_fp8.default, (codes, torch.empty(32, 16, dtype=torch.uint8))),
        (torch.ops.tpfp8.dequantize.default, (codes, one(0.5), 0, torch.empty(16, 32))),
        (torch.ops.tpfp8.amax.default, (x, one())),
        (torch.ops.tpfp8.delayed_scaling_update.default,
         (torch.rand(4, 3), torch.ones(3), torch.ones(3), torch.full((3,), 448.0), 0, True)),
        (torch.ops.tpfp8.delayed_scaling_update_many.default,
         ([torch.rand(2, 4), torch.rand(1, 4)], [torch.ones(2), torch.ones(1)],
          [torch.ones(2), torch.ones(1)], [448.0, 448.0, 57344.0], 0, True)),
        (torch.ops.tpfp8.delayed_scaling_update_many.default,
         ([torch.rand(2, 4), torch.rand(1, 4)], [torch.ones(3), torch.ones(3)],
          [torch.ones(3), torch.ones(3)], [448.0, 448.0, 57344.0], 0, True, [0, 2])),
        (torch.ops.tpfp8.gemm.default,
         (codes, codes, torch.empty(16, 16), one(0.5), one(0.25), 3, 3, None, False, False,
          False, False)),
    ]


@pytest.mark.parametrize("op,args", _opcheck_cases(), ids=lambda c: str(c)[:40])
def test_opcheck(op, args):
    """Schema (declared mutations), autograd registration, fake tensors, AOT dispatch."""
    torch.library.opcheck(op, args)
