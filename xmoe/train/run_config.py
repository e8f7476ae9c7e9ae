"""How the arguments of `xmoe train` become a RunConfig (the parser itself: cli.py).

Precedence, lowest first: the preset's defaults (for ``kernels``, the environment's: XMOE_WGRAD,
XMOE_AUTOTUNE), then a config file (--config, JSON or TOML with optional sections ``model``, ``moe``,
``train``, ``parallel``, ``kernels``, ``data`` and the top-level keys ``preset`` and ``init_from``), then
``--set section.field=value`` overrides, then the dedicated flags (--steps, --seed, --ep, --tp, --dp, --wgrad,
--data, --preset, ...). ``dp`` is derived last, from the merged ep and tp: processes / (ep * tp) unless given.
Unknown fields and values of the wrong type are errors naming them. The invocation's own choices (--out,
--resume, --overwrite, --device, ...) are not part of the run's config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, cast

from xmoe.checks import missing
from xmoe.config import (
    DataConfig,
    EpOverlap,
    KernelConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

log = logging.getLogger(__name__)

SECTIONS = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "kernels": KernelConfig,
    "data": DataConfig,
}
TOP_LEVEL = ("preset", "init_from")  # RunConfig's own fields: a config file's keys outside any section
# fields of an imported model that training may set freely: they change how it is trained, not which weights it has
# or what it computes
TRAINING_FIELDS = (
    "model.max_seq_len",
    "model.init_std",
    "model.moe.init_std",
    "model.moe.aux_loss_coef",
    "model.moe.balance_scope",
    "model.moe.z_loss_coef",
    "model.moe.bias_update_rate",
    "model.moe.capacity_factor",
    "model.moe.kernel_backend",
    "model.moe.dispatcher",
    "model.moe.dispatch_dtype",
    "model.moe.max_nodes_per_token",
)
# the train section's defaults: tiny's, and the paper presets' (see _default_train); the flags' help names them
TINY, PAPER = TrainConfig(), TrainConfig(lr=3e-4, global_batch_size=8, warmup_steps=100)


def _parse_value(text: str) -> Any:
    """JSON (2, 2.5, true, null, "x") or, failing that, the plain string; the config's type check does the rest."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"none": None, "true": True, "false": False}.get(text.lower(), text)


def _load_file(path: str) -> dict[str, Any]:
    """The config file's sections (tables of fields) and top-level keys (TOP_LEVEL, strings); the paths it names
    (``init_from``, ``data.path``, ``val_path``, ``tokenizer``) relative to the file's directory, as a file that
    names its data beside it means wherever it is run from. A UTF-8 byte-order mark is read as such."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"config file {file} is a directory; pass a .json or .toml file")
    if not file.is_file():
        raise missing(file, "config file")
    if file.suffix not in (".toml", ".json"):
        raise ValueError(f"config file {file} must end in .json or .toml")
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark (some Windows editors write one) is skipped
        if file.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except UnicodeDecodeError:
        raise ValueError(f"config file {file} is not text (not UTF-8); pass a .json or .toml file") from None
    except ValueError as e:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        raise ValueError(f"config file {file} is not valid {file.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {file} must hold sections ({', '.join(SECTIONS)}), not {type(data).__name__}")
    unknown = set(data) - set(SECTIONS) - set(TOP_LEVEL)
    if unknown:
        raise ValueError(
            f"config file {file}: unknown sections {sorted(unknown)}; valid: {sorted(SECTIONS)} and "
            f"the keys {', '.join(TOP_LEVEL)}"
        )
    for name, values in data.items():
        if name in TOP_LEVEL and not (isinstance(values, str) and values.strip()):
            raise ValueError(
                f"config file {file}: {name} ({values!r}) must be a string naming a "
                f"{'preset' if name == 'preset' else 'Hugging Face directory'}"
            )
        if name in SECTIONS and not isinstance(values, dict):
            raise ValueError(
                f"config file {file}: section {name} must be a table of fields (e.g. [{name}] in TOML), not {values!r}"
            )
    if isinstance(data.get("init_from"), str):
        data["init_from"] = _from_file(data["init_from"], file.parent)
    if isinstance(data.get("data"), dict):
        for key in ("path", "val_path", "tokenizer"):
            if isinstance(data["data"].get(key), str):
                data["data"][key] = _from_file(data["data"][key], file.parent)
    return data


def _from_file(spec: str, base: Path) -> str:
    """A path a config file names, joined to the file's directory ``base`` when relative; the synthetic source,
    "bytes" and absolute paths as given, each source of a mixture ("0.7:web,0.3:code") alike."""
    from xmoe.train.mixture import parse_mixture

    if spec == "bytes" or spec.split(":")[0] == "markov" or os.path.isabs(spec) or not spec.strip():
        return spec
    if parse_mixture(spec) is None:
        return str(base / spec)
    items = [item.strip().partition(":") for item in spec.split(",")]
    return ",".join(f"{weight}:{_from_file(source, base)}" for weight, _, source in items)


def _check_val_data(data: DataConfig, train: TrainConfig) -> None:
    """Refuse validation data that is the training data (a file or set of both; "markov" draws held-out samples);
    with val_fraction too, the refusal of two sources of validation data comes first (run_data.py)."""
    from xmoe.train.mixture import parse_mixture

    if data.val_path is None or train.val_fraction > 0:
        return

    def sources(spec: str) -> list[str]:
        mixture = parse_mixture(spec)
        return [spec] if mixture is None else [source for _, source in mixture]

    for val in sources(data.val_path):
        for path in sources(data.path):
            if os.path.exists(val) and os.path.exists(path) and os.path.samefile(val, path):
                raise ValueError(
                    f"the validation data (--val-data / data.val_path: {data.val_path}) is the training data "
                    f"(--data / data.path: {data.path}), whose loss on tokens it trains on says nothing of held-out "
                    "text; pass other data, or --val-fraction to hold out part of --data"
                )


def _apply(obj: Any, section: str, values: dict[str, Any]) -> Any:
    fields = {f.name for f in dataclasses.fields(obj)}
    for key in values:
        renamed = getattr(obj, "renamed", {}).get(key)
        if renamed is not None:
            raise ValueError(f"{section}.{key} is now called {section}.{renamed} (docs/routing.md); set that instead")
        if key not in fields:
            raise ValueError(f"unknown field {section}.{key}; valid fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(obj, **values)  # replace() re-runs validation


def _check_flags(args: argparse.Namespace) -> None:
    """Ranges of the flags that are used before any config validates them."""
    for name in ("dp", "ep", "tp", "gpus_per_node"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be >= 1")
    if not str(args.out).strip():
        raise ValueError(f"--out ({args.out!r}) must name a run directory, e.g. runs/a")


def _start(args: argparse.Namespace, file: dict[str, Any]) -> tuple[str, str | None]:
    """(preset, init_from): where the run's model comes from, each from its flag, else from the config file's key;
    the preset is "tiny" when neither is given, "" under init_from (whose directory sets the architecture)."""
    chosen: dict[str, tuple[str, str]] = {}  # key -> (value, where it was given)
    for key in TOP_LEVEL:
        if getattr(args, key, None):
            chosen[key] = (getattr(args, key), "--" + key.replace("_", "-"))
        elif key in file:
            chosen[key] = (file[key], f"{key} in {args.config}")
    if len(chosen) == 2:
        (preset, where_p), (directory, where_i) = chosen["preset"], chosen["init_from"]
        raise ValueError(
            f"{where_p} ({preset}) and {where_i} ({directory}) both choose the architecture; drop the "
            "preset (the Hugging Face directory's config.json sets it)"
        )
    init_from = chosen["init_from"][0] if "init_from" in chosen else None
    if args.allow_changes and not (args.resume or args.resume_from or init_from):
        raise ValueError("--allow-changes only applies with --resume, --resume-from or --init-from")
    return ("" if init_from else chosen.get("preset", ("tiny",))[0]), init_from


def build_run_config(args: argparse.Namespace, *, read_weights: bool = True) -> RunConfig:
    """The RunConfig of `xmoe train`'s arguments (the module docstring). ``read_weights=False``: an init_from
    directory's config.json alone is read, its weights' sizes not checked (`xmoe plan`, which trains nothing)."""
    from xmoe.model.presets import get_preset

    _check_flags(args)
    file = _load_file(args.config) if args.config else {}
    preset, init_from = _start(args, file)
    if init_from:
        from xmoe.hf.checkpoint import check_sizes, read_model_config

        hf, model = read_model_config(init_from)
        if read_weights:
            check_sizes(init_from, hf, model)  # sizes the weights do not hold, before anything is allocated
    else:
        model = get_preset(preset)
    imported = model
    sections = _sections(args, file, init_from)
    if "moe" in sections["model"]:
        raise ValueError(
            "model.moe is its own section: set its fields as moe.FIELD (e.g. --set moe.top_k=2, or a "
            "[moe] table in --config)"
        )
    if "hidden_size" in sections["model"]:  # the MoE block's width follows the model's unless set explicitly
        sections["moe"].setdefault("hidden_size", sections["model"]["hidden_size"])
    moe = _apply(model.moe, "moe", sections["moe"])
    model = _apply(model, "model", {**sections["model"], "moe": moe})
    if init_from:
        _check_imported(init_from, hf, imported, model, args.allow_changes)
    default_train = TrainConfig(lr=1e-4) if init_from else _default_train(preset, model)
    train = _apply(default_train, "train", sections["train"])
    data = _apply(DataConfig(), "data", sections["data"])
    _check_val_data(data, train)

    parallel = _parallel_config(args, sections["parallel"])
    _check_expert_parallel(model, parallel)
    kernels = _apply(KernelConfig(), "kernels", sections["kernels"])
    return RunConfig(
        model=model, train=train, parallel=parallel, kernels=kernels, data=data, init_from=init_from, preset=preset
    )


def _sections(args: argparse.Namespace, file: dict[str, Any], init_from: str | None) -> dict[str, dict[str, Any]]:
    """Each config section's values, lowest first: the config file's, then --set's, then the dedicated flags'; text
    data under init_from is read with the imported tokenizer unless one is set."""
    sections: dict[str, dict[str, Any]] = {name: dict(file.get(name, {})) for name in SECTIONS}
    for item in args.set:
        key, sep, value = item.partition("=")
        section, dot, field = key.partition(".")
        if not sep or not dot or section not in SECTIONS:
            raise ValueError(f"--set {item!r} must look like SECTION.FIELD=VALUE with SECTION in {sorted(SECTIONS)}")
        sections[section][field] = _parse_value(value)

    flags = {
        "steps": args.steps,
        "seed": args.seed,
        "global_batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "log_every": args.log_every,
        "ckpt_every": args.ckpt_every,
        "compile": args.compile,
        "recompute": args.recompute,
        "optimizer": getattr(args, "optimizer", None),
        "val_fraction": getattr(args, "val_fraction", None),
        "eval_every": getattr(args, "eval_every", None),
    }
    sections["train"].update({k: v for k, v in flags.items() if v is not None})
    if args.tensorboard:
        sections["train"]["tensorboard"] = True
    if getattr(args, "deterministic", False):
        sections["train"]["deterministic"] = True
    for field, value in (("wgrad", getattr(args, "wgrad", None)), ("autotune", getattr(args, "autotune", None))):
        if value is not None:
            sections["kernels"][field] = value
    for field, value in (
        ("dispatcher", args.dispatcher),
        ("kernel_backend", args.kernel_backend),
        ("fp8", getattr(args, "fp8", None)),
        ("dispatch_dtype", getattr(args, "dispatch_dtype", None)),
        ("max_nodes_per_token", getattr(args, "max_nodes_per_token", None)),
    ):
        if value is not None:
            sections["moe"][field] = value
    for field, value in (("path", getattr(args, "data", None)), ("val_path", getattr(args, "val_data", None))):
        if value is not None:
            sections["data"][field] = value
    if init_from and "tokenizer" not in sections["data"]:  # text data is read with the imported tokenizer
        sections["data"]["tokenizer"] = _imported_tokenizer(init_from)
    return sections


def _parallel_config(args: argparse.Namespace, values: dict[str, Any]) -> ParallelConfig:
    """The parallel section with its flags merged; dp derived last, from the world and the merged ep and tp."""
    par_values = dict(values)
    flags = {
        "dp": args.dp,
        "ep": args.ep,
        "tp": args.tp,
        "gpus_per_node": args.gpus_per_node,
        "placement": args.placement,
        "sequence_parallel": args.sequence_parallel or None,
        "timeout": args.timeout,
        "ep_overlap": getattr(args, "ep_overlap", None),
        "ep_chunks": getattr(args, "ep_chunks", None),
    }
    par_values.update({k: v for k, v in flags.items() if v is not None})
    parallel = _apply(ParallelConfig(), "parallel", par_values)  # validates ep and tp before dp divides by them
    if "dp" not in par_values:  # derived after the merge, from the ep and tp that will be used
        world = int(os.environ.get("WORLD_SIZE", "1"))
        parallel = dataclasses.replace(parallel, dp=max(1, world // (parallel.ep * parallel.tp)))
    return parallel


def _check_expert_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The experts divide over the EP ranks; the expert-parallel settings that do nothing at ep == 1 say so."""
    from xmoe.dispatch.base import experts_per_rank  # imports torch: not at module level (xmoe --help)

    experts_per_rank(model.moe.num_experts, parallel.ep)  # the one home of that check; names the fix
    if model.moe.dispatch_dtype == "fp8" and parallel.ep == 1:
        warnings.warn(
            "moe.dispatch_dtype 'fp8' changes how rows travel between expert-parallel ranks and does nothing with "
            "ep == 1 (nothing travels); pass --ep > 1",
            stacklevel=3,
        )
    if model.moe.dispatcher == "rbd" and parallel.ep == 1:
        warnings.warn(
            "moe.dispatcher 'rbd' changes how tokens travel between expert-parallel ranks and does "
            "nothing with ep == 1 (one process runs the local dispatcher); pass --ep > 1",
            stacklevel=3,
        )
    if model.moe.max_nodes_per_token and parallel.ep == 1:
        warnings.warn(
            f"moe.max_nodes_per_token ({model.moe.max_nodes_per_token}) limits the nodes of an expert-parallel "
            "group a token's experts live on and does nothing with ep == 1 (every expert on every rank); pass "
            "--ep > 1",
            stacklevel=3,
        )


def _check_imported(init_from: str, hf: dict, imported: ModelConfig, model: ModelConfig, allow_changes: bool) -> None:
    """Overrides that change an imported architecture (fewer layers drop checkpoint tensors without a word) are
    refused unless ``allow_changes``; the router's auxiliary-loss weight, which xmoe defines per layer, is not
    imported and is said so."""
    from xmoe.train.resume import flatten

    then: dict[str, Any] = {}
    now: dict[str, Any] = {}
    flatten("model", dataclasses.asdict(imported), then)
    flatten("model", dataclasses.asdict(model), now)
    changed = [
        f"{k}: imported {then[k]!r}, now {v!r}" for k, v in now.items() if then[k] != v and k not in TRAINING_FIELDS
    ]
    if changed and not allow_changes:
        raise ValueError(
            f"--init-from {init_from}: {len(changed)} setting(s) change the imported model "
            f"({'; '.join(changed[:6])}), so checkpoint weights would be dropped or not match; drop "
            "them, or pass --allow-changes to train the changed model"
        )
    if changed:
        log.info(f"--allow-changes: training the imported model with {'; '.join(changed[:6])}")
    coef = hf.get("router_aux_loss_coef")
    if coef and not model.moe.aux_loss_coef:
        log.info(
            f"--init-from: the load-balancing loss is off; {init_from}'s router_aux_loss_coef ({coef}) is not "
            "imported, as xmoe's balance loss is defined per layer (docs/routing.md): set one with --set "
            "moe.aux_loss_coef=VALUE"
        )


def _default_train(preset: str, model: ModelConfig) -> TrainConfig:
    """tiny trains on CPU in minutes; the paper presets default to their sequence length and a small batch."""
    if preset == "tiny":
        return TINY
    return dataclasses.replace(PAPER, seq_len=model.max_seq_len)


def _imported_tokenizer(hf_dir: str) -> str:
    """The tokenizer for text data of a run initialised from ``hf_dir``: its tokenizer.json, else "bytes"."""
    from xmoe.hf.checkpoint import RUN_TOKENIZER

    tokenizer = Path(hf_dir) / RUN_TOKENIZER
    return str(tokenizer) if tokenizer.is_file() else "bytes"


def model_of(preset: str | None, config: str | None, init_from: str | None, sets: list[str]) -> ModelConfig:
    """The model a run of these choices would train, built as build_run_config builds it (`xmoe plan` takes the
    same four: a preset, a config file, a Hugging Face directory, whose config.json alone is read, and --set
    overrides); an imported architecture may be changed without --allow-changes, as nothing is trained. Settings
    outside the model and moe sections are ignored, and a --set of one is said so."""
    args = _Unset(preset=preset, config=config, init_from=init_from, set=list(sets), allow_changes=bool(init_from))
    args.out = "plan"  # a name for _check_flags: no run directory is made
    for item in sets:
        section = item.partition("=")[0].partition(".")[0]
        if section in SECTIONS and section not in ("model", "moe"):
            log.warning(f"xmoe: --set {item} does not change the model; only model and moe settings are read here")
    quiet = logging.getLogger(__name__)
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # build_run_config's notes are about training the import, not planning it
    try:
        return build_run_config(args, read_weights=False).model
    finally:
        quiet.setLevel(level)


class _Unset(argparse.Namespace):
    """model_of's arguments: every flag of `xmoe train` not set here reads None, not given (the preset's, the
    file's or --set's value stands), whatever flags `xmoe train` gains."""

    def __getattr__(self, name: str) -> None:  # called only for attributes never set
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def resolve_ep_overlap(run: RunConfig, device_type: str) -> RunConfig:
    """``run`` with ``parallel.ep_overlap = "auto"`` replaced by the mode the planner predicts fastest for its layout
    (xmoe/plan/step_time.py: "off" without expert parallelism; a more involved mode only where it saves over 1% of
    the step). On a CPU the compute is timed at 0.05 TFLOP/s a process (one core's fp32 GEMMs), on a GPU at the
    planner's default."""
    par = run.parallel
    if par.ep_overlap != "auto":
        return run
    from xmoe.plan.step_time import DEFAULT_TFLOPS, choose_ep_overlap  # imports torch: not at module level

    t = run.train
    _, micro_batch, micro_batches = run.batch_layout()
    mode = choose_ep_overlap(
        run.model,
        gpus=par.world_size,
        ep=par.ep,
        gpus_per_node=par.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", par.world_size)),
        tp=par.tp,
        placement=par.placement,
        dispatcher=run.model.moe.dispatcher,
        dispatch_dtype=run.model.moe.dispatch_dtype,
        max_nodes_per_token=run.model.moe.max_nodes_per_token,
        tokens_per_gpu=micro_batch * t.seq_len // par.tp,
        chunks=par.ep_chunks,
        tflops=DEFAULT_TFLOPS if device_type == "cuda" else CPU_TFLOPS,
        recompute=t.recompute,
        micro_batches=micro_batches,
    )
    return dataclasses.replace(run, parallel=dataclasses.replace(par, ep_overlap=cast(EpOverlap, mode)))


CPU_TFLOPS = 0.05  # one 2-core machine's fp32 GEMMs on one thread (1024^3: 0.049 TFLOP/s)
