"""Peak GPU memory of `xmoe train` per recompute mode and micro-batch, beside `xmoe plan memory`'s prediction.

    python benchmarks/memory_fit.py --layers 8 --micro-batches 8 16 32 64 --out results/

Builds the trainer once (small preset shape, seq 2048, compiled regions as on any GPU by default), runs one real
optimizer step per (recompute mode, micro-batch) with that micro-batch as the whole per-rank batch, and reads
torch.cuda.max_memory_allocated over the step; a micro-batch that does not fit is reported as such. Each row also
holds the planner's estimate for the same layout (xmoe.plan.trainer_memory.estimate_trainer_memory) and their ratio.
Writes memory_fit.json / .md into --out. Skips without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

GIB = 2**30


def main() -> None:
    from benchmarks.harness import parse_trainer_args
    from xmoe.config import RECOMPUTE_MODES
    from xmoe.parallel.regions import apply_recompute
    from xmoe.plan.trainer_memory import estimate_trainer_memory
    from xmoe.train.cli import build_run_config
    from xmoe.train.loader import TokenLoader
    from xmoe.train.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--modes", nargs="+", default=list(RECOMPUTE_MODES))
    p.add_argument("--results", help="directory for memory_fit.json / .md")
    args = parse_trainer_args(p, sys.argv[1:])
    if not torch.cuda.is_available():
        print("memory_fit: skipped, no CUDA GPU")
        return
    first = min(args.micro_batches)
    args.batch_size, args.micro_batch_size, args.steps = first, first, 1000
    run = build_run_config(args)
    rows = []
    with tempfile.TemporaryDirectory() as out, contextlib.ExitStack() as stack:
        trainer = Trainer(run, out, device="cuda")
        stack.enter_context(trainer.kernels.applied())  # the run's kernels section, as Trainer.train applies it
        trainer.train_step(trainer.accumulation_steps())  # optimizer state exists from here on, as in training
        for mode in args.modes:
            apply_recompute(trainer.model, mode)
            for mb in sorted(args.micro_batches):
                trainer.loader = TokenLoader(trainer.dataset, mb)
                trainer.local_batch = trainer.micro_batch = mb
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                row = {"recompute": mode, "micro_batch": mb, "state_gib": base / GIB}
                try:
                    start = time.perf_counter()
                    trainer.train_step(trainer.accumulation_steps())
                    torch.cuda.synchronize()
                    row["step_s"] = time.perf_counter() - start
                    row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                except torch.OutOfMemoryError:
                    row["peak_gib"] = None
                    row["fits"] = False
                    trainer.optimizer.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                else:
                    row["fits"] = True
                est = estimate_trainer_memory(
                    run.model, micro_batch=mb, seq_len=run.train.seq_len, recompute=mode, compiled=trainer.compiled
                )
                row["predicted_gib"] = est.total / GIB
                if row["peak_gib"]:
                    row["predicted_over_measured"] = row["predicted_gib"] / row["peak_gib"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.results:
        folder = Path(args.results)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "command": "python " + " ".join(sys.argv),
        }
        (folder / "memory_fit.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = [
            f"# xmoe train peak memory vs xmoe plan memory, {args.layers} layers, small preset shape, seq 2048",
            "",
            f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}",
            "",
            f"`{meta['command']}`",
            "",
            "| recompute | micro-batch | measured peak GiB | predicted GiB | predicted / measured | step s |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] else "out of memory"
            ratio = f"{r['predicted_over_measured']:.3f}" if r.get("predicted_over_measured") else "-"
            lines.append(
                f"| {r['recompute']} | {r['micro_batch']} | {peak} | {r['predicted_gib']:.1f} | {ratio} | "
                f"{r.get('step_s', 0):.2f} |"
            )
        (folder / "memory_fit.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
