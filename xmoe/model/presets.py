"""Named model configurations: ``tiny`` for CPU runs, and the four models of the X-MoE paper's table.

Paper presets (Small, Medium, Large, Super): every layer MoE, no shared experts, as in the paper's runs.
Their vocabulary is GPT-2's 50257 padded to a multiple of 128 (50304), as Megatron-DeepSpeed pads it; the
paper's parameter counts exclude the embedding and head (see xmoe/model/counting.py), so the vocabulary only
moves FLOPs and memory. xmoe builds SwiGLU experts where the paper used GELU, so an xmoe "small" has 1.5x the
paper's expert parameters; ``counting.count_params(cfg, expert_matrices=2)`` gives the paper's convention.
Routing is dropless softmax top-k with a 0.01 load-balancing loss; set ``moe.capacity_factor`` (e.g. 1.25)
to reproduce the paper's token dropping.
"""

from __future__ import annotations

from collections.abc import Callable

from xmoe.config import ModelConfig, MoEConfig

PAPER_VOCAB_SIZE = 50304  # GPT-2 BPE (50257) padded to a multiple of 128


def tiny() -> ModelConfig:
    """About 1.9M parameters (1.0M active): byte-level, trains in minutes on 2 CPU cores.

    DeepSeek-MoE shape in miniature: first layer dense, then 16 fine-grained experts, top-4, 2 shared.
    """
    hidden = 128
    return ModelConfig(
        vocab_size=256,
        hidden_size=hidden,
        num_layers=4,
        num_heads=4,
        first_k_dense=1,
        max_seq_len=256,
        moe=MoEConfig(
            hidden_size=hidden,
            ffn_hidden_size=64,
            num_experts=16,
            top_k=4,
            num_shared_experts=2,
            aux_loss_coef=0.01,
        ),
    )


def _paper(seq: int, hidden: int, expert_ffn: int, heads: int, experts: int, top_k: int, layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=PAPER_VOCAB_SIZE,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        first_k_dense=0,
        max_seq_len=seq,
        moe=MoEConfig(
            hidden_size=hidden,
            ffn_hidden_size=expert_ffn,
            num_experts=experts,
            top_k=top_k,
            aux_loss_coef=0.01,
        ),
    )


def small() -> ModelConfig:
    """Paper Small: 10.1B / 1.3B (paper convention)."""
    return _paper(seq=2048, hidden=2048, expert_ffn=1408, heads=16, experts=64, top_k=6, layers=28)


def medium() -> ModelConfig:
    """Paper Medium: 55.2B / 5.2B (paper convention)."""
    return _paper(seq=4096, hidden=5120, expert_ffn=1536, heads=128, experts=128, top_k=6, layers=28)


def large() -> ModelConfig:
    """Paper Large: 201.4B / 11.5B (paper convention)."""
    return _paper(seq=4096, hidden=7168, expert_ffn=2048, heads=128, experts=256, top_k=8, layers=28)


def super_() -> ModelConfig:
    """Paper Super: 545.4B / 28.7B (paper convention). Named ``super`` in PRESETS."""
    return _paper(seq=4096, hidden=7168, expert_ffn=2560, heads=128, experts=256, top_k=8, layers=61)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "small": small,
    "medium": medium,
    "large": large,
    "super": super_,
}


def get_preset(name: str) -> ModelConfig:
    """A fresh ModelConfig for preset ``name`` (case-insensitive)."""
    try:
        return PRESETS[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None
