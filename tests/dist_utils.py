"""Run a function on several CPU processes joined by a gloo process group, from inside pytest.

    from dist_utils import run_distributed
    def _body(rank, world_size, arg): ...          # module level, so the children can unpickle it
    def test_x(): run_distributed(_body, 4, arg)

Children come from a "forkserver" that preloads torch once per pytest session: starting 4 ranks then costs ~0.3 s
instead of ~20 s (4 fresh torch imports on 2 cores with "spawn"). Plain "fork" is not used: the pytest process has
already run OpenMP work, and a forked child of such a process can deadlock in libgomp; the forkserver has run none.
Each child gets one intra-op thread (tests here run 2-4 ranks on 2 cores; more threads only oversubscribe), a
fresh free TCP port, the env variables torchrun would set (so DeviceMesh and ParallelDims see a launcher-like
world), and a collective timeout, so a rank stuck in a collective fails the test instead of hanging it. An exception
in any rank is re-raised in pytest with that rank's traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# imported once by the forkserver, so that every child starts with them loaded (names that fail to import are
# skipped); torch._dynamo: the first optimizer.step() imports it, ~2 s per rank otherwise. Torch only: the
# forkserver imports them without the caller's sys.path (children get it, the server does not; Python 3.11), so a
# preloaded project module could come from another checkout, e.g. the editable install
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, fn: Callable, world_size: int, port: int, local_world_size: int, timeout_s: float, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank % local_world_size),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    local_world_size: int | None = None,
    timeout_s: float = 60.0,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any rank fails or time runs out.

    ``local_world_size`` (default: world_size, one "node") is exported as LOCAL_WORLD_SIZE, the node size
    launchers report.
    """
    local_world_size = local_world_size or world_size
    multiprocessing.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first call only)
    ctx = mp.start_processes(
        _child,
        args=(fn, world_size, free_port(), local_world_size, timeout_s, args),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s + 60.0  # the collective timeout fires first; this catches the rest
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            raise TimeoutError(f"distributed test {fn.__name__} did not finish in {timeout_s + 60:.0f} s")
