"""``fp8_autocast``: the region in which tpfp8 modules compute in FP8, and the once-per-step
delayed-scaling updates."""
import contextlib
import threading

import torch
import torch.utils.checkpoint

from . import scaling as _scaling
from .recipe import CurrentScaling, DelayedScaling

_state = threading.local()


def _stack():
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def _top():
    """The innermost frame: a dict (recipe None: high precision inside a checkpointed block),
    None for fp8_autocast(enabled=False) or outside any."""
    stack = _stack()
    return stack[-1] if stack else None


def current():
    """The innermost active FP8 frame (recipe, amax_group, ...), or None in high precision."""
    top = _top()
    return top if top is not None and top["recipe"] is not None else None


def _checkpoint_keys(frame) -> dict:
    """What a frame inside a checkpointed block passes on to frames opened in it: the scales
    being recorded (first forward) or replayed (recompute)."""
    if frame is None:
        return {}
    return {key: frame[key] for key in ("record", "replay") if key in frame}


def _frame(recipe, amax_group, ran: dict, outer) -> dict:
    """A frame for the stack: `ran` collects the modules its exit updates; opened inside a
    checkpointed block (`outer`), it carries on the block's scales."""
    return {"recipe": recipe, "amax_group": amax_group, "ran": ran, **_checkpoint_keys(outer)}


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe=None, amax_group=None):
    """Runs tpfp8 modules in FP8 inside the ``with`` block.

    Args:
        enabled: False runs the block in high precision (useful to toggle from a flag).
        recipe: ``DelayedScaling()`` (the default) or ``CurrentScaling()``.
        amax_group: process group over which delayed-scaling amaxes are reduced (tensor
            parallelism); None on a single device.

    On exit, every module that ran a delayed-scaling forward in the block rolls its amax
    histories and updates its scales -- those of its input and weight from this block, that
    of its output gradient from the backward passes run since its last update (the previous
    step's): a handful of launches for all of them together, no host synchronisation. One
    mechanism for both directions, so a CUDA graph of a training step updates nothing behind
    the caller's back.
    """
    if recipe is None:
        recipe = DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise ValueError(f"recipe must be tpfp8.DelayedScaling or tpfp8.CurrentScaling, got "
                         f"{type(recipe).__name__}")
    frame = _frame(recipe, amax_group, {}, _top()) if enabled else None
    _stack().append(frame)
    try:
        yield
    finally:
        _stack().pop()
        if frame is not None and "replay" not in frame:  # a recompute's exit updates nothing
            _scaling.update(frame["ran"].values())


def checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant) for code with tpfp8 layers:
    backward recomputes the block in FP8 exactly as it first ran -- under the same
    ``fp8_autocast`` frames and, with delayed scaling, with the scales that forward used (the
    step's update has moved them since), folding no amax twice and updating nothing -- so the
    gradients equal those of the step without checkpointing. It may be called inside or
    outside ``fp8_autocast``, nested, and the block may open its own ``fp8_autocast``.
    (Plain ``torch.utils.checkpoint`` recomputes outside ``fp8_autocast``.) Other keyword
    arguments go to ``torch.utils.checkpoint.checkpoint``; it sets ``context_fn`` itself."""
    if "context_fn" in kwargs or kwargs.pop("use_reentrant", False) is not False:
        raise ValueError("tpfp8.checkpoint is non-reentrant and sets context_fn itself; call "
                         "it without use_reentrant=True and context_fn")
    base = _top()
    keys = _checkpoint_keys(base)
    scales = keys.get("record", keys.get("replay", {}))  # module -> its first forward's scales

    def contexts():
        return _CheckpointFrame(base, "record", scales), _CheckpointFrame(base, "replay", scales)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=contexts, **kwargs)


class _CheckpointFrame:
    """The frame a checkpointed block runs in: like `base` (where the checkpoint was called;
    None: high precision), recording the scales its layers cast with (first forward; updates
    go to `base`'s exit as without checkpointing) or replaying them (recompute: no update, the
    step's ran already). A class, not a generator: backward may recompute a block twice."""

    def __init__(self, base, mode: str, scales: dict):
        self.base, self.mode, self.scales = base, mode, scales

    def __enter__(self):
        base = self.base or {"recipe": None, "amax_group": None}
        ran = base.get("ran", {}) if self.mode == "record" else {}
        frame = _frame(base["recipe"], base["amax_group"], ran, self.base)
        frame[self.mode] = self.scales
        _stack().append(frame)

    def __exit__(self, *exc) -> None:
        _stack().pop()


def record_scales(frame, module, scale) -> None:
    """Inside a checkpointed forward: keeps the scales `module` cast with for the recompute."""
    record = frame.get("record")
    if record is not None and module not in record:
        record[module] = scale.clone()


def replayed_scales(frame, module):
    """In a checkpoint's recompute, the scales `module`'s first forward cast with, else None."""
    replay = frame.get("replay") if frame is not None else None
    return None if replay is None else replay.get(module)


def register(frame, layer) -> None:
    """Schedules `layer`'s delayed-scaling update (its input, weight and gradient state) for
    the exit of `frame`: the forward's amaxes of this step, and the gradient's amax of the
    backward passes run since the last update."""
    frame["ran"][layer] = layer
