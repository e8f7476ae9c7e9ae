"""The torch backend's grouped SwiGLU (the CPU path of `xmoe train`) against a float64 per-expert loop, and its
row sums (combine_rows, gather_rows' backward) against a float64 loop over the kept slots.

# N rows, H hidden, F expert ffn, E experts

Aligned shapes take torch._grouped_mm where the torch build runs it on CPU; odd shapes take the slice loop. Both
must give the loop's outputs and every gradient, with empty experts and an expanded output gradient.
"""

import pytest
import torch
import torch.nn.functional as F

from xmoe.kernels import reference


def _loop64(x_NH, w1, w3, w2, counts):
    outs, start = [], 0
    for e, n in enumerate(counts):
        r = x_NH[start : start + n]
        outs.append((F.silu(r @ w1[e]) * (r @ w3[e])) @ w2[e])
        start += n
    return torch.cat(outs)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "H,F_,counts",
    [
        (32, 48, [5, 0, 17, 1, 0, 9]),  # aligned: _grouped_mm where available
        (20, 36, [3, 0, 0, 11]),  # unaligned: slice loop
        (16, 24, [0, 0, 7, 0]),  # all rows on one expert
    ],
)
@pytest.mark.parametrize("expanded_grad", [False, True])
def test_grouped_swiglu_matches_float64_loop(H, F_, counts, expanded_grad):
    g = torch.Generator().manual_seed(sum(counts) + H)
    E, N = len(counts), sum(counts)
    x = torch.randn(N, H, generator=g)
    ws = [
        torch.randn(E, H, F_, generator=g) / H**0.5,
        torch.randn(E, H, F_, generator=g) / H**0.5,
        torch.randn(E, F_, H, generator=g) / F_**0.5,
    ]
    leaves32 = [t.clone().requires_grad_() for t in (x, *ws)]
    leaves64 = [t.double().requires_grad_() for t in (x, *ws)]
    y = reference.grouped_swiglu(*leaves32, torch.tensor(counts))
    assert not y._is_view()  # an FSDP2-wrapped experts module returning a view warns (and in-place ops break it)
    y_ref = _loop64(*leaves64, counts)
    assert _rel(y, y_ref) < 1e-5
    if expanded_grad:
        y.sum().backward()
        y_ref.sum().backward()
    else:
        grad = torch.randn(N, H, generator=g)
        y.backward(grad)
        y_ref.backward(grad.double())
    for a, b in zip(leaves32, leaves64, strict=False):
        assert _rel(a.grad, b.grad) < 1e-5


def test_import_probe_saves_nothing_under_outer_saved_tensor_hooks():
    # get_ops imports this module inside the first forward, possibly within an activation checkpoint: the probe's
    # autograd must not reach the checkpoint's hooks, or the recomputed block saves fewer tensors than its forward
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        reference._probe_cpu_grouped_mm()
    assert packed == []


def _sums64(rows_NH, table_TK, weights_TK):
    out = torch.zeros(table_TK.shape[0], rows_NH.shape[1], dtype=torch.float64)
    for t in range(table_TK.shape[0]):
        for k in range(table_TK.shape[1]):
            if table_TK[t, k] >= 0:
                out[t] += float(weights_TK[t, k]) * rows_NH[table_TK[t, k]].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [1.0, 0.3, 0.0])
def test_row_sums_read_kept_slots_only(dtype, keep):
    """RBD's tables keep few of a row's K slots: the CPU pass reads only those, equal bit for bit to the dense pass
    (every slot, zero weights) on finite rows and to the float64 loop within rounding; a row that only dropped
    slots point at may hold inf without reaching any token (the dense pass multiplies it by 0: NaN)."""
    g = torch.Generator().manual_seed(int(keep * 10))
    T, K, H = 23, 5, 40
    kept = torch.rand(T, K, generator=g) < keep
    kept[0] = False  # a token with no kept slot
    num_rows = int(kept.sum()) + 1  # row 0 only ever pointed at by dropped slots (clamped -1)
    table = torch.full((T, K), -1, dtype=torch.long)
    table[kept] = 1 + torch.randperm(num_rows - 1, generator=g)
    rows = torch.randn(num_rows, H, generator=g).to(dtype)
    weights = torch.rand(T, K, generator=g)
    for w in (weights, None):
        ref = _sums64(rows, table, w if w is not None else torch.ones(T, K))
        sparse = reference._sum_rows_per_token(rows, table, w, sparse=True)
        dense = reference._sum_rows_per_token(rows, table, w, sparse=False)
        assert sparse.dtype == dtype and torch.equal(sparse, dense)
        assert _rel(sparse, ref) < (1e-6 if dtype == torch.float32 else 1e-2) or ref.norm() == 0
        assert torch.all(sparse[0] == 0)
    rows[0] = float("inf")
    assert torch.isfinite(reference._sum_rows_per_token(rows, table, weights, sparse=True)).all()
    assert not torch.isfinite(reference._sum_rows_per_token(rows, table, weights, sparse=False)).all()
