"""The arguments of `xmoe train` (flags and their help) and the command that runs them: the check of this
machine's device, then a dry run's counts or the Trainer (whose set-up checks the memory: preflight.py). How the
arguments become a RunConfig, and their precedence: run_config.py.
"""

from __future__ import annotations

import argparse

from xmoe.config import COMPILE_MODES, FIT_MODES, OPTIMIZERS, RECOMPUTE_MODES, add_kernel_arguments
from xmoe.train.run_config import PAPER, TINY, build_run_config

EXAMPLES = """examples:
  xmoe train --steps 600 --out runs/a          # the tiny preset on the embedded corpus
  xmoe train --out runs/a --steps 900 --resume # continue runs/a (after a stop, a crash or Slurm's requeue)
  xmoe train --config docs/example_run.toml --out runs/b   # a whole run described in one file
  torchrun --nproc-per-node 4 -m xmoe train --ep 4 --set moe.top_k=2 --out runs/ep4
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`xmoe train`'s flags in five groups, as `--help` shows them: where the run lives, what it trains on, its
    schedule, its layout over processes, and how it computes (none of the last changes the model)."""
    _run_directory_arguments(
        p.add_argument_group(
            "run directory",
            "where the run lives and what it writes; starting again or continuing",
        )
    )
    _model_and_data_arguments(
        p.add_argument_group(
            "model and data",
            "what is trained, on what: a preset, a config file, field overrides, a Hugging Face start, the data",
        )
    )
    _schedule_arguments(
        p.add_argument_group("schedule", "steps, batches, sequence length, learning rate, seed, validation")
    )
    _layout_arguments(
        p.add_argument_group(
            "layout",
            "the processes: data, expert and tensor parallelism, placement over nodes, the all-to-alls",
        )
    )
    _compute_arguments(
        p.add_argument_group(
            "compute",
            "the device and kernels, compilation, recompute, the optimizer's implementation, the memory pre-flight: "
            "speed, memory and rounding, never the model",
        )
    )


def _run_directory_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--out",
        default="runs/default",
        help="run directory: metrics, checkpoints, plot (default runs/default); one run at a time",
    )
    again = g.add_mutually_exclusive_group()
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
    g.add_argument(
        "--allow-changes",
        action="store_true",
        help="with --resume: accept a checkpoint whose model, data or schedule differ from this run's "
        "(fine-tuning); with --init-from: accept --set / --config values that change the imported "
        "architecture (e.g. fewer layers); without it either is refused",
    )
    g.add_argument(
        "--ckpt-every", type=int, help=f"checkpoint every N steps and at the end (default {TINY.ckpt_every}; 0: never)"
    )
    g.add_argument("--log-every", type=int, help=f"log every N steps (default {TINY.log_every})")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to --out")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="the same run twice gives the same bits on a GPU too (train.deterministic: torch's deterministic "
        "algorithms, SDPA's flash and plain kernels only; may cost speed)",
    )


def _model_and_data_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--preset",
        help="model preset: tiny (default), small, medium, large, super (not with "
        "--init-from, whose directory sets the architecture; a config file's preset)",
    )
    g.add_argument(
        "--config",
        help="JSON or TOML file describing the run: config sections (model, moe, train, "
        "parallel, kernels, data) and the keys preset and init_from",
    )
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field, e.g. --set moe.top_k=2 (repeatable)",
    )
    g.add_argument(
        "--init-from",
        metavar="HF_DIR",
        help="start from a Hugging Face directory: its architecture, weights and tokenizer.json (a "
        "config file's init_from)",
    )
    g.add_argument(
        "--data",
        help="'markov' (embedded synthetic corpus, default), a .npy / .bin / .txt file, a prepared set (xmoe data "
        "prepare) or a mixture '0.7:data/web,0.3:data/code' (data.path)",
    )
    g.add_argument(
        "--val-data",
        help="validation data (.txt / .npy / .bin / markov, a prepared set, or a mixture evaluated source by source; "
        "data.val_path); else --val-fraction of --data",
    )
    g.add_argument("--val-fraction", type=float, help="hold out this fraction of --data for validation")
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="print parameters and FLOPs of the configuration without allocating the model",
    )


def _schedule_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--steps", type=int, help=f"optimizer steps (default {TINY.steps})")
    g.add_argument(
        "--batch-size",
        type=int,
        help=f"global batch in sequences (default {TINY.global_batch_size}; paper presets {PAPER.global_batch_size})",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        help="sequences per forward per rank (default: the whole per-rank batch, no accumulation)",
    )
    g.add_argument(
        "--seq-len", type=int, help=f"tokens per sequence (default {TINY.seq_len}; paper presets: their max_seq_len)"
    )
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {TINY.lr:g}; paper presets {PAPER.lr:g})")
    g.add_argument("--seed", type=int, help=f"seed of model init and data order (default {TINY.seed})")
    g.add_argument("--eval-every", type=int, help="validation loss every N steps (and at the end)")


def _layout_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dp", type=int, help="data-parallel degree (default: processes / (ep * tp))")
    g.add_argument("--ep", type=int, help="expert-parallel degree (default 1)")
    g.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    g.add_argument("--gpus-per-node", type=int, help="node size for placement (default: LOCAL_WORLD_SIZE)")
    g.add_argument("--placement", choices=["ep_first", "dp_first"], help="EP group layout over nodes")
    g.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="how long a collective waits for the slowest rank before the run fails (parallel.timeout; default "
        "1800); a rank silent for a quarter of it, at most 60 s, is named",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: norms and the MoE block's entry work on 1/tp of the positions (no all-reduce)",
    )
    g.add_argument("--dispatcher", choices=["pft", "padded", "rbd"], help="token dispatcher (default pft)")
    g.add_argument(
        "--ep-overlap",
        choices=["auto", "off", "shared", "chunks"],
        help="what hides the expert-parallel all-to-alls: shared experts, or chunks of tokens pipelined against "
        "each other's expert GEMMs (default auto: the planner's choice for the layout)",
    )
    g.add_argument("--ep-chunks", type=int, help="with --ep-overlap chunks: chunks per layer call (default 2)")
    g.add_argument(
        "--dispatch-dtype",
        choices=["bf16", "fp8"],
        help="expert parallelism: how routed rows travel to their experts (fp8: e4m3 with 1 x 128 scales, about half "
        "the bytes of bf16; the combine stays bf16); default bf16",
    )
    g.add_argument(
        "--max-nodes-per-token",
        type=int,
        metavar="M",
        help="node-limited routing under --ep: each token's experts on at most M nodes of its expert-parallel "
        "group (moe.max_nodes_per_token; default 0, no limit)",
    )


def _compute_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--device", default="auto", help="auto (GPU if present, default), cpu or cuda")
    g.add_argument("--kernel-backend", choices=["auto", "torch", "triton"], help="MoE kernels")
    g.add_argument(
        "--fp8",
        choices=["off", "experts"],
        help="FP8 GEMMs for the routed experts (moe.fp8; default off; GPUs with FP8 matrix instructions)",
    )
    add_kernel_arguments(g)
    g.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        help="torch.compile each block's two branches and the loss (default auto: on for one GPU or pure "
        "data parallelism on GPUs, off on CPU)",
    )
    g.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        help="activation recompute in backward: none (default), moe (MoE branches), full (every block)",
    )
    g.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="AdamW's implementation: auto (default: xmoe's Triton AdamW on one GPU or under DDP, torch's fused "
        "AdamW under FSDP2 / expert parallelism, torch's on CPU), torch, triton",
    )
    g.add_argument(
        "--fit",
        choices=FIT_MODES,
        default="check",
        help="memory pre-flight before the model is built: check (default: refuse a run the planner predicts "
        "will not fit the free memory, naming changes that fit), auto (apply the cheapest such change: a smaller "
        "micro-batch or recompute), off",
    )


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


def run(args: argparse.Namespace) -> dict | None:
    run_cfg = build_run_config(args)
    check_device(args.device)
    if args.dry_run:
        from xmoe.model.counting import describe

        run_cfg.batch_layout()  # the batch checks a real run makes first

        print(describe(run_cfg.model, run_cfg.train.seq_len, run_cfg.train.global_batch_size))
        return None
    from xmoe.train.trainer import Trainer

    trainer = Trainer(
        run_cfg,
        args.out,
        device=args.device,
        resume=args.resume,
        overwrite=args.overwrite,
        resume_from=args.resume_from,
        allow_changes=args.allow_changes,
        fit=args.fit,
    )
    return trainer.train()
