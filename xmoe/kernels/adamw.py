"""AdamW's update of one fp32 parameter in one Triton pass: the clip's divisor applied as the gradient is read, and
optionally a copy of the updated weight in a narrower dtype written beside it (the routed experts' bf16 copies
of the next step, which would otherwise cost a pass of their own: 4 bytes read and 2 written per weight).

Per element, in fp32 (torch.optim.AdamW's update, decoupled weight decay):

    g = grad / divisor                          (divisor: a device scalar, the clip's; 1 without)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

with IEEE-rounded square root and division. 28 bytes per parameter move (read p, g, m, v; write p, m, v), 30
with the copy. The gradient is not written back: torch's fused AdamW, given a ``grad_scale``, also stores the
unscaled gradient (4 bytes more per parameter), which nothing after the step reads here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xmoe.kernels._common import cdiv, check_device, interpreting

BLOCK = 2048  # elements per program


@triton.jit
def _adamw_kernel(
    p_ptr,  # (n,) fp32 contiguous: the parameter, updated in place
    g_ptr,  # (n,) its gradient, fp32 (or narrower), read only
    m_ptr,
    v_ptr,  # (n,) fp32 contiguous: AdamW's exp_avg and exp_avg_sq, updated in place
    div_ptr,  # () fp32: what every gradient is divided by (read when HAS_DIV)
    copy_ptr,  # (n,) narrower dtype: the updated parameter cast (written when HAS_COPY)
    n,
    lr_wd,  # lr * weight_decay
    beta1,
    beta2,
    step_size,  # lr / (1 - beta1^t)
    bc2_sqrt,  # sqrt(1 - beta2^t)
    eps,
    HAS_DIV: tl.constexpr,
    HAS_COPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_DIV:
        g = tl.div_rn(g, tl.load(div_ptr))
    p = p - lr_wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=mask)


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    divisor: torch.Tensor | None = None,
    copy: torch.Tensor | None = None,
) -> None:
    """One AdamW step of ``param`` (fp32, contiguous) and its moments, in place; ``step``: the step's count t (from
    1). ``divisor``: a one-element fp32 device tensor every gradient is divided by (the clip's). ``copy``: a
    tensor of param's shape, written with the updated parameter in its dtype."""
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, t in tensors.items():
        if t.shape != param.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the parameter {tuple(param.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton AdamW step")
        if t.dtype != torch.float32 and name != "grad":
            raise ValueError(f"{name} has dtype {t.dtype}; the Triton AdamW step keeps fp32 parameters and moments")
    if step < 1:
        raise ValueError(f"step ({step}) counts from 1")
    if copy is not None and (copy.shape != param.shape or not copy.is_contiguous()):
        raise ValueError(f"copy must be contiguous of the parameter's shape {tuple(param.shape)}")
    if divisor is not None and (divisor.numel() != 1 or divisor.dtype != torch.float32):
        raise ValueError(f"divisor must be one fp32 value, got {divisor.numel()} of {divisor.dtype}")
    check_device(*tensors.values(), *(t for t in (divisor, copy) if t is not None))
    n = param.numel()
    if n == 0:
        return
    block = 64 if interpreting() else BLOCK
    _adamw_kernel[(cdiv(n, block),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param if divisor is None else divisor,  # a pointer either way; read only when HAS_DIV
        param if copy is None else copy,
        n,
        lr * weight_decay,
        beta1,
        beta2,
        lr / (1.0 - beta1**step),
        math.sqrt(1.0 - beta2**step),
        eps,
        HAS_DIV=divisor is not None,
        HAS_COPY=copy is not None,
        BLOCK=block,
        num_warps=8,
    )
