"""The MoE layer: router -> padding-free plan -> dispatch -> grouped experts -> combine (+ shared experts).

# T tokens, H hidden, K top-k, E experts, N routed rows this rank computes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from xmoe.config import KernelConfig, MoEConfig
from xmoe.dispatch.base import Dispatcher
from xmoe.dispatch.local import LocalDispatcher
from xmoe.dispatch.padded import PaddedDispatcher
from xmoe.kernels.choice import Kernels, resolve_kernels
from xmoe.moe.balance import GlobalCounts
from xmoe.moe.experts import RoutedExperts, SwiGLU
from xmoe.moe.routed import OVERLAP_MODES, routed_and_shared
from xmoe.moe.router import Router


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out`` (the tokens the routed path takes) whose backward also sends gradient ``scale`` into
    ``aux_loss``.

    This puts the auxiliary losses into the router's gradient as if the caller had added them to its loss,
    without the caller doing anything (and without a global list of losses).
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, grad_aux, None


def make_dispatcher(cfg: MoEConfig, kernels: Kernels) -> Dispatcher:
    """The single-rank dispatcher named by the config, with the layer's kernels (parallel ones are installed by
    xmoe.parallel)."""
    if cfg.dispatcher == "padded":
        return PaddedDispatcher()
    return LocalDispatcher(kernels)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every MoELayer inside ``model``, in registration (layer) order; wrapped ones (FSDP, DDP) included."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@dataclass
class LayerStep:
    """What a layer exchanges with the optimizer step it runs in (xmoe/moe/step.py, which makes one per layer):
    ``aux_loss_scale``, ``casts``, ``real_tokens`` and ``global_counts`` it reads, ``stats`` it reports at each
    forward."""

    aux_loss_scale: float
    casts: tuple | None = None  # RoutedExperts.step_copies' copies, for the experts' forward
    stats: dict[str, torch.Tensor] | None = None
    # the micro-batch's real tokens: bool, one per position of the whole micro-batch (the model's (B, S) input) before
    # any parallel wrapper shares its tokens out; None: every token is real
    real_tokens: torch.Tensor | None = None
    global_counts: GlobalCounts | None = None  # the "global" balance scope's counts over the step (moe/balance.py)


class MoELayer(nn.Module):
    """A DeepSeek-style MoE block. ``layer(x)`` maps (..., H) to (..., H).

    A 3-D input (B, S, H) is B sequences for the sequence-level balance loss. After each call
    ``last_stats`` holds detached tensors for logging (no host sync): aux_loss, z_loss, tokens_per_expert (routed
    slots per global expert before dropping), real_tokens_per_expert (those of the real tokens) and num_dropped;
    inside an optimizer step (``moe_step``, set by
    xmoe/moe/step.py's MoEStep) the layer also reports them there, and takes from it the step's aux-loss scale, expert
    weight casts, real-token mask and the global balance scope's counts.

    ``kernels``: what the layer's router, experts and dispatcher run (xmoe/kernels/choice.py: the backend's ops, the
    weight-gradient engine, tile autotuning), resolved once where the layer is built and used wherever it runs;
    None: ``resolve_kernels(cfg.kernel_backend)``, for the default device under the environment's kernels section
    as it is now. ``build_model`` passes its device's, from the run's ``KernelConfig``.
    """

    def __init__(self, cfg: MoEConfig, dispatcher: Dispatcher | None = None, *, kernels: Kernels | None = None):
        super().__init__()
        self.cfg = cfg
        if kernels is None:
            kernels = resolve_kernels(cfg.kernel_backend)
        elif kernels.requested != cfg.kernel_backend:
            raise ValueError(
                f"the kernels given to this MoE layer were resolved for kernel_backend {kernels.requested!r}, its "
                f"config names {cfg.kernel_backend!r}: resolve them for the config's "
                "(resolve_kernels(cfg.kernel_backend, ...))"
            )
        self.kernels = kernels
        self.router = Router(cfg, kernels)
        self.experts = RoutedExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.ffn_hidden_size,
            cfg.init_std,
            kernels,
            fp8=cfg.fp8 == "experts",
        )
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.shared_width, cfg.init_std) if cfg.num_shared_experts > 0 else None
        )
        # Qwen2-MoE: a per-token sigmoid gate on the shared experts' output
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        self.dispatcher: Dispatcher = dispatcher if dispatcher is not None else make_dispatcher(cfg, kernels)
        # what overlaps the expert-parallel all-to-alls (moe/routed.py); set with the parallel dispatcher from outside
        self.overlap_mode = "off"
        self.overlap_chunks = 2
        # the optimizer step this layer runs in (None: it computes alone, its aux losses with gradient 1)
        self.moe_step: LayerStep | None = None
        # True: forward raises on a NaN / inf input, naming the layer's input (a host sync per call, so off by
        # default). The trainer leaves it off: a non-finite input makes the loss non-finite, which the trainer
        # detects at no per-layer cost (xmoe/train/safety.py); turn it on to find which layer a NaN enters.
        self.check_finite = False
        # which positions of the whole micro-batch this rank's forward sees, where a parallel wrapper shares the
        # tokens out (SSMB: xmoe/parallel/ssmb.py installs it): maps a per-position tensor of the micro-batch to the
        # positions of this layer's input, in its order; None: the input is the whole micro-batch
        self.local_positions: Callable[[torch.Tensor], torch.Tensor] | None = None
        # the layer of a multi-token-prediction block of depth d (xmoe/model/mtp.py) sees position i predict the
        # token d + 1 ahead: its real tokens are those with a target at depth d (MoEStep.set_real_tokens' ``ahead``)
        self.positions_ahead = 0
        self.last_stats: dict[str, torch.Tensor] = {}

    def _apply(self, fn, recurse=True):
        """A move (``.to``, ``.cuda``, ``to_empty``) carries the layer's kernel choice along: moved to a device type
        where ``kernel_backend = "auto"`` names another backend (a layer built on the CPU, then ``.cuda()``), the
        same choice (auto, its weight-gradient engine and autotuning) is resolved for the new device, as if the
        layer had been built there. A backend named outright stays what it is."""
        out = super()._apply(fn, recurse)
        device, kernels = self.experts.w1.device, self.kernels
        if device.type not in (kernels.device_type, "meta") and kernels.requested == "auto":
            config = KernelConfig(wgrad=kernels.wgrad, autotune=kernels.autotune)
            self._use_kernels(resolve_kernels("auto", config, device))
        return out

    def _use_kernels(self, kernels: Kernels) -> None:
        self.kernels = self.router.kernels = self.experts.kernels = kernels
        if hasattr(self.dispatcher, "kernels"):
            self.dispatcher.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if x.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"MoELayer expects inputs of shape (..., hidden_size={cfg.hidden_size}), got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise ValueError(f"MoELayer expects a floating-point input, got dtype {x.dtype}")
        self.kernels.check_device(x.device)
        if self.check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError(
                f"MoELayer input of shape {tuple(x.shape)} holds NaN or inf values "
                f"({int((~torch.isfinite(x)).sum())} of {x.numel()})"
            )
        num_sequences = x.shape[0] if x.dim() == 3 else 1
        x_TH = x.reshape(-1, cfg.hidden_size)
        step = self.moe_step

        # 1. route: fp32 scores, top-k ids and weights, balance losses over the real tokens
        valid_T = self._real_tokens(step, x_TH.shape[0])
        global_counts = step.global_counts if step is not None else None
        route = self.router(x_TH, num_sequences, valid_T, global_counts)
        aux_total = route.aux_loss + route.z_loss
        if torch.is_grad_enabled() and aux_total.requires_grad:
            # the step's scale: a trainer backpropagating loss / A over A micro-batches gives them 1 / A. Attached
            # to the tokens the routed path takes, before it: under torch.compile a graph break inside that path
            # (the torch backend's host-sized expert loop) ran what followed it without the losses' gradient
            scale = step.aux_loss_scale if step is not None else 1.0
            x_TH = _AttachAuxLoss.apply(x_TH, aux_total, scale)
        # 2.-4. padding-free plan(s), rows to their experts, grouped SwiGLU, weighted sum back per token, and the
        # shared experts (moe/routed.py: the one composition of these, and what overlaps what). Under autocast the
        # rows move and multiply in the autocast dtype: an fp32 residual stream would otherwise drag the grouped
        # GEMMs (which autocast does not see) into fp32 (measured: docs/architecture.md, "Measured reasons").
        if torch.is_autocast_enabled(x.device.type):
            x_TH = x_TH.to(torch.get_autocast_dtype(x.device.type))
        out_TH, num_dropped = routed_and_shared(self, x_TH, route, step.casts if step is not None else None)
        self.last_stats = {
            "aux_loss": route.aux_loss.detach(),
            "z_loss": route.z_loss.detach(),
            "tokens_per_expert": route.counts_E,
            "real_tokens_per_expert": route.real_counts_E,
            "num_dropped": num_dropped,
        }
        if step is not None:
            step.stats = self.last_stats
        return out_TH.view(x.shape)

    def set_overlap(self, mode: str, chunks: int = 2) -> None:
        """What overlaps the dispatcher's all-to-alls (moe/routed.py's docstring): "off", "shared" or "chunks"."""
        if mode not in OVERLAP_MODES:
            raise ValueError(f"ep_overlap ({mode!r}) must be one of {', '.join(OVERLAP_MODES)}")
        if chunks < 1:
            raise ValueError(f"ep_chunks ({chunks}) must be >= 1")
        if mode == "chunks" and self.cfg.capacity_factor is not None:
            raise ValueError(
                "ep_overlap='chunks' routes each chunk of a layer's tokens by a plan of its own, so a capacity factor "
                f"({self.cfg.capacity_factor}) would drop by chunk: use dropless routing (no capacity factor) or "
                "ep_overlap='shared'"
            )
        self.overlap_mode, self.overlap_chunks = mode, chunks

    def _real_tokens(self, step: LayerStep | None, num_tokens: int) -> torch.Tensor | None:
        """The step's real-token mark of this forward's ``num_tokens`` tokens (None: all are real)."""
        if step is None or step.real_tokens is None:
            return None
        real = step.real_tokens if self.local_positions is None else self.local_positions(step.real_tokens)
        valid_T = real.reshape(-1)
        if valid_T.shape[0] != num_tokens:
            raise ValueError(
                f"the optimizer step's real-token mask covers {valid_T.shape[0]} positions but this MoE layer routes "
                f"{num_tokens} tokens: pass MoEStep.set_real_tokens the targets' mask of the micro-batch being run"
            )
        return valid_T.to(torch.bool)

    def extra_repr(self) -> str:
        cfg = self.cfg
        return (
            f"experts={cfg.num_experts}, top_k={cfg.top_k}, hidden={cfg.hidden_size}, ffn={cfg.ffn_hidden_size}, "
            f"shared={cfg.num_shared_experts}, capacity_factor={cfg.capacity_factor}, dispatcher={cfg.dispatcher}"
            + (", fp8=experts" if cfg.fp8 == "experts" else "")
        )
