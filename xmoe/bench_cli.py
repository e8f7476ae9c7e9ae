"""The arguments of `xmoe bench` and their checks; ``xmoe/bench.py`` runs the benchmark.

Kept apart from bench.py so that building the parser (``xmoe --help``) imports neither torch nor numpy.
"""

from __future__ import annotations

import argparse

from xmoe.config import add_kernel_arguments
from xmoe.model.presets import PRESETS

EXAMPLES = """examples:
  xmoe bench                                  # the tiny layer on this machine's device
  xmoe bench --shape small --tokens 8192      # a paper preset's layer (a GPU is advised)
  xmoe bench --device cpu --backend torch --repeats 3
  xmoe bench --shape small --wgrad grouped_mm --autotune   # the layer under a kernel choice (a GPU)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape", default="tiny", choices=tuple(PRESETS), help="the MoE layer of this preset (default tiny)"
    )
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per call (default 2048)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: bfloat16 on GPU, float32 on CPU"
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="MoE kernels (default auto: triton on a GPU, torch on CPU)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs, the median is reported (default 5)")
    add_kernel_arguments(parser)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a value out of range."""
    if args.tokens <= 0:
        raise ValueError(f"--tokens ({args.tokens}) must be > 0")
    if args.repeats < 1:
        raise ValueError(f"--repeats ({args.repeats}) must be >= 1")
    if args.device not in ("auto", "cpu") and not args.device.startswith("cuda"):
        raise ValueError(f"--device ({args.device!r}) must be auto, cpu or cuda")
