"""Rows that arrive in FP8 (xmoe/kernels/fp8_rows.py; fp8_experts.grouped_swiglu_fp8 taking Fp8Rows): the plain-torch
quantiser against the Triton one bitwise and against float64, and the FP8 experts on quantised rows against the
same experts quantising the dequantised rows themselves (bitwise) and against the float64 reference.

# N rows, H hidden, F expert ffn, E experts; G = 128
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import fp8_reference as R
import pytest
import torch

from xmoe.dispatch.routing import build_plan
from xmoe.kernels import Fp8Rows, dequantize_rows, fp8_quant, quantize_rows, stand_in_rows
from xmoe.kernels.choice import resolve_kernels
from xmoe.kernels.fp8_experts import grouped_swiglu_fp8
from xmoe.kernels.fp8_quant import FORMATS, quantize_expert_weights

FMTS = sorted(FORMATS)
# numpy's warnings from the interpreter's kernels on the rows' infinities and NaNs
pytestmark = pytest.mark.filterwarnings(
    "ignore:(overflow|invalid value) encountered:RuntimeWarning", "ignore:All-NaN slice:RuntimeWarning"
)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _awkward_rows(fmt):
    """Magnitudes over 1e-4 .. 1e4, a partial last group (300 columns), and the cases a quantiser gets wrong:
    zero rows and groups, values landing on subnormals or rounding to (negative) zero, the format's max exactly
    and one fp32 rounding above it, infinities and NaNs (NaN alone in a group, or beside other values)."""
    fmax = FORMATS[fmt].max
    x = torch.randn(40, 300, generator=_gen(1)) * torch.logspace(-4, 4, 40)[:, None]
    x[3] = 0.0
    x[4, 128:256] = 0.0
    x[5, :128] = -1e-9 * torch.rand(128, generator=_gen(2))  # rounds to zero: stored as +0
    x[5, 0] = 1.0
    x[6, :128] = torch.linspace(-1, 1, 128) * 2.0**-15
    x[6, 0] = 1.0  # the rest on FP8 subnormals
    x[7, :128] = torch.linspace(-1, 1, 128) * fmax * 8
    x[8, :128] = x[7, :128] * (1 + 2**-20)
    x[9] = -0.0
    x[10, 5], x[11, 3] = float("inf"), -float("inf")
    x[12, 200] = float("nan")
    x[13, :128] = float("nan")
    x[14, 1], x[14, 2] = float("nan"), float("inf")
    return x


def _bytes(q, fmt):
    """FP8 values as their bytes (fp8_quant holds them in float32 under the interpreter)."""
    return q.to(FORMATS[fmt].dtype).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FMTS)
def test_torch_quantiser_gives_the_triton_bytes_and_scales(fmt, dtype):
    x = _awkward_rows(fmt).to(dtype)
    q, s = quantize_rows(x, fmt)
    q_t, s_t = fp8_quant.quantize_rows(x, fmt)
    assert q.dtype == FORMATS[fmt].dtype and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (40, 3)
    assert torch.equal(q.view(torch.uint8), _bytes(q_t, fmt))
    assert torch.equal(s.view(torch.int32), s_t.view(torch.int32))  # bitwise, NaN and inf scales included
    assert (q.view(torch.uint8)[5, 1:128] == 0).all()  # negative values that round to zero: +0, as the kernel
    # and the float64 reference (torch's own conversion, float64 quotients) where every value is finite
    finite = torch.isfinite(x).all(1)
    q_ref, s_ref = R.quantize_rows(x[finite], fmt)
    assert torch.equal(q[finite].double(), q_ref) and torch.equal(s[finite].double(), s_ref)


def test_quantiser_edges_and_refusals():
    q, s = quantize_rows(torch.randn(0, 200), "e4m3fn")
    assert q.shape == (0, 200) and s.shape == (0, 2)
    q, s = quantize_rows(torch.randn(3, 0), "e4m3fnuz")
    assert q.shape == (3, 0) and s.shape == (3, 0)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_rows(torch.randn(2, 3, 4), "e4m3fn")
    with pytest.raises(ValueError, match="e4m3fnx"):
        quantize_rows(torch.randn(2, 4), "e4m3fnx")
    with pytest.raises(ValueError, match=r"scales of shape \(4, 2\)"):
        dequantize_rows(*quantize_rows(torch.randn(4, 200), "e4m3fn")[:1], torch.ones(4, 1), torch.float32)


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_rows(fmt):
    x = torch.randn(9, 300, generator=_gen(3)) * torch.logspace(-3, 3, 9)[:, None]
    q, s = quantize_rows(x, fmt)
    exact = R.dequantize_rows(q, s)  # float64: each product q * s exact
    assert torch.equal(dequantize_rows(q, s, torch.float32), exact.float())  # one fp32 rounding of q * s
    for dtype in (torch.bfloat16, torch.float16):
        got = dequantize_rows(q, s, dtype)
        assert got.dtype == dtype and torch.equal(got, exact.float().to(dtype))
    assert _rel(dequantize_rows(q, s, torch.float32), x) < 0.04  # e4m3: 3 mantissa bits


# ------------------------------------------------------------------------------------------------ FP8 experts


def _experts_case(seed, H=136, Fd=96):
    counts = torch.tensor([5, 0, 9, 2])
    E, N = counts.shape[0], int(counts.sum())
    g = _gen(seed)
    x = torch.randn(N, H, generator=g) * torch.logspace(-2, 0, N)[:, None]
    grad = torch.randn(N, H, generator=g)
    w1, w3 = (torch.randn(E, H, Fd, generator=g) / H**0.5 for _ in range(2))
    w2 = torch.randn(E, Fd, H, generator=g) / Fd**0.5
    return counts, x, grad, w1, w3, w2


def _run(rows, counts, grad, w1, w3, w2, fmt, wgrad="auto"):
    """(y, d rows, dw1, dw3, dw2) of grouped_swiglu_fp8 on rows (a tensor or Fp8Rows) under kernels.wgrad ``wgrad``."""
    leaves = [w.clone().requires_grad_() for w in (w1, w3, w2)]
    x_in = rows.stand_in if isinstance(rows, Fp8Rows) else rows
    y = grouped_swiglu_fp8(rows, *leaves, counts, quantize_expert_weights(w1, w3, w2, fmt), fmt, wgrad=wgrad)
    return [y, *torch.autograd.grad(y, [x_in, *leaves], grad)]


@pytest.mark.parametrize("wgrad", ["auto", "fp8"])
def test_experts_on_quantised_rows_equal_them_on_the_dequantised_rows(wgrad):
    """Quantised rows in: no second quantisation, so the forward is bitwise what the dequantised rows give (their
    own quantisation gives back the same bytes), and so are the gradients (the weight gradients read the rows
    dequantised), with the input gradient returned for the stand-in."""
    fmt = "e4m3fn"
    counts, x, grad, w1, w3, w2 = _experts_case(seed=4)
    q, s = quantize_rows(x, fmt)
    deq = dequantize_rows(q, s, torch.float32)
    q2, s2 = quantize_rows(deq, fmt)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    stand_in = stand_in_rows(q, torch.float32).requires_grad_()
    assert stand_in.untyped_storage().nbytes() == 4  # one element: no (N, H) buffer
    if wgrad == "fp8":
        q = q.float()  # FP8 values held the interpreter's way (float32) are taken too
    want = _run(deq.clone().requires_grad_(), counts, grad, w1, w3, w2, fmt, wgrad)
    got = _run(Fp8Rows(q, s, stand_in), counts, grad, w1, w3, w2, fmt, wgrad)
    for name, a, b in zip(["y", "dx", "dw1", "dw3", "dw2"], got, want, strict=True):
        assert torch.equal(a, b), name


def test_experts_on_quantised_rows_match_float64():
    """Against the float64 emulation (fp8_reference) of the rows routed once each (K = 1, weight 1), fed the
    dequantised rows: y, the input gradient (of the dequantised rows) and the weight gradients."""
    fmt = "e4m3fnuz"
    counts, x, grad, w1, w3, w2 = _experts_case(seed=5, H=160, Fd=136)  # F: a full scale group and a part
    q, s = quantize_rows(x, fmt)
    stand_in = stand_in_rows(q, torch.float32).requires_grad_()
    got = _run(Fp8Rows(q, s, stand_in), counts, grad, w1, w3, w2, fmt)
    N = x.shape[0]
    plan = build_plan(torch.repeat_interleave(torch.arange(4), counts)[:, None], torch.ones(N, 1), 4, None)
    assert torch.equal(plan.token_ids_N, torch.arange(N))
    deq = R.dequantize_rows(q, s).float()
    ref = R.moe_experts_fp8(deq, torch.ones(N, 1), plan, w1, w3, w2, grad, fmt)
    for name, a, b in zip(["y", "dx", "dw1", "dw3", "dw2"], got, [ref[0], ref[1], *ref[3:]], strict=True):
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))


def test_quantised_rows_are_what_the_backward_keeps():
    """The forward keeps the FP8 rows and their scales for the weight gradients, not an (N, H) activation."""
    fmt = "e4m3fn"
    counts, x, _grad, w1, w3, w2 = _experts_case(seed=6)
    q, s = quantize_rows(x, fmt)
    q = q.float()  # as the interpreter's kernels hold FP8 values: kept as given
    stand_in = stand_in_rows(q, torch.float32).requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        grouped_swiglu_fp8(
            Fp8Rows(q, s, stand_in), w1, w3, w2.requires_grad_(), counts, quantize_expert_weights(w1, w3, w2, fmt), fmt
        )
    big = [t for t in kept if t.shape == x.shape and t.untyped_storage().nbytes() > 4]
    assert len(big) == 1 and big[0].data_ptr() == q.data_ptr()
    assert any(t.data_ptr() == s.data_ptr() for t in kept)


def test_bad_quantised_rows_are_refused():
    fmt = "e4m3fn"
    counts, x, _grad, w1, w3, w2 = _experts_case(seed=7)
    q, s = quantize_rows(x, fmt)
    qw = quantize_expert_weights(w1, w3, w2, fmt)
    stand_in = stand_in_rows(q, torch.float32)

    def call(rows):
        return grouped_swiglu_fp8(rows, w1, w3, w2, counts, qw, fmt)

    with pytest.raises(ValueError, match=r"Fp8Rows\.q .* take"):
        call(Fp8Rows(q.view(torch.float8_e4m3fnuz), s, stand_in))
    with pytest.raises(ValueError, match=r"Fp8Rows\.scale"):
        call(Fp8Rows(q, s[:, :1], stand_in))
    with pytest.raises(ValueError, match=r"Fp8Rows\.stand_in"):
        call(Fp8Rows(q, s, stand_in[:, :128]))


def test_fp8_routed_experts_module_takes_quantised_rows():
    """RoutedExperts with FP8 experts (what FP8 dispatch hands them): the rows as they arrived give what their
    dequantised copy gives, the gradient reaching the stand-in and the weights' gradients included."""
    from xmoe.moe.experts import RoutedExperts

    fmt = "e4m3fn"
    counts, x, grad, *_ = _experts_case(seed=8)
    experts = RoutedExperts(4, x.shape[1], 96, kernels=resolve_kernels("triton"), fp8=True)
    q, s = quantize_rows(x, fmt)
    results = []
    for rows in (dequantize_rows(q, s, torch.float32).requires_grad_(), Fp8Rows(q, s, stand_in_rows(q, torch.float32))):
        x_in = rows.stand_in.requires_grad_() if isinstance(rows, Fp8Rows) else rows
        experts.zero_grad(set_to_none=True)
        y = experts(rows, counts)
        y.backward(grad)
        results.append([y, x_in.grad, experts.w1.grad, experts.w3.grad, experts.w2.grad])
    for name, a, b in zip(["y", "dx", "dw1", "dw3", "dw2"], *results, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("fp8", [False, True])
def test_carrying_side_bytes_round_trip(fp8):
    """Row payloads with K int32 ids appended (comm.carrying, RBD's stage 1): every arrival (none, one row, a subset
    in another order: slices of the payload, as a receive buffer holds them) gives back the rows (bitwise as the
    base encoding alone gives them) and the ids exactly, at widths whose byte offsets are not multiples of 4."""
    from xmoe.dispatch.comm import carrying
    from xmoe.dispatch.fp8_dispatch import fp8_encoding

    gen = torch.Generator().manual_seed(3)
    for hidden in (5, 130):
        x_NH = torch.randn(6, hidden, generator=gen).to(torch.bfloat16)
        ids_NK = torch.randint(-1, 1000, (6, 3), generator=gen, dtype=torch.int32)
        base = fp8_encoding(False) if fp8 else None
        enc = carrying(ids_NK, base)
        payload = enc.encode(x_NH)
        like = x_NH.new_empty((0, hidden))
        for rows in ([], [4], [5, 0, 2]):
            index = torch.tensor(rows, dtype=torch.long)
            got, (extra, ids_back) = enc.decode(payload[index] if rows else payload[:0], like)
            assert torch.equal(ids_back, ids_NK[index]) and extra is None
            want = base.decode(base.encode(x_NH)[index], like)[0] if base is not None else x_NH[index]
            assert got.dtype == x_NH.dtype and torch.equal(got, want), (hidden, rows)
            if rows and not fp8:
                assert torch.equal(got, x_NH[index])
