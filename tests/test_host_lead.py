"""benchmarks/host_lead.py: its leads and phase sums against direct arithmetic, the samples it draws before a window
against the loader's own, and a CPU run whose phases add up to the measured step."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.host_lead import Marks, draw_ahead, instrumented, summarise  # noqa: E402
from xmoe.train.data import build_dataset  # noqa: E402
from xmoe.train.loader import TokenLoader  # noqa: E402


def test_summarise_against_direct_arithmetic():
    # two steps of (start, batch, forward): the GPU reaches each mark `lead` seconds after the host, then the end
    timed, host, leads = [], 0.0, [0.0, 0.002, 0.004, 0.010, 0.011, 0.0125]
    for i, name in enumerate(["start", "batch", "forward"] * 2):
        host += 0.001 * (i + 1)
        timed.append((name, host, host + leads[i]))
    timed.append(("start", host + 0.001, host + 0.001 + 0.0131))
    marks, phases = summarise(timed, window=2)
    by = {m["mark"]: m for m in marks}
    # leads over the marks from the second step's start on, in ms
    assert by["start"]["count"] == 2 and by["start"]["lead_ms"] == pytest.approx((10.0 + 13.1) / 2)
    assert by["start"]["min_lead_ms"] == pytest.approx(10.0)
    assert by["forward"]["lead_ms"] == pytest.approx(12.5) and by["batch"]["count"] == 1
    gpu = {p["phase"]: p["gpu_ms"] for p in phases}
    host_ms = {p["phase"]: p["host_ms"] for p in phases}
    assert host_ms["start -> batch"] == pytest.approx((2.0 + 5.0) / 2)  # host steps 2 ms then 5 ms, over 2 steps
    assert gpu["start -> batch"] == pytest.approx((4.0 + 6.0) / 2)  # on the GPU 4 ms then 6 ms
    # every phase together is the span from the first mark to the last, per step
    assert sum(gpu.values()) == pytest.approx((timed[-1][2] - timed[0][2]) * 1e3 / 2)


def test_samples_drawn_before_the_window_are_the_loaders_own():
    data = build_dataset("markov", 16, 64, seed=3)
    ref, probe = TokenLoader(data, 8), TokenLoader(data, 8)
    for _ in range(5):  # both mid-way through a draw of PREFETCH_ROWS rows
        next(ref)
        next(probe)
    expected = [next(ref) for _ in range(40)]  # the loader's own draws, before anything is patched
    drawn: dict = {}
    draw_ahead(probe, 40, drawn)
    trainer = SimpleNamespace(wrapped=lambda *a: None)
    marks = Marks(cuda=False)
    data.samples = lambda *a: pytest.fail("the dataset was drawn from inside the window")
    with instrumented(trainer, marks, drawn), marks.recording():
        for a, b in expected:
            c, d = next(probe)
            assert np.array_equal(a.numpy(), c.numpy()) and np.array_equal(b.numpy(), d.numpy())
            marks("start")
    assert [n for n, *_ in marks.timed] == ["batch", "start"] * 40
    assert TokenLoader._draw.__name__ == "_draw" and TokenLoader.__next__.__name__ == "__next__"  # restored


def test_cpu_run_phases_add_up_to_the_step(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "host_lead.py"),
        *("--preset", "tiny", "--layers", "1", "--seq-len", "32", "--batch-size", "16", "--micro-batch-size", "8"),
        *("--window", "3", "--warmup-steps", "1", "--compile", "off", "--results", str(tmp_path), "--tag", "t"),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp_path)
    result = json.loads((tmp_path / "host_lead_t.json").read_text())
    assert [w["window"] for w in result["windows"]] == [
        "loader as it is",
        "samples drawn before the window",
        "loader as it is, again",
    ]
    for w in result["windows"]:
        counts = {m["mark"]: m["count"] for m in w["marks"]}
        # after each window's first step: 2 steps of 2 micro-batches, and the window's closing start mark
        assert counts == {
            "start": 3,
            "batch": 4,
            "forward": 4,
            "backward": 4,
            "clipped": 2,
            "optimizer": 2,
            "finished": 2,
        }
        assert sum(p["gpu_ms"] for p in w["phases"]) == pytest.approx(w["wall_ms"], rel=0.05)
        assert w["marks_gpu_waited"] == len(w["marks"])  # on CPU the "GPU" is the host: every lead is zero
    assert "host lead t" in (tmp_path / "host_lead_t.md").read_text()
