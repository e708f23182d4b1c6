"""The product benchmarks run end to end at their ``--tiny`` size on the CPU: each checks its
providers against its reference before timing (``bench/generate.py``: every provider's prefill
and first step's logits against an fp32 reference; ``bench/qlora.py``: every provider's first loss
against the bf16 base's) and exits with an error where one is off, then writes a row per provider
(here into a temporary folder, ``FASTAF_BENCH_RESULTS``)."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, script: str, *args: str) -> list[dict]:
    env = {**os.environ, "FASTAF_BENCH_RESULTS": str(tmp_path)}
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--tiny", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = list(tmp_path.glob("*.csv"))
    assert len(files) == 1, files
    with files[0].open() as f:
        return list(csv.DictReader(f))


def test_the_generate_bench_checks_and_times_every_kind_of_provider(tmp_path):
    providers = ["fwd-base", "fwd-peft", "fwd-fastaf", "fwd-fastaf-init", "base", "peft", "fastaf", "fastaf-init",
                 "fastaf-mixed16", "peft-mixed16"]
    rows = _run(tmp_path, "generate.py", "--providers", ",".join(providers), "--repeats", "1")
    assert [r["provider"] for r in rows] == providers
    for r in rows:
        figure = float(r["ms"] or r["s"])
        assert math.isfinite(figure) and figure > 0, r
        if r["s"]:  # a generate provider: its logits were checked, within bf16's tolerance
            assert float(r["max_rel_err"]) <= 0.05 and float(r["tok_per_s"]) > 0, r
            assert r["adapters"] == ("16" if "mixed" in r["provider"] else "0" if r["provider"] == "base" else "1")


def test_the_qlora_bench_checks_and_times_peft_and_fastaf_over_a_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    providers = ["peft-bf16", "fastaf-bf16", "fastaf-qlora", "peft-qlora"]
    rows = _run(tmp_path, "qlora.py", "--providers", ",".join(providers))
    assert sorted(r["provider"] for r in rows) == sorted(providers)
    losses = {r["provider"]: float(r["loss0"]) for r in rows}
    for r in rows:
        assert float(r["ms"]) > 0 and r["quant"] == ("nf4-double" if "qlora" in r["provider"] else "bf16"), r
    # every adapter starts with B = 0: the first loss is the base's, the 4-bit base's within its quantization
    assert losses["fastaf-bf16"] == pytest.approx(losses["peft-bf16"], rel=1e-4)
    assert losses["fastaf-qlora"] == pytest.approx(losses["peft-qlora"], rel=1e-4)
    assert losses["fastaf-qlora"] == pytest.approx(losses["fastaf-bf16"], rel=0.02)
