"""torch.compile sees tpfp8.Linear whole: a model of them inside fp8_autocast traces with no
graph break (torch._dynamo.explain) for every configuration, and the compiled model equals
eager bit for bit -- outputs, gradients, main_grad and the FP8 state -- step after step.
(Tensor parallelism: tp_worker.py's compiled_matches_eager, on gloo ranks.)"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpfp8
from conftest import state_of


class Block(nn.Module):
    """fc1 -> GELU -> fc2, passing is_first_microbatch on (as Megatron's layers do)."""

    def __init__(self, **kw):
        super().__init__()
        self.fc1 = tpfp8.Linear(32, 64, name="fc1", **kw)
        self.fc2 = tpfp8.Linear(64, 32, name="fc2", **kw)

    def forward(self, x, is_first_microbatch=None):
        h = F.gelu(self.fc1(x, is_first_microbatch=is_first_microbatch))
        return self.fc2(h, is_first_microbatch=is_first_microbatch)


DELAYED, CURRENT = tpfp8.DelayedScaling(), tpfp8.CurrentScaling()
# name: (recipe, Linear options, per-step is_first_microbatch, debug rules)
CONFIGS = {
    "high precision": (None, {}, None, None),
    "delayed": (DELAYED, {}, None, None),
    "current": (CURRENT, {}, None, None),
    "delayed weight cache": (DELAYED, {}, (True, False, False), None),
    "current weight cache": (CURRENT, {}, (True, False, True), None),
    "delayed main_grad": (DELAYED, {"fuse_wgrad_accumulation": True}, (True, False, False),
                          None),
    "current main_grad": (CURRENT, {"fuse_wgrad_accumulation": True}, None, None),
    "current save_original_input": (CURRENT, {"save_original_input": True}, None, None),
    "delayed debug": (DELAYED, {}, None, {"log_stats": {}, "disable_fp8_gemm": {
        "gemms": ["dgrad"]}}),
    "current debug fake_quant": (CURRENT, {}, None, {"fake_quant": {
        "tensors": ["weight"], "format": "e5m2"}}),
}


def make(options, device):
    torch.manual_seed(0)
    return with_main_grad(Block(device=device, **options))


def with_main_grad(block):
    """Made outside the graph (see the error test), also for a copy (deepcopy drops it)."""
    for layer in block.modules():
        if isinstance(layer, tpfp8.Linear) and layer.fuse_wgrad_accumulation:
            layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    return block


def compiled_twin(eager, **options):
    """A copy of `eager` and its torch.compile (fullgraph; aot_eager unless told), afresh."""
    torch._dynamo.reset()
    model = with_main_grad(copy.deepcopy(eager))
    return model, torch.compile(model, fullgraph=True, **{"backend": "aot_eager", **options})


def assert_one_graph(eager, x, recipe, first):
    """torch._dynamo.explain of a copy of `eager` (fullgraph's view): one graph, no break."""
    with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        explained = torch._dynamo.explain(with_main_grad(copy.deepcopy(eager)))(x, first)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, \
        explained.break_reasons


def step(model, x, recipe, first=None):
    """One training step; returns what it computed and the model's state after it."""
    x = x.clone().requires_grad_(True)
    with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x) if first is None else model(x, first)
    y.square().sum().backward()
    state = [y.detach(), x.grad]
    for p in model.parameters():
        state += [p.grad, getattr(p, "main_grad", None)]
        p.grad = None
    return state + [b.clone() for b in model.buffers()]


@pytest.fixture
def debug_rules(request):
    yield
    tpfp8.debug.shutdown()


@pytest.mark.parametrize("name", CONFIGS)
def test_compiled_equals_eager_with_no_graph_break(device, name, debug_rules):
    recipe, options, firsts, debug = CONFIGS[name]
    if debug:
        tpfp8.debug.initialize([{"layers": "fc", "features": debug}])
    eager = make(options, device)
    _, compiled = compiled_twin(eager)
    x = torch.randn(16, 32, device=device)
    assert_one_graph(eager, x, recipe, firsts and firsts[0])
    for i in range(3):
        first = firsts and firsts[i]
        before = len(tpfp8.debug.records())
        got = step(compiled, x * (i + 1), recipe, first)
        middle = len(tpfp8.debug.records())
        want = step(eager, x * (i + 1), recipe, first)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b), f"step {i}"
        records = tpfp8.debug.records()
        # Debug reports: the same from the compiled step as from the eager one.
        assert records[before:middle] == records[middle:]
        assert (middle > before) == bool(debug and "log_stats" in debug)
        tpfp8.debug.step()


def two_layers(device):
    torch.manual_seed(0)
    return nn.Sequential(tpfp8.Linear(32, 64, device=device),
                         tpfp8.Linear(64, 32, device=device))


def test_inductor_compiles_our_layers_bit_for_bit(device):
    """The default backend (inductor) around our ops changes none of their results. (Two
    layers back to back: an activation between them would be inductor's own kernel, whose
    rounding may differ from eager's.)"""
    eager = two_layers(device)
    _, compiled = compiled_twin(eager, backend="inductor")
    x = torch.randn(16, 32, device=device)
    for i in range(3):
        got, want = step(compiled, x, DELAYED), step(eager, x, DELAYED)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b), f"step {i}"


@pytest.mark.parametrize("bad", ["residual dtype", "residual rows"])
def test_a_call_the_compiled_mlp_refuses_changes_no_state(bad):
    """A call fc2 would refuse fails when it is traced, as eager's does before fc1 runs: with
    its sequence length symbolic, the compiled LayerNormMLP used to run fc1's op, which wrote
    its amaxes into the FP8 state (inductor writes the buffer in place), and only then fail."""
    torch.manual_seed(0)
    mlp = tpfp8.LayerNormMLP(32, 32, normalization="RMSNorm", activation="swiglu")
    torch._dynamo.reset()
    compiled = torch.compile(mlp, fullgraph=True, backend="inductor")

    def call(tokens, residual_rows, dtype=torch.float32):
        x = torch.randn(tokens, 2, 32, requires_grad=True)
        with tpfp8.fp8_autocast(recipe=DELAYED):
            return compiled(x, residual=torch.randn(residual_rows, 2, 32).to(dtype))
    for tokens in (4, 6):  # (the second call makes the token count symbolic)
        call(tokens, tokens).sum().backward()
    before = [t.clone() for t in state_of(mlp.fc1)]
    with pytest.raises(Exception, match="residual"):
        call(8, 8, torch.bfloat16) if bad == "residual dtype" else call(8, 4)
    for a, b in zip(state_of(mlp.fc1), before, strict=True):
        assert torch.equal(a, b)
    call(10, 10).sum().backward()  # a good call of another length still runs


def fused_mlp(device):
    torch.manual_seed(0)
    return tpfp8.LayerNormMLP(32, 64, activation="swiglu", device=device)


@pytest.mark.parametrize("factory", [two_layers, fused_mlp], ids=["linears", "LayerNormMLP"])
def test_a_second_model_runs_no_graph_traced_for_the_first(device, factory):
    """Models of the same classes share torch.compile's graphs. The graph of the first model's
    later steps (its FP8 state made) must not run the second model's first step, whose state
    is not made yet: that step equals eager's, state included."""
    eager = factory(device)
    _, first = compiled_twin(eager)
    x = torch.randn(16, 32, device=device)
    for _ in range(2):
        step(first, x, DELAYED)
    second = torch.compile(copy.deepcopy(eager), fullgraph=True, backend="aot_eager")
    recipe = tpfp8.DelayedScaling()  # another object, as when a loop makes one per step
    for i in range(2):
        got, want = step(second, x, recipe), step(eager, x, recipe)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b), f"step {i}"


def test_missing_main_grad_is_a_clear_error_under_compile():
    torch._dynamo.reset()
    block = Block(fuse_wgrad_accumulation=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="needs weight.main_grad to exist before a compiled"):
        with tpfp8.fp8_autocast(recipe=CURRENT):
            compiled(torch.randn(4, 32))


def test_another_history_length_under_compile_then_equals_eager():
    """A recipe whose history length differs from the layer's state remakes the state inside
    the graph; after that first step (its gradient amax is not recorded there), compiled and
    eager steps agree again bit for bit."""
    recipe = tpfp8.DelayedScaling(amax_history_len=16)
    eager = make({}, "cpu")
    model, compiled = compiled_twin(eager)
    x = torch.randn(16, 32)
    step(compiled, x, recipe)
    step(eager, x, recipe)
    assert model.fc1.fp8_amax_history.shape == (2, 16)
    assert not model.fc1.fp8_grad_amax_history.any()  # the one difference: not recorded
    with torch.no_grad():
        for layer, twin in ((model.fc1, eager.fc1), (model.fc2, eager.fc2)):
            layer.fp8_grad_amax_history.copy_(twin.fp8_grad_amax_history)
    for i in range(2):
        for a, b in zip(step(compiled, x, recipe), step(eager, x, recipe)):
            assert (a is None and b is None) or torch.equal(a, b), f"step {i}"


@pytest.mark.skipif(not (torch.cuda.is_available() and tpfp8.with_cuda()),
                    reason="CUDA graphs need a GPU and tpfp8's CUDA build")
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_reduce_overhead_trains_like_eager(recipe):
    """mode="reduce-overhead" (CUDA graphs): the updates run at fp8_autocast's exit, outside
    the graphs, so replayed steps train exactly as eager ones, delayed scaling included (our
    layers back to back: inductor adds no kernel of its own)."""
    eager = two_layers("cuda")
    _, compiled = compiled_twin(eager, backend="inductor", mode="reduce-overhead")
    x = torch.randn(16, 32, device="cuda")
    for i in range(6):  # recorded, then replayed
        torch.compiler.cudagraph_mark_step_begin()
        got, want = step(compiled, x * (i + 1), recipe), step(eager, x * (i + 1), recipe)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b), f"step {i}"


def test_a_changed_setting_takes_effect_in_the_compiled_model():
    """A layer's config is one frozen value baked into the graph; setting an attribute makes a
    new one, and the compiled model retraces: gradients go to main_grad from then on."""
    eager = make({}, "cpu")
    model, compiled = compiled_twin(eager)
    x = torch.randn(16, 32)
    step(compiled, x, CURRENT)
    step(eager, x, CURRENT)
    for block in (model, eager):
        block.fc1.fuse_wgrad_accumulation = True
        with_main_grad(block)
    assert model.fc1.config.fuse_wgrad_accumulation
    got, want = step(compiled, x, CURRENT), step(eager, x, CURRENT)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    weight_grad, main_grad = got[2:4]  # fc1.weight's (step() lists y, dx, then per parameter)
    assert weight_grad is None and bool(main_grad.any())


def test_debug_steps_reuse_their_graphs(debug_rules):
    """Debug options are worked out per step outside the graph: a rule active every other step
    gives two graphs, reused, not one per step (which would hit dynamo's recompile limit)."""
    from torch._dynamo.utils import counters
    tpfp8.debug.initialize([{"layers": "fc1", "freq": 2, "features": {
        "disable_fp8_gemm": {"gemms": ["wgrad"]}}}])
    eager = make({}, "cpu")
    _, compiled = compiled_twin(eager)
    counters.clear()
    x = torch.randn(16, 32)
    for i in range(6):
        for a, b in zip(step(compiled, x, CURRENT), step(eager, x, CURRENT)):
            assert (a is None and b is None) or torch.equal(a, b), f"step {i}"
        tpfp8.debug.step()
    assert counters["stats"]["unique_graphs"] == 2
