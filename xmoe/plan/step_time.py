"""The step time of expert-parallel training, with and without each technique that hides or shrinks the all-to-all:
overlap (``ep_overlap`` off / shared / chunks), FP8 dispatch, node-limited routing, and RBD instead of flat.

# T tokens per GPU, K top-k, E experts, H hidden, F expert ffn, P ranks in the EP group, E_l = E / P, n chunks

step = compute - overlappable compute + sum over MoE layers and micro-batches of the layer calls' times
(overlap.py: forward, backward, and the forward again under recompute), where
  compute        the step's compute alone: measured (`xmoe plan memory --measure` runs one rank with no
                 communication and reports it) or estimated from the model's FLOPs at an assumed throughput;
  overlappable   the routed experts (6 T K H F FLOPs forward per layer, 2x that backward) and the shared experts
                 (6 T H F_s; up projections 2/3, down 1/3), timed at ``tflops``: the rest of the step (attention,
                 router, head, optimizer) overlaps no collective of the MoE layer;
  chunk cost     n chunks run the routed experts as n smaller grouped GEMMs, charged as if every local expert had
                 ``chunk_overhead_rows`` more rows per GEMM: a layer's expert time a (T K + E_l r0) becomes
                 a (T K + n E_l r0) (the default r0 = 300 fits one H100's routed layer, forward + backward bf16:
                 12.5 ms at 16384 tokens vs 2 x 7.35 ms at 8192 for the small shape, 1536 rows per expert, r0 = 328;
                 35.0 vs 2 x 22.2 ms for the medium shape, 768 rows per expert, r0 = 283);
  network        each exchange is a sequence of collectives on the EP group; a collective costs
                 max(intra part, inter part), each latency + bytes / bandwidth (comm.Network; nothing to send: 0):
    flat  dispatch, combine, and their backward: one all-to-all each of the slots' rows;
    RBD   dispatch = stage 1 (pilots across nodes, own-node rows) + its ids + stage 2 (replicas inside nodes) + its
          ids; combine = the weights along stages 1 and 2 + partial sums back along stages 2 and 1; backward: the
          rows along stages 1 and 2 + the weight gradients back (combine's), then stages 2 and 1 back (dispatch's);
          ids and weights K x 4 bytes per row;
  row bytes      2 H (bf16); FP8 dispatch: H + 4 H / 128 (e4m3 and one fp32 scale per 128), the forward dispatch
                 only: the combine and every backward exchange stay bf16.
Node-limited routing changes the rows (node_limit.py); chunks split every exchange into n of 1/n of the rows, each
paying its own latencies. ``exposed`` = step - compute - chunk cost: the communication no compute hides.
Not modelled: compute slowed by the collectives running beside it (NCCL's kernels take SMs; gloo's threads take
CPU cores), routing imbalance, the host sync's own cost, FSDP2's collectives (in the measured compute or not at
all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from xmoe.config import ModelConfig
from xmoe.model.flops import FlopDims, forward_macs
from xmoe.plan import overlap as sched
from xmoe.plan.comm import CommEstimate, Network, RowCounts, estimate_comm

DEFAULT_TFLOPS = 400.0  # bf16 expert GEMMs, forward + backward, one H100 (the small and medium routed layers above)
CHUNK_OVERHEAD_ROWS = 300.0  # r0 above
DISPATCHERS = ("pft", "rbd")
DISPATCH_DTYPES = ("bf16", "fp8")
ID_BYTES = 4  # int32 expert ids, fp32 router weights: K of each per RBD row


@dataclass(frozen=True)
class Techniques:
    dispatcher: str = "pft"  # "pft": flat all-to-all; "rbd"
    overlap: str = "off"  # sched.OVERLAP_MODES
    chunks: int = 2  # with overlap "chunks"
    dispatch_dtype: str = "bf16"  # "bf16" | "fp8" (the forward dispatch's rows)
    max_nodes_per_token: int = 0  # node-limited routing's M (0: off)

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher ({self.dispatcher!r}) must be one of {', '.join(DISPATCHERS)}")
        if self.overlap not in sched.OVERLAP_MODES:
            raise ValueError(f"ep_overlap ({self.overlap!r}) must be one of {', '.join(sched.OVERLAP_MODES)}")
        if self.chunks < 2:
            raise ValueError(f"ep_chunks ({self.chunks}) must be >= 2")
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dispatch_dtype ({self.dispatch_dtype!r}) must be one of {', '.join(DISPATCH_DTYPES)}")

    @property
    def label(self) -> str:
        mode = f"chunks {self.chunks}" if self.overlap == "chunks" else self.overlap
        node = f"M={self.max_nodes_per_token}" if self.max_nodes_per_token else "off"
        return f"{'flat' if self.dispatcher == 'pft' else 'RBD'}, {mode}, {self.dispatch_dtype}, nodes {node}"


@dataclass(frozen=True)
class ComputeModel:
    """One rank's compute per step, and the parts of it that the MoE layer's collectives can hide behind."""

    step_ms: float  # the whole step's compute, no communication
    experts_ms: float  # routed experts' forward, one MoE layer call (one micro-batch, unchunked)
    shared_ms: float  # shared experts' forward, one MoE layer call
    moe_layers: int
    micro_batches: int
    recompute: str  # "none" | "moe" | "full": the MoE layer's forward runs again in backward unless "none"
    rows: float  # routed rows a rank's experts compute per layer call (T K, balanced)
    local_experts: int
    chunk_overhead_rows: float
    source: str  # where step_ms came from, in words

    @property
    def forwards(self) -> int:
        return 1 if self.recompute == "none" else 2

    def chunked_experts_ms(self, chunks: int) -> float:
        """One chunk's routed-expert forward (n chunks: smaller GEMMs, module docstring)."""
        base = self.rows + self.local_experts * self.chunk_overhead_rows
        return self.experts_ms * (self.rows / chunks + self.local_experts * self.chunk_overhead_rows) / base

    @property
    def overlappable_ms(self) -> float:
        """Routed and shared experts' compute in the step (forward, backward 2x, recompute)."""
        return (self.experts_ms + self.shared_ms) * (self.forwards + 2) * self.moe_layers * self.micro_batches


def compute_model(
    cfg: ModelConfig,
    tokens: int,
    *,
    ep: int,
    compute_ms: float | None = None,
    experts_ms: float | None = None,
    tflops: float = DEFAULT_TFLOPS,
    recompute: str = "none",
    micro_batches: int = 1,
    chunk_overhead_rows: float = CHUNK_OVERHEAD_ROWS,
) -> ComputeModel:
    """The compute side: ``compute_ms`` (a measured step) when given, else the model's training FLOPs for
    ``tokens`` per micro-batch at ``tflops`` (plus the recomputed forward). The routed experts' forward of one
    layer call: ``experts_ms`` when measured, else its FLOPs at ``tflops``; the shared experts' in proportion."""
    _check_compute(tflops, compute_ms, experts_ms, chunk_overhead_rows, recompute)
    moe = cfg.moe
    moe_layers = cfg.num_layers - cfg.first_k_dense
    rows = tokens * moe.top_k
    flops_per_ms = tflops * 1e9
    routed_flops = 6 * rows * cfg.hidden_size * moe.ffn_hidden_size
    shared_flops = 6 * tokens * cfg.hidden_size * moe.shared_width
    ms_per_flop = experts_ms / routed_flops if experts_ms is not None else 1 / flops_per_ms
    experts_ms, shared_ms = routed_flops * ms_per_flop, shared_flops * ms_per_flop
    local_experts = moe.num_experts // ep
    model = ComputeModel(
        0.0, experts_ms, shared_ms, moe_layers, micro_batches, recompute, rows, local_experts, chunk_overhead_rows, ""
    )
    if compute_ms is None:  # the experts as above, the rest of the model's FLOPs at `tflops`
        seq = min(tokens, cfg.max_seq_len)
        macs = forward_macs(FlopDims.from_model_config(cfg, seq), 1)
        per_seq = {k: v * tokens / seq for k, v in macs.items()}  # attention per sequence of `seq` tokens
        rest = sum(per_seq.values()) - per_seq["routed_experts"] - per_seq["shared_experts"]
        again = {"none": 0.0, "moe": per_seq["router"], "full": rest - per_seq["lm_head"]}[recompute]
        compute_ms = 2 * (3 * rest + again) * micro_batches / flops_per_ms + model.overlappable_ms
        source = f"estimated: the model's FLOPs at {tflops:g} TFLOP/s (pass --compute-ms for a measured step)"
    else:
        source = f"measured {compute_ms:g} ms per step"
    model = replace(model, step_ms=compute_ms, source=source)
    if model.overlappable_ms > compute_ms:
        raise ValueError(
            f"the experts' compute ({model.overlappable_ms:.0f} ms per step: {experts_ms:.3g} ms forward per layer "
            f"call) exceeds the step's compute ({compute_ms:g} ms): give the experts' real time (--experts-ms) "
            "or throughput (--tflops)"
        )
    return model


def _check_compute(
    tflops: float, compute_ms: float | None, experts_ms: float | None, chunk_overhead_rows: float, recompute: str
) -> None:
    for name, value in (("tflops", tflops), ("compute_ms", compute_ms), ("experts_ms", experts_ms)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} ({value}) must be a finite number > 0")
    if chunk_overhead_rows < 0 or not math.isfinite(chunk_overhead_rows):
        raise ValueError(f"chunk_overhead_rows ({chunk_overhead_rows}) must be a finite number >= 0")
    if recompute not in ("none", "moe", "full"):
        raise ValueError(f"recompute ({recompute!r}) must be none, moe or full")


@dataclass(frozen=True)
class StepPrediction:
    techniques: Techniques
    step_ms: float
    compute_ms: float  # the step's compute without chunking
    chunk_cost_ms: float  # the chunked GEMMs' extra time
    network_ms: float  # the network busy over the step
    exposed_forward_ms: float  # compute waiting on the network: forward calls (count exchanges included)
    exposed_backward_ms: float  # backward calls, the recomputed forward included
    rows: RowCounts
    layer_network_ms: tuple[float, float]  # one layer call's network time: forward, backward (recompute included)
    layer_hideable_ms: tuple[float, float]  # and the experts' compute it can hide behind
    calls: int  # MoE layer calls per step (layers x micro-batches)

    @property
    def exposed_ms(self) -> float:
        return self.exposed_forward_ms + self.exposed_backward_ms


def row_bytes(hidden: int, dtype: str) -> float:
    """Bytes of one dispatched row: bf16, or FP8 e4m3 with one fp32 scale per 128 values."""
    return 2.0 * hidden if dtype == "bf16" else hidden + 4.0 * math.ceil(hidden / 128)


def _collective_ms(net: Network, intra_bytes: float, inter_bytes: float) -> float:
    return max(net.stage_us(intra_bytes, False), net.stage_us(inter_bytes, True)) / 1e3


def exchange_ms(est: CommEstimate, tech: Techniques, fraction: float, top_k: int) -> dict[str, float]:
    """Network time (ms) of one chunk (``fraction`` of the rows) of each exchange of a layer call."""
    r, net = est.rows.scaled(fraction), est.network
    bf16, fwd = row_bytes(est.hidden, "bf16"), row_bytes(est.hidden, tech.dispatch_dtype)
    ids = ID_BYTES * top_k

    def coll(intra_rows: float, inter_rows: float, nbytes: float) -> float:
        return _collective_ms(net, intra_rows * nbytes, inter_rows * nbytes)

    if tech.dispatcher == "pft":
        return {
            "dispatch": coll(r.flat_intra, r.flat_inter, fwd),
            "combine": coll(r.flat_intra, r.flat_inter, bf16),
            "combine_bwd": coll(r.flat_intra, r.flat_inter, bf16),
            "dispatch_bwd": coll(r.flat_intra, r.flat_inter, bf16),
        }
    own, pilots, replicas = r.flat_intra, r.rbd_inter, r.rbd_replicas

    def stages(nbytes: float) -> tuple[float, float]:
        return coll(own, pilots, nbytes), coll(replicas, 0.0, nbytes)

    rows_fwd, rows_bf16, small = stages(fwd), stages(bf16), stages(ids)
    return {
        "dispatch": sum(rows_fwd) + sum(small),
        "combine": sum(small) + sum(rows_bf16),
        "combine_bwd": sum(rows_bf16) + sum(small),
        "dispatch_bwd": sum(rows_bf16),
    }


def count_exchange_ms(est: CommEstimate, tech: Techniques, local_experts: int) -> float:
    """The count exchange: an equal-split all-to-all of int64 counts per destination, E_l of them (RBD: E_l + 1 +
    2Q, Q the most EP ranks on one node)."""
    q = math.ceil(est.ep / est.group_nodes)
    per_dest = 8 * (local_experts + (0 if tech.dispatcher == "pft" else 1 + 2 * q))
    return _collective_ms(est.network, (q - 1) * per_dest, (est.ep - q) * per_dest)


def predict_step(est: CommEstimate, compute: ComputeModel, tech: Techniques, *, top_k: int) -> StepPrediction:
    """The step time of ``tech`` on the rows and network of ``est`` (estimated under tech's node limit)."""
    if tech.max_nodes_per_token != est.max_nodes_per_token:
        raise ValueError(
            f"the rows were estimated with max_nodes_per_token {est.max_nodes_per_token}, the techniques ask for "
            f"{tech.max_nodes_per_token}: estimate_comm(..., max_nodes_per_token=M) first"
        )
    n = tech.chunks if tech.overlap == "chunks" else 1
    net = exchange_ms(est, tech, 1.0 / n, top_k)
    experts = compute.chunked_experts_ms(n) if n > 1 else compute.experts_ms
    shared = compute.shared_ms
    times = sched.CallTimes(
        count_exchange_ms(est, tech, compute.local_experts) if est.ep > 1 else 0.0,
        net["dispatch"],
        net["combine"],
        net["combine_bwd"],
        net["dispatch_bwd"],
        experts,
        shared * 2 / 3,
        shared / 3,
    )
    fwd = sched.forward(tech.overlap, n, times)
    bwd = sched.backward(tech.overlap, n, times)
    calls = compute.moe_layers * compute.micro_batches
    again = compute.forwards - 1  # the forward recomputed in backward
    layer_time = fwd.time * compute.forwards + bwd.time
    chunk_cost = (experts * n - compute.experts_ms) * (compute.forwards + 2) * calls
    step = compute.step_ms - compute.overlappable_ms + calls * layer_time
    return StepPrediction(
        tech,
        step,
        compute.step_ms,
        chunk_cost,
        calls * (fwd.network * compute.forwards + bwd.network),
        calls * fwd.exposed,
        calls * (bwd.exposed + again * fwd.exposed),
        est.rows,
        (fwd.network, bwd.network + again * fwd.network),
        (fwd.compute, bwd.compute + again * fwd.compute),
        calls,
    )


def pick_overlap(by_mode: dict[str, StepPrediction], min_gain: float = 0.01) -> str:
    """The mode of the shortest step; a more complex one (in sched.OVERLAP_MODES' order) only where it saves more
    than ``min_gain`` of the step of the one picked so far."""
    best = "off"
    for mode in sched.OVERLAP_MODES[1:]:
        if by_mode[mode].step_ms < by_mode[best].step_ms * (1 - min_gain):
            best = mode
    return best


def choose_ep_overlap(
    cfg: ModelConfig,
    *,
    gpus: int,
    ep: int,
    gpus_per_node: int = 8,
    tp: int = 1,
    placement: str = "ep_first",
    dispatcher: str = "pft",
    tokens_per_gpu: int | None = None,
    dispatch_dtype: str = "bf16",
    max_nodes_per_token: int = 0,
    chunks: int = 2,
    network: Network | None = None,
    compute_ms: float | None = None,
    tflops: float = DEFAULT_TFLOPS,
    recompute: str = "none",
    micro_batches: int = 1,
) -> str:
    """The overlap mode for a layout: "off" when ep == 1 (no all-to-all), else the mode of the shortest predicted
    step, preferring the simpler one (off < shared < chunks) unless the other saves more than 1% of the step
    (pick_overlap). ``dispatcher`` "padded" (equal-split buffers, no overlap path) gets "off"."""
    if ep == 1 or dispatcher == "padded":
        return "off"
    tokens = tokens_per_gpu or cfg.max_seq_len
    est = estimate_comm(
        cfg,
        gpus,
        gpus_per_node=gpus_per_node,
        ep=ep,
        tp=tp,
        placement=placement,
        tokens_per_gpu=tokens,
        network=network or Network(),
        max_nodes_per_token=max_nodes_per_token,
        mc_tokens=1024,
        mc_sources=4,
    )
    compute = compute_model(
        cfg, tokens, ep=ep, compute_ms=compute_ms, tflops=tflops, recompute=recompute, micro_batches=micro_batches
    )
    base = Techniques(dispatcher, "off", chunks, dispatch_dtype, est.max_nodes_per_token)
    top_k = cfg.moe.top_k
    return pick_overlap(
        {m: predict_step(est, compute, replace(base, overlap=m), top_k=top_k) for m in sched.OVERLAP_MODES}
    )
