"""Shared pytest fixtures: device selection with a clear skip reason when no GPU is there."""
import os

import pytest
import torch

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
