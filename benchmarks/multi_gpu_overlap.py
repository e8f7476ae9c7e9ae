"""The overlap mode of benchmarks/bench_train_multi_gpu.py: the small model sized to the GPUs it runs on, the
expert-parallel overlap each micro-batch runs with ("auto": the planner's choice, resolved as `xmoe train` resolves
it), and the planner's step beside each measured one.

# W world size, mb micro-batch (sequences per rank per step), SEQxLAYERS a variant of the base preset
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

FIT_FRACTION = 0.7  # of the free GPU memory (least over ranks) micro-batch 1 of "SEQxfit" may take, leaving room


def _run_config(cfg, dp: int, ep: int, tp: int, mb: int, seq: int, ep_overlap: str = "off"):
    from xmoe.config import ParallelConfig, RunConfig, TrainConfig

    return RunConfig(
        model=cfg,
        train=TrainConfig(global_batch_size=mb * dp * ep, micro_batch_size=mb, seq_len=seq),
        parallel=ParallelConfig(dp=dp, ep=ep, tp=tp, ep_overlap=ep_overlap),  # type: ignore[arg-type]
    )


def fit_variant(variant: str, base: str, layout: tuple[int, int, int], device: torch.device) -> str:
    """ "SEQxfit" -> "SEQxL": the most layers L of the preset (most_layers) at which micro-batch 1 of layout (dp, ep,
    tp) fits FIT_FRACTION of the free GPU memory, the least over ranks; the preset's layers off a GPU. Other variants
    come back as they are."""
    seq, layers = variant.split("x")
    if layers != "fit":
        return variant
    if device.type != "cuda":
        from xmoe.model.presets import get_preset

        return f"{seq}x{get_preset(base).num_layers}"
    free = torch.tensor(float(torch.cuda.mem_get_info(device)[0]), device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return f"{seq}x{most_layers(base, int(seq), layout, FIT_FRACTION * free.item())}"


def most_layers(base: str, seq: int, layout: tuple[int, int, int], budget: float) -> int:
    """The most layers (at most the preset's, at least 1) at which one GPU of layout (dp, ep, tp) training micro-batch
    1 of ``seq`` tokens peaks within ``budget`` bytes by the planner (xmoe.plan.fit.predict_train_peak, the trainer's
    pre-flight)."""
    from xmoe.model.presets import get_preset
    from xmoe.plan.fit import predict_train_peak

    cfg = get_preset(base)
    dp, ep, tp = layout
    for layers in range(cfg.num_layers, 1, -1):
        model = dataclasses.replace(
            cfg, num_layers=layers, first_k_dense=min(cfg.first_k_dense, layers - 1), max_seq_len=seq
        )
        if predict_train_peak(_run_config(model, dp, ep, tp, 1, seq), "cuda") <= budget:
            return layers
    return 1


def resolve(cfg, overlap: str, layout: tuple[int, int, int], mb: int, seq: int, device_type: str) -> str:
    """The overlap a method runs at micro-batch mb: its own, or for "auto" resolve_ep_overlap's choice."""
    if overlap != "auto":
        return overlap
    from xmoe.train.run_config import resolve_ep_overlap

    dp, ep, tp = layout
    return resolve_ep_overlap(_run_config(cfg, dp, ep, tp, mb, seq, "auto"), device_type).parallel.ep_overlap


def set_overlap(model: torch.nn.Module, mode: str, chunks: int = 2) -> None:
    """Every MoE layer of ``model`` overlaps its all-to-alls by ``mode`` from its next call."""
    from xmoe.moe.layer import moe_layers

    for layer in moe_layers(model):
        layer.set_overlap(mode, chunks)


def predictions(rows: list[dict], model_config, world: int, device_type: str) -> list[str]:
    """Adds pred_ms / pred_err to every overlap row that is not "off" itself (the planner's step for its mode, from
    the measured "xmoe" (off) step of the same variant and micro-batch: ep_planner.predict_model) and
    tokens_per_s_gpu to every row; returns one line per comparison with the targets."""
    from benchmarks.ep_planner import TARGET_ERROR, predict_model
    from xmoe.plan.step_time import DEFAULT_TFLOPS
    from xmoe.train.run_config import CPU_TFLOPS

    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    lines = []
    for row in rows:
        if row["status"] == "ok":
            row["tokens_per_s_gpu"] = row["tokens_per_s"] / world
    for row in rows:
        off = next(
            (
                r
                for r in rows
                if r["method"] == "xmoe" and r["variant"] == row["variant"] and r["micro_batch"] == row["micro_batch"]
            ),
            None,
        )
        if row["method"] == "xmoe" or row["status"] != "ok" or off is None or off["status"] != "ok":
            continue
        cfg, seq = model_config(row["variant"])
        pred = predict_model(
            cfg,
            row["micro_batch"] * seq,
            world=world,
            ep=row["ep"],
            gpus_per_node=gpus_per_node,
            off_ms=off["ms_step"],
            tflops=DEFAULT_TFLOPS if device_type == "cuda" else CPU_TFLOPS,
        )
        case = f"{row['variant']} mb {row['micro_batch']} EP={row['ep']}, {row['method']} ({row['overlap']})"
        gain = f"{row['tokens_per_s_gpu']:.0f} tokens/s per GPU vs {off['tokens_per_s_gpu']:.0f} with overlap off"
        if isinstance(pred, str):
            lines.append(f"{case}: {gain}; planner: no prediction: {pred}")
            continue
        row["pred_ms"] = pred[row["overlap"]]
        row["pred_err"] = row["ms_step"] / row["pred_ms"] - 1
        verdict = "meets" if abs(row["pred_err"]) <= TARGET_ERROR else "MISSES"
        lines.append(
            f"{case}: {gain} ({off['ms_step'] / row['ms_step']:.3f}x); planner {row['pred_ms']:.0f} ms vs measured "
            f"{row['ms_step']:.0f} ms ({100 * row['pred_err']:+.0f}%; {verdict} within {100 * TARGET_ERROR:.0f}%)"
        )
    return lines
