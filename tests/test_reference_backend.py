"""The torch backend's grouped SwiGLU (the CPU path of `xmoe train`) against a float64 per-expert loop.

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
