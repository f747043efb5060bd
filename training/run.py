"""Entry point shared by scripts/train.py: check the config, run it in its loop (``training.loops.loop_for``),
set up the run dir.

``preflight(cfg, agent)`` runs every check that needs no training (flag values and their
relations, env id, dataset, plasticity interventions, the run directory, the checkpoint to
resume) before ``run`` creates a run directory, so a mistyped command fails at once and leaves
nothing behind.

A run directory receives one run.  A directory that already holds a run's files (``RUN_FILES``)
is refused unless the command resumes it (``--resume DIR``, which needs a checkpoint) or starts
over with ``overwrite`` (``--overwrite``): the old run's files are then moved, not deleted, into
``DIR/.replaced-<time>/``.  ``run`` claims the directory by creating its ``config.json``
exclusively, so two commands started at once cannot share it either.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from plasticity_zoo import agents
from plasticity_zoo.training import config as config_lib
from plasticity_zoo.training import loops
from plasticity_zoo.training.config import RunConfig

# What a mistaken command line raises: scripts/train.py prints these as one `error:` line.  A
# SystemExit counts only when it carries a message (tyro's own exits carry a status code).
# NonFiniteLossError (a RuntimeError) is not one of them: it reports a diverged run.
USER_ERRORS = (ValueError, OSError, SystemExit)


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, USER_ERRORS) and not (isinstance(e, SystemExit) and not isinstance(e.code, str))


def load_config(run_dir) -> RunConfig:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise SystemExit(f"--resume {run_dir}: {path} not found (is this a run directory?)")
    try:
        d = json.loads(path.read_text())
        agent = agents.get(d["agent_name"])
        return config_lib.from_json(d, agent.CONFIG)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--resume {run_dir}: {path} is not a readable run config ({type(e).__name__}: {e})") from e


def final_step(cfg: RunConfig) -> int:
    """The step a finished run ends at (what ``--total-steps`` counts): its loop's ``last_step``
    (``total_steps``, except an on-policy agent's run, which ends at its last whole rollout).  A run
    whose last evaluation is below it stopped early."""
    agent = agents.get(cfg.agent_name)
    return loops.loop_for(cfg, agent).last_step(cfg, agent)


# What a run writes into its directory; a directory holding any of them holds a run.
RUN_FILES = ("config.json", "metrics.csv", "eval.csv", "dataset.json", "ckpt", "tb", "wandb")
REPLACED = ".replaced-"  # DIR/.replaced-<time>/: a run moved aside by --overwrite


def run_files(run_dir) -> list[str]:
    """The names in ``RUN_FILES`` that ``run_dir`` holds (none if it does not exist)."""
    d = Path(run_dir)
    return [name for name in RUN_FILES if (d / name).exists()] if d.is_dir() else []


def holds_a_run(run_dir, held) -> str:
    """The refusal for a new run into ``run_dir``, which holds ``held`` (from ``run_files``)."""
    from plasticity_zoo.training import checkpoint

    d = Path(run_dir)
    over = f"pass --overwrite to move its files into {d / REPLACED}<time>/ and start a new run there"
    if checkpoint.latest(d) is not None:
        return f"run directory {d} already holds a run; continue it with --resume {d}, or {over}"
    return (
        f"run directory {d} already holds a run that stopped before its first checkpoint "
        f"({', '.join(held)}; nothing to resume): {over}, or choose another --run-dir"
    )


def check_relations(cfg: RunConfig, agent):
    """Settings that are each valid but cannot work together (a ValueError naming the flags)."""
    if isinstance(cfg.env, str) and cfg.env.startswith("mt:"):
        from plasticity_zoo.envs.multitask import member_ids

        tasks = len(member_ids(cfg.env))
        if cfg.num_envs % tasks:
            raise ValueError(
                f"--env {cfg.env} has {tasks} tasks stepping side by side: --num-envs must be a "
                f"multiple of {tasks} (one env per task: --num-envs {tasks}), got {cfg.num_envs}"
            )
    starts = getattr(cfg.agent, "learning_starts", None)
    if agent.KIND == "offpolicy" and starts is not None and starts >= cfg.total_steps:
        raise ValueError(
            f"--learning-starts {starts} is not below --total-steps {cfg.total_steps}: the run would "
            "only take random actions and train nothing (lower --learning-starts or raise --total-steps)"
        )


def preflight(cfg: RunConfig, agent=None, overwrite: bool = False):
    """Every check a run can make before training, cheaply and before any run directory exists.

    Raises what the loops raise for the same mistakes (ValueError, SystemExit with a message,
    ``envs.datasets.DatasetError``), through the loops' own helpers: for ``--resume`` a run
    directory without a checkpoint (without one, a ``--run-dir`` that already holds a run, unless
    ``overwrite``); counts below 1 and the agent kind's checks (PPO's batch arithmetic); settings
    that cannot work together (``check_relations``); an unknown or malformed env id (the env is
    built once and closed) or, for an offline agent, a missing, unreadable or mismatched dataset;
    an intervention the agent cannot take; the agent's own option checks (ranges such as the
    discount's, the replay's batch and capacity).
    """
    from plasticity_zoo.plasticity.hooks import check_applicable

    agent = agents.get(cfg.agent_name) if agent is None else agent
    if cfg.resume:
        from plasticity_zoo.training import checkpoint

        if overwrite:
            raise SystemExit(f"--overwrite starts a new run; it cannot be combined with --resume {cfg.resume}")
        if not (Path(cfg.resume) / "config.json").is_file():
            load_config(cfg.resume)  # raises, naming the missing config.json
        if checkpoint.latest(cfg.resume) is None:
            raise SystemExit(
                f"--resume {cfg.resume}: no checkpoint found in {Path(cfg.resume) / 'ckpt'} "
                "(the run stopped before its first checkpoint: start it again with --overwrite, "
                "which moves its files aside, or in another --run-dir)"
            )
    elif cfg.run_dir and not overwrite and run_files(cfg.run_dir):
        raise SystemExit(holds_a_run(cfg.run_dir, run_files(cfg.run_dir)))
    loops.check(cfg, agent)  # counts below 1, the kind's own arithmetic, the device loop's needs
    if cfg.wandb:
        from plasticity_zoo.training.logger import require_wandb

        require_wandb()
    check_relations(cfg, agent)
    # an unknown or malformed env id fails here; for an offline agent a missing, unreadable or
    # mismatched dataset, and cfg becomes the agent's config as the run will build it
    cfg, obs_dim, act_dim = loops.loop_for(cfg, agent).resolve(cfg, agent)
    check_applicable(default_metrics(cfg, agent, log=lambda *_: None).plasticity, agent, cfg.agent_name)
    check_agent_config(cfg, agent, obs_dim, act_dim)


def check_agent_config(cfg: RunConfig, agent, obs_dim: int, act_dim: int):
    """The agent's own option checks (they run in ``agent.init``) and the optimizer interventions
    (``--plasticity.kron`` / ``--plasticity.ne``), by tracing one agent's init abstractly: no
    arrays are allocated and nothing is compiled."""
    import jax

    from plasticity_zoo.plasticity.hooks import check_optimizers, static_plasticity
    from plasticity_zoo.training.loop import agent_config

    static = static_plasticity(cfg.plasticity, agent)
    agent_cfg = agent_config(agent, cfg)
    state = jax.eval_shape(lambda k: agent.init(k, obs_dim, act_dim, agent_cfg, cfg.network, static), jax.random.key(0))
    check_optimizers(cfg.plasticity, agent, cfg.agent_name, state)


def move_aside(run_dir: Path) -> Path | None:
    """``--overwrite``: move everything in ``run_dir`` (but earlier ``.replaced-*`` folders) into a new
    ``run_dir/.replaced-<time>/``, say so, and return it (None if there was nothing to move)."""
    if not run_dir.is_dir():
        return None
    old = sorted(p for p in run_dir.iterdir() if not p.name.startswith(REPLACED))
    if not old:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, i = run_dir / f"{REPLACED}{stamp}", 1
    while dest.exists():
        dest, i = run_dir / f"{REPLACED}{stamp}-{i}", i + 1
    dest.mkdir()
    for p in old:
        os.replace(p, dest / p.name)
    print(f"--overwrite: moved the previous run's files ({', '.join(p.name for p in old)}) into {dest}/")
    return dest


def claim(run_dir: Path, cfg: RunConfig, default: bool) -> tuple[Path, bool]:
    """Make ``run_dir`` this run's: create it and its config.json exclusively -> (run_dir, whether
    it existed).  A directory that holds a run is refused; for the default directory (named by the
    time to the second) the next free ``<name>-<i>`` is taken instead."""
    for i in range(1000):
        d = run_dir if i == 0 else run_dir.with_name(f"{run_dir.name}-{i}")
        existed = d.exists()
        d.mkdir(parents=True, exist_ok=True)
        held = run_files(d)
        if not held:
            try:
                with open(d / "config.json", "x") as f:  # exclusive: of two runs started at once, one wins
                    f.write(config_lib.dump(cfg))
                return d, existed
            except FileExistsError:
                held = ["config.json"]
        if not default:
            raise SystemExit(holds_a_run(d, held))
    raise SystemExit(f"no free run directory next to {run_dir}")


def _empty_log(p: Path) -> bool:
    """A run file a user would not miss: config.json, dataset.json or a CSV log without rows."""
    if p.name in ("config.json", "dataset.json"):
        return True
    if p.suffix == ".csv" and p.is_file():
        with open(p) as f:
            return sum(1 for line in f if line.strip()) <= 1
    return False


def discard_empty_start(run_dir: Path, existed: bool):
    """After a user error inside the loop: remove the new run's files if they hold nothing but
    empty logs (and the directory if this run created it and it is empty now)."""
    files = [run_dir / name for name in run_files(run_dir)]
    if not all(_empty_log(p) for p in files):
        return
    for p in files:
        p.unlink(missing_ok=True)
    if not existed and not any(run_dir.iterdir()):
        run_dir.rmdir()


def protocol_defaults(cfg: RunConfig, agent, given: frozenset | None = None, log=print) -> RunConfig:
    """The agent's paper schedule (``agent.protocol(spec, num_envs)``, e.g. ScaleMRL's for ``mrq-mt``)
    applied to a config that leaves its ``learning_starts`` unset (None).

    ``learning_starts`` takes the protocol's value; each ``RunConfig`` field the protocol names
    (``eval_every``, ``eval_episodes``) takes it unless the user set it: ``given`` holds the names of the
    fields set on the command line (``training.cli``); None (a config built in Python) counts a field as
    set when it differs from ``RunConfig``'s default.  A resolved config (``learning_starts`` an int, as
    every ``config.json`` holds) is returned as it is, so applying this twice changes nothing."""
    protocol = getattr(agent, "protocol", None)
    if protocol is None or cfg.agent is None or getattr(cfg.agent, "learning_starts", 0) is not None:
        return cfg
    from plasticity_zoo.envs.multitask import is_multitask, task_spec

    if not isinstance(cfg.env, str) or not is_multitask(cfg.env):
        return cfg  # the agent refuses the env in preflight (with_tasks), naming what it needs
    values = protocol(task_spec(cfg.env, cfg.action_repeat), cfg.num_envs)
    defaults = RunConfig()
    run_fields = {k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(RunConfig)}}
    taken = {
        k: v
        for k, v in run_fields.items()
        if not (k in given if given is not None else getattr(cfg, k) != getattr(defaults, k))
    }
    cfg = dataclasses.replace(
        cfg, agent=dataclasses.replace(cfg.agent, learning_starts=values["learning_starts"]), **taken
    )
    said = [f"learning starts at {values['learning_starts']:,}"] + [
        f"{k.replace('_', ' ')} {v:,}" for k, v in taken.items()
    ]
    log(
        f"{cfg.agent_name} schedule ({agent.__name__}.protocol): {', '.join(said)} "
        f"({cfg.num_envs} envs over {len(task_spec(cfg.env, cfg.action_repeat).tasks)} tasks)"
    )
    return cfg


def default_metrics(cfg: RunConfig, agent, log=print) -> RunConfig:
    """The default plasticity metrics (``--plasticity.metrics-every`` left at its default) switched off,
    saying so, for an agent that declares no plastic networks; an explicit other value is refused
    by ``preflight`` as before."""
    from plasticity_zoo.plasticity.api import measured
    from plasticity_zoo.plasticity.config import PlasticityConfig

    default = PlasticityConfig().metrics_every
    if measured(agent) or cfg.plasticity.metrics_every != default:
        return cfg
    log(f"plasticity metrics: off (agent {cfg.agent_name!r} declares no plastic networks)")
    return dataclasses.replace(cfg, plasticity=dataclasses.replace(cfg.plasticity, metrics_every=0))


def run(cfg: RunConfig, stop_at: int | None = None, check: bool = True, overwrite: bool = False) -> dict:
    """Train (or resume, with ``cfg.resume``) a run.  ``check=False`` skips ``preflight`` (the caller ran it).

    A new run claims its directory (``claim``); with ``overwrite`` a run already there is first
    moved into ``run_dir/.replaced-<time>/`` (``move_aside``)."""
    from plasticity_zoo.networks.runtime import use_persistent_cache

    use_persistent_cache()  # compiled programs persist between runs (RLZOO_COMPILATION_CACHE=0: off)
    agent = agents.get(cfg.agent_name)
    cfg = default_metrics(protocol_defaults(cfg, agent), agent)
    if check:
        preflight(cfg, agent, overwrite=overwrite)
    if cfg.resume:
        if overwrite:
            raise SystemExit(f"--overwrite starts a new run; it cannot be combined with --resume {cfg.resume}")
        run_dir, resume, existed = Path(cfg.resume), True, True
    else:
        from plasticity_zoo.training.loop import default_run_dir

        if cfg.env is None:  # the command line's "not given" (offline agents): the loop resolves it (the dataset's)
            cfg = dataclasses.replace(cfg, env=loops.loop_for(cfg, agent).resolve(cfg, agent)[0].env)
        run_dir, resume = (Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)), False
        if overwrite:
            move_aside(run_dir)
        run_dir, existed = claim(run_dir, cfg, default=not cfg.run_dir)
    train = loops.loop_for(cfg, agent).train
    print(f"run directory: {run_dir}")
    try:
        return train(cfg, agent, run_dir, resume=resume, stop_at=stop_at)
    except BaseException as e:
        # A mistake the preflight could not see: do not leave an empty run behind.
        if is_user_error(e) and not resume and run_dir.is_dir():
            discard_empty_start(run_dir, existed)
        raise
