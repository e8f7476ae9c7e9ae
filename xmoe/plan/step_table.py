"""The step-time part of `xmoe plan comm`: the predicted step with and without each technique (step_time.py), as
text lines for the command to print."""

from __future__ import annotations

import itertools
from dataclasses import replace

from xmoe.plan import comm
from xmoe.plan import overlap as sched
from xmoe.plan.step_time import (
    DISPATCH_DTYPES,
    DISPATCHERS,
    ComputeModel,
    StepPrediction,
    Techniques,
    pick_overlap,
    predict_step,
)

CHUNK_COUNTS = (2, 3, 4, 8)


def predictions(
    estimates: dict[int, comm.CommEstimate], compute: ComputeModel, chunks: int, top_k: int
) -> list[StepPrediction]:
    """Every combination: dispatcher x overlap x dispatch dtype x node limit (the keys of ``estimates``)."""
    out = []
    for limit, dispatcher, mode, dtype in itertools.product(
        estimates, DISPATCHERS, sched.OVERLAP_MODES, DISPATCH_DTYPES
    ):
        est = estimates[limit]
        tech = Techniques(dispatcher, mode, chunks, dtype, est.max_nodes_per_token)
        out.append(predict_step(est, compute, tech, top_k=top_k))
    return out


def _key(p: StepPrediction) -> tuple:
    t = p.techniques
    return (t.dispatcher, t.overlap, t.dispatch_dtype, t.max_nodes_per_token)


def step_lines(
    estimates: dict[int, comm.CommEstimate], compute: ComputeModel, chunks: int, top_k: int, tokens: float
) -> list[str]:
    """The table of every combination, the best one with each technique taken away in turn, what stays exposed,
    and the overlap mode the trainer would choose for each setting."""
    preds = predictions(estimates, compute, chunks, top_k)
    by_key = {_key(p): p for p in preds}
    today = by_key[("pft", "off", "bf16", 0)]
    c = compute
    lines = [
        "",
        f"step time per GPU ({c.micro_batches} micro-batch(es) of {tokens:.0f} tokens, {c.moe_layers} MoE layers, "
        f"recompute {c.recompute}): compute {c.step_ms:.0f} ms ({c.source})",
        f"  routed experts {c.experts_ms:.2f} ms forward per layer call (backward 2x), shared experts "
        f"{c.shared_ms:.2f} ms: {c.overlappable_ms:.0f} ms of the step can hide communication; chunks: {chunks}, "
        f"each GEMM charged {c.chunk_overhead_rows:g} rows more per local expert ({c.local_experts})",
        f"  {'dispatcher':<11}{'overlap':<9}{'dispatch':<9}{'nodes':<7}{'network':>9}{'exposed fwd':>12}"
        f"{'bwd':>7}{'chunking':>9}{'step ms':>9}{'vs today':>9}",
    ]
    for p in preds:
        t = p.techniques
        lines.append(
            f"  {'flat' if t.dispatcher == 'pft' else 'RBD':<11}{t.overlap:<9}{t.dispatch_dtype:<9}"
            f"{('M=' + str(t.max_nodes_per_token)) if t.max_nodes_per_token else 'off':<7}{p.network_ms:>9.0f}"
            f"{p.exposed_forward_ms:>12.0f}{p.exposed_backward_ms:>7.0f}{p.chunk_cost_ms:>9.1f}{p.step_ms:>9.0f}"
            f"{today.step_ms / p.step_ms:>8.2f}x"
        )
    lines.append(
        "  (network: busy time of the step's all-to-alls; exposed: compute waiting on them, forward and backward; "
        "chunking: the smaller GEMMs' extra time)"
    )
    for limit in sorted({_key(p)[3] for p in preds}):
        best = min((p for p in preds if _key(p)[3] == limit), key=lambda p: p.step_ms)
        lines += [
            f"best with {'no node limit' if not limit else f'node limit M={limit}'}: {best.techniques.label}: "
            f"{best.step_ms:.0f} ms per step, {today.step_ms / best.step_ms:.2f}x today's {today.step_ms:.0f} ms",
            "  without one of its techniques: " + "; ".join(_leave_one_out(best, by_key)),
            "  " + _exposure(best),
        ]
        if best.techniques.overlap == "chunks":
            counts = {
                n: predict_step(estimates[limit], compute, replace(best.techniques, chunks=n), top_k=top_k)
                for n in CHUNK_COUNTS
            }
            lines.append("  by chunks: " + ", ".join(f"{n}: {p.step_ms:.0f} ms" for n, p in counts.items()))
    lines.append(_choices(preds))
    return lines


def _leave_one_out(best: StepPrediction, by_key: dict[tuple, StepPrediction]) -> list[str]:
    dispatcher, mode, dtype, limit = _key(best)
    swaps = {
        "RBD -> flat" if dispatcher == "rbd" else "flat -> RBD": ("pft" if dispatcher == "rbd" else "rbd", mode, dtype),
        f"overlap {mode} -> off" if mode != "off" else "overlap off -> chunks": (
            dispatcher,
            "off" if mode != "off" else "chunks",
            dtype,
        ),
        "FP8 dispatch -> bf16" if dtype == "fp8" else "bf16 dispatch -> FP8": (
            dispatcher,
            mode,
            "bf16" if dtype == "fp8" else "fp8",
        ),
    }
    out = [f"{name} {by_key[(*key, limit)].step_ms:.0f} ms" for name, key in swaps.items()]
    if limit:
        out.append(f"node limit off {by_key[(dispatcher, mode, dtype, 0)].step_ms:.0f} ms")
    return out


def _exposure(p: StepPrediction) -> str:
    """What stays exposed: the network time no expert compute beside it can cover, whatever the overlap, and (with
    overlap) the pipeline's ends on top: the count exchange, the first dispatch, the last combine."""
    (net_f, net_b), (hide_f, hide_b) = p.layer_network_ms, p.layer_hideable_ms
    floor_f, floor_b = max(0.0, net_f - hide_f), max(0.0, net_b - hide_b)
    text = (
        f"exposed {p.exposed_ms:.0f} ms per step (forward {p.exposed_forward_ms:.0f}, backward "
        f"{p.exposed_backward_ms:.0f}); per layer call the network needs {net_f:.1f} ms forward and {net_b:.1f} ms "
        f"backward beside {hide_f:.1f} and {hide_b:.1f} ms of expert compute"
    )
    if p.techniques.overlap == "off":
        return text + ": nothing overlaps"
    ends = p.exposed_ms - (floor_f + floor_b) * p.calls
    return (
        text + f": {(floor_f + floor_b) * p.calls:.0f} ms per step more network than compute to hide it (forward "
        f"{floor_f:.1f}, backward {floor_b:.1f} ms per call), {ends:.0f} ms the pipeline's ends (count exchange, "
        "first dispatch, last combine)" + (f"; chunking costs {p.chunk_cost_ms:.0f} ms" if p.chunk_cost_ms else "")
    )


def _choices(preds: list[StepPrediction]) -> str:
    """pick_overlap's mode (the trainer's default ep_overlap) for each dispatcher, dtype and node limit."""
    groups: dict[tuple, dict[str, StepPrediction]] = {}
    for p in preds:
        t = p.techniques
        groups.setdefault((t.dispatcher, t.dispatch_dtype, t.max_nodes_per_token), {})[t.overlap] = p
    picked = {key: pick_overlap(by_mode) for key, by_mode in groups.items()}
    if len(set(picked.values())) == 1:
        return f"default ep_overlap for this layout (choose_ep_overlap): {next(iter(picked.values()))} in every setting"
    described = [
        f"{'flat' if d == 'pft' else 'RBD'} {dt} {'M=' + str(lim) if lim else 'no node limit'}: {m}"
        for (d, dt, lim), m in picked.items()
    ]
    return "default ep_overlap for this layout (choose_ep_overlap): " + "; ".join(described)
