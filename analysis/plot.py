"""Learning curves of run directories: mean over seeds with 95% bootstrap intervals, and the final values.

From Python (a notebook)::

    from plasticity_zoo.analysis import plot

    fig = plot.learning_curves(["runs/a", "runs/b"], metrics=["plasticity/critic/dormant*"])  # a Figure
    print(plot.final_table(["runs/a", "runs/b"]))          # final value, seeds and 95% CI per (env, label)
    plot.save_figure(["runs/a", "runs/b"], "fig.png")      # both: writes the figure, returns the table

``scripts/plot.py`` is their command line.  A run that cannot be drawn (a missing file or column,
runs on different evaluation grids, an empty curve) raises ``PlotError`` (a ValueError) naming the
path; the command line prints it as one ``error:`` line.

Each run directory holds ``config.json`` (keys ``agent_name``, ``env`` and optional ``label``),
``eval.csv`` and, for ``metrics``, ``metrics.csv``; both CSVs have one row per (step, seed).  Curves
are grouped by environment (one subplot column each) and by label: ``config["label"]`` (``--label``),
else the agent's name followed by the settings in which the runs given differ (``sac
plasticity.redo=true``: ``analysis.aggregate.run_labels``); seeds of run directories sharing (env,
label) are pooled, so runs pool only when their configs match but for the seed and how they were
logged.  Every curve is the mean over seeds with a shaded 95% percentile-bootstrap confidence
interval.  Metric names may be glob patterns (``plasticity/critic/dormant*``); each matching column
gets its own line.  The table of final values is unsmoothed.

Pooled runs must share their evaluation (and, for ``metrics``, log) steps where they overlap; a run
may end earlier (the pooled curve then ends at the last step all runs reached).  Runs evaluated on
different grids (another ``--eval-every``) are refused with a message, or with ``align`` every
seed's curve is linearly interpolated onto all their steps within the span they share.  A CSV whose
steps go back (two runs appended to one file) is refused.  Nothing is saved when a curve would be
empty.

Multitask (``mt:``) runs have a ``task`` column in ``eval.csv``: one row per task per (step, seed)
and an aggregate row ``task == all`` (the mean over tasks; its ``score`` column, ``y="score"``, is
the mean over tasks of return / task maximum).  Their curve is the aggregate; ``per_task`` draws,
per env, the aggregate panel and one panel per task (each the mean and interval over seeds), in a
grid of panels with the ``metrics`` panels after them, and the table has a row per task.
"""

from __future__ import annotations

import csv
import fnmatch
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from plasticity_zoo.analysis import stats
from plasticity_zoo.analysis.aggregate import run_labels
from plasticity_zoo.training.logger import AGGREGATE_TASK  # a multitask run's aggregate rows: task == all

N_BOOT = 2000
CI = 0.95
BOOT_SEED = 0
INDEX_COLUMNS = ("step", "seed")
TASK_COLUMN = "task"  # training/logger.py: a multitask run's eval.csv
DPI = 120
LINESTYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Run:
    """One loaded run directory: its grouping keys and raw CSV tables.

    ``eval``: the evaluation table (a multitask run's aggregate rows, ``task == all``);
    ``by_task``: a multitask run's rows of each task, ``{task: table}`` in file order (else empty)."""

    path: Path
    env: str
    label: str
    eval: dict
    metrics: dict | None
    by_task: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Aggregate:
    """Mean and bootstrap CI across seeds at each step."""

    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    n_seeds: np.ndarray


class PlotError(ValueError):
    """Runs that cannot be drawn; the message names the offending path."""


def fail(path, message):
    """Refuse with a message that names the offending path."""
    raise PlotError(f"{path}: {message}")


def read_config(path):
    """Read ``config.json`` and check it names an agent and an env."""
    if not path.is_file():
        fail(path, "missing config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        fail(path, f"malformed JSON ({err})")
    if not isinstance(config, dict):
        fail(path, "expected a JSON object")
    for key in ("agent_name", "env"):
        if not isinstance(config.get(key), str):
            fail(path, f"missing string key {key!r}")
    return config


def read_csv(path):
    """Read a run CSV into ``{column: [cell, ...]}`` (cells kept as strings)."""
    if not path.is_file():
        fail(path, f"missing {path.name}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        rows = list(reader)
    if not header:
        fail(path, "empty file (no header)")
    missing = [c for c in INDEX_COLUMNS if c not in header]
    if missing:
        fail(path, f"header lacks column(s) {missing}")
    if not rows:
        fail(path, "has no rows")
    for line, row in enumerate(rows, start=2):
        if None in row or None in row.values():
            fail(path, f"line {line}: expected {len(header)} fields")
    return {name: [row[name] for row in rows] for name in header}


def numeric_column(table, name, path):
    """Return column ``name`` as floats, empty cells as NaN."""
    if name not in table:
        fail(path, f"no column {name!r}")
    try:
        return np.array([float(cell) if cell.strip() else np.nan for cell in table[name]])
    except ValueError as err:
        fail(path, f"column {name!r}: {err}")


def load_runs(run_dirs, with_metrics=False) -> list[Run]:
    """Load every run directory, each labelled among the others (``run_labels``)."""
    paths = [Path(d) for d in run_dirs]
    configs = [read_config(_run_dir(d) / "config.json") for d in paths]
    return [load_run(d, with_metrics, label) for d, label in zip(paths, run_labels(configs))]


def _run_dir(run_dir) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        fail(run_dir, "not a directory")
    return run_dir


def load_run(run_dir, with_metrics=False, label=None) -> Run:
    """Load config, eval.csv and (optionally) metrics.csv of one run dir (``label``: default the run's
    own, ``run_labels`` of it alone)."""
    run_dir = _run_dir(run_dir)
    config = read_config(run_dir / "config.json")
    label = label if label is not None else run_labels([config])[0]
    eval_table = read_csv(run_dir / "eval.csv")
    by_task = split_tasks(eval_table, run_dir / "eval.csv")
    if by_task:
        eval_table = by_task.pop(AGGREGATE_TASK)
    metrics = read_csv(run_dir / "metrics.csv") if with_metrics else None
    return Run(run_dir, config["env"], str(label), eval_table, metrics, by_task)


def split_tasks(table, path):
    """A multitask eval table (a ``task`` column) split into ``{task: table}`` in file order, the
    aggregate ``all`` among them; empty for a single-task table."""
    if TASK_COLUMN not in table:
        return {}
    tasks = list(dict.fromkeys(table[TASK_COLUMN]))
    if AGGREGATE_TASK not in tasks:
        fail(path, f"has a {TASK_COLUMN!r} column but no aggregate rows ({TASK_COLUMN} == {AGGREGATE_TASK})")
    return {
        task: {name: [cell for cell, t in zip(cells, table[TASK_COLUMN]) if t == task] for name, cells in table.items()}
        for task in tasks
    }


def seed_curves(table, column, path):
    """Split ``column`` of a run table into one ``{step: value}`` per seed.

    Missing (NaN) values are dropped; a repeated step keeps its last value.  A seed whose steps go
    back is refused: the file holds more than one run.
    """
    steps = numeric_column(table, "step", path)
    seeds = numeric_column(table, "seed", path)
    values = numeric_column(table, column, path)
    if np.isnan(steps).any() or np.isnan(seeds).any():
        fail(path, "empty 'step' or 'seed' cell")
    curves, last = {}, {}
    for line, (step, seed, value) in enumerate(zip(steps, seeds, values), start=2):
        if step < last.get(seed, -np.inf):
            fail(
                path,
                f"line {line}: seed {int(seed)} goes back from step {int(last[seed])} to {int(step)}; "
                "the file holds more than one run",
            )
        last[seed] = step
        curve = curves.setdefault(seed, {})
        if np.isfinite(value):
            curve[int(step)] = float(value)
    return list(curves.values())


def step_grid(table, path):
    """The steps a run table has rows at (whatever their values)."""
    return {int(s) for s in numeric_column(table, "step", path) if np.isfinite(s)}


def check_grids(runs, table_name):
    """The steps to align pooled runs onto, or None if their grids agree where they overlap.

    Grids agree when every step a run has inside the span all runs cover is a step of every run
    (a run's own last step excepted: a shorter run's final evaluation).  Otherwise -> the steps of
    all runs within that span (empty if the spans do not overlap)."""
    grids = [step_grid(getattr(run, table_name), run.path / f"{table_name}.csv") for run in runs]
    lo, hi = max(min(g) for g in grids), min(max(g) for g in grids)
    common = set.intersection(*grids)
    within = sorted({s for g in grids for s in g if lo <= s <= hi})
    if lo <= hi and all(s in common for g in grids for s in g if lo <= s <= hi and s != max(g)):
        return None
    return within


def describe_grids(runs, table_name):
    """``path: N steps from A to B (every D)`` for each run, for a refusal."""
    out = []
    for run in runs:
        g = sorted(step_grid(getattr(run, table_name), run.path / f"{table_name}.csv"))
        gap = f", every {int(np.median(np.diff(g)))}" if len(g) > 1 else ""
        out.append(f"{run.path}: {len(g)} steps from {g[0]} to {g[-1]}{gap}")
    return "; ".join(out)


def interpolate(curve, steps):
    """``curve`` linearly interpolated at ``steps`` (those within the curve's own first and last step)."""
    if not curve:
        return {}
    xs = np.array(sorted(curve), dtype=float)
    ys = np.array([curve[int(x)] for x in xs])
    inside = [s for s in steps if xs[0] <= s <= xs[-1]]
    return dict(zip(inside, np.interp(inside, xs, ys).tolist()))


def smooth(curve, k):
    """Trailing moving average over the last ``k`` points of a curve."""
    if k <= 1 or not curve:
        return curve
    steps = sorted(curve)
    values = np.array([curve[s] for s in steps])
    csum = np.concatenate([[0.0], np.cumsum(values)])
    end = np.arange(1, len(values) + 1)
    start = np.maximum(0, end - k)
    return dict(zip(steps, (csum[end] - csum[start]) / (end - start)))


def aggregate(curves):
    """Mean and 95% bootstrap CI across seed curves at each step.

    Uses the steps present in every curve; if there are none, the steps
    present in at least one curve, each over the seeds that have it.
    """
    step_sets = [set(c) for c in curves]
    steps = set.intersection(*step_sets) or set.union(*step_sets)
    rng = np.random.default_rng(BOOT_SEED)
    rows = []
    for step in sorted(steps):
        values = [c[step] for c in curves if step in c]
        rows.append((step, *stats.bootstrap_ci(values, N_BOOT, CI, rng), len(values)))
    columns = np.array(rows, dtype=float).reshape(-1, 5).T
    return Aggregate(*columns)


def group_runs(runs):
    """Group runs as ``{env: {label: [Run, ...]}}`` keeping first-seen order."""
    groups = {}
    for run in runs:
        groups.setdefault(run.env, {}).setdefault(run.label, []).append(run)
    return groups


def group_curves(runs, column, table_name, k=1, align=False):
    """Pool (smoothed) seed curves of ``column`` over runs; seeds stay per run.

    Runs on different step grids are refused, or with ``align`` interpolated (``check_grids``)."""
    curves = [
        smooth(curve, k)
        for run in runs
        for curve in seed_curves(getattr(run, table_name), column, run.path / f"{table_name}.csv")
    ]
    steps = check_grids(runs, table_name) if len(runs) > 1 else None
    if steps is None:
        return curves
    what = "evaluated" if table_name == "eval" else "logged"
    paths = ", ".join(str(run.path) for run in runs)
    if not align:
        fail(
            paths,
            f"runs pooled under one (env, label) were {what} at different steps "
            f"({describe_grids(runs, table_name)}), so few or none of their steps are shared; "
            "plot them separately, give them different labels (config.json 'label', --label when "
            "training), or pass --align to interpolate every seed onto their steps",
        )
    if not steps:
        fail(
            paths,
            f"runs pooled under one (env, label) were {what} over step ranges that do not overlap "
            f"({describe_grids(runs, table_name)}): nothing to align",
        )
    return [interpolate(curve, steps) for curve in curves]


def group_aggregate(runs, column, table_name, k=1, align=False):
    """``aggregate`` of ``group_curves``, refusing a curve without a single value."""
    agg = aggregate(group_curves(runs, column, table_name, k, align))
    if agg.steps.size == 0:
        fail(", ".join(str(r.path) for r in runs), f"no values in column {column!r} of {table_name}.csv")
    return agg


def expand_metric(pattern, runs):
    """Metric columns matching ``pattern``; every run must have them all."""
    matched = set()
    for run in runs:
        columns = [c for c in run.metrics if c not in INDEX_COLUMNS]
        hits = fnmatch.filter(columns, pattern)
        if not hits:
            fail(run.path / "metrics.csv", f"no column matches {pattern!r}")
        matched.update(hits)
    for run in runs:
        absent = sorted(matched - set(run.metrics))
        if absent:
            fail(run.path / "metrics.csv", f"no column(s) {absent} (matched by {pattern!r} elsewhere)")
    return sorted(matched)


def draw(ax, agg, color, label, linestyle="-"):
    """Draw a mean line with its shaded confidence band (a lone point gets a marker)."""
    ax.plot(
        agg.steps, agg.mean, color=color, linestyle=linestyle, label=label, marker="o" if agg.steps.size == 1 else None
    )
    ax.fill_between(agg.steps, agg.low, agg.high, color=color, alpha=0.2, linewidth=0)


def eval_panel(ax, groups, colors, y, k, align=False):
    """The evaluation curves of ``{label: [Run, ...]}`` on one axes."""
    for label, runs in groups.items():
        draw(ax, group_aggregate(runs, y, "eval", k, align), colors[label], label)
    ax.set_ylabel(y)


def metric_panel(ax, groups, colors, pattern, k, align=False):
    """The metrics.csv columns matching ``pattern`` of ``{label: [Run, ...]}`` on one axes."""
    all_runs = [run for runs in groups.values() for run in runs]
    columns = expand_metric(pattern, all_runs)
    for label, runs in groups.items():
        for i, column in enumerate(columns):
            name = label if len(columns) == 1 else f"{label}: {column}"
            agg = group_aggregate(runs, column, "metrics", k, align)
            draw(ax, agg, colors[label], name, LINESTYLES[i % len(LINESTYLES)])
    ax.set_ylabel(pattern)


def plot_env(axes, groups, colors, y, metrics, k, align=False):
    """Fill one column of axes: eval curves on top, one row per metric below."""
    eval_panel(axes[0], groups, colors, y, k, align)
    for ax, pattern in zip(axes[1:], metrics):
        metric_panel(ax, groups, colors, pattern, k, align)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1].set_xlabel("environment steps")


def env_tasks(env_groups):
    """The tasks of an env's multitask runs, in order of first appearance (empty for single-task runs)."""
    return list(dict.fromkeys(t for runs in env_groups.values() for run in runs for t in run.by_task))


def task_groups(env_groups, task):
    """``{label: [Run, ...]}`` of the runs that have ``task``, each with that task's rows as its eval table."""
    out = {}
    for label, runs in env_groups.items():
        have = [replace(run, eval=run.by_task[task]) for run in runs if task in run.by_task]
        if have:
            out[label] = have
    return out


def task_panels(groups, metrics):
    """``--per-task``: the panels of every env, ``(title, kind, {label: [Run]}, what)``, in order: the
    env's evaluation (the aggregate of a multitask env), one per task, one per ``--metrics`` pattern."""
    panels = []
    for env, env_groups in groups.items():
        tasks = env_tasks(env_groups)
        panels.append((f"{env} (all tasks)" if tasks else env, "eval", env_groups, None))
        panels += [(f"{env}: {task}", "eval", task_groups(env_groups, task), task) for task in tasks]
        panels += [(f"{env}: {pattern}", "metric", env_groups, pattern) for pattern in metrics]
    return panels


def make_task_figure(groups, y, metrics=(), k=1, title=None, align=False):
    """``--per-task``: a grid of panels (``task_panels``), about as many columns as rows."""
    labels = list(dict.fromkeys(label for env in groups.values() for label in env))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    panels = task_panels(groups, metrics)
    n_cols = int(np.ceil(np.sqrt(len(panels))))
    n_rows = int(np.ceil(len(panels) / n_cols))
    fig = Figure(figsize=(5.5 * n_cols, 3.5 * n_rows), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel()
    for ax, (name, kind, panel_groups, what) in zip(axes, panels):
        if kind == "eval":
            eval_panel(ax, panel_groups, colors, y, k, align)
        else:
            metric_panel(ax, panel_groups, colors, what, k, align)
        ax.set_title(name, fontsize="medium")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        ax.set_xlabel("environment steps")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return fig


def make_figure(groups, y, metrics=(), k=1, title=None, align=False):
    """Build the figure: one column per env, rows = eval + one per metric."""
    labels = list(dict.fromkeys(label for env in groups.values() for label in env))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    n_rows, n_cols = 1 + len(metrics), len(groups)
    fig = Figure(figsize=(5.5 * n_cols, 3.5 * n_rows), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    for col, (env, env_groups) in enumerate(groups.items()):
        axes[0, col].set_title(env)
        plot_env(axes[:, col], env_groups, colors, y, metrics, k, align)
    if title:
        fig.suptitle(title)
    return fig


def summary_rows(groups, y, align=False, per_task=False):
    """Final-step (unsmoothed) mean and CI of ``y`` for every (env, label); with ``per_task``, also
    for every task of a multitask env (its env column ``ENV: TASK``)."""
    rows = []
    for env, env_groups in groups.items():
        parts = [(env, env_groups)]
        if per_task:
            parts += [(f"{env}: {task}", task_groups(env_groups, task)) for task in env_tasks(env_groups)]
        for name, part in parts:
            for label, runs in part.items():
                agg = group_aggregate(runs, y, "eval", align=align)
                rows.append(
                    (name, label, int(agg.n_seeds[-1]), int(agg.steps[-1]), agg.mean[-1], agg.low[-1], agg.high[-1])
                )
    return rows


def format_table(rows, y):
    """Render summary rows as an aligned text table."""
    header = ("env", "label", "seeds", "final_step", f"final_{y}", "95% CI")
    cells = [header] + [
        (env, label, str(n), str(step), f"{mean:.3f}", f"[{low:.3f}, {high:.3f}]")
        for env, label, n, step, mean, low, high in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


# ----------------------------------------------------------------------------- the functions to call


def _build(run_dirs, y, metrics, smooth, title, align, per_task):
    """(figure, groups) of ``run_dirs``, loaded once."""
    if smooth < 1:
        raise PlotError(f"smooth must be >= 1, got {smooth}")
    runs = load_runs(run_dirs, with_metrics=bool(metrics))
    groups = group_runs(runs)
    build = make_task_figure if per_task else make_figure
    return build(groups, y, list(metrics), smooth, title, align), groups


def learning_curves(
    run_dirs, y="return_mean", *, metrics=(), smooth=1, title=None, align=False, per_task=False
) -> Figure:
    """The figure of ``run_dirs``: per env a column with the evaluation curves of column ``y`` of
    eval.csv on top and a row per ``metrics`` pattern (metrics.csv columns, globs allowed) below;
    ``smooth``: a trailing moving average over that many points per seed; ``align``: interpolate runs
    evaluated on different grids; ``per_task``: multitask runs get a panel per task.  Raises
    ``PlotError`` naming the path of a run that cannot be drawn."""
    return _build(run_dirs, y, metrics, smooth, title, align, per_task)[0]


def final_table(run_dirs, y="return_mean", *, align=False, per_task=False) -> str:
    """The text table of final values: per (env, label) the seeds pooled, the last step they share, the
    mean of ``y`` there (unsmoothed) and its 95% bootstrap interval."""
    runs = load_runs(run_dirs)
    groups = group_runs(runs)
    return format_table(summary_rows(groups, y, align, per_task), y)


def save_figure(
    run_dirs, out, y="return_mean", *, metrics=(), smooth=1, title=None, align=False, per_task=False
) -> str:
    """``learning_curves`` saved to ``out`` (its format from the extension; folders made), loading the runs
    once; returns ``final_table``'s text.  Nothing is written when a run cannot be drawn."""
    fig, groups = _build(run_dirs, y, metrics, smooth, title, align, per_task)
    table = format_table(summary_rows(groups, y, align, per_task), y)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return table
