"""Several ranks: name a rank that has gone silent long before the collective timeout (``parallel.timeout``) ends
the run, instead of letting the others wait without a word.

Each rank runs a thread that counts up a heartbeat in the launcher's key-value store (the TCPStore at
MASTER_ADDR:MASTER_PORT that the process group was made with, through a connection of its own) every ``beat_s``
seconds; at start it also records its pid and host there. The training step only notes the time on its own
process (``stepped``): nothing crosses the network per step. When ranks 0 and 1 have finished no step for
``stall_s`` seconds, each reads every rank's heartbeat twice, three beats apart: a rank whose count did not move is
silent (stopped, frozen with the interpreter held, or gone), where a rank busy in a slow kernel or collective still
beats. Rank 0 names the silent ranks in one log line (rank 1 does when rank 0 is the silent one), once per stall.
Where there is no store to reach (another launcher), nothing is watched.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import torch.distributed as dist

log = logging.getLogger(__name__)

STALL_S = 60.0  # at most this long without a finished step before silent ranks are named (less under short timeouts)


class Watchdog:
    """Started by the run guard with several ranks; ``stepped`` after every step; ``stop`` at the end."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.stall_s = min(STALL_S, timeout_s / 4)
        self.beat_s = self.stall_s / 4
        self._stepped = time.monotonic()
        self._named = False  # this stall has been reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        store = _store(self.beat_s)
        if store is not None:
            self._thread = threading.Thread(target=self._run, args=(store,), name="xmoe-watchdog", daemon=True)
            self._thread.start()
        return self

    def stepped(self) -> None:
        self._stepped = time.monotonic()
        self._named = False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.beat_s)

    def _run(self, store: dist.Store) -> None:
        beats = 0

        def beat() -> None:
            nonlocal beats
            beats += 1
            store.set(f"beat/{self.rank}", str(beats))

        try:
            store.set(f"who/{self.rank}", f"pid {os.getpid()} on host {socket.gethostname()}")
            beat()
            while not self._stop.wait(self.beat_s):
                beat()
                idle = time.monotonic() - self._stepped
                if self.rank > 1 or self._named or idle < self.stall_s:
                    continue
                self._named = True
                before = self._counts(store)
                for _ in range(3):  # this rank keeps beating while it watches the others
                    if self._stop.wait(self.beat_s):
                        return
                    beat()
                silent = [r for r, count in self._counts(store).items() if count == before[r]]
                if silent and self.rank == min(set(range(self.world)) - set(silent)):
                    self._report(store, silent, time.monotonic() - self._stepped)
        except Exception as e:  # noqa: BLE001 - the store went (a launcher that exited): stop watching
            log.debug(f"rank watchdog stopped: {e}")

    def _counts(self, store: dist.Store) -> dict[int, str | None]:
        keys = {r: f"beat/{r}" for r in range(self.world)}
        return {r: store.get(key).decode() if store.check([key]) else None for r, key in keys.items()}

    def _report(self, store: dist.Store, silent: list[int], idle: float) -> None:
        names = []
        for r in silent[:8]:
            who = store.get(f"who/{r}").decode() if store.check([f"who/{r}"]) else "never started its watch"
            names.append(f"rank {r} ({who})")
        more = f" and {len(silent) - 8} more" if len(silent) > 8 else ""
        log.warning(
            f"no step has finished for {idle:.0f} s: {', '.join(names)}{more} sent no heartbeat for "
            f"{3 * self.beat_s:.0f} s (stopped, frozen or gone); the others wait for it until the collective "
            f"timeout (parallel.timeout = {self.timeout_s:g} s) ends the run, {self.timeout_s - idle:.0f} s from now",
            extra={"all_ranks": True},
        )


def _store(timeout_s: float) -> dist.Store | None:
    """A connection of its own to the launcher's store (prefixed), or None where there is none to reach."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        client = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=max(timeout_s, 5.0))
        )
    except Exception as e:  # noqa: BLE001 - no store there: watch nothing
        log.debug(f"rank watchdog: no store at {host}:{port} ({e})")
        return None
    return dist.PrefixStore("xmoe/watchdog/", client)
