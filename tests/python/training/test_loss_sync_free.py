"""The training forward without transformers' host syncs (lrmoe/training/loss.py).

tools/sync_probe.py found two kinds of wait per step at qwen3-slice: transformers'
packed-sequence detection (``find_packed_sequence_indices``: a host ``.all()``) and the
model's own aux loss under ``output_router_logits=True`` (``torch.bincount``, once per
layer). These tests check that the replacements compute what transformers computes: the
mask against transformers' own mask built from the position ids, the aux loss against a
float64 Switch loss over the router logits transformers itself records.
"""
from __future__ import annotations

import pytest
import torch

from test_train import _tiny_lm, ref_switch_loss


def _packed_batch(vocab: int = 50):
    from lrmoe.data import TokenBlocks
    from lrmoe.training.batches import make_batch

    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (3, 12))
    seg = torch.tensor([[1] * 5 + [2] * 4 + [3] * 3, [1] * 12, [1] * 7 + [0] * 5])
    return ids, seg, make_batch(TokenBlocks(ids, ids.clone(), seg), slice(0, 3), True)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
def test_packed_mask_gives_transformers_logits(attn):
    """Logits with our 4-D mask equal the model's with its own mask from the position ids;
    the mask is not causal-only (a plain causal mask gives other logits)."""
    from lrmoe.training.loss import lm_forward, packed_causal_mask

    model = _tiny_lm(attn, seed=3)
    ids, _, batch = _packed_batch()
    mask = packed_causal_mask(model, batch)
    assert mask is not None and tuple(mask.shape)[::2] == (3, 12) and mask.shape[-1] == 12
    with torch.no_grad():
        ours, _ = lm_forward(model, batch, aux_loss=False)
        theirs = model(input_ids=ids, position_ids=batch.position_ids_BS, use_cache=False).logits
        causal_only = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (ours - causal_only).abs().max() > 1e-3, "the packed mask must change the logits"


def test_packed_mask_hand_checked():
    """The sdpa mask of row 0 (examples of 5, 4 and 3 tokens) is block-diagonal causal,
    cell by cell from the segment lengths."""
    from lrmoe.training.loss import packed_causal_mask

    model = _tiny_lm("sdpa", seed=0)
    _, _, batch = _packed_batch()
    mask = packed_causal_mask(model, batch)[0, 0]
    starts = [0, 5, 9, 12]
    for q in range(12):
        for k in range(12):
            same = any(a <= q < b and a <= k < b for a, b in zip(starts, starts[1:]))
            assert bool(mask[q, k]) == (same and k <= q), (q, k)


def test_no_packed_mask_without_positions_or_for_sliding_window():
    from lrmoe.training.loss import packed_causal_mask

    model = _tiny_lm("sdpa", seed=0)
    _, _, batch = _packed_batch()
    assert packed_causal_mask(model, batch.__class__(**{**batch.__dict__,
                                                        "position_ids_BS": None})) is None
    model.config.sliding_window = 4
    assert packed_causal_mask(model, batch) is None


def test_aux_loss_from_lrmoe_layers_without_output_router_logits():
    """With lrmoe's layers patched in, the model is not asked for router logits (so its own
    bincount aux loss never runs) and the aux loss equals the float64 Switch loss over the
    real tokens of the logits transformers records in a separate forward."""
    from lrmoe.integrations.transformers import patch_moe_blocks
    from lrmoe.training.loss import lm_forward

    model = _tiny_lm(seed=0)
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.gate.weight.mul_(50.0)
    patch_moe_blocks(model)
    ids, seg, batch = _packed_batch()
    asked = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kwargs: asked.append(kwargs.get("output_router_logits")),
        with_kwargs=True)
    with torch.no_grad():
        _, aux = lm_forward(model, batch, aux_loss=True)
    hook.remove()
    assert asked == [False]
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=batch.position_ids_BS, use_cache=False,
                    output_router_logits=True)
    want = ref_switch_loss(out.router_logits, (seg != 0).reshape(-1), 4, 2)
    assert float(aux) == pytest.approx(want, rel=1e-5)


def test_aux_loss_of_an_unpatched_model_asks_the_model():
    from lrmoe.training.loss import lm_forward

    model = _tiny_lm(seed=0)
    ids, seg, batch = _packed_batch()
    with torch.no_grad():
        _, aux = lm_forward(model, batch, aux_loss=True)
        out = model(input_ids=ids, position_ids=batch.position_ids_BS, use_cache=False,
                    output_router_logits=True)
    want = ref_switch_loss(out.router_logits, (seg != 0).reshape(-1), 4, 2)
    assert float(aux) == pytest.approx(want, rel=1e-5)
