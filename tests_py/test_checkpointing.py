"""Activation checkpointing of tpfp8 layers (torch.utils.checkpoint reentrant and not, nested,
tpfp8.checkpoint): a recompute repeats the forward it recomputes, so gradients and FP8 state
equal those of the same steps without checkpointing, bit for bit, whatever order forwards,
evaluations and backward passes run in; what it cannot repeat it refuses clearly."""
import copy
import functools
import gc
import pickle
from contextlib import nullcontext

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import tpfp8
from conftest import make, state_of

DELAYED, CURRENT = tpfp8.DelayedScaling(amax_history_len=4), tpfp8.CurrentScaling()


CHECKPOINT_VARIANTS = ["plain", "nested", "fp8_autocast inside", "backward twice",
                       "backward in fp8_autocast"]


CHECKPOINTS = {
    "tpfp8.checkpoint": tpfp8.checkpoint,
    "torch non-reentrant": functools.partial(torch.utils.checkpoint.checkpoint,
                                             use_reentrant=False),
    "torch reentrant": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True),
}


def check_checkpoint_matches_plain_steps(recipe, variant, device="cpu",
                                         checkpoint=tpfp8.checkpoint):
    """An activation checkpoint of a block: outputs, gradients and the FP8 state after each
    of 3 steps equal those of the same steps without checkpointing, bit for bit (delayed
    scaling: the recompute casts with the first forward's scales, folds no amax, updates
    nothing), wherever backward runs."""
    def block(seed):
        torch.manual_seed(seed)
        return nn.Sequential(tpfp8.Linear(32, 64), nn.GELU(), tpfp8.Linear(64, 16)).to(device)

    def fp8():
        return tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe)

    def forward(model, x, ckpt):
        if variant == "fp8_autocast inside":  # the block opens it; checkpointed from outside
            def inner(v):
                with fp8():
                    return model(v)
            return checkpoint(inner, x) if ckpt else inner(x)
        with fp8():
            if not ckpt:
                return model(x)
            if variant == "nested":
                return checkpoint(lambda v: model[2](model[1](checkpoint(model[0], v))), x)
            return checkpoint(model, x)

    plain, ckpt = block(21), block(21)
    for step in range(3):
        torch.manual_seed(100 + step)
        x, dy = torch.randn(8, 32, device=device), torch.randn(8, 16, device=device)
        results = []
        for model, use_ckpt in ((plain, False), (ckpt, True)):
            xg = x.clone().requires_grad_(True)
            model.zero_grad(set_to_none=True)
            y = forward(model, xg, use_ckpt)
            twice = variant == "backward twice"
            with tpfp8.fp8_autocast() if variant == "backward in fp8_autocast" else nullcontext():
                y.backward(dy, retain_graph=twice)
                if twice:
                    y.backward(dy)
            results.append([y.detach(), xg.grad] + [p.grad for p in model.parameters()]
                           + [t for layer in (model[0], model[2]) for t in state_of(layer)])
        for a, b in zip(*results):
            assert torch.equal(a, b), f"step {step}"


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("variant", CHECKPOINT_VARIANTS)
@pytest.mark.parametrize("recipe", [None, tpfp8.DelayedScaling(amax_history_len=4),
                                    tpfp8.CurrentScaling()],
                         ids=["high precision", "delayed", "current"])
def test_checkpoint_matches_plain_steps(device, recipe, variant, checkpoint):
    check_checkpoint_matches_plain_steps(recipe, variant, device, CHECKPOINTS[checkpoint])


@pytest.mark.parametrize("checkpoint", ["torch non-reentrant", "torch reentrant"])
def test_checkpoint_started_late_with_evaluations_between(checkpoint):
    """Steps without checkpointing first, then with it, and evaluation forwards (no grad,
    inside fp8_autocast: they update the state too) between steps: each step's gradients and
    FP8 state equal those of the same steps never checkpointed, bit for bit."""
    recipe = tpfp8.DelayedScaling(amax_history_len=4)
    models = [make(seed=24)[0], make(seed=24)[0]]
    for step in range(5):
        torch.manual_seed(300 + step)
        x, dy, probe = torch.randn(8, 32), torch.randn(8, 48), torch.randn(4, 32)
        results = []
        for lin, ckpt in zip(models, (False, step >= 2)):
            lin.zero_grad(set_to_none=True)
            with torch.no_grad(), tpfp8.fp8_autocast(recipe=recipe):
                lin(probe)
            xg = x.clone().requires_grad_(True)
            with tpfp8.fp8_autocast(recipe=recipe):
                y = CHECKPOINTS[checkpoint](lin, xg) if ckpt else lin(xg)
            y.backward(dy)
            results.append([y.detach(), xg.grad, lin.weight.grad] + state_of(lin))
        for a, b in zip(*results):
            assert torch.equal(a, b), f"step {step}"


def test_recompute_of_a_forward_two_updates_back_is_refused():
    """Two micro-batches in flight, each in its own fp8_autocast (a pipeline schedule): the
    first one's recompute comes after two updates, its scales are gone -- a clear error."""
    lin, _ = make(seed=25)
    outputs = []
    for _ in range(2):
        with tpfp8.fp8_autocast():
            outputs.append(torch.utils.checkpoint.checkpoint(
                lin, torch.randn(4, 32, requires_grad=True), use_reentrant=False))
    with pytest.raises(RuntimeError, match="after 2 delayed-scaling updates"):
        outputs[0].sum().backward()


def test_recompute_after_two_updates_is_refused():
    """A checkpointed block whose backward runs after two fp8_autocast exits (its scales are
    gone): a clear error, not a silently different gradient."""
    lin, _ = make(seed=23)
    x = torch.randn(4, 32, requires_grad=True)
    with tpfp8.fp8_autocast():
        y = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False)
    with tpfp8.fp8_autocast():
        lin(torch.randn(4, 32))
    with pytest.raises(RuntimeError, match="after 2 delayed-scaling updates"):
        y.sum().backward()




def grads_and_state(lin, *inputs):
    return [x.grad for x in inputs] + [p.grad for p in lin.parameters()] + state_of(lin)


def assert_same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"item {i}"


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_checkpointed_forward_never_backpropagated_leaves_nothing_behind(checkpoint):
    """A checkpointed forward whose backward never runs (a skipped step, an output dropped):
    its record goes with its graph, and the steps after it train as without checkpointing."""
    models = [make(seed=27)[0], make(seed=27)[0]]
    results = [[], []]
    for step in range(4):
        torch.manual_seed(400 + step)
        x = torch.randn(8, 32)
        for i, (lin, ckpt) in enumerate(zip(models, (False, True))):
            lin.zero_grad(set_to_none=True)
            xg = x.clone().requires_grad_(True)
            with tpfp8.fp8_autocast(recipe=DELAYED):
                y = CHECKPOINTS[checkpoint](lin, xg) if ckpt else lin(xg)
            if step != 1:  # step 1 is skipped after its forward
                y.sum().backward()
                results[i].append(grads_and_state(lin, xg))
            del y
    gc.collect()
    for a, b in zip(*results):
        assert_same(a, b)


def run_in_flight(lin, checkpoint, events):
    """Forwards of micro-batches, each in its own fp8_autocast (its recipe), and evaluation
    forwards between; then the backward passes in the order given. Returns every gradient and
    the FP8 state."""
    torch.manual_seed(500)
    inputs, outputs = [], []
    for recipe in events["forwards"]:
        x = torch.randn(8, 32, requires_grad=True)
        fp8 = tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe)
        with fp8:
            outputs.append(checkpoint(lin, x) if checkpoint else lin(x))
        inputs.append(x)
        with torch.no_grad(), tpfp8.fp8_autocast(recipe=CURRENT):  # an evaluation between
            lin(torch.randn(4, 32))
    for i in events["backward order"]:
        outputs[i].sum().backward()
    return grads_and_state(lin, *inputs)


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("events", [
    {"forwards": [CURRENT, None, DELAYED], "backward order": [2, 0, 1]},
    {"forwards": [DELAYED, CURRENT], "backward order": [1, 0]},
    {"forwards": [None, CURRENT, tpfp8.CurrentScaling(fp8_format="e4m3")],
     "backward order": [0, 2, 1]},
], ids=["current-hp-delayed", "delayed-current", "hp-current-current"])
def test_micro_batches_in_flight_recompute_their_own_forwards(checkpoint, events):
    """Micro-batches in flight under different recipes (and high precision), with evaluation
    forwards between, backward in another order: each recompute repeats its own forward."""
    want = run_in_flight(make(seed=28)[0], None, events)
    got = run_in_flight(make(seed=28)[0], CHECKPOINTS[checkpoint], events)
    assert_same(got, want)


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_layer_run_twice_in_a_block_and_in_two_blocks(checkpoint, recipe):
    """A layer run twice inside one checkpointed block (shared weights), and the same layer in
    two checkpointed blocks of one step under different recipes: each of its recomputes
    repeats the matching forward."""
    def step(lin, ckpt):
        torch.manual_seed(600)
        x1, x2 = torch.randn(8, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)
        block = lambda v: lin(torch.relu(lin(v)))  # noqa: E731
        with tpfp8.fp8_autocast(recipe=recipe):
            y1 = ckpt(block, x1) if ckpt else block(x1)
        with tpfp8.fp8_autocast(recipe=CURRENT if recipe is DELAYED else DELAYED):
            y2 = ckpt(lin, x2) if ckpt else lin(x2)
        (y1.sum() + y2.square().sum()).backward()
        return [x1.grad, x2.grad] + state_of(lin), list(lin.parameters())

    got, got_params = step(make(32, 32, seed=29)[0], CHECKPOINTS[checkpoint])
    want, want_params = step(make(32, 32, seed=29)[0], None)
    assert_same(got, want)
    for p, q in zip(got_params, want_params):
        if checkpoint == "torch reentrant":  # its inner backward adds the three parts of a
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)  # in another order
        else:
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("outer,inner", [("torch reentrant", "torch non-reentrant"),
                                         ("torch non-reentrant", "torch reentrant")])
def test_nested_checkpoints_of_both_kinds(outer, inner):
    """A reentrant checkpoint inside a non-reentrant one and the other way round: the inner
    recompute, made again by the outer one, repeats the first forward too."""
    def step(model, ckpt):
        torch.manual_seed(700)
        x = torch.randn(8, 32, requires_grad=True)
        block = lambda v: model[2](model[1](CHECKPOINTS[inner](model[0], v)))  # noqa: E731
        with tpfp8.fp8_autocast(recipe=DELAYED):
            y = CHECKPOINTS[outer](block, x) if ckpt else model(x)
        y.sum().backward()  # after the exit: the recomputes cast with the scales before it
        return grads_and_state(model[0], x) + grads_and_state(model[2])

    def model():
        torch.manual_seed(30)
        return nn.Sequential(tpfp8.Linear(32, 64), nn.GELU(), tpfp8.Linear(64, 16))

    for _ in range(2):
        assert_same(step(model(), True), step(model(), False))


def test_forward_from_a_backward_hook():
    """A layer called from a backward hook: in high precision by a layer that never ran in FP8
    it is a plain forward; in FP8 tpfp8 cannot tell it from a recompute it cannot match, so a
    clear error that leaves the state as it was."""
    for recipe in (None, DELAYED, CURRENT):
        lin, twin = make(seed=31)[0], make(seed=31)[0]
        probe = torch.randn(4, 32)
        got = []

        def hook(grad):
            with tpfp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
                got.append(lin(probe))
            return grad
        x = torch.randn(4, 32, requires_grad=True)
        x.register_hook(hook)
        if recipe is None:
            (x * 2).sum().backward()
            assert torch.equal(got[0], twin(probe))
            continue
        before = state_of(lin)
        with pytest.raises(RuntimeError, match="cannot tell which FP8 forward"):
            (x * 2).sum().backward()
        assert_same(state_of(lin), before)


class HomeMadeCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint written with setup_context (its forward has no ctx)."""

    @staticmethod
    def forward(fn, x):
        return fn(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.fn = inputs[0]
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            y = ctx.fn(x)
        torch.autograd.backward(y, dy)
        return None, x.grad


def without_output(fn, x):
    """A checkpoint that recomputes from a tensor hook (as Megatron's CheckpointWithoutOutput):
    the forward runs without grad, its recompute runs when the output's gradient arrives."""
    with torch.no_grad():
        y = fn(x)
    y = y.detach().requires_grad_(True)
    carrier = y * 1.0  # the graph below y's gradient

    def recompute(dy):
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            torch.autograd.backward(fn(xd), dy)
        x.grad = xd.grad if x.grad is None else x.grad + xd.grad
        return dy
    y.register_hook(recompute)
    return carrier


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_reentrant_checkpoint_far_above_the_layer(recipe):
    """A reentrant checkpoint 30 modules above the layer: backward after fp8_autocast's exit
    gives the gradients and state of the un-checkpointed step."""
    def step(ckpt):
        torch.manual_seed(800)
        lin = make(seed=33)[0]
        model = lin
        for _ in range(30):
            model = nn.Sequential(model)
        x = torch.randn(8, 32, requires_grad=True)
        with tpfp8.fp8_autocast(recipe=recipe):
            y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True) if ckpt \
                else model(x)
        y.square().sum().backward()
        return grads_and_state(lin, x)

    assert_same(step(True), step(False))


@pytest.mark.parametrize("checkpoint", ["setup_context", "without output"])
@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_checkpoints_that_cannot_be_matched_are_refused(checkpoint, recipe):
    """A Function with setup_context (no ctx in forward) and a checkpoint that recomputes from
    a tensor hook (as Megatron's CheckpointWithoutOutput) leave nothing that ties a recompute
    to its forward: in FP8 a clear error, not a guess."""
    lin = make(seed=33)[0]
    x = torch.randn(8, 32, requires_grad=True)
    with tpfp8.fp8_autocast(recipe=recipe):
        y = HomeMadeCheckpoint.apply(lin, x) if checkpoint == "setup_context" \
            else without_output(lin, x)
    with pytest.raises(RuntimeError, match="cannot tell which FP8 forward"):
        y.square().sum().backward()


def test_saved_tensor_hooks_disabled_with_hooks_in_place():
    """AOTAutograd disables saved-tensor hooks with the stack in place: a forward then leaves
    the hooks and their disabled state as they were."""
    lin, x = make(seed=35)[0], torch.randn(4, 32)
    autograd = torch._C._autograd
    with torch.autograd.graph.save_on_cpu():
        top = autograd._top_saved_tensors_default_hooks(False)
        autograd._saved_tensors_hooks_disable("hooks are off here", False)
        try:
            with torch.no_grad(), tpfp8.fp8_autocast():
                lin(x)
            assert not autograd._saved_tensors_hooks_is_enabled()
            assert autograd._saved_tensors_hooks_get_disabled_error_message() == \
                "hooks are off here"
        finally:
            autograd._saved_tensors_hooks_enable()
        assert autograd._top_saved_tensors_default_hooks(False) == top


def test_compiled_layer_under_an_eager_checkpoint():
    """torch.compile'd layer checkpointed from outside: the compiled code cannot see the
    recompute, so it is refused clearly (state untouched) -- except where it is the compiled
    forward again under the same guards: current scaling with backward under the forward's
    recipe repeats it exactly."""
    for reentrant, recipe, backward_in in ((False, DELAYED, True), (True, CURRENT, False),
                                           (True, DELAYED, False)):
        lin, _ = make(seed=32)
        compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
        x = torch.randn(8, 32, requires_grad=True)
        with tpfp8.fp8_autocast(recipe=recipe):
            y = torch.utils.checkpoint.checkpoint(compiled, x, use_reentrant=reentrant)
        before = state_of(lin)
        with (tpfp8.fp8_autocast(recipe=recipe) if backward_in else nullcontext()), \
                pytest.raises(RuntimeError, match="inside a backward pass"):
            y.sum().backward()
        assert_same(state_of(lin), before)
        torch._dynamo.reset()

    plain, _ = make(seed=32)
    results = []
    for layer, ckpt in ((plain, False), (lin, True)):
        layer.zero_grad(set_to_none=True)
        xg = x.detach().clone().requires_grad_(True)
        with tpfp8.fp8_autocast(recipe=CURRENT):
            fn = torch.compile(layer, backend="aot_eager", fullgraph=True)
            y = torch.utils.checkpoint.checkpoint(fn, xg, use_reentrant=False) if ckpt else fn(xg)
            y.sum().backward()
        results.append([xg.grad, layer.weight.grad, layer.bias.grad])
    assert_same(*results)


def test_pickle_and_deepcopy_after_a_recompute():
    """A layer that a checkpoint recomputed pickles and copies as any other; a pickle made by
    an earlier version (per-layer records of forwards) loads and trains."""
    lin, _ = make(seed=26)
    x = torch.randn(4, 32, requires_grad=True)
    with tpfp8.fp8_autocast():
        torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=True).sum().backward()
    twin = pickle.loads(pickle.dumps(copy.deepcopy(lin)))
    assert_same(state_of(twin), state_of(lin))
    state = lin.__getstate__()
    del state["_fp8_updates"]
    state.update(_fp8_ran=[], _fp8_ran_no_grad=None, _fp8_replayed=None)  # as pickled before
    old = tpfp8.Linear.__new__(tpfp8.Linear)
    old.__setstate__(state)
    assert not hasattr(old, "_fp8_ran")
    for layer in (twin, pickle.loads(pickle.dumps(old))):
        with tpfp8.fp8_autocast():
            torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()


@pytest.mark.parametrize("recipe,fullgraph", [(CURRENT, True), (DELAYED, False)],
                         ids=["current-fullgraph", "delayed-graph-breaks"])
def test_compiled_model_with_checkpoints_inside(recipe, fullgraph):
    """torch.compile of a model whose blocks call torch.utils.checkpoint: with current scaling
    the whole model compiles (its backward's recomputes were traced with the forward); delayed
    scaling's state updates are side effects torch's compiled checkpoint refuses, so it runs
    with fullgraph=False (torch runs each checkpoint eagerly). Both equal the plain model."""
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(36)
            self.a, self.b = tpfp8.Linear(32, 64), tpfp8.Linear(64, 32)

        def forward(self, x, ckpt=True):
            block = lambda v: self.b(torch.relu(self.a(v)))  # noqa: E731
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if ckpt \
                else block(x)

    results = []
    for compiled in (False, True):
        model = Blocks()
        fn = torch.compile(model, backend="aot_eager", fullgraph=fullgraph) if compiled \
            else functools.partial(model, ckpt=False)
        for step in range(2):
            torch.manual_seed(900 + step)
            x = torch.randn(8, 32, requires_grad=True)
            with tpfp8.fp8_autocast(recipe=recipe):
                y = fn(x)
            y.square().sum().backward()
        results.append([x.grad] + [p.grad for p in model.parameters()]
                       + state_of(model.a) + state_of(model.b))
    torch._dynamo.reset()
    assert_same(*results)
