"""Each mixture source's training loss over a logging window, counted on the device beside the step's own loss.

# B sequences, S positions, T = B * S tokens, H hidden, V vocabulary, C tokens per chunk, M sources

The model returns one mean loss per micro-batch, so the per-source losses are computed beside it: a forward hook on
the final norm takes its output h (the loss head's input), and without gradients each row's cross-entropy sum is
made from h and the head weight, chunk by chunk, and added into its source's (nats, tokens). That is one more head
forward (2 T H V FLOPs, no backward) per micro-batch, spent only when the data is a mixture. Targets equal to
IGNORE_INDEX count in neither sum, as in the model's loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from xmoe.model.loss import IGNORE_INDEX

CHUNK_TOKENS = 4096  # rows of (C, V) fp32 logits at a time, as the loss head's own chunks


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (tensor or sequence parallelism) as its whole value on every rank; a tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class SourceLosses:
    """Per-source (nats, tokens) summed over the micro-batches since the last ``take``, on ``device``."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = names
        self.sums_M2 = torch.zeros(len(names), 2, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, h_BSH: torch.Tensor, head_VH: torch.Tensor, targets_BS: torch.Tensor, sources_B: torch.Tensor):
        h_TH, targets_T = _full(h_BSH).detach().flatten(0, 1), targets_BS.flatten()
        S = targets_BS.shape[1]
        source_T = sources_B.to(h_TH.device).repeat_interleave(S)
        for i in range(0, h_TH.shape[0], CHUNK_TOKENS):
            logits_CV = F.linear(h_TH[i : i + CHUNK_TOKENS], head_VH).float()
            t_C = targets_T[i : i + CHUNK_TOKENS]
            nats_C = F.cross_entropy(logits_CV, t_C, ignore_index=IGNORE_INDEX, reduction="none").double()
            both_C2 = torch.stack([nats_C, (t_C != IGNORE_INDEX).double()], dim=1)
            self.sums_M2.index_add_(0, source_T[i : i + CHUNK_TOKENS], both_C2)

    @contextlib.contextmanager
    def watching(self, model: nn.Module, targets_BS: torch.Tensor, sources_B: torch.Tensor) -> Iterator[None]:
        """While open, each forward of ``model`` adds its rows' losses (its final norm's output through its head)."""

        def hook(module: nn.Module, inputs: tuple, h_BSH: torch.Tensor) -> None:
            self.add(h_BSH, _full(model.get_parameter("head.weight")), targets_BS, sources_B)

        handle = model.get_submodule("norm").register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def take(self) -> torch.Tensor:
        """(M, 2) float64: the sums since the last take; the counters restart."""
        sums = self.sums_M2.clone()
        self.sums_M2.zero_()
        return sums
