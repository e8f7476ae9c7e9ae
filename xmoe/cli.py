"""The `xmoe` command: `xmoe train`, `xmoe bench`, `xmoe plan`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="xmoe", description="Train expert-specialized Mixture-of-Experts models, padding-free."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from xmoe import bench
    from xmoe.log import configure_logging
    from xmoe.plan import cli as plan_cli
    from xmoe.train import cli as train_cli

    train_parser = sub.add_parser("train", help="train a model (default: the tiny preset on the embedded corpus)")
    train_cli.add_arguments(train_parser)
    bench_parser = sub.add_parser("bench", help="time one MoE layer, padding-free vs the padded baseline")
    bench.add_arguments(bench_parser)
    plan_cli.add_arguments(sub.add_parser("plan", help="memory and communication models (no GPU needed)"))

    args = parser.parse_args(argv)
    configure_logging()
    try:
        if args.command == "train":
            train_cli.run(args)
        elif args.command == "bench":
            bench.run(args)
        elif args.command == "plan":
            plan_cli.run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"xmoe {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)
