"""Read and write Hugging Face checkpoint directories (config.json + safetensors shards).

# E experts, H hidden, F expert ffn

Reading streams shard by shard: each shard is opened once (memory-mapped by safetensors) and each tensor is
copied into its parameter as soon as it is read, so the host never holds more than one tensor besides the model.
Into a parallelised model (DTensor parameters: xmoe/parallel/build.py) each rank reads only the part of each
tensor its shard covers (safetensors slices), and only the experts it owns. ``experts`` (a range of expert
numbers) reads only those routed experts of a plain model and leaves the rest at their initial values.

Writing uses the published layout: one tensor per expert matrix (``...experts.{e}.gate_proj.weight``, (F, H)),
``model.safetensors`` when everything fits in ``max_shard_bytes``, else ``model-0000k-of-0000n.safetensors``
plus ``model.safetensors.index.json`` (weight_map and total_size), as transformers writes them.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from xmoe.checks import missing, writing
from xmoe.config import ModelConfig
from xmoe.hf.families import DEEPSEEK, SCORE_BIAS_FAMILIES, fitting_family, hf_config_from_model, model_config_from_hf
from xmoe.hf.names import SHARED_COPY, expert_index, mla_rope_rows, tensor_names
from xmoe.hf.shards import INDEX_FILE, SINGLE_FILE, check_sizes, open_shard, read_json, weight_map
from xmoe.kernels.choice import resolve_kernels
from xmoe.model.init import local_box
from xmoe.model.transformer import Transformer

__all__ = ["INDEX_FILE", "SINGLE_FILE", "check_sizes", "read_json"]  # re-exported: readers import them from here
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
RUN_HF_CONFIG = "hf_config.json"  # in a run directory: the config.json it was imported from (export reuses it)
RUN_TOKENIZER = "tokenizer.json"  # in a run or HF directory: the tokenizer text goes through
log = logging.getLogger(__name__)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_config(path: str | os.PathLike) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise missing(file, "config file", "point at a Hugging Face model directory")
    return read_json(file, "restore the model directory's config.json")


def read_model_config(path: str | os.PathLike, max_seq_len: int | None = None) -> tuple[dict, ModelConfig]:
    """(config.json, the ModelConfig it describes) of a Hugging Face directory; errors name the file. The
    multi-token-prediction modules are those the checkpoint holds (transformers writes num_nextn_predict_layers 1
    into DeepSeek-V3 configs whose weights have none)."""
    hf = read_config(path)
    held = _mtp_modules_held(Path(path), hf)  # outside the try: a damaged weight map is named as itself
    try:
        return hf, model_config_from_hf(hf, max_seq_len, held)
    except KeyError as e:
        raise ValueError(
            f"{Path(path) / 'config.json'} lacks the field {e} that a {hf.get('model_type')} config needs"
        ) from None
    except (TypeError, ValueError) as e:  # "hidden_size": "128" reaches arithmetic or the config's type check
        quoted = [f"{k}: {v!r}" for k, v in hf.items() if isinstance(v, str) and _numeric(v)]
        why = f"numbers written as strings ({', '.join(quoted)}); write them without quotes" if quoted else str(e)
        raise ValueError(f"{Path(path) / 'config.json'}: {why}") from None


def _mtp_modules_held(path: Path, hf: dict) -> int | None:
    """The multi-token-prediction modules of a DeepSeek-V3 checkpoint (layers num_hidden_layers + d holding an
    eh_proj, d = 0, 1, ...), when its config declares some and its weights are there (else None: the config's)."""
    declared = hf.get("num_nextn_predict_layers") or 0
    if hf.get("model_type") != "deepseek_v3" or not isinstance(declared, int) or declared <= 0:
        return None
    try:
        names = weight_map(path)
    except FileNotFoundError:
        return None
    layers = hf.get("num_hidden_layers", 0)
    held = 0
    while held < declared and f"model.layers.{layers + held}.eh_proj.weight" in names:
        held += 1
    if held < declared:  # common: transformers saves DeepSeek-V3 models without them, declaring one
        log.debug(
            "%s: config.json declares %d multi-token-prediction module(s) (num_nextn_predict_layers), the weights "
            "hold %d: importing %d",
            path,
            declared,
            held,
            held,
        )
    return held


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _beyond_model(name: str, num_layers: int) -> bool:
    """Tensors of layers past num_hidden_layers: DeepSeek-V3's multi-token-prediction modules, unused when the model
    has none (or fewer)."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= num_layers


@torch.no_grad()
def load_weights(
    model: Transformer, path: str | os.PathLike, hf_config: dict | None = None, experts: range | None = None
) -> None:
    """Copy the checkpoint at ``path`` into ``model`` (built for the same config), streaming shard by shard."""
    path = Path(path)
    hf = hf_config if hf_config is not None else read_config(path)
    family, cfg = hf["model_type"], model.cfg
    deinterleave = family == "deepseek_v2" or (family == "deepseek_v3" and hf.get("rope_interleave", True))
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    wanted: dict[str, tuple[str, str | None]] = {}  # HF name -> (our name, expert matrix or None)
    skipped: set[str] = set()
    for ours, theirs, matrix in tensor_names(cfg, family):
        if matrix == SHARED_COPY or (
            matrix is not None and experts is not None and expert_index(theirs) not in experts
        ):
            skipped.add(theirs)
        else:
            wanted[theirs] = (ours, matrix)
    weights = weight_map(path)
    for d in _absent_mtp_modules(cfg, wanted, weights, path):
        wanted = {theirs: v for theirs, v in wanted.items() if not v[0].startswith(f"mtp.{d}.")}
    missing = [name for name in wanted if name not in weights]
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors the {family} config implies are missing, e.g. {missing[:3]}")
    unexpected = [n for n in weights if n not in wanted and n not in skipped and not _beyond_model(n, cfg.num_layers)]
    if unexpected:
        raise ValueError(f"{path}: tensors xmoe has no place for (unsupported options?), e.g. {unexpected[:3]}")
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in wanted:
        by_file[weights[name]].append(name)
    for file in sorted(by_file):
        with open_shard(path / file) as f:
            for name in by_file[file]:
                ours, matrix = wanted[name]
                rows = mla_rope_rows(cfg, ours) if deinterleave and matrix is None else None
                try:
                    _read_into(f, name, targets[ours], matrix is not None, rows, path)
                except SafetensorError as e:  # a shard whose header is whole but whose data is not
                    raise ValueError(
                        f"{path / file}: tensor {name} is unreadable ({e}); download or export the model again"
                    ) from None


def _absent_mtp_modules(cfg: ModelConfig, wanted: dict, weight_map: dict, path: Path) -> list[int]:
    """The multi-token-prediction modules of ``cfg`` the checkpoint holds no tensor of: they keep their initial
    values (adding prediction modules to a model that has none), with a warning."""
    absent = []
    for d in range(cfg.mtp_depth):
        names = [theirs for theirs, (ours, _) in wanted.items() if ours.startswith(f"mtp.{d}.")]
        if not any(name in weight_map for name in names):
            absent.append(d)
    if absent:
        log.warning(
            "%s holds no multi-token-prediction module %s: left at initial values", path, ", ".join(map(str, absent))
        )
    return absent


def _read_into(f, name: str, target: torch.Tensor, is_expert: bool, rope_rows: torch.Tensor | None, path: Path) -> None:
    """Copy HF tensor ``name`` into this rank's part of ``target`` (a plain tensor or a DTensor shard), reading only
    that part: one expert of an (E, A, B) stack is HF's (B, A) matrix, transposed; other tensors share the layout
    (MLA's rope rows permuted: those are read whole, one tensor at a time)."""
    local, shape, offset = local_box(target)
    box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=False))
    stored = f.get_slice(name)
    want: tuple[int, ...]
    if is_expert:
        expert, shape, box = expert_index(name) - offset[0], shape[1:], box[1:]
        if not 0 <= expert < local.shape[0]:
            return  # another EP rank's expert
        local, want = local[expert], (shape[1], shape[0])
    else:
        want = shape
    if tuple(stored.get_shape()) != tuple(want):
        raise ValueError(f"{path}: {name} has shape {tuple(stored.get_shape())}, the config implies {tuple(want)}")
    if local.numel() == 0:
        return
    if is_expert:
        tensor = stored[box[1], box[0]].T
    elif rope_rows is not None:
        tensor = f.get_tensor(name)[rope_rows][box]
    else:
        tensor = stored[box]
    local.copy_(tensor)


def load_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    max_seq_len: int | None = None,
    experts: range | None = None,
) -> Transformer:
    """An xmoe Transformer (eval mode) with the architecture and weights of a Hugging Face directory.

    ``model(tokens)`` returns logits. ``max_seq_len`` caps the rotary tables (default: the config's
    max_position_embeddings). The imported config.json stays on the model as ``model.hf_config``.
    """
    hf, cfg = read_model_config(path, max_seq_len)
    check_sizes(path, hf, cfg)  # before anything is allocated: sizes the weights do not hold are refused
    # the MoE layers' kernels for the device the model runs on (the environment's kernels section)
    kernels = resolve_kernels(cfg.moe.kernel_backend, device=device) if cfg.has_moe else None
    with torch.device("meta"):
        model = Transformer(cfg, kernels=kernels)
    model.to_empty(device=device)
    model.init_weights(seed=0)  # rotary tables, buffers, and values for experts this call does not read
    load_weights(model, path, hf, experts)
    if dtype != torch.float32:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    model.hf_config = hf  # type: ignore[assignment]  # a plain attribute (nn.Module's __setattr__ takes modules)
    return model.eval()


def _save_shard(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """One safetensors shard; a full disk (which safetensors reports as its own error) named with the free space."""
    with writing(file):
        save_file(tensors, str(file), metadata={"format": "pt"})


def _follow_umask(files: list[Path]) -> None:
    """safetensors writes its files 0600 whatever the umask; give them the mode every other file gets."""
    umask = None
    try:  # read, not set: setting it, even back, races with other threads creating files meanwhile
        status = Path("/proc/self/status").read_text()
        umask = next(int(line.split()[1], 8) for line in status.splitlines() if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    if umask is None:
        umask = os.umask(0o077)  # the strictest mode meanwhile
        os.umask(umask)
    for file in files:
        os.chmod(file, 0o666 & ~umask)


def _hf_tensors(model: Transformer, family: str):
    """(HF name, tensor) in write order; expert matrices transposed to HF's (out, in) and made contiguous."""
    cfg = model.cfg
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for ours, theirs, matrix in tensor_names(cfg, family):
        tensor = targets[ours].detach()
        if matrix == SHARED_COPY:  # the embedding or head again, as the published layout stores it for each MTP
            tensor = tensor.clone()  # module: safetensors refuses tensors that share memory
        elif matrix is not None:
            tensor = tensor[expert_index(theirs)].T
        elif family in DEEPSEEK and (rows := mla_rope_rows(cfg, ours)) is not None:
            tensor = tensor[torch.argsort(rows)]  # halves -> interleaved, the published layout
        yield theirs, tensor


@torch.no_grad()
def _plan_shards(
    model: Transformer, family: str, out_dtype: torch.dtype, max_shard_bytes: int
) -> tuple[list[str], dict[str, str], int]:
    """(shard file names, each tensor's file, total bytes): tensors in write order, a new shard wherever the next
    tensor would take the current one past ``max_shard_bytes``; one file of the single-file name when all fit."""
    shards: list[list[str]] = [[]]
    shard_bytes, total = 0, 0
    sizes = {name: t.numel() * out_dtype.itemsize for name, t in _hf_tensors(model, family)}
    for name, size in sizes.items():
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
        total += size
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    return files, {name: files[i] for i, names in enumerate(shards) for name in names}, total


def _write_index(path: Path, files: list[str], file_of: dict[str, str], total: int) -> None:
    """The shard index where there are several shards (a reader prefers the index: a single file an earlier save
    left is dropped), none where there is one."""
    if len(files) > 1:
        (path / SINGLE_FILE).unlink(missing_ok=True)
        index = {"metadata": {"total_size": total}, "weight_map": file_of}
        with writing(path / INDEX_FILE):
            (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    else:
        (path / INDEX_FILE).unlink(missing_ok=True)


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    *,
    family: str | None = None,
    base_config: dict | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory loadable by AutoModelForCausalLM.from_pretrained.

    ``family`` defaults to ``fitting_family(model.cfg)``; ``base_config`` (default: the ``hf_config`` an import left
    on the model) supplies the config fields xmoe does not model (token ids and the like).
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes ({max_shard_bytes}) must be > 0")
    cfg = model.cfg
    family = family or fitting_family(cfg)
    hf = hf_config_from_model(
        cfg, family, base_config if base_config is not None else getattr(model, "hf_config", None)
    )
    out_dtype = dtype or model.embed.weight.dtype
    if out_dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype ({out_dtype}) must be one of {list(_DTYPE_NAMES)}")
    hf["dtype"] = _DTYPE_NAMES[out_dtype]
    if family not in SCORE_BIAS_FAMILIES and any(bool(m.router.expert_bias.any()) for m in model.moe_layers()):
        raise ValueError(
            f"the routers hold a non-zero expert_bias (loss-free balancing), which {family} checkpoints "
            "cannot store; export as deepseek_v3 or train with moe.bias_update_rate=0"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    # 1. plan shards from sizes alone (nothing is copied yet)
    files, file_of, total = _plan_shards(model, family, out_dtype, max_shard_bytes)
    # 2. write one shard at a time
    pending: dict[str, torch.Tensor] = {}
    current = files[0]
    for name, tensor in _hf_tensors(model, family):
        if file_of[name] != current:
            _save_shard(pending, path / current)
            pending, current = {}, file_of[name]
        pending[name] = tensor.to("cpu", out_dtype).contiguous()
    _save_shard(pending, path / current)
    _follow_umask([path / f for f in files])
    _write_index(path, files, file_of, total)
    with writing(path / "config.json"):
        (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return path
