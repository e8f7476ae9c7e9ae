"""Arguments of `xmoe train` and how they become a RunConfig.

Precedence, lowest first: the preset, then a config file (--config, JSON or TOML with optional sections
``model``, ``moe``, ``train``, ``parallel``), then ``--set section.field=value`` overrides, then the
dedicated flags (--steps, --seed, --dp, ...). Unknown fields are errors that list the valid ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from xmoe.config import ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig

SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "train": TrainConfig, "parallel": ParallelConfig}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="model preset: tiny (default), small, medium, large, super")
    p.add_argument("--steps", type=int, help="optimizer steps (tiny default: 300)")
    p.add_argument("--out", default="runs/default", help="run directory: metrics, checkpoints, plot")
    p.add_argument("--data", default="markov",
                   help="'markov' (embedded synthetic corpus, default), or a .npy / .bin / .txt file")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--seed", type=int, help="seed of model init and data order")
    p.add_argument("--dp", type=int, help="data-parallel degree (default: processes / (ep * tp))")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--gpus-per-node", type=int, help="node size for placement (default: LOCAL_WORLD_SIZE)")
    p.add_argument("--placement", choices=["ep_first", "dp_first"], help="EP group layout over nodes")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: norms and the MoE block's entry work on 1/tp of the positions (no all-reduce)")
    p.add_argument("--dispatcher", choices=["pft", "padded", "rbd"], help="token dispatcher (default pft)")
    p.add_argument("--kernel-backend", choices=["auto", "torch", "triton"], help="MoE kernels")
    p.add_argument("--batch-size", type=int, help="global batch in sequences")
    p.add_argument("--micro-batch-size", type=int, help="sequences per forward per rank")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--log-every", type=int, help="log every N steps")
    p.add_argument("--ckpt-every", type=int, help="checkpoint every N steps and at the end (0: never)")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to --out")
    p.add_argument("--compile", choices=["auto", "on", "off"],
                   help="torch.compile each block's two branches and the loss (default auto: on for one GPU or pure "
                        "data parallelism on GPUs, off on CPU)")
    p.add_argument("--recompute", choices=["none", "moe", "full"],
                   help="activation recompute in backward: none (default), moe (MoE branches), full (every block)")
    p.add_argument("--device", default="auto", help="auto (GPU if present), cpu or cuda")
    p.add_argument("--config", help="JSON or TOML file of config sections")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field, e.g. --set moe.top_k=2 (repeatable)")
    p.add_argument("--init-from", metavar="HF_DIR",
                   help="start from a Hugging Face directory: its architecture, weights and tokenizer.json")
    p.add_argument("--val-data", help="validation data (.txt / .npy / .bin / markov); else --val-fraction of --data")
    p.add_argument("--val-fraction", type=float, help="hold out this fraction of --data for validation")
    p.add_argument("--eval-every", type=int, help="validation loss every N steps (and at the end)")
    p.add_argument("--dry-run", action="store_true",
                   help="print parameters and FLOPs of the configuration without allocating the model")


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"none": None, "true": True, "false": False}.get(text.lower(), text)


def _load_file(path: str) -> dict[str, dict[str, Any]]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {file} does not exist")
    if file.suffix == ".toml":
        import tomllib

        data = tomllib.loads(file.read_text())
    elif file.suffix == ".json":
        data = json.loads(file.read_text())
    else:
        raise ValueError(f"config file {file} must end in .json or .toml")
    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise ValueError(f"config file {file}: unknown sections {sorted(unknown)}; valid: {sorted(SECTIONS)}")
    return data


def _apply(obj: Any, section: str, values: dict[str, Any]) -> Any:
    fields = {f.name for f in dataclasses.fields(obj)}
    for key in values:
        if key not in fields:
            raise ValueError(f"unknown field {section}.{key}; valid fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(obj, **values)  # replace() re-runs validation


def build_run_config(args: argparse.Namespace) -> RunConfig:
    from xmoe.model.presets import get_preset

    model = get_preset(args.preset)
    if getattr(args, "init_from", None):
        from xmoe.hf.checkpoint import read_config
        from xmoe.hf.families import model_config_from_hf

        model = model_config_from_hf(read_config(args.init_from))
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if args.config:
        for name, values in _load_file(args.config).items():
            sections[name].update(values)
    for item in args.set:
        key, sep, value = item.partition("=")
        section, dot, field = key.partition(".")
        if not sep or not dot or section not in SECTIONS:
            raise ValueError(f"--set {item!r} must look like SECTION.FIELD=VALUE with SECTION in {sorted(SECTIONS)}")
        sections[section][field] = _parse_value(value)

    flags = {"steps": args.steps, "seed": args.seed, "global_batch_size": args.batch_size,
             "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len, "lr": args.lr,
             "log_every": args.log_every, "ckpt_every": args.ckpt_every, "compile": args.compile,
             "recompute": args.recompute, "val_fraction": getattr(args, "val_fraction", None),
             "eval_every": getattr(args, "eval_every", None)}
    sections["train"].update({k: v for k, v in flags.items() if v is not None})
    if args.tensorboard:
        sections["train"]["tensorboard"] = True
    for field, value in (("dispatcher", args.dispatcher), ("kernel_backend", args.kernel_backend)):
        if value is not None:
            sections["moe"][field] = value

    if "hidden_size" in sections["model"]:  # the MoE block's width follows the model's unless set explicitly
        sections["moe"].setdefault("hidden_size", sections["model"]["hidden_size"])
    moe = _apply(model.moe, "moe", sections["moe"])
    model = _apply(model, "model", {**sections["model"], "moe": moe})
    default_train = TrainConfig(lr=1e-4) if getattr(args, "init_from", None) else _default_train(args.preset, model)
    train = _apply(default_train, "train", sections["train"])

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep, tp = args.ep, args.tp
    dp = args.dp if args.dp is not None else max(1, world // (ep * tp))
    par_values = {"dp": dp, "ep": ep, "tp": tp, **sections["parallel"]}
    if args.gpus_per_node is not None:
        par_values["gpus_per_node"] = args.gpus_per_node
    if args.placement is not None:
        par_values["placement"] = args.placement
    if args.sequence_parallel:
        par_values["sequence_parallel"] = True
    parallel = _apply(ParallelConfig(), "parallel", par_values)
    if model.moe.num_experts % parallel.ep:
        raise ValueError(f"num_experts ({model.moe.num_experts}) must be divisible by --ep ({parallel.ep})")
    return RunConfig(model=model, train=train, parallel=parallel)


def _default_train(preset: str, model: ModelConfig) -> TrainConfig:
    """tiny trains on CPU in minutes; the paper presets default to their sequence length and a small batch."""
    if preset == "tiny":
        return TrainConfig()
    return TrainConfig(seq_len=model.max_seq_len, global_batch_size=8, lr=3e-4, warmup_steps=100)


def run(args: argparse.Namespace) -> dict | None:
    run_cfg = build_run_config(args)
    if args.dry_run:
        from xmoe.model.counting import describe

        print(describe(run_cfg.model, run_cfg.train.seq_len, run_cfg.train.global_batch_size))
        return None
    from xmoe.train.trainer import Trainer

    init_from = getattr(args, "init_from", None)
    tokenizer = "bytes"
    if init_from:
        tokenizer = _keep_imported_files(init_from, args.out)
    trainer = Trainer(run_cfg, args.out, data=args.data, device=args.device, resume=args.resume,
                      init_from=init_from, val_data=getattr(args, "val_data", None), tokenizer=tokenizer)
    return trainer.train()


def _keep_imported_files(hf_dir: str, out_dir: str) -> str:
    """Copy the imported config.json (export reuses its other fields) and tokenizer.json (text data, eval and
    generate use it) into the run directory; return the tokenizer for the data ("bytes" without one)."""
    import shutil

    from xmoe.hf.checkpoint import RUN_HF_CONFIG, RUN_TOKENIZER

    out = Path(out_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(hf_dir) / "config.json", out / RUN_HF_CONFIG)
        if (Path(hf_dir) / RUN_TOKENIZER).is_file():
            shutil.copy(Path(hf_dir) / RUN_TOKENIZER, out / RUN_TOKENIZER)
    tokenizer = Path(hf_dir) / RUN_TOKENIZER
    return str(tokenizer) if tokenizer.is_file() else "bytes"
