"""Popularity drift of routed experts across training steps (issue 30): per-step expert
counts from a routing trace, how far the normalised loads move from step t to t + d, and
an AR(1) fit of log-popularity that the simulator's load generator replays
(:func:`lrmoe.workload.loads.cluster_loads` with ``drift``).

Legend: S recorded steps, Lyr MoE layers, E experts, ``count_SLE`` routed (token, expert)
pairs per (step, layer, expert); p = count / sum over experts (the normalised load).
"""
from __future__ import annotations

import json
import os
from typing import Dict, Sequence, Tuple

import numpy as np

from lrmoe.workload.trace import load_trace


def trace_counts(path: os.PathLike) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-(step, layer) expert counts of a routing trace (``lrmoe train --record-trace``).

    Returns:
        (steps_S int64 recorded optimizer steps, layers_L int64, count_SLE int64).

    Raises:
        FileNotFoundError / ValueError: from :func:`lrmoe.workload.trace.load_trace`;
            ValueError when some (step, layer) record is missing.
    """
    meta, arrays = load_trace(path)
    steps, layers, E = list(meta["steps"]), list(meta["layers"]), int(meta["num_experts"])
    if len(arrays) != len(steps) * len(layers):
        raise ValueError(f"trace {path}: {len(arrays)} records, expected steps x layers = "
                         f"{len(steps)} x {len(layers)}")
    count = np.stack([np.bincount(a.reshape(-1), minlength=E) for a in arrays])
    return (np.asarray(steps, np.int64), np.asarray(layers, np.int64),
            count.reshape(len(steps), len(layers), E).astype(np.int64))


def _normalise(count_SLE: np.ndarray) -> np.ndarray:
    c = np.asarray(count_SLE, dtype=np.float64)
    if c.ndim != 3:
        raise ValueError(f"count_SLE must be 3-D (steps, layers, experts), got {c.shape}")
    if (c < 0).any():
        raise ValueError("count_SLE must be non-negative counts")
    tot = c.sum(axis=2, keepdims=True)
    if (tot <= 0).any():
        raise ValueError("count_SLE has a (step, layer) with no routed pairs")
    return c / tot


def tv_distance(count_SLE: np.ndarray, lag: int) -> np.ndarray:
    """(S - lag, Lyr) total-variation distance 0.5 sum_e |p_{t+lag,e} - p_{t,e}| between the
    normalised loads of steps t and t + lag (0: identical, 1: disjoint experts).

    Raises:
        ValueError: lag outside [1, S), or counts that are not (S, Lyr, E) non-negative
            with a positive total per (step, layer).
    """
    p = _normalise(count_SLE)
    if not 1 <= lag < p.shape[0]:
        raise ValueError(f"lag must be in [1, S={p.shape[0]}), got {lag}")
    return 0.5 * np.abs(p[lag:] - p[:-lag]).sum(axis=2)


def log_popularity(count_SLE: np.ndarray, pseudo: float = 0.5) -> np.ndarray:
    """(S, Lyr, E) log((count + pseudo) / (total + E pseudo)) minus its mean over experts:
    log-popularity relative to the layer's geometric mean (the pseudo-count keeps an
    expert with no pairs finite; 0.5 is the Jeffreys prior's)."""
    c = np.asarray(count_SLE, dtype=np.float64) + pseudo
    x = np.log(c / c.sum(axis=2, keepdims=True))
    return x - x.mean(axis=2, keepdims=True)


def lag_correlation(count_SLE: np.ndarray, lag: int = 1) -> np.ndarray:
    """(S - lag, Lyr) Pearson correlation over experts of log-popularity at t and t + lag
    (1: the same ranking and spread; near 0: unrelated).

    Raises:
        ValueError: lag outside [1, S).
    """
    x = log_popularity(count_SLE)
    if not 1 <= lag < x.shape[0]:
        raise ValueError(f"lag must be in [1, S={x.shape[0]}), got {lag}")
    a, b = x[:-lag], x[lag:]  # already centred over experts
    num = (a * b).sum(axis=2)
    den = np.sqrt((a * a).sum(axis=2) * (b * b).sum(axis=2))
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)


def sampling_tv(count_SLE: np.ndarray, draws: int = 20, seed: int = 0) -> np.ndarray:
    """(S, Lyr) expected TV distance between two independent multinomial draws of the
    recorded pair count from the step's *own* normalised load (Monte Carlo, ``draws``
    pairs): the noise floor a fixed popularity would show at this batch size. Pairs are
    drawn independently, so the floor is a little above the real one (a token's K experts
    are distinct)."""
    p = _normalise(count_SLE)
    n = np.asarray(count_SLE).sum(axis=2)
    rng = np.random.default_rng(seed)
    out = np.zeros(n.shape)
    for s in range(p.shape[0]):
        for l in range(p.shape[1]):
            a = rng.multinomial(n[s, l], p[s, l], size=draws)
            b = rng.multinomial(n[s, l], p[s, l], size=draws)
            out[s, l] = 0.5 * np.abs(a - b).sum(axis=1).mean() / n[s, l]
    return out


def fit_ar1(count_SLE: np.ndarray, max_lag: int = 8, min_count: float = 32.0) -> Dict[str, float]:
    """AR(1) fit of log-popularity with sampling noise, pooled over layers and experts.

    Model: y_{t,e} = x_{t,e} + n_{t,e}, with x_{t+1,e} - mu_e = phi (x_{t,e} - mu_e) +
    sigma eps (eps ~ N(0, 1)) and n the sampling noise of the count (variance ~ 1/count by
    the delta method, independent across steps). Its autocovariance over steps, per expert
    about its own mean mu_e over the window, is gamma_d = v phi^d for d >= 1 with the
    stationary variance v = sigma^2 / (1 - phi^2); the noise adds to gamma_0 only. So phi
    and v come from a least-squares line through log gamma_d, d = 1..max_lag (lags with
    gamma_d <= 0 are left out), sigma = sqrt(v (1 - phi^2)) and the noise variance is
    gamma_0 - v, set beside the delta-method prediction mean(1 / count).

    Only (layer, expert) series whose mean count over the window is >= ``min_count``
    enter: the log of a near-empty expert's count is mostly sampling noise (the delta
    method fails near 0), and the hot experts are the ones a placement plans for.

    Returns:
        dict: phi, sigma (per-step std of the innovation of log-popularity), v, noise_var,
        noise_var_predicted, jitter = sqrt(max(0, noise_var - noise_var_predicted)) (the
        std of a change that does not persist beyond the sampling noise: a batch's own
        routing), lags_used, series (the (layer, expert) pairs used), gamma
        (list, d = 0..max_lag).

    Raises:
        ValueError: fewer than max_lag + 2 steps, max_lag < 2, or no series with a mean
            count >= min_count (lower ``min_count``).
    """
    c = np.asarray(count_SLE)
    S = c.shape[0]
    if max_lag < 2 or S < max_lag + 2:
        raise ValueError(f"fit_ar1 needs max_lag >= 2 and at least max_lag + 2 steps; got "
                         f"max_lag {max_lag}, {S} steps")
    keep = c.mean(axis=0) >= min_count  # (Lyr, E)
    if not keep.any():
        raise ValueError(f"fit_ar1: no (layer, expert) has a mean count >= min_count "
                         f"{min_count}; lower min_count")
    x = log_popularity(c)
    x = (x - x.mean(axis=0, keepdims=True))[:, keep]  # about each series' own mean
    c = c[:, keep]
    gamma = np.array([(x[d:] * x[:S - d]).mean() for d in range(max_lag + 1)])
    d = np.arange(1, max_lag + 1)
    ok = gamma[1:] > 0
    if ok.sum() < 2:
        raise ValueError("fit_ar1: fewer than 2 positive autocovariances; the popularity "
                         "does not persist across steps (no AR(1) fit)")
    slope, icpt = np.polyfit(d[ok], np.log(gamma[1:][ok]), 1)
    phi = float(min(np.exp(slope), 1.0 - 1e-9))
    v = float(np.exp(icpt))
    noise, predicted = float(gamma[0] - v), float((1.0 / (c + 0.5)).mean())
    return dict(phi=phi, sigma=float(np.sqrt(v * (1 - phi * phi))), v=v,
                noise_var=noise, noise_var_predicted=predicted,
                jitter=float(np.sqrt(max(0.0, noise - predicted))),
                lags_used=int(ok.sum()), series=int(keep.sum()), gamma=[float(g) for g in gamma])


def drift_summary(count_SLE: np.ndarray, steps_S: Sequence[int],
                  windows: Sequence[Tuple[int, int]], lags: Sequence[int] = (1, 5, 20),
                  seed: int = 0, min_count: float = 32.0) -> dict:
    """Per window [a, b) of recorded-step indices and per layer: mean TV at each lag (lags
    not shorter than the window are left out), the sampling floor of TV
    (:func:`sampling_tv`), mean lag-1 correlation of log-popularity and the mean max/mean
    load; plus an AR(1) fit per window (:func:`fit_ar1` with ``min_count``)."""
    out = {}
    floor = sampling_tv(count_SLE, seed=seed)
    p = _normalise(count_SLE)
    for a, b in windows:
        c = count_SLE[a:b]
        w = dict(steps=[int(steps_S[a]), int(steps_S[b - 1])], layers=[])
        for l in range(c.shape[1]):
            cl = c[:, l:l + 1]
            row = {f"tv_lag{d}": float(tv_distance(cl, d).mean()) for d in lags if d < len(cl)}
            row["tv_floor"] = float(floor[a:b, l].mean())
            row["corr_lag1"] = float(lag_correlation(cl, 1).mean())
            row["max_over_mean"] = float((p[a:b, l].max(axis=1) * p.shape[2]).mean())
            w["layers"].append(row)
        w["ar1"] = fit_ar1(c, min_count=min_count)
        out[f"{a}-{b}"] = w
    return out


def load_fit(path: os.PathLike) -> Tuple[float, float, float]:
    """(phi, sigma, jitter) from a fit file written by ``experiments/trace_drift.py`` (its
    ``"fit"``; jitter 0 when absent).

    Raises:
        FileNotFoundError: no file. ValueError: no ``fit`` with phi and sigma.
    """
    with open(path) as f:
        d = json.load(f)
    fit = d.get("fit", {})
    if "phi" not in fit or "sigma" not in fit:
        raise ValueError(f"{path}: no 'fit' with phi and sigma (write it with "
                         "experiments/trace_drift.py)")
    return float(fit["phi"]), float(fit["sigma"]), float(fit.get("jitter", 0.0))
