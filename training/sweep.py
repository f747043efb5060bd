"""A sweep: a grid of ``train.py`` runs (agents x envs x variants x seed groups), run as Ray tasks.

A sweep is written as a TOML file (or the same keys as flags of ``scripts/sweep.py``)::

    agents = ["sac"]
    envs = ["Pendulum-v1", "dmc:cartpole-balance"]
    seeds = 3                 # seeds per (agent, env, variant)
    seeds_per_trial = 3       # vmapped in one trial (default: all); fewer splits them across trials
    retries = 1               # a failed trial is tried again this many times (resuming its checkpoint)
    cpus_per_trial = 1        # Ray resources of one trial; a GPU fraction lets trials share a GPU
    gpus_per_trial = 0

    [flags]                   # given to every trial (any train.py flag, without the dashes)
    total-steps = 20000
    "network.width" = 64

    [agent_flags.sac]         # given to one agent's trials only
    learning-starts = 1000

    [variants]                # named flag sets (default: one variant, "base"); a variant may use a preset
    none = {}
    redo = { preset = "redo-sokar" }
    sigreg = { "plasticity.sigreg-coef" = 0.2 }

    [grid]                    # crossed with the variants: one trial per combination
    "plasticity.metrics-every" = [0, 1000]

A flag's TOML value becomes its command-line form: ``true`` -> ``--name``, ``false`` ->
``--no-name`` (``--group.no-name``), a list -> ``--name v1 v2``, anything else ``--name value``.

Each trial is one ``train.py`` run in ``SWEEP/runs/<trial>/`` with ``--label`` set to its variant
(prefixed by the agent when the sweep has several), so ``scripts/report.py SWEEP`` groups it.  The
sweep directory also holds ``sweep.json`` (every trial's command), ``status/<trial>.json`` and
``logs/<trial>.log``.  Running the same sweep again skips finished trials, resumes interrupted ones
from their last checkpoint (``train.py --resume``), starts over (``--overwrite``, which moves the
old files aside) those that stopped before their first checkpoint, and may add new trials; a trial
whose command changed is refused.

Everything is checked before anything is created: the sweep's keys and values, then every distinct
trial command through train.py's own parsing and preflight (unknown flags, bad values, envs,
interventions that do not apply).

A search (``[search]``, run by Ray Tune: ``pip install -e '.[search]'``) draws a number of trials
from ranges instead of crossing a grid, for one agent on one env (one variant, one seed group)::

    [search]
    mode = "random"           # "random": drawn from `seed`; "optuna": Optuna's TPE through Ray Tune's OptunaSearch
    num_trials = 16
    seed = 0
    metric = "return_mean"    # an eval.csv column (mean over the trial's seeds), reported at every evaluation
    goal = "max"              # or "min"
    early_stopping = "asha"   # "none" (default), "asha" (ASHAScheduler) or "median" (MedianStoppingRule)
    grace_steps = 1000        # no trial is stopped before this env step (default: the trials' eval-every)
    reduction_factor = 3      # asha: the best 1/3 at each rung go on
    # min_trials = 3          # median: trials that must have reached a step before one is compared

    [search.space]            # train.py flags: a range, a log range, an int range, or a list of choices
    "actor-lr" = { low = 1e-4, high = 1e-3, log = true }
    critics = { low = 2, high = 5 }                 # both bounds ints: an int range
    "network.width" = [64, 128, 256]

Trial ``i`` is labelled ``t<i>`` (``t007``; ``<variant>,t007`` for a named variant).  A random trial's
values depend only on (seed, i, flag), so the same file gives the same trials and a larger
``num_trials`` adds trials.  An optuna trial's values are chosen when it starts and recorded in
``sweep.json``; a relaunch tells Optuna the finished trials' results, continues the unfinished ones
with their recorded values, then asks for the rest.  A trial stopped by the scheduler keeps its
run (``runs/<trial>/stopped.json`` says why) and counts as finished, ``stopped`` in its status.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

SPEC_KEYS = {
    "agents",
    "envs",
    "seeds",
    "seeds_per_trial",
    "retries",
    "cpus_per_trial",
    "gpus_per_trial",
    "flags",
    "agent_flags",
    "variants",
    "grid",
    "search",
}
# Flags a sweep sets itself for every trial.
OWNED_FLAGS = {"run-dir", "resume", "label", "seeds", "env", "progress", "overwrite"}
NAME = re.compile(r"^[A-Za-z0-9_.+=-]+$")


class SweepError(ValueError):
    """A sweep file or command that cannot be run (reported as one ``error:`` line)."""


@dataclass
class Spec:
    agents: list[str]
    envs: list[str]
    seeds: int = 1
    seeds_per_trial: int | None = None
    retries: int = 1
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    flags: dict = field(default_factory=dict)
    agent_flags: dict = field(default_factory=dict)
    variants: dict = field(default_factory=lambda: {"base": {}})
    grid: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Trial:
    name: str
    agent: str
    env: str
    label: str
    seed: int
    seeds: int
    argv: tuple[str, ...]
    """train.py's arguments for a new run (without --run-dir)"""
    index: int | None = None
    """a search's trial number (None in a grid)"""
    params: tuple = ()
    """a search's values of its ranges: ((flag, value), ...)"""


def read_spec(path) -> dict:
    """The keys of a TOML sweep file (a SweepError names the file and the problem)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise SweepError(f"sweep file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"sweep file {path} is not valid TOML: {e}") from None


def make_spec(d: dict) -> Spec:
    """Check the keys and value types of a sweep and build its ``Spec``."""
    unknown = set(d) - SPEC_KEYS
    if unknown:
        raise SweepError(f"unknown sweep keys {sorted(unknown)}; known: {', '.join(sorted(SPEC_KEYS))}")
    for key in ("agents", "envs"):
        v = d.get(key)
        if isinstance(v, str):
            d[key] = v = [v]
        if not v or not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise SweepError(f"sweep key {key!r} must be a non-empty list of names, got {v!r}")
        if len(set(v)) != len(v):
            raise SweepError(f"sweep key {key!r} lists a name twice: {v}")
    spec = Spec(**d)
    for key in ("seeds", "retries"):
        v = getattr(spec, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "seeds" else 0):
            raise SweepError(f"sweep key {key!r} must be an integer >= {1 if key == 'seeds' else 0}, got {v!r}")
    k = spec.seeds_per_trial
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k):
        raise SweepError(f"seeds_per_trial must be an integer >= 1, got {k!r}")
    for key in ("cpus_per_trial", "gpus_per_trial"):
        v = getattr(spec, key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (key == "cpus_per_trial" and v == 0):
            raise SweepError(
                f"sweep key {key!r} must be a number {'> 0' if key == 'cpus_per_trial' else '>= 0'}, got {v!r}"
            )
    if spec.gpus_per_trial > 1 and spec.gpus_per_trial != int(spec.gpus_per_trial):
        raise SweepError(f"gpus_per_trial above 1 must be whole GPUs, got {spec.gpus_per_trial}")
    for key in ("flags", "agent_flags", "variants", "grid", "search"):
        if not isinstance(getattr(spec, key), dict):
            raise SweepError(f"sweep key {key!r} must be a table, got {getattr(spec, key)!r}")
    for agent, flags in spec.agent_flags.items():
        if agent not in spec.agents:
            raise SweepError(f"agent_flags.{agent}: {agent!r} is not among the sweep's agents {spec.agents}")
        if not isinstance(flags, dict):
            raise SweepError(f"agent_flags.{agent} must be a table of flags")
    if not spec.variants:
        raise SweepError("variants is empty: give at least one (e.g. none = {})")
    for name, flags in spec.variants.items():
        if not NAME.match(name):
            raise SweepError(f"variant name {name!r}: use letters, digits and _ . + = - only")
        if not isinstance(flags, dict):
            raise SweepError(f"variant {name!r} must be a table of flags, got {flags!r}")
    for name, values in spec.grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"grid.{name} must be a non-empty list of values, got {values!r}")
    for where, flags in [
        ("flags", spec.flags),
        ("grid", spec.grid),
        *[(f"variants.{n}", f) for n, f in spec.variants.items()],
        *[(f"agent_flags.{a}", f) for a, f in spec.agent_flags.items()],
    ]:
        for name in flags:
            if _flag_name(name) in OWNED_FLAGS:
                key = "seeds" if name == "seeds" else "envs" if name == "env" else repr(name)
                raise SweepError(
                    f"{where}: the sweep sets --{_flag_name(name)} itself (use the sweep key {key} or leave it out)"
                )
    if spec.search:
        parse_search(spec)
    return spec


def _flag_name(key: str) -> str:
    return key.lstrip("-").replace("_", "-")


def to_args(flags: dict) -> list[str]:
    """TOML flags -> train.py arguments (see the module docstring)."""
    out: list[str] = []
    for key, value in flags.items():
        name = _flag_name(key)
        if value is None:
            continue
        if name == "preset":
            out += ["--preset", ",".join(value) if isinstance(value, list) else str(value)]
        elif isinstance(value, bool):
            group, _, leaf = name.rpartition(".")
            out.append(f"--{name}" if value else f"--{group + '.' if group else ''}no-{leaf}")
        elif isinstance(value, list):
            out += [f"--{name}", *map(str, value)]
        elif isinstance(value, dict):
            raise SweepError(f"flag {key!r} has a table as its value; flags take a value or a list")
        else:
            out += [f"--{name}", str(value)]
    return out


def _value_name(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _env_slug(env: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "-", env)


def _seed_groups(
    spec: Spec, agent: str, env: str, label: str, flags: dict, index: int | None = None, params: tuple = ()
) -> list[Trial]:
    """The trials of one (agent, env, flag set): the sweep's seeds in groups of ``seeds_per_trial``."""
    base_seed = int(spec.flags.get("seed", 0))
    k = spec.seeds_per_trial or spec.seeds
    flags = {key: v for key, v in flags.items() if key != "seed"}
    trials = []
    for first in range(0, spec.seeds, k):
        n = min(k, spec.seeds - first)
        seed = base_seed + first
        name = "__".join(
            [
                _env_slug(env),
                agent,
                _env_slug(label.split(" ")[-1]),
                f"seed{seed}" + (f"-{seed + n - 1}" if n > 1 else ""),
            ]
        )
        argv = (
            agent,
            "--env",
            env,
            "--seeds",
            str(n),
            "--seed",
            str(seed),
            "--label",
            label,
            "--no-progress",
            *to_args(flags),
        )
        trials.append(Trial(name, agent, env, label, seed, n, argv, index, params))
    return trials


def expand(spec: Spec) -> list[Trial]:
    """Every trial: agents x envs x variants x grid points x seed groups, in that order."""
    grid_keys = list(spec.grid)
    trials = []
    for agent, env, (variant, vflags), point in itertools.product(
        spec.agents, spec.envs, spec.variants.items(), itertools.product(*spec.grid.values())
    ):
        label = variant + "".join(f",{_flag_name(key)}={_value_name(v)}" for key, v in zip(grid_keys, point))
        if len(spec.agents) > 1:
            label = f"{agent} {label}"
        flags = {**spec.flags, **spec.agent_flags.get(agent, {}), **vflags, **dict(zip(grid_keys, point))}
        trials += _seed_groups(spec, agent, env, label, flags)
    names = [t.name for t in trials]
    if len(set(names)) != len(names):
        raise SweepError(
            "two trials got the same name (variant or grid values that differ only in characters "
            "a directory name cannot hold); rename the variants"
        )
    return trials


# ---- the sweep directory ---------------------------------------------------------------------------


class Ledger:
    """``SWEEP/sweep.json`` (the trials' commands), ``status/<trial>.json``, ``logs/<trial>.log``, ``runs/<trial>/``."""

    def __init__(self, root):
        self.root = Path(root)

    def run_dir(self, trial: Trial | str) -> Path:
        return self.root / "runs" / (trial if isinstance(trial, str) else trial.name)

    def log(self, trial: Trial | str) -> Path:
        return self.root / "logs" / f"{trial if isinstance(trial, str) else trial.name}.log"

    def status_path(self, name: str) -> Path:
        return self.root / "status" / f"{name}.json"

    def recorded(self) -> dict:
        return self._read_record("trials", {})

    def recorded_spec(self) -> dict | None:
        """The sweep keys last recorded in ``sweep.json`` (None before the first run)."""
        return self._read_record("spec", None)

    def _read_record(self, key: str, missing):
        path = self.root / "sweep.json"
        if not path.is_file():
            return missing
        try:
            return json.loads(path.read_text())[key]
        except (OSError, ValueError, KeyError) as e:
            raise SweepError(f"{path} is not a readable sweep record ({e})") from None

    def check_compatible(self, trials: list[Trial]):
        """A trial already in this sweep directory must have the same command (else refuse)."""
        old = self.recorded()
        for t in trials:
            if t.name in old and tuple(old[t.name]["argv"]) != t.argv:
                raise SweepError(
                    f"sweep directory {self.root} already holds trial {t.name} with other flags "
                    f"({' '.join(old[t.name]['argv'])}); give this sweep another --dir"
                )

    def record(self, trials: list[Trial], spec: dict):
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("runs", "status", "logs"):
            (self.root / sub).mkdir(exist_ok=True)
        merged = {**self.recorded(), **{t.name: _trial_record(t) for t in trials}}
        _write_json(self.root / "sweep.json", {"spec": spec, "trials": merged})

    def status(self, name: str) -> dict:
        try:
            return json.loads(self.status_path(name).read_text())
        except (OSError, ValueError):
            return {"state": "new", "attempts": 0}

    def set_status(self, name: str, **values):
        s = {**self.status(name), **values, "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
        _write_json(self.status_path(name), s)
        return s


def _trial_record(t: Trial) -> dict:
    d = {"argv": list(t.argv), "agent": t.agent, "env": t.env, "label": t.label, "seed": t.seed, "seeds": t.seeds}
    if t.index is not None:
        d.update(index=t.index, params=dict(t.params))
    return d


def _write_json(path: Path, d: dict):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(d, indent=2, sort_keys=True))
    os.replace(tmp, path)


def attempt_argv(ledger: Ledger, trial: Trial) -> tuple[list[str], str]:
    """The train.py arguments for the next attempt and what it does: 'resume' from the run's last
    checkpoint, 'restart' a run that stopped before its first one (--overwrite moves its files
    aside), or 'start'."""
    from plasticity_zoo.training import checkpoint
    from plasticity_zoo.training.run import run_files

    d = ledger.run_dir(trial)
    if checkpoint.latest(d) is not None:
        return ["--resume", str(d), "--no-progress"], "resume"
    if run_files(d):
        return [*trial.argv, "--run-dir", str(d), "--overwrite"], "restart"
    return [*trial.argv, "--run-dir", str(d)], "start"


def preflight(trials: list[Trial], ledger: Ledger):
    """Every distinct trial command through train.py's parsing and checks, before anything runs."""
    from plasticity_zoo.training.cli import parse
    from plasticity_zoo.training.run import is_user_error
    from plasticity_zoo.training.run import preflight as check_run

    seen = set()
    for t in trials:
        argv, how = attempt_argv(ledger, t)
        key = tuple(a for a in argv if a != "--overwrite") if how == "resume" else t.argv[:5] + t.argv[7:]
        if key in seen:
            continue
        seen.add(key)
        try:
            cfg = parse([a for a in argv if a != "--overwrite"])
            check_run(cfg, overwrite=how == "restart")
        except BaseException as e:
            if not is_user_error(e) or (isinstance(e, SystemExit) and not isinstance(e.code, str)):
                if isinstance(e, SystemExit):  # tyro printed its own message
                    raise SweepError(
                        f"trial {t.name}: train.py {' '.join(t.argv)} is not a valid command (tyro's message above)"
                    ) from None
                raise
            msg = e.code if isinstance(e, SystemExit) else str(e)
            raise SweepError(f"trial {t.name}: {msg}") from None


def latest_return(run_dir: Path) -> tuple[int, float] | None:
    """(step, mean over seeds of return_mean) of the last evaluation in ``run_dir/eval.csv`` (a
    multitask run's aggregate rows, ``task=all``)."""
    path = Path(run_dir) / "eval.csv"
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return None
    rows = [r for r in rows if r.get("task") in (None, "all")]  # training/logger.py: AGGREGATE_TASK
    if not rows:
        return None
    try:
        step = max(int(r["step"]) for r in rows)
        vals = [float(r["return_mean"]) for r in rows if int(r["step"]) == step]
    except (KeyError, ValueError):
        return None
    return step, sum(vals) / len(vals)


def progress_step(run_dir: Path) -> int | None:
    """The last logged step in ``run_dir/metrics.csv`` (read from the file's end)."""
    path = Path(run_dir) / "metrics.csv"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            last = f.read().decode(errors="replace").strip().splitlines()[-1]
        return int(float(last.split(",")[0]))
    except (OSError, IndexError, ValueError):
        return None


def table(ledger: Ledger, trials: list[Trial]) -> str:
    """The live table: each trial's state, attempts, progress and latest evaluation return."""
    rows = [("trial", "state", "tries", "step", "return")]
    for t in trials:
        s = ledger.status(t.name)
        d = ledger.run_dir(t)
        ev = latest_return(d)
        step = progress_step(d)
        total = s.get("total_steps")
        rows.append(
            (
                t.name,
                s["state"],
                str(s.get("attempts", 0)),
                "" if step is None else (f"{step}/{total}" if total else str(step)),
                "" if ev is None else f"{ev[1]:.1f} @{ev[0]}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def spec_dict(spec: Spec) -> dict:
    return dataclasses.asdict(spec)


# ---- search: trials drawn from ranges (random, or Optuna through Ray Tune) --------------------------

SEARCH_MODES = ("random", "optuna")
EARLY_STOPPING = ("none", "asha", "median")
SEARCH_KEYS = {
    "mode",
    "num_trials",
    "seed",
    "metric",
    "goal",
    "early_stopping",
    "grace_steps",
    "reduction_factor",
    "min_trials",
    "space",
}
METRICS = ("return_mean", "return_std", "score")  # eval.csv's numeric columns (score: mt: runs only)
FINISHED = ("done", "stopped")  # a search trial in one of these states is not run again
EXTRA = "pip install -e '.[search]'"


@dataclass(frozen=True)
class Range:
    """One searched flag: ``kind`` 'float' or 'int' over [low, high] (``log``: uniform in log), or 'choice'."""

    name: str
    kind: str
    low: float = 0.0
    """an int in an int range (unused by choices)"""
    high: float = 0.0
    log: bool = False
    choices: tuple = ()


@dataclass(frozen=True)
class Search:
    mode: str
    num_trials: int
    metric: str
    space: tuple[Range, ...]
    seed: int = 0
    goal: str = "max"
    early_stopping: str = "none"
    grace_steps: int | None = None
    reduction_factor: float = 3.0
    min_trials: int = 3

    def settings(self) -> dict:
        """What a search's trials depend on: a sweep directory keeps them across relaunches."""
        return json.loads(
            json.dumps(
                {
                    "mode": self.mode,
                    "seed": self.seed,
                    "metric": self.metric,
                    "goal": self.goal,
                    "space": {r.name: dataclasses.asdict(r) for r in self.space},
                }
            )
        )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_search(spec: Spec) -> Search:
    """The ``[search]`` table of a sweep, checked (a SweepError names the key and the problem)."""
    d = dict(spec.search)
    unknown = set(d) - SEARCH_KEYS
    if unknown:
        raise SweepError(f"unknown search keys {sorted(unknown)}; known: {', '.join(sorted(SEARCH_KEYS))}")
    mode = d.get("mode")
    if mode is None:
        raise SweepError(f"search.mode is missing: {' or '.join(map(repr, SEARCH_MODES))}")
    if mode not in SEARCH_MODES:
        raise SweepError(
            f"unknown search mode {mode!r}; modes: {', '.join(SEARCH_MODES)} (a grid sweep has no [search] table)"
        )
    n = d.get("num_trials")
    if n is None:
        raise SweepError("search.num_trials is missing: how many trials to run")
    if not _is_int(n) or n < 1:
        raise SweepError(f"search.num_trials must be an integer >= 1, got {n!r}")
    seed = d.get("seed", 0)
    if not _is_int(seed) or seed < 0:
        raise SweepError(f"search.seed must be an integer >= 0, got {seed!r}")
    goal = d.get("goal", "max")
    if goal not in ("max", "min"):
        raise SweepError(f"search.goal must be 'max' or 'min', got {goal!r}")
    metric = d.get("metric")
    if metric is None:
        raise SweepError(f"search.metric is missing: the eval.csv column to {goal}imise ({', '.join(METRICS)})")
    if metric not in METRICS:
        raise SweepError(f"search.metric {metric!r} is not an eval.csv column; one of {', '.join(METRICS)}")
    if metric == "score" and not all(env.startswith("mt:") for env in spec.envs):
        raise SweepError("search.metric 'score' is written by multitask (mt:) runs only; use return_mean")
    stop = d.get("early_stopping", "none")
    if stop not in EARLY_STOPPING:
        raise SweepError(f"unknown search.early_stopping {stop!r}; one of {', '.join(EARLY_STOPPING)}")
    grace = d.get("grace_steps")
    if grace is not None and (not _is_int(grace) or grace < 1):
        raise SweepError(f"search.grace_steps must be an integer >= 1 (env steps), got {grace!r}")
    for key, schedulers in (
        ("reduction_factor", ("asha",)),
        ("min_trials", ("median",)),
        ("grace_steps", ("asha", "median")),
    ):
        if key in d and stop not in schedulers:
            raise SweepError(
                f"search.{key} applies to early_stopping = {' or '.join(map(repr, schedulers))}, not {stop!r}"
            )
    rf = d.get("reduction_factor", 3.0)
    if not _is_number(rf) or rf <= 1:
        raise SweepError(f"search.reduction_factor must be a number > 1, got {rf!r}")
    min_trials = d.get("min_trials", 3)
    if not _is_int(min_trials) or min_trials < 1:
        raise SweepError(f"search.min_trials must be an integer >= 1, got {min_trials!r}")
    space = d.get("space")
    if not isinstance(space, dict) or not space:
        raise SweepError(
            "search.space is missing or empty: give the ranges, e.g. [search.space] "
            '"actor-lr" = { low = 1e-4, high = 1e-3, log = true }'
        )
    ranges = tuple(parse_range(name, v) for name, v in space.items())
    for r in ranges:
        flag = _flag_name(r.name)
        if flag in OWNED_FLAGS or flag == "seed":
            raise SweepError(f"search.space.{r.name}: the sweep sets --{flag} itself; it cannot be searched")
        if flag == "total-steps" and stop != "none":
            raise SweepError(
                "search.space: total-steps cannot be searched with early stopping (the scheduler "
                "compares trials of one length)"
            )
    _check_search_shape(spec)
    return Search(mode, n, metric, ranges, seed, goal, stop, grace, float(rf), min_trials)


def _check_search_shape(spec: Spec):
    """A search tunes one agent on one env, one flag set, all seeds in each trial."""
    for key in ("agents", "envs"):
        if len(getattr(spec, key)) != 1:
            raise SweepError(
                f"a search tunes one agent on one env; this one has {key} {getattr(spec, key)} "
                "(run one search per agent and env)"
            )
    if len(spec.variants) != 1:
        raise SweepError(f"a search takes one variant (its fixed flags), got {sorted(spec.variants)}")
    if spec.grid:
        raise SweepError("a search has no [grid]: give the values as a list of choices in [search.space]")
    if spec.seeds_per_trial is not None and spec.seeds_per_trial < spec.seeds:
        raise SweepError(
            "a search runs all its seeds in each trial (its metric is their mean): leave seeds_per_trial out"
        )


def parse_range(name: str, v) -> Range:
    """``[v1, v2, ...]`` (choices) or ``{ low = L, high = H, log = false }`` (ints when both bounds are)."""
    where = f"search.space.{name}"
    if isinstance(v, list):
        if not v:
            raise SweepError(f"{where}: an empty list of choices")
        if not all(isinstance(x, (bool, int, float, str)) for x in v):
            raise SweepError(f"{where}: choices are numbers, strings or booleans, got {v!r}")
        if len({(type(x), x) for x in v}) != len(v):
            raise SweepError(f"{where}: a choice is listed twice: {v!r}")
        return Range(name, "choice", choices=tuple(v))
    if not isinstance(v, dict):
        raise SweepError(
            f"{where}: give a range {{ low = ..., high = ... }} (with log = true for a log scale) "
            f"or a list of choices, got {v!r}"
        )
    unknown = set(v) - {"low", "high", "log"}
    if unknown:
        raise SweepError(f"{where}: unknown range keys {sorted(unknown)}; a range has low, high and log")
    if "low" not in v or "high" not in v:
        raise SweepError(f"{where}: a range needs both low and high, got {v!r}")
    low, high, log = v["low"], v["high"], v.get("log", False)
    if not _is_number(low) or not _is_number(high):
        raise SweepError(f"{where}: low and high must be numbers, got {low!r} and {high!r}")
    if not isinstance(log, bool):
        raise SweepError(f"{where}: log must be true or false, got {log!r}")
    if not low < high:
        raise SweepError(f"{where}: low ({low!r}) must be below high ({high!r})")
    if log and low <= 0:
        raise SweepError(f"{where}: a log range needs low > 0, got {low!r}")
    if _is_int(low) and _is_int(high):
        return Range(name, "int", low, high, log)
    return Range(name, "float", float(low), float(high), log)


def draw(r: Range, rng) -> float | int | bool | str:
    """One value of ``r`` from ``rng`` (a ``random.Random``); floats kept to 4 significant digits."""
    if r.kind == "choice":
        return r.choices[rng.randrange(len(r.choices))]
    if r.kind == "int":
        low, high = int(r.low), int(r.high)
        if not r.log:
            return rng.randint(low, high)
        return min(high, max(low, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))
    if r.log:
        x = math.exp(rng.uniform(math.log(r.low), math.log(r.high)))
    else:
        x = rng.uniform(r.low, r.high)
    return min(r.high, max(r.low, float(f"{x:.4g}")))


def random_params(search: Search, index: int) -> tuple:
    """Random trial ``index``'s values, ``((flag, value), ...)``: each drawn from (seed, index, flag)
    alone, so a trial does not change when ``num_trials`` or another range does."""
    import random

    return tuple((r.name, draw(r, random.Random(f"{search.seed}/{index}/{r.name}"))) for r in search.space)


def search_label(spec: Spec, index: int) -> str:
    variant = next(iter(spec.variants))
    return f"t{index:03d}" if variant == "base" else f"{variant},t{index:03d}"


def _search_trial(spec: Spec, label: str, params: tuple, index: int | None) -> Trial:
    agent, env = spec.agents[0], spec.envs[0]
    vflags = next(iter(spec.variants.values()))
    flags = {**spec.flags, **spec.agent_flags.get(agent, {}), **vflags, **dict(params)}
    [trial] = _seed_groups(spec, agent, env, label, flags, index, tuple(params))
    return trial


def search_trial(spec: Spec, index: int, params: tuple) -> Trial:
    """Search trial ``index`` with the values ``params`` (over the sweep's fixed flags)."""
    return _search_trial(spec, search_label(spec, index), params, index)


def probe_trials(spec: Spec, search: Search) -> list[Trial]:
    """Trials at the space's corners (every range at its low end, then at its high end) for the checks
    before an optuna search, whose values are chosen as it runs."""
    ends = [
        tuple((r.name, r.choices[0] if r.kind == "choice" else r.low) for r in search.space),
        tuple((r.name, r.choices[-1] if r.kind == "choice" else r.high) for r in search.space),
    ]
    return [_search_trial(spec, label, params, None) for label, params in zip(("low-corner", "high-corner"), ends)]


def check_space(spec: Spec, search: Search):
    """Each range's flag through train.py's parser at its ends (and each choice): a flag the agent does
    not take, or a value it refuses, is a SweepError naming the range."""
    base = search_trial(spec, 0, ())
    if _refusal(list(base.argv)) is not None:
        return  # the fixed flags themselves: the preflight names the trial
    for r in search.space:
        for value in r.choices if r.kind == "choice" else (r.low, r.high):
            text = _refusal([*base.argv, *to_args({r.name: value})])
            if text is None:
                continue
            unknown = re.search(r"Unrecognized options:\s*(.+)", text)
            if unknown and f"--{_flag_name(r.name)}" in [x.strip() for x in unknown.group(1).split(",")]:
                hint = re.search(r"Perhaps you meant:\s*(--[\w.-]+)", text)
                raise SweepError(
                    f"search.space.{r.name}: train.py {base.agent} has no flag --{_flag_name(r.name)}"
                    + (f" (perhaps {hint.group(1)}?)" if hint else "")
                )
            lines = text.splitlines()
            why = next(
                (line for line in lines if line.startswith(("Error parsing", "Unrecognized options:"))),
                " ".join(lines[:2]),
            )
            given = " ".join(to_args({r.name: value}))
            raise SweepError(f"search.space.{r.name}: train.py {base.agent} refuses {given}: {why}")


def _refusal(argv: list[str]) -> str | None:
    """None if train.py's parser takes ``argv``, else its complaint: a message, or the lines of tyro's
    box without its frame."""
    from plasticity_zoo.training.cli import parse
    from plasticity_zoo.training.run import is_user_error

    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            parse(argv)
    except BaseException as e:
        if isinstance(e, SystemExit) and not isinstance(e.code, str):
            lines = [" ".join(line.strip(" │|╭╮╰╯─").split()) for line in out.getvalue().splitlines()]
            return "\n".join(line for line in lines if line and not set(line) <= set("-─ ")) or "refused"
        if is_user_error(e):
            return str(e.code) if isinstance(e, SystemExit) else str(e)
        raise
    return None


def run_budget(trial: Trial) -> tuple[int, int]:
    """(total steps, eval-every) of ``trial``'s run, train.py's defaults where its flags do not say."""
    from plasticity_zoo.training.cli import parse

    cfg = parse(list(trial.argv))
    return int(cfg.total_steps), int(cfg.eval_every)


def check_search_dir(ledger: Ledger, search: Search | None):
    """A sweep directory holds one kind of sweep: a grid, or one search whose settings do not change."""
    old = ledger.recorded_spec()
    if not ledger.recorded() or old is None:
        return
    old_search = old.get("search") or {}
    if search is None:
        if old_search:
            raise SweepError(
                f"sweep directory {ledger.root} holds a {old_search.get('mode')} search; give this "
                "grid sweep another --dir"
            )
        return
    if not old_search:
        raise SweepError(f"sweep directory {ledger.root} holds a grid sweep; give this search another --dir")
    try:
        before = parse_search(Spec(**old)).settings()
    except (SweepError, TypeError) as e:
        raise SweepError(f"{ledger.root / 'sweep.json'} records a search this version cannot read ({e})") from None
    now = search.settings()
    changed = [key for key in now if now[key] != before.get(key)]
    if changed:
        raise SweepError(
            f"sweep directory {ledger.root} holds a search with other {', '.join(changed)} "
            f"({', '.join(f'{k} = {before[k]}' for k in changed if k != 'space') or 'see sweep.json'}); "
            "give this search another --dir (num_trials and early stopping may change)"
        )


@dataclass
class SearchPlan:
    trials: list[Trial]
    """the search's trials known now, by index: recorded ones, and every one of a random search"""
    finished: list[Trial]
    """done or stopped early: not run again"""
    todo: list[Trial]
    """known trials to run, in order: resumed from their checkpoint, restarted, or new (random)"""
    new: int
    """trials still to ask Optuna for"""
    next_index: int


def plan_search(spec: Spec, search: Search, ledger: Ledger) -> SearchPlan:
    """What a (re)launch of a search runs; refuses a directory whose trials the sweep would change."""
    check_search_dir(ledger, search)
    entries = sorted((r for r in ledger.recorded().values() if "index" in r), key=lambda r: r["index"])
    recorded = [
        search_trial(spec, r["index"], tuple((g.name, r["params"][g.name]) for g in search.space)) for r in entries
    ]
    next_index = 1 + max((r["index"] for r in entries), default=-1)
    if search.mode == "random":
        trials = [search_trial(spec, i, random_params(search, i)) for i in range(max(search.num_trials, next_index))]
        new = 0
    else:
        trials, new = recorded, max(0, search.num_trials - len(recorded))
    ledger.check_compatible(trials)
    finished = [t for t in trials if ledger.status(t.name)["state"] in FINISHED]
    todo = [t for t in trials if t not in finished and _number(t) < search.num_trials]
    return SearchPlan(trials, finished, todo, new, max(next_index, len(trials)))


def _number(t: Trial) -> int:
    return -1 if t.index is None else t.index


def eval_points(run_dir, metric: str, seeds: int) -> list[tuple[int, float]]:
    """(step, mean over the run's seeds of ``metric``) of each evaluation in ``run_dir/eval.csv`` that
    every seed has written (a multitask run's ``task=all`` rows); a line still being written is left out,
    and a step evaluated again after a resume counts its latest rows."""
    try:
        text = (Path(run_dir) / "eval.csv").read_text()
    except OSError:
        return []
    text = text[: text.rfind("\n") + 1]
    values: dict[int, list[float]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("task") not in (None, "all"):  # training/logger.py: AGGREGATE_TASK
            continue
        try:
            values.setdefault(int(row["step"]), []).append(float(row[metric]))
        except (KeyError, TypeError, ValueError):
            continue
    return [(step, sum(v[-seeds:]) / seeds) for step, v in sorted(values.items()) if len(v) >= seeds]


class EvalFeed:
    """A running trial's new evaluations, each once, in order.  The last evaluation (at
    ``total_steps``) is held back until the run has ended (``final``), so that a scheduler's decision
    on it cannot stop a run that is finishing."""

    def __init__(self, run_dir, metric: str, seeds: int, total_steps: int):
        self.run_dir, self.metric, self.seeds, self.total_steps = Path(run_dir), metric, seeds, total_steps
        self.last = -1

    def new(self, final: bool = False) -> list[tuple[int, float]]:
        points = [
            (s, v)
            for s, v in eval_points(self.run_dir, self.metric, self.seeds)
            if s > self.last and (final or s < self.total_steps)
        ]
        if points:
            self.last = points[-1][0]
        return points


def last_value(ledger: Ledger, trial: Trial, metric: str) -> tuple[int, float] | None:
    """(step, value) of ``trial``'s last evaluation; for a trial stopped early, the one it was stopped at
    (train.py may evaluate once more as it ends its iteration)."""
    points = eval_points(ledger.run_dir(trial), metric, trial.seeds)
    s = ledger.status(trial.name)
    if s["state"] == "stopped" and isinstance(s.get("stopped_at"), int):
        points = [p for p in points if p[0] <= s["stopped_at"]]
    return points[-1] if points else None


def stop_reason(search: Search, step: int, value: float) -> str:
    if search.early_stopping == "asha":
        return (
            f"ASHA (reduction factor {search.reduction_factor:g}): {search.metric} {value:.4g} at step {step} "
            f"was not among the best 1/{search.reduction_factor:g} of the trials that reached this step"
        )
    return (
        f"median stopping: the trial's best {search.metric} by step {step} ({value:.4g} now) was worse than the "
        "median of the other trials' running means at this step"
    )


def record_stop(ledger: Ledger, trial: Trial, search: Search, step: int, value: float, total_steps: int) -> dict:
    """A trial stopped early by the scheduler: its status (``stopped``), ``runs/<trial>/stopped.json``
    and a line in its log say who stopped it, where and why."""
    why = {
        "stopped_by": search.early_stopping,
        "step": step,
        "total_steps": total_steps,
        "metric": search.metric,
        "value": value,
        "reason": stop_reason(search, step, value),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    d = ledger.run_dir(trial)
    d.mkdir(parents=True, exist_ok=True)
    _write_json(d / "stopped.json", why)
    with open(ledger.log(trial), "a") as f:
        f.write(f"\n=== {why['time']}: stopped early at step {step} of {total_steps}: {why['reason']}\n")
    ledger.set_status(
        trial.name, state="stopped", stopped_by=search.early_stopping, stopped_at=step, reason=why["reason"]
    )
    return why


def search_rows(ledger: Ledger, trials: list[Trial], search: Search) -> list[dict]:
    """One row per trial, best first: finished ones by their last ``metric``, then those stopped early,
    then the rest by index."""
    sign = -1 if search.goal == "max" else 1
    rows = []
    for t in trials:
        s = ledger.status(t.name)
        ev = last_value(ledger, t, search.metric)
        rows.append(
            {
                "trial": t.label,
                "name": t.name,
                "index": t.index,
                "state": s["state"],
                "step": None if ev is None else ev[0],
                "total_steps": s.get("total_steps"),
                search.metric: None if ev is None else ev[1],
                "stopped_by": s.get("stopped_by"),
                "params": dict(t.params),
            }
        )
    order = {"done": 0, "stopped": 1}

    def key(r):
        if r["state"] in order and r[search.metric] is not None:
            return order[r["state"]], 0, sign * r[search.metric]
        return order.get(r["state"], 2), 1, r["index"]

    return sorted(rows, key=key)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v).lower() if isinstance(v, bool) else str(v)


def values_text(params) -> str:
    """A trial's values, ``flag=value ...`` (floats to 4 significant digits)."""
    return " ".join(f"{k}={_fmt(v)}" for k, v in dict(params).items())


def _csv_value(v):
    return str(v).lower() if isinstance(v, bool) else v


def search_table(ledger: Ledger, trials: list[Trial], search: Search) -> str:
    """The search's table: each trial's state (stopped early ones marked), progress, metric and values."""
    head = ("trial", "state", "step", search.metric, "values")
    lines = [head]
    for r in search_rows(ledger, trials, search):
        state = f"stopped early ({r['stopped_by']})" if r["state"] == "stopped" else r["state"]
        step = "" if r["step"] is None else (f"{r['step']}/{r['total_steps']}" if r["total_steps"] else str(r["step"]))
        value = "" if r[search.metric] is None else f"{r[search.metric]:.1f}"
        lines.append((r["trial"], state, step, value, values_text(r["params"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def write_search_summary(ledger: Ledger, trials: list[Trial], search: Search) -> Path:
    """``SWEEP/search.csv``: the table's rows, best first, one column per searched flag."""
    path = ledger.root / "search.csv"
    names = [r.name for r in search.space]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", "name", "state", "stopped_by", "step", "total_steps", search.metric, *names])
        for r in search_rows(ledger, trials, search):
            w.writerow(
                [
                    r["trial"],
                    r["name"],
                    r["state"],
                    r["stopped_by"] or "",
                    r["step"] if r["step"] is not None else "",
                    r["total_steps"] or "",
                    "" if r[search.metric] is None else r[search.metric],
                    *[_csv_value(r["params"].get(n, "")) for n in names],
                ]
            )
    return path


def search_missing(mode: str) -> str | None:
    """None when what ``mode`` runs on is installed, else the error that says how to install it."""
    missing = []
    try:
        import ray.tune  # noqa: F401
    except ImportError:
        missing.append("Ray Tune")
    if mode == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            missing.append("Optuna")
    if not missing:
        return None
    return (
        f"search mode {mode!r} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
        f"not installed: {EXTRA}"
    )


def optuna_space(search: Search) -> dict:
    """The space as Optuna distributions (for Ray Tune's OptunaSearch)."""
    from optuna import distributions as od

    out: dict[str, od.BaseDistribution] = {}
    for r in search.space:
        if r.kind == "choice":
            out[r.name] = od.CategoricalDistribution(r.choices)
        elif r.kind == "int":
            out[r.name] = od.IntDistribution(int(r.low), int(r.high), log=r.log)
        else:
            out[r.name] = od.FloatDistribution(r.low, r.high, log=r.log)
    return out
