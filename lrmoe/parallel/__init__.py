"""Expert parallelism (EP) over ``torch.distributed`` with the planned backward.

Legend: W ranks in the EP group, r this rank, E experts (global), El = E / W local experts
(rank d owns experts ``[d*El, (d+1)*El)``), T local tokens, K top_k, P = T*K local pairs,
H hidden, I expert intermediate size, N rows received by this rank's experts, R pairs this
rank keeps in the backward, M kept rows its experts receive. *Source* rank: the token
owner. *Expert* rank: the owner of the expert. Every rank is both.

Modules, in data-flow order:

* :mod:`~lrmoe.parallel.group` -- joining the group under torchrun, the config check
  across ranks, the failure announcement before the dispatch;
* :mod:`~lrmoe.parallel.plan` -- :class:`DispatchPlan`, every split, permutation and quota
  of one layer call, computed once from the exchanged counts;
* :mod:`~lrmoe.parallel.dispatch` -- the exchanges: counts, dispatch, combine, gradient
  rows, dx;
* :mod:`~lrmoe.parallel.placement` -- :class:`Placement`, a layer's placement settings
  (policy, memory budget, slots) and their reading from ``lrmoe train``'s config;
* :mod:`~lrmoe.parallel.replicas` -- placement policies executed: the planner's layout per
  call, replica weights fetched (``ultraep``, ``lrmoe``) or pushed after the optimizer
  step (``symi``), replica gradients summed into the owner, the bytes moved;
* :mod:`~lrmoe.parallel.function` -- :class:`ExpertParallelFunction`, the autograd;
* :mod:`~lrmoe.parallel.routes` -- :class:`Routes`, the one interface a layer runs its
  experts through: :class:`LocalRoutes` (one device) or :class:`EPRoutes` (this package's
  expert parallelism); where another backend plugs in;
* :mod:`~lrmoe.parallel.data_parallel` -- expert sharding, the data-parallel gradient
  sync (DDP for the non-expert parameters, the experts over dp), the global clip;
* :mod:`~lrmoe.parallel.state` -- the sharded state (experts as DTensors) that
  ``torch.distributed.checkpoint`` saves and re-shards;
* :mod:`~lrmoe.parallel.hooks` -- the training loop's one door: :class:`PlacementHooks`
  (set-up, the replica push as an optimizer step hook, checkpoint state, metrics) and
  the gradient sync before the step.

Forward (exact, every pair):
  source: permute by global expert -> rows for rank d are contiguous -> all_gather the
  (W, E) count matrix (plus a config hash) -> one ``.tolist()`` -> the DispatchPlan ->
  ``all_to_all_single`` x rows -> expert: re-sort (source, local expert) blocks to
  (local expert, source) order -> grouped GEMMs, swiglu (phi_sq) -> back to arrival order ->
  ``all_to_all_single`` y rows and the fp32 phi_sq side band (4 bytes a pair) -> source:
  weighted combine.
Backward (planned, docs/algorithm.md section 8):
  source: dalpha = <g, y> for every pair (exact router gradient) -> score every pair ->
  ``ops.select`` on the source's own rows within its share of the global quota Q_e (both
  from the plan, so the backward has no host sync) -> send ONLY the kept rows of
  G = alpha g and their int32 row positions -> expert: grouped GEMMs for dW and dX over the
  kept rows, its saved x rows gathered and its saved h rows read in place -> return dX of
  kept pairs only -> source: scatter into dx (dropped pairs add nothing).
Expert weight gradients stay on their rank; everything else is data-parallel
(:class:`DataParallel`: torch's DDP plus the experts' dp sum; :func:`clip_grad_norm_`);
the sharded checkpoint state is :mod:`~lrmoe.parallel.state`.

Profiler ranges (``lrmoe bench layer --ep``; the single-device names where a step has a
single-device twin): forward ``lrmoe.permute`` (source permute, the plan's permutation and
the expert-side re-sort and un-sort), ``lrmoe.a2a_counts`` (count all_gather + its host
sync), ``lrmoe.select`` (the plan's quotas and shares, on the host), ``lrmoe.a2a_dispatch``,
``lrmoe.expert_gemm_fwd`` (grouped GEMMs + swiglu), ``lrmoe.a2a_combine`` (y rows + phi_sq
side band), ``lrmoe.combine``; backward ``lrmoe.router_grad``, ``lrmoe.score``,
``lrmoe.select`` (selection), ``lrmoe.compact`` (gathers of kept rows on both sides),
``lrmoe.a2a_grad`` (G rows + int32 positions), ``lrmoe.expert_gemm_bwd``, ``lrmoe.a2a_dx``,
``lrmoe.scatter``; with a placement policy also ``lrmoe.plan`` (the planner call),
``lrmoe.replica_fetch`` (forward), ``lrmoe.replica_grads`` (backward) and
``lrmoe.replica_push`` (:meth:`PlacementHooks.push`). Ranges add no host syncs.

All-to-all bytes (``stats.a2a_bytes``, per rank, for the last step): bytes this rank SENDS
into each collective, counting the rows it sends to itself (a local copy on NCCL):
``forward_dispatch`` = P H s (s = element size: every local pair's x row),
``forward_combine`` = N (H s + 4) (y row + fp32 phi_sq of every row it received),
``counts`` = (E + 1) 8 W (its int64 counts + config hash, all_gathered to W ranks; one
more int64 slot with a placement policy),
``backward_grad`` = R H s (kept rows of G), ``backward_index`` = 4 R (their int32
positions), ``backward_dx`` = M H s (dX of the M kept rows its experts received).
"""
from lrmoe.parallel.data_parallel import (EXPERT_PARAM_ATTR, DataParallel, clip_grad_norm_,
                                          is_expert_param, shard_experts)
from lrmoe.parallel.dispatch import (combine, combine_dx, dispatch, dispatch_grads,
                                     exchange_counts)
from lrmoe.parallel.function import ExpertParallelFunction
from lrmoe.parallel.group import (FAILED, announce_failure, check_config_across_ranks,
                                  comm_device, config_hash, config_summary,
                                  init_torchrun_group, raise_on_mismatch)
from lrmoe.parallel.plan import DispatchPlan, InstanceLayout, build_plan, source_shares
from lrmoe.parallel.placement import Placement
from lrmoe.parallel.replicas import ReplicaState
from lrmoe.parallel.routes import EPRoutes, LocalRoutes, Routes, make_routes
from lrmoe.parallel.hooks import PlacementHooks, placement_metrics, push_replica_weights

__all__ = [
    "EXPERT_PARAM_ATTR", "FAILED", "DispatchPlan", "EPRoutes", "ExpertParallelFunction",
    "InstanceLayout", "LocalRoutes", "Placement", "PlacementHooks", "ReplicaState",
    "Routes", "make_routes", "placement_metrics", "push_replica_weights",
    "DataParallel", "announce_failure", "build_plan",
    "check_config_across_ranks", "clip_grad_norm_", "combine", "combine_dx", "comm_device",
    "config_hash", "config_summary", "dispatch", "dispatch_grads", "exchange_counts",
    "init_torchrun_group", "is_expert_param", "raise_on_mismatch", "shard_experts", "source_shares",
]
