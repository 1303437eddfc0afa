"""The methods ``lrmoe bench layer`` times, all over ONE set of weights.

  * ``lrmoe``: :class:`lrmoe.layer.LRMoELayer` at each recalibration rate c;
  * ``dropless``: the torchtitan-style grouped-GEMM MoE of :mod:`lrmoe.bench.baselines.dropless`
    (autograd's own backward); under expert parallelism ``dropless_moe_ep``;
  * ``transformers``: transformers' ``Qwen3MoeSparseMoeBlock`` as shipped;
  * ``torchtitan``: torchtitan's own ``MoE`` module (:mod:`lrmoe.bench.baselines.torchtitan_moe`),
    where torchtitan is importable.

Every method sees the same inputs and the same routing: the case's forced expert ids,
while each method's own router still runs so its cost and gradient are real. Before a
baseline is timed, :func:`check_agreement` compares its output and input gradient with
the LRMoE layer at c = 0 (which computes the same function); a baseline that disagrees
is reported as failing the check and is not timed.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top_k.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# Method and the tolerances live in lrmoe.bench.method so that the torchtitan baseline
# (lrmoe.bench.baselines.torchtitan_moe), which this module builds, need not import this one back.
from lrmoe.bench.method import Method, tolerance
from lrmoe.workload.shapes import SHAPES
from lrmoe.bench.cases import Case, Inputs
from lrmoe.moe.config import LRMoEConfig
from lrmoe.layer import LRMoELayer
from lrmoe.parallel.placement import Placement
from lrmoe.utils.phases import phase

METHODS = ("lrmoe", "dropless", "transformers", "torchtitan")
#: the methods that have an expert-parallel mode (``--ep``)
EP_METHODS = ("lrmoe", "dropless")


def default_methods() -> List[str]:
    """Every method that can run here: ``torchtitan`` only where it is importable."""
    from lrmoe.bench.baselines.torchtitan_moe import torchtitan_missing
    return [m for m in METHODS if m != "torchtitan" or torchtitan_missing() is None]


def check_choices(shapes: Sequence[str], methods: Sequence[str], dtype: str) -> torch.dtype:
    """Validate shape and method names; returns the torch dtype of ``dtype``.

    Raises:
        ValueError: naming the unknown shape, method or dtype and the choices, or
            ``torchtitan`` asked for where it cannot be imported (with the install line).
    """
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}; choose from {sorted(SHAPES)}")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if "torchtitan" in methods:
        from lrmoe.bench.baselines.torchtitan_moe import torchtitan_missing
        missing = torchtitan_missing()
        if missing is not None:
            raise ValueError(f"--methods torchtitan: {missing}")
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    return torch_dtype


def layer_config(case: Case, offload: str = "none") -> LRMoEConfig:
    """The LRMoE config of a case (metric ``lrm``, selection ``topk``, c set per method;
    ``offload`` as ``LRMoEConfig.offload``).

    The benchmark times the deterministic top-k selection, not the library's default
    importance sampling: a CUDA-graph replay (``--cuda-graph``) repeats its capture's
    seed, so only top-k replays the eager step, and top-k continues the record of
    docs/journal/performance.md. The two differ only in the select kernel."""
    d = case.dims
    return LRMoEConfig(hidden_size=d["hidden"], moe_intermediate_size=d["inter"],
                       num_experts=d["experts"], top_k=d["top_k"],
                       shared_expert_intermediate_size=d["shared"], metric="lrm",
                       selection="topk", offload=offload)


def build_methods(case: Case, rates: Sequence[float], methods: Sequence[str],
                  device: torch.device, ep_group=None, offload: str = "none",
                  policies: Sequence[Optional[str]] = (None,), replica_slots: int = 2
                  ) -> List[Method]:
    """All methods of one case over ONE set of weights (seeded; bf16 on GPU).

    Args:
        case: the shape, tokens and dtype. rates: LRMoE recalibration rates.
        methods: any of :data:`METHODS`.
        device: where weights and inputs live.
        ep_group: a process group for expert parallelism: the LRMoE layer shards its
            experts over it (E / W per rank, the same slice of one seeded initialisation
            on every method) and ``dropless`` becomes ``dropless_moe_ep``. A collective.
        offload: ``LRMoEConfig.offload`` of the LRMoE layer (the baselines keep their
            activations on the device).
        policies: expert parallel only: the placement policies LRMoE runs under (each a
            layer of its own over the same seeded weights; None: fixed ownership without
            the planner, the layer every baseline is checked against).
        replica_slots: spare expert slots per rank of a policy's layer
            (:class:`lrmoe.parallel.placement.Placement`).

    Returns:
        One :class:`Method` per policy and LRMoE rate, then dropless, transformers,
        torchtitan (those asked for). A policy's method at c = 0 has the baselines'
        tolerance: :func:`check_agreement` compares it with the layer without a policy.

    Raises:
        ValueError: ``transformers`` or ``torchtitan`` together with ``ep_group`` (they
            have no expert-parallel mode); a policy without ``ep_group``.
    """
    no_ep = [m for m in methods if m not in EP_METHODS]
    if ep_group is not None and no_ep:
        raise ValueError(f"--methods {' '.join(no_ep)} has no expert-parallel mode; drop it "
                         "from --methods when running with --ep")
    if ep_group is None and any(p is not None for p in policies):
        raise ValueError("--policies place experts over an expert-parallel group; add --ep N "
                         "(under torchrun --nproc-per-node N)")

    def layer(policy=None) -> LRMoELayer:
        torch.manual_seed(0)  # every layer the same weights
        placement = None if policy is None else Placement(policy, replica_slots=replica_slots)
        return LRMoELayer(layer_config(case, offload), ep_group=ep_group,
                          policy=placement).to(device=device, dtype=case.dtype)

    base = layer()
    out: List[Method] = []
    if "lrmoe" in methods:
        for policy in policies:
            timed = base if policy is None else layer(policy)
            for c in rates:
                def run_lrmoe(x, ids, c=c, timed=timed):
                    timed.set_recalibration(recalibration_rate=c)
                    return timed(x, ids)
                out.append(Method("lrmoe", float(c), run_lrmoe, list(timed.parameters()),
                                  base, tolerance=0.0 if policy is None else tolerance(
                                      case.dtype), timed=None if policy is None else timed))
    if "dropless" in methods:
        out.append(_dropless_method(base, case, ep_group))
    if "transformers" in methods:
        out.append(_transformers_method(base, case, device))
    if "torchtitan" in methods:
        from lrmoe.bench.baselines.torchtitan_moe import torchtitan_method
        out.append(torchtitan_method(base, case, device))
    return out


def _dropless_method(layer: LRMoELayer, case: Case, ep_group) -> Method:
    """The dropless baseline on ``layer``'s router, experts and shared expert."""
    from lrmoe.bench.baselines.dropless import dropless_moe, dropless_moe_ep

    a2a_bytes: Dict[str, int] = {}
    if ep_group is None:
        dropless = dropless_moe
    else:
        def dropless(*args):
            return dropless_moe_ep(*args, group=ep_group, a2a_bytes=a2a_bytes)

    def run_dropless(x, ids):
        with phase("router"):
            routing = layer.gate(x, ids)
        o = dropless(x, routing.weights_TK, routing.expert_ids_TK,
                     layer.experts.gate_up_proj, layer.experts.down_proj)
        if layer.shared_expert is not None:
            o = o + layer.shared_expert(x)
        return o
    return Method("dropless", None, run_dropless, list(layer.parameters()), layer,
                  tolerance(case.dtype), a2a_bytes if ep_group is not None else None)


def _transformers_method(base: LRMoELayer, case: Case, device: torch.device) -> Method:
    """transformers' Qwen3MoeSparseMoeBlock as shipped, its gate forced to the case ids."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    d = case.dims
    tcfg = Qwen3MoeConfig(hidden_size=d["hidden"], moe_intermediate_size=d["inter"],
                          num_experts=d["experts"], num_experts_per_tok=d["top_k"],
                          norm_topk_prob=True)
    # what a Qwen3MoeForCausalLM picks by default (PreTrainedModel.
    # get_correct_experts_implementation); a bare block would fall back to the eager loop
    tcfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(tcfg).to(device=device, dtype=case.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(base.gate.weight)
        block.experts.gate_up_proj.copy_(base.experts.gate_up_proj)
        block.experts.down_proj.copy_(base.experts.down_proj)
    forced = {}

    def gate_forward(hidden):
        with phase("router"):
            logits = F.linear(hidden, block.gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            w = probs.gather(1, forced["ids"])
            w = (w / w.sum(-1, keepdim=True)).to(logits.dtype)
        return logits, w, forced["ids"]
    block.gate.forward = gate_forward
    shared = base.shared_expert

    def run(x, ids):
        forced["ids"] = ids
        o = block(x.unsqueeze(0)).squeeze(0)
        return o + shared(x) if shared is not None else o
    params = list(block.parameters()) + (list(shared.parameters()) if shared else [])
    return Method("transformers", None, run, params, base, tolerance(case.dtype),
                  module=block)


# ----------------------------------------------------------------- agreement check
def rel_err(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _step(forward: Callable[[Tensor, Tensor], Tensor], inputs: Inputs
          ) -> Tuple[Tensor, Tensor]:
    """(output, input gradient) of one forward + backward on input set 0."""
    x = inputs.xs[0].detach().requires_grad_()
    out = forward(x, inputs.ids[0])
    out.backward(inputs.gs[0])
    return out.detach(), x.grad


def reference_outputs(layer: LRMoELayer, inputs: Inputs) -> Tuple[Tensor, Tensor]:
    """The LRMoE layer at c = 0 on input set 0: (output, input gradient), what every
    baseline must reproduce (c = 0 keeps every pair: the full backward)."""
    layer.set_recalibration(recalibration_rate=0.0)
    return _step(layer, inputs)


def check_agreement(method: Method, inputs: Inputs, reference: Tuple[Tensor, Tensor],
                    combine: Optional[Callable[[List[float]], List[float]]] = None
                    ) -> Optional[dict]:
    """Compare a baseline with the LRMoE layer at c = 0 on input set 0.

    Args:
        method: a baseline, or LRMoE under a placement policy at c = 0 (any other
            ``lrmoe`` method returns None: it is the reference, or keeps other pairs).
        inputs: the case's inputs. reference: :func:`reference_outputs`.
        combine: expert parallel: turns this rank's [out error, dx error] into the
            maximum over ranks (a collective), so every rank takes the same decision.

    Returns:
        ``{"out_rel_err", "dx_rel_err", "tolerance", "passed"}`` (relative Frobenius
        errors of the output and of the input gradient).
    """
    if method.method == "lrmoe" and (method.policy is None or method.rate != 0):
        return None  # at c > 0 a policy's quotas may keep other pairs: dx differs
    out, dx = _step(method.forward, inputs)
    errs = [rel_err(out, reference[0]), rel_err(dx, reference[1])]
    if combine is not None:
        errs = combine(errs)
    for p in method.params:
        p.grad = None
    passed = all(e <= method.tolerance for e in errs)  # NaN fails
    return dict(out_rel_err=errs[0], dx_rel_err=errs[1], tolerance=method.tolerance,
                passed=bool(passed))
