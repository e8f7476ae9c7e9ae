"""Training metrics: MFU, memory, expert load imbalance, and the run logger.

FLOPs are defined once, in ``xmoe.model.flops``; the step formulas are imported here so that the trainer finds
them beside ``mfu``. Per-GPU throughput: pass the global token and row counts of the step and divide by time * GPUs.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch

from xmoe.checks import writing
from xmoe.model.flops import FlopDims, paper_train_flops, train_flops
from xmoe.train import expert_load
from xmoe.train.checkpoint_dir import _write_text  # the one atomic file write (temp file, fsync, rename)

log = logging.getLogger(__name__)

__all__ = [
    "FlopDims",
    "MetricsLogger",
    "format_progress",
    "load_imbalance",
    "mfu",
    "paper_train_flops",
    "peak_flops",
    "peak_memory_bytes",
    "train_flops",
]


# Dense bf16 tensor-core peaks in TFLOP/s (no sparsity). First case-insensitive substring match of
# torch.cuda.get_device_name() wins, so the PCIe H100 entry must precede the generic (SXM) one.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("MI250X", 191.5),  # per GCD; ROCm shows each GCD as one device
    ("MI300X", 1307.0),
)


def peak_flops(device: torch.device | str | int | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of a CUDA/ROCm device from the table above; None on CPU or unknown GPUs."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS if key.lower() in name), None)


def mfu(flops_per_s_per_gpu: float, device: torch.device | str | int | None = None) -> float | None:
    """Model FLOPs utilisation = achieved / peak, or None when the peak is unknown."""
    peak = peak_flops(device)
    return None if peak is None else flops_per_s_per_gpu / peak


def peak_memory_bytes(device: torch.device | str | int = "cpu") -> int:
    """CUDA: torch.cuda.max_memory_allocated (tensors only, not the caching allocator's reserve).
    CPU: the peak resident set size of the whole process (ru_maxrss), which includes Python and libraries."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource  # POSIX only, hence the local import

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def load_imbalance(tokens_per_expert: torch.Tensor) -> float:
    """max / mean of tokens per expert (1.0 = perfectly balanced). For a [..., E] tensor, the worst row.
    All-zero counts (no tokens routed) return 1.0 rather than NaN, so logs stay valid JSON."""
    counts = tokens_per_expert.detach().float().reshape(-1, tokens_per_expert.shape[-1])
    mean = counts.mean(dim=-1)
    ratio = torch.where(mean > 0, counts.amax(dim=-1) / mean.clamp_min(1e-30), torch.ones_like(mean))
    return float(ratio.max())


# ---------------------------------------------------------------------------------------------- logger


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.0f}"


# Canonical keys, in display order. Other keys are logged and shown as "key value".
_FORMATS = {
    "loss": lambda v: f"loss {v:.3f}",
    "aux_loss": lambda v: f"aux {v:.3f}",
    "mtp_loss": lambda v: f"mtp {v:.3f}",
    "lr": lambda v: f"lr {v:.1e}",
    "grad_norm": lambda v: f"gnorm {v:.2f}",
    "tokens_per_s": lambda v: f"{_si(v)} tok/s",
    "tflops": lambda v: f"{v:.2f} TFLOP/s",
    "paper_tflops": lambda v: f"paper {v:.2f} TFLOP/s",
    "mfu": lambda v: f"MFU {100 * v:.1f}%",
    "mem_bytes": lambda v: f"mem {v / 2**30:.1f} GiB",
    "imbalance": lambda v: f"imbalance {v:.2f}",
    "dead_experts": lambda v: f"dead {v}",
    "hot_experts": lambda v: f"hot {v}",
}


def format_progress(step: int, total_steps: int, values: dict[str, Any]) -> str:
    """``step 40/300 | loss 3.214 | aux 0.010 | lr 2.9e-03 | 12.3k tok/s | ...`` (None values, lists, such as the
    per-layer expert counts, and tables, such as the kernels' launch counts, skipped)."""
    parts = [f"step {step}/{total_steps}"]
    parts += [fmt(values[k]) for k, fmt in _FORMATS.items() if values.get(k) is not None]
    for k, v in values.items():
        if k not in _FORMATS and k not in ("step", "elapsed_s") and v is not None and not isinstance(v, (list, dict)):
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " | ".join(parts)


# What the progress bar's postfix shows, most useful first; fields are dropped from the end to fit the terminal
# (tqdm itself shows step, elapsed time and the ETA).
_POSTFIX_KEYS = ("loss", "tokens_per_s", "mfu", "tflops", "grad_norm", "lr", "mem_bytes")


def fit_postfix(values: dict[str, Any], width: int) -> str:
    """The leading _POSTFIX_KEYS fields of ``values`` that fit in ``width`` characters (at least the loss);
    MFU stands in for TFLOP/s when known (on CPUs it is not)."""
    keys = [k for k in _POSTFIX_KEYS if values.get(k) is not None]
    if "mfu" in keys and "tflops" in keys:
        keys.remove("tflops")
    parts = [_FORMATS[k](values[k]) for k in keys]
    while len(parts) > 1 and len(", ".join(parts)) > width:
        parts.pop()
    return ", ".join(parts)


def _size_text(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _tree_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def describe_outputs(out_dir: str | os.PathLike) -> str:
    """Every output of a run with its size, e.g. for the last lines a user reads."""
    out = Path(out_dir)
    lines = [f"outputs in {out}/:"]
    for name in ("metrics.jsonl", "summary.json", "loss.png", expert_load.NAME, expert_load.PLOT, "tensorboard"):
        if (out / name).exists():
            lines.append(f"  {name:<40} {_size_text(_tree_bytes(out / name))}")
    ckpts = (
        sorted(p for p in (out / "checkpoints").glob("step_*") if p.is_dir() and (p / "COMPLETE").is_file())
        if (out / "checkpoints").is_dir()
        else []
    )
    for path in ckpts:
        lines.append(f"  {'checkpoints/' + path.name + '/':<40} {_size_text(_tree_bytes(path))}")
    return "\n".join(lines)


def summary_text(summary: dict[str, Any]) -> str:
    """The summary in units a person reads: nats/token, tokens/s, GiB, minutes."""
    parts = [f"steps {summary['steps']}"]
    if summary.get("final_loss") is not None:
        parts.append(
            f"final loss {summary['final_loss']:.4g} nats/token (best {summary['best_loss']:.4g})"
            if summary.get("best_loss") is not None
            else f"final loss {summary['final_loss']:.4g}"
        )
    if summary.get("final_val_loss") is not None:
        parts.append(f"validation loss {summary['final_val_loss']:.4g} (best {summary['best_val_loss']:.4g})")
    if summary.get("mean_tokens_per_s") is not None:
        parts.append(f"{_si(summary['mean_tokens_per_s'])} tokens/s")
    if summary.get("mean_tflops") is not None:
        parts.append(f"{summary['mean_tflops']:.3g} TFLOP/s per device")
    if summary.get("mean_mfu") is not None:
        parts.append(f"MFU {100 * summary['mean_mfu']:.1f}%")
    if summary.get("peak_mem_bytes") is not None:
        parts.append(f"peak memory {summary['peak_mem_bytes'] / 2**30:.2f} GiB")
    parts.append(f"{summary['wall_time_s'] / 60:.1f} minutes")
    return "summary: " + ", ".join(parts) + (f" ({summary['status']})" if summary.get("status") else "")


def _plain(value: Any) -> Any:
    """JSON-friendly scalars: 0-d tensors and numpy scalars become Python numbers."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item") and not isinstance(value, (int, float, str)):
        return value.item()
    return value


class MetricsLogger:
    """Rank 0 appends one JSON line per ``log`` to ``out_dir/metrics.jsonl`` and shows progress.

    Keys: ``step``, the values passed (canonical: loss, aux_loss, lr, grad_norm, tokens_per_s, tflops,
    paper_tflops, mfu, mem_bytes, imbalance, dead_experts, hot_experts, launches; TFLOP/s per GPU) and ``elapsed_s``
    (training wall time,
    cumulative across resumes). Each line is flushed, so a crash loses nothing already logged. Progress is
    a tqdm bar when stderr is a TTY, else one plain line per ``log`` on ``stream``, or through the "xmoe" logger
    when no stream is given (``xmoe.log``; the CLI prints it on stdout). Other ranks do
    nothing. Values may be floats, ints, None, 0-d tensors (each costs a host sync) or numpy scalars.

    Resume: pass ``resume_step``; the file is rewritten atomically keeping only records with
    step <= resume_step (later ones came from the interrupted run and will be logged again), and so is a
    torn last line. Without ``resume_step`` an existing file is replaced: a new run starts a new log. The same
    holds for the experts' loads, ``log_expert_load``'s ``out_dir/expert_load.npy`` (xmoe/train/expert_load.py).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        rank: int,
        total_steps: int,
        tensorboard: bool = False,
        *,
        resume_step: int | None = None,
        stream: TextIO | None = None,
        progress_bar: bool | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.active = rank == 0
        self.total_steps = total_steps
        self.path = self.out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self._stream = stream
        self._t0 = time.perf_counter()
        self._offset = 0.0
        self._first_new = 0  # index of this process's first record: its timing includes start-up
        self._bar = self._tb = self._file = None
        self._load: expert_load.ExpertLoadFile | None = None
        if not self.active:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self.records = [r for r in self._read() if r["step"] <= resume_step]
            if self.records:
                self._offset = float(self.records[-1].get("elapsed_s", 0.0))
        with writing(self.path):
            _write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._first_new = len(self.records)
        self._file = open(self.path, "a")
        self._load = expert_load.ExpertLoadFile(self.out_dir, resume_step)
        # the bar is created at the first log, after the trainer's header lines (created here, it would draw
        # itself first and the header would overwrite it)
        self._want_bar = progress_bar if progress_bar is not None else sys.stderr.isatty()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
            except ImportError as e:
                warnings.warn(
                    f"tensorboard=True but TensorBoard is unavailable ({e}); install it with "
                    "`pip install tensorboard`. Continuing with metrics.jsonl only.",
                    stacklevel=2,
                )

    def move_to(self, out_dir: Path) -> None:
        """Write into ``out_dir`` from now on, every record so far first (the run directory went while the run
        trained, and this one takes its place); TensorBoard events stop."""
        self.out_dir, self.path = out_dir, out_dir / "metrics.jsonl"
        if not self.active:
            return
        for handle in (self._tb, self._file):
            if handle is not None:
                handle.close()
        self._tb = None
        with writing(self.path):
            _write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._file = open(self.path, "a")
        if self._load is not None:
            self._load.move_to(out_dir)

    def _read(self) -> list[dict[str, Any]]:
        records = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by the crash we are resuming from
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
        return records

    def log(self, step: int, **values: Any) -> None:
        if not self.active:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
        record["elapsed_s"] = round(self._offset + time.perf_counter() - self._t0, 3)
        self.records.append(record)
        assert self._file is not None  # opened with the logger when active
        with writing(self.path):  # a full disk: one line naming the file and the space left
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        line = format_progress(step, self.total_steps, record)
        if self._want_bar and self._bar is None:
            from tqdm import tqdm

            # starting at this step: its rate and ETA come from the steps after it (counted from the run's start,
            # the first window's start-up time would read as thousands of steps per second)
            self._bar = tqdm(total=self.total_steps, initial=step, unit="step", dynamic_ncols=True)
        if self._bar is not None:
            self._bar.update(max(0, step - self._bar.n))
            # ~45 columns go to tqdm's own counter, bar and times; the postfix gets the rest
            width = shutil.get_terminal_size((100, 24)).columns - 45
            self._bar.set_postfix_str(fit_postfix(record, max(width, 12)), refresh=True)
        else:
            self._emit(line)
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def log_expert_load(self, step: int, load_LE: Any) -> None:
        """The window's routed real slots per expert of every MoE layer, (L, E) integers, to expert_load.npy."""
        if self._load is not None:
            self._load.append(step, load_LE)

    def finish(
        self,
        *,
        floor: float | None = None,
        baseline: float | None = None,
        references: dict[str, float] | None = None,
        status: str | None = None,
        title: str | None = None,
        step: int | None = None,
        info: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Print a summary, write ``summary.json``, ``loss.png`` (loss vs step over the whole run, with
        dashed lines for ``floor`` (entropy rate), ``baseline`` (unigram entropy) and any ``references``) and,
        where experts' loads were logged, the heat map ``expert_load.png``.
        Means of tokens/s, TFLOP/s and MFU skip this process's first record (it includes start-up time).
        ``step``: the last step trained (default: the last one logged; a run stopped between logging steps
        trained further). ``info``: what else describes the run (the trainer's kernel choices), kept as given."""
        if not self.active:
            return {}
        for handle in (self._bar, self._tb, self._file):
            if handle is not None:
                handle.close()
        if self._load is not None:
            self._load.close()
        losses = [(r["step"], r["loss"]) for r in self.records if isinstance(r.get("loss"), (int, float))]
        val = [(r["step"], r["val_loss"]) for r in self.records if isinstance(r.get("val_loss"), (int, float))]
        summary = self._summary(losses, val, step, status)
        given = {"floor (entropy rate)": floor, "baseline (unigram entropy)": baseline, **(references or {})}
        lines = {k: v for k, v in given.items() if v is not None}
        summary.update(info or {})
        with writing(self.out_dir / "summary.json"):
            _write_text(self.out_dir / "summary.json", json.dumps({**summary, "references": lines}, indent=1) + "\n")
        with writing(self.out_dir / "loss.png"):
            self._plot(losses, lines, title or str(self.out_dir), val)
        with writing(self.out_dir / expert_load.PLOT):
            expert_load.plot_expert_load(self.out_dir, title or str(self.out_dir))
        self._emit(summary_text(summary))
        return summary

    def _summary(
        self, losses: list[tuple[int, float]], val: list[tuple[int, float]], step: int | None, status: str | None
    ) -> dict[str, Any]:
        """summary.json's numbers: steps, final and best losses (held-out ones too), means of the timed records,
        peak memory, wall time, and why the run ended early."""
        timed = self.records[self._first_new + 1 :] or self.records[self._first_new :]

        def mean(key: str) -> float | None:
            vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
            return sum(vals) / len(vals) if vals else None

        mems = [r["mem_bytes"] for r in self.records if isinstance(r.get("mem_bytes"), (int, float))]
        finite = [v for _, v in losses if math.isfinite(v)]
        summary = {
            "steps": step if step is not None else self.records[-1]["step"] if self.records else 0,
            "final_loss": losses[-1][1] if losses else None,
            "best_loss": min(finite) if finite else None,
            "mean_tokens_per_s": mean("tokens_per_s"),
            "mean_tflops": mean("tflops"),
            "mean_mfu": mean("mfu"),
            "peak_mem_bytes": max(mems) if mems else None,
            "wall_time_s": round(self._offset + time.perf_counter() - self._t0, 3),
        }
        if status is not None:  # why the run ended before its last step
            summary["status"] = status
        if val:  # held-out loss, when the run evaluates one (--val-data / val_fraction)
            summary.update(final_val_loss=val[-1][1], best_val_loss=min(v for _, v in val))
        return summary

    def _emit(self, line: str) -> None:
        """A console line: to ``stream`` when one was given, else to the "xmoe" log (the CLI prints it)."""
        if self._stream is not None:
            print(line, file=self._stream, flush=True)
        else:
            log.info(line)

    def _plot(
        self,
        losses: list[tuple[int, float]],
        lines: dict[str, float],
        title: str,
        val: list[tuple[int, float]] | None = None,
    ) -> None:
        # The object API with an explicit Agg canvas: no pyplot, so no global backend switch and no display.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if losses:
            ax.plot([s for s, _ in losses], [v for _, v in losses], label="train loss", linewidth=1.2)
        if val:
            ax.plot(
                [s for s, _ in val],
                [v for _, v in val],
                marker="o",
                markersize=3,
                color="C9",
                label="validation loss",
                linewidth=1.2,
            )
        for i, (label, value) in enumerate(lines.items()):
            ax.axhline(value, linestyle="--", color=f"C{i + 1}", linewidth=1, label=f"{label}: {value:.3f}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        image = io.BytesIO()  # drawn in memory, then written as the other outputs are (temp file and rename)
        fig.savefig(image, format="png", dpi=110)
        _write_text(self.out_dir / "loss.png", image.getvalue())
