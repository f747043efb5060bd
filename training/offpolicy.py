"""The off-policy training loop: N vmapped seeds, device-side replay, exact resume.

Per env step the host makes one jitted call that stores the transition, runs the
``updates_per_step * num_envs`` gradient steps as one ``lax.scan`` and returns the next
action; everything seed-specific is vmapped over a leading seed axis.
"""
from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from envs import make_vector_env, nonstationary
from plasticity.hooks import Hooks, check_optimizers, static_plasticity
from plasticity.least import LEAST
from buffers import replay
from training import checkpoint
from training.config import RunConfig, dump, to_json
from training.evaluation import Evaluator
from training.logger import RunLogger
from training.loop import (NonFiniteLossError, Schedule, check_positive, finish, progress, raise_non_finite,
                           restore, run_counts, StopAtIterationEnd)

__all__ = ["NonFiniteLossError", "train", "init_state", "seed_slice", "make_step_fn", "make_train_block"]


def make_train_block(agent, cfg, num_updates: int):
    """``agent.train_block`` with ``num_updates`` bound: ``(state, buffer, key, review=None) -> (state, buffer, metrics)``."""
    return lambda state, buffer, key, review=None: agent.train_block(state, buffer, key, num_updates, review)


def buffer_fns(agent):
    """(init(capacity, obs_dim, act_dim), add(buffer, transitions)): the agent's replay."""
    return agent.buffer_init, agent.buffer_add


def make_step_fn(agent, cfg, num_updates: int, act_dim: int):
    """Two jitted calls per env step: store transitions, then learn and choose the next actions.

    ``sigreg`` (a ``SIGRegSpec``) switches SIGReg on in the agent's regularised losses, ``optim``
    (an ``OptimSpec``) Kron / NE masks in its optimizers; ``review`` (per-seed probabilities, or
    None) switches on NE's experience review.
    """
    block = make_train_block(agent, cfg, num_updates)

    # Storing the transition is its own jitted call.  In one program with the updates, XLA fuses
    # the batch gathers with the in-place write of the new row, the gathers then need the old
    # buffer, and XLA copies every buffer array each env step (30 ms per step at 1M rows).
    @partial(jax.jit, donate_argnums=(0,))
    def store(buffer, transition, obs):
        seeds, envs = obs.shape[:2]
        flat = jax.tree.map(lambda x: x.reshape(seeds, envs, *x.shape[1:]), transition)
        return jax.vmap(agent.buffer_add)(buffer, flat)

    @partial(jax.jit, static_argnames=("random_actions", "train"), donate_argnums=(0, 1))
    def learn_and_act(state, buffer, obs, key, random_actions: bool, train: bool, review=None):
        seeds, envs = obs.shape[:2]
        k_train, k_act = jax.random.split(key)
        metrics = {}
        if train:
            state, buffer, metrics = jax.vmap(block)(state, buffer, jax.random.split(k_train, seeds), review)
        if random_actions:
            action = jax.random.uniform(k_act, (seeds, envs, act_dim), minval=-1.0, maxval=1.0)
        else:
            action = jax.vmap(partial(agent.act, explore=True))(state, obs, jax.random.split(k_act, seeds))
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(m)) for m in jax.tree.leaves(metrics)] or [jnp.bool_(True)]))
        return state, buffer, action, metrics, finite

    def step(state, buffer, transition, obs, key, random_actions: bool, train: bool, review=None):
        buffer = store(buffer, transition, obs)
        return learn_and_act(state, buffer, obs, key, random_actions=random_actions, train=train, review=review)

    step.store, step.learn_and_act = store, learn_and_act  # for the donation regression test

    return step


def init_state(agent, cfg: RunConfig, obs_dim: int, act_dim: int):
    keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 1)
    static = static_plasticity(cfg.plasticity, agent)  # Kron / NE masks, SIGReg: built into the agent
    state = jax.vmap(lambda k: agent.init(k, obs_dim, act_dim, cfg.agent, cfg.network, static))(keys[1:])
    check_optimizers(cfg.plasticity, agent, cfg.agent_name, state)
    buffer = jax.vmap(lambda _: agent.buffer_init(cfg.agent.buffer_size, obs_dim, act_dim))(jnp.arange(cfg.seeds))
    return state, buffer, keys[0]


def seed_slice(tree, j: int):
    """One seed's agent state out of a vmapped one (for evaluation or export)."""
    return jax.tree.map(lambda x: x[j], tree)


def train(cfg: RunConfig, agent, run_dir: Path, resume: bool = False, stop_at: int | None = None,
          on_eval=None) -> dict:
    """Train (or resume) a run.  ``stop_at`` ends early at that step, as an interruption would.

    Steps count env steps per seed (each loop iteration steps ``num_envs`` envs per seed).
    ``on_eval(step, state, returns)``, if given, runs right after each evaluation with the vmapped
    agent state and the per-seed lists of returns (e.g. to keep policy snapshots); the next step
    donates the state's buffers, so copy what you keep.
    """
    a = cfg.agent
    S, E = cfg.seeds, cfg.num_envs
    check_positive(**run_counts(cfg))
    env = make_vector_env(cfg.env, S * E, cfg.seed * 10_000, cfg.action_repeat)
    evaluator = Evaluator(cfg.env, S, cfg.eval_episodes, cfg.seed * 10_000 + 5_000, cfg.action_repeat)
    obs_dim, act_dim = env.obs_dim, env.act_dim
    state, buffer, key = init_state(agent, cfg, obs_dim, act_dim)
    num_updates = a.updates_per_step * E
    learning_iters = cfg.total_steps // E - max(0, -(-a.learning_starts // E) - 1)  # iterations that learn
    hooks = Hooks(cfg.plasticity, agent, cfg.agent_name, total_updates=max(1, learning_iters * num_updates))
    state = hooks.start(state)
    logger = RunLogger(run_dir, cfg.tensorboard)
    step_fn = make_step_fn(agent, a, num_updates, act_dim)
    pc = cfg.plasticity
    least = (LEAST(S, E, pc.least_window, pc.least_max_len, int(pc.least_warmup * cfg.total_steps), coef=pc.least_coef)
             if pc.least else None)
    least_signals = jax.jit(jax.vmap(agent.least_signals)) if pc.least else None
    set_noise = jax.jit(jax.vmap(agent.with_exploration_noise)) if pc.least_noise_max > 0 else None
    eval_act = jax.jit(jax.vmap(lambda s, o: agent.act(s, o, None, explore=False)))

    if resume:
        (state, buffer, key), host, _ = restore(run_dir, (state, buffer, key), logger)
        env, obs, action, step = host["env"], host["obs"], jnp.asarray(host["action"]), host["step"]
        episode_log, updates_done = host["episode_log"], host["updates_done"]
        pending, least = host["pending"], host["least"]
        hooks.restore(host["plasticity"])
    else:
        logger.write_config(to_json(cfg))
        obs = env.reset()
        step, host = 0, None
        episode_log = [[] for _ in range(S)]
        updates_done, pending = 0, None
        key, k0 = jax.random.split(key)
        action = jax.random.uniform(k0, (S, E, act_dim), minval=-1.0, maxval=1.0)
    counter = getattr(env, "step_counter", None)  # ns: envs share one step counter; evaluation follows it
    if counter is not None:
        env.steps_per_call = E  # the counter counts per-seed env steps, the unit of --total-steps
        nonstationary.follow(evaluator.env, counter)
    schedule = Schedule(cfg, step, host)
    end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)

    def evaluate(step):
        returns = evaluator(lambda o: eval_act(state, jnp.asarray(o)))
        logger.log_eval(step, returns)
        if on_eval is not None:
            on_eval(step, state, returns)
        return float(np.mean(returns))

    def save(step):
        host = {"env": env, "obs": obs, "action": np.asarray(action), "step": step,
                "episode_log": episode_log, **schedule.host(),
                "updates_done": updates_done, "pending": pending, "plasticity": hooks.host_state(), "least": least}
        return checkpoint.save(run_dir, step, (state, buffer, key), host, {"config": to_json(cfg)})

    bar = progress(cfg, step)
    last_eval, last_return = math.nan, math.nan
    metrics, t_log, steps_log = None, time.perf_counter(), 0
    with StopAtIterationEnd(save, run_dir, bar, logger, step) as stop:  # SIGINT / SIGTERM: checkpoint, stop
        while step < end:
            stop.begin()
            if schedule.eval_due(step):
                last_eval = evaluate(step)
            new_obs, reward, terminated, truncated, next_obs = env.step(np.asarray(action).reshape(S * E, act_dim))
            transition = replay.Transition(obs, np.asarray(action).reshape(S * E, act_dim), reward, next_obs,
                                           terminated, truncated)
            if least is not None and step >= a.learning_starts:
                transition, new_obs = _least_step(least, least_signals, state, transition, new_obs, env, step,
                                                  jax.random.fold_in(key, 2), S, E)
            step += E
            steps_log += E
            obs = new_obs
            key, k = jax.random.split(key)
            learning = step >= a.learning_starts
            state, buffer, action, new_metrics, finite = step_fn(
                state, buffer, transition, obs.reshape(S, E, obs_dim), k, random_actions=not learning, train=learning,
                review=hooks.review)
            if learning:
                metrics = new_metrics
                if not bool(finite):
                    raise_non_finite(metrics, step, run_dir)
                state, rows = hooks.after_updates(updates_done, updates_done + num_updates, state, buffer,
                                                  jax.random.fold_in(k, 1))
                updates_done += num_updates
                if rows is not None:
                    pending = rows if pending is None else [{**p, **r} for p, r in zip(pending, rows)]
            for i, ret, length in env.pop_finished():
                episode_log[i // E].append((ret, length))
            if schedule.log_due(step, cfg.total_steps):
                sps = steps_log * S / (time.perf_counter() - t_log)  # env steps/s, all seeds
                if least is not None and pc.least_noise_max > 0:  # LEAST's optional noise increase
                    sigma = least.noise(a.exploration_noise, pc.least_noise_max).astype(np.float32)
                    state = set_noise(state, jnp.asarray(sigma))
                rows = []
                for j in range(S):
                    row = {"perf/sps": sps}
                    if least is not None:
                        row["plasticity/least_stops"] = least.stops
                        if pc.least_noise_max > 0:
                            row["plasticity/least_noise"] = float(sigma[j])
                    if episode_log[j]:
                        row["charts/episodic_return"] = np.mean([r for r, _ in episode_log[j]])
                        row["charts/episode_length"] = np.mean([n for _, n in episode_log[j]])
                    if metrics is not None:
                        row.update({k: float(v[j]) for k, v in metrics.items()})
                    if pending is not None:
                        row.update(pending[j])
                    rows.append(row)
                pending = None
                recent = [r for log in episode_log for r, _ in log]
                last_return = float(np.mean(recent)) if recent else last_return
                episode_log = [[] for _ in range(S)]
                logger.log_metrics(step, rows)
                bar(step, sps, last_return, last_eval)
                t_log, steps_log = time.perf_counter(), 0
            if schedule.checkpoint_due(step, end):
                save(step)
            stop.end(step)
    last_eval = finish(schedule, step, cfg.total_steps, evaluate, last_eval, bar, logger)
    return {"state": state, "step": step, "last_eval": last_eval, "run_dir": str(run_dir)}


def _least_step(least, signals, state, transition, new_obs, env, step, key, S, E):
    """LEAST: stop the episodes the rule flags; their last transition is stored as truncated."""
    per_seed = jax.tree.map(lambda x: jnp.asarray(x).reshape(S, E, *np.shape(x)[1:]), transition)
    q, g = signals(state, per_seed, jax.random.split(key, S))
    done = transition.terminated | transition.truncated
    stop = least.decide(step, np.asarray(q).reshape(-1), np.asarray(g).reshape(-1), done)
    if not stop.any():
        return transition, new_obs
    truncated = transition.truncated | stop
    new_obs = new_obs.copy()
    for i in np.flatnonzero(stop):
        new_obs[i] = env.stop(int(i))
    return transition._replace(truncated=truncated), new_obs
