"""Shared pytest fixtures: the `device` fixture (every test that takes it runs on the CPU and,
with a clear skip reason when there is none, on the GPU) and the GPU skip marker."""
import os

import pytest
import torch
from torch import nn

import tpfp8


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    if not tpfp8.with_cuda():
        return "tpfp8 was built without CUDA (no nvcc at build time)"
    return None


def package_root() -> str:
    """The folder the tested tpfp8 was imported from (the source tree, or a separate build such
    as the CPU-only one), for the PYTHONPATH of subprocesses."""
    return os.path.dirname(os.path.dirname(os.path.abspath(tpfp8.__file__)))


requires_gpu = pytest.mark.skipif(gpu_skip_reason() is not None,
                                  reason=str(gpu_skip_reason()))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=requires_gpu)])
def device(request) -> str:
    """The device a test runs on: "cpu" (the reference kernels), then "cuda"."""
    return request.param


def fp8_tight(device: str) -> float:
    """Bound for FP8 results against an exact emulation of the same casts: on the CPU only
    the summation order differs; cuBLASLt's FP8 GEMMs accumulate with ~14 mantissa bits
    between fp32 promotions (tests_py/test_gemm.py), so ~1e-4 on the GPU."""
    return 1e-5 if device == "cpu" else 1e-3


def make(k=32, n=48, bias=True, seed=0, **kw):
    """A tpfp8.Linear and an nn.Linear with the same weights."""
    torch.manual_seed(seed)
    lin = tpfp8.Linear(k, n, bias=bias, **kw)
    ref = nn.Linear(k, n, bias=bias)
    ref.load_state_dict(lin.state_dict(), strict=False)
    return lin, ref


def state_of(lin):
    """Copies of the layer's delayed-scaling scales and histories ([] before any)."""
    state = lin.fp8_state
    return [] if state is None else [state[d][k].clone() for d in ("forward", "backward")
                                     for k in ("scale", "amax_history")]


def capture_step(step, twin_step, grads_of, warmup=2):
    """A training step captured in one CUDA graph, as a user graphs one: `warmup` calls of
    `step()` on a side stream (each beside `twin_step()`, the eager twin's, kept in step), the
    gradients of the tensors in `grads_of` set to None (the captured backward then writes them
    rather than adds), then the capture on that stream. Returns (graph, step()'s output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
            twin_step()
        for t in grads_of:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out
