"""Python entry points of the native FP8 ops, allocating outputs the caller does not pass.

FP8 data is ``torch.uint8`` holding the codes (view it as ``torch.float8_e4m3fn`` /
``torch.float8_e5m2`` where torch has them). Every op runs on the input's device: the CUDA
kernel for CUDA tensors, the bit-identical CPU reference for CPU tensors. Nothing here
synchronises with the host.
"""
from typing import NamedTuple, Optional

import torch

from . import _C
from .formats import Fp8Format

_ops = torch.ops.tpfp8


class Quantized(NamedTuple):
    """Result of a cast: row-wise ``[M, K]`` and/or column-wise ``[K, M]`` uint8 codes, the
    fp32 amax buffer the input's max |x| was folded into, and ``scale_inv = 1 / scale``."""

    rowwise: Optional[torch.Tensor]
    columnwise: Optional[torch.Tensor]
    amax: torch.Tensor
    scale_inv: torch.Tensor


def _scalar(like: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=like.device)


def _as_codes(t: torch.Tensor) -> torch.Tensor:
    """FP8 codes as uint8: a float8 tensor viewed so; anything else as it is (the op refuses
    what is not uint8)."""
    return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t


def _format_of(t: torch.Tensor, fp8_format, default=None) -> Optional[Fp8Format]:
    """The FP8 format `t` holds: a float8 tensor's own (a different `fp8_format` is refused:
    its bytes would be decoded as the other format), else `fp8_format`, else `default`."""
    own = _FP8_DTYPES.get(t.dtype)
    given = None if fp8_format is None else Fp8Format.parse(fp8_format)
    if own is not None and given is not None and given != own:
        raise ValueError(f"a {t.dtype} tensor holds {own.name} codes, but format {given.name} "
                         f"was given; pass its own format or None, or view uint8 codes")
    return own if own is not None else given if given is not None else default


def _cast_outputs(x: torch.Tensor, rowwise: bool, columnwise: bool, scale_inv):
    """(row-wise [M, K] codes or None, column-wise [K, M] codes or None, scale_inv) for x."""
    rows, cols = x.shape if x.dim() == 2 else (0, 0)
    row = torch.empty((rows, cols), dtype=torch.uint8, device=x.device) if rowwise else None
    col = torch.empty((cols, rows), dtype=torch.uint8, device=x.device) if columnwise else None
    return row, col, _scalar(x) if scale_inv is None else scale_inv


def _use_history_max(amax_compute_algo: str) -> bool:
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got "
                         f"{amax_compute_algo!r}")
    return amax_compute_algo == "max"


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_format="e4m3", *,
             out: Optional[torch.Tensor] = None, amax: Optional[torch.Tensor] = None,
             scale_inv: Optional[torch.Tensor] = None) -> Quantized:
    """Casts ``x`` (2-D, fp32/bf16/fp16) to FP8 row-wise: ``code = rne(x * scale)``.

    ``scale`` is a one-element fp32 tensor on x's device. ``amax`` (if given) is updated in
    place with ``max(amax, max|x|)``; a fresh zero buffer is used otherwise.
    """
    fmt = Fp8Format.parse(fp8_format)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device) if out is None else out
    amax = _scalar(x) if amax is None else amax
    scale_inv = _scalar(x) if scale_inv is None else scale_inv
    _ops.quantize(x, scale, out, amax, scale_inv, int(fmt))
    return Quantized(out, None, amax, scale_inv)


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, fp8_format="e4m3", *,
                   rowwise: bool = True, columnwise: bool = True,
                   amax: Optional[torch.Tensor] = None,
                   scale_inv: Optional[torch.Tensor] = None,
                   dbias: Optional[torch.Tensor] = None) -> Quantized:
    """Casts ``x`` ``[M, K]`` once, writing row-wise ``[M, K]`` and/or column-wise ``[K, M]``
    codes (the column-wise data is the transpose), folding max|x| into ``amax``.

    ``dbias`` (``[K]`` fp32, or bf16/fp16 rounded from fp32 by torch), if given, receives the
    column sums ``x.sum(0)`` -- the bias gradient when x is an output gradient -- from the same
    read of x, added in an order fixed by the shape: the same fp32 bytes every run, on GPU and
    CPU (torch's 16-bit roundings of NaN differ between the two).
    """
    fmt = Fp8Format.parse(fp8_format)
    row, col, scale_inv = _cast_outputs(x, rowwise, columnwise, scale_inv)
    amax = _scalar(x) if amax is None else amax
    _ops.cast_transpose(x, scale, row, col, amax, scale_inv, int(fmt), dbias)
    return Quantized(row, col, amax, scale_inv)


def cast_transpose_current(x: torch.Tensor, amax: torch.Tensor, fp8_format="e4m3", *,
                           epsilon: float = 0.0, rowwise: bool = True, columnwise: bool = True,
                           scale_inv: Optional[torch.Tensor] = None,
                           dbias: Optional[torch.Tensor] = None) -> Quantized:
    """Current scaling's cast of ``x`` whose ``amax`` is known (e.g. all-reduced over a
    group): the kernel itself computes ``scale = fp8_max / max(amax, epsilon)`` (1 when amax is
    0, inf or NaN; the fp32 max when the quotient overflows), so no launch sits between the
    amax and the cast. Outputs (and ``dbias``) as :func:`cast_transpose`; ``amax`` is returned
    unchanged."""
    fmt = Fp8Format.parse(fp8_format)
    row, col, scale_inv = _cast_outputs(x, rowwise, columnwise, scale_inv)
    _ops.cast_transpose_current(x, amax, float(epsilon), row, col, scale_inv, int(fmt), dbias)
    return Quantized(row, col, amax, scale_inv)


def transpose_fp8(data: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Transposes 2-D FP8 codes ``[M, K]`` into ``[K, M]``."""
    data = _as_codes(data)
    if out is None:
        shape = (data.shape[1], data.shape[0]) if data.dim() == 2 else (0,)
        out = torch.empty(shape, dtype=torch.uint8, device=data.device)
    _ops.transpose_fp8(data, out)
    return out


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, fp8_format=None,
               dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decodes FP8 codes: ``out = round_to(dtype, decode(code) * scale_inv)``. The format is
    a float8 tensor's own, else ``fp8_format`` (default ``"e4m3"``) for uint8 codes."""
    fmt = _format_of(data, fp8_format, Fp8Format.E4M3)
    data = _as_codes(data)
    out = torch.empty(data.shape, dtype=dtype, device=data.device) if out is None else out
    _ops.dequantize(data, scale_inv, int(fmt), out)
    return out


def amax(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``max|x|`` as a one-element fp32 tensor (folded into ``out`` when given); NaN wins."""
    out = _scalar(x) if out is None else out
    _ops.amax(x, out)
    return out


def delayed_scaling_update(amax_history: torch.Tensor, scale: torch.Tensor,
                           scale_inv: torch.Tensor, fp8_max: torch.Tensor, margin: int = 0,
                           amax_compute_algo: str = "max") -> None:
    """End-of-step update of delayed scaling for n tensors, in place, in one launch.

    ``amax_history`` is fp32 ``[history_len, n]`` with this step's amaxes in row 0; ``scale``,
    ``scale_inv`` and ``fp8_max`` are fp32 ``[n]``. ``scale = fp8_max * 2**-margin / amax``
    with amax the max over the history ("max") or row 0 ("most_recent"), kept when amax is
    0 or not finite. The history then rolls one row toward the past and row 0 is zeroed.
    """
    _ops.delayed_scaling_update(amax_history, scale, scale_inv, fp8_max, int(margin),
                                _use_history_max(amax_compute_algo))


def delayed_scaling_update_many(histories, scales, scale_invs, fp8_max, margin: int = 0,
                                amax_compute_algo: str = "max", scale_offsets=()) -> None:
    """:func:`delayed_scaling_update` for state spread over many buffers (every module's own),
    in one launch per 96 tensors, nothing copied. ``histories[j]`` is fp32
    ``[n_j, history_len]`` (tensor-major: row i is tensor i's history, newest first),
    ``scales[j]`` / ``scale_invs[j]`` fp32 ``[n_j]`` -- or, with ``scale_offsets`` (one per
    history), their elements ``scale_offsets[j] .. scale_offsets[j] + n_j - 1``; ``fp8_max``
    one float per tensor, in order.
    """
    use_history_max = _use_history_max(amax_compute_algo)
    _ops.delayed_scaling_update_many(list(histories), list(scales), list(scale_invs),
                                     [float(v) for v in fp8_max], int(margin), use_history_max,
                                     [int(v) for v in scale_offsets])


_ACTIVATIONS = {"gelu": 0, "swiglu": 1}


class Activated(NamedTuple):
    """Result of a fused activation cast: FP8 row-wise ``[M, N]`` and/or column-wise ``[N, M]``
    codes of the result (``act(x)``, or ``dx`` in backward), the fp32 amax buffer its max|.|
    was folded into, ``scale_inv = 1 / scale``, the result in x's dtype if asked for, and (the
    backward, if asked for) dx's fp32 column sums: the bias gradient of the layer before."""

    rowwise: Optional[torch.Tensor]
    columnwise: Optional[torch.Tensor]
    amax: torch.Tensor
    scale_inv: torch.Tensor
    out: Optional[torch.Tensor]
    dbias: Optional[torch.Tensor] = None


def _activation_code(activation: str) -> int:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    return _ACTIVATIONS[activation]


def _activation_outputs(x, activation, backward, rowwise, columnwise, high_precision):
    """(row-wise, column-wise, high-precision) result buffers for pre-activation x, or None."""
    rows, width = x.shape if x.dim() == 2 else (0, 0)
    cols = width if backward or activation != "swiglu" else width // 2

    def new(shape, dtype, wanted):
        return torch.empty(shape, dtype=dtype, device=x.device) if wanted else None
    return (new((rows, cols), torch.uint8, rowwise), new((cols, rows), torch.uint8, columnwise),
            new((rows, cols), x.dtype, high_precision))


def activation_cast(x: torch.Tensor, scale: torch.Tensor, activation: str = "gelu",
                    fp8_format="e4m3", *, rowwise: bool = True, columnwise: bool = True,
                    high_precision: bool = False, amax: Optional[torch.Tensor] = None,
                    scale_inv: Optional[torch.Tensor] = None) -> Activated:
    """``act(x)`` written straight as FP8 (one read of x, no high-precision activation unless
    ``high_precision``): the cast of :func:`cast_transpose` applied to ``act(x)`` computed in
    fp32, with ``max|act(x)|`` folded into ``amax``.

    ``activation`` is ``"gelu"`` (torch's default erf form: ``x * Phi(x)``) with ``x``
    ``[M, N]``, or ``"swiglu"``: ``x = [a | b]`` ``[M, 2N]`` gives ``silu(a) * b`` ``[M, N]``.
    x is fp32/bf16/fp16, contiguous; N must be a multiple of 16 for FP8 outputs.
    """
    row, col, out = _activation_outputs(x, activation, False, rowwise, columnwise,
                                        high_precision)
    amax = _scalar(x) if amax is None else amax
    scale_inv = _scalar(x) if scale_inv is None else scale_inv
    _ops.activation_cast(x, scale, row, col, out, amax, scale_inv, _activation_code(activation),
                         int(Fp8Format.parse(fp8_format)))
    return Activated(row, col, amax, scale_inv, out)


def activation_amax(x: torch.Tensor, activation: str = "gelu",
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``max|act(x)|`` (folded into ``out`` when given; NaN wins), without writing act(x):
    current scaling's first pass."""
    out = _scalar(x) if out is None else out
    _ops.activation_amax(x, out, _activation_code(activation))
    return out


def activation_cast_current(x: torch.Tensor, activation: str = "gelu", fp8_format="e4m3", *,
                            amax: Optional[torch.Tensor] = None, epsilon: float = 0.0,
                            rowwise: bool = True, columnwise: bool = True,
                            high_precision: bool = False,
                            scale_inv: Optional[torch.Tensor] = None) -> Activated:
    """:func:`activation_cast` with current scaling: ``scale = fp8_max / max(amax, epsilon)``
    from the amax of ``act(x)``. Without ``amax`` it is computed first (:func:`activation_amax`:
    a second read of x, still less traffic than writing act(x) and reading it twice); pass
    one to use it as is (e.g. all-reduced over a group). ``amax`` is returned unchanged."""
    code = _activation_code(activation)
    if amax is None:
        amax = activation_amax(x, activation)
    row, col, out = _activation_outputs(x, activation, False, rowwise, columnwise,
                                        high_precision)
    scale_inv = _scalar(x) if scale_inv is None else scale_inv
    _ops.activation_cast_current(x, amax, float(epsilon), row, col, out, scale_inv, code,
                                 int(Fp8Format.parse(fp8_format)))
    return Activated(row, col, amax, scale_inv, out)


def activation_backward_cast(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                             activation: str = "gelu", fp8_format="e5m2", *,
                             rowwise: bool = True, columnwise: bool = True,
                             high_precision: bool = False, amax: Optional[torch.Tensor] = None,
                             scale_inv: Optional[torch.Tensor] = None,
                             dbias: bool = False) -> Activated:
    """The backward of :func:`activation_cast`: ``dx = grad * act'(x)`` written straight as FP8
    row-wise and/or column-wise (fc1's dgrad and wgrad operands), ``max|dx|`` folded into
    ``amax``; with ``dbias``, also dx's column sums (fp32, in the cast's fixed order).

    ``grad`` is the gradient of ``act(x)`` ``[M, N]`` in x's dtype, ``x`` the saved
    pre-activation; ``dx`` has x's shape (for SwiGLU ``[M, 2N]``: ``[da | db]``), whose width
    must be a multiple of 16 for FP8 outputs.
    """
    row, col, out = _activation_outputs(x, activation, True, rowwise, columnwise, high_precision)
    amax = _scalar(x) if amax is None else amax
    scale_inv = _scalar(x) if scale_inv is None else scale_inv
    sums = _column_sums(x) if dbias else None
    _ops.activation_backward_cast(grad, x, scale, row, col, out, amax, scale_inv,
                                  _activation_code(activation), int(Fp8Format.parse(fp8_format)),
                                  sums)
    return Activated(row, col, amax, scale_inv, out, sums)


def _column_sums(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape[1], dtype=torch.float32, device=x.device)


def activation_backward_amax(grad: torch.Tensor, x: torch.Tensor, activation: str = "gelu",
                             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``max|grad * act'(x)|`` (folded into ``out`` when given), without writing dx."""
    out = _scalar(x) if out is None else out
    _ops.activation_backward_amax(grad, x, out, _activation_code(activation))
    return out


def activation_backward_cast_current(grad: torch.Tensor, x: torch.Tensor,
                                     activation: str = "gelu", fp8_format="e5m2", *,
                                     amax: Optional[torch.Tensor] = None, epsilon: float = 0.0,
                                     rowwise: bool = True, columnwise: bool = True,
                                     high_precision: bool = False,
                                     scale_inv: Optional[torch.Tensor] = None,
                                     dbias: bool = False) -> Activated:
    """:func:`activation_backward_cast` with current scaling, as
    :func:`activation_cast_current` (``amax``: of dx, computed first when not given)."""
    code = _activation_code(activation)
    if amax is None:
        amax = activation_backward_amax(grad, x, activation)
    row, col, out = _activation_outputs(x, activation, True, rowwise, columnwise, high_precision)
    scale_inv = _scalar(x) if scale_inv is None else scale_inv
    sums = _column_sums(x) if dbias else None
    _ops.activation_backward_cast_current(grad, x, amax, float(epsilon), row, col, out,
                                          scale_inv, code, int(Fp8Format.parse(fp8_format)), sums)
    return Activated(row, col, amax, scale_inv, out, sums)


_GEMM_TYPES = {torch.float32: int(_C.GemmType.FLOAT32), torch.bfloat16: int(_C.GemmType.BFLOAT16),
               torch.float16: int(_C.GemmType.FLOAT16)}
_FP8_DTYPES = {getattr(torch, name): fmt for name, fmt in
               (("float8_e4m3fn", Fp8Format.E4M3), ("float8_e5m2", Fp8Format.E5M2))
               if hasattr(torch, name)}


def _gemm_type(t: torch.Tensor, fp8_format) -> int:
    fmt = _format_of(t, fp8_format)
    if fmt is not None:
        return fmt.gemm_type
    if t.dtype == torch.uint8:
        raise ValueError("uint8 GEMM operand: say which FP8 format it holds "
                         "(a_format= / b_format= 'e4m3' or 'e5m2')")
    if t.dtype not in _GEMM_TYPES:
        raise ValueError(f"GEMM operands are float32, bfloat16, float16 or FP8, got {t.dtype}")
    return _GEMM_TYPES[t.dtype]


def gemm(a: torch.Tensor, b: torch.Tensor, *, out: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None, a_scale_inv: Optional[torch.Tensor] = None,
         b_scale_inv: Optional[torch.Tensor] = None, a_format=None, b_format=None,
         bias: Optional[torch.Tensor] = None, accumulate: bool = False,
         fast_accum: bool = False, a_transposed: bool = False,
         b_transposed: bool = False, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``D[M, N] = (a_scale_inv * b_scale_inv) * A . B^T (+ bias) (+ D if accumulate, or
    + residual)``.

    ``A`` is ``[M, K]`` and ``B`` is ``[N, K]`` (both K-major; for high-precision operands,
    ``a_transposed`` / ``b_transposed`` take ``[K, M]`` / ``[K, N]`` instead). FP8 operands are
    uint8 codes with ``a_format``/``b_format`` (or ``torch.float8_*`` tensors) and a one-element
    fp32 ``scale_inv``; K and N must then be multiples of 16. Accumulation is fp32;
    ``fast_accum`` allows reduced-precision accumulation in FP8 kernels (for fprop).
    Without ``out`` the result is a new ``out_dtype`` tensor (default: the residual's dtype, or
    bfloat16). ``accumulate=True`` adds into ``out`` (e.g. an fp32 ``main_grad``); ``residual``, a
    contiguous ``[M, N]`` tensor of the output's dtype that does not share ``out``'s memory, is
    added before the output's one rounding (a skip connection in the GEMM's epilogue).
    """
    a_type, b_type = _gemm_type(a, a_format), _gemm_type(b, b_format)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs the `out` tensor to add into")
        m = a.shape[1] if a_transposed else a.shape[0]
        n = b.shape[1] if b_transposed else b.shape[0]
        if out_dtype is None:
            out_dtype = residual.dtype if isinstance(residual, torch.Tensor) else torch.bfloat16
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    _ops.gemm(_as_codes(a), _as_codes(b), out, a_scale_inv, b_scale_inv, a_type, b_type, bias,
              accumulate, fast_accum, a_transposed, b_transposed, residual)
    return out


class NormCast(NamedTuple):
    """Result of a fused norm -> FP8 cast: the normalized output ``[M, H]`` in the input's dtype
    (or None), its FP8 codes row-wise ``[M, H]`` / column-wise ``[H, M]`` (or None), the fp32
    amax buffer, ``scale_inv``, and the per-row fp32 ``mean`` (LayerNorm) and ``rstd``."""

    out: Optional[torch.Tensor]
    rowwise: Optional[torch.Tensor]
    columnwise: Optional[torch.Tensor]
    amax: torch.Tensor
    scale_inv: torch.Tensor
    mean: Optional[torch.Tensor]
    rstd: Optional[torch.Tensor]


def _norm_outputs(x, rms_norm, out, rowwise, columnwise, stats):
    rows = x.shape[0] if x.dim() == 2 else 0
    row, col, scale_inv = _cast_outputs(x, rowwise, columnwise, None)

    def f32(*size):
        return torch.empty(size, dtype=torch.float32, device=x.device)

    mean = f32(rows) if stats and not rms_norm else None
    rstd = f32(rows) if stats else None
    return torch.empty_like(x) if out else None, row, col, scale_inv, mean, rstd


def norm_cast(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor] = None,
              scale: Optional[torch.Tensor] = None, fp8_format="e4m3", *,
              rms_norm: bool = False, eps: float = 1e-5, out: bool = True,
              rowwise: bool = True, columnwise: bool = True, stats: bool = True,
              amax: Optional[torch.Tensor] = None) -> NormCast:
    """LayerNorm (``rms_norm=False``) or RMSNorm of ``x`` ``[M, H]`` (fp32/bf16/fp16,
    ``H % 16 == 0``, ``H <= 16384``) and its FP8 cast with the given ``scale``, in one pass:

      LayerNorm: ``y = (x - mean) * rstd * gamma + beta``, ``rstd = 1 / sqrt(var + eps)``
      RMSNorm:   ``y = x * rstd * gamma``,                 ``rstd = 1 / sqrt(mean(x^2) + eps)``

    computed in fp32 and rounded to x's dtype; the codes are ``rne(y * scale)`` and max|y| is
    folded into ``amax`` (a fresh zero buffer if None). ``gamma`` / ``beta`` are ``[H]``;
    ``out`` / ``rowwise`` / ``columnwise`` / ``stats`` (mean and rstd for backward) choose the
    outputs. Bit-identical on CPU and GPU."""
    fmt = Fp8Format.parse(fp8_format)
    scale = _scalar(x, 1.0) if scale is None else scale
    y, row, col, scale_inv, mean, rstd = _norm_outputs(x, rms_norm, out, rowwise, columnwise,
                                                       stats)
    amax = _scalar(x) if amax is None else amax
    _ops.norm_cast(x, gamma, beta, bool(rms_norm), float(eps), scale, y, row, col, amax,
                   scale_inv, mean, rstd, int(fmt))
    return NormCast(y, row, col, amax, scale_inv, mean, rstd)


def norm_cast_current(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor] = None,
                      fp8_format="e4m3", *, rms_norm: bool = False, eps: float = 1e-5,
                      scale_epsilon: float = 0.0, out: bool = True, rowwise: bool = True,
                      columnwise: bool = True, stats: bool = True) -> NormCast:
    """:func:`norm_cast` with current scaling: a first pass folds the normalized output's
    max|y| into a zero ``amax``, the second casts with ``fp8_max / max(amax, scale_epsilon)``
    (1 when amax is 0, inf or NaN), computed by the kernel itself."""
    fmt = Fp8Format.parse(fp8_format)
    y, row, col, scale_inv, mean, rstd = _norm_outputs(x, rms_norm, out, rowwise, columnwise,
                                                       stats)
    amax = _scalar(x)
    _ops.norm_cast_current(x, gamma, beta, bool(rms_norm), float(eps), amax,
                           float(scale_epsilon), y, row, col, scale_inv, mean, rstd, int(fmt))
    return NormCast(y, row, col, amax, scale_inv, mean, rstd)


def norm_backward(dy: torch.Tensor, x: torch.Tensor, mean: Optional[torch.Tensor],
                  rstd: torch.Tensor, gamma: torch.Tensor, rms_norm: bool = False,
                  dx_add: Optional[torch.Tensor] = None):
    """Backward of :func:`norm_cast`'s norm from its saved ``mean`` (LayerNorm; None for
    RMSNorm) and ``rstd``: ``(dx [M, H] in x's dtype, dgamma [H], dbeta [H] or None for
    RMSNorm)`` in gamma's dtype, computed in fp32 by one kernel pass over x and dy; dgamma and
    dbeta are summed in a fixed order, so the result is the same bytes every run and on CPU and
    GPU. ``dx_add`` (x's dtype and shape), the gradient that reaches x past the norm (as in
    ``x + f(norm(x))``), is added to dx in the same pass, before dx is rounded."""
    dx, dgamma, dbeta = _ops.norm_backward(dy, x, mean, rstd, gamma, bool(rms_norm), dx_add)
    return dx, dgamma, None if rms_norm else dbeta
