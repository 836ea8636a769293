"""Does a captured training step still replay after something else ran in the process?

bench/common.graphed captures a step as torch's documentation shows (warm-up on a side stream,
capture on torch.cuda.graph's own stream), and the benchmarks go on to build more cases after
it; every later capture (torch.cuda.graph, reduce-overhead's CUDA-graph trees) starts with
torch.cuda.empty_cache(). A graph that uses memory its process has freed faults there
(illegal address) or, where the memory was handed out again, reads and writes another
tensor's bytes without a word.

This captures one CUDA-graph case of bench/compile.py's MLP block and replays it twice, then does
one thing: `empty_cache` (torch.cuda.empty_cache()) or another case of compile.py (built, and
three of its steps run); then replays it again. Each probe runs in a process of its own, since an
illegal address ends the process's CUDA context. A probe is "ok" when the last replay runs and
writes what the replay before the action wrote (output and gradients), bit for bit. The table
shows each probe's status; the exit status is 1 where any probe is not ok.

  python bench/graph_replay.py      # 3 cases x 2 actions (the defaults), hidden 4096
  python bench/graph_replay.py --cases "tpfp8 delayed cuda graph" --between empty_cache

The fortieth session's probes (the same steps, run by hand) found `tpfp8 delayed cuda graph`
and `tpfp8 fused delayed cuda graph` at hidden 4096 faulting after either action; see
bench/RESULTS.md.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = ["bf16 cuda graph", "tpfp8 delayed cuda graph", "tpfp8 fused delayed cuda graph"]
BETWEEN = ["empty_cache", "bf16 compile reduce-overhead"]
_RESULT = "graph_replay result: "  # the line a probe prints its JSON on


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated CUDA-graph cases of bench/compile.py to capture "
                             f"(default: {', '.join(CASES)})")
    parser.add_argument("--between", default=",".join(BETWEEN),
                        help="comma-separated: what runs between the two replays, 'empty_cache' "
                             "or a case of bench/compile.py (default: "
                             f"{', '.join(BETWEEN)})")
    parser.add_argument("--hidden", type=int, default=4096, help="MLP hidden size (default 4096)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens a step (default 8192)")
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds a probe may take before it is stopped (default 180)")
    parser.add_argument("--out", default="bench/out", help="folder for graph_replay.json")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.between = [b.strip() for b in args.between.split(",") if b.strip()]
    import compile as cb  # (after parsing: --help needs neither torch nor tpfp8)
    import torch
    names = [c[0] for c in cb.CASES]
    for case in args.cases:
        if case not in names or cb.CASES[names.index(case)][3] not in cb.GRAPHED:
            parser.error(f"--cases: {case!r} is not a CUDA-graph case of bench/compile.py; "
                         f"those are: {', '.join(n for n, *_, m in cb.CASES if m in cb.GRAPHED)}")
    for action in args.between:
        if action != "empty_cache" and action not in names:
            parser.error(f"--between: {action!r} is neither 'empty_cache' nor a case of "
                         f"bench/compile.py")
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a CUDA device, and none is visible")
    return args


def probe(case, action, hidden, tokens):
    """One probe, in this process: prints its result as JSON on a line of its own."""
    import torch

    import compile as cb
    from common import graphed

    cases = {c[0]: c for c in cb.CASES}
    torch.manual_seed(0)
    reference = cb.MLP(hidden, "cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def make(name):
        """(step, the tensors a step writes: output, then input and parameter gradients)."""
        c = cases[name]
        fn, model, recipe = cb.build(c, reference, "cuda")
        graph = c[3] in cb.GRAPHED
        x_in = x.detach().clone().requires_grad_() if graph else x
        step = cb.make_step(fn, model, recipe, x_in, dy, c[3] == "reduce-overhead")
        return (graphed(step) if graph else step), [x_in] + list(model.parameters())

    def report(status):
        print(_RESULT + json.dumps({"status": status}), flush=True)

    try:
        replay, leaves = make(case)
    except cb.Skip as exc:
        return report(f"skipped: {exc}")
    replay()  # (delayed scaling's scales settle: the same input every step, the same amaxes)
    y = replay()
    torch.cuda.synchronize()
    # Copies on the host: a copy on the device could take the very memory being probed.
    first = [t.cpu() for t in [y] + [leaf.grad for leaf in leaves]]
    if action == "empty_cache":
        torch.cuda.empty_cache()
    else:
        try:
            other, _ = make(action)
        except cb.Skip as exc:
            return report(f"skipped: {exc}")
        for _ in range(3):
            other()
        torch.cuda.synchronize()
    y = replay()
    torch.cuda.synchronize()
    second = [t.cpu() for t in [y] + [leaf.grad for leaf in leaves]]
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    report("ok" if same else "different bytes")


def run_probe(case, action, args):
    """A probe in a fresh process: its status, and seconds taken."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", "--cases", case, "--between",
           action, "--hidden", str(args.hidden), "--tokens", str(args.tokens)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout:.0f} s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])["status"], seconds
    errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error:" in ln]
    why = errors[-1].strip() if errors else proc.stderr.strip()[-200:]
    return f"failed (exit {proc.returncode}): {why[:200]}", seconds


def main(argv=None):
    args = parse_args(argv)
    if args.probe:
        probe(args.cases[0], args.between[0], args.hidden, args.tokens)
        return 0
    from common import device_name, print_table, save_json
    dev = device_name("cuda")
    print(f"{dev}: each CUDA-graph case captured, replayed, then replayed again after each "
          f"action (hidden {args.hidden}, {args.tokens} tokens; a process per probe)",
          flush=True)
    results = {case: {} for case in args.cases}
    for i, case in enumerate(args.cases):
        for j, action in enumerate(args.between):
            status, seconds = run_probe(case, action, args)
            results[case][action] = status
            print(f"  [{i * len(args.between) + j + 1}/{len(args.cases) * len(args.between)}] "
                  f"{case} / {action}: {status} ({seconds:.0f} s)", flush=True)
    print_table(["case \\ between the replays"] + args.between,
                [[case] + [results[case][a] for a in args.between] for case in args.cases])
    save_json(os.path.join(args.out, "graph_replay.json"),
              {"device": dev, "hidden": args.hidden, "tokens": args.tokens,
               "results": results})
    return 0 if all(s == "ok" for r in results.values() for s in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
