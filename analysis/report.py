"""Aggregate report over a sweep or any run directories: the figures and tables papers use.

From Python (a notebook)::

    from plasticity_zoo.analysis import report

    out = report.write_report(["sweeps/plasticity"], "sweeps/plasticity/report", norm={"Pendulum-v1": (-1600, 0)})
    out["text"]                      # report.md's text; out["aggregate"]: IQM, mean, ... per label

``scripts/report.py`` is its command line.  ``write_report`` finds every run directory
(config.json + eval.csv) at or under the paths and groups runs by (env, label): a sweep labels each
trial with its variant, other runs are labelled by their agent and the settings that tell them
apart (``analysis.aggregate.run_labels``).  A seed's score is the mean of its last ``final_window``
evaluations (default 1: the final one).  A run that stopped before its last step is kept and marked:
``stopped at 43k of 100k`` in the per-env table (its ``note`` column) and a ``warning:`` line.  It
writes into ``out``:

- ``curves.png/.pdf``: per-env learning curves, mean over seeds with 95% bootstrap intervals
  (``analysis.plot``), with ``metrics`` each plasticity metric over time below the return
  (``metrics.png/.pdf``);
- ``aggregate.png/.pdf``: IQM, mean, median and optimality gap of normalised scores across envs per
  label, with 95% stratified-bootstrap intervals (Agarwal et al. 2021, "Deep RL at the Edge of the
  Statistical Precipice": every seed of every env is a run-task score);
- ``profiles.png/.pdf``: performance profiles (the share of runs above each normalised score);
- ``improvement.png/.pdf``: the probability that each label improves on ``baseline``;
- ``report.md``, ``per_env.csv``, ``aggregate.csv``, ``improvement.csv``: the numbers.

Multitask (``mt:``) runs are read at their aggregate rows (``task=all``, the mean over tasks);
``y="score"`` takes their normalised score (the mean over tasks of return / task maximum).
Normalisation (analysis/aggregate.py): ``dmc:`` envs 0-1000 (and ``mt:`` envs of ``dmc:`` tasks),
the MR.Q paper's Gymnasium tasks TD3-normalised, others with ``norm`` (``{ENV: (LOW, HIGH)}``, on the
command line ``--norm ENV=LOW:HIGH``); an env without one is left out of the cross-env aggregates (a
report over one env aggregates its raw scores).  The baseline is ``baseline``, else a label named
``none``, ``base`` or ``baseline``, else the first label in alphabetical order.  Labels missing from
some env are compared on the envs they share.  Intervals come from a fixed ``seed`` (default 0), so a
report is reproducible.  A mistake (no run directory, an unknown baseline or column) raises
``ReportError`` (a ValueError) with the message the command line prints as ``error:``.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from plasticity_zoo.analysis import aggregate as agg
from plasticity_zoo.analysis import plot, stats
from plasticity_zoo.analysis.aggregate import ReportError

__all__ = ["write_report", "ReportError"]

N_BOOT = 2000
TAUS = np.linspace(0.0, 1.2, 61)


def choose_baseline(labels: list[str], given: str | None) -> str:
    if given is not None:
        if given not in labels:
            raise agg.ReportError(f"--baseline {given!r} is not a label of these runs; labels: {', '.join(labels)}")
        return given
    for name in ("none", "base", "baseline"):
        if name in labels:
            return name
    return sorted(labels)[0]


def per_env_rows(groups, norm, rng_seed, y="return_mean"):
    rows = []
    for g in groups:
        point, low, high = stats.bootstrap_ci(g.scores, n_boot=N_BOOT, rng=rng_seed)
        ref, source = agg.reference(g.env, norm, y)
        n = (lambda v: float(agg.normalise(v, *ref))) if ref else (lambda v: float("nan"))
        rows.append(
            {
                "env": g.env,
                "label": g.label,
                "seeds": len(g.scores),
                "mean": point,
                "low": low,
                "high": high,
                "normalised": n(point),
                "normalised_low": n(low),
                "normalised_high": n(high),
                "reference": source,
                "note": agg.stopped_note(g),
            }
        )
    return rows


def score_tasks(groups, norm, y="return_mean"):
    """label -> {env: normalised scores} over the envs that have a reference (all envs' raw scores
    when the report holds one env), and a note on what was left out."""
    envs = sorted({g.env for g in groups})
    refs = {e: agg.reference(e, norm, y) for e in envs}
    kept = [e for e in envs if refs[e][0] is not None]
    note = ""
    if len(envs) == 1 and not kept:
        kept, raw = envs, True
        note = f"one env without a reference score ({envs[0]}): its raw scores are aggregated"
    else:
        raw = False
        left = [e for e in envs if e not in kept]
        if left:
            note = (
                "left out of the aggregates (no reference score): "
                + ", ".join(left)
                + " (include with "
                + " ".join(f"--norm {e}=LOW:HIGH" for e in left)
                + ")"
            )
    out: dict[str, dict[str, np.ndarray]] = {}
    for g in groups:
        if g.env in kept:
            s = np.asarray(g.scores) if raw else agg.normalise(g.scores, *refs[g.env][0])
            out.setdefault(g.label, {})[g.env] = s
    return out, kept, raw, note


def aggregate_rows(tasks, rng_seed):
    rows = []
    for label, per_env in sorted(tasks.items()):
        t = [per_env[e] for e in sorted(per_env)]
        row = {"label": label, "envs": len(t), "runs": int(sum(x.size for x in t))}
        for name, fn in stats.AGGREGATES.items():
            row[name], row[f"{name} low"], row[f"{name} high"] = stats.stratified_interval(t, fn, N_BOOT, rng=rng_seed)
        rows.append(row)
    return rows


def improvement_rows(tasks, baseline, rng_seed):
    rows = []
    for label in sorted(tasks):
        if label == baseline or baseline not in tasks:
            continue
        shared = sorted(set(tasks[label]) & set(tasks[baseline]))
        if not shared:
            continue
        p, lo, hi = stats.probability_of_improvement(
            [tasks[label][e] for e in shared], [tasks[baseline][e] for e in shared], N_BOOT, rng=rng_seed
        )
        rows.append(
            {"label": label, "baseline": baseline, "envs": len(shared), "P(label > baseline)": p, "low": lo, "high": hi}
        )
    return rows


def write_csv(path: Path, rows: list[dict]):
    with open(path, "w", newline="") as f:
        if not rows:
            return
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def _save(fig, out: Path, stem: str) -> list[str]:
    names = [f"{stem}.png", f"{stem}.pdf"]
    for n in names:
        fig.savefig(out / n, dpi=150, bbox_inches="tight")
    return names


def aggregate_figure(rows, unit):
    from matplotlib.figure import Figure

    names = list(stats.AGGREGATES)
    fig = Figure(figsize=(3.2 * len(names), 0.5 * len(rows) + 1.6), layout="constrained")
    axes = fig.subplots(1, len(names), sharey=True)
    ys = np.arange(len(rows))
    for ax, name in zip(axes, names):
        for i, r in enumerate(rows):
            ax.barh(
                i,
                r[f"{name} high"] - r[f"{name} low"],
                left=r[f"{name} low"],
                height=0.6,
                color=f"C{i % 10}",
                alpha=0.75,
            )
            ax.plot([r[name]] * 2, [i - 0.3, i + 0.3], color="k", lw=1.5)
        ax.set_title(name)
        ax.set_xlabel(unit)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys, [r["label"] for r in rows])
    return fig


def profile_figure(tasks, unit, rng_seed):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 4), layout="constrained")
    ax = fig.subplots()
    taus = (
        TAUS
        if unit == "normalised score"
        else np.linspace(
            min(float(np.min(np.concatenate(list(v.values())))) for v in tasks.values()),
            max(float(np.max(np.concatenate(list(v.values())))) for v in tasks.values()),
            61,
        )
    )
    for i, (label, per_env) in enumerate(sorted(tasks.items())):
        point, low, high = stats.performance_profile([per_env[e] for e in sorted(per_env)], taus, N_BOOT, rng=rng_seed)
        ax.plot(taus, point, color=f"C{i % 10}", label=label)
        ax.fill_between(taus, low, high, color=f"C{i % 10}", alpha=0.2)
    ax.set_xlabel(f"{unit} tau")
    ax.set_ylabel("fraction of runs with score > tau")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig, taus


def improvement_figure(rows):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 0.5 * len(rows) + 1.4), layout="constrained")
    ax = fig.subplots()
    for i, r in enumerate(rows):
        ax.barh(i, r["high"] - r["low"], left=r["low"], height=0.6, color=f"C{i % 10}", alpha=0.75)
        ax.plot([r["P(label > baseline)"]] * 2, [i - 0.3, i + 0.3], color="k", lw=1.5)
    ax.axvline(0.5, color="gray", ls="--", lw=1)
    ax.set_yticks(range(len(rows)), [f"{r['label']} > {r['baseline']}" for r in rows])
    ax.set_xlim(0, 1)
    ax.set_xlabel("probability of improvement")
    return fig


def curves(run_dirs, out: Path, y: str = "return_mean", metrics=(), align: bool = False) -> list[str]:
    """Per-env curves (and, with ``metrics``, the metrics figure) through ``analysis.plot``; a warning line
    naming the reason instead of a figure it cannot draw."""
    made = []
    jobs = [("curves", [])] + ([("metrics", list(metrics))] if metrics else [])
    for stem, extra in jobs:
        try:
            fig = plot.learning_curves(run_dirs, y, metrics=extra, align=align)
        except plot.PlotError as e:
            print(f"warning: {stem}.png not drawn: {e}", file=sys.stderr)
            continue
        for ext in ("png", "pdf"):
            fig.savefig(out / f"{stem}.{ext}", dpi=plot.DPI)
            made.append(f"{stem}.{ext}")
    return made


def markdown(per_env, agg_rows, imp_rows, unit, note, files, baseline) -> str:
    def table(rows, cols, fmt):
        head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
        return head + "".join("| " + " | ".join(fmt(r, c) for c in cols) + " |\n" for r in rows)

    def ci(r, c):
        return f"{r[c]:.3g} [{r[c + ' low']:.3g}, {r[c + ' high']:.3g}]"

    columns = ["env", "label", "seeds", "mean", "normalised"] + (["note"] if any(r["note"] for r in per_env) else [])
    lines = [
        "# Report",
        "",
        "## Final score per env (mean over seeds, 95% bootstrap interval)",
        "",
        table(
            per_env,
            columns,
            lambda r, c: (
                f"{r['mean']:.1f} [{r['low']:.1f}, {r['high']:.1f}]"
                if c == "mean"
                else (
                    f"{r['normalised']:.3f}"
                    if c == "normalised" and r["normalised"] == r["normalised"]
                    else ("-" if c == "normalised" else str(r[c]))
                )
            ),
        ),
        f"## Across envs ({unit}; 95% stratified-bootstrap intervals, Agarwal et al. 2021)",
        "",
    ]
    if note:
        lines += [f"Note: {note}.", ""]
    lines += [
        table(
            agg_rows,
            ["label", "envs", "runs", *stats.AGGREGATES],
            lambda r, c: ci(r, c) if c in stats.AGGREGATES else str(r[c]),
        ),
        "",
        f"## Probability of improvement over `{baseline}`",
        "",
    ]
    lines += [
        table(
            imp_rows,
            ["label", "envs", "P(label > baseline)"],
            lambda r, c: f"{r[c]:.3f} [{r['low']:.3f}, {r['high']:.3f}]" if c.startswith("P(") else str(r[c]),
        )
        if imp_rows
        else "(one label only)",
        "",
        "Figures: " + ", ".join(f"[{f}]({f})" for f in files if f.endswith(".png")),
        "",
    ]
    return "\n".join(lines)


def write_report(
    paths,
    out,
    *,
    y: str = "return_mean",
    final_window: int = 1,
    norm: Mapping[str, tuple[float, float]] | list[str] | None = None,
    baseline: str | None = None,
    metrics=(),
    align: bool = False,
    seed: int = 0,
) -> dict:
    """Write the report of the runs at or under ``paths`` (sweep or run directories) into ``out``.

    ``y``: the eval.csv column scored; ``final_window``: a seed's score is the mean of its last K
    evaluations; ``norm``: ``{env: (low, high)}`` (or ``["ENV=LOW:HIGH", ...]``) normalising an env's
    scores to [0, 1]; ``baseline``: the label the others are compared with; ``metrics``: metrics.csv
    columns (globs) drawn over time; ``align``: curves of runs evaluated on different grids are
    interpolated; ``seed``: the bootstrap's.  Returns ``{"groups", "per_env", "aggregate", "improvement",
    "files", "run_dirs", "text", "summary"}``: ``text`` is report.md, ``summary`` a line saying what was
    written.  Raises ``ReportError`` for a mistake."""
    norm = dict(norm) if isinstance(norm, Mapping) else agg.parse_norm(norm)
    out = Path(out)
    run_dirs = agg.find_runs([paths] if isinstance(paths, (str, Path)) else paths)
    groups = agg.load_groups(run_dirs, y, final_window)
    labels = sorted({g.label for g in groups})
    baseline = choose_baseline(labels, baseline)
    out.mkdir(parents=True, exist_ok=True)
    for g in groups:
        if g.stopped:
            print(
                f"warning: {g.env} {g.label}: {agg.stopped_note(g)} (kept: its score is its last evaluation; "
                "marked in report.md and per_env.csv)",
                file=sys.stderr,
            )
    per_env = per_env_rows(groups, norm, seed, y)
    tasks, kept, raw, note = score_tasks(groups, norm, y)
    unit = "raw score" if raw else "normalised score"
    files = curves(run_dirs, out, y, metrics, align)
    agg_rows, imp_rows = [], []
    if tasks:
        agg_rows = aggregate_rows(tasks, seed)
        imp_rows = improvement_rows(tasks, baseline, seed)
        files += _save(aggregate_figure(agg_rows, unit), out, "aggregate")
        fig, _ = profile_figure(tasks, unit, seed)
        files += _save(fig, out, "profiles")
        if imp_rows:
            files += _save(improvement_figure(imp_rows), out, "improvement")
    write_csv(out / "per_env.csv", per_env)
    write_csv(out / "aggregate.csv", agg_rows)
    write_csv(out / "improvement.csv", imp_rows)
    text = markdown(per_env, agg_rows, imp_rows, unit, note, files, baseline)
    (out / "report.md").write_text(text)
    summary = (
        f"{len(run_dirs)} run directories, {len(groups)} (env, label) groups; wrote {out}/: "
        f"report.md, per_env.csv, aggregate.csv, improvement.csv, {', '.join(files)}"
    )
    return {
        "groups": groups,
        "per_env": per_env,
        "aggregate": agg_rows,
        "improvement": imp_rows,
        "files": files,
        "run_dirs": run_dirs,
        "text": text,
        "summary": summary,
    }
