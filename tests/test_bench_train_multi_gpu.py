"""Smoke test of benchmarks/bench_train_multi_gpu.py on 4 gloo ranks, tiny preset: both modes run end to end,
rows carry TFLOP/s under both formulas, and an OOM raised on ONE rank stops the micro-batch search on ALL ranks
(the agreement the GPU run relies on; the fake OOM comes after the step's collectives, see --fake-oom)."""

import json
import os
import sys
from pathlib import Path

from dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--cpu", "--variants", "32x2", "--warmup", "1", "--iters", "2", "--target-s", "0.01"]


def _body(rank, world_size, out, argv):
    sys.path.insert(0, str(ROOT))
    os.environ["XMOE_RESULTS_DIR"] = out  # rank 0 writes train_multi_gpu_<mode>.json / .md here
    from benchmarks import bench_train_multi_gpu

    bench_train_multi_gpu.main(argv)


def _rows(out, mode):
    return json.loads((Path(out) / f"train_multi_gpu_{mode}.json").read_text())["rows"]


def test_table_mode_agrees_on_a_one_rank_oom(tmp_path):
    argv = FAST + ["--micro-batches", "1", "2", "4", "--fake-oom", "1", "2"]
    run_distributed(_body, 4, str(tmp_path), argv, timeout_s=90)
    rows = _rows(tmp_path, "table")
    seen = [(r["method"], r["micro_batch"], r["status"]) for r in rows]
    # rank 1 alone "ran out of memory" at mb 2: every rank stopped there, for both methods
    assert seen == [("xmoe", 1, "ok"), ("xmoe", 2, "OOM"), ("padded", 1, "ok"), ("padded", 2, "OOM")]
    xmoe, padded = rows[0], rows[2]
    assert (xmoe["ep"], xmoe["dp"], padded["ep"], padded["dp"]) == (4, 1, 4, 1)  # both expert-parallel
    for r in (xmoe, padded):
        assert r["tflops"] > 0 and r["paper_tflops"] > 0 and r["ms_step_max"] >= r["ms_step"] > 0
    assert xmoe["kept_rows_frac"] == 1.0  # dropless
    assert 0 < padded["kept_rows_frac"] < 1.0  # capacity factor 1.25 drops slots
    md = (tmp_path / "train_multi_gpu_table.md").read_text()
    assert "| 32x2 | xmoe | 4 | 1 | 1 | 1 | ok |" in md and "OOM" in md


def test_ssmb_mode_tp2_x_ep2(tmp_path):
    run_distributed(_body, 4, str(tmp_path), FAST + ["--mode", "ssmb", "--micro-batches", "2"], timeout_s=90)
    rows = _rows(tmp_path, "ssmb")
    assert [(r["method"], r["tp"], r["ep"], r["status"]) for r in rows] == [
        ("tp2-ssmb", 2, 2, "ok"),
        ("tp2-nossmb", 2, 2, "ok"),
    ]
    assert all(r["tflops"] > 0 for r in rows)


def test_overlap_mode_runs_off_and_the_planners_choice(tmp_path):
    run_distributed(_body, 4, str(tmp_path), FAST + ["--mode", "overlap", "--micro-batches", "1"], timeout_s=90)
    rows = _rows(tmp_path, "overlap")
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_train_multi_gpu import model_config
    from benchmarks.multi_gpu_overlap import resolve
    from xmoe.plan.step_time import choose_ep_overlap
    from xmoe.train.run_config import CPU_TFLOPS

    cfg, seq = model_config("tiny", "32x2", "pft", None)
    # the planner's own choice for this layout (EP = 4 ranks on one node, one micro-batch of 32 tokens a rank)
    chosen = choose_ep_overlap(cfg, gpus=4, ep=4, gpus_per_node=4, tokens_per_gpu=seq, tflops=CPU_TFLOPS)
    assert resolve(cfg, "auto", (1, 4, 1), 1, seq, "cpu") == chosen
    assert [(r["method"], r["ep"], r["overlap"], r["status"]) for r in rows] == [
        ("xmoe", 4, "off", "ok"),
        ("xmoe-auto", 4, chosen, "ok"),
    ]
    off, auto = rows
    assert auto["tokens_per_s_gpu"] == auto["tokens_per_s"] / 4 and "pred_ms" not in off
    assert auto["pred_ms"] > 0 and auto["pred_err"] == auto["ms_step"] / auto["pred_ms"] - 1
