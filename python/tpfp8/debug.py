"""Precision debugging for ``tpfp8.Linear``, built in.

Per layer (a regex on ``Linear(name=...)``) and step, a rule can:
  - ``log_stats``: report statistics of the tensors each GEMM really consumed -- after the
    sequence-parallel gather, in the precision and layout the GEMM read them;
  - ``disable_fp8_gemm``: run the listed GEMMs in high precision;
  - ``fake_quant``: quantize -> dequantize the listed tensors with a format, then run the GEMMs
    that consume them in high precision.

    tpfp8.debug.initialize({"rules": [{
        "layers": "mlp\\\\.fc1",                      # regex, searched in the layer's name
        "start_step": 0, "end_step": 100, "freq": 10,  # optional
        "features": {
            "log_stats": {"tensors": ["activation", "gradient"], "gemms": ["fprop", "wgrad"]},
            "disable_fp8_gemm": {"gemms": ["wgrad"]},
            "fake_quant": {"tensors": ["weight"], "format": "e5m2"},
        }}]}, log_dir="debug_logs")
    ... each training step: ...; tpfp8.debug.step()
    tpfp8.debug.shutdown()

The config may also be a path to a JSON or YAML file. Statistics are written as JSON lines to
``log_dir/tpfp8_debug_rank{R}.jsonl`` and to the ``tpfp8.debug`` logger; under tensor
parallelism a sharded tensor's statistics are reduced over the group, so they describe the
whole tensor and are the same on every rank (``scale_inv`` is the largest of the shards',
``scale_inv_min`` the smallest). ``overflow_pct`` counts the values the cast clipped: those
that round above the format's max, not those within rounding of it (with the scale rebuilt as
``1 / scale_inv``, so a value within an ulp of that limit may be counted either way). Each
``initialize`` starts its rank's file anew. A tensor with no elements (a layer no token reached)
reports ``n`` 0 and no minimum, maximum, mean or std. Reports never change what a layer
computes or the state it keeps: one that fails (a log folder removed mid-run) is dropped with a
warning, and a recomputed forward (activation checkpointing) reports nothing again. A layer
with no matching rule at a step runs exactly the normal path.
"""
import itertools
import json
import logging
import math
import os
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from .formats import Fp8Format
from .recipe import _is_int

TENSORS = ("activation", "weight", "gradient")
GEMMS = ("fprop", "dgrad", "wgrad")
FEATURES = ("log_stats", "disable_fp8_gemm", "fake_quant")
logger = logging.getLogger("tpfp8.debug")


@dataclass
class Rule:
    layers: "re.Pattern"
    start_step: int = 0
    end_step: Optional[int] = None
    freq: int = 1
    log: set = field(default_factory=set)      # {(tensor, gemm)}
    high_precision: set = field(default_factory=set)  # {gemm}
    fake: dict = field(default_factory=dict)   # {tensor: Fp8Format}

    def applies(self, name: str, step: int) -> bool:
        return (step >= self.start_step and (self.end_step is None or step <= self.end_step)
                and (step - self.start_step) % self.freq == 0
                and self.layers.search(name or "") is not None)


class _State:
    rules = None
    step = 0
    log_dir = None
    records = []
    started = set()  # the files this session has written to (each begun anew)
    matching = {}  # layer name -> matching rules at the current step (a step's regex searches)
    options = {}  # layer handle -> its options at the current step (see options_for)


_layers = weakref.WeakValueDictionary()  # handle -> layer (Linear.__init__ registers each)
_handles = itertools.count()
_UNKNOWN = object()


def _names(value, allowed, what, where):
    values = [value] if isinstance(value, str) else list(value or [])
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"{where}: {what} must be a non-empty list from {list(allowed)}, got "
                         f"{value!r}")
    return values


# What each GEMM reads: log_stats pairs outside these never log anything.
CONSUMED = {"fprop": ("activation", "weight"), "dgrad": ("gradient", "weight"),
            "wgrad": ("gradient", "activation")}
# The keys a rule and each feature's spec may hold.
_RULE_KEYS = ("layers", "start_step", "end_step", "freq", "features")
_SPEC_KEYS = {"log_stats": ("tensors", "gemms"), "disable_fp8_gemm": ("gemms",),
              "fake_quant": ("tensors", "format")}


def _known(keys, allowed, what, where):
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown {what} {unknown}; the keys are {list(allowed)}")


def _step_number(raw: dict, key: str, default, least: int, where: str):
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    if not _is_int(value) or value < least:
        raise ValueError(f"{where}: {key} must be an int >= {least}, got {value!r}")
    return value


def _parse_rule(raw: dict, i: int) -> Rule:
    where = f"debug rule {i}"
    if not isinstance(raw, dict) or "layers" not in raw or "features" not in raw:
        raise ValueError(f"{where}: a rule is a dict with 'layers' (a regex) and 'features'")
    _known(raw, _RULE_KEYS, "key(s)", where)
    try:
        pattern = re.compile(raw["layers"])
    except (re.error, TypeError) as e:
        raise ValueError(f"{where}: 'layers' is not a valid regex ({e})") from None
    rule = Rule(pattern, _step_number(raw, "start_step", 0, 0, where),
                _step_number(raw, "end_step", None, 0, where),
                _step_number(raw, "freq", 1, 1, where))
    if rule.end_step is not None and rule.end_step < rule.start_step:
        raise ValueError(f"{where}: end_step {rule.end_step} is before start_step "
                         f"{rule.start_step}: the rule would never apply")
    if not isinstance(raw["features"], dict):
        raise ValueError(f"{where}: 'features' is a dict of feature name -> its settings, got "
                         f"{type(raw['features']).__name__}")
    for name, spec in raw["features"].items():
        spec = spec or {}
        if name not in FEATURES:
            raise ValueError(f"{where}: unknown feature {name!r}; features are {list(FEATURES)}")
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: the settings of {name} are a dict, got "
                             f"{type(spec).__name__}")
        _known(spec, _SPEC_KEYS[name], f"setting(s) of {name}", where)
        if name == "log_stats":
            tensors = _names(spec.get("tensors", TENSORS), TENSORS, "tensors", where)
            gemms = _names(spec.get("gemms", GEMMS), GEMMS, "gemms", where)
            pairs = {(t, g) for t in tensors for g in gemms if t in CONSUMED[g]}
            if not pairs:
                raise ValueError(f"{where}: log_stats of {tensors} in {gemms} logs nothing: "
                                 f"fprop reads the activation and weight, dgrad the gradient "
                                 f"and weight, wgrad the gradient and activation")
            rule.log |= pairs
        elif name == "disable_fp8_gemm":
            rule.high_precision |= set(_names(spec.get("gemms"), GEMMS, "gemms", where))
        elif name == "fake_quant":
            fmt = Fp8Format.parse(spec.get("format", "e4m3"))
            for t in _names(spec.get("tensors"), TENSORS, "tensors", where):
                rule.fake[t] = fmt
    return rule


def _load(config):
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        with open(path) as f:
            if path.endswith((".yaml", ".yml")):
                try:
                    import yaml
                except ImportError:
                    raise ValueError("YAML debug configs need PyYAML (pip install pyyaml); or "
                                     "write the config as JSON") from None
                return yaml.safe_load(f)
            return json.load(f)
    return config


def initialize(config, log_dir: Optional[str] = None) -> None:
    """Activates the rules of `config` (dict, list of rules, or a JSON/YAML path); every error
    in it is reported here, before any step runs."""
    raw = _load(config)
    rules = raw.get("rules") if isinstance(raw, dict) else raw
    if not isinstance(rules, list):
        raise ValueError("a debug config is a list of rules, or a dict with 'rules': [...]")
    parsed = [_parse_rule(r, i) for i, r in enumerate(rules)]
    if log_dir:  # (before anything changes: a log_dir that cannot be made leaves the old rules)
        os.makedirs(log_dir, exist_ok=True)
    _State.rules = parsed
    _State.step, _State.log_dir, _State.records, _State.started = 0, log_dir, [], set()
    _work_out_options()


def step() -> None:
    """Advances the debug step counter (call once per training step)."""
    _State.step += 1
    _work_out_options()


def shutdown() -> None:
    """Deactivates debugging; layers run the normal path again."""
    _State.rules = None
    _work_out_options()


def records() -> list:
    """The statistics logged since initialize(), as dicts (also in the JSON-lines file)."""
    return list(_State.records)


def register(layer) -> int:
    """A handle for `layer`, by which the ops' reports find it (weakly held)."""
    handle = next(_handles)
    _layers[handle] = layer
    if _State.rules:  # now, not inside a compiled forward (whose graph would guard the step)
        _State.options[handle] = _options(layer, handle)
    return handle


def renamed(layer) -> None:
    """`layer.name` changed: its options follow now (the rules select layers by name)."""
    if _State.rules:
        _State.options[layer._debug_handle] = _options(layer, layer._debug_handle)


def _rules_for(layer) -> list:
    rules = _State.matching.get(layer.name)
    if rules is None:  # once per layer name and step: later calls cost one dict lookup
        rules = [r for r in _State.rules if r.applies(layer.name, _State.step)]
        _State.matching[layer.name] = rules
    return rules


def state():
    """The object whose ``rules`` are the rules set (falsy while none is): what native code
    checks (tpfp8._C.CallTemplate)."""
    return _State


def options_for(layer) -> Optional[tuple]:
    """The debug options of `layer` at the current step as the ops take them -- (hp_fprop,
    hp_dgrad, hp_wgrad, fake activation, fake weight, fake gradient format or -1, the layer's
    handle when it logs, else -1) -- or None when no rule applies. Worked out once per step,
    outside any compiled graph (`step`): a graph then depends on this value alone, not on the
    step counter, and is reused while the value stays the same."""
    if not _State.rules:
        return None
    options = _State.options.get(layer._debug_handle, _UNKNOWN)
    if options is _UNKNOWN:  # a layer made since the step began
        options = _State.options[layer._debug_handle] = _options(layer, layer._debug_handle)
    return options


def _options(layer, handle: int) -> Optional[tuple]:
    rules = _rules_for(layer)
    if not rules:
        return None
    hp = set().union(*(r.high_precision for r in rules))
    fake = {}
    for r in rules:
        fake.update(r.fake)
    logs = any(r.log for r in rules)
    return (int("fprop" in hp), int("dgrad" in hp), int("wgrad" in hp),
            *(int(fake[t]) if t in fake else -1 for t in TENSORS),
            handle if logs else -1)


# Added to a layer's handle for a recomputed forward (activation checkpointing): its forward
# GEMM reported when it first ran, but its backward GEMMs report from here (a reentrant
# checkpoint's first forward ran without autograd, so the recompute is what backward runs).
_RECOMPUTE = 1 << 40


def for_recompute(options: tuple) -> tuple:
    """`options` (options_for) for a recomputed forward: reporting its backward alone."""
    handle = options[-1]
    return options if handle < 0 else (*options[:-1], handle + _RECOMPUTE)


def _work_out_options() -> None:
    """Every live layer's options for the new step (the same dict object, updated)."""
    _State.matching = {}
    _State.options.clear()
    if _State.rules:
        for handle, layer in list(_layers.items()):
            _State.options[handle] = _options(layer, handle)


def _report(handle, gemm, tensor, used, original, scale_inv, fmt) -> None:
    """What the ops call for each operand of a logging layer's GEMMs (forward and backward):
    the rules are read here, when the GEMM runs, so a compiled graph reports like eager."""
    if handle >= _RECOMPUTE:
        if gemm == "fprop":
            return
        handle -= _RECOMPUTE
    layer = _layers.get(handle)
    if layer is None or not _State.rules:
        return
    if (tensor, gemm) in set().union(*(r.log for r in _rules_for(layer))):
        try:  # (inside the op, after its amaxes are recorded: it must not fail the call)
            _log(layer, gemm, tensor, used, original, scale_inv, fmt)
        except Exception as exc:
            warnings.warn(f"tpfp8.debug: the {gemm} {tensor} report of {layer.name!r} failed "
                          f"and was dropped ({type(exc).__name__}: {exc}); the layer's "
                          f"results are unaffected", RuntimeWarning, stacklevel=2)


def _sharded(layer, tensor: str) -> bool:
    """Whether this rank holds only part of `tensor` (its statistics need the group)."""
    mode = layer.parallel_mode
    return (mode is not None and tensor == "weight") or (mode, tensor) in (
        ("row", "activation"), ("column", "gradient"))


def _log(layer, gemm, tensor, used, original, scale_inv, fmt) -> None:
    group = layer.tp_group if _sharded(layer, tensor) else None
    stats = _statistics(used, original, scale_inv, fmt, group)
    shape = list(used.shape)
    if group is not None:  # the whole tensor's shape: the split dimension times the group
        split = 0 if (tensor == "weight" and layer.parallel_mode == "column") else 1
        shape[split] *= dist.get_world_size(group)
    _write({"step": _State.step, "layer": layer.name, "gemm": gemm, "tensor": tensor,
            "shape": shape, **stats})


def _statistics(used, original, scale_inv, fmt, group) -> dict:
    """fp64 statistics of `used`; FP8 ones against `original`. Sums, minima and maxima are
    reduced over `group`, so a sharded tensor reports the whole tensor's values."""
    u = used.double()
    sums = [float(u.numel()), u.sum(), (u * u).sum(), u.abs().sum()]
    fp8 = scale_inv is not None and fmt >= 0
    if fp8:
        o = original.double()
        scale = torch.reciprocal(scale_inv.float())
        nonzero = o != 0
        clipped = Fp8Format(fmt).clipped(original.float() * scale)  # fp32, as the cast
        sums += [(nonzero & (u == 0)).sum(), nonzero.sum(), clipped.sum(), ((u - o) ** 2).sum()]
    sums = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=u.device) for v in sums])
    # Minima and maxima (with the shards' scale_inv under current scaling, each rank its own);
    # none of an empty shard (a rank, or a layer, no token reached).
    inf = torch.full((1,), math.inf, dtype=torch.float64, device=u.device)
    lo, hi = (u.min().reshape(1), u.max().reshape(1)) if u.numel() else (inf, -inf)
    if fp8:
        lo = torch.cat([lo, scale_inv.reshape(1).double()])
        hi = torch.cat([hi, scale_inv.reshape(1).double()])
    if group is not None:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    s, lo, hi = sums.tolist(), lo.tolist(), hi.tolist()
    n, total, total_sq, l1 = s[:4]
    out = {"n": int(n), "amax": 0.0, "min": None, "max": None, "mean": None, "std": None,
           "l1_norm": l1, "l2_norm": math.sqrt(total_sq)}
    if n:
        mean = total / n
        out.update(amax=max(abs(lo[0]), abs(hi[0])), min=lo[0], max=hi[0], mean=mean,
                   std=math.sqrt(max(total_sq / n - mean * mean, 0.0)))
    if fp8:
        under, nonzeros, clipped, sq_err = s[4:]
        out.update(underflow_pct=100.0 * under / max(nonzeros, 1.0),
                   overflow_pct=100.0 * clipped / max(n, 1.0), scale_inv=hi[1],
                   scale_inv_min=lo[1], mse=sq_err / n if n else None)
    return out


def _write(record: dict) -> None:
    _State.records.append(record)
    logger.info("%s", json.dumps(record))
    if _State.log_dir:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        path = os.path.join(_State.log_dir, f"tpfp8_debug_rank{rank}.jsonl")
        try:
            with open(path, "a" if path in _State.started else "w") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:  # (the records and the logger keep the rest)
            _State.log_dir = None
            warnings.warn(f"tpfp8.debug: cannot write {path} ({exc}); the rest of this session "
                          f"goes to tpfp8.debug.records() and the 'tpfp8.debug' logger only",
                          RuntimeWarning, stacklevel=2)
            return
        _State.started.add(path)


_C.set_debug_logger(_report)
