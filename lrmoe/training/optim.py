"""AdamW with decoupled weight decay on matrices only, and the warm-up + cosine schedule."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

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
