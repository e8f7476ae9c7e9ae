"""The pre-flight of `xmoe train` (and of `xmoe eval` / `generate`): before anything is allocated, the planner's
predicted peak per rank (xmoe/plan/fit.py) against the memory this device has free, so that a run that cannot fit
stops in one line naming the changes that would fit, instead of failing minutes later in the allocator.

``--fit check`` (the default): refuse a run predicted above the free memory, warn within fit.WARN_MARGIN of it;
``--fit auto``: apply the cheapest change this process can make (a smaller micro-batch, recompute), which the run
header names; ``--fit off``: no check. Free memory: torch.cuda.mem_get_info on a GPU; on a CPU the host's
MemAvailable (/proc/meminfo), less where a cgroup limit leaves less, shared by the ranks on this host.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from xmoe.config import FIT_MODES, RunConfig
from xmoe.plan import fit

log = logging.getLogger(__name__)


def _meminfo(field: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _read_number(path: Path) -> float | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return float(text) if text.isdigit() else None


def _cgroup_room() -> float | None:
    """What this process's memory cgroup (v2, else v1) still lets it use: its limit less its usage, the
    reclaimable page cache counted as free; None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_number(Path(limit_file)), _read_number(Path(usage_file))
        if limit is None or usage is None or limit >= (_meminfo("MemTotal") or float("inf")):
            continue
        cache = 0.0
        try:
            for line in (Path(limit_file).parent / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
                    cache = float(value)
        except OSError:
            pass
        return max(0.0, limit - usage + cache)
    return None


def host_available() -> float:
    """Bytes of host memory a new allocation can have now: MemAvailable, or less where a cgroup limits this process
    (the page count the C library reports where /proc/meminfo is missing)."""
    available = _meminfo("MemAvailable")
    if available is None:
        available = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    room = _cgroup_room()
    return available if room is None else min(available, room)


def available_memory(device: torch.device) -> tuple[float, str]:
    """(bytes this process can still allocate on ``device``, the words naming that memory)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {device} ({torch.cuda.get_device_name(device)})"
    return host_available(), "of host memory available"


def _ranks_here(run: RunConfig, device: torch.device) -> int:
    """Ranks sharing this device's memory: one per GPU; on CPUs every rank on this host."""
    if device.type == "cuda":
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", run.parallel.world_size))


def _fix_text(fixes: list[fit.Fix]) -> str:
    shown = [f"{f.flags} ({fit.gib(f.peak)})" for f in fixes[:3]]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def check_weights(run: RunConfig, device: torch.device) -> None:
    """Refuse a model whose fp32 weights alone, split evenly over every rank, exceed one machine's memory (host and
    one GPU): building it could only fail, after minutes or by the kernel's OOM killer. Made whatever --fit says."""
    model, world = run.model, run.parallel.world_size
    params = _params(model)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "cuda":
        memory += torch.cuda.get_device_properties(device).total_memory
    if 4 * params / world > memory:
        raise ValueError(
            f"the model has {params:.3g} parameters ({4 * params / world / 2**30:.3g} GiB of fp32 weights per rank "
            f"over {world} rank(s), 16 bytes per parameter to train), more than this machine's "
            f"{memory / 2**30:.0f} GiB of memory; lower moe.num_experts ({model.moe.num_experts}), "
            f"model.num_layers ({model.num_layers}) or hidden sizes (`xmoe plan memory` predicts what fits)"
        )


def check_train(
    run: RunConfig, device: torch.device, mode: str, *, free: float | None = None, warn: bool = True
) -> tuple[RunConfig, str | None]:
    """The pre-flight of a training run on ``device``: (the run to train, ``run`` or under ``mode`` "auto" with the
    cheapest change applied; the run header's memory line, None with "off"). ValueError, one line, when the run is
    predicted not to fit and ``mode`` cannot change it so that it does. ``free``: the bytes to plan for (default:
    what ``device`` has free now); ``warn``: log a prediction within the margin (rank 0's business)."""
    if mode not in FIT_MODES:
        raise ValueError(f"--fit ({mode!r}) must be one of {', '.join(FIT_MODES)}")
    if mode == "off":
        return run, None
    try:
        peak = fit.predict_train_peak(run, device.type)
    except ValueError as exc:  # a layout the planner does not model: the run's own checks speak for it later
        if warn:
            log.warning(f"xmoe: the memory pre-flight is skipped: the planner cannot model this run ({exc})")
        return run, None
    now, what = available_memory(device)
    free = now if free is None else free
    ranks = _ranks_here(run, device)
    # ranks on one host share its memory: each may use its share, the margin kept free
    budget = free * (1 - fit.WARN_MARGIN) / ranks

    def scope(per_rank: float) -> str:
        return f"{fit.gib(per_rank)} per rank x {ranks} ranks on this host" if ranks > 1 else fit.gib(per_rank)

    line = f"memory: planned peak {scope(peak)} of {fit.gib(free)} {what}"
    if peak <= budget:
        return run, line
    fixes = fit.train_fixes(run, device.type, budget)
    if peak * ranks <= free:  # within the margin: run, but say what would leave room
        hint = f"; {_fix_text(fixes)} would leave more room" if fixes else ""
        if warn:
            log.warning(
                f"xmoe: warning: the planned peak {scope(peak)} is within {fit.WARN_MARGIN:.0%} of the "
                f"{fit.gib(free)} {what}: the run may run out of memory{hint}"
            )
        return run, line + " (within the margin)"
    applicable = [f for f in fixes if f.run is not None]
    if mode == "auto" and applicable:
        chosen = applicable[0]
        assert chosen.run is not None  # applicable
        return chosen.run, (
            f"memory: planned peak {scope(chosen.peak)} of {fit.gib(free)} {what} with --fit auto's "
            f"{chosen.flags} (as given: {fit.gib(peak)})"
        )
    raise ValueError(
        f"out of memory before the start: the run needs {scope(peak)} (the planner's peak) of the {fit.gib(free)} "
        f"{what}; {_advice(fixes, bool(applicable) and mode == 'check')}"
    )


def _advice(fixes: list, auto: bool) -> str:
    """What to do about a run that does not fit: the planner's fixes (``auto``: --fit auto could apply one)."""
    if fixes:
        hint = "; --fit auto applies the first" if auto else ""
        return f"try {_fix_text(fixes)}{hint}; --fit off skips this check"
    return (
        "no smaller micro-batch, recompute mode or layer count the planner tried fits: plan a larger layout "
        "with `xmoe plan memory`, or skip this check with --fit off"
    )


def check_run(
    run: RunConfig, device: torch.device, mode: str, *, warn: bool = True
) -> tuple[RunConfig, str | None, tuple[float, float] | None]:
    """A trainer's pre-flight: check_weights, then check_train on the least free memory of all ranks (collective
    under torch.distributed), so that every rank decides alike. Returns (the run to train, the header's memory
    line or None, (its planned peak per rank, the free bytes) for an out-of-memory line's advice, or None)."""
    check_weights(run, device)
    if mode == "off":
        return run, None, None
    free = torch.tensor(available_memory(device)[0], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
    fitted, line = check_train(run, device, mode, free=free.item(), warn=warn)
    try:
        return fitted, line, (fit.predict_train_peak(fitted, device.type), free.item())
    except ValueError:  # a layout the planner does not model (check_train said so)
        return fitted, line, None


def check_inference(cfg, tokens: int, device: torch.device, mode: str, *, cache_tokens: int = 0, what: str) -> None:
    """The pre-flight of `xmoe eval` / `generate`: ValueError (one line) where a forward of ``tokens`` tokens
    (``what``: the flags that set them) is predicted not to fit ``device``'s free memory; warns within the margin."""
    if mode not in ("check", "off"):
        raise ValueError(f"--fit ({mode!r}) must be check or off")
    if mode == "off":
        return
    peak = fit.predict_inference_peak(cfg, tokens, device.type, cache_tokens=cache_tokens)
    free, where = available_memory(device)
    if peak > free:
        weights = 4 * _params(cfg)
        fix = (
            f"lower {what}"
            if weights < free * (1 - fit.WARN_MARGIN)
            else "its fp32 weights alone do not fit: use a device with more memory"
        )
        raise ValueError(
            f"out of memory before the start: the model needs {fit.gib(peak)} (the planner's peak: "
            f"{fit.gib(weights)} of fp32 weights, {tokens} tokens per forward) of the {fit.gib(free)} {where}; "
            f"{fix}, or skip this check with --fit off"
        )
    if peak > free * (1 - fit.WARN_MARGIN):
        log.warning(
            f"xmoe: warning: the planned peak {fit.gib(peak)} is within {fit.WARN_MARGIN:.0%} of the "
            f"{fit.gib(free)} {where}: it may run out of memory"
        )


def _params(cfg) -> int:
    from xmoe.model.counting import count_params

    return count_params(cfg).total
