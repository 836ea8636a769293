"""Shared pytest fixtures: device selection with a clear skip reason when no GPU is there."""
import pytest
import torch

import tpfp8


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    if not tpfp8.with_cuda():
        return "tpfp8 was built without CUDA (no nvcc at build time)"
    return None


requires_gpu = pytest.mark.skipif(gpu_skip_reason() is not None,
                                  reason=str(gpu_skip_reason()))
