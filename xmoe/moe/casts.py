"""The weight copies an optimizer step writes for the next step (``CastCache``): one seam between the optimizer
(xmoe/train/optim.py: TritonAdamW writes them) and the MoE layers (moe/experts.py: make_casts takes them; moe/step.py:
expert_casts says which weights get one)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from xmoe.kernels.fp8_quant import BlockCopies, BlockCopy


class CastCache:
    """Weight copies in ``dtype`` for the next step, written by the optimizer step that makes the weights
    (xmoe/train/optim.py: TritonAdamW writes each in the same pass as its update, where a cast at the next MoEStep
    reads 4 and writes 2 bytes per weight once more); ``weights``: those that get one (``expert_casts``: the
    routed experts'). FP8 experts' weights get their FP8 copies instead (``fp8_groups``: (w1, w3) and (w2,) of
    each, whose copies lie side by side as fp8_quant.quantize_block_pair lays them out; ``take_fp8``).

    A copy is handed out once (``take``, ``take_fp8``), and only while its weight is the tensor it was written
    from and its version counter is the one recorded then: an in-place change after the step (a load, a ``copy_``
    under no_grad) makes the next MoEStep cast again. (Changes through ``.data`` are invisible to version counters;
    nothing in xmoe makes them.) An optimizer step writing a new copy drops the one not taken."""

    def __init__(
        self,
        weights: Iterable[torch.Tensor],
        dtype: torch.dtype,
        fp8_groups: Iterable[tuple[torch.Tensor, ...]] = (),
        fp8_format: str | None = None,
    ):
        self.dtype = dtype
        self._wanted = {id(w): w for w in weights}
        self._copies: dict[int, tuple[torch.Tensor, int]] = {}
        # FP8 experts' weights: groups of equal-shaped weights whose FP8 copies lie side by side (w1 and w3; w2),
        # quantised in 128 x 128 blocks of format fp8_format (fp8_quant.BlockCopies), keyed by the group's first
        self.fp8_format = fp8_format
        self._groups = {id(w): group for group in fp8_groups for w in group}
        self._fp8: dict[int, tuple[BlockCopies, dict[int, int]]] = {}  # buffers, versions of the members written

    def num_waiting(self) -> int:
        """How many weights have a copy waiting (a method, not ``__len__``: an empty cache stays truthy)."""
        return len(self._copies) + sum(len(versions) for _, versions in self._fp8.values())

    def has_casts(self) -> bool:
        """Whether any weight gets a cast (bf16) copy."""
        return bool(self._wanted)

    def has_fp8(self) -> bool:
        """Whether any weight gets an FP8 copy."""
        return bool(self._groups)

    def wants(self, weight: torch.Tensor) -> bool:
        return self._wanted.get(id(weight)) is weight or self._group(weight) is not None

    def _group(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        group = self._groups.get(id(weight))
        return group if group is not None and any(w is weight for w in group) else None

    def target(self, weight: torch.Tensor) -> torch.Tensor | BlockCopy | None:
        """Where to write ``weight``'s copy: a new tensor, a fp8_quant.BlockCopy (a view of its group's new FP8
        buffers, the first member's target making them), or None for a tensor that gets none."""
        group = self._group(weight)
        if group is not None:
            from xmoe.kernels.fp8_quant import BlockCopies

            entry = self._fp8.get(id(group[0]))
            if entry is None or id(weight) in entry[1]:  # a new step's copies: the old ones were not taken
                assert self.fp8_format is not None
                entry = (BlockCopies.empty(weight.shape, len(group), self.fp8_format, weight.device), {})
                self._fp8[id(group[0])] = entry
            return entry[0].member(next(i for i, w in enumerate(group) if w is weight))
        if not self.wants(weight):
            return None
        self._copies.pop(id(weight), None)
        return torch.empty(weight.shape, dtype=self.dtype, device=weight.device)

    def written(self, weight: torch.Tensor, copy: torch.Tensor | BlockCopy) -> None:
        """``copy`` now holds ``weight`` as it is (after its update)."""
        group = self._group(weight)
        if group is not None:
            self._fp8[id(group[0])][1][id(weight)] = weight._version
        else:
            self._copies[id(weight)] = (copy, weight._version)  # type: ignore[assignment]

    def take_fp8(self, group: tuple[torch.Tensor, ...]) -> BlockCopies | None:
        """The FP8 copies of ``group`` (as given to the constructor) if every member's is written and still holds
        it, else None (quantise them); handed out once."""
        entry, known = self._fp8.pop(id(group[0]), None), self._group(group[0]) or ()
        if entry is None or [id(w) for w in known] != [id(w) for w in group]:
            return None
        copies, versions = entry
        return copies if all(versions.get(id(w)) == w._version for w in group) else None

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
