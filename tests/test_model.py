"""Transformer: exact parameter counts, a float64 reference, causality, rotary, init, loss, training."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from xmoe.config import ModelConfig, MoEConfig
from xmoe.model.counting import count_params
from xmoe.model.presets import tiny
from xmoe.model.transformer import IGNORE_INDEX, Transformer, apply_rotary, rope_tables


def small_cfg(*, layers: int = 2, dense: int | None = None, shared: int = 0, tied: bool = False) -> ModelConfig:
    """A few-thousand-parameter model; ``dense`` = first_k_dense (default: all layers dense)."""
    return ModelConfig(
        vocab_size=61,  # odd on purpose: no shape may assume a power of two
        hidden_size=32,
        num_layers=layers,
        num_heads=4,
        first_k_dense=layers if dense is None else dense,
        ffn_hidden_size=48,
        max_seq_len=24,
        tie_embeddings=tied,
        moe=MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=6, top_k=2, num_shared_experts=shared),
    )


def rand_tokens(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --- parameter count -------------------------------------------------------------------------------------

COUNT_CASES = {
    "dense": dict(layers=3),
    "dense_tied": dict(layers=2, tied=True),
    "mixed": dict(layers=3, dense=1),
    "all_moe_shared": dict(layers=2, dense=0, shared=2),
    "mixed_tied_shared": dict(layers=3, dense=2, shared=1, tied=True),
}


@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_count_params_equals_numel(case: str) -> None:
    cfg = small_cfg(**COUNT_CASES[case])
    model = Transformer(cfg)
    assert model.num_params() == count_params(cfg, expert_matrices=3).total


def test_count_params_equals_numel_tiny_preset() -> None:
    cfg = tiny()
    with torch.device("meta"):  # shapes only; nothing allocated
        model = Transformer(cfg)
    assert model.num_params() == count_params(cfg).total
    assert 1_000_000 <= model.num_params() <= 3_000_000


# --- numerics against an independent float64 implementation --------------------------------------------


def reference_forward(model: Transformer, tokens_BS: torch.Tensor) -> torch.Tensor:
    """Float64 forward of a dense-only model written independently: complex-number rotary, explicit mask."""
    cfg = model.cfg
    S, D = tokens_BS.shape[1], cfg.head_dim
    p = {k: v.detach().double() for k, v in model.state_dict().items()}

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    freq_D2 = 1.0 / cfg.rope_theta ** (torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    angles_SD2 = torch.arange(S).double()[:, None] * freq_D2
    rot_SD2 = torch.polar(torch.ones_like(angles_SD2), angles_SD2)

    def rope(x_BSND: torch.Tensor) -> torch.Tensor:  # pairs (j, j + D/2) as complex numbers
        z = torch.complex(x_BSND[..., : D // 2], x_BSND[..., D // 2 :]) * rot_SD2[None, :, None, :]
        return torch.cat((z.real, z.imag), dim=-1)

    mask_SS = torch.ones(S, S, dtype=torch.bool).tril()
    x = p["embed.weight"][tokens_BS]
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        h = rms(x, p[pre + "attn_norm.weight"])
        q, k, v = ((h @ p[pre + f"attn.{n}.weight"].T).unflatten(-1, (cfg.num_heads, D)) for n in ("wq", "wk", "wv"))
        q, k = rope(q), rope(k)
        scores_BNSS = torch.einsum("bsnd,btnd->bnst", q, k) / math.sqrt(D)
        attn_BNSS = scores_BNSS.masked_fill(~mask_SS, float("-inf")).softmax(-1)
        out = torch.einsum("bnst,btnd->bsnd", attn_BNSS, v).flatten(-2)
        x = x + out @ p[pre + "attn.wo.weight"].T
        h = rms(x, p[pre + "ffn_norm.weight"])
        gate, up = h @ p[pre + "ffn.w1.weight"].T, h @ p[pre + "ffn.w3.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ p[pre + "ffn.w2.weight"].T
    return rms(x, p["norm.weight"]) @ p["head.weight"].T


def test_forward_matches_float64_reference() -> None:
    cfg = small_cfg(layers=2)
    model = Transformer(cfg)
    # Larger-than-default weights so attention is far from uniform and rotary errors would show.
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
    tokens = rand_tokens(cfg, 3, 19)
    got = model(tokens).double()
    want = reference_forward(model, tokens)
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-5, f"relative error {rel:.2e} against the float64 reference"


def test_rotary_depends_only_on_relative_position() -> None:
    D, S = 16, 40
    cos, sin = rope_tables(S, D, theta=10000.0)
    g = torch.Generator().manual_seed(1)
    q_D = torch.randn(D, generator=g, dtype=torch.float64)
    k_D = torch.randn(D, generator=g, dtype=torch.float64)
    # Same vector at every position, shape (1, 1, S, D).
    q_rot = apply_rotary(q_D.expand(1, 1, S, D), cos, sin)[0, 0]
    k_rot = apply_rotary(k_D.expand(1, 1, S, D), cos, sin)[0, 0]
    scores_SS = q_rot @ k_rot.T
    for m, n, shift in [(5, 2, 7), (3, 9, 20), (30, 0, 9)]:
        torch.testing.assert_close(scores_SS[m, n], scores_SS[m + shift, n + shift], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores_SS[5, 2], scores_SS[5, 3])  # the score does depend on the offset
    torch.testing.assert_close(q_rot.norm(dim=-1), q_D.norm().expand(S), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dense", [None, 1])
def test_causal_masking(dense: int | None) -> None:
    cfg = small_cfg(layers=2, dense=dense)
    model = Transformer(cfg).eval()
    tokens = rand_tokens(cfg, 2, 20)
    changed = tokens.clone()
    t = 11
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t:], b[:, t:], atol=1e-4)


# --- initialisation and meta-device build ----------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(layers=2, tied=True), dict(layers=3, dense=1, shared=1)])
def test_meta_build_then_init_is_deterministic(kw: dict) -> None:
    cfg = small_cfg(**kw)
    models = []
    for _ in range(2):
        with torch.device("meta"):
            m = Transformer(cfg)
        assert all(p.is_meta for p in m.parameters())
        m.to_empty(device="cpu")
        with torch.no_grad():  # to_empty leaves whatever memory held; make that garbage visible
            for t in [*m.parameters(), *m.buffers()]:
                t.fill_(float("nan"))
        m.init_weights(seed=123)
        models.append(m)
    direct = Transformer(cfg)
    direct.init_weights(seed=123)
    models.append(direct)
    ref = models[0].state_dict()
    for m in models[1:]:
        for name, t in m.state_dict().items():
            assert torch.equal(t, ref[name]), name
    if cfg.tie_embeddings:
        assert models[0].head.weight is models[0].embed.weight
    tokens = rand_tokens(cfg, 2, 16)
    with torch.no_grad():  # rotary buffers were rebuilt, so outputs match the directly built model
        torch.testing.assert_close(models[0](tokens), direct(tokens), atol=0, rtol=0)
    other = Transformer(cfg)
    other.init_weights(seed=124)
    assert not torch.equal(other.layers[0].attn.wq.weight, models[0].layers[0].attn.wq.weight)


def test_init_follows_stated_rule() -> None:
    cfg = dataclasses.replace(
        small_cfg(layers=4),
        hidden_size=256,
        num_heads=4,
        ffn_hidden_size=512,
        moe=MoEConfig(hidden_size=256, ffn_hidden_size=16, num_experts=6, top_k=2),
    )
    model = Transformer(cfg)
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for block in model.layers:
        assert block.attn.wq.weight.std().item() == pytest.approx(cfg.init_std, rel=0.03)
        assert block.ffn.w1.weight.std().item() == pytest.approx(cfg.init_std, rel=0.03)
        assert block.attn.wo.weight.std().item() == pytest.approx(out_std, rel=0.03)
        assert block.ffn.w2.weight.std().item() == pytest.approx(out_std, rel=0.03)
        assert torch.equal(block.attn_norm.weight, torch.ones(cfg.hidden_size))
    assert model.embed.weight.std().item() == pytest.approx(cfg.init_std, rel=0.03)


def test_init_scales_expert_down_projections() -> None:
    cfg = dataclasses.replace(
        small_cfg(layers=2, dense=0),
        moe=MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=16, top_k=2, init_std=0.05),
    )
    model = Transformer(cfg)
    scale = 1 / math.sqrt(2 * cfg.num_layers)
    for name, p in model.layers[0].ffn.named_parameters():
        leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
        want = 0.05 * (scale if leaf == "w2" else 1.0)
        assert p.std().item() == pytest.approx(want, rel=0.1), name


# --- loss and training -----------------------------------------------------------------------------------


def test_loss_equals_cross_entropy_of_logits() -> None:
    cfg = small_cfg(layers=2)
    model = Transformer(cfg)
    tokens, targets = rand_tokens(cfg, 3, 20, seed=1), rand_tokens(cfg, 3, 20, seed=2)
    targets[0, :5] = IGNORE_INDEX
    logits = model(tokens)
    want = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss = model(tokens, targets)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)


def test_chunked_loss_matches_unchunked_value_and_gradients() -> None:
    cfg = small_cfg(layers=2, tied=True)
    plain = Transformer(cfg, loss_chunk_tokens=0)
    chunked = Transformer(cfg, loss_chunk_tokens=7)  # 60 tokens -> 9 uneven chunks
    chunked.load_state_dict(plain.state_dict())
    tokens, targets = rand_tokens(cfg, 3, 20, seed=3), rand_tokens(cfg, 3, 20, seed=4)
    targets[1, 3:9] = IGNORE_INDEX
    a, b = plain(tokens, targets), chunked(tokens, targets)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for (name, pa), pb in zip(plain.named_parameters(), chunked.parameters(), strict=False):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_chunked_loss_in_bf16_and_without_gradients() -> None:
    # under autocast the chunks compute in bf16 as the unchunked head does (loss and gradients close to it); under
    # no_grad the chunked loss is the same value and holds no gradient buffers
    cfg = small_cfg(layers=1)
    plain = Transformer(cfg, loss_chunk_tokens=0)
    chunked = Transformer(cfg, loss_chunk_tokens=16)  # 60 tokens -> 4 chunks, the last of 12
    chunked.load_state_dict(plain.state_dict())
    tokens, targets = rand_tokens(cfg, 3, 20, seed=5), rand_tokens(cfg, 3, 20, seed=6)
    targets[0, :] = IGNORE_INDEX  # a chunk with ignored rows only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(tokens, targets), chunked(tokens, targets)
    a.backward()
    b.backward()
    assert a.dtype == b.dtype == torch.float32 and abs(a.item() - b.item()) < 1e-2 * a.item()
    for (name, pa), pb in zip(plain.named_parameters(), chunked.parameters(), strict=False):
        assert pb.grad.dtype == torch.float32
        assert ((pa.grad - pb.grad).norm() / pa.grad.norm()).item() < 2e-2, name
    with torch.no_grad():
        torch.testing.assert_close(chunked(tokens, targets), plain(tokens, targets), atol=1e-6, rtol=1e-6)


def test_chunked_loss_compiles_without_graph_break() -> None:
    cfg = small_cfg(layers=1)
    model = Transformer(cfg, loss_chunk_tokens=16)
    tokens, targets = rand_tokens(cfg, 3, 20, seed=7), rand_tokens(cfg, 3, 20, seed=8)
    results = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            model._chunk_ce = torch.compile(model._chunk_ce, fullgraph=True, backend="aot_eager")
        model.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dense", [None, 1])
def test_autocast_bf16_loss_is_fp32_and_close(dense: int | None) -> None:
    cfg = small_cfg(layers=2, dense=dense)
    model = Transformer(cfg)
    tokens = rand_tokens(cfg, 2, 16)
    ref = model(tokens, tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, tokens)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 0.05


@pytest.mark.parametrize("dense", [None, 1])
def test_a_few_adamw_steps_reduce_the_loss(dense: int | None) -> None:
    torch.manual_seed(0)
    cfg = small_cfg(layers=2, dense=dense)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = rand_tokens(cfg, 4, 24, seed=5)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(25):
        loss = model(inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(cfg.vocab_size), rel=0.1)  # near-uniform at init
    assert losses[-1] < losses[0] - 1.0, losses


# --- bad inputs --------------------------------------------------------------------------------------------


def test_bad_inputs_raise_value_error_naming_the_value() -> None:
    cfg = small_cfg(layers=1)
    model = Transformer(cfg)
    with pytest.raises(ValueError, match=r"sequence length \(25\).*max_seq_len \(24\)"):
        model(rand_tokens(cfg, 1, 25))
    with pytest.raises(ValueError, match="float32"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"targets shape \(1, 3\)"):
        model(rand_tokens(cfg, 1, 4), rand_tokens(cfg, 1, 3))
    with pytest.raises(ValueError, match=r"loss_chunk_tokens \(-1\)"):
        Transformer(cfg, loss_chunk_tokens=-1)
