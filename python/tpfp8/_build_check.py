"""Refuses, on import, a torch without the CUDA build tpfp8._C was compiled for.

tpfp8/__init__.py imports this before _C: loading a CUDA-built _C into a CPU-only torch (or one
for another CUDA major) fails in the dynamic loader, which only says that libc10_cuda.so or
libcudart.so.N is missing. setup.py's build_ext records the build in _build_info.py beside _C;
a build made before it did has none, and is not checked. `static_libstdcxx` is setup.py's check
of the module it has just built.
"""
import os
import re
import shutil
import subprocess

import torch

try:
    from . import _build_info
except ImportError:
    _build_info = None


def check(built_cuda, built_torch):
    """Raise ImportError when a module built with CUDA ``built_cuda`` ("13.0", or None for the
    CPU-only module, which runs with any torch) cannot load with the installed torch."""
    found = torch.version.cuda
    if built_cuda is None:
        return
    major = built_cuda.split(".")[0]
    if found is not None and found.split(".")[0] == major:
        return
    raise ImportError(
        f"tpfp8 was built with CUDA {built_cuda} (against torch {built_torch}), but the installed "
        f"torch {torch.__version__} is "
        + (f"built for CUDA {found}" if found else "a CPU-only build")
        + f". Install a torch built for CUDA {major}.x, or rebuild tpfp8 against this torch: "
        "`pip install --no-build-isolation .` in tpfp8's source (with a CPU-only torch, or "
        "TPFP8_FORCE_CPU=1, that builds the CPU-only module).")


# libstdc++'s std::locale::classic(): defined in a module only where libstdc++ is linked into it.
_LIBSTDCXX_SYMBOL = "_ZNSt6locale7classicEv"


def static_libstdcxx(path):
    """Whether the C++ shared object at ``path`` carries its own copy of libstdc++ (a compiler
    that links it statically, e.g. with -static-libstdc++): it needs no libstdc++.so
    (``readelf -d``) or exports libstdc++'s own symbols (``nm -D``). None where binutils cannot
    tell: readelf or nm missing, or failing (not an ELF file).

    Such a module shares the process with torch's libstdc++: two sets of iostream and locale
    state. Seen on a GPU machine whose default compiler made modules that crashed the process
    (SIGSEGV) formatting any error message that holds a number, instead of raising."""
    readelf, nm = shutil.which("readelf"), shutil.which("nm")
    if readelf is None or nm is None or not os.path.isfile(path):
        return None
    dynamic, symbols = (subprocess.run(args, capture_output=True, text=True)
                        for args in ([readelf, "-d", path], [nm, "-D", "--defined-only", path]))
    if dynamic.returncode != 0 or symbols.returncode != 0:
        return None
    shared = re.search(r"\(NEEDED\).*\[libstdc\+\+\.so", dynamic.stdout) is not None
    return not shared or _LIBSTDCXX_SYMBOL in symbols.stdout


if _build_info is not None:
    check(_build_info.CUDA_VERSION, _build_info.TORCH_VERSION)
