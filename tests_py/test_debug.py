"""tpfp8.debug on one device: config errors, rule selection, disable_fp8_gemm, fake_quant and
statistics against a float64 emulation. The sequence-parallel seed case runs in tp_worker.py."""
import itertools
import json
import math

import numpy as np
import pytest
import torch

import tpfp8
from conftest import state_of
from fp8_oracle import current_scale, fake_quant

GEMMS = ("fprop", "dgrad", "wgrad")


@pytest.fixture(autouse=True)
def _debug_off():
    yield
    tpfp8.debug.shutdown()


def rel(a, b):
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).norm() / b.norm())


def fq(t, fmt):
    """Current-scaling fake quantization in float64 (independent of tpfp8)."""
    return fake_quant(t, current_scale(t, fmt), fmt)


def emulate(x, w, dy, high=(), fake=None):
    """y, dx, dW with the GEMMs in `high` (or fed a fake-quantized tensor) in high precision."""
    fake = fake or {}
    xd, wd, dyd = x.detach().double(), w.detach().double(), dy.double()
    q = {"activation": fq(x, "e4m3"), "weight": fq(w, "e4m3"), "gradient": fq(dy, "e5m2")}
    hp = {"activation": xd, "weight": wd, "gradient": dyd}
    for t, fmt in fake.items():
        hp[t] = fq(hp[t].float(), fmt)

    def pick(gemm, a, b):
        high_gemm = gemm in high or a in fake or b in fake
        src = hp if high_gemm else q
        return src[a], src[b]

    xa, wa = pick("fprop", "activation", "weight")
    ga, wb = pick("dgrad", "gradient", "weight")
    gb, xb = pick("wgrad", "gradient", "activation")
    return xa @ wa.T, ga @ wb, gb.T @ xb


def run(lin, x, dy):
    x = x.clone().requires_grad_(True)
    lin.weight.grad = None
    with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
        y = lin(x)
    y.backward(dy)
    return y.detach(), x.grad, lin.weight.grad


def layer(seed=0):
    torch.manual_seed(seed)
    return tpfp8.Linear(32, 48, bias=False, name="block.fc1")


@pytest.mark.parametrize("config,message", [
    ([{"layers": "fc", "features": {"log_stats": {}, "sparkle": {}}}], "unknown feature"),
    ([{"layers": "fc", "features": {"log_stats": {"tensors": ["bias"]}}}], "tensors"),
    ([{"layers": "fc", "features": {"disable_fp8_gemm": {"gemms": ["xgrad"]}}}], "gemms"),
    ([{"layers": "fc(", "features": {"log_stats": {}}}], "not a valid regex"),
    ([{"layers": "fc", "freq": 0, "features": {}}], "freq"),
    ([{"features": {}}], "'layers'"),
    ({"rule": []}, "list of rules"),
    # each below was taken, and showed later (a TypeError in a layer's forward) or never
    ([{"layers": "fc", "features": {"log_stats": {"tensor": ["weight"]}}}], "unknown setting"),
    ([{"layers": "fc", "freqq": 5, "features": {}}], r"unknown key\(s\) \['freqq'\]"),
    ([{"layers": "fc", "end_step": "5", "features": {}}], "end_step must be an int"),
    ([{"layers": "fc", "freq": 2.5, "features": {}}], "freq must be an int"),
    ([{"layers": "fc", "start_step": 5, "end_step": 2, "features": {}}], "never apply"),
    ([{"layers": "fc", "features": {"log_stats": {"tensors": ["weight"], "gemms": ["wgrad"]}}}],
     "logs nothing"),
    ([{"layers": "fc", "features": ["log_stats"]}], "'features' is a dict"),
    ([{"layers": "fc", "features": {"log_stats": ["weight"]}}], "settings of log_stats"),
])
def test_bad_configs_fail_at_initialize(config, message):
    with pytest.raises(ValueError, match=message):
        tpfp8.debug.initialize(config)


def test_a_log_dir_that_cannot_be_made_leaves_the_rules_as_they_were(tmp_path):
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    tpfp8.debug.initialize([{"layers": "fc1", "features": {"log_stats": {}}}])
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(FileExistsError):
        tpfp8.debug.initialize([{"layers": "fc1", "features": {"disable_fp8_gemm": {
            "gemms": ["fprop"]}}}], log_dir=str(tmp_path / "taken"))
    run(layer(), x, dy)
    assert len(tpfp8.debug.records()) == 6  # the first config's rule, still active


def test_no_matching_rule_is_the_normal_path():
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    plain = run(layer(), x, dy)
    tpfp8.debug.initialize([{"layers": "attention", "features": {"log_stats": {}}}])
    debugged = run(layer(), x, dy)
    assert tpfp8.debug.records() == []
    for a, b in zip(plain, debugged):
        assert torch.equal(a, b)


def test_log_stats_only_changes_nothing():
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    plain = run(layer(), x, dy)
    tpfp8.debug.initialize([{"layers": "fc1", "features": {"log_stats": {}}}])
    debugged = run(layer(), x, dy)
    assert len(tpfp8.debug.records()) == 6  # 3 GEMMs x 2 operands
    for a, b in zip(plain, debugged):
        assert torch.equal(a, b)


@pytest.mark.parametrize("high", [c for n in range(4) for c in itertools.combinations(GEMMS, n)],
                         ids=lambda c: "+".join(c) or "none")
def test_disable_fp8_gemm_runs_exactly_those_gemms_in_high_precision(high):
    tpfp8.debug.initialize([{"layers": "fc1",
                             "features": {"disable_fp8_gemm": {"gemms": list(high)}}}]
                           if high else [])
    lin = layer(1)
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    for got, want in zip(run(lin, x, dy), emulate(x, lin.weight, dy, high=high)):
        assert rel(got, want) <= 1e-5


@pytest.mark.parametrize("tensor,fmt", [("weight", "e5m2"), ("activation", "e4m3"),
                                        ("gradient", "e4m3")])
def test_fake_quant_is_quantize_dequantize_then_high_precision(tensor, fmt):
    tpfp8.debug.initialize([{"layers": "fc1", "features": {
        "fake_quant": {"tensors": [tensor], "format": fmt}}}])
    lin = layer(2)
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    for got, want in zip(run(lin, x, dy), emulate(x, lin.weight, dy, fake={tensor: fmt})):
        assert rel(got, want) <= 1e-5


def fp64_stats(t):
    t = torch.as_tensor(t).double()
    return {"amax": t.abs().max(), "min": t.min(), "max": t.max(), "mean": t.mean(),
            "std": t.std(unbiased=False), "l1_norm": t.abs().sum(), "l2_norm": t.norm()}


def test_statistics_describe_what_each_gemm_consumed(tmp_path):
    tpfp8.debug.initialize([{"layers": "fc1", "features": {
        "log_stats": {"tensors": ["activation"], "gemms": ["fprop", "wgrad"]},
        "disable_fp8_gemm": {"gemms": ["wgrad"]}}}], log_dir=str(tmp_path))
    lin = layer(3)
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    x[0, 0] = 1e-7  # underflows to zero in E4M3 at this scale
    run(lin, x, dy)
    fprop, wgrad = tpfp8.debug.records()
    assert (fprop["gemm"], wgrad["gemm"]) == ("fprop", "wgrad")
    for rec, used in ((fprop, fq(x, "e4m3")), (wgrad, x)):  # FP8 codes vs high precision
        assert rec["shape"] == [16, 32]
        for key, want in fp64_stats(used).items():
            assert math.isclose(rec[key], float(want), rel_tol=1e-6), key
    scale = np.float32(448.0) / np.float32(x.abs().max())
    assert fprop["scale_inv"] == np.float32(1.0) / scale
    assert fprop["underflow_pct"] == pytest.approx(100.0 / 512)
    assert fprop["mse"] == pytest.approx(float(((fq(x, "e4m3") - x.double()) ** 2).mean()))
    assert "scale_inv" not in wgrad
    lines = (tmp_path / "tpfp8_debug_rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["gemm"] for line in lines] == ["fprop", "wgrad"]


ALL_LOGGED = [{"layers": "fc1", "features": {"log_stats": {}}}]


def test_a_failed_report_is_dropped_with_a_warning_and_changes_nothing(tmp_path):
    """A report that cannot be written (the log folder gone mid-run) used to raise out of
    the op after its delayed-scaling amax was recorded: a failed call that changed the next
    scale. The call now completes as with no rule, the report goes to records() alone, and a
    warning says why."""
    recipe = tpfp8.DelayedScaling(amax_history_len=4)
    logged, plain = layer(3), layer(3)
    plain.name = "unlogged"
    log_dir = tmp_path / "logs"
    tpfp8.debug.initialize(ALL_LOGGED, log_dir=str(log_dir))
    log_dir.rmdir()
    log_dir.write_text("a file where the folder was")
    x, dy = torch.randn(16, 32), torch.randn(16, 48)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        for lin in (logged, plain):
            with tpfp8.fp8_autocast(recipe=recipe):
                y = lin(x.clone().requires_grad_(True))
            y.backward(dy)
    assert len(tpfp8.debug.records()) == 6  # (each GEMM's two operands)
    for a, b in zip(state_of(logged), state_of(plain), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(logged.weight.grad, plain.weight.grad)


def test_a_layer_no_token_reached_reports_no_values():
    """Zero rows (an expert no token was routed to): the layer runs, and its reports say n 0
    with no minimum, maximum, mean or std (u.min() of nothing used to raise in the op)."""
    tpfp8.debug.initialize(ALL_LOGGED)
    y, dx, dw = run(layer(), torch.randn(0, 32), torch.randn(0, 48))
    assert y.shape == (0, 48) and torch.equal(dw, torch.zeros_like(dw))
    records = tpfp8.debug.records()
    assert {r["tensor"] for r in records if r["n"] == 0} == {"activation", "gradient"}
    for r in records:
        if r["n"] == 0:
            assert (r["min"], r["max"], r["mean"], r["std"], r["amax"]) == (None,) * 4 + (0.0,)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_layer_reports_each_gemm_once(use_reentrant):
    """A recomputed forward reports nothing again: each GEMM's operands once a step, as
    without checkpointing (the recompute used to repeat the forward's reports)."""
    tpfp8.debug.initialize(ALL_LOGGED)
    lin = layer()
    x = torch.randn(16, 32, requires_grad=True)
    with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
        y = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=use_reentrant)
    y.backward(torch.randn(16, 48))
    seen = [(r["gemm"], r["tensor"]) for r in tpfp8.debug.records()]
    assert sorted(seen) == [("dgrad", "gradient"), ("dgrad", "weight"), ("fprop", "activation"),
                            ("fprop", "weight"), ("wgrad", "activation"), ("wgrad", "gradient")]


def test_each_initialize_starts_its_log_file_anew(tmp_path):
    """Two sessions into one log folder: the file holds the last one's records only (it
    used to append, interleaving step numbers)."""
    for _ in range(2):
        tpfp8.debug.initialize(ALL_LOGGED, log_dir=str(tmp_path))
        run(layer(), torch.randn(16, 32), torch.randn(16, 48))
        tpfp8.debug.step()
        run(layer(), torch.randn(16, 32), torch.randn(16, 48))
    lines = (tmp_path / "tpfp8_debug_rank0.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == tpfp8.debug.records()
    assert len(lines) == 12


def test_rules_select_steps():
    tpfp8.debug.initialize([{"layers": "fc1", "start_step": 1, "end_step": 5, "freq": 2,
                             "features": {"log_stats": {"tensors": ["weight"],
                                                        "gemms": ["fprop"]}}}])
    lin = layer(4)
    for _ in range(7):
        with tpfp8.fp8_autocast(recipe=tpfp8.CurrentScaling()):
            lin(torch.randn(16, 32))
        tpfp8.debug.step()
    assert [r["step"] for r in tpfp8.debug.records()] == [1, 3, 5]


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_from_a_file(tmp_path, suffix):
    rule = {"layers": "fc1", "features": {"disable_fp8_gemm": {"gemms": ["fprop"]}}}
    path = tmp_path / f"debug{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"rules": [rule]}))
    else:
        yaml = pytest.importorskip("yaml", reason="PyYAML is installed by `make test`")
        path.write_text(yaml.safe_dump({"rules": [rule]}))
    tpfp8.debug.initialize(str(path))
    lin = layer(5)
    x, dy = torch.randn(8, 32), torch.randn(8, 48)
    y = run(lin, x, dy)[0]
    want = emulate(x, lin.weight, dy, high=("fprop",))[0]
    assert rel(y, want) <= 1e-5
