"""Hugging Face tensor names of each family (``tensor_names``) and the layout changes between them and xmoe's
(MLA's interleaved rotary rows, per-expert matrices).

# E experts, H hidden, F expert ffn, R rotary features
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from xmoe.config import ModelConfig
from xmoe.hf.families import SCORE_BIAS_FAMILIES


def _deinterleave(rope: int) -> torch.Tensor:
    """Row order that turns interleaved rotary pairs (2j, 2j+1) into half-split pairs (j, j + R/2)."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))


def mla_rope_rows(cfg: ModelConfig, name: str) -> torch.Tensor | None:
    """For an MLA projection whose output rows hold rotary features, the row permutation interleaved -> halves
    (None for other tensors). q: per head [nope | rope]; wkv_a: [latent | rope]."""
    perm_R = _deinterleave(cfg.qk_rope_head_dim)
    if name.endswith(("attn.wq.weight", "attn.wq_b.weight")):
        qk = cfg.head_dim
        rows = torch.arange(cfg.num_heads * qk).view(cfg.num_heads, qk)
        rows[:, cfg.qk_nope_head_dim :] = rows[:, cfg.qk_nope_head_dim :][:, perm_R]
        return rows.reshape(-1)
    if name.endswith("attn.wkv_a.weight"):
        rows = torch.arange(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        rows[cfg.kv_lora_rank :] = rows[cfg.kv_lora_rank :][perm_R]
        return rows
    return None


SHARED_COPY = "shared copy"  # tensor_names' third item for a checkpoint's copy of a tensor xmoe shares


def tensor_names(cfg: ModelConfig, family: str) -> Iterator[tuple[str, str, str | None]]:
    """(xmoe parameter name, Hugging Face name, expert weight) for every tensor of ``family``.

    Expert stacks appear once per expert: the HF name holds that expert's index and the third item names the
    xmoe stack's matrix ("w1", "w3", "w2"); HF stores each expert matrix transposed (out, in). Multi-token
    prediction (deepseek_v3): module d is layer ``num_hidden_layers + d`` with ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm`` and a block's tensors, plus copies of the embedding and the head (``embed_tokens``,
    ``shared_head.head``: third item SHARED_COPY), which xmoe shares with the main model: written on export, not
    read on import (as transformers' own MTP model takes the main model's)."""
    yield "embed.weight", "model.embed_tokens.weight", None
    yield "norm.weight", "model.norm.weight", None
    if not cfg.tie_embeddings:
        yield "head.weight", "lm_head.weight", None
    for i in range(cfg.num_layers):
        yield from _block_names(cfg, family, f"layers.{i}.", f"model.layers.{i}.", i >= cfg.first_k_dense)
    for d in range(cfg.mtp_depth):
        x, h = f"mtp.{d}.", f"model.layers.{cfg.num_layers + d}."
        for name in ("enorm", "hnorm", "eh_proj"):
            yield f"{x}{name}.weight", f"{h}{name}.weight", None
        yield x + "norm.weight", h + "shared_head.norm.weight", None
        yield from _block_names(cfg, family, x + "block.", h, cfg.has_moe)
        yield "embed.weight", h + "embed_tokens.weight", SHARED_COPY
        yield "embed.weight" if cfg.tie_embeddings else "head.weight", h + "shared_head.head.weight", SHARED_COPY


def _block_names(cfg: ModelConfig, family: str, x: str, h: str, is_moe: bool) -> Iterator[tuple[str, str, str | None]]:
    """tensor_names of one block: xmoe names under ``x``, Hugging Face names under ``h``."""
    mixtral = family == "mixtral"
    yield x + "attn_norm.weight", h + "input_layernorm.weight", None
    yield x + "ffn_norm.weight", h + "post_attention_layernorm.weight", None
    if cfg.attention == "mla":
        attn = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
        attn.update(
            {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"} if cfg.q_lora_rank else {"wq": "q_proj"}
        )
    else:
        attn = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
        if cfg.qk_norm != "none":
            attn.update(q_norm="q_norm", k_norm="k_norm")
    for ours, theirs in attn.items():
        yield f"{x}attn.{ours}.weight", f"{h}self_attn.{theirs}.weight", None
    if cfg.qkv_bias:
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
            yield f"{x}attn.{ours}.bias", f"{h}self_attn.{theirs}.bias", None
    ffn = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    if not is_moe:
        for ours, theirs in ffn.items():
            yield f"{x}ffn.{ours}.weight", f"{h}mlp.{theirs}.weight", None
        return
    moe = h + ("block_sparse_moe." if mixtral else "mlp.")
    yield x + "ffn.router.weight", moe + "gate.weight", None
    if family in SCORE_BIAS_FAMILIES:
        yield x + "ffn.router.expert_bias", moe + "gate.e_score_correction_bias", None
    for e in range(cfg.moe.num_experts):
        for ours, theirs in ffn.items():
            yield x + f"ffn.experts.{ours}", moe + f"experts.{e}." + (ours if mixtral else theirs) + ".weight", ours
    if cfg.moe.num_shared_experts:
        shared = "shared_expert" if family == "qwen2_moe" else "shared_experts"
        for ours, theirs in ffn.items():
            yield f"{x}ffn.shared_experts.{ours}.weight", f"{moe}{shared}.{theirs}.weight", None
    if cfg.moe.shared_expert_gate:
        yield x + "ffn.shared_gate.weight", moe + "shared_expert_gate.weight", None


def expert_index(hf_name: str) -> int:
    """The expert number in a per-expert HF tensor name (``...experts.{e}.<matrix>.weight``)."""
    return int(hf_name.split("experts.")[1].split(".")[0])
