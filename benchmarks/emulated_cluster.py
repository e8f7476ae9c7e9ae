"""An emulated multi-node cluster on one machine: N network namespaces stand for N nodes, one torchrun per node.

    python benchmarks/emulated_cluster.py --nodes 2 --ranks-per-node 2 --inter-gbit 1 -- \\
        xmoe train --preset tiny --ep 4 --steps 3 --out runs/emu
    python benchmarks/emulated_cluster.py --nodes 2 --inter-gbit 1 --measure   # the link's rate and round trip
    python benchmarks/emulated_cluster.py --cleanup                           # what a killed run left behind

The nodes are joined through a bridge in a namespace of its own by veth links shaped with tc (`emulated_net.py`);
the ranks of one node talk over their node's own address, unshaped. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN).

What follows `--` is what torchrun runs on every node:
    xmoe ARGS...          -> torchrun ... -m xmoe ARGS...       (the xmoe command, as `python -m xmoe`)
    -m MODULE ARGS...     -> torchrun ... -m MODULE ARGS...
    SCRIPT.py ARGS...     -> torchrun ... SCRIPT.py ARGS...     (run by this Python)
    --no-python CMD ...   -> torchrun ... --no-python CMD ...
    CMD ARGS...           -> torchrun ... --no-python CMD ARGS...  (any other program: python, sh, a binary)

From Python (benchmarks, tests):

    with EmulatedCluster(nodes=2, inter_gbit=1.0) as cluster:
        link = cluster.measure_link(0, 1)                   # LinkMeasurement: .rate_bit, .rtt_ms
        result = cluster.run(["xmoe", "train", "--ep", "4"], ranks_per_node=2, timeout=300)
        result.returncode, [n.log for n in result.nodes]
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks import emulated_link, emulated_net
from benchmarks.emulated_launch import NodeResult, RunResult, launch, torchrun_target
from benchmarks.emulated_link import LinkMeasurement
from benchmarks.emulated_net import Layout, NetError, have_net_admin

__all__ = ["EmulatedCluster", "Interrupted", "LinkMeasurement", "NetError", "NodeResult", "RunResult"]
__all__ += ["have_net_admin", "main", "torchrun_target"]

PROG = "emulated_cluster.py"


class Interrupted(BaseException):
    """SIGTERM or SIGHUP reached the process while a cluster was up (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def check_settings(nodes: int, inter_gbit: float, inter_latency_ms: float) -> None:
    """Raise ValueError naming a setting that cannot make a cluster."""
    if not 1 <= nodes <= 64:
        raise ValueError(f"--nodes {nodes}: give 1 to 64 nodes")
    if not (math.isfinite(inter_gbit) and 0.001 <= inter_gbit <= 1000):
        raise ValueError(f"--inter-gbit {inter_gbit}: give a rate between 0.001 and 1000 Gbit/s")
    if not (math.isfinite(inter_latency_ms) and 0 <= inter_latency_ms <= 10_000):
        raise ValueError(f"--inter-latency-ms {inter_latency_ms}: give 0 to 10000 ms")


@dataclass
class EmulatedCluster:
    """``nodes`` namespaces joined by links of ``inter_gbit`` Gbit/s (each direction, per node) and
    ``inter_latency_ms`` one way between two nodes. Made by ``start()`` / ``with``; removed by ``close()`` or on
    leaving the ``with``, also on an exception, SIGINT, SIGTERM, SIGHUP or interpreter exit."""

    nodes: int = 2
    inter_gbit: float = 1.0
    inter_latency_ms: float = 0.0

    def __post_init__(self):
        check_settings(self.nodes, self.inter_gbit, self.inter_latency_ms)
        self.layout: Layout | None = None
        self.last_result: RunResult | None = None
        self._old_handlers: dict[int, object] = {}

    def start(self) -> EmulatedCluster:
        if self.layout is not None:
            return self
        ok, reason = have_net_admin()
        if not ok:
            raise NetError(reason)
        layout = Layout(
            owner=os.getpid(),
            nodes=self.nodes,
            subnet=emulated_net.pick_subnet(emulated_net.host_routes()),
            rate_bit=round(self.inter_gbit * 1e9),
            latency_ms=self.inter_latency_ms,
        )
        atexit.register(self.close)
        self._catch_signals()
        self.layout = layout  # before it exists: a signal right after create() must still remove it
        try:
            emulated_net.create(layout)
        except BaseException:
            self.layout = None  # create() removed what it made, and only that
            self.close()
            raise
        return self

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _catch_signals(self) -> None:
        # SIGTERM / SIGHUP would end the process without running `finally` blocks: turn them into an exception
        # while the cluster is up, where nobody else handles them (only the main thread may set handlers)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                self._old_handlers[sig] = signal.signal(sig, _raise_interrupted)

    def close(self) -> None:
        """Remove everything the cluster made (idempotent); SIGINT, SIGTERM and SIGHUP are ignored meanwhile."""
        main = threading.current_thread() is threading.main_thread()
        held = {}
        if main:
            held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            if self.layout is not None:
                emulated_net.destroy(self.layout.namespaces())
                self.layout = None
        finally:
            if main:
                for sig, handler in {**held, **self._old_handlers}.items():
                    signal.signal(sig, handler)  # type: ignore[arg-type]
                self._old_handlers = {}
            atexit.unregister(self.close)

    def _up(self) -> Layout:
        if self.layout is None:
            raise RuntimeError("the emulated cluster is not started: use `with EmulatedCluster(...)` or .start()")
        return self.layout

    def node_address(self, i: int) -> str:
        return self._up().node_addr(i)

    def namespace(self, i: int) -> str:
        return self._up().node_ns(i)

    def interface(self, i: int) -> str:
        return self._up().node_if(i)

    def link_bytes(self, i: int) -> tuple[int, int]:
        """Bytes node ``i`` has sent and received over its link so far (its traffic with the other nodes)."""
        layout = self._up()
        return emulated_net.link_bytes(layout.node_ns(i), layout.node_if(i))

    def measure_link(
        self, src: int = 0, dst: int = 1, nbytes: int = 8 << 20, pings: int = 20, timeout_s: float = 60
    ) -> LinkMeasurement:
        """Rate and round trip from node ``src`` to node ``dst``, measured with plain TCP sockets."""
        layout = self._up()
        if not (0 <= src < layout.nodes and 0 <= dst < layout.nodes and src != dst):
            raise ValueError(f"measure_link({src}, {dst}): give two different nodes of 0..{layout.nodes - 1}")
        ns = [layout.node_ns(src), layout.node_ns(dst)]
        try:
            return emulated_link.measure(*ns, layout.node_addr(dst), src, dst, nbytes, pings, timeout_s)
        finally:
            emulated_net.kill_namespace_processes(ns)

    def run(
        self,
        command: list[str],
        ranks_per_node: int = 1,
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        out: str | Path | None = None,
        fail_grace_s: float = 5.0,
        stop_grace_s: float = 10.0,
    ) -> RunResult:
        """One torchrun of ``command`` (mapped by ``torchrun_target``) per node, ``ranks_per_node`` ranks each.

        Each node's output goes to ``out``/node_<i>.log (``out`` defaults to a new temporary folder). Once a node
        fails, the others get ``fail_grace_s`` to end, then are stopped; at ``timeout`` every node is stopped
        (SIGTERM, ``stop_grace_s``, then SIGKILL to everything in the node's namespace). SIGINT / SIGTERM stop the
        nodes the same way and propagate; ``last_result`` then holds what ran."""
        layout = self._up()
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node {ranks_per_node}: give at least 1")
        target = torchrun_target(command)
        logs = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=f"{emulated_net.PREFIX}-logs-"))
        self.last_result = RunResult(nodes=[], wall_s=0.0, returncode=0, out=logs)
        return launch(layout, target, ranks_per_node, env or {}, timeout, fail_grace_s, stop_grace_s, self.last_result)


def summary(cluster: EmulatedCluster, ranks_per_node: int, result: RunResult) -> list[str]:
    lat = f", {cluster.inter_latency_ms:g} ms one way" if cluster.inter_latency_ms else ""
    lines = [f"emulated cluster: {cluster.nodes} nodes x {ranks_per_node} ranks, {cluster.inter_gbit:g} Gbit/s{lat}"]
    for n in result.nodes:
        lines.append(f"  node {n.node}: exit {n.returncode:<4} {n.status:<11} {n.wall_s:7.1f} s  {n.log}")
    lines.append(f"wall {result.wall_s:.1f} s, exit {result.returncode} (logs in {result.out})")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [options] -- COMMAND ...",
        description="Run a torchrun command on N emulated nodes (network namespaces joined by shaped links).",
        epilog="COMMAND: `xmoe ...` or `-m MODULE ...` (torchrun -m), `SCRIPT.py ...`, or any program "
        "(torchrun --no-python). Needs root.",
    )
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="torchrun processes per node (default 1)")
    p.add_argument("--inter-gbit", type=float, default=1.0, help="rate of each node's link, Gbit/s (default 1)")
    p.add_argument("--inter-latency-ms", type=float, default=0.0, help="one-way delay between nodes (default 0)")
    p.add_argument("--out", help="folder for node_<i>.log (default: a new temporary folder)")
    p.add_argument("--timeout", type=float, help="stop every node after this many seconds (exit 124)")
    p.add_argument("--measure", action="store_true", help="measure the link node 0 -> node 1 first")
    p.add_argument("--dry-run", action="store_true", help="print what would be made and run; make nothing")
    p.add_argument("--cleanup", action="store_true", help="remove what killed runs of this tool left, then exit")
    return p


def _dry_run(args, command: list[str]) -> None:
    layout = Layout(
        os.getpid(), args.nodes, emulated_net.pick_subnet([]), round(args.inter_gbit * 1e9), args.inter_latency_ms
    )
    from benchmarks.emulated_launch import torchrun_argv

    for ns in layout.namespaces():
        print(f"ip netns add {ns}")
    for cmd in emulated_net.setup_commands(layout):
        print(" ".join(cmd))
    if command:
        for i in range(layout.nodes):
            argv = torchrun_argv(layout, i, args.ranks_per_node, "emu", torchrun_target(command))
            print(f"ip netns exec {layout.node_ns(i)} {' '.join(argv)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if args.cleanup:
        ok, reason = have_net_admin()
        if not ok:
            print(f"{PROG}: {reason}", file=sys.stderr)
            return 2
        emulated_net.cleanup()
        return 0
    try:
        check_settings(args.nodes, args.inter_gbit, args.inter_latency_ms)
        if args.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node {args.ranks_per_node}: give at least 1")
        if args.timeout is not None and not args.timeout > 0:
            raise ValueError(f"--timeout {args.timeout}: give a positive number of seconds")
        if args.measure and args.nodes < 2:
            raise ValueError("--measure needs --nodes 2 or more")
        if command:
            torchrun_target(command)
        elif not args.measure:
            raise ValueError("give the command to run after --, e.g. -- xmoe train --ep 4 --steps 3")
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        _dry_run(args, command)
        return 0
    return _run(args, command)


def _run(args, command: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    cluster = EmulatedCluster(args.nodes, args.inter_gbit, args.inter_latency_ms)
    code = 0
    try:
        with cluster:
            if args.measure:
                print(cluster.measure_link(0, 1).describe(), flush=True)
            if command:
                result = cluster.run(command, args.ranks_per_node, timeout=args.timeout, out=args.out)
                code = result.returncode
    except NetError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"{PROG}: {e}; every node stopped, everything removed", file=sys.stderr)
        code = 128 + e.signum
    if command and cluster.last_result is not None:
        print("\n".join(summary(cluster, args.ranks_per_node, cluster.last_result)), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
