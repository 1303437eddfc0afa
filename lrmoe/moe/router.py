"""Top-k router with fp32 math, load-balancing loss and z-loss.

Legend: T tokens, H hidden size, E experts, K top_k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrmoe.moe.config import LRMoEConfig


@dataclass
class Routing:
    """Result of :class:`Router` for T tokens.

    Attributes:
        logits_TE: (T, E) float32 router logits.
        weights_TK: (T, K) float32 routing weights alpha (after renormalisation/scaling).
        expert_ids_TK: (T, K) int64 selected experts, in decreasing selection score.
        probs_TE: (T, E) float32 router probabilities used by the load-balancing loss.
    """

    logits_TE: Tensor
    weights_TK: Tensor
    expert_ids_TK: Tensor
    probs_TE: Tensor


def load_balancing_loss(probs_TE: Tensor, expert_ids_TK: Tensor,
                        token_mask_T: Optional[Tensor] = None) -> Tensor:
    """Switch-style auxiliary loss, generalised to top-k as transformers computes it.

    L_aux = E * sum_e f_e * P_e with f_e = n_e / T (routed pairs of expert e per token,
    summed over the K slots) and P_e = mean_t probs[t, e]. Fedus et al., "Switch
    Transformers", JMLR 2022, eq. 4; transformers ``load_balancing_loss_func`` (which
    also restricts both means to the tokens of its ``attention_mask``, as ``token_mask_T``
    does here). Equals K for perfectly uniform routing with uniform probabilities.

    Args:
        probs_TE: (T, E) float32 probabilities (differentiable).
        expert_ids_TK: (T, K) int64 selected experts.
        token_mask_T: optional (T,) bool, True for the tokens that count (e.g. not
            padding); None counts every token.

    Returns:
        () float32 scalar; 0 (still differentiable) when no token counts (T = 0 or an
        all-False mask), never NaN.
    """
    num_tokens, num_experts = probs_TE.shape
    dev = probs_TE.device
    if token_mask_T is None:
        ones_P = torch.ones(expert_ids_TK.numel(), device=dev)
        # sum, not mean, for T = 0: the mean of no rows is NaN
        p_E = probs_TE.mean(dim=0) if num_tokens else probs_TE.sum(dim=0)
        denom = max(num_tokens, 1)
    else:
        w_T = token_mask_T.to(torch.float32)
        ones_P = w_T.repeat_interleave(expert_ids_TK.shape[1])
        denom = w_T.sum().clamp_min(1.0)  # a tensor: no host sync
        p_E = (probs_TE * w_T[:, None]).sum(dim=0) / denom
    counts_E = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    counts_E.scatter_add_(0, expert_ids_TK.reshape(-1), ones_P)
    return num_experts * torch.sum(counts_E / denom * p_E)


def router_z_loss(logits_TE: Tensor, token_mask_T: Optional[Tensor] = None) -> Tensor:
    """Router z-loss, mean_t (logsumexp_e logits[t, e])^2.

    Zoph et al., "ST-MoE: Designing Stable and Transferable Sparse Expert Models", 2022,
    eq. 5.

    Args:
        logits_TE: (T, E) float32.
        token_mask_T: optional (T,) bool; the mean runs over the True tokens only.

    Returns:
        () float32; 0 when no token counts, never NaN.
    """
    z_T = torch.logsumexp(logits_TE, dim=-1).square()
    if token_mask_T is None:
        return z_T.mean() if z_T.numel() else z_T.sum()
    w_T = token_mask_T.to(torch.float32)
    return (z_T * w_T).sum() / w_T.sum().clamp_min(1.0)


def router_losses(config: LRMoEConfig, routing: Routing,
                  token_mask_T: Optional[Tensor] = None) -> Tensor:
    """``router_aux_loss_coef * load_balancing_loss + router_z_loss_coef * z_loss``, the
    ``aux_loss`` of a layer. Shapes as :func:`load_balancing_loss`; () float32."""
    aux = config.router_aux_loss_coef * load_balancing_loss(
        routing.probs_TE, routing.expert_ids_TK, token_mask_T)
    if config.router_z_loss_coef:
        aux = aux + config.router_z_loss_coef * router_z_loss(routing.logits_TE, token_mask_T)
    return aux


class Router(nn.Module):
    """Linear router ``logits = x W^T`` in fp32, then top-k.

    Parameters mirror transformers: ``weight`` (E, H) like ``Qwen3MoeTopKRouter.weight``,
    and for the sigmoid router the buffer ``e_score_correction_bias`` (E,) like
    ``Glm4MoeTopkRouter``, which steers selection only and stays float32 when the module
    is cast to another dtype.

    Args:
        config: the layer config (router kind, top_k, norm_topk_prob, scaling).
    """

    def __init__(self, config: LRMoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        if config.router == "sigmoid":
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(config.num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # the selection bias stays fp32 under layer.to(bf16) / .half(): a 16-bit bias
        # would round the small corrections that steer the top-k choice; only its device
        # follows the module
        bias = self._buffers.get("e_score_correction_bias")
        out = super()._apply(fn, recurse)
        moved = self._buffers.get("e_score_correction_bias")
        if bias is not None and moved is not None and moved.dtype != torch.float32:
            self._buffers["e_score_correction_bias"] = bias.to(moved.device)
        return out

    def forward(self, x_TH: Tensor, expert_ids_TK: Optional[Tensor] = None) -> Routing:
        """Route T tokens.

        Args:
            x_TH: (T, H) float tensor.
            expert_ids_TK: optional (T, K) int64 forced expert ids (benchmarks replaying a
                trace or a synthetic skew): the router still runs, the weights become its
                scores at these ids (normalised and scaled as configured), so router
                gradients stay real.

        Returns:
            :class:`Routing`.

        Raises:
            ValueError: (CPU) non-finite router logits; on CUDA the same check is a
                device-side assertion, so the forward never waits for the device.
        """
        cfg = self.config
        with torch.autocast(device_type=x_TH.device.type, enabled=False):
            logits_TE = _router_logits(x_TH, self.weight)
            _check_finite(logits_TE)
            if cfg.router == "softmax":
                probs_TE = scores_TE = torch.softmax(logits_TE, dim=-1)
                choice_TE = probs_TE
            else:
                scores_TE = torch.sigmoid(logits_TE)
                choice_TE = scores_TE.detach() + self.e_score_correction_bias
                probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
            if expert_ids_TK is None:
                expert_ids_TK = torch.topk(choice_TE, cfg.top_k, dim=-1).indices
            weights_TK = scores_TE.gather(1, expert_ids_TK)
            if cfg.norm_topk_prob:
                weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
            if cfg.routed_scaling_factor != 1.0:
                weights_TK = weights_TK * cfg.routed_scaling_factor
        return Routing(logits_TE, weights_TK, expert_ids_TK, probs_TE)


class _LowPrecisionLogits(torch.autograd.Function):
    """logits = x W^T as one 16-bit GEMM with fp32 accumulation and fp32 output (CUDA
    ``mm`` with ``out_dtype``, which has no autograd formula of its own). The backward
    GEMMs take the fp32 logit gradient rounded to the activation dtype, as autograd does
    for any 16-bit linear layer; dW comes out in fp32."""

    @staticmethod
    def forward(ctx, x_TH, weight_EH):
        w16_EH = weight_EH.to(x_TH.dtype)
        ctx.save_for_backward(x_TH, w16_EH)
        ctx.weight_dtype = weight_EH.dtype
        return torch.mm(x_TH, w16_EH.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_TE):
        x_TH, w16_EH = ctx.saved_tensors
        g16_TE = grad_TE.to(x_TH.dtype)
        grad_x = torch.mm(g16_TE, w16_EH) if ctx.needs_input_grad[0] else None
        grad_w = (torch.mm(g16_TE.t(), x_TH, out_dtype=torch.float32).to(ctx.weight_dtype)
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w


def _router_logits(x_TH: Tensor, weight_EH: Tensor) -> Tensor:
    """(T, E) float32 logits. On CUDA with 16-bit activations one 16-bit GEMM with fp32
    output instead of upcasting the whole (T, H) activation; elsewhere a float32 GEMM."""
    if x_TH.is_cuda and x_TH.dtype in (torch.bfloat16, torch.float16):
        return _LowPrecisionLogits.apply(x_TH, weight_EH)
    return F.linear(x_TH.float(), weight_EH.float())


def _check_finite(logits_TE: Tensor) -> None:
    message = ("lrmoe: router logits contain NaN or inf; the layer input or the router "
               "weight is not finite (check the learning rate, loss scaling and the data)")
    if logits_TE.device.type == "cuda":
        torch._assert_async(torch.isfinite(logits_TE).all(), message)
    elif not bool(torch.isfinite(logits_TE).all()):
        raise ValueError(message)
