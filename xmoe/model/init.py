"""Layout-independent initial values: what a parameter starts from depends on the seed, its name and the global
indices an element has, never on how the parameter is sharded or on which rank holds it.

# R rows per block, E experts, H hidden, F expert ffn

Every parameter is cut along dim 0 into blocks of R rows, R a function of its global shape only: one row for a
3-D stack (an expert stack (E, H, F): one block per expert), else as many rows as hold about 2^20 values. Block b
of parameter ``name`` is drawn whole, fp32, by a generator of its own seeded from (seed, name, b), on the device
that holds the parameter. A shard covering rows [r0, r1) and any box of the other dimensions (FSDP2 shards dim 0,
or dim 1 of expert stacks; tensor parallelism dim 0 or dim 1) draws only the blocks its rows overlap and copies
its box out of each. So a one-process model, a model built on the meta device and materialised shard by shard,
and any dp x ep x tp layout hold bitwise the same global values (tests/test_build.py gathers them to check);
at most one block (one expert matrix, or ~4 MiB) is allocated besides the shard.

Values are deterministic per device type (CPU and CUDA generators differ), like any torch.Generator stream.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

BLOCK_VALUES = 2**20  # values per generator block of a 1-D or 2-D parameter


def block_rows(shape: Sequence[int]) -> int:
    """Rows per generator block of a parameter of global ``shape`` (a function of the shape alone)."""
    if len(shape) >= 3:
        return 1
    return max(1, BLOCK_VALUES // max(1, math.prod(shape[1:])))


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of block ``block`` of parameter ``name`` (63 bits, stable across Python runs)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's values, the global shape, the global offset of their first element) of a plain tensor or a
    DTensor; a DTensor's local shard is one contiguous box of the global tensor for every placement xmoe uses
    (Shard, and FSDP2's strided shard over a TP-sharded dimension)."""
    if not hasattr(param, "to_local"):
        return param, tuple(param.shape), (0,) * param.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dtensor = cast("DTensor", param)  # a tensor with to_local is a DTensor
    local = dtensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, dtensor.device_mesh, dtensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(
            f"local shard of shape {tuple(local.shape)} is not the box {tuple(shape)} at "
            f"{tuple(offset)} of its global {tuple(param.shape)} tensor"
        )
    return local, tuple(param.shape), tuple(offset)


def normal_(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill ``param`` (plain or DTensor) with normal(0, std) values by the rule in the module docstring."""
    normal_box_(*local_box(param), std, seed, name)


@torch.no_grad()
def normal_box_(
    local: torch.Tensor, shape: Sequence[int], offset: Sequence[int], std: float, seed: int, name: str
) -> None:
    """Fill ``local``, the box at ``offset`` of a global tensor of ``shape``, with that box's values."""
    if local.numel() == 0:
        return
    rows = block_rows(shape)
    r0, r1 = offset[0], offset[0] + local.shape[0]
    box = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=False))
    for block in range(r0 // rows, (r1 - 1) // rows + 1):
        start = block * rows
        values = torch.empty((min(rows, shape[0] - start), *shape[1:]), device=local.device)
        gen = torch.Generator(device=local.device).manual_seed(block_seed(seed, name, block))
        values.normal_(0.0, std, generator=gen)
        lo, hi = max(r0, start), min(r1, start + values.shape[0])
        local[lo - r0 : hi - r0].copy_(values[(slice(lo - start, hi - start), *box)])
