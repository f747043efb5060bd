"""The device loop: envs on the accelerator, whole chunks of training inside one jitted program.

For ``playground:`` envs (``envs/playground.py``) the env's step is a JAX function, so nothing has
to cross to the host between env steps.  One jitted call runs a *chunk* of K iterations, with K
chosen by the host so that the chunk ends exactly at the next log row, evaluation, checkpoint,
plasticity event or the run's end (``--device-chunk`` caps it): the only host work (PureJaxRL's
shape, with the zoo's logs, evaluation, checkpoints and plasticity hooks at chunk boundaries).
K is a traced loop bound, so chunks of any length share one compiled program, and each kind
draws its keys as its host loop does, so where a chunk ends changes nothing: a run chunked by 1
equals a run chunked by 100, and a resumed run equals an uninterrupted one, to the bit.  The envs
of every seed step as one batch of S * E (seed j owns envs ``j*E .. j*E+E-1``).

- **On-policy (PPO)**, ``DeviceOnPolicyIteration``: an iteration is a rollout, a ``lax.scan`` over
  ``num_steps`` vector steps, each followed by the host loop's own bookkeeping
  (``training/loops/onpolicy.py: seed_fns``, vmapped over seeds: reward scaling, the rollout slot,
  V(true final observation) at truncations, observation statistics, the next actions), then the
  update (``agent.update``: GAE, epochs x minibatches) per seed.
- **Off-policy (SAC, MR.Q)**, ``DeviceOffPolicyIteration``: an iteration is one vector step:
  the env step, ``agent.buffer_add`` of all ``num_envs`` transitions into the replay (on the device,
  in the carry), then once learning has started ``agent.train_block`` and the next actions (uniform
  random before ``learning_starts``, counted in env steps per seed), as ``training/loops/offpolicy.py``
  does per step.  The updates per vector step are ``updates_per_step * num_envs`` by default, or
  ``--updates-per-vector-step K`` whatever the number of envs (``agents.api.updates_per_vector_step``):
  many envs with a few large-batch updates per vector step, as Brax's SAC (``grad_updates_per_step``,
  Playground's DM Control recipe) and FastSAC / FastTD3 (``num_updates``) run them.

A step whose env state is not finite (``envs.playground.Step.diverged``) resets its env, is counted
per seed (``env/diverged`` in the log rows once above 0) and its transition stays out of the replay
(``buffer_add``'s ``valid`` rows).

Differences from the host loops (``--loop host``): evaluations and log rows fall at the first
iteration boundary at or past their step (the on-policy host loop evaluates inside a rollout); a
non-finite loss anywhere in a chunk stops the run at the chunk's end; LEAST (which cuts episodes
from the host) and non-stationary (``ns:``) envs do not run on the device.  Training episodes are
reported as per-seed totals since the last chunk.  Evaluation runs on the device too
(``training/evaluation.py``: one jitted program per evaluation).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.agents.api import updates_per_vector_step
from plasticity_zoo.buffers import replay
from plasticity_zoo.envs import playground
from plasticity_zoo.plasticity.hooks import Hooks
from plasticity_zoo.training.config import RunConfig
from plasticity_zoo.training.driver import Driver, StepReport
from plasticity_zoo.training.evaluation import run_evaluator
from plasticity_zoo.training.loop import env_resolve
from plasticity_zoo.training.loops import DEVICE_KINDS, offpolicy, onpolicy
from plasticity_zoo.training.loops.onpolicy import seed_fns
from plasticity_zoo.training.seeds import add_over_seeds, over_seeds


def _host(agent):
    """The host loop of the agent's kind, whose checks, initialisers and action mode this loop shares."""
    return {"onpolicy": onpolicy, "offpolicy": offpolicy}[agent.KIND]


def check(cfg: RunConfig, agent=None):
    """The device loop's settings (before any run directory exists), then the kind's own checks."""
    if not playground.is_playground(cfg.env):
        raise ValueError(
            f"--loop device needs an env that steps on the device (playground:<Name>), got {cfg.env!r}; use --loop host"
        )
    kind = "onpolicy" if agent is None else agent.KIND
    if kind not in DEVICE_KINDS:
        raise ValueError(
            f"--loop device runs on-policy (PPO) and off-policy (SAC, MR.Q) agents; "
            f"{agent.__name__.split('.')[-1]} is {kind}"
        )
    if cfg.device_chunk < 0:
        raise ValueError(f"--device-chunk must be >= 0, got {cfg.device_chunk}")
    if kind == "offpolicy":
        if cfg.plasticity.least:
            raise ValueError(
                "--plasticity.least cuts episodes from the host; it does not run in the device loop: pass --loop host"
            )
        return offpolicy.check(cfg, device=True)
    if cfg.agent.backend not in ("sync", "gymnasium"):
        raise ValueError(
            f"--backend {cfg.agent.backend} steps envs on the host; the device loop steps "
            "playground: envs itself (leave --backend at its default)"
        )
    return onpolicy.check(cfg)


class Report(NamedTuple):
    """What a chunk hands the host: the last update's metrics, whether every loss stayed finite,
    the key of the last update (for the plasticity events), per seed the finished episodes' summed
    returns, summed lengths and count, (off-policy) whether any iteration of the chunk learned, and
    per seed the env steps that diverged (``envs.playground.Step.diverged``)."""

    metrics: dict
    finite: jax.Array
    last_key: jax.Array
    return_sum: jax.Array
    length_sum: jax.Array
    episodes: jax.Array
    learned: jax.Array
    diverged: jax.Array


def _zero_totals(S: int):
    return jnp.zeros(S, jnp.float32), jnp.zeros(S, jnp.int32), jnp.zeros(S, jnp.int32), jnp.zeros(S, jnp.int32)


def _add_episodes(totals, out: playground.Step, S: int, E: int):
    """Per seed: summed returns, lengths and count of the episodes that finished in this env step, and
    the count of its envs that diverged."""
    r_sum, l_sum, count, diverged = totals
    per_seed = lambda x: x.reshape(S, E).sum(1)  # noqa: E731
    return (
        r_sum + per_seed(out.ep_return),
        l_sum + per_seed(out.ep_length),
        count + per_seed(out.finished.astype(jnp.int32)),
        diverged + per_seed(out.diverged.astype(jnp.int32)),
    )


def _zeros_like_shapes(shapes):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _env_keys(cfg: RunConfig):
    """The envs' reset keys from the host loops' env seeds (``seed * 10_000 + i``)."""
    return playground.env_keys(cfg.seed * 10_000 + np.arange(cfg.seeds * cfg.num_envs))


def _onpolicy_start(agent, env, carry, env_keys, S: int, E: int, T: int):
    """Reset the envs and sample the first actions (keys as ``OnPolicyIteration.fresh``)."""
    key, k = jax.random.split(carry.key)
    state, loop, env_state, action = make_start(agent, env, S, E, T)(carry.state, carry.loop, env_keys, k)
    return OnPolicyCarry(state, loop, env_state, action, key)


def _offpolicy_start(env, carry, env_keys, S: int, E: int):
    """Reset the envs; the first actions uniform (keys as ``OffPolicyIteration.fresh``)."""
    env_state = playground.jitted(env)[0](env_keys)
    key, k0 = jax.random.split(carry.key)
    action = jax.random.uniform(k0, (S, E, env.act_dim), minval=-1.0, maxval=1.0)
    return OffPolicyCarry(carry.state, carry.buffer, env_state, env_state.inner.obs.reshape(S, E, -1), action, key)


resolve = env_resolve  # the config as given; the sizes of the env (built and closed)


def last_step(cfg: RunConfig, agent) -> int:
    """The step a finished run ends at: the host loop's of its kind (on-policy: its last whole rollout)."""
    return _host(agent).last_step(cfg, agent)


def action_mode(cfg: RunConfig, agent) -> str:
    """How the envs map actions: as the host loop of the agent's kind maps them."""
    return _host(agent).action_mode(cfg, agent)


def template_tree(cfg: RunConfig, agent, obs_dim: int | None = None, act_dim: int | None = None):
    """The device tree a fresh run of this loop checkpoints, agent state first (build it under
    ``jax.eval_shape`` for a checkpoint template: ``analysis/restore.py: checkpoint_template``).
    ``obs_dim`` and ``act_dim`` are the Playground env's own, which this builds."""
    S, E = cfg.seeds, cfg.num_envs
    if agent.KIND == "onpolicy":
        env = playground.make(cfg.env, cfg.action_repeat, cfg.agent.action_mode, cfg.env_impl)
        state, loop, key = onpolicy.init_state(agent, cfg, env.obs_dim, env.act_dim)
        return _onpolicy_start(
            agent, env, OnPolicyCarry(state, loop, None, None, key), _env_keys(cfg), S, E, cfg.agent.num_steps
        )
    env = playground.make(cfg.env, cfg.action_repeat, "rescale", cfg.env_impl)
    state, buffer, key = offpolicy.init_state(agent, cfg, env.obs_dim, env.act_dim)
    return _offpolicy_start(env, OffPolicyCarry(state, buffer, None, None, None, key), _env_keys(cfg), S, E)


def train(cfg: RunConfig, agent, run_dir: Path, resume: bool = False, stop_at: int | None = None) -> dict:
    """Train (or resume) a run on the device.  ``stop_at`` ends early at the first iteration boundary at or after it."""
    counts = check(cfg, agent)
    if agent.KIND == "onpolicy":
        batch, num_iterations = counts
        iteration: _DeviceIteration = DeviceOnPolicyIteration(cfg, agent, num_iterations)
        last_step = num_iterations * batch
    else:
        iteration = DeviceOffPolicyIteration(cfg, agent)
        last_step = cfg.total_steps
    driver = Driver(cfg, agent, run_dir, iteration.hooks, iteration.evaluator)
    iteration.begin(driver, resume)
    end = last_step if stop_at is None else min(stop_at, last_step)
    last_eval = driver.run(iteration, end, last_step)
    return {
        "state": iteration.carry.state,
        "step": driver.step,
        "last_eval": last_eval,
        "run_dir": str(run_dir),
        "metrics": iteration.metrics,
        "buffer": getattr(iteration.carry, "buffer", None),  # off-policy: the replay, per seed
    }


class _DeviceIteration:
    """What both kinds share: the env, the evaluator, the carry in the checkpoint, the chunk sizes and
    the host work at a chunk's end.  A kind sets ``steps_per_iteration`` (env steps per seed),
    ``updates_per_iteration``, ``hooks``, ``carry``, ``chunk_fn`` and implements ``_start``,
    ``_chunk_args``, ``_updates_in`` and ``_learning_iterations_before``."""

    steps_per_iteration: int
    updates_per_iteration: int
    hooks: Any
    carry: Any
    chunk_fn: Callable

    def _start(self):
        raise NotImplementedError

    def _chunk_args(self, at: int) -> tuple:
        raise NotImplementedError

    def _updates_in(self, at: int, n: int) -> int:
        raise NotImplementedError

    def _learning_iterations_before(self, at: int) -> int:
        raise NotImplementedError

    def _plasticity_data(self):
        raise NotImplementedError

    def _last_log(self):
        raise NotImplementedError

    def _setup(self, cfg: RunConfig, agent, action_mode: str):
        self.cfg, self.agent = cfg, agent
        self.S, self.E = cfg.seeds, cfg.num_envs
        self.env = playground.make(cfg.env, cfg.action_repeat, action_mode, cfg.env_impl)
        self.evaluator = run_evaluator(cfg, action_mode)
        self.metrics, self.updates_done = None, 0
        self.diverged = np.zeros(self.S, np.int64)  # per seed, env steps whose state was not finite

    def begin(self, driver, resume: bool):
        if resume:  # the template's env state: its structure, from a reset
            self._start()
        driver.begin(self, resume)

    def fresh(self):
        self._start()

    def tree(self):
        return self.carry

    def load(self, tree, host):
        self.carry = type(self.carry)(*tree)
        self.updates_done = host["updates_done"]
        self.diverged = np.asarray(host.get("diverged", np.zeros(self.S, np.int64)))
        metrics = host.get("metrics")
        self.metrics = None if metrics is None else {k: jnp.asarray(v) for k, v in metrics.items()}

    def host(self) -> dict:
        return {
            "updates_done": self.updates_done,
            "diverged": self.diverged,
            "metrics": None if self.metrics is None else {k: np.asarray(v) for k, v in self.metrics.items()},
        }

    def eval_state(self):
        return self.carry.state

    @property
    def state(self):
        return self.carry.state

    @state.setter
    def state(self, state):
        self.carry = self.carry._replace(state=state)

    def iterations_to_next_event(self, at: int, room: int) -> int:
        """Iterations from step ``at`` until the next host work: ``room`` steps to the next log row,
        evaluation, checkpoint or the end (``Schedule.room``), or the next plasticity event."""
        n = _ceil_div(room, self.steps_per_iteration) if room > 0 else 1
        p, u = self.cfg.plasticity, self.updates_done
        for every in (p.reset_every if (p.redo or p.regrama) else 0, p.metrics_every, p.ne_every if p.ne else 0):
            if every:
                wanted = (u // every + 1) * every - u
                n = min(n, self._learning_iterations_before(at) + _ceil_div(wanted, self.updates_per_iteration))
        if self.cfg.device_chunk:
            n = min(n, self.cfg.device_chunk)
        return max(1, n)

    def step(self, at: int, room: int) -> StepReport:
        """One jitted chunk of iterations from step ``at``, ending at the next host work."""
        n = self.iterations_to_next_event(at, room)
        self.carry, report = self.chunk_fn(self.carry, jnp.int32(n), *self._chunk_args(at))
        updates = self._updates_in(at, n)
        steps = n * self.steps_per_iteration
        learned = bool(report.learned)
        if learned:
            self.metrics = report.metrics
        before, self.updates_done = self.updates_done, self.updates_done + updates
        self.diverged = self.diverged + np.asarray(report.diverged)
        metrics = self.metrics
        if metrics is not None and self.diverged.any():  # the column appears once an env has diverged
            metrics = {**metrics, "env/diverged": self.diverged}
        return StepReport(
            steps,
            steps * self.S,
            metrics,
            [
                [(float(r), float(length), int(c))] if c > 0 else []
                for r, length, c in zip(
                    np.asarray(report.return_sum), np.asarray(report.length_sum), np.asarray(report.episodes)
                )
            ],
            finite=report.finite if learned else None,
            stats={k: v for k, v in report.metrics.items() if k.startswith("losses/")} or report.metrics,
            updates=(before, self.updates_done) if updates else None,
            data=self._plasticity_data() if updates else None,
            key=jax.random.fold_in(report.last_key, 1) if updates else None,
            last_log=self._last_log(),
        )


# ----------------------------------------------------------------------------------------------
# On-policy: whole PPO iterations
# ----------------------------------------------------------------------------------------------
class OnPolicyCarry(NamedTuple):
    state: object  # the agents (leading seed axis S)
    loop: object  # training.loops.onpolicy.LoopState per seed
    env: object  # envs.playground.EnvState of S * E envs (None before the first reset)
    action: Any  # (S, E, act_dim): the actions the envs take next (None before the first reset)
    key: jax.Array


@functools.lru_cache(maxsize=8)
def make_chunk(agent, env: playground.Playground, S: int, E: int, T: int):
    """``chunk(carry, n) -> (carry, report)``: ``n`` PPO iterations (traced), jitted with the carry donated."""
    _, step_all, iterate_all = seed_fns(agent, T)

    def shaped(x):
        return x.reshape(S, E, *x.shape[1:])

    def iteration(carry: OnPolicyCarry, totals):
        key, k_roll = jax.random.split(carry.key)

        def env_step(c, t):
            state, loop, env_state, action, totals = c
            env_state, out = env.step(env_state, action.reshape(S * E, -1))
            state, loop, action = step_all(
                state,
                loop,
                t,
                shaped(out.reward),
                shaped(out.terminated),
                shaped(out.truncated),
                shaped(out.next_obs),
                shaped(out.obs),
                k_roll,
            )
            return (state, loop, env_state, action, _add_episodes(totals, out, S, E)), None

        (state, loop, env_state, action, totals), _ = jax.lax.scan(
            env_step, (carry.state, carry.loop, carry.env, carry.action, totals), jnp.arange(T, dtype=jnp.int32)
        )
        key, k = jax.random.split(key)
        state, loop, action, metrics, finite = iterate_all(state, loop, k)
        return OnPolicyCarry(state, loop, env_state, action, key), totals, metrics, finite, k

    def chunk(carry: OnPolicyCarry, n):
        metrics0 = _zeros_like_shapes(jax.eval_shape(iteration, carry, _zero_totals(S))[2])

        def body(_, c):
            carry, totals, _, finite, _ = c
            carry, totals, metrics, ok, k = iteration(carry, totals)
            return carry, totals, metrics, finite & ok, k

        carry, totals, metrics, finite, k = jax.lax.fori_loop(
            0, n, body, (carry, _zero_totals(S), metrics0, jnp.bool_(True), carry.key)
        )
        return_sum, length_sum, episodes, diverged = totals
        return carry, Report(metrics, finite, k, return_sum, length_sum, episodes, jnp.bool_(True), diverged)

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


class DeviceOnPolicyIteration(_DeviceIteration):
    """A chunk of whole on-policy iterations (rollout and update) in one jitted call."""

    def __init__(self, cfg: RunConfig, agent, num_iterations: int):
        a = cfg.agent
        self._setup(cfg, agent, a.action_mode)
        self.num_iterations, self.T = num_iterations, a.num_steps
        self.steps_per_iteration = self.T * self.E
        state, loop, key = onpolicy.init_state(agent, cfg, self.env.obs_dim, self.env.act_dim)
        self.updates_per_iteration = a.update_epochs * a.num_minibatches
        self.hooks = Hooks(
            cfg.plasticity, agent, cfg.agent_name, total_updates=num_iterations * self.updates_per_iteration
        )
        state = self.hooks.start(state)
        self.carry = OnPolicyCarry(state, loop, None, None, key)
        self.chunk_fn = make_chunk(agent, self.env, self.S, self.E, self.T)

    def begin(self, driver, resume: bool):
        super().begin(driver, resume)
        n = jnp.full((self.S,), self.num_iterations, jnp.int32)
        self.carry = self.carry._replace(state=self.carry.state.replace(num_iterations=n))

    def _start(self):
        self.carry = _onpolicy_start(self.agent, self.env, self.carry, _env_keys(self.cfg), self.S, self.E, self.T)

    def _chunk_args(self, at):
        return ()

    def _updates_in(self, at, n: int) -> int:
        return n * self.updates_per_iteration

    def _learning_iterations_before(self, at) -> int:
        return 0

    def _plasticity_data(self):
        return self.carry.loop.buffer

    def _last_log(self):
        return None


# ----------------------------------------------------------------------------------------------
# Off-policy: env step, replay add, updates
# ----------------------------------------------------------------------------------------------
class OffPolicyCarry(NamedTuple):
    state: object  # the agents (leading seed axis S)
    buffer: object  # each seed's replay, on the device
    env: object  # envs.playground.EnvState of S * E envs
    obs: Any  # (S, E, obs_dim): the observations to act on (None before the first reset)
    action: Any  # (S, E, act_dim): the actions the envs take next (None before the first reset)
    key: jax.Array


@functools.lru_cache(maxsize=8)
def make_offpolicy_chunk(agent, agent_cfg, env: playground.Playground, S: int, E: int):
    """``chunk(carry, n, step, replay_control) -> (carry, report)``: ``n`` vector steps (traced) from
    env step ``step`` (per seed), jitted with the carry donated.  Per step the keys are drawn as in
    ``training/loops/offpolicy.py``: one split of the run key, then (train key, act key)."""
    num_updates = updates_per_vector_step(agent_cfg, E)
    block = offpolicy.make_train_block(agent, agent_cfg, num_updates)
    learning_starts, act_dim = agent_cfg.learning_starts, env.act_dim

    def iteration(carry: OffPolicyCarry, i, step0, replay_control, totals):
        env_state, out = env.step(carry.env, carry.action.reshape(S * E, -1))
        per_seed = lambda x: x.reshape(S, E, *x.shape[1:])  # noqa: E731
        transition = replay.Transition(
            carry.obs,
            carry.action,
            per_seed(out.reward),
            per_seed(out.next_obs),
            per_seed(out.terminated),
            per_seed(out.truncated),
        )
        # a diverged step's transition is kept out of the replay (its env has reset)
        buffer = add_over_seeds(agent.buffer_add)(carry.buffer, transition, per_seed(~out.diverged))
        obs = per_seed(out.obs)
        key, k = jax.random.split(carry.key)
        k_train, k_act = jax.random.split(k)
        learning = step0 + (i + 1) * E >= learning_starts

        def train(args):
            state, buffer = args
            return over_seeds(block)(state, buffer, jax.random.split(k_train, S), replay_control)

        def wait(args):
            state, buffer = args
            return state, buffer, _zeros_like_shapes(jax.eval_shape(train, args)[2])

        state, buffer, metrics = jax.lax.cond(learning, train, wait, (carry.state, buffer))
        action = jax.lax.cond(
            learning,
            lambda: over_seeds(lambda s, o, kk: agent.act(s, o, kk, explore=True))(
                state, obs, jax.random.split(k_act, S)
            ),
            lambda: jax.random.uniform(k_act, (S, E, act_dim), minval=-1.0, maxval=1.0),
        )
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(m)) for m in jax.tree.leaves(metrics)] or [jnp.bool_(True)]))
        return (
            OffPolicyCarry(state, buffer, env_state, obs, action, key),
            _add_episodes(totals, out, S, E),
            metrics,
            finite,
            k,
            learning,
        )

    def chunk(carry: OffPolicyCarry, n, step0, replay_control=None):
        shapes = jax.eval_shape(iteration, carry, jnp.int32(0), step0, replay_control, _zero_totals(S))
        metrics0 = _zeros_like_shapes(shapes[2])

        def body(i, c):
            carry, totals, metrics, finite, k, learned = c
            carry, totals, new, ok, k, learning = iteration(carry, i, step0, replay_control, totals)
            metrics = jax.tree.map(lambda a, b: jnp.where(learning, a, b), new, metrics)
            return carry, totals, metrics, finite & ok, k, learned | learning

        carry, totals, metrics, finite, k, learned = jax.lax.fori_loop(
            0, n, body, (carry, _zero_totals(S), metrics0, jnp.bool_(True), carry.key, jnp.bool_(False))
        )
        return_sum, length_sum, episodes, diverged = totals
        return carry, Report(metrics, finite, k, return_sum, length_sum, episodes, learned, diverged)

    return jax.jit(chunk, donate_argnums=(0,))


class DeviceOffPolicyIteration(_DeviceIteration):
    """A chunk of off-policy vector steps (env step, replay add, updates, next actions) in one jitted call."""

    def __init__(self, cfg: RunConfig, agent):
        a = cfg.agent
        self._setup(cfg, agent, "rescale")
        self.steps_per_iteration = self.E
        self.updates_per_iteration = updates_per_vector_step(a, self.E)
        state, buffer, key = offpolicy.init_state(agent, cfg, self.env.obs_dim, self.env.act_dim)
        learning_iters = cfg.total_steps // self.E - max(0, -(-a.learning_starts // self.E) - 1)
        self.hooks = Hooks(
            cfg.plasticity, agent, cfg.agent_name, total_updates=max(1, learning_iters * self.updates_per_iteration)
        )
        state = self.hooks.start(state)
        self.carry = OffPolicyCarry(state, buffer, None, None, None, key)
        self.chunk_fn = make_offpolicy_chunk(agent, a, self.env, self.S, self.E)

    def _start(self):
        self.carry = _offpolicy_start(self.env, self.carry, _env_keys(self.cfg), self.S, self.E)

    def _chunk_args(self, at):
        return jnp.int32(at), self.hooks.replay_control

    def _learning_iterations_before(self, at) -> int:
        """Iterations from step ``at`` that do not learn (their step is still below ``learning_starts``)."""
        return max(0, _ceil_div(self.cfg.agent.learning_starts - at, self.E) - 1)

    def _updates_in(self, at, n: int) -> int:
        return max(0, n - self._learning_iterations_before(at)) * self.updates_per_iteration

    def _plasticity_data(self):
        return self.carry.buffer

    def _last_log(self):
        return self.cfg.total_steps
