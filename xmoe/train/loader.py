"""The sharded, resumable loader: batches of a ``TokenDataset`` for one data-parallel rank.

# B sequences per batch (this rank's), S seq_len, N rows drawn

A batch is the pair (inputs_BS, targets_BS), and with ``documents="mask"`` also ``segments_BS`` (each position's
document inside its row, from 0, non-decreasing) with the targets that would cross into the next document set to
IGNORE_INDEX; with a mixture, ``sources_B`` (each row's source).

Documents under "mask": a row that starts inside a document has segment 0 there; position p is in segment k when
k documents start at positions 1..p of the row. The target of position p is the token at p + 1; where that token
starts a new document (so p holds the end-of-document token) the target is IGNORE_INDEX = -100, as Megatron masks
the end-of-document loss: the model would otherwise be asked to guess the next document's first token from a
context the mask hides from it.
"""

from __future__ import annotations

import numpy as np
import torch

from xmoe.model.loss import IGNORE_INDEX
from xmoe.train.data import Draw, TokenDataset

DOCUMENT_MODES = ("concat", "mask")
PREFETCH_ROWS = 256  # TokenLoader draws this many of a rank's rows (whole batches, at least one) per call


class Batch(tuple):
    """(inputs_BS, targets_BS): unpacks as that pair; ``segments_BS`` (int32, documents="mask") and ``sources_B``
    (int64, a mixture's source of each row) ride beside it, None when not made."""

    segments_BS: torch.Tensor | None
    sources_B: torch.Tensor | None

    def __new__(
        cls,
        inputs_BS: torch.Tensor,
        targets_BS: torch.Tensor,
        segments_BS: torch.Tensor | None = None,
        sources_B: torch.Tensor | None = None,
    ) -> Batch:
        batch = super().__new__(cls, (inputs_BS, targets_BS))
        batch.segments_BS, batch.sources_B = segments_BS, sources_B
        return batch


def make_batch(draw: Draw, documents: bool) -> Batch:
    """The batch of drawn rows (module docstring); numpy in, CPU tensors out."""
    tokens_BS1 = torch.from_numpy(draw.tokens_NS1)
    inputs_BS, targets_BS = tokens_BS1[:, :-1].contiguous(), tokens_BS1[:, 1:].contiguous()
    segments_BS = None
    if documents:
        assert draw.starts_NS1 is not None  # drawn with documents=True
        starts_BS1 = torch.from_numpy(draw.starts_NS1)
        # a row's first position is segment 0 whether or not a document starts there
        segments_BS = torch.cumsum(starts_BS1[:, 1:-1], dim=1, dtype=torch.int32)
        segments_BS = torch.cat([torch.zeros_like(segments_BS[:, :1]), segments_BS], dim=1)
        targets_BS = targets_BS.masked_fill(starts_BS1[:, 1:], IGNORE_INDEX)
    sources_B = None if draw.sources_N is None else torch.from_numpy(draw.sources_N)
    return Batch(inputs_BS, targets_BS, segments_BS, sources_B)


def _split(draw: Draw, steps: int) -> list[Draw]:
    parts = [np.split(a, steps) if a is not None else [None] * steps for a in draw]
    return [Draw(*fields) for fields in zip(*parts, strict=True)]


def _concat(draws: list[Draw]) -> Draw:
    if len(draws) == 1:
        return draws[0]
    tokens, starts, sources = (None if f[0] is None else np.concatenate(f) for f in zip(*draws, strict=True))
    assert tokens is not None  # every draw has tokens
    return Draw(tokens, starts, sources)


class TokenLoader:
    """Deterministic, resumable batches of a ``TokenDataset`` for one data-parallel rank.

    Step s covers global positions [s * B, (s + 1) * B) of the dataset's order (B = global_batch_size; a
    batch that runs off the end of an epoch continues into the next). Rank r takes the contiguous slice
    [r * B / world_size, (r + 1) * B / world_size), so concatenating the ranks' batches in rank order gives
    the one-process batch. Pass the data-parallel rank and degree: peers that share a model replica's data
    (tensor-parallel, for example) pass the same rank. The state is the number of samples consumed, so the
    batches are a function of (the dataset's seed, the step, the rank). ``documents``: "concat" or "mask"
    (module docstring).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        documents: str = "concat",
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
        if global_batch_size < 1 or global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a positive multiple of world_size ({world_size})"
            )
        if documents not in DOCUMENT_MODES:
            raise ValueError(f"documents ({documents!r}) must be one of {', '.join(DOCUMENT_MODES)}")
        self.masked = documents == "mask"
        if self.masked and not dataset.has_documents:
            raise ValueError(
                f"data.documents = 'mask' needs to know where documents start, and {dataset.name} does not say: "
                "train on a prepared set (xmoe data prepare), set data.eos_id to a token file's end-of-document "
                "token, or use data.documents = 'concat'"
            )
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.rank, self.world_size = rank, world_size
        self.local_batch_size = global_batch_size // world_size
        self.samples_seen = 0  # global: summed over ranks
        # Batches drawn ahead in one call: a dataset's cost is mostly per call (the markov source walks its
        # positions once for all the rows it is given: benchmarks/results/data/markov_draw_cpu.md), and a step waits
        # for its batch. (the samples_seen the batches left start at, [local batches]).
        self._ahead: tuple[int, list[Draw]] = (0, [])

    @property
    def epoch(self) -> int:
        """Current epoch (always 0 for an endless stream)."""
        return 0 if self.dataset.epoch_size is None else self.samples_seen // self.dataset.epoch_size

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> Batch:
        """This rank's batch of B = local_batch_size rows: int64 CPU tensors, targets the inputs shifted one token
        left (IGNORE_INDEX across documents under "mask")."""
        start, ahead = self._ahead
        if not ahead or start != self.samples_seen:  # none left, or the state was set since they were drawn
            steps, pos_B = self._draw_positions(self.samples_seen)
            ahead = _split(self._draw(pos_B), steps)
        draw = ahead.pop(0)
        self.samples_seen += self.global_batch_size
        self._ahead = (self.samples_seen, ahead)
        return make_batch(draw, self.masked)

    def _draw_positions(self, samples_seen: int) -> tuple[int, np.ndarray]:
        """(batches, this rank's positions) of the one dataset call that starts at ``samples_seen``: PREFETCH_ROWS
        rows in whole batches, at least one."""
        steps = max(1, PREFETCH_ROWS // self.local_batch_size)
        return steps, np.concatenate([self._positions(samples_seen + j * self.global_batch_size) for j in range(steps)])

    def _positions(self, samples_seen: int) -> np.ndarray:
        """This rank's positions in the dataset's order for the batch that starts at ``samples_seen``."""
        first = samples_seen + self.rank * self.local_batch_size
        return np.arange(first, first + self.local_batch_size)

    def _draw(self, pos_B: np.ndarray) -> Draw:
        """The rows at increasing positions pos_B (a batch runs from one epoch into the next)."""
        size = self.dataset.epoch_size
        if size is None:
            return self.dataset.draw(0, pos_B, self.masked)
        epoch_B, index_B = np.divmod(pos_B, size)
        return _concat([self.dataset.draw(int(e), index_B[epoch_B == e], self.masked) for e in np.unique(epoch_B)])

    def state_dict(self) -> dict:
        return {"samples_seen": self.samples_seen, "seed": self.dataset.seed, "epoch_size": self.dataset.epoch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state``; the global batch size and world size may differ from the saving run."""
        for key in ("seed", "epoch_size"):
            if state[key] != getattr(self.dataset, key):
                raise ValueError(
                    f"loader state has {key}={state[key]} but the dataset has "
                    f"{getattr(self.dataset, key)}; resume with the same data and seed"
                )
        self.samples_seen = int(state["samples_seen"])
