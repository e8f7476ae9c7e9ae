"""The GPU benchmarks' sizes follow the device's memory (run on CPU: the choices are functions of the free memory):
check_gpu.py's model cases, and the trainer benchmarks' reading of what `--fit auto` changed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_cli import _args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import check_gpu
from benchmarks.harness import fit_auto_change

GB, GIB = 10**9, 2**30


@pytest.mark.parametrize(
    "free, kind, experts",
    [
        (139 * GIB, "fp8", 32),  # an H200: every case as it is
        (139 * GIB, "bf16", 32),
        (79 * GIB, "bf16", 32),  # an H100: the bf16 check fits, ~47 GiB
        (79 * GIB, "fp8", 16),  # ... its FP8 large case did not: half the experts
        (30 * GIB, "fp8", 8),
        (6 * GIB, "fp8", None),  # not even at E = K = 8: skipped
    ],
)
def test_check_gpu_sizes_the_large_case_to_the_free_memory(free, kind, experts):
    case, change = check_gpu.fit_case("large_model", check_gpu.CASES["large_model"], free, kind)
    T, H, F, E, K, capacity, routing = check_gpu.CASES["large_model"]
    budget = check_gpu.FREE_FRACTION * (free - check_gpu.POISON_BYTES)
    if experts is None:
        assert (
            case is None and change.startswith("skipped: needs") and check_gpu.case_bytes(T, H, F, K, K, kind) > budget
        )
        return
    assert case == (T, H, F, experts, K, capacity, routing)
    assert check_gpu.case_bytes(T, H, F, experts, K, kind) <= budget
    if experts < E:  # the largest power-of-two cut that fits
        assert check_gpu.case_bytes(T, H, F, 2 * experts, K, kind) > budget and f"E {E} -> {experts}" in change
    else:
        assert change == ""
    # the bytes per weight element the estimate rests on: the FP8 check needs more than 78 GiB at E = 32 (it ran out
    # of memory on an 80 GB card) and at most 141 GB (it passed on an H200); the bf16 check ~45 GiB at E = 32
    weights = 32 * H * F
    assert 78 * GIB < check_gpu.BYTES_PER_EXPERT_WEIGHT["fp8"] * weights <= 141 * GB
    assert abs(check_gpu.BYTES_PER_EXPERT_WEIGHT["bf16"] * weights / GIB - 45) < 2


def test_small_cases_are_never_resized():
    for name, case in check_gpu.CASES.items():
        if name not in check_gpu.MODEL_CASES:
            assert check_gpu.fit_case(name, case, 2 * GIB, "fp8") == (case, "")


def test_the_benchmarks_read_what_fit_auto_changed(monkeypatch):
    """From the header line the trainer itself prints (an injected free memory makes --fit auto change the run)."""
    from xmoe.plan import fit
    from xmoe.train import preflight
    from xmoe.train.cli import build_run_config

    run = build_run_config(_args("--batch-size", "32", "--seq-len", "256"))
    free = fit.predict_train_peak(run, "cpu") * 0.8
    changed, line = preflight.check_train(run, torch.device("cpu"), "auto", free=free)
    assert changed is not run and line is not None
    expected = {"micro_batch_size": str(changed.train.micro_batch_size)}
    if changed.train.recompute != run.train.recompute:
        expected["recompute"] = changed.train.recompute
    assert fit_auto_change(f"xmoe train: ...\n{line}\nwriting to runs/x/") == expected
    assert fit_auto_change("memory: planned peak 1.00 GiB of 8.00 GiB of host memory available") == {}


def test_bench_train_baseline_is_named_by_its_own_checkout(tmp_path):
    """bench_train --baseline: the commit is the baseline checkout's own HEAD (never that of a repository the folder
    merely lies inside, which would label the baseline with this checkout's commit), else --baseline-commit, and
    --fit is passed only to an xmoe whose `train` has it."""
    import subprocess

    from benchmarks.bench_train import baseline_source

    inside = tmp_path / "repo" / "copy"
    (inside / "xmoe" / "train").mkdir(parents=True)
    (inside / "xmoe" / "train" / "cli.py").write_text('parser.add_argument("--steps")\n')
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path / "repo")]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    assert baseline_source(str(inside)) == {"dir": str(inside), "commit": "unknown", "fits": False}
    assert baseline_source(str(inside), "abc1234")["commit"] == "abc1234"
    (inside / "xmoe" / "train" / "cli.py").write_text('parser.add_argument(\n    "--fit",\n)\n')
    subprocess.run(["git", "-C", str(inside), "init", "-q"], check=True)
    subprocess.run([*git[:-2], "-C", str(inside), "commit", "-q", "--allow-empty", "-m", "own"], check=True)
    own = subprocess.run(["git", "-C", str(inside), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert baseline_source(str(inside)) == {"dir": str(inside), "commit": own.stdout.strip(), "fits": True}
