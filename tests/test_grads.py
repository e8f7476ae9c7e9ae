"""The gradient scales of xmoe/parallel/grads.py against plain autograd (the multi-process scales are checked end to
end by test_expert_parallel.py and test_ssmb.py against single-process runs)."""

import torch
from torch import nn

from xmoe.parallel.grads import ScaleGrad, scale_weight_grads


def test_scale_weight_grads_scales_weights_only():
    torch.manual_seed(0)
    plain = nn.Linear(5, 3).double()
    scaled = nn.Linear(5, 3).double()
    scaled.load_state_dict(plain.state_dict())
    scale_weight_grads(scaled, 0.25)
    x1 = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    g = torch.randn(7, 3, dtype=torch.float64)
    out1, out2 = plain(x1), scaled(x2)
    assert torch.equal(out1, out2)  # forward untouched
    out1.backward(g)
    out2.backward(g)
    torch.testing.assert_close(scaled.weight.grad, 0.25 * plain.weight.grad, rtol=1e-15, atol=0)
    torch.testing.assert_close(scaled.bias.grad, 0.25 * plain.bias.grad, rtol=1e-15, atol=0)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-15, atol=0)


def test_scale_grad_is_identity_forward():
    x = torch.randn(4, requires_grad=True)
    y = ScaleGrad.apply(x, 3.0)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0))
