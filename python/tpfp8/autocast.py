"""``fp8_autocast``: the region in which tpfp8 modules compute in FP8, and the once-per-step
delayed-scaling updates."""
import contextlib
import threading

import torch
import torch.utils.checkpoint

from . import parallel as _parallel
from . import scaling as _scaling
from .recipe import DelayedScaling

_state = threading.local()


def _stack():
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def thread_state() -> threading.local:
    """The thread-local state whose ``stack`` holds each thread's frames (innermost last)."""
    return _state


def current():
    """The innermost active FP8 frame (recipe, amax_group, ...), or None in high precision
    (fp8_autocast(enabled=False), or outside any)."""
    stack = getattr(_state, "stack", None)
    top = stack[-1] if stack else None
    return top if top is not None and top["recipe"] is not None else None


def frame(recipe, amax_group) -> dict:
    """A frame for the stack; its exit updates the modules collected in "ran". It also holds
    what every layer's call reads of its (frozen) recipe, worked out once: the ops' codes, and
    the key delayed-scaling state is made for."""
    delayed = isinstance(recipe, DelayedScaling)
    return {"recipe": recipe, "amax_group": amax_group, "ran": {},
            "codes": _scaling.recipe_codes(recipe),
            "key": _scaling.recipe_key(recipe) if delayed else None}


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
    the caller's back. A block nested in an enabled one (a model that opens its own inside
    the training loop's) leaves its modules to the outermost block's exit, as
    TransformerEngine does: a module run in both is updated once a step.
    """
    if recipe is None:
        recipe = DelayedScaling()
    if amax_group is not None and not _is_group(amax_group):
        raise TypeError(f"amax_group must be a torch.distributed ProcessGroup (the group the "
                        f"amaxes are reduced over) or None, got {type(amax_group).__name__}")
    # (Anything not a recipe is refused: by the frame's recipe_codes, or here when disabled.)
    entered = frame(recipe, amax_group) if enabled else None
    if entered is None:
        _scaling.scaling_code(recipe)
    stack = _stack()
    stack.append(entered)
    try:
        yield
    finally:
        stack.pop()
        if entered is not None:
            outer = next((f for f in reversed(stack) if f is not None), None)
            if outer is None:
                _scaling.update(entered["ran"].values())
            else:  # (in the order their forwards ran: every rank updates in the same order)
                for layer in entered["ran"]:
                    outer["ran"].setdefault(layer, layer)


def _is_group(value) -> bool:
    """A process group, or what a rank outside one holds (refused later, by the layer, as a
    group that misses its tensor-parallel ranks)."""
    dist = torch.distributed
    return dist.is_available() and (isinstance(value, dist.ProcessGroup) or
                                     _parallel.is_non_member(value))


def checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``.
    Plain ``torch.utils.checkpoint`` (reentrant or not, nested too) works with tpfp8 layers as
    it is: a layer's forward run by backward repeats the forward it recomputes -- in FP8 under
    the same recipe wherever backward runs, with delayed scaling's scales of that forward (the
    step's update may have moved them since), folding no amax and updating nothing -- so the
    gradients equal those of the step without checkpointing (see tpfp8.checkpointing). Kept
    for code written against it."""
    kwargs.setdefault("use_reentrant", False)
    return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)


def register(frame, layer) -> None:
    """Schedules `layer`'s delayed-scaling update (its input, weight and gradient state) for
    the exit of `frame`: the forward's amaxes of this step, and the gradient's amax of the
    backward passes run since the last update."""
    frame["ran"][layer] = layer
