"""Parameter and FLOP counts from a ModelConfig alone: pure arithmetic, nothing is allocated.

Parameter parts (per-layer quantities times the number of layers they occur in; n_moe = L - first_k_dense):
  embedding       V*H
  attention       L * (matrices + q/k norms) 4*H*H + 0 by default (wq, wk, wv, wo; no biases); with G kv heads of
                  width D: H*D*(2N + 2G); MLA: its low-rank projections and latent norms
  dense_ffn       first_k_dense * m*H*F_dense
  routed_experts  n_moe * E * m*H*F         (active: top_k of the E experts)
  shared_experts  n_moe * m*H*F_shared (+ H with the shared-expert gate); F_shared = n_shared * F unless set
  router          n_moe * E*H
  norms           (2*L + 1) * H
  head            V*H, or 0 when tied to the embedding
  mtp             D * (2*H*H + 3*H): each multi-token-prediction module's projection and three norms; its block
                  counts as one more layer of the last layer's kind in the parts above (L -> L + D), and the
                  embedding and head are shared
``expert_matrices`` m applies to every FFN: 3 = SwiGLU (w1, w3, w2), what xmoe builds, and then the total
equals ``Transformer(cfg).num_params()`` exactly; 2 = GELU (up, down), the X-MoE paper's convention.

The paper's table ("params / active") is reproduced by ``paper_params``: two-matrix FFNs, attention and
FFN matrices only (no embedding, head, router or norms), in billions of 2**30, not 1e9. That rounds to the
printed value for 7 of the 8 numbers (Small 10.06/1.34, Medium 55.23/5.20, Large 201.36/11.48,
Super 545.43/28.36 against 10.1/1.3, 55.2/5.2, 201.4/11.5, 545.4/28.7); in decimal billions the same count is
7.5% higher, and no vocabulary size makes a decimal count fit (Small's experts alone are 10.3e9 > 10.1e9).

FLOPs are 2 x multiply-accumulates of the matrix products only (norms, softmax, activations and rotary are
ignored; the embedding lookup is free). Causal attention is counted at half: the QK^T and AV products cost
2 * 2*H*S/2 FLOPs per token per layer, S the sequence length. Training = 3 x forward (backward is two
forward-sized products); recomputation is not counted, so this is model FLOPs, not hardware FLOPs.
``paper_flops_per_token`` is the paper's TFLOP/s formula verbatim, for comparison with its tables.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xmoe.config import ModelConfig
from xmoe.model.flops import FlopDims, attention_matrix_params, forward_macs, paper_train_flops

PARTS = ("embedding", "attention", "dense_ffn", "routed_experts", "shared_experts", "router", "norms", "head", "mtp")


@dataclass(frozen=True)
class ParamCount:
    """Total and activated (per token) parameters, by part (keys of PARTS)."""

    total_by_part: dict[str, int]
    active_by_part: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.total_by_part.values())

    @property
    def active(self) -> int:
        return sum(self.active_by_part.values())


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs per token by part (keys of PARTS minus norms, embedding = 0)."""

    forward_by_part: dict[str, float]

    @property
    def forward(self) -> float:
        return sum(self.forward_by_part.values())

    @property
    def training(self) -> float:
        return 3.0 * self.forward


def _check_matrices(expert_matrices: int) -> None:
    if expert_matrices not in (2, 3):
        raise ValueError(f"expert_matrices ({expert_matrices}) must be 2 (GELU, the paper's) or 3 (SwiGLU, xmoe's)")


def _check_seq_len(cfg: ModelConfig, seq_len: int) -> None:
    if not 0 < seq_len <= cfg.max_seq_len:
        raise ValueError(f"seq_len ({seq_len}) must be in [1, max_seq_len={cfg.max_seq_len}]")


def _attention_norm_params(cfg: ModelConfig) -> int:
    if cfg.attention == "mla":
        return cfg.q_lora_rank + cfg.kv_lora_rank
    D = cfg.head_dim
    biases = (cfg.num_heads + 2 * cfg.kv_heads) * D if cfg.qkv_bias else 0
    return biases + {"none": 0, "head": 2 * D, "proj": (cfg.num_heads + cfg.kv_heads) * D}[cfg.qk_norm]


def count_params(cfg: ModelConfig, expert_matrices: int = 3) -> ParamCount:
    """Exact parameter count of ``cfg`` with ``expert_matrices`` matrices per FFN (see module docstring)."""
    _check_matrices(expert_matrices)
    H, V, m, moe, D = cfg.hidden_size, cfg.vocab_size, expert_matrices, cfg.moe, cfg.mtp_depth
    L = cfg.num_layers + D  # blocks: the multi-token-prediction blocks are of the last layer's kind
    n_moe = cfg.num_layers - cfg.first_k_dense + (D if cfg.has_moe else 0)
    expert = m * H * moe.ffn_hidden_size
    total = {
        "embedding": V * H,
        "attention": L * (attention_matrix_params(cfg) + _attention_norm_params(cfg)),
        "dense_ffn": (L - n_moe) * m * H * cfg.ffn_hidden_size,
        "routed_experts": n_moe * moe.num_experts * expert,
        "shared_experts": n_moe * (m * H * moe.shared_width + H * moe.shared_expert_gate),
        "router": n_moe * moe.num_experts * H,
        "norms": (2 * L + 1) * H,
        "head": 0 if cfg.tie_embeddings else V * H,
        "mtp": D * (2 * H * H + 3 * H),
    }
    active = dict(total, routed_experts=n_moe * moe.top_k * expert)
    return ParamCount(total, active)


def block_kinds(cfg: ModelConfig) -> list[bool]:
    """Whether each block is an MoE block, in forward order: the layers, then the multi-token-prediction blocks."""
    # a multi-token-prediction block takes the last layer's kind: MoE when the model has any MoE block
    return [i >= cfg.first_k_dense for i in range(cfg.num_layers)] + [cfg.has_moe] * cfg.mtp_depth


def paper_params(cfg: ModelConfig) -> tuple[float, float]:
    """(total, active) in the X-MoE paper's convention: GELU FFNs, attention + FFN matrices, in 2**30."""
    count = count_params(cfg, expert_matrices=2)
    kept = ("attention", "dense_ffn", "routed_experts", "shared_experts")
    return (
        sum(count.total_by_part[k] for k in kept) / 2**30,
        sum(count.active_by_part[k] for k in kept) / 2**30,
    )


def flops_per_token(cfg: ModelConfig, seq_len: int, expert_matrices: int = 3) -> FlopCount:
    """Forward FLOPs per token at ``seq_len`` by part; ``.training`` is 3x that.

    The formula is xmoe's one FLOP definition, ``xmoe.model.flops.forward_macs`` (causal attention counts
    the s(s+1)/2 visible pairs), divided over the tokens of one sequence. ``expert_matrices=2`` rescales the
    FFN parts to the paper's two-matrix (GELU) experts.
    """
    _check_matrices(expert_matrices)
    _check_seq_len(cfg, seq_len)
    macs = forward_macs(FlopDims.from_model_config(cfg, seq_len), num_sequences=1)
    ffn_scale = expert_matrices / 3

    def per_token(*keys: str) -> float:
        return 2.0 * sum(macs[k] for k in keys) / seq_len

    return FlopCount(
        {
            "embedding": 0.0,
            "attention": per_token("attn_proj", "attn_scores"),
            "dense_ffn": per_token("dense_ffn") * ffn_scale,
            "routed_experts": per_token("routed_experts") * ffn_scale,
            "shared_experts": per_token("shared_experts") * ffn_scale,
            "router": per_token("router"),
            "head": per_token("lm_head"),
            "mtp": per_token("mtp_proj"),
        }
    )


def paper_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token by the paper's formula (``xmoe.model.flops.paper_train_flops``).

    Full (not causal) attention, two-matrix experts, no router, every layer an MoE layer, shared experts
    ignored: use it only to compare TFLOP/s with the paper's tables.
    """
    _check_seq_len(cfg, seq_len)
    return paper_train_flops(FlopDims.from_model_config(cfg, seq_len), num_sequences=1) / seq_len


def _human(n: float, giga: str = "B") -> str:
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), (giga, 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def describe(cfg: ModelConfig, seq_len: int, global_batch: int) -> str:
    """Human-readable summary for ``xmoe train --dry-run``: parameters (both conventions) and step FLOPs."""
    if global_batch <= 0:
        raise ValueError(f"global_batch ({global_batch}) must be > 0")
    moe = cfg.moe
    swiglu, gelu = count_params(cfg, 3), count_params(cfg, 2)
    flops = flops_per_token(cfg, seq_len, 3)
    tokens = seq_len * global_batch
    lines = [
        f"model: vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, layers {cfg.num_layers} "
        f"({cfg.first_k_dense} dense), heads {cfg.num_heads} x {cfg.head_dim}, "
        f"experts {moe.num_experts} x ffn {moe.ffn_hidden_size}, top-{moe.top_k}, "
        f"shared {moe.num_shared_experts}, tied embeddings {cfg.tie_embeddings}",
        "",
        f"{'part':<16}{'params':>10}{'active':>10}{'params':>10}{'active':>10}{'fwd FLOP/tok':>14}",
        f"{'':<16}{'(SwiGLU)':>10}{'(SwiGLU)':>10}{'(GELU)':>10}{'(GELU)':>10}{'(SwiGLU)':>14}",
    ]
    for part in PARTS:
        lines.append(
            f"{part:<16}{_human(swiglu.total_by_part[part]):>10}{_human(swiglu.active_by_part[part]):>10}"
            f"{_human(gelu.total_by_part[part]):>10}{_human(gelu.active_by_part[part]):>10}"
            f"{_human(flops.forward_by_part.get(part, 0.0), 'G'):>14}"
        )
    lines.append(
        f"{'total':<16}{_human(swiglu.total):>10}{_human(swiglu.active):>10}"
        f"{_human(gelu.total):>10}{_human(gelu.active):>10}{_human(flops.forward, 'G'):>14}"
    )
    if cfg.mtp_depth:
        bare = replace(cfg, mtp_depth=0)
        extra, extra_flops = (
            swiglu.total - count_params(bare).total,
            flops.forward - flops_per_token(bare, seq_len).forward,
        )
        lines.append(
            f"multi-token prediction: {cfg.mtp_depth} module(s), {_human(extra)} params, "
            f"{_human(extra_flops, 'G')} fwd FLOP/tok (in the rows above; mtp: their projections and norms)"
        )
    paper_total, paper_active = paper_params(cfg)
    lines += [
        "",
        f"paper convention (GELU, no embedding/head/router/norms, units of 2^30): "
        f"{paper_total:.4g}B total, {paper_active:.4g}B active",
        f"tokens per step: {global_batch} x {seq_len} = {tokens}",
        f"training FLOPs per step: {_human(flops.training * tokens, 'G')}FLOP "
        f"(3 x forward, SwiGLU, causal attention halved); "
        f"paper formula: {_human(paper_flops_per_token(cfg, seq_len) * tokens, 'G')}FLOP",
    ]
    return "\n".join(lines)
