"""How one rank runs a training step, as the memory models read it: ``RankRun``, built and checked once by
``memory.estimate_memory`` and handed whole to FSDP2's backward walk (``fsdp_memory.py``) and a replica's
(``trainer_memory.py``), with the activations one layer saves under it. Letters and conventions: ``memory.py``'s
docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from xmoe.config import RECOMPUTE_MODES, ModelConfig, ParallelConfig
from xmoe.dispatch.base import experts_per_rank
from xmoe.model.counting import block_kinds
from xmoe.plan.terms import (
    _LayerActivations,
    activation_bytes,
    attention_activations,
    dense_ffn_activations,
    moe_activations,
)


@dataclass(frozen=True)
class RankRun:
    """One rank's training step: the model, the layout, the micro-batch, and the choices that decide what it holds.
    Construction refuses what a user can get wrong, naming the value."""

    cfg: ModelConfig
    parallel: ParallelConfig
    micro_batch: int  # sequences per rank per micro-batch
    seq_len: int
    recompute: str  # one of RECOMPUTE_MODES
    precision: str  # "bf16" (a GPU run) or "fp32" (a CPU run): terms.PRECISIONS
    kernel: str  # the expert kernels' saved tensors: "triton" (2 F-wide per row) or "torch" (4)
    ssmb: bool  # SSMB asked for: the MoE block on T / tp tokens (it acts only with tp > 1)
    padded: bool  # the GShard capacity buffers instead of PFT's rows
    capacity_factor: float | None  # None: the model's own (dropless when that is None too)
    imbalance: float  # max / mean routed rows per rank
    accumulation: int  # micro-batches per optimizer step

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute ({self.recompute!r}) must be one of {RECOMPUTE_MODES}")
        if self.imbalance < 1.0:
            raise ValueError(f"imbalance ({self.imbalance}) is max/mean rows per rank and must be >= 1")
        activation_bytes(self.precision)  # an unknown precision refused before the layout's checks
        self._check_layout()

    def _check_layout(self) -> None:
        """The layout's checks a user can fail."""
        cfg, par, micro_batch, seq_len = self.cfg, self.parallel, self.micro_batch, self.seq_len
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
        if self.ssmb and par.tp > 1 and (micro_batch * seq_len) % par.tp:
            raise ValueError(
                f"SSMB splits micro_batch*seq ({micro_batch * seq_len}) tokens over tp ({par.tp}); "
                "make it divisible or pass --no-ssmb"
            )

    @property
    def tokens(self) -> int:
        """T: tokens per rank per micro-batch."""
        return self.micro_batch * self.seq_len

    @property
    def moe_tokens(self) -> int:
        """Tokens this rank's MoE blocks process: T / tp under SSMB."""
        tp = self.parallel.tp
        return self.tokens // tp if self.ssmb and tp > 1 else self.tokens

    @property
    def b(self) -> int:
        """Bytes per activation element."""
        return activation_bytes(self.precision)

    @cached_property
    def acts(self) -> _LayerActivations:
        """One layer's saved activations by sub-block (attention, MoE, dense FFN) and the rows a rank computes."""
        cfg, tp, ep, b = self.cfg, self.parallel.tp, self.parallel.ep, self.b
        T, T_moe, autocast = self.tokens, self.moe_tokens, self.precision == "bf16"
        kinds = block_kinds(cfg)
        n_moe = sum(kinds)
        n_dense = len(kinds) - n_moe
        attn = attention_activations(T, cfg.hidden_size, cfg.num_heads, tp, b, autocast)
        moe_act = (
            moe_activations(
                cfg.moe,
                T_moe,
                ep=ep,
                padded=self.padded,
                capacity_factor=self.capacity_factor,
                imbalance=self.imbalance,
                kernel=self.kernel,
                b=b,
                router_fp32=True,
            )
            if n_moe
            else {}
        )
        dense_act = dense_ffn_activations(T, cfg.hidden_size, cfg.ffn_hidden_size, tp, b, autocast) if n_dense else {}
        rows = moe_act.get("dispatch_buffer", 0.0) / b / cfg.hidden_size  # rows a rank computes (E*C padded)
        if moe_act and ep == 1 and self.kernel == "triton" and not self.padded:
            # one EP rank: the local dispatcher lets the Triton experts fuse gather, SwiGLU and combine, keeping the
            # tokens they read and no dispatch or combine buffer (as block_activations' fused path)
            moe_act.update(dispatch_buffer=b * T_moe * cfg.hidden_size, combine_buffer=0.0)
        return _LayerActivations(attn, moe_act, dense_act, rows, T)
