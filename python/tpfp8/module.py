"""``tpfp8.Linear``: a drop-in ``torch.nn.Linear`` whose three GEMMs run in FP8 inside
``fp8_autocast``. All math and autograd happen in C++ (the op torch.ops.tpfp8.linear over
linear_forward / linear_backward, csrc/linear_autograd.cpp); this file holds the module's
parameters, FP8 state (as buffers) and frozen config, and makes the op's arguments."""
import collections
import copy
import glob
import json
import math
import os
import warnings
import weakref
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from . import _C
from . import autocast as _autocast
from . import checkpointing as _checkpointing
from . import debug as _debug
from . import parallel as _parallel
from . import scaling as _scaling
from .recipe import DelayedScaling

_PARALLEL = {None: int(_C.ParallelMode.NONE), "column": int(_C.ParallelMode.COLUMN),
             "row": int(_C.ParallelMode.ROW)}


class Linear(nn.Linear):
    """``y = x W^T + b`` with ``W`` [out_features, in_features], like ``torch.nn.Linear``
    (same parameters, same initialisation, loads an ``nn.Linear`` state dict). It is an
    ``nn.Linear`` (a subclass), so ``isinstance`` checks and tools that wrap or replace
    Linears (PEFT's LoRA, model surgery) accept it.

    Inside ``tpfp8.fp8_autocast`` the forward GEMM and both backward GEMMs run in FP8; outside
    it the same C++ path runs them in the input's precision. Under ``torch.autocast`` the input,
    weight and bias are computed in the autocast dtype.

    Args:
        in_features, out_features, bias, device, dtype: as for ``torch.nn.Linear``. FP8 needs
            both feature counts (per rank) to be multiples of ``tpfp8._C.FP8_MULTIPLE`` (16).
        save_original_input: keep the high-precision input for backward and re-quantize it
            there (not with delayed scaling), instead of the 1-byte column-wise FP8 copy.
        fuse_wgrad_accumulation: write the weight gradient into ``weight.main_grad`` (fp32,
            allocated if missing) instead of ``weight.grad``: overwritten by the backward of an
            ``is_first_microbatch=True`` call, accumulated by the others. The overwrite
            belongs to that call's backward, every time it runs, so it must be the first to
            reach ``main_grad`` in a step: run each micro-batch's backward before the next
            micro-batch's (as gradient accumulation and pipeline schedules do). Where it is
            not -- one backward through several micro-batches' outputs (their backwards run
            last first), a layer called twice with ``is_first_microbatch=True`` in one
            micro-batch (a shared or tied layer), two backwards through one forward
            (``retain_graph=True``) -- the overwrite drops the gradients before it: there,
            pass ``is_first_microbatch=None`` and zero ``main_grad`` yourself, as
            TransformerEngine users do.
        return_bias: return ``(y_without_bias, bias)`` so the caller can fuse the bias later.
        name: a label for debugging tools.
        parallel_mode: None, ``"column"`` (``Y = X [A_1 .. A_p]``: this rank holds
            ``weight [out/tp, in]`` and a bias shard, and outputs ``[..., out/tp]``) or
            ``"row"`` (``Y = sum_r X_r A_r``: ``weight [out, in/tp]``, input ``[..., in/tp]``,
            the full bias added after the reduction). ``in_features`` and ``out_features``
            are the full sizes.
        tp_group: the tensor-parallel process group (required with a parallel_mode).
        sequence_parallel: activations outside the layer are split along dim 0: a column
            layer all-gathers its input (in FP8 inside fp8_autocast), a row layer
            reduce-scatters its output.

    Shapes: input ``[..., in_features]`` (fp32, bf16 or fp16) -> ``[..., out_features]``
    (per-rank sizes under tensor parallelism).
    """

    # Settings that make the parameters (and their split): refused once the layer is built.
    _fixed_after_init = frozenset(
        ("in_features", "out_features", "parallel_mode", "tp_group", "sequence_parallel"))

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, save_original_input: bool = False,
                 fuse_wgrad_accumulation: bool = False, return_bias: bool = False,
                 name: Optional[str] = None, parallel_mode: Optional[str] = None,
                 tp_group=None, sequence_parallel: bool = False):
        nn.Module.__init__(self)  # (nn.Linear's would make full-size parameters: TP splits them)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"in_features and out_features must be positive, got "
                             f"{in_features} and {out_features}")
        self._check_parallel(parallel_mode, tp_group, sequence_parallel, in_features,
                             out_features)
        self.parallel_mode, self.tp_group = parallel_mode, tp_group
        self.sequence_parallel = sequence_parallel
        tp = _parallel.group_size(tp_group) if parallel_mode else 1
        out_local = out_features // tp if parallel_mode == "column" else out_features
        in_local = in_features // tp if parallel_mode == "row" else in_features
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_local, in_local, **factory))
        bias_size = out_local if parallel_mode == "column" else out_features
        self.bias = nn.Parameter(torch.empty(bias_size, **factory)) if bias else None
        if parallel_mode:  # what Megatron-style optimizers and checkpointers look for
            self.weight.tensor_model_parallel = True
            self.weight.partition_dim = 0 if parallel_mode == "column" else 1
            if self.bias is not None and parallel_mode == "column":
                self.bias.tensor_model_parallel, self.bias.partition_dim = True, 0
        self.save_original_input = save_original_input
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.return_bias = return_bias
        self.name = name
        self._debug_handle = _debug.register(self)
        self._config = self._make_config()
        # Delayed-scaling state (input, weight, output gradient): made with the parameters
        # (reset_parameters), so that a compiled model's first step finds it as a buffer; the
        # recipe it follows (None: no delayed-scaling step yet) and the group its amaxes were
        # last reduced over.
        for name in _STATE:
            self.register_buffer(name, None, persistent=False)  # checkpointed as extra state
        self._fp8_recipe, self._fp8_amax_group = None, None
        # For activation checkpointing (tpfp8.checkpointing): the scales before the last
        # delayed-scaling update (made by the first update) and the number of updates so far.
        self.register_buffer("fp8_scale_prev", None, persistent=False)
        self._fp8_updates, self._fp8_ran_fp8 = 0, False  # (any FP8 forward yet)
        # The cached FP8 weight (is_first_microbatch), made by the first call that fills it.
        for name in ("_fp8_weight_rowwise", "_fp8_weight_columnwise", "_fp8_weight_scale_inv"):
            self.register_buffer(name, None, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s initialisation. Under tensor parallelism the full weight is
        drawn as a single-device layer would draw it and this rank keeps its slice, so the
        shards equal the slices of a single-device layer built with the same seed."""
        weight = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype,
                             device=self.weight.device)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        bias = None
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            bias = torch.empty(self.out_features, dtype=self.bias.dtype,
                               device=self.bias.device).uniform_(-bound, bound)
        self.load_full_state_dict({"weight": weight, "bias": bias})
        self._reset_fp8_state()

    def _reset_fp8_state(self) -> None:
        """Fresh delayed-scaling state on the weight's device (scales 1, histories zero, the
        default recipe's history length) and no cached FP8 weight."""
        self._keep_state(_scaling.fresh(DelayedScaling(), self.weight.device))
        self._fp8_recipe = None
        self._keep_weight_cache((None, None, None))

    @staticmethod
    def _check_parallel(mode, group, sequence_parallel, in_features, out_features):
        if mode not in _PARALLEL:
            raise ValueError(f"parallel_mode must be None, 'column' or 'row', got {mode!r}")
        if mode is None:
            if sequence_parallel:
                raise ValueError("sequence_parallel=True needs parallel_mode 'column' or 'row'")
            return
        if group is None:
            raise ValueError(f"parallel_mode={mode!r} needs tp_group (a torch.distributed "
                             f"process group); initialise torch.distributed first")
        _parallel.check_group(group)
        features = out_features if mode == "column" else in_features
        what = "out_features" if mode == "column" else "in_features"
        _parallel.check_divisible(features, group, what, "choose a size the group divides")

    def _split_dims(self):
        """(weight dim, bias dim or None) that are split across the group."""
        if self.parallel_mode == "column":
            return 0, 0
        return (1, None) if self.parallel_mode == "row" else (None, None)

    _FULL_KEYS = ("weight", "bias")  # (the keys a full state dict of this class may hold)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Loads single-device (unsharded) ``weight`` / ``bias``; each rank keeps its slice.
        Every key and shape is checked before anything is copied (ValueError)."""
        _check_full_keys(state, self._FULL_KEYS, type(self).__name__)
        for param, value in self._full_parts(state):
            param.copy_(value)

    def _full_parts(self, state: dict, key=str) -> list:
        """(parameter, this rank's part of its tensor in `state`), each checked against the
        parameter's full (unsharded) shape; `key(name)` is a parameter's key in `state`."""
        w_dim, b_dim = self._split_dims()
        parts = []
        for name, dim, full in (("weight", w_dim, (self.out_features, self.in_features)),
                                ("bias", b_dim, (self.out_features,))):
            param, given = getattr(self, name), state.get(key(name))
            if param is None and given is None:
                continue
            if param is None or given is None:
                layer, other = ("has no", "has one") if param is None else ("has a", "none")
                raise ValueError(f"load_full_state_dict: the layer {layer} {key(name)}, the "
                                 f"state {other}")
            _check_full_shape(key(name), given, full, param)
            parts.append((param, given if dim is None else self._shard(given, dim)))
        return parts

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The single-device (unsharded) ``weight`` / ``bias``, gathered from every rank."""
        w_dim, b_dim = self._split_dims()
        out = {"weight": self.weight.detach().clone() if w_dim is None
               else self._unshard(self.weight, w_dim)}
        if self.bias is not None:
            out["bias"] = (self.bias.detach().clone() if b_dim is None
                           else self._unshard(self.bias, b_dim))
        return out

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full weight or bias along `dim`."""
        return _parallel.shard(full, dim, self.tp_group)

    def _unshard(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        return _parallel.unshard(local, dim, self.tp_group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")

    # ---- FP8 state ----------------------------------------------------------------------

    @property
    def config(self) -> "LinearConfig":
        """The layer's configuration as its ops take it (a frozen value; set the attributes
        ``save_original_input``, ``fuse_wgrad_accumulation`` or ``return_bias`` to change it
        for the next call)."""
        return self._config

    @property
    def fp8_state(self) -> Optional[dict]:
        """The delayed-scaling state, to inspect (views of the live buffers: read, do not
        write), or None before the first delayed-scaling FP8 step: ``{"forward": {"scale": [2],
        "scale_inv": [2], "amax_history": [history_len, 2]}`` (input, weight), ``"backward":
        {... [1] ...}`` (the output gradient), ``"recipe"``: the DelayedScaling it follows,
        ``"amax_group"``: the group its amaxes were last reduced over (or None)}. Row 0 of a
        history is the running step's amax. The module's buffers hold them: ``fp8_scale``,
        ``fp8_scale_inv`` [3], ``fp8_amax_history`` [2, history_len] and
        ``fp8_grad_amax_history`` [1, history_len]."""
        if self._fp8_recipe is None:
            return None
        state = _scaling.split(*self._state())
        return {**state, "recipe": self._fp8_recipe, "amax_group": self._fp8_amax_group}

    def get_extra_state(self) -> torch.Tensor:
        """FP8 state (delayed-scaling scales and amax histories, and the recipe they follow)
        for checkpoints, as one float32 tensor (`scaling.to_tensor`; empty before the first
        delayed-scaling step): what Hugging Face's ``save_pretrained`` and safetensors take, and
        ``torch.load(..., weights_only=True)`` reads."""
        if self._fp8_recipe is None:
            return torch.empty(0, device=self.weight.device, dtype=torch.float32)
        return _scaling.to_tensor(self._state(), self._fp8_recipe)

    def set_extra_state(self, state) -> None:
        """Loads the FP8 state as it was saved (its recipe, its history length); a forward
        with another ``amax_history_len`` then resizes the histories, keeping the newest
        entries. An empty state (saved before the first delayed-scaling step, or under current
        scaling) leaves the layer with none, as the saved layer had: fresh scales and
        histories. ``None`` (a plain ``nn.Linear`` checkpoint) leaves the layer's state as it
        is. State of the same layout is loaded into the module's own buffers (those a captured
        CUDA graph updates). Also reads the dict of checkpoints written before the tensor
        layout."""
        if state is None:
            return
        loaded, recipe = self._saved_state(state)
        mine = self._state()
        same = all(a.shape == b.shape and a.device == b.device for a, b in zip(mine, loaded))
        with torch.no_grad():
            if same:
                for buffer, value in zip(mine, loaded):
                    buffer.copy_(value)
            else:
                self._keep_state(loaded)
        self._fp8_recipe = recipe
        if recipe is None:  # (the cached FP8 weight was cast with the state just dropped)
            self._keep_weight_cache((None, None, None))

    def _saved_state(self, state) -> tuple:
        """(state tensors on the weight's device, recipe) of a checkpoint's FP8 state: fresh
        ones and None where it holds none. ValueError for a damaged one."""
        device = self.weight.device
        if isinstance(state, torch.Tensor):
            if state.numel() == 0:
                return _scaling.fresh(DelayedScaling(), device), None
            return _scaling.from_tensor(state, device)
        if not state:
            return _scaling.fresh(DelayedScaling(), device), None
        recipe = state["recipe"]
        if isinstance(recipe, dict):  # (older checkpoints hold the DelayedScaling itself)
            recipe = DelayedScaling(**recipe)
        loaded = _scaling.joined(state, device)
        _scaling.check_layout(loaded, recipe)
        return loaded, recipe

    def _state(self) -> tuple:
        b = self._buffers  # (not nn.Module.__getattr__ four times: host time per call)
        return b["fp8_scale"], b["fp8_scale_inv"], b["fp8_amax_history"], b["fp8_grad_amax_history"]

    def _keep_state(self, tensors) -> None:
        for name, t in zip(_STATE, tensors):
            setattr(self, name, t)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A plain nn.Linear checkpoint has no _extra_state: accept it. A damaged FP8 state is
        # refused before torch copies the parameters, so the layer stays as it was.
        saved = state_dict.setdefault(prefix + "_extra_state", None)
        if saved is not None:
            _named_errors(prefix + "_extra_state", self._saved_state, saved)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __getstate__(self):
        """Pickling: the amax group (a ProcessGroup) does not pickle; the next FP8 forward
        sets it again. (A tensor-parallel layer does not pickle: its tp_group cannot. A
        shallow ``copy.copy`` passes through here too, and shares the group.)"""
        state = self._copied_state()
        state["_fp8_amax_group"] = None
        return state

    def _copied_state(self) -> dict:
        """What a copy takes: all but the update plans and the call template this layer may
        keep (native, and made again by the copy's first update and call)."""
        state = super().__getstate__()  # a copy already
        state.pop(_scaling.PLANS, None)
        state.pop(_TEMPLATE, None)
        return state

    def __setstate__(self, state) -> None:
        # Pickles of earlier versions: no update count, and per-layer records of forwards for
        # recomputes (now kept by the checkpoints themselves).
        state.setdefault("_fp8_updates", 0)
        state.setdefault("_fp8_ran_fp8", state.get("_fp8_recipe") is not None)
        state.setdefault("_fp8_recipe_key", _scaling.recipe_key(state.get("_fp8_recipe")))
        for name in ("_fp8_ran", "_fp8_ran_no_grad", "_fp8_replayed", "_fp8_repeating",
                     "_fp8_loose"):
            state.pop(name, None)
        state.setdefault("_buffers", {}).setdefault("fp8_scale_prev", None)
        super().__setstate__(state)
        self._debug_handle = _debug.register(self)  # a copy reports as itself
        self._config = self._make_config()

    def __deepcopy__(self, memo):
        # A copy computes over the same tensor-parallel group: shared, not copied (a
        # ProcessGroup cannot be).
        for group in (self.tp_group, self._fp8_amax_group):
            if group is not None:
                memo[id(group)] = group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self._copied_state(), memo))
        # A Parameter's deepcopy drops what was set on it: keep the tensor-parallel layout
        # (optimizers and checkpointers read it); main_grad, like .grad, is not copied.
        for mine, theirs in ((self.weight, new.weight), (self.bias, new.bias)):
            for attr in ("tensor_model_parallel", "partition_dim"):
                if mine is not None and hasattr(mine, attr):
                    setattr(theirs, attr, getattr(mine, attr))
        return new

    def __setattr__(self, name, value):
        # The tensor-parallel layout fixes the parameters' shapes: changing it needs a new layer.
        if name in self._fixed_after_init and name in self.__dict__ and \
                value != self.__dict__[name]:
            kind = type(self).__name__
            raise AttributeError(f"{kind}.{name} is fixed when the layer is built (it sets the "
                                 f"parameters and their split); build a new tpfp8.{kind}")
        super().__setattr__(name, value)
        if name == "_fp8_recipe":
            super().__setattr__("_fp8_recipe_key", _scaling.recipe_key(value))
        if name in _SETTINGS and "_config" in self.__dict__:  # takes effect at the next call
            self._config = self._make_config()
        if name == "name" and "_debug_handle" in self.__dict__:
            _debug.renamed(self)

    def _make_config(self) -> "LinearConfig":
        group = self.tp_group.group_name if self.parallel_mode else ""
        return LinearConfig(_PARALLEL[self.parallel_mode], self.sequence_parallel, group,
                            self.save_original_input, self.fuse_wgrad_accumulation,
                            self.return_bias)

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.cuda()``, ``.half()``...: the FP8 state moves with the parameters and
        stays fp32 (a loaded checkpoint's scales and histories survive ``model.cuda()``), as do
        ``weight.main_grad`` (like ``.grad``) and the parameters' tensor-parallel attributes.
        The cached FP8 weight is dropped if the weight changed: the next
        ``is_first_microbatch=True`` call refills it."""
        before = self._weight_identity()
        # Read before the move: torch may swap the parameters' contents (swap_tensors), and
        # what was set on them with it.
        carried = [{attr: getattr(p, attr) for attr in _CARRIED if hasattr(p, attr)}
                   for p in (self.weight, self.bias)]
        # Moved, never converted; remade instead when no FP8 step has run (nothing to keep).
        moved = _FP32_STATE if self._fp8_recipe is not None else _FP32_STATE[len(_STATE):]
        original = {name: self._buffers[name] for name in _FP32_STATE}
        self._buffers.update(dict.fromkeys(_FP32_STATE))
        try:
            super()._apply(fn, *args, **kwargs)
            arrived = {name: None if original[name] is None else _moved(fn, original[name])
                       for name in moved}
        except BaseException:  # (a failed move, out of memory say, leaves the state as it was)
            self._buffers.update(original)
            raise
        self._buffers.update(arrived)
        if self._fp8_recipe is None:  # (moving it would copy, to_empty would give garbage)
            self._keep_state(_scaling.fresh(DelayedScaling(), self.weight.device))
        device = self.weight.device
        for param, attrs in zip((self.weight, self.bias), carried):
            for attr, value in attrs.items():
                if param is not None:
                    setattr(param, attr, value.to(device) if attr == "main_grad" else value)
        if self._weight_identity() != before:
            self._keep_weight_cache((None, None, None))
        return self

    def _weight_identity(self):
        w = self.weight
        return w.data_ptr() if w.device.type != "meta" else None, w.dtype, w.device

    def _keep_weight_cache(self, buffers) -> None:
        self._fp8_weight_rowwise, self._fp8_weight_columnwise, self._fp8_weight_scale_inv = buffers

    # ---- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                residual: Optional[torch.Tensor] = None):
        """``x [..., in_features] -> [..., out_features]``.

        ``is_first_microbatch``: None casts the weight to FP8 every call; True casts and
        caches it; False reuses the cache (the weights must not have changed since).

        ``residual``: a tensor of the output's shape and dtype added to it -- a block's skip
        connection, ``residual + layer(x)`` without a separate add kernel. The forward GEMM
        adds it before rounding its output once (so the sum can differ from the separate add
        in the last bit, closer to the exact sum); under row parallelism it is added after the
        reduction. Its gradient is the output's. Given ``residual=x`` to a ``LayerNormLinear``
        (``x + layer(norm(x))``, where ``out_features == in_features``), backward also adds
        that gradient to ``x``'s in the norm backward's own pass.

        A call that raises (bad input, a rejected option) leaves the module as it was: FP8
        state, weight cache and ``weight.main_grad`` are only changed by calls that succeed.
        On the meta device it gives the output's shape and dtype and keeps nothing.
        """
        _check_residual(residual)
        if residual is None and not torch.compiler.is_compiling():
            template = self.__dict__.get(_TEMPLATE)
            if template is not None:
                out = template.run(self, x, is_first_microbatch)
                if out is not None:
                    return out
        call = self._begin(x, is_first_microbatch)
        y, prologue_out = _run_op(call.vet, call.compiling, _LINEAR, call.x, *call.op_args,
                                  residual)
        self._end(call)
        if residual is None:  # (a template repeats calls without one)
            self._keep_template(call, x, is_first_microbatch)
        return self._outputs(y, self._config.return_bias, call.bias_out, prologue_out)

    def _keep_template(self, call: "_Call", x, is_first_microbatch) -> None:
        """After a call made the slow way: a template of it (`_C.CallTemplate`, see
        csrc/call_template.cpp) that the calls after it run with less host time while the
        template fits them -- where the call is one a template can repeat: eager, outside
        checkpoints and backward, no debug rule, new state or weight cache, or main_grad to
        make (an existing one is read from the weight at each call); an exact tensor in
        (floating point under torch.autocast, whose dtype the template keeps and converts to as
        `_compute_dtype` does); a plain Linear's op arguments.

        (design.md: nothing about a layer is cached under a hand-kept key. A template is no
        such key: nothing resets it by hand, its tensors are read from the layer at each call,
        and every input of the choices `_begin` and `_prepare` make is checked, live, at each
        call. Those checks mirror this slow path: a change here needs its twin in
        csrc/call_template.cpp, and tests_py/test_call_template.py holds each case to the slow
        path bit for bit.)"""
        if not self._repeatable(call, x, is_first_microbatch):
            return
        frame, delayed = call.frame, call.state is not None
        sources = [("weight", "_parameters", "weight"), ("bias", "_parameters", "bias")]
        if delayed:
            sources += _STATE_SOURCES
        if call.cache_mode == _WEIGHT_CACHE_REUSE:
            sources += _CACHE_SOURCES
        # As the template finds them; a value it could not pass (a subclass overriding
        # __torch_function__, a property) would make it refuse every call.
        if not all(type(self._source(c, n)) in _PLAIN for _, c, n in sources):
            return
        if self._config.return_bias:  # (the op adds none; the template returns it)
            sources.pop(1)
        self.__dict__[_TEMPLATE] = _C.CallTemplate(
            _LINEAR[1], (call.x, *call.op_args, None), sources, is_first_microbatch, self._config,
            codes=None if frame is None else frame["codes"], delayed=delayed,
            registers=delayed and call.cache_mode != _WEIGHT_CACHE_REUSE,
            frame_group=frame["amax_group"] if delayed else None, amax_group=call.amax_group,
            return_bias=self._config.return_bias, frames=_autocast.thread_state(),
            debug=_debug.state(), autocast_dtype=_autocast_dtype(x.device.type),
            main_grad=self._config.fuse_wgrad_accumulation)

    def _source(self, container: str, name: str):
        """What a call template reads for a tensor: layer.<container>[name], else the layer's
        own attribute (a bias of None); `_MISSING` where neither is."""
        value = self.__dict__[container].get(name, _MISSING)
        return self.__dict__.get(name, _MISSING) if value is _MISSING else value

    def _repeatable(self, call: "_Call", x, is_first_microbatch) -> bool:
        """Whether a template can repeat this call (see `_keep_template`)."""
        if x.device.type not in ("cpu", "cuda"):
            return False
        converted = torch.is_autocast_enabled(x.device.type)  # (by _compute_dtype)
        return (
            not call.compiling and call.checkpoints is None and type(x) is torch.Tensor
            and (x.is_floating_point() if converted else call.x is x)
            and not torch._C._is_torch_function_mode_enabled()
            and (is_first_microbatch is None or is_first_microbatch is False)
            and not (call.new_state or call.new_cache or call.new_main_grad is not None)
            and type(call.main_grad) in _PLAIN and not _debug.state().rules
            and call.param is self._parameters.get("weight") and _templated_class(type(self)))

    def _begin(self, x, is_first_microbatch, input_needs_grad: Optional[bool] = None) -> "_Call":
        """Everything before the op: the recipe or the forward a checkpoint repeats, the input
        in the GEMMs' dtype, the op's arguments after the input and the state made for them.
        ``input_needs_grad`` overrides ``x.requires_grad`` where ``x`` stands in for an input
        the op makes itself (LayerNormMLP's fc2: fc1's output)."""
        if not isinstance(x, torch.Tensor):  # (its values are checked once, in C++: ValueError)
            raise TypeError(f"Linear expects a tensor, got {type(x).__name__}")
        param, config = _parameter(self, "weight"), self._config
        compiling = torch.compiler.is_compiling()
        # (None: compiling, or no checkpoint around this forward and not inside backward)
        checkpoints = None if compiling else _checkpointing.around()
        # (a recompute: the forward it repeats)
        repeated = None if checkpoints is None else self._repeated(checkpoints)
        frame = self._recompute_frame(repeated) if repeated is not None else _autocast.current()
        weight, bias = param, _parameter(self, "bias")
        if _any_autocast():  # (one call answers most steps, before the per-device question)
            x, weight, bias = self._compute_dtype(x, weight, bias, in_fp8=frame is not None)
        bias_out = None
        if config.return_bias:
            bias_out, bias = bias, None
        if input_needs_grad is None:
            input_needs_grad = x.requires_grad
        call = self._prepare(config, frame, param, weight, bias, is_first_microbatch, repeated,
                             input_needs_grad, x.device)
        call.x, call.bias, call.bias_out = x, bias, bias_out
        call.frame, call.checkpoints, call.compiling = frame, checkpoints, compiling
        call.param = param
        call.recompute = repeated is not None
        call.vet = checkpoints is not None and checkpoints.in_backward
        return call

    def _end(self, call: "_Call") -> None:
        """After a successful op: keeps what the call made and records it for checkpoints."""
        if call.x.is_meta:
            return
        self._commit(call, call.param, call.frame, call.recompute)
        if call.compiling or call.recompute:
            return
        if call.checkpoints is not None:
            _checkpointing.record(self, self._forward_record(call.frame), call.checkpoints)
        if call.frame is not None and not self._fp8_ran_fp8:  # (frames have recipes)
            self._fp8_ran_fp8 = True

    # ---- what the fused modules change ----------------------------------------------------

    def _prologue(self) -> tuple:
        """The op's prologue arguments (weight, bias, code, eps, keep its output): what runs
        on the input before its cast -- nothing in a plain Linear."""
        return _NO_PROLOGUE

    def _prologue_needs_grad(self) -> bool:
        return False

    def _outputs(self, y, return_bias: bool, bias, prologue_out):
        """What forward returns: y, or (y, bias) with return_bias."""
        return (y, bias) if return_bias else y

    def _prepare(self, config, frame, param, weight, bias, is_first_microbatch, repeated,
                 input_needs_grad: bool, device) -> "_Call":
        """The op's arguments after the input (`weight` and `bias` in the GEMMs' dtype), and
        the state made for them (kept by `_commit` once the call succeeded)."""
        call = _Call()
        state = _NO_STATE
        if frame is not None and frame["key"] is not None:  # (a key: delayed scaling)
            state, call.new_state = self._delayed_state(frame["recipe"], frame["key"], device)
            call.state = state
            if repeated is not None:
                call.replay = self._forward_scales(repeated)
            call.amax_group = _parallel.amax_group_for(self.tp_group, config.sequence_parallel,
                                                       frame["amax_group"])
        call.cache_mode, call.weight_cache, call.new_cache = self._weight_cache_for(
            frame is not None, is_first_microbatch)
        if config.fuse_wgrad_accumulation and param.requires_grad:
            call.main_grad = getattr(param, "main_grad", None)
            if call.main_grad is None:
                _refuse_under_compile(
                    "fuse_wgrad_accumulation=True needs weight.main_grad to exist before a "
                    "compiled call (backward writes into it); run one step eagerly or set it, "
                    "e.g. weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)")
                with torch.inference_mode(False):
                    call.main_grad = call.new_main_grad = torch.zeros_like(
                        param, dtype=torch.float32)
            elif not isinstance(call.main_grad, torch.Tensor):
                raise TypeError(
                    "fuse_wgrad_accumulation needs weight.main_grad to be a float32 tensor "
                    f"shaped like the weight, got {type(call.main_grad).__name__}; e.g. "
                    "weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)")
        grad = torch.is_grad_enabled()
        call.need_dgrad = grad and (input_needs_grad or self._prologue_needs_grad())
        call.need_wgrad = grad and param.requires_grad
        debug = _debug.options_for(self)
        if debug and repeated is not None:  # (its forward reported its operands already)
            debug = _debug.for_recompute(debug)
        scale, _, amax_history, grad_amax_history = state
        if call.new_state and torch.compiler.is_compiling():
            # State made inside a compiled graph cannot be written by its backward: the first
            # compiled step under another history length records no gradient amax.
            grad_amax_history = None
        call.op_args = (
            weight, bias, scale, amax_history, grad_amax_history, call.replay, *call.weight_cache,
            call.main_grad, *(frame["codes"] if frame is not None else _scaling.HIGH_PRECISION),
            call.cache_mode, config.save_original_input, config.parallel_mode,
            config.sequence_parallel, config.group_name, debug or (), bool(is_first_microbatch),
            # (backward gets the high-precision input)
            frame is None or config.save_original_input or bool(debug),
            call.need_dgrad, call.need_wgrad, *self._prologue())
        return call

    def _delayed_state(self, recipe: DelayedScaling, key: tuple, device):
        """The state tensors (`_STATE`) for `recipe` (whose `scaling.recipe_key` is `key`), and
        whether they are new: the module's own buffers, or new tensors made from them (another
        history length, format or device)."""
        mine = self._state()
        # By key, not `self._fp8_recipe is recipe`: when both are one object, torch.compile
        # guards it only where it was read first (the autocast frame), so the graph of a later
        # step would also run another model's first call, whose state is not made yet.
        if self._fp8_recipe_key == key and mine[0].device == device:
            return mine, False
        if self._fp8_recipe is None and mine[0].device != device:  # (e.g. left on "meta")
            return _scaling.fresh(recipe, device), True
        adopted = _scaling.adopted(mine, self._fp8_recipe or recipe, recipe, device)
        return adopted, any(a is not b for a, b in zip(adopted, mine))

    def _weight_cache_for(self, fp8: bool, is_first_microbatch):
        """(mode, (rowwise, columnwise, scale_inv), new): new buffers on a first call."""
        if not fp8 or is_first_microbatch is None:
            return _WEIGHT_CACHE_NONE, (None, None, None), False
        cache = (self._fp8_weight_rowwise, self._fp8_weight_columnwise,
                 self._fp8_weight_scale_inv)
        new = cache[0] is None and bool(is_first_microbatch)
        if new:  # (reusing none: refused by the op's check)
            n, k = self.weight.shape
            u8 = {"dtype": torch.uint8, "device": self.weight.device}
            with torch.inference_mode(False):  # state outlives an inference_mode call
                cache = (torch.empty(n, k, **u8), torch.empty(k, n, **u8),
                         torch.empty(1, device=self.weight.device, dtype=torch.float32))
        return (_WEIGHT_CACHE_FILL if is_first_microbatch else _WEIGHT_CACHE_REUSE), cache, new

    def _forward_record(self, frame) -> "_checkpointing.Forward":
        """How this forward ran, for a checkpoint's recompute to repeat it."""
        if frame is None:
            return _checkpointing.Forward(self._fp8_updates, None, None)
        return _checkpointing.Forward(self._fp8_updates, frame["recipe"], frame["amax_group"])

    def _repeated(self, checkpoints) -> Optional["_checkpointing.Forward"]:
        """The forward a checkpoint's recompute repeats; None for a forward outside backward,
        or inside it in a layer that never ran in FP8 and is not in FP8 now (it just runs)."""
        if checkpoints is None or not checkpoints.in_backward:
            return None
        repeated = _checkpointing.repeated(self, checkpoints)
        if repeated is not None or (not self._fp8_ran_fp8 and _autocast.current() is None):
            return repeated
        raise RuntimeError(
            f"tpfp8.Linear {self.name or ''} ran inside a backward pass, but not as the "
            f"recompute of an activation checkpoint it can match to its forward, so it cannot "
            f"tell which FP8 forward (recipe, scales) to repeat. Checkpoint with "
            f"torch.utils.checkpoint (reentrant or not), tpfp8.checkpoint, or an "
            f"autograd.Function whose forward(ctx, ...) runs the block and whose backward "
            f"recomputes it (not from a tensor hook); and call tpfp8 layers in FP8 from "
            f"backward hooks only through such a checkpoint")

    @staticmethod
    def _recompute_frame(repeated) -> Optional[dict]:
        """The fp8_autocast frame a recompute runs in: that of the forward it repeats (where
        backward runs does not matter), registering nothing for an update."""
        if repeated.recipe is None:
            return None
        return _autocast.frame(repeated.recipe, repeated.amax_group)

    def _forward_scales(self, repeated) -> torch.Tensor:
        """The scales the forward being recomputed cast with: today's, or those before the
        one delayed-scaling update that ran since (a backward after fp8_autocast's exit)."""
        since = self._fp8_updates - repeated.updates
        if since == 0:
            return self.fp8_scale
        if since == 1:
            return self.fp8_scale_prev
        raise RuntimeError(
            f"an activation checkpoint recomputes tpfp8.Linear {self.name or ''} after {since} "
            f"delayed-scaling updates since its forward; its scales are kept for one: run "
            f"backward before the fp8_autocast block of the next step exits")

    def _commit(self, call: "_Call", weight, frame, recompute: bool) -> None:
        """Keeps what a successful call made (FP8 state, weight cache, main_grad) and
        schedules the delayed-scaling update for the exit of the fp8_autocast block."""
        if call.new_main_grad is not None:
            weight.main_grad = call.new_main_grad
        if call.new_cache:
            self._keep_weight_cache(call.weight_cache)
        if call.state is None:
            return
        if call.new_state:
            self._keep_state(call.state)
        if self._fp8_recipe_key != frame["key"]:  # (see _delayed_state)
            self._fp8_recipe = frame["recipe"]
        if self._fp8_amax_group is not call.amax_group:
            self._fp8_amax_group = call.amax_group
        # A recompute records no amax and updates nothing: its step's forward did. A reused
        # weight cache recorded no new amax: the step's update comes with the micro-batch that
        # filled it.
        if not recompute and call.cache_mode != _WEIGHT_CACHE_REUSE:
            _autocast.register(frame, self)

    @staticmethod
    def _compute_dtype(x, weight, bias, in_fp8: bool):
        """(x, weight, bias) in the dtype the GEMMs run in: torch.autocast's if enabled (the
        FP8 path casts the fp32 master weight itself), else the input's. (A call template
        converts as this does: its twin is `to_autocast_dtype` in csrc/call_template.cpp.)"""
        if x.is_floating_point() and not x.is_meta and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            weight = weight if in_fp8 else weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        return x, weight, bias


_NO_PROLOGUE = (None, None, int(_C.Prologue.NONE), 0.0, False)
_NO_STATE = (None, None, None, None)
# Whether torch.autocast is on for any device: one call, before the per-device question.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """torch.autocast's dtype for the device type, None where it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


# Where a layer keeps its call template (in its __dict__), and the tensors a template reads
# from the layer at every call: (the op's argument, the layer's container, the entry).
_TEMPLATE = "_fp8_call_template"
_STATE_SOURCES = [("scale", "_buffers", "fp8_scale"),
                  ("amax_history", "_buffers", "fp8_amax_history"),
                  ("grad_amax_history", "_buffers", "fp8_grad_amax_history")]
_CACHE_SOURCES = [("weight_cache_rowwise", "_buffers", "_fp8_weight_rowwise"),
                  ("weight_cache_columnwise", "_buffers", "_fp8_weight_columnwise"),
                  ("weight_cache_scale_inv", "_buffers", "_fp8_weight_scale_inv")]

_PLAIN = (type(None), torch.Tensor, nn.Parameter)
# What a call template repeats of the slow path: a class that overrides any of it (a fused
# module's prologue, a subclass's own bookkeeping) gets no template.
_TEMPLATED_PARTS = ("_begin", "_prepare", "_end", "_commit", "_delayed_state", "_compute_dtype",
                    "_weight_cache_for", "_prologue", "_prologue_needs_grad", "_outputs",
                    "_keep_template", "_repeatable", "_source")
_TEMPLATED_CLASSES = weakref.WeakKeyDictionary()


def _templated_class(cls) -> bool:
    """Whether layers of `cls` may use call templates (see `_TEMPLATED_PARTS`)."""
    templated = _TEMPLATED_CLASSES.get(cls)
    if templated is None:
        templated = _TEMPLATED_CLASSES[cls] = all(
            getattr(cls, part) is getattr(Linear, part) for part in _TEMPLATED_PARTS)
    return templated


_WEIGHT_CACHE_NONE, _WEIGHT_CACHE_FILL, _WEIGHT_CACHE_REUSE = (
    int(_C.WeightCache.NONE), int(_C.WeightCache.FILL), int(_C.WeightCache.REUSE))

# What a parameter carries beside its data, kept through moves.
_CARRIED = ("tensor_model_parallel", "partition_dim", "main_grad")

# Buffers that stay float32 whatever the parameters become.
_STATE = ("fp8_scale", "fp8_scale_inv", "fp8_amax_history", "fp8_grad_amax_history")
_FP32_STATE = _STATE + ("fp8_scale_prev", "_fp8_weight_scale_inv")

# Set in __init__ and fixed after: they decide the parameters' shapes and split.
class LinearConfig(NamedTuple):
    """A layer's configuration as its ops take it: one frozen value, made when the layer is
    built and made again when a setting that may change between steps is set (torch.compile
    bakes it into the graph and retraces when it changes)."""
    parallel_mode: int  # the op's code
    sequence_parallel: bool
    group_name: str  # the tensor-parallel group's name ("" for none)
    save_original_input: bool
    fuse_wgrad_accumulation: bool
    return_bias: bool


# The settings that may change between steps, and make the config again when they do.
_SETTINGS = frozenset(("save_original_input", "fuse_wgrad_accumulation", "return_bias"))


class _Call:
    """One forward's op arguments and the state made for it. (A plain class whose defaults are
    class attributes: a call sets only what differs, which costs less host time than a
    dataclass's __init__.)"""
    param: Optional[torch.Tensor] = None  # the weight the op was given
    state: Optional[tuple] = None  # the `_STATE` tensors, under delayed scaling
    new_state: bool = False
    replay: Optional[torch.Tensor] = None  # a checkpoint recompute's forward scales
    amax_group: Optional[object] = None
    cache_mode: int = 0  # the op's weight_cache code
    weight_cache: tuple = (None, None, None)
    new_cache: bool = False
    need_dgrad: bool = False  # the op's: whether backward computes the input's gradient
    need_wgrad: bool = False  # and the weight's
    main_grad: Optional[torch.Tensor] = None
    new_main_grad: Optional[torch.Tensor] = None
    # Set by `Linear._begin`: the input in the GEMMs' dtype, the op's arguments after it, the
    # bias the op adds and the bias returned beside y (return_bias), and what `_end` needs.
    x: Optional[torch.Tensor] = None
    op_args: tuple = ()
    bias: Optional[torch.Tensor] = None
    bias_out: Optional[torch.Tensor] = None
    frame: Optional[dict] = None
    checkpoints: Optional[object] = None
    compiling: bool = False
    recompute: bool = False
    vet: bool = False

    def gives_grad(self) -> bool:
        """Whether the op's output will be differentiated (its input or a parameter needs it)."""
        return self.need_dgrad or self.need_wgrad or (
            torch.is_grad_enabled() and self.bias is not None and self.bias.requires_grad)


def _parameter(module: nn.Module, name: str):
    """``getattr(module, name)`` for a parameter (or None), read from the module's dict where it
    is there: nn.Module.__getattr__ costs ~1.5 us of host time a parameter, three to five a call.
    Where something moved it out -- torch.nn.utils.parametrize, weight_norm, FSDP1's views -- or
    it is not a parameter (a bias of None), the ordinary lookup."""
    value = module._parameters.get(name, _MISSING)
    return getattr(module, name) if value is _MISSING else value


_MISSING = object()


def _check_residual(residual) -> None:
    if residual is not None and not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a tensor (added to the output) or None, got "
                        f"{type(residual).__name__}")


def _run_op(vet: bool, compiling: bool, op: tuple, *args):
    """One of the ops (`op`: as torch.compile traces it, and as eager calls run it) on `args`;
    with `vet` (a checkpoint's recompute inside backward, matched by the module) marked as
    checked, since the op refuses forwards inside backward otherwise."""
    run = op[0] if compiling else op[1]
    if not vet:
        return run(*args)
    _C.set_forward_vetted(True)
    try:
        return run(*args)
    finally:
        _C.set_forward_vetted(False)


def _op(name: str) -> tuple:
    """torch.ops.tpfp8.<name> as torch.compile traces it, and the same op as eager calls run it
    (`_C.EagerOp`: its arguments converted with less host time than torch.ops converts them)."""
    traced = getattr(torch.ops.tpfp8, name)
    return traced, _C.EagerOp(f"tpfp8::{name}", traced)


_LINEAR, _MLP = _op("linear"), _op("mlp")


def _moved(fn, t: torch.Tensor) -> torch.Tensor:
    """`t` after a module's `_apply(fn)`, moved but never converted to another dtype."""
    moved = fn(t)
    return moved if moved.dtype == t.dtype else t.to(moved.device)


def _refuse_under_compile(message: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(message)


def _check_full_keys(state: dict, known, owner: str, required=()) -> None:
    """Refuses a full state dict's keys that `owner` has no parameter for, and lacks
    `required` ones (None values count as absent)."""
    given = {k for k, v in state.items() if v is not None}
    unknown, missing = sorted(given - set(known)), sorted(set(required) - given)
    if unknown or missing:
        hint = (" (the FP8 state is no part of a full state dict: load_state_dict loads it)"
                if any(k.endswith("_extra_state") for k in unknown) else "")
        wrong = ", ".join(f"{what} keys {keys}" for what, keys in (("unknown", unknown),
                                                                   ("missing", missing)) if keys)
        raise ValueError(f"load_full_state_dict: {wrong}; {owner} takes {sorted(known)}{hint}")


def _check_full_shape(name: str, given: torch.Tensor, full: tuple,
                      into: torch.Tensor) -> None:
    """`given`, to be copied into the parameter `into`: a tensor of the full shape, and with
    values unless `into` is a meta tensor too."""
    if not isinstance(given, torch.Tensor) or (given.is_meta and not into.is_meta):
        what = "a meta tensor, which holds no values" if isinstance(given, torch.Tensor) else (
            f"a {type(given).__name__}")
        raise ValueError(f"load_full_state_dict: {name} is {what}; give a tensor")
    if tuple(given.shape) != tuple(full):
        raise ValueError(f"load_full_state_dict: {name} has shape {tuple(given.shape)}, the "
                         f"layer's single-device (unsharded) shape is {tuple(full)}")


# What swap_linear carries from an nn.Linear to its tpfp8.Linear: the hooks around its calls.
_MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                 "_backward_pre_hooks", "_is_full_backward_hook")


def swap_linear(model: nn.Module,
                filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Replaces, in place, every ``torch.nn.Linear`` of ``model`` (for which
    ``filter_fn(module, fully_qualified_name)`` is true) by a ``tpfp8.Linear`` holding the same
    parameters, in the same training mode, with its forward and backward hooks (their handles
    still remove them). A Linear that stands at several places (tied) becomes one
    ``tpfp8.Linear`` at all of them, named and filtered by its first place. A Linear whose
    ``forward`` was replaced on the instance (accelerate's offloading hooks) is swapped with a
    warning: the new layer runs its own. Returns ``model`` (or the new module if ``model``
    itself is an nn.Linear)."""

    def convert(lin: nn.Linear, name: str) -> Linear:
        new = Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                     device="meta", name=name)
        new.weight = lin.weight
        new.bias = lin.bias
        new._reset_fp8_state()  # on the weight's device
        for hooks in _MODULE_HOOKS:  # (moved, not shared: the handles hold these dicts)
            setattr(new, hooks, getattr(lin, hooks))
            setattr(lin, hooks, None if hooks == "_is_full_backward_hook" else
                    collections.OrderedDict())
        if "forward" in lin.__dict__:
            warnings.warn(f"swap_linear: {name or 'the model'} has its forward replaced on "
                          f"the instance (e.g. by accelerate's hooks), which the tpfp8.Linear "
                          f"does not keep; swap before adding such hooks", stacklevel=3)
        return new.train(lin.training)

    if type(model) is nn.Linear:
        return convert(model, "") if filter_fn is None or filter_fn(model, "") else model
    done = {}  # id of a Linear -> what it became (itself where the filter refused it)
    for fqn, module in list(model.named_modules()):
        for child_name, child in list(module._modules.items()):  # (tied ones too)
            full = f"{fqn}.{child_name}" if fqn else child_name
            if type(child) is not nn.Linear:
                continue
            if id(child) not in done:
                wanted = filter_fn is None or filter_fn(child, full)
                done[id(child)] = convert(child, full) if wanted else child
            setattr(module, child_name, done[id(child)])
    return model


def load_fp8_state(model: nn.Module, checkpoint) -> int:
    """Loads the FP8 state (``_extra_state``) of every ``tpfp8.Linear`` in ``model`` from
    ``checkpoint``: a state dict, or a folder of ``*.safetensors`` files (what Hugging Face's
    ``save_pretrained`` writes, sharded or not). For a model loaded with ``from_pretrained``
    and then converted with :func:`swap_linear`: the plain model it was built as has no place
    for the FP8 state, so ``from_pretrained`` loads the weights and leaves it out. Returns the
    number of layers that got a state (those saved before their first delayed-scaling step
    have none to get)."""
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = _extra_states_in(checkpoint)
    loaded, unmatched = 0, {k for k in checkpoint if k.endswith("_extra_state")}
    layers = [name for name, module in model.named_modules() if isinstance(module, Linear)]
    for name in layers:
        key = f"{name}._extra_state" if name else "_extra_state"
        saved = checkpoint.get(key)
        if saved is not None:
            unmatched.discard(key)
            layer = model.get_submodule(name)
            _named_errors(key, layer.set_extra_state, saved)
            loaded += layer._fp8_recipe is not None
    if unmatched:
        warnings.warn(
            f"load_fp8_state: {len(unmatched)} FP8 states in the checkpoint match no "
            f"tpfp8.Linear of the model (e.g. {sorted(unmatched)[0]}; the model's are named "
            f"e.g. {layers[0] if layers else 'nothing: it has none'}). Load into the model as "
            f"it was saved, before wrapping it (e.g. with PEFT)", stacklevel=2)
    return loaded


def _named_errors(key: str, load, saved):
    """load(saved), its ValueError naming the checkpoint entry it came from (a model has
    many)."""
    try:
        return load(saved)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def _extra_states_in(folder) -> dict:
    """The ``*._extra_state`` tensors of the safetensors files in ``folder``: those its
    index names where there is one (a sharded save), else every one."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, name) for name in names]
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}: pass the folder "
                         f"save_pretrained wrote, or a state dict")
    states = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            states.update({k: f.get_tensor(k) for k in f.keys() if k.endswith("_extra_state")})
    return states
