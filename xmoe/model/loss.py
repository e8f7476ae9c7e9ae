"""The loss head over token chunks: head projection and fp32 cross-entropy one chunk at a time, with both gradients
made in the forward pass.

# T tokens, H hidden, V vocabulary, C tokens per chunk

    chunked_head_loss(h_TH, weight_VH, targets_T, chunk, chunk_ce) -> the summed cross-entropy (fp32, 0-dim)

The loss is the last thing a forward computes, so its gradient with respect to each chunk's logits is known up to
the one scalar the backward brings (the loss scale): the forward computes it per chunk, right after the chunk's
logits, and turns it into the gradients of h (a (C, H) slice at a time) and of the head weight (summed over the
chunks in fp32). Only one chunk's (C, V) logits and their gradient ever exist; the backward multiplies the two
held gradients by the scalar. Against the chunks checkpointed and recomputed in backward this saves one of the
four head GEMMs per chunk, casts the weight to the compute dtype once instead of twice per chunk, and sums the
weight's gradient in place instead of autograd adding one full fp32 gradient per chunk. Held from forward to
backward: the (T, H) gradient of h in the compute dtype and the (V, H) fp32 weight gradient.

``chunk_ce(logits_CV, targets_C) -> (loss sum, dlogits_CV)``: the fp32 cross-entropy of one chunk and its gradient
with respect to the logits, in the logits' dtype (``Transformer._chunk_ce``, which torch.compile fuses into one pass
over the logits when the model is compiled).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

IGNORE_INDEX = -100  # targets with this value contribute no loss (F.cross_entropy's default)


def chunk_cross_entropy(logits_CV: torch.Tensor, targets_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over valid rows of -log softmax(logits)[target], d sum / d logits in the logits' dtype), in fp32."""
    logits = logits_CV.float()
    valid_C = targets_C != IGNORE_INDEX
    picked_C = torch.where(valid_C, targets_C, 0)
    lse_C = torch.logsumexp(logits, dim=-1)
    loss = ((lse_C - logits.gather(1, picked_C[:, None]).squeeze(1)) * valid_C).sum()
    probs = torch.exp(logits - lse_C[:, None])
    # the target's column by comparison, not one_hot (an int64 (C, V) tensor eagerly): fuses into the one pass
    hit_CV = torch.arange(logits.shape[1], device=logits.device)[None, :] == picked_C[:, None]
    grad = torch.where(hit_CV, probs - 1.0, probs) * valid_C[:, None]
    return loss, grad.to(logits_CV.dtype)


def _chunks(h_TH, weight_VH, targets_T, chunk, compute_dtype, chunk_ce, need_h, need_w):
    """(the loss sum, dh_TH, dw_VH), the gradients unscaled and None where not asked for: the forward's loop over
    the chunks."""
    w_VH = weight_VH.to(compute_dtype)  # once for every chunk
    total = torch.zeros((), dtype=torch.float32, device=h_TH.device)
    dh_TH = torch.empty(h_TH.shape, dtype=compute_dtype, device=h_TH.device) if need_h else None
    dw_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=h_TH.device) if need_w else None
    for i in range(0, h_TH.shape[0], chunk):
        h_CH = h_TH[i : i + chunk].to(compute_dtype)
        loss, dlogits_CV = chunk_ce(h_CH @ w_VH.t(), targets_T[i : i + chunk])
        total += loss
        if dh_TH is not None:
            torch.mm(dlogits_CV, w_VH, out=dh_TH[i : i + chunk])
        if dw_VH is not None:
            dw_VH += dlogits_CV.t() @ h_CH
        del dlogits_CV
    return total, dh_TH, dw_VH


class ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, weight_VH, targets_T, chunk, compute_dtype, chunk_ce, need_h, need_w):
        with torch.autocast(h_TH.device.type, enabled=False):  # the dtypes are chosen here
            total, dh_TH, dw_VH = _chunks(h_TH, weight_VH, targets_T, chunk, compute_dtype, chunk_ce, need_h, need_w)
        ctx.save_for_backward(dh_TH, dw_VH)
        ctx.dtypes = (h_TH.dtype, weight_VH.dtype)
        return total

    @staticmethod
    def backward(ctx, grad):
        dh_TH, dw_VH = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = (dh_TH.float() * grad).to(h_dtype) if dh_TH is not None else None
        dw = (dw_VH * grad).to(w_dtype) if dw_VH is not None else None
        return dh, dw, None, None, None, None, None, None


def chunked_head_loss(
    h_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_T: torch.Tensor,
    chunk: int,
    chunk_ce: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = chunk_cross_entropy,
) -> torch.Tensor:
    """sum_t CE(h[t] W^T, target[t]) over targets != -100, ``chunk`` tokens at a time (the module docstring), in the
    autocast dtype where autocast is on (else the weight's)."""
    device_type = h_TH.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else weight_VH.dtype
    grads = torch.is_grad_enabled()
    need_h, need_w = grads and h_TH.requires_grad, grads and weight_VH.requires_grad
    return ChunkedHeadLoss.apply(h_TH, weight_VH, targets_T, chunk, compute_dtype, chunk_ce, need_h, need_w)
