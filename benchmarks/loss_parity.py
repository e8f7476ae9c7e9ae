"""Losses of two `xmoe train` runs of the same seed and data, step by step, on one GPU: eager against compiled
regions (`--compare compile`), or bf16 against FP8 routed experts, both compiled (`--compare fp8`; `--compare
fp8_wgrad`: their weight gradients in FP8 too).

    python benchmarks/loss_parity.py --steps 50
    python benchmarks/loss_parity.py --compare fp8 --steps 300
    python benchmarks/loss_parity.py --from-json results/archive/fp8/loss_parity_fp8.json   # the .md again, no runs

Small preset shape, 4 layers, seq 2048, batch 8 in one micro-batch, on the embedded corpus, every step logged.
bf16 autocast rounds differently when the compiler fuses or reorders work, and FP8 quantises the experts' GEMM
inputs, so the runs drift apart; the table shows each step's relative difference, the summary the largest overall
and after step 50, how many steps after 50 differ by more than 1%, the mean signed difference after step 50 (a
bias: one run lower or higher throughout) and the largest difference of 10-step means after step 50 (a lasting
excursion rather than one step's noise), and each run's peak memory. Writes loss_parity.json / .md
(loss_parity_<compare>.* for the others) into --out. Skips without a GPU. `--from-json FILE` writes the .md
again from a saved .json (no runs; FILE's folder unless --out is given).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import commit, commit_line, results_dir, run_xmoe_train

RUNS = {  # --compare: (name, extra arguments) of the reference run and of the other
    "compile": (("eager", ["--compile", "off"]), ("compiled", ["--compile", "on"])),
    "fp8": (("bf16", ["--compile", "on"]), ("fp8", ["--compile", "on", "--fp8", "experts"])),
    "fp8_wgrad": (
        ("bf16", ["--compile", "on"]),
        ("fp8_wgrad", ["--compile", "on", "--fp8", "experts", "--wgrad", "fp8"]),
    ),
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


LATE = 50  # steps the runs are left to settle before the late figures
WINDOW = 10  # steps per mean in the windowed figure


def summary(ref: list[float], new: list[float]) -> dict:
    """Relative differences of ``new`` against ``ref`` (losses step by step): per step ("rel"), the largest and
    its step, the mean; for runs longer than LATE + WINDOW steps also, after step LATE, the largest, the steps
    over 1%, the mean signed difference and the largest difference of WINDOW-step means (with its steps)."""
    if len(ref) != len(new) or not ref:
        raise ValueError(f"the runs logged {len(ref)} and {len(new)} losses; they must log the same steps")
    signed = [(c - e) / abs(e) for e, c in zip(ref, new, strict=True)]
    rel = [abs(d) for d in signed]
    out = {"rel": rel, "max": max(rel), "max_step": rel.index(max(rel)) + 1, "mean": sum(rel) / len(rel)}
    if len(ref) > LATE + WINDOW:
        windows = [
            (abs(sum(new[i : i + WINDOW]) - sum(ref[i : i + WINDOW])) / abs(sum(ref[i : i + WINDOW])), i + 1)
            for i in range(LATE, len(ref) - WINDOW + 1)
        ]
        window_max, first = max(windows)
        out.update(
            late_max=max(rel[LATE:]),
            late_over_1pct=sum(r > 0.01 for r in rel[LATE:]),
            late_signed_mean=sum(signed[LATE:]) / len(signed[LATE:]),
            window_max=window_max,
            window_steps=(first, first + WINDOW - 1),
        )
    return out


def markdown(meta: dict, ref_name: str, ref: list[float], new_name: str, new: list[float]) -> list[str]:
    s = summary(ref, new)
    mem = meta.get("peak_mem_gib")  # older result files lack it
    every = 5 if len(ref) <= 100 else 25
    figures = f"largest relative difference {s['max']:.2e} (step {s['max_step']}); mean {s['mean']:.2e}"
    if "late_max" in s:
        first, last = s["window_steps"]
        figures += (
            f"; after step {LATE}: largest {s['late_max']:.2e}, {s['late_over_1pct']} steps over 1%, mean signed "
            f"difference ({new_name} - {ref_name}) / {ref_name} {s['late_signed_mean']:+.2e}, largest difference "
            f"of {WINDOW}-step means {s['window_max']:.2e} (steps {first}-{last})"
        )
    if mem:
        figures += f". Peak memory: {ref_name} {mem[ref_name]:.1f} GiB, {new_name} {mem[new_name]:.1f} GiB"
    lines = [
        f"# Losses, {ref_name} vs {new_name} ({len(ref)} steps, small preset shape, 4 layers, batch 8)",
        "",
        f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}",
        "",
        commit_line(meta),
        "",
        f"`{meta['command']}`",
        "",
        figures + ".",
        "",
        f"| step | {ref_name} | {new_name} | relative difference |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {i} | {e:.4f} | {c:.4f} | {r:.1e} |"
        for i, (e, c, r) in enumerate(zip(ref, new, s["rel"], strict=True), 1)
        if i <= 5 or i % every == 0
    ]
    return lines


def from_json(path: Path, out: Path) -> None:
    data = json.loads(path.read_text())
    ref_name, new_name = (k for k in data if k != "meta")
    out.mkdir(parents=True, exist_ok=True)
    write_markdown(out / f"{path.stem}.md", markdown(data["meta"], ref_name, data[ref_name], new_name, data[new_name]))


def write_markdown(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", choices=tuple(RUNS), default="compile", help="which two runs (default compile)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps of each run (default 50)")
    p.add_argument(
        "--out", help="results directory (default benchmarks/results/train or /fp8, or --from-json's folder)"
    )
    p.add_argument("--from-json", type=Path, help="write the .md of this saved .json again, without running")
    args = p.parse_args()
    if args.from_json is not None:
        if not args.from_json.is_file():
            raise SystemExit(f"loss_parity: --from-json {args.from_json}: no such file")
        from_json(args.from_json, Path(args.out) if args.out else args.from_json.parent)
        return
    if not torch.cuda.is_available():
        print("loss_parity: skipped, no CUDA GPU")
        return
    (ref_name, ref_args), (new_name, new_args) = RUNS[args.compare]
    ref, ref_mem, ref_cmd = run(ref_args, args.steps)
    new, new_mem, new_cmd = run(new_args, args.steps)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "python " + " ".join(sys.argv),
        "runs": {ref_name: ref_cmd, new_name: new_cmd},
        "peak_mem_gib": {ref_name: ref_mem, new_name: new_mem},
        **commit(),
    }
    folder = Path(args.out) if args.out else results_dir("fp8" if "fp8" in args.compare else "train")
    folder.mkdir(parents=True, exist_ok=True)
    stem = "loss_parity" if args.compare == "compile" else f"loss_parity_{args.compare}"
    (folder / f"{stem}.json").write_text(json.dumps({"meta": meta, ref_name: ref, new_name: new}, indent=1))
    write_markdown(folder / f"{stem}.md", markdown(meta, ref_name, ref, new_name, new))


if __name__ == "__main__":
    main()
