"""The benchmarks still run: each bench/ script on the CPU at its smallest size, one
repetition, writing its JSON where it writes one. Their timings mean nothing here; a script
broken by a change of the API it calls fails in CI instead of on the GPU machine, where device
time is short. (gemm.py and sm_share.py need a GPU and refuse the CPU by design.)"""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = ["--reps", "1"]
# script, its arguments, the JSON it writes (None: prints only)
RUNS = [
    ("cast.py", ["--shapes", "64x64", *ONE], "cast.json"),
    ("linear.py", ["--shapes", "32x32x32", "--rounds", "1", *ONE], "linear.json"),
    ("debug_overhead.py", ["--shapes", "32x32x32", *ONE], "debug_overhead.json"),
    ("norm_cast.py", ["--quick"], "norm_cast.json"),
    ("activation_cast.py", ["--quick"], "activation_cast.json"),
    ("compile.py", ["--shapes", "32x64", "--rounds", "1", "--warmup", "1", "--cases",
                    "tpfp8 fused delayed eager", *ONE], "compile.json"),
    ("block.py", ["--sizes", "tiny", "--batch", "1", "--seq", "16", "--rounds", "1", "--warmup",
                  "1", "--cases", "tpfp8 fused delayed eager", *ONE], "block.json"),
    ("tp.py", ONE, "tp_bytes.json"),
    ("soak.py", ["--steps", "3", "--every", "2", "--hidden", "32", "--tokens", "16"],
     "soak.json"),
    ("host_time.py", ["--size", "32"], None),
    ("drift.py", ["--shape", "16x32", "--seconds", "1"], "drift.json"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CI's smoke test of the benchmarks (220 s "
                    "on the GPU machine, whose device time is short): run them there for real")
@pytest.mark.parametrize("script,args,written", RUNS, ids=[r[0] for r in RUNS])
def test_benchmark_runs_on_the_cpu(script, args, written, tmp_path):
    out = ["--out", str(tmp_path)] if written else []
    run = subprocess.run([sys.executable, os.path.join("bench", script), "--device", "cpu",
                          *args, *out], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    if written:
        with open(tmp_path / written) as f:
            assert json.load(f), f"{written} is empty"
