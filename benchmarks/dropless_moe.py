"""Baseline: a dropless grouped-GEMM MoE written the way torchtitan writes it.

Route -> stable argsort of the expert ids -> gather token rows -> ``F.grouped_mm`` for
[gate | up] -> SwiGLU -> ``F.grouped_mm`` down -> scale by the routing weight ->
``index_add_`` back to the tokens. The backward is autograd's own: every routed pair
runs the full expert backward. This is what a user picks instead of LRMoE, so
``lrmoe bench layer`` measures LRMoE against it in the same run.

Legend: T tokens, K top_k, P = T*K pairs, E experts, H hidden size, I intermediate size.
Weights use the same layout as LRMoELayer (and transformers' Qwen3MoeExperts):
``w_gate_up_E2IH`` (E, 2I, H), ``w_down_EHI`` (E, H, I).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    if a.is_cuda and a.dtype == torch.bfloat16:
        return F.grouped_mm(a, b, offs=offsets)
    # CPU / other dtypes: the same product, one expert at a time (host offsets)
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        out.append(a[start:end] @ b[e])
        start = end
    return torch.cat(out)


def dropless_moe(x_TH: Tensor, weights_TK: Tensor, expert_ids_TK: Tensor,
                 w_gate_up_E2IH: Tensor, w_down_EHI: Tensor) -> Tensor:
    """Dropless MoE expert path: ``o_t = sum_k weights[t,k] * FFN_{ids[t,k]}(x_t)``.

    Args:
        x_TH: (T, H) bf16 (fused grouped GEMM on sm90) or any float (per-expert loop).
        weights_TK: (T, K) float routing weights (differentiable).
        expert_ids_TK: (T, K) int64 expert ids.
        w_gate_up_E2IH: (E, 2I, H); w_down_EHI: (E, H, I), dtype of x.

    Returns:
        (T, H) tensor of x's dtype; differentiable w.r.t. x, weights and both weights.
    """
    num_tokens, top_k = expert_ids_TK.shape
    num_experts, two_i, _ = w_gate_up_E2IH.shape
    flat_ids_P = expert_ids_TK.reshape(-1)
    tokens_per_expert_E = torch.histc(flat_ids_P.float(), bins=num_experts, min=0,
                                      max=num_experts)
    offsets_E = torch.cumsum(tokens_per_expert_E, 0).to(torch.int32)
    order_P = torch.argsort(flat_ids_P, stable=True)
    token_P = order_P // top_k
    x_PH = x_TH[token_P]
    h_P2I = _grouped_mm(x_PH, w_gate_up_E2IH.transpose(1, 2), offsets_E)
    gate_PI, up_PI = h_P2I.split(two_i // 2, dim=-1)
    phi_PI = F.silu(gate_PI) * up_PI
    y_PH = _grouped_mm(phi_PI, w_down_EHI.transpose(1, 2), offsets_E)
    y_PH = (y_PH.float() * weights_TK.reshape(-1)[order_P].unsqueeze(-1)).to(x_TH.dtype)
    out_TH = torch.zeros_like(x_TH)
    return out_TH.index_add(0, token_P, y_PH)
