"""tpfp8: FP8 tensor-parallel Linear for PyTorch on Hopper GPUs.

The native ops live in :mod:`tpfp8.ops` (and ``torch.ops.tpfp8``); FP8 formats in
:class:`tpfp8.Fp8Format`.
"""
import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import _C  # noqa: F401,E402  (registers the native ops in torch.ops.tpfp8)
from .formats import Fp8Format
from . import ops

__all__ = ["Fp8Format", "ops", "with_cuda"]
__version__ = "0.1.0"


def with_cuda() -> bool:
    """True when this build of tpfp8 has its CUDA kernels (else CPU references only)."""
    return bool(_C.with_cuda)
