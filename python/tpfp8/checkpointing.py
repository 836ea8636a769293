"""Activation checkpointing: which forward a recompute repeats.

A checkpoint (``torch.utils.checkpoint``, reentrant or not, or any ``autograd.Function`` that
runs its block without grad and again in backward, as Megatron's and DeepSpeed's do) runs a
layer's forward a second time inside backward. Under FP8 that second run must repeat the first
exactly: its recipe, amax group and delayed-scaling scales. So each forward leaves a record
(`Forward`) on every checkpoint whose forward is running around it, and a recompute takes the
next record of the checkpoint it recomputes. The records live on the checkpoint itself (torch's
checkpoint frame, or the Function's context), so they are freed with its graph, and one
checkpoint's records can never be taken by another's recompute, whatever order micro-batches,
evaluations or backward passes run in.

A checkpoint is found from what it leaves in place while it runs:
- non-reentrant: its saved-tensor hooks. A forward's hooks hold the checkpoint frame, a
  recompute's hold a weak reference to it (torch.utils.checkpoint's ``_CheckpointFrame``).
- reentrant: the Function's ``forward(ctx, ...)`` on the Python stack while it runs (grad and
  forward-mode grad both off: what tells it from a plain no-grad evaluation, which pays
  nothing), and the Function's backward node (``ctx`` itself) as backward's current node.

Checkpoints that leave neither (Megatron's CheckpointWithoutOutput recomputes from a tensor
hook; a Function with ``setup_context`` has no ctx in forward) cannot be matched to a forward:
a layer that has run in FP8 refuses a forward inside backward that nothing matches, rather than
guess which forward it repeats. (A layer that never ran in FP8, outside fp8_autocast, just runs.)
"""
import sys
import weakref
from typing import List, NamedTuple, Optional

import torch
import torch.utils.checkpoint

_FRAME = getattr(torch.utils.checkpoint, "_CheckpointFrame", None)
_TOP = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_FWD_GRAD = torch._C._is_fwd_grad_enabled
_FORWARDS, _CURSORS = "_tpfp8_forwards", "_tpfp8_cursors"  # attributes set on a checkpoint


class Forward(NamedTuple):
    """How a layer's forward ran: the layer's delayed-scaling updates before it, its recipe
    (None: high precision) and amax group."""
    updates: int
    recipe: object
    amax_group: object


class Checkpoints(NamedTuple):
    """The checkpoints around a forward: those whose forward is running (innermost first);
    whether it runs inside backward, and then the checkpoint being recomputed (if one is seen)
    with what identifies this recompute run."""
    running: List[object]
    in_backward: bool
    recomputed: Optional[object]
    run: object


def around() -> Optional[Checkpoints]:
    """The checkpoints around the forward being called (never while torch.compile traces);
    None where there are none and it runs outside backward (most calls: answered without
    building anything)."""
    packs = _pack_hooks()
    if not packs and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
        return None
    running, recomputed, run = [], None, None
    for pack in packs:
        frame, is_recompute = _frame_of(pack)
        if frame is None:
            continue
        if is_recompute:  # (the innermost recompute: checkpoints above it are re-made by it)
            recomputed, run = frame, pack
            break
        running.append(frame)
    if not torch.is_grad_enabled() and not _FWD_GRAD() and not torch.is_inference_mode_enabled():
        running.extend(_functions_running())
    if recomputed is not None:
        return Checkpoints(running, True, recomputed, run)
    task = torch._C._current_graph_task_id()
    if task == -1:
        return Checkpoints(running, False, None, None)
    # A reentrant checkpoint's backward: backward's current node is its ctx.
    return Checkpoints(running, True, torch._C._current_autograd_node(), task)


def record(layer, forward: Forward, checkpoints: Checkpoints) -> None:
    """Leaves `forward` on each running checkpoint, for its recompute to repeat."""
    for checkpoint in checkpoints.running:
        forwards = checkpoint.__dict__.setdefault(_FORWARDS, {})
        forwards.setdefault(layer, []).append(forward)


def repeated(layer, checkpoints: Checkpoints) -> Optional[Forward]:
    """The forward a recompute repeats: the next of the layer's records on the checkpoint being
    recomputed (a layer may run more than once in a block); checkpoints re-made by the
    recompute (nested ones) get it too, for their own recompute later. None where the
    checkpoint kept no (further) record of the layer."""
    checkpoint = checkpoints.recomputed
    forwards = getattr(checkpoint, "__dict__", {}).get(_FORWARDS, {}).get(layer)
    if forwards is None:
        return None
    cursors = checkpoint.__dict__.setdefault(_CURSORS, {})
    i = cursors.get((layer, checkpoints.run), 0)
    if i >= len(forwards):
        return None
    cursors[(layer, checkpoints.run)] = i + 1
    record(layer, forwards[i], checkpoints)
    return forwards[i]


def _pack_hooks() -> list:
    """The pack functions of the active saved-tensor hooks, innermost first. (torch shows only
    the top pair: take them off and put them back, with pushing allowed meanwhile if it was
    not -- AOTAutograd disables hooks with the stack in place.)"""
    if _TOP is None or _TOP(False) is None:
        return []
    autograd = torch._C._autograd
    disabled = None if autograd._saved_tensors_hooks_is_enabled() else \
        autograd._saved_tensors_hooks_get_disabled_error_message()
    taken = []
    try:
        while (top := _TOP(False)) is not None:
            taken.append(top)
            autograd._pop_saved_tensors_default_hooks()
    finally:
        if disabled is not None:
            autograd._saved_tensors_hooks_enable()
        try:
            for pack, unpack in reversed(taken):
                autograd._push_saved_tensors_default_hooks(pack, unpack)
        finally:
            if disabled is not None:
                autograd._saved_tensors_hooks_disable(disabled, False)  # (stack kept)
    return [pack for pack, _ in taken]


def _frame_of(hook, depth: int = 0):
    """(torch's checkpoint frame a hook belongs to, whether it is a recompute's): a forward's
    hook holds the frame, a recompute's a weak reference to it (possibly under a wrapper)."""
    if _FRAME is None or depth > 3:
        return None, False
    for cell in getattr(hook, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, _FRAME):
            return value, False
        if isinstance(value, weakref.ref) and isinstance(value(), _FRAME):
            return value(), True
        if callable(value):
            found = _frame_of(value, depth + 1)
            if found[0] is not None:
                return found
    wrapped = getattr(hook, "__wrapped__", None)
    return _frame_of(wrapped, depth + 1) if wrapped is not None else (None, False)


def _functions_running() -> list:
    """The contexts of the ``autograd.Function`` forwards running on this thread's stack,
    innermost first (a reentrant checkpoint runs its block inside one)."""
    found, frame = [], sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount:
            ctx = frame.f_locals.get(code.co_varnames[0])
            if isinstance(ctx, torch.autograd.function.BackwardCFunction):
                found.append(ctx)
        frame = frame.f_back
    return found
