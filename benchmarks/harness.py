"""Shared benchmark harness: device-event timing (median), peak extra memory, JSON + markdown results.

Every benchmark script times with ``time_ms`` (triton.testing.do_bench: warm-up, then the median of many runs
timed with CUDA events, L2 flushed between runs), measures ``peak_extra_bytes`` over one call, and writes its rows
through ``write_results`` so each result file carries the date, the GPU, the command and the commit that produced
it (``environment``; tests/test_benchmark_results.py refuses a committed result without its commit).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
COMMIT_ENV = "XMOE_COMMIT"


def time_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100, min_reps: int = 5) -> float:
    """Median milliseconds of fn() on the current CUDA device, over at least min_reps timed calls (after at
    least two warm-up calls): triton's do_bench alone sizes its loops by time, so a call longer than rep_ms would
    be timed once and one stall would be the result."""
    import triton.testing

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = start.elapsed_time(end)
    return float(
        triton.testing.do_bench(
            fn, warmup=max(warmup_ms, 2 * once), rep=max(rep_ms, min_reps * once), return_mode="median"
        )
    )


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated during fn() above what was allocated before it (fn's results are dropped)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return peak - base


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (the reference's norm floored at 1e-30)."""
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def environment() -> dict:
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": props.name if props else None,
        "sm_count": props.multi_processor_count if props else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "command": " ".join([_launcher(), sys.argv[0]] + sys.argv[1:]),
        **commit(),
    }


def commit() -> dict:
    """The code a result measures: ``commit``, git's HEAD of this checkout (or $XMOE_COMMIT, for a copy of the
    tree without git's history), and ``commit_dirty``, whether tracked files differ from it (None where unknown);
    saved results (benchmarks/results) do not count, so that results written one after another name the code alike.
    A result whose commit is "unknown" cannot be committed (tests/test_benchmark_results.py): set $XMOE_COMMIT."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None:
        given = os.environ.get(COMMIT_ENV, "").strip()
        if not given:
            print(f"harness: no git history here and ${COMMIT_ENV} unset: the results name no commit", file=sys.stderr)
        return {"commit": given or "unknown", "commit_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {"commit": head, "commit_dirty": bool(status) if status is not None else None}


def commit_ref(meta: dict) -> str:
    """A result's commit (from ``environment()`` or ``commit()``) as markdown, with a note where the tree was dirty."""
    note = " (with uncommitted changes to tracked files)" if meta.get("commit_dirty") else ""
    return f"`{meta.get('commit', 'unknown')}`{note}"


def commit_line(meta: dict) -> str:
    """The markdown line naming a result's commit (from ``environment()`` or ``commit()``)."""
    return f"Commit: {commit_ref(meta)}"


def _launcher() -> str:
    """How this script was started: under torchrun (WORLD_SIZE set) with its process count, else python."""
    if "WORLD_SIZE" in os.environ:
        return f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', os.environ['WORLD_SIZE'])}"
    return "python"


RESULTS_ENV = "XMOE_RESULTS_DIR"
RESULTS_ROOT = Path(__file__).resolve().parent / "results"


def results_dir(topic: str) -> Path:
    """benchmarks/results/<topic>: the folder of one topic's committed results (benchmarks/results/README.md)."""
    return RESULTS_ROOT / topic


def out_dir(topic: str) -> Path:
    """Where results go: $XMOE_RESULTS_DIR when set (run_multi_gpu.sh and the scripts' --out set it), else
    benchmarks/results/<topic>."""
    path = Path(os.environ.get(RESULTS_ENV) or results_dir(topic))
    path.mkdir(parents=True, exist_ok=True)
    return path


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    stem: str,
    rows: Sequence[dict],
    columns: Sequence[str],
    meta: dict,
    title: str,
    notes: str = "",
    *,
    topic: str,
) -> tuple[Path, Path]:
    """Write <stem>.json (meta + rows) and <stem>.md (header + table) under out_dir(topic); returns both paths.
    A meta made without ``environment()`` gets the commit here."""
    folder = out_dir(topic)
    meta = meta if "commit" in meta else {**meta, **commit()}
    json_path, md_path = folder / f"{stem}.json", folder / f"{stem}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=1))
    header = f"# {title}\n\n{meta.get('date')}, {meta.get('gpu')}, torch {meta.get('torch')}, "
    header += f"triton {meta.get('triton')}\n\n"
    header += f"{commit_line(meta)}\n\n"
    header += f"Command: `{meta.get('command')}`\n\n"
    md_path.write_text(header + (notes + "\n\n" if notes else "") + markdown_table(rows, columns) + "\n")
    return json_path, md_path


def write_step_report(folder: str, stem: str, title: str, text: str, payload: dict, gpu: str | None = None) -> None:
    """<folder>/<stem>.json (meta and ``payload``) and <stem>.md (``title``, date, the GPU, torch, the command, then
    ``text``): the results files of the single-GPU step diagnostics (profile_step.py, host_lead.py). ``gpu``: what
    to call the device where environment()'s GPU name does not say (no GPU)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    meta = environment()
    meta["gpu"] = gpu or meta["gpu"]
    (path / f"{stem}.json").write_text(json.dumps({"meta": meta, **payload}, indent=1))
    (path / f"{stem}.md").write_text(
        f"# {title}\n\n{meta['date']}, {meta['gpu']}, torch {meta['torch']}\n\n{commit_line(meta)}\n\n"
        f"`{meta['command']}`\n\n{text}\n"
    )


def distributed_skip_reason(script: str, cpu: bool) -> str | None:
    """Why a torchrun benchmark cannot run here (None: it can). ``cpu``: a gloo smoke run needs no GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        return f"needs >= 2 ranks: torchrun --nproc-per-node 2 {script}"
    if cpu:
        return None
    if not torch.cuda.is_available():
        return "no CUDA GPU visible (--cpu runs a gloo smoke test instead)"
    if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        return f"{torch.cuda.device_count()} GPU(s) for {os.environ.get('LOCAL_WORLD_SIZE')} ranks on this node"
    return None


def init_distributed(cpu: bool, timeout_s: float | None = None) -> torch.device:
    """Join torchrun's process group: gloo on CPU processes, else NCCL with this rank's GPU. ``timeout_s`` bounds
    every collective (a rank left waiting for a peer that died ends the run instead of hanging)."""
    import torch.distributed as dist

    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    device = torch.device("cpu")
    if not cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl", **kwargs)
    return device


def collective_time_ms(
    fn: Callable[[], object], device: torch.device, iters: int, trials: int = 5, warmup: bool = True
) -> float:
    """Median over trials of (time of ``iters`` back-to-back calls) / iters, for code with collectives: every rank
    runs the same fixed count (do_bench's adaptive repeats would desynchronise them) and barriers before each
    trial. CUDA events on GPUs; a host timer on CPU processes (the --cpu smoke runs)."""
    import torch.distributed as dist

    from xmoe.bench import time_ms as timed

    if warmup:
        fn()
    return timed(fn, device, trials, calls=iters, before=dist.barrier)


def parse_trainer_args(parser, argv: Sequence[str]):
    """`xmoe train`'s flags on ``parser`` plus ``--layers`` (default 8), parsed with the single-GPU benchmarks'
    defaults (small preset shape, seq 2048, no checkpoints, ``--fit auto``: a batch larger than this GPU holds is
    run in the micro-batches the memory pre-flight finds fit, for the benchmarks that pass ``fit`` to their
    Trainer); the layer count goes in ahead of the user's --set."""
    from xmoe.train.cli import add_arguments

    add_arguments(parser)
    parser.add_argument("--layers", type=int, default=8, help="layers of the small preset shape (default 8)")
    args = parser.parse_args(["--preset", "small", "--seq-len", "2048", "--ckpt-every", "0", "--fit", "auto", *argv])
    args.set = [f"model.num_layers={args.layers}", *args.set]
    return args


def run_xmoe_train(*args: str) -> tuple[list[dict] | None, str, float, str]:
    """`xmoe train ARGS --out <temporary directory>` as its own process (fresh allocator, no checkpoint left behind).
    Returns (metrics.jsonl records or None on failure, the command with RUN_DIR for the directory, wall seconds,
    the error output's tail)."""
    records, command, wall, error, _ = run_xmoe_train_output(*args)
    return records, command, wall, error


def run_xmoe_train_output(*args: str, source: str | None = None) -> tuple[list[dict] | None, str, float, str, str]:
    """run_xmoe_train, and the run's standard output (its header, with the memory pre-flight's line) last.
    ``source``: another checkout of xmoe to run instead of the one on the path (a baseline of the same call)."""
    import subprocess
    import tempfile
    import time

    env = None if source is None else {**os.environ, "PYTHONPATH": str(Path(source).resolve())}
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "xmoe", "train", *args, "--out", out]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=source, env=env)
        wall = time.perf_counter() - start
        command = " ".join(["python"] + cmd[1:]).replace(out, "RUN_DIR")
        if proc.returncode:
            return None, command, wall, (proc.stderr or proc.stdout)[-1500:], proc.stdout
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return records, command, wall, "", proc.stdout


def fit_auto_change(header: str) -> dict[str, str]:
    """What `xmoe train --fit auto` changed, from its header's memory line ("... with --fit auto's
    --micro-batch-size 4 --recompute moe (as given: ...)"): {"micro_batch_size": "4", "recompute": "moe"}, or {}
    where it changed nothing."""
    import re

    found = re.search(r"with --fit auto's (.*?) \(as given", header)
    if not found:
        return {}
    flags = found.group(1).split()
    return {
        flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2], strict=True)
    }


def _trace(prof) -> tuple[list[dict], list[dict]]:
    """(every event, the GPU kernels in start order) of a torch.profiler trace."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return events, sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def kernel_gaps(prof) -> list[tuple[float, str]]:
    """(idle ms, "previous kernel -> next kernel") for each gap between consecutive GPU kernels in a
    torch.profiler trace: time the GPU waited for the host (launches, Python, synchronisation)."""
    import itertools

    _, kernels = _trace(prof)
    gaps = []
    for a, b in itertools.pairwise(kernels):
        gap_us = b["ts"] - (a["ts"] + a["dur"])
        if gap_us > 0:
            gaps.append((gap_us / 1e3, f"{a['name'][:40]} -> {b['name'][:40]}"))
    return gaps


def host_ops_in_longest_gap(prof, top: int = 40) -> tuple[float, list[tuple[float, str]]]:
    """(the longest gap between GPU kernels in ms, [(ms of overlap, host op)] for the host ops, CPU-side events of a
    trace recorded with ProfilerActivity.CPU, that ran during it, longest first): what the GPU waited for."""
    import itertools

    events, kernels = _trace(prof)
    if len(kernels) < 2:
        return 0.0, []
    start, end, b_next = max(
        ((a["ts"] + a["dur"], b["ts"], b) for a, b in itertools.pairwise(kernels)), key=lambda se: se[1] - se[0]
    )
    # the thread that launched the kernel after the gap: the training loop's, not a helper thread's
    launch = next(
        (
            e
            for e in events
            if e.get("cat") == "cuda_runtime"
            and e.get("args", {}).get("correlation") == b_next.get("args", {}).get("correlation")
        ),
        None,
    )
    tid = launch.get("tid") if launch else None
    ops: dict[str, float] = {}
    for e in events:
        if tid is not None and e.get("tid") != tid:
            continue
        if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation", "python_function") and "dur" in e:
            overlap = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
            if overlap > 0:
                name = f"{e['cat']}: {e['name'][:80]}"
                ops[name] = ops.get(name, 0.0) + overlap / 1e3
    return (end - start) / 1e3, sorted(((ms, name) for name, ms in ops.items()), reverse=True)[:top]
