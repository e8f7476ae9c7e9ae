"""`xmoe plan memory` and `xmoe plan comm`: the analytical models of xmoe/plan, printed as tables.

Nothing is allocated and no GPU is needed; docs/planning.md explains both models and their numbers.
"""

from __future__ import annotations

import argparse
import math

from xmoe.config import RECOMPUTE_MODES, ModelConfig
from xmoe.model.presets import PRESETS, get_preset

# The models (and, through them, torch) are imported when a plan runs: `xmoe --help` stays quick.
GIB = 2**30
ASSUMED_GPU_MEM = 64.0  # GiB: an MI250X GCD, when no GPU is visible and --gpu-mem is not given
MAX_GPUS = 2**20  # the layouts are built rank by rank: a (dp, ep, tp) grid of this many ranks is 8 MiB
MAX_MC_TOKENS = 2**18  # tokens x experts float64 draws per source: 512 MiB for 256 experts

EXAMPLES = """examples:
  xmoe plan memory --preset medium --gpus 64            # search layouts that fit this machine's GPUs
  xmoe plan memory --preset small --gpu-mem 80 --tp 2   # fix some degrees, search the rest
  xmoe plan memory --trainer --preset small --layers 8 --seq 2048 --accumulation 4   # `xmoe train` on one GPU
  xmoe plan memory --preset medium --gpus 256 --gpu-mem 64 --measure      # run rank 0 of the proposed layout here
  xmoe plan memory --preset small --layers 2 --seq 256 --micro-batch 1 --gpus 64 --ep 16 --tp 1 --measure --json
  xmoe plan comm --preset large --gpus 256 --inter-bw 50
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", required=True, metavar="{memory,comm}")
    mem = sub.add_parser(
        "memory",
        help="per-GPU memory of training a preset; searches layouts that fit",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mem.add_argument("--preset", default="small", help=f"one of {', '.join(PRESETS)} (default small)")
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

    com = sub.add_parser(
        "comm",
        help="flat all-to-all vs RBD traffic and time of one MoE dispatch",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    com.add_argument("--preset", default="small", help=f"one of {', '.join(PRESETS)} (default small)")
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
        "--inter-bw", type=float, default=25.0, help="GB/s per GPU across nodes, its NIC share (default 25)"
    )
    com.add_argument("--intra-lat", type=float, default=5.0, help="us per intra-node stage (default 5)")
    com.add_argument("--inter-lat", type=float, default=10.0, help="us per inter-node stage (default 10)")
    com.add_argument("--routing", default="uniform", help="uniform (default) | skewed | FILE.json (tokens per expert)")
    com.add_argument("--tokens-per-gpu", type=int, help="tokens each GPU routes (default: the preset's seq)")
    com.add_argument("--mc-tokens", type=int, default=4096, help="Monte Carlo tokens per source GPU (default 4096)")
    com.add_argument("--seed", type=int, default=0, help="seed of the sampled routing (default 0)")


def _check_args(args: argparse.Namespace) -> None:
    """Counts >= 1 and sizes finite and > 0 (>= 0 where zero means something), naming the flag."""
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
    )
    for name in counts:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be >= 1")
    positive = ("gpu_mem", "capacity_factor", "intra_bw", "inter_bw")
    at_least = {"imbalance": 1.0, "reserve": 0.0, "intra_lat": 0.0, "inter_lat": 0.0}
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be a finite number > 0")
    for name, low in at_least.items():
        value = getattr(args, name, None)
        if value is not None and not (value >= low and math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be a finite number >= {low:g}")
    if getattr(args, "seed", 0) < 0:
        raise ValueError(f"--seed ({args.seed}) must be >= 0")
    if args.gpus > MAX_GPUS:
        raise ValueError(f"--gpus ({args.gpus}) must be <= {MAX_GPUS}: the planner lays out every rank")
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


def model_config(args: argparse.Namespace):
    """The preset of ``--preset``, shortened to ``--layers`` when given."""
    from dataclasses import replace

    cfg = get_preset(args.preset)
    if getattr(args, "layers", None) is not None:
        cfg = replace(cfg, num_layers=args.layers, first_k_dense=min(cfg.first_k_dense, args.layers))
    return cfg


def prepare_memory(args: argparse.Namespace) -> tuple[ModelConfig, str | None]:
    """Checked arguments of `plan memory`: (the model config, a line saying which GPU memory was assumed or None);
    ``args.gpu_mem`` is filled in."""
    _check_args(args)
    note = None
    if args.gpu_mem is None:
        args.gpu_mem, note = _gpu_memory_gib()
    return model_config(args), note


def run(args: argparse.Namespace) -> None:
    if args.plan_command == "memory":
        cfg, note = prepare_memory(args)
        text = run_trainer_memory(cfg, args) if args.trainer else run_memory(cfg, args)
        print(text if note is None else text.replace("\n", f"\n{note}\n", 1))
    else:
        _check_args(args)
        print(run_comm(model_config(args), args))


# ------------------------------------------------------------------------------------------------ memory


def rank_layouts(cfg, args, **extra) -> list:
    """The planner's layouts for the options given, best first (memory.search_layouts; ``extra``: more of
    estimate_memory's options)."""
    from xmoe.plan import memory

    cf = args.capacity_factor if args.capacity_factor is not None else (1.25 if args.padded else None)
    if args.tp is not None and args.tp > args.gpus_per_node:
        raise ValueError(f"--tp ({args.tp}) must be <= --gpus-per-node ({args.gpus_per_node})")
    options = dict(
        padded=args.padded,
        capacity_factor=cf,
        ssmb=not args.no_ssmb,
        seq_len=args.seq,
        imbalance=args.imbalance,
        kernel=args.kernel or "triton",
        reserve_gib=args.reserve,
        name=args.preset,
        **extra,
    )
    return memory.search_layouts(
        cfg,
        args.gpus,
        args.gpu_mem,
        gpus_per_node=args.gpus_per_node,
        tp=args.tp,
        ep=args.ep,
        dp=args.dp,
        micro_batch=args.micro_batch,
        recompute=args.recompute,
        max_micro_batch=args.max_micro_batch,
        placement=args.placement,
        **options,
    )


def run_memory(cfg, args) -> str:
    ranked = rank_layouts(cfg, args)
    best = ranked[0]
    searched = [
        n
        for n, v in (
            ("tp", args.tp),
            ("ep", args.ep),
            ("dp", args.dp),
            ("micro-batch", args.micro_batch),
            ("recompute", args.recompute),
        )
        if v is None
    ]
    lines = [
        f"xmoe plan memory: {args.preset} on {args.gpus} GPUs ({args.gpus_per_node} per node), "
        f"{args.gpu_mem:g} GiB each",
        _model_line(cfg),
    ]
    if not best.fits(args.gpu_mem):
        lines.append(f"NO layout fits in {args.gpu_mem:g} GiB; the smallest of {len(ranked)} tried is shown")
    elif searched:
        lines.append(
            f"searched {', '.join(searched)}: {sum(m.fits(args.gpu_mem) for m in ranked)} of "
            f"{len(ranked)} settings fit; proposed:"
        )
    lines += _breakdown(cfg, best, args.gpu_mem)
    if searched and best.fits(args.gpu_mem):
        lines += [
            "",
            "rule: fewest memory-saving tricks (recompute none < moe < full, then the smallest tp), then "
            f"the largest micro-batch (<= {args.max_micro_batch}), then the least traffic per GPU per "
            "micro-batch (FSDP2 / DDP collectives + all-to-all), then an EP group inside one node",
            "other feasible settings, by that rule:",
            f"  {'tp':>3}{'ep':>5}{'dp':>6}{'mb':>4}  {'recompute':<10}{'total GiB':>10}{'traffic GB':>11}",
        ]
        seen: set[tuple[int, str]] = set()
        for m in ranked[1:]:
            key = (m.parallel.tp, m.recompute)
            if m.fits(args.gpu_mem) and key not in seen and len(seen) < 6:
                seen.add(key)
                p = m.parallel
                lines.append(
                    f"  {p.tp:>3}{p.ep:>5}{p.dp:>6}{m.micro_batch:>4}  {m.recompute:<10}{m.total / GIB:>10.2f}"
                    f"{sum(m.traffic.values()) / 1e9:>11.1f}"
                )
    return "\n".join(lines)


def run_trainer_memory(cfg, args) -> str:
    """The peak of one `xmoe train` step on one GPU (plan.trainer_memory.estimate_trainer_memory) per recompute mode
    and micro-batch: the given ones, or micro-batches 1, 2, 4, ... up to --max-micro-batch."""
    from xmoe.plan.trainer_memory import estimate_trainer_memory

    seq = args.seq or cfg.max_seq_len
    modes = [args.recompute] if args.recompute else list(RECOMPUTE_MODES)
    batches = (
        [args.micro_batch] if args.micro_batch else [2**i for i in range(int(math.log2(args.max_micro_batch)) + 1)]
    )
    lines = [
        f"xmoe plan memory --trainer: {args.preset} with {cfg.num_layers} layers, seq {seq}, one GPU of "
        f"{args.gpu_mem:g} GiB, {args.accumulation} micro-batch(es) per step, compiled regions "
        f"{'off' if args.eager else 'on'}",
        _model_line(cfg),
        f"  {'recompute':<10}{'micro-batch':>12}{'states':>9}{'grads':>9}{'activ.':>9}{'working':>9}"
        f"{'peak GiB':>10}  fits",
    ]
    for mode in modes:
        for mb in batches:
            m = estimate_trainer_memory(
                cfg,
                micro_batch=mb,
                seq_len=seq,
                recompute=mode,
                accumulation=args.accumulation,
                compiled=not args.eager,
            )
            lines.append(
                f"  {mode:<10}{mb:>12}{m.states / GIB:>9.1f}{m.grads / GIB:>9.1f}{m.activations / GIB:>9.1f}"
                f"{m.working / GIB:>9.1f}{m.total / GIB:>10.1f}  {'yes' if m.total <= args.gpu_mem * GIB else 'no'}"
            )
    lines.append(
        "states: fp32 weights, AdamW moments, bf16 expert copies; grads, activations, working: at the peak "
        "of backward (docs/training-speed.md compares these with measured peaks)"
    )
    return "\n".join(lines)


def _model_line(cfg) -> str:
    from xmoe.model.counting import count_params, paper_params

    moe = cfg.moe
    total, paper = count_params(cfg).total, paper_params(cfg)[0]
    return (
        f"model: {cfg.num_layers} layers ({cfg.num_layers - cfg.first_k_dense} MoE), H {cfg.hidden_size}, "
        f"{moe.num_experts} experts x F {moe.ffn_hidden_size}, top-{moe.top_k}, {moe.num_shared_experts} shared; "
        f"{_count(total)} parameters (SwiGLU); {paper:.4g}B in the paper's convention (GELU, units of 2^30)"
    )


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _unit(largest: float) -> tuple[str, float]:
    """The binary unit that prints ``largest`` with digits before the point."""
    for name, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if largest >= scale:
            return name, scale
    return "KiB", 2**10


def _breakdown(cfg, m, gpu_mem: float) -> list[str]:
    from xmoe.plan import memory

    p = m.parallel
    nodes = memory.ep_group_nodes(p)
    dispatch = "padded (GShard)" if m.padded else "PFT"
    cf = f"capacity factor {m.capacity_factor:g}" if m.capacity_factor else "dropless"
    ssmb = (
        f"SSMB on: MoE block on {m.moe_tokens} of {m.tokens} tokens"
        if m.ssmb
        else ("SSMB off" + (" (tp 1)" if p.tp == 1 else ""))
    )
    unit, scale = _unit(m.total)
    layer_unit, layer_scale = _unit(min(max(m.moe_layer_bytes, sum(m.attention_layer.values())), 2**20))
    free = gpu_mem * GIB - m.total
    where = {
        "FSDP2": f"FSDP2 shards: {m.dense_params / 1e6:.1f}M dense over dp*ep={p.dp * p.ep}, "
        f"{m.expert_params / 1e6:.1f}M expert over dp={p.dp}",
        "DDP": f"DDP replica of {(m.dense_params + m.expert_params) / 1e6:.1f}M",
        "none": f"one process, {(m.dense_params + m.expert_params) / 1e6:.1f}M",
    }[m.wrapper]
    compute = (
        "fp32 throughout"
        if m.precision == "fp32"
        else "autocast bf16, FSDP2 gathers bf16"
        if m.wrapper == "FSDP2"
        else "autocast bf16, compiled regions"
    )
    rows = [
        ("parameters", f"fp32 ({where})", m.params),
        (
            "gradients",
            "reduced fp32 shards, unsharded ones in flight"
            if m.wrapper == "FSDP2"
            else "fp32, + DDP's buckets"
            if m.wrapper == "DDP"
            else "fp32",
            m.grads,
        ),
        ("optimizer", "AdamW exp_avg + exp_avg_sq, fp32", m.optimizer),
        (
            "gathered",
            "root kept, the unit in hand, the prefetched one"
            if m.wrapper == "FSDP2"
            else "bf16 expert copies for the step",
            m.gathered,
        ),
        ("activations", "saved, of the layers whose backward is still to run", m.activations),
        (
            "working",
            "activation gradients, reduce-scatter input, loss"
            if m.wrapper == "FSDP2"
            else "activation gradients, recomputed block, loss",
            m.working,
        ),
        ("reserve", "CUDA context, NCCL buffers, fragmentation", m.reserve),
    ]
    width = max(len(desc) for _, desc, _ in rows) + 2
    lines = [
        f"layout: tp {p.tp} x ep {p.ep} x dp {p.dp}, placement {p.placement} (EP group on {nodes} node"
        f"{'s' if nodes > 1 else ''}); micro-batch {m.micro_batch} x seq {m.seq_len} = {m.tokens} tokens per GPU",
        f"        recompute {m.recompute}; dispatch {dispatch}, {cf}; {ssmb}",
        f"per-GPU memory ({unit}) at the peak, {m.peak_at}; precision {m.precision} ({compute})",
        *[f"  {name:<13}{desc:<{width}}{value / scale:>8.2f}" for name, desc, value in rows],
        f"  {'total':<{13 + width}}{m.total / scale:>8.2f}   of {gpu_mem:g} GiB: "
        + (f"fits ({free / GIB:.2f} GiB free)" if free >= 0 else f"does NOT fit ({-free / GIB:.2f} GiB over)"),
        f"one layer's saved activations ({layer_unit}; attention on {m.tokens} tokens, "
        f"{'MoE block' if cfg.first_k_dense < cfg.num_layers else 'FFN'} on {m.moe_tokens})",
        "  attention: " + _terms(m.attention_layer, layer_scale),
        ("  MoE block: " if cfg.first_k_dense < cfg.num_layers else "  FFN: ") + _terms(m.ffn_layer, layer_scale),
    ]
    t = m.traffic
    if m.wrapper != "none":
        collectives = (
            f"DDP all-reduce {t['ddp'] / 1e9:.1f}"
            if m.wrapper == "DDP"
            else f"FSDP2 dense {t['fsdp_dense'] / 1e9:.1f}, FSDP2 experts {t['fsdp_experts'] / 1e9:.1f}"
        )
        lines.append(
            f"traffic per GPU per micro-batch (GB): {collectives}, expert all-to-all {t['all_to_all'] / 1e9:.1f}"
        )
    return lines + [f"note: {n}" for n in m.notes]


def _terms(parts: dict[str, float], scale: float) -> str:
    return ", ".join(f"{k} {v / scale:.1f}" for k, v in parts.items()) + f"; total {sum(parts.values()) / scale:.1f}"


# -------------------------------------------------------------------------------------------------- comm


def run_comm(cfg, args) -> str:
    from xmoe.plan import comm

    net = comm.Network(args.intra_bw, args.inter_bw, args.intra_lat, args.inter_lat)
    if min(args.intra_bw, args.inter_bw) <= 0 or min(args.intra_lat, args.inter_lat) < 0:
        raise ValueError("bandwidths must be > 0 and latencies >= 0")
    if args.tp > args.gpus_per_node:
        raise ValueError(f"--tp ({args.tp}) must be <= --gpus-per-node ({args.gpus_per_node})")
    probs = comm.routing_probs(args.routing, cfg.moe.num_experts, cfg.moe.top_k, args.seed)
    common = dict(
        gpus_per_node=args.gpus_per_node,
        tp=args.tp,
        placement=args.placement,
        routing=probs,
        tokens_per_gpu=args.tokens_per_gpu,
        network=net,
        mc_tokens=args.mc_tokens,
        seed=args.seed,
    )
    est = comm.estimate_comm(cfg, args.gpus, ep=args.ep, **common)
    r, moe = est.rows, cfg.moe
    mb = lambda rows: f"{est.nbytes(rows) / 1e6:.1f} MB"  # noqa: E731
    lines = [
        f"xmoe plan comm: {args.preset}, {args.gpus} GPUs ({args.gpus_per_node} per node), ep {est.ep} "
        f"(EP group on {est.group_nodes} node{'s' if est.group_nodes > 1 else ''}, {args.placement}), "
        f"{r.tokens:.0f} tokens per GPU, top-{moe.top_k} of {moe.num_experts} experts, H {cfg.hidden_size} bf16",
        f"routing {args.routing} ({est.method}); per GPU: intra {net.intra_bw:g} GB/s + {net.intra_lat:g} us, "
        f"inter {net.inter_bw:g} GB/s + {net.inter_lat:g} us",
        f"rows one GPU sends per dispatch{'':<9}{'flat':>12}{'RBD':>12}",
        f"  kept on the GPU (no transfer){'':<10}{r.flat_local:>12.0f}{r.flat_local:>12.0f}",
        f"  intra-node, own node{'':<19}{r.flat_intra:>12.0f}{r.flat_intra:>12.0f}",
        f"  intra-node, replicas on remote nodes{'':<3}{0:>12.0f}{r.rbd_replicas:>12.0f}",
        f"  inter-node{'':<29}{r.flat_inter:>12.0f}{r.rbd_inter:>12.0f}",
        f"redundancy rate R = {r.redundancy_rate:.3f}; RBD sends {100 * r.inter_saving:.1f}% fewer inter-node rows "
        f"({mb(r.flat_inter)} -> {mb(r.rbd_inter)})",
        f"time per dispatch: flat {est.flat_us:.0f} us, RBD {est.rbd_us:.0f} us -> {est.speedup:.2f}x "
        "(combine costs the same again; forward + backward 4x)",
    ]
    if est.method == "closed form":
        mc = comm.estimate_comm(cfg, args.gpus, ep=args.ep, method="mc", **common)
        lines.append(
            f"check by {mc.method}: inter rows flat {mc.rows.flat_inter:.0f}, "
            f"RBD {mc.rows.rbd_inter:.0f}, replicas {mc.rows.rbd_replicas:.0f}, "
            f"R {mc.rows.redundancy_rate:.3f}"
        )
    lines += [
        "",
        f"scaling (ep = {args.ep or 'min(E, gpus / tp)'}, {args.placement}, same tokens per GPU):",
        f"{'gpus':>9}{'ep':>5}{'nodes':>6}{'flat inter':>12}{'RBD inter':>11}{'saved':>7}{'R':>7}"
        f"{'flat MB':>9}{'RBD MB':>8}{'flat us':>9}{'RBD us':>8}{'speedup':>9}",
    ]
    # once ep stops growing with the GPU count every row reads the same: print each distinct row once, under
    # the range of GPU counts it holds for
    groups: list[tuple[list[int], str]] = []
    for e in comm.scaling_table(cfg, ep=args.ep, **common):
        x = e.rows
        row = (
            f"{e.ep:>5}{e.group_nodes:>6}{x.flat_inter:>12.0f}{x.rbd_inter:>11.0f}"
            f"{100 * x.inter_saving:>6.1f}%{x.redundancy_rate:>7.3f}{e.nbytes(x.flat_inter) / 1e6:>9.1f}"
            f"{e.nbytes(x.rbd_inter) / 1e6:>8.1f}{e.flat_us:>9.0f}{e.rbd_us:>8.0f}{e.speedup:>8.2f}x"
        )
        if groups and groups[-1][1] == row:
            groups[-1][0].append(e.gpus)
        else:
            groups.append(([e.gpus], row))
    for gpus, row in groups:
        label = str(gpus[0]) if len(gpus) == 1 else f"{gpus[0]}-{gpus[-1]}"
        lines.append(f"{label:>9}{row}" + ("  <-" if args.gpus in gpus else ""))
    return "\n".join(lines)
