"""FP8 recipes: how scales are chosen. One frozen object per choice, validated on creation."""
import math
import numbers
from dataclasses import dataclass

from .formats import Fp8Format

_FORMATS = {"hybrid": (Fp8Format.E4M3, Fp8Format.E5M2), "e4m3": (Fp8Format.E4M3, Fp8Format.E4M3)}


def _check_format(fp8_format: str) -> None:
    if fp8_format not in _FORMATS:
        raise ValueError(f"fp8_format must be 'hybrid' (E4M3 forward, E5M2 gradients) or "
                         f"'e4m3' (E4M3 everywhere), got {fp8_format!r}")


def _is_int(value) -> bool:
    """An int and not a bool (True is an int to Python, not a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A real number (NumPy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _finite_nonnegative(value) -> bool:
    """A number in [0, inf): what an epsilon may be."""
    return _is_number(value) and 0 <= value < math.inf


@dataclass(frozen=True)
class DelayedScaling:
    """Scale from the amax history of earlier steps: ``scale = fp8_max * 2**-margin / amax``,
    with amax the max over the last ``amax_history_len`` steps ("max") or the last step
    ("most_recent"). Casts need no extra pass over the tensor; the histories roll and the
    scales update once per step, at ``fp8_autocast`` exit (a gradient's amax, recorded by
    backward, at the next step's exit: before the backward that uses the new scale)."""

    margin: int = 0
    fp8_format: str = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        _check_format(self.fp8_format)
        if not _is_int(self.margin) or not -100 <= self.margin <= 100:
            raise ValueError(f"margin must be an int in [-100, 100], got {self.margin!r}")
        if not _is_int(self.amax_history_len) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int, got "
                             f"{self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got "
                             f"{self.amax_compute_algo!r}")

    @property
    def formats(self):
        """(forward format, gradient format)."""
        return _FORMATS[self.fp8_format]


@dataclass(frozen=True)
class CurrentScaling:
    """Scale from this very tensor: ``scale = fp8_max / max(amax, amax_epsilon)``, one extra
    read of the tensor per cast, no state across steps."""

    fp8_format: str = "hybrid"
    amax_epsilon: float = 0.0

    def __post_init__(self):
        _check_format(self.fp8_format)
        if not _finite_nonnegative(self.amax_epsilon):  # (inf would make every scale 0)
            raise ValueError(f"amax_epsilon must be a finite number >= 0 (the smallest amax "
                             f"a scale is computed from), got {self.amax_epsilon!r}")

    @property
    def formats(self):
        """(forward format, gradient format)."""
        return _FORMATS[self.fp8_format]
