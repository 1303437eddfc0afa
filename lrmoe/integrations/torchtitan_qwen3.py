"""torchtitan's Qwen3 MoE model at any shape, built from torchtitan's own config helpers
(torchtitan 0.3.0), where torchtitan's trainer cannot run.

Legend: D hidden (lrmoe's H), F expert intermediate (lrmoe's I), E experts, K top_k.

:func:`qwen3_moe_config` spells out torchtitan 0.3.0's ``_build_qwen3_moe_layers`` and its
``30B-A3B`` flavour (``torchtitan/models/qwen3/__init__.py``): softmax router with
route_norm, qk-norm, fused qkv, RMSNorm eps 1e-6, untied embeddings, normal init std 0.02
with the residual outputs (attention ``wo``, the experts' ``w2``) scaled by
1 / sqrt(2 n_layers), aux-loss-free load balancing (``load_balance_coeff`` 1e-3, the
expert bias). It cannot call that builder: ``torchtitan.models.qwen3``'s ``__init__``
imports the trainer's FSDP helpers, which need ``torch.distributed.fsdp.
DataParallelMeshDims`` (torch >= 2.12), and the GPU image has torch 2.11; the model
module itself loads (:func:`qwen3_model_module`). Used by tests/python/integrations/
test_torchtitan.py and ``lrmoe bench step --titan`` (:mod:`lrmoe.bench.titan_step`).
"""
from __future__ import annotations

from functools import partial
from types import ModuleType
from typing import Any, Optional

import torch

#: torchtitan 0.3.0's Qwen3 RMSNorm epsilon and init std
EPS = 1e-6
INIT_STD = 0.02
#: inner attention backends of torchtitan's language models (``get_attention_config``)
ATTENTION_BACKENDS = ("flex", "flex_flash", "varlen")


def qwen3_model_module() -> ModuleType:
    """``torchtitan.models.qwen3.model`` (``Qwen3Model``, ``Qwen3TransformerBlock``).

    On a torch without ``torch.distributed.fsdp.DataParallelMeshDims`` (< 2.12) the
    package ``torchtitan.models.qwen3`` is stood in for by an empty one, so that only the
    model module loads; any other import error is raised.

    Raises:
        ModuleNotFoundError: torchtitan is not installed (naming requirements/torchtitan.txt).
    """
    from lrmoe.integrations.torchtitan import require_torchtitan

    require_torchtitan("the torchtitan Qwen3 model")
    _block_mask_compat()
    try:
        from torchtitan.models.qwen3 import model
        return model
    except ImportError as exc:
        if "DataParallelMeshDims" not in str(exc):
            raise
    import importlib
    import os
    import sys
    import types

    import torchtitan.models
    pkg = types.ModuleType("torchtitan.models.qwen3")
    pkg.__path__ = [os.path.join(os.path.dirname(torchtitan.models.__file__), "qwen3")]
    sys.modules["torchtitan.models.qwen3"] = pkg
    return importlib.import_module("torchtitan.models.qwen3.model")


def _block_mask_compat() -> None:
    """Let torchtitan 0.3.0's flex mask build on a torch whose ``create_block_mask`` has no
    ``separate_full_blocks`` keyword (2.11, the GPU image's torch).

    torchtitan's decoder passes ``separate_full_blocks=not batch_invariant``; a torch
    without the keyword always separates full blocks, which is the same mask and the
    keyword's default, so the wrapper drops it when it is True and refuses the
    batch-invariant request (False), which such a torch cannot honour. Idempotent; a torch
    with the keyword is left alone.

    Raises:
        RuntimeError: (from the wrapper) batch-invariant mode asked on such a torch.
    """
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask
    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return
    from torchtitan.models.common import attention, decoder
    if getattr(decoder.create_attention_mask, "_lrmoe_compat", False):
        return
    inner = attention.create_attention_mask

    def create_attention_mask(*args: Any, separate_full_blocks: bool = True,
                              **kwargs: Any) -> Any:
        if not separate_full_blocks:
            raise RuntimeError("torchtitan asked for a batch-invariant flex mask "
                               "(separate_full_blocks=False), which this torch's "
                               "create_block_mask cannot build; use torch >= 2.12 or "
                               "leave batch-invariant mode off")
        return inner(*args, **kwargs)

    create_attention_mask._lrmoe_compat = True  # type: ignore[attr-defined]
    decoder.create_attention_mask = create_attention_mask


def qwen3_moe_config(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                     head_dim: int, moe_inter: int, num_experts: int, top_k: int,
                     vocab_size: int, max_seq_len: int, rope_theta: float = 1e6,
                     attn_backend: str = "flex",
                     load_balance_coeff: Optional[float] = 1e-3) -> Any:
    """A ``Qwen3Model.Config`` of torchtitan's Qwen3 MoE at this shape (module docstring).

    Args:
        dim: D. n_layers: transformer blocks, each attention + MoE. n_heads, n_kv_heads,
            head_dim: grouped-query attention. moe_inter: F. num_experts: E. top_k: K.
        vocab_size: embedding and LM-head rows. max_seq_len: the RoPE cache length.
        rope_theta: RoPE base (torchtitan's Qwen3 flavours: 1e6).
        attn_backend: ``flex`` (FlexAttention, block-causal document mask from the
            positions), ``flex_flash`` (Hopper+) or ``varlen`` (CUDA flash varlen).
        load_balance_coeff: the expert-bias step of aux-loss-free balancing, or None.

    Raises:
        ValueError: an unknown ``attn_backend`` (naming the accepted ones).
        ModuleNotFoundError: torchtitan is not installed.
    """
    if attn_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attn_backend must be one of {', '.join(ATTENTION_BACKENDS)} "
                         f"(torchtitan's language-model attention); got {attn_backend!r}")
    q3 = qwen3_model_module()
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import (get_attention_config, make_gqa_config,
                                                       make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)
    from torchtitan.models.common.nn_modules import RMSNorm

    linear = {"weight": partial(torch.nn.init.normal_, std=INIT_STD),
              "bias": torch.nn.init.zeros_}
    residual = partial(torch.nn.init.normal_, std=INIT_STD / (2 * n_layers) ** 0.5)

    def norm(d: int) -> Any:
        return RMSNorm.Config(normalized_shape=d, eps=EPS,
                              param_init={"weight": torch.nn.init.ones_})

    blocks = [q3.Qwen3TransformerBlock.Config(
        attention_norm=norm(dim), ffn_norm=norm(dim),
        attention=make_gqa_config(
            dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            wqkv_param_init=linear,
            wo_param_init={"weight": residual, "bias": torch.nn.init.zeros_},
            inner_attention=get_attention_config(attn_backend), fuse_qkv=True,
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=rope_theta),
            qk_norm=norm(head_dim)),
        moe=make_moe_config(
            num_experts=num_experts, load_balance_coeff=load_balance_coeff,
            router=make_router_config(dim=dim, num_experts=num_experts,
                                      gate_param_init=linear, top_k=top_k,
                                      score_func="softmax", route_norm=True),
            routed_experts=make_routed_experts_config(
                dim=dim, hidden_dim=moe_inter, num_experts=num_experts, top_k=top_k,
                param_init={"w1_EFD": linear["weight"], "w2_EDF": residual,
                            "w3_EFD": linear["weight"]},
                comm_backend="standard")))
        for _ in range(n_layers)]
    return q3.Qwen3Model.Config(
        vocab_size=vocab_size, dim=dim, norm=norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init={"weight": linear["weight"]}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=linear),
        layers=blocks)


def build_qwen3_moe(cfg: Any, seed: int = 0,
                    device: Optional[torch.device] = None) -> torch.nn.Module:
    """The float32 model of ``cfg`` (:func:`qwen3_moe_config`), initialised by torchtitan
    (``init_states``) after ``torch.manual_seed(seed)``, built directly on ``device``
    (default: the CPU); the same seed and device give the same weights."""
    device = torch.device("cpu") if device is None else torch.device(device)
    torch.manual_seed(seed)
    with device:
        model = cfg.build()
        model.init_states(buffer_device=device)
    return model
