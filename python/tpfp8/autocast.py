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

    On exit, every module that ran a delayed-scaling forward in the block rolls its amax
    history and updates its scales (a few launches per module, no host synchronisation).
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
            for meta in frame["ran"].values():
                meta.update()


class ScalingMeta:
    """Delayed-scaling state of one direction (forward or backward) of one module: scales,
    their inverses and the amax history [history_len, n] of its n tensors."""

    def __init__(self, formats, recipe: DelayedScaling, device):
        n = len(formats)
        self.recipe = recipe
        self.scale = torch.ones(n, device=device)
        self.scale_inv = torch.ones(n, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, n, device=device)
        self.fp8_max = torch.tensor([f.max for f in formats], device=device)

    def matches(self, recipe, device) -> bool:
        return (self.amax_history.shape[0] == recipe.amax_history_len
                and self.scale.device == torch.device(device))

    def update(self):
        ops.delayed_scaling_update(self.amax_history, self.scale, self.scale_inv, self.fp8_max,
                                   self.recipe.margin, self.recipe.amax_compute_algo)

    def state(self) -> dict:
        return {"scale": self.scale, "scale_inv": self.scale_inv,
                "amax_history": self.amax_history}

    def load(self, state: dict) -> None:
        for k, v in state.items():
            getattr(self, k).copy_(v)


def register_forward(meta: ScalingMeta) -> None:
    """Schedules `meta`'s update for the exit of the innermost fp8_autocast."""
    frame = current()
    if frame is not None:
        frame["ran"][id(meta)] = meta


_pending_backward = {}


def register_backward(meta: ScalingMeta) -> None:
    """Schedules `meta`'s update for the end of the running backward pass."""
    if not _pending_backward:
        torch.autograd.Variable._execution_engine.queue_callback(_update_backward)
    _pending_backward[id(meta)] = meta


def _update_backward() -> None:
    metas = list(_pending_backward.values())
    _pending_backward.clear()
    for meta in metas:
        meta.update()


def amax_group() -> Optional[object]:
    frame = current()
    return frame["amax_group"] if frame else None
