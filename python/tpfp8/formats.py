"""FP8 formats: E4M3 (max 448, activations and weights) and E5M2 (max 57344, gradients)."""
import enum
import math

import torch

from . import _C


class Fp8Format(enum.IntEnum):
    """An FP8 encoding; the integer value is what the native ops take (defined in C++,
    ``csrc/kernels/fp8_format.h``)."""

    E4M3 = int(_C.Fp8Format.E4M3)
    E5M2 = int(_C.Fp8Format.E5M2)

    @property
    def max(self) -> float:
        """Largest finite magnitude of the format."""
        return _MAX[self]

    @property
    def native(self) -> "_C.Fp8Format":
        """The C++ enum value, for the native option structs."""
        return _C.Fp8Format(int(self))

    @property
    def gemm_type(self) -> int:
        """The operand type code of torch.ops.tpfp8.gemm for FP8 data of this format."""
        return _GEMM_TYPE[self]

    def clipped(self, scaled: torch.Tensor) -> torch.Tensor:
        """Where a cast of `scaled` (fp32 values already multiplied by the scale) saturated:
        values that round to nearest even to a magnitude above ``max``, not those within
        rounding of it (E4M3: above 464; E5M2: 61440 and above). NaN is not clipped."""
        mantissa_bits, _, max_code, max_value = _C.fp8_traits(self.native)
        step = 2.0 ** (math.floor(math.log2(max_value)) - mantissa_bits)  # of the top binade
        threshold = max_value + step / 2
        magnitude = scaled.abs()
        # A tie goes to the even neighbour: down to max when max's code is even.
        return magnitude >= threshold if max_code & 1 else magnitude > threshold

    @classmethod
    def parse(cls, value) -> "Fp8Format":
        """Accepts an Fp8Format, its name ("e4m3"/"e5m2", any case) or its integer value."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.lower() in _BY_NAME:
            return _BY_NAME[value.lower()]
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return cls(value)
        raise ValueError(f"unknown FP8 format {value!r}: expected 'e4m3' or 'e5m2'")


# Read from C++ once, as plain values (torch.compile traces them; not pybind enums).
_MAX = {f: _C.fp8_max(f.native) for f in Fp8Format}
_BY_NAME = {"e4m3": Fp8Format.E4M3, "e5m2": Fp8Format.E5M2}
_GEMM_TYPE = {Fp8Format.E4M3: int(_C.GemmType.E4M3), Fp8Format.E5M2: int(_C.GemmType.E5M2)}
