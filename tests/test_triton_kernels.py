"""The Triton backend (xmoe/kernels/triton_ops.py) against a float64 loop reference and the torch backend.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows

Runs on CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), so fp32 only and
tiny shapes; the kernels run with 32 x 32 x 32 tiles there, so the shapes below span partial tiles and masked
columns (and the weight-gradient test several row blocks per expert). bf16 on a GPU: benchmarks/check_gpu.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import pytest
import torch
import torch.nn.functional as F
import triton  # noqa: F401  a declared test dependency (pip install -e ".[test]"): missing, this file fails

from xmoe.dispatch.routing import build_plan
from xmoe.kernels import get_ops, reference

tops = get_ops("triton", torch.device("cpu"))

# (T, H, F, E, K, capacity): odd H/F, k=1, k=E, capacity drops, many empty experts
CASES = {
    "odd": (13, 24, 40, 5, 2, None),
    "k1": (11, 20, 36, 4, 1, None),
    "k_eq_E": (6, 16, 20, 6, 6, None),
    "dropping": (17, 24, 24, 4, 2, 5),
    "sparse_experts": (9, 16, 32, 12, 2, None),
}


def _routing(T, E, K, seed, concentrate=False):
    g = torch.Generator().manual_seed(seed)
    if concentrate:  # every token's first choice is expert 0
        ids = torch.stack(
            [
                torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(E - 1, generator=g)[: K - 1]])
                for _ in range(T)
            ]
        )
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return ids, torch.rand(T, K, generator=g)


def _inputs(T, H, Fd, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, H, Fd, generator=g) / H**0.5
    w3 = torch.randn(E, H, Fd, generator=g) / H**0.5
    w2 = torch.randn(E, Fd, H, generator=g) / Fd**0.5
    return x, w, w1, w3, w2


def _loop_reference(x, w, w1, w3, w2, expert_ids_TK, row_of_slot_TK):
    """float64, one (token, slot) at a time: out[t] = sum_k w[t,k] * swiglu_{e(t,k)}(x[t]) over kept slots."""
    x, w, w1, w3, w2 = [t.detach().double().requires_grad_() for t in (x, w, w1, w3, w2)]
    rows = []
    for t in range(x.shape[0]):
        acc = 0.0 * x[t]  # attached to the graph even when every slot of the token is dropped
        for k in range(expert_ids_TK.shape[1]):
            if row_of_slot_TK[t, k] >= 0:
                e = int(expert_ids_TK[t, k])
                acc = acc + w[t, k] * ((F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e])
        rows.append(acc)
    return torch.stack(rows), (x, w, w1, w3, w2)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _run(ops, path, x, w, w1, w3, w2, plan, grad_out, wgrad="auto"):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w1, w3, w2)]
    x_, w_, w1_, w3_, w2_ = leaves
    arrays = (x_, w_, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, plan.tokens_per_expert_E, w1_, w3_, w2_)
    if path == "fused":
        out = ops.moe_experts(*arrays, wgrad=wgrad)
    else:
        out = reference.moe_experts(*arrays, ops=ops, wgrad=wgrad)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return [out] + [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, leaves, strict=False)]


def _check_layer(T, H, Fd, E, K, capacity, seed=0, concentrate=False):
    expert_ids, scores = _routing(T, E, K, seed, concentrate)
    plan = build_plan(expert_ids, scores, E, capacity)
    x, w, w1, w3, w2 = _inputs(T, H, Fd, E, K, seed)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1))
    ref_out, leaves64 = _loop_reference(x, w, w1, w3, w2, expert_ids, plan.row_of_slot_TK)
    ref = [ref_out] + list(torch.autograd.grad(ref_out, leaves64, grad_out.double(), allow_unused=True))
    ref = [r if r is not None else torch.zeros_like(l) for r, l in zip(ref, [ref_out] + list(leaves64), strict=False)]
    torch_backend = _run(reference, "ops", x, w, w1, w3, w2, plan, grad_out)
    names = ["out", "grad_x", "grad_weights", "grad_w1", "grad_w3", "grad_w2"]
    for path in ("ops", "fused"):
        got = _run(tops, path, x, w, w1, w3, w2, plan, grad_out)
        for name, g, r, tb in zip(names, got, ref, torch_backend, strict=False):
            assert g.shape == r.shape and g.dtype == torch.float32, (path, name)
            if r.norm() == 0:  # e.g. no rows at all: every gradient must be exactly zero
                assert torch.count_nonzero(g) == 0, (path, name)
                continue
            assert _rel(g, r) < 1e-5, (path, name, _rel(g, r))
            assert _rel(g, tb) < 1e-5, (path, name, "vs torch backend", _rel(g, tb))
    return plan


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_float64_loop(case):
    T, H, Fd, E, K, capacity = CASES[case]
    plan = _check_layer(T, H, Fd, E, K, capacity, seed=len(case))
    if case == "dropping":
        assert int(plan.num_dropped) > 0
    if case == "sparse_experts":
        assert int((plan.tokens_per_expert_E == 0).sum()) > 0


def test_all_rows_on_one_expert():
    # E=4, K=1, every token on expert 0: one long group, three empty ones
    _check_layer(21, 16, 24, 4, 1, None, seed=3, concentrate=True)
    _check_layer(10, 24, 16, 4, 2, None, seed=4, concentrate=True)


def test_no_rows():
    # capacity 0 drops every slot: N = 0, output and every gradient are zero
    plan = _check_layer(5, 16, 16, 3, 2, 0)
    assert plan.num_rows == 0


def test_gather_is_exact_and_combine_deterministic():
    T, H, E, K = 19, 40, 6, 3
    expert_ids, scores = _routing(T, E, K, seed=7)
    plan = build_plan(expert_ids, scores, E)
    x = torch.randn(T, H)
    x_NH = tops.gather_rows(x, plan.token_ids_N, plan.row_of_slot_TK)
    assert torch.equal(x_NH, x[plan.token_ids_N])  # a pure permutation: bitwise equal
    y = torch.randn(plan.num_rows, H, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)
    outs = [tops.combine_rows(y, w, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    g = torch.randn(T, H)
    grads = [torch.autograd.grad(o, [y, w], g) for o in outs]
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=False))
    ref = reference.combine_rows(y, w, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK)
    assert _rel(outs[0], ref) < 1e-6


def test_grouped_swiglu_zero_row_experts_get_zero_weight_grads():
    H, Fd, E = 16, 24, 5
    counts = torch.tensor([0, 7, 0, 0, 18])
    x = torch.randn(int(counts.sum()), H, requires_grad=True)
    _, _, w1, w3, w2 = [t.requires_grad_() for t in _inputs(3, H, Fd, E, 1, seed=5)]
    y = tops.grouped_swiglu(x, w1, w3, w2, counts)
    y_ref = reference.grouped_swiglu(x, w1, w3, w2, counts)
    assert _rel(y, y_ref) < 1e-5
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w1, w3, w2], g)
    want = torch.autograd.grad(y_ref, [x, w1, w3, w2], g)
    for a, b in zip(got, want, strict=False):
        assert _rel(a, b) < 1e-5
    for dw in got[1:]:
        assert torch.count_nonzero(dw[[0, 2, 3]]) == 0


@pytest.mark.parametrize("gather", ["a", "b", "none"])
def test_grouped_wgrad_long_and_empty_groups(gather):
    # groups of 0, 1, 31, 32, 33 and 97 rows: several 32-row reduction steps per tile, exact multiples, empty
    # experts between full ones; M and NC not multiples of the tile; c2 shares the pass over a
    from xmoe.kernels.grouped_wgrad import grouped_wgrad

    counts = torch.tensor([33, 0, 97, 1, 0, 32, 31])
    a, a_idx, b1, b2, b_idx = _wgrad_inputs(counts, gather, seed=11)
    c1, c2 = grouped_wgrad(a, a_idx, b1, b2, b_idx, counts)
    _check_wgrad(c1, a, a_idx, b1, b_idx, counts)
    _check_wgrad(c2, a, a_idx, b2, b_idx, counts)


def _wgrad_inputs(counts, gather, seed, T=250, M=40, NC=36):
    """(a, a_idx, b1, b2, b_idx) for grouped_wgrad with the rows of a ("a"), of b ("b") or of neither gathered."""
    g = torch.Generator().manual_seed(seed)
    N = int(counts.sum())
    idx = torch.randperm(T, generator=g)[:N]
    a = torch.randn(T if gather == "a" else N, M, generator=g)
    b1, b2 = (torch.randn(T if gather == "b" else N, NC, generator=g) for _ in range(2))
    return a, idx if gather == "a" else None, b1, b2, idx if gather == "b" else None


def _check_wgrad(c, a, a_idx, b, b_idx, counts):
    """c[e] against the float64 A_e^T B_e over expert e's rows; an expert without rows is exactly zero."""
    rows_a = a[a_idx] if a_idx is not None else a
    rows_b = b[b_idx] if b_idx is not None else b
    start = 0
    for e, n in enumerate(counts.tolist()):
        sl = slice(start, start + n)
        if n == 0:
            assert torch.count_nonzero(c[e]) == 0, e
        else:
            assert _rel(c[e], rows_a[sl].double().T @ rows_b[sl].double()) < 1e-5, e
        start += n


def test_rejects_mismatched_dtypes():
    counts = torch.tensor([2, 1])
    x = torch.randn(3, 16)
    w = torch.randn(2, 16, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"float32, bfloat16 or float16|dtype"):
        tops.grouped_swiglu(x, w, w, w.transpose(1, 2), counts)


@pytest.mark.parametrize("engine", ["triton", "grouped_mm"])
def test_fused_op_traces_under_torch_compile(engine):
    # engine grouped_mm: the eager call takes torch._grouped_mm (where this CPU build has it); under compile its
    # fp32 shape function is missing, so the traced backward must fall back to the Triton kernels, not fail
    T, H, Fd, E, K = 8, 16, 16, 3, 2
    expert_ids, scores = _routing(T, E, K, seed=9)
    plan = build_plan(expert_ids, scores, E)
    x, w, w1, w3, w2 = _inputs(T, H, Fd, E, K, seed=9)

    def layer(x, w, w1, w3, w2):
        return tops.moe_experts(
            x, w, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, plan.tokens_per_expert_E, w1, w3, w2,
            wgrad=engine,
        ).sum()  # fmt: skip

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break allowed
    results = []
    for fn in (compiled, layer):  # forward and backward: the custom ops and their fakes under AOTAutograd
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w3, w2)]
        out = fn(*leaves)
        results.append([out.detach()] + list(torch.autograd.grad(out, leaves)))
    for got, want in zip(*results, strict=False):
        assert _rel(got, want) < 1e-5


def test_router_kernel_traces_under_torch_compile():
    logits = torch.randn(10, 6)
    bias = torch.randn(6) * 0.01

    def router(logits):
        weights, ids, _ = tops.router_topk(logits, bias, 2, "softmax", True, 1.5)
        return (weights * torch.arange(1.0, 3.0)).sum(), ids

    torch._dynamo.reset()
    compiled = torch.compile(router, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, router):
        x = logits.clone().requires_grad_()
        total, ids = fn(x)
        results.append((total.detach(), ids, torch.autograd.grad(total, x)[0]))
    (t1, i1, g1), (t2, i2, g2) = results
    assert torch.equal(i1, i2) and _rel(t1, t2) < 1e-6 and _rel(g1, g2) < 1e-5
