"""Document-masked attention: rows of several documents, where a position sees only the earlier positions of its
own document and its rotary position restarts at each document.

# B sequences, S positions, N query heads, G key/value heads, D head dim, Dv value head dim, R rotary features,
# nQ / nK query / key blocks of ``block_size`` positions

``segments_BS`` (int32, the tokens' shape) gives each input position's document index inside its row: 0-based and
non-decreasing along the row. Then, for positions p and q of one row:

    p attends to q   iff   q <= p and segments[p] == segments[q]
    rotary position of p = p - (the first position of p's document in the row)

so a row holding documents A and B computes exactly what A and B would compute as rows of their own. ``Documents``
holds what the attention of every layer needs, built once per batch by ``Documents.build``:

* on CUDA devices, a FlexAttention ``BlockMask`` (``document_block_mask``): per (row, query block, key block)
  whether the block is empty (skipped), full (no mask evaluated) or partial (the mask evaluated per element). It is
  derived from the documents of each block's first and last positions, O(B * nQ * nK) work with no host
  synchronisation and nothing of size S x S; attention is ``flex_attention`` compiled (eager FlexAttention
  materialises the S x S scores). Inside a compiled region it is traced into the region's graph; a new batch's
  mask (new segments, a new mask function) reuses the compiled code.
* elsewhere, the dense (B, 1, S, S) boolean mask of the same rule for ``scaled_dot_product_attention``
  (FlexAttention has no backward on CPUs). Tests check the block mask against FlexAttention's own
  ``create_block_mask`` and both masks' attention against each other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128  # FlexAttention's default sparse block: its kernels tile a block of 128 by their own tiles


def check_segments_layout(segments_BS: Any, tokens_BS: torch.Tensor) -> None:
    """ValueError naming the problem unless ``segments_BS`` is an integer tensor of the tokens' shape and device;
    nothing read from the device (the values: check_segment_values)."""
    shape = tuple(tokens_BS.shape)
    if not isinstance(segments_BS, torch.Tensor) or segments_BS.dtype not in (torch.int32, torch.int64):
        got = segments_BS.dtype if isinstance(segments_BS, torch.Tensor) else type(segments_BS).__name__
        raise ValueError(f"segments must be an int32 tensor of the tokens' shape {shape}; got {got}")
    if tuple(segments_BS.shape) != shape:
        raise ValueError(f"segments shape {tuple(segments_BS.shape)} must equal the tokens' shape {shape}")
    if segments_BS.device != tokens_BS.device:
        raise ValueError(f"segments are on {segments_BS.device} but the tokens on {tokens_BS.device}; move them")


def check_segment_values(segments_BS: torch.Tensor) -> None:
    """ValueError naming the first bad position unless ``segments_BS`` is >= 0 and non-decreasing along each row
    (one flag read on the host)."""
    bad_BS = segments_BS.diff(dim=1, prepend=segments_BS.new_zeros(segments_BS.shape[0], 1)) < 0
    if bool(bad_BS.any()):
        row, pos = (int(i) for i in bad_BS.nonzero()[0])
        where = (
            f"starts at {int(segments_BS[row, 0])}"
            if pos == 0
            else (f"holds {int(segments_BS[row, pos])} at position {pos} after {int(segments_BS[row, pos - 1])}")
        )
        raise ValueError(
            f"segments must be 0-based document indices, non-decreasing along each row: row {row} {where}; "
            "number each row's documents 0, 1, 2, ... in order"
        )


def rotary_positions(segments_BS: torch.Tensor) -> torch.Tensor:
    """(B, S) int64: each position's offset from the first position of its document in its row."""
    S = segments_BS.shape[1]
    index_S = torch.arange(S, device=segments_BS.device)
    starts_BS = torch.ones_like(segments_BS, dtype=torch.bool)
    starts_BS[:, 1:] = segments_BS[:, 1:] != segments_BS[:, :-1]
    # the last document start at or before each position (a running maximum of the start indices)
    first_BS = torch.where(starts_BS, index_S, 0).cummax(dim=1).values
    return index_S - first_BS


def document_mask_mod(segments_BS: torch.Tensor):
    """FlexAttention's element rule (b, h, q, kv) -> visible: causal, and the same document."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (segments_BS[b, q_idx] == segments_BS[b, kv_idx])

    return mask_mod


def _ordered(blocks_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's layout of a (B, nQ, nK) block set: counts (B, 1, nQ) and the key blocks of each query block first,
    ascending (B, 1, nQ, nK), both int32."""
    num_BQ = blocks_BQK.sum(-1, dtype=torch.int32)
    order_BQK = torch.argsort(blocks_BQK.to(torch.int8), dim=-1, descending=True, stable=True)
    return num_BQ[:, None], order_BQK.to(torch.int32)[:, None]


def document_block_mask(segments_BS: torch.Tensor, block_size: int = FLEX_BLOCK):
    """The FlexAttention BlockMask of the document rule for non-decreasing ``segments_BS`` (one head dimension,
    broadcast over heads).

    With segments non-decreasing, a block's documents are the range [first, last] of its first and last positions,
    and a key block j before query block i ends where i begins or earlier. So, for j <= i:
      1. some pair is visible iff the key block's last document reaches the query block's first
         (kv_last >= q_first; always true on the diagonal);
      2. every pair is visible iff j < i and one document spans both blocks (kv_first == q_last);
      3. the diagonal block is never full (its upper triangle is masked), nor is a block that runs past S (its
         padding counts as masked, as in FlexAttention's own ``create_block_mask``).
    """
    from torch.nn.attention.flex_attention import BlockMask

    S = segments_BS.shape[1]
    device = segments_BS.device
    starts_N = torch.arange(0, S, block_size, device=device)
    first_BN = segments_BS[:, starts_N]
    last_BN = segments_BS[:, (starts_N + block_size - 1).clamp(max=S - 1)]
    n = starts_N.numel()
    causal_QK = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    touched_BQK = causal_QK & (last_BN[:, None, :] >= first_BN[:, :, None])
    whole_N = starts_N + block_size <= S
    full_BQK = (causal_QK.tril(-1) & whole_N[:, None] & whole_N) & (first_BN[:, None, :] == last_BN[:, :, None])
    kv_num, kv_indices = _ordered(touched_BQK & ~full_BQK)
    full_num, full_indices = _ordered(full_BQK)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=block_size,
        mask_mod=document_mask_mod(segments_BS),
        seq_lengths=(S, S),
    )


def document_visible(segments_BS: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) bool: the document rule as a dense mask (True: attend)."""
    S = segments_BS.shape[1]
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=segments_BS.device).tril()
    return ((segments_BS[:, :, None] == segments_BS[:, None, :]) & causal_SS)[:, None]


def uses_flex(device: torch.device) -> bool:
    """Whether documents on ``device`` take FlexAttention (CUDA and ROCm GPUs) rather than the dense mask."""
    return device.type == "cuda"


@dataclass
class Documents:
    """One batch's documents, shared by every layer: the rotary position of each input (B, S) and either the
    FlexAttention block mask (``block_mask``) or the dense mask (``visible_B1SS``)."""

    positions_BS: torch.Tensor
    block_mask: Any = None
    visible_B1SS: torch.Tensor | None = None

    @classmethod
    def build(cls, segments_BS: torch.Tensor, tokens_BS: torch.Tensor) -> Documents:
        """The batch's Documents; ValueError for bad segments (check_segments_layout, check_segment_values) before
        anything uses them. The values
        are checked last: on a GPU their host read waits for the device, and by then the masks' kernels are queued
        behind the previous step's work rather than launched on an idle device after it."""
        check_segments_layout(segments_BS, tokens_BS)
        positions_BS = rotary_positions(segments_BS)
        if uses_flex(segments_BS.device):
            docs = cls(positions_BS, block_mask=document_block_mask(segments_BS))
        else:
            docs = cls(positions_BS, visible_B1SS=document_visible(segments_BS))
        check_segment_values(segments_BS)
        return docs


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def document_attention(
    q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSDv: torch.Tensor, docs: Documents, scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the positions of each query's own document (scale None: 1/sqrt(D)); key/value
    head g serves query heads [g * N/G, (g + 1) * N/G)."""
    grouped = k_BGSD.shape[1] != q_BNSD.shape[1]
    if docs.block_mask is not None:
        # fp32 with q/k wider than 128 (MLA's 192): the default tiles need more shared memory than a Hopper block has
        wide = q_BNSD.dtype == torch.float32 and q_BNSD.shape[-1] > 128
        options = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1} if wide else None
        return _compiled_flex()(
            q_BNSD, k_BGSD, v_BGSDv, block_mask=docs.block_mask, scale=scale, enable_gqa=grouped, kernel_options=options
        )
    if grouped:
        repeat = q_BNSD.shape[1] // k_BGSD.shape[1]
        k_BGSD, v_BGSDv = k_BGSD.repeat_interleave(repeat, dim=1), v_BGSDv.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSDv, attn_mask=docs.visible_B1SS, scale=scale)
