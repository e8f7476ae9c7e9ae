"""Per-GPU memory model of training a preset: what the trainer allocates, moment by moment, and its peak
(``estimate_memory``; the search for layouts that fit over it: ``layouts.py``). Its parts: ``terms.py`` (bytes per
element, the activations each sub-block saves), ``rank_run.py`` (how a rank runs the step: built once, handed to
the rest), ``fsdp_memory.py`` (FSDP2's units, the moments of a step) and ``trainer_memory.py`` (a whole replica:
`xmoe train` on one GPU, a CPU process, a DDP rank).

# T tokens per rank per micro-batch (micro_batch * seq), H hidden, F expert ffn, E experts (E_local = E / ep on a
# rank), K top-k, N routed rows a rank computes (T_moe * K when dropless), C capacity per expert (padded baseline),
# V vocab, L layers, P this rank's parameters, b bytes per activation element
# W world (GPUs), dp / ep / tp the data-, expert- and tensor-parallel degrees (W = dp * ep * tp)

Conventions: the trainer's (xmoe/parallel/build.py, expert_parallel.py; docs/planning.md has the measurements):
  * Precision, ``precision``: "bf16" as on GPUs (autocast bf16, an fp32 residual stream, FSDP2 gathering weights
    in bf16 and reducing gradients in fp32; the router and the embedding are fp32 units), "fp32" as on CPUs (no
    autocast). Either way parameters are fp32 (FSDP2's shards are the master weights, 4 B), reduced gradients fp32
    (4 B) and AdamW's exp_avg and exp_avg_sq fp32 (8 B).
  * Layout. With ep or tp > 1, FSDP2 shards each MoE layer's experts (E_local of them, the same on the tp peers)
    over "dp", each block (attention and dense FFN split by tp first; norms, shared experts and, on CPUs, the
    router whole) over "dp_ep", the router and the untied embedding (GPUs) over "dp_ep" as fp32 units of their
    own, and the root (final norm and head; the embedding too on CPUs or when tied, the root then fp32) over
    "dp_ep". The root is gathered at the start of forward and stays so until the end of backward
    (reshard_after_forward=False), and its unsharded gradient (the head's, V x H) exists from the loss on: the root
    reduces last. Embedding, head, norms, router and experts are replicated over TP. With ep = tp = 1 on several
    GPUs: DDP replicas (whole parameters, gradients, AdamW, and DDP's fp32 gradient buckets); on one GPU the
    trainer itself.
  * Activations: what autograd saves in xmoe's code, counted tensor by tensor in terms.py. TP (without
    sequence parallelism) replicates the residual stream: norms and the inputs of the column-parallel
    projections are full size on every TP rank, the head-parallel parts 1/tp. The MoE block (ffn norm, router,
    buffers, experts, shared experts) is replicated over TP without SSMB and runs on T/tp tokens with SSMB.
    Recompute: "moe" keeps each MoE block's fp32 input (4*T*H), "full" each block's; backward rebuilds the layer
    in hand.
  * The peak. Backward walks the FSDP2 units in reverse order (``fsdp_memory._BackwardWalk``); at each moment the
    live bytes are the sharded states, the root's gathered weights and gradient, the sharded gradients of the units
    already reduced, the one reduce-scatter input FSDP2 keeps in flight, the saved activations of the layers not
    yet done, and the unit in hand: its gathered weights and unsharded gradients, the all-gather buffer of the unit
    prefetched next, the activation gradients. The end of backward (the embedding's gradient, the root's
    reduce-scatter) and the optimizer step are moments too. The peak is the largest moment. A replica's:
    estimate_trainer_memory's backward walk (bf16; the same walk over eager fp32 blocks on CPUs), plus DDP's
    buckets, or its optimizer step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from xmoe.config import ModelConfig, ParallelConfig
from xmoe.model.counting import block_kinds, count_params
from xmoe.parallel.dims import ParallelDims
from xmoe.plan.fsdp_memory import _BackwardWalk, _fsdp_units, _Unit, _Units
from xmoe.plan.rank_run import RankRun
from xmoe.plan.terms import GRAD_BYTES
from xmoe.plan.trainer_memory import _replica_peak

GIB = 2**30


# the finer terms of a moment, and the MemoryBreakdown field each adds to
TERMS = {
    "params": "params",
    "optimizer": "optimizer",
    "adam_step": "optimizer",
    "gathered": "gathered",
    "gathered_own": "gathered",
    "prefetch": "gathered",
    "casts": "gathered",
    "grads": "grads",
    "grads_unit": "grads",
    "buckets": "grads",
    "activations": "activations",
    "reduce_buffer": "working",
    "transient": "working",
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU bytes of one training setting at its predicted peak (``peak_at``); ``total`` is that peak plus the
    reserve. ``peak_terms`` holds the peak's bytes by the finer terms of TERMS, which add up to the fields."""

    name: str
    parallel: ParallelConfig
    micro_batch: int
    seq_len: int
    recompute: str
    padded: bool
    capacity_factor: float | None
    ssmb: bool
    tokens: int  # T: tokens per rank per micro-batch
    moe_tokens: int  # tokens the MoE block of this rank processes (T / tp under SSMB)
    dense_params: float  # parameters of this GPU's shard (counts, not bytes)
    expert_params: float
    params: float  # fp32 parameters: this GPU's shards, or a whole replica
    grads: float  # gradients alive at the peak: reduced fp32 shards, unsharded ones in flight, DDP's buckets
    optimizer: float  # AdamW's two fp32 moments (and, at its step, its temporaries)
    gathered: float  # unsharded weights at the peak: FSDP2's gathers and the prefetched one, a replica's bf16 casts
    activations: float  # saved activations alive at the peak
    working: float  # the rest at the peak: activation gradients, the loss chunk, the reduce-scatter input
    reserve: float
    traffic: dict[str, float]  # bytes each GPU sends per micro-batch: FSDP2 or DDP collectives, expert all-to-alls
    attention_layer: dict[str, float] = field(repr=False)
    ffn_layer: dict[str, float] = field(repr=False)  # the MoE block (or the dense FFN for an all-dense model)
    precision: str = "bf16"
    wrapper: str = "FSDP2"  # FSDP2, DDP, or none (one process)
    peak_at: str = ""
    peak_terms: dict[str, float] = field(default_factory=dict, repr=False)
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return (
            self.params + self.grads + self.optimizer + self.gathered + self.activations + self.working + self.reserve
        )

    @property
    def peak(self) -> float:
        """The predicted peak of allocated bytes, without the reserve (what `--measure` compares)."""
        return self.total - self.reserve

    @property
    def moe_layer_bytes(self) -> float:
        return sum(self.ffn_layer.values())

    def fits(self, gpu_mem_gib: float) -> bool:
        return self.total <= gpu_mem_gib * GIB

    def parts(self) -> dict[str, float]:
        return {
            "parameters": self.params,
            "gradients": self.grads,
            "optimizer": self.optimizer,
            "gathered": self.gathered,
            "activations": self.activations,
            "working": self.working,
            "reserve": self.reserve,
        }

    def tracker_parts(self) -> dict[str, float]:
        """The peak in the kinds of torch's MemTracker (what `--measure` reports), which names a tensor by how it
        was made: weights are the parameters and the gathered weights of units that hold them in submodules (root,
        blocks); gradients what was accumulated into a parameter's .grad (reduced shards, the root's); a unit whose
        own forward reads its parameters (experts, router, embedding) gathers them as activations, and DDP's
        buckets and a replica's bf16 casts, made outside backward, count as activations too; temporaries are the
        rest of backward (gradients of the unit in hand, all-gather and reduce-scatter buffers, activation
        gradients, the loss chunk)."""
        t = dict.fromkeys(TERMS, 0.0) | self.peak_terms
        return {
            "weights": t["params"] + t["gathered"],
            "gradients": t["grads"],
            "optimizer": t["optimizer"] + t["adam_step"],
            "activations": t["activations"] + t["gathered_own"] + t["buckets"] + t["casts"],
            "temporaries": t["grads_unit"] + t["prefetch"] + t["reduce_buffer"] + t["transient"],
        }


def estimate_memory(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    *,
    micro_batch: int = 1,
    seq_len: int | None = None,
    recompute: str = "none",
    padded: bool = False,
    capacity_factor: float | None = None,
    ssmb: bool = True,
    imbalance: float = 1.0,
    kernel: str = "triton",
    precision: str = "bf16",
    reserve_gib: float = 2.0,
    name: str = "",
    accumulation: int = 1,
) -> MemoryBreakdown:
    """The per-GPU peak memory of training ``cfg`` under ``parallel`` in ``precision`` ("bf16": a GPU run, "fp32":
    a CPU run); the module docstring gives the model. ``accumulation``: micro-batches per optimizer step, whose
    gradients a replica (one process, DDP) holds throughout the last one's backward (FSDP2 layouts: not modelled,
    their moments are those of one micro-batch)."""
    run = RankRun(
        cfg,
        parallel,
        micro_batch=micro_batch,
        seq_len=cfg.max_seq_len if seq_len is None else seq_len,
        recompute=recompute,
        precision=precision,
        kernel=kernel,
        ssmb=ssmb,
        padded=padded,
        capacity_factor=capacity_factor,
        imbalance=imbalance,
        accumulation=accumulation,
    )
    wrapper, units, label, terms, expert_params, dense_params = _peak(run)
    fields = dict.fromkeys(set(TERMS.values()), 0.0)
    for term, value in terms.items():
        fields[TERMS[term]] += value
    return MemoryBreakdown(
        name=name,
        parallel=parallel,
        micro_batch=micro_batch,
        seq_len=run.seq_len,
        recompute=recompute,
        padded=padded,
        capacity_factor=capacity_factor,
        ssmb=ssmb and parallel.tp > 1,
        tokens=run.tokens,
        moe_tokens=run.moe_tokens,
        dense_params=dense_params,
        expert_params=expert_params,
        reserve=reserve_gib * GIB,
        traffic=_traffic(run, units),
        attention_layer=run.acts.attention,
        ffn_layer=run.acts.moe or run.acts.dense,
        precision=precision,
        wrapper=wrapper,
        peak_at=label,
        peak_terms=terms,
        notes=_notes(run),
        **fields,
    )


def _notes(run: RankRun) -> tuple[str, ...]:
    """What the plan assumes that the reader should know."""
    cfg, tp = run.cfg, run.parallel.tp
    notes = []
    if tp > 1 and not run.ssmb:
        notes.append(f"without SSMB all {tp} TP ranks run the MoE block on the same {run.tokens} tokens")
    if run.imbalance == 1.0 and not run.padded and sum(block_kinds(cfg)):  # any MoE block, multi-token prediction's too
        notes.append("PFT rows assume balanced routing (T*K rows per rank); pass imbalance for hot ranks")
    if cfg.moe.fp8 != "off":
        notes.append(f"moe.fp8={cfg.moe.fp8!r}: planned as bf16 experts (the FP8 weight copies are not modelled)")
    return tuple(notes)


def _peak(run: RankRun) -> tuple[str, _Units | None, str, dict[str, float], float, float]:
    """(wrapper, FSDP2 units or None, the peak's moment, its bytes by term, expert and dense parameters per rank):
    the FSDP2 walk where experts or heads are sharded, else a replica's (one process, DDP)."""
    cfg, parallel = run.cfg, run.parallel
    units = None
    if parallel.world_size > 1 and (parallel.tp > 1 or parallel.ep > 1):
        wrapper = "FSDP2"
        units = _fsdp_units(cfg, parallel, run.precision)
        label, terms = max(_BackwardWalk(run, units).step_moments(), key=lambda moment: sum(moment[1].values()))
        expert_params = sum(u.shard for u in units.experts())
        dense_params = sum(u.shard for u in units.all()) - expert_params
    else:
        wrapper = "DDP" if parallel.world_size > 1 else "none"
        label, terms = _replica_peak(run)
        routed = count_params(cfg).total_by_part["routed_experts"]
        expert_params, dense_params = routed, count_params(cfg).total - routed
    return wrapper, units, label, terms, expert_params, dense_params


def _traffic(run: RankRun, units: _Units | None) -> dict[str, float]:
    """Bytes each GPU sends per micro-batch (a ring sends (G-1)/G of a collective's bytes over a group of G):
    FSDP2 all-gathers every unit forward and backward at its gathered width and reduce-scatters its gradients in
    fp32; DDP all-reduces the fp32 gradients (twice (G-1)/G); the expert all-to-alls move the rows."""
    cfg, ep, world = run.cfg, run.parallel.ep, run.parallel.world_size
    out = {"fsdp_dense": 0.0, "fsdp_experts": 0.0, "ddp": 0.0, "all_to_all": 0.0}
    if units is not None:  # FSDP2

        def sent(u: _Unit) -> float:
            return (2 * u.width + GRAD_BYTES) * u.numel * (u.group - 1) / u.group

        out["fsdp_experts"] = sum(sent(u) for u in units.experts())
        out["fsdp_dense"] = sum(sent(u) for u in units.all()) - out["fsdp_experts"]
    elif world > 1:  # DDP
        out["ddp"] = 2 * GRAD_BYTES * count_params(cfg).total * (world - 1) / world
    n_moe = sum(block_kinds(cfg))
    # dispatch + combine, forward and backward; (ep-1)/ep of the rows leave the GPU
    out["all_to_all"] = 4 * n_moe * run.acts.rows * cfg.hidden_size * run.b * (ep - 1) / ep
    return out


def ep_group_nodes(parallel: ParallelConfig) -> int:
    """How many nodes the EP group of rank 0 spans (pure layout arithmetic through ParallelDims)."""
    world = parallel.world_size
    with warnings.catch_warnings():  # straddling warnings are the planner's business to report, not to raise
        warnings.simplefilter("ignore")
        dims = ParallelDims(
            parallel.dp, parallel.ep, parallel.tp, world, parallel.gpus_per_node or world, parallel.placement
        )
    return len(dims.nodes_of_group("ep", 0))
