"""Attention variants (GQA, head_dim, q/k norms, MLA) against a float64 reference written from the formulas;
parameter counts; the KV cache; refused configurations."""

from __future__ import annotations

import math

import pytest
import torch

from xmoe.config import ModelConfig, MoEConfig
from xmoe.model.attention import KVCache
from xmoe.model.counting import count_params
from xmoe.model.transformer import Transformer
from xmoe.parallel.tensor import check_tensor_parallel

H = 32
VARIANTS = {
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "head_dim_mqa": dict(num_heads=4, num_kv_heads=1, attn_head_dim=12),
    "qk_norm_head": dict(num_heads=4, num_kv_heads=2, attn_head_dim=16, qk_norm="head"),
    "qk_norm_proj": dict(num_heads=4, num_kv_heads=2, qk_norm="proj"),
    "qkv_bias": dict(num_heads=4, num_kv_heads=2, qkv_bias=True),
    "mla_q_lora": dict(
        num_heads=4,
        attention="mla",
        q_lora_rank=12,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
    ),
    "mla_no_q_lora": dict(
        num_heads=2, attention="mla", kv_lora_rank=8, qk_nope_head_dim=0, qk_rope_head_dim=8, v_head_dim=6
    ),
}


def cfg_of(variant: str, layers: int = 2) -> ModelConfig:
    moe = MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=4, top_k=2, num_shared_experts=1)
    return ModelConfig(
        vocab_size=37,
        hidden_size=H,
        num_layers=layers,
        first_k_dense=1,
        ffn_hidden_size=24,
        max_seq_len=16,
        moe=moe,
        **VARIANTS[variant],
    )


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, pos, theta):
    """Pairs (j, j + R/2) turned by pos * theta^(-2j/R), float64."""
    R = x.shape[-1]
    ang = pos[:, None] * theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    x1, x2 = x[..., : R // 2], x[..., R // 2 :]
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), -1)


def reference_attention(attn, cfg: ModelConfig, x_SH: torch.Tensor) -> torch.Tensor:
    """One sequence, float64, a loop over heads; weights read from ``attn``."""
    W = {k: v.double() for k, v in attn.state_dict().items()}
    S, N = x_SH.shape[0], cfg.num_heads
    pos = torch.arange(S, dtype=torch.float64)
    if cfg.attention == "mla":
        dn, R, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q = _rms(x_SH @ W["wq_a.weight"].T, W["q_norm.weight"], cfg.latent_norm_eps) @ W["wq_b.weight"].T
        else:
            q = x_SH @ W["wq.weight"].T
        ckv = x_SH @ W["wkv_a.weight"].T
        kv = _rms(ckv[:, :r], W["kv_norm.weight"], cfg.latent_norm_eps) @ W["wkv_b.weight"].T
        k_rope = _rotate(ckv[:, r:], pos, cfg.rope_theta)
        heads = []
        for n in range(N):
            qn = q[:, n * (dn + R) : (n + 1) * (dn + R)]
            qn = torch.cat((qn[:, :dn], _rotate(qn[:, dn:], pos, cfg.rope_theta)), -1)
            kvn = kv[:, n * (dn + dv) : (n + 1) * (dn + dv)]
            kn, vn = torch.cat((kvn[:, :dn], k_rope), -1), kvn[:, dn:]
            heads.append(_softmax_av(qn, kn, vn))
        return torch.cat(heads, -1) @ W["wo.weight"].T
    D, G = cfg.head_dim, cfg.kv_heads
    q, k, v = (x_SH @ W[f"{n}.weight"].T + W.get(f"{n}.bias", 0) for n in ("wq", "wk", "wv"))
    if cfg.qk_norm == "proj":
        q, k = _rms(q, W["q_norm.weight"], cfg.norm_eps), _rms(k, W["k_norm.weight"], cfg.norm_eps)
    heads = []
    for n in range(N):
        g = n // (N // G)
        qn, kn, vn = q[:, n * D : (n + 1) * D], k[:, g * D : (g + 1) * D], v[:, g * D : (g + 1) * D]
        if cfg.qk_norm == "head":
            qn, kn = _rms(qn, W["q_norm.weight"], cfg.norm_eps), _rms(kn, W["k_norm.weight"], cfg.norm_eps)
        heads.append(_softmax_av(_rotate(qn, pos, cfg.rope_theta), _rotate(kn, pos, cfg.rope_theta), vn))
    return torch.cat(heads, -1) @ W["wo.weight"].T


def _softmax_av(q, k, v):
    scores = q @ k.T / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_matches_float64_reference(variant: str) -> None:
    cfg = cfg_of(variant)
    torch.manual_seed(0)
    model = Transformer(cfg)
    attn = model.layers[1].attn
    with torch.no_grad():  # norms away from ones, biases away from zero, so a wrongly applied one shows
        for name, p in attn.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    x = torch.randn(2, 11, H)
    got = attn(x, model.rope_cos[:11], model.rope_sin[:11])
    for b in range(2):
        want = reference_attention(attn, cfg, x[b].double())
        assert (got[b].double() - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_count_params_equals_numel(variant: str) -> None:
    cfg = cfg_of(variant)
    assert count_params(cfg).total == sum(p.numel() for p in Transformer(cfg).parameters())


def test_count_params_with_a_gated_shared_expert_of_its_own_width() -> None:
    moe = MoEConfig(
        hidden_size=H,
        ffn_hidden_size=16,
        num_experts=4,
        top_k=2,
        num_shared_experts=1,
        shared_ffn_hidden_size=20,
        shared_expert_gate=True,
    )
    cfg = ModelConfig(vocab_size=37, hidden_size=H, num_layers=2, num_heads=4, moe=moe, qkv_bias=True)
    model = Transformer(cfg)
    assert model.layers[0].ffn.shared_experts.w1.weight.shape == (20, H)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("variant", ["gqa", "qk_norm_head", "mla_q_lora"])
def test_kv_cache_continuation_equals_full_forward(variant: str) -> None:
    cfg = cfg_of(variant)
    torch.manual_seed(1)
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(cfg.num_layers)
        parts = [model(tokens[:, :6], cache=cache), model(tokens[:, 6:9], cache=cache)]
        parts += [model(tokens[:, i : i + 1], cache=cache) for i in range(9, 13)]
    assert cache.pos == 13
    step = torch.cat(parts, dim=1)
    assert (step - full).norm() / full.norm() < 1e-5


def test_defaults_keep_the_multi_head_layout() -> None:
    cfg = cfg_of("gqa")
    plain = ModelConfig(vocab_size=37, hidden_size=H, num_layers=1, num_heads=4, moe=cfg.moe)
    attn = Transformer(plain).layers[0].attn
    assert {k: tuple(v.shape) for k, v in attn.state_dict().items()} == {f"w{n}.weight": (H, H) for n in "qkvo"}


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(num_heads=4, qk_norm="layer"), "qk_norm"),
        (dict(num_heads=4, attention="gqa"), "attention"),
        (dict(num_heads=4, kv_lora_rank=8), "kv_lora_rank"),
        (dict(num_heads=4, attention="mla", kv_lora_rank=8, qk_rope_head_dim=3, v_head_dim=4), "qk_rope_head_dim"),
        (
            dict(num_heads=4, attention="mla", kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=4, num_kv_heads=2),
            "num_kv_heads",
        ),
        (dict(num_heads=5), "attn_head_dim"),
    ],
)
def test_bad_attention_configs_raise(kw: dict, match: str) -> None:
    moe = MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=match):
        ModelConfig(vocab_size=37, hidden_size=H, num_layers=1, moe=moe, **kw)


@pytest.mark.parametrize(
    "variant, tp, match",
    [
        ("mla_q_lora", 2, "mla"),
        ("qk_norm_proj", 2, "qk_norm"),
        ("qk_norm_head", 2, "qk_norm"),
        ("head_dim_mqa", 2, "num_kv_heads"),
    ],
)
def test_tensor_parallel_refuses_unsupported_attention(variant: str, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(cfg_of(variant), tp)
    check_tensor_parallel(cfg_of("gqa"), 2)  # kv heads split over tp: supported


def _gqa_tp_cfg(**kw) -> ModelConfig:
    moe = MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, top_k=2, kernel_backend="torch")
    return ModelConfig(
        vocab_size=37,
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        moe=moe,
        first_k_dense=1,
        ffn_hidden_size=16,
        max_seq_len=16,
        **kw,
    )


def _gqa_tp_body(rank: int, world_size: int, kw: dict) -> None:
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.tensor import apply_tensor_parallel

    def build():
        torch.manual_seed(0)
        return Transformer(_gqa_tp_cfg(**kw), loss_chunk_tokens=0)

    tokens = torch.randint(0, 37, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = build()
    ref(tokens[:, :-1], tokens[:, 1:]).backward()
    dims = ParallelDims.from_config(ParallelConfig(tp=world_size), world_size).build_mesh("cpu")
    model = apply_tensor_parallel(build(), dims)
    assert model.layers[0].attn.wk.weight.to_local().shape[0] == 2 * 12 // world_size  # kv heads split too
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert (grad - ref_grads[name]).norm() <= 1e-5 * ref_grads[name].norm(), (rank, name)


@pytest.mark.parametrize(
    "kw", [dict(num_kv_heads=2, attn_head_dim=12), dict(num_kv_heads=2, qkv_bias=True, attn_head_dim=12)]
)
def test_grouped_query_attention_under_tensor_parallelism_matches_one_process(kw: dict) -> None:
    from dist_utils import run_distributed

    run_distributed(_gqa_tp_body, 2, kw)


@pytest.mark.parametrize("variant", ["gqa", "head_dim_mqa", "mla_q_lora", "mla_no_q_lora"])
def test_flops_count_the_attention_actually_built(variant: str) -> None:
    from xmoe.model.flops import FlopDims, forward_macs

    cfg, s = cfg_of(variant), 10
    attn = Transformer(cfg).layers[0].attn
    matrices = sum(p.numel() for p in attn.parameters() if p.ndim == 2)  # MACs per token of the projections
    v_dim = cfg.v_head_dim if cfg.attention == "mla" else cfg.head_dim
    macs = forward_macs(FlopDims.from_model_config(cfg, s), num_sequences=1)
    assert macs["attn_proj"] == s * cfg.num_layers * matrices
    assert macs["attn_scores"] == cfg.num_layers * cfg.num_heads * (cfg.head_dim + v_dim) * s * (s + 1) // 2
