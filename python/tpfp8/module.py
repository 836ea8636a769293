"""``tpfp8.Linear``: a drop-in ``torch.nn.Linear`` whose three GEMMs run in FP8 inside
``fp8_autocast``. All math happens in C++ (csrc/linear.cpp); this file holds the module's
parameters and FP8 state and translates them into the C++ call."""
import copy
import dataclasses
import math
from typing import Callable, Optional

import torch
from torch import nn

from . import _C
from . import autocast as _autocast
from . import debug as _debug
from . import parallel as _parallel
from .recipe import CurrentScaling, DelayedScaling

_INPUT, _WEIGHT = 0, 1  # columns of the forward scaling state
_PARALLEL = {None: _C.ParallelMode.NONE, "column": _C.ParallelMode.COLUMN,
             "row": _C.ParallelMode.ROW}


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` [out_features, in_features], like ``torch.nn.Linear``
    (same parameters, same initialisation, loads an ``nn.Linear`` state dict).

    Inside ``tpfp8.fp8_autocast`` the forward GEMM and both backward GEMMs run in FP8; outside
    it the same C++ path runs them in the input's precision. Under ``torch.autocast`` the input,
    weight and bias are computed in the autocast dtype.

    Args:
        in_features, out_features, bias, device, dtype: as for ``torch.nn.Linear``. FP8 needs
            both feature counts (per rank) to be multiples of ``tpfp8._C.FP8_MULTIPLE`` (16).
        save_original_input: keep the high-precision input for backward and re-quantize it
            there (not with delayed scaling), instead of the 1-byte column-wise FP8 copy.
        fuse_wgrad_accumulation: write the weight gradient into ``weight.main_grad`` (fp32,
            allocated if missing) instead of ``weight.grad``: overwritten when
            ``is_first_microbatch=True``, accumulated otherwise.
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

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, save_original_input: bool = False,
                 fuse_wgrad_accumulation: bool = False, return_bias: bool = False,
                 name: Optional[str] = None, parallel_mode: Optional[str] = None,
                 tp_group=None, sequence_parallel: bool = False):
        super().__init__()
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
        self._fwd_meta = None  # delayed scaling state, made on the first FP8 forward
        self._bwd_meta = None
        # (what the options are made of, LinearOptions, refs, a _Call of them for reuse)
        self._options_cache = (None,)
        self._weight_cache = None
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
        features = out_features if mode == "column" else in_features
        what = "out_features" if mode == "column" else "in_features"
        _parallel.check_divisible(features, group, what, "choose a size the group divides")

    def _split_dims(self):
        """(weight dim, bias dim or None) that are split across the group."""
        if self.parallel_mode == "column":
            return 0, 0
        return (1, None) if self.parallel_mode == "row" else (None, None)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Loads single-device (unsharded) ``weight`` / ``bias``; each rank keeps its slice."""
        w_dim, b_dim = self._split_dims()
        w = state["weight"]
        self.weight.copy_(w if w_dim is None else _parallel.shard(w, w_dim, self.tp_group))
        if self.bias is not None and state.get("bias") is not None:
            b = state["bias"]
            self.bias.copy_(b if b_dim is None else _parallel.shard(b, b_dim, self.tp_group))

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The single-device (unsharded) ``weight`` / ``bias``, gathered from every rank."""
        w_dim, b_dim = self._split_dims()
        out = {"weight": self.weight.detach().clone() if w_dim is None
               else _parallel.unshard(self.weight, w_dim, self.tp_group)}
        if self.bias is not None:
            out["bias"] = (self.bias.detach().clone() if b_dim is None
                           else _parallel.unshard(self.bias, b_dim, self.tp_group))
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")

    # ---- FP8 state ----------------------------------------------------------------------

    def _delayed_metas(self, recipe: DelayedScaling, device):
        """The forward and backward delayed-scaling state for `recipe`: the module's own, or
        new objects made from it (a first FP8 step, or another history length or format). Only
        a call that succeeds keeps new ones (`_commit`)."""
        if self._fwd_meta is None:
            return _new_metas(recipe, device)
        fwd_fmt, grad_fmt = recipe.formats
        return (self._fwd_meta.adopted(recipe, [fwd_fmt, fwd_fmt], device),
                self._bwd_meta.adopted(recipe, [grad_fmt], device))

    def __getstate__(self):
        """Pickling and copy.deepcopy (an EMA copy, ``AveragedModel``): the prepared C++
        options are a cache, made again by the next forward, and do not pickle."""
        state = super().__getstate__()  # a copy already
        state["_options_cache"] = (None,)
        return state

    def __deepcopy__(self, memo):
        # A copy computes over the same tensor-parallel group: shared, not copied (a
        # ProcessGroup cannot be).
        if self.tp_group is not None:
            memo[id(self.tp_group)] = self.tp_group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def __setattr__(self, name, value):
        # The tensor-parallel layout fixes the parameters' shapes: changing it needs a new layer.
        if name in _FIXED_AFTER_INIT and name in self.__dict__ and value != self.__dict__[name]:
            raise AttributeError(f"Linear.{name} is fixed when the layer is built (it sets the "
                                 f"parameters' shapes and split); build a new tpfp8.Linear")
        super().__setattr__(name, value)

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.cuda()``, ``.half()``...: the FP8 state moves with the parameters and
        stays fp32 (a loaded checkpoint's scales and histories survive ``model.cuda()``), as do
        ``weight.main_grad`` (like ``.grad``) and the parameters' tensor-parallel attributes.
        What was made from the parameters as they were -- the cached FP8 weight, the prepared
        C++ options -- is dropped if they changed: the next ``is_first_microbatch=True`` call
        refills the cache."""
        before, params = self._weight_identity(), (self.weight, self.bias)
        super()._apply(fn, *args, **kwargs)
        device = self.weight.device
        for meta in (self._fwd_meta, self._bwd_meta):
            if meta is not None:
                meta.move_to(device)
        # torch makes new Parameter objects for some moves (to or from "meta", or with
        # torch.__future__'s overwrite flag): what was set on the old ones is carried over.
        for old, new in zip(params, (self.weight, self.bias)):
            for attr in ("tensor_model_parallel", "partition_dim", "main_grad"):
                value = getattr(old, attr, None)
                if new is not None and value is not None:
                    setattr(new, attr, value.to(device) if attr == "main_grad" else value)
        if self._weight_identity() != before:
            self._weight_cache = None
        self._options_cache = (None,)
        return self

    def _weight_identity(self):
        w = self.weight
        return w.data_ptr() if w.device.type != "meta" else None, w.dtype, w.device

    def _quantizers(self, recipe, metas, replay=None):
        """The input, weight and gradient quantizer specs; `metas`: the delayed-scaling state
        they cast with; `replay`: a checkpoint recompute's forward scales (its amaxes, in the
        history already, go to scratch)."""
        fwd_fmt, grad_fmt = recipe.formats
        specs = [_C.QuantizerSpec() for _ in range(3)]
        for spec, fmt in zip(specs, (fwd_fmt, fwd_fmt, grad_fmt)):
            spec.format = fmt.native
            spec.scaling = (_C.Scaling.DELAYED if isinstance(recipe, DelayedScaling)
                            else _C.Scaling.CURRENT)
        if isinstance(recipe, CurrentScaling):
            for spec in specs:
                spec.epsilon = recipe.amax_epsilon
            return specs
        fwd, bwd = metas
        for spec, col in ((specs[0], _INPUT), (specs[1], _WEIGHT)):
            spec.scale = (fwd.scale if replay is None else replay)[col:col + 1]
            spec.amax = (fwd.amax_slot(col) if replay is None
                         else torch.zeros(1, device=fwd.scale.device))
        specs[2].scale, specs[2].amax = bwd.scale[:1], bwd.amax_slot(0)
        specs[2].after_backward = bwd.native  # C++ updates it when backward is done
        return specs

    @property
    def fp8_state(self) -> Optional[dict]:
        """The delayed-scaling state, to inspect (the live tensors: read, do not write), or
        None before the first delayed-scaling FP8 step: ``{"forward": {"scale": [2],
        "scale_inv": [2], "amax_history": [history_len, 2]}`` (input, weight), ``"backward":
        {... [1] ...}`` (the output gradient), ``"recipe"``: the DelayedScaling it follows,
        ``"amax_group"``: the group its amaxes were last reduced over (or None)}. Row 0 of a
        history is the running step's amax."""
        if self._fwd_meta is None:
            return None
        return {"forward": self._fwd_meta.state(), "backward": self._bwd_meta.state(),
                "recipe": self._fwd_meta.recipe, "amax_group": self._fwd_meta.amax_group}

    def get_extra_state(self):
        """FP8 state (delayed-scaling scales and amax histories) for checkpoints: tensors and
        plain values only, so ``torch.load(..., weights_only=True)`` (its default) reads it."""
        if self._fwd_meta is None:
            return None
        return {"forward": self._fwd_meta.state(), "backward": self._bwd_meta.state(),
                "recipe": dataclasses.asdict(self._fwd_meta.recipe)}

    def set_extra_state(self, state) -> None:
        """Loads the FP8 state as it was saved (its recipe, its history length); a forward
        with another ``amax_history_len`` then resizes the histories, keeping the newest
        entries. State of the same layout is loaded into the module's own tensors (those a
        captured CUDA graph updates)."""
        if not state:
            return
        recipe = state["recipe"]
        if isinstance(recipe, dict):  # (older checkpoints hold the DelayedScaling itself)
            recipe = DelayedScaling(**recipe)
        loaded = _new_metas(recipe, self.weight.device)
        for meta, direction in zip(loaded, ("forward", "backward")):
            meta.load(state[direction])
        mine = (self._fwd_meta, self._bwd_meta)
        if mine[0] is not None and all(a.same_layout(b) for a, b in zip(mine, loaded)):
            for meta, new in zip(mine, loaded):
                meta.take(new)
        else:
            self._fwd_meta, self._bwd_meta = loaded
        self._options_cache = (None,)  # the recipe in its key may have changed

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A plain nn.Linear checkpoint has no _extra_state: accept it.
        state_dict.setdefault(prefix + "_extra_state", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- forward ------------------------------------------------------------------------

    @staticmethod
    def _check_type(x) -> None:
        # The values are checked once, in C++ (tpfp8._C.check_inputs): ValueError.
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Linear expects a tensor, got {type(x).__name__}")

    def _weight_cache_buffers(self, is_first_microbatch):
        """(mode, buffers): new buffers (kept only if the call succeeds) on a first call."""
        if is_first_microbatch is None:
            return _C.WeightCache.NONE, None
        cache = self._weight_cache
        if cache is None and is_first_microbatch:  # (reusing none: refused by the C++ check)
            n, k = self.weight.shape
            u8 = {"dtype": torch.uint8, "device": self.weight.device}
            with torch.inference_mode(False):  # state outlives an inference_mode call
                cache = (torch.empty(n, k, **u8), torch.empty(k, n, **u8),
                         torch.empty(1, device=self.weight.device))
        return (_C.WeightCache.FILL if is_first_microbatch else _C.WeightCache.REUSE), cache

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """``x [..., in_features] -> [..., out_features]``.

        ``is_first_microbatch``: None casts the weight to FP8 every call; True casts and
        caches it; False reuses the cache (the weights must not have changed since).

        A call that raises (bad input, a rejected option) leaves the module as it was: FP8
        state, weight cache and ``weight.main_grad`` are only changed by calls that succeed.
        """
        param = self.weight
        self._check_type(x)
        frame = _autocast.current()
        if x.is_meta:
            return self._meta_forward(x, frame, is_first_microbatch)
        x, weight, bias = self._compute_dtype(x, param, in_fp8=frame is not None)
        bias_out = None
        if self.return_bias:
            bias_out, bias = bias, None
        replay = _autocast.replayed_scales(frame, self)
        call = self._prepare(frame, x.device, param, is_first_microbatch, replay)
        y = _C.linear(x, weight, bias, call.options)
        self._commit(call, param)
        if frame is not None and isinstance(frame["recipe"], DelayedScaling):
            self._schedule_updates(is_first_microbatch)
            _autocast.record_scales(frame, self, self._fwd_meta.scale if replay is None else replay)
        return (y, bias_out) if self.return_bias else y

    def _meta_forward(self, x, frame, is_first_microbatch):
        """On the meta device (deferred initialisation, shape tracing): the output's shape and
        dtype, as ``nn.Linear`` gives there, with sequence parallelism's change of dim 0,
        after the checks a real call makes; no state is kept."""
        call = self._build_options(frame, x.device, self.weight, is_first_microbatch)
        _C.check_inputs(x, self.weight, self.bias, call.options)
        tp = _parallel.group_size(self.tp_group) if self.sequence_parallel else 1
        if self.sequence_parallel and self.parallel_mode == "column":
            x = x.repeat(tp, *([1] * (x.dim() - 1)))
        elif self.sequence_parallel:
            x = x[:x.shape[0] // tp]
        bias = None if self.return_bias else self.bias
        y = nn.functional.linear(x, self.weight.to(x.dtype),
                                 None if bias is None else bias.to(x.dtype))
        return (y, self.bias) if self.return_bias else y

    def _config_key(self, frame, device, weight, is_first_microbatch):
        """Everything the prepared C++ options are made of: any change makes new ones."""
        return (None if frame is None else (frame["recipe"], frame["amax_group"]), device,
                is_first_microbatch, id(weight), weight.requires_grad,
                id(getattr(weight, "main_grad", None)), self.save_original_input,
                self.fuse_wgrad_accumulation)

    def _prepare(self, frame, device, weight, is_first_microbatch, replay=None):
        """The C++ call's options and the state it needs (`weight`: the parameter, not a
        torch.autocast copy). Building options costs more host time than the rest of a
        forward's Python, so they are kept and reused while what they are made of stays the
        same (debugged calls and checkpoint recomputes, `replay`, build their own)."""
        debug = _debug.options_for(self)
        key = self._config_key(frame, device, weight, is_first_microbatch)
        if debug is None and replay is None and self._options_cache[0] == key:
            return self._options_cache[3]  # nothing left to commit
        call = self._build_options(frame, device, weight, is_first_microbatch, replay)
        if debug is not None:
            call.options.debug = debug
        elif replay is None:
            call.cache_args = (frame, device, is_first_microbatch)
        return call

    def _commit(self, call: "_Call", weight) -> None:
        """Keeps what a successful call made: new FP8 state, weight cache, main_grad, and the
        options for the next call."""
        if call.main_grad is not None:
            weight.main_grad = call.main_grad
        stale = False  # whether prepared options point at state this call replaced
        if call.metas is not None:
            if call.metas != (self._fwd_meta, self._bwd_meta):
                self._fwd_meta, self._bwd_meta = call.metas
                stale = True
            self._fwd_meta.amax_group = self._bwd_meta.amax_group = call.amax_group
        if call.weight_cache is not None and call.weight_cache is not self._weight_cache:
            self._weight_cache = call.weight_cache
            stale = True
        if stale:
            self._options_cache = (None,)
        if call.cache_args is not None:  # (after main_grad is set: the key names it)
            key = self._config_key(call.cache_args[0], call.cache_args[1], weight,
                                   call.cache_args[2])
            # The ids' objects are kept alive, so the ids stay theirs.
            self._options_cache = (key, call.options, (weight, getattr(weight, "main_grad", None)),
                                   _Call(call.options))

    def _build_options(self, frame, device, weight, is_first_microbatch, replay=None):
        call = _Call(_C.LinearOptions())
        if frame is not None:
            self._fp8_options(call, frame, device, is_first_microbatch, replay)
        self._wgrad_options(call, weight, is_first_microbatch)
        opts = call.options
        if self.parallel_mode:
            opts.parallel_mode = _PARALLEL[self.parallel_mode]
            opts.sequence_parallel = self.sequence_parallel
            opts.tp_group = self.tp_group
        return call

    def _compute_dtype(self, x, weight, in_fp8: bool):
        """(x, weight, bias) in the dtype the GEMMs run in: torch.autocast's if enabled (the
        FP8 path casts the fp32 master weight itself), else the input's."""
        bias = self.bias
        if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            weight = weight if in_fp8 else weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        return x, weight, bias

    def _fp8_options(self, call, frame, device, is_first_microbatch, replay=None) -> None:
        """Quantizers and the weight cache, for `_commit` to keep once the call succeeded."""
        recipe = frame["recipe"]
        call.amax_group = _parallel.amax_group_for(self.tp_group, self.sequence_parallel,
                                                   frame["amax_group"])
        mode, call.weight_cache = self._weight_cache_buffers(is_first_microbatch)
        if isinstance(recipe, DelayedScaling):
            call.metas = self._delayed_metas(recipe, device)
        opts = call.options
        opts.fp8 = True
        opts.input, opts.weight, opts.grad = self._quantizers(recipe, call.metas, replay)
        opts.save_original_input = self.save_original_input
        opts.weight_cache = mode
        if call.weight_cache is not None:
            (opts.weight_cache_rowwise, opts.weight_cache_columnwise,
             opts.weight_cache_scale_inv) = call.weight_cache

    def _wgrad_options(self, call, weight, is_first_microbatch) -> None:
        if not (self.fuse_wgrad_accumulation and weight.requires_grad):
            return
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None:
            with torch.inference_mode(False):
                main_grad = call.main_grad = torch.zeros_like(weight, dtype=torch.float32)
        call.options.fuse_wgrad_accumulation = True
        call.options.main_grad = main_grad
        call.options.main_grad_overwrite = bool(is_first_microbatch)

    def _schedule_updates(self, is_first_microbatch) -> None:
        if is_first_microbatch is not False:  # a reused weight cache recorded no new amax
            _autocast.register_forward(self._fwd_meta)


def _new_metas(recipe: DelayedScaling, device):
    """Fresh (forward, backward) delayed-scaling state: scales 1, histories zero."""
    fwd_fmt, grad_fmt = recipe.formats
    return (_autocast.ScalingMeta([fwd_fmt, fwd_fmt], recipe, device),
            _autocast.ScalingMeta([grad_fmt], recipe, device))


# Set in __init__ and fixed after: they decide the parameters' shapes and split.
_FIXED_AFTER_INIT = frozenset(
    ("in_features", "out_features", "parallel_mode", "tp_group", "sequence_parallel"))


@dataclasses.dataclass
class _Call:
    """One forward's C++ options and the state made for them, kept by `Linear._commit` only
    once the call has succeeded."""
    options: "_C.LinearOptions"
    metas: Optional[tuple] = None        # (forward, backward) delayed-scaling state
    amax_group: Optional[object] = None
    weight_cache: Optional[tuple] = None
    main_grad: Optional[torch.Tensor] = None  # made for this call (the weight had none)
    cache_args: Optional[tuple] = None  # (frame, device, is_first_microbatch): keep for reuse


def swap_linear(model: nn.Module,
                filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Replaces, in place, every ``torch.nn.Linear`` of ``model`` (for which
    ``filter_fn(module, fully_qualified_name)`` is true) by a ``tpfp8.Linear`` holding the same
    parameters. Returns ``model`` (or the new module if ``model`` itself is an nn.Linear)."""

    def convert(lin: nn.Linear, name: str) -> Linear:
        new = Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                     device="meta", name=name)
        new.weight = lin.weight
        new.bias = lin.bias
        return new

    if type(model) is nn.Linear:
        return convert(model, "") if filter_fn is None or filter_fn(model, "") else model
    for fqn, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{fqn}.{child_name}" if fqn else child_name
            if type(child) is nn.Linear and (filter_fn is None or filter_fn(child, full)):
                setattr(module, child_name, convert(child, full))
    return model
