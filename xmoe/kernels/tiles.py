"""Tile configurations of the grouped-GEMM kernels: per-kernel candidates, a pick per shape class and GPU, and
optional autotuning (``kernels.autotune``) whose winners persist on disk.

# H hidden, F expert ffn, E experts, N rows (expert-major)

A launch is described by its shape class: the kernel, the GEMM's reduction length and output width (powers of
two at or above them) and the rows per expert (N // E, also a power of two). How these pick a config:
  1. Triton's interpreter (TRITON_INTERPRET=1): one tiny config (the interpreter costs ~0.5 ms per program);
     tests may force others.
  2. fp32 on a GPU (exact "ieee" dots, a correctness path): small tiles that do not spill.
  3. autotuning (``kernels.autotune``) on a GPU: the cached winner of this class, or, on a miss, every candidate
     timed on the launch's own arguments (kernels that write only their outputs, so re-running is harmless), the
     fastest kept in memory and in ``$XMOE_CACHE_DIR`` (default ~/.cache/xmoe), one JSON file per GPU name and
     Triton version. Candidates that fail to compile or launch are skipped.
  4. The tuned table shipped for this GPU model, if any (xmoe/kernels/tuned/<GPU name>.json: the winners of an
     autotuning run of benchmarks/bench_experts.py over the three model shapes, and of benchmarks/bench_train.py's
     autotune cases for the classes compiled training launches: its "source" says which), for the classes it has,
     and for a class it lacks, the entry of a class next to it (``neighbour``: rows per expert or output width one
     power of two away).
  5. Otherwise the heuristic: the H200 sweep winners (benchmarks/results/layer/sweep_tiles.md) with 64-row tiles where
     experts average fewer than 64 rows, and pipeline stages cut until they fit the GPU's shared memory (an
     A100 has 164 KB per block against the H200's 227 KB; AMD GPUs 64 KB).
Whether to autotune is the caller's: ``pick`` takes it as an argument, which the launchers take from the ops that
call them (a run's ``kernels.autotune``, carried by the ``Kernels`` value its layers were built with: choice.py).
``source`` says in words where the picks of a run will come from; every pick counts where it came from
(launches.py), so that what ran can be told from what was predicted. ``force`` is this module's one switch: a hook
for tests and sweeps that run chosen tiles, which no run sets.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from xmoe.kernels import launches
from xmoe.kernels._common import interpreting, next_pow2


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group: int = 1  # weight-gradient kernels: experts whose rows one program walks in one flat loop


# Kernels (their use in the fused path):
#   up_fwd    h1, h3 = x[tok] w1, x[tok] w3 (two accumulators)        reduction H, width F
#   mm        y = a w2                                                 reduction F, width H (one column chunk)
#   dx        dx = dh1 w1^T + dh3 w3^T (two (a, b) pairs)              reduction F, width H (one column chunk)
#   down_bwd  da = g[tok] w2^T                                         reduction H, width F
#   wgrad     dW2 = (w a)^T g[tok]                                     reduction: the expert's rows
#   wgrad2    dW1, dW3 = x[tok]^T (dh1, dh3) (two accumulators)        reduction: the expert's rows
# and their FP8 forms (fp8_gemm.py; moe.fp8 = "experts"):
#   fp8_up        h1, h3 = x[tok] w1, x[tok] w3, a quantised              reduction H, width F (BLOCK_N = 128)
#   fp8_mm        y = a w2                                                 reduction F, width H (one column chunk)
#   fp8_dx        dx = (dh1 | dh3)(w1 | w3)^T, one pair                    reduction 2F, width H (one column chunk)
#   fp8_down_bwd  da = g[tok] w2^T                                         reduction H, width F
#   fp8_wgrad     dW = A^T B from 128 x 1 groups (fp8_wgrad.py)            reduction: the expert's rows
KERNELS = (
    "up_fwd",
    "mm",
    "dx",
    "down_bwd",
    "wgrad",
    "wgrad2",
    "fp8_up",
    "fp8_mm",
    "fp8_dx",
    "fp8_down_bwd",
    "fp8_wgrad",
)
FP8_KERNELS = KERNELS[6:]

# The hand-picked H200 table (one config per kernel whatever the shape): the heuristic's base for the 16-bit
# kernels. Winners of bench_experts.py --sweep at T=16384, small and medium shapes.
BASE: dict[str, TileConfig] = {
    "up_fwd": TileConfig(128, 128, 32, 8, 6),
    "mm": TileConfig(128, 256, 64, 8, 4),
    "dx": TileConfig(128, 256, 64, 8, 4),
    "down_bwd": TileConfig(128, 256, 64, 8, 4),
    "wgrad": TileConfig(128, 128, 32, 4, 6),  # 4 warps, 96 KB of stages: two programs per multiprocessor
    "wgrad2": TileConfig(128, 128, 32, 8, 4),
}

# The FP8 kernels' base configs (they have no earlier table). BLOCK_K divides the 128-wide scale groups. Each
# output tile holds its fp32 accumulator and the fresh one of the step's product (fp8_gemm_kernels.py): 128 x 128
# tiles need 8 warps or more, 16 for the up kernel's two of each. Compiled for sm_90 (Triton 3.9, ahead of time)
# none of these spills; 256-column tiles at 16 warps did (at most 128 registers per thread there: 160-192 bytes of
# stack). H200, up kernel, T = 16384 (benchmarks/results/fp8/sweep_tiles_fp8_2026-12-01.md): 128 x 128 at 16 warps
# 4.52 ms (medium) and 12.7 ms (large) against 5.84 and 16.0 for 64 x 128 at 8 warps. Tiles wider than 128
# columns run as two 128-column halves with one fresh accumulator of 128 columns (fp8_gemm_kernels._fp8_dot
# (HALVES)): 128 x 256 at 8 warps fits without spilling for fp8_mm, fp8_down_bwd and fp8_dx as one pair of depth 2F
# (254 registers); fp8_dx's two pairs (the ragged-F form) spill there (120 bytes).
FP8_BASE: dict[str, TileConfig] = {
    "fp8_up": TileConfig(128, 128, 128, 16, 3),
    "fp8_mm": TileConfig(128, 128, 128, 8, 4),
    "fp8_dx": TileConfig(128, 128, 128, 8, 4),
    "fp8_down_bwd": TileConfig(128, 128, 128, 8, 4),
    # H200: the fastest at the three shapes (benchmarks/results/fp8/sweep_tiles_fp8_wgrad.md)
    "fp8_wgrad": TileConfig(64, 128, 128, 4, 4),
}
_FP8_MM_CANDIDATES = [
    TileConfig(128, 128, 128, 8, 4),
    TileConfig(128, 256, 128, 8, 3),  # 256 columns: two 128-column halves (fp8_gemm_kernels._fp8_dot (HALVES))
    TileConfig(128, 256, 128, 8, 4),
    TileConfig(128, 128, 128, 16, 3),
    TileConfig(128, 128, 128, 16, 4),
    TileConfig(64, 256, 128, 8, 3),
    TileConfig(64, 128, 128, 4, 4),
]

# What autotuning tries, per kernel (the BASE or FP8_BASE entry first). wgrad groups: several experts per program for
# experts with few rows (E = 256, ~512 rows each on the large shape), where every output tile otherwise refills
# its pipeline after 16 row blocks.
CANDIDATES: dict[str, list[TileConfig]] = {
    "up_fwd": [BASE["up_fwd"], TileConfig(128, 128, 64, 8, 4), TileConfig(64, 128, 64, 4, 4)],
    "mm": [BASE["mm"], TileConfig(128, 256, 32, 8, 6), TileConfig(128, 128, 64, 8, 4)],
    "dx": [BASE["dx"], TileConfig(128, 256, 32, 8, 6), TileConfig(128, 128, 64, 8, 4)],
    "down_bwd": [BASE["down_bwd"], TileConfig(128, 256, 32, 8, 6), TileConfig(128, 128, 64, 8, 4)],
    "wgrad": [
        BASE["wgrad"],
        TileConfig(128, 256, 64, 8, 3),
        TileConfig(256, 128, 64, 8, 3),
        TileConfig(128, 128, 32, 4, 6, 2),
        TileConfig(128, 128, 32, 4, 6, 4),
        TileConfig(128, 256, 64, 8, 3, 2),
    ],
    "wgrad2": [
        BASE["wgrad2"],
        TileConfig(128, 128, 64, 8, 3),
        TileConfig(128, 128, 32, 8, 4, 2),
        TileConfig(128, 128, 32, 8, 4, 4),
        TileConfig(128, 128, 64, 8, 3, 2),
    ],
    "fp8_up": [FP8_BASE["fp8_up"], TileConfig(128, 128, 128, 16, 4), TileConfig(64, 128, 128, 8, 4)],
    "fp8_mm": _FP8_MM_CANDIDATES,
    "fp8_dx": _FP8_MM_CANDIDATES,
    "fp8_down_bwd": _FP8_MM_CANDIDATES,
    "fp8_wgrad": [FP8_BASE["fp8_wgrad"], TileConfig(128, 128, 128, 8, 4), TileConfig(64, 256, 128, 8, 3)],
}

INTERPRETER_CONFIG = TileConfig(32, 32, 32, 4, 1)  # few programs: the interpreter costs ~0.5 ms per program
# exact fp32 dots use no tensor cores: small tiles keep them from spilling; 2 stages, since 3 spilled the two-pair dx
# (16 bytes, Triton 3.6, ahead of time for sm_90)
FP32_CONFIG = TileConfig(64, 64, 32, 4, 2)


_FORCED: dict[str, TileConfig] = {}
_PICKED: dict[tuple, tuple[TileConfig, str]] = {}  # (shape class, device index, autotune) -> (config, its source)


@contextlib.contextmanager
def force(configs: dict[str, TileConfig]) -> Iterator[None]:
    """Run the named kernels with the given configs whatever else applies (tests and sweeps)."""
    for name in configs:
        if name not in KERNELS:
            raise ValueError(f"unknown kernel {name!r}; the kernels are {KERNELS}")
    saved = dict(_FORCED)
    _FORCED.update(configs)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


def shape_class(kernel: str, depth: int, width: int, num_rows: int, num_experts: int) -> str:
    """The cache key of a launch: kernel, reduction length, output width, rows per expert (powers of two)."""
    rows = next_pow2(max(num_rows // max(num_experts, 1), 1))
    return f"{kernel}|k{next_pow2(depth)}|n{next_pow2(width)}|r{rows}"


def smem_bytes(kernel: str, cfg: TileConfig, elem_bytes: int | None = None) -> int:
    """Shared memory of a config's pipeline: num_stages copies of the operand tiles one step loads (16-bit
    operands, 8-bit for the FP8 kernels, unless elem_bytes says otherwise)."""
    if elem_bytes is None:
        elem_bytes = 1 if kernel in FP8_KERNELS else 2
    a = cfg.block_m * cfg.block_k
    b = cfg.block_k * cfg.block_n
    two_b = kernel in ("up_fwd", "wgrad2", "fp8_up")
    per_step = a + 2 * b if two_b else a + b  # dx runs its two pairs one after the other
    return per_step * elem_bytes * cfg.num_stages


@functools.cache
def _max_shared(device_index: int) -> int:
    try:
        import triton

        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 (an unknown backend: assume an H100/H200-class budget and let launches report the rest)
        return 227 * 1024


def fit_to_gpu(kernel: str, cfg: TileConfig, max_shared: int) -> TileConfig | None:
    """cfg with its stages cut until they fit max_shared (at least 2 stages), or None when even 2 do not fit."""
    while smem_bytes(kernel, cfg) > max_shared and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg if smem_bytes(kernel, cfg) <= max_shared else None


def base_config(kernel: str) -> TileConfig:
    """The heuristic's starting point: the BASE entry, or FP8_BASE's for the FP8 kernels."""
    return BASE[kernel] if kernel in BASE else FP8_BASE[kernel]


def heuristic(kernel: str, num_rows: int, num_experts: int, max_shared: int, width: int | None = None) -> TileConfig:
    cfg = base_config(kernel)
    rows_tiled = kernel not in ("wgrad", "wgrad2", "fp8_wgrad")
    if rows_tiled and num_rows < 64 * max(num_experts, 1):
        cfg = replace(cfg, block_m=64)  # 128-row tiles would run more than half empty
    if width is not None and rows_tiled:
        if kernel != "fp8_up":  # no tile wider than the output (the tiny preset: H = 128 under a 256-column tile)
            cfg = replace(cfg, block_n=min(cfg.block_n, max(64, next_pow2(width))))
        elif width < cfg.block_n:  # F under one scale group of 128 columns: 128 x 128 at 16 warps spilled there
            cfg = replace(cfg, block_m=64)
    if kernel in FP8_KERNELS and max_shared <= 64 * 1024:
        # AMD (64 KB of LDS): compiled for gfx942 (Triton 3.9, ahead of time), 128 x 128 x 128 FP8 tiles at 8 warps
        # spill (144-700 bytes of scratch), and so does the dx kernel at 64 x 128 x 128, 4 warps (264); 64 x 128 x 64
        # at 4 warps spills in none of the four
        cfg = replace(cfg, block_m=64, block_k=64, num_warps=4)
    fitted = fit_to_gpu(kernel, cfg, max_shared)
    if fitted is None:  # a small shared memory (e.g. 64 KB): narrow the tile, then fit the stages again
        # (fp8_up keeps its 128 columns: one scale group of its output per row)
        narrow = replace(cfg, block_k=32) if kernel == "fp8_up" else replace(cfg, block_n=64, block_k=32)
        fitted = fit_to_gpu(kernel, narrow, max_shared) or replace(narrow, num_stages=2)
    return fitted


def neighbour(table: dict[str, TileConfig], key: str) -> TileConfig | None:
    """For a class ``key`` the table lacks, the config of a class next to it: the same kernel and reduction length,
    and the rows per expert or the output width one power of two away (not both; rows first, then width, the
    smaller side first). None where the table has no such class, where ``key`` has at most 64 rows per expert (the
    heuristic's 64-row tiles begin there) and where the neighbour's tile is wider than ``key``'s output. (Of the
    12 classes a compiled training step launched that the H200 table lacked, this named the autotuned winner for 10,
    the heuristic for 6: benchmarks/results/train/bench_train_autotune.md.)"""
    kernel, depth, width, rows = key.split("|")
    n, r = int(width[1:]), int(rows[1:])
    if r <= 64:
        return None
    for n2, r2 in ((n, r // 2), (n, r * 2), (n // 2, r), (n * 2, r)):
        cfg = table.get(f"{kernel}|{depth}|n{n2}|r{r2}")
        if cfg is not None and cfg.block_n <= n:
            return cfg
    return None


def device_budget(device: torch.device) -> tuple[int, dict[str, TileConfig]]:
    """(shared memory per block, shipped table) of the device: all that steps 4 and 5 of a pick know of it (the
    ahead-of-time compile checks in aot.py stand other GPUs in here)."""
    if device.type != "cuda":
        return 227 * 1024, {}
    return _max_shared(device.index or 0), shipped_table(_gpu_name(device))


def pick(
    kernel: str,
    dtype: torch.dtype,
    device: torch.device,
    depth: int,
    width: int,
    num_rows: int,
    num_experts: int,
    run: Callable[[TileConfig], object] | None = None,
    autotune: bool = False,
) -> TileConfig:
    """The config for one launch (see the module docstring for the order), counted by where it came from
    (launches.py: the launchers call this once per launch, just before launching). ``autotune``: the caller's
    kernels.autotune; ``run(cfg)`` launches the kernel with cfg, which autotuning calls, so pass it only when the
    launch writes nothing but its own outputs."""
    cfg, where = _pick(kernel, dtype, device, depth, width, num_rows, num_experts, run, autotune)
    launches.count("tiles", where)
    return cfg


def _pick(kernel, dtype, device, depth, width, num_rows, num_experts, run, autotune) -> tuple[TileConfig, str]:
    if kernel in _FORCED:
        return _FORCED[kernel], "forced"
    if interpreting():
        return INTERPRETER_CONFIG, "interpreter"
    if dtype == torch.float32:
        return FP32_CONFIG, "fp32"
    key = shape_class(kernel, depth, width, num_rows, num_experts)
    memo = (key, device.index, autotune)
    picked = _PICKED.get(memo)
    if picked is not None:
        return picked
    max_shared, table = device_budget(device)
    cfg, where = table.get(key), "table"
    if cfg is None:
        cfg, where = neighbour(table, key), "neighbour"
    if cfg is None:
        cfg, where = heuristic(kernel, num_rows, num_experts, max_shared, width), "heuristic"
    if autotune and device.type == "cuda" and run is not None:
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return cfg, where  # no timing inside a trace or a CUDA-graph capture; the next eager call tunes
        cache = _DiskCache.for_device(device)
        cfg, where = cache.get(key) or cache.put(key, _tune(kernel, run, max_shared) or cfg), "autotune"
    _PICKED[memo] = (cfg, where)
    return cfg, where


def source(dtype: torch.dtype, device: torch.device, autotune: bool = False) -> str:
    """Where ``pick`` takes the configs of launches in ``dtype`` on ``device`` from, in the run header's words (the
    order of ``pick``): "interpreter", "fp32", "autotune" (with ``autotune``, kernels.autotune), "table <GPU name>"
    (the shipped table; a class next to one of its classes, or else the heuristic, for classes it lacks) or
    "heuristic"."""
    if interpreting():
        return "interpreter"
    if dtype == torch.float32:
        return "fp32"
    if autotune and device.type == "cuda":
        return "autotune"
    name = _gpu_name(device) if device.type == "cuda" else ""
    return f"table {name}" if name and shipped_table(name) else "heuristic"


def _bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))


def candidates(kernel: str, max_shared: int) -> list[TileConfig]:
    """The kernel's autotuning candidates whose pipeline fits max_shared bytes."""
    return [cand for cand in CANDIDATES[kernel] if smem_bytes(kernel, cand) <= max_shared]


def _tune(
    kernel: str,
    run: Callable[[TileConfig], object],
    max_shared: int,
    timer: Callable[[Callable[[], object]], float] = _bench_ms,
) -> TileConfig | None:
    """The fastest of the kernel's candidates that fit max_shared, timed by ``timer`` (median ms of a call)."""
    best = None
    for cand in candidates(kernel, max_shared):
        try:
            ms = timer(functools.partial(run, cand))
        except Exception:  # noqa: BLE001  # out of resources, or a compiler that cannot pipeline this form: not a candidate here
            continue
        if best is None or ms < best[0]:
            best = (ms, cand)
    return best[1] if best else None


SHIPPED_DIR = Path(__file__).parent / "tuned"


def _gpu_name(device: torch.device) -> str:
    """The GPU's name as file names here spell it (NVIDIA_H200)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


@functools.cache
def shipped_table(gpu_name: str, folder: Path = SHIPPED_DIR) -> dict[str, TileConfig]:
    """{shape class: config} tuned for this GPU model and shipped with xmoe (empty for other GPUs)."""
    try:
        entries = json.loads((folder / f"{gpu_name}.json").read_text())["tiles"]
    except (OSError, ValueError, KeyError):
        return {}
    return {key: TileConfig(*cfg) for key, cfg in entries.items()}


class _DiskCache:
    """Tuned configs of one GPU model and Triton version: {shape class: [block_m, ..., group]} in one JSON file."""

    _open: ClassVar[dict[str, _DiskCache]] = {}

    def __init__(self, path: Path):
        self.path = path
        self.entries = self._read()

    @classmethod
    def for_device(cls, device: torch.device) -> _DiskCache:
        import triton

        folder = Path(os.environ.get("XMOE_CACHE_DIR") or Path.home() / ".cache" / "xmoe")
        path = folder / f"tiles-{_gpu_name(device)}-triton{triton.__version__}.json"
        if str(path) not in cls._open:
            cls._open[str(path)] = cls(path)
        return cls._open[str(path)]

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> TileConfig | None:
        entry = self.entries.get(key)
        return TileConfig(*entry) if entry else None

    def put(self, key: str, cfg: TileConfig) -> TileConfig:
        self.entries = {**self._read(), **self.entries, key: list(vars(cfg).values())}  # keep other writers' keys
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(self.entries, f, indent=1, sort_keys=True)
            os.replace(f.name, self.path)  # atomic: a reader sees the old file or the new one
        except OSError:
            pass  # a read-only home still tunes, in memory only
        return cfg


def clear_memo() -> None:
    """Forget in-process picks: their key holds the device's index, not what ``device_budget`` answers for it, so
    whoever changes that answer (aot's stand-in GPUs, each on the meta device) must forget them."""
    _PICKED.clear()
    _DiskCache._open.clear()
