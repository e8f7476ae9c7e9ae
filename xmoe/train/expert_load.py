"""Expert load you can see: per MoE layer and expert, the real tokens' routed slots of each logged window, its dead and
hot experts, and the heat map of load over training.

# W logged windows, L MoE layers, E experts, R rows of the heat map

The load of a window is what the optimizer steps since the last log line routed: real tokens only (padding and
positions without a target excluded, as the balance losses do), every slot before capacity dropping, summed over the
window's steps, micro-batches and ranks (``report.py`` reads it with the logging step's one all-reduce).

  dead expert   no slot in the window (in a layer that routed any)
  hot expert    more than HOT_FACTOR (2) times its layer's mean load E^-1 * sum_e load_e in the window

``OUT/expert_load.npy`` holds one record per window, ``numpy.load`` reads it: ``records["step"]`` (W,) int64, the
window's last step, and ``records["load"]`` (W, L, E) uint32 (a count above 2^32 - 1 in one window is stored as that).
Inline in metrics.jsonl it would be too big: 61 layers x 256 experts is ~16k counts, ~120 KB of JSON per line, and
every resume reads that file whole; here it is 4 bytes a count (62 KB a window at that size, 8 + 4 L E bytes a
record), appended in place: the record is written, then the header's count, so a run killed between the two leaves
a file whose header still describes whole records (flushed at each log, not synced, as metrics.jsonl). A resume keeps
the records up to its step, as metrics.jsonl.
"""

from __future__ import annotations

import ast
import io
import logging
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from xmoe.checks import writing
from xmoe.train.checkpoint_dir import _write_text  # the one atomic file write (temp file, fsync, rename)

log = logging.getLogger(__name__)

HOT_FACTOR = 2.0
NAME, PLOT = "expert_load.npy", "expert_load.png"
_MAGIC = b"\x93NUMPY\x01\x00"  # .npy format version 1.0
_ROWS_WIDTH = 20  # digits kept for the record count, so the header never changes length
_MAX_ROWS = 1024  # heat map rows at most: larger layer x expert grids show each group of experts by its extreme


def dead_and_hot(load_LE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dead experts per layer, hot experts per layer) of one window's load (int arrays of L)."""
    load = np.asarray(load_LE, dtype=np.float64)
    mean_L = load.mean(-1, keepdims=True)
    routed = mean_L > 0
    dead = ((load == 0) & routed).sum(-1)
    hot = (load > HOT_FACTOR * mean_L).sum(-1)
    return dead.astype(np.int64), hot.astype(np.int64)


def record_dtype(num_layers: int, num_experts: int) -> np.dtype:
    return np.dtype([("step", "<i8"), ("load", "<u4", (num_layers, num_experts))])


def _header(dtype: np.dtype, rows: int) -> bytes:
    descr = np.lib.format.dtype_to_descr(dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ({str(rows).rjust(_ROWS_WIDTH)},), }}"
    text += " " * (-(len(_MAGIC) + 2 + len(text) + 1) % 64) + "\n"  # numpy aligns the data to 64 bytes
    return _MAGIC + struct.pack("<H", len(text)) + text.encode("latin1")


def read_records(path: Path) -> np.ndarray:
    """The file's whole records (as ``numpy.load`` reads them); bytes after them are a write that never finished."""
    with open(path, "rb") as f:
        return _records(f, path)


def _records(f: BinaryIO, path: Path) -> np.ndarray:
    f.seek(0)
    if f.read(len(_MAGIC)) != _MAGIC:
        raise ValueError(f"{path} is not an expert-load file (.npy, format 1.0)")
    (length,) = struct.unpack("<H", f.read(2))
    meta = ast.literal_eval(f.read(length).decode("latin1"))
    dtype = np.lib.format.descr_to_dtype(meta["descr"])
    count = meta["shape"][0]
    return np.frombuffer(f.read(count * dtype.itemsize), dtype=dtype, count=count).copy()


class ExpertLoadFile:
    """``OUT/expert_load.npy``, written by rank 0 as the run logs (module docstring). ``resume_step``: keep the
    records of steps up to it (a resume: the file is cut back now, as metrics.jsonl); None: the first record starts
    a new file (a new run). Held open between records, as metrics.jsonl is: a run directory that goes while the run
    trains takes the writes with it until the run notices (``move_to``)."""

    def __init__(self, out_dir: Path, resume_step: int | None = None):
        self.path = Path(out_dir) / NAME
        self._dtype: np.dtype | None = None
        self._rows = 0
        self._file: BinaryIO | None = None
        if resume_step is None or not self.path.is_file():
            return
        try:
            old = read_records(self.path)
        except (OSError, ValueError, SyntaxError) as e:
            log.warning(f"{self.path} is unreadable ({e}); it starts again at the next logged step")
            return
        self._start(old[old["step"] <= resume_step])

    def append(self, step: int, load_LE: np.ndarray) -> None:
        load = np.asarray(load_LE)
        dtype = record_dtype(*load.shape)
        if self._dtype != dtype:
            if self._rows:
                log.warning(f"{self.path} holds another model's layers or experts; it starts again")
            self._start(np.zeros(0, dtype=dtype))
        elif self._file is None:  # closed by the logger's finish, and logging again
            self._file = open(self.path, "r+b")
        record = np.zeros((), dtype=dtype)
        record["step"] = step
        record["load"] = np.minimum(load, np.iinfo(np.uint32).max)
        header = _header(dtype, self._rows + 1)
        f = self._file
        assert f is not None  # opened just above
        with writing(self.path):  # a full disk: one line naming the file
            f.seek(len(header) + self._rows * dtype.itemsize)
            f.write(record.tobytes())
            f.truncate()
            f.flush()  # the record reaches the file before the header counts it (not synced: as metrics.jsonl)
            f.seek(0)
            f.write(header)
            f.flush()
        self._rows += 1

    def move_to(self, out_dir: Path) -> None:
        """Write into ``out_dir`` from now on, every record so far first (the run directory went while the run
        trained: the logger's move_to; the records are read through the file still held open)."""
        records = _records(self._file, self.path) if self._file is not None else None
        self.close()
        self.path = Path(out_dir) / NAME
        self._dtype, self._rows = None, 0
        if records is not None:
            self._start(records)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _start(self, records: np.ndarray) -> None:
        """Replace the file with ``records`` atomically (a temporary file renamed over it) and open it."""
        self.close()
        with writing(self.path):  # a full disk: one line naming the file
            _write_text(self.path, _header(records.dtype, len(records)) + records.tobytes())
        self._file = open(self.path, "r+b")
        self._dtype, self._rows = records.dtype, len(records)


def heat_rows(load_WLE: np.ndarray, max_rows: int = _MAX_ROWS) -> tuple[np.ndarray, int]:
    """(the heat map's values, (R, W), and the rows per layer): each expert's load against its layer's mean in the
    window as log2, clipped to [-3, 3] (1/8x to 8x); -inf for a dead expert, NaN where the layer routed nothing.
    Above ``max_rows`` rows, each row stands for a group of a layer's experts and shows the one furthest from the
    mean (a dead expert first), so that a dead or hot expert never averages away."""
    load = np.asarray(load_WLE, dtype=np.float64)
    num_windows, num_layers, num_experts = load.shape
    mean = load.mean(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.clip(np.log2(load / mean), -3.0, 3.0)
    value[load == 0] = -np.inf
    value[np.broadcast_to(mean == 0, value.shape)] = np.nan
    group = max(1, -(-num_layers * num_experts // max_rows))
    per_layer = -(-num_experts // group)
    padded = np.full((num_windows, num_layers, per_layer * group), np.nan)
    padded[..., :num_experts] = value
    grouped = padded.reshape(num_windows, num_layers, per_layer, group)
    extreme = np.where(np.isnan(grouped), -1.0, np.abs(grouped))  # -inf (dead) has the largest magnitude
    pick = np.take_along_axis(grouped, extreme.argmax(-1)[..., None], -1)[..., 0]
    return pick.reshape(num_windows, -1).T, per_layer


def plot_expert_load(out_dir: Path, title: str) -> Path | None:
    """``OUT/expert_load.png`` from ``OUT/expert_load.npy``: the heat map of every MoE layer's experts (rows, layers
    stacked) over the logged windows (columns), blue below and red above the layer's mean load, black where an
    expert is dead, with the dead and hot experts of all layers over training beneath. None without a load file."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    source = Path(out_dir) / NAME
    if not source.is_file():
        return None
    records = read_records(source)
    if len(records) == 0:
        return None
    steps, load = records["step"], records["load"]
    rows, per_layer = heat_rows(load)
    num_layers = load.shape[1]
    half = (steps[1] - steps[0]) / 2 if len(steps) > 1 else max(steps[0], 1) / 2
    fig = Figure(figsize=(9, 7.5))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[4, 1], width_ratios=[40, 1], hspace=0.08, wspace=0.03)
    top = fig.add_subplot(grid[0, 0])
    bottom = fig.add_subplot(grid[1, 0], sharex=top)
    cmap = colormaps["RdBu_r"].with_extremes(under="black", bad="0.85")
    image = top.imshow(
        np.where(np.isneginf(rows), -9.0, rows),
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        vmin=-3,
        vmax=3,
        extent=(steps[0] - half, steps[-1] + half, rows.shape[0], 0),
    )
    for layer in range(1, num_layers):
        top.axhline(layer * per_layer, color="0.3", linewidth=0.4)
    every = max(1, num_layers // 16)
    shown = range(0, num_layers, every)
    top.set_yticks([(i + 0.5) * per_layer for i in shown], [str(i) for i in shown])
    top.set_ylabel(f"MoE layer (rows: its {load.shape[2]} experts)")
    top.set_title(f"{title}\nexpert load against the layer's mean (black: dead, no token in the window)", fontsize=9)
    bar = fig.colorbar(image, cax=fig.add_subplot(grid[0, 1]), extend="both")
    bar.set_ticks(range(-3, 4), labels=["1/8x", "1/4x", "1/2x", "1x", "2x", "4x", "8x"])
    _plot_dead_and_hot(bottom, steps, load)
    top.tick_params(labelbottom=False)
    out, png = Path(out_dir) / PLOT, io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    _write_text(out, png.getvalue())  # atomic, as loss.png
    return out


def _plot_dead_and_hot(axes, steps: np.ndarray, load: np.ndarray) -> None:
    """The dead and hot experts of all layers in each window, beneath the heat map."""
    dead, hot = zip(*(dead_and_hot(window) for window in load), strict=True)
    axes.plot(steps, [d.sum() for d in dead], color="black", label="dead experts")
    axes.plot(steps, [h.sum() for h in hot], color="C3", label=f"hot (> {HOT_FACTOR:g}x mean)")
    axes.set_xlabel("step")
    axes.set_ylabel("experts")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
