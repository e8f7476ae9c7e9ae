"""Tensor parallelism for attention and the dense FFN, through torch's DTensor tensor-parallel API.

# tp tensor-parallel degree, n_h heads, H hidden, F_d dense FFN width, T tokens of a micro-batch (B sequences of S
# positions), b bytes per element

``apply_tensor_parallel(model, dims)`` splits, over the "tp" axis of ParallelDims (Megatron's layout):
  attention   wq, wk, wv   ColwiseParallel: rank t holds heads [t*n_h/tp, (t+1)*n_h/tp) (rows of each (H, H) weight)
              wo           RowwiseParallel: the matching input columns; the partial outputs are all-reduced
  dense FFN   w1, w3       ColwiseParallel: F_d/tp columns of the hidden layer
              w2           RowwiseParallel: all-reduce of the partial outputs
The multi-token-prediction blocks (xmoe/model/mtp.py) are split as the layers' are; their modules' projection and
norms stay replicated. Everything else stays replicated over TP: embedding, norms, LM head and the MoE blocks
(``ssmb.py`` shards the MoE blocks' tokens instead). The residual stream between those modules is a plain tensor,
identical on every TP rank, and so is its gradient: a colwise projection's input gradient is a partial sum over the
heads (or F columns), which ColwiseParallel all-reduces in backward. Replicated parameters computed on replicated
activations therefore get identical gradients on all TP peers and need no reduction over "tp".

Collectives per layer (bytes each rank sends, ring algorithm): forward one all-reduce of the attention output and one
of the dense FFN output, 2*b*T*H*(tp-1)/tp each; backward the same two, on the input gradients. Without sequence
parallelism (the default; the layout below is opt-in) norms and the inputs of the colwise projections are full size
on every rank, which is what ``xmoe.plan.memory`` models (``terms.attention_activations``: qkv_input full, q/k/v
and the attention output 1/tp).

Mesh. The "tp" axis of ``dims.dense_mesh`` ("dp_ep", "tp"), not of ``dims.mesh``: FSDP2 shards TP weights over the
"dp_ep" axis of the same mesh and requires both axes to share a parent mesh (the ranks are the same either way).

Sequence parallelism (``sequence_parallel=True``, Megatron-SP / torchtitan's layout). The residual stream is
sharded over the sequence instead of replicated: each rank holds positions [t*S/tp, (t+1)*S/tp) of every sequence.
  embedding        replicated lookup, output sliced to this rank's positions (backward: one all-gather)
  norms            SequenceParallel: on this rank's positions; weights are Replicate DTensors whose gradients
                   are Partial (sums over positions), reduced over "tp" by FSDP2 before its reduce-scatter
  attention        its input all-gathered (PrepareModuleInput), colwise q/k/v as above, wo reduce-scatters its
                   output over the sequence (RowwiseParallel(output_layouts=Shard(1))) instead of all-reducing it
  dense FFN        the same: all-gather in, reduce-scatter out
  MoE blocks       already on this rank's tokens: SSMB for free (``ssmb.apply_ssmb(sequence_parallel=True)`` is
                   applied here, for the TP reduction of the router / expert gradients, with no collective)
  final norm       SequenceParallel, then all-gathered: the LM head and loss run replicated on all tokens
Collectives per layer: the all-reduce after wo (and after w2) becomes a reduce-scatter plus the next sub-block's
all-gather, the same bytes; the MoE block's SSMB scatter / gather disappear. Norm activations and the residual
stream fall tp-fold too. Needs seq_len divisible by tp; the balance loss then sees partial sequences (see ssmb.py).
``xmoe.plan.memory`` models the layout without it.

Checkpoints. TP weights are DTensors with their global shapes and names (``layers.0.attn.wq.weight`` (H, H)), so
DCP saves and reloads them under any other TP degree or into one plain process, like the expert weights under EP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import nn

from xmoe.config import ModelConfig
from xmoe.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from xmoe.model.transformer import Block

ATTENTION_PLAN = {"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise"}
DENSE_FFN_PLAN = {"ffn.w1": "colwise", "ffn.w3": "colwise", "ffn.w2": "rowwise"}


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """The model-shape conditions of TP degree ``tp`` (ValueError naming the value and the fix)."""
    if tp < 1:
        raise ValueError(f"tp ({tp}) must be >= 1")
    if cfg.attention == "mla":
        raise ValueError(
            "attention='mla' has no tensor-parallel plan yet (its latent projections are not split by heads); "
            "use tp=1 with expert and data parallelism"
        )
    if cfg.qk_norm != "none" and tp > 1:
        # "proj" normalises whole projections that tp splits; "head" norms' weights would see only this rank's
        # heads and need a gradient all-reduce over tp that the plan does not install
        raise ValueError(
            f"qk_norm={cfg.qk_norm!r} has no tensor-parallel plan yet (its norm weights are shared by heads that tp "
            "splits over ranks); use tp=1 with expert and data parallelism"
        )
    if cfg.num_heads % tp:
        divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
        raise ValueError(
            f"num_heads ({cfg.num_heads}) must be divisible by tp ({tp}): each TP rank computes num_heads / tp "
            f"heads; choose tp among {divisors}"
        )
    if cfg.kv_heads % tp:
        raise ValueError(
            f"num_kv_heads ({cfg.kv_heads}) must be divisible by tp ({tp}): each TP rank holds kv_heads / tp "
            "key/value heads; lower tp"
        )
    if cfg.first_k_dense and cfg.ffn_hidden_size % tp:
        raise ValueError(
            f"the dense FFN width ffn_hidden_size ({cfg.ffn_hidden_size}) must be divisible by tp ({tp}); "
            "change model.ffn_hidden_size or tp"
        )


def tp_mesh(dims: ParallelDims):
    """The 1-D "tp" DeviceMesh that TP weights are placed on (see the module docstring for why dense_mesh's)."""
    if dims.dense_mesh is None:
        raise RuntimeError("call ParallelDims.build_mesh() before applying tensor parallelism")
    return dims.dense_mesh["tp"]


def _style(kind: str, sequence_parallel: bool = False):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # Defaults: colwise takes a replicated input and returns this rank's columns, rowwise takes those columns and
    # returns the all-reduced (replicated) output, or under SP the output reduce-scattered over the sequence (dim 1);
    # all hand back plain tensors, so model code sees no DTensor.
    if kind == "colwise":
        return ColwiseParallel()
    return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()


def _sequence_parallel_plan(block: Block) -> dict:
    """What SP adds to one block's plan: sharded norms, an all-gather in front of attention (and the dense FFN)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    plan = {
        "attn_norm": SequenceParallel(),
        # Attention.forward(x, cos, sin): gather x over the sequence, leave the rotary tables alone
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
        ),
        # an MoE block takes plain local tokens; a dense FFN gathers them first
        "ffn_norm": SequenceParallel(use_local_output=block.is_moe),
    }
    if not block.is_moe:
        plan["ffn"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, *, sequence_parallel: bool = False) -> nn.Module:
    """Split every block's attention (and dense FFN) over "tp" in place; returns the model. A no-op when tp == 1.

    Apply it first (before SSMB, EP and FSDP2), on a model whose weights are identical on every rank (one seed).
    ``sequence_parallel``: shard the residual stream over the sequence too (module docstring); this also applies SSMB.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel, parallelize_module

    if dims.tp == 1:
        return model
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "layers"):
        raise ValueError("apply_tensor_parallel expects an xmoe Transformer (with .cfg and .layers)")
    check_tensor_parallel(cfg, dims.tp)
    if sequence_parallel and cfg.mtp_depth:
        raise ValueError(
            f"sequence parallelism does not run multi-token prediction (model.mtp_depth={cfg.mtp_depth}): its modules "
            "read every position's hidden state and the embeddings of later positions; drop sequence_parallel or "
            "set model.mtp_depth=0"
        )
    mesh = tp_mesh(dims)
    # the layers' blocks, then the multi-token-prediction modules' (their projection stays replicated, as the head)
    layers = cast(nn.ModuleList, model.layers)
    blocks = [*layers, *(module.block for module in getattr(model, "mtp", []))]
    for block in blocks:
        if isinstance(block.attn.wq.weight, DTensor):
            raise ValueError("the model's attention weights are already DTensors: apply tensor parallelism once")
        kinds = dict(ATTENTION_PLAN)
        if not block.is_moe:
            kinds.update(DENSE_FFN_PLAN)
        plan = {name: _style(kind, sequence_parallel) for name, kind in kinds.items()}
        if sequence_parallel:
            plan.update(_sequence_parallel_plan(block))
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        from xmoe.parallel.ssmb import apply_ssmb

        model.register_forward_pre_hook(_check_sequence_split(dims.tp))
        parallelize_module(
            model,
            mesh,
            {
                "embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
                "norm": SequenceParallel(use_local_output=False),
            },
        )
        # the LM head and the loss see every position: gather the final norm's output
        parallelize_module(
            model.norm,  # type: ignore[arg-type]  # an RMSNorm, typed Tensor | Module here
            mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
        )
        apply_ssmb(model, dims, sequence_parallel=True)
    return model


def _check_sequence_split(tp: int):
    def check(module: nn.Module, args: tuple) -> None:
        seq_len = args[0].shape[1]
        if seq_len % tp:
            raise ValueError(
                f"sequence parallelism splits each sequence over tp ({tp}) ranks: seq_len ({seq_len}) "
                f"must be divisible by {tp}"
            )

    return check
