"""Routed loads for the planner and the simulator: synthetic (uniform or Zipf popularity)
and replayed from routing traces (``lrmoe train --record-trace``).

Legend: S steps, Lyr MoE layers, W source ranks, E experts, ``load_WE`` routed pairs from
source s to expert e.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np

from lrmoe.workload.trace import load_trace, trace_routing


def zipf_exponent(num_experts: int, max_over_mean: float) -> float:
    """The exponent a with max/mean = ``max_over_mean`` for popularity p_e ~ 1/(e+1)^a.

    Raises:
        ValueError: ``max_over_mean`` outside [1, E) (uniform is 1; all on one expert is E).
    """
    if not 1.0 <= max_over_mean < num_experts:
        raise ValueError(f"max_over_mean must be in [1, E={num_experts}) (1 = uniform), got "
                         f"{max_over_mean}")
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)

    def ratio(a: float) -> float:
        w = ranks ** -a
        return float(w[0] / w.mean())

    lo, hi = 0.0, 1.0
    while ratio(hi) < max_over_mean:
        hi *= 2.0
    for _ in range(100):  # bisection: ratio grows with a
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ratio(mid) < max_over_mean else (lo, mid)
    return 0.5 * (lo + hi)


def synthetic_loads(num_ranks: int, num_experts: int, pairs_per_rank: int,
                    max_over_mean: float = 1.0, seed: int = 0,
                    popularity_seed: Optional[int] = None) -> np.ndarray:
    """(W, E) int64 routed pairs: every source rank draws ``pairs_per_rank`` pairs from one
    expert popularity, uniform (``max_over_mean`` = 1) or Zipf with that max/mean.

    The Zipf ranks are shuffled over the experts (``popularity_seed``, default ``seed``),
    so hot experts land on random owners; the draw itself uses ``seed`` (a second step of
    the same popularity: same ``popularity_seed``, another ``seed``). Pairs, not tokens:
    a token's K experts are drawn independently here.

    Raises:
        ValueError: non-positive sizes or ``max_over_mean`` outside [1, E).
    """
    if num_ranks < 1 or num_experts < 1 or pairs_per_rank < 0:
        raise ValueError(f"need num_ranks >= 1, num_experts >= 1, pairs_per_rank >= 0; got "
                         f"{num_ranks}, {num_experts}, {pairs_per_rank}")
    a = 0.0 if max_over_mean == 1.0 else zipf_exponent(num_experts, max_over_mean)
    p = np.arange(1, num_experts + 1, dtype=np.float64) ** -a
    np.random.default_rng(seed if popularity_seed is None else popularity_seed).shuffle(p)
    rng = np.random.default_rng([seed, 1])
    return rng.multinomial(pairs_per_rank, p / p.sum(), size=num_ranks).astype(np.int64)


def drifting_loads(num_ranks: int, num_experts: int, pairs_per_rank: int, steps: int,
                   max_over_mean: float = 2.0, swaps_per_step: int = 8,
                   seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(S, W, E) int64 routed pairs whose Zipf popularity *drifts*: the ranking of experts
    moves between steps, so a policy planning from the previous step's loads (SYMI's
    one-step lag) plans for a popularity that has since changed (issue 30).

    Step 0 ranks the experts by a seeded shuffle; every later step applies
    ``swaps_per_step`` transpositions of neighbouring ranks, each at a uniformly drawn
    rank position i (ranks i and i + 1 trade experts), so at most 2 x ``swaps_per_step``
    experts change rank per step and the hot experts wander over many steps. Each source
    rank then draws ``pairs_per_rank`` pairs from Zipf weights over the ranks (exponent
    for ``max_over_mean``, :func:`zipf_exponent`; 1 = uniform, where the drift changes
    nothing). Everything follows from ``seed``.

    Returns:
        (load_SWE, rank_SE): the loads, and per step the expert at each popularity rank
        (rank_SE[s, 0] the hottest).

    Raises:
        ValueError: sizes < 1 (``pairs_per_rank`` < 0), ``swaps_per_step`` < 0, or
            ``max_over_mean`` outside [1, E).
    """
    if num_ranks < 1 or num_experts < 1 or steps < 1 or pairs_per_rank < 0:
        raise ValueError(f"need num_ranks, num_experts, steps >= 1 and pairs_per_rank >= 0; "
                         f"got {num_ranks}, {num_experts}, {steps}, {pairs_per_rank}")
    if swaps_per_step < 0:
        raise ValueError(f"swaps_per_step must be >= 0 (0: a fixed ranking), got {swaps_per_step}")
    a = 0.0 if max_over_mean == 1.0 else zipf_exponent(num_experts, max_over_mean)
    w = np.arange(1, num_experts + 1, dtype=np.float64) ** -a
    w /= w.sum()
    rng = np.random.default_rng([seed, 2])
    order = rng.permutation(num_experts)
    rank_SE = np.empty((steps, num_experts), dtype=np.int64)
    load = np.empty((steps, num_ranks, num_experts), dtype=np.int64)
    for s in range(steps):
        if s > 0 and num_experts > 1:
            for i in rng.integers(0, num_experts - 1, size=swaps_per_step):
                order[i], order[i + 1] = order[i + 1], order[i]
        rank_SE[s] = order
        p = np.empty(num_experts)
        p[order] = w  # expert order[r] has the weight of rank r
        load[s] = rng.multinomial(pairs_per_rank, p, size=num_ranks)
    return load, rank_SE


def trace_loads(path: os.PathLike, num_ranks: int, tokens_per_rank: Optional[int] = None,
                record: Optional[int] = None, seed: int = 0) -> Tuple[np.ndarray, dict]:
    """(W, E) routed pairs from a routing trace (``lrmoe train --record-trace``) and its meta.

    With ``record`` (an index into the trace's (step, layer) records), that record's
    tokens are dealt to the W source ranks in contiguous blocks (data-parallel shards).
    Otherwise ``W x tokens_per_rank`` tokens are drawn with replacement from all records
    (:func:`lrmoe.workload.trace.trace_routing`), which keeps the recorded model's skew at any
    batch size (default: the records' own token count per rank).

    Raises:
        FileNotFoundError: no trace at ``path``.
        ValueError: ``record`` out of range or fewer tokens than ranks.
    """

    meta, arrays = load_trace(path)
    E, K = int(meta["num_experts"]), int(meta["top_k"])
    if record is not None:
        if not -len(arrays) <= record < len(arrays):
            raise ValueError(f"record must index the trace's {len(arrays)} records, got {record}")
        ids_TK = arrays[record]
    else:
        tokens = tokens_per_rank if tokens_per_rank is not None else max(
            1, arrays[0].shape[0] // num_ranks)
        ids_TK = trace_routing(path, num_ranks * tokens, E, K, seed=seed).numpy()
    if ids_TK.shape[0] < num_ranks:
        raise ValueError(f"the trace record has {ids_TK.shape[0]} tokens, fewer than the "
                         f"{num_ranks} ranks; pass tokens_per_rank to resample")
    load = np.zeros((num_ranks, E), dtype=np.int64)
    for s, block in enumerate(np.array_split(ids_TK, num_ranks)):
        load[s] = np.bincount(block.reshape(-1), minlength=E)
    return load, meta


def drift_popularity(num_experts: int, steps: int, max_over_mean: float, phi: float,
                     sigma: float, popularity_seed: int, jitter: float = 0.0) -> np.ndarray:
    """(S, E) float64 expert popularity (each row sums to 1) whose log drifts as an AR(1)
    (issue 30): p_s = w exp(z_s + jitter eta_s) / sum, with w the shuffled Zipf weights of
    :func:`synthetic_loads` (same ``popularity_seed``, so step 0 is exactly that
    popularity when jitter = 0) and z_0 = 0, z_{s+1,e} = phi z_{s,e} + sigma eps_{s,e};
    eps, eta ~ N(0, 1) drawn from ``popularity_seed`` alone (every group of a cluster sees
    the same drift). ``jitter`` is a per-step change that does not persist (a batch's own
    routing beyond the multinomial draw: the fit's excess noise at lag 0).

    phi and sigma are per training step; docs/simulation.md, "Popularity drift" fits
    them to a recorded trace (:func:`lrmoe.workload.drift.fit_ar1`). With phi < 1, z is
    mean-reverting with stationary std sigma / sqrt(1 - phi^2), so the skew wanders
    around (and on average above) the Zipf's instead of growing without bound.

    Raises:
        ValueError: phi outside [0, 1], sigma < 0, or what :func:`zipf_exponent` raises.
    """
    if not 0.0 <= phi <= 1.0:
        raise ValueError(f"drift phi (AR(1) persistence per step) must be in [0, 1], got {phi}")
    if not sigma >= 0.0:
        raise ValueError(f"drift sigma (std of log-popularity's change per step) must be "
                         f">= 0, got {sigma}")
    if not jitter >= 0.0:
        raise ValueError(f"drift jitter (std of log-popularity's non-persistent part) must "
                         f"be >= 0, got {jitter}")
    a = 0.0 if max_over_mean == 1.0 else zipf_exponent(num_experts, max_over_mean)
    w = np.arange(1, num_experts + 1, dtype=np.float64) ** -a
    np.random.default_rng(popularity_seed).shuffle(w)  # as synthetic_loads shuffles p
    eps = np.random.default_rng([popularity_seed, 3]).standard_normal((steps, num_experts))
    # drawn only when asked, so that jitter 0 leaves every other draw as it was
    eta = (jitter * np.random.default_rng([popularity_seed, 4]).standard_normal(
        (steps, num_experts)) if jitter > 0 else np.zeros((steps, num_experts)))
    z = np.zeros(num_experts)
    out = np.empty((steps, num_experts))
    for s in range(steps):
        if s > 0:
            z = phi * z + sigma * eps[s]
        y = z + eta[s]
        q = w * np.exp(y - y.max())  # shifted: the exp cannot overflow
        out[s] = q / q.sum()
    return out


def cluster_loads(num_ranks: int, num_experts: int, tokens_per_rank: int, top_k: int,
                  steps: int, layers: int, max_over_mean: float = 2.0,
                  trace: Optional[str] = None, seed: int = 0, group: int = 0,
                  drift: Optional[Tuple[float, ...]] = None, counts=None,
                  counts_start: int = 0, counts_control: str = "real") -> np.ndarray:
    """(S, Lyr, W, E) int64 routed pairs for a cluster.

    ``counts`` (a counts .npz path or (S_rec, L_rec, E_rec) int array): replay recorded
    popularity, :func:`counts_loads` from recorded step ``counts_start`` (not with
    ``trace`` or ``drift``; ``max_over_mean`` is unused: the recording has its own skew).
    ``counts_control`` (``real``, ``shuffled``, ``frozen``, ``ranked``;
    :func:`counts_popularity`) keeps each step's recorded skew and changes its
    persistence; anything but ``real`` without ``counts`` is refused.

    ``group`` numbers one expert-parallel group of a larger cluster (its data-parallel
    copies route other tokens through the same model): it changes the draws, never a
    layer's popularity, so that every group of one cluster sees the same hot experts.

    Synthetic (``trace`` None): each layer has its own Zipf popularity with the given
    max/mean (hot experts at random ids, fixed over steps), each step a fresh multinomial
    draw of ``tokens_per_rank x top_k`` pairs per source (:func:`lrmoe.planner.
    synthetic_loads`). From a routing trace (``lrmoe train --record-trace``): simulated
    layer l replays recorded layer ``l mod L_rec`` and step s recorded step
    ``s mod S_rec``; that record's tokens are re-sampled with replacement to W x
    tokens_per_rank tokens (the recorded skew at the paper's batch) and dealt to the
    sources in blocks.

    ``drift`` = (phi, sigma) or (phi, sigma, jitter) (synthetic only; None or sigma =
    jitter = 0: off, the fixed popularity above, bit for bit): each layer's popularity
    drifts across steps,
    :func:`drift_popularity` from the layer's popularity seed, so a policy that plans from
    the previous step's loads (SYMI) plans for a popularity that has since moved. A trace
    replays its recorded steps in order, so it carries its own drift already.

    Raises:
        ValueError: non-positive sizes, a trace of another E / top_k, ``drift`` with a
            trace, a bad (phi, sigma), or a ``counts_control`` other than ``real``
            without ``counts``.
    """
    if group < 0:
        raise ValueError(f"group must be >= 0 (an EP group's index), got {group}")
    if min(num_ranks, num_experts, tokens_per_rank, steps, layers) < 1:
        raise ValueError("num_ranks, num_experts, tokens_per_rank, steps and layers must be "
                         f">= 1; got {num_ranks}, {num_experts}, {tokens_per_rank}, {steps}, "
                         f"{layers}")
    if counts is not None:
        if trace is not None or drift is not None:
            raise ValueError("counts replays recorded popularity; pass one of counts, trace "
                             "and drift")
        return counts_loads(counts, num_ranks, num_experts, tokens_per_rank, top_k, steps,
                            layers, counts_start, seed, group, control=counts_control)
    if counts_control != "real":
        raise ValueError(f"counts_control {counts_control!r} changes replayed counts; pass "
                         "counts too")
    out = np.zeros((steps, layers, num_ranks, num_experts), dtype=np.int64)
    if drift is not None and trace is not None:
        raise ValueError("drift is for synthetic loads; a trace replays its recorded steps "
                         "(and their drift) in order: pass one of drift and trace")
    if drift is not None and len(drift) not in (2, 3):
        raise ValueError(f"drift must be (phi, sigma) or (phi, sigma, jitter), got {drift}")
    jitter = float(drift[2]) if drift is not None and len(drift) == 3 else 0.0
    if drift is not None and (drift[1] > 0 or jitter > 0):
        phi, sigma = float(drift[0]), float(drift[1])
        for l in range(layers):
            p_SE = drift_popularity(num_experts, steps, max_over_mean, phi, sigma,
                                    popularity_seed=seed + 104729 * (l + 1), jitter=jitter)
            for s in range(steps):
                # the draw of synthetic_loads (same seed per step, layer and group)
                rng = np.random.default_rng([seed + 7919 * s + l + 1_000_003 * group, 1])
                out[s, l] = rng.multinomial(tokens_per_rank * top_k, p_SE[s], size=num_ranks)
        return out
    if drift is not None:  # sigma 0: no drift; checked like any other
        drift_popularity(num_experts, 1, max_over_mean, float(drift[0]), float(drift[1]),
                         0, jitter)
    if trace is None:
        for s in range(steps):
            for l in range(layers):
                out[s, l] = synthetic_loads(num_ranks, num_experts, tokens_per_rank * top_k,
                                            max_over_mean,
                                            seed=seed + 7919 * s + l + 1_000_003 * group,
                                            popularity_seed=seed + 104729 * (l + 1))
        return out
    meta, arrays = load_trace(trace)
    if int(meta["num_experts"]) != num_experts or int(meta["top_k"]) != top_k:
        raise ValueError(f"trace {trace} has E={meta['num_experts']}, top_k={meta['top_k']}; "
                         f"the simulated model has E={num_experts}, top_k={top_k}")
    rec_layers = list(meta["layers"])
    rec_steps = len(arrays) // len(rec_layers)
    rng = np.random.default_rng([seed, group] if group else seed)
    n = num_ranks * tokens_per_rank
    for s in range(steps):
        for l in range(layers):
            ids = arrays[(s % rec_steps) * len(rec_layers) + l % len(rec_layers)]
            pick = ids[rng.integers(0, ids.shape[0], size=n)]
            for w, block in enumerate(pick.reshape(num_ranks, tokens_per_rank, -1)):
                out[s, l, w] = np.bincount(block.reshape(-1), minlength=num_experts)
    return out


#: ``control`` of :func:`counts_popularity`: the replay and its matched-skew controls
COUNTS_CONTROLS = ("real", "shuffled", "frozen", "ranked")


def counts_popularity(counts, num_experts: int, steps: int, layers: int,
                      start: int = 0, flag: str = "counts", control: str = "real",
                      seed: int = 0) -> np.ndarray:
    """(S, Lyr, E) float64 popularity replayed from recorded routed counts (issue 30).

    ``counts`` is a counts .npz (``count_SLE``, experiments/trace_drift.py --counts) or an
    int (S_rec, L_rec, E_rec) array. Simulated step s takes recorded step ``start + s``
    (no wrap-around: wrapping would insert a jump that training never made), layer l
    recorded layer ``l mod L_rec``; each row is the counts over their sum. When
    E = r x E_rec, recorded expert e becomes experts r e .. r e + r - 1, each with p_e / r
    (contiguous, so under fixed ownership e / (E / W) every rank carries the recorded
    model's rank loads at EP W); any other E is refused.

    ``control`` separates the recording's skew from its persistence (which recorded
    experts stay hot from step to step, what SYMI's one-step lag pays for). Each acts on
    the recorded counts of one (step, layer), over the E_rec recorded experts, before
    the split, so the r children of a recorded expert stay contiguous as in the replay:

    * ``real``: the recording as it is (the replay).
    * ``shuffled``: each (step, layer)'s counts permuted over the recorded expert ids,
      independently per step and layer (``np.random.default_rng([seed, l, s, 6])``, l
      the simulated layer, s the simulated step): every step keeps the real step's load
      multiset, but which expert is hot is redrawn every step (no persistence).
    * ``frozen``: recorded step ``start`` repeated for every simulated step (each layer
      its own): the skew of one real step and full persistence (a fixed popularity).
    * ``ranked``: every step's own counts, sorted and handed out in the order of step
      ``start``'s ranking (its hottest expert gets the step's largest count; ties by
      expert id): each step's real load multiset, with the ranking held fixed.

    Raises:
        ValueError: a file that is not a counts npz, wrong shapes or negative counts, a
            (step, layer) with no pairs, an out-of-range window, an E that is not a
            multiple of E_rec, or an unknown ``control`` (each naming ``flag``).
        FileNotFoundError: no file at ``counts``.
    """
    if control not in COUNTS_CONTROLS:
        raise ValueError(f"{flag}: unknown counts control {control!r}; pick one of "
                         f"{', '.join(COUNTS_CONTROLS)}")
    if isinstance(counts, (str, os.PathLike)):
        if not os.path.isfile(counts):
            raise FileNotFoundError(f"{flag} {counts}: no such file")
        try:
            with np.load(counts) as d:
                c = np.asarray(d["count_SLE"])
        except (KeyError, ValueError, OSError) as err:
            raise ValueError(f"{flag} {counts}: not a counts .npz with count_SLE (write one "
                             f"with experiments/trace_drift.py --counts): {err}") from None
    else:
        c = np.asarray(counts)
    if c.ndim != 3 or min(c.shape) < 1 or not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"{flag}: need integer counts of shape (steps, layers, experts), got "
                         f"{c.dtype} {c.shape}")
    c = c.astype(np.int64)
    if (c < 0).any():
        raise ValueError(f"{flag}: counts must be >= 0")
    S_rec, L_rec, E_rec = c.shape
    if num_experts % E_rec:
        raise ValueError(f"{flag}: the recording has {E_rec} experts and the simulated model "
                         f"{num_experts}; E must be a multiple of {E_rec} (each recorded "
                         "expert is split evenly), or record a model with that E")
    if not (0 <= start and start + steps <= S_rec):
        raise ValueError(f"{flag}: steps {start}..{start + steps - 1} are outside the "
                         f"{S_rec} recorded steps; pick a start in [0, {S_rec - steps}] or "
                         "fewer --steps")
    w = c[start:start + steps][:, np.arange(layers) % L_rec].astype(np.float64)
    tot = w.sum(axis=2, keepdims=True)
    if (tot == 0).any():
        raise ValueError(f"{flag}: a recorded (step, layer) has no routed pairs")
    if control == "frozen":
        w = np.repeat(w[:1], steps, axis=0)
    elif control == "ranked":
        # step start's experts by falling count (stable: ties by id), per layer
        order = np.argsort(-w[0], axis=1, kind="stable")  # (Lyr, E_rec)
        srt = -np.sort(-w, axis=2)  # each step's counts, largest first
        out = np.empty_like(w)
        for l in range(layers):
            out[:, l, order[l]] = srt[:, l]
        w = out
    elif control == "shuffled":
        w = w.copy()
        for s in range(steps):
            for l in range(layers):
                w[s, l] = w[s, l, np.random.default_rng([seed, l, s, 6]).permutation(E_rec)]
    tot = w.sum(axis=2, keepdims=True)
    r = num_experts // E_rec
    return np.repeat(w / tot / r, r, axis=2)


def counts_loads(counts, num_ranks: int, num_experts: int, tokens_per_rank: int,
                 top_k: int, steps: int, layers: int, start: int = 0, seed: int = 0,
                 group: int = 0, flag: str = "counts", control: str = "real") -> np.ndarray:
    """(S, Lyr, W, E) int64 routed pairs drawn from recorded popularity
    (:func:`counts_popularity`, its ``control`` too; a shuffle is seeded by ``seed``, not
    ``group``): each source rank draws ``tokens_per_rank x top_k`` pairs, multinomial,
    seeded per (step, layer, group) as the synthetic path, so DP groups see the same
    popularity through other draws.

    Raises:
        ValueError / FileNotFoundError: what :func:`counts_popularity` raises.
    """
    p = counts_popularity(counts, num_experts, steps, layers, start, flag, control, seed)
    out = np.empty((steps, layers, num_ranks, num_experts), dtype=np.int64)
    for s in range(steps):
        for l in range(layers):
            rng = np.random.default_rng([seed + 7919 * s + l + 1_000_003 * group, 1])
            out[s, l] = rng.multinomial(tokens_per_rank * top_k, p[s, l], size=num_ranks)
    return out
