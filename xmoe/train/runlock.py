"""The run directory's lock: one trainer at a time per ``--out``, and a lock left by a run that died taken over.

Rank 0 takes an exclusive lock on ``OUT/xmoe.lock`` (``flock``; the file records pid, host and start time, and its
holder touches it every HEARTBEAT_S seconds). The kernel drops a ``flock`` when its process dies, so a lock file
whose flock is free was left by a run that ended without releasing it, and is taken over (saying what was checked).
Another host's lock file is taken over only once it has not been touched for STALE_AFTER_S seconds: where a
filesystem keeps flocks per host, a free flock proves nothing about a run on another host. Where ``flock`` is
unsupported, the file itself is the lock: created with O_EXCL, and taken over only when it names a process of this
host that no longer runs, or has not been touched for STALE_AFTER_S.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Self

log = logging.getLogger(__name__)

LOCK = "xmoe.lock"
HEARTBEAT_S = 15.0  # a lock holder touches its lock file this often
STALE_AFTER_S = 60.0  # another host's lock file untouched this long belongs to a run that has ended


class RunDirError(ValueError):
    """The run directory cannot be used as asked (locked, already holds a run, not a directory)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _holder_text(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}" + (
        f" (since {holder['started']})" if holder.get("started") else ""
    )


def _untouched_s(path: Path) -> float:
    """Seconds since the lock file was last written or touched by its holder's heartbeat."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return float("inf")


def _pid_text(holder: dict[str, Any]) -> str:
    pid = int(holder.get("pid", 0) or 0)
    return f"pid {pid} is not running" if not _pid_alive(pid) else f"pid {pid} now belongs to another process"


class DirLock:
    """An exclusive lock on a run directory, held until ``release`` (or the process's death); while held, a
    thread touches the lock file every HEARTBEAT_S seconds, so other hosts can tell a live holder from a dead one."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self._fd: int | None = None
        self.stale: dict[str, Any] | None = None  # the dead holder whose lock was taken over
        self.stale_reason = ""  # what showed that holder to be gone
        self._stop_beating = threading.Event()
        self._beating: threading.Thread | None = None

    def acquire(self) -> Self:
        me: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        for _ in range(5):  # retried only when a releasing holder unlinks the file between open and lock
            created = not self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_holder_text(_read_holder(self.path))}; "
                    "wait for that run to end or stop it, or choose another --out"
                ) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                if created:  # the empty file just made by the open above is nobody's lock
                    self.path.unlink(missing_ok=True)
                return self._acquire_exclusive_file(me)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # locked a file that was unlinked meanwhile: the lock is on the new one
        else:
            raise RunDirError(f"could not lock {self.path}: it keeps being replaced; is another run starting?")
        previous = _read_holder(self.path)
        if previous:  # the flock was free: whoever wrote this ended without releasing it, unless on another host
            try:
                self._check_free_flock(previous, me["host"])
            except RunDirError:
                os.close(fd)
                raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        self._start_heartbeat()
        return self

    def _check_free_flock(self, holder: dict[str, Any], host: str) -> None:
        """A lock file with a free flock: stale on this host; on another host only once untouched for
        STALE_AFTER_S (waiting up to that long, so a run requeued after a crash still starts)."""
        checked = "no process holds its flock"
        if holder.get("host") == host:
            self.stale, self.stale_reason = holder, f"{checked} and {_pid_text(holder)}"
            return
        untouched = _untouched_s(self.path)
        if untouched < STALE_AFTER_S:
            log.info(
                f"{self.path} names {_holder_text(holder)}, touched {untouched:.0f} s ago: waiting up to "
                f"{STALE_AFTER_S - untouched:.0f} s to see whether that run is still alive"
            )
        mtime = self.path.stat().st_mtime
        while untouched < STALE_AFTER_S:
            time.sleep(min(1.0, STALE_AFTER_S - untouched))
            if self.path.stat().st_mtime != mtime:
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_holder_text(holder)}: its lock file is kept "
                    f"fresh, so that run is alive (this filesystem's flocks do not reach across hosts); wait for it "
                    "to end or stop it, or choose another --out"
                )
            untouched = _untouched_s(self.path)
        self.stale = holder
        self.stale_reason = (
            f"{checked} and its host has not touched the lock file for {untouched:.0f} s (a live "
            f"run touches it every {HEARTBEAT_S:.0f} s)"
        )

    def _acquire_exclusive_file(self, me: dict[str, Any]) -> Self:
        """Fallback without flock: the lock file's existence is the lock; a dead holder on this host, or one that
        has not touched the file for STALE_AFTER_S, is stale."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_holder(self.path)
            pid = int(holder.get("pid", 0) or 0)
            untouched = _untouched_s(self.path)
            if holder.get("host") == me["host"] and not _pid_alive(pid):
                self.stale_reason = f"pid {pid} is not running"
            elif untouched >= STALE_AFTER_S:
                self.stale_reason = (
                    f"its lock file has not been touched for {untouched:.0f} s (a live run touches "
                    f"it every {HEARTBEAT_S:.0f} s)"
                )
            else:
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_holder_text(holder)} (its lock file was "
                    f"touched {untouched:.0f} s ago); wait for that run to end or stop it, or choose another --out "
                    f"(a lock file untouched for {STALE_AFTER_S:.0f} s is taken over)"
                ) from None
            self.stale = holder
            self.path.unlink(missing_ok=True)
            return self._acquire_exclusive_file(me)
        os.write(fd, json.dumps(me).encode())
        self._fd = fd
        self._start_heartbeat()
        return self

    def _start_heartbeat(self) -> None:
        stop, fd = self._stop_beating, self._fd
        assert fd is not None  # called right after the lock is taken

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    os.utime(fd)
                except OSError:
                    pass  # a filesystem that refuses it: other hosts then wait STALE_AFTER_S longer, no more

        self._beating = threading.Thread(target=beat, name="xmoe-lock-heartbeat", daemon=True)
        self._beating.start()

    def release(self) -> None:
        """Unlock (nothing to do when not held)."""
        if self._fd is None:
            return
        if self._beating is not None:  # stopped before the descriptor closes: it never touches a reused one
            self._stop_beating.set()
            self._beating.join()
        self.path.unlink(missing_ok=True)  # before unlocking: a waiter then locks a fresh file, not this one
        os.close(self._fd)
        self._fd = None
