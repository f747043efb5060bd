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
"""
from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

SPEC_KEYS = {"agents", "envs", "seeds", "seeds_per_trial", "retries", "cpus_per_trial", "gpus_per_trial",
             "flags", "agent_flags", "variants", "grid"}
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


def read_spec(path) -> dict:
    """The keys of a TOML sweep file (a SweepError names the file and the problem)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
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
            raise SweepError(f"sweep key {key!r} must be a number {'> 0' if key == 'cpus_per_trial' else '>= 0'}, "
                             f"got {v!r}")
    if spec.gpus_per_trial > 1 and spec.gpus_per_trial != int(spec.gpus_per_trial):
        raise SweepError(f"gpus_per_trial above 1 must be whole GPUs, got {spec.gpus_per_trial}")
    for key in ("flags", "agent_flags", "variants", "grid"):
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
    for where, flags in [("flags", spec.flags), ("grid", spec.grid), *[(f"variants.{n}", f) for n, f in
                                                                       spec.variants.items()],
                         *[(f"agent_flags.{a}", f) for a, f in spec.agent_flags.items()]]:
        for name in flags:
            if _flag_name(name) in OWNED_FLAGS:
                raise SweepError(f"{where}: the sweep sets --{_flag_name(name)} itself (use the sweep key "
                                 f"{'seeds' if name == 'seeds' else 'envs' if name == 'env' else name!r} or leave it out)")
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


def expand(spec: Spec) -> list[Trial]:
    """Every trial: agents x envs x variants x grid points x seed groups, in that order."""
    base_seed = int(spec.flags.get("seed", 0))
    k = spec.seeds_per_trial or spec.seeds
    grid_keys = list(spec.grid)
    trials = []
    for agent, env, (variant, vflags), point in itertools.product(
            spec.agents, spec.envs, spec.variants.items(), itertools.product(*spec.grid.values())):
        label = variant + "".join(f",{_flag_name(key)}={_value_name(v)}" for key, v in zip(grid_keys, point))
        if len(spec.agents) > 1:
            label = f"{agent} {label}"
        flags = {**spec.flags, **spec.agent_flags.get(agent, {}), **vflags, **dict(zip(grid_keys, point))}
        flags.pop("seed", None)
        for first in range(0, spec.seeds, k):
            n = min(k, spec.seeds - first)
            seed = base_seed + first
            name = "__".join([_env_slug(env), agent, _env_slug(label.split(" ")[-1]), f"seed{seed}"
                              + (f"-{seed + n - 1}" if n > 1 else "")])
            argv = (agent, "--env", env, "--seeds", str(n), "--seed", str(seed), "--label", label,
                    "--no-progress", *to_args(flags))
            trials.append(Trial(name, agent, env, label, seed, n, argv))
    names = [t.name for t in trials]
    if len(set(names)) != len(names):
        raise SweepError("two trials got the same name (variant or grid values that differ only in characters "
                         "a directory name cannot hold); rename the variants")
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
        path = self.root / "sweep.json"
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())["trials"]
        except (OSError, ValueError, KeyError) as e:
            raise SweepError(f"{path} is not a readable sweep record ({e})") from None

    def check_compatible(self, trials: list[Trial]):
        """A trial already in this sweep directory must have the same command (else refuse)."""
        old = self.recorded()
        for t in trials:
            if t.name in old and tuple(old[t.name]["argv"]) != t.argv:
                raise SweepError(f"sweep directory {self.root} already holds trial {t.name} with other flags "
                                 f"({' '.join(old[t.name]['argv'])}); give this sweep another --dir")

    def record(self, trials: list[Trial], spec: dict):
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("runs", "status", "logs"):
            (self.root / sub).mkdir(exist_ok=True)
        merged = {**self.recorded(), **{t.name: {"argv": list(t.argv), "agent": t.agent, "env": t.env,
                                                 "label": t.label, "seed": t.seed, "seeds": t.seeds}
                                        for t in trials}}
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
                    raise SweepError(f"trial {t.name}: train.py {' '.join(t.argv)} is not a valid command "
                                     "(tyro's message above)") from None
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
        rows.append((t.name, s["state"], str(s.get("attempts", 0)),
                     "" if step is None else (f"{step}/{total}" if total else str(step)),
                     "" if ev is None else f"{ev[1]:.1f} @{ev[0]}"))
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
