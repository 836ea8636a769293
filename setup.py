"""Builds tpfp8 and its native module tpfp8._C.

CUDA sources are compiled when torch was built with CUDA and nvcc is found; otherwise a CPU-only
module is built, which imports and runs every op through the CPU reference.

The build compiles against the torch installed in the running environment, so pip must not
isolate it: `pip install --no-build-isolation .` (pyproject.toml names no torch to build with;
an isolated build stops with a message saying so rather than download a second torch).

Environment:
  TPFP8_CUDA_GENCODE  nvcc target flags (default: -gencode=arch=compute_90a,code=sm_90a)
  TPFP8_FORCE_CPU=1   build without CUDA even when it is available
  MAX_JOBS            parallel compile jobs (torch's build_ext, with ninja)
  TPFP8_ALLOW_STATIC_LIBSTDCXX=1  keep a module that its compiler linked with its own copy of
                      libstdc++ (refused by default: see _refuse_static_libstdcxx)
"""
import glob
import importlib.util
import os
import shutil
import site
import sys

from setuptools import find_packages, setup

VERSION = "0.1.0"


def _check_wheel_support():
    """setuptools before 70.1 builds wheels only with the `wheel` package, which a fresh venv
    (setuptools 65) lacks and which --no-build-isolation does not install; its own error,
    "invalid command 'bdist_wheel'", does not say so."""
    if not {"bdist_wheel", "dist_info", "editable_wheel"} & set(sys.argv[1:]):
        return
    try:
        from setuptools.command import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
    except ImportError:
        try:
            import wheel  # noqa: F401
        except ImportError:
            import setuptools
            sys.exit(f"tpfp8: setuptools {setuptools.__version__} cannot build a wheel without "
                     "the `wheel` package: pip install 'setuptools>=70.1' (or: pip install wheel)")


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


_check_wheel_support()
_find_cuda_home()
try:
    from torch.utils import cpp_extension  # noqa: E402  (reads CUDA_HOME at import)
except ImportError as e:
    sys.exit(f"tpfp8 compiles against the torch of this environment, and it has none ({e}): "
             "install torch first, then build without pip's build isolation (which hides the "
             "installed torch): pip install --no-build-isolation .")

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


def _cuda_available():
    if os.environ.get("TPFP8_FORCE_CPU") == "1":
        return False
    import torch

    nvcc = cpp_extension.CUDA_HOME and os.path.exists(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    return torch.version.cuda is not None and bool(nvcc or shutil.which("nvcc"))


def _site_dirs():
    return site.getsitepackages() + [site.getusersitepackages()] + sys.path


def _cublaslt():
    """(include dir, library file) of cuBLASLt: the CUDA toolkit's, or the copy that torch's
    nvidia-cublas wheel installed (a toolkit without cuBLAS is common on build machines)."""
    roots = [cpp_extension.CUDA_HOME or ""]
    for sp in _site_dirs():
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
    def rel(pattern):
        return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))

    sources = rel("csrc/*.cpp") + rel("csrc/kernels/*.cpp")
    if with_cuda:
        sources += rel("csrc/kernels/*.cu")
    return sources


def _runpath(lib_dir):
    """Link flags for a RUNPATH to lib_dir that survives installing the module elsewhere: relative
    to tpfp8/ when lib_dir is in a site-packages (the nvidia wheel torch depends on, which pip
    installs beside tpfp8), else none. `import torch` loads torch's own cuBLASLt before _C, and
    the loader reuses a library already loaded under the same soname, so this is only a fallback;
    an absolute path would name the build machine's folders."""
    lib_dir = os.path.realpath(lib_dir)
    for sp in map(os.path.realpath, filter(None, _site_dirs())):
        if os.path.basename(sp) in ("site-packages", "dist-packages") and \
                lib_dir.startswith(sp + os.sep):
            return ["-Wl,-rpath,$ORIGIN/../" + os.path.relpath(lib_dir, sp)]
    return []


def _extension(with_cuda):
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
        extra_link_args=[f"-l:{os.path.basename(lt_lib)}", f"-L{os.path.dirname(lt_lib)}"]
        + _runpath(os.path.dirname(lt_lib)),
        extra_compile_args={"cxx": cxx, "nvcc": nvcc})


class BuildExtension(cpp_extension.BuildExtension):
    """torch's build_ext, which also writes tpfp8/_build_info.py beside _C (in place, or in the
    build folder that becomes the wheel): the torch and CUDA it was built against, which
    tpfp8/__init__.py checks before loading _C."""

    def run(self):
        super().run()
        _refuse_static_libstdcxx(self.get_ext_fullpath("tpfp8._C"))
        import torch

        # Written after the build: build_py may have copied a stale one from the source tree.
        folder = os.path.dirname(self.get_ext_fullpath("tpfp8._C"))
        with open(os.path.join(folder, "_build_info.py"), "w") as f:
            f.write(f'''"""What tpfp8._C was built against (written by setup.py's build_ext)."""
TORCH_VERSION = {torch.__version__!r}
CUDA_VERSION = {torch.version.cuda if WITH_CUDA else None!r}  # None: the CPU-only module
''')


def _refuse_static_libstdcxx(module):
    """Stops the build, removing the module, where the compiler linked libstdc++ into it
    (tpfp8/_build_check.py's static_libstdcxx, loaded by path: the package imports the module
    being built): beside torch's own libstdc++ such a module can crash the process where it
    should raise an error."""
    if os.environ.get("TPFP8_ALLOW_STATIC_LIBSTDCXX") == "1":
        return
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python", "tpfp8",
                        "_build_check.py")
    spec = importlib.util.spec_from_file_location("_tpfp8_build_check", path)
    build_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_check)
    static = build_check.static_libstdcxx(module)
    if static is None:
        print("tpfp8: could not check how the module links libstdc++ (needs binutils' readelf "
              "and nm)", file=sys.stderr)
    if not static:
        return
    os.remove(module)
    import sysconfig

    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    sys.exit(f"tpfp8: the C++ compiler ({cxx}) linked its own copy of libstdc++ into "
             f"{os.path.basename(module)} (removed). Loaded beside torch's libstdc++, such a "
             "module has been seen to crash the process (SIGSEGV) where it should raise an error. "
             "Build with a compiler that links libstdc++ dynamically, e.g. the system's: "
             "CXX=/usr/bin/g++ CC=/usr/bin/gcc, and no -static-libstdc++ in LDFLAGS "
             "(TPFP8_ALLOW_STATIC_LIBSTDCXX=1 keeps such a module).")


def _local_version():
    """The wheel's local version label: which torch build it needs (+cu130, +cpu)."""
    import torch

    return "cu" + torch.version.cuda.replace(".", "") if WITH_CUDA else "cpu"


WITH_CUDA = _cuda_available()
setup(
    name="tpfp8",
    version=f"{VERSION}+{_local_version()}",
    description="FP8 tensor-parallel Linear for PyTorch on Hopper GPUs",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[_extension(WITH_CUDA)],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
