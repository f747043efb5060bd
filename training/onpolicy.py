"""The on-policy loop: rollouts of S seeds x E envs, one PPO-style update per iteration, exact resume.

One vector env holds all ``S * E`` sub-envs (seed j owns envs ``j*E .. j*E+E-1``).  Per vector step
the host makes **one** jitted call, vmapped over seeds, that

  1. scales the rewards (reward normaliser) and writes the transition into the device-side rollout
     buffer (rewards, ``terminated``, ``truncated``, and V(true final observation) for truncations);
  2. updates the observation statistics with the new observations, normalises them, and samples the
     next actions, their log-probabilities and values (written into the next buffer slot).

After ``num_steps`` vector steps one jitted call runs ``agent.update`` (GAE, epochs x minibatches in
one scan) for every seed and samples the first actions of the next rollout with the updated policy.
Checkpoints (agent state with normalisers, loop buffers, rng, vector env, counters) are written at
iteration boundaries only, so a resumed run equals an uninterrupted one.

The agent module provides, beside ``init``/``act``/``update``: ``observe(state, raw_obs) -> (state,
obs_n)``, ``normalize_obs``, ``scale_reward(state, returns, reward, terminated)``,
``sample_action(state, obs_n, key) -> (action, logp, value)``, ``value(state, obs_n)``,
``reset_normalizers(state)``, ``rollout_split``/``rollout_join``/``rollout_merge`` (see ``FlatStep``)
and the ``Rollout`` buffer type.

Steps count env steps per seed (each vector step adds ``num_envs``); a run does
``total_steps // (num_steps * num_envs)`` full iterations (CleanRL's ``num_iterations``), which also
sets the learning-rate annealing horizon.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs import make_vector_env
from training import checkpoint
from training.config import RunConfig, to_json
from training.evaluation import Evaluator
from training.logger import RunLogger
from plasticity.hooks import Hooks, check_optimizers, static_plasticity
from training.loop import (Schedule, check_positive, finish, progress, raise_non_finite, restore,
                           run_counts, StopAtIterationEnd)


class LoopState(NamedTuple):
    buffer: object       # agent.Rollout, (T + 1 | T, E, ...) per seed
    returns: jax.Array   # (E,) discounted returns of the reward normaliser


def empty_loop(agent, T: int, E: int, obs_dim: int, act_dim: int) -> LoopState:
    z = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    b = agent.Rollout(z(T + 1, E, obs_dim), z(T + 1, E, act_dim), z(T + 1, E), z(T + 1, E), z(T, E),
                      jnp.zeros((T, E), bool), jnp.zeros((T, E), bool), z(T, E))
    return LoopState(b, z(E))


def init_state(agent, cfg: RunConfig, obs_dim: int, act_dim: int):
    keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 1)
    static = static_plasticity(cfg.plasticity, agent)  # Kron / NE masks, SIGReg: built into the agent
    state = jax.vmap(lambda k: agent.init(k, obs_dim, act_dim, cfg.agent, cfg.network, static))(keys[1:])
    check_optimizers(cfg.plasticity, agent, cfg.agent_name, state)
    loop = jax.vmap(lambda _: empty_loop(agent, cfg.agent.num_steps, cfg.num_envs, obs_dim, act_dim))(
        jnp.arange(cfg.seeds))
    return state, loop, keys[0]


def _write_policy_slot(buffer, i, obs_n, action, logp, value):
    return buffer._replace(obs=buffer.obs.at[i].set(obs_n), actions=buffer.actions.at[i].set(action),
                           logp=buffer.logp.at[i].set(logp), values=buffer.values.at[i].set(value))


@functools.lru_cache(maxsize=16)
def make_fns(agent, T: int):
    """(start, step, iterate, reset_norm, eval_act): jitted, vmapped over the leading seed axis.

    Kron / NE masks and SIGReg are static fields of the agent state (``state.plasticity``), so
    they are part of each program's cache key.  Cached per (agent, T), so runs in one process
    (e.g. a resumed run, tests) reuse the compilations.
    """

    def start(state, loop, raw_obs, key):
        state, obs_n = agent.observe(state, raw_obs)
        action, logp, v = agent.sample_action(state, obs_n, key)
        return state, loop._replace(buffer=_write_policy_slot(loop.buffer, 0, obs_n, action, logp, v)), action

    def step(state, loop, t, reward, terminated, truncated, next_obs, new_obs, key):
        state, returns, r = agent.scale_reward(state, loop.returns, reward, terminated)
        state, obs_n = agent.observe(state, new_obs)
        final_v = agent.value(state, agent.normalize_obs(state, next_obs))
        b = loop.buffer
        b = b._replace(rewards=b.rewards.at[t].set(r), terminated=b.terminated.at[t].set(terminated),
                       truncated=b.truncated.at[t].set(truncated),
                       final_values=b.final_values.at[t].set(jnp.where(truncated & ~terminated, final_v, 0.0)))
        action, logp, v = agent.sample_action(state, obs_n, key)
        return state, LoopState(_write_policy_slot(b, t + 1, obs_n, action, logp, v), returns), action

    def iterate(state, loop, key):
        k_update, k_act = jax.random.split(key)
        state, metrics = agent.update(state, loop.buffer, k_update)
        obs_n = loop.buffer.obs[T]
        action, logp, v = agent.sample_action(state, obs_n, k_act)
        return state, loop._replace(buffer=_write_policy_slot(loop.buffer, 0, obs_n, action, logp, v)), action, metrics

    def reset_norm(state, loop):
        return agent.reset_normalizers(state), loop._replace(returns=jnp.zeros_like(loop.returns))

    @partial(jax.jit, donate_argnums=(0, 1))
    def start_all(state, loop, raw_obs, key):
        return jax.vmap(start)(state, loop, raw_obs, jax.random.split(key, raw_obs.shape[0]))

    def step_all(state, loop, t, reward, terminated, truncated, next_obs, new_obs, key):
        keys = jax.random.split(jax.random.fold_in(key, t), reward.shape[0])
        return jax.vmap(step, in_axes=(0, 0, None, 0, 0, 0, 0, 0, 0))(
            state, loop, t, reward, terminated, truncated, next_obs, new_obs, keys)

    @partial(jax.jit, donate_argnums=(0, 1))
    def iterate_all(state, loop, key):
        seeds = loop.returns.shape[0]
        state, loop, action, metrics = jax.vmap(iterate)(state, loop, jax.random.split(key, seeds))
        losses = [v for k, v in metrics.items() if k.startswith("losses/")]
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in losses] or [jnp.bool_(True)]))
        return state, loop, action, metrics, finite

    eval_act = jax.jit(jax.vmap(lambda s, o: agent.act(s, o, None, explore=False)))
    return start_all, FlatStep(agent, step_all), iterate_all, jax.jit(jax.vmap(reset_norm)), eval_act


class FlatStep:
    """The per-vector-step call on *flattened* pytrees holding only what a step touches.

    Every array passed to or returned from a jitted call costs the host a few microseconds, and
    flattening the agent state (NNX ``State`` nodes) about 100 us, more than the call's own work at
    CleanRL's sizes.  So once per rollout the loop splits the agent state with
    ``agent.rollout_split(state) -> (frozen, mutable, skeleton)`` (for PPO: the actor/critic params,
    read only; the normaliser statistics, updated; the rest left out), flattens ``frozen`` and
    ``(mutable, loop)`` (``flatten``), steps on the flat leaves (only the mutable ones are donated and
    returned), and rebuilds the state at the end with ``agent.rollout_merge(state, mutable)``
    (``unflatten``).  One jitted function per structure (cached).

    ``step(frozen_leaves, mutable_leaves, t, reward, terminated, truncated, next_obs, new_obs, key)``
    -> ``(mutable_leaves, action)``: inputs shaped (seeds, envs, ...), host arrays are fine; the key
    of step ``t`` is ``fold_in(key, t)``, so one key serves a whole rollout.
    """

    def __init__(self, agent, step_all):
        self._agent, self._step_all = agent, step_all
        self._compiled = {}
        self._current = None

    def flatten(self, state, loop):
        agent = self._agent
        frozen, mutable, skeleton = agent.rollout_split(state)
        ff, tf = jax.tree.flatten(frozen)
        fm, tm = jax.tree.flatten((mutable, loop))
        key = (tf, tm, jax.tree.structure(skeleton))
        if key not in self._compiled:
            def flat(ff, fm, *args):
                mut, lp = jax.tree.unflatten(tm, fm)
                st = agent.rollout_join(skeleton, jax.tree.unflatten(tf, ff), mut)
                st, lp, action = self._step_all(st, lp, *args)
                return jax.tree.leaves((agent.rollout_split(st)[1], lp)), action

            self._compiled[key] = jax.jit(flat, donate_argnums=(1,))
        self._current = (key, state, tm)
        return ff, fm

    def unflatten(self, fm):
        _, state, tm = self._current
        mutable, loop = jax.tree.unflatten(tm, fm)
        return self._agent.rollout_merge(state, mutable), loop

    def __call__(self, ff, fm, *args):
        return self._compiled[self._current[0]](ff, fm, *args)


def _check(cfg: RunConfig):
    a = cfg.agent
    check_positive(**run_counts(cfg), num_steps=a.num_steps, num_minibatches=a.num_minibatches,
                   update_epochs=a.update_epochs)
    batch = a.num_steps * cfg.num_envs
    if batch % a.num_minibatches:
        raise ValueError(f"the batch (--num-steps {a.num_steps} x --num-envs {cfg.num_envs} = {batch}) must be "
                         f"divisible by --num-minibatches {a.num_minibatches}")
    if cfg.total_steps < batch:
        raise ValueError(f"--total-steps {cfg.total_steps} is less than one rollout (--num-steps {a.num_steps} x "
                         f"--num-envs {cfg.num_envs} = {batch} env steps per seed)")
    return batch, cfg.total_steps // batch


def train(cfg: RunConfig, agent, run_dir: Path, resume: bool = False, stop_at: int | None = None) -> dict:
    """Train (or resume) a run.  ``stop_at`` ends early at the first iteration boundary at or after it."""
    from envs import nonstationary

    a = cfg.agent
    S, E, T = cfg.seeds, cfg.num_envs, a.num_steps
    batch, num_iterations = _check(cfg)
    env = make_vector_env(cfg.env, S * E, cfg.seed * 10_000, cfg.action_repeat, backend=a.backend)
    evaluator = Evaluator(cfg.env, S, cfg.eval_episodes, cfg.seed * 10_000 + 5_000, cfg.action_repeat)
    obs_dim, act_dim = env.obs_dim, env.act_dim
    pc = cfg.plasticity
    state, loop, key = init_state(agent, cfg, obs_dim, act_dim)
    logger = RunLogger(run_dir, cfg.tensorboard)
    start_fn, step_fn, iterate_fn, reset_norm_fn, eval_act = make_fns(agent, T)
    # plasticity metrics, resets and NE events on samples of the latest rollout; periods count gradient updates
    updates_per_iteration = a.update_epochs * a.num_minibatches
    hooks = Hooks(pc, agent, cfg.agent_name, total_updates=num_iterations * updates_per_iteration)
    state = hooks.start(state)
    shaped = lambda x: np.asarray(x).reshape(S, E, *np.shape(x)[1:])  # noqa: E731

    if resume:
        (state, loop, key), host, _ = restore(run_dir, (state, loop, key), logger)
        env, action, step, episode_log = host["env"], jnp.asarray(host["action"]), host["step"], host["episode_log"]
        phase, updates_done, pending = host["phase"], host["updates_done"], host["pending"]
        hooks.restore(host["plasticity"])
        if getattr(env, "restored_fresh", False):  # a backend that cannot pickle its simulator restarted
            key, k = jax.random.split(key)
            state, loop, action = start_fn(state, loop, shaped(env.reset()), k)
    else:
        logger.write_config(to_json(cfg))
        key, k = jax.random.split(key)
        state, loop, action = start_fn(state, loop, shaped(env.reset()), k)
        step, phase, host = 0, 0, None
        updates_done, pending = 0, None
        episode_log = [[] for _ in range(S)]
    state = state.replace(num_iterations=jnp.full((S,), num_iterations, jnp.int32))
    counter = getattr(env, "step_counter", None)  # ns: envs on the sync backend share one counter
    if counter is not None:
        env.steps_per_call = E  # the counter counts per-seed env steps, the unit of --total-steps
        nonstationary.follow(evaluator.env, counter)
    schedule = Schedule(cfg, step, host)
    last_step = num_iterations * batch
    end = last_step if stop_at is None else min(stop_at, last_step)

    def evaluate(step):
        returns = evaluator(lambda o: eval_act(state, jnp.asarray(o)))
        logger.log_eval(step, returns)
        return float(np.mean(returns))

    def save(step):
        host = {"env": env, "action": np.asarray(action), "step": step, "episode_log": episode_log,
                **schedule.host(), "phase": phase,
                "updates_done": updates_done, "pending": pending, "plasticity": hooks.host_state()}
        return checkpoint.save(run_dir, step, (state, loop, key), host, {"config": to_json(cfg)})

    bar = progress(cfg, step)
    last_eval, last_return = math.nan, math.nan
    metrics, t_log, steps_log = None, time.perf_counter(), 0
    with StopAtIterationEnd(save, run_dir, bar, logger, step) as stop:  # SIGINT / SIGTERM: checkpoint, stop
        while step < end:
            stop.begin()
            key, k_roll = jax.random.split(key)
            ff, fm = step_fn.flatten(state, loop)
            for t in range(T):
                if schedule.eval_due(step):
                    state, loop = step_fn.unflatten(fm)
                    last_eval = evaluate(step)
                new_obs, reward, terminated, truncated, next_obs = env.step(np.asarray(action).reshape(S * E, act_dim))
                step += E
                steps_log += E
                if counter is not None and a.ns_reset_norm:
                    now = env.global_phase()
                    if now != phase:
                        state, loop = reset_norm_fn(*step_fn.unflatten(fm))
                        ff, fm = step_fn.flatten(state, loop)
                    phase = now
                fm, action = step_fn(ff, fm, np.int32(t), shaped(reward), shaped(terminated), shaped(truncated),
                                     shaped(next_obs), shaped(new_obs), k_roll)
                for i, ret, length in env.pop_finished():
                    episode_log[i // E].append((ret, length))
                if schedule.log_due(step):
                    sps = steps_log * S / (time.perf_counter() - t_log)
                    last_return = _log(logger, step, sps, episode_log, metrics, env, S, E, last_return)
                    episode_log = [[] for _ in range(S)]
                    bar(step, sps, last_return, last_eval)
                    t_log, steps_log = time.perf_counter(), 0
            state, loop = step_fn.unflatten(fm)
            key, k = jax.random.split(key)
            state, loop, action, metrics, finite = iterate_fn(state, loop, k)
            if not bool(finite):
                raise_non_finite({k: v for k, v in metrics.items() if k.startswith("losses/")}, step, run_dir)
            state, rows = hooks.after_updates(updates_done, updates_done + updates_per_iteration, state,
                                              loop.buffer, jax.random.fold_in(k, 1))
            updates_done += updates_per_iteration
            if rows is not None:  # logged with the next metrics row
                pending = rows if pending is None else [{**p, **r} for p, r in zip(pending, rows)]
            if pending is not None and metrics is not None:
                metrics = {**metrics, **{k: np.array([row[k] for row in pending]) for k in pending[0]}}
                pending = None
            if schedule.checkpoint_due(step, end):
                save(step)
            stop.end(step)
    last_eval = finish(schedule, step, last_step, evaluate, last_eval, bar, logger)
    return {"state": state, "step": step, "last_eval": last_eval, "run_dir": str(run_dir), "metrics": metrics}


def _log(logger, step, sps, episode_log, metrics, env, S, E, last_return):
    tasks = env.task_ids() if hasattr(env, "task_ids") else None
    rows = []
    for j in range(S):
        row = {"perf/sps": sps}
        if episode_log[j]:
            row["charts/episodic_return"] = np.mean([r for r, _ in episode_log[j]])
            row["charts/episode_length"] = np.mean([n for _, n in episode_log[j]])
        if metrics is not None:
            row.update({k: float(v[j]) for k, v in metrics.items()})
        if tasks is not None:
            row["ns/task_id"] = float(np.mean(tasks[j * E:(j + 1) * E]))
            row["ns/phase"] = env.global_phase()
        rows.append(row)
    logger.log_metrics(step, rows)
    recent = [r for log in episode_log for r, _ in log]
    return float(np.mean(recent)) if recent else last_return
