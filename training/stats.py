"""Aggregate statistics over seeds and tasks (pure numpy).

Follows the recommendations of Agarwal et al. (2021), "Deep Reinforcement
Learning at the Edge of the Statistical Precipice" (the ``rliable`` library):
interquartile mean as a robust point estimate and (stratified) percentile
bootstrap confidence intervals.

A ``statistic`` here is any function ``f(x, axis=...)`` that reduces ``x``
along ``axis`` (``np.mean``, ``np.median`` and :func:`iqm` all qualify); this
lets every bootstrap resample be evaluated in one vectorised call.
"""

import numpy as np


def _percentile_interval(boots, ci):
    """Return the central ``ci`` percentile interval of bootstrap estimates."""
    if not 0.0 < ci <= 1.0:
        raise ValueError(f"ci must be in (0, 1], got {ci}")
    tail = 100.0 * (1.0 - ci) / 2.0
    low, high = np.percentile(boots, [tail, 100.0 - tail])
    return float(low), float(high)


def bootstrap_ci(values, n_boot=2000, ci=0.95, rng=None, statistic=np.mean):
    """Percentile bootstrap confidence interval of ``statistic`` over seeds.

    Args:
        values: 1-D array of per-seed values.
        n_boot: number of bootstrap resamples.
        ci: coverage of the interval, in (0, 1].
        rng: ``np.random.Generator``, integer seed or None.
        statistic: reduction ``f(x, axis=...)``.

    Returns:
        ``(point, low, high)`` where ``point = statistic(values)``. With a
        single value the interval collapses to ``(v, v, v)``.
    """
    values = np.asarray(values, dtype=float)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"values must be a non-empty 1-D array, got shape {values.shape}")
    point = float(statistic(values, axis=0))
    if values.size == 1:
        return point, point, point
    rng = np.random.default_rng(rng)
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    boots = statistic(values[idx], axis=1)
    low, high = _percentile_interval(boots, ci)
    return point, low, high


def iqm(values, axis=None):
    """Interquartile mean: mean of the middle 50% of ``values``.

    Same semantics as ``scipy.stats.trim_mean(values, 0.25, axis)`` (used by
    rliable): after sorting, ``int(0.25 * n)`` values are cut from each end.
    With ``axis=None`` the array is flattened first.
    """
    values = np.asarray(values, dtype=float)
    if axis is None:
        values, axis = values.reshape(-1), 0
    n = values.shape[axis]
    if n == 0:
        raise ValueError("iqm of an empty array")
    cut = int(0.25 * n)
    middle = np.take(np.sort(values, axis=axis), np.arange(cut, n - cut), axis=axis)
    return np.mean(middle, axis=axis)


def stratified_bootstrap_ci(scores, statistic=iqm, n_boot=2000, ci=0.95, rng=None):
    """Stratified percentile bootstrap CI of an aggregate over runs and tasks.

    Runs are resampled with replacement independently within each task (the
    stratified bootstrap of rliable), and ``statistic`` is applied to each
    flattened resampled score matrix.

    Args:
        scores: array shaped ``(runs, tasks)``.
        statistic: reduction ``f(x, axis=...)`` applied to flattened scores.
        n_boot: number of bootstrap resamples.
        ci: coverage of the interval, in (0, 1].
        rng: ``np.random.Generator``, integer seed or None.

    Returns:
        ``(point, low, high)`` where ``point = statistic(scores.ravel())``.
    """
    scores = np.asarray(scores, dtype=float)
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(f"scores must be a non-empty (runs, tasks) array, got shape {scores.shape}")
    runs, tasks = scores.shape
    point = float(statistic(scores.reshape(-1), axis=0))
    rng = np.random.default_rng(rng)
    run_idx = rng.integers(0, runs, size=(n_boot, runs, tasks))
    resampled = scores[run_idx, np.arange(tasks)]
    boots = statistic(resampled.reshape(n_boot, runs * tasks), axis=1)
    low, high = _percentile_interval(boots, ci)
    return point, low, high
