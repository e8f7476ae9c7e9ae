"""Presets and counting: the paper's table, FLOPs against torch's flop counter, describe(), bad arguments."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from xmoe.model.counting import (
    count_params,
    describe,
    flops_per_token,
    paper_flops_per_token,
    paper_params,
)
from xmoe.model.presets import PRESETS, get_preset
from xmoe.model.transformer import Transformer

# name: (seq, hidden, expert ffn, heads, experts, top-k, layers, params (B), active (B)), from the paper.
PAPER_TABLE = {
    "small": (2048, 2048, 1408, 16, 64, 6, 28, 10.1, 1.3),
    "medium": (4096, 5120, 1536, 128, 128, 6, 28, 55.2, 5.2),
    "large": (4096, 7168, 2048, 128, 256, 8, 28, 201.4, 11.5),
    "super": (4096, 7168, 2560, 128, 256, 8, 61, 545.4, 28.7),
}


@pytest.mark.parametrize("name", PAPER_TABLE)
def test_paper_preset_shapes(name: str) -> None:
    seq, hidden, ffn, heads, experts, top_k, layers, _, _ = PAPER_TABLE[name]
    cfg = get_preset(name)
    got = (
        cfg.max_seq_len,
        cfg.hidden_size,
        cfg.moe.ffn_hidden_size,
        cfg.num_heads,
        cfg.moe.num_experts,
        cfg.moe.top_k,
        cfg.num_layers,
    )
    assert got == (seq, hidden, ffn, heads, experts, top_k, layers)
    assert cfg.first_k_dense == 0 and cfg.moe.num_shared_experts == 0


@pytest.mark.parametrize("name", PAPER_TABLE)
def test_paper_preset_counts_match_the_paper(name: str) -> None:
    *_, want_total, want_active = PAPER_TABLE[name]
    total, active = paper_params(get_preset(name))
    # The brief's bound is 10%. Beyond it, the convention reproduces the paper's printed digit (+-0.05B) for
    # 7 of the 8 numbers; Super's active (28.36 here vs 28.7 printed, 1.2%) is the one it does not.
    for kind, got, want in (("total", total, want_total), ("active", active, want_active)):
        assert abs(got / want - 1) < 0.10, (name, kind, got, want)
        if (name, kind) != ("super", "active"):
            assert abs(got - want) <= 0.05, (name, kind, got, want)


def test_tiny_preset_size() -> None:
    count = count_params(get_preset("tiny"))
    assert 1_000_000 <= count.total <= 3_000_000
    assert count.active < count.total


def test_count_params_by_hand_for_tiny() -> None:
    cfg = get_preset("tiny")  # V 256, H 128, L 4 (1 dense, F 512), E 16 x F 64, k 4, 2 shared
    c3, c2 = count_params(cfg, 3), count_params(cfg, 2)
    assert c3.total_by_part == {
        "embedding": 256 * 128,
        "attention": 4 * 4 * 128 * 128,
        "dense_ffn": 3 * 128 * 512,
        "routed_experts": 3 * 16 * 3 * 128 * 64,
        "shared_experts": 3 * 2 * 3 * 128 * 64,
        "router": 3 * 16 * 128,
        "norms": 9 * 128,
        "head": 256 * 128,
        "mtp": 0,
    }
    assert c3.active_by_part["routed_experts"] == 3 * 4 * 3 * 128 * 64
    assert c2.total_by_part["routed_experts"] == 3 * 16 * 2 * 128 * 64
    tied = count_params(dataclasses.replace(cfg, tie_embeddings=True))
    assert tied.total == c3.total - 256 * 128


def test_flops_match_torch_flop_counter() -> None:
    # A dense-only model, so every matmul is a plain nn.Linear torch can count; torch's counter does not see
    # the SDPA kernel on CPU, so attention scores/values are compared separately by formula.
    cfg = dataclasses.replace(get_preset("tiny"), first_k_dense=4)
    model = Transformer(cfg)
    B, S = 2, 48
    tokens = torch.randint(0, cfg.vocab_size, (B, S))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    matmul_ops = {"mm", "addmm", "bmm", "matmul"}
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items() if op.__name__ in matmul_ops)
    ours = flops_per_token(cfg, S)
    attn_core = cfg.num_layers * 2 * cfg.hidden_size * (S + 1)  # QK^T and AV over S(S+1)/2 pairs, forward
    assert counted / (B * S) == pytest.approx(3 * (ours.forward - attn_core), rel=1e-9)
    assert ours.forward_by_part["dense_ffn"] == 4 * 2 * 3 * 128 * 512


def test_paper_flop_formula_is_ours_with_full_attention_and_no_router() -> None:
    cfg, S = get_preset("small"), 2048
    ours = flops_per_token(cfg, S, expert_matrices=2)
    full_attention_extra = cfg.num_layers * 2 * cfg.hidden_size * (S - 1)  # S^2 pairs vs causal S(S+1)/2
    want = 3 * (ours.forward - ours.forward_by_part["router"] + full_attention_extra)
    assert paper_flops_per_token(cfg, S) == pytest.approx(want, rel=1e-12)
    assert ours.training == pytest.approx(3 * ours.forward)


def test_describe_reports_both_conventions() -> None:
    text = describe(get_preset("small"), seq_len=2048, global_batch=8)
    assert "16.18B" in text and "2.13B" in text  # SwiGLU total / active, embedding and head included
    assert "11.01B" in text and "1.65B" in text  # GELU total / active
    assert "10.06B total, 1.34B active" in text  # the paper's convention
    assert "8 x 2048 = 16384" in text


def test_get_preset_names_and_errors() -> None:
    assert set(PRESETS) == {"tiny", "small", "medium", "large", "super"}
    assert get_preset("Small") == get_preset("small")
    a = get_preset("tiny")
    a.moe.top_k = 1
    assert get_preset("tiny").moe.top_k == 4  # a fresh config every call
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*tiny, small, medium, large, super"):
        get_preset("huge")


def test_counting_rejects_bad_arguments() -> None:
    cfg = get_preset("tiny")
    with pytest.raises(ValueError, match=r"expert_matrices \(4\)"):
        count_params(cfg, expert_matrices=4)
    with pytest.raises(ValueError, match=r"seq_len \(257\).*max_seq_len=256"):
        flops_per_token(cfg, 257)
    with pytest.raises(ValueError, match=r"seq_len \(0\)"):
        paper_flops_per_token(cfg, 0)
    with pytest.raises(ValueError, match=r"global_batch \(0\)"):
        describe(cfg, 128, 0)
