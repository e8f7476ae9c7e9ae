"""The expert-parallel layer's row all-to-alls recorded, replayed alone, or replaced by local copies: how
benchmarks/bench_ep.py splits a layer call's time into its compute and the communication that no compute hid,
with CUDA events (host timers on CPUs) and no profiler.

# N rows sent, M rows received, W payload width (H values; FP8 dispatch: H + 4 H / 128 bytes)

Every row exchange of the flat dispatcher (xmoe/dispatch/alltoall.py), forward and backward, is one call of
``xmoe.dispatch.comm.Exchange.post`` (the dispatch, the combine, and the reverse exchange of each in backward).
Patching that one method leaves the rest of the layer as it is:
  recording(log)   each post's payload width, dtype and splits appended to ``log``; the exchange runs as usual
  local_copies()   each post replaced by a local copy of the same shape: the (M, W) receive buffer gets the first
                   min(N, M) sent rows and zeros after them, and no collective runs. Kernels, host syncs and the
                   count exchange stay as they are: the layer's compute-only counterpart
  replay(log)      the recorded exchanges alone, blocking, one after another, from buffers made beforehand: the
                   layer call's all-to-all time with nothing to hide it
The count exchange (P x E_local integers, then the layer call's one host sync) is not a row exchange: it stays real
under all three. RBD moves expert ids through other collectives (the receiver indexes with them), so copies there
would change the work: only the flat dispatcher's layer is split this way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

from xmoe.dispatch.comm import Exchange


@dataclass(frozen=True)
class Record:
    """One posted row exchange: what it sent (rows of ``width`` elements of ``dtype``) and its splits."""

    width: tuple[int, ...]
    dtype: torch.dtype
    output_splits: tuple[int, ...]
    input_splits: tuple[int, ...]

    @property
    def bytes_sent(self) -> int:
        elems = 1
        for w in self.width:
            elems *= w
        return sum(self.input_splits) * elems * self.dtype.itemsize


@contextmanager
def recording(log: list[Record]) -> Iterator[list[Record]]:
    """Every row exchange posted inside the block, appended to ``log`` (and run)."""
    real = Exchange.post

    def post(self: Exchange, payload: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> None:
        log.append(Record(tuple(payload.shape[1:]), payload.dtype, tuple(output_splits), tuple(input_splits)))
        real(self, payload, output_splits, input_splits)

    with mock.patch.object(Exchange, "post", post):
        yield log


def _local_post(self: Exchange, payload: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> None:
    received = payload.new_empty((sum(output_splits),) + tuple(payload.shape[1:]))
    kept = min(received.shape[0], payload.shape[0])
    received[:kept].copy_(payload[:kept])
    received[kept:].zero_()  # defined values (FP8 scales of 0 decode to 0), as a real exchange would deliver
    self.received, self.work, self.sent = received, None, None


@contextmanager
def local_copies() -> Iterator[None]:
    """Inside the block every row exchange is a local copy of the same shape (module docstring)."""
    with mock.patch.object(Exchange, "post", _local_post):
        yield


def replay(log: list[Record], group: dist.ProcessGroup | None, device: torch.device) -> Callable[[], None]:
    """A function that runs the exchanges of ``log`` alone, in order, each one blocking (buffers made here). Every
    rank must replay its own log of the same layer call: the collectives then match as they did in the layer."""
    buffers = [
        (
            torch.zeros((sum(r.input_splits),) + r.width, dtype=r.dtype, device=device),
            torch.empty((sum(r.output_splits),) + r.width, dtype=r.dtype, device=device),
            list(r.output_splits),
            list(r.input_splits),
        )
        for r in log
    ]

    def run() -> None:
        for sent, received, output_splits, input_splits in buffers:
            dist.all_to_all_single(received, sent, output_splits, input_splits, group=group)

    return run
