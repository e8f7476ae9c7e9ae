"""Which files of a Hugging Face directory hold its tensors, and what shapes they have, read from the safetensors
headers alone (no tensor data): what is checked before anything is allocated.

* One model per directory: ``model.safetensors`` beside an index that names other shards is two models (transformers
  would load the single file, a reader of the index the shards); it is refused rather than guessed.
* The index names shards by plain file names in the directory: a name with a path (``../x``, ``/x``, ``a/b``) is
  refused, so nothing outside the directory is read or has its size reported. A shard that is a symbolic link is
  followed: Hugging Face's own cache keeps its files as links into a blob store.
* config.json's sizes against the weights (``check_sizes``): the layer and expert counts first, then the shape of
  every tensor present that the config implies, on a model built on the meta device; a mismatch names the
  config.json field(s).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open

from xmoe.config import ModelConfig
from xmoe.hf.names import SHARED_COPY, tensor_names
from xmoe.model.transformer import Transformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FIX = "download or export the model again"


def read_json(file: Path, fix: str) -> dict:
    """A JSON object from ``file``; ValueError naming the file and ``fix`` when it is not one."""
    try:
        value = json.loads(file.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not text (not UTF-8); {fix}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value


@contextmanager
def open_shard(file: Path):
    """safe_open, with errors that name the shard (a truncated or zeroed file fails in its header)."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}); {_FIX}") from None
    with handle as f:
        yield f


def _plain_name(index: Path, name: str) -> None:
    parts = PurePosixPath(name).parts
    if len(parts) != 1 or parts[0] in (".", "..") or "\\" in name or "\0" in name or os.path.isabs(name):
        raise ValueError(
            f"{index} names {name!r} as a shard, which is not a file name in {index.parent} (a name with a path "
            f"reaches outside the model's directory); {_FIX}"
        )


def weight_map(path: Path) -> dict[str, str]:
    """HF tensor name -> the shard file (a plain name in ``path``) holding it."""
    index, single = path / INDEX_FILE, path / SINGLE_FILE
    if index.is_file():
        weight_map = read_json(index, _FIX).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor names to shard files; {_FIX}")
        files = sorted(set(weight_map.values()))
        for name in files:
            _plain_name(index, name)
        others = [name for name in files if name != SINGLE_FILE]
        if single.is_file() and others:
            raise ValueError(
                f"{path} holds two models: {SINGLE_FILE} and {INDEX_FILE}, which names {others[0]}"
                f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}; transformers would load "
                f"{SINGLE_FILE}, xmoe does not guess: remove the one that is not the model"
            )
        return weight_map
    if single.is_file():
        with open_shard(single) as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    raise FileNotFoundError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def header_shapes(path: Path, weights: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from its shard's header (no tensor data is read)."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in weights.items():
        by_file[file].append(name)
    shapes = {}
    for file, names in sorted(by_file.items()):
        with open_shard(path / file) as f:
            held = set(f.keys())
            for name in names:
                if name not in held:
                    raise ValueError(f"{path / INDEX_FILE} puts {name} in {file}, which does not hold it; {_FIX}")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _fields(hf: dict, values: set[int]) -> list[str]:
    """config.json's integer fields whose value is one of ``values``, as "name (value)"."""
    return [f"{k} ({v})" for k, v in hf.items() if isinstance(v, int) and not isinstance(v, bool) and v in values]


def _refuse(path: Path, what: list[str], held: str) -> ValueError:
    claim = " and ".join(what) if what else "its sizes"
    return ValueError(
        f"{path / 'config.json'} claims {claim}, but {held}; fix config.json, or use the weights it was written for"
    )


def check_sizes(path: str | os.PathLike, hf: dict, cfg: ModelConfig) -> None:
    """ValueError naming the config.json field whose size the weights of ``path`` do not hold (``cfg``: the
    ModelConfig read from ``hf``, its config.json); reads headers only and allocates nothing."""
    path = Path(path)
    weights = weight_map(path)
    # counts by the highest number present: a rank's file may hold only its own experts (what is missing is for
    # the reader to name); more layers than the config's are DeepSeek-V3's prediction modules
    layers = 1 + max((int(m.group(1)) for n in weights if (m := re.match(r"model\.layers\.(\d+)\.", n))), default=-1)
    if cfg.num_layers > layers:
        raise _refuse(path, _fields(hf, {cfg.num_layers}), f"the weights hold {layers} layers")
    experts = 1 + max((int(m.group(1)) for n in weights if (m := re.search(r"\.experts\.(\d+)\.", n))), default=-1)
    if experts and cfg.moe.num_experts > experts:
        raise _refuse(path, _fields(hf, {cfg.moe.num_experts}), f"the weights hold {experts} routed experts")
    shapes = header_shapes(path, weights)
    with torch.device("meta"):  # shapes only: the layer and expert counts are bounded by the weights now
        model = Transformer(cfg)
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for ours, theirs, matrix in tensor_names(cfg, hf["model_type"]):
        shape = tuple(targets[ours].shape)
        expert = matrix is not None and matrix != SHARED_COPY
        want = (shape[2], shape[1]) if expert else shape  # one expert, stored (out, in)
        have = shapes.get(theirs)
        if have is not None and have != want:  # a missing tensor is named by the reader, which knows what it needs
            raise _refuse(path, _fields(hf, set(want) - set(have)), f"the weights' {theirs} is {have}, not {want}")
