"""What the Triton GEMMs of the routed experts actually launched: counts by where each launch's tile came from and
by what computed each weight gradient, kept as they launch.

  tiles  per launch of a grouped GEMM (tiles.pick, which every launcher asks just before it launches): "forced",
         "interpreter", "fp32", "autotune", "table" (the shipped table), "neighbour" (a class next to one of its
         classes) or "heuristic"
  wgrad  per weight gradient computed (dW2, dW1, dW3 of each expert stack: three per backward of an expert layer):
         "triton" or "grouped_mm" (grouped_wgrad, in the activations' dtype), "fp8" (fp8_wgrad)

The kernels choose from the values they are handed (xmoe/kernels/choice.py: ``Kernels``); these counters only
record what came of it, so that a step's statistics and a run's summary say what ran, not what was predicted.
They are process-wide and counted inside the custom ops: a torch.compile'd region calls the ops as opaque calls,
so a count made anywhere else (the autograd Function, the GEMM sets) would be made once, at tracing, rather than
at every launch. Whoever wants the launches of some stretch of work takes ``snapshot()`` before it and
``since(before)`` after (xmoe/moe/step.py does for each optimizer step).
"""

from __future__ import annotations

from collections import Counter

KINDS = ("tiles", "wgrad")
_COUNTS: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}


def count(kind: str, what: str, n: int = 1) -> None:
    """``n`` launches of ``kind`` ("tiles" or "wgrad") that took ``what``."""
    _COUNTS[kind][what] += n


def snapshot() -> dict[str, dict[str, int]]:
    """The counts so far: {"tiles": {source: launches}, "wgrad": {engine: products}}."""
    return {kind: dict(counts) for kind, counts in _COUNTS.items()}


def since(before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The launches since ``before`` (a ``snapshot()``), without the zeros; {} where nothing launched."""
    out = {}
    for kind, counts in _COUNTS.items():
        grown = {what: n - before.get(kind, {}).get(what, 0) for what, n in counts.items()}
        grown = {what: n for what, n in sorted(grown.items()) if n}
        if grown:
            out[kind] = grown
    return out


def add(total: dict[str, dict[str, int]], more: dict[str, dict[str, int]]) -> None:
    """Add ``more`` (as ``since`` gives them) into ``total``, in place."""
    for kind, counts in more.items():
        into = total.setdefault(kind, {})
        for what, n in counts.items():
            into[what] = into.get(what, 0) + n
