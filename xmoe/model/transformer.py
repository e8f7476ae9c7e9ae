"""Decoder-only MoE transformer, written for one device; parallelism is applied from outside.

Layout (parameter names are part of the contract the parallel/ and checkpoint code rely on):
  embed.weight                                 (V, H)
  layers.{i}.attn_norm.weight                  (H,)
  layers.{i}.attn.{wq,wk,wv,wo}.weight         (N*D, H), (G*D, H) x2, (H, N*D): separate projections, TP shards
                                               q/k/v colwise; .{q_norm,k_norm}.weight with qk_norm
                                               (attention="mla": wq or wq_a/q_norm/wq_b, wkv_a, kv_norm, wkv_b, wo;
                                               see xmoe/model/attention.py)
  layers.{i}.ffn_norm.weight                   (H,)
  layers.{i}.ffn.{w1,w3}.weight, .w2.weight    (F, H), (H, F)   dense SwiGLU, i < first_k_dense
  layers.{i}.ffn.*                             xmoe.moe.layer.MoELayer, i >= first_k_dense: router.weight
                                               (E, H), experts.{w1,w3} (E, H, F), experts.w2 (E, F, H),
                                               shared_experts.{w1,w3,w2}.weight (n_shared * F wide)
  norm.weight                                  (H,)
  head.weight                                  (V, H)      the same Parameter as embed.weight when tied
  mtp.{d}.{enorm,hnorm,norm}.weight            (H,)        multi-token prediction, d < mtp_depth
  mtp.{d}.eh_proj.weight                       (H, 2H)     (xmoe/model/mtp.py); mtp.{d}.block.* is one block as
                                                           layers.{i}.* above, of the last layer's kind

Initialisation (``Transformer.init_weights``; the constructor calls it, so it also overrides the MoELayer's
own init so that every weight follows one rule, depth scaling included):
  * every matrix: normal(0, std), std = cfg.init_std, or cfg.moe.init_std inside MoE blocks (router, experts,
    shared experts);
  * output projections of a residual branch (leaf name ``wo`` or ``w2``: attention out, dense and expert
    down-projections) use std / sqrt(2 * num_layers), two residual branches per layer (GPT-2 / Megatron);
  * embedding normal(0, cfg.init_std); RMSNorm weights ones; any other 1-D parameter zeros;
  * MoE buffers (load-balancing state: expert_bias) zeros; rotary tables recomputed;
  * with a seed, the normal values of each parameter are drawn block by block from generators keyed by (seed,
    parameter name, block), so they do not depend on how the model is sharded (xmoe/model/init.py).

Legend: B batch, S sequence, H hidden, N heads, G key/value heads, D head_dim, F ffn width, V vocab, T = B*S tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from xmoe.config import ModelConfig
from xmoe.kernels.choice import Kernels, resolve_kernels
from xmoe.model import init as param_init
from xmoe.model.attention import KVCache, make_attention
from xmoe.model.documents import Documents
from xmoe.model.layers import RMSNorm, apply_rotary, rope_tables  # noqa: F401  (apply_rotary: re-exported)
from xmoe.model.loss import IGNORE_INDEX, chunk_cross_entropy, chunked_head_loss
from xmoe.model.mtp import MTPModule, depth_targets, shift_left
from xmoe.moe.experts import SwiGLU
from xmoe.moe.layer import MoELayer, moe_layers


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is dense or MoE.

    The two residual branches are methods of their own (``attn_branch``, ``ffn_branch``) so that training code can
    set, from outside, what to recompute in backward (``recompute``: "none"; "moe": the FFN branch of MoE blocks;
    "full": the whole block) and compile each branch as a region (``torch.compile`` of the bound method): the
    checkpoint stays outside the compiled code and the module's own call, hooks included, stays eager. With a
    ``cache`` (generation: no gradients) the block runs plainly. ``kernels``: an MoE block's (MoELayer's).
    """

    def __init__(
        self, cfg: ModelConfig, layer_id: int, moe: bool | None = None, kernels: Kernels | None = None
    ) -> None:
        super().__init__()
        self.is_moe = layer_id >= cfg.first_k_dense if moe is None else moe
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = make_attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if self.is_moe:
            self.ffn: nn.Module = MoELayer(cfg.moe, kernels=kernels)
        else:
            self.ffn = SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size)
        self.recompute = "none"

    def attn_branch(
        self,
        x_BSH: torch.Tensor,
        cos_SD2: torch.Tensor,
        sin_SD2: torch.Tensor,
        cache: KVCache | None = None,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            return x_BSH + self.attn(self.attn_norm(x_BSH), cos_SD2, sin_SD2, cache=cache)
        if docs is not None:
            return x_BSH + self.attn(self.attn_norm(x_BSH), cos_SD2, sin_SD2, docs=docs)
        return x_BSH + self.attn(self.attn_norm(x_BSH), cos_SD2, sin_SD2)

    def ffn_branch(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return x_BSH + self.ffn(self.ffn_norm(x_BSH))

    def _both(
        self, x_BSH: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor, docs: Documents | None = None
    ) -> torch.Tensor:
        return self.ffn_branch(self.attn_branch(x_BSH, cos_SD2, sin_SD2, docs=docs))

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SD2: torch.Tensor,
        sin_SD2: torch.Tensor,
        cache: KVCache | None = None,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        """``cos_SD2``, ``sin_SD2``: the rotary tables of the positions of x, (S, D/2), or (B, 1, S, D/2) with
        ``docs`` (the batch's documents: attention stays inside each, xmoe/model/documents.py)."""
        if cache is not None:
            return self.ffn_branch(self.attn_branch(x_BSH, cos_SD2, sin_SD2, cache))
        if self.recompute == "none" or not torch.is_grad_enabled():
            return self._both(x_BSH, cos_SD2, sin_SD2, docs)
        if self.recompute == "full":
            return checkpoint(self._both, x_BSH, cos_SD2, sin_SD2, docs, use_reentrant=False)
        x_BSH = self.attn_branch(x_BSH, cos_SD2, sin_SD2, docs=docs)
        if self.is_moe:  # "moe": only the MoE branch's activations are dropped and rebuilt
            return checkpoint(self.ffn_branch, x_BSH, use_reentrant=False)
        return self.ffn_branch(x_BSH)


class Transformer(nn.Module):
    """Token embedding -> blocks -> final RMSNorm -> LM head.

    ``forward(tokens)`` returns logits (B, S, V) in the activation dtype; ``forward(tokens, targets)`` returns
    the mean fp32 cross-entropy over targets != -100 (auxiliary MoE losses are already attached to the graph
    by each MoELayer, so ``loss.backward()`` trains the routers too; in training mode, so is the weighted
    multi-token-prediction loss of ``cfg.mtp_depth`` > 0, whose value ``take_mtp_loss`` gives: xmoe/model/mtp.py).

    ``loss_chunk_tokens``: when B*S exceeds it, the head and cross-entropy run over token chunks of this size, so
    only one chunk's (chunk, V) logits and their gradient ever exist (S=4096, B=4, V=50304 would otherwise hold
    3.3 GB of fp32 logits plus their gradient): the gradients of h and of the head weight are made chunk by
    chunk in the forward and held for the backward (model/loss.py); a head weight that is a DTensor takes
    checkpointed chunks instead, recomputed in backward (and a forward without gradients plain chunks). 0
    disables chunking (e.g. for a vocab-parallel loss applied from outside).

    Low precision: keep parameters fp32 and use autocast or FSDP's MixedPrecisionPolicy. ``model.to(bf16)``
    also casts the rotary tables to bf16 (positions past ~256 then lose angle precision).

    ``kernels``: what every MoE block runs (xmoe/kernels/choice.py), one value for all of them; None:
    ``resolve_kernels(cfg.moe.kernel_backend)``, for the default device under the environment's kernels section.
    ``xmoe.build_model`` builds on the meta device with its target device's, from the run's ``KernelConfig``.
    """

    rope_cos: torch.Tensor  # buffers (register_buffer below)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, *, loss_chunk_tokens: int = 4096, kernels: Kernels | None = None) -> None:
        super().__init__()
        if loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens ({loss_chunk_tokens}) must be >= 0 (0 disables chunking)")
        self.cfg = cfg
        self.loss_chunk_tokens = loss_chunk_tokens
        if kernels is None and cfg.has_moe:  # one value for all the MoE blocks
            kernels = resolve_kernels(cfg.moe.kernel_backend)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, kernels=kernels) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.mtp = nn.ModuleList(
            MTPModule(cfg, Block(cfg, cfg.num_layers + d, moe=cfg.has_moe, kernels=kernels))  # the last layer's kind
            for d in range(cfg.mtp_depth)
        )
        for d, module in enumerate(self.mtp, 1):  # an MTP block's real tokens: those with a target d ahead
            for layer in moe_layers(module):
                layer.positions_ahead = d
        self._mtp_sum: torch.Tensor | None = None  # the MTP losses of the training forwards not yet taken
        self._mtp_count = 0
        # Non-persistent: derived from the config, so checkpoints stay free of them and a meta-device build
        # recomputes them in init_weights().
        cos_SD2, sin_SD2 = rope_tables(cfg.max_seq_len, cfg.rope_dim, cfg.rope_theta, self.embed.weight.device, cfg)
        self.register_buffer("rope_cos", cos_SD2, persistent=False)
        self.register_buffer("rope_sin", sin_SD2, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter and buffer by the rule in the module docstring.

        With ``seed`` the values are layout-independent (xmoe/model/init.py): each parameter's are a function of
        the seed, its name and the global indices, so a model whose parameters are DTensor shards (built on the
        meta device, parallelised, then ``to_empty``) gets exactly the slices of the one-process model. Without
        it the global RNG draws each parameter in turn (quick, for models built directly in tests).
        """
        cfg = self.cfg
        if cfg.tie_embeddings:
            # to_empty() replaces each Parameter object separately, which unties them; tie again.
            self.head.weight = self.embed.weight
        cos_SD2, sin_SD2 = rope_tables(cfg.max_seq_len, cfg.rope_dim, cfg.rope_theta, cfg=cfg)
        self.rope_cos.copy_(cos_SD2)
        self.rope_sin.copy_(sin_SD2)
        out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
        # By identity, not by name: wrappers applied from outside (activation checkpointing) rename modules.
        moe_param_ids = {id(p) for layer in self.moe_layers() for p in layer.parameters()}
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
                continue
            std = cfg.moe.init_std if id(p) in moe_param_ids else cfg.init_std
            leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
            if leaf in ("wo", "w2"):
                std *= out_scale
            if seed is None:
                nn.init.normal_(p, 0.0, std)
            else:
                param_init.normal_(p, std, seed, name)
        for layer in self.moe_layers():
            for buf in layer.buffers():
                if not buf.is_meta:
                    buf.zero_()

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head is counted once); equals counting.count_params."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        tokens_BS: torch.Tensor,
        targets_BS: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        segments_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits, or the loss with ``targets_BS``. With ``cache`` (generation) the tokens continue the cached
        positions: their keys and values are appended to it and its position advances. With ``segments_BS`` (int32,
        the tokens' shape: each position's document index in its row, 0-based, non-decreasing) attention stays
        inside each document and rotary positions restart at each (xmoe/model/documents.py); a row then computes
        what its documents would compute as rows of their own."""
        if tokens_BS.ndim != 2 or tokens_BS.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"tokens must be an integer tensor of shape (batch, seq); got {tuple(tokens_BS.shape)} "
                f"{tokens_BS.dtype}"
            )
        S = tokens_BS.shape[1]
        start = 0 if cache is None else cache.pos
        if start + S > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length ({start + S}) exceeds max_seq_len ({self.cfg.max_seq_len}); raise max_seq_len"
            )
        if targets_BS is not None and targets_BS.shape != tokens_BS.shape:
            raise ValueError(
                f"targets shape {tuple(targets_BS.shape)} must equal tokens shape {tuple(tokens_BS.shape)}"
            )
        docs = None
        if segments_BS is None:
            cos_SD2, sin_SD2 = self.rope_cos[start : start + S], self.rope_sin[start : start + S]
        else:
            if cache is not None:
                raise ValueError(
                    "segments cannot be combined with a KV cache: generation continues one document per row, whose "
                    "positions start at 0; pass segments_BS=None"
                )
            docs = Documents.build(segments_BS, tokens_BS)
            # per row: (B, 1, S, D/2), broadcast over the heads
            cos_SD2, sin_SD2 = self.rope_cos[docs.positions_BS][:, None], self.rope_sin[docs.positions_BS][:, None]
        h_BSH = embedded_BSH = self.embed(tokens_BS)
        for block in self.layers:
            if cache is not None:
                h_BSH = block(h_BSH, cos_SD2, sin_SD2, cache)
            elif docs is not None:
                h_BSH = block(h_BSH, cos_SD2, sin_SD2, docs=docs)
            else:
                h_BSH = block(h_BSH, cos_SD2, sin_SD2)
        if cache is not None:
            cache.pos += S
        h_BSH = self.norm(h_BSH)
        if targets_BS is None:
            return self.head(h_BSH)
        loss = self._loss(h_BSH.flatten(0, 1), targets_BS.flatten())
        if len(self.mtp) and self.training:
            loss = loss + self._mtp_gradient(h_BSH, embedded_BSH, targets_BS, segments_BS, cos_SD2, sin_SD2, docs)
        return loss

    def _mtp_gradient(self, h_BSH, embedded_BSH, targets_BS, segments_BS, cos_SD2, sin_SD2, docs) -> torch.Tensor:
        """mtp_loss_weight / D * sum_d L_d (xmoe/model/mtp.py) as a zero that carries its gradient; the mean of the
        L_d is kept for ``take_mtp_loss``."""
        total = torch.zeros((), device=h_BSH.device)
        for d, module in enumerate(self.mtp, 1):
            h_BSH = module(h_BSH, shift_left(embedded_BSH, d), cos_SD2, sin_SD2, docs)
            targets_T = depth_targets(targets_BS, d, segments_BS).flatten()
            total = total + self._loss(h_BSH.flatten(0, 1), targets_T)
        mean = total / len(self.mtp)
        kept = mean.detach()
        self._mtp_sum = kept if self._mtp_sum is None else self._mtp_sum + kept
        self._mtp_count += 1
        weighted = self.cfg.mtp_loss_weight * mean
        return weighted - weighted.detach()

    def real_tokens(
        self, targets_BS: torch.Tensor, segments_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        """The positions whose targets count, as MoEStep.set_real_tokens takes them: the main loss's, and for each
        multi-token-prediction depth d the positions with a target at depth d (depth_targets, which the depth's loss
        reads), by d (None without MTP)."""
        depths = range(1, len(self.mtp) + 1)
        ahead = {d: depth_targets(targets_BS, d, segments_BS) != IGNORE_INDEX for d in depths} if depths else None
        return targets_BS != IGNORE_INDEX, ahead

    def take_mtp_loss(self) -> torch.Tensor | None:
        """The mean over depths of the MTP losses L_d, averaged over the training forwards since the last call (a
        device tensor, no host sync), or None when none ran; the count restarts."""
        if self._mtp_sum is None:
            return None
        mean = self._mtp_sum / self._mtp_count
        self._mtp_sum, self._mtp_count = None, 0
        return mean

    def _loss(self, h_TH: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        num_valid = (targets_T != IGNORE_INDEX).sum().clamp(min=1)  # a tensor: no host synchronisation
        T, chunk = h_TH.shape[0], self.loss_chunk_tokens
        if chunk == 0 or T <= chunk:
            return self._loss_sum(h_TH, targets_T) / num_valid
        weight = self.head.weight
        if torch.is_grad_enabled() and not hasattr(weight, "to_local"):
            # a plain weight: the gradients made chunk by chunk in the forward (loss.py)
            return chunked_head_loss(h_TH, weight, targets_T, chunk, self._chunk_ce) / num_valid
        # split, not a slice per chunk: one backward node gathers the chunks' gradients into h's in one pass,
        # where each slice's backward would write a zero-filled (T, H) gradient and autograd add them up
        total = sum(
            checkpoint(self._loss_sum, h_chunk, t_chunk, use_reentrant=False)
            for h_chunk, t_chunk in zip(h_TH.split(chunk), targets_T.split(chunk), strict=True)
        )
        return total / num_valid

    def _chunk_ce(self, logits_CV: torch.Tensor, targets_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's cross-entropy sum and its logits' gradient (loss.chunk_cross_entropy): a method, so that
        regional compilation can replace it with its compiled form."""
        return chunk_cross_entropy(logits_CV, targets_C)

    def _loss_sum(self, h_TH: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        logits_TV = self.head(h_TH).float()
        return F.cross_entropy(logits_TV, targets_T, ignore_index=IGNORE_INDEX, reduction="sum")

    def moe_layers(self) -> list[MoELayer]:
        """The MoELayer of every MoE block, in layer order."""
        return moe_layers(self)
