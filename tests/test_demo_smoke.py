"""Smoke test of examples/counting.py: a few functional training steps and inference on a random Llama."""
import subprocess
import sys
from pathlib import Path

COUNTING = Path(__file__).resolve().parents[1] / "examples" / "counting.py"


def test_counting_example_runs_and_leaves_the_model_unchanged():
    out = subprocess.run([sys.executable, str(COUNTING), "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unchanged" in out.stdout
