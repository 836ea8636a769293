"""A short self-check of the installed tpfp8: runs every native op on each available device
and compares with a plain-torch recomputation. Exits non-zero on any mismatch.

  python -m tpfp8.selfcheck
"""
import argparse
import sys
import time

import torch

import tpfp8
from tpfp8 import ops


def _torch_cast(x, scale, dtype):
    # torch's own cast (round to nearest even) after our saturation: the same codes.
    v = (x.float() * scale).clamp(-448.0, 448.0)
    return v.to(dtype).view(torch.uint8)


def check(device: str) -> list:
    failures = []
    x = torch.randn(257, 129, device=device, dtype=torch.bfloat16) * 30
    scale = torch.tensor([3.0], device=device, dtype=torch.float32)
    q = ops.cast_transpose(x, scale, "e4m3")
    want = _torch_cast(x, scale, torch.float8_e4m3fn)
    checks = {
        "cast_transpose rowwise": torch.equal(q.rowwise, want),
        "cast_transpose columnwise": torch.equal(q.columnwise, want.t()),
        "amax": q.amax.item() == x.float().abs().max().item(),
        "scale_inv": torch.equal(q.scale_inv, 1.0 / scale),
        "transpose_fp8": torch.equal(ops.transpose_fp8(q.rowwise), q.columnwise),
        "dequantize": torch.equal(
            ops.dequantize(q.rowwise, q.scale_inv, "e4m3"),
            want.view(torch.float8_e4m3fn).float() * q.scale_inv),
    }
    for name, ok in checks.items():
        print(f"  {device:5s} {name:26s} {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"{device}: {name}")
    return failures


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and tpfp8.with_cuda() else [])
    print(f"tpfp8 {tpfp8.__version__} (CUDA kernels: {tpfp8.with_cuda()}), "
          f"torch {torch.__version__}")
    t0 = time.perf_counter()
    failures = [f for d in devices for f in check(d)]
    print(f"self-check on {', '.join(devices)}: "
          f"{'all ok' if not failures else f'{len(failures)} FAILED'} "
          f"({time.perf_counter() - t0:.2f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
