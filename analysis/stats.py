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


# ---- aggregates over tasks with per-task run lists (Agarwal et al. 2021, Sec. 4 and App. A) -----------
#
# ``tasks`` is a list with one 1-D array of (normalised) run scores per task; tasks may hold different
# numbers of runs.  For a rectangular (runs, tasks) matrix every function below equals rliable's
# definition: IQM and the optimality gap over all run-task scores, mean and median of the per-task
# mean scores.  With ragged tasks IQM pools all run-task scores, the others weight tasks equally.
# Each ``*_of`` takes resampled tasks shaped (n_boot, runs_t) and returns (n_boot,).


def iqm_of(tasks):
    """Interquartile mean of all run-task scores (rliable ``aggregate_iqm``)."""
    return iqm(np.concatenate(tasks, axis=-1), axis=-1)


def mean_of(tasks):
    """Mean over tasks of the mean score per task (rliable ``aggregate_mean``)."""
    return np.mean(np.stack([t.mean(axis=-1) for t in tasks], axis=-1), axis=-1)


def median_of(tasks):
    """Median over tasks of the mean score per task (rliable ``aggregate_median``)."""
    return np.median(np.stack([t.mean(axis=-1) for t in tasks], axis=-1), axis=-1)


def optimality_gap_of(tasks, gamma: float = 1.0):
    """How far scores fall short of ``gamma``: the mean of max(gamma - score, 0) (rliable
    ``aggregate_optimality_gap``; per task, then over tasks)."""
    return np.mean(np.stack([np.maximum(gamma - t, 0.0).mean(axis=-1) for t in tasks], axis=-1), axis=-1)


AGGREGATES = {"IQM": iqm_of, "mean": mean_of, "median": median_of, "optimality gap": optimality_gap_of}


def _as_tasks(tasks):
    out = [np.asarray(t, dtype=float).reshape(-1) for t in tasks]
    if not out or any(t.size == 0 for t in out):
        raise ValueError("every task needs at least one run score")
    return out


def _resample(tasks, n_boot, rng):
    """Runs drawn with replacement within each task (the stratified bootstrap): (n_boot, runs_t) per task."""
    return [t[rng.integers(0, t.size, size=(n_boot, t.size))] for t in tasks]


def stratified_interval(tasks, statistic, n_boot=2000, ci=0.95, rng=None):
    """``(point, low, high)`` of ``statistic(tasks)`` with a stratified percentile bootstrap interval."""
    tasks = _as_tasks(tasks)
    point = float(np.asarray(statistic([t[None] for t in tasks]))[0])
    boots = statistic(_resample(tasks, n_boot, np.random.default_rng(rng)))
    low, high = _percentile_interval(boots, ci)
    return point, low, high


def score_distribution(tasks, taus):
    """Performance profile: for each threshold tau, the share of runs scoring above tau, averaged over
    tasks (rliable ``run_score_distribution``).  ``tasks`` as above, or resampled (n_boot, runs_t)."""
    taus = np.asarray(taus, dtype=float)
    return np.mean(np.stack([(t[..., None] > taus).mean(axis=-2) for t in tasks], axis=0), axis=0)


def performance_profile(tasks, taus, n_boot=2000, ci=0.95, rng=None):
    """``(profile, low, high)`` over ``taus``, with a pointwise stratified bootstrap interval."""
    tasks = _as_tasks(tasks)
    point = score_distribution(tasks, taus)
    boots = score_distribution(_resample(tasks, n_boot, np.random.default_rng(rng)), taus)
    tail = 100.0 * (1.0 - ci) / 2.0
    low, high = np.percentile(boots, [tail, 100.0 - tail], axis=0)
    return point, low, high


def _p_greater(x, y):
    """P(X > Y) + P(X = Y) / 2 for run scores x (..., n) and y (..., m): the Mann-Whitney U statistic / (n m)."""
    d = x[..., :, None] - y[..., None, :]
    return np.mean((d > 0) + 0.5 * (d == 0), axis=(-2, -1))


def probability_of_improvement(x_tasks, y_tasks, n_boot=2000, ci=0.95, rng=None):
    """``(point, low, high)``: the probability that a run of X beats a run of Y on a task, averaged
    over tasks (Agarwal et al. 2021, Sec. 4.3; rliable ``probability_of_improvement``), with X's and Y's
    runs resampled independently within each task."""
    x_tasks, y_tasks = _as_tasks(x_tasks), _as_tasks(y_tasks)
    if len(x_tasks) != len(y_tasks):
        raise ValueError(f"X has {len(x_tasks)} tasks and Y {len(y_tasks)}")
    point = float(np.mean([_p_greater(x, y) for x, y in zip(x_tasks, y_tasks)]))
    rng = np.random.default_rng(rng)
    xb, yb = _resample(x_tasks, n_boot, rng), _resample(y_tasks, n_boot, rng)
    boots = np.mean(np.stack([_p_greater(x, y) for x, y in zip(xb, yb)], axis=0), axis=0)
    low, high = _percentile_interval(boots, ci)
    return point, low, high
