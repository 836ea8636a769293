# tpfp8: the two commands of the README, and their parts.
#   make demo   set up, build, self-check, train the Llama-style decoder demo in bf16 and FP8
#               (tensor-parallel on 2 GPUs where there are 2), and run the cast benchmark
#   make test   set up, build, run GoogleTest (ctest) and pytest, then pytest again on the
#               CPU-only build (TPFP8_FORCE_CPU=1)
PYTHON ?= python3
JOBS ?= $(shell nproc)
TORCH_SPEC ?= torch==2.14.1
CMAKE_BUILD := build/cmake
CPU_ONLY_BUILD := build/cpu_only
export PYTHONPATH := $(CURDIR)/python:$(PYTHONPATH)
export MAX_JOBS ?= $(JOBS)

.PHONY: help deps build build-python build-cpp test test-cpp test-py test-cpu-only demo bench \
	format format-check lint clean

help:
	@echo "make demo    set up, build, self-check, FP8 vs bf16 decoder training demo, cast benchmark"
	@echo "make test    set up, build, GoogleTest + pytest, and pytest on the CPU-only build"
	@echo "make format  clang-format C++/CUDA sources (with clang-format 21, installed under build/)"
	@echo "make format-check  the same, changing nothing: fails where a file is not formatted"
	@echo "make lint    ruff over the Python code"

# Installs only what is missing: apt for the C++ test tools, pip for torch (the machine's
# local wheel) and the Python tools.
deps:
	@command -v cmake >/dev/null && [ -e /usr/include/gtest/gtest.h ] || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake libgtest-dev; }
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	@$(PYTHON) -c "import numpy, pytest, ninja, yaml, peft" 2>/dev/null || \
	  $(PYTHON) -m pip install -q numpy pytest ninja pyyaml peft

build: build-python build-cpp

build-python: deps
	$(PYTHON) setup.py -q build_ext --inplace

build-cpp: deps
	cmake -S . -B $(CMAKE_BUILD) -DCMAKE_BUILD_TYPE=Release \
	  "-DTPFP8_CUDA_LIBRARY_ROOTS=$$($(PYTHON) -c 'import glob, site; print(";".join(g for s in site.getsitepackages() for g in glob.glob(s + "/nvidia/cu*")))')" \
	  $$([ -x /usr/local/cuda/bin/nvcc ] && echo -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
	cmake --build $(CMAKE_BUILD) -j $(JOBS)

# The test binaries are independent, so they run side by side (on the H200: 91 s with -j 16,
# 287 s one after another).
test-cpp: build-cpp
	cd $(CMAKE_BUILD) && ctest --output-on-failure -j $(JOBS)

# pytest's exit 5 (nothing collected) is a failure here, not a pass.
test-py: build-python
	$(PYTHON) -m pytest tests_py -q -rs; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# The CPU-only module (what a machine without nvcc builds) in its own folder, tested whole:
# it must keep compiling and working even where the CUDA build is the one in use.
test-cpu-only: deps
	TPFP8_FORCE_CPU=1 $(PYTHON) setup.py -q build -b $(CPU_ONLY_BUILD)
	cd $(CPU_ONLY_BUILD) && export PYTHONPATH=$$(ls -d $(CURDIR)/$(CPU_ONLY_BUILD)/lib.*) && \
	  $(PYTHON) -c "import tpfp8; assert not tpfp8.with_cuda(), tpfp8.__file__; print('CPU-only tpfp8 from', tpfp8.__file__)" && \
	  $(PYTHON) -m pytest $(CURDIR)/tests_py -q -rs -p no:cacheprovider; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

test: test-cpp test-py test-cpu-only

# The benchmarks draw their plots with matplotlib.
demo: build-python
	@$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PYTHON) -m pip install -q matplotlib
	$(PYTHON) -m tpfp8.selfcheck
	$(PYTHON) -m tpfp8.demo
	$(PYTHON) bench/cast.py

# The sources are formatted with clang-format 21 (older releases lay out a few lines otherwise:
# 14 eight of them), so format installs that release under build/ instead of using the one on PATH.
CLANG_FORMAT_SPEC ?= clang-format==21.1.8
CLANG_FORMAT_DIR := build/clang-format
CLANG_FORMAT := PYTHONPATH=$(CLANG_FORMAT_DIR) $(CLANG_FORMAT_DIR)/bin/clang-format
FORMATTED = $$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'bench/*.cu' 'tests_cpp/*')

$(CLANG_FORMAT_DIR)/bin/clang-format:
	$(PYTHON) -m pip install -q --target $(CLANG_FORMAT_DIR) "$(CLANG_FORMAT_SPEC)"

format: $(CLANG_FORMAT_DIR)/bin/clang-format
	$(CLANG_FORMAT) -i --style=file $(FORMATTED)

format-check: $(CLANG_FORMAT_DIR)/bin/clang-format
	$(CLANG_FORMAT) --dry-run -Werror --style=file $(FORMATTED)

lint:
	$(PYTHON) -m ruff check python bench tests_py

clean:
	rm -rf build python/tpfp8/_C*.so
