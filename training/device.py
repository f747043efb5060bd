"""The device loop: envs on the accelerator and whole PPO iterations inside one jitted program.

For ``playground:`` envs (``envs/playground.py``) the env's step is a JAX function, so nothing has
to cross to the host between env steps.  One jitted call runs a *chunk* of K iterations, each

  1. a rollout: ``lax.scan`` over ``num_steps`` vector steps of all S seeds x E envs (the envs of
     every seed step as one batch of S * E; the agent's bookkeeping is the host loop's own
     ``training/onpolicy.py: seed_fns`` step, vmapped over seeds: reward scaling, the rollout slot,
     V(true final observation) at truncations, observation statistics, the next actions);
  2. the update: ``agent.update`` (GAE, epochs x minibatches in one scan) per seed, and the next
     rollout's first actions,

with K chosen by the host so that the chunk ends exactly at the next log row, evaluation,
checkpoint, plasticity event or the run's end (``--device-chunk`` caps it): the only host work
(PureJaxRL's shape, with the zoo's logs, evaluation, checkpoints and plasticity hooks at chunk
boundaries).  K is a traced loop bound, so chunks of any length share one compiled program, and
the key sequence is the host loop's (one split per rollout, one per update), so where a chunk
ends changes nothing: a run chunked by 1 equals a run chunked by 100, and a resumed run equals an
uninterrupted one, to the bit.

Differences from the host loop (``--loop host``): evaluations and log rows fall at the first
iteration boundary at or past their step (the host loop evaluates inside a rollout); a non-finite
loss anywhere in a chunk stops the run at the chunk's end; non-stationary (``ns:``) envs do not
run on the device.  Training episodes are reported as per-seed totals since the last chunk.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs import playground
from training.config import RunConfig
from training.driver import Driver
from training.evaluation import Evaluator, eval_action_mode, eval_base_seed
from training.onpolicy import check as onpolicy_check, init_state, seed_fns
from plasticity.hooks import Hooks

KINDS = ("onpolicy",)  # agent kinds with a device loop


def uses_device_loop(cfg: RunConfig, agent) -> bool:
    """Whether a run takes this loop: ``--loop device``, or ``auto`` on a ``playground:`` env with an
    agent kind the device loop runs."""
    loop = getattr(cfg, "loop", "auto")
    if loop == "device":
        return True
    return loop == "auto" and playground.is_playground(cfg.env) and agent.KIND in KINDS


def check(cfg: RunConfig, agent=None):
    """The device loop's settings (before any run directory exists), then the on-policy arithmetic."""
    if not playground.is_playground(cfg.env):
        raise ValueError(f"--loop device needs an env that steps on the device (playground:<Name>), got "
                         f"{cfg.env!r}; use --loop host")
    if agent is not None and agent.KIND not in KINDS:
        raise ValueError(f"--loop device runs on-policy agents (PPO); {agent.__name__.split('.')[-1]} is "
                         f"{agent.KIND}: use --loop host, which steps playground: envs from the host")
    if cfg.device_chunk < 0:
        raise ValueError(f"--device-chunk must be >= 0, got {cfg.device_chunk}")
    if cfg.agent.backend not in ("sync", "gymnasium"):
        raise ValueError(f"--backend {cfg.agent.backend} steps envs on the host; the device loop steps "
                         "playground: envs itself (leave --backend at its default)")
    return onpolicy_check(cfg)


class Carry(NamedTuple):
    state: object      # the agents (leading seed axis S)
    loop: object       # training.onpolicy.LoopState per seed
    env: object        # envs.playground.EnvState of S * E envs (seed j owns envs j*E .. j*E+E-1)
    action: jax.Array  # (S, E, act_dim): the actions the envs take next
    key: jax.Array


class Report(NamedTuple):
    """What a chunk hands the host: the last update's metrics, whether every loss stayed finite,
    the key of the last update (for the plasticity events), and per seed the finished episodes'
    summed returns, summed lengths and count."""

    metrics: dict
    finite: jax.Array
    last_key: jax.Array
    return_sum: jax.Array
    length_sum: jax.Array
    episodes: jax.Array


@functools.lru_cache(maxsize=8)
def make_chunk(agent, env: playground.Playground, S: int, E: int, T: int):
    """``chunk(carry, n) -> (carry, report)``: ``n`` iterations (traced), jitted with the carry donated."""
    start_all, step_all, iterate_all = seed_fns(agent, T)
    del start_all

    def shaped(x):
        return x.reshape(S, E, *x.shape[1:])

    def iteration(carry: Carry, totals):
        key, k_roll = jax.random.split(carry.key)

        def env_step(c, t):
            state, loop, env_state, action, (r_sum, l_sum, count) = c
            env_state, out = env.step(env_state, action.reshape(S * E, -1))
            state, loop, action = step_all(state, loop, t, shaped(out.reward), shaped(out.terminated),
                                           shaped(out.truncated), shaped(out.next_obs), shaped(out.obs), k_roll)
            ended = shaped(out.terminated | out.truncated)
            totals = (r_sum + shaped(out.ep_return).sum(1), l_sum + shaped(out.ep_length).sum(1),
                      count + ended.sum(1))
            return (state, loop, env_state, action, totals), None

        (state, loop, env_state, action, totals), _ = jax.lax.scan(
            env_step, (carry.state, carry.loop, carry.env, carry.action, totals), jnp.arange(T, dtype=jnp.int32))
        key, k = jax.random.split(key)
        state, loop, action, metrics, finite = iterate_all(state, loop, k)
        return Carry(state, loop, env_state, action, key), totals, metrics, finite, k

    def chunk(carry: Carry, n):
        zeros = (jnp.zeros(S, jnp.float32), jnp.zeros(S, jnp.int32), jnp.zeros(S, jnp.int32))
        shapes = jax.eval_shape(iteration, carry, zeros)
        metrics0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[2])

        def body(_, c):
            carry, totals, _, finite, _ = c
            carry, totals, metrics, ok, k = iteration(carry, totals)
            return carry, totals, metrics, finite & ok, k

        carry, totals, metrics, finite, k = jax.lax.fori_loop(
            0, n, body, (carry, zeros, metrics0, jnp.bool_(True), carry.key))
        return carry, Report(metrics, finite, k, *totals)

    return jax.jit(chunk, donate_argnums=(0,))


@functools.lru_cache(maxsize=8)
def make_start(agent, env: playground.Playground, S: int, E: int, T: int):
    """``start(state, loop, env_keys, key) -> (state, loop, env_state, action)``: reset the envs, first actions."""
    start_all = seed_fns(agent, T)[0]

    def start(state, loop, keys, key):
        env_state = env.reset(keys)
        obs = env_state.inner.obs.reshape(S, E, -1)
        state, loop, action = start_all(state, loop, obs, key)
        return state, loop, env_state, action

    return jax.jit(start, donate_argnums=(0, 1))


def train(cfg: RunConfig, agent, run_dir: Path, resume: bool = False, stop_at: int | None = None) -> dict:
    """Train (or resume) a run on the device.  ``stop_at`` ends early at the first iteration boundary at or after it."""
    batch, num_iterations = check(cfg, agent)
    iteration = DeviceIteration(cfg, agent, num_iterations)
    driver = Driver(cfg, agent, run_dir, iteration.hooks, iteration.evaluator)
    iteration.begin(driver, resume)
    last_step = num_iterations * batch
    end = last_step if stop_at is None else min(stop_at, last_step)
    last_eval = driver.run(iteration, end, last_step)
    return {"state": iteration.carry.state, "step": driver.step, "last_eval": last_eval, "run_dir": str(run_dir),
            "metrics": iteration.metrics}


class DeviceIteration:
    """A chunk of whole on-policy iterations (rollout and update) in one jitted call."""

    def __init__(self, cfg: RunConfig, agent, num_iterations: int):
        a = cfg.agent
        self.cfg, self.agent, self.num_iterations = cfg, agent, num_iterations
        self.S, self.E, self.T = S, E, T = cfg.seeds, cfg.num_envs, a.num_steps
        self.env = playground.make(cfg.env, cfg.action_repeat, a.action_mode, cfg.env_impl)
        self.evaluator = Evaluator(cfg.env, S, cfg.eval_episodes, eval_base_seed(cfg), cfg.action_repeat,
                                   eval_action_mode(cfg, agent), env_impl=cfg.env_impl)
        state, loop, key = init_state(agent, cfg, self.env.obs_dim, self.env.act_dim)
        self.updates_per_iteration = a.update_epochs * a.num_minibatches
        self.hooks = Hooks(cfg.plasticity, agent, cfg.agent_name,
                           total_updates=num_iterations * self.updates_per_iteration)
        state = self.hooks.start(state)
        self.carry = Carry(state, loop, None, None, key)
        self.chunk_fn = make_chunk(agent, self.env, S, E, T)
        self.metrics, self.updates_done = None, 0

    def begin(self, driver, resume: bool):
        if resume:  # the template's env state and actions: their structure, from a reset
            self._start()
        driver.begin(self, resume)
        n = jnp.full((self.S,), self.num_iterations, jnp.int32)
        self.carry = self.carry._replace(state=self.carry.state.replace(num_iterations=n))

    def _start(self):
        """Reset the envs (env seeds as the host loop's: ``seed * 10_000 + i``) and sample the first actions."""
        c = self.carry
        key, k = jax.random.split(c.key)
        keys = playground.env_keys(self.cfg.seed * 10_000 + np.arange(self.S * self.E))
        start = make_start(self.agent, self.env, self.S, self.E, self.T)
        state, loop, env_state, action = start(c.state, c.loop, keys, k)
        self.carry = Carry(state, loop, env_state, action, key)

    def fresh(self):
        self._start()

    def tree(self):
        return self.carry

    def load(self, tree, host):
        self.carry = Carry(*tree)
        self.updates_done = host["updates_done"]
        metrics = host.get("metrics")
        self.metrics = None if metrics is None else {k: jnp.asarray(v) for k, v in metrics.items()}

    def host(self) -> dict:
        return {"updates_done": self.updates_done,
                "metrics": None if self.metrics is None else {k: np.asarray(v) for k, v in self.metrics.items()}}

    def eval_state(self):
        return self.carry.state

    def iterations_to_next_event(self, drv: Driver) -> int:
        """Iterations until the next host work: log row, evaluation, checkpoint, plasticity event or the end."""
        batch, step = self.T * self.E, drv.step
        sched = drv.schedule
        targets = [sched.next_log, sched.next_eval, sched.next_ckpt, drv.end]
        n = min(-(-(t - step) // batch) for t in targets if t > step) if any(t > step for t in targets) else 1
        p, u, per = self.cfg.plasticity, self.updates_done, self.updates_per_iteration
        for every in (p.reset_every if (p.redo or p.regrama) else 0, p.metrics_every, p.ne_every if p.ne else 0):
            if every:
                n = min(n, -(-((u // every + 1) * every - u) // per))
        if self.cfg.device_chunk:
            n = min(n, self.cfg.device_chunk)
        return max(1, n)

    def run_one(self, drv: Driver):
        drv.evaluate_if_due(drv.step, lambda: self.carry.state)
        n = self.iterations_to_next_event(drv)
        self.carry, report = self.chunk_fn(self.carry, jnp.int32(n))
        drv.step += n * self.T * self.E
        drv.advance(n * self.T * self.E * self.S)
        self.metrics = report.metrics
        drv.stop_if_non_finite(report.finite, {k: v for k, v in report.metrics.items() if k.startswith("losses/")},
                               drv.step)
        drv.episode_totals(report.return_sum, report.length_sum, report.episodes)
        before, self.updates_done = self.updates_done, self.updates_done + n * self.updates_per_iteration
        state = drv.plasticity(before, self.updates_done, self.carry.state, self.carry.loop.buffer,
                               jax.random.fold_in(report.last_key, 1))
        self.carry = self.carry._replace(state=state)
        drv.log_if_due(drv.step, self.metrics)
