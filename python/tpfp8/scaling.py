"""A layer's delayed-scaling state as four tensors -- ``scale`` and ``scale_inv`` [3] of its
input, weight and output gradient, the amax history of the input and weight [2, history_len]
(written by forward) and that of the gradient [1, history_len] (written by backward); tensor-
major, newest first -- and the update that rolls them, once per step, for many layers at a
time."""
from typing import Iterable

import torch

from . import _C
from .recipe import CurrentScaling, DelayedScaling

_FORWARD, _BACKWARD = slice(0, 2), slice(2, 3)  # of scale and scale_inv: input, weight | grad
# The native codes as plain ints, read once (torch.compile traces ints, not pybind enums).
_NONE, _DELAYED, _CURRENT = (int(v) for v in (_C.Scaling.NONE, _C.Scaling.DELAYED,
                                              _C.Scaling.CURRENT))
# recipe_codes(None): what a call outside fp8_autocast passes.
HIGH_PRECISION = (_NONE, int(_C.Fp8Format.E4M3), int(_C.Fp8Format.E5M2), 0.0)
# The recipes, each with its native scaling code: what fp8_autocast accepts.
_SCALING = {DelayedScaling: _DELAYED, CurrentScaling: _CURRENT}


def scaling_code(recipe) -> int:
    """The recipe's native scaling code; ValueError for anything not a recipe."""
    code = _SCALING.get(type(recipe))  # (a lookup answers once a step; subclasses: below)
    if code is not None:
        return code
    for kind, code in _SCALING.items():
        if isinstance(recipe, kind):
            return code
    names = " or ".join(f"tpfp8.{r.__name__}" for r in _SCALING)
    raise ValueError(f"recipe must be {names}, got {type(recipe).__name__}")


def recipe_codes(recipe) -> tuple:
    """(scaling, forward format, gradient format, epsilon) as the ops take them."""
    if recipe is None:
        return HIGH_PRECISION
    code = scaling_code(recipe)
    fwd, grad = recipe.formats
    return code, int(fwd), int(grad), float(getattr(recipe, "amax_epsilon", 0.0))


def recipe_key(recipe) -> tuple:
    """What a layer's delayed-scaling state was made for, as plain values (None: nothing
    yet); a layer keeps it beside its recipe (module.py's _delayed_state says why)."""
    if recipe is None:
        return None
    return (recipe.margin, recipe.fp8_format, recipe.amax_history_len, recipe.amax_compute_algo)


def maxima(recipe: DelayedScaling) -> tuple:
    """The largest FP8 value of each of the three tensors' formats."""
    fwd, grad = recipe.formats
    return float(fwd.max), float(fwd.max), float(grad.max)


def fresh(recipe: DelayedScaling, device) -> tuple:
    """Scales 1, histories zero, in float32 whatever torch's default dtype (Hugging Face
    builds a bf16 model under a bf16 default). Never inference tensors, so state first made
    under ``torch.inference_mode`` still loads and trains."""
    with torch.inference_mode(False):
        length, f32 = recipe.amax_history_len, {"device": device, "dtype": torch.float32}
        return (torch.ones(3, **f32), torch.ones(3, **f32), torch.zeros(2, length, **f32),
                torch.zeros(1, length, **f32))


def adopted(state: tuple, old: DelayedScaling, recipe: DelayedScaling, device) -> tuple:
    """`state` (made under `old`) under `recipe`: the same tensors when only the margin or
    the algorithm changes (the next update reads them), else new ones. Another
    ``amax_history_len`` resizes the histories keeping the newest entries (dropping the oldest,
    or padding with zeros, as TransformerEngine does); another format rescales the scales by
    the ratio of the formats' maxima (the scale stays fp8_max / amax)."""
    scale, scale_inv, *histories = state
    length, ratio = recipe.amax_history_len, None
    if maxima(recipe) != maxima(old):
        ratio = torch.tensor([n / o for n, o in zip(maxima(recipe), maxima(old))],
                             dtype=torch.float32)
    if histories[0].shape[1] == length and ratio is None and scale.device == device:
        return state
    with torch.inference_mode(False):
        histories = [_resized(h.to(device), length) for h in histories]
        if ratio is not None:
            scale = scale.to(device) * ratio.to(device)
            scale_inv = torch.reciprocal(scale)  # as every update computes it
        else:  # a copy: the module's own stay untouched until the call succeeds
            scale, scale_inv = scale.to(device, copy=True), scale_inv.to(device, copy=True)
    return (scale, scale_inv, *histories)


def _resized(history: torch.Tensor, length: int) -> torch.Tensor:
    if history.shape[1] == length:
        return history.clone()
    resized = history.new_zeros(history.shape[0], length)
    keep = min(length, history.shape[1])
    resized[:, :keep] = history[:, :keep]
    return resized


def split(scale, scale_inv, history, grad_history) -> dict:
    """The checkpoint / inspection layout: forward (input, weight) and backward (gradient)
    views, histories as [history_len, n]."""
    def part(rows, h):
        return {"scale": scale[rows], "scale_inv": scale_inv[rows], "amax_history": h.t()}
    return {"forward": part(_FORWARD, history), "backward": part(_BACKWARD, grad_history)}


def joined(state: dict, device) -> tuple:
    """New (scale, scale_inv, amax_history, grad_amax_history) from the layout `split`
    makes."""
    fwd, bwd = state["forward"], state["backward"]
    with torch.inference_mode(False):
        def f32(t):
            return t.to(device, torch.float32).contiguous()
        return (f32(torch.cat([fwd["scale"], bwd["scale"]])),
                f32(torch.cat([fwd["scale_inv"], bwd["scale_inv"]])),
                f32(fwd["amax_history"].t()), f32(bwd["amax_history"].t()))


def check_layout(state: tuple, recipe: DelayedScaling) -> None:
    """ValueError unless `state` is (scale [3], scale_inv [3], amax_history [2, H],
    grad_amax_history [1, H]) with H the recipe's ``amax_history_len``."""
    length = recipe.amax_history_len
    want = ((3,), (3,), (2, length), (1, length))
    got = tuple(tuple(t.shape) for t in state)
    if got != want:
        raise ValueError(f"tpfp8.Linear FP8 state: shapes {list(got)} (scale, scale_inv, amax "
                         f"history, gradient amax history), expected {list(want)} for the "
                         f"recipe's amax_history_len={length}; the checkpoint is damaged")


# A layer's FP8 state in a checkpoint: one float32 tensor (what Hugging Face's save_pretrained
# and safetensors take; torch.load(weights_only=True) reads it too): a header -- layout
# version, then the DelayedScaling's margin, format (0 hybrid, 1 e4m3), history length and
# algorithm (0 max, 1 most_recent) -- then scale [3], scale_inv [3], the forward histories
# [2, H] and the gradient's [1, H]. Empty: no delayed-scaling step yet.
_LAYOUT = 1
_HEADER = 5
_FORMAT_CODES, _ALGO_CODES = ("hybrid", "e4m3"), ("max", "most_recent")


def to_tensor(state: tuple, recipe: DelayedScaling) -> torch.Tensor:
    """The checkpoint tensor of `state` (scale, scale_inv, amax_history, grad_amax_history)."""
    header = torch.tensor([_LAYOUT, recipe.margin, _FORMAT_CODES.index(recipe.fp8_format),
                           recipe.amax_history_len,
                           _ALGO_CODES.index(recipe.amax_compute_algo)],
                          dtype=torch.float32, device=state[0].device)
    return torch.cat([header] + [t.reshape(-1) for t in state])


def from_tensor(saved: torch.Tensor, device) -> tuple:
    """(state tensors on `device`, DelayedScaling) from a checkpoint tensor (`to_tensor`).
    The header is read where the checkpoint lies (the module may be on "meta")."""
    saved = saved.detach().reshape(-1)
    header = [int(v) for v in saved[:_HEADER].tolist()]
    if len(header) < _HEADER or header[0] != _LAYOUT:
        raise ValueError(f"tpfp8.Linear FP8 state: unknown layout (header {header}); this "
                         f"tpfp8 reads layout {_LAYOUT}, written by tpfp8 >= 0.1")
    _, margin, fmt, length, algo = header
    if not (0 <= fmt < len(_FORMAT_CODES) and 0 <= algo < len(_ALGO_CODES) and length > 0):
        raise ValueError(f"tpfp8.Linear FP8 state: bad header {header} (format code 0-1, "
                         f"history length > 0, algorithm code 0-1); the checkpoint is damaged")
    if saved.numel() != _HEADER + 6 + 3 * length:
        raise ValueError(f"tpfp8.Linear FP8 state: {saved.numel()} values, expected "
                         f"{_HEADER + 6 + 3 * length} for a history of {length}")
    recipe = DelayedScaling(margin=margin, fp8_format=_FORMAT_CODES[fmt],
                            amax_history_len=length, amax_compute_algo=_ALGO_CODES[algo])
    with torch.inference_mode(False):
        flat = saved[_HEADER:].to(device, torch.float32)
        parts = flat.split([3, 3, 2 * length, length])
        state = (parts[0].clone(), parts[1].clone(), parts[2].reshape(2, length).clone(),
                 parts[3].reshape(1, length).clone())
    return state, recipe


def update(layers: Iterable) -> None:
    """Rolls the histories and updates the scales of many layers at once, each by the recipe
    its state follows (a layer that an inner fp8_autocast block ran under another recipe follows
    that one): per device, recipe and amax group, one all-reduce of all the newest amaxes (tensor
    parallelism) and one launch per 96 tensors, on each layer's own buffers. Every rank of an
    amax group calls this with its layers in the same order (the order their forwards ran).

    Host time: the update of a set of layers is planned once (`_C.UpdatePlan`) and kept by the
    first of them -- with the set's state tensors, until a set starting with that layer is planned
    again; a step then checks in C++ that every layer still holds what the plan took, and plans
    again if not."""
    layers = tuple(layers)
    if not layers:
        return
    kept = layers[0].__dict__
    plans = kept.get(PLANS)
    # (A key to find the plan by, not proof that it fits: its run checks every layer.)
    key = (len(layers), id(layers[-1]))
    plan = None if plans is None else plans.get(key)
    if plan is not None and plan.run(layers):
        return
    if plans is None or len(plans) >= _MAX_PLANS:
        plans = kept[PLANS] = {}
    plan = plans[key] = _plan(layers)
    if not plan.run(layers):
        raise RuntimeError("tpfp8: a delayed-scaling update planned just now refused to run; "
                           "please report this")


# Where the first layer of a set keeps the plans of the sets it starts, by their length and last
# layer (not pickled, not copied: module.py); a few, for sets that vary (experts chosen by a
# router, blocks nested in each other).
PLANS = "_fp8_update_plans"
_MAX_PLANS = 4
# What a plan checks each layer still holds: its state buffers, and the attributes that chose
# its group; and the count it adds one to.
_PLANNED_BUFFERS = ("fp8_scale", "fp8_scale_inv", "fp8_amax_history", "fp8_grad_amax_history",
                    "fp8_scale_prev")
_PLANNED_ATTRS = ("_fp8_recipe_key", "_fp8_amax_group")
_COUNT = "_fp8_updates"


def _plan(layers: tuple):
    """The update of `layers` as a `_C.UpdatePlan`: one `_C.DelayedUpdate` per device, recipe
    and amax group."""
    batches = {}
    for position, layer in enumerate(layers):
        state = layer._buffers
        scale = state["fp8_scale"]
        key = (scale.device, layer._fp8_recipe_key, layer._fp8_amax_group)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = (layer._fp8_recipe, [], [], [], [], [], [])
        batch[1].append(scale)
        batch[2].append(state["fp8_scale_inv"])
        batch[3].append(state["fp8_amax_history"])
        batch[4].append(state["fp8_grad_amax_history"])
        batch[5].append(_previous(state))
        batch[6].append(position)
    # (each update keeps each scale before it in `previous`, in the same launch: what a
    # checkpoint's recompute after this update casts with)
    updates = [_C.DelayedUpdate(scales, scale_invs, histories, grad_histories,
                                maxima(recipe) * len(scales), recipe.margin,
                                recipe.amax_compute_algo == "max",
                                "" if group is None else group.group_name, previous)
               for (_, _, group), (recipe, scales, scale_invs, histories, grad_histories,
                                   previous, _) in batches.items()]
    groups = [batch[6] for batch in batches.values()]
    return _C.UpdatePlan(layers, _PLANNED_BUFFERS, _PLANNED_ATTRS, _COUNT, updates, groups)


def _previous(state: dict) -> torch.Tensor:
    """The buffer that keeps the layer's scale before an update (made the first time, or after
    the state moved)."""
    scale, previous = state["fp8_scale"], state["fp8_scale_prev"]
    if previous is None or previous.device != scale.device:
        with torch.inference_mode(False):
            previous = state["fp8_scale_prev"] = torch.empty_like(scale)
    return previous
