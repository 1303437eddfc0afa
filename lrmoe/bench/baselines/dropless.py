"""The ``dropless`` baseline of ``lrmoe bench layer``: a dropless grouped-GEMM MoE written
the way torchtitan writes it (the real torchtitan module is the ``torchtitan`` method,
:mod:`lrmoe.bench.baselines.torchtitan_moe`).

Route -> stable argsort of the expert ids -> gather token rows -> ``F.grouped_mm`` for
[gate | up] -> SwiGLU -> ``F.grouped_mm`` down -> scale by the routing weight ->
``index_add_`` back to the tokens. The backward is autograd's own: every routed pair
runs the full expert backward. This is what a user picks instead of LRMoE, so
``lrmoe bench layer`` measures LRMoE against it in the same run.

``dropless_moe_ep`` is the same baseline under expert parallelism, the way torchtitan's
``ExpertParallel`` runs it: counts exchange -> ``all_to_all`` of the token rows -> local
grouped GEMMs -> ``all_to_all`` back -> weighted ``index_add``; autograd's backward sends
every pair's gradient row both ways.

Legend: T tokens, K top_k, P = T*K pairs, E experts, H hidden size, I intermediate size;
under EP: W ranks, El = E / W local experts (rank d owns ``[d*El, (d+1)*El)``), N rows
received by this rank's experts.
Weights use the same layout as LRMoELayer (and transformers' Qwen3MoeExperts):
``w_gate_up_E2IH`` (E, 2I, H), ``w_down_EHI`` (E, H, I); under EP the local shards
``w_gate_up_L2IH`` (El, 2I, H), ``w_down_LHI`` (El, H, I).
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from lrmoe.utils.phases import phase


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
    num_experts = w_gate_up_E2IH.shape[0]
    flat_ids_P = expert_ids_TK.reshape(-1)
    tokens_per_expert_E = torch.histc(flat_ids_P.float(), bins=num_experts, min=0,
                                      max=num_experts)
    offsets_E = torch.cumsum(tokens_per_expert_E, 0).to(torch.int32)
    order_P = torch.argsort(flat_ids_P, stable=True)
    token_P = order_P // top_k
    x_PH = x_TH[token_P]
    y_PH = _expert_ffn(x_PH, w_gate_up_E2IH, w_down_EHI, offsets_E)
    return _weighted_combine(x_TH, y_PH, weights_TK, order_P, token_P)


def _expert_ffn(x_NH: Tensor, w_gate_up_E2IH: Tensor, w_down_EHI: Tensor,
                offsets_E: Tensor) -> Tensor:
    """SwiGLU experts over expert-sorted rows: (N, H) -> (N, H); int32 inclusive offsets."""
    h_N2I = _grouped_mm(x_NH, w_gate_up_E2IH.transpose(1, 2), offsets_E)
    gate_NI, up_NI = h_N2I.split(w_gate_up_E2IH.shape[1] // 2, dim=-1)
    return _grouped_mm(F.silu(gate_NI) * up_NI, w_down_EHI.transpose(1, 2), offsets_E)


def _weighted_combine(x_TH: Tensor, y_PH: Tensor, weights_TK: Tensor, order_P: Tensor,
                      token_P: Tensor) -> Tensor:
    """o_t = sum of the routing-weighted rows of token t (rows in ``order_P`` order)."""
    y_PH = (y_PH.float() * weights_TK.reshape(-1)[order_P].unsqueeze(-1)).to(x_TH.dtype)
    return torch.zeros_like(x_TH).index_add(0, token_P, y_PH)


def _a2a_autograd(x: Tensor, out_rows: int, out_splits: List[int], in_splits: List[int],
                  group) -> Tensor:
    """Differentiable ``all_to_all_single`` of rows (its backward: the reverse all-to-all).

    ``torch.distributed.nn.functional.all_to_all_single``: the same code in torch 2.11
    and 2.13 and the same ``c10d::alltoall_base_`` call as ``dist.all_to_all_single``, so
    the collective finishes inside the caller's profiler range (functional collectives
    return a lazily waited tensor). torch 2.13 marks it deprecated; the warning is muted.
    """
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                                 input_split_sizes=in_splits, group=group)


def dropless_moe_ep(x_TH: Tensor, weights_TK: Tensor, expert_ids_TK: Tensor,
                    w_gate_up_L2IH: Tensor, w_down_LHI: Tensor, group=None,
                    a2a_bytes: Optional[Dict[str, int]] = None) -> Tensor:
    """Expert-parallel dropless MoE (torchtitan style): same function as
    :func:`dropless_moe` over the tokens of all ranks, experts sharded over ``group``.

    Source side: stable sort of the pairs by global expert (rows for rank d contiguous)
    -> ``all_to_all`` of the (E,) int64 counts, one host sync for the split sizes ->
    autograd ``all_to_all`` of the x rows. Expert side: re-sort (source, local expert)
    blocks to (local expert, source) -> grouped GEMMs -> un-sort -> ``all_to_all`` back.
    Source: routing-weighted ``index_add``. Backward: autograd's, every pair's gradient
    row goes source -> expert and its dX row back. A collective: every rank of ``group``
    calls it (a rank with T = 0 included) and its backward. Profiler ranges use the names
    of ``lrmoe.parallel`` (forward only; autograd runs the backward all-to-alls outside
    any range: ``_AlltoAllSingleBackward`` nodes).

    Args:
        x_TH: (T, H) local tokens, float (bf16 on CUDA: fused grouped GEMM).
        weights_TK: (T, K) float routing weights (differentiable).
        expert_ids_TK: (T, K) int64 GLOBAL expert ids in ``[0, W*El)``.
        w_gate_up_L2IH: (El, 2I, H) and w_down_LHI: (El, H, I): this rank's expert shard,
            dtype of x, on x's device (NCCL needs CUDA tensors, gloo CPU ones).
        group: process group (default: the world).
        a2a_bytes: optional dict that receives the bytes this rank sends into each
            all-to-all, counting rows sent to itself, keys as ``lrmoe.parallel``'s
            ``stats.a2a_bytes``: ``counts`` = 8 E, ``forward_dispatch`` = P H s,
            ``forward_combine`` = N H s, ``backward_grad`` = P H s (autograd's reverse of
            the combine), ``backward_index`` = 0, ``backward_dx`` = N H s (s = element size).

    Returns:
        (T, H) tensor of x's dtype; differentiable w.r.t. x, weights and both shards.

    Raises:
        ValueError: ``expert_ids_TK`` and ``x_TH`` disagree on T.
    """
    if expert_ids_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"dropless_moe_ep: expert_ids_TK has {expert_ids_TK.shape[0]} rows "
                         f"but x_TH has {x_TH.shape[0]} tokens; pass one id row per token")
    world = dist.get_world_size(group)
    top_k = expert_ids_TK.shape[1]
    local = w_gate_up_L2IH.shape[0]
    dev = x_TH.device
    with phase("permute"):
        flat_ids_P = expert_ids_TK.reshape(-1).long()
        order_P = torch.argsort(flat_ids_P, stable=True)
        token_P = order_P // top_k
        x_PH = x_TH[token_P]
    with phase("a2a_counts"):
        # scatter_add, not bincount: CUDA bincount reads max(ids) on the host
        counts_E = torch.zeros(world * local, dtype=torch.int64, device=dev).scatter_add_(
            0, flat_ids_P, torch.ones_like(flat_ids_P))
        recv_WL = torch.empty_like(counts_E)  # (W*El,): rows each source sends my experts
        dist.all_to_all_single(recv_WL, counts_E, group=group)
        recv_WL = recv_WL.view(world, local)
        splits = torch.stack([counts_E.view(world, local).sum(1), recv_WL.sum(1)])
        send, recv = splits.tolist()  # the one host sync
    num_recv = sum(recv)
    with phase("a2a_dispatch"):
        x_recv_NH = _a2a_autograd(x_PH, num_recv, recv, send, group)
    with phase("permute"):
        # arrival order is (source, local expert) blocks; the GEMMs want local expert major
        local_N = torch.repeat_interleave(torch.arange(world * local, device=dev) % local,
                                          recv_WL.reshape(-1), output_size=num_recv)
        perm_N = torch.argsort(local_N, stable=True)
        offsets_L = torch.cumsum(recv_WL.sum(0), 0).to(torch.int32)
        x_NH = x_recv_NH[perm_N]
    with phase("expert_gemm_fwd"):
        y_NH = _expert_ffn(x_NH, w_gate_up_L2IH, w_down_LHI, offsets_L)
    with phase("permute"):
        inverse_N = torch.empty_like(perm_N)
        inverse_N[perm_N] = torch.arange(num_recv, device=dev)
        y_recv_NH = y_NH[inverse_N]
    with phase("a2a_combine"):
        y_PH = _a2a_autograd(y_recv_NH, x_PH.shape[0], send, recv, group)
    with phase("combine"):
        out_TH = _weighted_combine(x_TH, y_PH, weights_TK, order_P, token_P)
    if a2a_bytes is not None:
        row = x_TH.shape[1] * x_TH.element_size()
        a2a_bytes.clear()
        a2a_bytes.update(counts=counts_E.numel() * 8, forward_dispatch=sum(send) * row,
                         forward_combine=num_recv * row, backward_grad=sum(send) * row,
                         backward_index=0, backward_dx=num_recv * row)
    return out_TH
