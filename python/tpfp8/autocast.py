"""``fp8_autocast``: the region in which tpfp8 modules compute in FP8, and the once-per-step
delayed-scaling updates."""
import contextlib
import threading

import torch
import torch.distributed as dist

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
    history and updates its scales: a handful of launches for all of them together, no host
    synchronisation.
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
            update_all(frame["ran"].values())


class ScalingMeta:
    """Delayed-scaling state of one direction (forward or backward) of one module: scales and
    their inverses [n], and the amax histories of its n tensors, stored tensor-major
    (``history[i]`` is tensor i's history, newest first) so that one batched launch updates
    every module in place."""

    def __init__(self, formats, recipe: DelayedScaling, device):
        n = len(formats)
        self.recipe = recipe
        self.amax_group = None  # set per step by the module (tensor parallelism)
        self.scale = torch.ones(n, device=device)
        self.scale_inv = torch.ones(n, device=device)
        self.history = torch.zeros(n, recipe.amax_history_len, device=device)
        self.fp8_max = [float(f.max) for f in formats]

    @property
    def amax_history(self) -> torch.Tensor:
        """[history_len, n] view: row 0 is the running step's amax of each tensor."""
        return self.history.t()

    def amax_slot(self, i: int) -> torch.Tensor:
        """Where a cast of tensor i folds its amax: a [1] view of its history."""
        return self.history[i, :1]

    def matches(self, recipe, device) -> bool:
        return (self.history.shape[1] == recipe.amax_history_len
                and self.scale.device == torch.device(device))

    def state(self) -> dict:
        return {"scale": self.scale, "scale_inv": self.scale_inv,
                "amax_history": self.amax_history}

    def load(self, state: dict) -> None:
        self.scale.copy_(state["scale"])
        self.scale_inv.copy_(state["scale_inv"])
        self.amax_history.copy_(state["amax_history"])


def update_all(metas) -> None:
    """Rolls the histories and updates the scales of many modules at once: per (device,
    recipe) one launch for up to 96 tensors, reading and writing each module's own buffers;
    under tensor parallelism one all-reduce of all the modules' amaxes first."""
    groups = {}
    for m in metas:
        key = (m.scale.device, m.recipe.amax_history_len, m.recipe.margin,
               m.recipe.amax_compute_algo, id(m.amax_group))
        groups.setdefault(key, []).append(m)
    for group in groups.values():
        if group[0].amax_group is not None:  # one collective for all the modules' amaxes
            newest = [m.history[:, 0] for m in group]
            amax = torch.cat(newest)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group[0].amax_group)
            torch._foreach_copy_(newest, amax.split([m.scale.numel() for m in group]))
        recipe = group[0].recipe
        ops.delayed_scaling_update_many([m.history for m in group], [m.scale for m in group],
                                        [m.scale_inv for m in group],
                                        [v for m in group for v in m.fp8_max], recipe.margin,
                                        recipe.amax_compute_algo)


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
    update_all(metas)
