"""Fake (meta) kernels of the native ops, for torch.compile and torch.library.opcheck.

Every tpfp8 op writes into tensors its caller passes and returns nothing, so tracing needs no
output shapes: a fake kernel only declares that the op exists off the real devices. The
arguments are checked once, by the C++ op when it runs.
"""
import torch

_OPS = ("quantize", "cast_transpose", "cast_transpose_current", "transpose_fp8", "dequantize",
        "amax", "delayed_scaling_update", "delayed_scaling_update_many", "gemm")


def _writes_only_its_arguments(*args, **kwargs) -> None:
    return None


for _name in _OPS:
    torch.library.register_fake(f"tpfp8::{_name}")(_writes_only_its_arguments)
