"""Measure an emulated cluster's link between two nodes with plain TCP sockets: round-trip latency and rate.

A server in the destination node's namespace drains messages (an 8-byte length, then that many bytes) and answers
each with one byte; a client in the source node's namespace sends empty messages (pings: one round trip each),
1 MiB to open TCP's congestion window, then the measured message. Both are `python -I -S -c` one-file programs, so
a measurement costs two interpreter starts (no torch) and the transfer: ~0.5 s for 8 MiB at 200 Mbit/s.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass

_SERVER = r"""
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 20)
def drain(n):
    while n:
        got = conn.recv_into(buf, min(n, len(buf)))
        if got == 0:
            raise SystemExit(0)
        n -= got
while True:
    head = bytearray()
    while len(head) < 8:
        part = conn.recv(8 - len(head))
        if not part:
            raise SystemExit(0)
        head += part
    drain(int.from_bytes(head, "big"))
    conn.sendall(b"k")
"""

_CLIENT = r"""
import json, socket, sys, time
addr, port, nbytes, pings = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
conn = socket.create_connection((addr, port), timeout=60)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
payload = memoryview(bytes(nbytes))
def message(n):
    start = time.perf_counter()
    conn.sendall(n.to_bytes(8, "big"))
    conn.sendall(payload[:n])
    if conn.recv(1) != b"k":
        raise SystemExit("the link measurement's server closed the connection")
    return time.perf_counter() - start
rtts = [message(0) for _ in range(pings)]
message(min(nbytes, 1 << 20))
print(json.dumps({"rtts": rtts, "seconds": message(nbytes)}))
"""


@dataclass(frozen=True)
class LinkMeasurement:
    """What crossed from node ``src`` to node ``dst``: ``rate_bit`` bits/s of payload, round trips in ms."""

    src: int
    dst: int
    nbytes: int
    rate_bit: float
    rtt_ms: float  # median of the pings
    rtt_min_ms: float

    @property
    def gbit(self) -> float:
        return self.rate_bit / 1e9

    @property
    def mbyte_s(self) -> float:
        return self.rate_bit / 8e6

    def describe(self) -> str:
        return (
            f"link node {self.src} -> node {self.dst}: {self.gbit:.3f} Gbit/s ({self.mbyte_s:.1f} MB/s) over "
            f"{_size(self.nbytes)}; round trip {self.rtt_ms:.3f} ms (median, min {self.rtt_min_ms:.3f})"
        )


def _in_ns(ns: str, code: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-I", "-S", "-c", code, *args]


def measure(
    src_ns: str, dst_ns: str, dst_addr: str, src: int, dst: int, nbytes: int, pings: int, timeout_s: float
) -> LinkMeasurement:
    """Run the server in ``dst_ns`` (listening on ``dst_addr``) and the client in ``src_ns``; see the module doc."""
    server = subprocess.Popen(_in_ns(dst_ns, _SERVER, dst_addr), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"the link measurement's server in {dst_ns} did not start")
        client = subprocess.run(
            _in_ns(src_ns, _CLIENT, dst_addr, port, str(nbytes), str(pings)),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if client.returncode != 0:
            said = (client.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"the link measurement from {src_ns} failed: {said}")
        data = json.loads(client.stdout)
    finally:
        server.kill()
        server.wait()
    rtt_s = statistics.median(data["rtts"])
    # the timed message's answer costs one ping's round trip on top of the transfer
    transfer_s = max(data["seconds"] - rtt_s, 1e-9)
    return LinkMeasurement(src, dst, nbytes, nbytes * 8 / transfer_s, rtt_s * 1e3, min(data["rtts"]) * 1e3)


def _size(nbytes: int) -> str:
    """8 MiB, 256 KiB: a message size as measured (a size below 1 MiB is not '0 MiB')."""
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"
