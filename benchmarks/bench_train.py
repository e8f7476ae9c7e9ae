"""Whole-model training throughput on one GPU: `xmoe train` on a small-shaped model, per kernel backend.

    python benchmarks/bench_train.py                       # small preset, 4 layers, seq 2048, 30 steps
    python benchmarks/bench_train.py --layers 8 --steps 40

Each backend runs as its own `xmoe train` process (fresh allocator, no checkpoints) on the embedded corpus;
the numbers are the trainer's own metrics (xmoe's FLOP formula, MFU against the device's bf16 peak), averaged
over the logged windows after the first (which holds compilation and warm-up). Writes bench_train.json / .md
under $XMOE_RESULTS_DIR (else benchmarks/results/). Skips without a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import environment, markdown_table, write_results  # noqa: E402


def run_backend(backend: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "xmoe", "train", "--preset", "small", "--set", f"model.num_layers={args.layers}",
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--micro-batch-size",
               str(args.micro_batch_size), "--steps", str(args.steps), "--log-every", str(args.steps // 3),
               "--ckpt-every", "0", "--kernel-backend", backend, "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            return {"backend": backend, "error": proc.stderr[-2000:]}
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()][1:]
    def mean(key):
        return sum(r[key] for r in records) / len(records)
    return {"backend": backend, "tokens_per_s": mean("tokens_per_s"), "tflops": mean("tflops"),
            "paper_tflops": mean("paper_tflops"), "mfu": mean("mfu"), "peak_mem_gib": records[-1]["mem_bytes"] / 2**30,
            "final_loss": records[-1]["loss"], "command": " ".join(cmd[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--backends", nargs="+", default=["triton", "torch"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_train: skipped, no CUDA GPU")
        return
    rows = [run_backend(b, args) for b in args.backends]
    for r in rows:
        if "mfu" in r:
            r["mfu_pct"] = 100 * r["mfu"]
    columns = ["backend", "tokens_per_s", "tflops", "paper_tflops", "mfu_pct", "peak_mem_gib", "final_loss", "error"]
    write_results("bench_train", rows, columns, environment(),
                  f"xmoe train, small preset with {args.layers} layers, seq {args.seq_len}, batch {args.batch_size}",
                  notes=f"Per row: `python {rows[0].get('command', '')}` (backend varies); tflops: xmoe's formula, "
                        "paper_tflops: the paper's; averages over the logged windows after the first.")
    print(markdown_table(rows, columns))

if __name__ == "__main__":
    main()
