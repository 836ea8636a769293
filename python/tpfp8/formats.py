"""FP8 formats: E4M3 (max 448, activations and weights) and E5M2 (max 57344, gradients)."""
import enum


class Fp8Format(enum.IntEnum):
    """An FP8 encoding; the integer value is what the native ops take."""

    E4M3 = 0
    E5M2 = 1

    @property
    def max(self) -> float:
        """Largest finite magnitude of the format."""
        return 448.0 if self is Fp8Format.E4M3 else 57344.0

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
