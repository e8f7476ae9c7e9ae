"""benchmarks/loss_parity.py's summary figures against a direct loop, and its .md written again from a saved .json
(the path a user takes to re-read a GPU run on a CPU machine)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.loss_parity import LATE, WINDOW, summary  # noqa: E402


def _curves(steps):
    rng = random.Random(0)
    ref = [2.0 + 8.0 / (1 + i) + rng.uniform(-0.01, 0.01) for i in range(steps)]
    new = [r * (1 + rng.uniform(-0.004, 0.004)) for r in ref]
    for i in range(120, min(126, steps)):  # a lasting excursion of the second run: 3% high for 6 steps
        new[i] = ref[i] * 1.03
    return ref, new


def test_summary_matches_a_direct_loop():
    ref, new = _curves(200)
    s = summary(ref, new)
    rel = [abs(n - r) / r for r, n in zip(ref, new, strict=True)]
    assert (
        s["max"] == pytest.approx(max(rel)) and s["max_step"] == rel.index(max(rel)) + 1 and 121 <= s["max_step"] <= 126
    )
    assert s["late_over_1pct"] == 6
    assert s["late_signed_mean"] == pytest.approx(
        sum((n - r) / r for r, n in zip(ref[LATE:], new[LATE:], strict=True)) / 150
    )
    best = (0.0, 0)
    for i in range(LATE, 200 - WINDOW + 1):
        a, b = sum(ref[i : i + WINDOW]), sum(new[i : i + WINDOW])
        best = max(best, (abs(b - a) / a, i + 1))
    assert s["window_max"] == pytest.approx(best[0])
    assert s["window_steps"] == (best[1], best[1] + WINDOW - 1)
    assert 0.01 < s["window_max"] < 0.03  # six of ten steps 3% high, the rest within 0.4%


def test_short_runs_have_no_late_figures_and_unequal_runs_are_refused():
    ref, new = _curves(LATE + WINDOW)
    assert "late_max" not in summary(ref, new)
    with pytest.raises(ValueError, match="same steps"):
        summary(ref, new[:-1])


def test_from_json_writes_the_markdown(tmp_path):
    ref, new = _curves(200)
    meta = {"date": "d", "gpu": "g", "torch": "t", "command": "c", "peak_mem_gib": {"bf16": 1.0, "fp8": 1.0}}
    saved = tmp_path / "loss_parity_fp8.json"
    saved.write_text(json.dumps({"meta": meta, "bf16": ref, "fp8": new}))
    out = tmp_path / "md"
    script = ROOT / "benchmarks" / "loss_parity.py"
    subprocess.run([sys.executable, str(script), "--from-json", str(saved), "--out", str(out)], check=True)
    text = (out / "loss_parity_fp8.md").read_text()
    assert "6 steps over 1%" in text and "| 125 |" in text
    missing = subprocess.run(
        [sys.executable, str(script), "--from-json", str(tmp_path / "none.json")], text=True, capture_output=True
    )
    assert missing.returncode != 0 and "no such file" in missing.stderr
