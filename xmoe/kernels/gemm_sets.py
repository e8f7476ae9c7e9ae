"""The bf16 GEMM set of the routed experts' autograd Function (experts_fn.py), and the engine of the weight
gradients in the activations' dtype, which the FP8 set (fp8_gemm_set.py) uses too unless kernels.wgrad = "fp8".
Both sets carry the choices their GEMMs run under as values (``wgrad``: kernels.wgrad; ``autotune``:
kernels.autotune), handed in by the Function, which has them from the op's caller, and pass them on to the
launchers as arguments: nothing in a backward reads a module-level option.

# T tokens, H hidden, F expert ffn, E experts, N kept rows (expert-major)

Bf16Gemms: the GEMMs of grouped_gemm.py in the activations' dtype (bf16 on GPUs; fp32 under TRITON_INTERPRET=1):
  up          swiglu_up_fwd (x or x[token_ids_N]: the fused path's gather is the up GEMM's row read)
  down        grouped_mm, y = a w2 (a column range of w2 per chunk)
  swiglu_bwd  swiglu_down_bwd: da = g w2^T (g read by token id, or gathered first on the Hopper weight-gradient
              path, where the same gathered rows then feed dW2), then dh1, dh3, w a and the combine weights' gradient
  input_grad  grouped_mm, dx = dh1 w1^T + dh3 w3^T (one column range of w1^T, w3^T per chunk)
RowWgrad: grouped_wgrad.grouped_wgrad, dW2 = (w a)^T g[tok] and dW1, dW3 = x[tok]^T (dh1, dh3) per expert, by the
Triton kernels reading rows by token id or, where grouped_wgrad.wgrad_engine says "grouped_mm" (Hopper, many short
experts), by torch._grouped_mm over rows gathered first: one (N, H) gathered buffer alive at a time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from xmoe.kernels.grouped_gemm import grouped_mm, swiglu_down_bwd, swiglu_up_fwd
from xmoe.kernels.grouped_wgrad import grouped_wgrad, wgrad_engine


def span(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """t's indices start:stop along dim, as a view; t itself where they are all of it."""
    if start == 0 and stop == t.shape[dim]:
        return t
    return t[(slice(None),) * dim + (slice(start, stop),)]


def gathers(
    x: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    counts_E: torch.Tensor,
    num_rows: int,
    hidden: int,
    ffn: int,
    wgrad: str,
) -> bool:
    """Whether the fused backward gathers rows by token id before its weight gradients in the activations' dtype
    (the Hopper engine, grouped_wgrad.wgrad_engine for kernels.wgrad ``wgrad``, takes rows in expert order); the
    grouped path has them so."""
    return token_ids_N is not None and wgrad_engine(x, num_rows, counts_E.shape[0], hidden, ffn, wgrad) == "grouped_mm"


class RowWgrad(NamedTuple):
    """Weight gradients in the activations' dtype (grouped_wgrad). ``gather``: rows gathered by token id first.
    w2_begin / w2_end bracket the moment the backward frees w a (between them nothing of dW2 is alive but the
    result); w13 reads x's rows as the GEMM set gives them (``wgrad_rows``). ``wgrad``, ``autotune``: the
    kernels section's, for grouped_wgrad."""

    counts_E: torch.Tensor
    gather: bool
    wgrad: str
    autotune: bool

    def w2_begin(self, a_w, grad, token_ids_N, g_rows) -> list:
        """dW2 from w a and the output gradient's rows: g_rows as the SwiGLU backward read them, or (None) read
        here, gathered by token id on the Hopper path (freed when this returns)."""
        rows, ids = g_rows if g_rows is not None else self.rows(grad, token_ids_N)
        return [grouped_wgrad(a_w, None, rows, None, ids, self.counts_E, self.wgrad, self.autotune)[0]]

    def w2_end(self, pending: list, grad, token_ids_N) -> tuple[torch.Tensor, None]:
        return pending.pop(), None

    def w13(self, kept, gemms, x, token_ids_N, dh1, dh3) -> tuple[torch.Tensor, torch.Tensor]:
        """(dW1, dW3): one pass over x's rows (two accumulators); gathered rows are freed when this returns."""
        rows, ids = gemms.wgrad_rows(x, token_ids_N, self.gather)
        return grouped_wgrad(rows, ids, dh1, dh3, None, self.counts_E, self.wgrad, self.autotune)

    def rows(self, t: torch.Tensor, token_ids_N: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, row ids) of t as the weight gradients read them: gathered (ids None) or read by token id."""
        return (t.index_select(0, token_ids_N), None) if self.gather and token_ids_N is not None else (t, token_ids_N)


class Bf16Gemms(NamedTuple):
    """The experts' GEMMs in the activations' dtype (module docstring), over the weights w1, w3 (E, H, F) and
    w2 (E, F, H) themselves, under kernels.wgrad ``wgrad`` and kernels.autotune ``autotune``; the stage methods are
    experts_fn.py's."""

    w1_EHF: torch.Tensor
    w3_EHF: torch.Tensor
    w2_EFH: torch.Tensor
    wgrad: str
    autotune: bool

    @property
    def quantum(self) -> int:
        return 1  # column chunks of y and dx may start anywhere

    @property
    def hidden(self) -> int:
        return self.w1_EHF.shape[1]

    @property
    def ffn(self) -> int:
        return self.w1_EHF.shape[2]

    def saved(self) -> tuple[torch.Tensor, ...]:
        return self.w1_EHF, self.w3_EHF, self.w2_EFH

    def rows_in(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def up(self, x, token_ids_N, counts_E, store_h) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return swiglu_up_fwd(x, token_ids_N, self.w1_EHF, self.w3_EHF, counts_E, store_h, self.autotune)

    def down(self, a, counts_E, c0: int, c1: int) -> torch.Tensor:
        return grouped_mm(a, span(self.w2_EFH, 2, c0, c1), None, None, counts_E, self.autotune)

    def grad_rows(self, grad: torch.Tensor, fused: bool) -> torch.Tensor:
        # the grouped path's kernels make their own operands contiguous where they need it
        return grad.contiguous() if fused else grad

    def swiglu_bwd(self, grad, token_ids_N, h1, h3, row_w_N, counts_E, reuse, gather):
        # gathered: the same rows then feed dW2
        g_rows = RowWgrad(counts_E, gather, self.wgrad, self.autotune).rows(grad, token_ids_N)
        dh1, dh3, a_w, grad_w_N = swiglu_down_bwd(*g_rows, self.w2_EFH, h1, h3, row_w_N, counts_E, reuse, self.autotune)
        return dh1, dh3, a_w, grad_w_N, (dh1, dh3), g_rows

    def input_grad(self, dh, counts_E, c0: int, c1: int) -> torch.Tensor:
        w1t, w3t = (span(w.transpose(1, 2), 2, c0, c1) for w in (self.w1_EHF, self.w3_EHF))
        return grouped_mm(dh[0], w1t, dh[1], w3t, counts_E, self.autotune)

    def wgrad_rows(self, x, token_ids_N, gather: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return (x.index_select(0, token_ids_N), None) if gather and token_ids_N is not None else (x, token_ids_N)

    def weight_grads(self, x, token_ids_N, counts_E, num_rows: int) -> RowWgrad:
        gather = gathers(x, token_ids_N, counts_E, num_rows, self.hidden, self.ffn, self.wgrad)
        return RowWgrad(counts_E, gather, self.wgrad, self.autotune)
