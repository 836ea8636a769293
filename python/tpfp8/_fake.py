"""Fake (meta) kernels of the native ops, for torch.compile, torch.library.opcheck and the meta
device.

The cast and GEMM ops write into tensors their caller passes and return nothing: their fake
kernels only declare that the op exists off the real devices. The Linear's ops return new
tensors: their fake kernels give the shapes the C++ ops give (csrc/linear.cpp) and, for the
forward, run the same argument check (ValueError) the op runs. (``linear`` itself is reached
here only without autograd -- inference mode: with it, its C++ autograd kernel calls the two
others; the same for ``mlp``, LayerNormMLP's two Linears.)
"""
import torch
from torch.distributed import distributed_c10d

from . import _C

_WRITERS = ("quantize", "cast_transpose", "cast_transpose_current", "transpose_fp8",
            "dequantize", "amax", "delayed_scaling_update", "delayed_scaling_update_many", "gemm",
            "norm_cast", "norm_cast_current", "activation_cast", "activation_cast_current",
            "activation_amax", "activation_backward_cast", "activation_backward_cast_current",
            "activation_backward_amax")
OPS = _WRITERS + ("linear", "mlp", "linear_forward", "linear_backward", "norm_backward")
_COLUMN, _NONE = int(_C.ParallelMode.COLUMN), int(_C.Scaling.NONE)
_LAYER_NORM = int(_C.Prologue.LAYER_NORM)
_NORMS = (_LAYER_NORM, int(_C.Prologue.RMS_NORM))


def _on_one_device(*args) -> None:
    """Refuses tensors on several devices: with one on the meta device beside real ones the
    call comes here, where the native op's device check does not run, and writes nothing."""
    tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
               if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"a tpfp8 op got tensors on several devices "
                         f"({', '.join(sorted(map(str, devices)))}); put them on one")


def _writes_only_its_arguments(*args, **kwargs) -> None:
    _on_one_device(*args, *kwargs.values())


for _name in _WRITERS:
    torch.library.register_fake(f"tpfp8::{_name}")(_writes_only_its_arguments)


@torch.library.register_fake("tpfp8::norm_backward")
def _norm_backward(dy, x, mean, rstd, gamma, rms_norm, dx_add=None):
    _on_one_device(dy, x, mean, rstd, gamma, dx_add)
    dbeta = gamma.new_empty(0) if rms_norm else gamma.new_empty(gamma.shape)
    return x.new_empty(x.shape), gamma.new_empty(gamma.shape), dbeta


def _group_size(group_name: str) -> int:
    return distributed_c10d._resolve_process_group(group_name).size() if group_name else 1


def _static(*tensors) -> bool:
    return all(isinstance(d, int) for t in tensors if t is not None for d in t.shape)


def _at_hints(t):
    """`t`, or where its sizes are symbolic a stand-in of their values in the call being traced
    (the native check reads sizes as integers), without guarding them; None where one has no
    value (a data-dependent size: the op checks when it runs)."""
    if t is None or _static(t):
        return t
    hints = [d if isinstance(d, int) else d.node.hint for d in t.shape]
    return None if None in hints else t.new_empty(hints)


@torch.library.register_fake("tpfp8::linear_forward")
def _linear_forward(x, weight, bias, scale, amax_history, cache_rowwise, cache_columnwise,
                    cache_scale_inv, main_grad, scaling, fwd_format, grad_format, epsilon,
                    weight_cache, save_original_input, parallel_mode, sequence_parallel,
                    group_name, debug, need_dgrad, need_wgrad, prologue_weight=None,
                    prologue_bias=None, prologue=0, prologue_eps=0.0,
                    keep_prologue_output=False, residual=None):
    # The op's own check, at trace time: a call it would refuse fails to compile instead of
    # failing in the graph, where an op before it (an MLP's fc1) has written its FP8 state.
    # Symbolic sizes are checked at their values in this call...
    tensors = (x, weight, bias, scale, amax_history, cache_rowwise, cache_columnwise,
               cache_scale_inv, main_grad, prologue_weight, prologue_bias, residual)
    now = [_at_hints(t) for t in tensors]
    if all(n is not None or t is None for n, t in zip(now, tensors)):
        (x_, weight_, bias_, scale_, history_, rowwise_, columnwise_, cache_scale_inv_,
         main_grad_, prologue_weight_, prologue_bias_, residual_) = now
        _C.check_linear_forward(x_, weight_, bias_, scale_, history_, rowwise_, columnwise_,
                                cache_scale_inv_, main_grad_, scaling, fwd_format, grad_format,
                                epsilon, weight_cache, save_original_input, parallel_mode,
                                sequence_parallel, group_name, debug, prologue_weight_,
                                prologue_bias_, prologue, prologue_eps, residual_)
    n, k = weight.shape
    tp = _group_size(group_name) if sequence_parallel else 1
    shape = list(x.shape)
    shape[-1] = n
    if sequence_parallel:
        shape[0] = shape[0] * tp if parallel_mode == _COLUMN else shape[0] // tp
    if residual is not None:  # ... and the residual's shape guarded: another one recompiles
        for got, want in zip(residual.shape, shape, strict=True):
            torch._check(got == want, lambda: "residual must have the output's shape")
    rows = x.numel() // x.shape[-1]
    gathers = parallel_mode == _COLUMN and sequence_parallel

    def u8(*size):
        return x.new_empty(size, dtype=torch.uint8)

    def f32(*size):
        return x.new_empty(size, dtype=torch.float32)

    fp8 = scaling != _NONE
    x_fp8 = u8(0)
    if fp8 and need_wgrad and not save_original_input:
        if gathers and not debug:
            x_fp8 = u8(rows, k)  # this rank's rows, re-gathered in backward
        else:
            x_fp8 = u8(k, rows * tp if gathers else rows)
    uncached = fp8 and weight_cache == 0
    # A prologue's output (the GEMMs' input) where backward or the caller keeps it; a norm's
    # statistics.
    saves_hp = not fp8 or save_original_input or bool(debug)
    x_hp = x.new_empty(list(x.shape[:-1]) + [k]) if prologue and (
        keep_prologue_output or saves_hp) else x.new_empty(0)
    norm = prologue in _NORMS
    mean = f32(rows) if prologue == _LAYER_NORM else f32(0)
    rstd = f32(rows) if norm else f32(0)
    return (x.new_empty(shape), x_fp8, f32(1) if fp8 else f32(0),
            u8(k, n) if uncached and need_dgrad else u8(0), f32(1) if uncached else f32(0),
            x_hp, mean, rstd)


@torch.library.register_fake("tpfp8::linear_backward")
def _linear_backward(dy, x, x_fp8, x_scale_inv, weight, w_fp8, w_scale_inv, scale,
                     grad_amax_history, main_grad, main_grad_overwrite, scaling, fwd_format,
                     grad_format, epsilon, save_original_input, parallel_mode, sequence_parallel,
                     group_name, debug, x_shape, x_dtype, bias_dtype, need_dgrad, need_wgrad,
                     prologue_input=None, prologue_weight=None, prologue_bias=None, mean=None,
                     rstd=None, prologue=0, prologue_output_grad=None, handoff_scale=None,
                     handoff_grad_amax_history=None, handoff_rowwise=False,
                     handoff_columnwise=False, handoff_dbias=False, dy_rowwise=None,
                     dy_columnwise=None, dy_scale_inv=None, dy_dbias=None, input_grad=None):
    def nothing(dtype=None):  # (a placeholder for a gradient not asked for)
        return dy.new_empty(0, dtype=dtype)
    handoff = handoff_rowwise or handoff_columnwise
    if not need_dgrad or handoff:
        dx = nothing()
    elif prologue:
        dx = prologue_input.new_empty(prologue_input.shape)
    else:
        dx = dy.new_empty(x_shape, dtype=x_dtype)
    dw = weight.new_empty(weight.shape) if need_wgrad and main_grad is None else nothing()
    db = dy.new_empty(weight.shape[0], dtype=bias_dtype) if bias_dtype is not None else nothing()
    norm = need_dgrad and prologue in _NORMS
    dpw = prologue_weight.new_empty(prologue_weight.shape) if norm else nothing()
    dpb = prologue_bias.new_empty(prologue_bias.shape) if norm and prologue_bias is not None \
        else nothing()
    # The activation input's gradient in FP8 for the layer before (GradHandoff, csrc/linear.h).
    rows, cols = (prologue_input.numel() // prologue_input.shape[-1],
                  prologue_input.shape[-1]) if handoff else (0, 0)
    u8 = torch.uint8
    dx_rowwise = dy.new_empty(rows, cols, dtype=u8) if handoff_rowwise else nothing(u8)
    dx_columnwise = dy.new_empty(cols, rows, dtype=u8) if handoff_columnwise else nothing(u8)
    dx_scale_inv = dy.new_empty(1 if handoff else 0, dtype=torch.float32)
    dx_dbias = dy.new_empty(cols if handoff and handoff_dbias else 0, dtype=torch.float32)
    return dx, dw, db, dpw, dpb, dx_rowwise, dx_columnwise, dx_scale_inv, dx_dbias


@torch.library.register_fake("tpfp8::linear")
def _linear(x, weight, bias, scale, amax_history, grad_amax_history, replay, cache_rowwise,
            cache_columnwise, cache_scale_inv, main_grad, scaling, fwd_format, grad_format,
            epsilon, weight_cache, save_original_input, parallel_mode, sequence_parallel,
            group_name, debug, main_grad_overwrite, saves_input, need_dgrad, need_wgrad,
            prologue_weight=None, prologue_bias=None, prologue=0, prologue_eps=0.0,
            keep_prologue_output=False, residual=None):
    recompute = replay is not None
    out = _linear_forward(x, weight, bias, replay if recompute else scale,
                          None if recompute else amax_history, cache_rowwise, cache_columnwise,
                          cache_scale_inv, main_grad, scaling, fwd_format, grad_format, epsilon,
                          weight_cache, save_original_input, parallel_mode, sequence_parallel,
                          group_name, debug, need_dgrad, need_wgrad, prologue_weight,
                          prologue_bias, prologue, prologue_eps, keep_prologue_output, residual)
    return out[0], out[5]


@torch.library.register_fake("tpfp8::mlp")
def _mlp(x, *args):
    """Two ``linear`` calls, fc1's output fc2's input, fc2 adding the residual (the last
    argument; inference mode, as ``linear``)."""
    per_layer = (len(args) - 1) // 2
    y1, normalized = _linear(x, *args[:per_layer])
    y, _ = _linear(y1, *args[per_layer:2 * per_layer], residual=args[-1])
    return y, normalized
