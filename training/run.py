"""Entry point shared by scripts/train.py: check the config, pick the loop for the agent, set up the run dir.

``preflight(cfg, agent)`` runs every check that needs no training (flag values, env id,
dataset, plasticity interventions, the checkpoint to resume) before ``run`` creates a run
directory, so a mistyped command fails at once and leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
from pathlib import Path

import numpy as np

import agents
from training import config as config_lib
from training.config import RunConfig

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


LOOPS = {"offpolicy": "training.offpolicy", "onpolicy": "training.onpolicy", "offline": "training.offline"}


def loop_module(agent):
    """The module with the kind's iteration: ``check(cfg)`` and ``train(cfg, agent, run_dir, ...)``."""
    if agent.KIND not in LOOPS:
        raise ValueError(f"agent {agent.__name__!r} has unknown kind {agent.KIND!r}; kinds: {', '.join(LOOPS)}")
    return importlib.import_module(LOOPS[agent.KIND])


def preflight(cfg: RunConfig, agent=None):
    """Every check a run can make before training, cheaply and before any run directory exists.

    Raises what the loops raise for the same mistakes (ValueError, SystemExit with a message,
    ``envs.datasets.DatasetError``), through the loops' own helpers: for ``--resume`` a run
    directory without a checkpoint (without one, a run directory that already holds a run);
    counts below 1 and the agent kind's checks (PPO's batch arithmetic); an unknown or malformed
    env id (the env is built once and closed) or, for an offline agent, a missing, unreadable or
    mismatched dataset; an intervention the agent cannot take; the agent's own option checks.
    """
    from plasticity.hooks import check_applicable

    agent = agents.get(cfg.agent_name) if agent is None else agent
    if cfg.resume:
        from training import checkpoint

        if not (Path(cfg.resume) / "config.json").is_file():
            load_config(cfg.resume)  # raises, naming the missing config.json
        if checkpoint.latest(cfg.resume) is None:
            raise SystemExit(f"--resume {cfg.resume}: no checkpoint found in {Path(cfg.resume) / 'ckpt'} "
                             "(the run stopped before its first checkpoint: start it again)")
    elif cfg.run_dir and (Path(cfg.run_dir) / "ckpt").exists():
        raise SystemExit(f"run directory {cfg.run_dir} already holds a run; use --resume {cfg.run_dir} to continue it")
    loop_module(agent).check(cfg)  # counts below 1 and the kind's own arithmetic
    if agent.KIND == "offline":
        from training.offline import resolve_dataset

        _, dataset, _ = resolve_dataset(cfg)  # the dataset file exists, is readable HDF5 and fits its env
        obs_dim, act_dim = dataset.obs_dim, dataset.act_dim
    else:
        from envs import make_env

        env = make_env(cfg.env, 0, cfg.action_repeat)  # an unknown or malformed env id fails here
        obs_dim, act_dim = int(np.prod(env.observation_space.shape)), int(np.prod(env.action_space.shape))
        env.close()
    check_applicable(cfg.plasticity, agent, cfg.agent_name)
    check_agent_config(cfg, agent, obs_dim, act_dim)


def check_agent_config(cfg: RunConfig, agent, obs_dim: int, act_dim: int):
    """The agent's own option checks (they run in ``agent.init``) and the optimizer interventions
    (``--plasticity.kron`` / ``--plasticity.ne``), by tracing one agent's init abstractly: no
    arrays are allocated and nothing is compiled."""
    import jax

    from plasticity.hooks import check_optimizers, static_plasticity

    static = static_plasticity(cfg.plasticity, agent)
    state = jax.eval_shape(lambda k: agent.init(k, obs_dim, act_dim, cfg.agent, cfg.network, static),
                           jax.random.key(0))
    check_optimizers(cfg.plasticity, agent, cfg.agent_name, state)


def _only_empty_logs(run_dir: Path) -> bool:
    """True if ``run_dir`` holds nothing a user would miss: config.json, dataset.json and CSV logs
    without rows (header only)."""
    for p in run_dir.iterdir():
        if p.is_dir():
            return False
        if p.name in ("config.json", "dataset.json"):
            continue
        if p.suffix == ".csv":
            with open(p) as f:
                if sum(1 for line in f if line.strip()) <= 1:
                    continue
        return False
    return True


def run(cfg: RunConfig, stop_at: int | None = None, check: bool = True) -> dict:
    """Train (or resume, with ``cfg.resume``) a run.  ``check=False`` skips ``preflight`` (the caller ran it)."""
    agent = agents.get(cfg.agent_name)
    if check:
        preflight(cfg, agent)
    if cfg.resume:
        run_dir, resume = Path(cfg.resume), True
    else:
        from training.loop import default_run_dir

        run_dir, resume = (Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)), False
        if (run_dir / "ckpt").exists():
            raise SystemExit(f"run directory {run_dir} already holds a run; use --resume {run_dir} to continue it")
    train = loop_module(agent).train
    print(f"run directory: {run_dir}")
    existed = run_dir.exists()
    try:
        return train(cfg, agent, run_dir, resume=resume, stop_at=stop_at)
    except BaseException as e:
        # A mistake the preflight could not see: do not leave an empty run directory behind.
        if is_user_error(e) and not resume and not existed and run_dir.is_dir() and _only_empty_logs(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
