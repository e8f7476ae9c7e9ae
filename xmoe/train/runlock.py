"""The run directory's lock: one trainer at a time per ``--out``, and a lock left by a run that died taken over.

Rank 0 takes an exclusive lock on ``OUT/xmoe.lock`` (``flock``; the file records pid, host and start time, and its
holder touches it every HEARTBEAT_S seconds). The kernel drops a ``flock`` when its process dies, so a lock file
whose flock is free was left by a run that ended without releasing it, and is taken over (saying what was checked).
Another host's lock file is taken over only once it has not been touched for STALE_AFTER_S seconds: where a
filesystem keeps flocks per host, a free flock proves nothing about a run on another host. Where ``flock`` is
unsupported, the file itself is the lock: created with O_EXCL, and taken over only when it names a process of this
host that no longer runs, or has not been touched for STALE_AFTER_S. The lock file is opened without following
links (a link there is refused, its target left alone), and a wait for another host's heartbeat is timed by this
host's clock, so a lock stamped in the future by a host whose clock runs ahead ends the wait all the same.

The holder keeps a descriptor of the directory itself: ``lost`` tells when the directory it locked, or its lock
file, is no longer at its path (deleted, moved, replaced), and ``release`` then leaves the path alone, which may be
another run's by now.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any, Self

log = logging.getLogger(__name__)

LOCK = "xmoe.lock"
HEARTBEAT_S = 15.0  # a lock holder touches its lock file this often
STALE_AFTER_S = 60.0  # another host's lock file untouched this long belongs to a run that has ended
LOST_CHECK_S = 1.0  # between the saves and logs it always checks, a trainer looks for its directory this often


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
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a link is nobody's lock: read nothing through it
        with os.fdopen(fd) as f:
            holder = json.loads(f.read(1 << 16))
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _holder_text(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}" + (
        f" (since {holder['started']})" if holder.get("started") else ""
    )


def _untouched_s(path: Path) -> float:
    """Seconds since the lock file was last written or touched by its holder's heartbeat (0 for a time in the
    future: another host's clock ahead of ours)."""
    try:
        return max(0.0, time.time() - path.lstat().st_mtime)
    except OSError:
        return float("inf")


def refuse_link(path: Path, what: str) -> None:
    """RunDirError when ``path`` is a symbolic link: xmoe writes, moves and deletes a run directory's own entries
    and follows no link there (its target would be overwritten, or its files moved into the run)."""
    if path.is_symlink():
        raise RunDirError(
            f"{path} is a symbolic link (to {os.readlink(path)}), where a run keeps its {what}; xmoe follows no "
            "link inside a run directory: remove the link (its target is left alone) or choose another --out"
        )


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _pid_text(holder: dict[str, Any]) -> str:
    pid = int(holder.get("pid", 0) or 0)
    return f"pid {pid} is not running" if not _pid_alive(pid) else f"pid {pid} now belongs to another process"


class DirLock:
    """An exclusive lock on a run directory, held until ``release`` (or the process's death); while held, a
    thread touches the lock file every HEARTBEAT_S seconds, so other hosts can tell a live holder from a dead one."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self._fd: int | None = None
        self._dir_fd: int | None = None  # the locked directory itself, wherever it goes (lost, release)
        self._checked = 0.0  # monotonic time of lost()'s last look
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
            created = not os.path.lexists(self.path)
            fd = self._open_lock_file(os.O_RDWR | os.O_CREAT)
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
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
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
        self._hold(fd)
        return self

    def _open_lock_file(self, flags: int) -> int:
        """``os.open`` of the lock file that follows no link and opens nothing but a plain file."""
        refuse_link(self.path, "lock file")
        try:
            fd = os.open(self.path, flags | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:  # made a link between the check above and the open
                refuse_link(self.path, "lock file")
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunDirError(f"{self.path} is not a plain file; remove it (a run makes its lock file itself)")
        return fd

    def _hold(self, fd: int) -> None:
        """The lock is ours: remember the directory it locks (by descriptor) and start the heartbeat."""
        self._fd = fd
        self._dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        self._start_heartbeat()

    def lost(self, *, now: bool = True) -> str:
        """Why the locked directory is no longer this run's (deleted, moved or replaced, or its lock file removed
        or replaced), or "" while it is. Two stats; unless ``now``, at most once per LOST_CHECK_S ("" between)."""
        if self._fd is None or self._dir_fd is None:
            return ""
        now_s = time.monotonic()
        if not now and now_s - self._checked < LOST_CHECK_S:
            return ""
        self._checked = now_s
        out = self.path.parent
        try:
            here = _identity(os.stat(out))
        except FileNotFoundError:
            return f"run directory {out} was deleted"
        if here != _identity(os.fstat(self._dir_fd)):
            return f"run directory {out} was moved or replaced by another directory"
        try:
            lock = _identity(os.lstat(self.path))
        except FileNotFoundError:
            return f"run directory {out} was changed under this run: its lock file {self.path} was removed"
        if lock != _identity(os.fstat(self._fd)):
            return f"run directory {out} was changed under this run: its lock file {self.path} was replaced"
        return ""

    def _check_free_flock(self, holder: dict[str, Any], host: str) -> None:
        """A lock file with a free flock: stale on this host; on another host only once untouched for
        STALE_AFTER_S (waiting up to that long, so a run requeued after a crash still starts)."""
        checked = "no process holds its flock"
        if holder.get("host") == host:
            self.stale, self.stale_reason = holder, f"{checked} and {_pid_text(holder)}"
            return
        mtime = self.path.lstat().st_mtime
        ahead = mtime - time.time()  # > 0: the holder's host stamped it by a clock ahead of ours
        untouched = _untouched_s(self.path)
        wait_s = max(0.0, STALE_AFTER_S - untouched)
        if wait_s > 0:
            log.info(
                f"{self.path} names {_holder_text(holder)}, touched {untouched:.0f} s ago: waiting up to "
                f"{wait_s:.0f} s to see whether that run is still alive"
            )
        started = time.monotonic()  # this host's clock times the wait: the file's stamp may be in the future
        while (waited := time.monotonic() - started) < wait_s:
            time.sleep(min(1.0, wait_s - waited))
            if self.path.lstat().st_mtime != mtime:
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_holder_text(holder)}: its lock file is kept "
                    f"fresh, so that run is alive (this filesystem's flocks do not reach across hosts); wait for it "
                    "to end or stop it, or choose another --out"
                )
        self.stale = holder
        if ahead > 1.0:
            self.stale_reason = (
                f"{checked} and its lock file, stamped {ahead:.0f} s in the future (that host's clock runs ahead "
                f"of this one's), did not change for {waited:.0f} s (a live run touches it every {HEARTBEAT_S:.0f} s)"
            )
        else:
            self.stale_reason = (
                f"{checked} and its host has not touched the lock file for {untouched + waited:.0f} s (a live "
                f"run touches it every {HEARTBEAT_S:.0f} s)"
            )

    def _acquire_exclusive_file(self, me: dict[str, Any]) -> Self:
        """Fallback without flock: the lock file's existence is the lock; a dead holder on this host, or one that
        has not touched the file for STALE_AFTER_S, is stale."""
        try:
            fd = self._open_lock_file(os.O_WRONLY | os.O_CREAT | os.O_EXCL)
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
        self._hold(fd)
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
        # before unlocking, so that a waiter locks a fresh file, not this one; only the file this lock holds, in the
        # directory it locked: the path may name another run's lock by now (lost)
        assert self._dir_fd is not None  # set with _fd
        try:
            if _identity(os.stat(LOCK, dir_fd=self._dir_fd, follow_symlinks=False)) == _identity(os.fstat(self._fd)):
                os.unlink(LOCK, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        os.close(self._dir_fd)
        self._fd = self._dir_fd = None
