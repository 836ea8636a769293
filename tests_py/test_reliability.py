"""Faults a demanding user hits, each a test that failed before its fix: a NaN/Inf step, a
rejected call, double backward, two threads, inference_mode state, a resumed checkpoint with
other settings, the meta device, debug statistics, and attributes changed after a step.
Numerics tests run on every device there is (the `device` fixture: CPU, and CUDA on a GPU)."""
import gc
import math
import threading
import weakref

import pytest
import torch
from torch import nn

import tpfp8
from conftest import make


def saved_state(lin):
    """The module's FP8 state as saved in a checkpoint: {direction: {name: tensor}, "recipe":
    DelayedScaling}, or None (no delayed-scaling step yet)."""
    extra = lin.state_dict()["_extra_state"]
    if extra.numel() == 0:
        return None
    state, recipe = tpfp8.scaling.from_tensor(extra, extra.device)
    return {**tpfp8.scaling.split(*state), "recipe": recipe}


def fp8_state(lin):
    """The saved FP8 state's tensors: {direction: {name: tensor}}."""
    return {d: v for d, v in saved_state(lin).items() if d != "recipe"}


def everything(lin):
    """Every piece of a module's state a rejected call must leave alone, as comparable values."""
    fp8 = fp8_state(lin) if saved_state(lin) is not None else None
    main_grad = getattr(lin.weight, "main_grad", None)
    return (fp8, None if main_grad is None else main_grad.clone(),
            lin.state_dict()["weight"].clone())


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


# ---- 1. a NaN or Inf step never becomes a scale -------------------------------------

def steps(lin, device, bad=None, bad_value=float("nan"), n=50, recipe=None):
    """A step at 1x then `n` steps at 16x; `bad` ("input", "weight", "gradient") inserts a step
    whose tensor holds `bad_value` right after the first."""
    recipe = recipe or tpfp8.DelayedScaling()
    torch.manual_seed(1)
    data = [(torch.randn(16, 32, device=device) * (1 if i == 0 else 16),
             torch.randn(16, 32, device=device)) for i in range(n + 1)]

    def step(x, dy):
        x = x.clone().requires_grad_(True)
        with tpfp8.fp8_autocast(recipe=recipe):
            y = lin(x)
        y.backward(dy)

    for i, (x, dy) in enumerate(data):
        step(x, dy)
        if i == 0 and bad is not None:
            x, dy = x.clone(), dy.clone()
            saved = lin.weight.detach().clone()
            target = {"input": x, "gradient": dy}.get(bad)
            with torch.no_grad():
                (lin.weight if bad == "weight" else target)[0, 0] = bad_value
            step(x, dy)
            with torch.no_grad():
                lin.weight.copy_(saved)
    return fp8_state(lin)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("bad", ["input", "weight", "gradient"])
def test_a_bad_step_is_dropped_as_if_it_had_not_run(device, bad, bad_value):
    """The bad tensor's scale and history after the run equal those of the run without the
    bad step, bit for bit; before, a NaN froze the scale for amax_history_len steps."""
    clean = steps(tpfp8.Linear(32, 32, device=device), device)
    dirty = steps(tpfp8.Linear(32, 32, device=device), device, bad, bad_value)
    direction, col = {"input": ("forward", 0), "weight": ("forward", 1),
                      "gradient": ("backward", 0)}[bad]
    for key in ("scale", "scale_inv"):
        assert torch.equal(dirty[direction][key][col], clean[direction][key][col]), key
    assert torch.equal(dirty[direction]["amax_history"][:, col],
                       clean[direction]["amax_history"][:, col])
    assert bool(torch.isfinite(dirty[direction]["amax_history"]).all())
    if bad == "input":  # the case: the scale follows the 16x steps (~121 -> ~9)
        assert float(dirty["forward"]["scale"][0]) < 20


def test_nan_step_with_most_recent_keeps_the_last_good_scale(device):
    recipe = tpfp8.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")
    clean = steps(tpfp8.Linear(32, 32, device=device), device, n=3, recipe=recipe)
    dirty = steps(tpfp8.Linear(32, 32, device=device), device, "input", n=3, recipe=recipe)
    assert same(dirty["forward"]["scale"][0], clean["forward"]["scale"][0])


# ---- 2. a rejected call changes nothing ---------------------------------------------

def test_rejected_call_leaves_no_unfilled_weight_cache(device):
    lin = tpfp8.Linear(32, 32, fuse_wgrad_accumulation=True, device=device)
    lin.weight.main_grad = torch.zeros(32, 32, dtype=torch.bfloat16, device=device)  # wrong
    x = torch.randn(8, 32, device=device)
    with tpfp8.fp8_autocast(), pytest.raises(ValueError, match="main_grad as float32"):
        lin(x, is_first_microbatch=True)
    lin.weight.main_grad = torch.zeros(32, 32, device=device)
    with tpfp8.fp8_autocast(), pytest.raises(ValueError, match="is_first_microbatch=True"):
        lin(x, is_first_microbatch=False)  # no cache was made: refused, not uninitialised
    with tpfp8.fp8_autocast():
        first = lin(x, is_first_microbatch=True)
        second = lin(x, is_first_microbatch=False)
    assert bool(torch.isfinite(second).all()) and torch.equal(first, second)


@pytest.mark.parametrize("recipe", [tpfp8.DelayedScaling(), tpfp8.CurrentScaling()],
                         ids=["delayed", "current"])
def test_rejected_size_check_allocates_no_main_grad(recipe):
    lin = tpfp8.Linear(24, 48, fuse_wgrad_accumulation=True)
    with tpfp8.fp8_autocast(recipe=recipe), pytest.raises(ValueError, match="multiples of 16"):
        lin(torch.randn(4, 24))
    assert getattr(lin.weight, "main_grad", None) is None
    assert saved_state(lin) is None


@pytest.mark.parametrize("bad_main_grad", ["shape", "strided"])
@pytest.mark.parametrize("history_len", [1024, 16])
def test_rejected_call_keeps_fp8_state_cache_and_main_grad(history_len, bad_main_grad):
    """After real steps, a call rejected in C++ (main_grad of the wrong shape, or strided: the
    GEMM writes it in place, and it was refused only in backward, after the gradient's amax)
    under the same or another recipe leaves scales, histories, the recipe, the weight cache and
    main_grad."""
    lin = tpfp8.Linear(32, 32, fuse_wgrad_accumulation=True)
    x = torch.randn(8, 32)
    for first in (True, False):
        with tpfp8.fp8_autocast():
            lin(x, is_first_microbatch=first).sum().backward()
    with tpfp8.fp8_autocast():
        want = lin(x, is_first_microbatch=False)  # the same input: folds the same amax
    before = everything(lin)
    good_main_grad = lin.weight.main_grad
    lin.weight.main_grad = torch.zeros(16, 32) if bad_main_grad == "shape" else \
        torch.zeros(32, 32).t()
    with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=history_len)):
        with pytest.raises(ValueError, match="main_grad"):
            lin(x, is_first_microbatch=True)
    lin.weight.main_grad = good_main_grad
    assert same(everything(lin), before)
    assert saved_state(lin)["recipe"].amax_history_len == 1024
    with tpfp8.fp8_autocast():
        got = lin(x, is_first_microbatch=False)  # the cache from the real steps, still filled
    assert torch.equal(got, want)


@pytest.mark.parametrize("fused", [tpfp8.MLP, tpfp8.LayerNormMLP])
def test_an_mlp_call_its_fc2_rejects_leaves_fc1_untouched(fused):
    """The MLP op checks both layers before fc1 runs: a call whose fc2 is refused (its main_grad
    of the wrong dtype) folded fc1's input amax before, and fc1's next scale came out 1000x
    smaller (the rejected input's), silently."""
    def steps(reject):
        torch.manual_seed(0)
        m = fused(32, 32, fuse_wgrad_accumulation=True)
        x = torch.randn(4, 32)
        with tpfp8.fp8_autocast():
            m(x).sum().backward()
        if reject:
            good, before = m.fc2.weight.main_grad, (everything(m.fc1), everything(m.fc2))
            m.fc2.weight.main_grad = torch.zeros(32, 32, dtype=torch.bfloat16)
            with tpfp8.fp8_autocast(), pytest.raises(ValueError, match="main_grad"):
                m(x * 1000)
            m.fc2.weight.main_grad = good
            assert same((everything(m.fc1), everything(m.fc2)), before)
        with tpfp8.fp8_autocast():
            m(x).sum().backward()
        return everything(m.fc1), everything(m.fc2)
    assert same(steps(reject=True), steps(reject=False))


def test_an_mlp_whose_fc2_cannot_run_in_fp8_is_refused_before_fc1_casts():
    m = tpfp8.LayerNormMLP(32, 8, activation="swiglu")  # fc1 32 -> 16, fc2 8 -> 32
    with tpfp8.fp8_autocast(), pytest.raises(ValueError, match="multiples of 16, got 8"):
        m(torch.randn(4, 32))
    assert not m.fc1.fp8_amax_history.any()


@pytest.mark.parametrize("fp8", [False, True])
def test_a_strided_bias_works_as_in_nn_linear(device, fp8):
    """A bias that is a view of a larger tensor (a slice of a packed parameter), which
    nn.Linear takes: the result of a contiguous copy, where it was refused after the casts."""
    # (bf16: an FP8 GEMM writing bf16 takes the bias in its epilogue, the path that refused it)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    x, dy = torch.randn(8, 32, **bf16), torch.randn(8, 16, **bf16)
    runs = []
    for strided in (False, True):
        torch.manual_seed(0)
        lin = tpfp8.Linear(32, 16, **bf16)
        packed = torch.randn(16, 2, **bf16)
        lin.bias = nn.Parameter(packed[:, 0] if strided else packed[:, 0].contiguous())
        with tpfp8.fp8_autocast(enabled=fp8):
            y = lin(x)
        y.backward(dy)
        runs.append((y, lin.weight.grad, lin.bias.grad))
    assert same(runs[0], runs[1])


# ---- 3. double backward -------------------------------------------------------------

@pytest.mark.parametrize("shape", [(8, 32), (2, 4, 32)])
def test_double_backward_in_high_precision_matches_nn_linear(shape):
    torch.manual_seed(0)
    lin = tpfp8.Linear(32, 16)
    ref = nn.Linear(32, 16)
    ref.load_state_dict(lin.state_dict(), strict=False)
    x = torch.randn(*shape)
    grads = []
    for module in (lin, ref):
        xi = x.clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(module(xi).pow(2).sum(), xi, create_graph=True)
        assert dx.requires_grad
        penalty = dx.pow(2).sum()
        grads.append(torch.autograd.grad(penalty, [xi, module.weight, module.bias]))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_double_backward_with_fused_wgrad_raises_clearly():
    lin = tpfp8.Linear(32, 16, fuse_wgrad_accumulation=True)
    x = torch.randn(8, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="without fuse_wgrad_accumulation"):
        torch.autograd.grad(lin(x).pow(2).sum(), x, create_graph=True)


def test_double_backward_in_fp8_raises_clearly():
    lin = tpfp8.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
        y = lin(x)
    with pytest.raises(RuntimeError, match="double backward .* only in high precision"):
        torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)


# ---- 4. concurrent backward passes --------------------------------------------------

def test_two_threads_each_update_their_own_layers(device):
    """Two threads train their own layers at once -- a small one many quick steps while a
    large one's backward passes are long -- and each ends exactly where it ends alone. (With
    one global queue, the small layer's updates waited in the large one's pass and merged:
    updates were lost.)"""
    sizes = [(32, 16, 200), (256, 512, 8)]  # (features, tokens, steps) of each thread

    def make(i):  # here, not in the threads: initialisation draws from the global RNG
        torch.manual_seed(3)
        return tpfp8.Linear(sizes[i][0], sizes[i][0], device=device)

    def train(i, lin, barrier=None):
        features, tokens, steps = sizes[i]
        gen = torch.Generator(device=device).manual_seed(i)
        if barrier is not None:
            barrier.wait()
        for _ in range(steps):
            x = torch.randn(tokens, features, device=device, generator=gen, requires_grad=True)
            dy = torch.randn(tokens, features, device=device, generator=gen) * (i + 1)
            with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=4)):
                y = lin(x)
            y.backward(dy)
        return fp8_state(lin), x.grad

    alone = [train(i, make(i)) for i in range(2)]
    layers, together = [make(i) for i in range(2)], [None, None]
    barrier = threading.Barrier(2)

    def worker(i):
        together[i] = train(i, layers[i], barrier)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert same(together[i], alone[i]), f"thread {i}"


def test_a_failed_backward_leaves_nothing_queued():
    """A backward pass that raises drops its end-of-pass callback: its queued updates must
    not keep the layer's state alive (a retry loop would grow memory)."""
    lin = tpfp8.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)

    def fail(grad):
        raise RuntimeError("hook failure")

    x.register_hook(fail)
    with tpfp8.fp8_autocast():
        y = lin(x)
    with pytest.raises(RuntimeError, match="hook failure"):
        y.sum().backward()
    state = weakref.ref(lin.fp8_grad_amax_history)
    del lin, y
    gc.collect()
    assert state() is None


# ---- 5. state made under inference_mode ---------------------------------------------

def test_fp8_state_made_under_inference_mode_reloads_and_trains(device):
    lin = tpfp8.Linear(32, 32, device=device)
    with torch.inference_mode(), tpfp8.fp8_autocast():
        lin(torch.randn(8, 32, device=device))
    saved = lin.state_dict()
    fresh = tpfp8.Linear(32, 32, device=device)
    fresh.load_state_dict(saved)
    lin.load_state_dict(saved)  # into the state made under inference_mode
    x = torch.randn(8, 32, device=device, requires_grad=True)
    for module in (lin, fresh):
        with tpfp8.fp8_autocast():
            module(x).sum().backward()
    assert same(fp8_state(lin), fp8_state(fresh))


# ---- 6. another amax_history_len resizes, never discards ----------------------------

def test_other_history_length_keeps_newest_entries_and_scales():
    lin = tpfp8.Linear(32, 32)
    for i in range(6):
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=8)):
            lin(torch.randn(8, 32) * (i + 1))
    before = fp8_state(lin)["forward"]
    for length in (4, 16):
        twin = tpfp8.Linear(32, 32)
        twin.load_state_dict(lin.state_dict())
        x = torch.randn(8, 32)
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=length)):
            twin(x)
        after = fp8_state(twin)["forward"]
        history = after["amax_history"]
        assert history.shape == (length, 2)
        # Resized to the newest min(length, 8) rows, then rolled once: row 1 is this step's.
        n = min(length - 1, 8)
        assert torch.equal(history[2:n + 1], before["amax_history"][1:n])
        assert not history[n + 1:].any() and not history[0].any()
        assert float(history[1, 0]) == float(x.abs().max())
        # The new scale comes from the kept history (and the step), not from scratch.
        want = torch.tensor(448.0) / history[:, 0].max()
        assert float(after["scale"][0]) == float(want)


def test_resumed_checkpoint_with_other_history_length_casts_with_its_scales():
    """The first step after a resume with another amax_history_len uses the saved scale (it
    used 1 before): its output equals the output of the run that was not interrupted."""
    torch.manual_seed(0)
    lin = tpfp8.Linear(32, 32)
    for _ in range(3):
        with tpfp8.fp8_autocast():
            lin(torch.randn(8, 32) * 50)
    resumed = tpfp8.Linear(32, 32)
    resumed.load_state_dict(lin.state_dict())
    x = torch.randn(8, 32) * 50
    with tpfp8.fp8_autocast():
        want = lin(x)
    with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=32)):
        got = resumed(x)
    assert torch.equal(got, want)


def test_other_format_rescales_the_gradient_scale():
    lin = tpfp8.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    with tpfp8.fp8_autocast():
        lin(x).sum().backward()
    hybrid = fp8_state(lin)["backward"]["scale"]
    with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(fp8_format="e4m3")):
        lin(x)
    e4m3 = fp8_state(lin)["backward"]["scale"]
    assert float(e4m3[0]) == float(hybrid[0] * (448.0 / 57344.0))


# ---- 7. recipe values, the meta device ----------------------------------------------

@pytest.mark.parametrize("eps", [float("inf"), float("nan"), -1.0, None, "0", True])
def test_current_scaling_refuses_an_unusable_epsilon(eps):
    with pytest.raises(ValueError, match="amax_epsilon must be a finite number"):
        tpfp8.CurrentScaling(amax_epsilon=eps)


def test_numpy_numbers_are_numbers():
    np = pytest.importorskip("numpy")
    assert tpfp8.CurrentScaling(amax_epsilon=np.float32(1e-6)).amax_epsilon > 0
    layer = tpfp8.LayerNormLinear(32, 16, eps=np.float32(1e-5))
    with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling(amax_epsilon=np.float64(1e-6))):
        assert torch.isfinite(layer(torch.randn(4, 32))).all()


@pytest.mark.parametrize("field, value", [("amax_history_len", True), ("margin", False),
                                          ("amax_history_len", 16.0), ("margin", "1")])
def test_delayed_scaling_takes_ints_not_bools(field, value):
    """True is an int to Python (a history of 1), not a length to a user: refused."""
    with pytest.raises(ValueError, match=f"{field} must be"):
        tpfp8.DelayedScaling(**{field: value})


def test_an_amax_group_that_is_no_process_group_is_refused_on_entry():
    """It was found at the block's exit, after the forwards, as an AttributeError."""
    layer = tpfp8.Linear(16, 16)
    with pytest.raises(TypeError, match="amax_group must be a torch.distributed ProcessGroup"):
        with tpfp8.fp8_autocast(amax_group="tp"):
            layer(torch.randn(2, 16))
    assert layer.fp8_state is None


@pytest.mark.parametrize("fp8", [False, True])
def test_meta_device_works_like_nn_linear(fp8):
    lin = tpfp8.Linear(32, 48, device="meta")
    ref = nn.Linear(32, 48, device="meta")
    x = torch.randn(2, 4, 32, device="meta", requires_grad=True)
    with tpfp8.fp8_autocast(enabled=fp8):
        y = lin(x)
    want = ref(x)
    assert (y.shape, y.dtype, y.device) == (want.shape, want.dtype, want.device)
    y.sum().backward()
    assert x.grad.shape == x.shape and lin.weight.grad.shape == lin.weight.shape
    assert saved_state(lin) is None  # a shape pass makes no FP8 state


def test_deferred_initialisation_then_fp8_training():
    with torch.device("meta"):
        model = nn.Sequential(tpfp8.Linear(32, 64), nn.GELU(), tpfp8.Linear(64, 16))
    model(torch.randn(4, 32, device="meta"))
    model.to_empty(device="cpu")
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    with tpfp8.fp8_autocast():
        y = model(torch.randn(4, 32))
    y.sum().backward()
    assert bool(torch.isfinite(y).all()) and model[0].weight.grad is not None


# ---- 8. debug statistics count what the cast clipped --------------------------------

@pytest.mark.parametrize("value", [1.0, 3.0, 0.1, 7.0])
def test_current_scaling_clips_nothing(value, tmp_path):
    """A constant tensor's amax element is scaled to fp8_max within fp32 rounding: 0 %."""
    tpfp8.debug.initialize([{"layers": "fc", "features": {
        "log_stats": {"tensors": ["activation"], "gemms": ["fprop"]}}}])
    try:
        lin = tpfp8.Linear(32, 32, name="fc")
        with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
            lin(torch.full((8, 32), value))
        (record,) = tpfp8.debug.records()
    finally:
        tpfp8.debug.shutdown()
    assert record["overflow_pct"] == 0.0


def test_delayed_scaling_counts_the_values_clipped():
    """Scale from a step at amax 1; the next step's 4 outliers (of 256) are clipped, values
    within rounding of 448 are not."""
    lin = tpfp8.Linear(32, 32, name="fc")
    with tpfp8.fp8_autocast():
        lin(torch.full((8, 32), 1.0))
    x = torch.full((8, 32), 0.5)
    x[0, :4] = 2.0                       # 896 after scaling: clipped to 448
    x[1, 0] = 464.0 / 448.0              # 464: the tie rounds down to 448, not clipped
    x[1, 1] = 1.0                        # 448 exactly
    tpfp8.debug.initialize([{"layers": "fc", "features": {
        "log_stats": {"tensors": ["activation"], "gemms": ["fprop"]}}}])
    try:
        with tpfp8.fp8_autocast():
            lin(x)
        (record,) = tpfp8.debug.records()
    finally:
        tpfp8.debug.shutdown()
    assert record["overflow_pct"] == 100.0 * 4 / 256


def unbounded_rne(v: float, mantissa_bits: int) -> float:
    """`v` > 0 rounded to nearest even on a grid of `mantissa_bits` without an upper bound
    (float64 arithmetic, independent of the library)."""
    step = 2.0 ** (math.floor(math.log2(v)) - mantissa_bits)
    q = v / step
    down = math.floor(q)
    up = down + 1
    pick = up if q - down > 0.5 or (q - down == 0.5 and down % 2) else down
    return pick * step


@pytest.mark.parametrize("fmt,mantissa_bits", [(tpfp8.Fp8Format.E4M3, 3),
                                               (tpfp8.Fp8Format.E5M2, 2)])
def test_clipped_is_what_rounding_would_put_above_max(fmt, mantissa_bits):
    """Fp8Format.clipped agrees with an independent unbounded rounding around the threshold,
    and (E5M2) with torch's own float8 cast, which gives inf exactly there."""
    values = []
    for centre in (fmt.max, fmt.max * (1 + 2.0 ** -(mantissa_bits + 1))):
        c = torch.tensor(centre, dtype=torch.float32)
        below, above = c.clone(), c.clone()
        for _ in range(3):
            below = torch.nextafter(below, torch.tensor(0.0))
            above = torch.nextafter(above, torch.tensor(1e30))
            values += [below.item(), above.item()]
        values.append(centre)
    x = torch.tensor(values, dtype=torch.float32)
    want = [unbounded_rne(v, mantissa_bits) > fmt.max for v in x.double().tolist()]
    assert fmt.clipped(x).tolist() == want
    assert fmt.clipped(-x).tolist() == want
    if fmt is tpfp8.Fp8Format.E5M2:
        assert fmt.clipped(x).tolist() == torch.isinf(x.to(torch.float8_e5m2).float()).tolist()
    assert not fmt.clipped(torch.tensor([float("nan")])).item()


# ---- 10. attributes changed after a step take effect or are refused -----------------

def test_turning_off_wgrad_fusion_after_a_step_takes_effect():
    lin = tpfp8.Linear(32, 32, fuse_wgrad_accumulation=True)
    x = torch.randn(8, 32)
    for _ in range(2):
        with tpfp8.fp8_autocast():
            lin(x).sum().backward()
    main_grad = lin.weight.main_grad.clone()
    assert lin.weight.grad is None
    lin.fuse_wgrad_accumulation = False
    with tpfp8.fp8_autocast():
        lin(x).sum().backward()
    assert torch.equal(lin.weight.main_grad, main_grad)
    assert lin.weight.grad is not None


def test_turning_on_save_original_input_after_a_step_takes_effect():
    lin = tpfp8.Linear(32, 32)
    recipe = tpfp8.CurrentScaling()
    with tpfp8.fp8_autocast(recipe=recipe):
        lin(torch.randn(8, 32))
    lin.save_original_input = True
    with tpfp8.fp8_autocast(), pytest.raises(ValueError, match="cannot be used with delayed"):
        lin(torch.randn(8, 32))


@pytest.mark.parametrize("name,value", [("parallel_mode", "column"), ("in_features", 64),
                                        ("sequence_parallel", True), ("out_features", 16)])
def test_layout_attributes_are_refused_after_construction(name, value):
    lin = tpfp8.Linear(32, 32)
    with pytest.raises(AttributeError, match=f"Linear.{name} is fixed"):
        setattr(lin, name, value)
    setattr(lin, name, getattr(lin, name))  # the same value is fine


# ---- state replaced by a debugged call or a reload -----------------------------------

def test_prepared_options_follow_state_a_debugged_call_replaced():
    """A debugged call (which prepares its own options) with another history length replaces
    the FP8 state; the next plain call must cast with the new state, not options prepared for
    the old one (its scale froze)."""
    def run(debugged):
        torch.manual_seed(0)
        lin = tpfp8.Linear(32, 32, name="fc")
        x = torch.randn(8, 32)
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=8)):
            lin(x)
        if debugged:
            tpfp8.debug.initialize([{"layers": "fc", "features": {"log_stats": {}}}])
        try:
            with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=4)):
                lin(x)
        finally:
            tpfp8.debug.shutdown()
        for _ in range(3):
            with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=8)):
                lin(x * 100)
        return fp8_state(lin)

    assert same(run(True), run(False))


def test_reload_writes_into_the_live_state_tensors():
    """Loading a checkpoint of the same layout writes into the tensors the module already
    updates (a captured CUDA graph keeps updating those)."""
    lin = tpfp8.Linear(32, 32)
    with tpfp8.fp8_autocast():
        lin(torch.randn(8, 32))
    saved, saved_scale = lin.state_dict(), lin.fp8_scale.clone()
    live = lin.fp8_scale
    with tpfp8.fp8_autocast():
        lin(torch.randn(8, 32) * 100)
    assert not torch.equal(live, saved_scale)
    lin.load_state_dict(saved)
    assert lin.fp8_scale is live and torch.equal(live, saved_scale)


# ---- state made with the layer: initialisation paths, moves, argument checks --------------

def test_uninitialised_construction_gets_fresh_fp8_state():
    """skip_init / meta + to_empty leave the parameters to a checkpoint; the FP8 state of a
    layer that has run no FP8 step is made fresh on the new device, never left as garbage."""
    plain = nn.Linear(32, 32)
    lin = torch.nn.utils.skip_init(tpfp8.Linear, 32, 32)
    lin.load_state_dict(plain.state_dict())
    assert torch.equal(lin.fp8_scale, torch.ones(3)) and not lin.fp8_amax_history.any()
    with torch.device("meta"):
        deferred = tpfp8.Linear(32, 32)
    deferred.load_state_dict(plain.state_dict(), assign=True)  # the buffers stay on "meta"
    x = torch.randn(4, 32)
    with tpfp8.fp8_autocast():
        y, want = deferred(x), lin(x)
    assert torch.equal(y, want) and deferred.fp8_scale.device.type == "cpu"


def test_fp8_state_loads_into_a_layer_on_meta_and_bad_headers_are_refused():
    """A trained layer's FP8 state loads into one built on "meta" (the header is read where
    the checkpoint lies); a damaged header is a clear error that leaves the layer as it was."""
    lin, _ = make(seed=40)
    with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling(amax_history_len=8)):
        lin(torch.randn(4, 32)).sum().backward()
    saved = lin.state_dict()
    with torch.device("meta"):
        deferred = tpfp8.Linear(32, 48)
    deferred.load_state_dict(saved, assign=True)
    assert deferred.fp8_state["recipe"] == lin.fp8_state["recipe"]
    other, _ = make(seed=41)
    before = {name: t.clone() for name, t in other.state_dict().items()}
    for position, value in ((2, 7.0), (4, -1.0), (3, 0.0)):  # format, algorithm, length codes
        bad = dict(saved)
        bad["_extra_state"] = saved["_extra_state"].clone()
        bad["_extra_state"][position] = value
        with pytest.raises(ValueError, match="bad header"):
            other.load_state_dict(bad)
        after = other.state_dict()  # (its weights too: the header is read before them)
        assert all(torch.equal(after[name], before[name]) for name in before)
    # In a model the error names the layer's entry; so does load_fp8_state's.
    model = torch.nn.Sequential(torch.nn.GELU(), other)
    bad = {f"1.{k}": v for k, v in saved.items()}
    bad["1._extra_state"] = saved["_extra_state"][:-1]
    with pytest.raises(ValueError, match=r"^1\._extra_state: .* values, expected"):
        model.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"^1\._extra_state: .* values, expected"):
        tpfp8.load_fp8_state(model, bad)


@pytest.mark.parametrize("fused", [False, True], ids=["Linear", "LayerNormMLP"])
def test_an_empty_saved_fp8_state_leaves_a_trained_layer_with_none(fused):
    """A checkpoint saved before the first delayed-scaling step (or under current scaling) has
    no FP8 state: loaded into a layer that has some, the layer is as the saved one was (its old
    scales were kept, and its steps differed from the saved model's)."""
    def make_layer():
        torch.manual_seed(0)
        return tpfp8.LayerNormMLP(32, 64) if fused else tpfp8.Linear(32, 48)
    empty = make_layer().state_dict()
    warm, cold = make_layer(), make_layer()
    with tpfp8.fp8_autocast():
        warm(torch.randn(16, 32) * 100).sum().backward()
    warm.load_state_dict(empty)
    cold.load_state_dict(empty)
    assert warm.state_dict().keys() == empty.keys()
    assert all(torch.equal(t, empty[k]) for k, t in warm.state_dict().items())
    assert tpfp8.load_fp8_state(warm, empty) == 0
    x = torch.randn(16, 32)
    with tpfp8.fp8_autocast():
        assert torch.equal(warm(x), cold(x))


def test_an_old_style_state_whose_shapes_disagree_is_refused():
    """The dict of checkpoints written before the tensor layout is checked as the tensor is:
    histories of 16 under a recipe of 1024 were taken, and the layer's own next checkpoint was
    unreadable."""
    lin = tpfp8.Linear(32, 32)
    with tpfp8.fp8_autocast():
        lin(torch.randn(8, 32)).sum().backward()
    before = {k: t.clone() for k, t in lin.state_dict().items()}
    old_style = {"recipe": tpfp8.DelayedScaling(),
                 "forward": {"scale": torch.ones(2), "scale_inv": torch.ones(2),
                             "amax_history": torch.zeros(16, 2)},
                 "backward": {"scale": torch.ones(1), "scale_inv": torch.ones(1),
                              "amax_history": torch.zeros(16, 1)}}
    with pytest.raises(ValueError, match="amax_history_len=1024"):
        lin.load_state_dict({**before, "_extra_state": old_style})
    assert all(torch.equal(t, before[k]) for k, t in lin.state_dict().items())


def test_moves_that_swap_parameters_keep_main_grad():
    lin = tpfp8.Linear(32, 32, fuse_wgrad_accumulation=True)
    lin.weight.main_grad = torch.full((32, 32), 2.0)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        lin.to(torch.bfloat16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert torch.equal(lin.weight.main_grad, torch.full((32, 32), 2.0))


def test_fp8_weight_of_another_dtype_is_refused_before_any_amax():
    lin = tpfp8.Linear(32, 32, dtype=torch.float64)
    with tpfp8.fp8_autocast(), pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        lin(torch.randn(4, 32))
    assert not lin.fp8_amax_history.any()


def test_weight_cache_arguments_are_checked_not_trusted():
    """The op is public: a weight-cache mode without its buffers is a ValueError, not a crash."""
    x, w = torch.randn(4, 32), torch.randn(32, 32)
    plain = (None,) * 8
    for scaling in (0, 2):
        with pytest.raises(ValueError, match="weight cache"):
            torch.ops.tpfp8.linear(x, w, None, *plain, scaling, 0, 1, 0.0, 1, False, 0, False,
                                   "", [], False, True, True, True)
    rowwise = torch.empty(32, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="weight cache"):
        torch.ops.tpfp8.linear(x, w, None, None, None, None, None, rowwise, None, None, None,
                               2, 0, 1, 0.0, 2, False, 0, False, "", [], False, True, True, True)
