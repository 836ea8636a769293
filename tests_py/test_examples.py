"""The examples under examples/ run as a user would run them (tiny configs, CPU)."""
import os
import runpy
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load(name):
    return runpy.run_path(os.path.join(EXAMPLES, name), run_name="example")


def test_hf_llama_fp8_trains_saves_reloads_and_generates(capsys):
    pytest.importorskip("transformers", reason="transformers not installed")
    example = load("hf_llama_fp8.py")
    losses, text = example["main"](["--steps", "8", "--device", "cpu"])
    assert losses[-1] < losses[0] - 0.5, losses  # it learns (FP8, checkpointed)
    assert text.startswith("def ") and len(text) > len("def ")
    out = capsys.readouterr().out
    assert "FP8 state of 14 layers" in out  # 2 layers x 7 Linears, the LM head left out


def test_examples_have_help(monkeypatch, capsys):
    pytest.importorskip("transformers", reason="transformers not installed")
    for name in sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".py")):
        example = load(name)
        monkeypatch.setattr(sys, "argv", [name, "--help"])
        with pytest.raises(SystemExit) as exit_:
            example["main"]()
        assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out
