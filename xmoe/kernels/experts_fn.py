"""The routed experts' one autograd Function: SwiGLU experts over expert-major rows, fused with gather and
combine or not, for any GEMM set (gemm_sets.py: bf16; fp8_gemm_set.py: FP8).

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows (expert-major)

  experts(fmt, wgrad, autotune, x, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
          w1, w3, w2, qw, x_q)
      fused (token_ids_N given): x is x_TH, out[t] = sum_k w[t,k] expert_{e(t,k)}(x[t]), (T, H)
      grouped (token_ids_N None): x is x_NH, expert-major rows, y[n] = expert_{e(n)}(x[n]), (N, H)
  fmt: None for the bf16 set, an FP8 format's name for the FP8 set (qw: its Fp8ExpertWeights; x_q: rows that
  arrive quantised, (values, scales), with x a stand-in for them: fp8_experts.grouped_swiglu_fp8).
  wgrad, autotune: the caller's kernels.wgrad and kernels.autotune (its layer's Kernels value, choice.py), kept on
  ctx as constants and handed to the GEMM set in forward and again in backward, which reads no module-level
  option.

What a GEMM set provides (stage methods; rows_in -> up -> down in forward, the rest in backward):
  rows_in(x)                       the up GEMM's operand: x itself, or its FP8 rows
  up(rows, token_ids_N, E, store)  (h1, h3, a): h1, h3 (N, F) kept for backward (empty unless store), a the down
                                   GEMM's operand (rows read at token_ids_N where given)
  down(a, E, c0, c1)               columns c0:c1 of y = a w2, (N, c1 - c0)
  grad_rows(g, fused)              the output gradient as the backward reads it
  swiglu_bwd(g, token_ids_N, h1, h3, row_w_N, E, reuse, gather)
                                   (dh1, dh3, w a, grad_row_w_N, dh, g_rows): the SwiGLU backward with the combine
                                   weights (fused), dh the input-gradient GEMM's operand, g_rows the (rows, ids) of g
                                   the weight gradient of w2 reads, or None where it gathers them itself
  input_grad(dh, E, c0, c1)        columns c0:c1 of dx = dh1 w1^T + dh3 w3^T, (N, c1 - c0)
  wgrad_rows(x, token_ids_N, gather)   (rows, ids) of x the weight gradients of w1, w3 read
  weight_grads(x, token_ids_N, E, N)  the engine of the weight gradients (gemm_sets.RowWgrad,
                                   fp8_gemm_set.ColWgrad): w2_begin / w2_end around the moment w a is freed, w13
  saved()                          the tensors its backward needs; restore(fmt, saved, dtype) rebuilds it

Fused: the up GEMM reads x_TH rows by token id (no (N, H) dispatch buffer); y and dx are made and summed per token
(k in order, no atomics) one column chunk of H at a time (``column_chunks``), so they exist only as (N, chunk)
buffers, one alive at a time. Backward order: SwiGLU backward (dh1 over da; with ``reuse`` w a over h1, dh3 over
h3), dW2, then w a (h1's storage, which ctx holds until the backward returns) freed before dx, dx, dW1 and dW3.
Grouped: dx before dW2, unchunked. Saved between forward and backward: h1, h3 (2 N F elements in the activations'
dtype) and what the set saves (the weights, or their FP8 copies).

The kernels are torch.library custom ops, so torch.compile treats them as opaque calls and traces the code around
them; the Function takes tensors, tuples of tensors and constants only and keeps only constants on its ctx (the
GEMM set is built in forward, and again from the saved tensors in backward), as dynamo traces such Functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from xmoe.kernels._common import cdiv, interpreting
from xmoe.kernels.combine import combine_fwd, combine_into
from xmoe.kernels.fp8_gemm_set import Fp8Gemms
from xmoe.kernels.gemm_sets import Bf16Gemms
from xmoe.kernels.grouped_gemm import can_reuse_saved


def column_chunks(hidden: int, num_rows: int, num_tokens: int, quantum: int = 1) -> list[tuple[int, int]]:
    """Column ranges of H for the (N, H) results that are summed per token at once (y, dx): each chunk's (N, C)
    buffer is about as large as the (T, H) output it is summed into (C ~ H * T / N = H / K), at least 1024
    columns (4 of the widest 256-column tiles: each chunk's launch keeps several waves of programs), and every
    chunk starts at a multiple of ``quantum`` (the FP8 weights' 128-column scale blocks). Under torch.compile one
    chunk."""
    if torch.compiler.is_compiling() or hidden == 0:
        return [(0, hidden)]
    align, floor = (32, 32) if interpreting() else (256, 1024)
    align = math.lcm(align, quantum)
    cols = max(cdiv(cdiv(hidden * num_tokens, max(num_rows, 1)), align) * align, floor)
    return [(c0, min(c0 + cols, hidden)) for c0 in range(0, hidden, cols)]


def mark_overwritten(*saved: torch.Tensor) -> None:
    """Saved tensors the backward wrote gradients over: a second backward through the same graph (retain_graph)
    then fails with autograd's in-place error instead of reading them."""
    for t in saved:
        torch.autograd.graph.increment_version(t)


def chunked_combine(
    product: Callable[..., torch.Tensor],
    operands: tuple,
    width: int,
    num_rows: int,
    row_of_slot_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    quantum: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """combine(product(*operands, 0, width), weights) -> (T, width) in like's dtype, one column chunk of the
    (N, width) product at a time: product(*operands, c0, c1) gives its columns c0:c1."""
    num_tokens = row_of_slot_TK.shape[0]
    chunks = column_chunks(width, num_rows, num_tokens, quantum)
    if len(chunks) == 1:
        return combine_fwd(product(*operands, 0, width), row_of_slot_TK, weights_TK)
    out_TH = torch.empty(num_tokens, width, dtype=like.dtype, device=like.device)
    for c0, c1 in chunks:
        part = product(*operands, c0, c1)
        combine_into(part, row_of_slot_TK, weights_TK, out_TH[:, c0:c1])
        del part  # freed before the next chunk's buffer is allocated: one chunk alive at a time
    return out_TH


def restore(
    fmt: str | None, tensors: list[torch.Tensor], dtype: torch.dtype, wgrad: str, autotune: bool
) -> Bf16Gemms | Fp8Gemms:
    """The GEMM set of ``fmt`` (None: bf16) from the tensors its ``saved()`` gave; dtype: the activations';
    wgrad, autotune: the kernels section's."""
    if fmt is None:
        w1, w3, w2 = tensors
        return Bf16Gemms(w1, w3, w2, wgrad, autotune)
    return Fp8Gemms.restore(tensors, fmt, dtype, wgrad, autotune)


class ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, fmt, wgrad, autotune, x, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
        w1, w3, w2, qw, x_q,
    ):  # fmt: skip
        fused = token_ids_N is not None
        if fused and token_ids_N.shape != slot_ids_N.shape:
            raise ValueError(
                f"token_ids_N {tuple(token_ids_N.shape)} and slot_ids_N {tuple(slot_ids_N.shape)} must have one shape"
            )
        gemms: Bf16Gemms | Fp8Gemms = (
            Bf16Gemms(w1, w3, w2, wgrad, autotune) if fmt is None else Fp8Gemms(qw, fmt, x.dtype, x_q, wgrad, autotune)
        )
        rows = gemms.rows_in(x)
        h1, h3, a = gemms.up(rows, token_ids_N, tokens_per_expert_E, any(ctx.needs_input_grad))
        del rows
        if fused:
            num_rows = token_ids_N.shape[0]
            out = chunked_combine(
                gemms.down, (a, tokens_per_expert_E), gemms.hidden, num_rows, row_of_slot_TK, weights_TK,
                gemms.quantum, x,
            )  # fmt: skip
        else:
            out = gemms.down(a, tokens_per_expert_E, 0, gemms.hidden)
        del a
        routing = (weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK) if fused else ()
        ctx.save_for_backward(x, *routing, tokens_per_expert_E, *gemms.saved(), h1, h3)
        ctx.fmt, ctx.fused, ctx.wgrad, ctx.autotune = fmt, fused, wgrad, autotune
        return out

    @staticmethod
    def backward(ctx, grad):
        x, *saved = ctx.saved_tensors
        weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK = saved[:4] if ctx.fused else (None,) * 4
        counts_E, *tensors, h1, h3 = saved[4:] if ctx.fused else saved
        gemms = restore(ctx.fmt, tensors, x.dtype, ctx.wgrad, ctx.autotune)
        grad = gemms.grad_rows(grad, ctx.fused)
        row_w_N = weights_TK.reshape(-1)[slot_ids_N].float() if ctx.fused else None
        reuse = can_reuse_saved()
        num_rows = token_ids_N.shape[0] if ctx.fused else x.shape[0]
        engine = gemms.weight_grads(x, token_ids_N, counts_E, num_rows)
        # 1. da = g[token] w2^T -> dh1 (over da), dh3 (over h3 when allowed); w a (over h1 when allowed); the
        #    combine weights' gradient <g[token] w2^T, a>
        dh1, dh3, a_w, grad_w_N, dh, g_rows = gemms.swiglu_bwd(
            grad, token_ids_N, h1, h3, row_w_N, counts_E, reuse, engine.gather
        )
        if reuse:
            mark_overwritten(h1, h3)
        if ctx.fused:
            # 2. dW2_e = (w a)_e^T g[token]_e, then w a freed before dx: it is h1's storage, which ctx holds until
            #    the backward returns
            pending = engine.w2_begin(a_w, grad, token_ids_N, g_rows)
            del g_rows
            if reuse:
                a_w.untyped_storage().resize_(0)
            del a_w
            dw2, kept = engine.w2_end(pending, grad, token_ids_N)
            del pending
            # 3. dx = dh1 w1^T + dh3 w3^T summed per token (k in order, no atomics), one column chunk at a time
            dx = chunked_combine(
                gemms.input_grad, (dh, counts_E), gemms.hidden, num_rows, row_of_slot_TK, None, gemms.quantum, x
            )
            del dh
        else:
            dx = gemms.input_grad(dh, counts_E, 0, gemms.hidden)
            del dh
            pending = engine.w2_begin(a_w, grad, None, g_rows)
            del g_rows
            dw2, kept = engine.w2_end(pending, grad, None)
            del pending, a_w
        # 4. dW1_e, dW3_e = x[token]_e^T (dh1_e, dh3_e)
        dw1, dw3 = engine.w13(kept, gemms, x, token_ids_N, dh1, dh3)
        del dh1, dh3
        if not ctx.fused:
            return None, None, None, dx, None, None, None, None, None, dw1, dw3, dw2, None, None
        # 5. the combine weights' gradient: one slot per kept row, dropped slots stay 0
        grad_w = torch.zeros(weights_TK.numel(), dtype=weights_TK.dtype, device=weights_TK.device)
        grad_w[slot_ids_N] = grad_w_N.to(grad_w.dtype)  # slots are unique: a permutation, no accumulation
        return None, None, None, dx, grad_w.view_as(weights_TK), None, None, None, None, dw1, dw3, dw2, None, None


def experts(
    fmt, wgrad, autotune, x, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1, w3, w2, qw,
    x_q,
):  # fmt: skip
    """ExpertsFn.apply (module docstring)."""
    return ExpertsFn.apply(
        fmt, wgrad, autotune, x, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1, w3, w2,
        qw, x_q,
    )  # fmt: skip
