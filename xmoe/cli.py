"""The `xmoe` command: `xmoe train`, `xmoe bench`, `xmoe plan`, `xmoe export | eval | generate`."""

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

    from xmoe import infer as infer_cli

    infer_cli.add_export_arguments(sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory"))
    infer_cli.add_eval_arguments(sub.add_parser("eval", help="loss, perplexity and bits per byte on a data file"))
    infer_cli.add_generate_arguments(sub.add_parser("generate", help="KV-cached greedy / temperature / top-p sampling"))

    args = parser.parse_args(argv)
    configure_logging()
    try:
        if args.command == "train":
            train_cli.run(args)
        elif args.command == "bench":
            bench.run(args)
        elif args.command == "plan":
            plan_cli.run(args)
        else:
            {"export": infer_cli.run_export, "eval": infer_cli.run_eval, "generate": infer_cli.run_generate}[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"xmoe {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)
