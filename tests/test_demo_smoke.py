"""Smoke test of examples/counting.py: a few functional training steps and inference on a random Llama."""
from pathlib import Path

from tests.test_examples import run_example

COUNTING = Path(__file__).resolve().parents[1] / "examples" / "counting.py"


def test_counting_example_runs_and_leaves_the_model_unchanged(capsys, monkeypatch):
    out = run_example(COUNTING, ["--steps", "3"], capsys, monkeypatch)
    assert "unchanged" in out
