"""One construction pipeline for every model xmoe runs: the trainer, `xmoe eval / generate / export`, the simulated
rank of `xmoe plan memory --measure`, the benchmarks and the tests.

  1. the model on the meta device: shapes only, nothing allocated; its MoE layers built with the kernel choices
     resolved once for the target device (xmoe/kernels/choice.py: ``Kernels``, from the run's ``KernelConfig``)
  2. parallelism from outside, in the fixed order: TP (attention, dense FFN; tensor.py) -> SSMB (MoE blocks on 1/tp
     of the tokens; ssmb.py) -> EP (experts sliced over "ep", all-to-all dispatch) + FSDP2 (experts over "dp", dense
     weights over "dp_ep"; expert_parallel.py), still on the meta device
  3. ``to_empty``: every rank allocates its own shards and nothing else
  4. initial values from the seed, layout-independent (xmoe/model/init.py: the same global model at any dp x ep x tp),
     then, with ``init_from``, a Hugging Face directory read straight into the local shards (xmoe/hf/checkpoint.py);
     the trainer's ``--resume`` loads DCP shards into them afterwards (xmoe/train/checkpoint.py)
  5. pure data parallelism (several processes, ep = tp = 1): the materialised replica wrapped in DDP
  6. recompute and compiled regions on the blocks (regions.py)
  7. the routed experts' weight path (xmoe/moe/weights.py), chosen here once: a model one process trains computes
     on detached copies whose gradients are added straight into the fp32 .grad, and the fused AdamW writes the
     next step's copies (``BuiltModel.copy_writers``); under DDP, FSDP2 and expert parallelism the copies are
     autograd casts
Apart from a DDP replica, no rank ever holds a whole expert stack or the whole model: beside its shards at most one
generator block (init.py) or one tensor being read (HF) exists at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from xmoe.config import KernelConfig, ModelConfig
from xmoe.kernels.choice import resolve_kernels
from xmoe.model.transformer import Transformer
from xmoe.moe.experts import use_one_process
from xmoe.moe.weights import CopyWriter
from xmoe.parallel import regions
from xmoe.parallel.dims import ParallelDims
from xmoe.parallel.expert_parallel import apply_expert_parallel
from xmoe.parallel.ssmb import apply_ssmb
from xmoe.parallel.tensor import apply_tensor_parallel


@dataclass
class BuiltModel:
    """``model``: the one-device Transformer, parallelised in place (its methods: ``moe_layers``, ``cfg``);
    ``wrapped``: what runs forward and what the optimizer and checkpoints see (DDP around it, or the model itself);
    ``compiled``: whether its blocks run as compiled regions; ``copy_writers``: the (parameter, writer) pairs of the
    routed experts' weights whose next compute copies the fused AdamW writes in its pass (xmoe/train/optim.py:
    build_optimizer takes them; empty unless one process computes in a ``param_dtype``)."""

    model: Transformer
    wrapped: nn.Module
    compiled: bool
    copy_writers: list[tuple[torch.Tensor, CopyWriter]] = field(default_factory=list)


def parallelize(
    model: Transformer,
    dims: ParallelDims | None,
    *,
    sequence_parallel: bool = False,
    ssmb: bool = True,
    fsdp: bool | None = None,
    param_dtype: torch.dtype | None = None,
    ep_overlap: str = "off",
    ep_chunks: int = 2,
) -> bool:
    """Step 2, in place, on meta (or real) tensors. ``fsdp``: None = FSDP2 when experts or heads are sharded (ep or
    tp > 1), True = also under pure data parallelism (ZeRO-3 replicas), False = never. ``param_dtype``: FSDP2's
    compute dtype (bf16 on GPUs). ``ep_overlap`` / ``ep_chunks``: what overlaps the expert-parallel all-to-alls
    (moe/routed.py; "auto" is resolved by the caller). Returns whether the materialised model is to be wrapped in
    DDP (step 5)."""
    if dims is None or dims.world_size == 1:
        return False
    if dims.tp > 1:
        apply_tensor_parallel(model, dims, sequence_parallel=sequence_parallel)
        if ssmb:
            apply_ssmb(model, dims)  # with sequence parallelism, TP already installed the SSMB regions
    if fsdp or (fsdp is None and (dims.tp > 1 or dims.ep > 1)):
        apply_expert_parallel(model, dims, param_dtype=param_dtype, ep_overlap=ep_overlap, ep_chunks=ep_chunks)
        return False
    return dims.tp == dims.ep == 1


def build_model(
    cfg: ModelConfig,
    device: torch.device | str,
    dims: ParallelDims | None = None,
    *,
    seed: int = 0,
    init_from: str | None = None,
    sequence_parallel: bool = False,
    ssmb: bool = True,
    fsdp: bool | None = None,
    param_dtype: torch.dtype | None = None,
    recompute: str = "none",
    compile: str = "off",
    loss_chunk_tokens: int = 4096,
    ep_overlap: str = "off",
    ep_chunks: int = 2,
    kernels: KernelConfig | None = None,
) -> BuiltModel:
    """Steps 1-7 for ``cfg`` on ``device`` (``dims``: a built ParallelDims for several processes, else None).

    ``init_from``: a Hugging Face directory whose weights replace the initial values (``cfg`` must be its
    architecture). ``recompute`` (config.RECOMPUTE_MODES) and ``compile`` (config.COMPILE_MODES): regions.py.
    ``param_dtype``: the parameters' compute dtype (bf16 on GPUs; None: their own): FSDP2's mixed precision, or on
    one process the dtype of the routed experts' copies the optimizer writes (step 7).
    ``kernels``: the run's kernels section (None: the environment's defaults), resolved here once with
    ``cfg.moe.kernel_backend`` for ``device`` into the value every MoE layer, its router, experts and dispatchers are
    built with (xmoe/kernels/choice.py)."""
    device = torch.device(device)
    resolved = resolve_kernels(cfg.moe.kernel_backend, kernels, device) if cfg.has_moe else None
    with torch.device("meta"):
        model = Transformer(cfg, loss_chunk_tokens=loss_chunk_tokens, kernels=resolved)
    ddp = parallelize(
        model,
        dims,
        sequence_parallel=sequence_parallel,
        ssmb=ssmb,
        fsdp=fsdp,
        param_dtype=param_dtype,
        ep_overlap=ep_overlap,
        ep_chunks=ep_chunks,
    )
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    if init_from is not None:
        from xmoe.hf.checkpoint import load_weights

        load_weights(model, init_from)
    wrapped: nn.Module = model
    if ddp:
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        # no buffer broadcast before each forward: the routers' expert_bias stays the same on every rank (each moves
        # it by the same all-reduced loads, xmoe/moe/step.py), and the rotary tables are computed. A newer torch
        # names that forward_sync_buffers (and deprecates broadcast_buffers); it still broadcasts the buffers once
        # here, with the parameters, which changes nothing: every rank built the same values
        device_ids = [device.index] if device.type == "cuda" else None
        if "forward_sync_buffers" in inspect.signature(DDP).parameters:
            wrapped = DDP(model, device_ids=device_ids, forward_sync_buffers=False)
        else:  # an older torch
            wrapped = DDP(model, device_ids=device_ids, broadcast_buffers=False)
    regions.apply_recompute(model, recompute)
    ep, tp = (dims.ep, dims.tp) if dims is not None else (1, 1)
    compiled = regions.should_compile(compile, device, ep, tp)
    if compiled:
        regions.apply_compile(model)
    one_process = dims is None or dims.world_size == 1
    copy_writers = use_one_process(model, param_dtype) if one_process else []
    return BuiltModel(model, wrapped, compiled, copy_writers)
