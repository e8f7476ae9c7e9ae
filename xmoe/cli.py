"""The `xmoe` command: `xmoe train`, `xmoe data`, `xmoe bench`, `xmoe plan`, `xmoe export | eval | generate`.

Exit codes: 0 success; 2 a user error (one line ``xmoe <command>: error: ...``; ``--debug`` shows the
traceback); 3 training stopped on a non-finite loss or gradient norm; 128 + signum when a signal stopped a
run after saving (143 for SIGTERM, 130 for SIGINT).

Imports stay lazy: building the parsers imports neither torch nor numpy, so ``xmoe --help`` is quick.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

EXAMPLES = """examples:
  xmoe train                                  # the tiny preset on the embedded corpus (runs/default)
  xmoe train --preset small --dry-run         # parameters and FLOPs of a paper preset
  xmoe plan memory --preset medium --gpus 64  # will it fit, and in which layout
"""


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from xmoe import __version__
    from xmoe import bench_cli as bench
    from xmoe.data import cli as data_cli
    from xmoe.plan import cli as plan_cli
    from xmoe.train import cli as train_cli

    parser = argparse.ArgumentParser(
        prog="xmoe",
        description="Train expert-specialized Mixture-of-Experts models, padding-free.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"xmoe {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="{train,data,bench,plan,export,eval,generate}")
    subs = {}
    for name, module, help_text in (
        ("train", train_cli, "train a model (default: the tiny preset on the embedded corpus)"),
        ("data", data_cli, "prepare corpora into token shards; what a prepared set holds"),
        ("bench", bench, "time one MoE layer, padding-free vs the padded baseline"),
        ("plan", plan_cli, "memory and communication models (no GPU needed)"),
    ):
        subs[name] = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=module.EXAMPLES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        subs[name].add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error"
        )
        module.add_arguments(subs[name])
    from xmoe import infer

    for name, add, help_text in (
        ("export", infer.add_export_arguments, "write a run's checkpoint as a Hugging Face directory"),
        ("eval", infer.add_eval_arguments, "loss, perplexity and bits per byte on a data file"),
        ("generate", infer.add_generate_arguments, "KV-cached greedy / temperature / top-p sampling"),
    ):
        subs[name] = sub.add_parser(name, help=help_text, description=help_text)
        subs[name].add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error"
        )
        add(subs[name])
    return parser, subs


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors a user's input or environment causes: reported in one line, not as a traceback (DCP's
    CheckpointException derives from BaseException, so the caller catches more than Exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from xmoe.train.checkpoint_dir import CheckpointError

    return ValueError, OSError, CheckpointError, CheckpointException


def _message(exc: BaseException) -> str:
    from xmoe.checks import DiskFullError

    if isinstance(exc, DiskFullError):  # names the file and the free space itself
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full: {exc}"
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror and exc.filename and text.startswith("[Errno"):
        text = f"{exc.strerror}: {exc.filename}"  # not "[Errno 2] No such file or directory: 'x'"
    return " ".join(text.split())  # one line, however the message was built


def _plan_model(args: argparse.Namespace):
    """The model `xmoe plan` plans when --config, --init-from or --set defines it, built as `xmoe train` builds
    its own (xmoe/train/run_config.py); None for a plain --preset (the planner takes the preset itself)."""
    if not (args.config or args.init_from or args.set):
        return None
    from xmoe.train.run_config import model_of

    # the plan's default preset is small (a config file without a preset key gets train's default, tiny)
    preset = args.preset or (None if args.config or args.init_from else "small")
    return model_of(preset, args.config, args.init_from, args.set)


def main(argv: list[str] | None = None) -> None:
    parser, _subs = _parser()
    args = parser.parse_args(argv)
    from xmoe.log import configure_logging

    configure_logging()
    if args.command is None:
        parser.print_usage(sys.stderr)
        print(
            "xmoe: error: choose a command: train, data, bench, plan, export, eval or generate (xmoe --help explains "
            "them)",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        _dispatch(args)
    except BrokenPipeError:  # the reader went away (`xmoe plan comm | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which saves and exits 130 itself)
        print(f"xmoe {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BaseException as exc:
        if args.debug or not isinstance(exc, (Exception, *_user_error_types())):  # SystemExit and the like
            raise
        _exit_on(exc, args.command)
        raise


def _dispatch(args: argparse.Namespace) -> None:
    """Run the chosen command, importing only its module."""
    if args.command == "train":
        from xmoe.train import cli as train_cli

        train_cli.run(args)
    elif args.command == "data":
        from xmoe.data import cli as data_cli

        data_cli.run(args)
    elif args.command == "bench":
        from xmoe import bench

        bench.run(args)
    elif args.command == "plan":
        from xmoe.plan import cli as plan_cli

        base = _plan_model(args)
        if getattr(args, "measure", False):
            from xmoe.train import simulate  # one rank trained for a few steps: the training layer's work

            print(simulate.run(args, base))
        else:
            plan_cli.run(args, base)
    else:
        from xmoe import infer

        {"export": infer.run_export, "eval": infer.run_eval, "generate": infer.run_generate}[args.command](args)


def _exit_on(exc: BaseException, command: str) -> None:
    """One line and the exit code for what a user can cause: a stopped run (128 + signal), non-finite training
    (3), a bad input (2), running out of memory outside a training loop (2). Returns for anything else."""
    from xmoe.train.safety import NonFiniteError, RunStopped

    if isinstance(exc, RunStopped):
        print(f"xmoe {command}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    if isinstance(exc, NonFiniteError):
        print(f"xmoe {command}: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    if isinstance(exc, _user_error_types()):
        print(f"xmoe {command}: error: {_message(exc)}", file=sys.stderr)
        sys.exit(2)
    from xmoe.train import oom

    if oom.is_out_of_memory(exc):  # outside a training loop, whose own line names the step and checkpoint
        print(f"xmoe {command}: error: {oom.one_line(exc)}", file=sys.stderr)
        sys.exit(2)
