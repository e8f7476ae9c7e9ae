"""The terms both memory models are built from: bytes per element of each kind of state, the activations each
sub-block saves for backward (attention, dense FFN, MoE block, RMSNorm), what recompute keeps of a block, and
AdamW's transient. Letters and conventions: ``memory.py``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xmoe.config import ModelConfig, MoEConfig, ParallelConfig

PRECISIONS = ("bf16", "fp32")  # the trainer's on GPUs and on CPUs
MASTER_BYTES = 4  # fp32 parameters: FSDP2's shards are the master weights, there is no other copy
GRAD_BYTES = 4  # fp32 gradients once reduced (FSDP2's reduce dtype), and a replica's
ADAM_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, fp32
RESIDUAL_BYTES = 4  # the residual stream between blocks, fp32 in both precisions
INDEX_BYTES = 8  # int64 routing arrays
LOSS_CHUNK_TOKENS = 4096  # Transformer(loss_chunk_tokens=...) default: one chunk's logits exist at a time


def activation_bytes(precision: str) -> int:
    """b: bytes per element of what autocast computes in (bf16), or of everything (fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision ({precision!r}) must be one of {PRECISIONS}: bf16 as on GPUs, fp32 as on CPUs")
    return 2 if precision == "bf16" else 4


def norm_activations(T: int, H: int) -> float:
    """RMSNorm (transformer.py) works in fp32 whatever the activation dtype: it keeps the fp32 input copy, 1/rms,
    the fp32 normalized tensor and an fp32 copy of its weight; its output is saved by whoever consumes it."""
    return 8 * T * H + 4 * T + 4 * H


def attention_activations(T: int, H: int, heads: int, tp: int, b: int = 2, autocast: bool = False) -> dict[str, float]:
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


def mtp_activations(T: int, H: int, b: int = 2) -> float:
    """Bytes one multi-token-prediction module saves besides its block (xmoe/model/mtp.py): its three eager RMSNorms
    (enorm, hnorm, and the final one), eh_proj's input (2H wide, in the compute dtype) and the head's input (or, with
    the loss in chunks, h's gradient in the compute dtype, which model/loss.py holds instead: the same bytes)."""
    return 3 * norm_activations(T, H) + b * T * 2 * H + b * T * H


def capacity(moe: MoEConfig, num_tokens: int, capacity_factor: float | None = None) -> int:
    """Slots per expert for ``num_tokens`` tokens: MoEConfig.capacity with ``capacity_factor`` (None: the
    config's own factor; dropless when both are None, where the padded baseline uses C = T)."""
    factor = capacity_factor if capacity_factor is not None else moe.capacity_factor
    return replace(moe, capacity_factor=factor).capacity(num_tokens)


def moe_activations(
    moe: MoEConfig,
    T: int,
    *,
    ep: int = 1,
    padded: bool = False,
    capacity_factor: float | None = None,
    imbalance: float = 1.0,
    kernel: str = "triton",
    b: int = 2,
    router_fp32: bool = False,
) -> dict[str, float]:
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
    H, E, K = moe.hidden_size, moe.num_experts, moe.top_k
    weight_copy = 4 * E * H if b != 4 and not router_fp32 else 0
    out: dict[str, float] = {
        "norm": norm_activations(T, H),
        # F.linear(x.float(), weight.float()) keeps fp32 copies of both (an fp32 input is saved as is: same
        # bytes; an fp32 weight is the parameter itself: no copy), then the softmax output and the top-k ids
        "router": 4 * T * H + weight_copy + 4 * T * E + INDEX_BYTES * T * K + (4 * T * E if moe.z_loss_coef > 0 else 0),
    }
    C = capacity(moe, T, capacity_factor)
    if padded:
        out.update(_padded_terms(moe, T, C, b))
    else:
        dropless = capacity_factor is None and moe.capacity_factor is None
        rows = (T * K if dropless else min(T * K, E * C)) * imbalance
        out.update(_pft_terms(moe, T, rows, ep, kernel, b))
    if moe.num_shared_experts:
        Fs = moe.shared_width
        # input (one storage with the router's fp32 copy when activations are fp32) + 4 hidden tensors
        out["shared_experts"] = (b * T * H if b != 4 else 0) + 4 * b * T * Fs
    return out


def _padded_terms(moe: MoEConfig, T: int, C: int, b: int) -> dict[str, float]:
    """The padded baseline's buffers: E*C rows whatever the routing, and the (T, E, C) masks."""
    H, F, E, K = moe.hidden_size, moe.ffn_hidden_size, moe.num_experts, moe.top_k
    kept = min(T * K, E * C)
    return {
        "dispatch_masks": (b + 4) * T * E * C,  # dispatch mask (activation dtype) + fp32 combine weights
        "dispatch_buffer": b * E * C * H,  # x_ECH, saved by the expert bmm
        "expert_hidden": 4 * b * E * C * F,  # the bmm path saves h1, silu(h1), h3, product
        "combine_buffer": 4 * E * C * H,  # fp32 copy of the expert output, saved by the combine einsum
        "routing_indices": (INDEX_BYTES + 4) * T * K + 3 * INDEX_BYTES * kept,  # ids, weights, index_put
    }


def _pft_terms(moe: MoEConfig, T: int, rows: float, ep: int, kernel: str, b: int) -> dict[str, float]:
    """PFT's buffers for ``rows`` routed rows (received rows under EP)."""
    H, F, E, K = moe.hidden_size, moe.ffn_hidden_size, moe.num_experts, moe.top_k
    hidden_tensors = 2 if kernel == "triton" else 4
    regroup = 2 * INDEX_BYTES * rows if ep > 1 and E // ep > 1 else 0  # (source, expert) <-> expert-major
    return {
        "dispatch_buffer": b * rows * H,  # rows the experts read (received rows under EP)
        "expert_hidden": hidden_tensors * b * rows * F,
        "combine_buffer": b * rows * H,  # expert output rows (after the reverse all-to-all under EP)
        # row_of_slot (T, K) and weights (T, K); token and slot id per row; the EP regroup permutations
        "routing_indices": (INDEX_BYTES + 4) * T * K + 2 * INDEX_BYTES * rows + regroup,
    }


@dataclass(frozen=True)
class _LayerActivations:
    attention: dict[str, float]  # one attention branch's saved bytes
    moe: dict[str, float]  # one MoE branch's ({} for an all-dense model)
    dense: dict[str, float]  # one dense FFN branch's ({} without dense layers)
    rows: float  # N: rows the experts of a rank compute per MoE layer
    tokens: int  # T


def _keeps(recompute: str, attn: float, ffn: float, residual: float, is_moe: bool) -> tuple[float, ...]:
    """(kept while the layer waits for its backward, rebuilt for its FFN branch's backward, freed after it, rebuilt
    for its attention branch's backward, freed after it) under ``recompute`` (Block.forward)."""
    if recompute == "full":
        return residual, attn + ffn, 0.0, attn, residual
    if recompute == "moe" and is_moe:
        return attn + residual, ffn, residual, 0.0, attn
    return attn + ffn, 0.0, ffn, 0.0, attn


def _adam_step(cfg: ModelConfig, par: ParallelConfig, precision: str, sharded: bool) -> float:
    """AdamW's transient: none for the fused GPU kernel; on CPUs the single-tensor step makes the square root and
    the quotient of one parameter at a time beside the previous one's denominator, up to 3 of the largest local
    parameter tensor (``sharded``: FSDP2's shards, else a replica's)."""
    if precision == "bf16":
        return 0.0
    H, moe = cfg.hidden_size, cfg.moe
    dense_group, expert_group = (par.dp * par.ep, par.dp) if sharded else (1, 1)
    largest = max(
        cfg.vocab_size * H / dense_group,
        H * cfg.num_heads * cfg.head_dim / par.tp / dense_group,
        H * max(moe.shared_width, cfg.ffn_hidden_size / par.tp) / dense_group,
        moe.num_experts // par.ep * H * moe.ffn_hidden_size / expert_group,
    )
    return 3 * MASTER_BYTES * largest
