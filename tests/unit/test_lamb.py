"""LAMB on one process against a reference written from the paper (You et al. 2019, algorithm 2)."""

import pytest
import torch

from polyshard.errors import PolyshardError
from polyshard.optim import Lamb, NormSpec, build_optimizer


def reference_lamb(weights, grads_per_step, lr=1e-2, b1=0.9, b2=0.999, eps=1e-6, wd=0.01):
    """Plain LAMB, element by element in float64: the weights after one step per gradient list."""
    ws = [w.clone() for w in weights]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_per_step, start=1):
        for w, m, v, g in zip(ws, ms, vs, grads):
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            r = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * w
            ratio = (w.norm() / r.norm()).item() if w.norm() > 0 and r.norm() > 0 else 1.0
            w.sub_(lr * ratio * r)
    return ws


def _problem(steps=4):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(6, 5, generator=g, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)]
    grads = [[torch.randn(w.shape, generator=g, dtype=torch.float64) for w in weights] for _ in range(steps)]
    return weights, grads


def test_lamb_matches_reference():
    weights, grads = _problem()
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(params, lr=1e-2)
    for step in grads:
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        opt.step()
    for p, w in zip(params, reference_lamb(weights, grads)):
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12)


def test_flat_tensor_with_segments_equals_separate_tensors():
    """Two model tensors in one flat optimizer tensor (as a ZeRO bucket): trust ratios stay per tensor."""
    weights, grads = _problem()
    flat = torch.nn.Parameter(torch.cat([w.reshape(-1) for w in weights]))
    spec = NormSpec(segments=((0, 30), (30, 7)), groups=((), ()))
    opt = Lamb([flat], lr=1e-2, norm_specs={flat: spec})
    for step in grads:
        flat.grad = torch.cat([g.reshape(-1) for g in step])
        opt.step()
    expected = torch.cat([w.reshape(-1) for w in reference_lamb(weights, grads)])
    torch.testing.assert_close(flat.detach(), expected, rtol=1e-12, atol=1e-12)
    whole = Lamb([p := torch.nn.Parameter(torch.cat([w.reshape(-1) for w in weights]))], lr=1e-2)
    p.grad = torch.cat([g.reshape(-1) for g in grads[0]])
    whole.step()  # one ratio over both tensors: not LAMB's per-tensor update
    assert not torch.allclose(p.detach(), torch.cat([w.reshape(-1) for w in reference_lamb(weights, grads[:1])]))


def test_zero_weight_takes_ratio_one():
    weights, grads = _problem(steps=1)
    p = torch.nn.Parameter(weights[1].clone())  # all zeros: ||w|| = 0
    p.grad = grads[0][1].clone()
    Lamb([p], lr=1e-2).step()
    torch.testing.assert_close(p.detach(), reference_lamb([weights[1]], [[grads[0][1]]])[0])


def test_bad_arguments_raise():
    with pytest.raises(PolyshardError, match="lr"):
        Lamb([torch.nn.Parameter(torch.zeros(2))], lr=0)
    with pytest.raises(PolyshardError, match="segments"):
        NormSpec(segments=((0, 1),), groups=())
    with pytest.raises(PolyshardError, match="adamw, sgd, lamb"):
        build_optimizer("adam", [torch.nn.Parameter(torch.zeros(2))])
