"""The training objective: next-token NLL on the loss tokens plus the model's
load-balancing loss over the real (non-padding) tokens; and the validation loss.

Legend: B sequences, S = seq_len, V vocabulary, T = B*S token rows, E experts, K top-k.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrmoe.training.batches import Batch, make_batch


def causal_lm_nll(logits_BSV: Tensor, labels_BS: Tensor) -> Tuple[Tensor, Tensor]:
    """Summed next-token negative log-likelihood, as transformers' causal-LM loss shifts it.

    Position s predicts ``labels[:, s + 1]``; labels -100 are ignored.

    Args:
        logits_BSV: (B, S, V) logits (any float dtype; computed in float32).
        labels_BS: (B, S) int64 labels, -100 where no loss is taken.

    Returns:
        (nll_sum () float32, count () int64): sum of -log p over loss tokens, their number.
    """
    logits = logits_BSV[:, :-1].float()
    targets = labels_BS[:, 1:].to(logits.device)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                          ignore_index=-100, reduction="sum")
    return nll, (targets != -100).sum()


def _load_balancing_loss_func(model: nn.Module) -> Any:
    """transformers' ``load_balancing_loss_func`` of the model's own modeling module (the
    Switch-Transformer loss every transformers MoE family defines); Qwen3-MoE's when the
    module has none."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if fn is None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
        fn = load_balancing_loss_func
    return fn


def lm_forward(model: nn.Module, batch: Batch, *, aux_loss: bool,
               wrapper: Optional[nn.Module] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Call a transformers causal LM on ``batch``.

    The model gets the batch's position ids (restarting per packed example: transformers
    then masks attention block-diagonally, see :mod:`lrmoe.training.batches`) and no
    2-D attention mask. The load-balancing loss is transformers' own
    ``load_balancing_loss_func`` over the router logits with the batch's padding mask, so
    padding positions count neither in the routed fractions nor in the mean router
    probabilities (the model's ``outputs.aux_loss`` would count them: it sees no mask).

    Args:
        model: e.g. a (patched) ``Qwen3MoeForCausalLM``.
        batch: on the model's device.
        aux_loss: also compute the load-balancing loss (``output_router_logits=True``).
        wrapper: what to call instead of ``model`` (its DDP wrapper), or None.

    Returns:
        ``(logits (B, S, V), aux () float32 or None)``; aux is None without router logits.
    """
    call = wrapper if wrapper is not None else model
    out = call(input_ids=batch.input_ids_BS, position_ids=batch.position_ids_BS,
               use_cache=False, output_router_logits=aux_loss)
    aux = None
    router_logits = getattr(out, "router_logits", None) if aux_loss else None
    if router_logits:
        cfg = model.config
        num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts")
        aux = _load_balancing_loss_func(model)(
            tuple(router_logits), num_experts, cfg.num_experts_per_tok,
            batch.attention_mask_BS)
        aux = aux.float() if isinstance(aux, Tensor) else None
    return out.logits, aux


def autocast(device: torch.device, dtype: Optional[torch.dtype]) -> Any:
    """``torch.autocast`` to ``dtype`` on ``device``, or a disabled one for None."""
    if dtype is None:
        return torch.autocast(device_type=device.type, enabled=False)
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(model: nn.Module, blocks: Any, batch_size: int, max_batches: int,
             device: torch.device, autocast_dtype: Optional[torch.dtype],
             isolate_examples: bool = True) -> Dict[str, float]:
    """Validation loss over the first ``max_batches`` batches of ``blocks`` in order.

    Args:
        model: a causal LM returning ``.logits`` (B, S, V).
        blocks: TokenBlocks (``input_ids``, ``labels``: (N, S) int64; optional
            ``segment_ids``).
        batch_size: sequences per forward.
        max_batches: 0 for all of ``blocks``.
        device: where the model is. autocast_dtype: bf16 autocast, or None.
        isolate_examples: as in training (:func:`lrmoe.training.batches.make_batch`).

    Returns:
        ``{"val_loss": mean NLL per loss token (nats), "val_ppl": exp(val_loss),
        "val_tokens": loss tokens counted}``.

    Raises:
        ValueError: the blocks hold no loss token.
    """
    was_training = model.training
    model.eval()
    n = len(blocks)
    num = math.ceil(n / batch_size)
    if max_batches:
        num = min(num, max_batches)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    try:
        for b in range(num):
            batch = make_batch(blocks, slice(b * batch_size, (b + 1) * batch_size),
                               isolate_examples).to(device)
            with autocast(device, autocast_dtype):
                logits, _ = lm_forward(model, batch, aux_loss=False)
            s, c = causal_lm_nll(logits, batch.labels_BS)
            nll += s.double()
            count += c
    finally:
        model.train(was_training)
    tokens = int(count)
    if tokens == 0:
        raise ValueError("the validation split holds no loss token; raise data.val_fraction "
                         "or check the data")
    loss = float(nll) / tokens
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": tokens}
