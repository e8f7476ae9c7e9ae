"""Checks of values that configs and commands share: a config field's value against its annotation, a positive
finite number, a path that leads nowhere, a write that found the disk full. Each raises (or returns) an error
naming the value and the fix."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import shutil
import types
import typing
from typing import Literal


def missing(path: str | os.PathLike[str], what: str, fix: str = "") -> FileNotFoundError:
    """The error for a path that leads to no file or directory, ending in ``fix``: a looping or dangling symlink is
    named as such (a plain existence check reports both as "not found")."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return FileNotFoundError(f"{what} {str(path)!r} is a symlink loop; point at the file itself")
        if os.path.islink(path):
            return FileNotFoundError(
                f"{what} {str(path)!r} is a symlink to {os.readlink(path)!r}, which does not "
                "exist; point at the file itself"
            )
    return FileNotFoundError(f"{what} {str(path)!r} not found" + (f"; {fix}" if fix else ""))


class DiskFullError(OSError):
    """A write that failed for want of space (ENOSPC, EDQUOT): its text names the file and the free space."""

    def __str__(self) -> str:
        return str(self.strerror)


def _is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT anywhere in the exception's chain, or in its text (safetensors reports a Rust I/O error)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(seen) for words in ("No space left on device", "Disk quota exceeded", "StorageFull")):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def free_space(path: str | os.PathLike[str]) -> str:
    """The free space of the filesystem ``path`` is (or would be) on, in words."""
    where = os.path.abspath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        return f"{shutil.disk_usage(where).free / 2**20:.0f} MiB free on its filesystem"
    except OSError:
        return "free space unknown"


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]):
    """Around a write of ``path``: a full disk, however the writer reports it, becomes a DiskFullError naming the
    file and the free space; other errors pass unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if not _is_disk_full(e):
            raise
        raise DiskFullError(
            errno.ENOSPC, f"disk full writing {path} ({free_space(path)}); free some space or write elsewhere"
        ) from e


def positive(name: str, value: int | float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} ({value}) must be finite and > 0")


def _describe(kind: typing.Any) -> str:
    """What a value of annotation ``kind`` looks like, for error messages."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        kind, getattr(kind, "__name__", str(kind))
    )


def _conforms(value: typing.Any, kind: typing.Any) -> bool:
    if typing.get_origin(kind) is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(kind))
    if typing.get_args(kind) and typing.get_origin(kind) is not Literal:  # Optional[X] / X | None
        return any(_conforms(value, a) for a in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is float:  # an integer is a fine number (JSON and TOML write 1 for 1.0); a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:  # 16.0 or true as a count is a mistake to report, not to round
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_types(obj: typing.Any) -> None:
    """Raise ValueError naming ``section.field``, the value and the expected type for any field of the config
    dataclass ``obj`` whose value does not match its annotation; integers given for float fields become floats.
    Runs first in every config's __post_init__, so range checks below compare numbers, never strings."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, kind = getattr(obj, f.name), hints[f.name]
        if not _conforms(value, kind):
            name = f"{obj.section}.{f.name}" if obj.section else f.name
            raise ValueError(f"{name} ({value!r}) must be {_describe(kind)}, not {type(value).__name__}")
        if kind in (float, float | None) and isinstance(value, int):
            setattr(obj, f.name, float(value))
