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

The routed experts' FP8 copies (moe.fp8 = "experts") come from the same pass (``copy`` a fp8_quant.BlockCopy):
``_adamw_quant_blocks_kernel`` steps an (E, R, C) weight one 128 x 128 block per program, then quantises the
block it just wrote (read back from L2, not HBM) into both layouts with its block scale, as
fp8_quant._quant_blocks_kernel would from the updated weight: 30 bytes per weight instead of 28 here and 6 more
(4 read, 2 written) in a quantising pass of its own. The copies and the update are bitwise those of the two passes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xmoe.kernels._common import cdiv, check_device, interpreting
from xmoe.kernels.fp8_quant import GROUP, BlockCopy, _store_block, check_block_copy, format_constexprs

BLOCK = 2048  # elements per program
QUANT_CHUNK, QUANT_WARPS = 16, 8  # rows of a block per pass and warps per program of the FP8 variant


@triton.jit
def _adamw_step(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    div_ptr,
    offs,
    mask,
    lr_wd,
    beta1,
    beta2,
    step_size,
    bc2_sqrt,
    eps,
    HAS_DIV: tl.constexpr,
):
    """One AdamW step of the elements at offs (where mask), in fp32, written back; returns the updated weights
    (0 where masked): both kernels' arithmetic."""
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
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
    return p


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
    p = _adamw_step(
        p_ptr, g_ptr, m_ptr, v_ptr, div_ptr, offs, mask, lr_wd, beta1, beta2, step_size, bc2_sqrt, eps, HAS_DIV
    )
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_quant_blocks_kernel(
    p_ptr,  # (E, R, C) fp32 contiguous: the parameter, updated in place
    g_ptr,  # (E, R, C) its gradient, fp32 (or narrower), contiguous
    m_ptr,
    v_ptr,  # (E, R, C) fp32 contiguous: exp_avg, exp_avg_sq
    div_ptr,  # () fp32 (read when HAS_DIV)
    q_ptr,  # (E, R, C) FP8, strides (stride_qe, stride_qr, unit): the updated weight quantised
    qt_ptr,  # (E, C, R) FP8 contiguous: the same values transposed
    s_ptr,  # (E, cdiv(R, GROUP), cdiv(C, GROUP)) fp32, strides (stride_se, stride_sr, unit): the block scales
    R,
    C,
    stride_qe,
    stride_qr,
    stride_se,
    stride_sr,
    lr_wd,
    beta1,
    beta2,
    step_size,
    bc2_sqrt,
    eps,
    HAS_DIV: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_EXP: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One G x G block per program, CHUNK rows at a time in loops that are not unrolled (as _quant_blocks_kernel).
    # Pass 1 steps the block and takes its amax from the updated values; after a barrier (the block's stores
    # visible to every thread of the program) passes 2 and 3 read it back, straight and transposed, and quantise
    # it exactly as _quant_blocks_kernel's passes 2 and 3 do.
    pid_c, pid_r, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_c = pid_c * GROUP + tl.arange(0, GROUP)
    in_c = offs_c < C
    e64 = e.to(tl.int64)
    base = e64 * R * C
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for r0 in range(0, GROUP, CHUNK):
        offs_r = pid_r * GROUP + r0 + tl.arange(0, CHUNK)
        mask = (offs_r < R)[:, None] & in_c[None, :]
        offs = base + offs_r[:, None] * C + offs_c[None, :]
        p = _adamw_step(
            p_ptr, g_ptr, m_ptr, v_ptr, div_ptr, offs, mask, lr_wd, beta1, beta2, step_size, bc2_sqrt, eps, HAS_DIV
        )
        amax = tl.maximum(amax, tl.max(tl.abs(p), axis=1))  # masked elements stay 0
    tl.debug_barrier()
    _store_block(
        p_ptr + base,
        C,
        q_ptr,
        stride_qe,
        stride_qr,
        qt_ptr,
        s_ptr,
        stride_se,
        stride_sr,
        e64,
        pid_r,
        pid_c,
        R,
        C,
        tl.max(amax, axis=0),
        FP8_MAX,
        MIN_EXP,
        GROUP,
        CHUNK,
    )


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
    copy: torch.Tensor | BlockCopy | None = None,
) -> None:
    """One AdamW step of ``param`` (fp32, contiguous) and its moments, in place; ``step``: the step's count t (from
    1). ``divisor``: a one-element fp32 device tensor every gradient is divided by (the clip's). ``copy``: a
    tensor of param's shape, written with the updated parameter in its dtype; or, for an (E, R, C) parameter, a
    fp8_quant.BlockCopy written with it quantised in 128 x 128 blocks (fp8_quant.quantize_blocks' values, both
    layouts, and scales)."""
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
    if isinstance(copy, BlockCopy):
        form = check_block_copy(param, copy)
    elif copy is not None and (copy.shape != param.shape or not copy.is_contiguous()):
        raise ValueError(f"copy must be contiguous of the parameter's shape {tuple(param.shape)}")
    if divisor is not None and (divisor.numel() != 1 or divisor.dtype != torch.float32):
        raise ValueError(f"divisor must be one fp32 value, got {divisor.numel()} of {divisor.dtype}")
    outputs = copy[:3] if isinstance(copy, BlockCopy) else (copy,)
    check_device(*tensors.values(), *(t for t in (*outputs, divisor) if t is not None))
    n = param.numel()
    if n == 0:
        return
    scalars = (lr * weight_decay, beta1, beta2, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step), eps)
    div = param if divisor is None else divisor  # a pointer either way; read only when HAS_DIV
    if isinstance(copy, BlockCopy):
        experts, rows, cols = param.shape
        _adamw_quant_blocks_kernel[(cdiv(cols, GROUP), cdiv(rows, GROUP), experts)](
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            div,
            copy.q,
            copy.qt,
            copy.scale,
            rows,
            cols,
            copy.q.stride(0),
            copy.q.stride(1),
            copy.scale.stride(0),
            copy.scale.stride(1),
            *scalars,
            HAS_DIV=divisor is not None,
            **format_constexprs(form),
            GROUP=GROUP,
            CHUNK=QUANT_CHUNK,
            num_warps=QUANT_WARPS,
        )
        return
    block = 64 if interpreting() else BLOCK
    _adamw_kernel[(cdiv(n, block),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        div,
        param if copy is None else copy,
        n,
        *scalars,
        HAS_DIV=divisor is not None,
        HAS_COPY=copy is not None,
        BLOCK=block,
        num_warps=8,
    )
