"""Causal self-attention variants, chosen by ``ModelConfig.attention``, and the KV cache of generation.

Legend: B batch, S new positions, L cached + new positions, H hidden, N query heads, G key/value heads,
D query/key head dim, Dv value head dim, R rotary features, Cq / Ckv q / kv latent ranks.

Every variant keeps the output projection named ``wo`` (init's depth scaling and the TP plan rely on it) and
takes ``forward(x_BSH, cos_SR2, sin_SR2, cache=None, docs=None)``: the rotary tables already sliced to the positions
of x ((S, R/2), or (B, 1, S, R/2) when each row's positions restart at its documents), while generating the
``KVCache`` that holds the keys and values of the earlier positions, and with document masking the batch's
``Documents`` (xmoe/model/documents.py: each position attends only within its own document).

Rotary layout: feature pairs (j, j + R/2) turn together (``layers.apply_rotary``, Hugging Face's rotate_half).
Checkpoints whose rotary features are interleaved pairs (2j, 2j+1), as DeepSeek-V3's, are permuted on import
(xmoe.hf), so one layout serves all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xmoe.config import ModelConfig
from xmoe.model.documents import Documents, document_attention
from xmoe.model.layers import RMSNorm, apply_rotary


class KVCache:
    """Keys and values of the positions seen so far, per layer, for incremental decoding.

    ``pos`` is the number of positions already cached; the Transformer advances it after each forward. Keys and
    values grow by concatenation: generation in xmoe is for checks and small models, where the copy is cheap.
    """

    def __init__(self, num_layers: int) -> None:
        self.pos = 0
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer_id: int, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values of layer ``layer_id``; return all of them (B, G, L, D)."""
        past_k, past_v = self.keys[layer_id], self.values[layer_id]
        if past_k is not None:
            assert past_v is not None  # stored together, below
            k_BGSD = torch.cat((past_k, k_BGSD), dim=2)
            v_BGSD = torch.cat((past_v, v_BGSD), dim=2)
        self.keys[layer_id], self.values[layer_id] = k_BGSD, v_BGSD
        return k_BGSD, v_BGSD


def causal_attention(
    q_BNSD: torch.Tensor,
    k_BGLD: torch.Tensor,
    v_BGLD: torch.Tensor,
    scale: float | None = None,
    docs: Documents | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the visible positions (scale None: 1/sqrt(D)); the S queries are the last S of
    the L keys; with ``docs`` (L = S) only those of the query's own document.

    Key/value heads are repeated to the query heads (head n reads kv head n // (N/G), as Hugging Face's repeat_kv).
    """
    if docs is not None:
        return document_attention(q_BNSD, k_BGLD, v_BGLD, docs, scale)
    num_heads, num_kv = q_BNSD.shape[1], k_BGLD.shape[1]
    if num_kv != num_heads:
        k_BGLD = k_BGLD.repeat_interleave(num_heads // num_kv, dim=1)
        v_BGLD = v_BGLD.repeat_interleave(num_heads // num_kv, dim=1)
    S, L = q_BNSD.shape[2], k_BGLD.shape[2]
    if S == L:
        return F.scaled_dot_product_attention(q_BNSD, k_BGLD, v_BGLD, is_causal=True, scale=scale)
    # cached decoding: query i sits at position L - S + i and sees keys 0 .. L - S + i
    visible_SL = torch.ones(S, L, dtype=torch.bool, device=q_BNSD.device).tril(diagonal=L - S)
    return F.scaled_dot_product_attention(q_BNSD, k_BGLD, v_BGLD, attn_mask=visible_SL, scale=scale)


class Attention(nn.Module):
    """Multi-head attention with G <= N key/value heads (grouped-query when G < N) and rotary positions.

    ``qkv_bias`` adds biases to the q, k and v projections (Qwen2-MoE). ``qk_norm``: "head" RMS-normalises every
    head of q and k over its D features (Qwen3); "proj" the whole q (N*D) and k (G*D) projections before they split
    into heads (OLMoE). SDPA picks the fused kernel.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = D = cfg.head_dim
        h, n, g = cfg.hidden_size, cfg.num_heads, cfg.kv_heads
        self.wq = nn.Linear(h, n * D, bias=cfg.qkv_bias)
        self.wk = nn.Linear(h, g * D, bias=cfg.qkv_bias)
        self.wv = nn.Linear(h, g * D, bias=cfg.qkv_bias)
        self.wo = nn.Linear(n * D, h, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            q_width, k_width = (D, D) if cfg.qk_norm == "head" else (n * D, g * D)
            self.q_norm = RMSNorm(q_width, cfg.norm_eps)
            self.k_norm = RMSNorm(k_width, cfg.norm_eps)

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SD2: torch.Tensor,
        sin_SD2: torch.Tensor,
        cache: KVCache | None = None,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q, k, v = self.wq(x_BSH), self.wk(x_BSH), self.wv(x_BSH)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads, not cfg.num_heads: under tensor parallelism each rank holds only its share of the heads.
        q_BNSD = q.view(B, S, -1, self.head_dim).transpose(1, 2)
        k_BGSD = k.view(B, S, -1, self.head_dim).transpose(1, 2)
        v_BGSD = v.view(B, S, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm == "head":
            q_BNSD, k_BGSD = self.q_norm(q_BNSD), self.k_norm(k_BGSD)
        q_BNSD = apply_rotary(q_BNSD, cos_SD2, sin_SD2)
        k_BGSD = apply_rotary(k_BGSD, cos_SD2, sin_SD2)
        if cache is not None:
            k_BGSD, v_BGSD = cache.update(self.layer_id, k_BGSD, v_BGSD)
        out_BNSD = causal_attention(q_BNSD, k_BGSD, v_BGSD, docs=docs)
        return self.wo(out_BNSD.transpose(1, 2).reshape(B, S, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3).

    1. q = wq_b(q_norm(wq_a x)) (or wq x without a q latent), split per head into D_nope and R features
    2. [c_kv, k_rope] = wkv_a x; c_kv (Ckv) is RMS-normalised, k_rope (R) is one rotary key shared by all heads
    3. [k_nope, v] = wkv_b c_kv per head; k = [k_nope, k_rope], q = [q_nope, rotary(q_rope)]
    4. causal (or document-masked) attention with scale 1/sqrt(D_nope + R) (times YaRN's mscale^2,
       ``cfg.softmax_scale``), then wo over the N*Dv outputs
    The cache stores the expanded keys and values (simple; caching the latent would be smaller).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        h, n = cfg.hidden_size, cfg.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, n * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(h, n * qk_dim, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.latent_norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, n * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(n * self.v_dim, h, bias=False)

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SR2: torch.Tensor,
        sin_SR2: torch.Tensor,
        cache: KVCache | None = None,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q = self.wq_b(self.q_norm(self.wq_a(x_BSH))) if hasattr(self, "wq_b") else self.wq(x_BSH)
        q_BNSD = q.view(B, S, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q_BNSD.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.wkv_a(x_BSH).split([self.kv_rank, self.rope_dim], dim=-1)
        kv_BNSE = self.wkv_b(self.kv_norm(c_kv)).view(B, S, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v_BNSDv = kv_BNSE.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope_B1SR = apply_rotary(k_rope.unsqueeze(1), cos_SR2, sin_SR2)
        q_BNSD = torch.cat((q_nope, apply_rotary(q_rope, cos_SR2, sin_SR2)), dim=-1)
        k_BNSD = torch.cat((k_nope, k_rope_B1SR.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        if cache is not None:
            k_BNSD, v_BNSDv = cache.update(self.layer_id, k_BNSD, v_BNSDv)
        out_BNSDv = causal_attention(q_BNSD, k_BNSD, v_BNSDv.contiguous(), self.scale, docs)
        return self.wo(out_BNSDv.transpose(1, 2).reshape(B, S, -1))


def make_attention(cfg: ModelConfig, layer_id: int) -> nn.Module:
    """The attention module ``cfg.attention`` names."""
    return LatentAttention(cfg, layer_id) if cfg.attention == "mla" else Attention(cfg, layer_id)
