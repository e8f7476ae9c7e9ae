"""Arguments of `xmoe train` and how they become a RunConfig.

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
from typing import Any

from xmoe.checks import missing
from xmoe.config import (
    COMPILE_MODES,
    RECOMPUTE_MODES,
    DataConfig,
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
    "model.moe.aux_loss_type",
    "model.moe.z_loss_coef",
    "model.moe.bias_update_rate",
    "model.moe.capacity_factor",
    "model.moe.kernel_backend",
    "model.moe.dispatcher",
)
_TINY, _PAPER = TrainConfig(), TrainConfig(lr=3e-4, global_batch_size=8, warmup_steps=100)  # see _default_train

EXAMPLES = """examples:
  xmoe train --steps 600 --out runs/a          # the tiny preset on the embedded corpus
  xmoe train --out runs/a --steps 900 --resume # continue runs/a (after a stop, a crash or Slurm's requeue)
  xmoe train --config docs/example_run.toml --out runs/b   # a whole run described in one file
  torchrun --nproc-per-node 4 -m xmoe train --ep 4 --set moe.top_k=2 --out runs/ep4
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        help="model preset: tiny (default), small, medium, large, super (not with "
        "--init-from, whose directory sets the architecture; a config file's preset)",
    )
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {_TINY.steps})")
    p.add_argument(
        "--out",
        default="runs/default",
        help="run directory: metrics, checkpoints, plot (default runs/default); one run at a time",
    )
    p.add_argument(
        "--data", help="'markov' (embedded synthetic corpus, default), or a .npy / .bin / .txt file (data.path)"
    )
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint in --out")
    again.add_argument(
        "--resume-from",
        metavar="CKPT_DIR",
        help="continue from this checkpoint directory (later ones in --out are set aside)",
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run already in --out (metrics, summary, plot, checkpoints) and start again",
    )
    p.add_argument(
        "--allow-changes",
        action="store_true",
        help="with --resume: accept a checkpoint whose model, data or schedule differ from this run's "
        "(fine-tuning); with --init-from: accept --set / --config values that change the imported "
        "architecture (e.g. fewer layers); without it either is refused",
    )
    p.add_argument("--seed", type=int, help=f"seed of model init and data order (default {_TINY.seed})")
    p.add_argument("--dp", type=int, help="data-parallel degree (default: processes / (ep * tp))")
    p.add_argument("--ep", type=int, help="expert-parallel degree (default 1)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    p.add_argument("--gpus-per-node", type=int, help="node size for placement (default: LOCAL_WORLD_SIZE)")
    p.add_argument("--placement", choices=["ep_first", "dp_first"], help="EP group layout over nodes")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: norms and the MoE block's entry work on 1/tp of the positions (no all-reduce)",
    )
    p.add_argument("--dispatcher", choices=["pft", "padded", "rbd"], help="token dispatcher (default pft)")
    p.add_argument("--kernel-backend", choices=["auto", "torch", "triton"], help="MoE kernels")
    p.add_argument(
        "--fp8",
        choices=["off", "experts"],
        help="FP8 GEMMs for the routed experts (moe.fp8; default off; GPUs with FP8 matrix instructions)",
    )
    p.add_argument(
        "--wgrad",
        choices=["auto", "triton", "grouped_mm"],
        help="what computes the Triton backward's weight gradients (kernels.wgrad; default $XMOE_WGRAD, "
        "else auto: torch._grouped_mm on sm_90 GPUs with >= 128 experts per rank, else Triton)",
    )
    p.add_argument(
        "--autotune",
        action=argparse.BooleanOptionalAction,
        help="time every tile candidate of each new GPU kernel shape and keep the fastest (kernels.autotune;"
        " default on if XMOE_AUTOTUNE=1, else off: the shipped tile table or the heuristic)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"global batch in sequences (default {_TINY.global_batch_size}; paper presets {_PAPER.global_batch_size})",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        help="sequences per forward per rank (default: the whole per-rank batch, no accumulation)",
    )
    p.add_argument(
        "--seq-len", type=int, help=f"tokens per sequence (default {_TINY.seq_len}; paper presets: their max_seq_len)"
    )
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {_TINY.lr:g}; paper presets {_PAPER.lr:g})")
    p.add_argument("--log-every", type=int, help=f"log every N steps (default {_TINY.log_every})")
    p.add_argument(
        "--ckpt-every", type=int, help=f"checkpoint every N steps and at the end (default {_TINY.ckpt_every}; 0: never)"
    )
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to --out")
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        help="torch.compile each block's two branches and the loss (default auto: on for one GPU or pure "
        "data parallelism on GPUs, off on CPU)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        help="activation recompute in backward: none (default), moe (MoE branches), full (every block)",
    )
    p.add_argument("--device", default="auto", help="auto (GPU if present, default), cpu or cuda")
    p.add_argument(
        "--config",
        help="JSON or TOML file describing the run: config sections (model, moe, train, "
        "parallel, kernels, data) and the keys preset and init_from",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field, e.g. --set moe.top_k=2 (repeatable)",
    )
    p.add_argument(
        "--init-from",
        metavar="HF_DIR",
        help="start from a Hugging Face directory: its architecture, weights and tokenizer.json (a "
        "config file's init_from)",
    )
    p.add_argument(
        "--val-data", help="validation data (.txt / .npy / .bin / markov; data.val_path); else --val-fraction of --data"
    )
    p.add_argument("--val-fraction", type=float, help="hold out this fraction of --data for validation")
    p.add_argument("--eval-every", type=int, help="validation loss every N steps (and at the end)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print parameters and FLOPs of the configuration without allocating the model",
    )


def _parse_value(text: str) -> Any:
    """JSON (2, 2.5, true, null, "x") or, failing that, the plain string; the config's type check does the rest."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"none": None, "true": True, "false": False}.get(text.lower(), text)


def _load_file(path: str) -> dict[str, Any]:
    """The config file's sections (tables of fields) and top-level keys (TOP_LEVEL, strings)."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"config file {file} is a directory; pass a .json or .toml file")
    if not file.is_file():
        raise missing(file, "config file")
    if file.suffix not in (".toml", ".json"):
        raise ValueError(f"config file {file} must end in .json or .toml")
    try:
        text = file.read_text(encoding="utf-8")
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
    return data


def _apply(obj: Any, section: str, values: dict[str, Any]) -> Any:
    fields = {f.name for f in dataclasses.fields(obj)}
    for key in values:
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


def check_device(device: str, flag: str = "--device") -> str:
    """``device`` ("auto", "cpu", "cuda" or "cuda:N") if this machine has it, "auto" resolved; ValueError naming
    ``flag`` and the fix otherwise."""
    import torch

    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"{flag} ({device!r}) must be auto, cpu, cuda or cuda:N")
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA"
            if torch.version.cuda is None and torch.version.hip is None
            else "torch sees no GPU"
        )
        raise ValueError(f"{flag} {device} was asked for but {why}; use {flag} cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"{flag} {device}: this machine has {torch.cuda.device_count()} GPU(s), numbered from 0")
    return device


def build_run_config(args: argparse.Namespace) -> RunConfig:
    from xmoe.model.presets import get_preset

    _check_flags(args)
    file = _load_file(args.config) if args.config else {}
    preset, init_from = _start(args, file)
    if init_from:
        from xmoe.hf.checkpoint import read_model_config

        hf, model = read_model_config(init_from)
    else:
        model = get_preset(preset)
    imported = model
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
        "val_fraction": getattr(args, "val_fraction", None),
        "eval_every": getattr(args, "eval_every", None),
    }
    sections["train"].update({k: v for k, v in flags.items() if v is not None})
    if args.tensorboard:
        sections["train"]["tensorboard"] = True
    for field, value in (("wgrad", getattr(args, "wgrad", None)), ("autotune", getattr(args, "autotune", None))):
        if value is not None:
            sections["kernels"][field] = value
    for field, value in (
        ("dispatcher", args.dispatcher),
        ("kernel_backend", args.kernel_backend),
        ("fp8", getattr(args, "fp8", None)),
    ):
        if value is not None:
            sections["moe"][field] = value
    for field, value in (("path", getattr(args, "data", None)), ("val_path", getattr(args, "val_data", None))):
        if value is not None:
            sections["data"][field] = value
    if init_from and "tokenizer" not in sections["data"]:  # text data is read with the imported tokenizer
        sections["data"]["tokenizer"] = _imported_tokenizer(init_from)

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

    par_values = dict(sections["parallel"])
    flags = {
        "dp": args.dp,
        "ep": args.ep,
        "tp": args.tp,
        "gpus_per_node": args.gpus_per_node,
        "placement": args.placement,
        "sequence_parallel": args.sequence_parallel or None,
    }
    par_values.update({k: v for k, v in flags.items() if v is not None})
    parallel = _apply(ParallelConfig(), "parallel", par_values)  # validates ep and tp before dp divides by them
    if "dp" not in par_values:  # derived after the merge, from the ep and tp that will be used
        world = int(os.environ.get("WORLD_SIZE", "1"))
        parallel = dataclasses.replace(parallel, dp=max(1, world // (parallel.ep * parallel.tp)))
    from xmoe.dispatch.base import experts_per_rank  # imports torch: not at module level (xmoe --help)

    experts_per_rank(model.moe.num_experts, parallel.ep)  # the one home of that check; names the fix
    if model.moe.dispatcher == "rbd" and parallel.ep == 1:
        warnings.warn(
            "moe.dispatcher 'rbd' changes how tokens travel between expert-parallel ranks and does "
            "nothing with ep == 1 (one process runs the local dispatcher); pass --ep > 1",
            stacklevel=2,
        )
    kernels = _apply(KernelConfig(), "kernels", sections["kernels"])
    return RunConfig(
        model=model, train=train, parallel=parallel, kernels=kernels, data=data, init_from=init_from, preset=preset
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
        return _TINY
    return dataclasses.replace(_PAPER, seq_len=model.max_seq_len)


def _check_fits(run_cfg: RunConfig, device: str) -> None:
    """Refuse a model whose fp32 weights alone, split evenly over every rank, exceed one machine's memory (host and
    one GPU): building it could only fail, after minutes or by the kernel's OOM killer."""
    import torch

    from xmoe.model.counting import count_params

    model, world = run_cfg.model, run_cfg.parallel.world_size
    params = count_params(model).total
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.startswith("cuda"):
        memory += torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if 4 * params / world > memory:
        raise ValueError(
            f"the model has {params:.3g} parameters ({4 * params / world / 2**30:.3g} GiB of fp32 weights per rank "
            f"over {world} rank(s), 16 bytes per parameter to train), more than this machine's "
            f"{memory / 2**30:.0f} GiB of memory; lower moe.num_experts ({model.moe.num_experts}), "
            f"model.num_layers ({model.num_layers}) or hidden sizes (`xmoe plan memory` predicts what fits)"
        )


def run(args: argparse.Namespace) -> dict | None:
    run_cfg = build_run_config(args)
    device = check_device(args.device)
    if args.dry_run:
        from xmoe.model.counting import describe

        run_cfg.batch_layout()  # the batch checks a real run makes first

        print(describe(run_cfg.model, run_cfg.train.seq_len, run_cfg.train.global_batch_size))
        return None
    _check_fits(run_cfg, device)
    from xmoe.train.trainer import Trainer

    trainer = Trainer(
        run_cfg,
        args.out,
        device=args.device,
        resume=args.resume,
        overwrite=args.overwrite,
        resume_from=args.resume_from,
        allow_changes=args.allow_changes,
    )
    return trainer.train()


def _imported_tokenizer(hf_dir: str) -> str:
    """The tokenizer for text data of a run initialised from ``hf_dir``: its tokenizer.json, else "bytes"."""
    from xmoe.hf.checkpoint import RUN_TOKENIZER

    tokenizer = Path(hf_dir) / RUN_TOKENIZER
    return str(tokenizer) if tokenizer.is_file() else "bytes"
