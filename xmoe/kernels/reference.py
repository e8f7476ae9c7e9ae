"""The torch backend of xmoe's MoE ops: the reference every other backend is tested against, and the fallback.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows (expert-major)

Three ops and their composition, one signature per backend (see xmoe/kernels/__init__.py):
  gather_rows(x_TH, token_ids_N, row_of_slot_TK) -> x_NH             rows of the expert buffer
  combine_rows(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK) -> out_TH
                                                                     out[t] = sum_k w[t,k] * y[row[t,k]]
  grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E) -> y_NH
                                                                     per expert: (silu(x w1) * (x w3)) w2
  moe_experts(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1, w3, w2)
                                                                     combine(grouped_swiglu(gather(x))): a backend
                                                                     may fuse it (Triton does: no (N, H) buffers)
and, for the gradients of the routed experts' compute-dtype weight copies:
  accumulate_grad(grad, update, dtype) -> grad + update                into grad, or update in dtype if None

Determinism: gather's backward and combine's forward both sum a token's K rows by looping over k in a fixed
order, so no floating-point atomics are involved anywhere (on CPU each k's step is one index_add_ that writes a
token's row at most once).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def _sum_rows_per_token(
    rows_NH: torch.Tensor, row_of_slot_TK: torch.Tensor, weights_TK=None, sparse: bool | None = None
) -> torch.Tensor:
    """out[t] = sum_k weights[t,k] * rows[row[t,k]] over kept slots, accumulated in fp32, k in order.

    On CPU only the kept slots are read: RBD's tables keep a few of a row's K slots, and reading every (t, k) made
    its CPU ranks copy and multiply K full (T, H) blocks per call. Elsewhere every (t, k) is read with a zero
    weight where dropped, which needs no host sync (``sparse`` forces either). Both add the same numbers in the same
    order; only the dense pass turns a dropped slot's row holding inf or NaN into NaN."""
    num_tokens, top_k = row_of_slot_TK.shape
    acc_TH = torch.zeros(num_tokens, rows_NH.shape[1], dtype=torch.float32, device=rows_NH.device)
    if rows_NH.shape[0] == 0:
        return acc_TH.to(rows_NH.dtype)
    sparse = rows_NH.device.type == "cpu" if sparse is None else sparse
    for k in range(top_k):
        row_T = row_of_slot_TK[:, k]
        kept_T = row_T >= 0
        if sparse:
            t_kept = kept_T.nonzero().squeeze(1)
            vals = rows_NH[row_T[t_kept]].float()
            if weights_TK is not None:
                vals = vals * weights_TK[t_kept, k].float()[:, None]
            acc_TH.index_add_(0, t_kept, vals)  # each token at most once per k: no two writes to one row
            continue
        w_T = kept_T.to(torch.float32) if weights_TK is None else weights_TK[:, k].float() * kept_T
        acc_TH += rows_NH[row_T.clamp(min=0)].float() * w_T[:, None]
    return acc_TH.to(rows_NH.dtype)


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, token_ids_N, row_of_slot_TK):
        ctx.save_for_backward(row_of_slot_TK)
        return x_TH[token_ids_N]

    @staticmethod
    def backward(ctx, grad_NH):
        (row_of_slot_TK,) = ctx.saved_tensors
        return _sum_rows_per_token(grad_NH.contiguous(), row_of_slot_TK), None, None


class CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK):
        ctx.save_for_backward(y_NH, weights_TK, token_ids_N, slot_ids_N)
        return _sum_rows_per_token(y_NH, row_of_slot_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TH):
        y_NH, weights_TK, token_ids_N, slot_ids_N = ctx.saved_tensors
        grad_NH = grad_TH[token_ids_N]  # each kept row sees its token's output gradient
        w_N = weights_TK.reshape(-1)[slot_ids_N]
        grad_y = (grad_NH.float() * w_N[:, None].float()).to(y_NH.dtype)
        grad_w = torch.zeros(weights_TK.numel(), dtype=weights_TK.dtype, device=weights_TK.device)
        grad_w[slot_ids_N] = (grad_NH.float() * y_NH.float()).sum(-1).to(grad_w.dtype)  # dropped slots: 0
        return grad_y, grad_w.view_as(weights_TK), None, None, None


def gather_rows(x_TH, token_ids_N, row_of_slot_TK):
    return GatherRows.apply(x_TH, token_ids_N, row_of_slot_TK)


def combine_rows(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK):
    return CombineRows.apply(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK)


def _probe_cpu_grouped_mm() -> bool:
    """Whether this torch build runs torch._grouped_mm on CPU in fp32, backward included (a tiny call).

    It runs when this module is first imported, where a backend is first resolved (a layer built, or moved to another
    device), which may be inside a caller's no_grad, autocast, or an activation checkpoint, whose saved-tensor hooks
    would count the probe's saved tensors as the forward's (the recompute, importing nothing, then saves fewer and
    checkpoint refuses). So the probe runs with gradients on, autocast off and saved tensors kept plainly, whatever
    its caller set."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with (
            torch.enable_grad(),
            torch.autocast("cpu", enabled=False),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            x = torch.ones(3, 8, requires_grad=True)
            w = torch.ones(2, 8, 8, requires_grad=True)
            torch._grouped_mm(x, w, offs=torch.tensor([1, 3], dtype=torch.int32)).backward(torch.ones(3, 8))
        assert w.grad is not None  # the backward just filled it
        return bool(torch.all(w.grad[1] == 2.0))
    except (RuntimeError, NotImplementedError):
        return False


# Probed at import, not on first use: torch.compile traces the check below as plain constants.
_CPU_GROUPED_MM = _probe_cpu_grouped_mm()


def _grouped_mm_ok(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device and dtype: on CUDA/ROCm its bf16 fast path; on CPU (torch
    builds that have its CPU kernel) fp32 too, about 2x faster in backward than a per-expert loop, whose slices'
    gradients must be stacked into (E, H, F) afterwards."""
    if device_type == "cuda":
        return dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    # torch.compile's fake kernel of _grouped_mm accepts bf16 only, so compiled CPU code takes the slice loop
    return device_type == "cpu" and dtype == torch.float32 and _CPU_GROUPED_MM and not torch.compiler.is_compiling()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (_grouped_mm's backward rejects expanded ones, such as
    the gradient of ``y.sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous_grad(y: torch.Tensor) -> torch.Tensor:
    """y, whose gradient reaches its producer contiguous. Eagerly by a hook on y itself, so that y is not a view: an
    FSDP2-wrapped module returning a view warns (an in-place op on it would skip FSDP2's hooks); compiled code
    keeps the identity Function, which the compiler traces whole."""
    if torch.compiler.is_compiling():
        return _ContiguousGrad.apply(y)
    if y.requires_grad:
        y.register_hook(torch.Tensor.contiguous)
    return y


def grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, *, wgrad: str = "auto", autotune: bool = False):
    """SwiGLU experts over uneven, contiguous row groups (expert e owns tokens_per_expert_E[e] rows). ``wgrad`` and
    ``autotune`` (how the Triton backend's kernels compute) change nothing here: autograd computes every gradient."""
    hidden, ffn = w1_EHF.shape[1], w1_EHF.shape[2]
    aligned = hidden % 8 == 0 and ffn % 8 == 0  # _grouped_mm needs 16-byte aligned strides
    if _grouped_mm_ok(x_NH.device.type, x_NH.dtype) and aligned and x_NH.shape[0] > 0:
        offs_E = torch.cumsum(tokens_per_expert_E, 0).to(torch.int32)
        h1_NF = torch._grouped_mm(x_NH, w1_EHF, offs=offs_E)
        h3_NF = torch._grouped_mm(x_NH, w3_EHF, offs=offs_E)
        return _contiguous_grad(torch._grouped_mm(F.silu(h1_NF) * h3_NF, w2_EFH, offs=offs_E))
    # Loop over contiguous slices: needs the group sizes on the host (one sync; the CPU path does not mind).
    # unbind, not w[e]: indexing one expert's slice makes its backward allocate a zero (E, H, F) gradient per
    # expert (E full-size buffers summed); unbind's backward stacks the E slices into one.
    w1_E, w3_E, w2_E = w1_EHF.unbind(0), w3_EHF.unbind(0), w2_EFH.unbind(0)
    outs = []
    for e, rows_MH in enumerate(torch.split(x_NH, tokens_per_expert_E.tolist())):
        if rows_MH.shape[0]:
            outs.append((F.silu(rows_MH @ w1_E[e]) * (rows_MH @ w3_E[e])) @ w2_E[e])
    if not outs:  # no rows at all: keep the result attached to the weights' graph
        return x_NH.new_zeros(0, hidden) + 0 * (w1_EHF.sum() + w3_EHF.sum() + w2_EFH.sum())
    return torch.cat(outs)


def moe_experts(
    x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH, ops=None,
    *, wgrad: str = "auto", autotune: bool = False,
):  # fmt: skip
    """gather -> grouped SwiGLU -> combine, unfused, through ``ops`` (a backend module; default this one), its
    grouped SwiGLU under ``wgrad`` and ``autotune``."""
    ops = ops or _THIS
    x_NH = ops.gather_rows(x_TH, token_ids_N, row_of_slot_TK)
    y_NH = ops.grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, wgrad=wgrad, autotune=autotune)
    return ops.combine_rows(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK)


_THIS = sys.modules[__name__]


def accumulate_grad(grad: torch.Tensor | None, update: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad + update`` written into ``grad`` (None: ``update`` as a new tensor of ``dtype``): how a weight
    gradient computed in a narrower dtype joins its parameter's .grad."""
    return update.to(dtype) if grad is None else grad.add_(update)
