"""Builds tpfp8 and its native module tpfp8._C.

CUDA sources are compiled when torch was built with CUDA and nvcc is found; otherwise a CPU-only
module is built, which imports and runs every op through the CPU reference.

Environment:
  TPFP8_CUDA_GENCODE  nvcc target flags (default: -gencode=arch=compute_90a,code=sm_90a)
  TPFP8_FORCE_CPU=1   build without CUDA even when it is available
  MAX_JOBS            parallel compile jobs (torch's build_ext, with ninja)
"""
import glob
import os
import shutil

from setuptools import find_packages, setup


def _find_cuda_home():
    """torch guesses CUDA_HOME from the nvcc on PATH; a wrapper such as /usr/local/bin/nvcc
    makes that /usr/local, which has no CUDA headers. Pick a folder that really has them."""
    nvcc = shutil.which("nvcc")
    if "CUDA_HOME" in os.environ or not nvcc:
        return
    for home in (os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"):
        if os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = home
            return


_find_cuda_home()
from torch.utils import cpp_extension  # noqa: E402  (reads CUDA_HOME at import)

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


def _cuda_available():
    if os.environ.get("TPFP8_FORCE_CPU") == "1":
        return False
    import torch

    nvcc = cpp_extension.CUDA_HOME and os.path.exists(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    return torch.version.cuda is not None and bool(nvcc or shutil.which("nvcc"))


def _cublaslt():
    """(include dir, library file) of cuBLASLt: the CUDA toolkit's, or the copy that torch's
    nvidia-cublas wheel installed (a toolkit without cuBLAS is common on build machines)."""
    import site
    import sys

    roots = [cpp_extension.CUDA_HOME or ""]
    for sp in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
        roots += sorted(glob.glob(os.path.join(sp, "nvidia", "cu*"))) + [
            os.path.join(sp, "nvidia", "cublas")]
    for root in roots:
        header = os.path.join(root, "include", "cublasLt.h")
        libs = sorted(glob.glob(os.path.join(root, "lib*", "libcublasLt.so*")), key=len)
        if os.path.exists(header) and libs:
            return os.path.dirname(header), libs[0]
    raise RuntimeError("cuBLASLt not found (cublasLt.h + libcublasLt.so): install the CUDA "
                       "toolkit's cuBLAS or `pip install nvidia-cublas`, or set TPFP8_FORCE_CPU=1")


def _sources(with_cuda):
    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    sources = rel("csrc/*.cpp") + rel("csrc/kernels/*.cpp")
    if with_cuda:
        sources += rel("csrc/kernels/*.cu")
    return sources


def _extension():
    with_cuda = _cuda_available()
    # No -std for C++: torch picks the standard its headers need (C++20 from torch 2.10 on).
    cxx = ["-O3", "-ffp-contract=off"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not with_cuda:
        return cpp_extension.CppExtension(
            "tpfp8._C", _sources(False), include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx})
    gencode = os.environ.get("TPFP8_CUDA_GENCODE", DEFAULT_GENCODE).split()
    lt_include, lt_lib = _cublaslt()
    include_dirs.append(lt_include)
    nvcc = ["-O3", "-std=c++17", "-DTPFP8_WITH_CUDA", "--expt-relaxed-constexpr"] + gencode
    return cpp_extension.CUDAExtension(
        "tpfp8._C", _sources(True), include_dirs=include_dirs,
        define_macros=[("TPFP8_WITH_CUDA", None)],
        # The wheel ships only libcublasLt.so.N (no unversioned link): link that file by name.
        extra_link_args=[f"-l:{os.path.basename(lt_lib)}", f"-L{os.path.dirname(lt_lib)}",
                         f"-Wl,-rpath,{os.path.dirname(lt_lib)}"],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc})


setup(
    name="tpfp8",
    version="0.1.0",
    description="FP8 tensor-parallel Linear for PyTorch on Hopper GPUs",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
