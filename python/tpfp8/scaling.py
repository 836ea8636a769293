"""A layer's delayed-scaling state as three tensors -- ``scale`` and ``scale_inv`` [3] and
``amax_history`` [3, history_len] (tensor-major, newest first) of its input, weight and output
gradient -- and the update that rolls them, once per step, for many layers at a time."""
from typing import Iterable

import torch

from . import _C
from .recipe import CurrentScaling, DelayedScaling

ROLES = ("input", "weight", "gradient")


def recipe_codes(recipe) -> tuple:
    """(scaling, forward format, gradient format, epsilon) as the ops take them."""
    if recipe is None:
        return int(_C.Scaling.NONE), int(_C.Fp8Format.E4M3), int(_C.Fp8Format.E5M2), 0.0
    fwd, grad = recipe.formats
    if isinstance(recipe, CurrentScaling):
        return int(_C.Scaling.CURRENT), int(fwd), int(grad), float(recipe.amax_epsilon)
    return int(_C.Scaling.DELAYED), int(fwd), int(grad), 0.0


def maxima(recipe: DelayedScaling) -> list:
    """The largest FP8 value of each of the three tensors' formats."""
    fwd, grad = recipe.formats
    return [float(fwd.max), float(fwd.max), float(grad.max)]


def fresh(recipe: DelayedScaling, device) -> tuple:
    """Scales 1, histories zero. Never inference tensors, so state first made under
    ``torch.inference_mode`` still loads and trains."""
    with torch.inference_mode(False):
        return (torch.ones(3, device=device), torch.ones(3, device=device),
                torch.zeros(3, recipe.amax_history_len, device=device))


def adopted(state: tuple, old: DelayedScaling, recipe: DelayedScaling, device) -> tuple:
    """`state` (made under `old`) under `recipe`: the same tensors when only the margin or
    the algorithm changes (the next update reads them), else new ones. Another
    ``amax_history_len`` resizes the histories keeping the newest entries (dropping the oldest,
    or padding with zeros, as TransformerEngine does); another format rescales the scales by
    the ratio of the formats' maxima (the scale stays fp8_max / amax)."""
    scale, scale_inv, history = state
    length, ratio = recipe.amax_history_len, None
    if maxima(recipe) != maxima(old):
        ratio = torch.tensor([n / o for n, o in zip(maxima(recipe), maxima(old))])
    if history.shape[1] == length and ratio is None and scale.device == device:
        return state
    with torch.inference_mode(False):
        history = history.to(device)
        if history.shape[1] != length:
            resized = history.new_zeros(history.shape[0], length)
            keep = min(length, history.shape[1])
            resized[:, :keep] = history[:, :keep]
            history = resized
        scale, scale_inv = scale.to(device), scale_inv.to(device)
        if ratio is not None:
            scale = scale * ratio.to(device)
            scale_inv = torch.reciprocal(scale)  # as every update computes it
        if scale is state[0]:  # (a move copies; otherwise keep the module's own untouched)
            scale, scale_inv = scale.clone(), scale_inv.clone()
    return scale, scale_inv, history


def split(scale, scale_inv, history) -> dict:
    """The checkpoint / inspection layout: forward (input, weight) and backward (gradient)
    views, histories as [history_len, n]."""
    def part(rows):
        return {"scale": scale[rows], "scale_inv": scale_inv[rows],
                "amax_history": history[rows].t()}
    return {"forward": part(slice(0, 2)), "backward": part(slice(2, 3))}


def joined(state: dict, device) -> tuple:
    """New (scale, scale_inv, amax_history) from the layout `split` makes."""
    fwd, bwd = state["forward"], state["backward"]
    with torch.inference_mode(False):
        return tuple(torch.cat([fwd[key].t() if key == "amax_history" else fwd[key],
                                bwd[key].t() if key == "amax_history" else bwd[key]])
                     .to(device, torch.float32).contiguous()
                     for key in ("scale", "scale_inv", "amax_history"))


def update(layers: Iterable) -> None:
    """Rolls the histories and updates the scales of many layers at once: per device,
    history length, recipe and amax group, one all-reduce of all the newest amaxes (tensor
    parallelism) and one launch per 96 tensors, on each layer's own buffers. Every rank of an
    amax group calls this with its layers in the same order (the order their forwards ran)."""
    batches = {}
    for layer in layers:
        history, recipe, group = layer.fp8_amax_history, layer._fp8_recipe, layer._fp8_amax_group
        if history is None:
            continue
        key = (history.device, history.shape[1], recipe.margin, recipe.amax_compute_algo,
               "" if group is None else group.group_name)
        batches.setdefault(key, []).append(layer)
    for (_, _, margin, algo, group_name), batch in batches.items():
        _C.update_delayed([m.fp8_amax_history for m in batch], [m.fp8_scale for m in batch],
                          [m.fp8_scale_inv for m in batch],
                          [v for m in batch for v in maxima(m._fp8_recipe)], margin,
                          algo == "max", group_name)
