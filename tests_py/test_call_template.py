"""A layer's call template (tpfp8._C.CallTemplate): after a call made the slow way, the calls of
a layer that decide everything the same way run from a template with less host time. These tests
hold it to the slow path bit for bit -- the twin of each layer runs under a torch-function mode,
which always takes the slow path (and torch.ops) -- through everything that can change between
calls: state or parameters replaced, recipes, settings, gradient needs, checkpoints, autocast,
debug rules; and check that the template takes the calls it should, holds no tensor, and leaves
the layer untouched when its op refuses a call."""
import copy
import gc
import threading
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.utils.parametrize
import torch.utils.checkpoint
from torch import nn
from torch.overrides import TorchFunctionMode

import tpfp8

BF16 = {"dtype": torch.bfloat16}


class SlowPath(TorchFunctionMode):
    """Runs every function as it is: under it a layer never uses its template."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _pair(device, bias=True, **kwargs):
    torch.manual_seed(0)
    layer = tpfp8.Linear(64, 32, bias=bias, device=device, **BF16, **kwargs)
    return layer, copy.deepcopy(layer)


def _step(layer, x, recipe=tpfp8.DelayedScaling(), fp8=True, is_first_microbatch=None,
          context=None):
    """One training step: what it gives (outputs and gradients) and the layer's state after."""
    x = x.detach().requires_grad_(x.requires_grad)
    with tpfp8.fp8_autocast(enabled=fp8, recipe=recipe), context or _nothing():
        out = layer(x, is_first_microbatch=is_first_microbatch)
    y = out[0] if isinstance(out, tuple) else out
    if torch.is_grad_enabled() and y.requires_grad:
        y.float().square().sum().backward()
    results = [*(out if isinstance(out, tuple) else (out,)), x.grad]
    results += [p.grad for p in layer.parameters()]
    results += [getattr(p, "main_grad", None) for p in layer.parameters()]
    results += [b for b in layer.buffers() if b is not None]
    for p in layer.parameters():
        p.grad = None
    return [r.clone() if isinstance(r, torch.Tensor) else r for r in results]


def _outcome(layer, x, **kwargs):
    try:
        return _step(layer, x, **kwargs)
    except (ValueError, TypeError, RuntimeError, AttributeError) as e:
        for p in layer.parameters():
            p.grad = None
        return e


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _same(layer, twin, x, **kwargs):
    """The same step of both layers gives the same bytes, or is refused the same way."""
    mine = _outcome(layer, x, **kwargs)
    with SlowPath():
        theirs = _outcome(twin, x, **kwargs)
    if isinstance(theirs, Exception):
        assert (type(mine), str(mine)) == (type(theirs), str(theirs))
        return
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a is b is None


def _input(device, requires_grad=True):
    torch.manual_seed(1)
    return torch.randn(16, 64, device=device, **BF16).requires_grad_(requires_grad)


def _on_both(layer, twin, change):
    change(layer)
    change(twin)


RECIPES = {"delayed": tpfp8.DelayedScaling(), "current": tpfp8.CurrentScaling()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", ["delayed", "current", "high precision"])
def test_templated_steps_equal_the_slow_path(device, recipe, bias):
    layer, twin = _pair(device, bias=bias)
    x = _input(device)
    kwargs = {"recipe": RECIPES.get(recipe), "fp8": recipe in RECIPES}
    for _ in range(4):  # (each step uses the previous step's delayed-scaling update)
        _same(layer, twin, x, **kwargs)


def test_the_template_takes_the_calls_after_the_first(device):
    layer, _ = _pair(device)
    x = _input(device)
    _step(layer, x)
    with mock.patch.object(tpfp8.Linear, "_begin", side_effect=AssertionError("slow path")):
        for _ in range(3):
            _step(layer, x)
            _step(layer, x, fp8=True, recipe=tpfp8.DelayedScaling())  # (another frame)


def _replace_state(layer):
    """Replaces the state tensors past nn.Module's __setattr__, as FSDP-style code does."""
    for name in ("fp8_scale", "fp8_amax_history", "fp8_grad_amax_history"):
        layer._buffers[name] = layer._buffers[name].clone() * 2


def _replace_weight(layer):
    layer.weight = nn.Parameter(layer.weight.detach() * 0.5)


def _add_bias(layer):
    torch.manual_seed(2)
    layer.bias = nn.Parameter(torch.randn(32, device=layer.weight.device, **BF16))


CHANGES = {
    "state replaced": _replace_state,
    "weight replaced": _replace_weight,
    "weight frozen": lambda layer: layer.weight.requires_grad_(False),
    "bias frozen": lambda layer: layer.bias.requires_grad_(False),
    "bias dropped": lambda layer: setattr(layer, "bias", None),
    "return_bias": lambda layer: setattr(layer, "return_bias", True),
    "save_original_input": lambda layer: setattr(layer, "save_original_input", True),
    "fuse_wgrad_accumulation": lambda layer: setattr(layer, "fuse_wgrad_accumulation", True),
    "weight's data replaced": lambda layer: setattr(layer.weight, "data",
                                                    layer.weight.detach() * 2),
    "state reloaded": lambda layer: layer.load_state_dict(layer.state_dict()),
    "reset": lambda layer: (torch.manual_seed(3), layer.reset_parameters()),
    "weight removed": lambda layer: setattr(layer, "weight", None),
    "scale removed": lambda layer: layer._buffers.__setitem__("fp8_scale", None),
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("change", CHANGES)
def test_a_layer_changed_between_calls_computes_as_changed(device, change, recipe):
    """(save_original_input under delayed scaling: refused the same way by both.)"""
    layer, twin = _pair(device)
    x = _input(device)
    recipe = RECIPES[recipe]
    for _ in range(2):
        _same(layer, twin, x, recipe=recipe)
    _on_both(layer, twin, CHANGES[change])
    for _ in range(3):
        _same(layer, twin, x, recipe=recipe)


def _set_main_grad(value):
    return lambda layer: setattr(layer.weight, "main_grad", value(layer.weight))


MAIN_GRAD_CHANGES = {
    "replaced": _set_main_grad(lambda w: torch.full_like(w, 0.5, dtype=torch.float32)),
    "removed": lambda layer: delattr(layer.weight, "main_grad"),
    "set to None": _set_main_grad(lambda w: None),
    "of the weight's dtype": _set_main_grad(torch.zeros_like),
    "not a tensor": _set_main_grad(lambda w: 0.0),
    "weight frozen": lambda layer: layer.weight.requires_grad_(False),
    "weight replaced": _replace_weight,
}


@pytest.mark.parametrize("recipe", ["delayed", "current", "high precision"])
def test_fused_wgrad_accumulation_steps_equal_the_slow_path(device, recipe):
    """The weight gradient accumulated into weight.main_grad, step after step."""
    layer, twin = _pair(device, fuse_wgrad_accumulation=True)
    x = _input(device)
    kwargs = {"recipe": RECIPES.get(recipe), "fp8": recipe in RECIPES}
    for first in (None, None, None, True, False, False, None):
        _same(layer, twin, x, is_first_microbatch=first, **kwargs)


def test_the_template_takes_fused_wgrad_accumulation_calls(device):
    layer, _ = _pair(device, fuse_wgrad_accumulation=True)
    x = _input(device)
    _step(layer, x)  # (makes weight.main_grad: the slow path)
    _step(layer, x)
    with mock.patch.object(tpfp8.Linear, "_begin", side_effect=AssertionError("slow path")):
        for _ in range(2):  # (the second into a main_grad replaced in between)
            main_grad = layer.weight.main_grad
            before = main_grad.clone()
            _step(layer, x)
            assert layer.weight.main_grad is main_grad and not torch.equal(main_grad, before)
            assert layer.weight.grad is None
            layer.weight.main_grad = torch.zeros_like(main_grad)


def test_a_weight_frozen_then_unfrozen_reads_main_grad_again(device):
    layer, twin = _pair(device, fuse_wgrad_accumulation=True)
    x = _input(device)
    for requires_grad in (True, False, True):
        _on_both(layer, twin, lambda layer: layer.weight.requires_grad_(requires_grad))
        for _ in range(2):
            _same(layer, twin, x)


def test_the_template_holds_no_main_grad(device):
    layer, _ = _pair(device, fuse_wgrad_accumulation=True)
    x = _input(device)
    for _ in range(3):
        _step(layer, x)
    old = weakref.ref(layer.weight.main_grad)
    layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    gc.collect()
    assert old() is None


@pytest.mark.parametrize("change", MAIN_GRAD_CHANGES)
def test_main_grad_changed_between_calls_is_used_as_changed(device, change):
    """(A main_grad the op refuses is refused the same way by both; one removed is made anew.)"""
    layer, twin = _pair(device, fuse_wgrad_accumulation=True)
    x = _input(device)
    for _ in range(2):
        _same(layer, twin, x)
    _on_both(layer, twin, MAIN_GRAD_CHANGES[change])
    for _ in range(3):
        _same(layer, twin, x)


class _Doubled(nn.Module):
    def forward(self, t):
        return t * 2


def _bias_as_buffer(layer):
    bias = layer.bias.detach().clone()
    del layer.bias
    layer.register_buffer("bias", bias)


BIASES = {
    "parametrized": lambda layer: torch.nn.utils.parametrize.register_parametrization(
        layer, "bias", _Doubled()),
    "a buffer": _bias_as_buffer,
}


@pytest.mark.parametrize("return_bias", [False, True])
@pytest.mark.parametrize("where", BIASES)
def test_a_bias_kept_elsewhere_is_found(device, where, return_bias):
    """A bias that is not a parameter of the layer (parametrized, a buffer) is what the
    layer adds or returns, every call."""
    layer, twin = _pair(device, return_bias=return_bias)
    x = _input(device)
    _same(layer, twin, x)
    _on_both(layer, twin, BIASES[where])
    for _ in range(3):
        _same(layer, twin, x)


class _Counting(tpfp8.Linear):
    """A subclass with bookkeeping of its own in the slow path."""

    commits = 0

    def _commit(self, *args, **kwargs):
        self.commits += 1
        return super()._commit(*args, **kwargs)


def test_a_subclass_overriding_the_slow_path_keeps_it(device):
    layer = _Counting(64, 32, device=device, **BF16)
    x = _input(device)
    for _ in range(4):
        _step(layer, x)
    assert layer.commits == 4


def test_a_bias_added_to_a_layer_without_one_is_added(device):
    layer, twin = _pair(device, bias=False)
    x = _input(device)
    _same(layer, twin, x)
    _same(layer, twin, x)
    _on_both(layer, twin, _add_bias)
    _same(layer, twin, x)
    assert layer.bias.grad is None  # (_step clears it; it was computed: compared above)


STEPS = {
    "history length": {"recipe": tpfp8.DelayedScaling(amax_history_len=4)},
    "margin": {"recipe": tpfp8.DelayedScaling(margin=1)},
    "format": {"recipe": tpfp8.DelayedScaling(fp8_format="e4m3")},
    "current scaling": {"recipe": tpfp8.CurrentScaling()},
    "high precision": {"fp8": False},
    "input without grad": {"x_grad": False},
    "no grad": {"context": torch.no_grad()},
    "inference mode": {"context": torch.inference_mode()},
}


@pytest.mark.parametrize("other", STEPS)
def test_calls_that_decide_otherwise_take_the_slow_path(device, other):
    """Between templated steps, a step that decides something otherwise; then back."""
    layer, twin = _pair(device)
    kwargs = dict(STEPS[other])
    x = _input(device, kwargs.pop("x_grad", True))
    plain = _input(device)
    for _ in range(2):
        _same(layer, twin, plain)
    for _ in range(2):
        _same(layer, twin, x, **kwargs)
    for _ in range(2):
        _same(layer, twin, plain)


def test_is_first_microbatch_sequences(device):
    layer, twin = _pair(device)
    x = _input(device)
    for first in (None, True, False, False, True, False, None, False):
        _same(layer, twin, x, is_first_microbatch=first)


class _Checkpointed(nn.Module):
    """The layer under torch.utils.checkpoint (its parameters and state are the layer's)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, is_first_microbatch=None):
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def test_checkpointed_and_autocast_calls(device):
    layer, twin = _pair(device)
    x = _input(device)
    _same(layer, twin, x)
    _same(layer, twin, x)
    _same(_Checkpointed(layer), _Checkpointed(twin), x)
    _same(layer, twin, x)
    x32 = x.detach().float().requires_grad_()
    _same(layer, twin, x32, context=torch.autocast(device, dtype=torch.bfloat16))
    _same(layer, twin, x)


def _autocast(device, dtype=torch.bfloat16):
    return torch.autocast(device, dtype=dtype)


def _fp32_pair(device, **kwargs):
    """An fp32 layer, its twin and an fp32 input: mixed precision, as under torch.autocast."""
    torch.manual_seed(0)
    layer = tpfp8.Linear(64, 32, device=device, **kwargs)
    return layer, copy.deepcopy(layer), _input(device).detach().float().requires_grad_()


@pytest.mark.parametrize("dtypes", ["fp32 layer, fp32 input", "fp32 layer, bf16 input",
                                    "bf16 layer, fp32 input"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", ["delayed", "current", "high precision"])
def test_templated_steps_under_torch_autocast_equal_the_slow_path(device, recipe, bias, dtypes):
    """torch.autocast's conversions (input and bias; the weight too in high precision), as
    the slow path makes them, and the same gradients back through them."""
    layer_dtype, input_dtype = (getattr(torch, "float32" if d.startswith("fp32") else "bfloat16")
                                for d in dtypes.split(", "))
    torch.manual_seed(0)
    layer = tpfp8.Linear(64, 32, bias=bias, device=device, dtype=layer_dtype)
    twin = copy.deepcopy(layer)
    x = _input(device).detach().to(input_dtype).requires_grad_()
    kwargs = {"recipe": RECIPES.get(recipe), "fp8": recipe in RECIPES,
              "context": _autocast(device)}
    for _ in range(4):
        _same(layer, twin, x, **kwargs)


def test_the_template_takes_autocast_calls_and_returns_the_converted_bias(device):
    layer, twin, x = _fp32_pair(device, return_bias=True)
    _same(layer, twin, x, context=_autocast(device))
    with mock.patch.object(tpfp8.Linear, "_begin", side_effect=AssertionError("slow path")):
        for _ in range(2):
            _step(layer, x, context=_autocast(device))
            with tpfp8.fp8_autocast(), _autocast(device):
                y, bias = layer(x)
    assert y.dtype == bias.dtype == torch.bfloat16
    assert torch.equal(bias, layer.bias.to(torch.bfloat16)) and bias.requires_grad


def test_autocast_switched_between_calls(device):
    """On, off, another dtype, on again: each call computes as the slow path does."""
    layer, twin, x = _fp32_pair(device)
    for dtype in (torch.bfloat16, None, torch.float16, torch.bfloat16, None):
        context = _nothing() if dtype is None else _autocast(device, dtype)
        for _ in range(2):
            _same(layer, twin, x, context=context)


def _gradient_order(layer, x, return_bias, context):
    """The order in which a step's gradients reach x and the layer's parameters."""
    order = []
    x = x.detach().requires_grad_()
    leaves = {"x": x, **dict(layer.named_parameters())}
    handles = [t.register_post_accumulate_grad_hook(lambda _, n=n: order.append(n))
               for n, t in leaves.items()]
    with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()), context:
        out = layer(x)
    y, bias = out if return_bias else (out, None)
    loss = y.float().square().sum() + (bias.float().sum() if return_bias else 0)
    loss.backward()
    for h in handles:
        h.remove()
    for p in layer.parameters():
        p.grad = None
    return order


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("return_bias", [False, True])
def test_gradients_arrive_in_the_slow_paths_order(device, return_bias, autocast):
    """A templated call builds the slow path's autograd graph, in its order: gradient hooks
    (and DDP's buckets) see the gradients in the same order."""
    layer, twin, x = _fp32_pair(device, return_bias=return_bias)
    for _ in range(3):
        context = _autocast(device) if autocast else _nothing()
        mine = _gradient_order(layer, x, return_bias, context)
        with SlowPath():
            theirs = _gradient_order(twin, x, return_bias, context)
        assert mine == theirs


class _Marked(torch.Tensor):
    pass


class _MarkedParameter(nn.Parameter):
    """A parameter whose conversions (Tensor.to) come back as _Marked tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out.as_subclass(_Marked) if func is torch.Tensor.to else out


def test_a_returned_bias_is_converted_by_its_own_torch_function(device):
    layer, twin, x = _fp32_pair(device, return_bias=True)
    _same(layer, twin, x, context=_autocast(device))
    _on_both(layer, twin, lambda m: setattr(m, "bias", _MarkedParameter(m.bias.detach())))
    for _ in range(2):
        with tpfp8.fp8_autocast(), _autocast(device):
            mine = layer(x)[1]
            with SlowPath():
                theirs = twin(x)[1]
        assert type(mine) is type(theirs) is _Marked and torch.equal(mine, theirs)


def test_debug_rules_set_between_calls_apply(device, tmp_path):
    layer, twin = _pair(device, name="fc1")
    x = _input(device)
    _same(layer, twin, x)
    _same(layer, twin, x)
    rule = {"layers": "fc1", "features": {"disable_fp8_gemm": {"gemms": ["fprop"]}}}
    tpfp8.debug.initialize([rule])
    try:
        _same(layer, twin, x)
        _same(layer, twin, x)
    finally:
        tpfp8.debug.shutdown()
    _same(layer, twin, x)


def test_the_template_holds_no_tensor(device):
    """A replaced weight is freed, and torch.utils.swap_tensors (which refuses tensors that
    something else holds) works on a templated layer's weight."""
    layer, _ = _pair(device)
    x = _input(device)
    for _ in range(2):
        _step(layer, x)
    old = weakref.ref(layer.weight)
    _replace_weight(layer)
    gc.collect()
    assert old() is None
    _step(layer, x)
    _step(layer, x)
    other = nn.Parameter(torch.zeros_like(layer.weight))
    torch.utils.swap_tensors(layer.weight, other)
    assert layer.weight.abs().sum() == 0


def test_a_refused_call_leaves_the_layer_untouched(device):
    layer, twin = _pair(device)
    x = _input(device)
    _same(layer, twin, x)
    _same(layer, twin, x)
    before = [b.clone() for b in layer.buffers() if b is not None]
    with tpfp8.fp8_autocast():
        with pytest.raises(ValueError):
            layer(torch.randn(16, 48, device=device, **BF16))
    after = [b for b in layer.buffers() if b is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    _same(layer, twin, x)


def test_copies_and_pickles_of_a_templated_layer(device):
    layer, twin = _pair(device)
    x = _input(device)
    _same(layer, twin, x)
    _same(layer, twin, x)
    for copied in (copy.deepcopy(layer), _pickled(layer)):
        twin_copy = copy.deepcopy(twin)
        for _ in range(2):
            _same(copied, twin_copy, x)


def _pickled(layer):
    import io
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_thread_outside_fp8_autocast_computes_in_high_precision(device):
    """Frames are per thread: while this thread is inside fp8_autocast, another thread's call
    of the same templated layer is in high precision, and registers nothing here."""
    layer, twin = _pair(device)
    x = _input(device)
    _same(layer, twin, x)
    _same(layer, twin, x)
    out = []
    with tpfp8.fp8_autocast():
        layer(x)
        thread = threading.Thread(target=lambda: out.append(layer(x.detach())))
        thread.start()
        thread.join()
    with SlowPath():
        with tpfp8.fp8_autocast():
            twin(x)
        assert torch.equal(out[0], twin(x.detach()))
    _same(layer, twin, x)
