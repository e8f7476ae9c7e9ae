"""Per-GPU memory model of training a preset: parameters, gradients, optimizer state, activations.

# T tokens per rank per micro-batch (micro_batch * seq), H hidden, F expert ffn, E experts, K top-k,
# N routed rows a rank computes (T_moe * K when dropless), C capacity per expert (padded baseline), V vocab
# W world (GPUs), dp / ep / tp the data-, expert- and tensor-parallel degrees (W = dp * ep * tp)

Conventions (docs/planning.md gives the reasons and the comparison with the paper):
  * Mixed precision, ZeRO-3 / FSDP full sharding: bf16 parameters (2 B) and gradients (2 B), AdamW state in
    fp32 (master copy, exp_avg, exp_avg_sq: 12 B), all three sharded. Dense parameters (attention, embedding,
    head, norms, router, shared experts) are first split by TP where Megatron splits them (attention, dense
    FFN, vocab-parallel embedding and head) and then sharded over the "dp_ep" axis (dp * ep ranks). Routed
    experts are split by EP (E / ep per rank) and sharded over the "dp" axis (dp ranks), the expert
    data-parallel group of xmoe/parallel/dims.py; the tp ranks of a TP group hold copies of the same experts.
    Sharding costs a working set: two layers' unsharded bf16 weights (the one computing and the prefetched
    one) plus one layer's unsharded bf16 gradient before its reduce-scatter.
  * Activations are what autograd saves in xmoe's own code (xmoe/model/transformer.py, xmoe/moe/, the Triton
    kernels), counted tensor by tensor in the functions below; b = bytes per activation element (2, bf16).
    TP (without sequence parallelism) replicates the residual stream: norms and the inputs of the
    column-parallel projections are full size on every TP rank, the head-parallel parts (q, k, v, attention
    output, log-sum-exp) are 1/tp. The MoE block (ffn norm, router, buffers, experts, shared experts) is
    replicated over TP without SSMB and runs on T/tp tokens with SSMB.
  * Recompute: "none" keeps everything; "moe" checkpoints every MoE block (keeps its b*T_moe*H input);
    "full" checkpoints every block (keeps its b*T*H input). Peak = saved activations of all layers +
    max(one layer's activations again as gradients in flight (+ the recomputed layer), the loss chunk).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Optional

from xmoe.config import ModelConfig, MoEConfig, ParallelConfig
from xmoe.dispatch.base import experts_per_rank
from xmoe.model.counting import count_params
from xmoe.model.flops import attention_matrix_params
from xmoe.parallel.dims import ParallelDims

GIB = 2**30
PARAM_BYTES = 2  # bf16 working parameters
GRAD_BYTES = 2  # bf16 gradients
ADAM_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq
INDEX_BYTES = 8  # int64 routing arrays
RECOMPUTE = ("none", "moe", "full")  # also the search's order of preference: each one costs more compute
LOSS_CHUNK_TOKENS = 4096  # Transformer(loss_chunk_tokens=...) default: one chunk's logits exist at a time
TP_CHOICES = (1, 2, 4, 8)


def norm_activations(T: int, H: int) -> float:
    """RMSNorm (transformer.py) works in fp32 whatever the activation dtype: it keeps the fp32 input copy, 1/rms,
    the fp32 normalized tensor and an fp32 copy of its weight; its output is saved by whoever consumes it."""
    return 8 * T * H + 4 * T + 4 * H


def attention_activations(T: int, H: int, heads: int, tp: int, b: int = 2) -> dict[str, float]:
    """Bytes one attention sub-block saves (pre-norm RMSNorm, q/k/v/o projections, rotary, SDPA)."""
    return {
        "norm": norm_activations(T, H),
        "qkv_input": b * T * H,  # the norm output, saved once by wq, wk, wv (full size on every TP rank)
        "q_k_v": 3 * b * T * H / tp,  # rotated q, k and v saved by flash SDPA (rotary itself saves only cos/sin)
        "attn_out": 2 * b * T * H / tp,  # SDPA output, and its (B, S, H) copy that wo saves
        "softmax_lse": 4 * T * heads / tp,  # fp32 log-sum-exp per (head, position)
    }


def dense_ffn_activations(T: int, H: int, F: int, tp: int, b: int = 2) -> dict[str, float]:
    """Bytes a dense SwiGLU sub-block saves (the first_k_dense layers); F split by TP."""
    return {
        "norm": norm_activations(T, H),
        "ffn_input": b * T * H,
        "hidden": 4 * b * T * F / tp,  # w1 out (silu's input), silu(w1 out), w3 out, their product (w2's input)
    }


def capacity(moe: MoEConfig, num_tokens: int, capacity_factor: Optional[float] = None) -> int:
    """Slots per expert for ``num_tokens`` tokens: MoEConfig.capacity with ``capacity_factor`` (None: the
    config's own factor; dropless when both are None, where the padded baseline uses C = T)."""
    factor = capacity_factor if capacity_factor is not None else moe.capacity_factor
    return replace(moe, capacity_factor=factor).capacity(num_tokens)


def moe_activations(moe: MoEConfig, T: int, *, ep: int = 1, padded: bool = False,
                    capacity_factor: Optional[float] = None, imbalance: float = 1.0, kernel: str = "triton",
                    b: int = 2) -> dict[str, float]:
    """Bytes one MoE block saves for T tokens (T is already T/tp under SSMB).

    PFT: the dispatch and combine buffers are N*H each with N = T*K routed rows (the paper's
    A_dispatch = A_combine = s*k*h*m), capped at E*C kept rows with a capacity factor; ``imbalance`` scales the
    rows of the most loaded rank (1.0 = perfectly balanced). Padded (xmoe's GShard/DeepSpeed-MoE baseline):
    E*C rows whatever the routing, plus the (T, E, C) dispatch and combine masks.
    ``kernel``: "triton" experts save h1, h3 (a = silu(h1)*h3 is recomputed); "torch" (torch._grouped_mm or the
    CPU loop) saves h1, silu(h1), h3 and their product.
    """
    if kernel not in ("triton", "torch"):
        raise ValueError(f"kernel ({kernel!r}) must be 'triton' or 'torch'")
    H, F, E, K = moe.hidden_size, moe.ffn_hidden_size, moe.num_experts, moe.top_k
    out: dict[str, float] = {
        "norm": norm_activations(T, H),
        # F.linear(x.float(), weight.float()) keeps fp32 copies of both (an fp32 input is saved as is: same
        # bytes; an fp32 weight is the parameter itself: no copy), then the softmax output and the top-k ids
        "router": 4 * T * H + (4 * E * H if b != 4 else 0) + 4 * T * E + INDEX_BYTES * T * K
        + (4 * T * E if moe.z_loss_coef > 0 else 0),
    }
    C = capacity(moe, T, capacity_factor)
    dropless = capacity_factor is None and moe.capacity_factor is None
    if padded:
        kept = min(T * K, E * C)
        out["dispatch_masks"] = (b + 4) * T * E * C  # dispatch mask (activation dtype) + fp32 combine weights
        out["dispatch_buffer"] = b * E * C * H  # x_ECH, saved by the expert bmm
        out["expert_hidden"] = 4 * b * E * C * F  # the bmm path saves h1, silu(h1), h3, product
        out["combine_buffer"] = 4 * E * C * H  # fp32 copy of the expert output, saved by the combine einsum
        out["routing_indices"] = (INDEX_BYTES + 4) * T * K + 3 * INDEX_BYTES * kept  # ids, weights, index_put
    else:
        rows = (T * K if dropless else min(T * K, E * C)) * imbalance
        hidden_tensors = 2 if kernel == "triton" else 4
        out["dispatch_buffer"] = b * rows * H  # rows the experts read (received rows under EP)
        out["expert_hidden"] = hidden_tensors * b * rows * F
        out["combine_buffer"] = b * rows * H  # expert output rows (after the reverse all-to-all under EP)
        regroup = 2 * INDEX_BYTES * rows if ep > 1 and E // ep > 1 else 0  # (source, expert) <-> expert-major
        # row_of_slot (T, K) and weights (T, K); token and slot id per row; the EP regroup permutations
        out["routing_indices"] = (INDEX_BYTES + 4) * T * K + 2 * INDEX_BYTES * rows + regroup
    if moe.num_shared_experts:
        Fs = moe.shared_width
        # input (one storage with the router's fp32 copy when activations are fp32) + 4 hidden tensors
        out["shared_experts"] = (b * T * H if b != 4 else 0) + 4 * b * T * Fs
    return out


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU bytes of one training setting; ``total`` is the predicted peak."""

    name: str
    parallel: ParallelConfig
    micro_batch: int
    seq_len: int
    recompute: str
    padded: bool
    capacity_factor: Optional[float]
    ssmb: bool
    tokens: int  # T: tokens per rank per micro-batch
    moe_tokens: int  # tokens the MoE block of this rank processes (T / tp under SSMB)
    dense_params: float  # parameters of this GPU's shard (counts, not bytes)
    expert_params: float
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float  # saved over all layers, plus the final norm and the head's input
    working: float  # transient peak on top of the saved activations
    reserve: float
    traffic: dict[str, float]  # bytes each GPU sends per micro-batch: ZeRO-3 collectives and expert all-to-alls
    attention_layer: dict[str, float] = field(repr=False)
    ffn_layer: dict[str, float] = field(repr=False)  # the MoE block (or the dense FFN for an all-dense model)
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.gathered + self.activations + self.working
                + self.reserve)

    @property
    def moe_layer_bytes(self) -> float:
        return sum(self.ffn_layer.values())

    def fits(self, gpu_mem_gib: float) -> bool:
        return self.total <= gpu_mem_gib * GIB

    def parts(self) -> dict[str, float]:
        return {"parameters": self.params, "gradients": self.grads, "optimizer": self.optimizer,
                "gathered": self.gathered, "activations": self.activations, "working": self.working,
                "reserve": self.reserve}


def _zero3_bytes(num_params: float, group: int) -> float:
    """ZeRO-3 moves every weight three times per micro-batch (all-gather forward, all-gather backward,
    reduce-scatter of the gradient); each GPU sends (G-1)/G of the unsharded bytes over a group of G."""
    return 3 * PARAM_BYTES * num_params * (group - 1) / group


def _validate(cfg: ModelConfig, par: ParallelConfig, micro_batch: int, seq_len: int, ssmb: bool) -> None:
    """The checks a user can fail."""
    world = par.world_size
    node = par.gpus_per_node or world
    if par.tp > node:
        raise ValueError(f"tp ({par.tp}) must be <= gpus per node ({node}): TP needs the intra-node links")
    if world > node and world % node:
        raise ValueError(f"gpus ({world}) must be a multiple of gpus per node ({node}); use whole nodes")
    experts_per_rank(cfg.moe.num_experts, par.ep)
    if cfg.num_heads % par.tp:
        raise ValueError(f"tp ({par.tp}) must divide num_heads ({cfg.num_heads})")
    if micro_batch < 1:
        raise ValueError(f"micro_batch ({micro_batch}) must be >= 1")
    if not 0 < seq_len <= cfg.max_seq_len:
        raise ValueError(f"seq_len ({seq_len}) must be in [1, max_seq_len={cfg.max_seq_len}]")
    if ssmb and par.tp > 1 and (micro_batch * seq_len) % par.tp:
        raise ValueError(f"SSMB splits micro_batch*seq ({micro_batch * seq_len}) tokens over tp ({par.tp}); "
                         "make it divisible or pass --no-ssmb")


def estimate_memory(cfg: ModelConfig, parallel: ParallelConfig, *, micro_batch: int = 1,
                    seq_len: Optional[int] = None, recompute: str = "none", padded: bool = False,
                    capacity_factor: Optional[float] = None, ssmb: bool = True, imbalance: float = 1.0,
                    kernel: str = "triton", act_bytes: int = 2, reserve_gib: float = 2.0,
                    name: str = "") -> MemoryBreakdown:
    """The per-GPU memory of training ``cfg`` under ``parallel`` (see the module docstring for the model)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute ({recompute!r}) must be one of {RECOMPUTE}")
    if imbalance < 1.0:
        raise ValueError(f"imbalance ({imbalance}) is max/mean rows per rank and must be >= 1")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    _validate(cfg, parallel, micro_batch, seq_len, ssmb)
    tp, b = parallel.tp, act_bytes
    params = _parameter_shards(cfg, parallel)
    T = micro_batch * seq_len
    T_moe = T // tp if ssmb and tp > 1 else T
    act = _activations(cfg, parallel, T, T_moe, recompute, padded, capacity_factor, imbalance, kernel, b)
    rows = act.moe_layer.get("dispatch_buffer", 0.0) / b / cfg.hidden_size  # rows a rank computes (E*C padded)
    notes = []
    if tp > 1 and not ssmb:
        notes.append(f"without SSMB all {tp} TP ranks run the MoE block on the same {T} tokens")
    if imbalance == 1.0 and not padded:
        notes.append("PFT rows assume balanced routing (T*K rows per rank); pass imbalance for hot ranks")
    local = params.dense + params.experts
    return MemoryBreakdown(
        name=name, parallel=parallel, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute,
        padded=padded, capacity_factor=capacity_factor, ssmb=ssmb and tp > 1, tokens=T, moe_tokens=T_moe,
        dense_params=params.dense, expert_params=params.experts, params=PARAM_BYTES * local,
        grads=GRAD_BYTES * local, optimizer=ADAM_BYTES * local, gathered=params.gathered,
        activations=act.saved, working=act.working, reserve=reserve_gib * GIB,
        traffic=_traffic(cfg, parallel, params, rows, b), attention_layer=act.attention_layer,
        ffn_layer=act.moe_layer or act.dense_layer, notes=tuple(notes),
    )


@dataclass(frozen=True)
class _ParamShards:
    dense_unsharded: float  # dense parameters after the TP split, before ZeRO-3 sharding
    dense: float  # this GPU's shard of the dense parameters
    experts: float  # this GPU's shard of the routed experts
    gathered: float  # bytes of the unsharded working set (weights in flight, one layer's gradient)


def _parameter_shards(cfg: ModelConfig, parallel: ParallelConfig) -> _ParamShards:
    """1. parameters: TP split, then ZeRO-3 sharding (dense over dp_ep, experts over dp)."""
    tp, ep, dp = parallel.tp, parallel.ep, parallel.dp
    H, V, moe = cfg.hidden_size, cfg.vocab_size, cfg.moe
    n_moe, n_dense = cfg.num_layers - cfg.first_k_dense, cfg.first_k_dense
    parts = count_params(cfg, expert_matrices=3).total_by_part
    tp_split = parts["attention"] + parts["dense_ffn"] + parts["embedding"] + parts["head"]
    replicated = parts["norms"] + parts["router"] + parts["shared_experts"]
    dense_unsharded = tp_split / tp + replicated
    # unsharded working set: this rank's biggest layer (dense part gathered over dp_ep, experts over dp), or
    # the vocab-parallel embedding / head, whichever is larger
    expert_layer = (moe.num_experts // ep) * 3 * H * moe.ffn_hidden_size if dp > 1 else 0
    sharded_dense = dp * ep > 1
    moe_layer = 4 * H * H / tp + 2 * H + moe.num_experts * H + 3 * H * moe.shared_width
    dense_layer = 4 * H * H / tp + 2 * H + 3 * H * cfg.ffn_hidden_size / tp
    biggest = max(
        (moe_layer * sharded_dense + expert_layer) if n_moe else 0,
        dense_layer * sharded_dense if n_dense else 0,
        V * H / tp * sharded_dense,
    )
    return _ParamShards(
        dense_unsharded=dense_unsharded,
        dense=dense_unsharded / (dp * ep),
        experts=parts["routed_experts"] / ep / dp,
        gathered=3 * PARAM_BYTES * biggest,  # two layers' weights in flight + one layer's unsharded gradient
    )


@dataclass(frozen=True)
class _Activations:
    attention_layer: dict[str, float]
    moe_layer: dict[str, float]
    dense_layer: dict[str, float]
    saved: float  # over all layers, plus the final norm and the head's input
    working: float  # transient peak on top of ``saved``


def _activations(cfg: ModelConfig, parallel: ParallelConfig, T: int, T_moe: int, recompute: str, padded: bool,
                 capacity_factor: Optional[float], imbalance: float, kernel: str, b: int) -> _Activations:
    """2. activations per layer, saved over all layers under ``recompute``, and the transient working peak."""
    tp, ep = parallel.tp, parallel.ep
    H, V, moe = cfg.hidden_size, cfg.vocab_size, cfg.moe
    n_moe, n_dense = cfg.num_layers - cfg.first_k_dense, cfg.first_k_dense
    attn = attention_activations(T, H, cfg.num_heads, tp, b)
    moe_act = moe_activations(moe, T_moe, ep=ep, padded=padded, capacity_factor=capacity_factor,
                              imbalance=imbalance, kernel=kernel, b=b) if n_moe else {}
    dense_act = dense_ffn_activations(T, H, cfg.ffn_hidden_size, tp, b) if n_dense else {}
    attn_sum, moe_sum, dense_sum = sum(attn.values()), sum(moe_act.values()), sum(dense_act.values())
    if recompute == "none":
        saved = n_moe * (attn_sum + moe_sum) + n_dense * (attn_sum + dense_sum)
        regen = 0.0
    elif recompute == "moe":
        saved = n_moe * (attn_sum + b * T_moe * H) + n_dense * (attn_sum + dense_sum)
        regen = moe_sum
    else:
        saved = cfg.num_layers * b * T * H
        regen = attn_sum + max(moe_sum, dense_sum)
    saved += norm_activations(T, H) + b * T * H  # final norm, head input
    layer_max = attn_sum + max(moe_sum, dense_sum)
    loss_chunk = 12 * min(T, LOSS_CHUNK_TOKENS) * V / tp  # bf16 logits, fp32 log-softmax, their gradients
    return _Activations(attention_layer=attn, moe_layer=moe_act, dense_layer=dense_act, saved=saved,
                        working=max(layer_max + regen, loss_chunk))


def _traffic(cfg: ModelConfig, parallel: ParallelConfig, params: _ParamShards, rows: float,
             b: int) -> dict[str, float]:
    """3. bytes each GPU sends per micro-batch: ZeRO-3 collectives and the expert all-to-alls."""
    ep, dp = parallel.ep, parallel.dp
    n_moe = cfg.num_layers - cfg.first_k_dense
    routed = count_params(cfg, expert_matrices=3).total_by_part["routed_experts"]
    return {
        "zero3_dense": _zero3_bytes(params.dense_unsharded, dp * ep),
        "zero3_experts": _zero3_bytes(routed / ep, dp),
        # dispatch + combine, forward and backward; (ep-1)/ep of the rows leave the GPU
        "all_to_all": 4 * n_moe * rows * cfg.hidden_size * b * (ep - 1) / ep,
    }


def ep_group_nodes(parallel: ParallelConfig) -> int:
    """How many nodes the EP group of rank 0 spans (pure layout arithmetic through ParallelDims)."""
    world = parallel.world_size
    with warnings.catch_warnings():  # straddling warnings are the planner's business to report, not to raise
        warnings.simplefilter("ignore")
        dims = ParallelDims(parallel.dp, parallel.ep, parallel.tp, world, parallel.gpus_per_node or world,
                            parallel.placement)
    return len(dims.nodes_of_group("ep", 0))


def _preference(m: MemoryBreakdown) -> tuple:
    """The search's order: fewest memory-saving tricks (recompute, then TP), then the largest micro-batch, then
    the least traffic per GPU per micro-batch (ZeRO-3 collectives + expert all-to-alls: a small EP makes every
    GPU all-gather E/EP experts' weights each pass, a large EP moves rows instead), then EP inside a node."""
    par = m.parallel
    node = par.gpus_per_node or par.world_size
    return (RECOMPUTE.index(m.recompute), par.tp, -m.micro_batch, round(sum(m.traffic.values()) / 1e6),
            par.ep * par.tp > node)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_layouts(cfg: ModelConfig, gpus: int, gpu_mem_gib: float, *, gpus_per_node: int = 8,
                   tp: Optional[int] = None, ep: Optional[int] = None, dp: Optional[int] = None,
                   micro_batch: Optional[int] = None, recompute: Optional[str] = None,
                   max_micro_batch: int = 8, placement: str = "ep_first", **kwargs) -> list[MemoryBreakdown]:
    """Every layout that the given options allow, feasible ones first in order of preference, then the rest
    by total memory. Options left as None are searched: tp in {1,2,4,8} (<= node, dividing gpus and heads),
    ep among the divisors of E that divide gpus / tp, dp = the rest, micro-batch 1, 2, 4, ... up to
    ``max_micro_batch``, recompute none / moe / full. Placement is EP-first when EP*TP fits in a node.
    ``kwargs`` go to estimate_memory (padded, capacity_factor, ssmb, seq_len, imbalance, ...)."""
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
    if (len(given) == 3 and tp * ep * dp != gpus) or gpus % math.prod(given):
        raise ValueError(f"tp * ep * dp = {'*'.join(map(str, given))} = {math.prod(given)} must equal (or, with one "
                         f"left to search, divide) gpus ({gpus})")
    tps = [tp] if tp else [t for t in TP_CHOICES if t <= gpus_per_node and not gpus % t and not cfg.num_heads % t]
    if max_micro_batch < 1:
        raise ValueError(f"max_micro_batch ({max_micro_batch}) must be >= 1")
    mbs = [micro_batch] if micro_batch else [2**i for i in range(max_micro_batch.bit_length())]
    recs = [recompute] if recompute else list(RECOMPUTE)
    results, errors = [], []
    for t in tps:
        eps = [ep] if ep else [e for e in _divisors(cfg.moe.num_experts) if (gpus // t) % e == 0]
        for e in eps:
            if gpus % (t * e) or (dp is not None and dp * t * e != gpus):
                continue
            d = gpus // (t * e)
            place = "ep_first" if e * t <= gpus_per_node else placement
            par = ParallelConfig(dp=d, ep=e, tp=t, gpus_per_node=gpus_per_node, placement=place)
            for rec in recs:
                for mb in mbs:
                    try:
                        results.append(estimate_memory(cfg, par, micro_batch=mb, recompute=rec, **kwargs))
                    except ValueError as exc:  # e.g. tokens not divisible by tp under SSMB: skip the layout
                        errors.append(str(exc))
    if not results:
        why = f" (last reason: {errors[-1]})" if errors else ""
        raise ValueError(f"no layout of {gpus} GPUs satisfies tp={tp}, ep={ep}, dp={dp} for this model "
                         f"({cfg.moe.num_experts} experts, {cfg.num_heads} heads){why}")
    feasible = sorted((m for m in results if m.fits(gpu_mem_gib)), key=_preference)
    infeasible = sorted((m for m in results if not m.fits(gpu_mem_gib)), key=lambda m: m.total)
    return feasible + infeasible


@dataclass(frozen=True)
class TrainerMemory:
    """Peak bytes of `xmoe train` on one GPU (see estimate_trainer_memory); ``total`` is the predicted peak."""

    states: float  # fp32 parameters, AdamW moments, bf16 expert weight copies held for the step
    grads: float  # fp32 gradients alive at the peak
    activations: float  # saved activations alive at the peak
    working: float  # the backward's transient at the peak (recomputed block, bf16 weight gradients, loss chunk)
    blocks_done: int  # blocks whose backward has run at the peak (0: the peak is at the start of backward)

    @property
    def total(self) -> float:
        return self.states + self.grads + self.activations + self.working


def block_activations(cfg: ModelConfig, T: int, i: int, *, compiled: bool = True, fused: bool = True,
                      b: int = 2) -> tuple[float, float]:
    """(attention branch, FFN branch) bytes block ``i`` of `xmoe train`'s model saves for T tokens, autocast bf16.

    Each branch keeps its fp32 residual input (RMSNorm's backward reads it) and the bf16 weight copies autocast
    made for its matmuls; compiled regions keep RMSNorm's fp32 1/rms only beyond that (the compiler rebuilds the
    normalised tensor), eager RMSNorm its fp32 copies (norm_activations). ``fused``: the one-rank Triton path
    (gather, experts and combine in one op) keeps no dispatch or combine buffer, only the bf16 tokens it reads."""
    H, moe = cfg.hidden_size, cfg.moe
    norm = 4 * T if compiled else norm_activations(T, H)
    attn = dict(attention_activations(T, H, cfg.num_heads, 1, b), norm=norm)
    attn_bytes = sum(attn.values()) + b * attention_matrix_params(cfg) + 4 * T * H
    if i < cfg.first_k_dense:
        ffn = dict(dense_ffn_activations(T, H, cfg.ffn_hidden_size, 1, b), norm=norm)
        return attn_bytes, sum(ffn.values()) + b * 3 * H * cfg.ffn_hidden_size + 4 * T * H
    ffn = dict(moe_activations(moe, T, kernel="triton" if fused else "torch", b=b), norm=norm)
    if fused:
        ffn["dispatch_buffer"], ffn["combine_buffer"] = b * T * H, 0.0
    shared_w = 3 * H * moe.shared_width
    return attn_bytes, sum(ffn.values()) + b * shared_w + 4 * T * H


def estimate_trainer_memory(cfg: ModelConfig, *, micro_batch: int, seq_len: Optional[int] = None,
                            recompute: str = "none", accumulation: int = 1, compiled: bool = True,
                            fused: bool = True) -> TrainerMemory:
    """The peak of one `xmoe train` step on one GPU, in the trainer's own precision layout (not ZeRO-3's):

    * states: fp32 parameters (4 B), AdamW's two fp32 moments (8 B), and the bf16 copies of the routed experts made
      once per step (2 B per expert weight);
    * the last micro-batch's backward walks the blocks top-down: the LM head's fp32 gradient first, then each
      block frees its saved activations while its fp32 parameter gradients appear (with ``accumulation`` > 1
      every gradient exists from the first micro-batch on). The peak is the largest sum of gradients plus
      activations of the blocks left plus the transient of the block in hand: its bf16 weight gradients before
      they are added into fp32, and with recompute its activations rebuilt; or the loss chunk's logits at the
      start of backward;
    * saved activations per block: block_activations. "moe" keeps the MoE branch's fp32 input instead of its
      activations, "full" only each block's fp32 input.
    benchmarks/memory_fit.py measures the peaks this predicts (docs/training-speed.md has the table).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute ({recompute!r}) must be one of {RECOMPUTE}")
    if micro_batch < 1 or accumulation < 1:
        raise ValueError(f"micro_batch ({micro_batch}) and accumulation ({accumulation}) must be >= 1")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    H, L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    T, b = micro_batch * seq_len, 2
    parts = count_params(cfg, expert_matrices=3).total_by_part
    total_params = sum(parts.values())
    states = 12 * total_params + 2 * parts["routed_experts"]

    # per-block weights from the one parameter count (attention variants, shared-expert widths included)
    n_moe, n_dense = L - cfg.first_k_dense, cfg.first_k_dense
    attn_w = parts["attention"] / L + 2 * H  # + the block's two RMSNorm weights
    moe_w = (parts["routed_experts"] + parts["router"] + parts["shared_experts"]) / max(1, n_moe)
    dense_w = parts["dense_ffn"] / max(1, n_dense)
    blocks = []  # (saved, rebuilt in backward, fp32 gradient bytes, bf16 weight-gradient transient)
    for i in range(L):
        is_moe = i >= cfg.first_k_dense
        attn, ffn = block_activations(cfg, T, i, compiled=compiled, fused=fused, b=b)
        if recompute == "full":
            saved, regen = 4 * T * H, attn + ffn
        elif recompute == "moe" and is_moe:
            saved, regen = attn + 4 * T * H, ffn
        else:
            saved, regen = attn + ffn, 0.0
        weights = attn_w + (moe_w if is_moe else dense_w)
        blocks.append((saved, regen, 4 * weights, b * weights))

    all_grads = 4 * total_params
    head_grads = 4 * (parts["head"] or parts["embedding"])
    start_grads = all_grads if accumulation > 1 else head_grads
    tail = 4 * T * H + b * T * H  # final norm's input and the head's input
    saved_left = sum(saved for saved, *_ in blocks)
    loss_chunk = 12 * min(T, LOSS_CHUNK_TOKENS) * V  # bf16 logits, fp32 log-softmax and their gradients
    best = TrainerMemory(states, start_grads, saved_left + tail, loss_chunk, 0)
    grads = start_grads
    for j, (saved, regen, grad_bytes, transient) in enumerate(reversed(blocks), 1):
        made = 0.0 if accumulation > 1 else grad_bytes  # this block's fp32 gradients appear as it runs
        here = TrainerMemory(states, grads + made, saved_left, regen + transient, j)
        if here.total > best.total:
            best = here
        grads += made
        saved_left -= saved
    return best
