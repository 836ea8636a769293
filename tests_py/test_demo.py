"""The demo (the README's main command) on the CPU with a tiny decoder: both runs learn from the
same start, the FP8 run computes in FP8 and tracks high precision, the results are written,
and the tensor-parallel run (2 gloo ranks under torchrun) equals the single-rank one."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import tpfp8
from tpfp8 import demo
from conftest import package_root

TINY = ["--steps", "40", "--hidden", "32", "--ffn", "64", "--heads", "2", "--layers", "2",
        "--seq", "32", "--batch", "4", "--data-mb", "2"]


def tiny_args(*extra):
    return demo.resolve(demo.parse_args(TINY + list(extra)), cuda=False)


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    """The demo's two runs on one CPU rank: (summary, --out folder)."""
    out = tmp_path_factory.mktemp("demo")
    args = tiny_args("--out", str(out), "--tp", "1")
    summary = demo.run(args, None, torch.device("cpu"))
    return summary, out


def test_both_runs_learn_from_the_same_start(single_rank):
    summary, _ = single_rank
    hp, f8 = summary["hp_losses"], summary["fp8_losses"]
    assert len(hp) == len(f8) == 40
    assert all(math.isfinite(x) for x in hp + f8)
    assert f8[0] == pytest.approx(hp[0], rel=1e-2)  # same weights, same first batch
    assert hp[0] == pytest.approx(math.log(256), rel=0.05)  # untrained: about uniform
    for losses in (hp, f8):
        assert sum(losses[-4:]) / 4 < 0.75 * losses[0]
    assert abs(summary["gap"]) < 0.05
    assert summary["hp_tokens_per_s"] > 0 and summary["fp8_tokens_per_s"] > 0


def test_fp8_run_computes_in_fp8(single_rank):
    summary, _ = single_rank
    # 2 layers x (qkv, o, gate_up, down); delayed scaling made the state of each.
    assert summary["fp8_linears"] == summary["fp8_linears_with_state"] == 8


def test_fp8_copy_swaps_the_layers_but_not_the_lm_head():
    model = demo.build_model(tiny_args(), None, torch.device("cpu"))
    fp8 = demo.fp8_copy(model)
    assert type(fp8.lm_head) is nn.Linear
    assert isinstance(fp8.layers[1].mlp.down, tpfp8.Linear)
    assert not any(isinstance(m, tpfp8.Linear) for m in model.modules())
    for (name, a), (_, b) in zip(model.named_parameters(), fp8.named_parameters()):
        assert torch.equal(a, b), name


def test_results_are_written(single_rank):
    summary, out = single_rank
    written = json.loads((out / "demo.json").read_text())
    for key in ("hp_final", "fp8_final", "gap", "hp_tokens_per_s", "fp8_tokens_per_s",
                "speedup", "hp_losses", "fp8_losses", "fp8_linears", "args"):
        assert key in written, key
    assert written["gap"] == pytest.approx(summary["gap"])
    assert written["args"]["recipe"] == "delayed"


def test_batches_are_next_byte_windows():
    data = demo.stdlib_bytes(1)
    assert len(data) == 2**20 and torch.equal(data, demo.stdlib_bytes(1))
    args = tiny_args("--steps", "3")
    steps = list(demo.batches(data, args))
    assert len(steps) == 3
    inputs, targets = steps[0]
    assert inputs.shape == targets.shape == (32, 4) and inputs.dtype == torch.long
    assert torch.equal(inputs[1:], targets[:-1])
    again = next(demo.batches(data, args))
    assert torch.equal(again[0], inputs)


def test_tensor_parallel_run_matches_single_rank(single_rank, tmp_path):
    reference, _ = single_rank
    config = tmp_path / "debug.json"
    config.write_text(json.dumps([{"layers": r"layers\.0\.mlp\.gate_up", "freq": 10,
                                   "features": {"log_stats": {"tensors": ["activation"],
                                                              "gemms": ["fprop"]}}}]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root(), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="")  # (on the CPU as the single-rank run: the same math)
    cmd = [sys.executable, "-m", "tpfp8.demo", *TINY, "--tp", "2", "--out", str(tmp_path),
           "--debug-config", str(config)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "2 ranks (gloo" in out and "tokens/s" in out and "final loss" in out
    result = json.loads((tmp_path / "demo.json").read_text())
    # Same weights (each rank holds slices), same batches: the same losses up to rounding.
    assert result["hp_losses"] == pytest.approx(reference["hp_losses"], rel=1e-5)
    assert result["fp8_losses"] == pytest.approx(reference["fp8_losses"], rel=1e-3)
    assert result["fp8_linears_with_state"] == 8
    stats = (tmp_path / "tpfp8_debug_rank0.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in stats] == [0, 10, 20, 30]


def test_demo_help():
    env = dict(os.environ, PYTHONPATH=package_root())
    out = subprocess.run([sys.executable, "-m", "tpfp8.demo", "--help"], env=env,
                         capture_output=True, text=True, timeout=60).stdout
    for option in ("--steps", "--hidden", "--ffn", "--heads", "--layers", "--seq", "--batch",
                   "--lr", "--dtype", "--recipe", "--tp", "--data-mb", "--seed",
                   "--debug-config", "--out"):
        assert option in out
    assert "4096 on a GPU" in out


@pytest.fixture(scope="module")
def single_rank_fused(tmp_path_factory):
    """The --fused demo's two runs (20 steps) on one CPU rank."""
    out = tmp_path_factory.mktemp("demo_fused")
    return demo.run(tiny_args("--fused", "--steps", "20", "--tp", "1", "--out", str(out)), None,
                    torch.device("cpu"))


def test_fused_copy_computes_what_the_model_computes(single_rank_fused):
    """--fused: the same weights in RMSNormLinear / LayerNormMLP (gate_up regrouped): the
    same function in high precision (up to the norms' rounding), and it trains in FP8."""
    model = demo.build_model(tiny_args(), None, torch.device("cpu"))
    fused = demo.fused_copy(model)
    assert isinstance(fused.layers[0].attn.qkv, tpfp8.RMSNormLinear)
    assert isinstance(fused.layers[0].mlp, tpfp8.LayerNormMLP)
    tokens = torch.randint(0, 256, (32, 4))
    torch.testing.assert_close(fused(tokens), model(tokens), rtol=1e-4, atol=1e-5)
    summary = single_rank_fused
    assert abs(summary["gap"]) < 0.05 and summary["fp8_linears_with_state"] == 8


def test_fused_tensor_parallel_run_matches_single_rank(single_rank_fused, tmp_path):
    """--fused --tp 2: qkv's norm on each rank's rows then column-parallel, the MLP column
    fc1 -> row fc2, sequence parallel; the norm weights' gradients summed inside backward (the
    demo does not reduce them again): the single-rank run's losses."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root(), os.environ.get("PYTHONPATH", "")]), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "tpfp8.demo", *TINY, "--fused", "--steps", "20", "--tp", "2",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "demo.json").read_text())
    reference = single_rank_fused
    assert result["hp_losses"] == pytest.approx(reference["hp_losses"], rel=1e-5)
    assert result["fp8_losses"] == pytest.approx(reference["fp8_losses"], rel=1e-3)
    assert result["fp8_linears_with_state"] == 8
