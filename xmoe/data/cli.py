"""`xmoe data prepare` (inputs into token shards, prepare.py) and `xmoe data info` (what a prepared set holds,
prepared.py): their arguments and the commands."""

from __future__ import annotations

import argparse
import re

EXAMPLES = """examples:
  xmoe data prepare corpus/ --out data/web --tokenizer bytes        # .txt / .md / .jsonl(.gz) / .parquet files
  xmoe data prepare a.jsonl.gz b.parquet --field content --out data/code --tokenizer tokenizer.json
  xmoe data info data/web                                           # what a prepared set holds
  xmoe train --data "0.7:data/web,0.3:data/code"                    # train on a mixture of prepared sets
"""

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """Bytes from "128M", "64K", "1G" or a plain number (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not match or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 128M, 64K or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="{prepare,info}")
    prep = sub.add_parser(
        "prepare",
        help="tokenize text, JSONL and Parquet files into shards with a document index",
        description="Tokenize files or folders of .txt / .md (a document per file), .jsonl / .jsonl.gz (a "
        "document per line) and .parquet (a document per row) into token shards, a document index and a "
        "manifest (docs/data.md). Run it again with the same arguments to finish a run that was stopped.",
    )
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders (searched recursively)")
    prep.add_argument("--out", required=True, help="output directory (new, empty, or an unfinished one to continue)")
    prep.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (default; end of document: byte 0), a tokenizers JSON file, or a Hugging Face model directory",
    )
    prep.add_argument("--field", default="text", help="the JSON field or Parquet column holding the text (text)")
    prep.add_argument("--eos-token", help="the end-of-document token (default: the tokenizer's own, see docs/data.md)")
    prep.add_argument("--workers", type=int, help="worker processes (default: one per CPU core)")
    prep.add_argument(
        "--shard-size", type=parse_size, default="128M", help="input per shard, e.g. 128M (default), 1G, 64K"
    )
    prep.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    info = sub.add_parser("info", help="what a prepared set holds", description="What a prepared set holds.")
    info.add_argument("directory", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="also read every shard against the manifest's crc32")
    info.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> None:
    if args.data_command == "prepare":
        from xmoe.data.prepare import prepare

        if args.workers is not None and args.workers < 1:
            raise ValueError(f"--workers ({args.workers}) must be >= 1")
        m = prepare(
            args.inputs,
            args.out,
            args.tokenizer,
            field=args.field,
            eos_token=args.eos_token,
            shard_bytes=args.shard_size,
            workers=args.workers,
        )
        print(
            f"{args.out}: {m['tokens']:,} tokens, {m['documents']:,} documents in {len(m['shards'])} shard(s) "
            f"from {len(m['sources'])} file(s) (`xmoe data info {args.out}` says more)"
        )
    elif args.data_command == "info":
        from xmoe.data.prepared import PreparedSet

        prepared = PreparedSet(args.directory)
        print(prepared.describe())
        if args.verify:
            bad = prepared.verify()
            if bad:
                raise ValueError(f"{len(bad)} shard file(s) differ from the manifest: {'; '.join(bad[:4])}")
            print("  verified   every shard matches the manifest's crc32")
    else:
        raise ValueError("choose a data command: prepare or info (xmoe data --help explains them)")
