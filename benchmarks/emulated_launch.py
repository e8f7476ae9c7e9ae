"""One torchrun per emulated node: the command line, the environment, and the wait that stops every node.

Each node's torchrun starts under `ip netns exec <node namespace>` in a session of its own (its process group is
what a stop signals first); its workers start their own sessions, so a stop ends by killing whatever is still
inside the node's namespace. Rendezvous is torchrun's c10d on node 0's address, with node 0 named the store's host
(`is_host`: torchrun's own guess compares against the machine's hostname, which no namespace address matches) and
every agent giving its node's address (`--local-addr`), so the store and MASTER_ADDR live where the others reach them.
"""

from __future__ import annotations

import itertools
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.emulated_net import PREFIX, Layout, kill_namespace_processes, namespace_pids

RDZV_PORT = 29400  # each node namespace is new and empty, so any port is free there
# what an enclosing launcher may have set; each node's torchrun sets its own
_LAUNCHER_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"}
_LAUNCHER_VARS |= {"ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}
_runs = itertools.count()


@dataclass
class NodeResult:
    """One node's torchrun: ``status`` is ok / failed (ended by itself), stopped (after another node failed),
    timeout, interrupted (a signal reached the tool), or running while it lives."""

    node: int
    namespace: str
    log: Path
    status: str = "running"
    returncode: int | None = None  # 128 + N for a death by signal N
    wall_s: float = 0.0


@dataclass
class RunResult:
    """All nodes of one run; ``returncode`` is the worst among nodes that ended by themselves (124 on a timeout,
    128 + N when signal N interrupted the tool)."""

    nodes: list[NodeResult]
    wall_s: float
    returncode: int
    out: Path
    signum: int | None = None  # the signal that interrupted the tool


def torchrun_target(command: list[str]) -> list[str]:
    """What follows torchrun's own options for ``command`` (the module docstring of emulated_cluster.py)."""
    if not command:
        raise ValueError("give the command to run after --, e.g. -- xmoe train --ep 4 --steps 3")
    head, rest = command[0], command[1:]
    if head == "xmoe":
        return ["-m", "xmoe", *rest]
    if head in ("-m", "--module"):
        if not rest or rest[0].startswith("-"):
            raise ValueError(f"{head} needs a module name after it, e.g. -m xmoe train")
        return ["-m", *rest]
    if head == "--no-python":
        if not rest:
            raise ValueError("--no-python needs a program after it")
        return command
    if head.startswith("-"):
        raise ValueError(f"{head}: the command after -- starts with a program, a SCRIPT.py, `xmoe` or `-m MODULE`")
    if head.endswith(".py"):
        return command
    return ["--no-python", *command]


def torchrun_argv(layout: Layout, i: int, ranks_per_node: int, rdzv_id: str, target: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(layout.nodes),
        "--node-rank",
        str(i),
        "--nproc-per-node",
        str(ranks_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{layout.node_addr(0)}:{RDZV_PORT}",
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"is_host={int(i == 0)}",
        "--local-addr",
        layout.node_addr(i),
        "--max-restarts",
        "0",
        *target,
    ]


def node_env(base: dict[str, str], layout: Layout, i: int, ranks_per_node: int, extra: dict[str, str]) -> dict:
    """The environment of node ``i``'s torchrun: ``base`` without an enclosing launcher's variables, every
    socket library pinned to the node's interface, and one OpenMP thread per core share of the machine."""
    env = {k: v for k, v in base.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    ifname = layout.node_if(i)
    env.update(GLOO_SOCKET_IFNAME=ifname, TP_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname, PYTHONUNBUFFERED="1")
    env.update(XMOE_EMU_NODE=str(i), XMOE_EMU_NODES=str(layout.nodes), XMOE_EMU_ADDR=layout.node_addr(i))
    # more OpenMP threads than cores spin at every barrier; torchrun would pick 1 and warn about it
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (layout.nodes * ranks_per_node))))
    env.update(extra)
    return env


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(running: list[tuple[NodeResult, subprocess.Popen]], grace_s: float, status: str, t0: float) -> None:
    """SIGTERM each torchrun's process group (torchrun passes it to its workers), up to ``grace_s`` for them to
    end, then SIGKILL. A torchrun whose workers are gone is killed at once: it may sit in a store wait (its exit
    barrier, after its workers succeeded) that a Python signal handler cannot interrupt. A second signal to this
    process skips the wait."""
    for _, proc in running:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        while time.monotonic() < deadline:
            alive = [(node, proc) for node, proc in running if proc.poll() is None]
            if not alive:
                break
            for node, proc in alive:
                if set(namespace_pids(node.namespace)) <= {proc.pid}:
                    _signal_group(proc, signal.SIGKILL)
            time.sleep(0.05)
    finally:
        for node, proc in running:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            node.status, node.returncode, node.wall_s = status, _exit_code(proc.returncode), time.monotonic() - t0


def _wait(procs, result: RunResult, t0: float, timeout, fail_grace_s: float, stop_grace_s: float) -> None:
    failed_at = None
    while True:
        now = time.monotonic()
        running = []
        for node, proc in zip(result.nodes, procs, strict=True):
            if node.status != "running":
                continue
            rc = proc.poll()
            if rc is None:
                running.append((node, proc))
                continue
            node.returncode, node.wall_s = _exit_code(rc), now - t0
            node.status = "ok" if rc == 0 else "failed"
            failed_at = now if rc != 0 and failed_at is None else failed_at
        if not running:
            return
        if timeout is not None and now - t0 >= timeout:
            return _stop(running, stop_grace_s, "timeout", t0)
        if failed_at is not None and now - failed_at >= fail_grace_s:
            return _stop(running, stop_grace_s, "stopped", t0)
        time.sleep(0.05)


def _overall(result: RunResult) -> int:
    if result.signum is not None:
        return 128 + result.signum
    failures = [n.returncode or 0 for n in result.nodes if n.status == "failed"]
    if failures:
        return max(failures)
    return 124 if any(n.status == "timeout" for n in result.nodes) else 0


def launch(
    layout: Layout,
    target: list[str],
    ranks_per_node: int,
    extra_env: dict[str, str],
    timeout: float | None,
    fail_grace_s: float,
    stop_grace_s: float,
    result: RunResult,
) -> RunResult:
    """Start every node's torchrun of ``target``, wait as EmulatedCluster.run describes, fill ``result``."""
    result.out.mkdir(parents=True, exist_ok=True)
    rdzv_id = f"{PREFIX}-{layout.owner}-{next(_runs)}"
    procs: list[subprocess.Popen] = []
    files = []
    t0 = time.monotonic()
    try:
        for i in range(layout.nodes):
            node = NodeResult(i, layout.node_ns(i), result.out / f"node_{i}.log")
            argv = torchrun_argv(layout, i, ranks_per_node, rdzv_id, target)
            log = open(node.log, "w")  # closed below, once the process has ended
            files.append(log)
            log.write(f"# node {i} of {layout.nodes}: namespace {layout.node_ns(i)}, address {layout.node_addr(i)}\n")
            log.write(f"# {shlex.join(argv)}\n")
            log.flush()
            env = node_env(dict(os.environ), layout, i, ranks_per_node, extra_env)
            cmd = ["ip", "netns", "exec", layout.node_ns(i), *argv]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            result.nodes.append(node)
        _wait(procs, result, t0, timeout, fail_grace_s, stop_grace_s)
    except BaseException as e:
        running = [(n, p) for n, p in zip(result.nodes, procs, strict=False) if n.status == "running"]
        result.signum = getattr(e, "signum", signal.SIGINT if isinstance(e, KeyboardInterrupt) else None)
        # a signal gives the nodes their grace to stop; an error of this tool stops them at once
        _stop(running, 0.0 if result.signum is None else stop_grace_s, "interrupted", t0)
        raise
    finally:
        for proc in procs:  # a process started after an exception in the loop above
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        # workers run in sessions of their own and may outlive their torchrun
        kill_namespace_processes([layout.node_ns(i) for i in range(layout.nodes)])
        for log in files:
            log.close()
        result.wall_s = time.monotonic() - t0
        result.returncode = _overall(result)
    return result
