"""tpfp8: FP8 tensor-parallel Linear for PyTorch on Hopper GPUs.

``tpfp8.Linear`` is a drop-in ``torch.nn.Linear`` that computes in FP8 inside
``tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling() | tpfp8.CurrentScaling())``;
``tpfp8.LayerNormLinear`` / ``RMSNormLinear`` / ``LayerNormMLP`` / ``MLP`` fuse the norm and
the activation in front of their GEMMs with the FP8 casts;
``tpfp8.swap_linear(model)`` converts a model's ``nn.Linear`` layers, and
``tpfp8.checkpoint(block, *inputs)`` checkpoints activations of FP8 blocks. The native ops live
in :mod:`tpfp8.ops` (and ``torch.ops.tpfp8``).
"""
import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import _build_check  # noqa: F401  (refuses a torch without the CUDA build _C needs)
from . import _C  # noqa: F401,E402  (registers the native ops in torch.ops.tpfp8)
from . import _fake  # noqa: F401  (their fake kernels, for torch.compile)
from .formats import Fp8Format
from . import ops
from . import parallel
from . import debug
from .autocast import checkpoint, fp8_autocast
from .module import Linear, load_fp8_state, swap_linear
from .fused import (ActivationLinear, LayerNormLinear, LayerNormMLP, MLP, RMSNormLinear,
                    swap_fused)
from .recipe import CurrentScaling, DelayedScaling

__all__ = ["ActivationLinear", "CurrentScaling", "DelayedScaling", "Fp8Format", "LayerNormLinear",
           "LayerNormMLP", "Linear", "MLP", "RMSNormLinear", "checkpoint", "debug", "fp8_autocast",
           "load_fp8_state", "ops", "parallel", "swap_fused", "swap_linear", "with_cuda"]
__version__ = "0.1.0"


def with_cuda() -> bool:
    """True when this build of tpfp8 has its CUDA kernels (else CPU references only)."""
    return bool(_C.with_cuda)
