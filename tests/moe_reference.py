"""An independent float64 per-token loop reference of the MoE layer, written from the formulas in
xmoe/moe/router.py's docstring and MoEConfig's capacity rule, sharing no code with xmoe's implementation.
"""

from __future__ import annotations

import math

import torch


def _silu(v):
    return v / (1 + torch.exp(-v))


def reference_forward(params: dict, x: torch.Tensor, cfg, num_sequences: int = 1):
    """Returns (out (T, H) float64, aux_loss, z_loss, kept list of (t, k, e)), differentiable in float64."""
    x = x.double().reshape(-1, cfg.hidden_size)
    num_tokens, num_experts, top_k = x.shape[0], cfg.num_experts, cfg.top_k
    wr, w1, w3, w2 = (params[k].double() for k in ("router", "w1", "w3", "w2"))
    bias = params.get("bias", torch.zeros(num_experts)).double()

    slots = []  # (t, k, e, score, weight)
    all_scores, all_lse = [], []
    for t in range(num_tokens):
        logits = torch.stack([torch.dot(wr[e], x[t]) for e in range(num_experts)])
        all_lse.append(torch.log(torch.exp(logits - logits.max()).sum()) + logits.max())
        if cfg.score_func == "softmax":
            scores = torch.exp(logits - logits.max())
            scores = scores / scores.sum()
        else:
            scores = 1 / (1 + torch.exp(-logits))
        all_scores.append(scores)
        choice = [scores[e].item() + bias[e].item() for e in range(num_experts)]
        eligible = list(range(num_experts))
        if cfg.num_expert_groups > 1:
            size = num_experts // cfg.num_expert_groups
            group_scores = []
            for g in range(cfg.num_expert_groups):
                vals = sorted(choice[g * size : (g + 1) * size], reverse=True)
                group_scores.append(sum(vals[:2]) if cfg.score_func == "sigmoid" and size >= 2 else vals[0])
            best = sorted(range(cfg.num_expert_groups), key=lambda g: -group_scores[g])[: cfg.topk_groups]
            eligible = [e for e in eligible if e // size in best]
        chosen = sorted(eligible, key=lambda e: -choice[e])[:top_k]
        sel = [scores[e] for e in chosen]
        denom = sum(sel) if cfg.norm_topk_prob else 1.0
        for k, e in enumerate(chosen):
            slots.append((t, k, e, scores[e].item(), sel[k] / denom * cfg.routed_scaling_factor))

    kept = slots
    if cfg.capacity_factor is not None:
        cap = max(1, math.ceil(cfg.capacity_factor * num_tokens * top_k / num_experts))
        kept = []
        for e in range(num_experts):
            mine = [s for s in slots if s[2] == e]
            mine.sort(key=lambda s: (-s[3], s[0] * top_k + s[1]))
            kept += mine[:cap]

    rows = [torch.zeros(cfg.hidden_size, dtype=torch.float64) for _ in range(num_tokens)]
    for t, _k, e, _, weight in kept:
        h = _silu(x[t] @ w1[e]) * (x[t] @ w3[e])
        rows[t] = rows[t] + weight * (h @ w2[e])
    out = torch.stack(rows)
    if "s1" in params:
        s1, s3, s2 = (params[k].double() for k in ("s1", "s3", "s2"))
        out = out + (_silu(x @ s1.T) * (x @ s3.T)) @ s2.T

    aux = torch.zeros((), dtype=torch.float64)
    if cfg.aux_loss_coef > 0:
        groups = num_sequences if cfg.balance_scope == "sequence" else 1
        seq_len = num_tokens // groups
        for b in range(groups):
            for e in range(num_experts):
                count = sum(1 for s in slots if s[2] == e and b * seq_len <= s[0] < (b + 1) * seq_len)
                probs = []
                for t in range(b * seq_len, (b + 1) * seq_len):
                    p = all_scores[t]
                    probs.append(p[e] / p.sum() if cfg.score_func == "sigmoid" else p[e])
                aux = aux + count * num_experts / (top_k * seq_len) * torch.stack(probs).mean()
        aux = cfg.aux_loss_coef * aux / groups
    z = cfg.z_loss_coef * torch.stack(all_lse).square().mean() if cfg.z_loss_coef > 0 else torch.zeros(())
    return out, aux, z, [(t, k, e) for t, k, e, _, _ in kept]


def layer_params(layer) -> dict:
    params = {
        "router": layer.router.weight,
        "bias": layer.router.expert_bias,
        "w1": layer.experts.w1,
        "w3": layer.experts.w3,
        "w2": layer.experts.w2,
    }
    if layer.shared_experts is not None:
        params.update(
            s1=layer.shared_experts.w1.weight, s3=layer.shared_experts.w3.weight, s2=layer.shared_experts.w2.weight
        )
    return params
