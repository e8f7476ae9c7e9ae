"""FP8 quantisers of the routed experts' operands: fine-grained fp32 scales, FP8 values, nothing else quantised.

# T tokens, H hidden, F expert ffn, E experts, N rows; R x C a matrix's rows and columns; G = 128 (GROUP)

DeepSeek-V3's scaling: activations and gradients in 1 x 128 groups along the reduction dimension (one scale per
row and 128 columns), weights in 128 x 128 blocks (one scale per block, so one quantised weight serves both
GEMMs it is used in, transposed or not). A group's scale is amax / max in fp32 (max: the format's largest value),
its values x * (max / amax) rounded to FP8; both divisions are correctly rounded (tl.div_rn), so the scales and
values are the same on every device and in a float64 reference. Powers of two (scaling and dequantising then
exact) were measured and not taken: in 1 x 128 groups they err 1.02-1.9x as much (relative to the norm; 1.9x with
outlier columns), in 128 x 128 blocks 1.00-1.03x, because the exact scale puts each group's largest element
exactly on the format's max and a power of two rounds it (benchmarks/fp8_scales.py, results/fp8/fp8_scales.md).

  quantize_rows(x_RC, fmt) -> (q_RC, scale_RG)        1 x G groups, the scale of q[r, c] is scale[r, c // G]
  quantize_expert_weights(w1_EHF, w3_EHF, w2_EFH, fmt) -> Fp8ExpertWeights
                                                       G x G blocks; each weight in its layout and transposed,
                                                       so that both GEMMs read it reduction-dimension-contiguous
                                                       (w1 and w3 in one (E, H, 2F) buffer: quantize_block_pair)
Kernels: _quant_rows_kernel, _quant_blocks_kernel (its passes 2 and 3, _store_block, shared with adamw.py's FP8
variant); _group_scale and _store_fp8 are shared with fp8_gemm_kernels.py, whose producers quantise in their
epilogues.

Formats (``FORMATS``, ``fp8_format(device)``: fp8_formats.py, re-exported here): e4m3fn and e4m3fnuz. Under
TRITON_INTERPRET=1 (tests on CPU) the quantised values are stored as float32: the interpreter's casts to FP8 flush
subnormals and mis-encode e4m3fnuz, so ``_store_fp8`` rounds to the format's grid in fp32 arithmetic instead,
exactly as the hardware's round-to-nearest-even conversion does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from xmoe.kernels._common import cdiv, check_float, interpreting, kernel_op
from xmoe.kernels.fp8_formats import FIX as FIX  # the formats, re-exported: callers import them from here
from xmoe.kernels.fp8_formats import FORMATS as FORMATS
from xmoe.kernels.fp8_formats import Fp8Format as Fp8Format
from xmoe.kernels.fp8_formats import _format
from xmoe.kernels.fp8_formats import format_constexprs as format_constexprs
from xmoe.kernels.fp8_formats import fp8_format as fp8_format

GROUP = 128  # columns per activation scale, rows and columns per weight scale


@triton.jit
def _group_scale(amax, FP8_MAX: tl.constexpr):
    """(scale, max / amax) of groups whose largest magnitude is amax: scale = amax / max, both divisions correctly
    rounded. amax is floored at 1e-30, so an all-zero group gets finite factors and quantises to zeros; an infinite
    amax gives an infinite scale and a zero factor, so the group dequantises to NaN: non-finite values survive
    (a saturating conversion would turn inf into the format's max)."""
    amax = tl.maximum(amax, 1e-30)
    return tl.div_rn(amax, FP8_MAX), tl.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)


@triton.jit
def _round_to_fp8_grid(v, MIN_EXP: tl.constexpr):
    """v (fp32, |v| <= the format's max) rounded to nearest-even on the grid of 3 mantissa bits whose smallest
    normal exponent is MIN_EXP: what the hardware conversion does, in fp32 arithmetic (the interpreter's path)."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)
    y = v * inv_step  # exact: |y| < 16
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 addition rounds y to an integer, ties to even
    return y * step


@triton.jit
def _store_fp8(ptr, v, mask, MIN_EXP: tl.constexpr):
    """Store v (already scaled into the format's range, at most an fp32 rounding above max, which rounds to max)
    as FP8 at ptr; float32 storage (the interpreter) gets the same values rounded in fp32."""
    if ptr.dtype.element_ty == tl.float32:
        v = _round_to_fp8_grid(v, MIN_EXP)
    tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # (R, C) fp32/bf16/fp16, row stride stride_x, unit column stride
    q_ptr,  # (R, C) FP8 (float32 under the interpreter), contiguous
    s_ptr,  # (R, cdiv(C, GROUP)) fp32, contiguous
    R,
    C,
    stride_x,
    FP8_MAX: tl.constexpr,
    MIN_EXP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    mask_r = offs_r < R
    mask = mask_r[:, None] & (offs_c < C)[None, :]
    rows = offs_r.to(tl.int64)
    v = tl.load(x_ptr + rows[:, None] * stride_x + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    scale, inv = _group_scale(tl.max(tl.abs(v), axis=1), FP8_MAX)
    _store_fp8(q_ptr + rows[:, None] * C + offs_c[None, :], v * inv[:, None], mask, MIN_EXP)
    tl.store(s_ptr + rows * tl.num_programs(1) + tl.program_id(1), scale, mask=mask_r)


@triton.jit
def _quant_blocks_kernel(
    w_ptr,  # (E, R, C) fp32/bf16/fp16, strides (stride_we, stride_wr, unit)
    q_ptr,  # (E, R, C) FP8, strides (stride_qe, stride_qr, unit): a column slice of a wider buffer, or all of it
    qt_ptr,  # (E, C, R) FP8, contiguous: the transposed copy
    s_ptr,  # (E, cdiv(R, GROUP), cdiv(C, GROUP)) fp32, strides (stride_se, stride_sr, unit)
    R,
    C,
    stride_we,
    stride_wr,
    stride_qe,
    stride_qr,
    stride_se,
    stride_sr,
    FP8_MAX: tl.constexpr,
    MIN_EXP: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # one G x G block per program, walked CHUNK rows at a time, in loops that are not unrolled (chunks unrolled
    # spilled on sm_90: a 616-byte stack); the launcher takes the whole block at 16 warps (57-59 registers, no
    # spill with Triton 3.6; at 8 warps an earlier form spilled). Pass 1: amax; pass 2: quantise into q; pass 3:
    # the transposed copy, from the block loaded in transposed order (the same products, so the same values),
    # which the compiler lays out for coalesced stores. Transposing in registers (tl.trans of the values and of
    # the mask) gave a wrong copy on an H200 with Triton 3.6 (37% of the elements), though right in the
    # interpreter and in compiles with Triton 3.9.
    pid_c, pid_r, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_c = pid_c * GROUP + tl.arange(0, GROUP)
    in_c = offs_c < C
    e64 = e.to(tl.int64)
    w_e = w_ptr + e64 * stride_we
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for r0 in range(0, GROUP, CHUNK):
        offs_r = pid_r * GROUP + r0 + tl.arange(0, CHUNK)
        mask = (offs_r < R)[:, None] & in_c[None, :]
        v = tl.load(w_e + offs_r[:, None] * stride_wr + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    _store_block(
        w_e,
        stride_wr,
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


@triton.jit
def _store_block(
    w_e,
    stride_wr,
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
    amax,
    FP8_MAX: tl.constexpr,
    MIN_EXP: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Passes 2 and 3 of _quant_blocks_kernel's block (pid_r, pid_c) of expert e64's (R, C) weight at w_e (row
    stride stride_wr), whose largest magnitude is amax: the values quantised into q (strides stride_qe,
    stride_qr, unit) and, loaded in transposed order, into qt ((E, C, R), contiguous), CHUNK rows at a time; the
    scale into s (strides stride_se, stride_sr, unit)."""
    scale, inv = _group_scale(amax, FP8_MAX)
    offs_c = pid_c * GROUP + tl.arange(0, GROUP)
    in_c = offs_c < C
    for r0 in range(0, GROUP, CHUNK):
        offs_r = pid_r * GROUP + r0 + tl.arange(0, CHUNK)
        mask = (offs_r < R)[:, None] & in_c[None, :]
        v = tl.load(w_e + offs_r[:, None] * stride_wr + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        _store_fp8(q_ptr + e64 * stride_qe + offs_r[:, None] * stride_qr + offs_c[None, :], v * inv, mask, MIN_EXP)
    for r0 in range(0, GROUP, CHUNK):
        offs_r = pid_r * GROUP + r0 + tl.arange(0, CHUNK)
        mask_t = in_c[:, None] & (offs_r < R)[None, :]
        vt = tl.load(w_e + offs_c[:, None] + offs_r[None, :] * stride_wr, mask=mask_t, other=0.0).to(tl.float32)
        _store_fp8(qt_ptr + e64 * R * C + offs_c[:, None] * R + offs_r[None, :], vt * inv, mask_t, MIN_EXP)
    tl.store(s_ptr + e64 * stride_se + pid_r * stride_sr + pid_c, scale)


@kernel_op("fp8_quantize_rows")
def quantize_rows(x_RC: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_RC, scale_RG): x_RC in 1 x GROUP groups of format ``fmt``; x ~ q * scale[:, c // GROUP]."""
    check_float("x_RC", x_RC, 2)
    form = _format(fmt)
    if x_RC.stride(-1) != 1:
        x_RC = x_RC.contiguous()
    rows, cols = x_RC.shape
    q = torch.empty(rows, cols, dtype=form.storage(), device=x_RC.device)
    scale = torch.empty(rows, cdiv(cols, GROUP), dtype=torch.float32, device=x_RC.device)
    if rows == 0 or cols == 0:
        return q, scale
    block_r = 16 if interpreting() else 32
    _quant_rows_kernel[(cdiv(rows, block_r), cdiv(cols, GROUP))](
        x_RC,
        q,
        scale,
        rows,
        cols,
        x_RC.stride(0),
        **format_constexprs(form),
        BLOCK_R=block_r,
        GROUP=GROUP,
        num_warps=4,
    )
    return q, scale


@quantize_rows.register_fake
def _(x_RC, fmt):
    rows, cols = x_RC.shape
    return (
        x_RC.new_empty(rows, cols, dtype=_format(fmt).storage()),
        x_RC.new_empty(rows, cdiv(cols, GROUP), dtype=torch.float32),
    )


def _quantize_blocks_into(
    w_ERC: torch.Tensor,
    q: torch.Tensor,
    qt: torch.Tensor,
    scale: torch.Tensor,
    form,
    chunk: int = GROUP,
    warps: int = 16,
) -> None:
    """Quantise w_ERC into q (values), qt (transposed, contiguous) and scale, q and scale column slices or whole.
    ``chunk`` rows of a block per pass and ``warps`` per program: the whole block at 16 warps, 2.2x the speed of
    32-row chunks at 4 warps on an H200 (benchmarks/bench_fp8_quant.py; the copies are the same at any setting)."""
    experts, rows, cols = w_ERC.shape
    if w_ERC.numel() == 0:
        return
    _quant_blocks_kernel[(cdiv(cols, GROUP), cdiv(rows, GROUP), experts)](
        w_ERC,
        q,
        qt,
        scale,
        rows,
        cols,
        w_ERC.stride(0),
        w_ERC.stride(1),
        q.stride(0),
        q.stride(1),
        scale.stride(0),
        scale.stride(1),
        **format_constexprs(form),
        GROUP=GROUP,
        CHUNK=chunk,
        num_warps=warps,
    )


def _weight(name: str, w_ERC: torch.Tensor) -> torch.Tensor:
    check_float(name, w_ERC, 3)
    return w_ERC if w_ERC.stride(-1) == 1 else w_ERC.contiguous()


class BlockCopy(NamedTuple):
    """Where one (E, R, C) weight's FP8 copy is written: q (E, R, C) its values (unit column stride: a column slice
    of a side-by-side buffer, or all of it), qt (E, C, R) contiguous, the values transposed, scale (E, cdiv(R, G),
    cdiv(C, G)) fp32 its block scales (a column slice, or all), fmt the format's name."""

    q: torch.Tensor
    qt: torch.Tensor
    scale: torch.Tensor
    fmt: str


class BlockCopies(NamedTuple):
    """The FP8 copies of ``len(qts)`` weights of one (E, R, C) shape: values side by side in q (E, R, n C), each
    weight's transposed values in its own (E, C, R), scales side by side in scale (E, cdiv(R, G), n cdiv(C, G))."""

    q: torch.Tensor
    qts: list[torch.Tensor]
    scale: torch.Tensor
    fmt: str

    @classmethod
    def empty(cls, shape: torch.Size, count: int, fmt: str, device: torch.device) -> BlockCopies:
        (experts, rows, cols), storage = shape, _format(fmt).storage()
        return cls(
            torch.empty(experts, rows, count * cols, dtype=storage, device=device),
            [torch.empty(experts, cols, rows, dtype=storage, device=device) for _ in range(count)],
            torch.empty(experts, cdiv(rows, GROUP), count * cdiv(cols, GROUP), dtype=torch.float32, device=device),
            fmt,
        )

    def member(self, i: int) -> BlockCopy:
        """Weight i's part, as views."""
        cols, groups = self.q.shape[-1] // len(self.qts), self.scale.shape[-1] // len(self.qts)
        q, scale = self.q[..., i * cols : (i + 1) * cols], self.scale[..., i * groups : (i + 1) * groups]
        return BlockCopy(q, self.qts[i], scale, self.fmt)


def check_block_copy(w_ERC: torch.Tensor, copy: BlockCopy) -> Fp8Format:
    """ValueError unless ``copy`` is laid out to hold w_ERC's FP8 copy; its format."""
    form = _format(copy.fmt)
    if w_ERC.dim() != 3:
        raise ValueError(f"an FP8 block copy is of an (E, R, C) weight, not one of shape {tuple(w_ERC.shape)}")
    want = BlockCopies.empty(w_ERC.shape, 1, copy.fmt, torch.device("meta")).member(0)  # the layout, no memory
    for name in ("q", "qt", "scale"):
        t, w = getattr(copy, name), getattr(want, name)
        if t.shape != w.shape or t.dtype != w.dtype or t.stride(-1) != 1 or (name == "qt" and not t.is_contiguous()):
            raise ValueError(
                f"FP8 copy {name} is {tuple(t.shape)} {t.dtype} with strides {t.stride()}; the weight "
                f"{tuple(w_ERC.shape)} needs {tuple(w.shape)} {w.dtype} with unit column stride"
                + " (contiguous)"
                * (name == "qt")
            )
    return form


@kernel_op("fp8_quantize_blocks")
def quantize_blocks(w_ERC: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_ERC, q_ECR, scale): w_ERC in GROUP x GROUP blocks of format ``fmt``, and the same values transposed;
    w[e, r, c] ~ q[e, r, c] * scale[e, r // GROUP, c // GROUP]."""
    w_ERC, form = _weight("w_ERC", w_ERC), _format(fmt)
    out = BlockCopies.empty(w_ERC.shape, 1, fmt, w_ERC.device)
    _quantize_blocks_into(w_ERC, *out.member(0)[:3], form)
    return out.q, out.qts[0], out.scale


@quantize_blocks.register_fake
def _(w_ERC, fmt):
    out = BlockCopies.empty(w_ERC.shape, 1, fmt, w_ERC.device)
    return out.q, out.qts[0], out.scale


@kernel_op("fp8_quantize_block_pair")
def quantize_block_pair(
    w1_ERC: torch.Tensor, w3_ERC: torch.Tensor, fmt: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q13, q1_ECR, q3_ECR, scale13): quantize_blocks of w1 and of w3 (the same values and scales), their
    (E, R, C) copies side by side in one (E, R, 2C) buffer and their scales in one (E, cdiv(R, G), 2 cdiv(C, G)):
    q13[..., :C] is w1's, q13[..., C:] w3's, so an input gradient dh1 w1^T + dh3 w3^T reads one operand of depth 2C
    (``fp8_gemm.input_grad_operands``)."""
    w1_ERC, w3_ERC, form = _weight("w1_ERC", w1_ERC), _weight("w3_ERC", w3_ERC), _format(fmt)
    if w1_ERC.shape != w3_ERC.shape:
        raise ValueError(f"w1_ERC {tuple(w1_ERC.shape)} and w3_ERC {tuple(w3_ERC.shape)} must have one shape")
    out = BlockCopies.empty(w1_ERC.shape, 2, fmt, w1_ERC.device)
    for i, w in enumerate((w1_ERC, w3_ERC)):
        _quantize_blocks_into(w, *out.member(i)[:3], form)
    return out.q, out.qts[0], out.qts[1], out.scale


@quantize_block_pair.register_fake
def _(w1_ERC, w3_ERC, fmt):
    out = BlockCopies.empty(w1_ERC.shape, 2, fmt, w1_ERC.device)
    return out.q, out.qts[0], out.qts[1], out.scale


def halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of t's last dimension, as views: w1's and w3's parts of a side-by-side buffer."""
    n = t.shape[-1] // 2
    return t[..., :n], t[..., n:]


class Fp8ExpertWeights(NamedTuple):
    """The routed experts' weights in FP8, each laid out for the GEMMs that read it (reduction dimension last):
    w1_EFH, w3_EFH feed the up GEMM (x w1, x w3; reduction H), w2_EHF the down GEMM (a w2; reduction F), w13_EHF
    (E, H, 2F), w1 | w3 side by side, the input gradient ((dh1 | dh3)(w1 | w3)^T; reduction 2F) and w2_EFH the down
    dgrad (g w2^T; reduction H). scale13: (E, cdiv(H, G), 2 cdiv(F, G)), w1's and w3's scales side by side, and
    scale2: (E, cdiv(F, G), cdiv(H, G)), fp32, one per 128 x 128 block of the weight in its (E, H, F) / (E, F, H)
    layout, shared by both copies (quantize_block_pair). w1_EHF, w3_EHF, scale1, scale3: the halves, as views."""

    w1_EFH: torch.Tensor
    w3_EFH: torch.Tensor
    w2_EHF: torch.Tensor
    w13_EHF: torch.Tensor
    w2_EFH: torch.Tensor
    scale13: torch.Tensor
    scale2: torch.Tensor

    @classmethod
    def of(cls, up: BlockCopies, down: BlockCopies) -> Fp8ExpertWeights:
        """From the block copies of (w1, w3), side by side, and of (w2,)."""
        (q1t, q3t), (q2t,) = up.qts, down.qts
        return cls(w1_EFH=q1t, w3_EFH=q3t, w2_EHF=q2t, w13_EHF=up.q, w2_EFH=down.q, scale13=up.scale, scale2=down.scale)

    @property
    def w1_EHF(self) -> torch.Tensor:
        return halves(self.w13_EHF)[0]

    @property
    def w3_EHF(self) -> torch.Tensor:
        return halves(self.w13_EHF)[1]

    @property
    def scale1(self) -> torch.Tensor:
        return halves(self.scale13)[0]

    @property
    def scale3(self) -> torch.Tensor:
        return halves(self.scale13)[1]


def quantize_expert_weights(
    w1_EHF: torch.Tensor, w3_EHF: torch.Tensor, w2_EFH: torch.Tensor, fmt: str
) -> Fp8ExpertWeights:
    """The FP8 copies the experts' GEMMs read (one pass over each weight): once per optimizer step, by
    ``ExpertWeights.step_copies`` (xmoe/moe/weights.py) where the optimizer step did not write them with its update
    (xmoe/kernels/adamw.py), or once per forward outside an optimizer step."""
    q13, q1t, q3t, s13 = quantize_block_pair(w1_EHF, w3_EHF, fmt)
    q2, q2t, s2 = quantize_blocks(w2_EFH, fmt)
    return Fp8ExpertWeights.of(BlockCopies(q13, [q1t, q3t], s13, fmt), BlockCopies(q2, [q2t], s2, fmt))
