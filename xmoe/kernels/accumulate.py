"""A weight gradient computed in a narrower dtype added into its fp32 parameter's .grad, in Triton: one pass.

The routed experts compute with bf16 copies of their fp32 weights, made once per optimizer step (xmoe/moe/step.py);
each backward's bf16 weight gradient is then added into the fp32 .grad (or becomes it, upcast, when there is
none yet). torch does both as a dtype-converting elementwise op, which it runs unvectorised. This kernel reads
each narrow value once, converts it in registers and writes (or reads, adds and writes) the fp32 value: 6 (or
10) bytes per weight, the sum in the same order as torch's (fp32 + fp32(narrow)), so the results are bitwise
torch's. On an H200, 2.2B weights (benchmarks/bench_optimizer.py, one run, benchmarks/results/train/bench_optimizer.md):
upcast 6.30 ms by torch (about 2.1 TB/s) against 3.38 ms here (3.9 TB/s); add 7.88 against 5.24 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xmoe.kernels import reference
from xmoe.kernels._common import cdiv, check_device, interpreting

BLOCK = 4096  # elements per program: 16 KiB of fp32 written, 8 KiB of bf16 read


@triton.jit
def _accumulate_kernel(
    dst_ptr,  # (n,) fp32 contiguous: read only when ADD
    src_ptr,  # (n,) bf16/fp16/fp32 contiguous
    n,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    value = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
    if ADD:
        value = tl.load(dst_ptr + offs, mask=mask) + value
    tl.store(dst_ptr + offs, value, mask=mask)


def accumulate_grad(grad: torch.Tensor | None, update: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad + update`` written into ``grad`` (None: ``update`` as a new tensor of ``dtype``); both contiguous,
    of one shape. Other layouts or a target dtype other than fp32 take torch's path."""
    fast = dtype == torch.float32 and update.is_contiguous() and (grad is None or grad.is_contiguous())
    if grad is not None:
        if grad.shape != update.shape:
            raise ValueError(f"a gradient of shape {tuple(update.shape)} cannot add into one of {tuple(grad.shape)}")
        fast = fast and grad.dtype == torch.float32
    if not fast:
        return reference.accumulate_grad(grad, update, dtype)
    check_device(update, *(() if grad is None else (grad,)))
    out = torch.empty(update.shape, dtype=dtype, device=update.device) if grad is None else grad
    n = update.numel()
    if n:
        block = 64 if interpreting() else BLOCK
        _accumulate_kernel[(cdiv(n, block),)](out, update, n, ADD=grad is not None, BLOCK=block, num_warps=8)
    return out
