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

from lrmoe.integrations.transformers import moe_layers
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


#: attention implementations whose transformers mask builder takes a 4-D mask as given
_MASKED_IMPLEMENTATIONS = ("sdpa", "flex_attention", "eager")


def packed_causal_mask(model: nn.Module, batch: Batch) -> Any:
    """The causal mask of a packed batch built as transformers builds it, without its sync.

    Given position ids and no mask, transformers finds the packed examples itself
    (``masking_utils.find_packed_sequence_indices``) and then asks ``(ids[:, -1] ==
    0).all()`` on the host, which waits for the GPU at every forward (tools/sync_probe.py).
    Here the same sequence indices (a new example wherever the position does not follow
    the previous one by 1) go to transformers' own ``create_causal_mask`` as its
    ``and_mask_function`` (causal AND same example, the mask transformers composes for a
    packed batch), and the 4-D result is passed to the model, which uses a 4-D mask as
    given.

    Args:
        model: a transformers causal LM (``config._attn_implementation``).
        batch: with ``position_ids_BS`` (B, S) int64 restarting per example, on the
            model's device.

    Returns:
        a (B, 1, S, S) bool tensor (``sdpa``), float tensor (``eager``) or ``BlockMask``
        (``flex_attention``); None (transformers builds the mask) without position ids, for
        another attention implementation, or for a model with sliding-window attention.
    """
    pos_BS = batch.position_ids_BS
    cfg = getattr(model, "config", None)
    if pos_BS is None or cfg is None or getattr(cfg, "sliding_window", None) is not None \
            or getattr(cfg, "_attn_implementation", None) not in _MASKED_IMPLEMENTATIONS:
        return None
    from transformers.masking_utils import create_causal_mask, packed_sequence_mask_function

    first_BS = torch.diff(pos_BS, prepend=pos_BS[:, :1] - 1, dim=-1) != 1
    seq_BS = first_BS.cumsum(-1)
    weight = model.get_input_embeddings().weight
    # only the shape (B, S), the dtype (eager's fill value) and the device are read
    shape_BS0 = torch.empty(*pos_BS.shape, 0, dtype=weight.dtype, device=pos_BS.device)
    return create_causal_mask(config=cfg, inputs_embeds=shape_BS0, attention_mask=None,
                              past_key_values=None, position_ids=None,
                              and_mask_function=packed_sequence_mask_function(seq_BS))


def lm_forward(model: nn.Module, batch: Batch, *, aux_loss: bool,
               wrapper: Optional[nn.Module] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Call a transformers causal LM on ``batch``.

    The model gets the batch's position ids (restarting per packed example) and the
    block-diagonal causal mask of :func:`packed_causal_mask` (transformers' own mask, built
    without its host sync; see :mod:`lrmoe.training.batches`). The load-balancing loss is
    transformers' own ``load_balancing_loss_func`` over the router logits (each lrmoe
    layer's ``router_logits`` when the model has lrmoe layers, so no host sync; else the
    model's ``output_router_logits``) with the batch's padding mask, so padding positions
    count neither in the routed fractions nor in the mean router probabilities (the
    model's ``outputs.aux_loss`` would count them: it sees no mask).

    Args:
        model: e.g. a (patched) ``Qwen3MoeForCausalLM``.
        batch: on the model's device.
        aux_loss: also compute the load-balancing loss.
        wrapper: what to call instead of ``model`` (its DDP wrapper), or None.

    Returns:
        ``(logits (B, S, V), aux () float32 or None)``; aux is None without router logits.
    """
    call = wrapper if wrapper is not None else model
    # With lrmoe's layers in the model the router logits are read off the layers, and the
    # model is not asked for them: with output_router_logits=True transformers also
    # computes its own aux loss without a mask, whose torch.bincount waits for the GPU
    # once per layer (tools/sync_probe.py found 8 such waits a step at qwen3-slice).
    # (every MoE block of the model is an lrmoe layer: patch_moe_blocks patches all)
    layers = [m for _, m in moe_layers(model)] if aux_loss else []
    ask_logits = aux_loss and not layers
    # the model's own aux loss reads attention_mask as a 2-D padding mask: no 4-D mask then
    mask = None if ask_logits else packed_causal_mask(model, batch)
    out = call(input_ids=batch.input_ids_BS, position_ids=batch.position_ids_BS,
               use_cache=False, output_router_logits=ask_logits,
               **({} if mask is None else {"attention_mask": mask}))
    aux = None
    if layers:
        router_logits = [layer.router_logits for layer in layers]
    else:
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
