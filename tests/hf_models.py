"""Tiny randomly initialised transformers models, one per family, saved as Hugging Face directories.

Nothing is downloaded: the configs come from transformers' own config classes. Weights are redrawn larger than
transformers' init (std 0.02 makes every logit nearly equal) and the norms and the score-correction bias are made
non-trivial, so a misplaced tensor, a wrong rotary layout or a wrong routing rule shows in the logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 61, 32
FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2", "qwen2_moe")


def hf_config(family: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            num_key_value_heads=2,
            head_dim=12,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            intermediate_size=40,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            **common,
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=24,
            rope_theta=1000.0,
            **common,
        )
    if family == "olmoe":
        return transformers.OlmoeConfig(
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=3,
            intermediate_size=16,
            norm_topk_prob=False,
            **common,
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            intermediate_size=40,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=20,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=6,
            v_head_dim=10,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            **common,
        )
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            intermediate_size=40,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=6,
            v_head_dim=10,
            routed_scaling_factor=1.5,
            **common,
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=28,
            intermediate_size=40,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            qkv_bias=True,
            **common,
        )
    raise ValueError(family)


def build_reference(family: str, seed: int = 0):
    """A transformers model in eval mode, float32, with weights that make every tensor matter."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15 if p.ndim > 1 else 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    return model


def saved_reference(family: str, directory: Path, seed: int = 0):
    model = build_reference(family, seed)
    model.save_pretrained(directory)
    return model


def load_reference(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
