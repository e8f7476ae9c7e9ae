"""What the trainer applies to a built model from outside, after parallelism: activation recompute and regional
compilation.

Regions, not the whole model: each block's two residual branches (``Block.attn_branch``, ``Block.ffn_branch``) and
the loss head (``Transformer._loss_sum``: head projection + fp32 cross-entropy; ``Transformer._chunk_ce``: one token
chunk's cross-entropy and logit gradient, model/loss.py) are compiled
one by one. Blocks of one kind share the compiled code, so compile time does not grow with depth; module calls,
parallelism hooks (DDP, FSDP2) and recompute checkpoints stay eager around the compiled regions. What the compiler
gains is fusion of the elementwise work between the GEMMs: RMSNorm and its fp32 casts, rotary embedding, residual
adds, the router's fp32 softmax / top-k / balance losses, the SwiGLU of dense and shared FFNs, the cast and
log-sum-exp of the logits (docs/training-speed.md has the measurements).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from xmoe.config import COMPILE_MODES, RECOMPUTE_MODES
from xmoe.model.transformer import Block, Transformer

log = logging.getLogger(__name__)


def blocks(model: nn.Module) -> list[Block]:
    """Every transformer block of ``model`` (found by type: wrappers applied from outside rename modules)."""
    return [m for m in model.modules() if isinstance(m, Block)]


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Recompute in backward what ``mode`` names instead of keeping it: "none", "moe" (the FFN branch of every MoE
    block: router, experts, shared experts; the block's input is kept) or "full" (every block; its input is
    kept). Losses and gradients are those of "none" (tests/test_regions.py)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute ({mode!r}) must be one of {', '.join(RECOMPUTE_MODES)}")
    for block in blocks(model):
        block.recompute = mode


def should_compile(setting: str, device: torch.device, ep: int = 1, tp: int = 1) -> bool:
    """``setting`` "on"/"off" as said; "auto": on for GPUs unless experts or heads are sharded (EP / TP add
    collectives with host-read split sizes inside the MoE branch, which would split its graph)."""
    if setting not in COMPILE_MODES:
        raise ValueError(f"compile ({setting!r}) must be 'auto', 'on' or 'off'")
    if setting != "auto":
        return setting == "on"
    return device.type == "cuda" and ep == 1 and tp == 1


def apply_compile(model: Transformer, fullgraph: bool = False) -> None:
    """torch.compile each block's branches and the model's loss head, in place (bound methods replaced). The MoE
    layers' kernels are a frozen value each was built with (xmoe/kernels/choice.py), which the compiled regions
    take as constants.

    ``fullgraph=True`` makes a graph break an error (the tests use it; training leaves it off, so that an
    unsupported combination such as the CPU torch backend's host-sized expert loop still runs, split in two)."""
    for block in blocks(model):  # the compiled callables replace the bound methods on the instances
        block.attn_branch = torch.compile(block.attn_branch, fullgraph=fullgraph)  # type: ignore[method-assign]
        block.ffn_branch = torch.compile(block.ffn_branch, fullgraph=fullgraph)  # type: ignore[method-assign]
    model._loss_sum = torch.compile(model._loss_sum, fullgraph=fullgraph)  # type: ignore[method-assign]
    model._chunk_ce = torch.compile(model._chunk_ce, fullgraph=fullgraph)  # type: ignore[method-assign]
    log.info("compiled %d blocks' attention and FFN branches and the loss head", len(blocks(model)))
