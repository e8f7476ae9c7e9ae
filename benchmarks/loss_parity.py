"""Losses of `xmoe train` with and without the compiled regions, step by step, on one GPU.

    python benchmarks/loss_parity.py --steps 50 --out results/

Two runs of the same seed and data (small preset shape, 4 layers, seq 2048, batch 8 in one micro-batch), eager
(`--compile off`) and compiled (`--compile on`), every step logged. bf16 autocast rounds differently when the
compiler fuses or reorders work, so the two runs drift apart by rounding noise; the table shows each step's
relative difference and the largest. Writes loss_parity.json / .md into --out. Skips without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import run_xmoe_train


def losses(mode: str, steps: int) -> list[float]:
    records, command, _, error = run_xmoe_train(
        "--preset",
        "small",
        "--set",
        "model.num_layers=4",
        "--seq-len",
        "2048",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "8",
        "--steps",
        str(steps),
        "--log-every",
        "1",
        "--ckpt-every",
        "0",
        "--compile",
        mode,
    )
    if records is None:
        raise SystemExit(f"loss_parity: `{command}` failed:\n{error}")
    return [r["loss"] for r in records]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("loss_parity: skipped, no CUDA GPU")
        return
    eager, compiled = losses("off", args.steps), losses("on", args.steps)
    rel = [abs(c - e) / abs(e) for e, c in zip(eager, compiled, strict=False)]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "python " + " ".join(sys.argv),
    }
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "loss_parity.json").write_text(json.dumps({"meta": meta, "eager": eager, "compiled": compiled}, indent=1))
    lines = [
        f"# Losses, eager vs compiled regions ({args.steps} steps, small preset shape, 4 layers, batch 8)",
        "",
        f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}",
        "",
        f"`{meta['command']}`",
        "",
        f"largest relative difference {max(rel):.2e} (step {rel.index(max(rel)) + 1}); mean {sum(rel) / len(rel):.2e}",
        "",
        "| step | eager | compiled | relative difference |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {i} | {e:.4f} | {c:.4f} | {r:.1e} |"
        for i, (e, c, r) in enumerate(zip(eager, compiled, rel, strict=False), 1)
        if i <= 5 or i % 5 == 0
    ]
    (folder / "loss_parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]))


if __name__ == "__main__":
    main()
