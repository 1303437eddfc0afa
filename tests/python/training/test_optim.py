"""The gradient clip folded into the fused AdamW step (lrmoe.training.optim.clip_in_step),
against a float64 AdamW with clipping written out by hand (Loshchilov & Hutter 2019,
Algorithm 2; clip factor min(1, max_norm / (norm + 1e-6)) as torch/nn/utils/clip_grad.py)."""
from __future__ import annotations

import math

import pytest
import torch

from lrmoe.training.optim import clip_in_step

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _reference(params0, grads_per_step, max_norm):
    """Plain float64 AdamW with the global-norm clip, step by step (no torch.optim)."""
    ps = [p.clone() for p in params0]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    norms = []
    for t, grads in enumerate(grads_per_step, start=1):
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        norms.append(norm)
        f = min(1.0, max_norm / (norm + 1e-6))
        for i, g in enumerate(grads):
            g = g * f
            ps[i] = ps[i] * (1 - LR * WD)
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            mhat = m[i] / (1 - BETAS[0] ** t)
            vhat = v[i] / (1 - BETAS[1] ** t)
            ps[i] = ps[i] - LR * mhat / (vhat.sqrt() + EPS)
    return ps, norms


def _run(fused, params0, grads_per_step, max_norm):
    ps = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=fused)
    norms = []
    for grads in grads_per_step:
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        norms.append(float(clip_in_step(opt, ps, max_norm)))
        opt.step()
    return [p.detach() for p in ps], norms


def _case(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    params0 = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[scale * torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
             for _ in range(4)]
    return params0, grads


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("scale,max_norm", [(3.0, 1.0),      # every step clipped
                                            (0.01, 1.0),     # none clipped
                                            (1.0, 4.5),      # some clipped
                                            (3.0, float("inf"))])
def test_clip_in_step_matches_hand_written_adamw(fused, scale, max_norm):
    params0, grads = _case(0, scale)
    want, want_norms = _reference(params0, grads, max_norm)
    got, got_norms = _run(fused, params0, grads, max_norm)
    # the returned norm is the one before clipping (float32 tensor)
    assert got_norms == pytest.approx(want_norms, rel=1e-6)
    # the fused kernel reads its grad_scale as float32: the clip factor then carries a
    # float32 rounding (rel ~6e-8), the update a little more
    tol = dict(rtol=1e-6, atol=1e-8) if fused and max_norm < float("inf") else \
        dict(rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


def test_clip_in_step_changes_the_update_when_it_clips():
    # the fold must act: an unclipped update differs from the clipped reference
    params0, grads = _case(1, 3.0)
    clipped, _ = _reference(params0, grads, 1.0)
    unclipped, _ = _run(True, params0, grads, float("inf"))
    assert max(float((a - b).abs().max()) for a, b in zip(clipped, unclipped)) > 1e-4


def test_clip_in_step_grad_scale_is_cleared_for_inf():
    params0, grads = _case(2, 3.0)
    ps = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = torch.optim.AdamW(ps, fused=True)
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    clip_in_step(opt, ps, 1.0)
    assert opt.grad_scale is not None
    clip_in_step(opt, ps, float("inf"))
    assert opt.grad_scale is None


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_clip_in_step_rejects_bad_max_norm(bad):
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="optim.grad_clip"):
        clip_in_step(torch.optim.AdamW([p]), [p], bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_clip_in_step_on_cuda_fused_float32():
    # the trainer's case: fused AdamW on CUDA, float32 weights
    params0, grads = _case(3, 3.0)
    want, want_norms = _reference(params0, grads, 1.0)
    ps = [torch.nn.Parameter(p.float().cuda()) for p in params0]
    opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    norms = []
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = g.float().cuda()
        norms.append(float(clip_in_step(opt, ps, 1.0)))
        opt.step()
    assert norms == pytest.approx(want_norms, rel=1e-5)
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.detach().double().cpu(), w, rtol=1e-4, atol=1e-5)
