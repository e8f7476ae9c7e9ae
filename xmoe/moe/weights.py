"""The routed experts' weights as training computes with them: one owner per RoutedExperts (``ExpertWeights``).

# E experts held by this module, H hidden, F expert ffn

It holds together what one step does with the expert weights:
  masters    the module's parameters w1, w3, w2 (fp32), which checkpoints, state_dict, FSDP2 and expert
             parallelism see as they always were; read from the module at each call (wrappers swap them)
  copies     what the step's GEMMs read: the weights in the compute dtype (bf16), or FP8 experts' FP8 copies with
             their 128 x 128 block scales (fp8_quant.Fp8ExpertWeights), made once when an optimizer step opens
             (``step_copies``, called by xmoe/moe/step.py's MoEStep) or per forward outside one (``compute``,
             ``compute_fp8``)
  gradients  each copy's gradient reaches the fp32 master's .grad
  refresh    the one method the fused AdamW (xmoe/train/optim.py: TritonAdamW) calls per weight it updates: its pass
             writes the weight's next copy beside the update, and that copy waits for the next step

Two paths, properties of the weights chosen once, when the model is built (xmoe/parallel/build.py calls
``use_one_process`` on one process; everything else keeps the default):
  autograd   (default: DDP, FSDP2, expert parallelism, a layer used alone) the step's copies are autograd casts of
             the parameters (``w.to(dtype)``), whose gradients flow back through the cast, so wrappers that reduce
             through autograd hooks see them; DTensors (FSDP2, expert parallelism) are cast per forward, where the
             wrappers' hooks have gathered them
  detached   (one process) the step's copies are leaves of their own; each backward adds a copy's gradient
             straight into the fp32 .grad (one mixed-dtype pass of the kernel backend's ``accumulate_grad``, 10
             bytes per weight, where autograd's cast-back and fp32 accumulation take two passes, 18 bytes: measured
             in docs/architecture.md, "Measured reasons"). FP8 copies' gradients come back through zero-stride
             stand-ins the same way. With a copy dtype the optimizer receives (parameter, ``CopyWriter``) pairs at
             build time and writes the next step's copies in its own pass (4 bytes read and 2 written per weight
             saved at each step's start)

The rule for a copy the optimizer wrote: the next step opened with gradients on takes it, once; an optimizer step
writing a new one drops one not taken; FP8 copies are taken only where every weight of a side-by-side pair was
written by the same optimizer step. Whatever else changes the weights must drop the copies waiting
(``invalidate``): ``load_state_dict`` does (a load hook of RoutedExperts), as does ``reset_parameters`` and the
build's choice of path; an in-place edit of your own (``w.mul_()`` under no_grad, a write through ``.data``) must
call ``invalidate()`` itself, or the next step computes with the weights as the optimizer left them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from xmoe.kernels.fp8_quant import BlockCopies, BlockCopy, Fp8ExpertWeights

NAMES = ("w1", "w3", "w2")
# FP8 copies lie side by side in groups (fp8_quant.quantize_block_pair's layout): (w1, w3) and (w2,)
_FP8_GROUPS = {"w1": ("w1", "w3"), "w3": ("w1", "w3"), "w2": ("w2",)}

Update = Callable[["torch.Tensor | BlockCopy"], None]  # the optimizer's pass for one weight, writing the copy given


@dataclass(frozen=True)
class CopyWriter:
    """What the fused AdamW holds for one weight whose copy it writes (paired with the parameter at build time):
    ``writer(update)`` calls ``update(target)`` once, where ``target`` is the copy's new storage (a tensor of the
    copy dtype, or an fp8_quant.BlockCopy), and keeps the written copy for the next step. ``kind``: what it writes
    ("bf16", "FP8", ...), for the run's header."""

    refresh: Callable[[Update], None]
    kind: str

    def __call__(self, update: Update) -> None:
        self.refresh(update)


class Masters(Protocol):
    """What holds the fp32 masters: RoutedExperts (xmoe/moe/experts.py), whose parameters they are."""

    @property
    def w1(self) -> torch.Tensor: ...

    @property
    def w3(self) -> torch.Tensor: ...

    @property
    def w2(self) -> torch.Tensor: ...


def _local(w: torch.Tensor) -> torch.Tensor:
    """Under expert parallelism the weights are DTensors sharded over the EP ranks: compute on this rank's slice."""
    return w.to_local() if hasattr(w, "to_local") else w


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


class ExpertWeights:
    """The weights of ``experts`` (a RoutedExperts: its parameters w1, w3, w2 are the masters) as a step computes
    with them, on the autograd path until ``use_one_process`` (the module docstring). ``fp8``: the experts' GEMMs
    read FP8 copies."""

    def __init__(self, experts: Masters, fp8: bool):
        self._experts = experts
        self.fp8 = fp8
        self._detached = False
        self._copy_dtype: torch.dtype | None = None
        self._fp8_format: str | None = None  # the format of the FP8 copies it writes
        self._waiting: dict[str, torch.Tensor] = {}  # by weight name: copies written by the last optimizer step
        # FP8: by group, the group's copies and the names of the members written into them
        self._waiting_fp8: dict[tuple[str, ...], tuple[BlockCopies, set[str]]] = {}

    @property
    def detached(self) -> bool:
        """Whether the weights are on the one-process path (``use_one_process``; else autograd casts)."""
        return self._detached

    @property
    def copy_dtype(self) -> torch.dtype | None:
        """The dtype of the bf16 experts' copies the optimizer writes (None: it writes none)."""
        return self._copy_dtype

    def masters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2): the module's parameters as they are now."""
        e = self._experts
        return e.w1, e.w3, e.w2

    # ------------------------------------------------------------------------------------ the build's choice

    def use_one_process(self, copy_dtype: torch.dtype | None) -> list[tuple[torch.Tensor, CopyWriter]]:
        """Take the detached path (one process; the build calls this once). Returns the (parameter, writer) pairs
        of the weights whose next copies the fused AdamW is to write with its update: with ``copy_dtype``, those
        of another dtype (bf16 experts), or FP8 experts' contiguous fp32 weights (their FP8 copies, in the format
        of their device); none without it."""
        self._detached, self._copy_dtype, self._fp8_format = True, None, None
        self.invalidate()
        params = self.masters()
        if copy_dtype is None or any(hasattr(w, "to_local") for w in params):
            return []
        if self.fp8:
            if not all(w.dtype == torch.float32 and w.is_contiguous() for w in params):
                return []
            from xmoe.kernels.fp8_quant import fp8_format  # imports triton: only for FP8 experts

            self._fp8_format = fp8_format(params[0].device).name
            written, kind = list(zip(NAMES, params, strict=True)), "FP8"
        else:
            written = [(n, w) for n, w in zip(NAMES, params, strict=True) if w.dtype != copy_dtype]
            kind = _dtype_name(copy_dtype)
        self._copy_dtype = copy_dtype
        return [(w, CopyWriter(functools.partial(self.refresh, n), kind)) for n, w in written]

    # ----------------------------------------------------------------------------------------- the optimizer

    def refresh(self, name: str, update: Update) -> None:
        """The fused AdamW's call for weight ``name`` it updates: ``update(target)`` writes the updated weight and
        its next copy into ``target``, a new tensor of the copy dtype or, for FP8 experts, a view of its group's
        new FP8 buffers (fp8_quant.BlockCopy; the first member written in a step makes them). The copy waits
        for the next step; the one it replaces, not taken, is dropped."""
        w = getattr(self._experts, name)
        if self.fp8:
            from xmoe.kernels.fp8_quant import BlockCopies

            group = _FP8_GROUPS[name]
            entry = self._waiting_fp8.get(group)
            if entry is None or name in entry[1]:  # a new step's copies: the old ones were not taken
                assert self._fp8_format is not None  # set with the writers (use_one_process)
                entry = (BlockCopies.empty(w.shape, len(group), self._fp8_format, w.device), set())
                self._waiting_fp8[group] = entry
            update(entry[0].member(group.index(name)))
            entry[1].add(name)
            return
        assert self.copy_dtype is not None  # set with the writers (use_one_process)
        self._waiting.pop(name, None)
        copy = torch.empty(w.shape, dtype=self.copy_dtype, device=w.device)
        update(copy)
        self._waiting[name] = copy

    def invalidate(self) -> None:
        """Drop the copies waiting for the next step: the weights changed outside the optimizer's pass."""
        self._waiting.clear()
        self._waiting_fp8.clear()

    def waiting(self, name: str) -> torch.Tensor | None:
        """The bf16 (copy dtype) copy of weight ``name`` waiting for the next step, or None."""
        return self._waiting.get(name)

    def num_waiting(self) -> int:
        """How many weights have a copy waiting for the next step."""
        return len(self._waiting) + sum(len(written) for _, written in self._waiting_fp8.values())

    # --------------------------------------------------------------------------------------------- the step

    def step_copies(self, dtype: torch.dtype, ops: ModuleType) -> tuple | None:
        """The copies one optimizer step's micro-batches share, made when it opens (their weights do not change
        within it); None for DTensors, cast per forward. ``ops``: the kernel backend's, whose ``accumulate_grad``
        adds the detached copies' gradients into the fp32 .grad.

        bf16: (w1, w3, w2) in ``dtype``: autograd casts, or on the detached path (a dtype other than the
        parameters') leaves of their own, the optimizer's copies where they wait. FP8: the gradient receivers
        (the parameters, or on the detached path zero-stride stand-ins of dtype ``dtype``: no memory, the FP8 GEMMs
        never read them) and the Fp8ExpertWeights (the optimizer's where written, else one quantising pass)."""
        params = self.masters()
        if any(hasattr(w, "to_local") for w in params):
            return None
        if self.fp8:
            from xmoe.kernels.fp8_quant import fp8_format

            receivers = tuple(_leaf_into(w, _stand_in(w, dtype), ops) for w in params) if self.detached else params
            fmt = fp8_format(params[0].device).name
            return (*receivers, self._take_fp8(fmt) or self.compute_fp8(fmt)[3])
        if self.detached and dtype != params[0].dtype:
            return tuple(_leaf_into(w, self._take(n, w, dtype), ops) for n, w in zip(NAMES, params, strict=True))
        return tuple(w.to(dtype) for w in params)

    def compute(self, dtype: torch.dtype, copies: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """(w1, w3, w2) of the experts on this rank in ``dtype``. ``copies`` (the step's, ``step_copies``) serve
        every call with gradients on (the micro-batches of one step): the gradients of all of them reach the fp32
        parameters through the one copy."""
        if copies is not None and not self.fp8 and copies[0].dtype == dtype and torch.is_grad_enabled():
            return copies
        return tuple(_local(w).to(dtype) for w in self.masters())

    def compute_fp8(self, fmt: str, copies: tuple | None = None) -> tuple:
        """(w1, w3, w2, Fp8ExpertWeights): what the FP8 GEMMs read and the tensors their weight gradients are
        returned for; ``copies`` (the step's) serve every call with gradients on, else the weights are quantised
        here."""
        from xmoe.kernels.fp8_quant import quantize_expert_weights  # imports triton: only when FP8 is asked for

        if copies is not None and self.fp8 and torch.is_grad_enabled():
            return copies
        w1, w3, w2 = (_local(w) for w in self.masters())
        return w1, w3, w2, quantize_expert_weights(w1.detach(), w3.detach(), w2.detach(), fmt)

    def _take(self, name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` in ``dtype``, detached: the optimizer's copy where one waits in that dtype, else a cast."""
        copy = self._waiting.pop(name, None)
        return copy if copy is not None and copy.dtype == dtype else weight.detach().to(dtype)

    def _take_fp8(self, fmt: str) -> Fp8ExpertWeights | None:
        """The FP8 copies the last optimizer step wrote, if it wrote every weight's in format ``fmt``; else None
        (quantise them). Handed out once."""
        up, down = self._waiting_fp8.pop(("w1", "w3"), None), self._waiting_fp8.pop(("w2",), None)
        if self._fp8_format != fmt or up is None or down is None or not {"w1", "w3"} <= up[1] or "w2" not in down[1]:
            return None
        from xmoe.kernels.fp8_quant import Fp8ExpertWeights

        return Fp8ExpertWeights.of(up[0], down[0])


def _stand_in(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of param's shape holding one element (zero strides): a leaf to receive gradients for param."""
    return torch.zeros((), dtype=dtype, device=param.device).expand(param.shape)


def _leaf_into(param: torch.Tensor, leaf: torch.Tensor, ops: ModuleType) -> torch.Tensor:
    """leaf as an autograd leaf of its own whose gradient each backward adds into param's .grad (by the kernel
    backend's ``accumulate_grad``)."""
    leaf.requires_grad_(param.requires_grad)
    if param.requires_grad:
        leaf.register_post_accumulate_grad_hook(functools.partial(_accumulate_fp32, param, ops))
    return leaf


def _accumulate_fp32(param: torch.Tensor, ops: ModuleType, copy: torch.Tensor) -> None:
    """Add a compute-dtype copy's gradient into its fp32 parameter's .grad (one mixed-dtype pass) and drop it."""
    assert copy.grad is not None  # a post-accumulate-grad hook runs once the gradient is there
    param.grad = ops.accumulate_grad(param.grad, copy.grad, param.dtype)
    copy.grad = None
