"""SwiGLU experts as grouped GEMMs over uneven, contiguous row groups, forward and backward: the registered ops
and their launchers (argument checks, tile picks, grids); the Triton kernels, and how they schedule row tiles
without a host sync, are in grouped_gemm_kernels.py.

# N rows (expert-major: expert e owns tokens_per_expert_E[e] rows), E experts, H hidden, F expert ffn

  tile_map         each row tile's (expert, first row, end row) for one BLOCK_M, built on device (_tile_map_kernel)
  swiglu_up_fwd    h1, h3 and a = silu(h1) * h3 of x or of x[token_ids_N] (_swiglu_up_fwd_kernel)
  grouped_mm       c = a1 b1_e (+ a2 b2_e): y = a w2_e, dx = dh1 w1_e^T + dh3 w3_e^T (_grouped_mm_kernel)
  swiglu_down_bwd  da = g w2_e^T (_grouped_mm_kernel), then dh1, dh3, the combine-weighted a and the combine-weight
                   gradient in one elementwise pass (_swiglu_bwd_kernel)
Each GEMM's tile is tiles.pick's for the kernel name it passes (up_fwd, mm, dx, down_bwd), tuned where the caller's
``autotune`` (its kernels.autotune) says so; fp8_gemm.py and grouped_wgrad.py launch over the same tile maps with the
same launch options (tile_map, _launch_kwargs).
"""

from __future__ import annotations

import torch

from xmoe.kernels import tiles
from xmoe.kernels._common import cdiv, check_device, check_float, check_index, interpreting, kernel_op, next_pow2
from xmoe.kernels.grouped_gemm_kernels import (
    _grouped_mm_kernel,
    _swiglu_bwd_kernel,
    _swiglu_up_fwd_kernel,
    _tile_map_kernel,
)
from xmoe.kernels.tiles import TileConfig


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 stays exact; 16-bit dots ignore the setting, so they take the backend's default (HIP on gfx90a refuses
    # to compile a dot that names "tf32", whatever its inputs)
    return "ieee" if dtype == torch.float32 else None


def _launch_kwargs(cfg: TileConfig, dtype: torch.dtype) -> dict:
    return dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION=_dot_precision(dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def tile_map(counts_E: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(map (3, num_tiles), bounds (3, E)) int32 for row-grouped launches, built on device (no host sync).

    num_tiles = cdiv(num_rows, block_m) + E bounds sum_e cdiv(n_e, block_m); the programs past the real tiles
    read expert E and exit at once."""
    num_experts = counts_E.shape[0]
    num_tiles = cdiv(num_rows, block_m) + num_experts
    map_3T = torch.empty(3, num_tiles, dtype=torch.int32, device=counts_E.device)
    bounds_3E = torch.empty(3, num_experts, dtype=torch.int32, device=counts_E.device)
    block_t = 64
    _tile_map_kernel[(cdiv(num_tiles, block_t),)](
        counts_E,
        map_3T,
        bounds_3E,
        num_experts,
        num_tiles,
        BLOCK_M=block_m,
        BLOCK_E=next_pow2(max(num_experts, 1)),
        BLOCK_T=block_t,
        num_warps=4,
    )
    return map_3T, bounds_3E


def _check_experts(x: torch.Tensor, counts_E: torch.Tensor, *weights: torch.Tensor) -> None:
    check_index("tokens_per_expert_E", counts_E, 1)
    check_device(x, counts_E, *weights)
    for w in weights:
        if w.dtype != x.dtype:
            raise ValueError(f"expert weights ({w.dtype}) and activations ({x.dtype}) must share one dtype")
        if w.shape[0] != counts_E.shape[0]:
            raise ValueError(f"weights hold {w.shape[0]} experts but tokens_per_expert_E has {counts_E.shape[0]}")


@kernel_op("swiglu_up_fwd")
def swiglu_up_fwd(
    x: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    w1_EHF: torch.Tensor,
    w3_EHF: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    store_h: bool,
    autotune: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h1, h3, a) of shape (N, F); rows are x[token_ids_N] when token_ids_N is given, else x. h1/h3 are (0, F)
    unless store_h."""
    check_float("x", x, 2)
    check_float("w1_EHF", w1_EHF, 3)
    _check_experts(x, tokens_per_expert_E, w1_EHF, w3_EHF)
    if w1_EHF.stride() != w3_EHF.stride() or w1_EHF.shape != w3_EHF.shape:
        w1_EHF, w3_EHF = w1_EHF.contiguous(), w3_EHF.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_experts, hidden, ffn = w1_EHF.shape
    if x.shape[1] != hidden:
        raise ValueError(f"x has {x.shape[1]} columns but w1_EHF expects hidden size {hidden}")
    num_rows = token_ids_N.shape[0] if token_ids_N is not None else x.shape[0]
    a = x.new_empty(num_rows, ffn)
    h1 = x.new_empty(num_rows if store_h else 0, ffn)
    h3 = x.new_empty(num_rows if store_h else 0, ffn)
    if num_rows == 0 or ffn == 0:
        return h1, h3, a

    def launch(cfg: TileConfig) -> None:
        map_3T, _ = tile_map(tokens_per_expert_E, num_rows, cfg.block_m)
        _swiglu_up_fwd_kernel[(map_3T.shape[1] * cdiv(ffn, cfg.block_n),)](
            x,
            token_ids_N if token_ids_N is not None else map_3T,
            w1_EHF,
            w3_EHF,
            h1,
            h3,
            a,
            map_3T,
            num_experts,
            map_3T.shape[1],
            hidden,
            ffn,
            x.stride(0),
            *w1_EHF.stride(),
            GATHER=token_ids_N is not None,
            STORE_H=store_h,
            EVEN_K=hidden % cfg.block_k == 0,
            EVEN_N=ffn % cfg.block_n == 0,
            **_launch_kwargs(cfg, x.dtype),
        )

    launch(tiles.pick("up_fwd", x.dtype, x.device, hidden, ffn, num_rows, num_experts, launch, autotune))
    return h1, h3, a


@swiglu_up_fwd.register_fake
def _(x, token_ids_N, w1_EHF, w3_EHF, tokens_per_expert_E, store_h, autotune=False):
    num_rows = token_ids_N.shape[0] if token_ids_N is not None else x.shape[0]
    ffn = w1_EHF.shape[2]
    h_rows = num_rows if store_h else 0
    return x.new_empty(h_rows, ffn), x.new_empty(h_rows, ffn), x.new_empty(num_rows, ffn)


def _grouped_mm(a1, b1_EKN, a2, b2_EKN, tokens_per_expert_E, idx_N, kernel: str, autotune: bool) -> torch.Tensor:
    check_float("a1", a1, 2)
    check_float("b1_EKN", b1_EKN, 3)
    _check_experts(a1, tokens_per_expert_E, b1_EKN, *([b2_EKN] if a2 is not None else []))
    if a2 is not None and (a2.shape != a1.shape or b2_EKN.shape != b1_EKN.shape or idx_N is not None):
        raise ValueError("the second (a, b) pair must match the first one's shapes, and rows are not gathered")
    a1, a2 = [a if a is None or a.stride(-1) == 1 else a.contiguous() for a in (a1, a2)]
    if a2 is not None and (b2_EKN.stride() != b1_EKN.stride() or a2.stride() != a1.stride()):
        a1, a2, b1_EKN, b2_EKN = a1.contiguous(), a2.contiguous(), b1_EKN.contiguous(), b2_EKN.contiguous()
    num_experts, depth, width = b1_EKN.shape
    num_rows = idx_N.shape[0] if idx_N is not None else a1.shape[0]
    c = a1.new_empty(num_rows, width)
    if num_rows == 0 or width == 0:
        return c
    if depth == 0:
        return c.zero_()

    def launch(cfg: TileConfig) -> None:
        map_3T, _ = tile_map(tokens_per_expert_E, num_rows, cfg.block_m)
        _grouped_mm_kernel[(map_3T.shape[1] * cdiv(width, cfg.block_n),)](
            a1,
            a2 if a2 is not None else a1,
            idx_N if idx_N is not None else map_3T,
            b1_EKN,
            b2_EKN if b2_EKN is not None else b1_EKN,
            c,
            map_3T,
            num_experts,
            map_3T.shape[1],
            depth,
            width,
            a1.stride(0),
            *b1_EKN.stride(),
            GATHER=idx_N is not None,
            HAS_SECOND=a2 is not None,
            EVEN_K=depth % cfg.block_k == 0,
            EVEN_N=width % cfg.block_n == 0,
            **_launch_kwargs(cfg, a1.dtype),
        )

    launch(tiles.pick(kernel, a1.dtype, a1.device, depth, width, num_rows, num_experts, launch, autotune))
    return c


@kernel_op("grouped_mm")
def grouped_mm(
    a1: torch.Tensor,
    b1_EKN: torch.Tensor,
    a2: torch.Tensor | None,
    b2_EKN: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    autotune: bool = False,
) -> torch.Tensor:
    """c[rows of e] = a1[rows of e] @ b1_EKN[e] (+ a2[rows of e] @ b2_EKN[e]); b may be a strided view (a
    transpose, a column slice)."""
    return _grouped_mm(a1, b1_EKN, a2, b2_EKN, tokens_per_expert_E, None, "mm" if a2 is None else "dx", autotune)


@grouped_mm.register_fake
def _(a1, b1_EKN, a2, b2_EKN, tokens_per_expert_E, autotune=False):
    return a1.new_empty(a1.shape[0], b1_EKN.shape[2])


@kernel_op("swiglu_down_bwd")
def swiglu_down_bwd(
    g: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    w2_EFH: torch.Tensor,
    h1_NF: torch.Tensor,
    h3_NF: torch.Tensor,
    row_weights_N: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    reuse_h: bool,
    autotune: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh1, dh3, a_scaled, grad_row_weights) given the gradient g of y = (row_weights *) (silu(h1) * h3) w2.

    1. da = g[token_ids_N] w2_e^T (grouped GEMM reading g rows by token id when token_ids_N is given);
    2. one elementwise pass: a = silu(h1) * h3 recomputed, dh1, dh3 and a_scaled = row_weights * a (the wgrad
       operand of w2), and grad_row_weights[n] = <da_n, a_n> (fp32; empty when row_weights_N is None).
    dh1 is written over da (one (N, F) buffer less). With reuse_h, a_scaled is written over h1 and dh3 over h3:
    the backward then allocates one (N, F) buffer instead of four, and h1/h3 hold gradients afterwards (the
    caller bumps their version, so a second backward through the same graph fails loudly)."""
    if reuse_h and not (h1_NF.is_contiguous() and h3_NF.is_contiguous()):
        raise ValueError("reuse_h writes over h1_NF and h3_NF, which must then be contiguous")
    h1_NF, h3_NF = h1_NF.contiguous(), h3_NF.contiguous()
    num_rows, ffn = h1_NF.shape
    has_w = row_weights_N is not None
    da = _grouped_mm(g, w2_EFH.transpose(1, 2), None, None, tokens_per_expert_E, token_ids_N, "down_bwd", autotune)
    dh1 = da  # the elementwise pass writes dh1 over da
    dh3, a = (h3_NF, h1_NF) if reuse_h else (torch.empty_like(h1_NF), torch.empty_like(h1_NF))
    grad_w = torch.empty(num_rows if has_w else 0, dtype=torch.float32, device=h1_NF.device)
    if num_rows == 0 or ffn == 0:
        return dh1, dh3, a, grad_w.zero_()
    block_r, block_f = (16, 32) if interpreting() else (8, min(512, next_pow2(ffn)))
    # every element is read (da, h1, h3) and then written (dh1, dh3, a) by the same program in one step, so
    # the outputs may alias the inputs
    _swiglu_bwd_kernel[(cdiv(num_rows, block_r),)](
        da,
        h1_NF,
        h3_NF,
        row_weights_N.float().contiguous() if row_weights_N is not None else da,
        dh1,
        dh3,
        a,
        grad_w if has_w else da,
        num_rows,
        ffn,
        HAS_W=has_w,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        num_warps=4,
    )
    return dh1, dh3, a, grad_w


@swiglu_down_bwd.register_fake
def _(g, token_ids_N, w2_EFH, h1_NF, h3_NF, row_weights_N, tokens_per_expert_E, reuse_h, autotune=False):
    num_w = h1_NF.shape[0] if row_weights_N is not None else 0
    return (
        torch.empty_like(h1_NF),
        torch.empty_like(h1_NF),
        torch.empty_like(h1_NF),
        h1_NF.new_empty(num_w, dtype=torch.float32),
    )


def can_reuse_saved() -> bool:
    """Whether a backward may write gradients over its saved h1/h3: not under torch.compile (the ops declare no
    mutation)."""
    return not torch.compiler.is_compiling()
