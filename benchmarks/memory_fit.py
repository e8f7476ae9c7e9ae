"""Peak GPU memory of `xmoe train` per recompute mode and micro-batch, beside `xmoe plan memory`'s prediction.

    python benchmarks/memory_fit.py --layers 8 --micro-batches 8 16 32 64 --results benchmarks/results/plan
    python benchmarks/memory_fit.py --preflight --results benchmarks/results/plan  # the pre-flight at 2, 4 and 8 layers

Builds the trainer once (small preset shape, seq 2048, compiled regions as on any GPU by default), runs one real
optimizer step per (recompute mode, micro-batch) with that micro-batch as the whole per-rank batch, and reads
torch.cuda.max_memory_allocated over the step; a micro-batch that does not fit is reported as such. Each row also
holds the planner's estimate for the same layout (xmoe.plan.trainer_memory.estimate_trainer_memory) and their ratio.
Writes memory_fit.json / .md into --results. Skips without a GPU; the first micro-batch must fit (else: skipped, said).

--preflight: `xmoe train --preset small --set model.num_layers=N --fit auto` (the paper presets' batch of 8 sequences
of 2048 tokens, 3 steps) as its own process for each N of --preflight-layers (default 2 4 8), its peak
(torch.cuda.max_memory_allocated, the trainer's metrics) beside the memory pre-flight's prediction for the run as it
ran (xmoe.plan.fit.predict_train_peak, with the micro-batch or recompute --fit auto chose on this GPU); the target is
within 5%. Writes memory_fit_preflight.json / .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

GIB = 2**30


def main() -> None:
    from benchmarks.harness import commit, commit_line, parse_trainer_args
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
    p.add_argument("--preflight", action="store_true", help="compare the pre-flight's prediction with `xmoe train`")
    p.add_argument("--preflight-layers", type=int, nargs="+", default=[2, 4, 8], help="with --preflight")
    args = parse_trainer_args(p, sys.argv[1:])
    if not torch.cuda.is_available():
        print("memory_fit: skipped, no CUDA GPU")
        return
    if args.preflight:
        preflight(args.preflight_layers, args.results)
        return
    first = min(args.micro_batches)
    args.batch_size, args.micro_batch_size, args.steps = first, first, 1000
    run = build_run_config(args)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(run, out, device="cuda")
        try:
            trainer.train_step(trainer.accumulation_steps())  # optimizer state exists from here on, as in training
        except torch.OutOfMemoryError:
            print(f"memory_fit: skipped, micro-batch {first} does not fit this GPU at {args.layers} layers")
            return
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
            **commit(),
        }
        (folder / "memory_fit.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = [
            f"# xmoe train peak memory vs xmoe plan memory, {args.layers} layers, small preset shape, seq 2048",
            "",
            f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}",
            "",
            commit_line(meta),
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


def preflight_argv(layers: int) -> list[str]:
    """`xmoe train`'s flags of a --preflight run: the small shape at ``layers`` layers as a user would start it."""
    return ["--preset", "small", "--set", f"model.num_layers={layers}", "--steps", "3", "--log-every", "1"] + [
        "--ckpt-every",
        "0",
        "--fit",
        "auto",
    ]


def predicted_as_run(argv: list[str], header: str) -> float:
    """The pre-flight's prediction (bytes) for the run ``argv`` as it ran: with the change --fit auto made, which
    its ``header`` (standard output) names."""
    from benchmarks.harness import fit_auto_change
    from xmoe.plan.fit import predict_train_peak
    from xmoe.train.cli import add_arguments, build_run_config

    change = fit_auto_change(header)
    flags = [x for key, value in change.items() for x in (f"--{key.replace('_', '-')}", value)]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return predict_train_peak(build_run_config(parser.parse_args([*argv, *flags])), "cuda")


def preflight(layers_list: list[int], results: str | None) -> None:
    from benchmarks.harness import environment, fit_auto_change, markdown_table, run_xmoe_train_output, write_results

    rows = []
    for layers in layers_list:
        argv = preflight_argv(layers)
        records, command, wall, error, output = run_xmoe_train_output(*argv)
        row = {"layers": layers, "fit": " ".join(f"{k}={v}" for k, v in fit_auto_change(output).items())}
        row["command"] = command
        row["predicted_gib"] = predicted_as_run(argv, output) / GIB
        if records is None:
            rows.append(row | {"error": error.strip().splitlines()[-1] if error.strip() else "failed"})
        else:
            row["measured_gib"] = max(r["mem_bytes"] for r in records) / GIB
            rows.append(row | {"predicted_over_measured": row["predicted_gib"] / row["measured_gib"], "wall_s": wall})
        print(json.dumps(rows[-1]), flush=True)
    columns = ["layers", "fit", "measured_gib", "predicted_gib", "predicted_over_measured", "wall_s", "error"]
    if results:
        import os

        from benchmarks.harness import RESULTS_ENV

        os.environ[RESULTS_ENV] = results
        write_results(
            "memory_fit_preflight",
            rows,
            columns,
            environment(),
            "xmoe train's memory pre-flight against its measured peak, small shape, batch 8 x seq 2048",
            notes="The rows' commands are in memory_fit_preflight.json; predicted: xmoe.plan.fit.predict_train_peak "
            "of the run as --fit auto left it (a refusal is the pre-flight's own line).",
            topic="plan",
        )
    print(markdown_table(rows, columns))


if __name__ == "__main__":
    main()
