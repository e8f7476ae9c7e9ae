"""FP8 grouped GEMMs of the routed experts with fine-grained scales, forward and input gradients: the registered
ops and their launchers (FP8 format and layout checks, tile picks, grids); the Triton kernels, and how they apply
the scales, are in fp8_gemm_kernels.py.

# T tokens, H hidden, F expert ffn, E experts, N rows (expert-major); G = 128 (fp8_quant.GROUP)

  fp8_swiglu_up_fwd    h1, h3 of FP8 x or x[token_ids_N], and a = silu(h1) * h3 quantised in 1 x G groups
                       (_fp8_up_fwd_kernel)
  fp8_grouped_mm       c = a1 b1_e (+ a2 b2_e), out in the activations' dtype: y = a w2, dx = dh1 w1^T + dh3 w3^T
                       (_fp8_grouped_mm_kernel; dx as one product of depth 2F: input_grad_operands)
  fp8_swiglu_down_bwd  da = g[tok] w2^T (_fp8_grouped_mm_kernel), then grouped_gemm.swiglu_down_bwd's elementwise
                       pass, also writing dh1, dh3 quantised for the dx GEMM (_fp8_swiglu_bwd_kernel)
The weight gradients are bf16 (grouped_wgrad.py) unless kernels.wgrad = "fp8" (fp8_wgrad.py: their reduction runs
over each expert's rows, so their operands are quantised in 128 x 1 groups down the columns, transposed).
Tile maps and launch options are grouped_gemm.py's. On NVIDIA GPUs with TMA (compute capability 9.0 and newer)
fp8_grouped_mm's kernel reads the operands whose rows are not gathered (the weights, and a when it is
expert-major) through tensor descriptors (``uses_tma``); elsewhere, for gathered rows and in the up kernel,
through pointers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import replace

import torch

from xmoe.kernels import tiles
from xmoe.kernels._common import cdiv, check_device, check_index, interpreting, kernel_op
from xmoe.kernels.fp8_gemm_kernels import _fp8_grouped_mm_kernel, _fp8_swiglu_bwd_kernel, _fp8_up_fwd_kernel
from xmoe.kernels.fp8_quant import FORMATS, GROUP, format_constexprs, halves
from xmoe.kernels.grouped_gemm import _launch_kwargs, tile_map
from xmoe.kernels.tiles import TileConfig

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side tensor descriptors: pointer loads everywhere
    TensorDescriptor = None

FP8_DTYPES = tuple(f.dtype for f in FORMATS.values())


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


_forced_tma: bool | None = None  # uses_tma's answer inside forced_tma, else None: the device's


def uses_tma(device: torch.device) -> bool:
    """Whether fp8_grouped_mm's kernel on ``device`` reads its operands that are not gathered through tensor
    descriptors: NVIDIA GPUs with TMA (sm_90 and newer), where the copies then take no registers or address
    arithmetic (H200: ``benchmarks/results/fp8/sweep_tiles_fp8_tma.md``). AMD GPUs, Ada and the interpreter load
    through pointers, unless ``forced_tma`` says otherwise."""
    if TensorDescriptor is None:
        return False
    if _forced_tma is not None:
        return _forced_tma
    if device.type != "cuda":
        return False
    return _has_tma(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def forced_tma(on: bool) -> Iterator[None]:
    """``uses_tma`` answers ``on`` for every device inside (where Triton has tensor descriptors): pointer-load
    baselines on Hopper (benchmarks/bench_experts.py), the stand-in GPUs of the compile reports (aot.py), and
    descriptors under the interpreter (tests)."""
    global _forced_tma
    before, _forced_tma = _forced_tma, on
    try:
        yield
    finally:
        _forced_tma = before


def _tma_layout(t: torch.Tensor) -> bool:
    """Whether TMA takes t's layout: 16-byte aligned base and strides, unit last stride, no empty dimension."""
    size = t.element_size()
    return (
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and all(st * size % 16 == 0 for st in t.stride()[:-1])
        and all(n > 0 for n in t.shape)
    )


def _descriptors(tensors: tuple[torch.Tensor, ...], block: list[int], on: bool) -> tuple[list, bool]:
    """Tensor descriptors of the tensors, read in ``block`` tiles, and True; or the tensors themselves and False
    where descriptors are off or one of them has a layout TMA does not take (a pair is read one way)."""
    if not (on and all(_tma_layout(t) for t in tensors)):
        return list(tensors), False
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), block) for t in tensors], True


def _format_of(q: torch.Tensor, fmt: str) -> dict:
    """The kernels' format constexprs, after checking that q is held the way quantize_rows stores ``fmt``."""
    form = FORMATS[fmt]
    if q.dtype != form.storage():
        raise ValueError(f"FP8 operand of dtype {q.dtype}; format {fmt} is held as {form.storage()} here")
    return format_constexprs(form)


def _check_fp8(name: str, q: torch.Tensor, ndim: int) -> None:
    if q.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(q.shape)}")
    if q.dtype not in FP8_DTYPES and not (interpreting() and q.dtype == torch.float32):
        raise ValueError(
            f"{name} has dtype {q.dtype}; the FP8 kernels take {FP8_DTYPES} (float32 holding FP8 "
            "values under TRITON_INTERPRET=1)"
        )
    if q.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last (reduction) dimension")


def _check_groups(counts_E: torch.Tensor, *weights: torch.Tensor) -> None:
    check_index("tokens_per_expert_E", counts_E, 1)
    for w in weights:
        if w.shape[0] != counts_E.shape[0]:
            raise ValueError(f"weights hold {w.shape[0]} experts but tokens_per_expert_E has {counts_E.shape[0]}")


def _launch(cfg: TileConfig, dtype: torch.dtype) -> dict:
    return dict(_launch_kwargs(cfg, dtype), GROUP=GROUP)


@kernel_op("fp8_swiglu_up_fwd")
def fp8_swiglu_up_fwd(
    xq: torch.Tensor,
    scale_x: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    w1_EFH: torch.Tensor,
    w3_EFH: torch.Tensor,
    scale1_EFH: torch.Tensor,
    scale3_EFH: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    store_h: bool,
    fmt: str,
    out_dtype: torch.dtype,
    autotune: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h1, h3, aq, scale_a): h1, h3 (N, F) in out_dtype ((0, F) unless store_h) and a = silu(h1) * h3 quantised
    in 1 x G groups. Rows are xq[token_ids_N] when token_ids_N is given, else xq. scale*_EFH: block scales
    indexed [e, f // G, h // G] (a transposed view of quantize_blocks' scale)."""
    for name, q in (("xq", xq), ("w1_EFH", w1_EFH), ("w3_EFH", w3_EFH)):
        _check_fp8(name, q, 3 if name != "xq" else 2)
    _check_groups(tokens_per_expert_E, w1_EFH, w3_EFH)
    check_device(xq, scale_x, w1_EFH, w3_EFH, scale1_EFH, scale3_EFH, tokens_per_expert_E)
    if w1_EFH.stride() != w3_EFH.stride() or scale1_EFH.stride() != scale3_EFH.stride():
        raise ValueError("w1_EFH and w3_EFH (and their scales) must share one layout")
    num_experts, ffn, hidden = w1_EFH.shape
    if xq.shape[1] != hidden:
        raise ValueError(f"xq has {xq.shape[1]} columns but w1_EFH expects hidden size {hidden}")
    num_rows = token_ids_N.shape[0] if token_ids_N is not None else xq.shape[0]
    consts = _format_of(xq, fmt)
    h1 = torch.empty(num_rows if store_h else 0, ffn, dtype=out_dtype, device=xq.device)
    h3 = torch.empty_like(h1)
    aq = torch.empty(num_rows, ffn, dtype=xq.dtype, device=xq.device)
    scale_a = torch.empty(num_rows, cdiv(ffn, GROUP), dtype=torch.float32, device=xq.device)
    if num_rows == 0 or ffn == 0:
        return h1, h3, aq, scale_a

    def launch(cfg: TileConfig) -> None:
        cfg = replace(cfg, block_n=GROUP)  # the epilogue quantises one group of a per row
        map_3T, _ = tile_map(tokens_per_expert_E, num_rows, cfg.block_m)
        _fp8_up_fwd_kernel[(map_3T.shape[1] * cdiv(ffn, GROUP),)](
            xq,
            scale_x,
            token_ids_N if token_ids_N is not None else map_3T,
            w1_EFH,
            w3_EFH,
            scale1_EFH,
            scale3_EFH,
            h1,
            h3,
            aq,
            scale_a,
            map_3T,
            num_experts,
            map_3T.shape[1],
            hidden,
            ffn,
            xq.stride(0),
            scale_x.stride(0),
            w1_EFH.stride(0),
            w1_EFH.stride(1),
            *scale1_EFH.stride(),
            GATHER=token_ids_N is not None,
            STORE_H=store_h,
            EVEN_K=hidden % cfg.block_k == 0,
            EVEN_N=ffn % GROUP == 0,
            **consts,
            **_launch(cfg, xq.dtype),
        )

    launch(tiles.pick("fp8_up", xq.dtype, xq.device, hidden, ffn, num_rows, num_experts, launch, autotune))
    return h1, h3, aq, scale_a


@fp8_swiglu_up_fwd.register_fake
def _(
    xq, scale_x, token_ids_N, w1_EFH, w3_EFH, scale1_EFH, scale3_EFH, tokens_per_expert_E, store_h, fmt, out_dtype,
    autotune=False,
):  # fmt: skip
    num_rows = token_ids_N.shape[0] if token_ids_N is not None else xq.shape[0]
    ffn = w1_EFH.shape[1]
    h = xq.new_empty(num_rows if store_h else 0, ffn, dtype=out_dtype)
    return (
        h,
        torch.empty_like(h),
        xq.new_empty(num_rows, ffn),
        xq.new_empty(num_rows, cdiv(ffn, GROUP), dtype=torch.float32),
    )


def _fp8_mm(a1, sa1, b1_ENK, sb1, a2, sa2, b2_ENK, sb2, counts_E, idx_N, out_dtype, kernel, autotune) -> torch.Tensor:
    _check_fp8("a1", a1, 2)
    _check_fp8("b1_ENK", b1_ENK, 3)
    _check_groups(counts_E, b1_ENK)
    check_device(a1, sa1, b1_ENK, sb1, counts_E)
    if a2 is not None and (
        a2.shape != a1.shape
        or b2_ENK.shape != b1_ENK.shape
        or idx_N is not None
        or a2.stride() != a1.stride()
        or sa2.stride() != sa1.stride()
        or b2_ENK.stride() != b1_ENK.stride()
        or sb2.stride() != sb1.stride()
    ):
        raise ValueError(
            "the second (a, b) pair must match the first one's shapes and layouts, and rows are not gathered"
        )
    num_experts, width, depth = b1_ENK.shape
    if a1.shape[1] != depth:
        raise ValueError(f"a1 has {a1.shape[1]} columns but b1_ENK reduces over {depth}")
    num_rows = idx_N.shape[0] if idx_N is not None else a1.shape[0]
    c = torch.empty(num_rows, width, dtype=out_dtype, device=a1.device)
    if num_rows == 0 or width == 0:
        return c
    if depth == 0:
        return c.zero_()

    tma = uses_tma(a1.device)

    def launch(cfg: TileConfig) -> None:
        map_3T, _ = tile_map(counts_E, num_rows, cfg.block_m)
        halves = cfg.block_n > GROUP  # tiles wider than a scale block run as two halves (_fp8_dot (HALVES))
        a_block, b_block = [cfg.block_m, cfg.block_k], [1, cfg.block_n // 2 if halves else cfg.block_n, cfg.block_k]
        a_pair, a_tma = _descriptors((a1,) if a2 is None else (a1, a2), a_block, tma and idx_N is None)
        b_pair, b_tma = _descriptors((b1_ENK,) if b2_ENK is None else (b1_ENK, b2_ENK), b_block, tma)
        _fp8_grouped_mm_kernel[(map_3T.shape[1] * cdiv(width, cfg.block_n),)](
            a_pair[0],
            a_pair[-1],
            sa1,
            sa2 if a2 is not None else sa1,
            idx_N if idx_N is not None else map_3T,
            b_pair[0],
            b_pair[-1],
            sb1,
            sb2 if a2 is not None else sb1,
            c,
            map_3T,
            num_experts,
            map_3T.shape[1],
            depth,
            width,
            a1.stride(0),
            sa1.stride(0),
            b1_ENK.stride(0),
            b1_ENK.stride(1),
            *sb1.stride(),
            GATHER=idx_N is not None,
            HAS_SECOND=a2 is not None,
            A_TMA=a_tma,
            B_TMA=b_tma,
            EVEN_K=depth % cfg.block_k == 0,
            EVEN_N=width % cfg.block_n == 0,
            HALVES=halves,
            **_launch(cfg, a1.dtype),
        )

    launch(tiles.pick(kernel, a1.dtype, a1.device, depth, width, num_rows, num_experts, launch, autotune))
    return c


@kernel_op("fp8_grouped_mm")
def fp8_grouped_mm(
    a1: torch.Tensor,
    scale_a1: torch.Tensor,
    b1_ENK: torch.Tensor,
    scale_b1: torch.Tensor,
    a2: torch.Tensor | None,
    scale_a2: torch.Tensor | None,
    b2_ENK: torch.Tensor | None,
    scale_b2: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    out_dtype: torch.dtype,
    input_grad: bool,
    autotune: bool = False,
) -> torch.Tensor:
    """c[rows of e] = a1[rows of e] @ b1_ENK[e]^T (+ the same for a2, b2), out_dtype; the a's FP8 in 1 x G groups
    (scale_a: (rows, cdiv(K, G))), the b's FP8 in G x G blocks, K-major (a column slice of N is a view), scale_b
    indexed [e, n // G, k // G]. input_grad: the product is dx = dh1 w1^T + dh3 w3^T (``input_grad_operands``),
    whose tiles the table keeps apart from y = a w2's (fp8_dx, fp8_mm)."""
    return _fp8_mm(
        a1,
        scale_a1,
        b1_ENK,
        scale_b1,
        a2,
        scale_a2,
        b2_ENK,
        scale_b2,
        tokens_per_expert_E,
        None,
        out_dtype,
        "fp8_dx" if input_grad else "fp8_mm",
        autotune,
    )


@fp8_grouped_mm.register_fake
def _(
    a1, scale_a1, b1_ENK, scale_b1, a2, scale_a2, b2_ENK, scale_b2, tokens_per_expert_E, out_dtype, input_grad,
    autotune=False,
):  # fmt: skip
    return a1.new_empty(a1.shape[0], b1_ENK.shape[1], dtype=out_dtype)


@kernel_op("fp8_swiglu_down_bwd")
def fp8_swiglu_down_bwd(
    gq: torch.Tensor,
    scale_g: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    w2_EFH: torch.Tensor,
    scale2_EFH: torch.Tensor,
    h1_NF: torch.Tensor,
    h3_NF: torch.Tensor,
    row_weights_N: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    reuse_h: bool,
    fmt: str,
    autotune: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh1, dh3, a_scaled, grad_row_weights, dhq, scale_dh): grouped_gemm.swiglu_down_bwd with FP8 inputs (gq in
    1 x G groups, read at rows token_ids_N when given; w2_EFH, the FP8 w2 in its own layout, with scale2_EFH indexed
    [e, f // G, h // G]) and, besides the results in h1's dtype (for the weight gradients), dh1 and dh3 quantised in
    1 x G groups for the input gradient, side by side: dhq (N, 2F) holds dh1 in columns :F and dh3 in F:, scale_dh
    (N, 2 cdiv(F, G)) their scales (``input_grad_operands``). reuse_h: as there."""
    if reuse_h and not (h1_NF.is_contiguous() and h3_NF.is_contiguous()):
        raise ValueError("reuse_h writes over h1_NF and h3_NF, which must then be contiguous")
    h1_NF, h3_NF = h1_NF.contiguous(), h3_NF.contiguous()
    num_rows, ffn = h1_NF.shape
    consts = _format_of(gq, fmt)
    has_w = row_weights_N is not None
    da = _fp8_mm(
        gq,
        scale_g,
        w2_EFH,
        scale2_EFH,
        None,
        None,
        None,
        None,
        tokens_per_expert_E,
        token_ids_N,
        h1_NF.dtype,
        "fp8_down_bwd",
        autotune,
    )
    dh3, a = (h3_NF, h1_NF) if reuse_h else (torch.empty_like(h1_NF), torch.empty_like(h1_NF))
    grad_w = torch.empty(num_rows if has_w else 0, dtype=torch.float32, device=h1_NF.device)
    dhq = torch.empty(num_rows, 2 * ffn, dtype=gq.dtype, device=gq.device)
    scale_dh = torch.empty(num_rows, 2 * cdiv(ffn, GROUP), dtype=torch.float32, device=gq.device)
    if num_rows == 0 or ffn == 0:
        return da, dh3, a, grad_w.zero_(), dhq, scale_dh
    block_r = 16 if interpreting() else 8
    # dh1 is written over da: every element is read and then written by the same program in one step
    _fp8_swiglu_bwd_kernel[(cdiv(num_rows, block_r),)](
        da,
        h1_NF,
        h3_NF,
        row_weights_N.float().contiguous() if row_weights_N is not None else da,
        da,
        dh3,
        a,
        grad_w if has_w else da,
        dhq,
        scale_dh,
        num_rows,
        ffn,
        HAS_W=has_w,
        **consts,
        BLOCK_R=block_r,
        GROUP=GROUP,
        num_warps=4,
    )
    return da, dh3, a, grad_w, dhq, scale_dh


@fp8_swiglu_down_bwd.register_fake
def _(
    gq, scale_g, token_ids_N, w2_EFH, scale2_EFH, h1_NF, h3_NF, row_weights_N, tokens_per_expert_E, reuse_h, fmt,
    autotune=False,
):  # fmt: skip
    num_rows, ffn = h1_NF.shape
    num_w = num_rows if row_weights_N is not None else 0
    return (
        torch.empty_like(h1_NF),
        torch.empty_like(h1_NF),
        torch.empty_like(h1_NF),
        h1_NF.new_empty(num_w, dtype=torch.float32),
        gq.new_empty(num_rows, 2 * ffn),
        gq.new_empty(num_rows, 2 * cdiv(ffn, GROUP), dtype=torch.float32),
    )


def input_grad_operands(dhq_N2F: torch.Tensor, scale_dh: torch.Tensor, w13_EHF: torch.Tensor, scale13: torch.Tensor):
    """fp8_grouped_mm's (a1, scale_a1, b1, scale_b1, a2, scale_a2, b2, scale_b2) for dx = dh1 w1^T + dh3 w3^T from
    the side-by-side buffers of fp8_swiglu_down_bwd and quantize_block_pair: one pair of depth 2F where F is a whole
    number of scale groups (the halves' groups then line up), else the two halves as two pairs of depth F."""
    if (dhq_N2F.shape[1] // 2) % GROUP == 0:
        return dhq_N2F, scale_dh, w13_EHF, scale13, None, None, None, None
    (a1, a2), (sa1, sa2), (b1, b2), (sb1, sb2) = (halves(t) for t in (dhq_N2F, scale_dh, w13_EHF, scale13))
    return a1, sa1, b1, sb1, a2, sa2, b2, sb2
