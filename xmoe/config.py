"""Typed configuration for every xmoe component.

One dataclass per component, validated on construction (the checks in xmoe/checks.py): a value a user can get
wrong raises ``ValueError`` naming the value and the fix. Presets are plain functions returning configs.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, get_args

from xmoe.checks import check_types, positive
from xmoe.checks import missing as missing  # re-exported: the commands import it from here

ScoreFunc = Literal["softmax", "sigmoid"]
KernelBackend = Literal["auto", "torch", "triton"]
Fp8Mode = Literal["off", "experts"]
DispatcherName = Literal["pft", "padded", "rbd"]
AuxLossType = Literal["batch", "seq"]
AttentionKind = Literal["mha", "mla"]
QKNorm = Literal["none", "head", "proj"]
RopeScaling = Literal["none", "yarn"]
WgradEngine = Literal["auto", "triton", "grouped_mm"]
RECOMPUTE_MODES = ("none", "moe", "full")  # cheapest first: the planner's search prefers them in this order
COMPILE_MODES = ("auto", "on", "off")


@dataclass
class MoEConfig:
    """One MoE block: router, routed experts (SwiGLU), optional shared experts.

    Routing (see docs/routing.md for the formulas):
      scores = softmax(logits) or sigmoid(logits), logits = x @ router.weight.T in fp32.
      Selection uses scores + expert_bias (the bias is the auxiliary-loss-free balancing state and only
      changes *which* experts are picked, never the weights). With num_expert_groups > 1 only experts in the
      best ``topk_groups`` groups are eligible.
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
    aux_loss_type: AuxLossType = "batch"
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: Optional[float] = None
    kernel_backend: KernelBackend = "auto"
    dispatcher: DispatcherName = "pft"
    init_std: float = 0.02
    shared_ffn_hidden_size: int = 0  # shared experts' total width (0: num_shared_experts * ffn_hidden_size)
    shared_expert_gate: bool = False  # scale the shared experts' output by sigmoid(x @ w_gate) (Qwen2-MoE)
    # "experts": the routed experts' GEMMs in FP8 (fine-grained scales, fp32 accumulation; weight gradients bf16)
    # on GPUs with FP8 matrix instructions (NVIDIA sm_89+, AMD gfx942 / gfx950); docs/kernels.md, "FP8 experts"
    fp8: Fp8Mode = "off"
    section: ClassVar[str] = "moe"

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            positive(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts}); lower top_k or add experts"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts ({self.num_shared_experts}) must be >= 0")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func ({self.score_func!r}) must be 'softmax' or 'sigmoid'")
        if self.aux_loss_type not in ("batch", "seq"):
            raise ValueError(f"aux_loss_type ({self.aux_loss_type!r}) must be 'batch' or 'seq'")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend ({self.kernel_backend!r}) must be 'auto', 'torch' or 'triton'")
        if self.dispatcher not in ("pft", "padded", "rbd"):
            raise ValueError(f"dispatcher ({self.dispatcher!r}) must be 'pft', 'padded' or 'rbd'")
        if self.fp8 not in ("off", "experts"):
            raise ValueError(f"fp8 ({self.fp8!r}) must be 'off' or 'experts'")
        if self.fp8 == "experts" and self.kernel_backend == "torch":
            raise ValueError("fp8='experts' runs xmoe's Triton FP8 kernels, which kernel_backend='torch' does not "
                             "use: set kernel_backend to 'auto' or 'triton', or fp8='off'")
        if self.fp8 == "experts" and self.dispatcher == "padded":
            raise ValueError("fp8='experts' has no FP8 path for the padded baseline's capacity buffers: use "
                             "dispatcher 'pft' or 'rbd', or fp8='off'")
        positive("num_expert_groups", self.num_expert_groups)
        if self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by num_expert_groups "
                f"({self.num_expert_groups})"
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
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} ({value}) must be a finite number >= 0")
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            raise ValueError(f"routed_scaling_factor ({self.routed_scaling_factor}) must be finite and > 0")
        if self.capacity_factor is not None and not (
            self.capacity_factor > 0 and math.isfinite(self.capacity_factor)
        ):
            raise ValueError(
                f"capacity_factor ({self.capacity_factor}) must be > 0, or None for dropless routing"
            )
        positive("init_std", self.init_std)
        if self.shared_ffn_hidden_size < 0:
            raise ValueError(f"shared_ffn_hidden_size ({self.shared_ffn_hidden_size}) must be >= 0 (0: "
                             "num_shared_experts * ffn_hidden_size)")
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
class ParallelConfig:
    """Parallel degrees. world = dp * ep * tp; see xmoe/parallel/dims.py for how the mesh is laid out.

    ``placement``: "ep_first" packs an EP group into consecutive ranks (inside a node when it fits);
    "dp_first" strides it across nodes. ``gpus_per_node`` = None reads LOCAL_WORLD_SIZE from the launcher.
    """

    dp: int = 1
    ep: int = 1
    tp: int = 1
    gpus_per_node: Optional[int] = None
    placement: Literal["ep_first", "dp_first"] = "ep_first"
    sequence_parallel: bool = False  # with tp > 1: norms on 1/tp of the positions (Megatron-style SP)
    section: ClassVar[str] = "parallel"

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("dp", "ep", "tp"):
            positive(name, getattr(self, name))
        if self.gpus_per_node is not None:
            positive("gpus_per_node", self.gpus_per_node)
        if self.placement not in ("ep_first", "dp_first"):
            raise ValueError(f"placement ({self.placement!r}) must be 'ep_first' or 'dp_first'")
        if self.sequence_parallel and self.tp == 1:
            warnings.warn("sequence_parallel does nothing with tp == 1", stacklevel=2)

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.tp


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
            raise ValueError(
                f"moe.hidden_size ({self.moe.hidden_size}) must equal hidden_size ({self.hidden_size})"
            )
        if self.ffn_hidden_size == 0:
            self.ffn_hidden_size = 256 * math.ceil(8 * self.hidden_size / 3 / 256)
        positive("ffn_hidden_size", self.ffn_hidden_size)

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
        mla_only = [n for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                    if getattr(self, n)]
        if self.qkv_bias and self.qk_norm != "none":
            raise ValueError("qkv_bias with qk_norm is not a known architecture; use one of them")
        if mla_only:
            raise ValueError(f"{', '.join(mla_only)} only apply with attention='mla'; set attention='mla' or leave "
                             "them 0")

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
    def softmax_scale(self) -> Optional[float]:
        """Attention's softmax scale when it is not 1/sqrt(head_dim): YaRN with mscale_all_dim under MLA multiplies
        it by yarn_mscale(factor, mscale_all_dim)^2 (DeepSeek-V2/V3)."""
        if self.rope_scaling == "yarn" and self.attention == "mla" and self.rope_mscale_all_dim:
            return self.head_dim ** -0.5 * yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
        return None

    @property
    def rope_dim(self) -> int:
        """Features of a head that the rotary embedding turns."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class TrainConfig:
    """Optimisation and run settings for ``xmoe train``."""

    steps: int = 300
    global_batch_size: int = 16  # sequences per optimizer step, summed over data-parallel ranks
    micro_batch_size: int = 0  # sequences per forward pass per rank (0: global / dp, no accumulation)
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 100  # 0: no checkpoints (benchmark runs)
    keep_last: int = 2
    tensorboard: bool = False
    eval_every: int = 0  # validation loss every N steps (0: at the end only), when there is validation data
    val_fraction: float = 0.0  # hold out this fraction of the data for validation (0: none, unless --val-data)
    val_windows: int = 64  # validation windows of seq_len tokens evaluated each time (0: all)
    compile: str = "auto"  # torch.compile regions: "auto" (GPU without EP/TP), "on", "off"
    recompute: str = "none"  # activation recompute: "none", "moe" (MoE FFN branches), "full" (whole blocks)
    # a step whose loss or gradient norm is not finite: 0 stops the run at once (the check rides on the logging
    # and checkpoint steps' existing host syncs); N > 0 skips up to N such steps in a row without updating the
    # weights (this needs one host sync per step) and stops at the (N+1)-th
    nonfinite_skips: int = 0
    section: ClassVar[str] = "train"

    def __post_init__(self) -> None:
        check_types(self)
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"train.compile ({self.compile!r}) must be 'auto', 'on' or 'off'")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"train.recompute ({self.recompute!r}) must be 'none', 'moe' or 'full'")
        for name in ("steps", "global_batch_size", "seq_len", "lr", "log_every", "keep_last"):
            positive(name, getattr(self, name))
        if not 0 <= self.seed < 2**63:  # torch.manual_seed takes a 64-bit signed integer
            raise ValueError(f"seed ({self.seed}) must be in [0, 2**63)")
        if self.nonfinite_skips < 0:
            raise ValueError(f"nonfinite_skips ({self.nonfinite_skips}) must be >= 0 (0: stop at the first)")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be in [0, 1)")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay ({self.weight_decay}) must be a finite number >= 0")
        if self.ckpt_every < 0:
            raise ValueError(f"ckpt_every ({self.ckpt_every}) must be >= 0 (0 disables checkpoints)")
        if self.micro_batch_size < 0:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must be >= 0 (0: no accumulation)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be >= 0")
        if self.eval_every < 0 or self.val_windows < 0:
            raise ValueError(f"eval_every ({self.eval_every}) and val_windows ({self.val_windows}) must be >= 0")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction ({self.val_fraction}) must be in [0, 1) (0: no held-out data)")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ValueError(f"grad_clip ({self.grad_clip}) must be finite and >= 0 (0 disables clipping)")


def _from_env(name: str, field_name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment's default of ``kernels.<field_name>``, checked when a KernelConfig is made."""
    value = os.environ.get(name) or default
    if value not in choices:
        raise ValueError(f"{name} ({value!r}) must be one of {', '.join(choices)} (it sets the default of "
                         f"kernels.{field_name}); set one of them or unset it")
    return value


@dataclass
class KernelConfig:
    """How the Triton kernels compute (docs/kernels.md, "Kernel choices"): speed, memory and rounding, never the
    model. Defaults come from the environment (XMOE_WGRAD, XMOE_AUTOTUNE=1), read when the config is made; the
    trainer applies its run's choice to the kernels (``xmoe.kernels.choice``) and records what it resolved to.

    ``wgrad``: what computes the fused backward's weight gradients: "auto" (torch._grouped_mm over gathered rows on
    sm_90 in bf16 with at least 128 experts per rank averaging at most 1024 rows, the Triton kernels elsewhere),
    "triton", or "grouped_mm" (wherever torch._grouped_mm runs: bf16, H and F multiples of 8).
    ``autotune``: on a GPU, time every tile candidate of a shape class at its first launch and keep the fastest
    (cached in $XMOE_CACHE_DIR, default ~/.cache/xmoe) instead of the shipped table or the heuristic."""

    wgrad: WgradEngine = field(
        default_factory=lambda: _from_env("XMOE_WGRAD", "wgrad", get_args(WgradEngine), "auto"))
    autotune: bool = field(default_factory=lambda: _from_env("XMOE_AUTOTUNE", "autotune", ("0", "1"), "0") == "1")
    section: ClassVar[str] = "kernels"

    def __post_init__(self) -> None:
        check_types(self)


@dataclass
class DataConfig:
    """What a run trains on: ``path``, "markov[:opt=value,...]" (the synthetic source) or a .npy / .bin / .txt file;
    ``val_path``, validation data of the same kinds (None: train.val_fraction of ``path``, or none); ``tokenizer``,
    for .txt files: "bytes" or a tokenizers JSON file."""

    path: str = "markov"
    val_path: Optional[str] = None
    tokenizer: str = "bytes"
    section: ClassVar[str] = "data"

    def __post_init__(self) -> None:
        check_types(self)
        for name, fix in (("path", "'markov' or a .npy / .bin / .txt file"), ("val_path", "a file, 'markov' or null"),
                          ("tokenizer", "'bytes' or a tokenizers JSON file")):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"data.{name} ({value!r}) is empty; name {fix}")


@dataclass
class RunConfig:
    """Everything one ``xmoe train`` run needs (a TOML file's worth: docs/example_run.toml): the model, how it is
    trained and laid out, its data, and where the model starts. ``init_from``: a Hugging Face directory whose
    weights replace the seeded initialisation (``model`` is then its architecture); ``preset``: the name of the
    preset ``model`` was made from, which labels the run's header and plot ("" for none)."""

    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    init_from: Optional[str] = None
    preset: str = ""
    section: ClassVar[str] = ""  # its own fields are top-level keys of a config file

    def __post_init__(self) -> None:
        check_types(self)

    def batch_layout(self) -> tuple[int, int, int]:
        """(sequences per data-parallel rank per step, per micro-batch, micro-batches per step). Data is sharded over
        dp x ep ranks (TP peers read the same tokens); raises ValueError when the batch does not split evenly."""
        t, ranks = self.train, self.parallel.dp * self.parallel.ep
        if t.global_batch_size % ranks:
            raise ValueError(
                f"global batch ({t.global_batch_size}) must be divisible by the {ranks} data-parallel "
                "ranks; change --batch-size"
            )
        local = t.global_batch_size // ranks
        micro = t.micro_batch_size or local
        if local % micro:
            raise ValueError(f"per-rank batch ({local}) must be divisible by micro_batch_size ({micro})")
        if t.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len ({t.seq_len}) exceeds the model's max_seq_len ({self.model.max_seq_len})")
        return local, micro, local // micro
