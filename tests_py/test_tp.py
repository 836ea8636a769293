"""Tensor parallelism: tests_py/tp_worker.py under torchrun, each of its checks reported as a
pytest case of its own (see the worker's docstring for what each rank checks). Each launch
runs once per session; the process group times out after 60 s, so a hang fails fast."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import gpu_skip_reason, package_root
from tp_worker import CASE_NAMES

HERE = os.path.dirname(os.path.abspath(__file__))
NO_GPU = gpu_skip_reason()
FEW_GPUS = torch.cuda.device_count() < 2

# name -> (ranks, environment, why it cannot run here or None)
LAUNCHES = {
    "cpu gloo x2": (2, {}, None),
    "cpu gloo x4": (4, {}, None),
    "cuda gloo x2 (one GPU shared)": (2, {"TP_DEVICE": "cuda", "TP_BACKEND": "gloo"}, NO_GPU),
    "cuda nccl x1": (1, {"TP_DEVICE": "cuda", "TP_BACKEND": "nccl"}, NO_GPU),
    "cuda nccl, a rank per GPU": (
        min(max(torch.cuda.device_count(), 2), 4), {"TP_DEVICE": "cuda", "TP_BACKEND": "nccl"},
        NO_GPU or (FEW_GPUS and "NCCL with several ranks needs several GPUs (one rank per GPU)")),
}


@functools.lru_cache(maxsize=None)
def launch(name, tmp_dir):
    """Runs the worker once for launch `name`: (every rank's results by case, output tail)."""
    nproc, env, _ = LAUNCHES[name]
    path = os.path.join(tmp_dir, name.replace(" ", "_").replace(",", "") + ".json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(HERE, "tp_worker.py")]
    full_env = dict(os.environ, **env, TP_RESULTS=path)
    full_env["PYTHONPATH"] = os.pathsep.join([package_root(), full_env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900)
    ranks = []
    for r in range(nproc):
        try:
            with open(f"{path}.rank{r}") as f:
                ranks.append(json.load(f))
        except FileNotFoundError:
            ranks.append({})
    return ranks, proc.returncode, (proc.stdout + proc.stderr)[-4000:]


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp_results"))


def launch_params():
    return [pytest.param(name, marks=pytest.mark.skipif(bool(why), reason=str(why)))
            for name, (_, _, why) in LAUNCHES.items()]


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("launch_name", launch_params())
def test_tensor_parallel(launch_name, case, results_dir):
    ranks, returncode, tail = launch(launch_name, results_dir)
    verdicts = [r.get(case) for r in ranks]
    failed = [v for v in verdicts if v not in (None, "passed")]
    assert not failed, "\n".join(failed) + "\n" + tail
    assert all(v == "passed" for v in verdicts), (
        f"not reached: an earlier check failed or the run broke (exit {returncode})\n{tail}")


@pytest.mark.parametrize("launch_name", launch_params())
def test_tensor_parallel_run_ends_cleanly(launch_name, results_dir):
    """Every check ran and the ranks left the process group together."""
    ranks, returncode, tail = launch(launch_name, results_dir)
    assert returncode == 0 and all(len(r) == len(CASE_NAMES) for r in ranks), tail
