"""FP8 weight gradients (xmoe/kernels/fp8_wgrad.py, kernels.wgrad = "fp8") against float64 references
(fp8_reference.py), in Triton's interpreter (FP8 values held in float32, as test_fp8.py says).

# N rows (expert-major), C columns, E experts; G = 128
Counts cross the 128-row groups (0, 1, 127, 128, 129, 300 rows), columns the interpreter's 32-wide tiles.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import fp8_reference as R
import pytest
import torch

from xmoe.kernels import tiles
from xmoe.kernels.fp8_wgrad import column_groups, fp8_wgrad, quantize_cols

COUNTS = [129, 0, 1, 300, 128, 127]


def _rows(n, c, seed):
    """Rows whose magnitudes span 1e-3 .. 1e3 down the rows, with one column 100x the rest: a column's scale
    read from the wrong group, or a group's from the wrong column, changes results well beyond rounding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)][:, None]
    x[:, c // 3] *= 100
    return x


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _written(q, s, counts):
    """The groups quantize_cols wrote, in order (its layout also has slots past the last expert's groups)."""
    used = sum(-(-n // 128) for n in counts.tolist())
    return q[:, : used * 128], s[:used]


def test_column_groups_layout():
    counts = torch.tensor(COUNTS)
    bounds, expert_J = column_groups(counts, sum(COUNTS))
    starts = torch.cumsum(torch.tensor([0] + COUNTS[:-1]), 0)
    groups = torch.tensor([-(-n // 128) for n in COUNTS])
    assert bounds.dtype == torch.int32 and expert_J.dtype == torch.int32
    assert bounds[0].tolist() == starts.tolist() and bounds[1].tolist() == (starts + torch.tensor(COUNTS)).tolist()
    assert bounds[2].tolist() == (torch.cumsum(groups, 0) - groups).tolist()
    want = torch.repeat_interleave(torch.arange(len(COUNTS)), groups)
    assert expert_J[: len(want)].tolist() == want.tolist()
    assert len(expert_J) == -(-sum(COUNTS) // 128) + len(COUNTS)  # a host-side bound, no sync
    assert (expert_J[len(want) :] == len(COUNTS)).all()  # slots past the last group: expert E, skipped


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("gather", [False, True])
def test_quantize_cols_matches_float64(fmt, gather):
    counts = torch.tensor(COUNTS)
    N, C, T = sum(COUNTS), 70, 800
    x = _rows(T if gather else N, C, seed=1)
    x[5] = 0.0  # an all-zero row inside a group; and expert 3 gets an all-zero 128-row group below
    idx = torch.randperm(T, generator=torch.Generator().manual_seed(2))[:N] if gather else None
    rows = x[idx] if gather else x
    if not gather:
        x[130 + 128 : 130 + 256] = 0.0
    bounds, expert_J = column_groups(counts, N)
    q, s = quantize_cols(x, idx, bounds, expert_J, fmt)
    assert q.shape == (C, len(expert_J) * 128) and s.shape == (len(expert_J), C)
    q_ref, s_ref = R.quantize_cols(rows, counts, fmt)
    q, s = _written(q, s, counts)
    assert torch.equal(s.double(), s_ref) and torch.equal(q.double(), q_ref)  # bitwise, padding zeros included
    assert torch.isfinite(q).all()


def test_quantize_cols_bf16_input_and_no_rows():
    counts = torch.tensor([3, 0, 200])
    x = _rows(203, 40, seed=3).bfloat16()
    bounds, expert_J = column_groups(counts, 203)
    q, s = _written(*quantize_cols(x, None, bounds, expert_J, "e4m3fn"), counts)
    q_ref, s_ref = R.quantize_cols(x.float(), counts, "e4m3fn")
    assert torch.equal(s.double(), s_ref) and torch.equal(q.double(), q_ref)
    empty = torch.zeros(3, dtype=torch.int64)
    bounds, expert_J = column_groups(empty, 0)
    q, s = quantize_cols(torch.empty(0, 40), None, bounds, expert_J, "e4m3fn")
    assert q.shape == (40, 3 * 128) and s.shape == (3, 40)
    with pytest.raises(ValueError, match="not column_groups' of 5 rows"):
        quantize_cols(torch.empty(5, 40), None, bounds, expert_J, "e4m3fn")


@pytest.fixture(params=[False, True], ids=["one_tile", "halves"])
def wide(request):
    """The interpreter's 32-column tiles, or 256 columns computed as two 128-column halves."""
    if not request.param:
        yield
        return
    with tiles.force({"fp8_wgrad": tiles.TileConfig(32, 256, 32, 4, 1)}):
        yield


def test_fp8_wgrad_matches_float64_of_its_inputs(tma, wide):
    counts = torch.tensor(COUNTS)
    N, M, NC = sum(COUNTS), 70, 136  # NC: a full 128-column half and a ragged one
    a, b = _rows(N, M, seed=4), _rows(N, NC, seed=5)
    bounds, expert_J = column_groups(counts, N)
    aq, sa = quantize_cols(a, None, bounds, expert_J, "e4m3fn")
    bq, sb = quantize_cols(b, None, bounds, expert_J, "e4m3fn")
    c = fp8_wgrad(aq, sa, bq, sb, bounds, "e4m3fn", torch.float32)
    assert c.shape == (len(COUNTS), M, NC)
    da = R.dequantize_cols(*_written(aq, sa, counts))
    db = R.dequantize_cols(*_written(bq, sb, counts))
    ref, col = [], 0
    for n in COUNTS:
        width = -(-n // 128) * 128
        ref.append(da[:, col : col + width] @ db[:, col : col + width].T)
        col += width
    ref = torch.stack(ref)
    assert (c[1] == 0).all() and _rel(c, ref) < 1e-6  # the empty expert's gradient is zero
    # against the unquantised product: FP8's own error, e4m3's 3 mantissa bits
    assert _rel(c, R._per_expert_wgrad(a.double(), b.double(), counts)) < 0.08
    if tma is not None:
        assert [t.data_ptr() for t in tma] == [aq.data_ptr(), bq.data_ptr()]


def test_fp8_wgrad_checks_its_operands():
    counts = torch.tensor([4, 4])
    bounds, expert_J = column_groups(counts, 8)
    aq, sa = quantize_cols(torch.randn(8, 16), None, bounds, expert_J, "e4m3fn")
    other_bounds, other_J = column_groups(torch.tensor([8, 200]), 208)
    bq, sb = quantize_cols(torch.randn(208, 16), None, other_bounds, other_J, "e4m3fn")
    with pytest.raises(ValueError, match="one column_groups layout"):
        fp8_wgrad(aq, sa, bq, sb, bounds, "e4m3fn", torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        fp8_wgrad(aq.double(), sa, aq, sa, bounds, "e4m3fn", torch.float32)
