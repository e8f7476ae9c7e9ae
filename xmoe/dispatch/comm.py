"""Communication primitives for expert parallelism: an autograd-aware all-to-all of rows with uneven splits, in
one piece or posted and waited for in two (so that work placed between them overlaps the exchange), and the
exchange of per-expert row counts that sizes it.

# P ranks in the EP group, E_local experts per rank, H hidden, N rows sent, M rows received, W payload width

The all-to-all is its own autograd.Function around ``dist.all_to_all_single`` (rather than
``torch.distributed.nn.functional.all_to_all_single``) so that its backward is exactly the reverse exchange with
the splits swapped, with the split lists held on the host and no extra synchronisation, and so that a group of
one rank costs nothing (no copy, no collective).

Posted exchanges (``post_rows`` ... ``wait_rows``). ``post_rows`` starts the all-to-all asynchronously
(``async_op=True``: on GPUs it runs on the communication library's own stream and ``wait`` makes the compute
stream wait for it, with no host synchronisation; on CPUs gloo's worker threads move the data while this one
computes) and ``wait_rows`` finishes it. In backward the roles swap: ``wait_rows``' backward posts the reverse
exchange of the gradient rows and ``post_rows``' backward waits for it. Autograd's engine runs the ready node with
the highest sequence number first, i.e. nodes created later in forward run earlier in backward, so the work a
forward places between a post and its wait runs in backward between the reverse post and its wait: an overlap in
forward is one in backward too. Every rank must post its exchanges in the same order (forward and backward); the
MoE layer's composition (xmoe/moe/routed.py) keeps one program order on all ranks.

A payload may be encoded on the way (``Encoding``: FP8 dispatch sends e4m3 values with their scales, H + 4 H / 128
bytes a row instead of 2 H); gradients always travel in the rows' own dtype (quantisation's gradient is taken as
the identity).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
import torch.distributed as dist


def _all_to_all(x_NH: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """A blocking all-to-all: on CPUs the host waits in it for the whole exchange (timed by WaitTimer)."""
    out_MH = x_NH.new_empty((sum(output_splits),) + tuple(x_NH.shape[1:]))
    exchange = partial(dist.all_to_all_single, out_MH, x_NH.contiguous(), output_splits, input_splits, group=group)
    _timed(exchange, "blocking", in_place=True, group=group)
    return out_MH


def all_to_all_plain(x_NH: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """The uneven all-to-all outside autograd (ids, or inside a Function's own forward/backward); a group of one
    rank returns x as is."""
    if dist.get_world_size(group) == 1:
        return x_NH
    return _all_to_all(x_NH, output_splits, input_splits, group)


class AllToAllRows(torch.autograd.Function):
    """Rows [sum(input_splits[:p]), sum(input_splits[:p+1])) go to rank p; rows from rank p arrive in that order."""

    @staticmethod
    def forward(ctx, x_NH, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all(x_NH, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_MH):
        output_splits, input_splits = ctx.splits
        # the gradient of a row travels back to where the row came from: the same exchange, splits swapped
        return _all_to_all(grad_MH, input_splits, output_splits, ctx.group), None, None, None


def all_to_all_rows(
    x_NH: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0. Splits are host lists (NCCL and gloo both need them there)."""
    if x_NH.shape[0] != sum(input_splits):
        raise ValueError(f"x has {x_NH.shape[0]} rows but input_splits {input_splits} sum to {sum(input_splits)}")
    if dist.get_world_size(group) == 1:
        return x_NH
    return AllToAllRows.apply(x_NH, output_splits, input_splits, group)


def exchange_counts(send_counts_PE: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """send_counts_PE[p, e]: rows this rank sends to rank p's local expert e (int64, on the rows' device).

    Returns recv_counts_PE[p, e]: rows rank p sends to this rank's local expert e. One equal-split all-to-all of
    P * E_local integers; it stays on the device (no host synchronisation here).
    """
    if send_counts_PE.dim() != 2 or send_counts_PE.shape[0] != dist.get_world_size(group):
        raise ValueError(
            f"send_counts must be (P={dist.get_world_size(group)}, E_local), got {tuple(send_counts_PE.shape)}"
        )
    if send_counts_PE.shape[0] == 1:
        return send_counts_PE
    recv_counts_PE = torch.empty_like(send_counts_PE)
    send_PE = send_counts_PE.contiguous()
    _timed(lambda: dist.all_to_all_single(recv_counts_PE, send_PE, group=group), "counts", in_place=True, group=group)
    return recv_counts_PE


def host_list(values: torch.Tensor) -> list[Any]:
    """``values.tolist()``: the host synchronisation of an expert-parallel layer call (timed by WaitTimer: on CPUs
    it also waits for the count exchange's peers)."""
    return _timed(values.tolist, "counts")


def splits_to_host(send_counts_PE: torch.Tensor, recv_counts_PE: torch.Tensor) -> tuple[list[int], list[int]]:
    """(input_splits, output_splits) of the row all-to-all as host lists: ONE device-to-host copy.

    This is the host synchronisation of expert-parallel dispatch (its measured cost: docs/architecture.md,
    "Measured reasons"): the collective needs the split sizes on the host, and the receive buffer's size is data
    dependent.
    """
    num_ranks = send_counts_PE.shape[0]
    both = host_list(torch.cat([send_counts_PE.sum(1), recv_counts_PE.sum(1)]))
    return both[:num_ranks], both[num_ranks:]


# --------------------------------------------------------------------------------------- posted exchanges


class WaitTimer:
    """Host time spent blocked in the expert-parallel exchanges of this process (the posted exchanges' waits, the
    blocking ones (RBD's ids, routing weights and second stage), the count exchange and its host sync): the
    exposed communication of a CPU (gloo) run. On GPUs a wait only makes the compute stream wait, so the host
    time says nothing there; profile instead. Off unless ``enabled``. ``by_kind`` splits it: "posted" (the waits of
    posted exchanges), "blocking" (blocking exchanges of rows, ids and weights), "counts" (the count exchange and
    the host sync that reads it). ``events``, when a list: each timed wait appended as (kind, start, end, ranks),
    perf_counter seconds and, for a collective waited in place, the global ranks of its group (else None); and each
    posted exchange, when waited, as ("flight", posted, completed, None): not a wait, its time in flight."""

    enabled = False
    seconds = 0.0
    by_kind: ClassVar[dict[str, float]] = {}
    events: ClassVar[list[tuple[str, float, float, tuple[int, ...] | None]] | None] = None

    @classmethod
    def reset(cls) -> float:
        """The seconds since the last reset (``by_kind`` cleared too)."""
        spent, cls.seconds, cls.by_kind = cls.seconds, 0.0, {}
        return spent


def _timed(fn: Callable[[], Any], kind: str, *, in_place: bool = False, group: Any = None) -> Any:
    """``fn()``, its time added to WaitTimer's when enabled. ``in_place``: ``fn`` is a collective waited where it is
    called, over ``group`` (None: the world), whose ranks an event records."""
    if not WaitTimer.enabled:
        return fn()
    start = time.perf_counter()
    try:
        return fn()
    finally:
        end = time.perf_counter()
        WaitTimer.seconds += end - start
        WaitTimer.by_kind[kind] = WaitTimer.by_kind.get(kind, 0.0) + end - start
        if WaitTimer.events is not None:
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD)) if in_place else None
            WaitTimer.events.append((kind, start, end, ranks))


@dataclass
class Encoding:
    """How rows travel: ``encode`` (N, H) rows -> (N, W) payload (any dtype), ``decode`` ((M, W) payload, a (0, H)
    tensor of the rows' dtype) -> (M, H) rows, with anything else the receiver needs (FP8 values and scales)."""

    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]


def carrying(side_NC: torch.Tensor, base: Encoding | None = None) -> Encoding:
    """An Encoding that appends ``side_NC``'s bytes to each row's payload (``base``'s, else the row itself): a few
    numbers a row (token ids) ride in the posted exchange instead of a blocking one of their own. The decode's extra
    output is (``base``'s extra, the received (M, C) side rows in ``side_NC``'s dtype). Forward only: gradients
    travel as rows, without it."""
    side_bytes = _as_bytes(side_NC)
    kept: dict[str, torch.dtype] = {}

    def encode(x_NH: torch.Tensor) -> torch.Tensor:
        payload = base.encode(x_NH) if base is not None else x_NH.detach()
        kept["dtype"] = payload.dtype
        return torch.cat([_as_bytes(payload), side_bytes], dim=1)

    def decode(payload_MW: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, Any]:
        width = payload_MW.shape[1] - side_bytes.shape[1]
        main = bytes_as(payload_MW[:, :width], kept["dtype"])
        side = bytes_as(payload_MW[:, width:], side_NC.dtype)
        if base is None:
            return main, (None, side)
        rows, extra = base.decode(main, like)
        return rows, (extra, side)

    return Encoding(encode, decode)


def _as_bytes(x_NC: torch.Tensor) -> torch.Tensor:
    """(N, C) -> (N, C * itemsize) uint8, the same memory."""
    return x_NC.contiguous().view(torch.uint8)


def bytes_as(bytes_MC: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Columns of a byte payload read as ``dtype``: copied to a fresh tensor first, since a slice of one or no rows
    counts as contiguous while keeping the payload's row stride and offset, which a dtype view cannot take."""
    fresh = torch.empty(bytes_MC.shape, dtype=torch.uint8, device=bytes_MC.device)
    return fresh.copy_(bytes_MC).view(dtype)


class Exchange:
    """One posted all-to-all of rows and, in backward, its reverse: what ``post_rows`` and ``wait_rows`` share.
    ``extra`` is what the encoding's decode returned beside the rows (None without an encoding)."""

    def __init__(self, output_splits: list[int], input_splits: list[int], group, encoding: Encoding | None):
        self.output_splits, self.input_splits, self.group, self.encoding = output_splits, input_splits, group, encoding
        self.work: Any = None
        self.sent: torch.Tensor | None = None  # kept alive until the exchange that reads it completes
        self.received: torch.Tensor | None = None
        self.extra: Any = None
        self.rows_like: torch.Tensor | None = None  # dtype and width of the decoded rows
        self.flight: list[float] = []  # perf_counter at post and at completion, where WaitTimer.events records

    def post(self, payload: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> None:
        if dist.get_world_size(self.group) == 1:  # nothing to move: the payload is what arrives
            self.received, self.work = payload, None
            return
        self.sent = payload.contiguous()
        self.received = payload.new_empty((sum(output_splits),) + tuple(payload.shape[1:]))
        self.work = dist.all_to_all_single(
            self.received, self.sent, output_splits, input_splits, group=self.group, async_op=True
        )
        if WaitTimer.enabled and WaitTimer.events is not None:
            flight = self.flight = [time.perf_counter()]  # the callback keeps this exchange's own list
            self.work.get_future().then(lambda _: flight.append(time.perf_counter()))

    def wait(self) -> torch.Tensor:
        assert self.received is not None, "waited for an exchange that was not posted"
        if self.work is not None:
            _timed(self.work.wait, "posted")
            if self.flight and WaitTimer.events is not None:
                flight, self.flight = self.flight, []
                # completed at the callback, else (it has not run yet) now
                completed = flight[1] if len(flight) > 1 else time.perf_counter()
                WaitTimer.events.append(("flight", flight[0], completed, None))
        received, self.received, self.work, self.sent = self.received, None, None, None
        return received


class _PostRows(torch.autograd.Function):
    """Forward: post the exchange of x's rows; returns an empty link tensor carrying the autograd edge to
    ``_WaitRows`` (the payload may not be a float tensor). Backward: wait for the gradient rows' reverse exchange."""

    @staticmethod
    def forward(ctx, x_NH, ex: Exchange):
        ctx.ex = ex
        payload = ex.encoding.encode(x_NH) if ex.encoding is not None else x_NH
        ex.rows_like = x_NH.new_empty((0, x_NH.shape[1]))
        ex.post(payload, ex.output_splits, ex.input_splits)
        return x_NH.new_empty(0)

    @staticmethod
    def backward(ctx, _link):
        return ctx.ex.wait(), None


class _WaitRows(torch.autograd.Function):
    """Forward: wait for the exchange and decode the received rows. Backward: post the reverse exchange of the
    gradient rows (the splits swapped)."""

    @staticmethod
    def forward(ctx, link, ex: Exchange):
        ctx.ex = ex
        received = ex.wait()
        if ex.encoding is None:
            return received
        assert ex.rows_like is not None
        rows, ex.extra = ex.encoding.decode(received, ex.rows_like)
        return rows

    @staticmethod
    def backward(ctx, grad_MH):
        ex = ctx.ex
        ex.post(grad_MH, ex.input_splits, ex.output_splits)
        return grad_MH.new_empty(0), None


def post_rows(
    x_NH: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    encoding: Encoding | None = None,
) -> tuple[torch.Tensor, Exchange]:
    """Post the uneven all-to-all of x's rows (rows [sum(input_splits[:p]), sum(input_splits[:p+1])) to rank p); the
    returned (link, exchange) go to ``wait_rows``. Differentiable, the reverse exchange posted and waited for by
    the pair's backward."""
    if x_NH.shape[0] != sum(input_splits):
        raise ValueError(f"x has {x_NH.shape[0]} rows but input_splits {input_splits} sum to {sum(input_splits)}")
    ex = Exchange(output_splits, input_splits, group, encoding)
    return _PostRows.apply(x_NH, ex), ex


def wait_rows(link: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """The received (M, H) rows of a posted exchange, decoded (the encoding's extra output is ``ex.extra``)."""
    return _WaitRows.apply(link, ex)
