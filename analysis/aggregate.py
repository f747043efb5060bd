"""What a report aggregates: run directories found under paths, each seed's final score, normalisation.

A run directory is a directory holding ``config.json`` and ``eval.csv`` (``.replaced-*`` folders,
runs moved aside by ``--overwrite``, are skipped).  Runs are grouped by (env, label): the label is
``config["label"]`` (``--label``; a sweep sets it to the variant), else ``run_labels``' default: the
agent's name, followed by the settings that tell its runs apart (``sac plasticity.redo=true``), so that
runs pool only when their configs match but for the seed, the run's name and how it is logged
(``training.config.NOT_THE_EXPERIMENT``).  A seed's score is the mean of its last ``window``
evaluations of column ``y``; seeds of runs sharing (env, label) are pooled.  A run whose last
evaluation is below the step a finished run ends at (``training.run.final_step``) stopped early: its
group lists it in ``stopped``.
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
TD3_NORMALISATION = {
    "Ant": (-70.3, 3942.0),
    "HalfCheetah": (-289.4, 10574.0),
    "Hopper": (18.8, 3226.0),
    "Humanoid": (120.4, 5165.0),
    "Walker2d": (2.8, 3946.0),
}
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
    stopped: list = field(default_factory=list)  # (run dir, step reached, final step) of runs that stopped early


def _settings(config: dict) -> dict:
    """A run's settings that make it an experiment: ``config.json`` flattened to dotted names as the flags
    spell them (``plasticity.redo``; agent options bare: ``tau``), without the env and agent (what runs
    are grouped by), the records beside the flags and ``NOT_THE_EXPERIMENT``."""
    from plasticity_zoo.training.config import NOT_THE_EXPERIMENT

    out = {}

    def walk(d: dict, prefix: str):
        for k, v in d.items():
            name = prefix + k
            if name in NOT_THE_EXPERIMENT or (not prefix and k in ("env", "agent_name", "provenance", "resumes")):
                continue
            if isinstance(v, dict):
                walk(v, "" if name == "agent" else name + ".")
            else:
                out[name] = v

    walk(config, "")
    return out


def _value(v) -> str:
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(map(_value, v))
    return str(v)


def run_labels(configs: list[dict]) -> list[str]:
    """The label of each run (its ``config.json``, read with the others it is plotted or reported with).

    ``config["label"]`` when set; else the agent's name, followed by ``name=value`` for each setting in
    which its unlabelled runs of one env differ (the same settings on every env, so that a label names
    one variant across envs): a ReDo run beside plain SAC runs is ``sac plasticity.redo=true``, those
    ``sac plasticity.redo=false``, and runs that differ only in their seed share ``sac``.  Settings a run
    does not record (an older config.json) are not compared."""
    unlabelled = [i for i, c in enumerate(configs) if not c.get("label")]
    settings = {i: _settings(configs[i]) for i in unlabelled}
    by_env: dict[tuple, list[int]] = {}
    for i in unlabelled:
        by_env.setdefault((configs[i]["agent_name"], json.dumps(configs[i].get("env"))), []).append(i)
    differ: dict[str, set] = {}
    for (agent, _), runs in by_env.items():
        shared = set.intersection(*(set(settings[i]) for i in runs))
        differ.setdefault(agent, set()).update(
            k for k in shared if len({json.dumps(settings[i][k], sort_keys=True) for i in runs}) > 1
        )
    labels = []
    for i, c in enumerate(configs):
        if c.get("label"):
            labels.append(str(c["label"]))
            continue
        keys = sorted(k for k in differ[c["agent_name"]] if k in settings[i])
        labels.append(" ".join([c["agent_name"], ", ".join(f"{k}={_value(settings[i][k])}" for k in keys)]).strip())
    return labels


def final_step(run_dir: Path, config: dict) -> int | None:
    """The step the run in ``run_dir`` ends at when it finishes (``training.run.final_step`` of its
    ``config.json``, read as ``config``); None for a config.json that is not a whole run config (written
    by hand, or by another version of the zoo)."""
    if not isinstance(config.get("total_steps"), int) or not isinstance(config.get("agent"), dict):
        return None  # (without loading the agent's module)
    from plasticity_zoo.training.run import final_step as of_config
    from plasticity_zoo.training.run import load_config

    try:
        return of_config(load_config(run_dir))
    except (SystemExit, ValueError, TypeError, KeyError):
        return None


def find_runs(paths) -> list[Path]:
    """Run directories at or under ``paths`` (sorted; a path that holds none is an error)."""
    out = []
    for p in map(Path, paths):
        if not p.exists():
            raise ReportError(f"{p}: no such file or directory")
        found = [
            d.parent
            for d in sorted(p.rglob("config.json"))
            if (d.parent / "eval.csv").is_file()
            and not any(part.startswith(".replaced-") for part in d.parent.relative_to(p).parts)
        ]
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
    configs = []
    for d in run_dirs:
        try:
            cfg = json.loads((d / "config.json").read_text())
            if not isinstance(cfg, dict) or "env" not in cfg or not isinstance(cfg.get("agent_name"), str):
                raise ValueError("it needs the keys env and agent_name")
        except (OSError, ValueError) as e:
            raise ReportError(f"{d / 'config.json'} is not a readable run config ({e})") from None
        configs.append(cfg)
    for d, cfg, label in zip(run_dirs, configs, run_labels(configs)):
        g = groups.setdefault((cfg["env"], label), Group(cfg["env"], label))
        g.runs.append(d)
        reached = None
        for seed, (steps, values) in read_eval(d, y).items():
            g.curves[(d, seed)] = (steps, values)
            g.scores.append(float(np.mean(values[-window:])))
            reached = int(steps.max()) if reached is None else max(reached, int(steps.max()))
        final = final_step(d, cfg)
        if final is not None and reached is not None and reached < final:
            g.stopped.append((d, reached, final))
    return list(groups.values())


def steps_text(n: int) -> str:
    """A step count as a report says it: 43k, 100k, 1.5M, 999."""
    for size, suffix in ((1_000_000, "M"), (1_000, "k")):
        if n >= size:
            return f"{n / size:.4g}{suffix}"
    return str(n)


def stopped_note(g: Group) -> str:
    """``<run dir's name> stopped at 43k of 100k`` (its last evaluation, and the step a finished run ends at)
    for each run of ``g`` that stopped early, joined by ``; ``; empty if none did."""
    return "; ".join(
        f"{d.name} stopped at {steps_text(reached)} of {steps_text(final)}" for d, reached, final in g.stopped
    )


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
    members = None
    if env.startswith(("mt:", "ns:")):
        from plasticity_zoo.training.evaluation import eval_tasks

        try:
            members = eval_tasks(env)
        except ValueError as e:
            return None, f"{e} (give --norm {env}=LOW:HIGH)"
    if members:  # scored per task (mt:, a chain with eval=all): the aggregate rows are means over tasks
        if y == "score":
            return SCORE_RANGE, "multitask score: mean over tasks of return / task maximum"
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
