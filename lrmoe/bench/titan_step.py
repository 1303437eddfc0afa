"""The torchtitan cells of ``lrmoe bench step --titan``: torchtitan's Qwen3 MoE model at
an ``lrmoe train`` preset's shape, trained by a plain loop on the preset's own batches.

Why a loop and not torchtitan's trainer: torchtitan 0.3.0's trainer imports
``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12) and the GPU image has
torch 2.11; the model modules load (:mod:`lrmoe.integrations.torchtitan_qwen3`). What
the loop keeps of torchtitan's trainer on one GPU without parallelism: its model
(torchtitan's modules, weights and init; its ``get_attention_masks`` document mask from
the positions and its compiled FlexAttention), its optimizer pre-step hook of aux-loss-
free load balancing (the expert-bias update of ``register_moe_load_balancing_hook``).
What it takes from ``lrmoe train`` (so that only the model differs between the cells):
the batches (:class:`lrmoe.training.batches.BatchStream` over the same data, the same
order: positions restart at every packed example, so torchtitan's block-causal mask keeps
examples apart as lrmoe's does), the loss (summed next-token NLL over the loss tokens /
their number; no load-balancing loss: torchtitan's Qwen3 balances with the expert bias),
bf16 autocast over float32 weights, AdamW (fused on CUDA) with the preset's lr schedule,
weight decay and groups (:func:`lrmoe.training.optim.build_optimizer`), grad clipping
(``optim.grad_clip``), and the timing: host wall time of a step from taking the batch
to the loss's host read; MoE time by device events around every torchtitan ``MoE``
(router, dispatch, experts, combine: the block lrmoe's timer brackets too) with
:class:`lrmoe.training.moe_timer.MoELayerTimer`.

Two kinds of cell: ``titan`` (torchtitan's own MoE: ``GroupedExperts``, grouped GEMM
``torch._grouped_mm``) and ``titan-lrmoe`` at a rate c (the routed experts swapped by
:func:`lrmoe.integrations.torchtitan.swap_moe` with the preset's ``lrmoe`` section).

Attention (``titan_attention``): ``flex`` (torchtitan's FlexAttention, compiled by
torchtitan with ``max_autotune``: the first cell's warm-up steps absorb the compile),
``flex_flash`` or ``varlen`` on CUDA; ``dense`` is the CPU stand-in (flex attention has
no CPU backward): the same document mask materialised from the BlockMask's ``mask_mod``
and ``scaled_dot_product_attention``; ``auto`` = flex on CUDA, dense elsewhere.
"""
from __future__ import annotations

import gc
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch
from torch import nn

TITAN_ATTENTIONS = ("auto", "flex", "flex_flash", "varlen", "dense")
REQUIREMENTS = "pip install --no-deps -r requirements/torchtitan.txt"


def resolve_attention(name: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA, ``dense`` elsewhere; other names are checked.

    Raises:
        ValueError: an unknown name, or a CUDA-only backend off CUDA (naming
            ``--titan-attention`` and the fix).
    """
    if name not in TITAN_ATTENTIONS:
        raise ValueError(f"--titan-attention must be one of {', '.join(TITAN_ATTENTIONS)}; "
                         f"got {name!r}")
    if name == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if name != "dense" and device.type != "cuda":
        raise ValueError(f"--titan-attention {name} needs a CUDA device (torchtitan's flex "
                         "attention has no CPU backward, varlen is a CUDA kernel); use "
                         "--titan-attention dense (or auto) on the CPU")
    return name


def require_titan() -> None:
    """Raise a ModuleNotFoundError naming requirements/torchtitan.txt when torchtitan (or
    a module it imports) is missing: ``--titan`` needs it."""
    from lrmoe.integrations.torchtitan import require_torchtitan

    require_torchtitan("lrmoe bench step --titan")


_DENSE_CLASS: Optional[type] = None


def _dense_attention_class() -> type:
    """A subclass of torchtitan's ``FlexAttention`` that computes with sdpa and the dense
    mask of the BlockMask (the CPU stand-in; made once)."""
    global _DENSE_CLASS
    if _DENSE_CLASS is None:
        from torch.nn.attention.flex_attention import create_mask
        from torchtitan.models.common.attention import FlexAttention

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, score_mod=None,
                    scale=None, enable_gqa=False, out_transform=None, **kwargs):
            if score_mod is not None or out_transform is not None:
                raise NotImplementedError("dense attention: no score_mod / out_transform")
            b, length = q_BLNH.shape[0], q_BLNH.shape[1]
            mask_B1LL = create_mask(attention_masks.mask_mod, b, 1, length, length,
                                    device=q_BLNH.device)
            out_BNLH = torch.nn.functional.scaled_dot_product_attention(
                q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                attn_mask=mask_B1LL, scale=scale, enable_gqa=enable_gqa)
            return out_BNLH.transpose(1, 2)

        _DENSE_CLASS = type("DenseMaskAttention", (FlexAttention,),
                            {"forward": forward, "__module__": __name__})
    return _DENSE_CLASS


def build_titan_model(cfg: Any, vocab_size: int, attention: str, device: torch.device,
                      rate: Optional[float]) -> nn.Module:
    """torchtitan's Qwen3 MoE at ``cfg.model``'s shape on ``device`` (float32 weights,
    torchtitan's init at ``run.seed``: every titan cell starts from the same weights).

    Args:
        cfg: the preset's :class:`lrmoe.training.config.TrainConfig`.
        vocab_size: the data's vocabulary (lrmoe's model uses the same).
        attention: a resolved backend (:func:`resolve_attention`).
        rate: None keeps torchtitan's MoE; c swaps in LRMoE's experts at that rate.
    """
    from lrmoe.integrations.torchtitan import LRMoETitanConfig, swap_moe
    from lrmoe.integrations.torchtitan_qwen3 import build_qwen3_moe, qwen3_moe_config
    from lrmoe.moe.config import BACKWARD_FIELDS

    m = cfg.model
    # rope theta 1e4: transformers' Qwen3MoeConfig default, lrmoe's model (no cost change)
    tcfg = qwen3_moe_config(
        dim=m.hidden_size, n_layers=m.num_hidden_layers, n_heads=m.num_attention_heads,
        n_kv_heads=m.num_key_value_heads, head_dim=m.head_dim,
        moe_inter=m.moe_intermediate_size, num_experts=m.num_experts,
        top_k=m.num_experts_per_tok, vocab_size=vocab_size,
        max_seq_len=max(m.max_position_embeddings, cfg.data.seq_len), rope_theta=1e4,
        attn_backend="flex" if attention == "dense" else attention)
    model = build_qwen3_moe(tcfg, seed=cfg.run.seed, device=device)
    if attention == "dense":
        dense = _dense_attention_class()
        for layer in model.layers.values():
            layer.attention.inner_attention.__class__ = dense
    if rate is not None:
        b = cfg.backward
        fields = {f: getattr(b, f) for f in BACKWARD_FIELDS}
        fields["recalibration_rate"] = rate
        swap_moe(model, LRMoETitanConfig(**fields))
    model.train()
    return model


def titan_moe_modules(model: nn.Module) -> List[nn.Module]:
    """The model's torchtitan ``MoE`` blocks, in layer order."""
    from torchtitan.models.common.moe import MoE

    return [mod for mod in model.modules() if isinstance(mod, MoE)]


def titan_shape(model: nn.Module) -> SimpleNamespace:
    """The shape of a torchtitan Qwen3 MoE model with the field names of
    :class:`lrmoe.training.sections.ModelConfig`, for
    :func:`lrmoe.bench.step.flops_per_token` (read from the built modules)."""
    layers = list(model.layers.values())
    attn, moe = layers[0].attention, layers[0].moe
    num_experts, inter, hidden = (int(s) for s in
                                  moe.routed_experts.inner_experts.w1_EFD.shape)
    return SimpleNamespace(
        hidden_size=hidden, num_hidden_layers=len(layers), num_attention_heads=attn.n_heads,
        num_key_value_heads=attn.n_kv_heads, head_dim=attn.head_dim,
        num_experts=num_experts, num_experts_per_tok=int(moe.router.top_k),
        moe_intermediate_size=inter)


@torch.no_grad()
def update_expert_bias(moe_modules: List[nn.Module]) -> None:
    """torchtitan 0.3.0's aux-loss-free load balancing (``_update_expert_bias`` of
    ``register_moe_load_balancing_hook``, one rank, no recomputation): before the
    optimizer step, each MoE's ``expert_bias_E`` moves by ``coeff * sign(mean - count)``
    (centred) and its token counts reset."""
    for moe in moe_modules:
        if moe.load_balance_coeff is None:
            continue
        counts_E = moe.tokens_per_expert_E.float()
        delta_E = moe.load_balance_coeff * torch.sign(counts_E.mean() - counts_E)
        moe.expert_bias_E.add_(delta_E - delta_E.mean())
        moe.tokens_per_expert_E.zero_()


def train_titan(cfg: Any, data: Any, attention: str, rate: Optional[float],
                out_dir: Path) -> Dict[str, Any]:
    """Train one titan cell for ``cfg.run.steps`` steps; write ``out_dir/metrics.jsonl``
    (one ``{"kind": "train", "step", "loss", "time_s", "tokens", "tokens_per_s",
    "grad_norm", "lr", "moe_time_ms", "moe_forward_ms", "moe_backward_ms"}`` per step:
    loss in nats per loss token, times in s / ms).

    Args:
        cfg: the preset's TrainConfig (``run.steps``, ``run.seed``, ``run.device``, ...).
        data: :class:`lrmoe.data.LMData` of the preset (its ``train`` blocks).
        attention: ``--titan-attention`` value (:func:`resolve_attention`).
        rate: None (torchtitan's MoE) or c (LRMoE's experts).
        out_dir: the cell's folder (created).

    Returns:
        ``{"peak_gib": peak CUDA memory (None off CUDA), "flops_per_token": of the
        model's shape, "attention": the resolved backend}``.

    Raises:
        FloatingPointError: a non-finite loss.
    """
    from lrmoe.bench.step import flops_per_token
    from lrmoe.training import setup
    from lrmoe.training.batches import BatchStream
    from lrmoe.training.loss import autocast, causal_lm_nll
    from lrmoe.training.moe_timer import MoELayerTimer
    from lrmoe.training.optim import build_optimizer, clip_in_step
    from lrmoe.training.readout import StepReadout

    device = setup.resolve_device(cfg.run.device)
    threads = torch.get_num_threads()
    amp = setup.configure_device(cfg, device)  # threads, TF32, peak-memory reset
    attention = resolve_attention(attention, device)
    try:
        model = build_titan_model(cfg, data.vocab_size, attention, device, rate)
        moes = titan_moe_modules(model)
        timer = MoELayerTimer(model, device, layers=moes)
        optimizer, scheduler = build_optimizer(cfg.optim, model, device,
                                               cfg.optim.lr_decay_steps or cfg.run.steps)
        d = cfg.data
        stream = BatchStream(data.train, d.batch_size, cfg.run.seed,
                             isolate_examples=d.isolate_examples)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        out_dir.mkdir(parents=True, exist_ok=True)
        records = []
        # the same reading as lrmoe train: a step's numbers a step late, its time the
        # device's period (lrmoe/training/readout.py), so both kinds of cell time alike
        readout = StepReadout(device, timer)

        def finished(record: Optional[Dict[str, Any]]) -> None:
            if record is None:
                return
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"titan cell, step {record['step']}: the loss is "
                                         f"{record['loss']}")
            records.append(record)

        for step in range(1, cfg.run.steps + 1):
            start = readout.clock.event()
            batch, tokens = stream.next()
            denom = max(batch.num_loss_tokens(), 1)
            optimizer.zero_grad(set_to_none=True)
            with timer.armed():
                batch = batch.to(device)
                ids = batch.input_ids_BS
                positions = batch.position_ids_BS
                if positions is None:  # one document per row: plain causal
                    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
                masks = model.get_attention_masks(positions)
                with autocast(device, amp):
                    logits = model(ids, positions, masks)
                nll, _ = causal_lm_nll(logits, batch.labels_BS)
                (nll / denom).backward()
            grad_norm = clip_in_step(optimizer, model.parameters(), max_norm)  # as lrmoe train
            update_expert_bias(moes)  # torchtitan's optimizer pre-step hook
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            record = {"kind": "train", "step": step, "lr": lr, "tokens": tokens,
                      "loss_tokens": denom}
            finished(readout.push(readout.stage(start, record, nll.detach(), None, grad_norm,
                                                denom, 1)))
        finished(readout.flush())
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                       for r in records))
        peak = (torch.cuda.max_memory_allocated(device) / 2**30
                if device.type == "cuda" else None)
        out = {"peak_gib": peak, "attention": attention,
               "flops_per_token": flops_per_token(titan_shape(model), data.vocab_size,
                                                  d.seq_len)}
        timer.remove()
        del model, optimizer, scheduler, timer
        return out
    finally:
        torch.set_num_threads(threads)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def load_preset_data(cfg: Any) -> Any:
    """The preset's data as ``lrmoe train`` loads it (tokenizer check, the cache, the
    split; the same checks and report lines).

    Raises:
        ValueError, FileNotFoundError: what ``lrmoe train`` raises for this data.
    """
    from lrmoe.training import preflight, setup

    t = time.perf_counter()
    data = setup.load_run_data(cfg, preflight.check_inputs(cfg))
    setup.report_run_data(cfg, data, time.perf_counter() - t)
    return data
