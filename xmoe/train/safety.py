"""Stopping a run safely: on a signal (checkpoint, then exit 128 + signum) and on a non-finite loss.

Signals (SIGTERM from Slurm or a scheduler's preemption, SIGINT from Ctrl-C, SIGHUP from a closed terminal):
the handler only records the signal; the trainer acts at the next step boundary where all ranks agree, so
every rank saves the same step. A second signal restores the default action and re-raises it: the process
ends at once (an interrupted checkpoint is never published, see rundir.py: RunDir.save).

Non-finite training: a NaN or inf loss or gradient norm is recorded on the device with no host sync, as the
first bad step; ``check`` reads it at steps that already synchronise (logging and checkpoint steps), so no
checkpoint is ever written after a non-finite step. With ``nonfinite_skips`` > 0 each step is checked on the
host instead (one sync per step) and up to that many bad steps in a row are skipped without an update.

Several ranks: ``check`` agrees on both flags with one tiny all-reduce (MAX of [signal, first bad step]), at
the logging / checkpoint cadence only; one process checks the signal flag at every step (free). Between those
steps the signal flag is also voted on every step without waiting: ``start_vote`` posts an asynchronous MAX
all-reduce of one host int over a gloo group of its own, ``vote`` reads it one step later, so every rank stops at
the step after the one a signal arrived in (not at the next logging step), with no GPU sync. A run directory that
rank 0 finds gone (``runlock.DirLock.lost``) travels the same way, as the stop code DIR_LOST; so does, under
torchrun, the launcher's exit (PARENT_GONE: a rank whose parent process changed was orphaned by a killed launcher,
and stops with a checkpoint rather than train on holding the run's lock).

Under a launcher: the same signal again within DUPLICATE_S of the first is the same request (a scheduler signals
every process of a job, torchrun then passes it on to its ranks), not the second signal that ends a rank at once;
and a rank that stopped on a signal ignores further ones while it exits, so the launcher's closing signal, sent
when the first rank exits, does not turn its exit code 128 + signum into death by that signal. With several ranks
the guard also starts the watchdog (``watchdog.py``) that names a silent rank, and makes its vote group with the
run's collective timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DIR_LOST = 1 << 10  # a stop code beyond every signal number: the run directory is no longer this run's
PARENT_GONE = 1 << 9  # under torchrun: the launcher exited (below DIR_LOST, above every signal, in the MAX vote)
DUPLICATE_S = 1.0  # the same signal again within this many seconds is the same request passed on by a launcher
SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN or inf; the run stopped without saving past the last good step."""

    exit_code = 3


class RunStopped(Exception):
    """A signal stopped the run at a step boundary after saving; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + (signal.SIGHUP if signum == PARENT_GONE else signum)  # a launcher's exit: a hangup


def signal_name(signum: int) -> str:
    if signum == PARENT_GONE:
        return "its launcher's exit"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RunGuard:
    """Context manager: installs the stop-signal handlers (main thread only) and tracks non-finite steps."""

    def __init__(self, device: torch.device, nonfinite_skips: int = 0, timeout_s: float | None = None) -> None:
        self.received: int | None = None
        self._received_at = 0.0
        self.dir_lost = False  # rank 0 found the run directory deleted, moved or replaced
        self.timeout_s = timeout_s  # several ranks: the vote group's collective timeout, and the watchdog's
        self._parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None  # torchrun's agent
        self.parent_gone = False
        self._watchdog: Any = None
        self.skips_allowed = nonfinite_skips
        self.skipped_in_row = 0
        self.skipped_total = 0
        self._first_bad = torch.zeros((), dtype=torch.long, device=device)  # 0: no bad step yet
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._vote_group = None  # several ranks: a gloo group for the per-step signal vote
        self._vote_flag = torch.zeros(1, dtype=torch.long)
        self._vote_work = None

    def __enter__(self) -> RunGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank enters the guard: a collective call
            timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
            # its own group: never queued behind training traffic
            self._vote_group = dist.new_group(backend="gloo", timeout=timeout)
            if self.timeout_s is not None:
                from xmoe.train.watchdog import Watchdog

                self._watchdog = Watchdog(dist.get_rank(), dist.get_world_size(), self.timeout_s).start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._vote_work is not None and exc_type is None:
            self._vote_work.wait()  # every rank posted it: finish it before the process group goes
        self._vote_work = None
        exiting = self._vote_group is not None and exc_type is not None and issubclass(exc_type, RunStopped)
        if self._vote_group is not None:
            dist.destroy_process_group(self._vote_group)
        self._vote_group = None
        for signum, handler in self._previous.items():
            # a rank of several that stopped is on its way out: the launcher's closing signal must not end it
            # by that signal (module docstring)
            signal.signal(signum, signal.SIG_IGN if exiting else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:  # the second signal: no more waiting for a step boundary
            if signum == self.received and time.monotonic() - self._received_at < DUPLICATE_S:
                return  # the first one again, passed on by a launcher
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received, self._received_at = signum, time.monotonic()

    # ----------------------------------------------------------------------------------------- non-finite

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, world: int = 1) -> bool:
        """Record this step's loss and gradient norm; True means: skip the optimizer step (skip policy only)."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if self.skips_allowed == 0:  # no host sync: remember the first bad step on the device
            self._first_bad = torch.where(~finite & (self._first_bad == 0), step, self._first_bad)
            return False
        if world > 1:  # every rank must skip the same steps: decide on the clipped norm, the same on all of them
            finite = torch.isfinite(grad_norm)
        if bool(finite):  # one host sync per step, the price of the skip policy
            self.skipped_in_row = 0
            return False
        self.skipped_in_row += 1
        self.skipped_total += 1
        if self.exhausted:
            self._first_bad.fill_(step - self.skipped_in_row + 1)
            return True
        log.warning(
            f"step {step}: non-finite loss or gradient norm, update skipped "
            f"({self.skipped_in_row} of {self.skips_allowed} allowed in a row)"
        )
        return True

    @property
    def exhausted(self) -> bool:
        """The skip policy has run out: more non-finite steps in a row than allowed."""
        return 0 < self.skips_allowed < self.skipped_in_row

    def lose_directory(self) -> None:
        """The run directory is gone: stop as for a signal, with the code DIR_LOST (which outranks signals)."""
        self.dir_lost = True

    def _stop_code(self) -> int:
        if self._parent is not None and not self.parent_gone and os.getppid() != self._parent:
            self.parent_gone = True  # orphaned: torchrun's agent was killed
        return DIR_LOST if self.dir_lost else PARENT_GONE if self.parent_gone else self.received or 0

    def check(self, world: int) -> tuple[int | None, int | None]:
        """(signal or DIR_LOST to stop for, first non-finite step), agreed over ranks; call at the same steps on
        every rank."""
        flags = torch.stack([torch.tensor(self._stop_code(), device=self._first_bad.device), self._first_bad])
        if world > 1 and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, first_bad = (int(v) for v in flags.tolist())
        return signum or None, first_bad or None

    def signalled(self) -> bool:
        """The local flag, for one process (free to read at every step)."""
        return self._stop_code() != 0

    def start_vote(self) -> None:
        """Several ranks: post this step's signal vote (MAX over ranks of the local flag) without waiting; every
        rank calls it once per step, after ``vote``."""
        if self._vote_group is None:
            return
        self._vote_flag = torch.tensor([self._stop_code()], dtype=torch.long)
        self._vote_work = dist.all_reduce(self._vote_flag, op=dist.ReduceOp.MAX, group=self._vote_group, async_op=True)

    def vote(self) -> int | None:
        """The signal any rank had received when the previous step's vote was posted (the same on every rank),
        or None; the vote has had a whole step to finish, so waiting for it costs nothing in practice."""
        if self._watchdog is not None:
            self._watchdog.stepped()
        if self._vote_work is None:
            return None
        self._vote_work.wait()
        self._vote_work = None
        return int(self._vote_flag[0]) or None
