"""The benchmarks still run: each bench/ script on the CPU at its smallest size, one
repetition, writing its JSON where it writes one. Their timings mean nothing here; a script
broken by a change of the API it calls fails in CI instead of on the GPU machine, where device
time is short. (gemm.py and sm_share.py need a GPU and refuse the CPU by design.)"""
import json
import os
import re
import subprocess
import sys
import time

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
                    "tpfp8 fused delayed eager", "--profile", "fused delayed eager", *ONE],
     "compile.json"),
    ("block.py", ["--sizes", "tiny", "--batch", "1", "--seq", "16", "--rounds", "1", "--warmup",
                  "1", "--cases", "tpfp8 fused delayed eager", *ONE], "block.json"),
    ("tp.py", ONE, "tp_bytes.json"),
    ("soak.py", ["--steps", "3", "--every", "2", "--hidden", "32", "--tokens", "16"],
     "soak.json"),
    ("host_time.py", ["--size", "32"], None),
    ("drift.py", ["--shape", "16x32", "--seconds", "1"], "drift.json"),
]
# The scripts that take --settle (bench/common.settle), each recording what it applied.
SETTLES = {"cast.py", "linear.py", "debug_overhead.py", "norm_cast.py", "activation_cast.py",
           "compile.py", "block.py"}


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
            result = json.load(f)
        assert result, f"{written} is empty"
        if script in SETTLES:
            assert result["settle_s"] == 0.0, "settling is for the GPU's clocks: none on the CPU"


# bench/repeat.py with a stand-in benchmark: run n (0-based) writes ratio `ratios`[n] for case
# "tpfp8 a" (and 0.1 less for "tpfp8 b"); where that entry is None it fails, "sleep" hangs (in
# a child of its own, as compile workers do), "bad" writes a truncated JSON.
FAKE_BENCH = """
import json, os, subprocess, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
counter = os.path.join(os.path.dirname(out), "count")
n = int(open(counter).read()) if os.path.exists(counter) else 0
open(counter, "w").write(str(n + 1))
ratio = {ratios}[n]
if ratio is None:
    sys.exit(3)
if ratio == "sleep":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(os.path.join(os.path.dirname(out), "child"), "w").write(str(child.pid))
    time.sleep(60)
if ratio == "bad":
    open(os.path.join(out, "fake.json"), "w").write('{{"results": [')
    sys.exit(0)
def case(family, r):
    return {{"family": family, "status": "ok", "ms": 10.0 / r, "speedup_vs_faster_bf16": r}}
cases = {{"bf16 eager": case("bf16", 1.0), "tpfp8 a": case("tpfp8", ratio),
          "tpfp8 b": case("tpfp8 fused", ratio - 0.1)}}
with open(os.path.join(out, "fake.json"), "w") as f:
    json.dump({{"results": [{{"tokens": 8, "hidden": 4, "cases": cases}}]}}, f)
"""


def run_repeat(tmp_path, ratios, *options):
    bench = tmp_path / "fake_bench.py"
    bench.write_text(FAKE_BENCH.format(ratios=ratios))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, os.path.join("bench", "repeat.py"), "--out", str(out),
                          *options, "--", sys.executable, str(bench)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    summary = None
    if (out / "repeat.json").exists():
        with open(out / "repeat.json") as f:
            summary = {(r["size"], r["case"]): r for r in json.load(f)["summary"]}
    return run, summary


def test_repeat_reports_median_range_and_target_count_over_the_runs_that_succeeded(tmp_path):
    run, summary = run_repeat(tmp_path, [1.6, None, 1.8, 1.7], "--runs", "4", "--target", "1.7")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[1].startswith("run 2/4: ") and "s; FAILED (return code 3" in lines[1], lines
    assert lines[2].endswith("s; best tpfp8 case: 8x4 1.800x (tpfp8 a)"), lines
    assert "3 of 4 runs succeeded" in run.stdout, run.stdout
    a = summary[("8x4", "tpfp8 a")]
    assert a["ratios"] == pytest.approx([1.6, 1.8, 1.7])
    assert (a["median"], a["low"], a["high"]) == pytest.approx((1.7, 1.6, 1.8))
    assert a["at_target"] == 2
    assert summary[("8x4", "tpfp8 b")]["median"] == pytest.approx(1.6)
    # each run's fastest tpfp8 case, here always "tpfp8 a"
    best = summary[("8x4", "best tpfp8 case")]
    assert best["ratios"] == pytest.approx(a["ratios"]) and best["cases"] == ["tpfp8 a"] * 3
    assert (tmp_path / "out" / "run2" / "log.txt").exists()


def test_repeat_stops_a_hung_run_with_its_children_and_skips_an_unreadable_json(tmp_path):
    run, summary = run_repeat(tmp_path, ["sleep", "bad", 1.7], "--runs", "3", "--timeout", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("run 1/3: ") and "FAILED (stopped after 2 s" in lines[0], lines
    assert lines[1].startswith("run 2/3: ") and "FAILED (unreadable JSON" in lines[1], lines
    assert "1 of 3 runs succeeded" in run.stdout, run.stdout
    assert summary[("8x4", "tpfp8 a")]["ratios"] == pytest.approx([1.7])
    child = int((tmp_path / "out" / "child").read_text())
    for _ in range(50):  # the killed child is reaped by init a moment later
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hung run's child {child} outlived the timeout")


def test_repeat_stops_at_its_budget_and_fails_when_no_run_succeeds(tmp_path):
    run, summary = run_repeat(tmp_path, [None, None, None], "--runs", "3", "--budget", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "stopping after 1 runs" in run.stdout and "0 of 1 runs succeeded" in run.stdout
    assert summary == {}
    run = subprocess.run([sys.executable, os.path.join("bench", "repeat.py"), "--runs", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "give the benchmark command after --" in run.stderr


@pytest.mark.parametrize("written", ["compile_4096_r5_session38.json",
                                     "block_8b_r3_session38.json"])
def test_repeat_reads_what_compile_and_block_write(written, monkeypatch):
    """The JSON of real GPU runs, kept in bench/results, parses into one row per case."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import repeat
    with open(os.path.join(ROOT, "bench", "results", written)) as f:
        results = json.load(f)["results"]
    found = repeat.ratios_by_case(results)
    cases = {case for (_, case) in found}
    assert "bf16 eager" in cases and repeat.BEST in cases
    best = max((v[0], case) for (_, case), v in found.items()
               if case != repeat.BEST and case.startswith("tpfp8"))
    ratio, _, name = found[("8192x4096", repeat.BEST)]
    assert (ratio, name) == best and ratio > 1.0


def test_settle_runs_the_step_for_its_time_with_at_most_two_queued(monkeypatch):
    """bench/common.settle, with CUDA events stood in for: the step runs back to back for the
    time asked, waiting on the oldest step whenever three are queued; 0 s runs nothing; the
    option takes a finite number of seconds >= 0."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import common
    queued = []

    class Event:
        def record(self):
            queued.append(self)

        def synchronize(self):
            assert self is queued[0], "settle waits on the oldest call"
            queued.remove(self)
    monkeypatch.setattr(common.torch.cuda, "Event", Event)
    seen = []
    t0 = time.perf_counter()
    common.settle(lambda: seen.append(len(queued)), 0.05)
    assert time.perf_counter() - t0 >= 0.05 and len(seen) > 3
    assert max(seen) == 2 and len(queued) == 2
    seen.clear()
    common.settle(lambda: seen.append(len(queued)), 0.0)
    assert seen == []
    for bad in ("inf", "nan", "-1"):
        with pytest.raises(Exception, match="finite number of seconds"):
            common.seconds_arg(bad)


def test_every_timed_window_of_linear_follows_the_settle_asked_for(monkeypatch):
    """bench/linear.measure hands --settle to each of its timings (steady state, one step at a
    time, graphed), so that no method is timed at an idle card's clocks."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import linear
    seen = []

    def fake_time_ms(fn, device, reps, warmup=5, pipelined=False, settle_s=0.0):
        seen.append(settle_s)
        return 1.0
    monkeypatch.setattr(linear, "time_ms", fake_time_ms)
    r = linear.measure({"bf16 nn.Linear": lambda: None, "tpfp8 delayed": lambda: None}, "cpu",
                       reps=1, rounds=2, settle_s=0.7)
    assert seen == [0.7] * 6  # 2 rounds x 2 cases, then each case one at a time
    assert r["tpfp8 delayed"]["speedup_vs_bf16"] == 1.0
    tp = subprocess.run([sys.executable, os.path.join("bench", "tp.py"), "--help"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert tp.returncode == 0 and "--settle" not in tp.stdout, "tp.py's ranks cannot settle"


def test_profile_kernel_kinds_name_every_kernel_of_a_real_profile(monkeypatch):
    """The kinds --profile sums GPU time by, over the kernel names of a real profile (the 8B-like
    layer, bf16 compiled and tpfp8 under reduce-overhead, H200, kept in bench/results)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import compile as bench_compile
    with open(os.path.join(ROOT, "bench", "results", "profile_8b_kernels_session41.log")) as f:
        names = [m.group(1) for m in map(re.compile(r"^ +[\d.]+ us +x *[\d.]+ +(.+)$").match, f)
                 if m]
    kinds = {name: bench_compile.kernel_kind(name) for name in names}
    assert len(kinds) > 40
    for name, kind in kinds.items():
        want = ("GEMM" if name.startswith("nvjet") else "attention" if "cudnn" in name else
                "tpfp8" if "tpfp8::" in name else
                "compiler-generated" if name.startswith("triton_") else
                "other" if "reduce_kernel" in name else "memset / copy")
        assert kind == want, name


def test_block_fused_layer_folds_its_skip_connections_as_it_adds_them():
    """bench/block.py's fused layer with its residual adds folded into the layers against its
    adds run apart (the main form): the same step, to bf16 rounding."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import block
    import tpfp8
    torch.manual_seed(0)
    layer = block.DecoderLayer(*block.SIZES["tiny"], 16, "cpu")
    outs = []
    for fold in (True, False):
        fused = layer.fused(fold_residual=fold)
        x = torch.randn(32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        with tpfp8.fp8_autocast(recipe=tpfp8.DelayedScaling()):
            y = fused(x)
        (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
        outs.append((y.detach().float(), x.grad.float()))
    for a, b in zip(*outs):
        assert float((a - b).norm() / b.norm()) < 1e-2
