"""FP8 routed experts (xmoe/kernels/fp8_*.py, moe.fp8 = "experts") against float64 references (fp8_reference.py).

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows; G = 128

Runs in Triton's interpreter on CPU, which cannot convert to FP8 faithfully (it flushes subnormals and mis-encodes
e4m3fnuz). There the kernels hold FP8 values in float32, rounded to the format's grid in fp32 arithmetic
(fp8_quant._store_fp8), and multiply them with exact fp32 dots: every kernel's scales, groups, layouts and
indexing are checked here, for both formats, exactly or to fp32 rounding. The hardware conversions and FP8 dots:
benchmarks/check_gpu.py on a GPU. Shapes are small but cross the 128-wide scale groups (H = 160, F = 136: a full
group and a partial one) and the interpreter's 32-wide tiles.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import types

import fp8_reference as R
import pytest
import torch

from xmoe import MoEConfig, MoELayer
from xmoe.config import KernelConfig
from xmoe.dispatch.routing import build_plan
from xmoe.kernels import fp8_quant, launches, tiles
from xmoe.kernels.choice import resolve_kernels
from xmoe.kernels.fp8_experts import grouped_swiglu_fp8, moe_experts_fp8
from xmoe.kernels.fp8_gemm import fp8_grouped_mm, fp8_swiglu_down_bwd, fp8_swiglu_up_fwd, input_grad_operands
from xmoe.kernels.fp8_quant import (
    FORMATS,
    quantize_block_pair,
    quantize_blocks,
    quantize_expert_weights,
    quantize_rows,
)

FMTS = sorted(FORMATS)
# rows up to 1e4 in magnitude drive exp(-h1) past fp32's range in the interpreter's numpy (silu is then exactly 0
# or h1, as on a GPU)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rows(R_, C, seed):
    """Rows of random values whose magnitudes span 1e-4 .. 1e4 (row scales then differ by up to 2^27)."""
    return torch.randn(R_, C, generator=_gen(seed)) * torch.logspace(-4, 4, R_)[:, None]


def _weights(E, rows, cols, seed):
    """(E, rows, cols) whose G x G blocks differ in magnitude (up to 100x): a scale read from the wrong block or
    the wrong transpose changes results well beyond rounding."""
    g = _gen(seed)
    w = torch.randn(E, rows, cols, generator=g) / rows**0.5
    mag = torch.logspace(-1, 1, 7)[torch.randint(0, 7, (E, -(-rows // 128), -(-cols // 128)), generator=g)]
    return w * mag.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :rows, :cols]


def _deq_rows(q, s):
    return R.dequantize_rows(q, s)


def _deq_blocks(q, s):
    return R.dequantize_blocks(q, s)


# ------------------------------------------------------------------------------------------------ quantisers


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_rows_matches_float64(fmt):
    f = FORMATS[fmt]
    x = _rows(37, 300, seed=1)  # odd rows; 300 columns: two full groups and one of 44
    x[3] = 0.0  # a zero row
    x[4, 128:256] = 0.0  # a zero group inside a row
    x[5, :128] = torch.linspace(-1, 1, 128) * f.max * 8  # amax exactly max * 8: scale 8
    x[6, :128] = x[5, :128] * (1 + 2**-20)  # amax * (max / amax) one fp32 rounding above max: still max
    x[7, :128] = torch.linspace(-1, 1, 128) * 2.0**-15
    x[7, 0] = 1.0  # one large value: the rest of the group lands on FP8 subnormals (or zero)
    q, s = quantize_rows(x, fmt)
    q_ref, s_ref = R.quantize_rows(x, fmt)
    assert q.shape == x.shape and s.shape == (37, 3) and s.dtype == torch.float32
    assert torch.equal(q.double(), q_ref) and torch.equal(s.double(), s_ref)
    assert s[5, 0] == 8 and q[5, 0].abs() == f.max and q[6, :128].abs().max() == f.max
    assert q[3].eq(0).all() and q[4, 128:256].eq(0).all() and torch.isfinite(s).all() and (s > 0).all()
    sub = q[7, 1:128].abs()
    assert ((sub > 0) & (sub < 2.0**f.min_exp)).any()  # subnormals occurred and matched torch's conversion
    # dequantised: within half a grid step of x, relative 2^-4 for normal values
    err = (_deq_rows(q, s) - x.double()).abs()
    normal = q.double().abs() > 2.0**f.min_exp  # (a subnormal may round up to the smallest normal)
    assert (err[normal] <= 2.0**-4 * x.double().abs()[normal] * 1.0001).all()


def test_quantize_rows_empty_and_nonfinite():
    q, s = quantize_rows(torch.randn(0, 200), "e4m3fn")
    assert q.shape == (0, 200) and s.shape == (0, 2)
    x = _rows(9, 260, seed=2)
    x[1, 5] = float("inf")
    x[2, 200] = float("nan")
    q, s = quantize_rows(x, "e4m3fn")
    deq = _deq_rows(q, s)
    assert not torch.isfinite(deq[1, :128]).any() and torch.isnan(deq[2, 200])  # non-finite values survive
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, :128] = mask[2, 128:256] = False
    q_ref, _s_ref = R.quantize_rows(torch.where(mask, x, 0.0), "e4m3fn")
    assert torch.equal(q.double()[mask], q_ref[mask])  # every other group as if they were not there


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_blocks_matches_float64(fmt):
    w = _weights(3, 200, 150, seed=3)  # partial blocks in both dimensions
    w[1, :128, 128:] = 0.0  # a zero block
    q, qt, s = quantize_blocks(w, fmt)
    q_ref, s_ref = R.quantize_blocks(w, fmt)
    assert s.shape == (3, 2, 2) and torch.equal(s.double(), s_ref) and torch.equal(q.double(), q_ref)
    assert torch.equal(qt, q.transpose(1, 2)) and qt.is_contiguous()
    assert q[1, :128, 128:].eq(0).all() and 0 < s[1, 0, 1] < 1e-30
    qw = quantize_expert_weights(w, w, w.transpose(1, 2).contiguous(), fmt)
    assert torch.equal(qw.w1_EFH, qt) and torch.equal(qw.w1_EHF, q) and torch.equal(qw.scale2, s.transpose(1, 2))
    # w1 and w3 side by side: each half holds what quantize_blocks gives it alone, scales too (ragged 150 columns)
    w3 = _weights(3, 200, 150, seed=4)
    q13, q1t, q3t, s13 = quantize_block_pair(w, w3, fmt)
    q3, q3t_alone, s3 = quantize_blocks(w3, fmt)
    assert q13.shape == (3, 200, 300) and s13.shape == (3, 2, 4)
    assert torch.equal(q13[..., :150], q) and torch.equal(q13[..., 150:], q3)
    assert torch.equal(s13[..., :2], s) and torch.equal(s13[..., 2:], s3)
    assert torch.equal(q1t, qt) and torch.equal(q3t, q3t_alone)
    qw = quantize_expert_weights(w, w3, w.transpose(1, 2).contiguous(), fmt)
    assert qw.w13_EHF.data_ptr() == qw.w1_EHF.data_ptr() and torch.equal(qw.w3_EHF, q3)
    assert torch.equal(qw.scale3, s3) and qw.scale13.data_ptr() == qw.scale1.data_ptr()
    with pytest.raises(ValueError, match="one shape"):
        quantize_block_pair(w, w3[:, :, :128], fmt)


# ------------------------------------------------------------------------------------------------ GEMM kernels


def _plan(T, E, K, seed, capacity=None, experts=None):
    g = _gen(seed)
    pool = experts if experts is not None else E
    ids = torch.stack([torch.randperm(pool, generator=g)[:K] for _ in range(T)])
    return build_plan(ids, torch.rand(T, K, generator=g), E, capacity)


@pytest.mark.parametrize("gather", [True, False])
def test_up_kernel_matches_float64_of_its_inputs(gather, tma):
    T, H, Fd, E, K = 23, 160, 136, 5, 2
    plan = _plan(T, E, K, seed=4, experts=4)  # expert 4 gets no rows
    x = _rows(T, H, seed=5)
    xq, sx = quantize_rows(x if gather else x[plan.token_ids_N], "e4m3fn")
    q1, q1t, s1 = quantize_blocks(_weights(E, H, Fd, seed=6), "e4m3fn")
    q3, q3t, s3 = quantize_blocks(_weights(E, H, Fd, seed=7), "e4m3fn")
    tok = plan.token_ids_N if gather else None
    h1, h3, aq, sa = fp8_swiglu_up_fwd(
        xq,
        sx,
        tok,
        q1t,
        q3t,
        s1.transpose(1, 2),
        s3.transpose(1, 2),
        plan.tokens_per_expert_E,
        True,
        "e4m3fn",
        torch.float32,
    )
    rows = _deq_rows(xq, sx)
    rows = rows[plan.token_ids_N] if gather else rows
    counts = plan.tokens_per_expert_E
    assert _rel(h1, R._per_expert(rows, _deq_blocks(q1, s1), counts)) < 1e-6
    assert _rel(h3, R._per_expert(rows, _deq_blocks(q3, s3), counts)) < 1e-6
    # a is quantised from the kernel's fp32 h1, h3: the reference quantises the same values, up to the fp32 ulp by
    # which the kernel's silu may differ from float64 (scales to an ulp, rare values one FP8 step apart)
    a = torch.nn.functional.silu(h1.double()) * h3.double()
    q_ref, s_ref = R.quantize_rows(a, "e4m3fn")
    assert ((sa.double() - s_ref).abs() <= 1e-6 * s_ref).all()
    assert (aq.double() != q_ref).double().mean() < 1e-3 and _rel(_deq_rows(aq, sa), _deq_rows(q_ref, s_ref)) < 1e-4
    h1n, _, aq_n, _ = fp8_swiglu_up_fwd(
        xq, sx, tok, q1t, q3t, s1.transpose(1, 2), s3.transpose(1, 2), counts, False, "e4m3fn", torch.float32
    )
    assert h1n.shape == (0, Fd) and torch.equal(aq_n, aq)
    if tma is not None:  # the up kernel reads through pointers even where descriptors are on
        assert tma == []


@pytest.fixture(params=[False, True], ids=["one_tile", "halves"])
def halves(request):
    """The FP8 grouped GEMM's tiles as the interpreter runs them (32 columns), or 256 columns wide, which the kernel
    computes as two 128-column halves (_fp8_dot (HALVES)): here a full scale block and a ragged one."""
    if not request.param:
        yield False
        return
    wide = tiles.TileConfig(32, 256, 32, 4, 1)
    with tiles.force(dict.fromkeys(("fp8_mm", "fp8_dx", "fp8_down_bwd"), wide)):
        yield True


def test_grouped_mm_kernel_one_and_two_pairs_and_column_views(tma, halves):
    T, H, Fd, E = 29, 160, 136, 4
    plan = _plan(T, E, 2, seed=8)
    counts, tok, N = plan.tokens_per_expert_E, plan.token_ids_N, plan.num_rows
    # down dgrad form: a = g (T, H) read by token id, b = w2 (E, F, H), reduction over H
    gq, sg = quantize_rows(_rows(T, H, seed=9), "e4m3fn")
    q2, _, s2 = quantize_blocks(_weights(E, Fd, H, seed=10), "e4m3fn")
    from xmoe.kernels.fp8_gemm import _fp8_mm

    da = _fp8_mm(gq, sg, q2, s2, None, None, None, None, counts, tok, torch.float32, "fp8_down_bwd", False)
    ref = R._per_expert(_deq_rows(gq, sg)[tok], _deq_blocks(q2, s2).transpose(1, 2), counts)
    assert _rel(da, ref) < 1e-6
    # dx form: two pairs, reduction over F, output H; and a column slice of the output (a view of b and its scales)
    d1q, d1s = quantize_rows(_rows(N, Fd, seed=11), "e4m3fn")
    d3q, d3s = quantize_rows(_rows(N, Fd, seed=12), "e4m3fn")
    q1, _, s1 = quantize_blocks(_weights(E, H, Fd, seed=13), "e4m3fn")
    q3, _, s3 = quantize_blocks(_weights(E, H, Fd, seed=14), "e4m3fn")
    ref = R._per_expert(_deq_rows(d1q, d1s), _deq_blocks(q1, s1).transpose(1, 2), counts) + R._per_expert(
        _deq_rows(d3q, d3s), _deq_blocks(q3, s3).transpose(1, 2), counts
    )
    dx = fp8_grouped_mm(d1q, d1s, q1, s1, d3q, d3s, q3, s3, counts, torch.float32, True)
    assert _rel(dx, ref) < 1e-6
    if tma is not None:  # gq's rows are gathered: only the weights by descriptor there, then all four here
        assert [t.data_ptr() for t in tma] == [q2.data_ptr()] + [t.data_ptr() for t in (d1q, d3q, q1, q3)]
    part = fp8_grouped_mm(
        d1q, d1s, q1[:, 128:], s1[:, 1:], d3q, d3s, q3[:, 128:], s3[:, 1:], counts, torch.float32, True
    )
    assert _rel(part, ref[:, 128:]) < 1e-6
    # a layout TMA does not take (a base 4 bytes past 16-byte alignment): that pair is read through pointers
    odd = torch.empty(d1q.numel() + 1, dtype=d1q.dtype)[1:].view_as(d1q).copy_(d1q)
    assert odd.data_ptr() % 16 != 0
    assert torch.equal(fp8_grouped_mm(odd, d1s, q1, s1, d3q, d3s, q3, s3, counts, torch.float32, True), dx)
    if tma is not None:
        assert all(t.data_ptr() != odd.data_ptr() for t in tma)


@pytest.mark.parametrize("ffn", [128, 136])
def test_input_grad_reads_the_side_by_side_buffers(ffn, tma, halves):
    """dx = dh1 w1^T + dh3 w3^T from the (N, 2F) and (E, H, 2F) buffers: one product of depth 2F when F is whole
    scale groups, two of depth F (views) when it is not; both against float64 of the two products apart."""
    T, H, E = 27, 160, 4
    plan = _plan(T, E, 2, seed=21)
    counts, N = plan.tokens_per_expert_E, plan.num_rows
    (d1q, d1s), (d3q, d3s) = (quantize_rows(_rows(N, ffn, seed=22 + i), "e4m3fn") for i in range(2))
    dq, ds = torch.cat([d1q, d3q], 1), torch.cat([d1s, d3s], 1)
    q13, _, _, s13 = quantize_block_pair(_weights(E, H, ffn, seed=24), _weights(E, H, ffn, seed=25), "e4m3fn")
    g = ds.shape[1] // 2
    ref = sum(
        R._per_expert(_deq_rows(dq[:, c], ds[:, sg]), _deq_blocks(q13[..., c], s13[..., sg]).transpose(1, 2), counts)
        for c, sg in ((slice(0, ffn), slice(0, g)), (slice(ffn, None), slice(g, None)))
    )
    operands = input_grad_operands(dq, ds, q13, s13)
    assert (operands[4] is None) == (ffn % 128 == 0)
    dx = fp8_grouped_mm(*operands, counts, torch.float32, True)
    assert _rel(dx, ref) < 1e-6
    if tma is not None and ffn % 128 == 0:  # one pair: the whole buffers by descriptor
        assert [t.data_ptr() for t in tma] == [dq.data_ptr(), q13.data_ptr()]


@pytest.mark.parametrize("reuse", [False, True])
def test_swiglu_bwd_kernel_matches_float64(reuse):
    T, H, Fd, E = 21, 160, 136, 3
    plan = _plan(T, E, 2, seed=15)
    counts, tok, N = plan.tokens_per_expert_E, plan.token_ids_N, plan.num_rows
    gq, sg = quantize_rows(_rows(T, H, seed=16), "e4m3fn")
    q2, _, s2 = quantize_blocks(_weights(E, Fd, H, seed=17), "e4m3fn")
    h1, h3 = torch.randn(N, Fd, generator=_gen(18)), torch.randn(N, Fd, generator=_gen(19))
    row_w = torch.rand(N, generator=_gen(20))
    h1_in, h3_in = h1.clone(), h3.clone()
    dh1, dh3, a_w, grad_w, dhq, s_dh = fp8_swiglu_down_bwd(
        gq, sg, tok, q2, s2, h1_in, h3_in, row_w, counts, reuse, "e4m3fn"
    )
    assert dhq.shape == (N, 2 * Fd) and s_dh.shape == (N, 4)  # dh1 | dh3, each in 2 groups (136 columns)
    q1, q3, s1, s3 = dhq[:, :Fd], dhq[:, Fd:], s_dh[:, :2], s_dh[:, 2:]
    da = R._per_expert(_deq_rows(gq, sg)[tok], _deq_blocks(q2, s2).transpose(1, 2), counts)
    h1d, h3d, w = h1.double(), h3.double(), row_w.double()[:, None]
    sig = torch.sigmoid(h1d)
    a = h1d * sig * h3d
    assert _rel(grad_w, (da * a).sum(1)) < 1e-6
    assert _rel(a_w, w * a) < 1e-6
    dh1_ref = w * da * h3d * sig * (1 + h1d * (1 - sig))
    assert _rel(dh1, dh1_ref) < 1e-6 and _rel(dh3, w * da * h1d * sig) < 1e-6
    for q, s, d in ((q1, s1, dh1), (q3, s3, dh3)):  # quantised from exactly the values it wrote beside them
        q_ref, s_ref = R.quantize_rows(d, "e4m3fn")
        assert torch.equal(q.double(), q_ref) and torch.equal(s.double(), s_ref)
    if reuse:
        assert a_w.data_ptr() == h1_in.data_ptr() and dh3.data_ptr() == h3_in.data_ptr()


# ------------------------------------------------------------------------------------------------ the FP8 layer


def _fused_call(x, w, plan, w1, w3, w2, g, fmt, wgrad="auto"):
    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w3, w2)]
    qw = quantize_expert_weights(w1, w3, w2, fmt)
    out = moe_experts_fp8(
        leaves[0],
        leaves[1],
        plan.token_ids_N,
        plan.slot_ids_N,
        plan.row_of_slot_TK,
        plan.tokens_per_expert_E,
        *leaves[2:],
        qw,
        fmt,
        wgrad=wgrad,
    )
    return [out] + list(torch.autograd.grad(out, leaves, g))


# (T, H, F, E, K, capacity, experts routed to, format)
LAYER_CASES = {
    "odd_e4m3fn": (19, 160, 136, 5, 2, None, None, "e4m3fn"),
    "odd_e4m3fnuz": (19, 160, 136, 5, 2, None, None, "e4m3fnuz"),
    "drops_and_empty_experts": (24, 136, 160, 6, 2, 5, 4, "e4m3fn"),
}


@pytest.mark.parametrize(
    "case,descriptors,wgrad",
    [(c, False, "auto") for c in sorted(LAYER_CASES)]
    + [("drops_and_empty_experts", True, "auto"), ("drops_and_empty_experts", False, "fp8")],
)
def test_fused_fp8_layer_matches_float64_emulation(case, descriptors, wgrad, monkeypatch):
    R.load_by(monkeypatch, descriptors)  # descriptors at one case: the kernel tests above cover both paths
    T, H, Fd, E, K, capacity, pool, fmt = LAYER_CASES[case]
    plan = _plan(T, E, K, seed=21, capacity=capacity, experts=pool)
    x, w, g = _rows(T, H, seed=22) * 1e-3, torch.rand(T, K, generator=_gen(23)), torch.randn(T, H, generator=_gen(24))
    w1, w3, w2 = _weights(E, H, Fd, 25), _weights(E, H, Fd, 26), _weights(E, Fd, H, 27)
    got = _fused_call(x, w, plan, w1, w3, w2, g, fmt, wgrad)  # "fp8": the weight gradients in FP8 too (fp8_wgrad.py)
    ref = R.moe_experts_fp8(x, w, plan, w1, w3, w2, g, fmt, fp8_wgrad=wgrad == "fp8")
    names = ["out", "dx", "d_weights", "dw1", "dw3", "dw2"]
    for name, a, b in zip(names, got, ref, strict=False):
        assert a.shape == b.shape, name
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))
    if capacity is not None:
        assert int(plan.num_dropped) > 0 and int((plan.tokens_per_expert_E == 0).sum()) > 0
        assert torch.count_nonzero(got[3][plan.tokens_per_expert_E == 0]) == 0  # no rows: zero gradient


@pytest.mark.parametrize("descriptors,wgrad", [(False, "auto"), (True, "auto"), (False, "fp8")])
def test_grouped_fp8_swiglu_matches_float64_emulation(descriptors, wgrad, monkeypatch):
    R.load_by(monkeypatch, descriptors)
    # grouped_swiglu_fp8 on rows N is the fused op on N tokens routed once each (K = 1, weight 1)
    H, Fd, E = 136, 160, 4
    counts = torch.tensor([7, 0, 12, 3])
    N = int(counts.sum())
    ids = torch.repeat_interleave(torch.arange(E), counts)[:, None]
    plan = build_plan(ids, torch.ones(N, 1), E, None)
    assert torch.equal(plan.token_ids_N, torch.arange(N))
    x, g = _rows(N, H, seed=28) * 1e-2, torch.randn(N, H, generator=_gen(29))
    w1, w3, w2 = _weights(E, H, Fd, 30), _weights(E, H, Fd, 31), _weights(E, Fd, H, 32)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
    qw = quantize_expert_weights(w1, w3, w2, "e4m3fn")
    y = grouped_swiglu_fp8(leaves[0], *leaves[1:], counts, qw, "e4m3fn", wgrad=wgrad)
    got = [y] + list(torch.autograd.grad(y, leaves, g))
    ones = torch.ones(N, 1)
    out, dx, _, dw1, dw3, dw2 = R.moe_experts_fp8(x, ones, plan, w1, w3, w2, g, "e4m3fn", fp8_wgrad=wgrad == "fp8")
    for name, a, b in zip(["y", "dx", "dw1", "dw3", "dw2"], got, [out, dx, dw1, dw3, dw2], strict=False):
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))


# The FP8 layer against the unquantised one. e4m3 keeps 3 mantissa bits: one rounding errs by up to 2^-4 of the
# value (about 2.4% RMS); the output goes through two quantised GEMMs, each with both operands rounded, and the
# input gradient through two more, so about 5-7% of the norm is the expected error (measured below: 5-7%; the
# router weight's gradient, a small sum of products of both, 10%).
FP8_BOUND = {"out": 0.09, "grad_x": 0.09, "grad_w1": 0.08, "grad_w3": 0.08, "grad_w2": 0.08, "grad_router": 0.11}


def _layer_grads(layer, x, g):
    xx = x.clone().requires_grad_()
    out = layer(xx)
    out.backward(g)
    e = layer.experts
    return {
        "out": out.detach(),
        "grad_x": xx.grad,
        "grad_w1": e.w1.grad,
        "grad_w3": e.w3.grad,
        "grad_w2": e.w2.grad,
        "grad_router": layer.router.weight.grad,
    }


@pytest.mark.parametrize("wgrad", ["auto", "fp8"])
def test_fp8_layer_close_to_unquantised_layer(wgrad, monkeypatch):
    torch.manual_seed(0)
    kw = dict(hidden_size=256, ffn_hidden_size=192, num_experts=4, top_k=2, num_shared_experts=0)
    exact = MoELayer(MoEConfig(**kw, kernel_backend="torch"))
    kernels = resolve_kernels("triton", KernelConfig(wgrad=wgrad))  # the layer runs the section it is built with
    fp8 = MoELayer(MoEConfig(**kw, kernel_backend="triton", fp8="experts"), kernels=kernels)
    fp8.load_state_dict(exact.state_dict())
    assert fp8.experts.fp8 and "fp8=experts" in repr(fp8)
    x, g = torch.randn(2, 24, 256, generator=_gen(33)), torch.randn(2, 24, 256, generator=_gen(34))
    want = _layer_grads(exact, x, g)
    monkeypatch.setenv("XMOE_WGRAD", "auto" if wgrad == "fp8" else "fp8")  # the environment, now: not what runs
    before = launches.snapshot()
    got = _layer_grads(fp8, x, g)
    # dW2, dW1, dW3 by the engine the layer was built with: fp8_wgrad, or the bf16 Triton kernels ("auto" off sm_90)
    assert launches.since(before)["wgrad"] == {"fp8" if wgrad == "fp8" else "triton": 3}
    errs = {name: _rel(got[name], want[name]) for name in FP8_BOUND}
    for name, bound in FP8_BOUND.items():
        assert 1e-3 < errs[name] < bound, (name, errs[name])  # quantised (not exact), and within the stated bound


def test_step_casts_quantise_once_and_accumulate_into_fp32_grads(monkeypatch):
    from xmoe.moe.experts import use_one_process
    from xmoe.moe.step import MoEStep

    torch.manual_seed(1)
    layer = MoELayer(
        MoEConfig(hidden_size=160, ffn_hidden_size=136, num_experts=3, top_k=2, kernel_backend="triton", fp8="experts")
    )
    xs = [torch.randn(12, 160, generator=_gen(35 + i)) for i in range(2)]
    calls = []
    real = fp8_quant.quantize_expert_weights
    monkeypatch.setattr(fp8_quant, "quantize_expert_weights", lambda *a: calls.append(1) or real(*a))
    grads = {}
    for detach in (None, False, True):  # None: outside an optimizer step, quantised per forward
        layer.zero_grad(set_to_none=True)
        calls.clear()
        if detach:  # the one-process path the build chooses (no optimizer writes copies here)
            assert use_one_process(layer, None) == []
        step = MoEStep(layer, len(xs), torch.device("cpu"), cast_dtype=torch.float32) if detach is not None else None
        if step is not None:
            step.__enter__()
            cache = layer.moe_step.casts
            assert len(cache) == 4 and isinstance(cache[3], fp8_quant.Fp8ExpertWeights)
            if detach:  # stand-ins: one element each, the parameters' shapes
                assert all(
                    c.shape == w.shape and c.untyped_storage().nbytes() == 4
                    for c, w in zip(cache[:3], (layer.experts.w1, layer.experts.w3, layer.experts.w2), strict=False)
                )
            else:
                assert cache[0] is layer.experts.w1
        for x in xs:
            layer(x).square().sum().backward()
        if step is not None:
            step.__exit__(None, None, None)
            assert layer.moe_step is None
        assert len(calls) == (2 if detach is None else 1)
        grads[detach] = [w.grad.clone() for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2)]
    for detach in (False, True):
        for a, b in zip(grads[detach], grads[None], strict=False):
            assert a.dtype == torch.float32 and _rel(a, b) < 1e-6


def test_fp8_ops_trace_under_torch_compile():
    T, H, Fd, E, K = 8, 136, 136, 3, 2
    plan = _plan(T, E, K, seed=36)
    x, w = _rows(T, H, seed=37) * 1e-2, torch.rand(T, K, generator=_gen(38))
    w1, w3, w2 = _weights(E, H, Fd, 39), _weights(E, H, Fd, 40), _weights(E, Fd, H, 41)

    def layer(x, w, w1, w3, w2):
        qw = quantize_expert_weights(w1.detach(), w3.detach(), w2.detach(), "e4m3fn")
        return moe_experts_fp8(
            x,
            w,
            plan.token_ids_N,
            plan.slot_ids_N,
            plan.row_of_slot_TK,
            plan.tokens_per_expert_E,
            w1,
            w3,
            w2,
            qw,
            "e4m3fn",
        ).sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break allowed
    results = []
    for fn in (compiled, layer):
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w3, w2)]
        out = fn(*leaves)
        results.append([out.detach()] + list(torch.autograd.grad(out, leaves)))
    for got, want in zip(*results, strict=False):
        assert _rel(got, want) < 1e-6


# ------------------------------------------------------------------------------------------------ refusals, config


def _fake_gpu(monkeypatch, name, major=0, minor=0, arch=None):
    props = types.SimpleNamespace(name=name, major=major, minor=minor, gcnArchName=arch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.version, "hip", "6.2" if arch else None)


@pytest.mark.parametrize(
    "name,major,minor,arch,expect",
    [
        ("NVIDIA H200", 9, 0, None, "e4m3fn"),
        ("NVIDIA L40S", 8, 9, None, "e4m3fn"),
        ("NVIDIA A100-SXM4-80GB", 8, 0, None, "sm_80"),
        ("AMD Instinct MI300X", 9, 4, "gfx942:sramecc+:xnack-", "e4m3fnuz"),
        ("AMD Instinct MI250X", 9, 0, "gfx90a:sramecc+:xnack-", "gfx90a"),
    ],
)
def test_fp8_format_by_device_and_refusals(monkeypatch, name, major, minor, arch, expect):
    _fake_gpu(monkeypatch, name, major, minor, arch)
    device = torch.device("cuda", 0)
    if expect in FORMATS:
        assert fp8_quant.fp8_format(device).name == expect
        return
    with pytest.raises(ValueError, match=rf"{name.split()[-1]}.*{expect}.*moe.fp8='off'"):
        fp8_quant.fp8_format(device)


def test_fp8_refused_on_cpu_outside_the_interpreter(monkeypatch):
    from xmoe.kernels import fp8_formats

    monkeypatch.setattr(fp8_formats, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"cpu device has none.*moe.fp8='off'"):
        fp8_quant.fp8_format(torch.device("cpu"))
    layer = MoELayer(MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=2, top_k=1, fp8="experts"))
    with pytest.raises(ValueError, match="FP8 matrix instructions"):
        layer(torch.randn(4, 16))
    # the trainer refuses it while resolving its kernels, before the data, the model or any output
    from xmoe.config import KernelConfig
    from xmoe.kernels.choice import resolve_layer

    with pytest.raises(ValueError, match=r"cpu device has none.*--fp8 off"):
        resolve_layer(layer.cfg, KernelConfig(), 4, torch.device("cpu"), torch.float32)


def test_config_fp8_field_and_train_flag():
    base = dict(hidden_size=16, ffn_hidden_size=16, num_experts=2, top_k=1)
    assert MoEConfig(**base).fp8 == "off"
    with pytest.raises(ValueError, match="fp8"):
        MoEConfig(**base, fp8="on")
    with pytest.raises(ValueError, match="kernel_backend='torch'"):
        MoEConfig(**base, fp8="experts", kernel_backend="torch")
    with pytest.raises(ValueError, match="padded"):
        MoEConfig(**base, fp8="experts", dispatcher="padded")
    import argparse

    from xmoe.train.cli import add_arguments, build_run_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert build_run_config(parser.parse_args(["--fp8", "experts"])).model.moe.fp8 == "experts"
    assert build_run_config(parser.parse_args([])).model.moe.fp8 == "off"
    assert build_run_config(parser.parse_args(["--set", "moe.fp8=experts"])).model.moe.fp8 == "experts"
    # FP8 weight gradients: kernels.wgrad = "fp8" (--wgrad fp8), with FP8 experts only
    from xmoe.config import KernelConfig
    from xmoe.kernels.choice import resolve_layer

    run = build_run_config(parser.parse_args(["--fp8", "experts", "--wgrad", "fp8"]))
    assert run.kernels.wgrad == "fp8"
    choice = resolve_layer(run.model.moe, run.kernels, 64, torch.device("cpu"), torch.float32)
    assert choice.wgrad == "fp8" and "weight gradients fp8 (kernels.wgrad fp8)" in choice.describe()
    with pytest.raises(ValueError, match=r"kernels.wgrad='fp8' .* needs moe.fp8='experts'"):
        resolve_layer(MoEConfig(**base), KernelConfig(wgrad="fp8"), 64, torch.device("cpu"), torch.float32)
