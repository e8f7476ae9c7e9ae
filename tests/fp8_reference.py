"""float64 references of the FP8 quantisers and of the FP8 experts (xmoe/kernels/fp8_*.py), written independently
of the kernels: torch's own FP8 casts for the rounding, float64 quotients for the scales, per-expert loops.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows; G = 128
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xmoe.kernels.fp8_quant import FORMATS

G = 128


def group_scale(amax: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax / max, max / amax) rounded to fp32, amax floored at fp32's 1e-30 (float64 quotients of fp32 values
    rounded once more to fp32 are the correctly rounded fp32 quotients)."""
    amax = amax.float().clamp(min=1e-30).double()
    fmax = FORMATS[fmt].max
    return (amax / fmax).float(), (fmax / amax).float()


def to_grid(x: torch.Tensor, inv: torch.Tensor, fmt: str) -> torch.Tensor:
    """x * inv in fp32 (one rounding), then rounded to the format's values by torch's conversion, as float64."""
    return (x.float() * inv).to(FORMATS[fmt].dtype).double()


def quantize_rows(x_RC: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): 1 x G groups along each row."""
    x = x_RC.float()
    rows, cols = x.shape
    groups = -(-cols // G)
    q = torch.empty(rows, cols, dtype=torch.float64, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float64, device=x.device)
    for g in range(groups):
        block = x[:, g * G : (g + 1) * G]
        s, inv = group_scale(block.abs().amax(1) if block.numel() else x.new_zeros(rows), fmt)
        scale[:, g] = s.double()
        q[:, g * G : (g + 1) * G] = to_grid(block, inv[:, None], fmt)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double().repeat_interleave(G, dim=1)[:, : q.shape[1]]


def quantize_cols(rows_N: torch.Tensor, counts_E: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_CP, scale_JC) of expert-major rows in G x 1 groups down each column, every expert's rows starting a new
    group (its last one zero-padded to G rows): group j's rows are columns j*G .. j*G + G - 1 of q, in expert
    order. Only the groups that hold rows (the kernel's layout also has unwritten slots past them)."""
    qs, scales, start = [], [], 0
    for n in counts_E.tolist():
        for g0 in range(0, n, G):
            block = rows_N[start + g0 : start + min(g0 + G, n)].T  # (C, rows of the group)
            padded = block.new_zeros(block.shape[0], G, dtype=torch.float32)
            padded[:, : block.shape[1]] = block.float()
            q, s = quantize_rows(padded, fmt)  # one 1 x G group per column of the rows
            qs.append(q)
            scales.append(s[:, 0])
        start += n
    cols = rows_N.shape[1]
    if not qs:
        return rows_N.new_zeros(cols, 0, dtype=torch.float64), rows_N.new_zeros(0, cols, dtype=torch.float64)
    return torch.cat(qs, 1), torch.stack(scales)


def dequantize_cols(q_CP: torch.Tensor, scale_JC: torch.Tensor) -> torch.Tensor:
    """The (C, P) values of quantize_cols' layout (q times its group's scale)."""
    return q_CP.double() * scale_JC.double().T.repeat_interleave(G, dim=1)


def quantize_blocks(w_ERC: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): G x G blocks of each expert's matrix."""
    w = w_ERC.float()
    experts, rows, cols = w.shape
    q = torch.empty(experts, rows, cols, dtype=torch.float64, device=w.device)
    scale = torch.empty(experts, -(-rows // G), -(-cols // G), dtype=torch.float64, device=w.device)
    for i in range(scale.shape[1]):
        for j in range(scale.shape[2]):
            block = w[:, i * G : (i + 1) * G, j * G : (j + 1) * G]
            s, inv = group_scale(block.abs().amax(dim=(1, 2)), fmt)
            scale[:, i, j] = s.double()
            q[:, i * G : (i + 1) * G, j * G : (j + 1) * G] = to_grid(block, inv[:, None, None], fmt)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape[1:]
    full = scale.double().repeat_interleave(G, dim=1).repeat_interleave(G, dim=2)
    return q.double() * full[:, :rows, :cols]


def fake_quant_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return dequantize_rows(*quantize_rows(x, fmt))


def fake_quant_blocks(w: torch.Tensor, fmt: str) -> torch.Tensor:
    return dequantize_blocks(*quantize_blocks(w, fmt))


def _per_expert(rows_N, weights_E, counts_E):
    """rows_N[rows of e] @ weights_E[e] for every expert e (float64)."""
    out, start = [], 0
    for e, n in enumerate(counts_E.tolist()):
        out.append(rows_N[start : start + n] @ weights_E[e])
        start += n
    return torch.cat(out) if out else rows_N.new_zeros(0, weights_E.shape[2])


def _per_expert_wgrad(a_N, b_N, counts_E):
    out, start = [], 0
    for n in counts_E.tolist():
        out.append(a_N[start : start + n].T @ b_N[start : start + n])
        start += n
    return torch.stack(out)  # (E, ., .): every expert, rows or not


def _combine(rows_N, row_of_slot_TK, weights_TK=None):
    num_tokens, top_k = row_of_slot_TK.shape
    out = torch.zeros(num_tokens, rows_N.shape[1], dtype=torch.float64, device=rows_N.device)
    for k in range(top_k):
        kept = row_of_slot_TK[:, k] >= 0
        w = kept.double() if weights_TK is None else weights_TK[:, k].double() * kept
        out += rows_N[row_of_slot_TK[:, k].clamp(min=0)] * w[:, None] if rows_N.shape[0] else 0.0
    return out


def fake_quant_cols(rows_N: torch.Tensor, counts_E: torch.Tensor, fmt: str) -> torch.Tensor:
    """rows_N (expert-major) through quantize_cols and back, in its own layout (float64)."""
    deq = dequantize_cols(*quantize_cols(rows_N, counts_E, fmt))
    cols, start = [], 0
    for n in counts_E.tolist():
        cols.append(deq[:, start : start + n])
        start += -(-n // G) * G
    return torch.cat(cols, 1).T if cols else rows_N.double()


def moe_experts_fp8(x_TH, weights_TK, plan, w1, w3, w2, grad_TH, fmt, act_dtype=None, fp8_wgrad=False):
    """(out, dx, d_weights, dw1, dw3, dw2) of the fused FP8 experts, float64: the GEMMs of the forward and of the
    input gradient on fake-quantised operands (x, a, grad_out, dh1, dh3 in 1 x G groups; weights in G x G blocks),
    the weight gradients on unquantised ones (fp8_wgrad: on operands fake-quantised in G x 1 groups of each
    expert's rows), as xmoe/kernels/fp8_experts.py defines them. act_dtype (bf16 on a GPU): also round where the
    kernels store in the activations' dtype (h1, h3, the y and dx rows, da, the weight gradients' operands and
    results, the outputs)."""
    rnd = (lambda t: t.to(act_dtype).double()) if act_dtype is not None else (lambda t: t)
    tok, counts = plan.token_ids_N, plan.tokens_per_expert_E
    w1q, w3q, w2q = (fake_quant_blocks(w, fmt) for w in (w1, w3, w2))
    x = x_TH.double()
    xq = fake_quant_rows(x, fmt)[tok]
    h1, h3 = _per_expert(xq, w1q, counts), _per_expert(xq, w3q, counts)
    y = rnd(_per_expert(fake_quant_rows(F.silu(h1) * h3, fmt), w2q, counts))
    out = rnd(_combine(y, plan.row_of_slot_TK, weights_TK))
    h1, h3 = rnd(h1), rnd(h3)  # what the forward keeps for the backward
    a = F.silu(h1) * h3
    g = grad_TH.double()
    row_w = weights_TK.reshape(-1)[plan.slot_ids_N].double()[:, None]
    da = rnd(_per_expert(fake_quant_rows(g, fmt)[tok], w2q.transpose(1, 2), counts))
    sig = torch.sigmoid(h1)
    d_weights = torch.zeros(weights_TK.numel(), dtype=torch.float64, device=x.device)
    d_weights[plan.slot_ids_N] = (da * a).sum(1)
    da = da * row_w
    dh1 = da * h3 * sig * (1 + h1 * (1 - sig))
    dh3 = da * h1 * sig
    dx_rows = _per_expert(fake_quant_rows(dh1, fmt), w1q.transpose(1, 2), counts) + _per_expert(
        fake_quant_rows(dh3, fmt), w3q.transpose(1, 2), counts
    )
    dx = rnd(_combine(rnd(dx_rows), plan.row_of_slot_TK))
    wq = (lambda t: fake_quant_cols(t, counts, fmt)) if fp8_wgrad else (lambda t: t)
    dw2 = rnd(_per_expert_wgrad(wq(rnd(a * row_w)), wq(g[tok]), counts))
    dh1, dh3 = rnd(dh1), rnd(dh3)
    xw = wq(x[tok])
    dw1, dw3 = rnd(_per_expert_wgrad(xw, wq(dh1), counts)), rnd(_per_expert_wgrad(xw, wq(dh3), counts))
    return out, dx, d_weights.view_as(weights_TK), dw1, dw3, dw2


def load_by(monkeypatch, descriptors: bool):
    """The FP8 GEMMs' operands read through pointers, or (as on Hopper) through tensor descriptors; returns the
    list of tensors that descriptors were made of (None for pointers). Not a reference: the FP8 tests' switch."""
    from xmoe.kernels import fp8_gemm

    made = []

    class Counted(fp8_gemm.TensorDescriptor):
        def __post_init__(self):
            super().__post_init__()
            made.append(self.base)

    monkeypatch.setattr(fp8_gemm, "_forced_tma", descriptors)  # as fp8_gemm.forced_tma sets it
    monkeypatch.setattr(fp8_gemm, "TensorDescriptor", Counted)
    return made if descriptors else None
