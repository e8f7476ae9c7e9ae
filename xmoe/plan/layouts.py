"""The search for layouts that fit: every dp x ep x tp, micro-batch and recompute mode the options allow, each
planned by ``memory.estimate_memory``, feasible ones first in the order of ``_preference``.
"""

from __future__ import annotations

import math

from xmoe.config import RECOMPUTE_MODES, ModelConfig, ParallelConfig, Placement
from xmoe.plan.memory import MemoryBreakdown, estimate_memory

TP_CHOICES = (1, 2, 4, 8)


def _preference(m: MemoryBreakdown) -> tuple:
    """The search's order: fewest memory-saving tricks (recompute, then TP), then the largest micro-batch, then
    the least traffic per GPU per micro-batch (FSDP2 collectives + expert all-to-alls: a small EP makes every
    GPU all-gather E/EP experts' weights each pass, a large EP moves rows instead), then EP inside a node."""
    par = m.parallel
    node = par.gpus_per_node or par.world_size
    return (
        RECOMPUTE_MODES.index(m.recompute),
        par.tp,
        -m.micro_batch,
        round(sum(m.traffic.values()) / 1e6),
        par.ep * par.tp > node,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_layouts(
    cfg: ModelConfig,
    gpus: int,
    gpu_mem_gib: float,
    *,
    gpus_per_node: int = 8,
    tp: int | None = None,
    ep: int | None = None,
    dp: int | None = None,
    micro_batch: int | None = None,
    recompute: str | None = None,
    max_micro_batch: int = 8,
    placement: Placement = "ep_first",
    **kwargs,
) -> list[MemoryBreakdown]:
    """Every layout that the given options allow, feasible ones first in order of preference, then the rest
    by total memory. Options left as None are searched: tp in {1,2,4,8} (<= node, dividing gpus and heads),
    ep among the divisors of E that divide gpus / tp, dp = the rest, micro-batch 1, 2, 4, ... up to
    ``max_micro_batch``, recompute none / moe / full. Placement is EP-first when EP*TP fits in a node.
    ``kwargs`` go to estimate_memory (padded, capacity_factor, ssmb, seq_len, imbalance, ...)."""
    _check_search(gpus, gpus_per_node, tp, ep, dp, max_micro_batch)
    tps = [tp] if tp else [t for t in TP_CHOICES if t <= gpus_per_node and not gpus % t and not cfg.num_heads % t]
    mbs = [micro_batch] if micro_batch else [2**i for i in range(max_micro_batch.bit_length())]
    recs = [recompute] if recompute else list(RECOMPUTE_MODES)
    results, errors = [], []
    for t in tps:
        eps = [ep] if ep else [e for e in _divisors(cfg.moe.num_experts) if (gpus // t) % e == 0]
        for e in eps:
            if gpus % (t * e) or (dp is not None and dp * t * e != gpus):
                continue
            d = gpus // (t * e)
            place: Placement = "ep_first" if e * t <= gpus_per_node else placement
            par = ParallelConfig(dp=d, ep=e, tp=t, gpus_per_node=gpus_per_node, placement=place)
            for rec in recs:
                for mb in mbs:
                    try:
                        results.append(estimate_memory(cfg, par, micro_batch=mb, recompute=rec, **kwargs))
                    except ValueError as exc:  # e.g. tokens not divisible by tp under SSMB: skip the layout
                        errors.append(str(exc))
    if not results:
        why = f" (last reason: {errors[-1]})" if errors else ""
        raise ValueError(
            f"no layout of {gpus} GPUs satisfies tp={tp}, ep={ep}, dp={dp} for this model "
            f"({cfg.moe.num_experts} experts, {cfg.num_heads} heads){why}"
        )
    feasible = sorted((m for m in results if m.fits(gpu_mem_gib)), key=_preference)
    infeasible = sorted((m for m in results if not m.fits(gpu_mem_gib)), key=lambda m: m.total)
    return feasible + infeasible


def _check_search(
    gpus: int, gpus_per_node: int, tp: int | None, ep: int | None, dp: int | None, max_micro_batch: int
) -> None:
    """The search's options: whole nodes, TP inside one, fixed degrees dividing the GPUs, a micro-batch to try."""
    if gpus < 1:
        raise ValueError(f"gpus ({gpus}) must be >= 1")
    if gpus_per_node < 1:
        raise ValueError(f"gpus per node ({gpus_per_node}) must be >= 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"gpus ({gpus}) must be a multiple of gpus per node ({gpus_per_node}); use whole nodes")
    if tp is not None and tp > gpus_per_node:
        raise ValueError(f"tp ({tp}) must be <= gpus per node ({gpus_per_node}): TP needs the intra-node links")
    for label, value in (("tp", tp), ("ep", ep), ("dp", dp)):
        if value is not None and (value < 1 or gpus % value):
            raise ValueError(f"{label} ({value}) must divide gpus ({gpus})")
    given = [v for v in (tp, ep, dp) if v is not None]
    if (len(given) == 3 and math.prod(given) != gpus) or gpus % math.prod(given):
        raise ValueError(
            f"tp * ep * dp = {'*'.join(map(str, given))} = {math.prod(given)} must equal (or, with one "
            f"left to search, divide) gpus ({gpus})"
        )
    if max_micro_batch < 1:
        raise ValueError(f"max_micro_batch ({max_micro_batch}) must be >= 1")
