"""Packaging: pyproject.toml builds with the installed torch (no isolated build that would need a
second one), the built module keeps no absolute RUNPATH and links libstdc++ dynamically (setup.py
refuses one with its own copy), `import tpfp8` refuses a torch without the CUDA build it was
compiled for, and the README's install lines work in a fresh venv."""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest
import torch

import tpfp8
from tpfp8 import _build_check

from conftest import package_root

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pyproject_names_setuptools_backend_and_no_torch():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        build = tomllib.load(f)["build-system"]
    assert build["build-backend"] == "setuptools.build_meta"
    # setuptools < 70.1 cannot build a wheel without the `wheel` package.
    assert "setuptools>=70.1" in build["requires"]
    assert not [r for r in build["requires"] if r.startswith("torch")], build["requires"]


def _run_setup_py(code, *args):
    """Runs setup.py with `args`, after `code` (which hides modules), in a subprocess."""
    prog = (f"import runpy, sys\n{code}\nsys.argv = ['setup.py', *{list(args)!r}]\n"
            "runpy.run_path('setup.py', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", prog], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_setup_py_without_torch_says_to_skip_build_isolation():
    # What an isolated `pip install .` runs: setuptools present, torch not.
    proc = _run_setup_py("sys.modules['torch'] = None", "egg_info")
    assert proc.returncode != 0
    assert "pip install --no-build-isolation ." in proc.stderr, proc.stderr


def test_setup_py_with_old_setuptools_and_no_wheel_says_what_to_install():
    # A fresh venv's setuptools 65 without `wheel`: setuptools' own error is
    # "invalid command 'bdist_wheel'".
    proc = _run_setup_py("sys.modules['setuptools.command.bdist_wheel'] = None\n"
                         "sys.modules['wheel'] = None", "dist_info")
    assert proc.returncode != 0
    assert "pip install 'setuptools>=70.1'" in proc.stderr, proc.stderr


def _runpath(lib):
    out = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
    return [p for m in re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", out)
            for p in m.split(":")]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_module_runpath_has_no_absolute_path():
    paths = _runpath(tpfp8._C.__file__)
    assert all(p.startswith("$ORIGIN") for p in paths), (tpfp8._C.__file__, paths)


BINUTILS = shutil.which("nm") is not None and shutil.which("readelf") is not None
NEEDS_BINUTILS = pytest.mark.skipif(not BINUTILS, reason="readelf and nm (binutils) not installed")


def _gxx_with_static_libstdcxx():
    """g++, where it can link libstdc++ statically (its libstdc++.a is installed); else None."""
    gxx = shutil.which("g++")
    if gxx is None or not BINUTILS:
        return None
    found = subprocess.run([gxx, "-print-file-name=libstdc++.a"], capture_output=True,
                           text=True).stdout.strip()
    return gxx if os.path.isabs(found) else None


GXX_STATIC = _gxx_with_static_libstdcxx()  # (asked once)
NEEDS_STATIC_LIBSTDCXX = pytest.mark.skipif(GXX_STATIC is None,
                                            reason="needs nm and g++ with libstdc++.a")


@NEEDS_BINUTILS
def test_module_links_libstdcxx_dynamically():
    assert _build_check.static_libstdcxx(tpfp8._C.__file__) is False


@NEEDS_BINUTILS
def test_libstdcxx_check_cannot_tell_for_a_file_that_is_no_module(tmp_path):
    (tmp_path / "text.so").write_text("not an ELF file")
    assert _build_check.static_libstdcxx(str(tmp_path / "text.so")) is None
    assert _build_check.static_libstdcxx(str(tmp_path / "missing.so")) is None


LINKS = {"dynamic": [], "static": ["-static-libstdc++"],
         "static, its symbols hidden": ["-static-libstdc++", "-Wl,--exclude-libs,ALL"]}


@NEEDS_STATIC_LIBSTDCXX
@pytest.mark.parametrize("link", LINKS)
def test_a_module_with_its_own_libstdcxx_is_recognised(tmp_path, link):
    src = tmp_path / "format.cpp"
    src.write_text("#include <sstream>\n#include <string>\n"
                   "std::string format(long n) { std::ostringstream s; s << n; return s.str(); }\n")
    lib = tmp_path / "libformat.so"
    subprocess.run([GXX_STATIC, "-shared", "-fPIC", *LINKS[link], str(src),
                    "-o", str(lib)], check=True, timeout=120)
    assert _build_check.static_libstdcxx(str(lib)) is (link != "dynamic")


@NEEDS_STATIC_LIBSTDCXX
def test_setup_py_refuses_a_module_with_its_own_libstdcxx(tmp_path):
    """The CPU-only module linked with -static-libstdc++: refused and removed, with what to do
    instead; TPFP8_ALLOW_STATIC_LIBSTDCXX=1 keeps it (the same build folder: a relink)."""
    env = dict(os.environ, TPFP8_FORCE_CPU="1", LDFLAGS="-static-libstdc++",
               MAX_JOBS=str(os.cpu_count() or 2))
    args = [sys.executable, "setup.py", "-q", "build", "-b", str(tmp_path / "lib"), "-t",
            str(tmp_path / "tmp")]
    modules = str(tmp_path / "lib" / "*" / "tpfp8" / "_C*.so")
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "linked its own copy of libstdc++" in proc.stderr, proc.stderr[-2000:]
    assert "CXX=/usr/bin/g++ CC=/usr/bin/gcc" in proc.stderr
    assert not glob.glob(modules)
    env["TPFP8_ALLOW_STATIC_LIBSTDCXX"] = "1"
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [_build_check.static_libstdcxx(m) for m in glob.glob(modules)] == [True]


def test_build_info_matches_the_module():
    from tpfp8 import _build_info

    assert _build_info.TORCH_VERSION == torch.__version__
    assert (_build_info.CUDA_VERSION is not None) == tpfp8.with_cuda()
    if tpfp8.with_cuda():
        assert _build_info.CUDA_VERSION == torch.version.cuda


@pytest.mark.parametrize("found", [None, "12.8"])
def test_cuda_build_refused_by_torch_without_that_cuda(monkeypatch, found):
    monkeypatch.setattr(torch.version, "cuda", found)
    with pytest.raises(ImportError, match=r"tpfp8 was built with CUDA 13\.0 .*Install a torch "
                                          r"built for CUDA 13\.x, or rebuild tpfp8"):
        _build_check.check("13.0", "2.14.1+cu130")


@pytest.mark.parametrize("found", [None, "12.8", "13.2"])
def test_cpu_only_build_and_same_cuda_major_accepted(monkeypatch, found):
    monkeypatch.setattr(torch.version, "cuda", found)
    _build_check.check(None, "2.14.1")
    if found and found.startswith("13."):
        _build_check.check("13.0", "2.14.1+cu130")


def test_import_refuses_before_loading_the_module():
    """`import tpfp8` of a CUDA build with a CPU-only torch: the clear error, raised before the
    loader tries _C (simulated: recorded CUDA build, torch.version.cuda None)."""
    prog = ("import sys, types, torch\n"
            "info = types.ModuleType('tpfp8._build_info')\n"
            "info.CUDA_VERSION, info.TORCH_VERSION = '13.0', '2.14.1+cu130'\n"
            "sys.modules['tpfp8._build_info'] = info\n"
            "torch.version.cuda = None\n"
            "try:\n    import tpfp8\n"
            "except ImportError as e:\n"
            "    assert 'tpfp8._C' not in sys.modules, 'loaded _C first'\n"
            "    sys.exit(str(e))\n")
    env = dict(os.environ, PYTHONPATH=package_root())
    proc = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "tpfp8 was built with CUDA 13.0" in proc.stderr
    assert "is a CPU-only build" in proc.stderr
    assert "TPFP8_FORCE_CPU=1" in proc.stderr


def _readme_pip_lines():
    """The `pip ...` lines of the README's first "Building by hand" block, as argument lists."""
    with open(os.path.join(REPO, "README.md")) as f:
        section = f.read().split("## Building by hand", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines()
            if line.startswith("pip ")]


def _copy_sources(dest):
    """What the build reads, without this checkout's built modules and build folders."""
    ignore = shutil.ignore_patterns("*.so", "_build_info.py", "__pycache__")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), dest)
    for name in ("csrc", "python"):
        shutil.copytree(os.path.join(REPO, name), os.path.join(dest, name), ignore=ignore)


@pytest.mark.skipif(package_root() != os.path.join(REPO, "python"),
                    reason="builds from source: run once, with the source tree's tpfp8")
def test_readme_install_lines_in_a_fresh_venv(tmp_path):
    """The README's lines, as written, with the pip of a fresh `python3 -m venv` (which sees this
    environment's torch, so nothing large is installed), building the CPU-only module (a few
    minutes); first a plain `pip install .`, which must stop with the hint and install no torch.
    """
    lines = _readme_pip_lines()
    assert lines and lines[-1] == ["pip", "install", "--no-build-isolation", "-e", "."], lines
    pinned = [a.split("==")[1] for line in lines for a in line if a.startswith("torch==")]
    if pinned and torch.__version__.split("+")[0] != pinned[0]:
        pytest.skip(f"the README pins torch {pinned[0]}, this is {torch.__version__}: the venv "
                    "would install a second torch")
    venv, src = tmp_path / "venv", tmp_path / "src"
    src.mkdir()
    _copy_sources(src)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=300)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    env.update(TPFP8_FORCE_CPU="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def run(args, timeout=1200):
        return subprocess.run(args, cwd=src, env=env, capture_output=True, text=True,
                              timeout=timeout)

    pip = [python, "-m", "pip"]
    proc = run(pip + ["install", "."], timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "pip install --no-build-isolation ." in out, out[-4000:]
    assert not list(venv.glob("lib/python*/site-packages/torch")), "installed a second torch"

    for line in lines:
        proc = run(pip + line[1:])
        assert proc.returncode == 0, (line, (proc.stdout + proc.stderr)[-4000:])
    check = ("import os, torch, tpfp8\n"
             "assert not tpfp8.with_cuda()\n"
             "print(os.path.dirname(tpfp8.__file__))\n"
             "print(tpfp8.Linear(16, 16)(torch.ones(2, 16)).shape)\n")
    proc = subprocess.run([python, "-c", check], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == [str(src / "python" / "tpfp8"), "torch.Size([2,", "16])"]
