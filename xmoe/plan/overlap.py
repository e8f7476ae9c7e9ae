"""What overlaps what in one MoE layer call under ``parallel.ep_overlap``: the schedules, forward and backward, and
the time they take.

Two resources: the network (the EP group's collectives, run one after another in the order they are posted: NCCL
uses one stream per group, gloo serialises a group's work) and the compute stream (kernels in program order). An
op starts when its resource is free and the ops it needs have finished; its end is start + duration. The layer
call's time is the last op's end (a max-plus system: shortening any op never lengthens it). ``exposed`` is the time
the compute stream waits on the network: the call's time less the compute it runs.

Forward (post = start an asynchronous collective, wait = make compute wait for it):
  off      count; dispatch; experts; combine; shared up; shared down                      all serial
  shared   count; post dispatch; shared up; wait; experts; post combine; shared down; wait
  chunks   count; post d(0), d(1); shared up; for each chunk i: wait d(i), experts(i), post c(i), post d(i+2);
           shared down; wait every c(i)
Backward, as autograd's engine runs it (ready nodes with the highest sequence number first: what forward made
later runs earlier):
  off      shared down', shared up', combine', experts', dispatch'                       all serial
  shared   post combine'; shared down'; wait; experts'; post dispatch'; shared up'; wait
  chunks   post c'(n-1) .. c'(0); shared down'; experts'(n-1), experts'(n-2) (each after its c');
           then for i = n-3 .. 0: wait d'(i+2), experts'(i); each experts'(i) followed by post d'(i);
           shared up'; wait every d'(i)
where x' is x's backward: combine' sends the output gradients to the experts, dispatch' the input gradients home.
The count exchange (one for all chunks, with the host sync that sizes the buffers) runs before anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

OVERLAP_MODES = ("off", "shared", "chunks")
Op = tuple[str, str, float, tuple[str, ...]]  # name, "net" | "gpu", duration (ms), names of the ops it needs


@dataclass(frozen=True)
class CallTimes:
    """Durations (ms) of one MoE layer call's parts; the network and expert times are one chunk's."""

    count: float  # the count exchange (forward only, once per call)
    dispatch: float  # forward dispatch of one chunk (its dtype)
    combine: float  # forward combine of one chunk
    combine_bwd: float  # the combine's backward: output gradients to the experts, one chunk
    dispatch_bwd: float  # the dispatch's backward: input gradients home, one chunk
    experts: float  # routed experts' forward of one chunk (backward: backward_factor x this)
    shared_up: float  # shared experts' up projections (x w1, x w3, SwiGLU), whole call
    shared_down: float  # shared experts' down projection, whole call
    backward_factor: float = 2.0  # backward compute / forward compute


@dataclass(frozen=True)
class Timeline:
    time: float  # the call's time (ms)
    compute: float  # compute stream busy (ms)
    network: float  # network busy (ms)

    @property
    def exposed(self) -> float:
        return self.time - self.compute


def _run(ops: list[Op]) -> Timeline:
    """``ops`` in the order the host issues them."""
    free = {"net": 0.0, "gpu": 0.0}
    busy = {"net": 0.0, "gpu": 0.0}
    end: dict[str, float] = {}
    for name, where, duration, needs in ops:
        start = max([free[where], *(end[n] for n in needs)])
        end[name] = free[where] = start + duration
        busy[where] += duration
    return Timeline(max(end.values(), default=0.0), busy["gpu"], busy["net"])


def forward(mode: str, chunks: int, t: CallTimes) -> Timeline:
    """One forward layer call (module docstring); ``chunks`` is used by mode "chunks" only."""
    ops: list[Op] = [("count", "net", t.count, ())]
    if mode == "off":
        ops += [
            ("d0", "net", t.dispatch, ("count",)),
            ("e0", "gpu", t.experts, ("d0",)),
            ("c0", "net", t.combine, ("e0",)),
            ("su", "gpu", t.shared_up, ("c0",)),
            ("sd", "gpu", t.shared_down, ()),
        ]
        return _run(ops)
    n = chunks if mode == "chunks" else 1
    ops += [(f"d{i}", "net", t.dispatch, ("count",)) for i in range(min(n, 2))]
    ops.append(("su", "gpu", t.shared_up, ("count",)))
    for i in range(n):
        ops.append((f"e{i}", "gpu", t.experts, (f"d{i}",)))
        ops.append((f"c{i}", "net", t.combine, (f"e{i}",)))
        if i + 2 < n:
            ops.append((f"d{i + 2}", "net", t.dispatch, (f"e{i}",)))
    ops.append(("sd", "gpu", t.shared_down, ()))
    return _run(ops)


def backward(mode: str, chunks: int, t: CallTimes) -> Timeline:
    """One backward layer call (module docstring)."""
    f = t.backward_factor
    if mode == "off":
        return _run(
            [
                ("sd", "gpu", f * t.shared_down, ()),
                ("su", "gpu", f * t.shared_up, ()),
                ("c0", "net", t.combine_bwd, ("su",)),
                ("e0", "gpu", f * t.experts, ("c0",)),
                ("d0", "net", t.dispatch_bwd, ("e0",)),
            ]
        )
    n = chunks if mode == "chunks" else 1
    ops: list[Op] = [(f"c{i}", "net", t.combine_bwd, ()) for i in reversed(range(n))]
    ops.append(("sd", "gpu", f * t.shared_down, ()))
    for i in reversed(range(n)):
        after = (f"d{i + 2}",) if i + 2 < n else ()  # the wait of d'(i+2), issued before experts'(i)
        ops.append((f"e{i}", "gpu", f * t.experts, (f"c{i}", *after)))
        ops.append((f"d{i}", "net", t.dispatch_bwd, (f"e{i}",)))
    ops.append(("su", "gpu", f * t.shared_up, ()))
    return _run(ops)
