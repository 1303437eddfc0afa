"""AdamW with decoupled weight decay on matrices only, the warm-up + cosine schedule, and
the gradient clip folded into the fused AdamW step."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Tuple

import torch
from torch import Tensor, nn

from lrmoe.training.config import OptimConfig


def lr_factor(step: int, *, lr: float, min_lr: float, warmup_steps: int,
              decay_steps: int) -> float:
    """Multiplier of ``lr`` for the optimizer step with 0-based index ``step``.

    Linear warm-up ``(step + 1) / warmup_steps`` for ``step < warmup_steps``; then cosine
    from lr to min_lr: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - warmup_steps) / (decay_steps - warmup_steps)`` clipped to [0, 1]
    (min_lr from ``decay_steps`` on; SGDR, Loshchilov & Hutter 2017, without restarts).
    Returns lr(step) / lr.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    value = min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return value / lr


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Two AdamW groups: matrices with ``weight_decay``; biases, norms and other vectors
    without (decay would pull norm gains towards 0)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2 or name.endswith(".bias") or "norm" in name.lower():
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: OptimConfig, model: nn.Module, device: torch.device,
                    decay_steps: int) -> Tuple[torch.optim.Optimizer,
                                               torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (fused on CUDA) over :func:`param_groups` and a ``LambdaLR`` of
    :func:`lr_factor`.

    Args:
        cfg: the ``optim`` section.
        model: the (patched) model, already on ``device``.
        device: where the parameters are.
        decay_steps: the step at which the cosine reaches ``min_lr``.

    Returns:
        ``(optimizer, scheduler)``; step the scheduler once per optimizer step.
    """
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                  betas=cfg.betas, eps=cfg.adam_eps,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, lr=cfg.lr, min_lr=cfg.min_lr,
                                       warmup_steps=cfg.warmup_steps, decay_steps=decay_steps))
    return optimizer, scheduler


def clip_in_step(optimizer: torch.optim.Optimizer, params: Iterable[Tensor],
                 max_norm: float) -> Tensor:
    """Clip the global L2 gradient norm to ``max_norm`` and return the norm before clipping.

    Same result as ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (grads scaled by
    ``min(1, max_norm / (norm + 1e-6))``, torch/nn/utils/clip_grad.py), but with a fused
    Adam/AdamW (``fused=True``) the scaling rides inside the optimizer's own kernel: the
    factor goes in as the optimizer's ``grad_scale`` tensor, which ``torch._fused_adamw_``
    divides every gradient by as it reads it (the hook torch's GradScaler uses). That
    saves one read and one write of every gradient per step (a ``_foreach_mul_`` of
    7.5 ms per step at the qwen3-slice shape on the H100; docs/results.md). Nothing reads
    the gradients between this call and ``optimizer.step()`` (the placement hooks copy
    weights, not grads). Any other optimizer, or ``max_norm = inf``, falls back to torch's
    own clip (no scaling at all for inf).

    Args:
        optimizer: the optimizer whose next ``step()`` applies the update; a fused Adam(W)
            has ``defaults["fused"]`` true.
        params: the parameters whose ``.grad`` count (those without a grad are skipped).
        max_norm: the largest allowed global norm, > 0; ``float("inf")``: measure only.

    Returns:
        the global L2 norm of the gradients before clipping: a 0-dim float32 tensor on the
        gradients' device (no host sync).

    Raises:
        ValueError: ``max_norm`` is not > 0.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0 (optim.grad_clip; inf: no clipping), got "
                         f"{max_norm!r}")
    params = [p for p in params if p.grad is not None]
    fused = bool(optimizer.defaults.get("fused")) and isinstance(
        optimizer, (torch.optim.Adam, torch.optim.AdamW))
    if not fused:
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        return torch.nn.utils.clip_grad_norm_(params, max_norm).float()
    norm = (torch.nn.utils.get_total_norm([p.grad for p in params]) if params
            else torch.zeros(()))
    optimizer.grad_scale = None if max_norm == float("inf") else (  # type: ignore[attr-defined]
        # the kernel divides by grad_scale (a float32 it reads on the device): the inverse
        # of clip_grad_norm_'s clamped clip coefficient
        torch.clamp((norm + 1e-6) / max_norm, min=1.0).float())
    return norm.float()
