"""The offline loop: a fixed dataset, N vmapped seeds, epochs of updates, evaluation in the real env.

Time is counted in gradient updates (``--total-steps``, ``--eval-every``, ``--log-every`` and
``--checkpoint-every`` are update counts, applied at epoch boundaries).  Per epoch the host makes
one jitted call, vmapped over seeds, that runs the agent's whole epoch (for RAVL: model rollouts
and ``updates_per_epoch`` updates in one scan).

An offline agent module provides, beside ``CONFIG`` (with ``dataset``, ``kind``, ``dataset_root``
and ``updates_per_epoch`` fields), ``init`` and ``act``:

- ``prepare(key, dataset, dataset_path, cfg, seed, log) -> aux``: once per run, e.g. fit or load
  a dynamics model; ``aux`` is a pytree shared by all seeds (not checkpointed: it is cached on disk);
- ``data_init(real_transitions, cfg) -> data``: what one seed learns from, a NamedTuple whose field
  ``real`` holds the dataset (the other fields, e.g. rollout buffers, are checkpointed);
- ``make_epoch(cfg, env_id) -> epoch(state, data, aux, key) -> (state, data, metrics)``;
- ``sample_batch(state, data, key, n)``: a training batch (plasticity metrics and resets use it).

``dataset.json`` in the run directory records the dataset path, env and fingerprint.
Checkpoints hold the agent states, the agent's buffers (``data`` without the dataset, which is
re-read and checked against a fingerprint on resume) and the rng, so ``--resume`` continues exactly.
Evaluation rows carry normalised scores: ``score_d4rl`` (D4RL constants, hopper / halfcheetah /
walker2d) and ``score_dataset`` (the dataset's own random / expert references), when known.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from envs import datasets
from plasticity.hooks import Hooks, check_optimizers, static_plasticity
from training import checkpoint
from training.config import RunConfig, to_json
from training.evaluation import Evaluator
from training.logger import RunLogger
from training.loop import (Schedule, check_positive, finish, progress, raise_non_finite, restore,
                           run_counts, StopAtIterationEnd)

DEFAULT_ENV = RunConfig.env


def resolve_dataset(cfg: RunConfig):
    """-> (path, Dataset, env id for evaluation), from ``--dataset PATH`` or ``--env E --kind K``."""
    a = cfg.agent
    if a.dataset:
        path = Path(a.dataset).expanduser()
    elif a.kind:
        if cfg.env == DEFAULT_ENV:
            raise SystemExit("--kind needs --env (e.g. --env hopper --kind medium) to find the dataset in the cache")
        path = datasets.find(datasets.gymnasium_id(cfg.env), a.kind, a.dataset_root)
    else:
        raise SystemExit(f"agent {cfg.agent_name!r} is offline: give --dataset PATH or --env ENV --kind KIND "
                         f"(kinds: {', '.join(datasets.KINDS)}; make one with scripts/make_dataset.py)")
    if not path.exists():
        raise SystemExit(f"--dataset {path}: no such file")
    stored = datasets.load(path, validate=False).env_id
    given = None if cfg.env == DEFAULT_ENV else cfg.env
    if stored and given and datasets.d4rl_name(given) != datasets.d4rl_name(stored) and given != stored:
        raise SystemExit(f"--env {given} does not match the dataset's env {stored} ({path})")
    env_id = stored or (datasets.gymnasium_id(given) if given else None)
    if env_id is None:
        raise SystemExit(f"{path} does not record its environment: pass --env (e.g. Hopper-v5)")
    dataset = datasets.load(path, env_id=env_id)
    dataset.metadata.setdefault("env_id", env_id)  # a real D4RL file names no env: action bounds come from it
    return path, dataset, env_id


def scores(returns, env_id: str, metadata: dict) -> dict:
    """Normalised scores of a mean return under each reference that is known for this dataset."""
    out = {}
    for ref in ("d4rl", "dataset"):
        try:
            out[f"score_{ref}"] = float(datasets.normalized_score(returns, env_id=env_id, metadata=metadata,
                                                                  reference=ref))
        except (ValueError, KeyError):
            pass
    return out


def fingerprint(dataset) -> dict:
    return {"rows": len(dataset), "reward_sum": float(np.sum(dataset.rewards, dtype=np.float64)),
            "obs_sum": float(np.sum(dataset.observations, dtype=np.float64))}


def initial_state(cfg: RunConfig, agent, dataset, init_keys):
    """Fresh agent states (one per key, vmapped) and per-seed data (the dataset plus the agent's buffers)."""
    static = static_plasticity(cfg.plasticity, agent)  # Kron / NE masks, SIGReg: built into the agent
    state = jax.vmap(lambda k: agent.init(k, dataset.obs_dim, dataset.act_dim, cfg.agent, cfg.network, static))(
        init_keys)
    check_optimizers(cfg.plasticity, agent, cfg.agent_name, state)
    real = jax.tree.map(jnp.asarray, dataset.transitions(unit_actions=True))  # the agent acts in [-1, 1]
    data = jax.vmap(lambda _: agent.data_init(real, cfg.agent))(jnp.arange(len(init_keys)))  # copied per seed
    return state, data


def train(cfg: RunConfig, agent, run_dir: Path, resume: bool = False, stop_at: int | None = None) -> dict:
    """Train (or resume) an offline run.  ``stop_at`` ends early at that update count."""
    a = cfg.agent
    S, U = cfg.seeds, a.updates_per_epoch
    check_positive(**run_counts(cfg))
    if cfg.total_steps % U:
        raise ValueError(f"--total-steps ({cfg.total_steps}) must be a multiple of --updates-per-epoch ({U})")
    if cfg.num_envs != 1:
        raise ValueError("--num-envs does not apply to offline agents (they collect no data)")
    if cfg.plasticity.least:
        raise ValueError(f"--plasticity.least does not apply to agent {cfg.agent_name!r}: offline agents "
                         "collect no episodes to stop")
    path, dataset, env_id = resolve_dataset(cfg)
    cfg = dataclasses.replace(cfg, env=env_id)  # config.json (and plots) name the env evaluated on
    evaluator = Evaluator(env_id, S, cfg.eval_episodes, cfg.seed * 10_000 + 5_000, cfg.action_repeat)
    keys = jax.random.split(jax.random.key(cfg.seed), S + 2)
    k_prepare, key = keys[0], keys[1]
    aux = agent.prepare(k_prepare, dataset, path, a, cfg.seed, log=print)

    state, data = initial_state(cfg, agent, dataset, keys[2:])
    pc = cfg.plasticity
    hooks = Hooks(pc, agent, cfg.agent_name, total_updates=cfg.total_steps)
    state = hooks.start(state)
    logger = RunLogger(run_dir, cfg.tensorboard)
    epoch_fn = jax.jit(jax.vmap(agent.make_epoch(a, env_id), in_axes=(0, 0, None, 0)), donate_argnums=(0, 1))
    eval_act = jax.jit(jax.vmap(lambda s, o: agent.act(s, o, None, explore=False)))
    meta = {"dataset": str(path), "env_id": env_id, "fingerprint": fingerprint(dataset)}

    if resume:
        (state, model_buffers, key), host, _ = restore(run_dir, (state, _buffers(data), key), logger, unit="update")
        if host["dataset"] != meta["fingerprint"]:
            raise SystemExit(f"--resume {run_dir}: the dataset {path} changed since the run started "
                             f"({host['dataset']} != {meta['fingerprint']})")
        data = _with_buffers(data, model_buffers)
        step = host["step"]
        hooks.restore(host["plasticity"])
    else:
        logger.write_config(to_json(cfg))
        (Path(run_dir) / "dataset.json").write_text(json.dumps(meta, indent=2))
        step, host = 0, None
    schedule = Schedule(cfg, step, host)
    end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)

    def evaluate(step):
        returns = evaluator(lambda o: eval_act(state, jnp.asarray(o)))
        logger.log_eval(step, returns, [scores(np.mean(r), env_id, dataset.metadata) for r in returns])
        return float(np.mean(returns))

    def save(step):
        host = {"step": step, **schedule.host(), "plasticity": hooks.host_state(),
                "dataset": meta["fingerprint"]}
        return checkpoint.save(run_dir, step, (state, _buffers(data), key), host, {"config": to_json(cfg)})

    bar = progress(cfg, step)
    last_eval = math.nan
    t_log, updates_log = time.perf_counter(), 0
    with StopAtIterationEnd(save, run_dir, bar, logger, step) as stop:  # SIGINT / SIGTERM: checkpoint, stop
        while step < end:
            stop.begin()
            if schedule.eval_due(step):
                last_eval = evaluate(step)
            key, k = jax.random.split(key)
            state, data, metrics = epoch_fn(state, data, aux, jax.random.split(k, S))
            if not all(bool(jnp.all(jnp.isfinite(m))) for m in jax.tree.leaves(metrics)):
                raise_non_finite(metrics, step + U, run_dir, unit="update")
            state, rows = hooks.after_updates(step, step + U, state, data, jax.random.fold_in(k, 1))
            step += U
            updates_log += U
            if schedule.log_due(step, end):
                ups = updates_log / (time.perf_counter() - t_log)
                per_seed = [{"perf/updates_per_s": ups, **{m: float(v[j]) for m, v in metrics.items()},
                             **(rows[j] if rows else {})} for j in range(S)]
                logger.log_metrics(step, per_seed)
                bar(step, ups, last_eval, last_eval)
                t_log, updates_log = time.perf_counter(), 0
            if schedule.checkpoint_due(step, end):
                save(step)
            stop.end(step)
    last_eval = finish(schedule, step, cfg.total_steps, evaluate, last_eval, bar, logger)
    return {"state": state, "step": step, "last_eval": last_eval, "run_dir": str(run_dir), "env_id": env_id}


def _buffers(data):
    """The checkpointed part of ``data``: everything but the dataset itself (field ``real``)."""
    return data._replace(real=None)


def _with_buffers(data, buffers):
    return buffers._replace(real=data.real)
