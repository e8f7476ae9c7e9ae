"""Weight gradients of grouped GEMMs over uneven, contiguous row groups: dW_e = A_e^T B_e over expert e's rows.

# T tokens, H hidden, F expert ffn, E experts, N rows (expert-major: expert e owns tokens_per_expert_E[e] rows)

In the fused path: dW2_e = (w a)_e^T g[tok]_e (rows of g gathered by token id) and dW1_e, dW3_e = x[tok]_e^T
(dh1_e, dh3_e) in one pass over the gathered x rows (two accumulators). The kernels (grouped_wgrad_kernels.py)
are chosen per launch by the tile config's ``group`` (xmoe/kernels/tiles.py). Split-K over the rows was not
taken: at these shapes there are 10^4-10^5 output tiles per launch (E * H/128 * F/128), so splitting adds fp32
partial buffers the size of the gradients (~15 GB per weight on the large shape) to shorten reductions that are
already short.

  grouped_wgrad(a, a_idx, b1, b2, b_idx, counts) -> (c1, c2)             new results in a's dtype
  grouped_wgrad_into(a, a_idx, b1, b2, b_idx, counts, c1, c2, flags, f1, f2)
      the same products added into fp32 targets (the parameters' .grad): c += A^T B where flags[f] is set, c =
      A^T B where it is not, then flags[f] set; the kernels do it in their epilogue, the grouped_mm engine and
      the FP8 weight gradients by an add of their result (accumulate.py's accumulate_into)

The Hopper path (``wgrad_engine``): on sm_90 the same products can run as ``torch._grouped_mm`` over row-gathered
operands (PyTorch's grouped GEMM, a TMA-fed, warp-specialised kernel with no split-K), at the cost of one
transient (N, H) gathered buffer. On an H200 it is faster at every model shape, but the gathered buffer is worth
its memory only where experts are many and short (E >= 128, at most 1024 rows each); docs/kernels.md has the
measurements (benchmarks/results/per_gemm.md, bench_experts_wgrad.md, bench_experts_small_grouped_mm.md).
"""

from __future__ import annotations

import torch

from xmoe.kernels import tiles
from xmoe.kernels._common import cdiv, check_device, check_index, kernel_op
from xmoe.kernels.accumulate import accumulate_into
from xmoe.kernels.grouped_gemm import _launch_kwargs, tile_map
from xmoe.kernels.grouped_wgrad_kernels import _grouped_wgrad_flat_kernel, _grouped_wgrad_kernel
from xmoe.kernels.tiles import TileConfig


def _checked(a, a_idx_N, b1, b2, b_idx_N, counts_E):
    """(a, b1, b2) contiguous, after the checks both ops share, and the number of rows."""
    if a_idx_N is not None and b_idx_N is not None:
        raise ValueError("grouped_wgrad gathers the rows of a or of b, not both")
    a, b1 = a.contiguous(), b1.contiguous()
    b2 = b2.contiguous() if b2 is not None else None
    check_index("tokens_per_expert_E", counts_E, 1)
    check_device(a, b1, counts_E)
    if b1.dtype != a.dtype or (b2 is not None and b2.dtype != a.dtype):
        raise ValueError(f"wgrad operands must share one dtype, got {a.dtype} and {b1.dtype}")
    return a, b1, b2, a_idx_N.shape[0] if a_idx_N is not None else a.shape[0]


def _by_grouped_mm(a, a_idx_N, b_idx_N, num_rows, num_experts, width_b) -> bool:
    return (
        a_idx_N is None
        and b_idx_N is None
        and num_experts > 0
        and wgrad_engine(a, num_rows, num_experts, a.shape[1], width_b) == "grouped_mm"
    )


@kernel_op("grouped_wgrad")
def grouped_wgrad(
    a: torch.Tensor,
    a_idx_N: torch.Tensor | None,
    b1: torch.Tensor,
    b2: torch.Tensor | None,
    b_idx_N: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(c1, c2): c[e] = A_e^T B_e over expert e's rows, A rows = a[a_idx_N] (or a), B rows = b[b_idx_N] (or b).
    c2 is empty when b2 is None. Without row ids, where ``wgrad_engine`` says so, by torch._grouped_mm."""
    a, b1, b2, num_rows = _checked(a, a_idx_N, b1, b2, b_idx_N, tokens_per_expert_E)
    num_experts, width_a, width_b = tokens_per_expert_E.shape[0], a.shape[1], b1.shape[1]
    if _by_grouped_mm(a, a_idx_N, b_idx_N, num_rows, num_experts, width_b):
        offs_E = torch.cumsum(tokens_per_expert_E, 0, dtype=torch.int32)
        return (
            grouped_mm_wgrad(a, b1, offs_E),
            grouped_mm_wgrad(a, b2, offs_E) if b2 is not None else a.new_empty(0, width_a, width_b),
        )
    c1 = a.new_empty(num_experts, width_a, width_b)
    c2 = a.new_empty(num_experts if b2 is not None else 0, width_a, width_b)
    if num_rows == 0 or num_experts == 0:
        return c1.zero_(), c2.zero_()
    if width_a == 0 or width_b == 0:
        return c1, c2
    _run(a, a_idx_N, b1, b2, b_idx_N, tokens_per_expert_E, num_rows, c1, c2, None)
    return c1, c2


@grouped_wgrad.register_fake
def _(a, a_idx_N, b1, b2, b_idx_N, tokens_per_expert_E):
    num_experts = tokens_per_expert_E.shape[0]
    return (
        a.new_empty(num_experts, a.shape[1], b1.shape[1]),
        a.new_empty(num_experts if b2 is not None else 0, a.shape[1], b1.shape[1]),
    )


@kernel_op("grouped_wgrad_into", mutates_args=("c1", "c2", "flags"))
def grouped_wgrad_into(
    a: torch.Tensor,
    a_idx_N: torch.Tensor | None,
    b1: torch.Tensor,
    b2: torch.Tensor | None,
    b_idx_N: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor | None,
    flags: torch.Tensor,
    flag1: int,
    flag2: int,
) -> None:
    """grouped_wgrad's (c1, c2) added into fp32 (E, M, NC) targets: c1 += A^T B1 where flags[flag1] is nonzero,
    c1 = A^T B1 where it is 0 (c1's values are then not read), the same for c2 (given with b2) by flags[flag2];
    then those flags are set. flags: int32, 1-D."""
    a, b1, b2, num_rows = _checked(a, a_idx_N, b1, b2, b_idx_N, tokens_per_expert_E)
    num_experts, width_a, width_b = tokens_per_expert_E.shape[0], a.shape[1], b1.shape[1]
    targets = ((c1, flag1),) + (((c2, flag2),) if b2 is not None else ())
    if (c2 is None) != (b2 is None):
        raise ValueError("grouped_wgrad_into takes c2 exactly when it takes b2")
    if flags.dim() != 1 or flags.dtype != torch.int32 or not all(0 <= f < flags.shape[0] for _, f in targets):
        raise ValueError(f"flags must be a 1-D int32 tensor holding indices {[f for _, f in targets]}")
    for c, _ in targets:
        if c.shape != (num_experts, width_a, width_b) or c.dtype != torch.float32 or not c.is_contiguous():
            raise ValueError(
                f"a gradient target must be a contiguous float32 tensor of shape {(num_experts, width_a, width_b)}, "
                f"got {c.dtype} {tuple(c.shape)}"
            )
    check_device(a, c1, flags)
    if _by_grouped_mm(a, a_idx_N, b_idx_N, num_rows, num_experts, width_b):
        offs_E = torch.cumsum(tokens_per_expert_E, 0, dtype=torch.int32)
        for (c, f), b in zip(targets, (b1, b2), strict=False):
            accumulate_into(c, grouped_mm_wgrad(a, b, offs_E), flags, f)
        return
    if num_experts and width_a and width_b:  # no rows: the kernels still write (or add) each expert's zeros
        _run(a, a_idx_N, b1, b2, b_idx_N, tokens_per_expert_E, num_rows, c1, c2, (flags, flag1, flag2))
    for _, f in targets:
        flags[f] = 1


@grouped_wgrad_into.register_fake
def _(a, a_idx_N, b1, b2, b_idx_N, tokens_per_expert_E, c1, c2, flags, flag1, flag2):
    return None


def _run(a, a_idx_N, b1, b2, b_idx_N, counts_E, num_rows, c1, c2, into) -> None:
    """Pick the tile config and launch. ``into`` (flags, flag1, flag2): the accumulating epilogue; autotuning then
    times its candidates on scratch results (store-only), so that the targets are written once."""
    kernel = "wgrad2" if b2 is not None else "wgrad"
    operands = (a, a_idx_N, b1, b2, b_idx_N)
    num_experts, width_a, width_b = c1.shape
    scratch: list[tuple] = []

    def trial(cfg: TileConfig) -> None:
        if into is None:
            _launch_wgrad(cfg, counts_E, num_rows, *operands, c1, c2, None)
            return
        if not scratch:
            scratch.append((torch.empty_like(c1), torch.empty_like(c2) if c2 is not None else None))
        _launch_wgrad(cfg, counts_E, num_rows, *operands, *scratch[0], None)

    cfg = tiles.pick(kernel, a.dtype, a.device, width_a, width_b, num_rows, num_experts, trial)
    _launch_wgrad(cfg, counts_E, num_rows, *operands, c1, c2, into)


def _launch_wgrad(cfg, counts_E, num_rows, a, a_idx_N, b1, b2, b_idx_N, c1, c2, into) -> None:
    num_experts, width_a, width_b = c1.shape
    # operands past the flags: a launch reads a_idx / b_idx / b2 / c2 / the gradient flags only when its flag says so
    common = (
        a,
        a_idx_N if a_idx_N is not None else counts_E,
        b1,
        b2 if b2 is not None else b1,
        b_idx_N if b_idx_N is not None else counts_E,
        c1,
        c2 if b2 is not None else c1,
        *(into if into is not None else (counts_E, 0, 0)),
    )
    flags = dict(
        A_GATHER=a_idx_N is not None,
        B_GATHER=b_idx_N is not None,
        HAS_SECOND=b2 is not None,
        EVEN_M=width_a % cfg.block_m == 0,
        EVEN_N=width_b % cfg.block_n == 0,
        ACCUMULATE=into is not None,
        **_launch_kwargs(cfg, a.dtype),
    )
    tiles_mn = cdiv(width_a, cfg.block_m) * cdiv(width_b, cfg.block_n)
    if cfg.group == 1:
        import os

        mode = {"atomic": 1, "load": 2, "tma": 3}[os.environ.get("XMOE_WGRAD_EPILOGUE", "atomic")]
        if mode == 3:
            from triton.tools.tensor_descriptor import TensorDescriptor

            common = list(common)
            for i in (5, 6):
                common[i] = TensorDescriptor.from_tensor(common[i], [1, cfg.block_m, cfg.block_n])
        _, bounds_3E = tile_map(counts_E, num_rows, cfg.block_m)
        order_E = torch.argsort(counts_E, descending=True)  # longest-first: shorter tail when skewed
        _grouped_wgrad_kernel[(num_experts * tiles_mn,)](
            *common, bounds_3E, order_E, num_experts, width_a, width_b, a.stride(0), b1.stride(0), MODE=mode, **flags
        )
        return
    # row tiles of block_k rows (the reduction step), so that no tile straddles two experts
    map_3T, bounds_3E = tile_map(counts_E, num_rows, cfg.block_k)
    num_groups = cdiv(num_experts, cfg.group)
    group_of_e = torch.arange(num_experts, device=counts_E.device) // cfg.group
    group_rows = torch.zeros(num_groups, dtype=counts_E.dtype, device=counts_E.device).index_add_(
        0, group_of_e, counts_E
    )
    order_G = torch.argsort(group_rows, descending=True)  # longest groups first, as for single experts
    _grouped_wgrad_flat_kernel[(num_groups * tiles_mn,)](
        *common,
        map_3T,
        bounds_3E,
        order_G,
        num_experts,
        map_3T.shape[1],
        width_a,
        width_b,
        a.stride(0),
        b1.stride(0),
        GROUP=cfg.group,
        **flags,
    )


# Where "auto" takes the Hopper path (module docstring): many experts with short reductions.
GROUPED_MM_MIN_EXPERTS = 128
GROUPED_MM_MAX_ROWS_PER_EXPERT = 1024


def _is_sm90(device_index: int) -> bool:
    # not functools.cache'd: dynamo traces this from the autograd Function's backward (and warns about caches);
    # torch keeps the device properties behind get_device_capability
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index) == (9, 0)


def wgrad_engine(x: torch.Tensor, num_rows: int, num_experts: int, hidden: int, ffn: int) -> str:
    """ "grouped_mm" or "triton": what computes the weight gradients for these operands (grouped_wgrad without row
    ids; the fused backward gathers its rows first when this says "grouped_mm"). hidden, ffn: the two widths.

    ``tiles.OPTIONS.wgrad`` (a run's ``kernels.wgrad``): "triton" always the kernels above; "grouped_mm"
    torch._grouped_mm wherever it runs (bf16; on CPU also fp32 in builds with its CPU kernel; tests use this on
    CPU); "auto" (default) grouped_mm on sm_90 in bf16 with at least GROUPED_MM_MIN_EXPERTS experts averaging at
    most GROUPED_MM_MAX_ROWS_PER_EXPERT rows; "fp8" (FP8 weight gradients, fp8_wgrad.py) as "auto" for the
    bf16 ones it does not concern. Either way H and F must be multiples of 8 (its 16-byte stride rule)
    and there must be rows; otherwise "triton"."""
    mode = tiles.OPTIONS.wgrad
    usable = (
        hasattr(torch, "_grouped_mm")
        and hidden % 8 == 0
        and ffn % 8 == 0
        and num_rows > 0
        # its GPU kernels and torch.compile's shape function take bf16 only; the CPU kernel fp32 too
        and (
            x.dtype == torch.bfloat16
            or (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling())
        )
    )
    if mode == "triton" or not usable:
        return "triton"
    if mode == "grouped_mm":
        return "grouped_mm"
    return (
        "grouped_mm"
        if (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and _is_sm90(x.device.index or 0)
            and num_experts >= GROUPED_MM_MIN_EXPERTS
            and num_rows <= GROUPED_MM_MAX_ROWS_PER_EXPERT * num_experts
        )
        else "triton"
    )


def grouped_mm_wgrad(a_NM: torch.Tensor, b_NK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """c[e] = a_e^T b_e over the contiguous row groups ending at offs_E (int32 cumulative counts), by
    torch._grouped_mm; a and b are (N, M) and (N, K) rows already in expert order."""
    return torch._grouped_mm(a_NM.t(), b_NK, offs=offs_E)  # (E, M, K)
