"""How far the host runs ahead of the GPU through a training step, without a profiler.

    python benchmarks/host_lead.py --layers 8 --batch-size 64 --micro-batch-size 16 --compile on --fp8 experts
    python benchmarks/host_lead.py --results benchmarks/results/train --tag moe4_b8 --layers 4 --batch-size 8 ...

Builds `xmoe train`'s Trainer from the same flags (small preset shape, seq 2048), runs warm-up steps, then windows of
``--window`` optimizer steps with a mark at each phase of every step: the step's start, each micro-batch taken from
the loader, its forward and backward issued, the clipping, the optimizer step, the MoE step's finish. Each mark
records the host's clock and a CUDA event. The lead at a mark is how long after the host passed it the GPU got
there: while it is above zero the GPU has queued work and the host's time is hidden; at zero the GPU waited for the
host. (A profiler's trace cannot say this: its own per-op cost slows the host, and the idle it shows between steps
can be its own.) Windows, in order: the loader as it is, the loader serving samples drawn before the window (what a
loader drawing beside the step could gain at most), the loader as it is again. On CPU the "GPU" clock is the host's
(every lead zero): a check that the marks and sums run. With --results writes host_lead_<tag>.json / .md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

WAITED_MS = 0.05  # a lead below this: the GPU reached the mark as the host did


class Marks:
    """(name, host seconds, CUDA event or None) per mark while ``on``; GPU seconds from a reference event."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.on, self.rows = cuda, False, []

    def __call__(self, name: str) -> None:
        if self.on:
            event = None
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            self.rows.append((name, time.perf_counter(), event))

    @contextlib.contextmanager
    def recording(self):
        """Marks inside; on exit each row gets its GPU time (the host's where there is no GPU)."""
        self.rows = []
        if self.cuda:
            torch.cuda.synchronize()
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            torch.cuda.synchronize()
            host_ref = time.perf_counter()
        self.on = True
        try:
            yield
        finally:
            self.on = False
            if self.cuda:
                torch.cuda.synchronize()
        self.timed = [(n, h, host_ref + ref.elapsed_time(e) / 1e3 if e is not None else h) for n, h, e in self.rows]


def _drawn_key(pos: np.ndarray) -> tuple[int, int]:
    """How ``draw_ahead`` files a draw and ``instrumented`` finds it: its first position and its length."""
    return int(pos[0]), len(pos)


@contextlib.contextmanager
def instrumented(trainer, marks: Marks, drawn: dict | None):
    """The trainer's phases marked (functions wrapped for the block, restored after); ``drawn``: a dict the
    loader's draws are served from while it is not None (filled beforehand by ``draw_ahead``)."""
    import xmoe.train.trainer as trainer_mod
    from xmoe.moe.step import MoEStep
    from xmoe.train.loader import TokenLoader

    def after(fn, name):
        def call(*a, **k):
            out = fn(*a, **k)
            marks(name)
            return out

        return call

    draw = TokenLoader._draw

    def served(loader, pos):
        return drawn[_drawn_key(pos)] if drawn is not None else draw(loader, pos)

    patches = [
        (trainer_mod, "clip_gradients", after(trainer_mod.clip_gradients, "clipped")),
        (trainer_mod, "optimizer_step", after(trainer_mod.optimizer_step, "optimizer")),
        (MoEStep, "end_micro_batch", after(MoEStep.end_micro_batch, "backward")),
        (MoEStep, "finish", after(MoEStep.finish, "finished")),
        (TokenLoader, "__next__", after(TokenLoader.__next__, "batch")),
        (TokenLoader, "_draw", served),
        (trainer, "wrapped", after(trainer.wrapped, "forward")),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def draw_ahead(loader, batches: int, drawn: dict) -> None:
    """Fill ``drawn`` with the loader's next draws, enough for ``batches`` batches, filed as ``instrumented`` looks
    them up, and make its next batch come from a fresh draw (the same samples: the draw is a function of the
    positions)."""
    start, end = loader.samples_seen, loader.samples_seen + (batches + 1) * loader.global_batch_size
    while start < end:
        steps, pos = loader._draw_positions(start)
        drawn[_drawn_key(pos)] = loader._draw(pos)
        start += steps * loader.global_batch_size
    loader._ahead = (0, [])


def summarise(timed, window: int) -> tuple[list[dict], list[dict]]:
    """(per mark: count, mean and min lead over the window's steps after its first; per phase: host and GPU ms
    per step)."""
    first_end = next(i for i, row in enumerate(timed) if row[0] == "start" and i > 0)  # the first step's marks
    leads: dict[str, list[float]] = {}
    for name, host, gpu in timed[first_end:]:
        leads.setdefault(name, []).append((gpu - host) * 1e3)
    marks = [
        {"mark": n, "count": len(v), "lead_ms": float(np.mean(v)), "min_lead_ms": min(v)} for n, v in leads.items()
    ]
    phases: dict[str, list[float]] = {}
    for (a, h0, g0), (b, h1, g1) in itertools.pairwise(timed):
        row = phases.setdefault(f"{a} -> {b}", [0.0, 0.0])
        row[0] += (h1 - h0) * 1e3 / window
        row[1] += (g1 - g0) * 1e3 / window
    return marks, [{"phase": p, "host_ms": h, "gpu_ms": g} for p, (h, g) in phases.items()]


def main() -> None:
    from benchmarks.harness import markdown_table, parse_trainer_args, write_step_report
    from xmoe.train.cli import build_run_config
    from xmoe.train.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup-steps", type=int, default=3, help="steps before the windows (compilation happens here)")
    p.add_argument("--window", type=int, default=8, help="optimizer steps per window")
    p.add_argument("--tag", default="step", help="results file name: host_lead_<tag>")
    p.add_argument("--results", help="directory for host_lead_<tag>.json / .md (default: print only)")
    args = parse_trainer_args(p, sys.argv[1:])
    if args.window < 2:
        p.error(f"--window ({args.window}) must be at least 2: the first step of a window starts on an idle GPU")
    cuda = torch.cuda.is_available()
    args.steps = args.warmup_steps + 3 * args.window + 1
    run = build_run_config(args)
    tokens = run.train.global_batch_size * run.train.seq_len
    marks = Marks(cuda)
    windows = []
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(run, out, device="cuda" if cuda else "cpu")
        accum = trainer.accumulation_steps()
        for _ in range(args.warmup_steps):
            trainer.train_step(accum)
        for label in ("loader as it is", "samples drawn before the window", "loader as it is, again"):
            drawn: dict | None = None
            if label.startswith("samples"):
                drawn = {}
                draw_ahead(trainer.loader, args.window * accum, drawn)
            with instrumented(trainer, marks, drawn), marks.recording():
                began = time.perf_counter()
                for _ in range(args.window):
                    marks("start")
                    trainer.train_step(accum)
                marks("start")
            wall_ms = (time.perf_counter() - began) * 1e3 / args.window
            mark_rows, phase_rows = summarise(marks.timed, args.window)
            waited = sum(r["min_lead_ms"] < WAITED_MS for r in mark_rows)
            windows.append(
                {
                    "window": label,
                    "wall_ms": wall_ms,
                    "tokens_per_s": tokens / wall_ms * 1e3,
                    "marks_gpu_waited": waited,
                    "marks": mark_rows,
                    "phases": phase_rows,
                }
            )
    lines = [
        f"{args.layers} layers, batch {run.train.global_batch_size}, micro {run.train.micro_batch_size}, compile "
        f"{run.train.compile}, seq {run.train.seq_len}, fp8 {run.model.moe.fp8}; {args.window} steps per window; "
        "leads over the steps after each window's first"
    ]
    for w in windows:
        lines += [
            "",
            f"## {w['window']}: {w['wall_ms']:.1f} ms per step, {w['tokens_per_s']:.0f} tokens/s; marks where the GPU"
            f" waited for the host (lead under {WAITED_MS} ms): {w['marks_gpu_waited']} of {len(w['marks'])}",
            "",
            markdown_table(w["marks"], ["mark", "count", "lead_ms", "min_lead_ms"]),
            "",
            markdown_table(w["phases"], ["phase", "host_ms", "gpu_ms"]),
        ]
    text = "\n".join(lines)
    print(text)
    if args.results:
        gpu = None if cuda else "none (CPU: every lead is zero)"
        stem, title = f"host_lead_{args.tag}", f"host lead {args.tag}"
        write_step_report(args.results, stem, title, text, {"windows": windows}, gpu)


if __name__ == "__main__":
    main()
