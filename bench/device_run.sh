#!/usr/bin/env bash
# Builds tpfp8 on a GPU machine, runs the GPU tests and the benchmarks, writes logs to $OUT.
#   OUT=/tmp/out bash bench/device_run.sh [gemm|cast|norm|linear|debug|tp|demo|tests|soak|host|
#                                         compile|block|norm|activation ...]
# (default: gemm cast linear debug tp demo tests). Each step's wall time goes to the log;
# JSON/PNG results are packed into $OUT/results.tgz at the end (the device tool returns only a
# few files). compile, block: torchao, for their float8 cases, is not on the GPU machine; a
# wheel in .whl/ (ignored by git, e.g. torchao-0.17.0-py3-none-any.whl: carry `.whl`) is installed
# to /tmp/site for those steps only.
# GoogleTest: the GPU machine has no libgtest; copy the sources there first, e.g. from this
# repository's machine: `cp -r /usr/src/googletest .deps/` (ignored by git; carry `.deps`).
# On the lent H200 the image's default compiler (/opt/gcc) makes a module that crashes formatting
# any error message with a number (SIGSEGV in ostream code inside _C itself, 36th session); the
# system g++ works, so it is pinned here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
export CXX=${TPFP8_CXX:-/usr/bin/g++} CC=${TPFP8_CC:-/usr/bin/gcc}
steps=${*:-gemm cast linear debug tp demo tests}
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
log=$OUT/device.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$log"
python3 setup.py -q build_ext --inplace >> "$log" 2>&1 || { tail -30 "$log"; exit 1; }
gtest=$PWD/.deps/googletest; [ -d "$gtest" ] || gtest=/usr/src/googletest
torchao_path() {  # PYTHONPATH with torchao (from its wheel in .whl/) for compile and block
  if ls .whl/torchao-*.whl >/dev/null 2>&1 &&
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/torchao-*.whl >> "$log" 2>&1; then
    echo "/tmp/site:$PYTHONPATH"
  else
    echo "$PYTHONPATH"
  fi
}
for step in $steps; do
  echo "== $step ($(date +%T))" | tee -a "$log"
  case $step in
    tests)
      cmake -S . -B build/cmake -DTPFP8_GTEST_SOURCE_DIR="$gtest" >> "$log" 2>&1 &&
        cmake --build build/cmake -j "$MAX_JOBS" >> "$log" 2>&1 || { tail -30 "$log"; exit 1; }
      (cd build/cmake && ctest --output-on-failure -j "$MAX_JOBS" 2>&1) | tee -a "$log" | tail -4
      python3 -m pytest tests_py -q -rs -p no:cacheprovider --durations=15 2>&1 |
        tee -a "$log" | tail -4 ;;
    cast) python3 bench/cast.py --out "$OUT" 2>&1 | tee -a "$log" | grep -E '^\|' ;;
    norm) python3 bench/norm_cast.py --out "$OUT" 2>&1 | tee -a "$log" | grep -E '^\|' ;;
    activation) python3 bench/activation_cast.py --out "$OUT" 2>&1 | tee -a "$log" |
                  grep -E '^\|' ;;
    gemm) python3 bench/gemm.py --out "$OUT" 2>&1 | tee -a "$log" | grep -E '^\|' ;;
    linear) python3 bench/linear.py --out "$OUT" 2>&1 | tee -a "$log" | grep -E '^\|' ;;
    debug) python3 bench/debug_overhead.py --out "$OUT" 2>&1 | tee -a "$log" | grep -E '^\|' ;;
    tp)
      python3 bench/tp.py --out "$OUT" 2>&1 | tee -a "$log" | grep -E '^\|'
      if [ "$ngpu" -ge 2 ]; then
        python3 -m torch.distributed.run --standalone --nproc_per_node="$ngpu" bench/tp.py \
          --time --out "$OUT" 2>&1 | tee -a "$log" | grep -E '^\|'
      fi ;;
    soak) python3 bench/soak.py --out "$OUT" 2>&1 | tee -a "$log" | grep -E '^\||soak' ;;
    host) python3 bench/host_time.py 2>&1 | tee -a "$log" ;;
    compile|block)
      PYTHONPATH=$(torchao_path) python3 bench/$step.py --out "$OUT" 2>&1 | tee -a "$log" |
        grep -E '^\|' ;;
    demo) python3 -m tpfp8.demo --tp "$(( ngpu >= 2 ? 2 : 1 ))" --out "$OUT/demo" 2>&1 |
            tee -a "$log" | tail -6 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "== done ($(date +%T))" | tee -a "$log"
(cd "$OUT" && find . -name '*.json' -o -name '*.png' | tar czf results.tgz -T - 2>/dev/null)
