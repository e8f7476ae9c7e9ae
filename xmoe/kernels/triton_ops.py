"""The Triton backend of xmoe's MoE ops (same signatures and semantics as reference.py), plus the fused path.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows (expert-major)

  gather_rows(x_TH, token_ids_N, row_of_slot_TK) -> x_NH                              permute.py
  combine_rows(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK) -> out_TH   combine.py
  grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E) -> y_NH
  moe_experts(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
              w1_EHF, w3_EHF, w2_EFH) -> out_TH
      == combine_rows(grouped_swiglu(gather_rows(x_TH, ...), ...), weights_TK, ...), fused: the up GEMM reads
      x_TH rows by token id (no (N, H) dispatch buffer), y and dx are made and summed per token one column chunk
      of H at a time, the combine weights enter the SwiGLU backward pass (y is never saved).
Both experts ops are experts_fn.ExpertsFn with the bf16 GEMM set (gemm_sets.Bf16Gemms: grouped_gemm.py's kernels,
the weight gradients by grouped_wgrad.py); experts_fn.py says what each stage computes, saves and frees. They take
how their kernels compute as keyword arguments, the kernels section's values (``wgrad``: kernels.wgrad;
``autotune``: kernels.autotune), which a layer passes from the Kernels value it was built with (choice.py).

Every op is a torch.autograd.Function over torch.library custom ops, so torch.compile treats the kernels as
opaque calls and traces the code around them.
"""

from __future__ import annotations

from xmoe.kernels.accumulate import accumulate_grad as accumulate_grad
from xmoe.kernels.combine import combine_rows
from xmoe.kernels.experts_fn import column_chunks as column_chunks
from xmoe.kernels.experts_fn import experts
from xmoe.kernels.permute import gather_rows
from xmoe.kernels.router_topk import router_topk, router_topk_supports

__all__ = ["combine_rows", "gather_rows", "grouped_swiglu", "moe_experts", "router_topk", "router_topk_supports"]


def moe_experts(
    x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH,
    *, wgrad: str = "auto", autotune: bool = False,
):  # fmt: skip
    """Routed SwiGLU experts with gather and combine fused in: out[t] = sum_k w[t,k] * expert_{e(t,k)}(x[t])."""
    return experts(
        None, wgrad, autotune, x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
        w1_EHF, w3_EHF, w2_EFH, None, None,
    )  # fmt: skip


def grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, *, wgrad: str = "auto", autotune: bool = False):
    """Per expert e: (silu(x w1_e) * (x w3_e)) w2_e over its rows."""
    return experts(
        None, wgrad, autotune, x_NH, None, None, None, None, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH, None, None
    )
