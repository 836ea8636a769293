"""``fp8_autocast``: the region in which tpfp8 modules compute in FP8, and the once-per-step
delayed-scaling updates."""
import contextlib
import threading
from typing import Optional

import torch

from . import ops
from .recipe import CurrentScaling, DelayedScaling

_state = threading.local()


def _stack():
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def current():
    """The innermost active (recipe, amax_group), or None outside FP8."""
    stack = _stack()
    return stack[-1] if stack and stack[-1] is not None else None


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe=None, amax_group=None):
    """Runs tpfp8 modules in FP8 inside the ``with`` block.

    Args:
        enabled: False runs the block in high precision (useful to toggle from a flag).
        recipe: ``DelayedScaling()`` (the default) or ``CurrentScaling()``.
        amax_group: process group over which delayed-scaling amaxes are reduced (tensor
            parallelism); None on a single device.

    On exit, the modules that ran a delayed-scaling forward in the block roll their amax
    histories and update their scales: one launch per page of 256 tensors (85 modules), no
    host synchronisation.
    """
    if recipe is None:
        recipe = DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise ValueError(f"recipe must be tpfp8.DelayedScaling or tpfp8.CurrentScaling, got "
                         f"{type(recipe).__name__}")
    frame = {"recipe": recipe, "amax_group": amax_group, "ran": {}} if enabled else None
    _stack().append(frame)
    try:
        yield
    finally:
        _stack().pop()
        if frame is not None:
            for page in frame["ran"].values():
                page.update()


class ScalingPage:
    """Delayed-scaling state of up to COLUMNS tensors of many modules, in one set of tensors,
    so a single launch rolls every history and updates every scale. Pages are never resized
    (views that modules and saved backward state hold stay valid); a full page starts a new
    one. A page updates all its columns at once: a tensor whose module did not run in a step
    records amax 0 for that step."""

    COLUMNS = 256

    def __init__(self, recipe: DelayedScaling, device):
        self.recipe = recipe
        self.scale = torch.ones(self.COLUMNS, device=device)
        self.scale_inv = torch.ones(self.COLUMNS, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, self.COLUMNS, device=device)
        self.fp8_max = torch.ones(self.COLUMNS, device=device)
        self.used = 0

    def allocate(self, formats) -> Optional[slice]:
        if self.used + len(formats) > self.COLUMNS:
            return None
        cols = slice(self.used, self.used + len(formats))
        self.fp8_max[cols] = torch.tensor([f.max for f in formats])
        self.used += len(formats)
        return cols

    def update(self) -> None:
        # Unused columns hold amax 0: their scales stay 1 and they cost nothing worth avoiding.
        ops.delayed_scaling_update(self.amax_history, self.scale, self.scale_inv, self.fp8_max,
                                   self.recipe.margin, self.recipe.amax_compute_algo)


_pages = {}  # (device, history_len, margin, algo) -> [ScalingPage]


class ScalingMeta:
    """A module's delayed-scaling state for one direction: a few columns of a shared page.
    ``scale``, ``scale_inv`` [n] and ``amax_history`` [history_len, n] are views."""

    def __init__(self, formats, recipe: DelayedScaling, device):
        key = (str(torch.device(device)), recipe.amax_history_len, recipe.margin,
               recipe.amax_compute_algo)
        pages = _pages.setdefault(key, [])
        cols = pages[-1].allocate(formats) if pages else None
        if cols is None:
            pages.append(ScalingPage(recipe, device))
            cols = pages[-1].allocate(formats)
        self.page, self.cols, self.recipe = pages[-1], cols, recipe
        self.scale = self.page.scale[cols]
        self.scale_inv = self.page.scale_inv[cols]
        self.amax_history = self.page.amax_history[:, cols]

    def matches(self, recipe, device) -> bool:
        return (self.recipe == recipe and self.scale.device == torch.device(device))

    def state(self) -> dict:
        return {"scale": self.scale.clone(), "scale_inv": self.scale_inv.clone(),
                "amax_history": self.amax_history.clone()}

    def load(self, state: dict) -> None:
        for k, v in state.items():
            getattr(self, k).copy_(v)


def register_forward(meta: ScalingMeta) -> None:
    """Schedules the update of `meta`'s page for the exit of the innermost fp8_autocast."""
    frame = current()
    if frame is not None:
        frame["ran"][id(meta.page)] = meta.page


_pending_backward = {}


def register_backward(meta: ScalingMeta) -> None:
    """Schedules the update of `meta`'s page for the end of the running backward pass."""
    if not _pending_backward:
        torch.autograd.Variable._execution_engine.queue_callback(_update_backward)
    _pending_backward[id(meta.page)] = meta.page


def _update_backward() -> None:
    pages = list(_pending_backward.values())
    _pending_backward.clear()
    for page in pages:
        page.update()


def amax_group() -> Optional[object]:
    frame = current()
    return frame["amax_group"] if frame else None
