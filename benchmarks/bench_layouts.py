"""One rank of each paper preset's layout, simulated on this GPU, beside the planner; and the largest model that
really trains on this GPU.

    python benchmarks/bench_layouts.py                                         # all four presets + the 8-GPU table
    python benchmarks/bench_layouts.py --out DIR --presets medium --layers 4 --no-largest   # a quick look

Part 1, paper scale (X-MoE, SC'25: Small, Medium and Large on 256 GPUs, Super on 1024, 64 GiB MI250X GCDs by
default): for each preset, the layout `xmoe plan memory` proposes and the best feasible one with another expert- or
tensor-parallel degree; rank 0 of each is run by `xmoe plan memory ... --measure --json` in a process of its own
(torch's fake process group: its real shards, kernels and allocations, no communication). Part 2, the paper's
single-node table: Small (seq 2048 and 1024, 28 layers; seq 2048, 14 layers) on 8 GPUs of 40 GiB (A100). Each row:
layout, the planner's peak (less its reserve) and the measured peak in GiB, their ratio, the rank's compute time per
step and the tokens per second per GPU that compute alone would allow.
Part 3: the most layers of the Small preset (seq 2048, micro-batch 1, --recompute full, --compile off) whose planned
one-GPU peak (`estimate_trainer_memory`) fits 90% of this GPU, trained for real by `xmoe train` (3 steps), its
peak allocated memory beside the prediction.
Writes bench_layouts.json / .md into --out. Skips without a GPU unless --cpu (then tiny sizes, for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import commit_line, environment, markdown_table, results_dir

GIB = 2**30
PAPER_GPUS = {"small": 256, "medium": 256, "large": 256, "super": 1024}
SINGLE_NODE = [("small", 2048, None), ("small", 1024, None), ("small", 2048, 14)]  # (preset, seq, layers)
COLUMNS = [
    "part",
    "preset",
    "gpus",
    "layout",
    "planned_gib",
    "measured_gib",
    "ratio",
    "ms_per_step",
    "tokens_per_s_per_gpu",
    "seconds",
]


def _xmoe(*args: str, timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m xmoe ARGS` in a process of its own; exit code -1 on a timeout."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "xmoe", *args], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return -1, "", f"timed out after {timeout:.0f} s"
    return proc.returncode, proc.stdout, proc.stderr


def plan_args(preset: str, gpus: int, gpu_mem: float, layers, seq=None) -> list[str]:
    out = ["plan", "memory", "--preset", preset, "--gpus", str(gpus), "--gpu-mem", str(gpu_mem)]
    out += ["--layers", str(layers)] if layers else []
    return out + (["--seq", str(seq)] if seq else [])


def layouts(preset: str, gpus: int, gpu_mem: float, layers, seq=None) -> list[dict]:
    """The planner's proposed layout and the best feasible one with another (ep, tp), as plan-memory options."""
    from xmoe.plan import cli as plan_cli
    from xmoe.plan.tables import rank_layouts

    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    args = parser.parse_args(plan_args(preset, gpus, gpu_mem, layers, seq)[1:])
    cfg, _ = plan_cli.prepare_memory(args)
    ranked = [m for m in rank_layouts(cfg, args) if m.fits(gpu_mem)]
    chosen = (
        ranked[:1]
        + [m for m in ranked[1:] if (m.parallel.ep, m.parallel.tp) != (ranked[0].parallel.ep, ranked[0].parallel.tp)][
            :1
        ]
    )
    return [
        dict(tp=m.parallel.tp, ep=m.parallel.ep, dp=m.parallel.dp, micro_batch=m.micro_batch, recompute=m.recompute)
        for m in chosen
    ]


def measure(
    part: str, preset: str, gpus: int, gpu_mem: float, layout: dict, layers, seq, device: str, timeout: float
) -> dict:
    opts = [f"--{k.replace('_', '-')}={v}" for k, v in layout.items()]
    start = time.perf_counter()
    code, out, err = _xmoe(
        *plan_args(preset, gpus, gpu_mem, layers, seq),
        *opts,
        "--measure",
        "--json",
        "--device",
        device,
        timeout=timeout,
    )
    row = dict(
        part=part,
        preset=preset if not layers else f"{preset} ({layers} layers)",
        gpus=gpus,
        layout=f"tp {layout['tp']} x ep {layout['ep']} x dp {layout['dp']}, mb {layout['micro_batch']}, "
        f"recompute {layout['recompute']}",
        seconds=round(time.perf_counter() - start, 1),
    )
    if code != 0:
        return row | {"status": f"failed: {err.strip().splitlines()[-1] if err.strip() else code}"}
    result = json.loads(out)
    return row | dict(
        planned_gib=result["planned_peak_bytes"] / GIB,
        measured_gib=result["measured_peak_bytes"] / GIB,
        ratio=result["ratio"],
        ms_per_step=result["compute_ms_per_step"],
        tokens_per_s_per_gpu=result["tokens_per_s"],
        status="ok",
        result=result,
    )


def largest_one_gpu(device: str, timeout: float) -> dict:
    """Part 3: the most Small layers that the one-GPU planner fits in 90% of this GPU, trained for real."""
    import dataclasses

    import torch

    from xmoe.model.presets import get_preset
    from xmoe.plan.trainer_memory import estimate_trainer_memory

    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 8 * GIB
    base = get_preset("small")
    fits = [
        n
        for n in range(1, base.num_layers + 1)
        if estimate_trainer_memory(
            dataclasses.replace(base, num_layers=n), micro_batch=1, seq_len=2048, recompute="full", compiled=False
        ).total
        <= 0.9 * total
    ]
    layers = fits[-1]
    planned = estimate_trainer_memory(
        dataclasses.replace(base, num_layers=layers), micro_batch=1, seq_len=2048, recompute="full", compiled=False
    ).total
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        code, _, err = _xmoe(
            "train",
            "--preset",
            "small",
            "--set",
            f"model.num_layers={layers}",
            "--steps",
            "3",
            "--batch-size",
            "1",
            "--seq-len",
            "2048",
            "--recompute",
            "full",
            "--compile",
            "off",
            "--ckpt-every",
            "0",
            "--log-every",
            "1",
            "--device",
            device,
            "--out",
            out,
            timeout=timeout,
        )
        records = (
            [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            if (Path(out) / "metrics.jsonl").is_file()
            else []
        )
    from xmoe.model.counting import count_params

    row = dict(
        part="largest on one GPU",
        preset=f"small ({layers} layers, "
        f"{count_params(dataclasses.replace(base, num_layers=layers)).total / 1e9:.2f}B parameters)",
        gpus=1,
        layout="one GPU, mb 1, seq 2048, recompute full, eager",
        planned_gib=planned / GIB,
        seconds=round(time.perf_counter() - start, 1),
    )
    if code != 0 or not records:
        return row | {"status": f"failed: {err.strip().splitlines()[-1] if err.strip() else code}"}
    peak = max(r["mem_bytes"] for r in records)
    return row | dict(
        measured_gib=peak / GIB, ratio=peak / planned, tokens_per_s_per_gpu=records[-1]["tokens_per_s"], status="ok"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(results_dir("plan")), help="directory for bench_layouts.json / .md")
    p.add_argument("--presets", default="small,medium,large,super", help="comma-separated paper presets")
    p.add_argument("--gpu-mem", type=float, default=64.0, help="GiB per GPU the planner plans for (default 64)")
    p.add_argument("--layers", type=int, help="shorten every preset to this many layers (a quick look)")
    p.add_argument("--no-single-node", action="store_true", help="skip part 2")
    p.add_argument("--no-largest", action="store_true", help="skip part 3")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per simulated rank")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke test of the script)")
    args = p.parse_args()
    import torch

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_layouts: skipped, no CUDA GPU (pass --cpu for a smoke test)")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta, rows = environment(), []

    def record(row: dict) -> None:  # results rewritten after every row: a run stopped early keeps what it measured
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "result"}), flush=True)
        write(out, meta, rows)

    for preset in args.presets.split(","):
        for layout in layouts(preset, PAPER_GPUS[preset], args.gpu_mem, args.layers):
            record(
                measure(
                    "paper scale",
                    preset,
                    PAPER_GPUS[preset],
                    args.gpu_mem,
                    layout,
                    args.layers,
                    None,
                    device,
                    args.timeout,
                )
            )
    if not args.no_single_node:
        for preset, seq, layers in SINGLE_NODE:
            layers = args.layers or layers
            for layout in layouts(preset, 8, 40.0, layers, seq)[:1]:
                record(
                    measure(f"8 GPUs, 40 GiB, seq {seq}", preset, 8, 40.0, layout, layers, seq, device, args.timeout)
                )
    if not args.no_largest:
        record(largest_one_gpu(device, 2 * args.timeout))
    print(markdown_table(rows, COLUMNS + ["status"]))


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    (out / "bench_layouts.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "bench_layouts.md").write_text(
        f"# One simulated rank per paper layout, beside the planner\n\n{meta['date']}, {meta['gpu']}, torch "
        f"{meta['torch']}, triton {meta['triton']}, `{meta['command']}`\n\n{commit_line(meta)}\n\n"
        "planned: `xmoe plan memory`'s peak less "
        "its reserve; measured: the caching allocator's peak of allocated bytes of the simulated rank (fake process "
        "group: no communication, so ms/step and tokens/s are compute only). Largest on one GPU: a real `xmoe "
        "train` run.\n\n" + markdown_table(rows, COLUMNS + ["status"]) + "\n"
    )


if __name__ == "__main__":
    main()
