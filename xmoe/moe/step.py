"""One optimizer step as the MoE layers see it: the one seam between a training loop and the layers.

# L MoE layers, E experts, A micro-batches per optimizer step

A training loop (xmoe/train/step.py, which the trainer and the simulated rank share) makes one ``MoEStep`` per
optimizer step and asks it; nothing in xmoe/train/ sets or reads an attribute of an MoE module (tests/test_seam.py):

    moe = MoEStep(model, A, device, cast_dtype=torch.bfloat16)
    with moe:                                   # the layers report to it; each expert stack is cast once
        for each of the A micro-batches:
            moe.set_real_tokens(*model.real_tokens(targets))  # which positions count in the balance losses and loads
            (model(inputs, targets) / A).backward()
            moe.end_micro_batch()               # the micro-batch's routing statistics, added on the device
    optimizer.step()
    stats = moe.finish()                        # one all-reduce of the loads, the bias update, the step's StepStats

What passes between the step and each layer while it is open (``moe/layer.py: LayerStep``, the layer's
``moe_step``):
  aux_loss_scale  the gradient the layer's auxiliary losses receive: 1 / A, as the LM loss is backpropagated as
                  loss / A for each micro-batch (xmoe/parallel/grads.py tabulates every scale)
  casts           the routed experts' weight copies for the step's micro-batches (RoutedExperts.step_copies: the
                  compute dtype, or the FP8 copies with their block scales; xmoe/moe/weights.py owns them), made
                  once at entry and dropped at exit; None where the weights are DTensors (expert parallelism,
                  FSDP2), which are cast per forward
  stats           what the layer's latest forward routed; a forward recomputed in backward reports the same values
                  again, so end_micro_batch() reads each layer once per micro-batch
  real_tokens     the micro-batch's real tokens (set_real_tokens; None: all): the only ones the auxiliary losses,
                  the loads and so the expert-bias update count
  global_counts   with balance_scope "global" and an auxiliary loss: the real slots per expert and real tokens of the
                  step's micro-batches so far on every rank (moe/balance.py's GlobalCounts), which the balance loss
                  takes its expert frequencies from; each forward adds its micro-batch's with one all-reduce of E + 1
                  integers when there are several processes
and, once per step, the dispatchers' traffic counters (read and reset by finish()) and what the experts' Triton
GEMMs launched since the step was made (xmoe/kernels/launches.py: tile sources, weight-gradient engines).

The global scope is not causal within one forward: the frequencies of the whole step are known only after its last
micro-batch, whose backward has long run by then. Micro-batch a therefore balances against the step's counts so far
(micro-batches 1..a on every rank, as Megatron-Core's global auxiliary loss does with its running average): with
A = 1 exactly the loss of the global batch, over any number of ranks; with A > 1 the last micro-batch uses the whole
step's frequencies and earlier ones a prefix of them (docs/routing.md, "Scopes").

Outside a step a layer computes alone: its auxiliary losses get gradient 1 and every forward casts its weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from xmoe.dispatch.base import add_counters
from xmoe.kernels import launches
from xmoe.moe.balance import GlobalCounts
from xmoe.moe.layer import LayerStep, MoELayer, moe_layers


@dataclass
class StepStats:
    """One optimizer step's MoE statistics, on the device (nothing here is read on the host).

    aux: the auxiliary losses (balance + z, summed over layers), averaged over the micro-batches; rows: routed rows
    the experts computed (slots kept after capacity dropping, padding tokens' included), summed; load_LE: the real
    tokens' routed slots per expert per layer (int64, this rank's, before dropping), summed over the micro-batches,
    None without MoE layers; traffic: the dispatchers' counters summed over layers, ``max_*`` ones their maximum
    (Python numbers; {} when no dispatcher counts); launches: what the Triton GEMMs of this process launched during
    the step, {"tiles": {source: launches}, "wgrad": {engine: weight gradients}} (xmoe/kernels/launches.py; {}
    where none ran: the torch backend)."""

    aux: torch.Tensor
    rows: torch.Tensor
    load_LE: torch.Tensor | None
    traffic: dict[str, int] = field(default_factory=dict)
    launches: dict[str, dict[str, int]] = field(default_factory=dict)


class MoEStep:
    """The MoE side of one optimizer step of ``model``'s ``micro_batches`` micro-batches (the module docstring);
    ``device``: where the step's statistics live.

    ``cast_dtype``: the compute dtype of the routed experts' weight copies, made once for the step's micro-batches,
    whose weights do not change (None: none, each forward casts). With fp32 parameters and bf16 compute a cast
    reads 4 and writes 2 bytes per expert weight (measured: docs/architecture.md, "Measured reasons"). Made outside
    any compiled region, the copies reach torch.compile'd blocks as plain inputs. How they are made, and how their
    gradients reach the fp32 parameters, is the experts' weights' path, chosen when the model was built
    (xmoe/moe/weights.py: autograd casts, or on one process detached copies, those the last optimizer step wrote
    where they wait); experts whose weights are DTensors (expert parallelism, FSDP2, which swaps in other tensors
    around each forward) get none."""

    def __init__(
        self,
        model: nn.Module,
        micro_batches: int,
        device: torch.device,
        *,
        cast_dtype: torch.dtype | None = None,
    ):
        if micro_batches < 1:
            raise ValueError(f"micro_batches ({micro_batches}) must be >= 1")
        self.micro_batches = micro_batches
        self.cast_dtype = cast_dtype
        self._layers: list[MoELayer] = moe_layers(model)
        self._slots = [LayerStep(1.0 / micro_batches) for _ in self._layers]
        for layer, slot in zip(self._layers, self._slots, strict=True):
            if layer.cfg.balance_scope == "global" and (layer.cfg.aux_loss_coef > 0 or layer.cfg.z_loss_coef > 0):
                slot.global_counts = GlobalCounts(layer.cfg.num_experts, device)
        self._aux = torch.zeros((), device=device)
        self._rows = torch.zeros((), dtype=torch.long, device=device)
        self._load_LE: torch.Tensor | None = None
        self._launched = launches.snapshot()

    def __enter__(self) -> MoEStep:
        """The layers report to this step; their experts' weight copies are made now (with gradients on: a step
        taken under no_grad casts nothing ahead)."""
        cast_dtype = self.cast_dtype if torch.is_grad_enabled() else None
        for layer, slot in zip(self._layers, self._slots, strict=False):
            if cast_dtype is not None:
                slot.casts = layer.experts.step_copies(cast_dtype)
            layer.moe_step = slot
        return self

    def __exit__(self, *exc) -> None:
        """The copies are dropped, so nothing stale outlives the step; the layers compute alone again."""
        for layer, slot in zip(self._layers, self._slots, strict=False):
            layer.moe_step = None
            slot.casts = None

    def set_real_tokens(self, valid_BS: torch.Tensor | None, ahead: Mapping[int, torch.Tensor] | None = None) -> None:
        """Which positions of the next micro-batch are real tokens (bool (B, S), True where the target counts: the
        training step passes ``targets != IGNORE_INDEX``); None: all of them (the default). ``ahead``: for the MoE
        layers of multi-token-prediction blocks (``positions_ahead`` = d), the positions with a target at depth d
        by d (xmoe/model/mtp.py: depth_targets; ``Transformer.real_tokens`` gives both); a depth not given counts
        ``valid_BS``."""
        for layer, slot in zip(self._layers, self._slots, strict=True):
            depth = layer.positions_ahead
            slot.real_tokens = ahead[depth] if depth and ahead is not None and depth in ahead else valid_BS

    def end_micro_batch(self) -> None:
        """Add the micro-batch's routing statistics (every layer's report) to the step's, on the device."""
        given = [slot.stats for slot in self._slots]
        if not given:
            return
        reports = [r for r in given if r is not None]
        if len(reports) < len(given):
            raise RuntimeError("end_micro_batch() needs a forward of every MoE layer inside the step first")

        def total(key: str) -> torch.Tensor:
            return torch.stack([torch.as_tensor(r[key]).float().reshape(()) for r in reports]).sum()

        routed = torch.stack([r["tokens_per_expert"] for r in reports]).sum()
        load_LE = torch.stack([r["real_tokens_per_expert"].long() for r in reports])
        self._aux += total("aux_loss") + total("z_loss")
        self._rows += routed - total("num_dropped").long()
        self._load_LE = load_LE if self._load_LE is None else self._load_LE + load_LE
        for slot in self._slots:
            slot.stats = None
            if slot.global_counts is not None:
                slot.global_counts.end_micro_batch()

    def finish(self, update_bias: bool = True) -> StepStats:
        """After the optimizer step: the auxiliary-loss-free bias update (with ``update_bias``, and a
        bias_update_rate > 0), from the real tokens' loads summed over all ranks by one all-reduce so that every rank
        moves its bias identically; returns the step's statistics (this rank's) and resets the dispatchers'
        counters."""
        if update_bias and self._load_LE is not None and any(layer.cfg.bias_update_rate > 0 for layer in self._layers):
            load_LE = self._load_LE.float()
            if dist.is_initialized():
                dist.all_reduce(load_LE)
            for layer, load_E in zip(self._layers, load_LE, strict=False):
                layer.router.update_bias(load_E)
        traffic = self._take_traffic()
        return StepStats(
            self._aux / self.micro_batches, self._rows, self._load_LE, traffic, launches.since(self._launched)
        )

    def _take_traffic(self) -> dict[str, int]:
        """The dispatchers' counters since the last step, summed over layers (they count with no sync)."""
        totals: dict[str, int] = {}
        for layer in self._layers:
            counters = layer.dispatcher.stats
            if counters is None:
                continue
            add_counters(totals, dataclasses.asdict(counters))
            counters.reset()
        return totals
