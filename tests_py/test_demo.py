"""The demo (the README's main command) on CPU with tiny sizes: it trains both runs under
torchrun, the FP8 loss tracks the high-precision loss, and it writes its results."""
import json
import os
import subprocess
import sys

from conftest import package_root


def test_demo_runs_and_fp8_tracks_high_precision(tmp_path):
    config = tmp_path / "debug.json"
    config.write_text(json.dumps([{"layers": "fc1", "freq": 20, "features": {
        "log_stats": {"tensors": ["activation"], "gemms": ["fprop"]}}}]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root(), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tpfp8.demo", "--steps", "80", "--hidden", "32", "--seq", "16",
           "--batch", "4", "--tp", "2", "--out", str(tmp_path), "--debug-config", str(config)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    result = json.loads((tmp_path / "demo.json").read_text())
    assert abs(result["gap"]) <= 0.05, out[-2000:]
    assert result["fp8_final"] < 0.5 * 0.26  # both runs learned (initial loss ~0.26)
    assert "tokens/s" in out and "final loss" in out
    stats = (tmp_path / "tpfp8_debug_rank0.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in stats] == [0, 20, 40, 60]


def test_demo_help():
    env = dict(os.environ, PYTHONPATH=package_root())
    out = subprocess.run([sys.executable, "-m", "tpfp8.demo", "--help"], env=env,
                         capture_output=True, text=True, timeout=60).stdout
    for option in ("--steps", "--hidden", "--recipe", "--tp", "--debug-config"):
        assert option in out
