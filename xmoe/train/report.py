"""What a training run says: the header it starts with, one record per logging window, the lines it ends with.

The records go through ``metrics.MetricsLogger`` (metrics.jsonl, the progress line, TensorBoard, summary.json and
loss.png; the experts' loads to expert_load.npy and expert_load.png, xmoe/train/expert_load.py); everything a logging
step reads from the device is read here, with one all-reduce and one host sync.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from xmoe.config import RunConfig
from xmoe.dispatch.base import add_counters
from xmoe.kernels import launches
from xmoe.moe.step import StepStats
from xmoe.train import expert_load, metrics

log = logging.getLogger(__name__)


@dataclass
class Window:
    """The optimizer steps since the last log line, added up on the device: nothing is read on the host until the
    log. ``start`` is the clock at the window's start, moved on by the time it excludes (evaluation, saving)."""

    device: torch.device
    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    rows: torch.Tensor = field(init=False)  # routed rows the experts computed, summed
    load_LE: torch.Tensor | None = None  # real tokens' slots per expert per layer, summed (None: no MoE layers)
    traffic: dict[str, int] = field(default_factory=dict)  # the dispatchers' counters, summed (max_*: their maximum)
    # what the experts' Triton GEMMs launched on this rank, summed (StepStats.launches; {} where none ran)
    launched: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rows = torch.zeros((), dtype=torch.long, device=self.device)

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.rows += stats.rows
        if stats.load_LE is not None:
            self.load_LE = stats.load_LE if self.load_LE is None else self.load_LE + stats.load_LE
        add_counters(self.traffic, stats.traffic)
        launches.add(self.launched, stats.launches)

    def exclude(self, since: float) -> None:
        """The time from ``since`` until now (an evaluation, a checkpoint) is not training time."""
        self.start += time.perf_counter() - since


def comm_metrics(traffic: dict[str, int], steps: int) -> dict[str, float]:
    """This rank's dispatch traffic per step over a window (``traffic``: the dispatchers' counters summed over its
    ``steps`` steps): MB sent over the network by the all-to-all dispatchers, the rows they sent to other nodes
    (inter_node_rows: flat's rows, RBD's pilots) and the most nodes one of the rank's tokens was sent to in any
    layer and step of the window (max_token_nodes, at most moe.max_nodes_per_token under a node limit); for RBD
    also the inter-node rows against what flat all-to-all would have sent, and the redundancy rate R."""
    if not traffic:
        return {}
    sent = traffic.get("bytes_sent", traffic.get("bytes_intra", 0) + traffic.get("bytes_inter", 0))
    out = {"comm_mb_per_step": sent / steps / 2**20}
    if "rows_inter" in traffic:
        out.update(inter_node_rows=traffic["rows_inter"] / steps, max_token_nodes=traffic["max_token_nodes"])
    if "flat_rows_inter" in traffic:  # RBD's
        slots = traffic["slots"]
        out.update(
            rbd_inter_rows=traffic["rows_inter"] / steps,
            flat_inter_rows=traffic["flat_rows_inter"] / steps,
            rbd_redundancy=1.0 - traffic["token_nodes"] / slots if slots else 0.0,
        )
    return out


class Reporter:
    """The run's words: ``announce`` at the start, ``log_window`` at each logging step, ``finish`` at the end.
    ``dataset``: the training data (its ``name``, ``vocab_size`` and, for the synthetic source, ``loss_floor`` and
    ``unigram_entropy``); ``preset``: the preset the model came from ("" for none); ``kernels``: the run's kernel
    choices as resolved on its device (xmoe.kernels.choice), named in the header and recorded in the summary beside
    what the kernels launched from the header on (``launches``: xmoe/kernels/launches.py); ``memory``: the memory
    pre-flight's line for the header."""

    def __init__(
        self,
        run: RunConfig,
        out_dir: Path,
        logger: metrics.MetricsLogger,
        *,
        rank: int,
        world: int,
        device: torch.device,
        dataset: Any,
        preset: str,
        kernels: Any,
        optimizer: str = "",
        memory: str | None = None,
    ):
        self.run, self.out_dir, self.logger = run, out_dir, logger
        self.memory = memory  # the pre-flight's line (xmoe.train.preflight), None when it did not run
        self.rank, self.world, self.device = rank, world, device
        self.dataset, self.preset, self.kernel_choice = dataset, preset, kernels
        self.optimizer = optimizer
        self.flop_dims = metrics.FlopDims.from_model_config(run.model, run.train.seq_len)
        self.launched = launches.snapshot()  # what the Triton GEMMs launched before the run: not the run's

    def announce(self, n_params: int, micro_batch: int, accum: int, dp_size: int, compiled: bool, step: int) -> None:
        """The run's header (rank 0): the model, the data and the batch, where it writes."""
        self.launched = launches.snapshot()
        if self.rank:
            return
        t, m = self.run.train, self.run.model
        lines = [
            f"xmoe train: {n_params / 1e6:.2f}M parameters, {m.num_layers} layers "
            f"({m.num_layers - m.first_k_dense} MoE: {m.moe.num_experts} experts, top-{m.moe.top_k}, "
            f"{m.moe.num_shared_experts} shared), device {self.device}, {self.world} process(es)",
            f"data {self.run.data.path}: vocab {self.dataset.vocab_size}, seq {t.seq_len}, global batch "
            f"{t.global_batch_size} ({micro_batch} x {accum} micro-batches x {dp_size} ranks), "
            f"compiled regions {'on' if compiled else 'off'}, recompute {t.recompute}"
            + (f", {self.optimizer}" if self.optimizer else "")
            + (f", expert-parallel overlap {self._overlap()}" if self.run.parallel.ep > 1 else ""),
            self.kernel_choice.describe(),
        ]
        if self.memory:
            lines.append(self.memory)
        floor = getattr(self.dataset, "loss_floor", None)
        if floor is not None:
            lines.append(
                f"loss floor (source entropy at this seq_len) {floor:.3f} nats/token, unigram baseline "
                f"{self.dataset.unigram_entropy:.3f}"
            )
        if step:
            lines.append(f"continuing from step {step} to {t.steps}")
        lines.append(f"writing to {self.out_dir}/ (Ctrl-C or SIGTERM: save a checkpoint and stop)")
        log.info("\n".join(lines))

    def _overlap(self) -> str:
        par = self.run.parallel
        return f"chunks ({par.ep_chunks})" if par.ep_overlap == "chunks" else par.ep_overlap

    def log_window(
        self,
        step: int,
        loss: torch.Tensor,
        aux: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        window: Window,
        val: dict[str, float] | None = None,
        sources_M2: torch.Tensor | None = None,
        mtp_loss: torch.Tensor | None = None,
    ) -> None:
        """One record for the window ending at ``step`` (every rank calls it: the values are all-reduced). ``val``:
        the validation losses (``Trainer._validate``); ``sources_M2``: a mixture's (nats, tokens) per source over the
        window (source_loss.SourceLosses), logged as loss/SOURCE; ``mtp_loss``: the window's multi-token-prediction
        loss (Transformer.take_mtp_loss), logged as mtp_loss."""
        loss_v, aux_v, gnorm_v, rows_v, mtp_v, per_source, load_v = self._reduce(
            loss, aux, grad_norm, window, sources_M2, mtp_loss
        )
        # the clock is read after that sync: the window's GPU work has finished, none of it spills uncounted
        # into the next window (no other host sync in a step lets the host run ahead by up to the launch queue)
        seconds = time.perf_counter() - window.start
        record = dict(loss=loss_v, aux_loss=aux_v, lr=lr, grad_norm=gnorm_v, **self._rates(window, rows_v, seconds))
        record.update(comm_metrics(window.traffic, window.steps))
        if window.launched:  # rank 0's, as its traffic: {"tiles": {source: launches}, "wgrad": {engine: products}}
            record["launches"] = window.launched
        load_LE = None
        if window.load_LE is not None:
            load_LE = np.asarray(load_v, dtype=np.float64).reshape(window.load_LE.shape).astype(np.int64)
            dead_L, hot_L = expert_load.dead_and_hot(load_LE)
            record.update(
                imbalance=metrics.load_imbalance(torch.from_numpy(load_LE)),  # the most imbalanced layer's
                dead_experts=int(dead_L.sum()),
                hot_experts=int(hot_L.sum()),
                dead_per_layer=dead_L.tolist(),
                hot_per_layer=hot_L.tolist(),
            )
        for name, nats, tokens in zip(self.dataset.source_names, per_source[::2], per_source[1::2], strict=False):
            record[f"loss/{name}"] = nats / tokens if tokens else None
        if mtp_v is not None:
            record["mtp_loss"] = mtp_v
        self.logger.log(step, **record, **(val or {}))
        if load_LE is not None:
            self.logger.log_expert_load(step, load_LE)

    def _reduce(
        self,
        loss: torch.Tensor,
        aux: torch.Tensor,
        grad_norm: torch.Tensor,
        window: Window,
        sources_M2: torch.Tensor | None,
        mtp_loss: torch.Tensor | None,
    ) -> tuple[float, float, float, float, float | None, list[float], list[float]]:
        """One all-reduce and one host read for everything logged: loss, aux, grad norm, routed rows, the MTP loss
        and, when there are MoE layers, the real tokens' slots per expert of every layer (float64: counts stay
        exact). Returns (loss, aux, grad norm, rows, MTP loss or None, per-source (nats, tokens), load)."""
        values = torch.stack([loss.double(), aux.double(), grad_norm.double(), window.rows.double()])
        if mtp_loss is not None:
            values = torch.cat([values, mtp_loss.double().reshape(1).to(values.device)])
        if sources_M2 is not None:
            values = torch.cat([values, sources_M2.flatten().to(values.device)])
        if window.load_LE is not None:
            values = torch.cat([values, window.load_LE.flatten().double()])
        if dist.is_initialized():
            dist.all_reduce(values)
            values[:3] /= self.world
            if mtp_loss is not None:
                values[4] /= self.world
        loss_v, aux_v, gnorm_v, rows_v, *rest = values.tolist()  # the one host sync of a logging step
        mtp_v = rest.pop(0) if mtp_loss is not None else None
        per_source = rest[: 0 if sources_M2 is None else sources_M2.numel()]
        return loss_v, aux_v, gnorm_v, rows_v, mtp_v, per_source, rest[len(per_source) :]

    def _rates(self, window: Window, rows_v: float, seconds: float) -> dict:
        """Throughput, FLOP rates, MFU and peak memory of the window."""
        t = self.run.train
        sequences = window.steps * t.global_batch_size
        tokens = sequences * t.seq_len
        # rows were counted on each rank for its own tokens; their sum is the global routed rows
        routed_rows = int(rows_v) if window.load_LE is not None else None
        per_device = metrics.train_flops(self.flop_dims, sequences, routed_rows=routed_rows) / seconds / self.world
        return dict(
            tokens_per_s=tokens / seconds,
            tflops=per_device / 1e12,
            paper_tflops=metrics.paper_train_flops(self.flop_dims, sequences) / seconds / self.world / 1e12,
            mfu=metrics.mfu(per_device, self.device) if self.device.type == "cuda" else None,
            mem_bytes=metrics.peak_memory_bytes(self.device),
        )

    def finish(self, step: int, status: str | None = None) -> dict:
        """summary.json, loss.png and the list of outputs; ``status`` says why a run ended early."""
        floor = getattr(self.dataset, "loss_floor", None)
        summary = self.logger.finish(
            floor=floor,
            baseline=getattr(self.dataset, "unigram_entropy", None),
            status=status,
            title=f"{self.out_dir} ({self._model_text()})",
            step=step,
            info={"kernels": self.kernel_choice.record(), "launches": launches.since(self.launched)},
        )
        if self.rank == 0:
            if floor is not None and isinstance(summary.get("final_loss"), float):
                log.info(
                    f"final loss {summary['final_loss']:.3f}: {summary['final_loss'] - floor:.3f} nats/token "
                    f"above the source's floor {floor:.3f} (unigram baseline {self.dataset.unigram_entropy:.3f})"
                )
            log.info(metrics.describe_outputs(self.out_dir))
        return summary

    def _model_text(self) -> str:
        m = self.run.model
        preset = f"preset {self.preset}, " if self.preset else ""
        return (
            f"{preset}{m.num_layers} layers, H {m.hidden_size}, {m.moe.num_experts} experts top-{m.moe.top_k}, "
            f"data {self.dataset.name.split('(')[0]}"
        )
