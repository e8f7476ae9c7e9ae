"""The emulated multi-node cluster (benchmarks/emulated_cluster.py): argument checks and the torchrun command
without privileges; with root, a 2 x 2 training run across two shaped namespaces, a failing node, the link's
measured rate, Ctrl-C and the cleanup of a killed run, each leaving the host's namespaces, links and queue
disciplines exactly as they were (skipped with the reason where network namespaces cannot be made)."""

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import emulated_net  # noqa: E402  (after the path above)
from benchmarks.emulated_cluster import EmulatedCluster, main  # noqa: E402
from benchmarks.emulated_launch import node_env, torchrun_argv, torchrun_target  # noqa: E402
from benchmarks.emulated_net import Layout, NetError, have_net_admin, pick_subnet, setup_commands  # noqa: E402

TOOL = str(ROOT / "benchmarks" / "emulated_cluster.py")
NAME = re.compile(rf"^{emulated_net.PREFIX}-(\d+)-")


def _layout(nodes=2, latency_ms=0.0):
    return Layout(4242, nodes, pick_subnet([]), 200_000_000, latency_ms)


@pytest.fixture
def net():
    ok, reason = have_net_admin()
    if not ok:
        pytest.skip(reason)


def _host_state(mine=()):
    """The root namespace's links and queue disciplines, and the namespace list without other runs' clusters
    (another test process may build its own meanwhile); ``mine``: owner pids whose namespaces count."""
    mine = {os.getpid(), *mine}

    def out(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()

    netns = [l for l in out("ip", "netns", "list") if not (NAME.match(l) and int(NAME.match(l)[1]) not in mine)]
    return netns, out("ip", "-o", "link", "show"), out("tc", "qdisc", "show")


def _marked_pids(marker):
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


# --- no privileges needed ---------------------------------------------------------------------------------------


def test_command_maps_to_torchrun():
    assert torchrun_target(["xmoe", "train", "--ep", "4"]) == ["-m", "xmoe", "train", "--ep", "4"]
    assert torchrun_target(["-m", "pkg.mod", "-x"]) == ["-m", "pkg.mod", "-x"]
    assert torchrun_target(["benchmarks/b.py", "--n", "2"]) == ["benchmarks/b.py", "--n", "2"]
    assert torchrun_target(["python", "-c", "pass"]) == ["--no-python", "python", "-c", "pass"]
    assert torchrun_target(["--no-python", "sh", "-c", "true"]) == ["--no-python", "sh", "-c", "true"]
    for bad, says in (([], "after --"), (["-m"], "module name"), (["--steps", "3"], "--steps")):
        with pytest.raises(ValueError, match=says):
            torchrun_target(bad)


def test_torchrun_line_and_environment_of_a_node():
    layout = _layout(nodes=3)
    argv = torchrun_argv(layout, 2, 4, "rid", ["-m", "xmoe", "train"])
    opts = dict(zip(argv[3:-3:2], argv[4:-3:2], strict=True))
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"] and argv[-3:] == ["-m", "xmoe", "train"]
    assert opts == {
        "--nnodes": "3",
        "--node-rank": "2",
        "--nproc-per-node": "4",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": f"{layout.node_addr(0)}:29400",
        "--rdzv-id": "rid",
        "--rdzv-conf": "is_host=0",
        "--local-addr": layout.node_addr(2),
        "--max-restarts": "0",
    }
    assert "is_host=1" in torchrun_argv(layout, 0, 4, "rid", ["x.py"])
    # c10d ranks agents by their addresses as strings: node order must survive that
    addrs = [layout.node_addr(i) for i in range(64)]
    assert sorted(addrs) == addrs and len(set(addrs)) == 64
    assert all(ipaddress.ip_address(a) in layout.subnet for a in addrs)

    base = {"RANK": "3", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin"}
    env = node_env(base, layout, 1, 2, {"XMOE_X": "1"})
    assert env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == "xemu1" == layout.node_if(1)
    assert (env["XMOE_EMU_NODE"], env["XMOE_EMU_NODES"], env["XMOE_X"], env["PATH"]) == ("1", "3", "1", "/bin")
    assert not {"RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 6))
    assert node_env({"OMP_NUM_THREADS": "3"}, layout, 0, 2, {})["OMP_NUM_THREADS"] == "3"


def test_subnet_avoids_the_hosts_routes():
    assert str(pick_subnet(["default via 192.0.2.1 dev eth0", "192.0.2.0/24 dev eth0"])) == "10.213.0.0/24"
    assert str(pick_subnet(["10.213.0.0/24 dev x", "unreachable 10.213.10.7"])) == "10.213.20.0/24"
    assert str(pick_subnet(["10.0.0.0/8 dev x"])) == "172.31.200.0/24"


def test_setup_touches_only_its_own_namespaces():
    layout = _layout(latency_ms=0.5)
    cmds = setup_commands(layout)
    own = set(layout.namespaces())
    for cmd in cmds:
        assert cmd[1] == "-n" and cmd[2] in own, cmd  # never the root namespace
    # each node's link shaped at both ends (its egress, its switch port's), the delay split between them
    shaped = {(c[2], c[6]) for c in cmds if "tbf" in c}
    ends = {(layout.node_ns(i), f"xemu{i}") for i in range(2)} | {(layout.switch_ns, f"xemu-p{i}") for i in range(2)}
    assert shaped == ends and len([c for c in cmds if "tbf" in c]) == 4
    assert all(c[c.index("rate") + 1] == "200000000bit" for c in cmds if "tbf" in c)
    assert {c[c.index("delay") + 1] for c in cmds if "netem" in c} == {"250us"}
    assert not [c for c in setup_commands(_layout()) if "netem" in c]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--nodes", "0", "--", "true"], "--nodes 0"),
        (["--inter-gbit", "0", "--", "true"], "--inter-gbit 0"),
        (["--inter-gbit", "nan", "--", "true"], "--inter-gbit nan"),
        (["--inter-latency-ms", "-1", "--", "true"], "--inter-latency-ms -1"),
        (["--ranks-per-node", "0", "--", "true"], "--ranks-per-node 0"),
        (["--timeout", "0", "--", "true"], "--timeout 0"),
        (["--nodes", "2"], "give the command to run after --"),
        (["--", "-m"], "module name"),
        (["--nodes", "1", "--measure"], "--measure needs --nodes 2"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and says in err[-1] and err[-1].startswith("emulated_cluster.py: error:")


def test_dry_run_prints_the_plan_without_privileges(capsys):
    assert main(["--dry-run", "--nodes", "2", "--ranks-per-node", "2", "--", "xmoe", "train", "--ep", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [l for l in lines if l.startswith("ip netns exec")]
    assert len(runs) == 2 and all("--nproc-per-node 2 " in l and l.endswith("-m xmoe train --ep 4") for l in runs)
    assert "-n1 " in runs[1] and "--node-rank 1" in runs[1]
    assert sum(l.startswith("ip netns add") for l in lines) == 3  # switch + 2 nodes


def test_without_privileges_it_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(emulated_net, "_has_capability", lambda bit: False)
    ok, reason = have_net_admin()
    assert not ok and "root" in reason and "\n" not in reason
    assert main(["--nodes", "2", "--", "true"]) == 2
    assert capsys.readouterr().err.strip() == f"emulated_cluster.py: {reason}"
    with pytest.raises(NetError, match="root"):
        EmulatedCluster(nodes=2).start()


# --- with root: namespaces ----------------------------------------------------------------------------------------


def test_two_nodes_of_two_ranks_train_and_leave_nothing(net, tmp_path):
    before = _host_state()
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    train = ["xmoe", "train", "--preset", "tiny", "--ep", "4", "--steps", "3", "--batch-size", "8", "--seq-len", "64"]
    train += ["--ckpt-every", "0", "--log-every", "1", "--out", str(tmp_path / "run")]
    with EmulatedCluster(nodes=2, inter_gbit=1.0) as cluster:
        result = cluster.run(train, ranks_per_node=2, env=env, timeout=300, out=tmp_path / "logs")
        link = [cluster.link_bytes(i) for i in range(2)]
        assert set(cluster.layout.namespaces()) <= set(emulated_net.list_namespaces())
    logs = "\n".join(n.log.read_text()[-3000:] for n in result.nodes)
    assert result.returncode == 0 and [n.status for n in result.nodes] == ["ok", "ok"], logs
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    assert "4 process(es)" in result.nodes[0].log.read_text() + result.nodes[1].log.read_text()
    # the expert all-to-all crossed each node's shaped link both ways (ranks of one node never use it)
    assert all(sent > 100_000 and received > 100_000 for sent, received in link), link
    assert _host_state() == before


def test_a_failing_node_fails_the_run_and_leaves_nothing(net, tmp_path):
    before = _host_state()
    exit_on_node_1 = "import os, sys; sys.exit(3 if os.environ['XMOE_EMU_NODE'] == '1' else 0)"
    with EmulatedCluster(nodes=2, inter_gbit=1.0) as cluster:
        result = cluster.run(["python", "-c", exit_on_node_1], out=tmp_path, timeout=120, fail_grace_s=1.0)
    node0, node1 = result.nodes
    assert node1.status == "failed" and node1.returncode == result.returncode != 0
    assert re.search(r"exitcode\s*:\s*3", node1.log.read_text()), node1.log.read_text()[-2000:]
    assert node0.status in ("ok", "stopped")  # its agent may wait at torchrun's exit barrier until stopped
    assert _host_state() == before


def test_measured_rate_follows_the_shaped_rate(net):
    with EmulatedCluster(nodes=2, inter_gbit=0.2) as cluster:
        with pytest.raises(NetError, match="exists already"):  # and the first one is left as it was
            EmulatedCluster(nodes=3).start()
        link = cluster.measure_link(0, 1, nbytes=4 << 20)
    # payload rate: TCP/IP and Ethernet headers take ~4.5% of the shaped frames
    assert 0.5 * 200e6 < link.rate_bit < 1.1 * 200e6, link.describe()
    assert 0 < link.rtt_min_ms <= link.rtt_ms < 50


def test_latency_needs_netem_or_is_refused_in_one_line(net):
    before = _host_state()
    cluster = EmulatedCluster(nodes=2, inter_gbit=1.0, inter_latency_ms=5.0)
    try:
        with cluster:
            link = cluster.measure_link(0, 1, nbytes=1 << 20, pings=5)
        assert 9.5 < link.rtt_ms < 20, link.describe()  # 5 ms each way
    except NetError as e:
        assert "netem" in str(e) and "--inter-latency-ms 0" in str(e) and "\n" not in str(e)
    assert _host_state() == before


def test_ctrl_c_stops_every_node_and_removes_everything(net, tmp_path):
    marker = f"emu-{uuid.uuid4().hex}"
    cmd = [sys.executable, TOOL, "--nodes", "2", "--out", str(tmp_path), "--"]
    cmd += ["python", "-c", f"import time; time.sleep(120)  # {marker}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    before = _host_state()  # taken without the child's namespaces (not yet its own)
    try:
        deadline = time.monotonic() + 120
        while len(_marked_pids(marker)) < 4 and time.monotonic() < deadline:  # 2 torchruns + their 2 workers
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert len(_marked_pids(marker)) >= 4
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in out and "SIGINT" in err
    assert _marked_pids(marker) == []
    assert _host_state(mine=[proc.pid]) == before


def test_cleanup_removes_what_a_killed_run_left(net):
    before = _host_state()
    marker = f"emu-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys, time\n"
        "from benchmarks.emulated_cluster import EmulatedCluster\n"
        "c = EmulatedCluster(nodes=2).start()\n"
        f"subprocess.Popen(['ip', 'netns', 'exec', c.namespace(0), 'sh', '-c', 'sleep 300; : {marker}'])\n"
        "print('up', flush=True)\n"
        "time.sleep(300)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        time.sleep(0.2)
        owner.kill()  # no cleanup can run: its namespaces and the process inside stay behind
        owner.wait()
        left = emulated_net.leftovers().get(owner.pid, [])
        assert len(left) == 3 and _marked_pids(marker)
        done = subprocess.run([sys.executable, TOOL, "--cleanup"], capture_output=True, text=True, timeout=60)
    finally:
        owner.kill()
    assert done.returncode == 0 and f"removed 3 namespace(s) of pid {owner.pid}" in done.stdout, done.stdout
    assert _marked_pids(marker) == []
    assert _host_state(mine=[owner.pid]) == before


def test_bench_ep_cluster_cases_list_today_first(capsys):
    """bench_ep_cluster --cases: exactly the named cases, today's path (flat, bf16, no limit, no overlap) measured
    first where not named, limits the cluster cannot bind left out; a malformed case is one line of argparse."""
    from benchmarks import bench_ep_cluster

    parser = bench_ep_cluster._parser()
    args = parser.parse_args(["--cases", "rbd:fp8:1:chunks", "pft:bf16:2:shared"])
    assert bench_ep_cluster._cases(args, 2) == [
        dict(dispatcher="pft", dtype="bf16", node_limit=0, mode="off"),
        dict(dispatcher="rbd", dtype="fp8", node_limit=1, mode="chunks"),
    ]
    assert len(bench_ep_cluster._cases(args, 4)) == 3
    named = parser.parse_args(["--cases", "rbd:bf16:0:off", "pft:bf16:0:off"])
    assert [c["dispatcher"] for c in bench_ep_cluster._cases(named, 2)] == ["rbd", "pft"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--cases", "rbd:fp16:1:off"])
    assert "expected pft|rbd" in capsys.readouterr().err


def test_bench_ep_cluster_charges_the_measured_collective_latency():
    """A row carrying the cluster's measured fixed cost of a collective (collective_latency) is predicted with it:
    flat with overlap off runs five collectives per MoE layer call, every one crossing nodes (the count exchange,
    dispatch, combine and their two backward exchanges), none hidden, so 10 ms more per collective is 5 x layers x
    10 ms more per step; RBD runs more collectives, so it pays more."""
    from benchmarks import bench_ep_cluster

    args = bench_ep_cluster._parser().parse_args(["--cases", "pft:bf16:0:off"])
    base = dict(dtype="bf16", node_limit=0, mode="off", step_ms=3000.0, exposed_ms=1200.0, experts_fwd_ms=20.0)
    base.update(least_exposed_ms=1000.0, intra_lat_ms=0.05)
    added = {}
    for dispatcher in ("pft", "rbd"):
        rows = [dict(base, dispatcher=dispatcher, inter_lat_ms=lat) for lat in (1.0, 11.0)]
        for r in rows:
            bench_ep_cluster.predictions(args, [r], nodes=2, link_bytes_s=36e6, rtt_ms=0.1)
        added[dispatcher] = rows[1]["predicted_ms"] - rows[0]["predicted_ms"]
    assert added["pft"] == pytest.approx(5 * args.layers * 10.0)
    assert added["rbd"] > added["pft"]


def test_bench_ep_cluster_takes_the_all_to_all_rate_over_one_flows():
    """Where the cluster's all-to-all rate was measured (alltoall_rate), the planner's inter-node bandwidth is that
    rate, not the single flow's: half the rate doubles the time on the wire, which with overlap off is exposed; a
    `chunks` case takes the rate measured for its chunked all-to-alls."""
    from benchmarks import bench_ep_cluster

    args = bench_ep_cluster._parser().parse_args(["--cases", "pft:bf16:0:off"])
    row = dict(dispatcher="pft", dtype="bf16", node_limit=0, mode="off", step_ms=3000.0, exposed_ms=1200.0)
    row.update(least_exposed_ms=1000.0, experts_fwd_ms=20.0, inter_lat_ms=0.0, intra_lat_ms=0.0)
    variants = [dict(row), dict(row, a2a_node_mbyte_s=36.0), dict(row, a2a_node_mbyte_s=18.0)]
    for r in variants:
        bench_ep_cluster.predictions(args, [r], nodes=2, link_bytes_s=36e6, rtt_ms=0.1)
    assert variants[1]["predicted_network_ms"] == pytest.approx(variants[0]["predicted_network_ms"])
    assert variants[2]["predicted_network_ms"] > 1.9 * variants[1]["predicted_network_ms"]
    assert variants[2]["predicted_ms"] - variants[1]["predicted_ms"] == pytest.approx(
        variants[2]["predicted_exposed_ms"] - variants[1]["predicted_exposed_ms"]
    )
    # a `chunks` case takes the rate of its chunked all-to-alls (two in flight), its overlap-off twin the whole one's
    rates = dict(a2a_node_mbyte_s=36.0, a2a_chunks_node_mbyte_s=18.0)
    off, chunks = dict(row, **rates), dict(row, mode="chunks", **rates)
    bench_ep_cluster.predictions(args, [off, chunks], nodes=2, link_bytes_s=36e6, rtt_ms=0.1)
    assert off["predicted_network_ms"] == pytest.approx(variants[1]["predicted_network_ms"])
    assert chunks["predicted_network_ms"] > 1.9 * off["predicted_network_ms"]


def test_bench_ep_cluster_predicts_from_the_critical_rank():
    """The planner's compute for a case is its overlap-off twin's step less the exposed time of the rank that waits
    least (the one the others wait for): the same case with that rank waiting 100 ms less is predicted 100 ms
    longer, and a row from before the field existed falls back to the ranks' mean."""
    from benchmarks import bench_ep_cluster

    args = bench_ep_cluster._parser().parse_args(["--cases", "pft:bf16:0:off"])
    row = dict(dispatcher="pft", dtype="bf16", node_limit=0, mode="off", step_ms=3000.0, exposed_ms=1200.0)
    row.update(least_exposed_ms=1000.0, experts_fwd_ms=20.0)
    variants = [dict(row), dict(row, least_exposed_ms=900.0), {k: v for k, v in row.items() if k != "least_exposed_ms"}]
    for r in variants:  # each its own run: a case's compute comes from the first overlap-off row of its group
        bench_ep_cluster.predictions(args, [r], nodes=2, link_bytes_s=36e6, rtt_ms=0.1)
    assert variants[1]["predicted_ms"] - variants[0]["predicted_ms"] == pytest.approx(100.0)
    assert variants[0]["predicted_ms"] - variants[2]["predicted_ms"] == pytest.approx(200.0)
    assert variants[0]["error"] == pytest.approx(3000.0 / variants[0]["predicted_ms"] - 1)
    # with a core per rank, flat `chunks` absorbs the arrival skew (mean less least exposed: 200 ms) and takes the
    # ranks' mean compute; where ranks outnumber the cores, with exchanges one at a time, or with RBD's blocking
    # stages, the critical rank's
    cases = [("pft", True, "chunks", 0.0), ("pft", False, "chunks", 200.0), ("pft", False, "shared", 0.0)]
    for dispatcher, contended, mode, shorter in [*cases, ("rbd", False, "chunks", 0.0)]:
        pair = [dict(row, dispatcher=dispatcher, lat_contended=c, mode=m) for c, m in ((True, "off"), (True, mode))]
        pair.append(dict(row, dispatcher=dispatcher, lat_contended=contended, mode=mode))
        bench_ep_cluster.predictions(args, pair, nodes=2, link_bytes_s=36e6, rtt_ms=0.1)
        assert pair[1]["predicted_ms"] - pair[2]["predicted_ms"] == pytest.approx(shorter), (dispatcher, mode)


def test_bench_ep_cluster_repredicts_a_saved_report(tmp_path):
    """--repredict: a saved report's rows predicted again by this code (stale predictions replaced), the measured
    fields untouched, written beside it with the commit that predicted them."""
    import json

    from benchmarks import bench_ep_cluster

    args = bench_ep_cluster._parser().parse_args(["--cases", "pft:bf16:0:off"])
    row = dict(dispatcher="pft", dtype="bf16", node_limit=0, mode="off", step_ms=3000.0, exposed_ms=1200.0)
    row.update(least_exposed_ms=1000.0, experts_fwd_ms=20.0, a2a_node_mbyte_s=30.0)
    rows = [dict(row), dict(row, mode="chunks", step_ms=2500.0, lat_contended=False)]
    stale = [dict(r, predicted_ms=1.0, error=5.0) for r in rows]
    cluster = dict(nodes=2, link="link", link_mbyte_s=36.0, rows=stale)
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(dict(settings=vars(args), clusters=[cluster], date="d", machine="m", command="c")))
    out = bench_ep_cluster.repredict(saved)
    assert out == tmp_path / "run_repredicted.json" and out.with_suffix(".md").exists()
    bench_ep_cluster.predictions(args, rows, nodes=2, link_bytes_s=36e6, rtt_ms=0.0)
    again = json.loads(out.read_text())
    assert again["clusters"][0]["rows"] == rows and again["repredicted"]["command"].endswith(str(saved))
    assert "made again" in out.with_suffix(".md").read_text()
    (tmp_path / "other.json").write_text(json.dumps({"steps": [1.0]}))
    (tmp_path / "empty.json").write_text(json.dumps({"settings": {}, "clusters": []}))
    (tmp_path / "rowless.json").write_text(json.dumps({"settings": {}, "clusters": [{"nodes": 2}]}))
    for wrong in (tmp_path / name for name in ("other.json", "missing.json", "empty.json", "rowless.json")):
        with pytest.raises(SystemExit, match=f"{wrong.name} is not a report of this benchmark"):
            bench_ep_cluster.repredict(wrong)


def test_bench_ep_cluster_splits_in_place_waits_at_the_last_arrival():
    """_arrivals: a collective waited in place splits into waiting for its group's last member (from each rank's
    own start) and the exchange after it; posted waits (no group recorded) are left out; ranks whose timed
    collectives do not line up give nothing."""
    from benchmarks.bench_ep_cluster import _arrivals

    # rank 0 arrives at 1.0, rank 1 at 1.5, both leave at 2.0; rank 2 waits alone in its own group from 1.2 to 1.4
    r0 = [[("blocking", 1.0, 2.0, (0, 1)), ("posted", 2.0, 2.5, None)]]
    r1 = [[("blocking", 1.5, 2.0, (0, 1)), ("posted", 2.0, 2.2, None)]]
    r2 = [[("counts", 1.2, 1.4, (2,))]]
    got = _arrivals([r0, r1, r2])
    assert got["in_place_arrival_ms"] == pytest.approx(1e3 * (0.5 + 0 + 0) / 3)
    assert got["in_place_exchange_ms"] == pytest.approx(1e3 * (0.5 + 0.5 + 0.2) / 3)
    assert _arrivals([r0, [[]]]) == {}  # rank 1 timed no collective in place: nothing to match


def test_bench_ep_cluster_times_posted_exchanges_from_the_last_post():
    """_flights: a posted exchange is on the network from the last rank's post to each rank's completion; exchanges
    in flight together count once; other events are left out; exchanges that do not line up give nothing."""
    from benchmarks.bench_ep_cluster import _flights

    # two exchanges in flight together: rank 0 posts both at 1.0, rank 1 at 1.4 and 1.6; they complete at 2.0 and 2.5
    r0 = [[("flight", 1.0, 2.0, None), ("posted", 1.9, 2.0, None), ("flight", 1.0, 2.5, None)]]
    r1 = [[("flight", 1.4, 2.0, None), ("flight", 1.6, 2.5, None), ("counts", 0.5, 0.6, (0, 1))]]
    got = _flights([r0, r1])
    assert got["posted_flight_ms"] == pytest.approx(1e3 * (1.5 + 1.1) / 2)  # [1.0, 2.5] and [1.4, 2.5]
    assert got["posted_transfer_ms"] == pytest.approx(1e3 * 1.1)  # [1.4, 2.0] with [1.6, 2.5] on both ranks
    # one after the other: both count in full
    r0 = [[("flight", 1.0, 2.0, None), ("flight", 3.0, 3.5, None)]]
    r1 = [[("flight", 1.5, 2.0, None), ("flight", 3.2, 3.5, None)]]
    assert _flights([r0, r1])["posted_transfer_ms"] == pytest.approx(1e3 * (0.5 + 0.3))
    assert _flights([r0, [[("flight", 1.5, 2.0, None)]]]) == {}
