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

import functools
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.envs import make_vector_env, nonstationary
from plasticity_zoo.networks.runtime import threefry_unrolled
from plasticity_zoo.plasticity.hooks import Hooks, check_optimizers, static_plasticity
from plasticity_zoo.training.config import RunConfig
from plasticity_zoo.training.driver import Driver, StepReport
from plasticity_zoo.training.evaluation import run_evaluator
from plasticity_zoo.training.loop import RunTree, check_positive, env_resolve, finished_episodes, run_counts
from plasticity_zoo.training.seeds import init_over_seeds, over_seeds


class LoopState(NamedTuple):
    buffer: object  # agent.Rollout, (T + 1 | T, E, ...) per seed
    returns: jax.Array  # (E,) discounted returns of the reward normaliser


def empty_loop(agent, T: int, E: int, obs_dim: int, act_dim: int) -> LoopState:
    z = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    b = agent.Rollout(
        z(T + 1, E, obs_dim),
        z(T + 1, E, act_dim),
        z(T + 1, E),
        z(T + 1, E),
        z(T, E),
        jnp.zeros((T, E), bool),
        jnp.zeros((T, E), bool),
        z(T, E),
    )
    return LoopState(b, z(E))


def init_state(agent, cfg: RunConfig, obs_dim: int, act_dim: int):
    keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 1)
    static = static_plasticity(cfg.plasticity, agent)  # Kron / NE masks, SIGReg: built into the agent
    state = init_over_seeds(agent, keys[1:], obs_dim, act_dim, cfg.agent, cfg.network, static)
    check_optimizers(cfg.plasticity, agent, cfg.agent_name, state)
    loop = jax.vmap(lambda _: empty_loop(agent, cfg.agent.num_steps, cfg.num_envs, obs_dim, act_dim))(
        jnp.arange(cfg.seeds)
    )
    return RunTree(state, loop, keys[0])


def template_tree(cfg: RunConfig, agent, obs_dim: int, act_dim: int):
    """The device tree a fresh run checkpoints (``OnPolicyIteration.tree()``: the agent states, the
    rollout buffers, the key), as ``init_state`` builds it; trace it with ``jax.eval_shape`` for a template."""
    return init_state(agent, cfg, obs_dim, act_dim)


resolve = env_resolve  # the config as given; the sizes of the env (built and closed)


def last_step(cfg: RunConfig, agent) -> int:
    """The step a finished run ends at: its last whole rollout (``check``: the number of iterations
    times the rollout batch), at or below ``--total-steps``."""
    batch, iterations = check(cfg)
    return batch * iterations


def action_mode(cfg: RunConfig, agent) -> str:
    """How the envs, the evaluation's included, map actions: ``--action-mode`` (``envs.actions``)."""
    return cfg.agent.action_mode


def _write_policy_slot(buffer, i, obs_n, action, logp, value):
    return buffer._replace(
        obs=buffer.obs.at[i].set(obs_n),
        actions=buffer.actions.at[i].set(action),
        logp=buffer.logp.at[i].set(logp),
        values=buffer.values.at[i].set(value),
    )


def seed_fns(agent, T: int):
    """(start_all, step_all, iterate_all): the loop's pure functions, vmapped over the leading seed axis.

    ``start_all(state, loop, raw_obs, key) -> (state, loop, action)``: normalise the first
    observations and sample the first actions; ``step_all(state, loop, t, reward, terminated,
    truncated, next_obs, new_obs, key) -> (state, loop, action)``: one vector step's bookkeeping (the
    key of step ``t`` is ``fold_in(key, t)``, split over seeds); ``iterate_all(state, loop, key) ->
    (state, loop, action, metrics, finite)``: the update and the next rollout's first actions.
    The host loop jits each (``make_fns``); the device loop (``training/loops/device.py``) composes
    them with the env's step inside one jitted program, so both loops do the same arithmetic.
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
        b = b._replace(
            rewards=b.rewards.at[t].set(r),
            terminated=b.terminated.at[t].set(terminated),
            truncated=b.truncated.at[t].set(truncated),
            final_values=b.final_values.at[t].set(jnp.where(truncated & ~terminated, final_v, 0.0)),
        )
        action, logp, v = agent.sample_action(state, obs_n, key)
        return state, LoopState(_write_policy_slot(b, t + 1, obs_n, action, logp, v), returns), action

    def iterate(state, loop, key):
        k_update, k_act = jax.random.split(key)
        state, metrics = agent.update(state, loop.buffer, k_update)
        obs_n = loop.buffer.obs[T]
        action, logp, v = agent.sample_action(state, obs_n, k_act)
        return state, loop._replace(buffer=_write_policy_slot(loop.buffer, 0, obs_n, action, logp, v)), action, metrics

    def start_all(state, loop, raw_obs, key):
        return jax.vmap(start)(state, loop, raw_obs, jax.random.split(key, raw_obs.shape[0]))

    def step_all(state, loop, t, reward, terminated, truncated, next_obs, new_obs, key):
        keys = jax.random.split(jax.random.fold_in(key, t), reward.shape[0])
        return jax.vmap(step, in_axes=(0, 0, None, 0, 0, 0, 0, 0, 0))(
            state, loop, t, reward, terminated, truncated, next_obs, new_obs, keys
        )

    def iterate_all(state, loop, key):
        seeds = loop.returns.shape[0]
        state, loop, action, metrics = over_seeds(iterate)(state, loop, jax.random.split(key, seeds))
        losses = [v for k, v in metrics.items() if k.startswith("losses/")]
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in losses] or [jnp.bool_(True)]))
        return state, loop, action, metrics, finite

    return start_all, step_all, iterate_all


def _unrolled_draws(fn):
    """``fn`` called inside ``networks.runtime.threefry_unrolled()``: its programs hash their random draws
    with the unrolled Threefry lowering on CPU (the same bits).  The host loop's per-step program makes three
    draws (the step's key, the seeds' keys, the action's noise) and little arithmetic at CleanRL's sizes, so
    JAX's rolled loops were a large share of each call (docs/benchmarks.md, PPO throughput)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with threefry_unrolled():
            return fn(*args, **kwargs)

    return call


@functools.lru_cache(maxsize=16)
def make_fns(agent, T: int):
    """(start, step, iterate, reset_norm, eval_act): ``seed_fns`` jitted for the host loop.

    Kron / NE masks and SIGReg are static fields of the agent state (``state.plasticity``), so
    they are part of each program's cache key.  Cached per (agent, T), so runs in one process
    (e.g. a resumed run, tests) reuse the compilations.  The step and the update lower their random
    draws unrolled (``_unrolled_draws``).
    """
    start_all, step_all, iterate_all = seed_fns(agent, T)

    def reset_norm(state, loop):
        return agent.reset_normalizers(state), loop._replace(returns=jnp.zeros_like(loop.returns))

    eval_act = jax.jit(jax.vmap(lambda s, o: agent.act(s, o, None, explore=False)))
    return (
        jax.jit(start_all, donate_argnums=(0, 1)),
        FlatStep(agent, step_all),
        _unrolled_draws(jax.jit(iterate_all, donate_argnums=(0, 1))),
        jax.jit(jax.vmap(reset_norm)),
        eval_act,
    )


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
        with threefry_unrolled():  # see _unrolled_draws
            return self._compiled[self._current[0]](ff, fm, *args)


def check(cfg: RunConfig, agent=None):
    """Settings the on-policy loop cannot run with (a ValueError naming the flag; ``agent`` is not
    needed) -> (the rollout batch in env steps per seed, the number of iterations)."""
    a = cfg.agent
    check_positive(
        **run_counts(cfg), num_steps=a.num_steps, num_minibatches=a.num_minibatches, update_epochs=a.update_epochs
    )
    batch = a.num_steps * cfg.num_envs
    if batch % a.num_minibatches:
        raise ValueError(
            f"the batch (--num-steps {a.num_steps} x --num-envs {cfg.num_envs} = {batch}) must be "
            f"divisible by --num-minibatches {a.num_minibatches}"
        )
    if cfg.total_steps < batch:
        raise ValueError(
            f"--total-steps {cfg.total_steps} is less than one rollout (--num-steps {a.num_steps} x "
            f"--num-envs {cfg.num_envs} = {batch} env steps per seed)"
        )
    return batch, cfg.total_steps // batch


def train(cfg: RunConfig, agent, run_dir: Path, resume: bool = False, stop_at: int | None = None) -> dict:
    """Train (or resume) a run.  ``stop_at`` ends early at the first iteration boundary at or after it."""
    batch, num_iterations = check(cfg)
    iteration = OnPolicyIteration(cfg, agent, num_iterations)
    driver = Driver(cfg, agent, run_dir, iteration.hooks, iteration.evaluator)
    iteration.begin(driver, resume)
    last_step = num_iterations * batch
    end = last_step if stop_at is None else min(stop_at, last_step)
    last_eval = driver.run(iteration, end, last_step)
    return {
        "state": iteration.state,
        "step": driver.step,
        "last_eval": last_eval,
        "run_dir": str(run_dir),
        "metrics": iteration.metrics,
    }


class OnPolicyIteration:
    """One rollout of ``num_steps`` vector steps of S seeds x E envs, then one update per seed."""

    def __init__(self, cfg: RunConfig, agent, num_iterations: int):
        a = cfg.agent
        self.cfg, self.agent, self.num_iterations = cfg, agent, num_iterations
        self.S, self.E, self.T = S, E, T = cfg.seeds, cfg.num_envs, a.num_steps
        self.env = make_vector_env(
            cfg.env,
            S * E,
            cfg.seed * 10_000,
            cfg.action_repeat,
            backend=a.backend,
            action_mode=a.action_mode,
            env_impl=cfg.env_impl,
        )
        self.evaluator = run_evaluator(cfg, action_mode(cfg, agent))  # --action-mode
        self.obs_dim, self.act_dim = self.env.obs_dim, self.env.act_dim
        self.state, self.loop, self.key = init_state(agent, cfg, self.obs_dim, self.act_dim)
        self.start_fn, self.step_fn, self.iterate_fn, self.reset_norm_fn, _ = make_fns(agent, T)
        # plasticity metrics, resets and NE events on samples of the latest rollout; periods count gradient updates
        self.updates_per_iteration = a.update_epochs * a.num_minibatches
        self.hooks = Hooks(
            cfg.plasticity, agent, cfg.agent_name, total_updates=num_iterations * self.updates_per_iteration
        )
        self.state = self.hooks.start(self.state)
        self.metrics: dict | None = None  # the last iteration's (set by each iteration; None before the first)
        self.updates_done, self.phase = 0, 0
        self.t, self.k_roll, self.ff, self.fm = 0, None, None, None  # the rollout's vector step; its key, flat leaves

    def _shaped(self, x):
        return np.asarray(x).reshape(self.S, self.E, *np.shape(x)[1:])

    def begin(self, driver, resume: bool):
        driver.begin(self, resume)
        S = self.S
        if resume and getattr(self.env, "restored_fresh", False):  # a backend that cannot pickle its simulator
            self.key, k = jax.random.split(self.key)
            self.state, self.loop, self.action = self.start_fn(self.state, self.loop, self._shaped(self.env.reset()), k)
        self.state = self.state.replace(num_iterations=jnp.full((S,), self.num_iterations, jnp.int32))
        self.counter = getattr(self.env, "step_counter", None)  # ns: envs on the sync backend share one counter
        if self.counter is not None:
            self.env.steps_per_call = self.E  # the counter counts per-seed env steps, the unit of --total-steps
            nonstationary.follow(self.evaluator.env, self.counter)

    def fresh(self):
        self.key, k = jax.random.split(self.key)
        self.state, self.loop, self.action = self.start_fn(self.state, self.loop, self._shaped(self.env.reset()), k)

    def tree(self):
        return RunTree(self.state, self.loop, self.key)

    def load(self, tree, host):
        self.state, self.loop, self.key = tree
        self.env, self.action = host["env"], jnp.asarray(host["action"])
        self.phase, self.updates_done = host["phase"], host["updates_done"]
        # the last update's statistics: the log rows of the next rollout show them (as uninterrupted)
        metrics = host.get("metrics")
        self.metrics = None if metrics is None else {k: jnp.asarray(v) for k, v in metrics.items()}

    def host(self) -> dict:
        return {
            "env": self.env,
            "action": np.asarray(self.action),
            "phase": self.phase,
            "updates_done": self.updates_done,
            "metrics": None if self.metrics is None else {k: np.asarray(v) for k, v in self.metrics.items()},
        }

    def eval_state(self):
        if self.t == 0:
            return self.state
        return self.step_fn.unflatten(self.fm)[0]  # inside a rollout: the flat leaves hold the live state

    def step(self, at: int, room: int) -> StepReport:
        """One vector step of the rollout; the last one also runs the update (after its log row: the
        rollout's rows show the last update's metrics), and the iteration is whole after it."""
        a, S, E, env, shaped, step_fn, t = self.cfg.agent, self.S, self.E, self.env, self._shaped, self.step_fn, self.t
        if t == 0:
            self.key, self.k_roll = jax.random.split(self.key)
            self.ff, self.fm = step_fn.flatten(self.state, self.loop)
        new_obs, reward, terminated, truncated, next_obs = env.step(np.asarray(self.action).reshape(S * E, -1))
        if self.counter is not None and a.ns_reset_norm:
            now = env.global_phase()
            if now != self.phase:
                self.state, self.loop = self.reset_norm_fn(*step_fn.unflatten(self.fm))
                self.ff, self.fm = step_fn.flatten(self.state, self.loop)
            self.phase = now
        self.fm, self.action = step_fn(
            self.ff,
            self.fm,
            np.int32(t),
            shaped(reward),
            shaped(terminated),
            shaped(truncated),
            shaped(next_obs),
            shaped(new_obs),
            self.k_roll,
        )
        episodes, logged = finished_episodes(env, S, E), self.metrics
        self.t = (t + 1) % self.T
        if self.t:
            return StepReport(E, E * S, logged, episodes, whole=False)
        self.state, self.loop = step_fn.unflatten(self.fm)
        self.ff = self.fm = None
        self.key, k = jax.random.split(self.key)
        self.state, self.loop, self.action, self.metrics, finite = self.iterate_fn(self.state, self.loop, k)
        before, self.updates_done = self.updates_done, self.updates_done + self.updates_per_iteration
        return StepReport(
            E,
            E * S,
            logged,
            episodes,
            finite=finite,
            stats={name: v for name, v in self.metrics.items() if name.startswith("losses/")},
            updates=(before, self.updates_done),
            data=self.loop.buffer,
            key=jax.random.fold_in(k, 1),
            learn_after_log=True,
        )

    def log_columns(self):
        """Non-stationary envs: the seeds' mean task id and the global phase (per seed, at a log row)."""
        if not hasattr(self.env, "task_ids"):
            return None
        tasks, E = self.env.task_ids(), self.E
        return [
            {"ns/task_id": float(np.mean(tasks[j * E : (j + 1) * E])), "ns/phase": self.env.global_phase()}
            for j in range(self.S)
        ]
