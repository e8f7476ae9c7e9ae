"""router_topk in Triton: scores, biased top-k selection and combine weights from fp32 router logits, one pass.

# T tokens, E experts, K top-k

Forward, per block of token rows held in registers (E <= 512 fits one tile):
  1. scores = softmax(logits) | sigmoid(logits); choice = scores + expert_bias
  2. K rounds of (row max of choice, lowest column holding it, mask it to -inf): the ids come out in descending
     choice order like torch.topk's, and the chosen raw scores are picked up on the way
  3. weights = chosen scores (/ (their sum + 1e-20) when norm_topk_prob) * routed_scaling_factor
Backward recomputes the scores from the saved logits (T*E fp32, what torch's softmax would save anyway) and
scatters grad_weights onto the K chosen columns, then goes back through the normalisation and the activation:
  ds_e  = c * (g_e / D - <g, s> / D^2) on chosen columns (c * g_e without norm), 0 elsewhere
  dlogits = s * (ds - <ds, s>) (softmax) | ds * s * (1 - s) (sigmoid)
ids are discrete and scores_TK is returned for ranking only (the router detaches it), so neither has a gradient.
Group-limited routing (num_expert_groups > 1) is not done here; the router keeps its torch path for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xmoe.kernels._common import cdiv, check_device, interpreting, kernel_op, next_pow2

MAX_EXPERTS, MAX_TOP_K = 512, 16
# Warps of the backward kernel: 4, but 8 for 64-expert tiles (64 x 64), where 4 warps spill on sm_90 (56-136 bytes
# per thread, Triton 3.6 and 3.9) and 8 do not. The kernel alone on the H200 (benchmarks/bench_router.py
# --bwd-warps 4,8, CUDA-graph replay), T = 16384: E = 64 18.8 us at 4 warps, 18.9 at 8 (level, without the spill);
# E = 128 15.0 against 19.1 and E = 256 26.0 against 36.7, so 4 stay there.
BWD_NUM_WARPS: int | None = None  # forces one count for every tile (bench_router.py --bwd-warps); None: the above


def _bwd_warps(block_e: int) -> int:
    if BWD_NUM_WARPS is not None:
        return BWD_NUM_WARPS
    return 8 if block_e == 64 else 4


def router_topk_supports(num_experts: int, top_k: int, num_expert_groups: int = 1) -> bool:
    """Whether router_topk covers this routing (the router falls back to its torch path otherwise)."""
    return num_expert_groups == 1 and num_experts <= MAX_EXPERTS and top_k <= MAX_TOP_K


@triton.jit
def _scores(logits, mask_e, SIGMOID: tl.constexpr):
    # logits (BLOCK_T, BLOCK_E) fp32 (masked rows 0, so no row is all -inf); masked columns get score 0
    logits = tl.where(mask_e[None, :], logits, float("-inf"))
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-logits))
    else:
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    return tl.where(mask_e[None, :], s, 0.0)


@triton.jit
def _router_topk_fwd_kernel(
    logits_ptr,  # (T, E) fp32 contiguous
    bias_ptr,  # (E,) fp32
    weights_ptr,  # (T, K) fp32 contiguous, out
    ids_ptr,  # (T, K) int64 contiguous, out
    scores_ptr,  # (T, K) fp32 contiguous, out: raw scores of the chosen experts
    T,
    E,
    K,
    scale,
    SIGMOID: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t, mask_e = offs_t < T, offs_e < E
    logits = tl.load(
        logits_ptr + offs_t.to(tl.int64)[:, None] * E + offs_e[None, :],
        mask=mask_t[:, None] & mask_e[None, :],
        other=0.0,
    )
    s = _scores(logits, mask_e, SIGMOID)
    bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)
    choice = tl.where(mask_e[None, :], s + bias[None, :], float("-inf"))
    ids_k = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    sel_k = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for k in range(K):
        best = tl.max(choice, axis=1)
        # lowest column among equal maxima: a deterministic choice (ties have measure zero for real logits)
        idx = tl.min(tl.where(choice == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        # a row of NaN scores (a diverged step, or a simulated rank's uninitialised inputs) equals no maximum: keep
        # its ids in range, so it ends in the trainer's non-finite stop rather than an out-of-bounds gather
        idx = tl.minimum(idx, E - 1)
        hit = offs_e[None, :] == idx[:, None]
        s_idx = tl.sum(tl.where(hit, s, 0.0), axis=1)
        choice = tl.where(hit, float("-inf"), choice)
        ids_k = tl.where(offs_k[None, :] == k, idx[:, None], ids_k)
        sel_k = tl.where(offs_k[None, :] == k, s_idx[:, None], sel_k)
    w = sel_k
    if NORM:
        w = w / (tl.sum(sel_k, axis=1)[:, None] + 1e-20)  # padded columns of sel_k are 0
    out = offs_t.to(tl.int64)[:, None] * K + offs_k[None, :]
    mask = mask_t[:, None] & (offs_k < K)[None, :]
    tl.store(weights_ptr + out, w * scale, mask=mask)
    tl.store(ids_ptr + out, ids_k.to(tl.int64), mask=mask)
    tl.store(scores_ptr + out, sel_k, mask=mask)


@triton.jit
def _router_topk_bwd_kernel(
    grad_w_ptr,  # (T, K) fp32 contiguous
    logits_ptr,  # (T, E) fp32 contiguous
    ids_ptr,  # (T, K) int64 contiguous
    grad_logits_ptr,  # (T, E) fp32 contiguous, out
    T,
    E,
    K,
    scale,
    SIGMOID: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    mask_t, mask_e = offs_t < T, offs_e < E
    mask = mask_t[:, None] & mask_e[None, :]
    rows = offs_t.to(tl.int64)[:, None] * E + offs_e[None, :]
    s = _scores(tl.load(logits_ptr + rows, mask=mask, other=0.0), mask_e, SIGMOID)
    # 1. scatter grad_weights onto the chosen columns (ids of a row are distinct: no accumulation)
    g = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)  # 1.0 on chosen columns (g may be 0 there)
    for k in range(K):
        idx = tl.load(ids_ptr + offs_t.to(tl.int64) * K + k, mask=mask_t, other=-1)
        g_k = tl.load(grad_w_ptr + offs_t.to(tl.int64) * K + k, mask=mask_t, other=0.0)
        hit = offs_e[None, :] == idx[:, None]
        g = tl.where(hit, g_k[:, None], g)
        chosen = tl.where(hit, 1.0, chosen)
    # 2. through the normalisation and the scaling
    if NORM:
        denom = tl.sum(chosen * s, axis=1) + 1e-20
        gs = tl.sum(g * s, axis=1)
        ds = chosen * (g / denom[:, None] - (gs / (denom * denom))[:, None]) * scale
    else:
        ds = g * scale
    # 3. through the activation
    if SIGMOID:
        dl = ds * s * (1.0 - s)
    else:
        dl = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    tl.store(grad_logits_ptr + rows, dl, mask=mask)


def _blocks(num_experts: int, top_k: int) -> tuple[int, int, int]:
    block_e = max(16, next_pow2(num_experts))
    # ~4K fp32 per tile keeps the few live (BLOCK_T, BLOCK_E) tiles in registers; the interpreter wants small
    block_t = 4 if interpreting() else max(1, min(64, 4096 // block_e))
    return block_t, block_e, max(2, next_pow2(top_k))  # K = 1: 2-wide tile, no 1-wide edge case


def _check(logits_TE: torch.Tensor, top_k: int, score_func: str) -> None:
    if logits_TE.dim() != 2 or logits_TE.dtype != torch.float32:
        raise ValueError(f"logits_TE must be a 2-D float32 tensor, got {logits_TE.dtype} {tuple(logits_TE.shape)}")
    num_experts = logits_TE.shape[1]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts ({num_experts}) must be in [1, {MAX_EXPERTS}] for the Triton router")
    if not 1 <= top_k <= min(num_experts, MAX_TOP_K):
        raise ValueError(f"top_k ({top_k}) must be in [1, min(num_experts={num_experts}, {MAX_TOP_K})]")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"score_func ({score_func!r}) must be 'softmax' or 'sigmoid'")


@kernel_op("router_topk_fwd")
def router_topk_fwd(
    logits_TE: torch.Tensor,
    expert_bias_E: torch.Tensor,
    top_k: int,
    score_func: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights_TK fp32, ids_TK int64, scores_TK fp32): see the module docstring."""
    _check(logits_TE, top_k, score_func)
    num_tokens, num_experts = logits_TE.shape
    if expert_bias_E.shape != (num_experts,):
        raise ValueError(f"expert_bias_E shape {tuple(expert_bias_E.shape)} must be ({num_experts},)")
    check_device(logits_TE, expert_bias_E)
    weights_TK = logits_TE.new_empty(num_tokens, top_k)
    ids_TK = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TE.device)
    scores_TK = torch.empty_like(weights_TK)
    if num_tokens:
        block_t, block_e, block_k = _blocks(num_experts, top_k)
        _router_topk_fwd_kernel[(cdiv(num_tokens, block_t),)](
            logits_TE.contiguous(),
            expert_bias_E.float().contiguous(),
            weights_TK,
            ids_TK,
            scores_TK,
            num_tokens,
            num_experts,
            top_k,
            float(routed_scaling_factor),
            SIGMOID=score_func == "sigmoid",
            NORM=norm_topk_prob,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_K=block_k,
            num_warps=4,
        )
    return weights_TK, ids_TK, scores_TK


@router_topk_fwd.register_fake
def _(logits_TE, expert_bias_E, top_k, score_func, norm_topk_prob, routed_scaling_factor):
    num_tokens = logits_TE.shape[0]
    ids_TK = logits_TE.new_empty(num_tokens, top_k, dtype=torch.int64)
    return logits_TE.new_empty(num_tokens, top_k), ids_TK, logits_TE.new_empty(num_tokens, top_k)


@kernel_op("router_topk_bwd")
def router_topk_bwd(
    grad_weights_TK: torch.Tensor,
    logits_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    score_func: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:
    """grad_logits_TE of router_topk_fwd's weights_TK."""
    num_tokens, num_experts = logits_TE.shape
    grad_TE = torch.empty_like(logits_TE)
    if num_tokens:
        block_t, block_e, _ = _blocks(num_experts, ids_TK.shape[1])
        _router_topk_bwd_kernel[(cdiv(num_tokens, block_t),)](
            grad_weights_TK.float().contiguous(),
            logits_TE,
            ids_TK.contiguous(),
            grad_TE,
            num_tokens,
            num_experts,
            ids_TK.shape[1],
            float(routed_scaling_factor),
            SIGMOID=score_func == "sigmoid",
            NORM=norm_topk_prob,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            num_warps=_bwd_warps(block_e),
        )
    return grad_TE


@router_topk_bwd.register_fake
def _(grad_weights_TK, logits_TE, ids_TK, score_func, norm_topk_prob, routed_scaling_factor):
    return torch.empty_like(logits_TE)


class RouterTopkFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, expert_bias_E, top_k, score_func, norm_topk_prob, routed_scaling_factor):
        logits_TE = logits_TE.contiguous()
        weights_TK, ids_TK, scores_TK = router_topk_fwd(
            logits_TE, expert_bias_E, top_k, score_func, norm_topk_prob, routed_scaling_factor
        )
        ctx.save_for_backward(logits_TE, ids_TK)
        ctx.args = (score_func, norm_topk_prob, routed_scaling_factor)
        ctx.mark_non_differentiable(ids_TK, scores_TK)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for the non-differentiable outputs
        return weights_TK, ids_TK, scores_TK

    @staticmethod
    def backward(ctx, grad_weights_TK, grad_ids, grad_scores):
        logits_TE, ids_TK = ctx.saved_tensors
        grad_TE = None
        if grad_weights_TK is not None and ctx.needs_input_grad[0]:
            grad_TE = router_topk_bwd(grad_weights_TK, logits_TE, ids_TK, *ctx.args)
        return grad_TE, None, None, None, None, None


def router_topk(
    logits_TE: torch.Tensor,
    expert_bias_E: torch.Tensor | None,
    top_k: int,
    score_func: str = "softmax",
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
):
    """(weights_TK, ids_TK, scores_TK) of the router (no expert groups); only weights_TK carries a gradient."""
    if expert_bias_E is None:
        expert_bias_E = logits_TE.new_zeros(logits_TE.shape[-1])
    return RouterTopkFn.apply(logits_TE, expert_bias_E, top_k, score_func, norm_topk_prob, routed_scaling_factor)
