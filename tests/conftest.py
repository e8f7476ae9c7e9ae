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
