"""The network of an emulated cluster: network namespaces for nodes, a bridge for the switch, shaped veth links.

    switch namespace  xmoe-emu-<owner>-sw: bridge xemu-br, ports xemu-p0 .. xemu-p<N-1>
    node namespaces   xmoe-emu-<owner>-n<i>: lo + xemu<i> (address .101+i of one private /24), peer of xemu-p<i>

Every name carries the prefix and the owner's pid, so a cleanup can find what a killed run left and never touches
anything else. The root namespace gets nothing: each veth pair is created inside the switch namespace with its peer
moved straight into the node's, and the node namespaces have no route but their own /24. Each node's link is
shaped in both directions by a tbf (rate) on its two ends' egress, with netem (delay) above it where the kernel has
netem: node i's uploads leave through xemu<i>, its downloads through the switch port xemu-p<i>. Ranks of one node
reach each other through the node's own address, which the kernel routes over lo: unshaped, as inside a real node.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

PREFIX = "xmoe-emu"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-(sw|n\d+|probe)$")
# candidates for the cluster's subnet, the first that overlaps no route of the host is taken (the addresses never
# leave the namespaces, but a clash would make logs and `ip` listings ambiguous)
_SUBNETS = [f"10.213.{i}.0/24" for i in range(0, 250, 10)] + [f"172.31.{i}.0/24" for i in range(200, 250)]
_ROUTE_TYPES = {
    "unicast",
    "local",
    "broadcast",
    "multicast",
    "anycast",
    "unreachable",
    "prohibit",
    "blackhole",
    "throw",
}
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21


class NetError(RuntimeError):
    """A namespace, link or queue discipline could not be made; the message is one line for the user."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetError(f"`ip {' '.join(args)}` failed: {_first_line(proc.stderr)}")
    return proc


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no message)"])[0]


def _has_capability(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return os.geteuid() == 0
    return bool(int(caps.split()[1], 16) >> bit & 1)


def have_net_admin() -> tuple[bool, str]:
    """Whether this process can build an emulated cluster, and if not, one line saying why."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"the emulated cluster needs iproute2's {' and '.join(missing)} command, not found on PATH"
    if not (_has_capability(CAP_NET_ADMIN) and _has_capability(CAP_SYS_ADMIN)):
        return False, "the emulated cluster needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to make network namespaces"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        said = _first_line(made.stderr)
        return False, f"the emulated cluster cannot make network namespaces: `ip netns add` said: {said}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def pick_subnet(routes: list[str]) -> ipaddress.IPv4Network:
    """The first candidate /24 that overlaps no destination of ``routes`` (lines of `ip route`)."""
    taken = []
    for line in routes:
        words = line.split()
        if words and words[0] in _ROUTE_TYPES:
            words = words[1:]
        if not words or words[0] == "default":
            continue
        try:
            taken.append(ipaddress.ip_network(words[0], strict=False))
        except ValueError:
            continue  # not an address: nothing to clash with
    for cand in _SUBNETS:
        net = ipaddress.IPv4Network(cand)
        if not any(net.overlaps(t) for t in taken if t.version == 4):
            return net
    raise NetError("every candidate subnet of the emulated cluster overlaps a route of this host")


def host_routes() -> list[str]:
    return _ip("-4", "route", "show", "table", "all").stdout.splitlines()


@dataclass(frozen=True)
class Layout:
    """Names, addresses and shaping of one emulated cluster (nothing here touches the system)."""

    owner: int
    nodes: int
    subnet: ipaddress.IPv4Network
    rate_bit: int  # per node link, each direction
    latency_ms: float  # one way, node to node

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}-{self.owner}-sw"

    def node_ns(self, i: int) -> str:
        return f"{PREFIX}-{self.owner}-n{i}"

    def node_if(self, i: int) -> str:
        return f"xemu{i}"

    def port_if(self, i: int) -> str:
        return f"xemu-p{i}"

    def node_addr(self, i: int) -> str:
        # .101, .102, ...: three digits each, so torchrun's c10d rendezvous, which ranks agents by sorting their
        # addresses as strings, gives node i group rank i (its ranks are i * ranks_per_node + local rank)
        return str(self.subnet.network_address + 101 + i)

    def namespaces(self) -> list[str]:
        return [self.switch_ns] + [self.node_ns(i) for i in range(self.nodes)]


def shaping_commands(ns: str, dev: str, rate_bit: int, delay_ms: float) -> list[list[str]]:
    """tc commands shaping the egress of ``dev`` in ``ns`` to ``rate_bit`` after ``delay_ms`` of delay.

    tbf's bucket holds 1 ms at the rate (at least 64 KiB: a GSO packet of the veth must fit, else tbf splits it
    per segment), its queue 50 ms (at least 4 MiB) so that the incast of an all-to-all queues instead of dropping:
    a dropped segment costs TCP a 200 ms retransmission timeout, far more than the queueing delay."""
    rate_byte = rate_bit / 8
    burst = max(int(rate_byte * 1e-3), 64 << 10)
    limit = max(int(rate_byte * 0.05), 4 << 20)
    tbf = ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)]
    if delay_ms <= 0:
        return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
    # netem delays, tbf (its child) shapes: the arrangement the netem documentation gives for rate + delay
    netem = ["netem", "delay", f"{delay_ms * 1000:.0f}us", "limit", "100000"]
    return [
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem],
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf],
    ]


def setup_commands(layout: Layout) -> list[list[str]]:
    """Every command that builds ``layout``, in order (after the namespaces are added)."""
    sw = layout.switch_ns
    cmds = [
        ["ip", "-n", sw, "link", "set", "lo", "up"],
        ["ip", "-n", sw, "link", "add", "xemu-br", "type", "bridge"],
        ["ip", "-n", sw, "link", "set", "xemu-br", "up"],
    ]
    prefix = layout.subnet.prefixlen
    # the delay is split between the two egresses a packet crosses from node a to node b (a's own, b's switch
    # port), so one way between two nodes is latency_ms and a round trip twice that
    half_ms = layout.latency_ms / 2
    for i in range(layout.nodes):
        ns, dev, port = layout.node_ns(i), layout.node_if(i), layout.port_if(i)
        cmds += [
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns],
            ["ip", "-n", sw, "link", "set", port, "master", "xemu-br"],
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", ns, "addr", "add", f"{layout.node_addr(i)}/{prefix}", "dev", dev],
            ["ip", "-n", ns, "link", "set", dev, "up"],
        ]
        cmds += shaping_commands(ns, dev, layout.rate_bit, half_ms)
        cmds += shaping_commands(sw, port, layout.rate_bit, half_ms)
    return cmds


def create(layout: Layout) -> None:
    """Build ``layout``; on any failure remove what was made and raise NetError with one line."""
    taken = set(layout.namespaces()) & set(list_namespaces())
    if taken:
        raise NetError(f"namespace {min(taken)} exists already: one emulated cluster per process at a time")
    made = []
    try:
        for ns in layout.namespaces():
            _ip("netns", "add", ns)
            made.append(ns)
        for cmd in setup_commands(layout):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise NetError(_explain(cmd, proc.stderr, layout))
    except BaseException:
        destroy(made)
        raise


def _explain(cmd: list[str], stderr: str, layout: Layout) -> str:
    said = _first_line(stderr)
    if "netem" in cmd and "unknown" in said.lower():
        return (
            f"--inter-latency-ms {layout.latency_ms:g} needs the netem queue discipline, which this kernel lacks "
            f"(tc: {said}); use --inter-latency-ms 0 (the rate alone is shaped with tbf)"
        )
    return f"`{' '.join(cmd)}` failed: {said}"


def link_bytes(ns: str, dev: str) -> tuple[int, int]:
    """Bytes sent and received so far by ``dev`` in ``ns``."""
    stats = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", "dev", dev).stdout)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def namespace_pids(ns: str) -> list[int]:
    proc = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def kill_namespace_processes(namespaces: list[str], grace_s: float = 0.0) -> None:
    """End every process inside ``namespaces`` (all were started there by this tool): SIGTERM, ``grace_s`` to
    exit, then SIGKILL, and wait until none is left (a process left inside would keep its namespace alive)."""
    steps = [(signal.SIGTERM, grace_s)] if grace_s > 0 else []
    for sig, wait_s in [*steps, (signal.SIGKILL, 5.0)]:
        pids = [p for ns in namespaces for p in namespace_pids(ns)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(namespace_pids(ns) for ns in namespaces):
            time.sleep(0.05)


def destroy(namespaces: list[str]) -> None:
    """Remove ``namespaces`` with everything in them (links, bridge, queue disciplines) after their processes."""
    kill_namespace_processes(namespaces)
    existing = set(list_namespaces())
    for ns in namespaces:
        if ns in existing:
            _ip("netns", "del", ns, check=False)


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers() -> dict[int, list[str]]:
    """The tool's namespaces on this host, by owner pid."""
    owners: dict[int, list[str]] = {}
    for ns in list_namespaces():
        match = _NAME_RE.match(ns)
        if match:
            owners.setdefault(int(match.group(1)), []).append(ns)
    return owners


def cleanup(log=print) -> int:
    """Remove the namespaces (and their processes) of emulated clusters whose owner is gone; return how many."""
    removed = 0
    for owner, namespaces in sorted(leftovers().items()):
        if _alive(owner):
            log(f"kept {len(namespaces)} namespace(s) of pid {owner}, which is still running: {' '.join(namespaces)}")
            continue
        destroy(namespaces)
        removed += len(namespaces)
        log(f"removed {len(namespaces)} namespace(s) of pid {owner}: {' '.join(namespaces)}")
    if removed == 0:
        log("nothing to remove")
    return removed
