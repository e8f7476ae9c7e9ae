"""The tables of `xmoe plan memory` and `xmoe plan comm`: the analytical models of xmoe/plan, run on the command's
checked arguments (cli.py), their results laid out as text for the command to print.

Nothing is allocated and no GPU is needed; docs/planning.md explains both models and their numbers.
"""

from __future__ import annotations

import math

from xmoe.config import RECOMPUTE_MODES

# The models (and, through them, torch) are imported when a table is built: `xmoe --help` stays quick.
GIB = 2**30


# ------------------------------------------------------------------------------------------------ memory


def rank_layouts(cfg, args, **extra) -> list:
    """The planner's layouts for the options given, best first (layouts.search_layouts; ``extra``: more of
    estimate_memory's options)."""
    from xmoe.plan import layouts

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
        name=model_name(args),
        **extra,
    )
    return layouts.search_layouts(
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
        f"xmoe plan memory: {model_name(args)} on {args.gpus} GPUs ({args.gpus_per_node} per node), "
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
        f"xmoe plan memory --trainer: {model_name(args)} with {cfg.num_layers} layers, seq {seq}, one GPU of "
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


def model_name(args) -> str:
    """The model's name in a table's first line: the preset, the config file or the Hugging Face directory."""
    return getattr(args, "preset", None) or getattr(args, "init_from", None) or getattr(args, "config", None) or "small"


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
    compute = (
        "fp32 throughout"
        if m.precision == "fp32"
        else "autocast bf16, FSDP2 gathers bf16"
        if m.wrapper == "FSDP2"
        else "autocast bf16, compiled regions"
    )
    rows = _memory_rows(m)
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
        f"{'MoE block' if cfg.has_moe else 'FFN'} on {m.moe_tokens})",
        "  attention: " + _terms(m.attention_layer, layer_scale),
        ("  MoE block: " if cfg.has_moe else "  FFN: ") + _terms(m.ffn_layer, layer_scale),
    ]
    if m.wrapper != "none":
        lines.append(_traffic_line(m))
    return lines + [f"note: {n}" for n in m.notes]


def _memory_rows(m) -> list[tuple[str, str, float]]:
    """(term, what it holds in this layout, bytes) for each line of the breakdown."""
    p = m.parallel
    where = {
        "FSDP2": f"FSDP2 shards: {m.dense_params / 1e6:.1f}M dense over dp*ep={p.dp * p.ep}, "
        f"{m.expert_params / 1e6:.1f}M expert over dp={p.dp}",
        "DDP": f"DDP replica of {(m.dense_params + m.expert_params) / 1e6:.1f}M",
        "none": f"one process, {(m.dense_params + m.expert_params) / 1e6:.1f}M",
    }[m.wrapper]
    fsdp, ddp = m.wrapper == "FSDP2", m.wrapper == "DDP"
    return [
        ("parameters", f"fp32 ({where})", m.params),
        (
            "gradients",
            "reduced fp32 shards, unsharded ones in flight" if fsdp else "fp32, + DDP's buckets" if ddp else "fp32",
            m.grads,
        ),
        ("optimizer", "AdamW exp_avg + exp_avg_sq, fp32", m.optimizer),
        (
            "gathered",
            "root kept, the unit in hand, the prefetched one" if fsdp else "bf16 expert copies for the step",
            m.gathered,
        ),
        ("activations", "saved, of the layers whose backward is still to run", m.activations),
        (
            "working",
            "activation gradients, reduce-scatter input, loss"
            if fsdp
            else "activation gradients, recomputed block, loss",
            m.working,
        ),
        ("reserve", "CUDA context, NCCL buffers, fragmentation", m.reserve),
    ]


def _traffic_line(m) -> str:
    """What one GPU sends per micro-batch: its wrapper's collectives and the expert all-to-alls."""
    t = m.traffic
    collectives = (
        f"DDP all-reduce {t['ddp'] / 1e9:.1f}"
        if m.wrapper == "DDP"
        else f"FSDP2 dense {t['fsdp_dense'] / 1e9:.1f}, FSDP2 experts {t['fsdp_experts'] / 1e9:.1f}"
    )
    return f"traffic per GPU per micro-batch (GB): {collectives}, expert all-to-all {t['all_to_all'] / 1e9:.1f}"


def _terms(parts: dict[str, float], scale: float) -> str:
    return ", ".join(f"{k} {v / scale:.1f}" for k, v in parts.items()) + f"; total {sum(parts.values()) / scale:.1f}"


# -------------------------------------------------------------------------------------------------- comm


def run_comm(cfg, args) -> str:
    from xmoe.plan import comm

    inter_bw = args.inter_bw if args.node_inter_bw is None else args.node_inter_bw / args.gpus_per_node
    net = comm.Network(args.intra_bw, inter_bw, args.intra_lat, args.inter_lat)
    if min(args.intra_bw, inter_bw) <= 0 or min(args.intra_lat, args.inter_lat) < 0:
        raise ValueError("bandwidths must be > 0 and latencies >= 0")
    limits = _node_limits(args.max_nodes_per_token)
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
        f"xmoe plan comm: {model_name(args)}, {args.gpus} GPUs ({args.gpus_per_node} per node), ep {est.ep} "
        f"(EP group on {est.group_nodes} node{'s' if est.group_nodes > 1 else ''}, {args.placement}), "
        f"{r.tokens:.0f} tokens per GPU, top-{moe.top_k} of {moe.num_experts} experts, H {cfg.hidden_size} bf16",
        f"routing {args.routing} ({est.method}); per GPU: intra {net.intra_bw:g} GB/s + {net.intra_lat:g} us, "
        f"inter {net.inter_bw:g} GB/s + {net.inter_lat:g} us"
        + ("" if args.node_inter_bw is None else f" (the node's {args.node_inter_bw:g} GB/s over its GPUs)"),
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
    lines += _step_lines(cfg, args, est, common, limits)
    return "\n".join(lines + _scaling_lines(cfg, args, common))


def _scaling_lines(cfg, args, common: dict) -> list[str]:
    """The same dispatch at every GPU count, each distinct row once: once ep stops growing with the GPU count every
    row reads the same, so a row stands under the range of GPU counts it holds for."""
    from xmoe.plan import comm

    lines = [
        "",
        f"scaling (ep = {args.ep or 'min(E, gpus / tp)'}, {args.placement}, same tokens per GPU):",
        f"{'gpus':>9}{'ep':>5}{'nodes':>6}{'flat inter':>12}{'RBD inter':>11}{'saved':>7}{'R':>7}"
        f"{'flat MB':>9}{'RBD MB':>8}{'flat us':>9}{'RBD us':>8}{'speedup':>9}",
    ]
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
    return lines


def _node_limits(text: str) -> list[int]:
    """--max-nodes-per-token's comma-separated list of M (0: none), checked."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--max-nodes-per-token ({text!r}) must be integers, comma-separated (e.g. 4 or 1,2,4)"
        ) from None
    if any(v < 0 for v in values):
        raise ValueError(f"--max-nodes-per-token ({text}) must be >= 0 (0: no limit)")
    return sorted(set(values) - {0})


def _step_lines(cfg, args, est, common: dict, limits: list[int]) -> list[str]:
    """The step time with and without each technique (plan.step_table), compute measured or estimated."""
    from xmoe.plan import comm, step_table, step_time

    layers_ms = args.layer_compute_ms
    compute = step_time.compute_model(
        cfg,
        int(est.rows.tokens),
        ep=est.ep,
        compute_ms=args.compute_ms if layers_ms is None else layers_ms * cfg.num_layers * args.micro_batches,
        experts_ms=args.experts_ms,
        tflops=args.tflops,
        recompute=args.recompute,
        micro_batches=args.micro_batches,
        chunk_overhead_rows=args.chunk_overhead_rows,
    )
    estimates = {0: est}
    for limit in limits:
        limited = comm.estimate_comm(cfg, args.gpus, ep=args.ep, max_nodes_per_token=limit, **common)
        if limited.max_nodes_per_token:  # M < the group's nodes: the rule binds
            estimates[limit] = limited
    lines = step_table.step_lines(estimates, compute, args.ep_chunks, cfg.moe.top_k, est.rows.tokens)
    unbound = [m for m in limits if m not in estimates]
    if unbound:
        lines.append(f"node limit M={unbound} not shown: the EP group spans only {est.group_nodes} node(s)")
    for limit, e in estimates.items():
        if limit:
            r = e.rows
            lines.append(
                f"node limit M={limit} ({e.method}): {r.token_nodes / r.tokens:.2f} nodes per token (none: "
                f"{est.rows.token_nodes / est.rows.tokens:.2f}); inter-node rows per dispatch flat "
                f"{r.flat_inter:.0f}, RBD {r.rbd_inter:.0f} (none: {est.rows.rbd_inter:.0f}), replicas "
                f"{r.rbd_replicas:.0f}"
            )
    return lines
