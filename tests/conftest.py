import os
import sys

# One OpenMP thread per test process: the suite runs several processes at once (gloo worlds, torchrun), and
# oversubscribed OpenMP threads spin at barriers (a 100x128x64 matmul + backward measured 30 ms instead of
# 0.3 ms on the 2-core CI machine under load). Set before torch is imported; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The Triton kernel tests run on CPU tensors in Triton's interpreter. Triton picks interpreter or compiler per
# @triton.jit function when it is first imported (torch may import it early), so set this before anything.
os.environ["TRITON_INTERPRET"] = "1"

import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402  (after the environment above)

# A smaller-than-tiny model for runs through `xmoe train` (two layers of 8 experts of width 32, hidden 64, batches of 8
# sequences of 64 tokens): seconds per run on the CPU. Tests import it (`from conftest import SMALL`) and add their
# own steps, logging, checkpoints and device.
SMALL = [
    "--set",
    "model.hidden_size=64",
    "--set",
    "moe.hidden_size=64",
    "--set",
    "model.num_layers=2",
    "--set",
    "moe.ffn_hidden_size=32",
    "--set",
    "moe.num_experts=8",
    "--batch-size",
    "8",
    "--seq-len",
    "64",
]


@pytest.fixture(params=[False, True], ids=["pointers", "descriptors"])
def tma(request, monkeypatch):
    """The FP8 kernel tests twice: operands through pointers, and through tensor descriptors (as on Hopper); the
    value lists the tensors descriptors were made of (None for pointers)."""
    import fp8_reference

    return fp8_reference.load_by(monkeypatch, request.param)


@pytest.fixture(autouse=True)
def _library_logging():
    """Each test starts with the "xmoe" logger as a library leaves it: the ``xmoe`` command's configure_logging (run
    by a test calling main) stops propagation to the root logger, where pytest's caplog listens."""
    import logging

    yield
    logger = logging.getLogger("xmoe")
    logger.handlers.clear()
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
