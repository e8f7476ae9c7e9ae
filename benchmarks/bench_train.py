"""Whole-model training throughput on one GPU: `xmoe train` cases side by side in one run.

    python benchmarks/bench_train.py                          # the standard set of cases (below)
    python benchmarks/bench_train.py --cases moe8_b64_compiled dense8_b64_compiled --steps 12

Each case runs as its own `xmoe train` process (fresh allocator, no checkpoints) on the embedded corpus, small
preset shape (hidden 2048, 64 experts of width 1408, top-6, seq 2048). The numbers are the trainer's own metrics
(xmoe's FLOP formula over the tokens actually routed, MFU against the device's bf16 peak), averaged over the
logged windows after the first (which holds compilation and warm-up); the peak memory is the trainer's
torch.cuda.max_memory_allocated. "dense" is the model of equal active FLOPs: every layer a dense SwiGLU of width
top_k x 1408 = 8448. A case the memory pre-flight predicts will not fit this GPU runs with `--fit auto`'s change
(a smaller micro-batch, the global batch kept; the row's "fit" says so). Writes bench_train.json / .md into --out.
Skips without a GPU.

--baseline DIR runs every case a second time, just before this checkout's run, with the xmoe of another checkout
(e.g. `git worktree add DIR COMMIT`): the same call on the same GPU, so a change's effect on the whole model is read
from one file (the rows' "vs_baseline": this checkout's tokens/s over the baseline's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import (
    RESULTS_ENV,
    environment,
    fit_auto_change,
    markdown_table,
    results_dir,
    run_xmoe_train_output,
    write_results,
)

DENSE = ["--set", "model.first_k_dense={layers}", "--set", "model.ffn_hidden_size=8448"]


def _case(layers: int, batch: int, micro: int, *extra: str) -> dict:
    return {"layers": layers, "batch": batch, "micro": micro, "extra": list(extra)}


CASES = {
    # 4 layers, global batch 8
    "moe4_b8_eager": _case(4, 8, 4, "--compile", "off"),
    "moe4_b8_compiled": _case(4, 8, 4, "--compile", "on"),
    "moe4_b8_compiled_mb8": _case(4, 8, 8, "--compile", "on"),
    "moe4_b8_compiled_mb8_fp8": _case(4, 8, 8, "--compile", "on", "--fp8", "experts"),
    "moe4_b8_compiled_mb8_wgrad_grouped_mm": _case(4, 8, 8, "--compile", "on", "--wgrad", "grouped_mm"),
    "moe4_b8_compiled_mb8_fp8_wgrad_grouped_mm": _case(
        4, 8, 8, "--compile", "on", "--fp8", "experts", "--wgrad", "grouped_mm"
    ),
    "moe4_b8_compiled_mb8_torch_adamw": _case(4, 8, 8, "--compile", "on", "--optimizer", "torch"),
    # --autotune: every tile candidate timed at each new shape class (in the first, unaveraged window)
    "moe4_b8_compiled_mb8_autotune": _case(4, 8, 8, "--compile", "on", "--autotune"),
    "moe4_b8_compiled_mb8_fp8_autotune": _case(4, 8, 8, "--compile", "on", "--fp8", "experts", "--autotune"),
    # 4 layers, global batch 64 (fits an 80 GB card; 8 layers with fp32 AdamW do not)
    "moe4_b64_compiled_mb16": _case(4, 64, 16, "--compile", "on"),
    "moe4_b64_compiled_mb16_fp8": _case(4, 64, 16, "--compile", "on", "--fp8", "experts"),
    "dense4_b64_compiled_mb16": _case(4, 64, 16, "--compile", "on", *DENSE),
    # 8 layers, global batch 32 and 64
    "moe8_b32_compiled": _case(8, 32, 4, "--compile", "on"),
    "moe8_b64_eager": _case(8, 64, 8, "--compile", "off"),
    "moe8_b64_compiled": _case(8, 64, 8, "--compile", "on"),
    "moe8_b64_compiled_mb16": _case(8, 64, 16, "--compile", "on"),
    "moe8_b64_compiled_mb16_fp8": _case(8, 64, 16, "--compile", "on", "--fp8", "experts"),
    "moe8_b64_compiled_mb16_fp8_wgrad": _case(8, 64, 16, "--compile", "on", "--fp8", "experts", "--wgrad", "fp8"),
    "moe8_b64_compiled_mb16_wgrad_grouped_mm": _case(8, 64, 16, "--compile", "on", "--wgrad", "grouped_mm"),
    "moe8_b64_compiled_mb16_fp8_wgrad_grouped_mm": _case(
        8, 64, 16, "--compile", "on", "--fp8", "experts", "--wgrad", "grouped_mm"
    ),
    "moe8_b64_compiled_mb16_autotune": _case(8, 64, 16, "--compile", "on", "--autotune"),
    "moe8_b64_compiled_mb16_fp8_autotune": _case(8, 64, 16, "--compile", "on", "--fp8", "experts", "--autotune"),
    "moe8_b64_compiled_mb32": _case(8, 64, 32, "--compile", "on"),
    "moe8_b64_compiled_torch": _case(8, 64, 8, "--compile", "on", "--kernel-backend", "torch"),
    "moe8_b64_compiled_moe_recompute": _case(8, 64, 8, "--compile", "on", "--recompute", "moe"),
    "moe8_b64_compiled_full_recompute": _case(8, 64, 8, "--compile", "on", "--recompute", "full"),
    "moe8_b64_compiled_full_recompute_mb16": _case(8, 64, 16, "--compile", "on", "--recompute", "full"),
    "dense8_b64_eager": _case(8, 64, 8, "--compile", "off", *DENSE),
    "dense8_b64_compiled": _case(8, 64, 8, "--compile", "on", *DENSE),
    "dense8_b64_compiled_mb16": _case(8, 64, 16, "--compile", "on", *DENSE),
}


def run_case(name: str, args: argparse.Namespace, source: str | None = None, fits: bool = True) -> dict:
    """One case with this checkout's xmoe, or with the one in ``source``; ``fits``: whether that xmoe has the memory
    pre-flight's --fit (a baseline older than it runs the case as given)."""
    case = CASES[name]
    extra = [e.format(layers=case["layers"]) for e in case["extra"]]
    fit = ["--fit", "auto"] if fits else []  # a case larger than this GPU runs at the micro-batch the planner finds
    records, command, wall, error, output = run_xmoe_train_output(
        "--preset",
        "small",
        "--set",
        f"model.num_layers={case['layers']}",
        "--seq-len",
        "2048",
        "--batch-size",
        str(case["batch"]),
        "--micro-batch-size",
        str(case["micro"]),
        "--steps",
        str(args.steps),
        "--log-every",
        str(max(1, args.steps // 3)),
        "--ckpt-every",
        "0",
        *fit,
        *extra,
        source=source,
    )
    change = fit_auto_change(output)
    row = {
        "case": name,
        "code": "this" if source is None else "baseline",
        "layers": case["layers"],
        "batch": case["batch"],
        "micro": int(change.get("micro_batch_size", case["micro"])),
        "fit": " ".join(f"{k}={v}" for k, v in change.items()),
        "command": command,
        "wall_s": wall,
    }
    if records is None:
        return {**row, "error": error}
    timed = records[1:] or records

    def mean(key):
        return sum(r[key] for r in timed) / len(timed)

    return {
        **row,
        "tokens_per_s": mean("tokens_per_s"),
        "tflops": mean("tflops"),
        "mfu_pct": 100 * mean("mfu"),
        "peak_mem_gib": max(r["mem_bytes"] for r in records) / 2**30,
        "loss": records[-1]["loss"],
    }


def baseline_source(folder: str, commit: str | None = None) -> dict:
    """The baseline checkout: its folder, its commit (``commit`` where given, else git's HEAD there when it is a
    checkout of its own, not a folder inside another) and whether its `xmoe train` has --fit."""
    import subprocess

    found = ""
    if commit is None:
        git = ["git", "-C", folder, "rev-parse", "--show-toplevel", "--short", "HEAD"]
        done = subprocess.run(git, capture_output=True, text=True)
        lines = done.stdout.split() if done.returncode == 0 else []
        if len(lines) == 2 and Path(lines[0]).resolve() == Path(folder).resolve():
            found = lines[1]
    cli = Path(folder, "xmoe", "train", "cli.py")
    return {
        "dir": folder,
        "commit": commit or found or "unknown",
        "fits": cli.is_file() and '"--fit"' in cli.read_text(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases",
        nargs="+",
        default=list(CASES),
        choices=list(CASES),
        metavar="CASE",
        help=f"which cases (default all): {', '.join(CASES)}",
    )
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per case (default 12)")
    p.add_argument(
        "--out", default=str(results_dir("train")), help="results directory (default benchmarks/results/train)"
    )
    p.add_argument("--stem", default="bench_train", help="results file name without extension (default bench_train)")
    p.add_argument("--baseline", metavar="DIR", help="another checkout of xmoe to run each case with too, same call")
    p.add_argument("--baseline-commit", help="the baseline's commit, where DIR has no git history")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_train: skipped, no CUDA GPU")
        return
    if args.baseline and not Path(args.baseline, "xmoe", "__main__.py").is_file():
        p.error(f"--baseline {args.baseline}: no xmoe package there (expected {args.baseline}/xmoe/__main__.py)")
    baseline = baseline_source(args.baseline, args.baseline_commit) if args.baseline else None
    rows = []
    for name in args.cases:
        if baseline is not None:
            rows.append(run_case(name, args, baseline["dir"], baseline["fits"]))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "command"}), flush=True)
        rows.append(run_case(name, args))
        if baseline is not None and "tokens_per_s" in rows[-1] and "tokens_per_s" in rows[-2]:
            rows[-1]["vs_baseline"] = rows[-1]["tokens_per_s"] / rows[-2]["tokens_per_s"]
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "command"}), flush=True)
    columns = [
        "case",
        *(["code"] if baseline else []),
        "layers",
        "batch",
        "micro",
        "fit",
        "tokens_per_s",
        "tflops",
        "mfu_pct",
        "peak_mem_gib",
        "loss",
        "wall_s",
        *(["vs_baseline"] if baseline else []),
        "error",
    ]
    notes = (
        "Per row: the command in bench_train.json; tflops: xmoe's formula; averages over the logged "
        "windows after the first; fit: what `--fit auto` changed for the case to fit this GPU (micro: the one run)."
    )
    if baseline:
        notes += f" Baseline: the xmoe of commit {baseline['commit']}, run just before this checkout's, case by case."
    os.environ[RESULTS_ENV] = args.out
    write_results(
        args.stem,
        rows,
        columns,
        environment(),
        "xmoe train on one GPU, small preset shape, seq 2048",
        notes=notes,
        topic="train",
    )
    print(markdown_table(rows, columns))


if __name__ == "__main__":
    main()
