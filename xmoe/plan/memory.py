"""Per-GPU memory model of training a preset: what the trainer allocates, moment by moment, and its peak.

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
  * Activations: what autograd saves in xmoe's code, counted tensor by tensor in the functions below. TP (without
    sequence parallelism) replicates the residual stream: norms and the inputs of the column-parallel
    projections are full size on every TP rank, the head-parallel parts 1/tp. The MoE block (ffn norm, router,
    buffers, experts, shared experts) is replicated over TP without SSMB and runs on T/tp tokens with SSMB.
    Recompute: "moe" keeps each MoE block's fp32 input (4*T*H), "full" each block's; backward rebuilds the layer
    in hand.
  * The peak. Backward walks the FSDP2 units in reverse order (``_fsdp_moments``); at each moment the live bytes
    are the sharded states, the root's gathered weights and gradient, the sharded gradients of the units already
    reduced, the one reduce-scatter input FSDP2 keeps in flight, the saved activations of the layers not yet
    done, and the unit in hand: its gathered weights and unsharded gradients, the all-gather buffer of the unit
    prefetched next, the activation gradients. The end of backward (the embedding's gradient, the root's
    reduce-scatter) and the optimizer step are moments too. The peak is the largest moment. A replica's:
    estimate_trainer_memory's backward walk (bf16; the same walk over eager fp32 blocks on CPUs), plus DDP's
    buckets, or its optimizer step.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Optional

from xmoe.config import RECOMPUTE_MODES, ModelConfig, MoEConfig, ParallelConfig
from xmoe.dispatch.base import experts_per_rank
from xmoe.model.counting import count_params
from xmoe.model.flops import attention_matrix_params
from xmoe.parallel.dims import ParallelDims

GIB = 2**30
PRECISIONS = ("bf16", "fp32")  # the trainer's on GPUs and on CPUs
MASTER_BYTES = 4  # fp32 parameters: FSDP2's shards are the master weights, there is no other copy
GRAD_BYTES = 4  # fp32 gradients once reduced (FSDP2's reduce dtype), and a replica's
ADAM_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, fp32
RESIDUAL_BYTES = 4  # the residual stream between blocks, fp32 in both precisions
INDEX_BYTES = 8  # int64 routing arrays
LOSS_CHUNK_TOKENS = 4096  # Transformer(loss_chunk_tokens=...) default: one chunk's logits exist at a time
TP_CHOICES = (1, 2, 4, 8)


def activation_bytes(precision: str) -> int:
    """b: bytes per element of what autocast computes in (bf16), or of everything (fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision ({precision!r}) must be one of {PRECISIONS}: bf16 as on GPUs, fp32 as on CPUs")
    return 2 if precision == "bf16" else 4


def norm_activations(T: int, H: int) -> float:
    """RMSNorm (transformer.py) works in fp32 whatever the activation dtype: it keeps the fp32 input copy, 1/rms,
    the fp32 normalized tensor and an fp32 copy of its weight; its output is saved by whoever consumes it."""
    return 8 * T * H + 4 * T + 4 * H


def attention_activations(T: int, H: int, heads: int, tp: int, b: int = 2,
                          autocast: bool = False) -> dict[str, float]:
    """Bytes one attention sub-block saves (pre-norm RMSNorm, q/k/v/o projections, rotary, SDPA). ``autocast``:
    the norm's output is fp32 (an fp32 residual stream) and autocast casts it once per projection (its cache
    keeps weight casts only), so wq, wk and wv save a copy each."""
    return {
        "norm": norm_activations(T, H),
        "qkv_input": (3 if autocast else 1) * b * T * H,  # the norm output (full size on every TP rank)
        "q_k_v": 3 * b * T * H / tp,  # rotated q, k and v saved by flash SDPA (rotary itself saves only cos/sin)
        "attn_out": 2 * b * T * H / tp,  # SDPA output, and its (B, S, H) copy that wo saves
        "softmax_lse": 4 * T * heads / tp,  # fp32 log-sum-exp per (head, position)
    }


def dense_ffn_activations(T: int, H: int, F: int, tp: int, b: int = 2, autocast: bool = False) -> dict[str, float]:
    """Bytes a dense SwiGLU sub-block saves (the first_k_dense layers); F split by TP. ``autocast``: w1 and w3 each
    save their own cast of the fp32 norm output."""
    return {
        "norm": norm_activations(T, H),
        "ffn_input": (2 if autocast else 1) * b * T * H,
        "hidden": 4 * b * T * F / tp,  # w1 out (silu's input), silu(w1 out), w3 out, their product (w2's input)
    }


def capacity(moe: MoEConfig, num_tokens: int, capacity_factor: Optional[float] = None) -> int:
    """Slots per expert for ``num_tokens`` tokens: MoEConfig.capacity with ``capacity_factor`` (None: the
    config's own factor; dropless when both are None, where the padded baseline uses C = T)."""
    factor = capacity_factor if capacity_factor is not None else moe.capacity_factor
    return replace(moe, capacity_factor=factor).capacity(num_tokens)


def moe_activations(moe: MoEConfig, T: int, *, ep: int = 1, padded: bool = False,
                    capacity_factor: Optional[float] = None, imbalance: float = 1.0, kernel: str = "triton",
                    b: int = 2, router_fp32: bool = False) -> dict[str, float]:
    """Bytes one MoE block saves for T tokens (T is already T/tp under SSMB).

    PFT: the dispatch and combine buffers are N*H each with N = T*K routed rows (the paper's
    A_dispatch = A_combine = s*k*h*m), capped at E*C kept rows with a capacity factor; ``imbalance`` scales the
    rows of the most loaded rank (1.0 = perfectly balanced). Padded (xmoe's GShard/DeepSpeed-MoE baseline):
    E*C rows whatever the routing, plus the (T, E, C) dispatch and combine masks.
    ``kernel``: "triton" experts save h1, h3 (a = silu(h1)*h3 is recomputed); "torch" (torch._grouped_mm or the
    CPU loop) saves h1, silu(h1), h3 and their product. ``router_fp32``: the router's weight is an fp32 parameter
    (the trainer's), so the router keeps no fp32 copy of it whatever b is (a module cast to bf16 does).
    """
    if kernel not in ("triton", "torch"):
        raise ValueError(f"kernel ({kernel!r}) must be 'triton' or 'torch'")
    H, F, E, K = moe.hidden_size, moe.ffn_hidden_size, moe.num_experts, moe.top_k
    weight_copy = 4 * E * H if b != 4 and not router_fp32 else 0
    out: dict[str, float] = {
        "norm": norm_activations(T, H),
        # F.linear(x.float(), weight.float()) keeps fp32 copies of both (an fp32 input is saved as is: same
        # bytes; an fp32 weight is the parameter itself: no copy), then the softmax output and the top-k ids
        "router": 4 * T * H + weight_copy + 4 * T * E + INDEX_BYTES * T * K + (4 * T * E if moe.z_loss_coef > 0 else 0),
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


# the finer terms of a moment, and the MemoryBreakdown field each adds to
TERMS = {"params": "params", "optimizer": "optimizer", "adam_step": "optimizer", "gathered": "gathered",
         "gathered_own": "gathered", "prefetch": "gathered", "casts": "gathered", "grads": "grads",
         "grads_unit": "grads", "buckets": "grads", "activations": "activations", "reduce_buffer": "working",
         "transient": "working"}


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
    capacity_factor: Optional[float]
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
        return (self.params + self.grads + self.optimizer + self.gathered + self.activations + self.working
                + self.reserve)

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
        return {"parameters": self.params, "gradients": self.grads, "optimizer": self.optimizer,
                "gathered": self.gathered, "activations": self.activations, "working": self.working,
                "reserve": self.reserve}

    def tracker_parts(self) -> dict[str, float]:
        """The peak in the kinds of torch's MemTracker (what `--measure` reports), which names a tensor by how it
        was made: weights are the parameters and the gathered weights of units that hold them in submodules (root,
        blocks); gradients what was accumulated into a parameter's .grad (reduced shards, the root's); a unit whose
        own forward reads its parameters (experts, router, embedding) gathers them as activations, and DDP's
        buckets and a replica's bf16 casts, made outside backward, count as activations too; temporaries are the
        rest of backward (gradients of the unit in hand, all-gather and reduce-scatter buffers, activation
        gradients, the loss chunk)."""
        t = dict.fromkeys(TERMS, 0.0) | self.peak_terms
        return {"weights": t["params"] + t["gathered"], "gradients": t["grads"],
                "optimizer": t["optimizer"] + t["adam_step"],
                "activations": t["activations"] + t["gathered_own"] + t["buckets"] + t["casts"],
                "temporaries": t["grads_unit"] + t["prefetch"] + t["reduce_buffer"] + t["transient"]}


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
                    kernel: str = "triton", precision: str = "bf16", reserve_gib: float = 2.0,
                    name: str = "") -> MemoryBreakdown:
    """The per-GPU peak memory of training ``cfg`` under ``parallel`` in ``precision`` ("bf16": a GPU run, "fp32":
    a CPU run); the module docstring gives the model."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute ({recompute!r}) must be one of {RECOMPUTE_MODES}")
    if imbalance < 1.0:
        raise ValueError(f"imbalance ({imbalance}) is max/mean rows per rank and must be >= 1")
    b = activation_bytes(precision)
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    _validate(cfg, parallel, micro_batch, seq_len, ssmb)
    tp, ep = parallel.tp, parallel.ep
    T = micro_batch * seq_len
    T_moe = T // tp if ssmb and tp > 1 else T
    autocast = precision == "bf16"
    n_moe, n_dense = cfg.num_layers - cfg.first_k_dense, cfg.first_k_dense
    attn = attention_activations(T, cfg.hidden_size, cfg.num_heads, tp, b, autocast)
    moe_act = moe_activations(cfg.moe, T_moe, ep=ep, padded=padded, capacity_factor=capacity_factor,
                              imbalance=imbalance, kernel=kernel, b=b, router_fp32=True) if n_moe else {}
    dense_act = dense_ffn_activations(T, cfg.hidden_size, cfg.ffn_hidden_size, tp, b, autocast) if n_dense else {}
    rows = moe_act.get("dispatch_buffer", 0.0) / b / cfg.hidden_size  # rows a rank computes (E*C padded)
    if moe_act and ep == 1 and kernel == "triton" and not padded:
        # one EP rank: the local dispatcher lets the Triton experts fuse gather, SwiGLU and combine, keeping the
        # tokens they read and no dispatch or combine buffer (as block_activations' fused path)
        moe_act.update(dispatch_buffer=b * T_moe * cfg.hidden_size, combine_buffer=0.0)
    acts = _LayerActivations(attn, moe_act, dense_act, rows, T)
    units = None
    if parallel.world_size > 1 and (tp > 1 or ep > 1):
        wrapper = "FSDP2"
        units = _fsdp_units(cfg, parallel, precision)
        label, terms = max(_fsdp_moments(cfg, parallel, units, acts, recompute, precision, kernel, ssmb),
                           key=lambda moment: sum(moment[1].values()))
        expert_params = sum(u.shard for u in units.experts())
        dense_params = sum(u.shard for u in units.all()) - expert_params
    else:
        wrapper = "DDP" if parallel.world_size > 1 else "none"
        label, terms = _replica_peak(cfg, parallel, acts, micro_batch, seq_len, recompute, precision, kernel)
        routed = count_params(cfg).total_by_part["routed_experts"]
        expert_params, dense_params = routed, count_params(cfg).total - routed
    fields = dict.fromkeys(set(TERMS.values()), 0.0)
    for term, value in terms.items():
        fields[TERMS[term]] += value
    notes = []
    if tp > 1 and not ssmb:
        notes.append(f"without SSMB all {tp} TP ranks run the MoE block on the same {T} tokens")
    if imbalance == 1.0 and not padded and n_moe:
        notes.append("PFT rows assume balanced routing (T*K rows per rank); pass imbalance for hot ranks")
    if cfg.moe.fp8 != "off":
        notes.append(f"moe.fp8={cfg.moe.fp8!r}: planned as bf16 experts (the FP8 weight copies are not modelled)")
    return MemoryBreakdown(
        name=name, parallel=parallel, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute,
        padded=padded, capacity_factor=capacity_factor, ssmb=ssmb and tp > 1, tokens=T, moe_tokens=T_moe,
        dense_params=dense_params, expert_params=expert_params, reserve=reserve_gib * GIB,
        traffic=_traffic(cfg, parallel, units, precision, rows), attention_layer=attn,
        ffn_layer=moe_act or dense_act, precision=precision, wrapper=wrapper, peak_at=label, peak_terms=terms,
        notes=tuple(notes), **fields,
    )


@dataclass(frozen=True)
class _LayerActivations:
    attention: dict[str, float]  # one attention branch's saved bytes
    moe: dict[str, float]  # one MoE branch's ({} for an all-dense model)
    dense: dict[str, float]  # one dense FFN branch's ({} without dense layers)
    rows: float  # N: rows the experts of a rank compute per MoE layer
    tokens: int  # T


@dataclass(frozen=True)
class _Unit:
    """One FSDP2 unit on one rank: ``numel`` parameters before sharding (after TP and EP), sharded over ``group``
    ranks, its weights gathered (and their gradients made) at ``width`` bytes per element."""

    numel: float
    group: int
    width: int

    @property
    def shard(self) -> float:
        return self.numel / self.group

    @property
    def weights(self) -> float:
        """Bytes of its gathered weights; as many for its unsharded gradients and for its all-gather buffer."""
        return self.width * self.numel

    @property
    def reduce_input(self) -> float:
        """Bytes of the fp32 reduce-scatter input of its gradients (FSDP2 keeps one such buffer in flight)."""
        return GRAD_BYTES * self.numel

    @property
    def reduced(self) -> float:
        return GRAD_BYTES * self.shard


_NO_UNIT = _Unit(0.0, 1, 0)


@dataclass(frozen=True)
class _LayerUnits:
    block: _Unit  # attention, norms, dense FFN or shared experts (and the router on CPUs)
    experts: Optional[_Unit]  # the routed experts of an MoE layer
    router: Optional[_Unit]  # the router's fp32 unit of an MoE layer (GPUs)
    moe_side: float  # parameters of the block's MoE part (ffn norm, shared experts, CPU router): gradients first


@dataclass(frozen=True)
class _Units:
    layers: list[_LayerUnits]
    root: _Unit  # final norm and head (+ the embedding on CPUs or when tied)
    embed: Optional[_Unit]  # the untied embedding's fp32 unit (GPUs)
    head: float  # head parameters (V x H): its gradient lives from the loss to the root's reduce-scatter

    def all(self) -> list[_Unit]:
        units = [self.root] + ([self.embed] if self.embed else [])
        for layer in self.layers:
            units += [u for u in (layer.block, layer.experts, layer.router) if u]
        return units

    def experts(self) -> list[_Unit]:
        return [layer.experts for layer in self.layers if layer.experts]


def _fsdp_units(cfg: ModelConfig, par: ParallelConfig, precision: str) -> _Units:
    """The FSDP2 units of one rank (expert_parallel.apply_expert_parallel), from the one parameter count."""
    parts = count_params(cfg, expert_matrices=3).total_by_part
    H, V, L, moe = cfg.hidden_size, cfg.vocab_size, cfg.num_layers, cfg.moe
    n_moe = L - cfg.first_k_dense
    gpu, b = precision == "bf16", activation_bytes(precision)
    dense_group = par.dp * par.ep
    attention = parts["attention"] / L / par.tp + 2 * H  # TP-split projections (+ q/k norms), the two norms
    shared = parts["shared_experts"] / n_moe if n_moe else 0.0
    router = moe.num_experts * H
    layers = []
    for i in range(L):
        if i < cfg.first_k_dense:
            layers.append(_LayerUnits(_Unit(attention + 3 * H * cfg.ffn_hidden_size / par.tp, dense_group, b),
                                      None, None, 0.0))
            continue
        experts = _Unit(3 * (moe.num_experts // par.ep) * H * moe.ffn_hidden_size, par.dp, b)
        in_block = 0 if gpu else router
        block = _Unit(attention + shared + in_block, dense_group, b)
        layers.append(_LayerUnits(block, experts, _Unit(router, dense_group, 4) if gpu else None,
                                  H + shared + in_block))
    tied = cfg.tie_embeddings
    embed_in_root = tied or not gpu
    # a tied embedding keeps the root an fp32 unit (the residual stream starts in fp32)
    root = _Unit(V * H + H + (V * H if embed_in_root and not tied else 0), dense_group, 4 if tied else b)
    embed = None if embed_in_root else _Unit(V * H, dense_group, 4)
    return _Units(layers, root, embed, V * H)


def _keeps(recompute: str, attn: float, ffn: float, residual: float, is_moe: bool) -> tuple[float, ...]:
    """(kept while the layer waits for its backward, rebuilt for its FFN branch's backward, freed after it, rebuilt
    for its attention branch's backward, freed after it) under ``recompute`` (Block.forward)."""
    if recompute == "full":
        return residual, attn + ffn, 0.0, attn, residual
    if recompute == "moe" and is_moe:
        return attn + residual, ffn, residual, 0.0, attn
    return attn + ffn, 0.0, ffn, 0.0, attn


def _fsdp_moments(cfg: ModelConfig, par: ParallelConfig, units: _Units, acts: _LayerActivations, recompute: str,
                  precision: str, kernel: str, ssmb: bool) -> list[tuple[str, dict[str, float]]]:
    """Every moment of one FSDP2 training step that can hold its peak, as (label, bytes by term): the loss, each
    layer's FFN and attention branches in backward order, the end of backward, the optimizer step."""
    H, V, L, moe = cfg.hidden_size, cfg.vocab_size, cfg.num_layers, cfg.moe
    b, T, tp = activation_bytes(precision), acts.tokens, par.tp
    P = sum(u.shard for u in units.all())
    base = {"params": MASTER_BYTES * P, "optimizer": ADAM_BYTES * P}
    moments: list[tuple[str, dict[str, float]]] = []

    def at(label: str, **terms: float) -> None:
        moments.append((label, base | terms))

    residual = RESIDUAL_BYTES * T * H
    attn_b, moe_b, dense_b = (sum(d.values()) for d in (acts.attention, acts.moe, acts.dense))
    plans = [_keeps(recompute, attn_b, moe_b if layer.experts else dense_b, residual, layer.experts is not None)
             for layer in units.layers]
    tail = norm_activations(T, H) + b * T * H  # the final norm, the head's input
    left = sum(plan[0] for plan in plans)
    root, head_grad = units.root.weights, units.root.width * units.head
    # the loss: the log-softmax's backward (bf16 logits, fp32 log-probabilities and both gradients, or all fp32),
    # then the head's weight gradient beside the logits' (with several chunks, added into the earlier chunks')
    chunk = min(T, LOSS_CHUNK_TOKENS)
    more = float(T > chunk)
    first = units.layers[-1].block.weights  # the root's backward prefetches the last block
    at("loss backward", gathered=root, prefetch=first, grads=more * head_grad, activations=left + tail,
       transient=12 * chunk * V)
    at("head gradient", gathered=root, prefetch=first, grads=(1 + more) * head_grad, activations=left + tail,
       transient=b * chunk * V)
    # expert rows' gradients in the grouped SwiGLU's backward: in and out (N x H each), and of h1 / h3
    rows_grad = b * acts.rows * (2 * H + (moe.ffn_hidden_size if kernel == "torch" else 2 * moe.ffn_hidden_size))
    # the combine's backward: the rows' output gradients, and on the torch path fp32 products (and fp32 copies of
    # them and of the expert outputs when b < 4) for the rows' and the weights' gradients; Triton: two row tensors
    NH = acts.rows * H
    combine_grad = (b + 8 + (8 if b < 4 else 0)) * NH if kernel == "torch" else 2 * b * NH
    reduced, in_flight = 0.0, 0.0
    for i in reversed(range(L)):
        layer, (_, ffn_regen, ffn_done, attn_regen, attn_done) = units.layers[i], plans[i]
        block, experts, router = layer.block, layer.experts, layer.router or _NO_UNIT
        nxt = units.layers[i - 1].block.weights if i else (units.embed.weights if units.embed else 0.0)
        if not experts:  # a dense block: one unit, one stage
            at(f"layer {i} block backward", gathered=root + block.weights, prefetch=nxt, grads=head_grad + reduced,
               grads_unit=block.weights, reduce_buffer=in_flight, activations=left + ffn_regen,
               transient=2 * residual + 2 * b * T * cfg.ffn_hidden_size / tp)
            reduced, in_flight, left = reduced + block.reduced, block.reduce_input, left - ffn_done - attn_done
            continue
        # the MoE branch's backward: the combine's first (the experts' all-gather prefetched; the shared experts'
        # gradients made), which frees its buffer; then w2's gradient, then w1's and w3's, by which time the torch
        # path's separate ops have freed the hidden tensors (one Triton op keeps them to its end); SSMB averages each
        # weight's gradient over tp into a new tensor, one weight at a time
        moe_side = block.width * layer.moe_side
        at(f"layer {i} MoE backward", gathered=root + block.weights, prefetch=experts.weights + router.weights,
           grads=head_grad + reduced, reduce_buffer=in_flight, activations=left + ffn_regen, grads_unit=moe_side,
           transient=residual + combine_grad)
        average = experts.weights / 3 if ssmb and tp > 1 else 0.0
        live = left + ffn_regen - acts.moe.get("combine_buffer", 0.0)
        hidden = acts.moe.get("expert_hidden", 0.0) if kernel == "torch" else 0.0
        for grads_made, freed in ((experts.weights / 3, 0.0), (experts.weights, hidden)):
            at(f"layer {i} MoE backward", gathered=root + block.weights,
               gathered_own=experts.weights + router.weights, prefetch=nxt, grads=head_grad + reduced,
               reduce_buffer=in_flight, activations=live - freed, grads_unit=grads_made + router.weights + moe_side,
               transient=residual + rows_grad + average)
        reduced += experts.reduced + router.reduced
        in_flight = (router if layer.router else experts).reduce_input
        left -= ffn_done
        at(f"layer {i} attention backward", gathered=root + block.weights, prefetch=nxt, grads=head_grad + reduced,
           grads_unit=block.weights, reduce_buffer=in_flight, activations=left + attn_regen,
           transient=2 * residual + 4 * b * T * H / tp)
        reduced, in_flight, left = reduced + block.reduced, block.reduce_input, left - attn_done
    root_grads = head_grad if units.embed else units.root.weights  # the embedding's own, on CPUs or when tied
    embed = units.embed or _NO_UNIT
    # the embedding's gradient, then (in the final callback) the root's reduce-scatter: its gathered weights are
    # freed first and the buffer in flight released, the gradients copied into an fp32 input; then the embedding's
    at("embedding backward", gathered=root, gathered_own=embed.weights, grads=root_grads + reduced,
       grads_unit=embed.weights, reduce_buffer=in_flight)
    at("root reduce-scatter", gathered_own=embed.weights, grads=root_grads + reduced, grads_unit=embed.weights,
       reduce_buffer=units.root.reduce_input)
    if units.embed:
        at("embedding reduce-scatter", grads=reduced + units.root.reduced, grads_unit=embed.weights,
           reduce_buffer=embed.reduce_input)
    at("optimizer step", grads=GRAD_BYTES * P, adam_step=_adam_step(cfg, par, precision, sharded=True))
    return moments


def _replica_peak(cfg: ModelConfig, par: ParallelConfig, acts: _LayerActivations, micro_batch: int, seq_len: int,
                  recompute: str, precision: str, kernel: str) -> tuple[str, dict[str, float]]:
    """The peak of a whole replica: the trainer on one process, or a DDP rank (the same plus DDP's fp32 gradient
    buckets, as large as the gradients): the larger of backward's and the optimizer step's. bf16:
    estimate_trainer_memory (compiled regions, as the trainer runs them with ep = tp = 1 on a GPU); fp32: the same
    backward walk over the eager fp32 blocks."""
    parts = count_params(cfg, expert_matrices=3).total_by_part
    P = sum(parts.values())
    if precision == "bf16":
        m = estimate_trainer_memory(cfg, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute,
                                    fused=kernel == "triton")
    else:
        m = _fp32_replica(cfg, acts, recompute, kernel)
    buckets = GRAD_BYTES * P if par.world_size > 1 else 0.0
    states = {"params": MASTER_BYTES * P, "optimizer": ADAM_BYTES * P, "buckets": buckets}
    backward = states | {"casts": m.states - 12 * P, "grads": m.grads, "activations": m.activations,
                         "transient": m.working}
    step = states | {"grads": GRAD_BYTES * P, "adam_step": _adam_step(cfg, par, precision, sharded=False)}
    where = f"backward, {m.blocks_done} of {cfg.num_layers} blocks done" if m.blocks_done else "loss backward"
    return max((where, backward), ("optimizer step", step), key=lambda moment: sum(moment[1].values()))


def _adam_step(cfg: ModelConfig, par: ParallelConfig, precision: str, sharded: bool) -> float:
    """AdamW's transient: none for the fused GPU kernel; on CPUs the single-tensor step makes the square root and
    the quotient of one parameter at a time beside the previous one's denominator, up to 3 of the largest local
    parameter tensor (``sharded``: FSDP2's shards, else a replica's)."""
    if precision == "bf16":
        return 0.0
    H, moe = cfg.hidden_size, cfg.moe
    dense_group, expert_group = (par.dp * par.ep, par.dp) if sharded else (1, 1)
    largest = max(cfg.vocab_size * H / dense_group,
                  H * cfg.num_heads * cfg.head_dim / par.tp / dense_group,
                  H * max(moe.shared_width, cfg.ffn_hidden_size / par.tp) / dense_group,
                  moe.num_experts // par.ep * H * moe.ffn_hidden_size / expert_group)
    return 3 * MASTER_BYTES * largest


def _fp32_replica(cfg: ModelConfig, acts: _LayerActivations, recompute: str, kernel: str) -> TrainerMemory:
    """estimate_trainer_memory's walk for an fp32 eager replica (the trainer on a CPU): no casts, fp32 gradients
    made directly, and each block's activation gradients (as in _fsdp_moments) as its transient."""
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    T, b, moe = acts.tokens, 4, cfg.moe
    parts = count_params(cfg, expert_matrices=3).total_by_part
    residual = RESIDUAL_BYTES * T * H
    rows_grad = b * acts.rows * (2 * H + (moe.ffn_hidden_size if kernel == "torch" else 2 * moe.ffn_hidden_size))
    weights = _block_weights(cfg, parts)
    attn_b, moe_b, dense_b = (sum(d.values()) for d in (acts.attention, acts.moe, acts.dense))
    blocks = []
    for i in range(L):
        is_moe = i >= cfg.first_k_dense
        kept, regen, *_ = _keeps(recompute, attn_b, moe_b if is_moe else dense_b, residual, is_moe)
        transient = residual + (rows_grad if is_moe else 2 * b * T * cfg.ffn_hidden_size)
        blocks.append((kept, regen, GRAD_BYTES * weights[i], transient))
    tail = norm_activations(T, H) + b * T * H
    head = parts["head"] or parts["embedding"]
    return _backward_walk(12 * sum(parts.values()), blocks, GRAD_BYTES * head, tail,
                          12 * min(T, LOSS_CHUNK_TOKENS) * V)


def _traffic(cfg: ModelConfig, par: ParallelConfig, units: Optional[_Units], precision: str,
             rows: float) -> dict[str, float]:
    """Bytes each GPU sends per micro-batch (a ring sends (G-1)/G of a collective's bytes over a group of G):
    FSDP2 all-gathers every unit forward and backward at its gathered width and reduce-scatters its gradients in
    fp32; DDP all-reduces the fp32 gradients (twice (G-1)/G); the expert all-to-alls move the rows."""
    ep, world = par.ep, par.world_size
    out = {"fsdp_dense": 0.0, "fsdp_experts": 0.0, "ddp": 0.0, "all_to_all": 0.0}
    if units is not None:  # FSDP2

        def sent(u: _Unit) -> float:
            return (2 * u.width + GRAD_BYTES) * u.numel * (u.group - 1) / u.group

        out["fsdp_experts"] = sum(sent(u) for u in units.experts())
        out["fsdp_dense"] = sum(sent(u) for u in units.all()) - out["fsdp_experts"]
    elif world > 1:  # DDP
        out["ddp"] = 2 * GRAD_BYTES * count_params(cfg).total * (world - 1) / world
    n_moe = cfg.num_layers - cfg.first_k_dense
    # dispatch + combine, forward and backward; (ep-1)/ep of the rows leave the GPU
    out["all_to_all"] = 4 * n_moe * rows * cfg.hidden_size * activation_bytes(precision) * (ep - 1) / ep
    return out


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
    the least traffic per GPU per micro-batch (FSDP2 collectives + expert all-to-alls: a small EP makes every
    GPU all-gather E/EP experts' weights each pass, a large EP moves rows instead), then EP inside a node."""
    par = m.parallel
    node = par.gpus_per_node or par.world_size
    return (RECOMPUTE_MODES.index(m.recompute), par.tp, -m.micro_batch, round(sum(m.traffic.values()) / 1e6),
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
    recs = [recompute] if recompute else list(RECOMPUTE_MODES)
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


def _block_weights(cfg: ModelConfig, parts: dict[str, int]) -> list[float]:
    """Parameters of each block, from the one parameter count (attention variants, shared-expert widths included)."""
    L, H = cfg.num_layers, cfg.hidden_size
    n_moe, n_dense = L - cfg.first_k_dense, cfg.first_k_dense
    attn_w = parts["attention"] / L + 2 * H  # + the block's two RMSNorm weights
    moe_w = (parts["routed_experts"] + parts["router"] + parts["shared_experts"]) / max(1, n_moe)
    dense_w = parts["dense_ffn"] / max(1, n_dense)
    return [attn_w + (moe_w if i >= cfg.first_k_dense else dense_w) for i in range(L)]


def _backward_walk(states: float, blocks: list[tuple[float, float, float, float]], start_grads: float,
                   tail: float, loss_chunk: float, accumulating: bool = False) -> TrainerMemory:
    """The peak of a replica's backward: the loss chunk at its start, then block by block top-down, each freeing
    its saved activations while its gradients appear (with ``accumulating`` every gradient exists throughout, in
    ``start_grads``). ``blocks``: (saved, rebuilt in backward, gradient bytes, transient) per block, bottom first."""
    saved_left = sum(saved for saved, *_ in blocks)
    best = TrainerMemory(states, start_grads, saved_left + tail, loss_chunk, 0)
    grads = start_grads
    for j, (saved, regen, grad_bytes, transient) in enumerate(reversed(blocks), 1):
        made = 0.0 if accumulating else grad_bytes  # this block's gradients appear as it runs
        here = TrainerMemory(states, grads + made, saved_left, regen + transient, j)
        if here.total > best.total:
            best = here
        grads += made
        saved_left -= saved
    return best


def estimate_trainer_memory(cfg: ModelConfig, *, micro_batch: int, seq_len: Optional[int] = None,
                            recompute: str = "none", accumulation: int = 1, compiled: bool = True,
                            fused: bool = True) -> TrainerMemory:
    """The peak of one `xmoe train` step on one GPU, in the trainer's own precision layout:

    * states: fp32 parameters (4 B), AdamW's two fp32 moments (8 B), and the bf16 copies of the routed experts made
      once per step (2 B per expert weight);
    * the last micro-batch's backward walks the blocks top-down (``_backward_walk``): the LM head's fp32 gradient
      first, then each block frees its saved activations while its fp32 parameter gradients appear (with
      ``accumulation`` > 1 every gradient exists from the first micro-batch on). The peak is the largest sum of
      gradients plus activations of the blocks left plus the transient of the block in hand: its bf16 weight
      gradients before they are added into fp32, and with recompute its activations rebuilt; or the loss chunk's
      logits at the start of backward;
    * saved activations per block: block_activations. "moe" keeps the MoE branch's fp32 input instead of its
      activations, "full" only each block's fp32 input.
    benchmarks/memory_fit.py measures the peaks this predicts (docs/training-speed.md has the table).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute ({recompute!r}) must be one of {RECOMPUTE_MODES}")
    if micro_batch < 1 or accumulation < 1:
        raise ValueError(f"micro_batch ({micro_batch}) and accumulation ({accumulation}) must be >= 1")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    H, L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    T, b = micro_batch * seq_len, 2
    parts = count_params(cfg, expert_matrices=3).total_by_part
    total_params = sum(parts.values())
    states = 12 * total_params + 2 * parts["routed_experts"]
    blocks = []  # (saved, rebuilt in backward, fp32 gradient bytes, bf16 weight-gradient transient)
    for i, weights in enumerate(_block_weights(cfg, parts)):
        is_moe = i >= cfg.first_k_dense
        attn, ffn = block_activations(cfg, T, i, compiled=compiled, fused=fused, b=b)
        if recompute == "full":
            saved, regen = 4 * T * H, attn + ffn
        elif recompute == "moe" and is_moe:
            saved, regen = attn + 4 * T * H, ffn
        else:
            saved, regen = attn + ffn, 0.0
        blocks.append((saved, regen, 4 * weights, b * weights))
    accumulating = accumulation > 1
    start_grads = 4 * total_params if accumulating else 4 * (parts["head"] or parts["embedding"])
    tail = 4 * T * H + b * T * H  # final norm's input and the head's input
    loss_chunk = 12 * min(T, LOSS_CHUNK_TOKENS) * V  # bf16 logits, fp32 log-softmax and their gradients
    return _backward_walk(states, blocks, start_grads, tail, loss_chunk, accumulating)
