"""Expert parallelism (EP) over ``torch.distributed`` with the planned backward.

Legend: W ranks in the EP group, r this rank, E experts (global), El = E / W local experts
(rank d owns experts ``[d*El, (d+1)*El)``), T local tokens, K top_k, P = T*K local pairs,
H hidden, I expert intermediate size, N rows received by this rank's experts, R pairs this
rank keeps in the backward. *Source* rank: the token owner. *Expert* rank: the owner of
the expert. Every rank is both.

Forward (exact, every pair):
  source: permute by global expert -> rows for rank d are contiguous -> all_gather the
  (W, E) count matrix (plus a config hash) -> one ``.tolist()`` for the splits ->
  ``all_to_all_single`` x rows -> expert: re-sort (source, local expert) blocks to
  (local expert, source) order -> grouped GEMMs, swiglu (phi_sq) -> back to arrival order ->
  ``all_to_all_single`` y rows and the fp32 phi_sq side band (4 bytes a pair) -> source:
  weighted combine.
Backward (planned, DESIGN.md section 2):
  source: dalpha = <g, y> for every pair (exact router gradient) -> score every pair ->
  global quota Q_e from the all-gathered counts -> per-(source, expert) share of Q_e by
  largest remainder (deterministic, identical on every rank; computed on the host from
  the counts the forward already synced, so the backward has no host sync) ->
  ``ops.select`` on the source's own rows -> send ONLY the kept rows of G = alpha g and their
  int32 row positions -> expert: compaction of its saved x/h rows, grouped GEMMs for dW and
  dX -> return dX of kept pairs only -> source: scatter into dx (dropped pairs add nothing).
Expert weight gradients stay on their rank; everything else is data-parallel
(:func:`allreduce_non_expert_grads`, :func:`clip_grad_norm_`).

Profiler ranges (``lrmoe bench layer --ep``; the single-device names where a step has a
single-device twin): forward ``lrmoe.permute`` (source permute and the expert-side re-sort
and un-sort), ``lrmoe.a2a_counts`` (count all_gather + its host sync), ``lrmoe.a2a_dispatch``,
``lrmoe.expert_gemm_fwd`` (grouped GEMMs + swiglu), ``lrmoe.a2a_combine`` (y rows + phi_sq
side band), ``lrmoe.combine``; backward ``lrmoe.router_grad``, ``lrmoe.score``,
``lrmoe.select`` (quotas and shares on the host, selection), ``lrmoe.compact`` (gathers
of kept rows on both sides), ``lrmoe.a2a_grad`` (G rows + int32 positions),
``lrmoe.expert_gemm_bwd``, ``lrmoe.a2a_dx``, ``lrmoe.scatter``. Ranges add no host syncs.

All-to-all bytes (``stats.a2a_bytes``, per rank, for the last step): bytes this rank SENDS
into each collective, counting the rows it sends to itself (a local copy on NCCL):
``forward_dispatch`` = P H s (s = element size: every local pair's x row),
``forward_combine`` = N (H s + 4) (y row + fp32 phi_sq of every row it received),
``counts`` = (E + 1) 8 W (its int64 counts + config hash, all_gathered to W ranks),
``backward_grad`` = R H s (kept rows of G), ``backward_index`` = 4 R (their int32
positions), ``backward_dx`` = M H s (dX of the M kept rows its experts received).
"""
from __future__ import annotations

import datetime
import hashlib
import os
from itertools import accumulate
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function as phase  # names the benchmark's breakdown

from lrmoe import ops
from lrmoe.config import LRMoEConfig
from lrmoe.experts import score_pairs

#: attribute set on expert-sharded parameters (``param._lrmoe_expert_parallel = True``)
EXPERT_PARAM_ATTR = "_lrmoe_expert_parallel"

_HASH_FIELDS = ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "router",
                "norm_topk_prob", "routed_scaling_factor", "shared_expert_intermediate_size",
                "shared_expert_gate", "recalibration_rate", "metric", "quota_rule",
                "selection", "selective_backward", "seed")
#: the hash slot of the per-forward counts exchange when a rank failed before it
_FAILED = -1


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_torchrun_group(ep_size: int, use_cuda: bool, setting: str) -> str:
    """Join the default process group that ``torchrun`` prepared for this process.

    NCCL when ``use_cuda`` (after ``torch.cuda.set_device(LOCAL_RANK)``, so each rank
    binds its own GPU before NCCL does), gloo otherwise; 300 s collective timeout. Does
    nothing but the checks when the group already exists.

    Args:
        ep_size: the expert-parallel size asked for; must equal torchrun's world size.
        use_cuda: pick NCCL and bind ``cuda:LOCAL_RANK``.
        setting: how the user gave ``ep_size`` (``"--ep 2"``, ``"ep_size=2"``), for errors.

    Returns:
        The backend name (``"nccl"`` or ``"gloo"``).

    Raises:
        ValueError: not started by torchrun (its env variables are missing), a world
            size other than ``ep_size``, or (NCCL) more processes per node than GPUs; the
            message names ``setting`` and ``torchrun --nproc-per-node``.
    """
    launch = f"launch with torchrun --nproc-per-node {ep_size} ... --ep {ep_size}"
    missing = [v for v in _TORCHRUN_ENV if v not in os.environ]
    if missing and not dist.is_initialized():
        raise ValueError(f"{setting} needs {ep_size} processes started by torchrun, but "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                         f"set (this process was not started by torchrun); {launch}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != ep_size:
        raise ValueError(f"{setting} needs {ep_size} processes, but torchrun started "
                         f"{world}; pass --ep {world} to use them all, or {launch}")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if backend == "nccl":  # one GPU per rank before NCCL binds the current device
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise ValueError(f"{setting}: local rank {local} needs GPU {local}, but torch "
                                 f"sees {torch.cuda.device_count()} CUDA device(s) on this "
                                 "node; start at most that many processes per node "
                                 "(torchrun --nproc-per-node) or run on the CPU (--device cpu)")
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    return dist.get_backend()


def config_hash(config: LRMoEConfig, ep_size: int, dtype: Optional[torch.dtype] = None
                ) -> int:
    """A 62-bit hash of the fields every EP rank must agree on (and the EP size, and the
    compute dtype of the forward when given)."""
    text = repr([(f, getattr(config, f)) for f in _HASH_FIELDS] + [("ep_size", ep_size)]
                + ([("dtype", str(dtype))] if dtype is not None else []))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def config_summary(config: LRMoEConfig, ep_size: int) -> str:
    """The hashed fields as text, for error messages."""
    return ", ".join(f"{f}={getattr(config, f)!r}" for f in _HASH_FIELDS) + f", ep={ep_size}"


def check_config_across_ranks(config: LRMoEConfig, group) -> None:
    """Fail fast (on every rank) when the ranks of ``group`` disagree on the MoE config.

    A collective: every rank of ``group`` must call it.

    Raises:
        ValueError: naming the ranks whose config differs from rank 0's and this rank's
            settings.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([config_hash(config, world)], dtype=torch.int64)
    dev = _comm_device(group)
    mine = mine.to(dev)
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    hashes = [int(t.item()) for t in got]
    _raise_on_mismatch(hashes, config, world, dist.get_rank(group))


def _raise_on_mismatch(hashes: Sequence[int], config: LRMoEConfig, world: int,
                       rank: int, dtype: Optional[torch.dtype] = None) -> None:
    failed = [i for i, h in enumerate(hashes) if h == _FAILED]
    if failed:
        raise RuntimeError(
            f"expert-parallel ranks {failed} failed before the dispatch all-to-all (their own "
            f"error says why); rank {rank} stops too instead of waiting for them")
    bad = [i for i, h in enumerate(hashes) if h != hashes[0]]
    if bad:
        what = "configuration or compute dtype" if dtype is not None else "configuration"
        raise ValueError(
            f"expert-parallel ranks disagree on the LRMoE {what}: ranks {bad} differ "
            f"from rank 0 (E, K, H, I, shared expert, c, metric, quota rule, selection, "
            f"router, seed, EP size{' and the dtype of the expert inputs' if dtype else ''} "
            f"must match on every rank); rank {rank} has {config_summary(config, world)}"
            + (f", dtype={dtype}" if dtype is not None else ""))


def announce_failure(config: LRMoEConfig, group) -> None:
    """Join the counts exchange of the forward in place of a rank that failed before it
    (bad input, non-finite router logits), so the other ranks raise at once instead of
    waiting for the collective timeout. Call it from an ``except`` block, then re-raise.
    A collective."""
    world = dist.get_world_size(group)
    meta = torch.zeros(config.num_experts + 1, dtype=torch.int64, device=_comm_device(group))
    meta[-1] = _FAILED
    dist.all_gather([torch.empty_like(meta) for _ in range(world)], meta, group=group)


def _comm_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _a2a(x: Tensor, out_rows: int, in_splits: List[int], out_splits: List[int], group
         ) -> Tensor:
    """``all_to_all_single`` with variable row splits (x contiguous, first dim rows)."""
    out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return out


def _h2d(values, dtype: torch.dtype, dev: torch.device) -> Tensor:
    """A host list as a tensor on ``dev`` without a host sync: a plain ``torch.tensor(...,
    device=cuda)`` copies from pageable memory and synchronises the stream; a pinned
    staging tensor copied with ``non_blocking`` does not (the caching host allocator keeps
    it alive until the copy has run)."""
    t = torch.as_tensor(values, dtype=dtype)
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


def _block_sums(row: Sequence[int], start: int, stop: int) -> int:
    return int(sum(row[start:stop]))


def source_shares(counts_WE: Tensor, quota_E: Tensor) -> Tensor:
    """Split each expert's global quota over source ranks (largest remainder).

    share[s, e] = floor(Q_e n[s, e] / N_e) plus one for the ``Q_e - sum_s floor(...)``
    sources with the largest remainders ``Q_e n[s, e] mod N_e`` (ties to the lower rank).
    Runs :func:`lrmoe.ops.source_shares` (exact integer C++) on the counts' device, no
    host sync; identical on every rank.

    Args:
        counts_WE: (W, E) integer routed pairs of each source rank per expert.
        quota_E: (E,) global quotas, ``Q_e <= N_e = sum_s n[s, e]``.

    Returns:
        (W, E) int64 with ``sum_s share[s, e] == Q_e`` and ``share <= counts``.
    """
    return ops.source_shares(counts_WE.to(torch.int32), quota_E.to(torch.int32)).long()


def _source_to_expert_order(blocks_WL: Tensor, num_rows: int):
    """Rows arrive as (source, local expert) blocks; experts want (local expert, source).

    Returns ``dest_N`` (int64, arrival row -> expert-order row) and the int32 inclusive
    per-local-expert offsets of the expert order.
    """
    w, el = blocks_WL.shape
    dev = blocks_WL.device
    flat = blocks_WL.reshape(-1)
    start_arrival = torch.cumsum(flat, 0) - flat
    flat_t = blocks_WL.t().reshape(-1)
    start_expert = (torch.cumsum(flat_t, 0) - flat_t).view(el, w).t().reshape(-1)
    block = torch.repeat_interleave(torch.arange(w * el, device=dev), flat,
                                    output_size=num_rows)
    j = torch.arange(num_rows, device=dev) - start_arrival[block]
    dest = start_expert[block] + j
    offsets = torch.cumsum(blocks_WL.sum(0), 0).to(torch.int32)
    return dest, offsets


def _inverse(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


class ExpertParallelFunction(torch.autograd.Function):
    """Autograd of the expert-parallel routed experts (see the module docstring).

    ``apply(x_TH, weights_TK, expert_ids_TK, w_gate_up_L2IH, w_down_LHI, config, stats,
    group)`` with the LOCAL expert shards (El = E / W). A collective: every rank of
    ``group`` must call forward and backward (a rank with T = 0 included).

    Returns:
        o_TH: (T, H), dtype of x.
    """

    @staticmethod
    def forward(ctx, x_TH, weights_TK, expert_ids_TK, w_gate_up_L2IH, w_down_LHI,
                config: LRMoEConfig, stats, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        num_experts, top_k, el = config.num_experts, expert_ids_TK.shape[1], w_gate_up_L2IH.shape[0]
        dev = x_TH.device
        try:
            with phase("lrmoe.permute"):
                row_pair_P, pair_row_P, n_E, offsets_E = ops.permute(expert_ids_TK,
                                                                     num_experts)
                x_PH = ops.gather_rows(x_TH, row_pair_P, None, top_k)
        except Exception:
            announce_failure(config, group)
            raise

        # counts exchange; the config hash rides along (fails fast on set_recalibration drift)
        with phase("lrmoe.a2a_counts"):
            meta = torch.cat([n_E.long(), _h2d([config_hash(config, world, x_TH.dtype)],
                                                torch.int64, dev)])
            meta_comm = meta.to(_comm_device(group))
            got = [torch.empty_like(meta_comm) for _ in range(world)]
            dist.all_gather(got, meta_comm, group=group)
            meta_WE1 = torch.stack(got).to(dev)
            meta_host = meta_WE1.tolist()  # the one host sync of the dispatch
        _raise_on_mismatch([row[-1] for row in meta_host], config, world, rank, x_TH.dtype)
        counts_host = [row[:num_experts] for row in meta_host]
        counts_WE = meta_WE1[:, :num_experts]
        send = [_block_sums(counts_host[rank], d * el, (d + 1) * el) for d in range(world)]
        recv = [_block_sums(counts_host[s], rank * el, (rank + 1) * el) for s in range(world)]
        num_recv = sum(recv)

        with phase("lrmoe.a2a_dispatch"):
            x_recv_NH = _a2a(x_PH, num_recv, send, recv, group)
        with phase("lrmoe.permute"):
            dest_N, offsets_L = _source_to_expert_order(
                counts_WE[:, rank * el:(rank + 1) * el], num_recv)
            x_NH = ops.gather_rows(x_recv_NH, _inverse(dest_N).to(torch.int32), None, 1)
        with phase("lrmoe.expert_gemm_fwd"):
            h_N2I = ops.grouped_mm(x_NH, w_gate_up_L2IH.transpose(1, 2), offsets_L)
            phi_NI, phi_sq_N = ops.swiglu(h_N2I)
            y_NH = ops.grouped_mm(phi_NI, w_down_LHI.transpose(1, 2), offsets_L)
        with phase("lrmoe.permute"):
            y_recv_NH = ops.gather_rows(y_NH, dest_N.to(torch.int32), None, 1)
            phi_sq_recv_N = phi_sq_N.index_select(0, dest_N)
        with phase("lrmoe.a2a_combine"):
            y_PH = _a2a(y_recv_NH, x_PH.shape[0], recv, send, group)
            phi_sq_P = _a2a(phi_sq_recv_N, x_PH.shape[0], recv, send, group)
        with phase("lrmoe.combine"):
            o_TH = ops.combine(y_PH, pair_row_P, weights_TK, top_k)

        ctx.save_for_backward(x_NH, h_N2I, dest_N, weights_TK, w_gate_up_L2IH, w_down_LHI,
                              y_PH, phi_sq_P, row_pair_P, pair_row_P, offsets_E, counts_WE)
        ctx.config, ctx.stats, ctx.group, ctx.top_k = config, stats, group, top_k
        ctx.counts_host, ctx.recv, ctx.el = counts_host, recv, el
        ctx.x_dtype = x_TH.dtype
        esize = x_TH.element_size()
        h = x_TH.shape[1]
        stats.tokens_per_expert_E = counts_WE.sum(0).to(torch.int32)
        stats.num_pairs = x_PH.shape[0]
        stats.a2a_bytes = {
            "forward_dispatch": sum(send) * h * esize,
            "forward_combine": num_recv * (h * esize + 4),
            "counts": meta.numel() * 8 * world,
        }
        return o_TH

    @staticmethod
    def backward(ctx, grad_TH):
        (x_NH, h_N2I, dest_N, weights_TK, w_gate_up_L2IH, w_down_LHI, y_PH, phi_sq_P,
         row_pair_P, pair_row_P, offsets_E, counts_WE) = ctx.saved_tensors
        cfg, stats, group, top_k, el = ctx.config, ctx.stats, ctx.group, ctx.top_k, ctx.el
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        counts_host, recv_fwd = ctx.counts_host, ctx.recv
        dev = y_PH.device
        g_TH = grad_TH.to(ctx.x_dtype).contiguous()
        num_pairs = row_pair_P.shape[0]

        with phase("lrmoe.router_grad"):
            grad_weights_TK = ops.routing_weight_grad(g_TH, y_PH, pair_row_P, top_k)
        alpha_P = weights_TK.detach().reshape(-1).float()
        if cfg.selective_backward:
            score_P, seed = score_pairs(cfg, stats, g_TH, weights_TK, phi_sq_P, row_pair_P)
            with phase("lrmoe.select"):
                # quotas and shares depend only on the counts the forward already brought
                # to the host: the same exact C++ on the CPU needs no device sync
                counts_cpu = torch.tensor(counts_host, dtype=torch.int32)
                quota_cpu = ops.quota(counts_cpu.sum(0).to(torch.int32),
                                      cfg.recalibration_rate, cfg.quota_rule)
                shares_cpu = source_shares(counts_cpu, quota_cpu)
                shares_host = shares_cpu.tolist()
                share_E = _h2d(shares_cpu[rank], torch.int32, dev)
                quota_E = _h2d(quota_cpu, torch.int32, dev)
                num_retained = int(sum(shares_host[rank]))
                kept_rows_R, kept_pair_R, pair_kept_P, _, kept_scale_R, mass = ops.select(
                    score_P, row_pair_P, offsets_E, share_E, num_retained, cfg.selection,
                    seed)
            with phase("lrmoe.compact"):
                scale_R = alpha_P.index_select(0, kept_pair_R) * kept_scale_R
            stats.quota_E, stats.retained_mass = quota_E, mass
        else:
            shares_host = counts_host
            num_retained = num_pairs
            kept_rows_R = torch.arange(num_pairs, dtype=torch.int32, device=dev)
            kept_pair_R, pair_kept_P = row_pair_P, pair_row_P
            with phase("lrmoe.compact"):
                scale_R = alpha_P.index_select(0, row_pair_P)
            stats.quota_E, stats.retained_mass = counts_WE.sum(0).to(torch.int32), None
        stats.num_retained, stats.kept_pair_R = num_retained, kept_pair_R
        stats.backward_steps += 1

        # source -> expert: only the kept rows and their positions
        with phase("lrmoe.compact"):
            G_RH = ops.gather_rows(g_TH, kept_pair_R, scale_R, top_k)
        send = [_block_sums(shares_host[rank], d * el, (d + 1) * el) for d in range(world)]
        recv = [_block_sums(shares_host[s], rank * el, (rank + 1) * el) for s in range(world)]
        num_recv = sum(recv)
        with phase("lrmoe.a2a_grad"):
            G_recv_MH = _a2a(G_RH, num_recv, send, recv, group)
            pos_recv_M = _a2a(kept_rows_R.to(torch.int32), num_recv, send, recv, group)

        with phase("lrmoe.compact"):
            # position in source s's row order -> arrival row of the forward -> expert order
            arrival_start = [sum(recv_fwd[:s]) for s in range(world)]
            segment_start = [_block_sums(counts_host[s], 0, rank * el) for s in range(world)]
            base_W = _h2d([a - b for a, b in zip(arrival_start, segment_start)], torch.int64,
                          dev)
            base_M = torch.repeat_interleave(base_W, _h2d(recv, torch.int64, dev),
                                             output_size=num_recv)
            row_M = dest_N.index_select(0, pos_recv_M.long() + base_M)
            row_sorted_M, order_M = torch.sort(row_M)  # (local expert, source) order
            kept_per_expert = [sum(shares_host[s][rank * el + le] for s in range(world))
                               for le in range(el)]
            kept_offsets_L = _h2d(list(accumulate(kept_per_expert)), torch.int32, dev)
            row32 = row_sorted_M.to(torch.int32)
            G_MH = ops.gather_rows(G_recv_MH, order_M.to(torch.int32), None, 1)
            h_M2I = ops.gather_rows(h_N2I, row32, None, 1)
            X_MH = ops.gather_rows(x_NH, row32, None, 1)
        with phase("lrmoe.expert_gemm_bwd"):
            phi_MI, _ = ops.swiglu(h_M2I)
            dphi_MI = ops.grouped_mm(G_MH, w_down_LHI, kept_offsets_L)
            grad_w_down_LHI = ops.grouped_mm(G_MH.t(), phi_MI, kept_offsets_L)
            dh_M2I = ops.swiglu_backward(dphi_MI, h_M2I)
            grad_w_gate_up_L2IH = ops.grouped_mm(dh_M2I.t(), X_MH, kept_offsets_L)
            dx_MH = ops.grouped_mm(dh_M2I, w_gate_up_L2IH, kept_offsets_L)

        # expert -> source: dX of the kept pairs, in the order they were sent
        with phase("lrmoe.scatter"):
            dx_recv_MH = ops.gather_rows(dx_MH, _inverse(order_M).to(torch.int32), None, 1)
        with phase("lrmoe.a2a_dx"):
            dx_RH = _a2a(dx_recv_MH, num_retained, recv, send, group)
        with phase("lrmoe.scatter"):
            grad_x_TH = ops.combine(dx_RH, pair_kept_P, None, top_k)

        h = g_TH.shape[1]
        esize = g_TH.element_size()
        stats.a2a_bytes = dict(stats.a2a_bytes or {})
        stats.a2a_bytes.update({"backward_grad": num_retained * h * esize,
                                "backward_index": num_retained * 4,
                                "backward_dx": num_recv * h * esize})
        buffers = {"G": G_MH, "X": X_MH, "h": h_M2I, "phi": phi_MI, "dphi": dphi_MI,
                   "dh": dh_M2I, "dx": dx_MH}
        stats.buffers = {k: tuple(v.shape) for k, v in buffers.items()}
        stats.buffer_bytes = sum(v.numel() * v.element_size() for v in buffers.values())
        return (grad_x_TH.to(ctx.x_dtype), grad_weights_TK.to(weights_TK.dtype), None,
                grad_w_gate_up_L2IH, grad_w_down_LHI, None, None, None)


# ------------------------------------------------------------------- data-parallel helpers
def is_expert_param(p: Tensor) -> bool:
    """True for expert-sharded parameters (their gradients stay on their rank)."""
    return bool(getattr(p, EXPERT_PARAM_ATTR, False))


def allreduce_non_expert_grads(module: nn.Module, group=None,
                               bucket_bytes: int = 64 << 20) -> None:
    """Data-parallel gradient sync for a loss that is the MEAN of the ranks' local losses.

    Non-expert gradients are averaged over ``group``: flattened into buckets of at most
    ``bucket_bytes`` per dtype (one all-reduce per bucket, as DDP's reducer does, instead
    of one per parameter), summed, divided by W and copied back. Expert-sharded gradients
    are only divided by W: each already sums the contributions of every rank's tokens
    through the all-to-all, so no collective is needed for them. Parameters without a
    gradient contribute zeros (every rank joins the same collectives, in parameter
    order). A collective.
    """
    world = dist.get_world_size(group)
    open_bucket: Dict[torch.dtype, List[Tensor]] = {}
    open_bytes: Dict[torch.dtype, int] = {}
    full: List[List[Tensor]] = []
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if is_expert_param(p):
            if p.grad is not None:
                p.grad.div_(world)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dt = p.grad.dtype
        open_bucket.setdefault(dt, []).append(p.grad)
        open_bytes[dt] = open_bytes.get(dt, 0) + p.grad.numel() * p.grad.element_size()
        if open_bytes[dt] >= bucket_bytes:
            full.append(open_bucket.pop(dt))
            open_bytes[dt] = 0
    for grads in full + list(open_bucket.values()):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def clip_grad_norm_(module: nn.Module, max_norm: float, group=None) -> Tensor:
    """Clip by the global gradient norm over all ranks; returns the norm (fp32 tensor).

    Expert-sharded parameters' squared norms are summed over ``group``; non-expert
    parameters (already identical on every rank after :func:`allreduce_non_expert_grads`)
    count once. A collective.
    """
    params = [p for p in module.parameters() if p.grad is not None]
    dev = params[0].grad.device if params else torch.device("cpu")
    expert_sq = torch.zeros((), dtype=torch.float64, device=dev)
    dense_sq = torch.zeros((), dtype=torch.float64, device=dev)
    for p in params:
        sq = p.grad.detach().double().pow(2).sum()
        if is_expert_param(p):
            expert_sq = expert_sq + sq
        else:
            dense_sq = dense_sq + sq
    dist.all_reduce(expert_sq, group=group)
    norm = (expert_sq + dense_sq).sqrt()
    if max_norm < float("inf"):
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(factor.to(p.grad.dtype))
    return norm.float()


def expert_state_dict(module: nn.Module, group=None) -> Dict[str, object]:
    """This rank's checkpoint: its expert shards (all ranks) + everything else (kept by
    every rank; rank 0's copy is the one to write), tagged with the EP size and rank."""
    return {"ep_size": dist.get_world_size(group), "ep_rank": dist.get_rank(group),
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def load_expert_state_dict(module: nn.Module, checkpoint: Dict[str, object],
                           group=None) -> None:
    """Load :func:`expert_state_dict` output saved on the same EP size and rank.

    Raises:
        ValueError: the checkpoint was written with another EP size or rank.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if checkpoint.get("ep_size") != world:
        raise ValueError(f"checkpoint was saved with expert-parallel size "
                         f"{checkpoint.get('ep_size')} but this run has EP size {world}; "
                         "resume with the same --ep (resharding is not supported)")
    if checkpoint.get("ep_rank") != rank:
        raise ValueError(f"checkpoint shard is for EP rank {checkpoint.get('ep_rank')} but "
                         f"this is rank {rank}; load each rank's own shard file")
    module.load_state_dict(checkpoint["state"])
