"""The fused modules: a norm or an activation written straight to FP8 by the kernel that
computes it, in front of a ``tpfp8.Linear``'s GEMMs -- ``LayerNormLinear`` / ``RMSNormLinear``
(norm -> Linear), ``LayerNormMLP`` (norm -> fc1 -> activation -> fc2) and ``MLP`` (the same
without the norm), with TransformerEngine's names. They are ``tpfp8.Linear`` layers whose op
runs a prologue on the input (csrc/prologue.h); FP8 state, recipes, weight caching, tensor
parallelism, debugging, checkpointing and torch.compile work as for ``tpfp8.Linear``."""
import collections
import copy
import functools
from typing import Optional

import torch
import torch.fx
from torch import nn

from . import _C
from . import parallel as _parallel
from .module import (_MLP, Linear, _check_full_keys, _check_full_shape, _check_residual,
                     _parameter, _run_op)
from .recipe import _finite_nonnegative

_NORMS = {"LayerNorm": int(_C.Prologue.LAYER_NORM), "RMSNorm": int(_C.Prologue.RMS_NORM)}
_ACTIVATIONS = {"gelu": int(_C.Prologue.GELU), "swiglu": int(_C.Prologue.SWIGLU)}


def _choice(value, allowed: dict, what: str):
    if value not in allowed:
        raise ValueError(f"{what} must be one of {sorted(allowed)}, got {value!r}")
    return allowed[value]


def _norm_width_error(features: int) -> Optional[str]:
    """Why the fused norm's kernel cannot take rows of `features` (it keeps a row in
    registers), or None."""
    align, most = _C.NORM_HIDDEN_ALIGN, _C.NORM_MAX_HIDDEN
    if features % align == 0 and features <= most:
        return None
    return (f"the fused norm needs in_features a multiple of {align} and at most {most}, got "
            f"{features}; use torch's norm before a tpfp8.Linear instead")


class _GatedShards:
    """Tensor-parallel shards of an MLP's fc1 whose outputs are SwiGLU's ``[gate | up]``
    (keyword ``_gated``): each rank holds its slices of both halves, ``[gate_r | up_r]``, so
    that its SwiGLU pairs them."""

    def __init__(self, in_features, out_features, *args, _gated: bool = False, **kwargs):
        self._gated = _gated  # (before the Linear's __init__, which shards the parameters)
        group = kwargs.get("tp_group")
        if _gated and kwargs.get("parallel_mode") == "column" and group is not None:
            _parallel.check_group(group)
            _parallel.check_divisible(out_features // 2, group, "ffn_hidden_size (each of "
                                      "SwiGLU's gate and up)", "choose a size the group divides")
        super().__init__(in_features, out_features, *args, **kwargs)

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        shard = super()._shard
        if not self._gated:
            return shard(full, dim)
        return torch.cat([shard(h, dim) for h in full.chunk(2, dim)], dim)

    def _unshard(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        unshard = super()._unshard
        if not self._gated:
            return unshard(local, dim)
        return torch.cat([unshard(h.contiguous(), dim) for h in local.chunk(2, dim)], dim)


class LayerNormLinear(_GatedShards, Linear):
    """``Linear(norm(x))``: LayerNorm (or RMSNorm) over the last dimension, then ``x W^T + b``,
    as TransformerEngine's ``LayerNormLinear`` (parameters ``layer_norm_weight``,
    ``layer_norm_bias``, ``weight``, ``bias``).

    Inside ``fp8_autocast`` the norm's kernel writes the Linear's FP8 input (row-wise for the
    forward GEMM, column-wise for wgrad) and its amax in the same pass over ``x``, instead of
    writing the normalized tensor and reading it again to cast it. Current scaling reads ``x``
    twice (an amax pass first: the scale must be known before the first byte is cast);
    delayed scaling once. Debugging and ``save_original_input`` use the high-precision
    normalized tensor, which then gets the ordinary cast. The norm's backward runs on dgrad's
    output. Under ``torch.autocast`` the norm reads ``x`` in the autocast dtype, as
    TransformerEngine's modules do, where torch's autocast runs ``nn.LayerNorm`` in fp32: for
    an fp32 input whose rows have a large mean against their spread (a residual stream), the
    fused LayerNorm loses that much more precision; keep such a norm in torch, before a
    ``tpfp8.Linear``.

    Args:
        in_features, out_features, bias, device, dtype: as ``tpfp8.Linear``.
        eps: added to the variance (LayerNorm) or mean square (RMSNorm).
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (no ``layer_norm_bias``).
        return_layernorm_output: also return the normalized input (in high precision; under
            sequence parallelism this rank's rows), e.g. for a residual taken after the norm.
            Gradients flowing into it reach ``x``, ``layer_norm_weight`` and
            ``layer_norm_bias``.
        **kwargs: ``tpfp8.Linear``'s keyword arguments. ``parallel_mode="row"`` is refused (a
            norm needs every feature). Under column parallelism with ``sequence_parallel``
            each rank normalizes its own rows and FP8-gathers them; the norm's weight
            gradients are summed over the group in backward, so every rank holds the full
            gradient (do not all-reduce them again).

    Returns ``y``, then (with ``return_bias``) the bias, then (with
    ``return_layernorm_output``) the normalized input: a tuple when more than ``y``.
    The norm kernel needs ``in_features`` to be a multiple of 16 and at most 16384
    (``tpfp8._C.NORM_HIDDEN_ALIGN``, ``NORM_MAX_HIDDEN``); other widths raise ``ValueError``.
    """

    _fixed_after_init = Linear._fixed_after_init | {"normalization"}

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 bias: bool = True, normalization: str = "LayerNorm",
                 return_layernorm_output: bool = False, device=None, dtype=None, **kwargs):
        code = _choice(normalization, _NORMS, "normalization")
        if kwargs.get("parallel_mode") == "row":
            raise ValueError("LayerNormLinear cannot be row-parallel: its norm needs every "
                             "feature of the input; use parallel_mode='column' or None")
        if not _finite_nonnegative(eps):
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        if (error := _norm_width_error(in_features)) is not None:
            raise ValueError(error)
        super().__init__(in_features, out_features, bias, device, dtype, **kwargs)
        self.normalization, self.eps, self._norm_code = normalization, eps, code
        self.return_layernorm_output = return_layernorm_output
        factory = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, **factory))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(in_features, **factory))
                                if normalization == "LayerNorm" else None)

    def reset_parameters(self) -> None:
        """The Linear's initialisation, and the norm's: weight 1, bias 0."""
        super().reset_parameters()
        if getattr(self, "layer_norm_weight", None) is not None:
            with torch.no_grad():
                self.layer_norm_weight.fill_(1.0)
                if self.layer_norm_bias is not None:
                    self.layer_norm_bias.zero_()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalization={self.normalization}, eps={self.eps}"

    _FULL_KEYS = Linear._FULL_KEYS + ("layer_norm_weight", "layer_norm_bias")

    def _full_parts(self, state: dict, key=str) -> list:
        """As ``tpfp8.Linear``'s, plus ``layer_norm_weight`` / ``layer_norm_bias`` (replicated;
        optional: ``reset_parameters`` sets them itself)."""
        parts = super()._full_parts(state, key)
        for name in ("layer_norm_weight", "layer_norm_bias"):
            param, given = getattr(self, name, None), state.get(key(name))
            if param is None and given is not None:
                raise ValueError(f"load_full_state_dict: the layer has no {key(name)} "
                                 f"({self.normalization}), the state has one")
            if param is not None and given is not None:
                _check_full_shape(key(name), given, tuple(param.shape), param)
                parts.append((param, given))
        return parts

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        out = super().full_state_dict()
        out["layer_norm_weight"] = self.layer_norm_weight.detach().clone()
        if self.layer_norm_bias is not None:
            out["layer_norm_bias"] = self.layer_norm_bias.detach().clone()
        return out

    def _prologue(self) -> tuple:
        return (_parameter(self, "layer_norm_weight"), _parameter(self, "layer_norm_bias"),
                self._norm_code, float(self.eps), self.return_layernorm_output)

    def _prologue_needs_grad(self) -> bool:
        weight, bias = _parameter(self, "layer_norm_weight"), _parameter(self, "layer_norm_bias")
        return weight.requires_grad or (bias is not None and bias.requires_grad)

    def _outputs(self, y, return_bias: bool, bias, prologue_out):
        out = (y,) + ((bias,) if return_bias else ()) + (
            (prologue_out,) if self.return_layernorm_output else ())
        return out if len(out) > 1 else y


class RMSNormLinear(LayerNormLinear):
    """``LayerNormLinear`` with ``normalization="RMSNorm"``: ``x / sqrt(mean(x^2) + eps) * g``
    then the Linear; parameters ``layer_norm_weight``, ``weight``, ``bias``."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 bias: bool = True, **kwargs):
        if kwargs.setdefault("normalization", "RMSNorm") != "RMSNorm":
            raise ValueError("RMSNormLinear's normalization is RMSNorm; use LayerNormLinear "
                             "for LayerNorm")
        super().__init__(in_features, out_features, eps, bias, **kwargs)


class ActivationLinear(Linear):
    """``Linear(act(h))``: GELU (exact, erf) or SwiGLU (``silu(a) * b`` of ``h = [a | b]``, so
    ``h`` is ``2 * in_features`` wide) and then the Linear, the activation written straight to
    FP8 inside ``fp8_autocast``. LayerNormMLP's fc2; keyword arguments as ``tpfp8.Linear``."""

    _fixed_after_init = Linear._fixed_after_init | {"activation"}

    def __init__(self, in_features: int, out_features: int, activation: str = "gelu",
                 bias: bool = True, device=None, dtype=None, **kwargs):
        self._activation_code = _choice(activation, _ACTIVATIONS, "activation")
        self.activation = activation
        super().__init__(in_features, out_features, bias, device, dtype, **kwargs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"

    def _prologue(self) -> tuple:
        return (None, None, self._activation_code, 0.0, False)


class _GatedLinear(_GatedShards, Linear):
    """``MLP``'s fc1: a ``tpfp8.Linear`` whose outputs may be SwiGLU's ``[gate | up]``."""

    def _get_name(self) -> str:  # (its repr: the public class it is)
        return "Linear"


class _TwoLayers(nn.Module):
    """fc1 -> activation -> fc2 as one op (``torch.ops.tpfp8.mlp``); fc1 a ``Linear`` with or
    without a norm in front. ``state_dict`` keys are TransformerEngine's (``_KEYS``)."""

    _KEYS = {"fc1.weight": "fc1_weight", "fc1.bias": "fc1_bias", "fc2.weight": "fc2_weight",
             "fc2.bias": "fc2_bias"}

    def __setattr__(self, name, value):
        for path, te_name in self._KEYS.items():
            if name == te_name:  # (a read-only alias: see the bottom of this file)
                raise AttributeError(f"{type(self).__name__}.{name} is {path}, read-only by "
                                     f"this name; set {path} instead")
        super().__setattr__(name, value)

    def _make_layers(self, fc1_class, fc1_kwargs: dict, hidden_size: int, ffn_hidden_size: int,
                     bias: bool, activation: str, set_parallel_mode: bool, name: Optional[str],
                     **common) -> None:
        _choice(activation, _ACTIVATIONS, "activation")
        if common.get("sequence_parallel") and not set_parallel_mode:
            raise ValueError(f"{type(self).__name__}(sequence_parallel=True) needs "
                             f"set_parallel_mode=True (fc1 column-, fc2 row-parallel) and "
                             f"tp_group")
        gated = activation == "swiglu"
        self.fc1 = fc1_class(
            hidden_size, ffn_hidden_size * (2 if gated else 1), bias=bias,
            parallel_mode="column" if set_parallel_mode else None,
            name=f"{name}.fc1" if name else None, _gated=gated, **fc1_kwargs, **common)
        self.fc2 = ActivationLinear(
            ffn_hidden_size, hidden_size, activation, bias,
            parallel_mode="row" if set_parallel_mode else None,
            name=f"{name}.fc2" if name else None, **common)
        self._register_state_dict_hook(_TwoLayers._te_keys)
        self._register_load_state_dict_pre_hook(self._own_keys, with_module=True)

    @staticmethod
    def _te_keys(module, state_dict, prefix, local_metadata):
        for mine, theirs in module._KEYS.items():
            if prefix + mine in state_dict:
                state_dict[prefix + theirs] = state_dict.pop(prefix + mine)
        return state_dict

    @staticmethod
    def _own_keys(module, state_dict, prefix, *args):
        for mine, theirs in module._KEYS.items():
            if prefix + theirs in state_dict:
                state_dict[prefix + mine] = state_dict.pop(prefix + theirs)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The single-device (unsharded) parameters, gathered from every rank, by
        ``state_dict``'s keys (TransformerEngine's: ``fc1_weight``, ...)."""
        out = {}
        for layer in ("fc1", "fc2"):
            key = self._full_key(layer)
            out.update((key(name), v) for name, v in getattr(self, layer).full_state_dict().items())
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Loads single-device (unsharded) parameters by ``full_state_dict``'s keys, all of
        them; each rank keeps its slices. Every key and shape is checked before anything is
        copied (ValueError)."""
        has = [key for key in self._KEYS.values() if getattr(self, key) is not None]
        _check_full_keys(state, has, type(self).__name__, required=has)
        parts = []
        for layer in ("fc1", "fc2"):
            parts += getattr(self, layer)._full_parts(state, self._full_key(layer))
        for param, value in parts:
            param.copy_(value)

    def reset_parameters(self) -> None:
        """Initialises fc1's and fc2's parameters as their constructors do (deferred
        initialisation: build on ``device="meta"``, ``to_empty()``, then this)."""
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def _full_key(self, layer: str):
        """A parameter of `layer` (fc1 or fc2) -> its key here (TransformerEngine's name)."""
        return lambda name: self._KEYS[f"{layer}.{name}"]

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                residual: Optional[torch.Tensor] = None):
        """fc1 and fc2 as one op (torch.ops.tpfp8.mlp), so that in FP8 fc2's backward hands
        fc1 its gradient already cast: the activation's backward writes fc1's FP8 gradient,
        and its column sums (fc1's bias gradient), in its own pass, with fc1's gradient scale
        (not when debugging). The submodules' own forward hooks do not run here.

        ``residual`` is added to the output as ``tpfp8.Linear`` adds it (fc2's GEMM adds it, or
        fc2 after its reduction when row-parallel). With ``residual=x`` in a ``LayerNormMLP``
        -- the pre-norm block ``x + mlp(x)`` -- the norm's backward also adds the output's
        gradient to ``x``'s in its own pass: neither add of the skip connection runs alone."""
        fc1, fc2 = self.fc1, self.fc2
        if fc1.return_bias or fc2.return_bias:  # (the op adds both biases itself)
            raise ValueError(f"{type(self).__name__} adds fc1's bias before the activation and "
                             f"returns fc2's output alone: set return_bias=False on fc1 and "
                             f"fc2 (fc2's bias can be left out with bias=False and added after)")
        _check_residual(residual)
        first = fc1._begin(x, is_first_microbatch)
        second = fc2._begin(first.x, is_first_microbatch, input_needs_grad=first.gives_grad())
        y, normalized = _run_op(first.vet or second.vet, first.compiling, _MLP, first.x,
                                *first.op_args, *second.op_args, residual)
        fc1._end(first)
        fc2._end(second)
        return self._outputs(y, normalized)

    def _outputs(self, y, normalized):
        return y


class MLP(_TwoLayers):
    """``fc2(act(fc1(x)))``: ``LayerNormMLP`` without its norm, for an MLP whose input comes
    from elsewhere than a norm (or whose norm stays outside). The activation writes fc2's FP8
    input, and fc2's backward hands fc1 its gradient already cast, as in ``LayerNormMLP``: one
    pass over fc1's output gradient fewer than ``Linear`` then ``ActivationLinear``.

    Args:
        hidden_size, ffn_hidden_size, bias, activation, set_parallel_mode, tp_group,
        sequence_parallel, fuse_wgrad_accumulation, name, device, dtype: as ``LayerNormMLP``.

    ``state_dict`` keys and read-only attributes: ``fc1_weight``, ``fc1_bias``, ``fc2_weight``,
    ``fc2_bias`` (the FP8 state under ``fc1._extra_state`` and ``fc2._extra_state``); the
    modules are ``fc1`` (a
    ``tpfp8.Linear``) and ``fc2`` (``ActivationLinear``). ``forward(x, is_first_microbatch=None)``
    returns ``y``. Build it explicitly: ``swap_fused`` does not make one.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True,
                 activation: str = "gelu", device=None, dtype=None, *,
                 set_parallel_mode: bool = False, tp_group=None, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, name: Optional[str] = None):
        super().__init__()
        self._make_layers(_GatedLinear, {}, hidden_size, ffn_hidden_size, bias, activation,
                          set_parallel_mode, name, device=device, dtype=dtype, tp_group=tp_group,
                          sequence_parallel=sequence_parallel,
                          fuse_wgrad_accumulation=fuse_wgrad_accumulation)


class LayerNormMLP(_TwoLayers):
    """``fc2(act(fc1(norm(x))))``, as TransformerEngine's ``LayerNormMLP``: the norm writes
    fc1's FP8 input, the activation writes fc2's (see ``LayerNormLinear``).

    Args:
        hidden_size, ffn_hidden_size: the model and the MLP's widths.
        eps, normalization, return_layernorm_output: as ``LayerNormLinear``.
        bias: biases of fc1 and fc2.
        activation: ``"gelu"`` (exact, erf) or ``"swiglu"`` (fc1 has ``2 * ffn_hidden_size``
            outputs ``[gate | up]``; ``silu(gate) * up``).
        set_parallel_mode: fc1 column-parallel and fc2 row-parallel over ``tp_group`` (with
            ``sequence_parallel``: the input and output split along dim 0).
        fuse_wgrad_accumulation, name, device, dtype: as ``tpfp8.Linear``.

    ``state_dict`` keys are TransformerEngine's: ``layer_norm_weight``, ``layer_norm_bias``,
    ``fc1_weight``, ``fc1_bias``, ``fc2_weight``, ``fc2_bias`` (the FP8 state stays under
    ``fc1._extra_state`` and ``fc2._extra_state``), and so are read-only attributes of those
    names (``mlp.fc1_weight`` is ``mlp.fc1.weight``); the modules are ``fc1``
    (``LayerNormLinear``) and ``fc2`` (``ActivationLinear``), whose names
    ``named_parameters()`` gives. ``full_state_dict()`` / ``load_full_state_dict()`` give and
    take the single-device (unsharded) parameters by those keys.
    ``forward(x, is_first_microbatch=None)`` returns ``y`` or, with
    ``return_layernorm_output``, ``(y, normalized x)``.
    """

    _KEYS = {"fc1.layer_norm_weight": "layer_norm_weight",
             "fc1.layer_norm_bias": "layer_norm_bias", **_TwoLayers._KEYS}

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 bias: bool = True, normalization: str = "LayerNorm", activation: str = "gelu",
                 return_layernorm_output: bool = False, device=None, dtype=None, *,
                 set_parallel_mode: bool = False, tp_group=None, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, name: Optional[str] = None):
        super().__init__()
        norm = {"eps": eps, "normalization": normalization,
                "return_layernorm_output": return_layernorm_output}
        self._make_layers(LayerNormLinear, norm, hidden_size, ffn_hidden_size, bias, activation,
                          set_parallel_mode, name, device=device, dtype=dtype, tp_group=tp_group,
                          sequence_parallel=sequence_parallel,
                          fuse_wgrad_accumulation=fuse_wgrad_accumulation)

    def _outputs(self, y, normalized):
        return (y, normalized) if self.return_layernorm_output else y


def _te_name(path: str) -> property:
    return property(lambda self: functools.reduce(getattr, path.split("."), self),
                    doc=f"``{path}`` by TransformerEngine's name (read-only)")


def _setting_of(layer: str, name: str) -> property:
    """The MLP's setting `name`, which its `layer` (fc1 or fc2) holds and uses: read and set
    there (where the layer refuses a change, so does the MLP), so that the two never differ."""
    return property(lambda self: getattr(getattr(self, layer), name),
                    lambda self, value: setattr(getattr(self, layer), name, value),
                    doc=f"``{layer}.{name}``")


# The parameters by TransformerEngine's names too, as attributes (its state_dict keys); its
# settings, as the layers that use them hold them.
for _cls in (MLP, LayerNormMLP):
    for _path, _name in _cls._KEYS.items():
        setattr(_cls, _name, _te_name(_path))
    _cls.activation = _setting_of("fc2", "activation")
for _name in ("eps", "normalization", "return_layernorm_output"):
    setattr(LayerNormMLP, _name, _setting_of("fc1", _name))


def swap_fused(model: nn.Module) -> nn.Module:
    """Fuses, in place, the pairs the model makes unambiguous: a ``nn.LayerNorm`` /
    ``nn.RMSNorm`` (affine, over the last dimension) whose output goes to one ``nn.Linear`` or
    ``tpfp8.Linear`` and nowhere else becomes one ``LayerNormLinear`` (the norm's slot an
    ``nn.Identity``), and a linear layer taking an exact ``nn.GELU()``'s output alone becomes an
    ``ActivationLinear`` taking the GELU's input. Found in every ``nn.Sequential`` (its order is
    the data flow) and in every module whose ``forward`` ``torch.fx`` can trace with its
    submodules as opaque calls: there the traced graph must show the norm (or GELU) and the
    Linear each called once, the norm's output used by that Linear alone, as its only argument.
    A norm whose width the fused kernel cannot take (see ``LayerNormLinear``) stays unfused.
    Modules shared between places in the tree, untraceable ``forward``s (data-dependent
    control flow), a norm feeding several projections (q, k and v) and a norm or Linear whose
    tensors a traced forward also reads (``self.norm.weight.dtype``) are left as they are;
    convert the remaining ``nn.Linear`` layers with :func:`tpfp8.swap_linear`. What an
    untraceable ``forward`` calls is not seen: one that reaches into a fused pair's norm
    (``self.block.norm(x)``) gets its input back from the norm's ``nn.Identity`` slot, so fuse
    such a model by hand. The new layer keeps the replaced one's training mode and, from a
    ``tpfp8.Linear``, its settings and FP8 state. Under ``torch.autocast`` a fused norm reads
    its input in the autocast dtype, not in fp32 as torch's autocast runs ``nn.LayerNorm`` (see
    ``LayerNormLinear``). The new modules
    hold the same parameters, so the state dict changes names: the norm's ``weight`` / ``bias``
    move under the Linear's name as ``layer_norm_weight`` / ``layer_norm_bias`` (as in
    TransformerEngine's modules). Load a plain model's checkpoint before fusing, and save the
    fused model's to load into a fused one: ``load_state_dict(..., strict=False)`` across the
    two would leave the norms unloaded. Returns ``model``."""
    shared = _shared_modules(model)
    # Every traceable forward, read before anything changes: its pairs, and how often each
    # module is called from it (a norm a parent also calls directly must stay a norm).
    traced = [(owner, *_traced_calls(owner)) for owner in model.modules()
              if _traceable_owner(owner)]
    calls = collections.Counter()
    for _, _, counts in traced:
        calls.update(counts)
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        names = list(seq._modules)
        for a, b in zip(names, names[1:]):
            _fuse_pair(seq, a, b, shared, calls, expected_calls=0)
    for owner, pairs, _ in traced:
        for a, b in pairs:
            _fuse_pair(owner, a, b, shared, calls, expected_calls=1)
    return model


def _fuse_pair(owner: nn.Module, a: str, b: str, shared: set, calls: collections.Counter,
               expected_calls: int) -> None:
    """Fuses submodules `a` (a norm or an exact GELU) and `b` (a Linear taking its output alone)
    of `owner`, where they are of those kinds, neither is shared, and the traced forwards call
    each `expected_calls` times (a Sequential's own calls are not among them; a pair traced in
    `owner`'s forward counts that one)."""
    first, second = owner.get_submodule(a), owner.get_submodule(b)
    if not _plain_linear(second) or id(first) in shared or id(second) in shared:
        return
    if calls[id(first)] != expected_calls or calls[id(second)] != expected_calls:
        return
    if _fusable_norm(first):
        fused = _norm_linear(first, second)
    elif type(first) is nn.GELU and first.approximate == "none":
        fused = _activation_linear(second)
    else:
        return
    _set_submodule(owner, b, fused)
    _set_submodule(owner, a, nn.Identity().train(first.training))


def _shared_modules(model: nn.Module) -> set:
    """ids of the modules that stand at more than one place in the tree."""
    seen, shared = set(), set()
    for _, m in model.named_modules(remove_duplicate=False):
        (shared if id(m) in seen else seen).add(id(m))
    return shared


def _set_submodule(owner: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(owner.get_submodule(parent) if parent else owner, name, module)


def _traceable_owner(m: nn.Module) -> bool:
    # (Sequentials are read in order; tpfp8's own modules are never rewritten.)
    return bool(m._modules) and not isinstance(m, (nn.Sequential, Linear, _TwoLayers))


class _OpaqueSubmodules(torch.fx.Tracer):
    """Traces one module's forward, every submodule a single call node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _traced_calls(owner: nn.Module) -> tuple:
    """(pairs, calls): the (a, b) submodule paths where `owner.forward` calls `b` on the output
    of `a`, which nothing else uses, each called once; and how many times it calls each
    module (by id). Nothing of either where forward cannot be traced."""
    try:  # (on a shallow copy: a forward that sets attributes sets the copy's)
        graph = _OpaqueSubmodules().trace(copy.copy(owner))
    except Exception:  # (control flow on values, unsupported Python: not provable, left alone)
        return [], collections.Counter()
    calls = [n for n in graph.nodes if n.op == "call_module"]
    count = collections.Counter(n.target for n in calls)
    # A tensor of a submodule read directly (`self.norm.weight.dtype`) counts as a use of it:
    # once fused, a norm's slot is an Identity without its parameters.
    modules = dict(owner.named_modules())
    count.update(path for path in (n.target.rpartition(".")[0] for n in graph.nodes
                                   if n.op == "get_attr") if path and path in modules)
    by_module = collections.Counter()
    for target, n in count.items():
        by_module[id(owner.get_submodule(target))] += n
    pairs = []
    for n in calls:
        users = list(n.users)
        if count[n.target] != 1 or len(users) != 1:
            continue
        user = users[0]
        if user.op == "call_module" and count[user.target] == 1 and user.args == (n,) \
                and not user.kwargs:
            pairs.append((n.target, user.target))
    return pairs, by_module


def _plain_linear(m) -> bool:
    return type(m) is nn.Linear or (type(m) is Linear and m.parallel_mode is None)


def _fusable_norm(m) -> bool:
    """An affine LayerNorm / RMSNorm over the last dimension, of a width the kernel takes."""
    rms = getattr(nn, "RMSNorm", None)  # (torch >= 2.4)
    if type(m) is nn.LayerNorm:
        affine = m.elementwise_affine
    elif rms is not None and type(m) is rms:
        affine = m.weight is not None
    else:
        return False
    return affine and len(m.normalized_shape) == 1 and \
        _norm_width_error(m.normalized_shape[0]) is None


def _norm_linear(norm, lin) -> LayerNormLinear:
    rms = type(norm) is not nn.LayerNorm
    eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
    new = LayerNormLinear(lin.in_features, lin.out_features, eps=eps,
                          bias=lin.bias is not None,
                          normalization="RMSNorm" if rms else "LayerNorm", device="meta")
    new.weight, new.bias = lin.weight, lin.bias
    new.layer_norm_weight = norm.weight
    if not rms:
        new.layer_norm_bias = norm.bias
    return _adopted(new, lin)


def _activation_linear(lin) -> ActivationLinear:
    new = ActivationLinear(lin.in_features, lin.out_features, "gelu", bias=lin.bias is not None,
                           device="meta")
    new.weight, new.bias = lin.weight, lin.bias
    return _adopted(new, lin)


def _adopted(new: Linear, old) -> Linear:
    """`new` in `old`'s training mode, with a tpfp8.Linear `old`'s settings and FP8 state (its
    input is the same tensor: the norm's or the GELU's output), else fresh state, on its
    weight's device."""
    for attr in ("save_original_input", "fuse_wgrad_accumulation", "return_bias", "name"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    new._reset_fp8_state()
    if isinstance(old, Linear):
        new.set_extra_state(old.get_extra_state())
    return new.train(old.training)
