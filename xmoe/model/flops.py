"""FLOP formulas of a training step from the model's dimensions: pure arithmetic, nothing is allocated.

FLOP accounting (the one place it is defined)
---------------------------------------------
# B sequences, S seq len, T = B*S tokens, H hidden, L layers (L_moe MoE + L_dense dense), V vocab,
# n_h heads, n_kv key/value heads, d_h head dim, E experts, K top-k, F expert ffn, F_d dense ffn,
# n_s shared experts, N token-expert rows the routed experts actually processed (all MoE layers summed).

One multiply-accumulate (MAC) is 2 FLOPs; a training step is 3 x the forward FLOPs (the backward pass costs
2 x forward: gradients w.r.t. activations and w.r.t. weights). Only matmuls count: norms, softmax,
activations, RoPE, top-k selection and the optimizer are ignored, and activation recomputation is not
counted (model FLOPs, the MFU convention).

(a) xmoe's formula, forward MACs of one step:
    attention projections  T * L * H * d_h * (2 n_h + 2 n_kv)      (= 4 H^2 per token when n_kv = n_h, n_h d_h = H;
                                                                   MLA: its low-rank matrices' parameters)
    attention QK^T and PV  L * B * n_h * (d_h + d_v) * S (S + 1) / 2   causal: only the S(S+1)/2 (query, key)
                                                                   pairs with key <= query are counted, not S^2;
                                                                   d_v = d_h except under MLA
    dense FFN (SwiGLU)     T * L_dense * 3 H F_d                   gate, up and down matrices
    router                 T * L_moe * H E
    shared experts         T * L_moe * n_s * 3 H F                 n_s F: MoEConfig.shared_ffn_hidden_size when set
    routed experts         N * 3 H F                               N excludes dropped slots; dropless N = T L_moe K
    LM head                T * V H                                 the embedding lookup is free
    multi-token prediction D modules (model.mtp_depth; xmoe/model/mtp.py), each over all T tokens: its block
                           counts as one more layer of its kind in every line above (L -> L + D, and L_moe or
                           L_dense + D), the head D more times, and its projection T * D * 2 H^2
    training FLOPs = 2 * 3 * MACs

(b) the paper's formula, kept only to compare with its reported numbers:
    forward MACs = L * B S (4 H^2 + 2 d_h n_h S + 2 F H K) + B V H S
    TFLOP/s      = 2 * 3 * MACs / (time * GPUs) / 1e12
    It counts full (non-causal) attention, two expert matrices instead of SwiGLU's three, every layer as
    a top-k MoE layer, and no router / shared experts / dense layers / drops, so (a) and (b) differ.

Per-GPU throughput: pass the global token and row counts of the step and divide by time * GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from xmoe.config import ModelConfig

__all__ = ["FlopDims", "forward_macs", "paper_train_flops", "train_flops"]


@dataclass
class FlopDims:
    """Model dimensions the FLOP formulas need; ``head_dim`` 0 means H / n_h, ``num_kv_heads`` 0 means n_h."""

    hidden_size: int
    num_layers: int
    num_moe_layers: int
    num_heads: int
    vocab_size: int
    seq_len: int
    num_experts: int
    top_k: int
    expert_ffn_size: int
    dense_ffn_size: int
    num_shared_experts: int = 0
    head_dim: int = 0
    num_kv_heads: int = 0
    attn_proj_params: int = 0  # one layer's attention matrix parameters (0: from heads; MLA sets it)
    shared_ffn_size: int = 0  # total shared-expert width (0: num_shared_experts * expert_ffn_size)
    v_head_dim: int = 0  # value head dim (0: head_dim)
    mtp_depth: int = 0  # multi-token-prediction modules: one block each (MoE when mtp_moe), a 2H x H projection
    mtp_moe: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.num_moe_layers <= self.num_layers:
            raise ValueError(f"num_moe_layers ({self.num_moe_layers}) must be in [0, num_layers={self.num_layers}]")
        self.head_dim = self.head_dim or self.hidden_size // self.num_heads
        self.num_kv_heads = self.num_kv_heads or self.num_heads
        self.v_head_dim = self.v_head_dim or self.head_dim

    @classmethod
    def from_model_config(cls, model: ModelConfig, seq_len: int) -> FlopDims:
        """The dimensions of ``model`` at sequence length ``seq_len``."""
        return cls(
            hidden_size=model.hidden_size,
            num_layers=model.num_layers,
            num_moe_layers=model.num_layers - model.first_k_dense,
            num_heads=model.num_heads,
            vocab_size=model.vocab_size,
            seq_len=seq_len,
            num_experts=model.moe.num_experts,
            top_k=model.moe.top_k,
            expert_ffn_size=model.moe.ffn_hidden_size,
            dense_ffn_size=model.ffn_hidden_size,
            num_shared_experts=model.moe.num_shared_experts,
            shared_ffn_size=model.moe.shared_width,
            head_dim=model.head_dim,
            num_kv_heads=model.kv_heads,
            attn_proj_params=attention_matrix_params(model) if model.attention == "mla" else 0,
            v_head_dim=model.v_head_dim if model.attention == "mla" else 0,
            mtp_depth=model.mtp_depth,
            mtp_moe=model.has_moe,  # the last layer's kind
        )


def attention_matrix_params(model: ModelConfig) -> int:
    """Matrix parameters of one layer's attention (= its projection MACs per token)."""
    H, N, D = model.hidden_size, model.num_heads, model.head_dim
    if model.attention != "mla":
        return H * D * (2 * N + 2 * model.kv_heads)
    q_rank, kv_rank, R = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
    q = H * q_rank + q_rank * N * D if q_rank else H * N * D
    kv = H * (kv_rank + R) + kv_rank * N * (model.qk_nope_head_dim + model.v_head_dim)
    return q + kv + N * model.v_head_dim * H


def forward_macs(d: FlopDims, num_sequences: int, routed_rows: int | None = None) -> dict[str, int]:
    """Forward multiply-accumulates of one step by component, formula (a) above. Integers, exact."""
    H, s, n = d.hidden_size, d.seq_len, num_sequences * d.seq_len
    # the multi-token-prediction blocks are layers too, of the last layer's kind
    blocks = d.num_layers + d.mtp_depth
    num_moe = d.num_moe_layers + (d.mtp_depth if d.mtp_moe else 0)
    num_dense = blocks - num_moe
    if routed_rows is None:  # dropless: every token reaches its k experts in every MoE layer
        routed_rows = n * num_moe * d.top_k
    return {
        "attn_proj": n * blocks * (d.attn_proj_params or H * d.head_dim * (2 * d.num_heads + 2 * d.num_kv_heads)),
        "attn_scores": blocks * num_sequences * d.num_heads * (d.head_dim + d.v_head_dim) * (s * (s + 1) // 2),
        "dense_ffn": n * num_dense * 3 * H * d.dense_ffn_size,
        "router": n * num_moe * H * d.num_experts,
        "shared_experts": n * num_moe * 3 * H * (d.shared_ffn_size or d.num_shared_experts * d.expert_ffn_size),
        "routed_experts": routed_rows * 3 * H * d.expert_ffn_size,
        "lm_head": n * (1 + d.mtp_depth) * d.vocab_size * H,
        "mtp_proj": n * d.mtp_depth * 2 * H * H,
    }


def train_flops(d: FlopDims, num_sequences: int, routed_rows: int | None = None) -> int:
    """Training FLOPs of one step (forward + backward), xmoe's formula (a)."""
    return 2 * 3 * sum(forward_macs(d, num_sequences, routed_rows).values())


def paper_train_flops(d: FlopDims, num_sequences: int) -> int:
    """Training FLOPs of one step under the paper's formula (b); divide by time * GPUs for TFLOP/s."""
    H, s, B = d.hidden_size, d.seq_len, num_sequences
    per_layer = B * s * (4 * H * H + 2 * d.head_dim * d.num_heads * s + 2 * d.expert_ffn_size * H * d.top_k)
    return 2 * 3 * (d.num_layers * per_layer + B * d.vocab_size * H * s)
