"""FP8 formats: E4M3 (max 448, activations and weights) and E5M2 (max 57344, gradients)."""
import enum

import torch


class Fp8Format(enum.IntEnum):
    """An FP8 encoding; the integer value is what the native ops take."""

    E4M3 = 0
    E5M2 = 1

    @property
    def max(self) -> float:
        """Largest finite magnitude of the format."""
        return 448.0 if self is Fp8Format.E4M3 else 57344.0

    def clipped(self, scaled: torch.Tensor) -> torch.Tensor:
        """Where a cast of `scaled` (fp32 values already multiplied by the scale) saturated:
        values that round to nearest even to a magnitude above ``max``, not those within
        rounding of it. Ties go to the even neighbour: down to 448 (mantissa 110) in E4M3, up
        past 57344 (mantissa 11) in E5M2. NaN is not clipped."""
        magnitude = scaled.abs()
        if self is Fp8Format.E4M3:
            return magnitude > 464.0  # 448 + half its step of 32
        return magnitude >= 61440.0  # 57344 + half its step of 8192

    @classmethod
    def parse(cls, value) -> "Fp8Format":
        """Accepts an Fp8Format, its name ("e4m3"/"e5m2", any case) or its integer value."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return cls(value)
        raise ValueError(f"unknown FP8 format {value!r}: expected 'e4m3' or 'e5m2'")
