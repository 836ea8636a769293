"""An FP8 oracle in NumPy/float64, written independently of the C++ encoder: the format's
values come from its definition, and encoding picks the nearest value (ties to the even code)."""
import numpy as np

FORMATS = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}
MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def code_values(fmt):
    """float64 value of each of the 256 codes (NaN for NaN codes, inf for E5M2 inf)."""
    ebits, mbits, bias = FORMATS[fmt]
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> mbits) & ((1 << ebits) - 1)
    m = (codes & ((1 << mbits) - 1)).astype(np.float64)
    val = np.where(e == 0, np.ldexp(m, 1 - bias - mbits),
                   np.ldexp(1.0 + m / (1 << mbits), e - bias))
    if fmt == "e4m3":
        val = np.where((codes & 0x7F) == 0x7F, np.nan, val)
    else:
        val = np.where(e == 31, np.where(m == 0, np.inf, np.nan), val)
    return sign * val


def encode(v32, fmt):
    """Codes of the fp32 array `v32` (already scaled): nearest, ties to even, saturating."""
    vals = code_values(fmt)[: int(np.nonzero(code_values(fmt)[:128] == MAX[fmt])[0][0]) + 1]
    a = np.abs(v32.astype(np.float64))
    hi = np.clip(np.searchsorted(vals, a, side="right"), 1, len(vals) - 1)
    lo = hi - 1
    dlo, dhi = a - vals[lo], vals[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= vals[-1], len(vals) - 1, code)
    code = code | np.where(np.signbit(v32), 0x80, 0)
    return np.where(np.isnan(v32), 0x7F, code).astype(np.uint8)


def pending_scale(state, fmt, tensor=0):
    """The scale delayed scaling gives `tensor` of `state` (fp8_state's "forward" or
    "backward") at its next update, with the "max" algorithm and margin 0: fp8_max / the
    largest amax of its history, the newest (pending) row included; the old scale when that
    is 0. Gradients use the scale their layer's last fp8_autocast exit made, so the scale a
    backward uses is this, taken before its step's forward."""
    amax = np.float32(state["amax_history"][:, tensor].max().cpu())
    old = np.float32(state["scale"][tensor].cpu())
    return np.float32(MAX[fmt]) / amax if amax > 0 else old


def current_scale(t, fmt):
    """Current scaling's fp32 scale of tensor `t`: fp8_max / amax, in fp32 as tpfp8 computes."""
    amax = np.float32(t.detach().float().abs().max().cpu())
    return np.float32(MAX[fmt]) / amax


def fake_quant(t, scale, fmt):
    """Quantize `t` with `scale` as the kernels do (fp32 product, nearest even, saturate),
    decode and multiply by the fp32 scale_inv: a CPU float64 torch tensor."""
    import torch

    s = np.float32(scale)
    codes = encode(t.detach().float().cpu().numpy() * s, fmt)
    return torch.from_numpy(code_values(fmt)[codes] * np.float64(np.float32(1.0) / s))
