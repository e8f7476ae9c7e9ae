"""The weight copies an optimizer step writes for the next step (``CastCache``): one seam between the optimizer
(xmoe/train/optim.py: TritonAdamW writes them) and the MoE layers (moe/experts.py: make_casts takes them; moe/step.py:
expert_casts says which weights get one)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class CastCache:
    """Weight copies in ``dtype`` for the next step, written by the optimizer step that makes the weights
    (xmoe/train/optim.py: TritonAdamW writes each in the same pass as its update, where a cast at the next MoEStep
    reads 4 and writes 2 bytes per weight once more); ``weights``: those that get one (``expert_casts``: the
    routed experts').

    A copy is handed out once (``take``), and only while its weight is the tensor it was written from and its
    version counter is the one recorded then: an in-place change after the step (a load, a ``copy_`` under
    no_grad) makes the next MoEStep cast again. (Changes through ``.data`` are invisible to version counters;
    nothing in xmoe makes them.) An optimizer step writing a new copy drops the one not taken."""

    def __init__(self, weights: Iterable[torch.Tensor], dtype: torch.dtype):
        self.dtype = dtype
        self._wanted = {id(w): w for w in weights}
        self._copies: dict[int, tuple[torch.Tensor, int]] = {}

    def num_waiting(self) -> int:
        """How many weights have a copy waiting (a method, not ``__len__``: an empty cache stays truthy)."""
        return len(self._copies)

    def wants(self, weight: torch.Tensor) -> bool:
        return self._wanted.get(id(weight)) is weight

    def target(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A new tensor to write ``weight``'s copy into, or None for a tensor that gets none."""
        if not self.wants(weight):
            return None
        self._copies.pop(id(weight), None)
        return torch.empty(weight.shape, dtype=self.dtype, device=weight.device)

    def written(self, weight: torch.Tensor, copy: torch.Tensor) -> None:
        """``copy`` now holds ``weight`` as it is (after its update)."""
        self._copies[id(weight)] = (copy, weight._version)

    def waiting(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The copy waiting for ``weight`` (not taken), or None."""
        entry = self._copies.get(id(weight))
        return None if entry is None else entry[0]

    def take(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """``weight``'s copy in ``dtype`` if one is waiting and still holds it, else None (cast it)."""
        entry = self._copies.pop(id(weight), None)
        if entry is None or not self.wants(weight):
            return None
        copy, version = entry
        return copy if copy.dtype == dtype and version == weight._version else None
