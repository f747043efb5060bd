"""What a report aggregates: run directories found under paths, each seed's final score, normalisation.

A run directory is a directory holding ``config.json`` and ``eval.csv`` (``.replaced-*`` folders,
runs moved aside by ``--overwrite``, are skipped).  Runs are grouped by (env, label): the label is
``config["label"]`` (a sweep sets it to the variant) or the agent's name.  A seed's score is the mean
of its last ``window`` evaluations of column ``y``; seeds of runs sharing (env, label) are pooled.
A multitask (``mt:``) run's eval.csv has a ``task`` column: only its aggregate rows (``task=all``:
the mean over tasks) are read, and its ``score`` column (the mean over tasks of return / the task's
maximum) is already normalised.

Normalised score = (score - low) / (high - low), per env: ``dmc:`` tasks 0 to 1000 (the Control
Suite's return range); the Gymnasium MuJoCo tasks of the MR.Q paper TD3-normalised (random and TD3
returns at 1M steps; Fujimoto et al. 2025, Sec. 5, the Gym aggregates); an ``mt:`` env whose members
are all ``dmc:`` tasks 0 to 1000 (its return is their mean), and its ``score`` column as it is
(0 to 1); any env with ``--norm ENV=LOW:HIGH``.  Without a reference an env keeps its raw score and is left out of
aggregates across envs (a report over one env aggregates its raw scores).
"""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from plasticity_zoo.training.logger import AGGREGATE_TASK  # the task column of a multitask run's aggregate rows

# (random, TD3) returns at 1M steps, Gymnasium MuJoCo (MR.Q paper, Fujimoto et al. 2025, the Gym table).
TD3_NORMALISATION = {"Ant": (-70.3, 3942.0), "HalfCheetah": (-289.4, 10574.0), "Hopper": (18.8, 3226.0),
                     "Humanoid": (120.4, 5165.0), "Walker2d": (2.8, 3946.0)}
DMC_RANGE = (0.0, 1000.0)
SCORE_RANGE = (0.0, 1.0)  # a multitask run's score column: already normalised


class ReportError(ValueError):
    pass


@dataclass
class Group:
    """The runs of one (env, label): every seed's eval curve and its final score."""

    env: str
    label: str
    runs: list = field(default_factory=list)
    curves: dict = field(default_factory=dict)  # (run dir, seed) -> (steps, values)
    scores: list = field(default_factory=list)  # one final score per seed


def find_runs(paths) -> list[Path]:
    """Run directories at or under ``paths`` (sorted; a path that holds none is an error)."""
    out = []
    for p in map(Path, paths):
        if not p.exists():
            raise ReportError(f"{p}: no such file or directory")
        found = [d.parent for d in sorted(p.rglob("config.json")) if (d.parent / "eval.csv").is_file()
                 and not any(part.startswith(".replaced-") for part in d.parent.relative_to(p).parts)]
        if p.is_dir() and (p / "config.json").is_file() and (p / "eval.csv").is_file() and p not in found:
            found.insert(0, p)
        if not found:
            raise ReportError(f"{p}: no run directory (config.json and eval.csv) at or under it")
        out += [d for d in found if d not in out]
    return out


def read_eval(run_dir: Path, y: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """seed -> (steps, values of column ``y``) from ``run_dir/eval.csv``."""
    path = run_dir / "eval.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ReportError(f"{path} has no evaluations yet")
    if y not in rows[0]:
        raise ReportError(f"{path} has no column {y!r}; columns: {', '.join(rows[0])}")
    if "task" in rows[0]:  # a multitask run: its aggregate rows (the per-task rows are for plots)
        rows = [r for r in rows if r["task"] == AGGREGATE_TASK]
        if not rows:
            raise ReportError(f"{path} has no aggregate (task={AGGREGATE_TASK}) rows yet")
    per_seed: dict[int, list] = {}
    try:
        for r in rows:
            per_seed.setdefault(int(r["seed"]), []).append((int(r["step"]), float(r[y])))
    except (KeyError, ValueError) as e:
        raise ReportError(f"{path}: unreadable row ({e})") from None
    return {s: (np.array([a for a, _ in v]), np.array([b for _, b in v])) for s, v in sorted(per_seed.items())}


def load_groups(run_dirs, y: str = "return_mean", window: int = 1) -> list[Group]:
    """Runs grouped by (env, label), in order of first appearance, with each seed's final score."""
    if window < 1:
        raise ReportError(f"--final-window must be >= 1, got {window}")
    groups: dict[tuple[str, str], Group] = {}
    for d in run_dirs:
        try:
            cfg = json.loads((d / "config.json").read_text())
            env, label = cfg["env"], cfg.get("label") or cfg["agent_name"]
        except (OSError, ValueError, KeyError) as e:
            raise ReportError(f"{d / 'config.json'} is not a readable run config ({e})") from None
        g = groups.setdefault((env, label), Group(env, label))
        g.runs.append(d)
        for seed, (steps, values) in read_eval(d, y).items():
            g.curves[(d, seed)] = (steps, values)
            g.scores.append(float(np.mean(values[-window:])))
    return list(groups.values())


def parse_norm(items) -> dict[str, tuple[float, float]]:
    """``["ENV=LOW:HIGH", ...]`` -> {env: (low, high)}."""
    out = {}
    for item in items or []:
        m = re.fullmatch(r"(.+)=([^:]+):([^:]+)", item)
        try:
            low, high = float(m.group(2)), float(m.group(3))
        except (AttributeError, ValueError):
            raise ReportError(f"--norm {item!r}: write ENV=LOW:HIGH, e.g. Pendulum-v1=-1600:0") from None
        if not (math.isfinite(low) and math.isfinite(high)) or high == low:
            raise ReportError(f"--norm {item!r}: LOW and HIGH must be finite and differ")
        out[m.group(1)] = (low, high)
    return out


def reference(env: str, given: dict, y: str = "return_mean") -> tuple[tuple[float, float] | None, str]:
    """(low, high) of column ``y`` and where they come from, or (None, why not)."""
    if env in given:
        return given[env], "--norm"
    if env.startswith("mt:"):
        if y == "score":
            return SCORE_RANGE, "multitask score: mean over tasks of return / task maximum"
        from plasticity_zoo.envs.multitask import member_ids

        try:
            members = member_ids(env)
        except ValueError as e:
            return None, f"{e} (give --norm {env}=LOW:HIGH)"
        if all(m.startswith("dmc:") for m in members):
            return DMC_RANGE, "DMC return range 0-1000 (mean over dmc: tasks)"
        return None, f"no reference score for {env}: not all its tasks are dmc: (use --y score, or --norm)"
    if env.startswith("dmc:"):  # (an ns: env changes its rewards: it needs --norm)
        return DMC_RANGE, "DMC return range 0-1000"
    name = re.sub(r"-v\d+$", "", env)
    if name in TD3_NORMALISATION:
        return TD3_NORMALISATION[name], "TD3-normalised (MR.Q paper's random / TD3 returns)"
    return None, f"no reference score for {env} (give --norm {env}=LOW:HIGH)"


def normalise(score, low: float, high: float):
    return (np.asarray(score, dtype=float) - low) / (high - low)
