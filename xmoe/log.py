"""Logging for the library: modules log through ``logging.getLogger(__name__)`` (children of "xmoe"), never print.

``configure_logging`` is what the ``xmoe`` command calls: one handler on the "xmoe" logger that writes the bare
message to the current ``sys.stdout`` and lets only rank 0 of a multi-process run through (``RankZeroFilter``), so
a run of 64 processes prints its messages once. A program that uses xmoe as a library configures logging its own
way and may add ``RankZeroFilter`` to its handlers.
"""

from __future__ import annotations

import logging
import os
import sys


def process_rank() -> int:
    """This process's global rank: from torch.distributed once initialised, else the launcher's RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankZeroFilter(logging.Filter):
    """Passes records on rank 0 only; a record logged with ``extra={"all_ranks": True}`` passes on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "all_ranks", False) or process_rank() == 0


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time of the record (pytest and callers may swap it)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns one; the property always reads sys.stdout
        pass


def configure_logging(level: int = logging.INFO) -> logging.Logger:
    """Route the "xmoe" loggers' records at ``level`` and above to stdout, rank 0 only; idempotent."""
    logger = logging.getLogger("xmoe")
    logger.setLevel(level)
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(RankZeroFilter())
        logger.addHandler(handler)
        logger.propagate = False  # the handler above prints each record once; the root logger would repeat it
    return logger
