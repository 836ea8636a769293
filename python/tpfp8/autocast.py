"""``fp8_autocast``: the region in which tpfp8 modules compute in FP8, and the once-per-step
delayed-scaling updates."""
import contextlib
import threading

import torch
import torch.utils.checkpoint

from . import _C
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
    history and updates its scales: a handful of launches for all of them together, no host
    synchronisation.
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
            update_all(frame["ran"].values())


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


class ScalingMeta:
    """Delayed-scaling state of one direction (forward or backward) of one module: scales and
    their inverses [n], and the amax histories of its n tensors, stored tensor-major
    (``history[i]`` is tensor i's history, newest first) so that one batched launch updates
    every module in place. Its tensors are never inference tensors, so state first made
    under ``torch.inference_mode`` still loads and trains."""

    def __init__(self, formats, recipe: DelayedScaling, device, *, scale=None, scale_inv=None,
                 history=None):
        n = len(formats)
        with torch.inference_mode(False):
            self.scale = torch.ones(n, device=device) if scale is None else scale
            self.scale_inv = torch.reciprocal(self.scale) if scale_inv is None else scale_inv
            self.history = (torch.zeros(n, recipe.amax_history_len, device=device)
                            if history is None else history)
        self.fp8_max = [float(f.max) for f in formats]
        self._make_native(recipe, None)

    def adopted(self, recipe: DelayedScaling, formats, device) -> "ScalingMeta":
        """This state under `recipe`: itself when nothing changes, else a new object (this one
        untouched until the caller keeps it). Another ``amax_history_len`` resizes the
        histories keeping the newest entries (dropping the oldest, or padding with zeros, as
        TransformerEngine does); another format rescales the scales by the ratio of the
        formats' maxima (the scale stays fp8_max / amax); margin and algorithm are read by the
        next update."""
        if (recipe is self._recipe or recipe == self._recipe) and self.scale.device == device:
            return self
        fp8_max = [float(f.max) for f in formats]
        with torch.inference_mode(False):
            history = self.history.to(device)
            length = recipe.amax_history_len
            if history.shape[1] != length:
                resized = history.new_zeros(history.shape[0], length)
                keep = min(length, history.shape[1])
                resized[:, :keep] = history[:, :keep]
                history = resized
            # Shared with this object when nothing changes them: one of the two is dropped.
            scale, scale_inv = self.scale.to(device), self.scale_inv.to(device)
            if fp8_max != self.fp8_max:  # one format per state: one ratio, no host copy
                (ratio,) = {new / old for new, old in zip(fp8_max, self.fp8_max)}
                scale = scale * ratio
                scale_inv = None  # 1 / scale, as every update computes it
        return ScalingMeta(formats, recipe, device, scale=scale, scale_inv=scale_inv,
                           history=history)

    def take(self, other: "ScalingMeta") -> None:
        """Becomes `other` (a loaded checkpoint's state of the same layout) in place: the
        tensors captured by a CUDA graph or prepared options stay the ones updated."""
        self.load(other.state())
        self._follow(other.recipe)

    def same_layout(self, other: "ScalingMeta") -> bool:
        return (self.history.shape == other.history.shape and self.fp8_max == other.fp8_max
                and self.scale.device == other.scale.device)

    def _make_native(self, recipe, amax_group) -> None:
        """The same state for C++, which runs every update: views of these tensors."""
        self.native = _C.DelayedUpdate()
        self.native.fp8_max = self.fp8_max
        self._share_with_native()
        self._follow(recipe)
        self._amax_group = None
        self.amax_group = amax_group

    def _follow(self, recipe: DelayedScaling) -> None:
        """The recipe's margin and algorithm, read by the next update."""
        self._recipe = recipe
        self.native.margin = recipe.margin
        self.native.use_history_max = recipe.amax_compute_algo == "max"

    # Pickling and copy.deepcopy: the tensors travel, the C++ view of them is made anew, and
    # the amax group (every FP8 forward sets it again; a ProcessGroup does not pickle) stays.
    def __getstate__(self):
        state = self.__dict__.copy()
        del state["native"]
        state["_amax_group"] = None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._make_native(state["_recipe"], state["_amax_group"])

    @property
    def recipe(self) -> DelayedScaling:
        return self._recipe

    @property
    def amax_group(self):
        """Process group its amaxes are reduced over (tensor parallelism), or None."""
        return self._amax_group

    @amax_group.setter
    def amax_group(self, group) -> None:
        if group is not self._amax_group:
            self._amax_group = self.native.amax_group = group

    @property
    def amax_history(self) -> torch.Tensor:
        """[history_len, n] view: row 0 is the running step's amax of each tensor."""
        return self.history.t()

    def amax_slot(self, i: int) -> torch.Tensor:
        """Where a cast of tensor i folds its amax: a [1] view of its history."""
        return self.history[i, :1]

    def move_to(self, device) -> None:
        """The same state on `device` (fp32 kept), for C++ too."""
        self.scale, self.scale_inv, self.history = (
            t.to(device) for t in (self.scale, self.scale_inv, self.history))
        self._share_with_native()

    def _share_with_native(self) -> None:
        self.native.history, self.native.scale = self.history, self.scale
        self.native.scale_inv = self.scale_inv

    def state(self) -> dict:
        return {"scale": self.scale, "scale_inv": self.scale_inv,
                "amax_history": self.amax_history}

    def load(self, state: dict) -> None:
        self.scale.copy_(state["scale"])
        self.scale_inv.copy_(state["scale_inv"])
        self.amax_history.copy_(state["amax_history"])


def update_all(metas) -> None:
    """Rolls the histories and updates the scales of many modules at once, in C++ (the path
    backward's states take at the end of backward): per device, recipe and amax group, one
    all-reduce of all the newest amaxes (tensor parallelism) and one launch per 96 tensors,
    on each module's own buffers."""
    _C.update_delayed([m.native for m in metas])


def register_forward(meta: ScalingMeta) -> None:
    """Schedules `meta`'s update for the exit of the innermost fp8_autocast."""
    frame = current()
    if frame is not None:
        frame["ran"][id(meta)] = meta
