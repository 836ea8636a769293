"""Tensor parallelism: launches tests_py/tp_worker.py under torchrun (see its docstring for
what each rank checks). The process group times out after 60 s, so a hang fails fast."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import package_root, requires_gpu

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(nproc, timeout=600, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(HERE, "tp_worker.py")]
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [package_root(), full_env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "TP OK" in out, out[-6000:]
    return out


@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_on_cpu_gloo(nproc):
    torchrun(nproc)


@requires_gpu
def test_tensor_parallel_two_ranks_share_the_gpu_through_gloo():
    torchrun(2, TP_DEVICE="cuda", TP_BACKEND="gloo")


@requires_gpu
def test_tensor_parallel_nccl_one_rank():
    torchrun(1, TP_DEVICE="cuda", TP_BACKEND="nccl")


@requires_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL with several ranks needs several GPUs (one rank per GPU)")
def test_tensor_parallel_nccl_multi_gpu():
    torchrun(min(torch.cuda.device_count(), 4), TP_DEVICE="cuda", TP_BACKEND="nccl")
