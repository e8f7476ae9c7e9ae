"""Typed configuration of the model itself: the MoE block (``MoEConfig``) and the transformer around it
(``ModelConfig``), validated on construction by the checks in xmoe/checks.py. ``xmoe.config`` re-exports both
beside the configs of a run (training, parallelism, kernels, data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from xmoe.checks import check_types, positive

ScoreFunc = Literal["softmax", "sigmoid"]
KernelBackend = Literal["auto", "torch", "triton"]
Fp8Mode = Literal["off", "experts"]
DispatcherName = Literal["pft", "padded", "rbd"]
DispatchDtype = Literal["bf16", "fp8"]
BalanceScope = Literal["sequence", "micro_batch", "global"]
AttentionKind = Literal["mha", "mla"]
QKNorm = Literal["none", "head", "proj"]
RopeScaling = Literal["none", "yarn"]
BALANCE_SCOPES = ("sequence", "micro_batch", "global")
# aux_loss_type, balance_scope's older name, and its values
_OLD_SCOPES = {"seq": "sequence", "batch": "micro_batch"}


@dataclass
class MoEConfig:
    """One MoE block: router, routed experts (SwiGLU), optional shared experts.

    Routing (see docs/routing.md for the formulas):
      scores = softmax(logits) or sigmoid(logits), logits = x @ router.weight.T in fp32.
      Selection uses scores + expert_bias (the bias is the auxiliary-loss-free balancing state and only
      changes *which* experts are picked, never the weights). With num_expert_groups > 1 only experts in the
      best ``topk_groups`` groups are eligible. With ``max_nodes_per_token`` M > 0 under expert parallelism, only
      experts on the token's M best nodes are (xmoe/moe/node_limit.py).
      weights = selected scores, divided by their sum when norm_topk_prob, times routed_scaling_factor.

    Capacity: ``capacity_factor=None`` is dropless. Otherwise each expert keeps at most
    C = ceil(capacity_factor * T * top_k / num_experts) slots; when more are routed to it, it keeps the C with
    the highest routing score (ties: lower token index first) and drops the rest; a dropped slot contributes
    nothing to the output.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    score_func: ScoreFunc = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    num_expert_groups: int = 1
    topk_groups: int = 1
    aux_loss_coef: float = 0.0
    # what the balance loss balances over (docs/routing.md, "Scopes"): each sequence, each micro-batch of a rank, or
    # every micro-batch of the optimizer step on every rank
    balance_scope: BalanceScope = "global"
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    kernel_backend: KernelBackend = "auto"
    dispatcher: DispatcherName = "pft"
    # how dispatched rows travel between expert-parallel ranks: "bf16" (the activations as they are) or "fp8" (e4m3
    # with 1 x 128 scales, quantised before the all-to-all; the combine and every gradient stay in the activations'
    # dtype); xmoe/dispatch/fp8_dispatch.py
    dispatch_dtype: DispatchDtype = "bf16"
    # node-limited routing: each token's experts on at most this many nodes of its expert-parallel group as placed
    # (docs/routing.md, "Node-limited routing"); 0: no limit. Applies under expert parallelism only
    max_nodes_per_token: int = 0
    init_std: float = 0.02
    shared_ffn_hidden_size: int = 0  # shared experts' total width (0: num_shared_experts * ffn_hidden_size)
    shared_expert_gate: bool = False  # scale the shared experts' output by sigmoid(x @ w_gate) (Qwen2-MoE)
    # "experts": the routed experts' GEMMs in FP8 (fine-grained scales, fp32 accumulation; weight gradients bf16)
    # on GPUs with FP8 matrix instructions (NVIDIA sm_89+, AMD gfx942 / gfx950); docs/kernels.md, "FP8 experts"
    fp8: Fp8Mode = "off"
    section: ClassVar[str] = "moe"
    # fields of older versions: their new name (what a config that still names them is told)
    renamed: ClassVar[dict[str, str]] = {"aux_loss_type": "balance_scope"}

    def __post_init__(self) -> None:
        check_types(self)
        self._check_sizes()
        self._check_choices()
        self._check_groups()
        self._check_coefficients()

    def _check_sizes(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            positive(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts}); lower top_k or add experts"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts ({self.num_shared_experts}) must be >= 0")

    def _check_choices(self) -> None:
        """Each named choice, then the combinations that have no path."""
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func ({self.score_func!r}) must be 'softmax' or 'sigmoid'")
        if self.balance_scope not in BALANCE_SCOPES:
            raise ValueError(
                f"balance_scope ({self.balance_scope!r}) must be one of {', '.join(map(repr, BALANCE_SCOPES))}"
            )
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend ({self.kernel_backend!r}) must be 'auto', 'torch' or 'triton'")
        if self.dispatcher not in ("pft", "padded", "rbd"):
            raise ValueError(f"dispatcher ({self.dispatcher!r}) must be 'pft', 'padded' or 'rbd'")
        if self.fp8 not in ("off", "experts"):
            raise ValueError(f"fp8 ({self.fp8!r}) must be 'off' or 'experts'")
        if self.dispatch_dtype not in ("bf16", "fp8"):
            raise ValueError(f"dispatch_dtype ({self.dispatch_dtype!r}) must be 'bf16' or 'fp8'")
        if self.dispatch_dtype == "fp8" and self.dispatcher == "padded":
            raise ValueError(
                "dispatch_dtype='fp8' quantises the padding-free rows; the padded baseline moves its capacity buffers "
                "as they are: use dispatcher 'pft' or 'rbd', or dispatch_dtype='bf16'"
            )
        if self.fp8 == "experts" and self.kernel_backend == "torch":
            raise ValueError(
                "fp8='experts' runs xmoe's Triton FP8 kernels, which kernel_backend='torch' does not "
                "use: set kernel_backend to 'auto' or 'triton', or fp8='off'"
            )
        if self.fp8 == "experts" and self.dispatcher == "padded":
            raise ValueError(
                "fp8='experts' has no FP8 path for the padded baseline's capacity buffers: use "
                "dispatcher 'pft' or 'rbd', or fp8='off'"
            )
        if self.max_nodes_per_token < 0:
            raise ValueError(f"max_nodes_per_token ({self.max_nodes_per_token}) must be >= 0 (0: no node limit)")

    def _check_groups(self) -> None:
        """Group-limited routing: groups divide the experts and leave top_k experts eligible."""
        positive("num_expert_groups", self.num_expert_groups)
        if self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by num_expert_groups ({self.num_expert_groups})"
            )
        if not 1 <= self.topk_groups <= self.num_expert_groups:
            raise ValueError(
                f"topk_groups ({self.topk_groups}) must be in [1, num_expert_groups={self.num_expert_groups}]"
            )
        eligible = self.topk_groups * (self.num_experts // self.num_expert_groups)
        if self.top_k > eligible:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the {eligible} experts eligible under group-limited routing "
                f"(topk_groups={self.topk_groups} groups of {self.num_experts // self.num_expert_groups}); "
                "raise topk_groups or lower top_k"
            )

    def _check_coefficients(self) -> None:
        """Loss weights, scales and the capacity factor finite and in range; the shared experts' options need them."""
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} ({value}) must be a finite number >= 0")
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            raise ValueError(f"routed_scaling_factor ({self.routed_scaling_factor}) must be finite and > 0")
        if self.capacity_factor is not None and not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise ValueError(f"capacity_factor ({self.capacity_factor}) must be > 0, or None for dropless routing")
        positive("init_std", self.init_std)
        if self.shared_ffn_hidden_size < 0:
            raise ValueError(
                f"shared_ffn_hidden_size ({self.shared_ffn_hidden_size}) must be >= 0 (0: "
                "num_shared_experts * ffn_hidden_size)"
            )
        if (self.shared_ffn_hidden_size or self.shared_expert_gate) and not self.num_shared_experts:
            raise ValueError("shared_ffn_hidden_size and shared_expert_gate need num_shared_experts >= 1")

    @property
    def shared_width(self) -> int:
        """Total hidden width of the shared experts (one dense SwiGLU); 0 without shared experts."""
        return self.shared_ffn_hidden_size or self.num_shared_experts * self.ffn_hidden_size

    def capacity(self, num_tokens: int) -> int:
        """Slots each expert keeps for ``num_tokens`` tokens (all of them when dropless)."""
        if self.capacity_factor is None:
            return num_tokens
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))


@dataclass
class ModelConfig:
    """A decoder-only transformer whose FFNs after the first ``first_k_dense`` layers are MoE blocks.

    Attention (xmoe/model/attention.py), ``attention``:
      "mha"  multi-head attention with ``num_kv_heads`` key/value heads (grouped-query when fewer than
             ``num_heads``; 0 = num_heads) of width ``attn_head_dim`` (0 = hidden_size / num_heads). ``qk_norm``:
             "head" RMS-normalises each head of q and k (Qwen3), "proj" the whole q and k projections (OLMoE).
      "mla"  multi-head latent attention (DeepSeek-V2/V3): q through a rank-``q_lora_rank`` bottleneck (0: one
             projection), keys and values from a rank-``kv_lora_rank`` latent, each head's query/key made of
             ``qk_nope_head_dim`` features without positions and ``qk_rope_head_dim`` rotary features (the rotary
             key shared by all heads), values ``v_head_dim`` wide. The latents are RMS-normalised with
             ``latent_norm_eps``.

    Multi-token prediction (DeepSeek-V3; xmoe/model/mtp.py): ``mtp_depth`` D sequential modules after the model,
    module d predicting the token d + 1 positions ahead, each one block of the model's last layer's kind, sharing
    the embedding and the output head; their mean loss enters training with weight ``mtp_loss_weight``. 0: none.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    moe: MoEConfig
    ffn_hidden_size: int = 0  # dense FFN width for the first_k_dense layers (0: 4 * hidden, rounded)
    first_k_dense: int = 0
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: AttentionKind = "mha"
    num_kv_heads: int = 0
    attn_head_dim: int = 0
    qk_norm: QKNorm = "none"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    latent_norm_eps: float = 1e-6
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2-MoE); attention="mha" only
    # YaRN context extension (rope_scaling="yarn"; formulas in xmoe/model/layers.py, yarn_inv_freq)
    rope_scaling: RopeScaling = "none"
    rope_factor: float = 1.0
    rope_original_max_len: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.1
    section: ClassVar[str] = "model"

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_seq_len"):
            positive(name, getattr(self, name))
        # norm_eps <= 0 divides by zero in RMSNorm on an all-zero row (and a negative one takes a NaN sqrt)
        for name in ("norm_eps", "rope_theta", "init_std"):
            positive(name, getattr(self, name))
        if self.attention == "mla":
            self._check_mla()
        elif self.attention == "mha":
            self._check_mha()
        else:
            raise ValueError(f"attention ({self.attention!r}) must be 'mha' or 'mla'")
        if self.rope_scaling not in ("none", "yarn"):
            raise ValueError(f"rope_scaling ({self.rope_scaling!r}) must be 'none' or 'yarn'")
        if self.rope_scaling == "yarn":
            positive("rope_factor", self.rope_factor)
            positive("rope_original_max_len", self.rope_original_max_len)
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"first_k_dense ({self.first_k_dense}) must be in [0, num_layers={self.num_layers}]")
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"moe.hidden_size ({self.moe.hidden_size}) must equal hidden_size ({self.hidden_size})")
        if self.ffn_hidden_size == 0:
            self.ffn_hidden_size = 256 * math.ceil(8 * self.hidden_size / 3 / 256)
        positive("ffn_hidden_size", self.ffn_hidden_size)
        if self.mtp_depth < 0:
            raise ValueError(f"mtp_depth ({self.mtp_depth}) must be >= 0 (0: no multi-token prediction)")
        if not (self.mtp_loss_weight >= 0 and math.isfinite(self.mtp_loss_weight)):
            raise ValueError(f"mtp_loss_weight ({self.mtp_loss_weight}) must be a finite number >= 0")

    def _check_mha(self) -> None:
        for name in ("num_kv_heads", "attn_head_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0 (0: the default)")
        if self.attn_head_dim == 0 and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}), "
                "or set attn_head_dim"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.kv_heads > self.num_heads or self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads}): each key/value "
                "head serves an equal group of query heads"
            )
        if self.qk_norm not in ("none", "head", "proj"):
            raise ValueError(f"qk_norm ({self.qk_norm!r}) must be 'none', 'head' (Qwen3) or 'proj' (OLMoE)")
        mla_only = [
            n
            for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            if getattr(self, n)
        ]
        if self.qkv_bias and self.qk_norm != "none":
            raise ValueError("qkv_bias with qk_norm is not a known architecture; use one of them")
        if mla_only:
            raise ValueError(
                f"{', '.join(mla_only)} only apply with attention='mla'; set attention='mla' or leave them 0"
            )

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            positive(name, getattr(self, name))
        for name in ("q_lora_rank", "qk_nope_head_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for rotary embeddings")
        if self.num_kv_heads or self.attn_head_dim or self.qk_norm != "none" or self.qkv_bias:
            raise ValueError(
                "num_kv_heads, attn_head_dim, qk_norm and qkv_bias do not apply to attention='mla' (its widths are "
                "qk_nope_head_dim, qk_rope_head_dim and v_head_dim); leave them at 0 / 'none'"
            )
        positive("latent_norm_eps", self.latent_norm_eps)

    @property
    def head_dim(self) -> int:
        """Width of one query/key head (nope + rope features under MLA)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.attn_head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_kv_heads, or num_heads when 0; MLA expands its latent to every head)."""
        if self.attention == "mla":
            return self.num_heads
        return self.num_kv_heads or self.num_heads

    @property
    def softmax_scale(self) -> float | None:
        """Attention's softmax scale when it is not 1/sqrt(head_dim): YaRN with mscale_all_dim under MLA multiplies
        it by yarn_mscale(factor, mscale_all_dim)^2 (DeepSeek-V2/V3)."""
        if self.rope_scaling == "yarn" and self.attention == "mla" and self.rope_mscale_all_dim:
            return self.head_dim**-0.5 * yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
        return None

    @property
    def has_moe(self) -> bool:
        """Whether the model has MoE blocks: the layers from ``first_k_dense`` on, so its last layer, and then the
        multi-token-prediction blocks, which take the last layer's kind; False for an all-dense model."""
        return self.num_layers > self.first_k_dense

    @property
    def rope_dim(self) -> int:
        """Features of a head that the rotary embedding turns."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def upgrade_moe_fields(values: dict) -> dict:
    """An MoEConfig's asdict() form as older versions stored it (a checkpoint's meta.json), in today's fields:
    ``aux_loss_type`` "batch" / "seq" is ``balance_scope`` "micro_batch" / "sequence"."""
    if "aux_loss_type" not in values:
        return values
    out = {k: v for k, v in values.items() if k != "aux_loss_type"}
    out.setdefault("balance_scope", _OLD_SCOPES.get(values["aux_loss_type"], values["aux_loss_type"]))
    return out
