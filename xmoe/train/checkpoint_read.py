"""Reading a distributed checkpoint without running code from it.

torch.distributed.checkpoint (DCP) stores two things through pickle: the ``.metadata`` file (which tensor lies
where) and every non-tensor value of the state (the optimizer's param groups: learning rate, betas, flags, the
parameter names), each a ``torch.save`` blob inside a ``__<rank>_0.distcp`` file. DCP's own reader unpickles both
without restriction (``pickle.load``, ``torch.load(weights_only=False)``), so a crafted checkpoint could run
code when it is read. xmoe reads them through allow-lists instead:

* ``.metadata``: an unpickler that resolves only the classes DCP's metadata is made of (its dataclasses, torch
  dtypes, layouts and sizes, paths) and refuses any other global, naming it;
* non-tensor values: ``torch.load(weights_only=True)``, torch's restricted unpickler (numbers, strings, bools,
  None, lists, tuples, dicts, tensors).

Tensor data already goes through ``torch.load(weights_only=True)`` in DCP itself. A refusal is a
``CheckpointError`` naming the file and what it held. The crc32 in meta.json detects damage, not tampering:
whoever can rewrite a checkpoint can rewrite meta.json too, so safety rests on these readers, not on checksums.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from xmoe.train.checkpoint_dir import CheckpointError

# module -> names the metadata pickle may name; "*dtype" stands for every torch dtype
_METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # looks a layout up by name among torch's own
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _refusal(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path} holds {what}, which an xmoe checkpoint never holds: refusing to read it (a crafted or foreign "
        "file would run code). Use a checkpoint written by xmoe, or delete this one."
    )


def read_metadata(ckpt: Path) -> Metadata:
    """The DCP metadata of checkpoint directory ``ckpt``, through the allow-listed unpickler."""
    path = ckpt / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise _refusal(path, f"a Python object of type {e}") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise _refusal(path, f"a {type(metadata).__name__} where DCP metadata belongs")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with the metadata read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: xmoe never writes them
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not an xmoe checkpoint format")
        metadata = read_metadata(Path(self.path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = getattr(self, "load_id", None)  # as DCP's reader does: the load this read belongs to
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner with every non-tensor value read by torch's restricted unpickler."""

    def __init__(self, ckpt: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ckpt = ckpt

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch's message names the refused global
            what = f"of type {named[1]}" if named else "outside torch's weights-only allow-list"
            raise _refusal(self.ckpt / "*.distcp", f"a Python object {what} as {read_item.dest_index.fqn}") from None
        # hand the value on as a fresh blob of what was read, so DCP's own placement (its flattening of nested
        # state) applies unchanged; it unpickles only what the restricted reader just accepted
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)
