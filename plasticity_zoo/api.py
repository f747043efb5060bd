"""The zoo from Python (a notebook, a script of one's own): the command line's runs, as functions.

    import plasticity_zoo as pz

    result = pz.train("sac", env="Pendulum-v1", total_steps=20_000, seeds=3)
    result.run_dir, result.last_eval          # where it wrote, its last evaluation return
    policy = result.policy()                  # one observation in, one action out, in the env's units
    pz.plot.make_figure(...)                  # plasticity_zoo.analysis: plots, reports, statistics

``train`` takes what ``scripts/train.py`` takes: an agent name and its flags as keywords
(``total_steps=2000`` is ``--total-steps 2000``; ``network={"width": 64}`` or ``network__width=64`` is
``--network.width 64``; ``plasticity={"redo": True}`` is ``--plasticity.redo``; ``preset="..."`` is
``--preset ...``), or a ``RunConfig`` built with ``config``.  The same parser, presets, checks and
paper protocols apply, so a run started here is the run the same command line would start, and its
directory is read by ``evaluate.py``, ``plot.py``, ``report.py`` and ``--resume`` alike.  A user
error raises ``ValueError``/``SystemExit`` with the message the command line prints as ``error:``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Result", "config", "flags", "train", "resume", "restore"]


def _flag(name: str, value: Any) -> list[str]:
    """One keyword as command-line arguments: booleans as switches, sequences as repeated values."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        if "." in flag:  # nested: --network.layer-norm / --network.no-layer-norm
            head, _, tail = flag.rpartition(".")
            return [flag] if value else [f"{head}.no-{tail}"]
        return [flag] if value else ["--no-" + flag[2:]]
    if value is None:
        return [flag, "None"]
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def flags(**keywords: Any) -> list[str]:
    """Keywords as the command line's flags (``config`` and ``train`` use this; shown for reference).

    >>> flags(total_steps=2000, network={"width": 16}, plasticity__redo=True)
    ['--total-steps', '2000', '--network.width', '16', '--plasticity.redo']"""
    out: list[str] = []
    for name, value in keywords.items():
        name = name.replace("__", ".")
        if isinstance(value, Mapping):
            for sub, v in value.items():
                out += flags(**{f"{name}__{sub}": v})
        else:
            out += _flag(name, value)
    return out


def config(agent: str, *args: str, preset: str | Sequence[str] | None = None, **keywords: Any):
    """The ``RunConfig`` the command line ``train.py AGENT ARGS... --preset P --KEYWORD VALUE ...`` builds."""
    from plasticity_zoo.training.cli import parse

    names = [preset] if isinstance(preset, str) else list(preset or ())
    return parse([agent, *args, *(a for name in names for a in ("--preset", name)), *flags(**keywords)])


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished (or stopped) ``train`` call: its run directory and what the loop returned."""

    run_dir: Path
    step: int  # env steps (offline agents: updates) done
    last_eval: float  # the last evaluation's mean return over seeds (NaN if none ran)
    out: dict = dataclasses.field(repr=False)  # everything the loop returned (the final agent state included)

    def restore(self, step: int | None = None):
        """The run's agent at its newest checkpoint (or ``step``): ``restore(self.run_dir, step)``."""
        return restore(self.run_dir, step)

    def policy(self, seed: int = 0):
        """Seed ``seed``'s deterministic policy as the run evaluates it, acting in the env's units."""
        return self.restore().env_policy(seed)


def train(agent, *args: str, overwrite: bool = False, **keywords: Any) -> Result:
    """Train a run as ``scripts/train.py`` does, in this process; returns when it ends.

    ``agent`` is an agent name (then ``args`` and ``keywords`` are its flags, as in ``config``) or a
    ``RunConfig``.  ``overwrite=True`` moves a run already in ``run_dir`` aside (``--overwrite``)."""
    from plasticity_zoo.networks.runtime import use_persistent_cache
    from plasticity_zoo.training.config import RunConfig
    from plasticity_zoo.training.run import preflight, run

    use_persistent_cache()
    if isinstance(agent, RunConfig):
        if args or keywords:
            raise ValueError("train(RunConfig, ...) takes no further flags: build the config with config(...)")
        cfg = agent
    else:
        cfg = config(agent, *args, **keywords)
    preflight(cfg, overwrite=overwrite)
    out = run(cfg, check=False, overwrite=overwrite)
    return Result(Path(out["run_dir"]), int(out["step"]), float(out["last_eval"]), out)


def resume(run_dir, **keywords: Any) -> Result:
    """Continue the run in ``run_dir`` (``train.py --resume RUN_DIR``), e.g. ``total_steps=`` a larger total."""
    from plasticity_zoo.training.cli import parse
    from plasticity_zoo.training.run import preflight, run

    cfg = parse(["--resume", str(run_dir), *flags(**keywords)])
    preflight(cfg)
    out = run(cfg, check=False)
    return Result(Path(out["run_dir"]), int(out["step"]), float(out["last_eval"]), out)


def restore(run_dir, step: int | None = None):
    """A run's agent at its newest intact checkpoint (or ``step``): a ``RestoredRun`` with ``.policy(seed)``
    (the unit action box the agents act in), ``.env_policy(seed)`` (the env's units), ``.evaluator()``,
    ``.state``, ``.cfg``.  Nothing in the directory is written."""
    from plasticity_zoo.analysis.restore import restore_policy

    return restore_policy(run_dir, step)
