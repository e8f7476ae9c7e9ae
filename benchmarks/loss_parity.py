"""Losses of two `xmoe train` runs of the same seed and data, step by step, on one GPU: eager against compiled
regions (`--compare compile`), or bf16 against FP8 routed experts, both compiled (`--compare fp8`).

    python benchmarks/loss_parity.py --steps 50 --out results/
    python benchmarks/loss_parity.py --compare fp8 --steps 300 --out results/

Small preset shape, 4 layers, seq 2048, batch 8 in one micro-batch, on the embedded corpus, every step logged.
bf16 autocast rounds differently when the compiler fuses or reorders work, and FP8 quantises the experts' GEMM
inputs, so the runs drift apart; the table shows each step's relative difference, the largest overall and after
step 50, and each run's peak memory. Writes loss_parity.json / .md (loss_parity_fp8.* for fp8) into --out.
Skips without a GPU.
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

RUNS = {  # --compare: (name, extra arguments) of the reference run and of the other
    "compile": (("eager", ["--compile", "off"]), ("compiled", ["--compile", "on"])),
    "fp8": (("bf16", ["--compile", "on"]), ("fp8", ["--compile", "on", "--fp8", "experts"])),
}


def run(extra: list[str], steps: int) -> tuple[list[float], float, str]:
    """(loss at every step, peak memory in GiB, the command) of one run."""
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
        *extra,
    )
    if records is None:
        raise SystemExit(f"loss_parity: `{command}` failed:\n{error}")
    return [r["loss"] for r in records], max(r["mem_bytes"] for r in records) / 2**30, command


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", choices=tuple(RUNS), default="compile", help="which two runs (default compile)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps of each run (default 50)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("loss_parity: skipped, no CUDA GPU")
        return
    (ref_name, ref_args), (new_name, new_args) = RUNS[args.compare]
    ref, ref_mem, ref_cmd = run(ref_args, args.steps)
    new, new_mem, new_cmd = run(new_args, args.steps)
    rel = [abs(c - e) / abs(e) for e, c in zip(ref, new, strict=True)]
    late = rel[50:] or rel
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "python " + " ".join(sys.argv),
        "runs": {ref_name: ref_cmd, new_name: new_cmd},
        "peak_mem_gib": {ref_name: ref_mem, new_name: new_mem},
    }
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    stem = "loss_parity" if args.compare == "compile" else f"loss_parity_{args.compare}"
    (folder / f"{stem}.json").write_text(json.dumps({"meta": meta, ref_name: ref, new_name: new}, indent=1))
    every = 5 if args.steps <= 100 else 25
    lines = [
        f"# Losses, {ref_name} vs {new_name} ({args.steps} steps, small preset shape, 4 layers, batch 8)",
        "",
        f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}",
        "",
        f"`{meta['command']}`",
        "",
        f"largest relative difference {max(rel):.2e} (step {rel.index(max(rel)) + 1}); mean {sum(rel) / len(rel):.2e}; "
        f"largest after step 50: {max(late):.2e}. "
        f"Peak memory: {ref_name} {ref_mem:.1f} GiB, {new_name} {new_mem:.1f} GiB.",
        "",
        f"| step | {ref_name} | {new_name} | relative difference |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {i} | {e:.4f} | {c:.4f} | {r:.1e} |"
        for i, (e, c, r) in enumerate(zip(ref, new, rel, strict=True), 1)
        if i <= 5 or i % every == 0
    ]
    (folder / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]))


if __name__ == "__main__":
    main()
