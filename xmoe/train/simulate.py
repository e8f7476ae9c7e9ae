"""One rank of any layout, trained for a few steps on the local device: `xmoe plan memory ... --measure`.

# W world size, R this rank, T tokens a rank routes per micro-batch, K top-k, P ranks of an EP group

The process group is torch's fake backend (``FakeStore``, backend "fake"): a world of W ranks in which this process
is rank R. DeviceMesh, DTensor, FSDP2, DDP and the all-to-alls run their own code on the local device, but no
collective moves data: each leaves its output buffer as it was allocated. Buffers keep their real sizes, so the
model a rank builds (xmoe/parallel/build.py: its shards only), its kernels, its optimizer and its memory are those
of rank R of a real run; the values are not, and neither are the losses. Where a collective's result sizes a
buffer (the expert all-to-all's split counts) the simulated rank takes the counts the planner assumes: it receives
as many rows as it routes (T * K, dropless, balanced), times ``imbalance``, spread evenly over the P sources and
its local experts (xmoe/parallel/simulated.py, ``PlannedCounts``).

Each step is the trainer's (xmoe/train/step.py: forward and backward under its precision, clipping, AdamW, the
expert-bias update of the step's MoEStep). Measured: the peak (GPU: the caching allocator's peak of allocated
bytes; CPU: bytes of live tensor storages, counted by torch's MemTracker), the bytes by kind at the peak
(MemTracker, one step after a warm-up step), and the compute time of the steps after those two, beside
``xmoe.plan.memory``'s prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xmoe.config import KernelConfig, ModelConfig, ParallelConfig, kernel_config
from xmoe.kernels import launches
from xmoe.kernels.choice import KernelChoice, describe_record, resolve_layer
from xmoe.model_config import KernelBackend
from xmoe.parallel.build import build_model
from xmoe.parallel.dims import ParallelDims
from xmoe.parallel.simulated import keep_buckets, plan_counts
from xmoe.train.optim import build_optimizer, param_groups
from xmoe.train.step import clip_gradients, forward_backward, optimizer_step

log = logging.getLogger(__name__)

NOTE = (
    "simulated rank: no collective communicated (torch's fake process group), so times are compute only and "
    "losses are meaningless; the all-to-all counts are the planner's (balanced routing x imbalance)"
)
KINDS = {
    "PARAM": "weights",
    "GRAD": "gradients",
    "OPT": "optimizer",
    "ACT": "activations",
    "TEMP": "temporaries",
    "BUFFER": "buffers",
    "OTH": "other",
}  # MemTracker's reference types


@dataclass
class Measurement:
    """What one simulated rank measured; ``as_dict`` is the `--json` object."""

    layout: dict[str, Any]
    device: str
    steps: int
    measured_peak_bytes: int
    measured_by_kind: dict[str, int]
    compute_ms_per_step: float
    tokens_per_s: float  # this rank's tokens per second that compute alone would allow
    kernels: dict[str, Any]  # the kernels section and what it resolved to (KernelChoice.record)
    launches: dict[str, dict[str, int]]  # what the Triton GEMMs launched over the steps (xmoe/kernels/launches.py)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"note": NOTE}


@contextlib.contextmanager
def _world(simulate: bool, world: int, rank: int) -> Iterator[None]:
    """With ``simulate``, a fake process group of ``world`` ranks in which this process is ``rank``, destroyed
    after; else the process group this process already belongs to."""
    if not simulate:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group exists already; --measure simulates a world of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _batches(
    vocab: int, micro_batch: int, seq_len: int, device: torch.device, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen).to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rank(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    *,
    micro_batch: int,
    seq_len: int,
    rank: int = 0,
    recompute: str = "none",
    imbalance: float = 1.0,
    steps: int = 3,
    device: str = "auto",
    ssmb: bool = True,
    seed: int = 0,
    lr: float = 1e-4,
    weight_decay: float = 0.1,
    simulate: bool = True,
    kernels: KernelConfig | None = None,
) -> Measurement:
    """Rank ``rank`` of ``parallel`` (all ``parallel.world_size`` ranks of it) training ``cfg``: ``steps`` >= 3 steps
    of ``micro_batch`` sequences of ``seq_len`` tokens, in a fake world of its own (the module docstring).
    ``simulate=False``: in the process group this process already belongs to, for real (the same measurement of
    a real run's rank: the tests compare the two). ``ssmb``: with tp > 1, the MoE blocks on 1/tp of the tokens.
    ``kernels``: the kernels section the rank's model is built with, as the trainer builds its own (None: the
    environment's defaults)."""
    if steps < 3:
        raise ValueError(f"--steps ({steps}) must be >= 3: a warm-up step, a measured step, then timed ones")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    autocast = dev.type == "cuda"
    world = parallel.world_size
    tokens = micro_batch * seq_len // (parallel.tp if ssmb else 1)  # what the MoE blocks of a rank route
    dtype = torch.bfloat16 if autocast else torch.float32  # the trainer's, for its kernel choice
    kernels = kernels or KernelConfig()
    choice = resolve_layer(cfg.moe, kernels, tokens, dev, dtype, ep=parallel.ep)
    before = launches.snapshot()
    with _world(simulate, world, rank):
        rank_run = _RankRun(cfg, parallel, rank, dev, seed=seed, ssmb=ssmb, recompute=recompute, choice=choice)
        ms, peak, by_kind = rank_run.measure(micro_batch, seq_len, steps, simulate, imbalance, lr, weight_decay)
    layout = dict(
        world=world,
        rank=rank,
        **dict(tp=parallel.tp, ep=parallel.ep, dp=parallel.dp, placement=parallel.placement),
        **dict(micro_batch=micro_batch, seq_len=seq_len, recompute=recompute, imbalance=imbalance),
        layers=cfg.num_layers,
    )
    tokens_per_s = micro_batch * seq_len / (ms / 1e3)
    launched = launches.since(before)
    return Measurement(layout, str(dev), steps, int(peak), by_kind, ms, tokens_per_s, choice.record(), launched)


class _RankRun:
    """One rank of a layout, built and stepped as the trainer does, its memory tracked from the build on."""

    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelConfig,
        rank: int,
        dev: torch.device,
        *,
        seed: int,
        ssmb: bool,
        recompute: str,
        choice: KernelChoice,
    ) -> None:
        # model_cfg, kernel_choice: not "cfg" / "kernels", the MoE modules' attribute names (tests/test_seam.py)
        self.model_cfg, self.parallel, self.dev, self.seed, self.ssmb, self.recompute = (
            cfg,
            parallel,
            dev,
            seed,
            ssmb,
            recompute,
        )
        self.kernel_choice = choice  # the kernels section, and the backend it resolved to on ``dev``
        self.world, self.autocast = parallel.world_size, dev.type == "cuda"
        self.dims = None
        if self.world > 1:
            self.dims = ParallelDims.from_config(
                parallel, self.world, rank=rank, node_size=parallel.gpus_per_node or self.world
            ).build_mesh(dev.type)

    def measure(
        self, micro_batch: int, seq_len: int, steps: int, simulate: bool, imbalance: float, lr: float, wd: float
    ) -> tuple[float, int, dict[str, int]]:
        """(ms per timed step, peak bytes, bytes by kind at the peak) of ``steps`` steps: a warm-up, one tracked,
        the rest timed."""
        from torch.distributed._tools.mem_tracker import MemTracker

        cfg, dev, autocast, dims = self.model_cfg, self.dev, self.autocast, self.dims
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        tracker = MemTracker()
        with tracker:
            built, optimizer = self._build(simulate, imbalance, lr, wd)
        params = [p for p in built.wrapped.parameters() if p.requires_grad]
        batches = _batches(cfg.vocab_size, micro_batch, seq_len, dev, self.seed)

        def one_step() -> None:
            _, moe = forward_backward(built.model, built.wrapped, batches, 1, dev, autocast)  # as the trainer
            optimizer_step(optimizer, clip_gradients(optimizer, params, 1.0, dims)[1])
            optimizer.zero_grad(set_to_none=True)
            moe.finish()

        one_step()  # warm-up: kernels compiled or tuned, AdamW's state allocated
        tracker.track_external(built.wrapped, optimizer)
        with tracker:
            tracker.reset_mod_stats()
            one_step()
        ms = _time_steps(one_step, steps - 2, dev)
        return (ms, *_peak(tracker, dev))

    def _build(self, simulate: bool, imbalance: float, lr: float, weight_decay: float):
        """The trainer's model and optimizer for this rank."""
        cfg, dev, autocast = self.model_cfg, self.dev, self.autocast
        built = build_model(
            cfg,
            dev,
            self.dims,
            seed=self.seed,
            sequence_parallel=self.parallel.sequence_parallel,
            ssmb=self.ssmb,
            param_dtype=torch.bfloat16 if autocast else None,
            recompute=self.recompute,
            kernels=self.kernel_choice.config,
        )
        if simulate:
            plan_counts(built.model, imbalance)
            keep_buckets(built.wrapped)
        optimizer = build_optimizer(
            param_groups(built.wrapped, weight_decay),
            dev,
            lr=lr,
            backend=self.kernel_choice.backend,
            copies=built.copy_writers,
        )
        return built, optimizer


def _time_steps(one_step, steps: int, dev: torch.device) -> float:
    """Milliseconds per step over ``steps`` steps, the device synchronised at both ends."""
    _sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    _sync(dev)
    return (time.perf_counter() - start) * 1e3 / steps


def _peak(tracker, dev: torch.device) -> tuple[int, dict[str, int]]:
    """(peak bytes, the tracker's bytes by kind at its peak): the allocator's peak on a GPU, the tracker's total
    elsewhere."""
    # keyed by the device the tensors are on ("cuda:0"), which a bare "cuda" does not equal
    snapshot: dict = next(
        (
            kinds
            for where, kinds in tracker.get_tracker_snapshot("peak").items()
            if torch.device(where).type == dev.type
        ),
        {},
    )
    by_kind = {KINDS.get(getattr(k, "name", str(k)), str(k)): int(v) for k, v in snapshot.items() if str(k) != "Total"}
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else int(snapshot.get("Total", 0))
    return peak, by_kind


# ------------------------------------------------------------------------------------------------ the command


def run(args, base: ModelConfig | None = None) -> str:
    """`xmoe plan memory ... --measure`: the planner's proposed layout (or the one given), rank ``--rank`` of it
    measured here; returns the table to print, or with ``--json`` one JSON object. ``base``: the model of --config,
    --init-from or --set (xmoe.plan.cli.model_config), built here with that layout's shards."""
    from xmoe.plan.cli import prepare_memory
    from xmoe.plan.tables import model_name, rank_layouts

    _check_measure(args)
    cfg, note = prepare_memory(args, base)
    device = _device(args.device)
    if args.kernel is None:
        args.kernel = "triton" if device.type == "cuda" else "torch"
    # the planner in the trainer's precision on this device: bf16 (autocast, FSDP2 mixed precision) on GPUs,
    # fp32 on CPUs
    best = rank_layouts(cfg, args, precision="bf16" if device.type == "cuda" else "fp32")[0]
    kernel_backend: KernelBackend = "auto" if args.kernel == "triton" and device.type == "cuda" else "torch"
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, kernel_backend=kernel_backend))
    header = (
        f"xmoe plan memory --measure: {model_name(args)}, {cfg.num_layers} layers, rank {args.rank} of tp "
        f"{best.parallel.tp} x ep {best.parallel.ep} x dp {best.parallel.dp} ({args.gpus} GPUs), micro-batch "
        f"{best.micro_batch} x seq {best.seq_len}, recompute {best.recompute}, on {device}"
    )
    if not args.json:
        log.info(f"xmoe plan memory --measure: building rank {args.rank} and running {args.steps} steps")
    m = measure_rank(
        cfg,
        best.parallel,
        micro_batch=best.micro_batch,
        seq_len=best.seq_len,
        rank=args.rank,
        recompute=best.recompute,
        imbalance=args.imbalance,
        steps=args.steps,
        device=str(device),
        ssmb=not args.no_ssmb,
        kernels=kernel_config(args),
    )
    result = m.as_dict() | {
        "preset": model_name(args),
        "planned_peak_bytes": int(best.peak),
        "planned_peak_at": best.peak_at,
        "planned_reserve_bytes": int(best.reserve),
        "planned_by_kind": {k: int(v) for k, v in best.tracker_parts().items()},
        "ratio": m.measured_peak_bytes / best.peak,
    }
    if args.json:
        return json.dumps(result, indent=2)
    steps = _step_lines(cfg, args, best, m.compute_ms_per_step) if best.parallel.ep > 1 else []
    return "\n".join([header, _table(result, note), *steps])


def _check_measure(args) -> None:
    """What --measure cannot run: the one-GPU trainer's view, the padded dispatcher, a rank outside the world."""
    if args.trainer:
        raise ValueError(
            "--measure runs one rank of a multi-GPU layout; for --trainer's one-GPU peak run "
            "`xmoe train` itself (its log reports the peak memory)"
        )
    if args.padded or args.capacity_factor is not None:
        raise ValueError(
            "--measure simulates the padding-free dropless dispatcher; leave out --padded and --capacity-factor"
        )
    if not 0 <= args.rank < args.gpus:
        raise ValueError(f"--rank ({args.rank}) must be in [0, --gpus={args.gpus})")


def _step_lines(cfg: ModelConfig, args, best, compute_ms: float) -> list[str]:
    """The step time with the expert-parallel all-to-alls (xmoe/plan/step_table.py), from the compute just measured:
    with and without each technique that hides or shrinks them, on `plan comm`'s default network."""
    from xmoe.plan import comm, step_table, step_time

    par = best.parallel
    tokens = best.micro_batch * best.seq_len // par.tp
    est = comm.estimate_comm(
        cfg, args.gpus, gpus_per_node=args.gpus_per_node, ep=par.ep, tp=par.tp, tokens_per_gpu=tokens, mc_tokens=1024
    )
    compute = step_time.compute_model(cfg, tokens, ep=par.ep, compute_ms=compute_ms, recompute=best.recompute)
    lines = step_table.step_lines({0: est}, compute, 2, cfg.moe.top_k, tokens)
    net = est.network
    lines.append(
        f"network: plan comm's defaults ({net.intra_bw:g} GB/s per GPU inside a node, {net.inter_bw:g} across); "
        "`xmoe plan comm ... --compute-ms` takes this compute with your network and node limits"
    )
    return lines


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"--device ({name!r}) must be auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no GPU; use --device cpu")
    return torch.device(name)


def _table(r: dict[str, Any], note: str | None) -> str:
    unit, gib = ("GiB", 2.0**30) if r["planned_peak_bytes"] >= 2**30 else ("MiB", 2.0**20)
    planned, measured = r["planned_by_kind"], dict(r["measured_by_kind"])
    measured["temporaries"] = sum(measured.pop(k, 0) for k in ("temporaries", "buffers", "other"))
    lines = [f"  {'':<30}{'planned ' + unit:>12}{'measured ' + unit:>14}"]
    lines += [f"  {kind:<30}{planned[kind] / gib:>12.3f}{measured.get(kind, 0) / gib:>14.3f}" for kind in planned]
    lines.append(
        f"  {'peak (planned: less reserve)':<30}{r['planned_peak_bytes'] / gib:>12.3f}"
        f"{r['measured_peak_bytes'] / gib:>14.3f}   measured / planned {r['ratio']:.3f}"
    )
    lines.append(f"planned peak: {r['planned_peak_at']}")
    lines.append(
        f"compute {r['compute_ms_per_step']:.1f} ms per step ({r['steps']} steps on {r['device']}): "
        f"{r['tokens_per_s']:.0f} tokens/s per GPU from compute alone"
    )
    lines.append(
        f"by kind: MemTracker's, at the peak of a step (the planner's in the same kinds: "
        f"MemoryBreakdown.tracker_parts); peak: "
        f"{'the caching allocator' if r['device'].startswith('cuda') else 'live tensor storages'}"
    )
    lines.append(describe_record(r["kernels"]))
    lines.append(f"note: {NOTE}")
    if note:
        lines.append(note)
    return "\n".join(lines)
