"""`xmoe plan memory` and `xmoe plan comm`: their arguments, the checks of them, and the command, which prints
the tables that tables.py builds from the analytical models of xmoe/plan.

Nothing is allocated and no GPU is needed; docs/planning.md explains both models and their numbers.
"""

from __future__ import annotations

import argparse
import math

from xmoe.config import RECOMPUTE_MODES, ModelConfig, add_kernel_arguments
from xmoe.model.presets import PRESETS, get_preset
from xmoe.plan.tables import GIB, model_name, run_comm, run_memory, run_trainer_memory
from xmoe.plan.tables import rank_layouts as rank_layouts  # re-exported beside prepare_memory, which it follows

# The models (and, through them, torch) are imported when a plan runs: `xmoe --help` stays quick.
ASSUMED_GPU_MEM = 64.0  # GiB: an MI250X GCD, when no GPU is visible and --gpu-mem is not given
MAX_GPUS = 2**20  # the layouts are built rank by rank: a (dp, ep, tp) grid of this many ranks is 8 MiB
MAX_MC_TOKENS = 2**18  # tokens x experts float64 draws per source: 512 MiB for 256 experts
MAX_LAYERS = 1024  # the memory model walks every layer of every layout it tries: ~6 s of CPU at 1024 layers
# --measure builds the simulated rank's DeviceMesh, which visits every rank of the world: 8 s at 65536 ranks
MAX_MEASURE_GPUS = 2**16

EXAMPLES = """examples:
  xmoe plan memory --preset medium --gpus 64            # search layouts that fit this machine's GPUs
  xmoe plan memory --preset small --gpu-mem 80 --tp 2   # fix some degrees, search the rest
  xmoe plan memory --trainer --preset small --layers 8 --seq 2048 --accumulation 4   # `xmoe train` on one GPU
  xmoe plan memory --preset medium --gpus 256 --gpu-mem 64 --measure      # run rank 0 of the proposed layout here
  xmoe plan memory --preset small --layers 2 --seq 256 --micro-batch 1 --gpus 64 --ep 16 --tp 1 --measure --json
  xmoe plan memory --preset small --layers 2 --gpus 8 --ep 8 --measure --wgrad triton   # under a kernel choice
  xmoe plan memory --config my_model.toml --gpus 16 --gpu-mem 80   # your own model (or --init-from HF_DIR, --set)
  xmoe plan comm --preset large --gpus 256 --inter-bw 50
  xmoe plan comm --preset large --gpus 256 --inter-bw 25 --compute-ms 1110 --max-nodes-per-token 2,4   # step time
"""


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What defines the model, as `xmoe train` takes it (xmoe/train/run_config.py builds it)."""
    p.add_argument(
        "--preset", help=f"one of {', '.join(PRESETS)} (default small, unless --config or --init-from names the model)"
    )
    p.add_argument("--config", help="a run's JSON or TOML file (`xmoe train --config`): its model and moe sections")
    p.add_argument(
        "--init-from", metavar="HF_DIR", help="a Hugging Face model directory: its config.json (no weights are read)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one model or moe field, e.g. --set moe.top_k=2 (repeatable)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", required=True, metavar="{memory,comm}")
    mem = sub.add_parser(
        "memory",
        help="per-GPU memory of training a preset; searches layouts that fit",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arguments(mem)
    _add_memory_layout_arguments(mem)
    _add_memory_run_arguments(mem)
    add_kernel_arguments(mem, "with --measure: ")

    com = sub.add_parser(
        "comm",
        help="flat all-to-all vs RBD traffic and time of one MoE dispatch",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arguments(com)
    _add_comm_arguments(com)
    add_step_arguments(com)


def _add_memory_layout_arguments(mem: argparse.ArgumentParser) -> None:
    """`plan memory`'s world, layout and model-size flags: what the planner fixes or searches."""
    mem.add_argument("--gpus", type=int, default=8, help="world size (default 8)")
    mem.add_argument(
        "--gpu-mem",
        type=float,
        help=f"GiB per GPU (default: this machine's GPU, else {ASSUMED_GPU_MEM:g}, an MI250X GCD)",
    )
    mem.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    mem.add_argument("--tp", type=int, help="tensor-parallel degree (default: searched in 1, 2, 4, 8)")
    mem.add_argument("--ep", type=int, help="expert-parallel degree (default: searched among divisors of E)")
    mem.add_argument("--dp", type=int, help="data-parallel degree (default: gpus / (tp * ep))")
    mem.add_argument("--micro-batch", type=int, help="sequences per GPU per micro-batch (default: searched)")
    mem.add_argument("--max-micro-batch", type=int, default=8, help="largest micro-batch the search tries")
    mem.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    mem.add_argument("--recompute", choices=RECOMPUTE_MODES, help="activation recompute (default: searched)")
    mem.add_argument("--padded", action="store_true", help="GShard/DeepSpeed-MoE capacity buffers instead of PFT")
    mem.add_argument(
        "--capacity-factor", type=float, help="capacity factor (default: 1.25 with --padded, dropless otherwise)"
    )
    mem.add_argument("--no-ssmb", action="store_true", help="run the MoE block on all tokens of every TP rank")
    mem.add_argument(
        "--placement",
        choices=("ep_first", "dp_first"),
        default="ep_first",
        help="placement when an EP group cannot fit in a node (inside a node: always ep_first)",
    )
    mem.add_argument("--imbalance", type=float, default=1.0, help="max/mean routed rows per rank (default 1)")


def _add_memory_run_arguments(mem: argparse.ArgumentParser) -> None:
    """`plan memory`'s flags of how a rank runs: kernels, the one-GPU trainer's view, shortened models, and
    --measure's simulated rank."""
    mem.add_argument(
        "--kernel",
        choices=("triton", "torch"),
        help="expert kernels: triton saves 2 F-wide tensors per row, torch 4 (default triton; with "
        "--measure, what the device runs: triton on a GPU, torch on a CPU)",
    )
    mem.add_argument(
        "--trainer",
        action="store_true",
        help="the peak of `xmoe train` on one GPU instead (fp32 weights and AdamW, bf16 expert copies, "
        "compiled regions), per recompute mode and micro-batch",
    )
    mem.add_argument("--layers", type=int, help="the preset with this many layers (a shortened model)")
    mem.add_argument(
        "--mtp-depth",
        type=int,
        default=0,
        help="multi-token-prediction modules (model.mtp_depth; default 0): each one more block, its projection "
        "and its loss head",
    )
    mem.add_argument(
        "--accumulation", type=int, default=1, help="with --trainer: micro-batches per optimizer step (default 1)"
    )
    mem.add_argument("--eager", action="store_true", help="with --trainer: compiled regions off (--compile off)")
    mem.add_argument("--reserve", type=float, default=2.0, help="GiB for CUDA context, NCCL, fragmentation (default 2)")
    mem.add_argument(
        "--measure",
        action="store_true",
        help="also run one rank of the layout here, in a simulated world (torch's fake process group: "
        "real shards, kernels and allocations, no communication), and print its measured peak and "
        "compute time beside the prediction",
    )
    mem.add_argument("--rank", type=int, default=0, help="with --measure: the rank to run (default 0)")
    mem.add_argument("--steps", type=int, default=3, help="with --measure: training steps (default 3, >= 3)")
    mem.add_argument("--device", default="auto", help="with --measure: auto (GPU if present, default), cpu or cuda")
    mem.add_argument("--json", action="store_true", help="with --measure: print one JSON object instead")


def _add_comm_arguments(com: argparse.ArgumentParser) -> None:
    """`plan comm`'s world, links and routing."""
    com.add_argument("--gpus", type=int, default=64, help="world size (default 64)")
    com.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    com.add_argument("--ep", type=int, help="expert-parallel degree (default min(E, gpus / tp))")
    com.add_argument("--tp", type=int, default=1, help="tensor-parallel degree, spaces EP ranks apart (default 1)")
    com.add_argument(
        "--placement",
        choices=("ep_first", "dp_first"),
        default="ep_first",
        help="EP group layout over nodes (default ep_first)",
    )
    com.add_argument("--intra-bw", type=float, default=300.0, help="GB/s per GPU inside a node (default 300)")
    com.add_argument(
        "--inter-bw",
        type=float,
        default=25.0,
        help="GB/s per GPU across nodes, its NIC share as an all-to-all achieves it, not the line rate (default 25)",
    )
    com.add_argument("--intra-lat", type=float, default=5.0, help="us per intra-node stage (default 5)")
    com.add_argument("--inter-lat", type=float, default=10.0, help="us per inter-node stage (default 10)")
    com.add_argument("--routing", default="uniform", help="uniform (default) | skewed | FILE.json (tokens per expert)")
    com.add_argument("--tokens-per-gpu", type=int, help="tokens each GPU routes (default: the preset's seq)")
    com.add_argument("--mc-tokens", type=int, default=4096, help="Monte Carlo tokens per source GPU (default 4096)")
    com.add_argument("--seed", type=int, default=0, help="seed of the sampled routing (default 0)")


def add_step_arguments(com: argparse.ArgumentParser) -> None:
    """`plan comm`'s step-time model (step_time.py): the compute, the techniques, the emulated cluster's links."""
    step = com.add_argument_group("step time (overlap, FP8 dispatch, node-limited routing; docs/planning.md)")
    step.add_argument(
        "--node-inter-bw",
        type=float,
        help="GB/s across nodes per node, shared by its --gpus-per-node GPUs, as an all-to-all achieves it (instead "
        "of --inter-bw; at most 0.125 for a node linked at 1 Gbit/s)",
    )
    step.add_argument(
        "--compute-ms",
        type=float,
        help="measured compute of one step, no communication (`xmoe plan memory --measure` prints it; default: the "
        "model's FLOPs at --tflops)",
    )
    step.add_argument(
        "--layer-compute-ms", type=float, help="measured compute of one layer per micro-batch instead (x layers)"
    )
    step.add_argument(
        "--experts-ms",
        type=float,
        help="measured forward of one layer call's routed experts (backward taken as 2x; default: FLOPs at --tflops)",
    )
    step.add_argument(
        "--tflops",
        type=float,
        default=400.0,
        help="throughput assumed where nothing was measured (default 400: bf16 expert GEMMs on one H100)",
    )
    step.add_argument(
        "--recompute",
        choices=("none", "moe", "full"),
        default="none",
        help="activation recompute: moe and full run each MoE forward, its all-to-alls included, again in backward",
    )
    step.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (default 1)")
    step.add_argument("--ep-chunks", type=int, default=2, help="chunks of ep_overlap 'chunks' (default 2)")
    step.add_argument(
        "--chunk-overhead-rows",
        type=float,
        default=300.0,
        help="chunking's cost: rows each local expert's GEMM costs extra per chunk (default 300, from one H100)",
    )
    step.add_argument(
        "--max-nodes-per-token",
        default="4",
        help="node limits M to compare with none, comma-separated (default 4; 0: none only)",
    )


def _check_args(args: argparse.Namespace) -> None:
    """Counts >= 1 and sizes finite and > 0 (>= 0 where zero means something), then the planner's limits, naming
    the flag."""
    _check_ranges(args)
    _check_limits(args)


def _check_ranges(args: argparse.Namespace) -> None:
    counts = (
        "gpus",
        "gpus_per_node",
        "tp",
        "ep",
        "dp",
        "micro_batch",
        "max_micro_batch",
        "seq",
        "tokens_per_gpu",
        "mc_tokens",
        "layers",
        "accumulation",
        "steps",
        "micro_batches",
    )
    for name in counts:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be >= 1")
    positive = (
        "gpu_mem",
        "capacity_factor",
        "intra_bw",
        "inter_bw",
        "node_inter_bw",
        "compute_ms",
        "layer_compute_ms",
        "experts_ms",
        "tflops",
    )
    at_least = {"imbalance": 1.0, "reserve": 0.0, "intra_lat": 0.0, "inter_lat": 0.0, "chunk_overhead_rows": 0.0}
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be a finite number > 0")
    for name, low in at_least.items():
        value = getattr(args, name, None)
        if value is not None and not (value >= low and math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be a finite number >= {low:g}")
    if getattr(args, "ep_chunks", 2) < 2:
        raise ValueError(f"--ep-chunks ({args.ep_chunks}) must be >= 2")
    if getattr(args, "compute_ms", None) is not None and getattr(args, "layer_compute_ms", None) is not None:
        raise ValueError("give --compute-ms (per step) or --layer-compute-ms (per layer), not both")
    if getattr(args, "seed", 0) < 0:
        raise ValueError(f"--seed ({args.seed}) must be >= 0")


def _check_limits(args: argparse.Namespace) -> None:
    """What the planner can lay out, walk and sample in reasonable time and memory."""
    if args.gpus > MAX_GPUS:
        raise ValueError(f"--gpus ({args.gpus}) must be <= {MAX_GPUS}: the planner lays out every rank")
    if getattr(args, "measure", False) and args.gpus > MAX_MEASURE_GPUS:
        raise ValueError(
            f"--gpus ({args.gpus}) must be <= {MAX_MEASURE_GPUS} with --measure: the simulated rank's device mesh "
            f"holds every rank of the world (the plan alone takes up to {MAX_GPUS})"
        )
    if (getattr(args, "layers", None) or 0) > MAX_LAYERS:
        raise ValueError(
            f"--layers ({args.layers}) must be <= {MAX_LAYERS}: the planner walks every layer of every layout it tries"
        )
    if getattr(args, "mc_tokens", 0) > MAX_MC_TOKENS:
        raise ValueError(
            f"--mc-tokens ({args.mc_tokens}) must be <= {MAX_MC_TOKENS} (it draws tokens x experts "
            "random numbers per source GPU; the default 4096 came within 0.05% of the exact count in "
            "docs/planning.md's example)"
        )


def _gpu_memory_gib() -> tuple[float, str]:
    """This machine's GPU memory in GiB, or the assumed default; and a line saying which."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, f"GPU memory: {props.total_memory / GIB:.1f} GiB, this machine's {props.name}"
    return ASSUMED_GPU_MEM, (
        f"GPU memory: {ASSUMED_GPU_MEM:g} GiB assumed (an MI250X GCD; no GPU visible here): pass --gpu-mem for yours"
    )


def model_config(args: argparse.Namespace, base: ModelConfig | None = None) -> ModelConfig:
    """``base`` (the model of --config / --init-from / --set, built by the caller as `xmoe train` builds it), else
    the preset of ``--preset``; shortened to ``--layers`` when given, with ``--mtp-depth`` prediction modules."""
    from dataclasses import replace

    cfg = base if base is not None else get_preset(args.preset or "small")
    if getattr(args, "layers", None) is not None:
        cfg = replace(cfg, num_layers=args.layers, first_k_dense=min(cfg.first_k_dense, args.layers))
    if getattr(args, "mtp_depth", 0):
        cfg = replace(cfg, mtp_depth=args.mtp_depth)  # ModelConfig refuses a negative depth by name
    return cfg


def prepare_memory(args: argparse.Namespace, base: ModelConfig | None = None) -> tuple[ModelConfig, str | None]:
    """Checked arguments of `plan memory`: (the model config, a line saying which GPU memory was assumed or None);
    ``args.gpu_mem`` is filled in. ``base``: as model_config's."""
    _check_args(args)
    note = None
    if args.gpu_mem is None:
        args.gpu_mem, note = _gpu_memory_gib()
    cfg = model_config(args, base)
    if cfg.num_layers > MAX_LAYERS:
        raise ValueError(
            f"{model_name(args)} has {cfg.num_layers} layers; `xmoe plan memory` takes at most {MAX_LAYERS} (it walks "
            "every layer of every layout it tries): plan a shortened model with --layers"
        )
    return cfg, note


def run(args: argparse.Namespace, base: ModelConfig | None = None) -> None:
    """The command; ``base``: the model of --config / --init-from / --set (model_config)."""
    if args.plan_command == "memory":
        cfg, note = prepare_memory(args, base)
        text = run_trainer_memory(cfg, args) if args.trainer else run_memory(cfg, args)
        print(text if note is None else text.replace("\n", f"\n{note}\n", 1))
    else:
        _check_args(args)
        print(run_comm(model_config(args, base), args))
