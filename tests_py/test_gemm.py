"""tpfp8.ops.gemm: the CPU reference against float64 math, cuBLASLt against the CPU reference
on the same FP8 bytes, and the argument errors."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import package_root, requires_gpu
from fp8_oracle import code_values
from tpfp8 import ops

FP8_PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]


def rand(shape, seed, dtype=torch.float32):
    """Random values, never zero (a zero hides an unwritten or mis-indexed element)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x).to(dtype)


def fp8_operand(shape, fmt, seed, transposed_like=False):
    x = rand(shape, seed)
    scale = torch.tensor([{"e4m3": 64.0, "e5m2": 4096.0}[fmt] / float(x.abs().max())])
    q = ops.quantize(x, scale, fmt)
    return q.rowwise, q.scale_inv


def decoded(codes, fmt, scale_inv):
    return code_values(fmt)[codes.numpy()] * float(scale_inv)


def rel_err(got, want):
    got, want = got.double().cpu(), torch.as_tensor(want).double()
    assert not torch.isnan(got).any(), "NaN in the result (an unwritten or overflowed element)"
    return float((got - want).norm() / want.norm())


# ---- CPU reference --------------------------------------------------------------------

@pytest.mark.parametrize("fa,fb", FP8_PAIRS)
def test_cpu_fp8_gemm_matches_float64(fa, fb):
    a, sa = fp8_operand((17, 48), fa, 1)
    b, sb = fp8_operand((32, 48), fb, 2)
    bias = rand((32,), 3, torch.bfloat16)
    d = ops.gemm(a, b, a_format=fa, b_format=fb, a_scale_inv=sa, b_scale_inv=sb, bias=bias,
                 out_dtype=torch.float32)
    want = decoded(a, fa, sa) @ decoded(b, fb, sb).T + bias.double().numpy()
    assert rel_err(d, want) < 1e-7


@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_cpu_high_precision_layouts_and_accumulate(a_t, b_t):
    a, b = rand((9, 20), 4), rand((13, 20), 5)
    a_in = a.t().contiguous() if a_t else a
    b_in = b.t().contiguous() if b_t else b
    d = ops.gemm(a_in, b_in, a_transposed=a_t, b_transposed=b_t, out_dtype=torch.float32)
    want = a.double() @ b.double().T
    assert rel_err(d, want) < 1e-6
    ops.gemm(a_in, b_in, out=d, accumulate=True, a_transposed=a_t, b_transposed=b_t)
    assert rel_err(d, 2 * want) < 1e-6


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cpu_residual_is_added_before_the_one_rounding(out_dtype):
    a, sa = fp8_operand((17, 48), "e4m3", 1)
    b, sb = fp8_operand((32, 48), "e4m3", 2)
    bias, residual = rand((32,), 3, torch.bfloat16), rand((17, 32), 4, out_dtype)
    kw = dict(a_format="e4m3", b_format="e4m3", a_scale_inv=sa, b_scale_inv=sb, bias=bias,
              out_dtype=out_dtype)
    d = ops.gemm(a, b, residual=residual, **kw)
    exact = (decoded(a, "e4m3", sa) @ decoded(b, "e4m3", sb).T + bias.double().numpy()
             + residual.double().numpy())
    assert torch.equal(d, torch.from_numpy(exact).to(out_dtype))  # (fp64 sum, rounded once)
    assert torch.equal(residual, rand((17, 32), 4, out_dtype))  # (read, never written)
    del kw["out_dtype"]  # (then the residual's)
    assert torch.equal(ops.gemm(a, b, residual=residual, **kw), d)


def test_accept_float8_dtypes_directly():
    a, sa = fp8_operand((16, 32), "e4m3", 6)
    b, sb = fp8_operand((16, 32), "e5m2", 7)
    d1 = ops.gemm(a.view(torch.float8_e4m3fn), b.view(torch.float8_e5m2), a_scale_inv=sa,
                  b_scale_inv=sb)
    d2 = ops.gemm(a, b, a_format="e4m3", b_format="e5m2", a_scale_inv=sa, b_scale_inv=sb)
    assert torch.equal(d1, d2)


def _fp8(shape, fmt="e4m3"):
    return fp8_operand(shape, fmt, 11)


ERRORS = [
    (lambda: ops.gemm(*[_fp8((16, 24))[0]] * 2, a_format="e4m3", b_format="e4m3",
                      a_scale_inv=torch.ones(1), b_scale_inv=torch.ones(1)),
     r"multiple of 16, got K=24"),
    (lambda: ops.gemm(_fp8((16, 32))[0], _fp8((24, 32))[0], a_format="e4m3", b_format="e4m3",
                      a_scale_inv=torch.ones(1), b_scale_inv=torch.ones(1)),
     r"multiple of 16, got N=24"),
    (lambda: ops.gemm(_fp8((16, 32))[0], _fp8((16, 32))[0], a_format="e5m2", b_format="e5m2",
                      a_scale_inv=torch.ones(1), b_scale_inv=torch.ones(1)), "two e5m2"),
    (lambda: ops.gemm(_fp8((16, 32))[0], _fp8((32, 16))[0], a_format="e4m3", b_format="e4m3",
                      a_scale_inv=torch.ones(1), b_scale_inv=torch.ones(1), b_transposed=True),
     "TN only"),
    (lambda: ops.gemm(_fp8((16, 32))[0], rand((16, 32), 1), a_format="e4m3",
                      a_scale_inv=torch.ones(1)), "cannot mix"),
    (lambda: ops.gemm(_fp8((16, 32))[0], _fp8((16, 32))[0], a_format="e4m3", b_format="e4m3"),
     "needs its scale_inv"),
    (lambda: ops.gemm(rand((4, 8), 1), rand((4, 8), 2, torch.bfloat16)), "one dtype"),
    (lambda: ops.gemm(rand((4, 8), 1), rand((4, 6), 2)), "K=8 but B over K=6"),
    (lambda: ops.gemm(rand((4, 8), 1), rand((4, 8), 2), out=torch.empty(4, 5)),
     "out must be Float of shape"),
    (lambda: ops.gemm(rand((4, 8), 1), rand((4, 8), 2), out_dtype=torch.float32,
                      bias=torch.ones(5)), r"bias must be \[N\]"),
    (lambda: ops.gemm(torch.zeros(4, 16, dtype=torch.uint8), rand((4, 16), 2)), "FP8 format"),
    (lambda: ops.gemm(rand((4, 8), 1), rand((5, 8), 2), out_dtype=torch.float32,
                      residual=torch.ones(4, 5, dtype=torch.bfloat16)),
     "residual must be Float of shape"),
    (lambda: ops.gemm(rand((4, 8), 1), rand((5, 8), 2), out_dtype=torch.float32,
                      residual=torch.ones(5, 4)), r"residual must be Float of shape \[4, 5\]"),
    (lambda: ops.gemm(rand((4, 8), 1), rand((5, 8), 2), out_dtype=torch.float32,
                      residual=torch.ones(5, 4).t()), "residual must be contiguous"),
    (lambda: ops.gemm(rand((4, 8), 1), rand((5, 8), 2), out=torch.ones(4, 5), accumulate=True,
                      residual=torch.ones(4, 5)), "not both"),
    (lambda: (lambda out: ops.gemm(rand((4, 8), 1), rand((5, 8), 2), out=out, residual=out))(
        torch.ones(4, 5)), "shares memory with out"),
]


@pytest.mark.parametrize("call,message", ERRORS)
def test_bad_gemm_raises_clear_error(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


# ---- GPU: cuBLASLt against the CPU reference on the same bytes --------------------------

GPU_SHAPES = [(1, 16, 16), (16, 32, 64), (17, 48, 80), (4096, 16, 8192), (64, 8192, 16),
              (4096, 1024, 2048), (17, 8192, 8192)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}


def gpu_vs_cpu(a, b, out_dtype, bias=None, accumulate=False, return_rows=False, **kw):
    """Runs on both devices; for large M the CPU reference covers a sample of rows."""
    m, n = a.shape[0], b.shape[0]
    rows = torch.arange(m) if m <= 256 else torch.randperm(m)[:128].sort().values
    init = rand((m, n), 99, out_dtype)
    gpu_out = init.cuda() if accumulate else torch.full((m, n), float("nan"), dtype=out_dtype,
                                                        device="cuda")
    def cuda(t):
        return None if t is None else t.cuda()
    ops.gemm(a.cuda(), b.cuda(), out=gpu_out, bias=cuda(bias), accumulate=accumulate,
             **{k: cuda(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    cpu_out = init[rows].clone()
    if kw.get("residual") is not None:  # (row-wise, as A)
        kw = dict(kw, residual=kw["residual"][rows].contiguous())
    ops.gemm(a[rows].contiguous(), b, out=cpu_out, bias=bias, accumulate=accumulate, **kw)
    return (gpu_out.cpu()[rows], cpu_out) + ((rows,) if return_rows else ())


# Hopper's FP8 tensor cores keep about 14 mantissa bits while they accumulate inside one
# promotion interval (cuBLASLt's "split" accumulation then adds those partial sums in fp32;
# "fast" accumulation never promotes). So FP8 results differ from an exact fp32 sum by ~2^-14
# relative per element with split accumulation and by more, growing with K, with fast
# accumulation -- measured on the H200: up to 3.3e-4 (split) and 6.3e-3 (fast, K=1024)
# normwise. The bounds below are those physics plus margin, and every case is also held to
# the error of torch._scaled_mm (the vendor path through the same library) on the same bytes.
FP8_BOUND = {False: 1e-3, True: 2e-2}


def scaled_mm_error(a, b, fa, fb, sa, sb, fast_accum, want, rows):
    """Normwise error of torch._scaled_mm (fp32 out) on the same FP8 bytes and scales."""
    dt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    ref = torch._scaled_mm(a.cuda().view(dt[fa]), b.cuda().view(dt[fb]).t(),
                           scale_a=sa.cuda(), scale_b=sb.cuda(), out_dtype=torch.float32,
                           use_fast_accum=fast_accum)
    return rel_err(ref.cpu()[rows], want)


@requires_gpu
@pytest.mark.parametrize("m,k,n", GPU_SHAPES)
@pytest.mark.parametrize("fa,fb", FP8_PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gpu_fp8_gemm_matches_cpu(m, k, n, fa, fb, out_dtype, fast_accum):
    a, sa = fp8_operand((m, k), fa, m + k)
    b, sb = fp8_operand((n, k), fb, n + 3 * k)
    bias = rand((n,), 5, torch.bfloat16) if (m + n) % 2 else None
    got, want, rows = gpu_vs_cpu(a, b, out_dtype, bias=bias, a_format=fa, b_format=fb,
                                 a_scale_inv=sa, b_scale_inv=sb, fast_accum=fast_accum,
                                 return_rows=True)
    err = rel_err(got, want)
    assert err <= max(TOL[out_dtype], FP8_BOUND[fast_accum])
    if out_dtype == torch.float32 and bias is None:
        assert err <= 2 * scaled_mm_error(a, b, fa, fb, sa, sb, fast_accum, want, rows) + 1e-6


@requires_gpu
@pytest.mark.parametrize("m,k,n", GPU_SHAPES[:5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gpu_high_precision_gemm_matches_cpu(m, k, n, dtype, accumulate):
    a, b = rand((m, k), 1, dtype), rand((n, k), 2, dtype)
    got, want = gpu_vs_cpu(a, b, torch.float32, bias=rand((n,), 3), accumulate=accumulate)
    assert rel_err(got, want) <= 1e-5


@requires_gpu
def test_gpu_fp8_accumulate_into_fp32_main_grad():
    a, sa = fp8_operand((256, 512), "e5m2", 1)
    b, sb = fp8_operand((128, 512), "e4m3", 2)
    got, want = gpu_vs_cpu(a, b, torch.float32, accumulate=True, a_format="e5m2",
                           b_format="e4m3", a_scale_inv=sa, b_scale_inv=sb)
    assert rel_err(got, want) <= FP8_BOUND[False]


@requires_gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fp8_residual_matches_cpu(out_dtype, bias):
    a, sa = fp8_operand((200, 512), "e4m3", 1)  # (<= 256 rows: the CPU checks them all)
    b, sb = fp8_operand((384, 512), "e4m3", 2)
    # (larger than the product, ~20: a residual dropped or added twice is far outside the bound)
    residual = (64 * rand((200, 384), 7)).to(out_dtype)
    got, want = gpu_vs_cpu(a, b, out_dtype, bias=rand((384,), 5, torch.bfloat16) if bias else None,
                           a_format="e4m3", b_format="e4m3", a_scale_inv=sa, b_scale_inv=sb,
                           residual=residual, fast_accum=True)
    assert rel_err(got, want) <= max(TOL[out_dtype], FP8_BOUND[True])
    assert rel_err(got, want.double() - residual.double()) > 1.0


@requires_gpu
def test_gpu_gemm_is_cuda_graph_capturable():
    a, sa = fp8_operand((512, 256), "e4m3", 1)
    b, sb = fp8_operand((384, 256), "e4m3", 2)
    a, b, sa, sb = a.cuda(), b.cuda(), sa.cuda(), sb.cuda()
    out = torch.empty(512, 384, dtype=torch.bfloat16, device="cuda")
    def run():
        return ops.gemm(a, b, out=out, a_format="e4m3", b_format="e4m3", a_scale_inv=sa,
                               b_scale_inv=sb, fast_accum=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # warm-up on the capture stream: plan and workspace are made here
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    want = out.clone()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


SEARCH_SCRIPT = """
import torch
from tpfp8 import ops
from test_gemm import fp8_operand, gpu_vs_cpu, rel_err, FP8_BOUND
for fast_accum, (m, k, n) in [(True, (512, 256, 384)), (False, (300, 512, 128))]:
    a, sa = fp8_operand((m, k), "e4m3", 1)
    b, sb = fp8_operand((n, k), "e5m2", 2)
    got, want = gpu_vs_cpu(a, b, torch.bfloat16, bias=torch.ones(n, dtype=torch.bfloat16),
                           a_format="e4m3", b_format="e5m2", a_scale_inv=sa, b_scale_inv=sb,
                           fast_accum=fast_accum)
    print("err", rel_err(got, want), max(2.0 ** -8, FP8_BOUND[fast_accum]))
"""


@requires_gpu
def test_gpu_gemm_search_mode_sweeps_and_stays_correct():
    """TPFP8_GEMM_AUTOTUNE=search (read once a process, hence the subprocess): each new shape
    says on stderr how many configurations it times, and the chosen one matches the CPU
    reference as the heuristic's does."""
    env = dict(os.environ, TPFP8_GEMM_AUTOTUNE="search",
               PYTHONPATH=os.pathsep.join([package_root(), os.path.dirname(__file__)]))
    proc = subprocess.run([sys.executable, "-c", SEARCH_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    swept = re.findall(r"timing (\d+) cuBLASLt configurations for the GEMM M=(\d+)", proc.stderr)
    assert [m for _, m in swept] == ["512", "300"], proc.stderr
    assert all(int(count) > 8 for count, _ in swept), proc.stderr  # more than the heuristic's
    errors = [tuple(map(float, line.split()[1:])) for line in proc.stdout.splitlines()]
    assert len(errors) == 2 and all(err <= bound for err, bound in errors), proc.stdout


LOG_SCRIPT = """
import torch
from tpfp8 import ops
a = torch.randn(272, 384, device="cuda", dtype=torch.bfloat16)
b = torch.randn(208, 384, device="cuda", dtype=torch.bfloat16)
out = torch.zeros(272, 208, device="cuda", dtype=torch.float32)
for _ in range(2):  # the second call reuses the plan and says nothing
    ops.gemm(a, b, out_dtype=torch.bfloat16)
ops.gemm(a, b, out=out, accumulate=True)
torch.cuda.synchronize()
"""


@requires_gpu
def test_gpu_gemm_log_names_each_new_plan_and_how_it_was_chosen():
    """TPFP8_GEMM_LOG=1 (read once a process): one stderr line per new plan, naming the shape,
    the configuration and either the candidates' times (the chosen one starred, also the
    fastest) or why none were timed; a plan reused logs nothing."""
    env = dict(os.environ, TPFP8_GEMM_LOG="1", PYTHONPATH=package_root())
    env.pop("TPFP8_GEMM_AUTOTUNE", None)  # the default mode, which times the candidates
    proc = subprocess.run([sys.executable, "-c", LOG_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tpfp8 GEMM ")]
    assert len(lines) == 2, proc.stderr
    timed, accumulated = lines
    plan = "tpfp8 GEMM M=272 N=208 K=384 bfloat16 x bfloat16 -> "
    assert timed.startswith(plan + "bfloat16: algo "), timed
    assert re.search(r" tile \d+ stages \d+ cluster \d+ swizzle \d+ custom \d+ split-k \d+;",
                     timed), timed
    if "the only candidate" not in timed:
        times = re.search(r"us a call:(.*)$", timed).group(1).split()
        chosen = [float(t[1:]) for t in times if t.startswith("*")]
        others = [float(t) for t in times if not t.startswith("*") and float(t) >= 0]
        assert len(chosen) == 1 and chosen[0] > 0 and all(chosen[0] <= t for t in others), timed
    assert accumulated.startswith(plan + "float32 accumulate: algo "), accumulated
    assert accumulated.endswith("the heuristic's first (not timed: D accumulates)"), accumulated
