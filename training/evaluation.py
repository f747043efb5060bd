"""Deterministic evaluation at fixed evaluation seeds: the evaluator every loop builds, and the policies it runs.

Every loop builds its evaluator as ``run_evaluator(cfg, action_mode)`` does: seed ``j``'s evaluation
episode ``k`` resets its env with seed ``eval_base_seed(cfg) + j * eval_block(cfg) + k``, the action
repeat is the run's and the action mode the loop's (its ``action_mode``; for a finished run
``training.loops.eval_action_mode``).  For a multitask
(``mt:``) env ``--eval-episodes K`` counts episodes per task: a seed's block is K x T episodes
(``eval_block``), episode ``k`` runs task ``k % T``, and ``training.logger.task_results`` summarises
them per task.  A task chain with ``eval=all`` (``ns:chain:...:eval=all``) is scored the same way over
its distinct tasks (``envs.nonstationary.eval_tasks``), each evaluation env pinned to its task.
``SeedPolicy`` acts as ``Driver.evaluate`` does; ``analysis/restore.py`` loads a finished run's
checkpoint for it, so ``scripts/evaluate.py`` reproduces a run's own evaluations.

On a ``playground:`` env the episodes of a deterministic (memoryless) policy run on the device: one
jitted program resets the evaluation envs from the same env seeds and scans the policy and the physics
over one episode length; only the per-step rewards and episode ends come back, and the host sums them
as the host-stepped evaluation does, in the same order (``Evaluator._on_device``).  The program is the
host evaluation's per-step programs composed, so the returns are the host evaluation's (a test compares
the two).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.envs import make_vector_env, nonstationary
from plasticity_zoo.envs.multitask import is_multitask, member_ids
from plasticity_zoo.envs.playground import PlaygroundVectorEnv, env_keys
from plasticity_zoo.networks.runtime import cached_per_config

EVAL_SEED_OFFSET = 5_000  # evaluation env seeds: cfg.seed * 10_000 + 5_000 + i (training envs: cfg.seed * 10_000 + i)


class Evaluator:
    """``episodes`` evaluation episodes per seed (per task and seed for an ``mt:`` env); every
    evaluation resets to the same env seeds.

    A seed's block is ``self.episodes`` episodes: ``episodes`` for a single-task env, ``episodes x T``
    for an ``mt:`` env of T tasks, whose episode ``k`` runs task ``k % T`` (the vector env runs task
    ``i % T`` in env ``i`` and every block is a multiple of T), so each task gets ``episodes`` episodes
    per seed; ``tasks`` holds the member ids (None for a single-task env).
    Seed ``j``'s episode ``k`` resets with env seed ``base_seed + j * stride + k`` (``stride``:
    default ``self.episodes``, i.e. ``base_seed + i`` for the ``i``-th env).  ``policy(obs)`` maps
    observations shaped (seeds, self.episodes, obs_dim) to actions shaped (seeds, self.episodes, act_dim).
    A policy with a memory (``RecurrentPolicy``, a recurrent ``SeedPolicy``) also has ``reset()``,
    called when the episodes start, and ``observe(reward)``, called with each step's rewards shaped
    (seeds, self.episodes).  Returns per seed the list of episode returns, in episode order.
    """

    def __init__(
        self,
        env_id: str,
        seeds: int,
        episodes: int,
        base_seed: int,
        action_repeat=None,
        action_mode: str = "rescale",
        stride: int | None = None,
        env_impl: str = "jax",
    ):
        self.tasks = eval_tasks(env_id)
        self.seeds, self.episodes = seeds, episodes * (len(self.tasks) if self.tasks else 1)
        self.env = make_vector_env(
            env_id, seeds * self.episodes, base_seed, action_repeat, action_mode=action_mode, env_impl=env_impl
        )
        if self.tasks and not is_multitask(env_id):  # a chain scored on every task: env i runs task i % T
            nonstationary.pin_tasks(self.env, self.tasks)
        stride = self.episodes if stride is None else stride
        self.env_seeds = [base_seed + j * stride + k for j in range(seeds) for k in range(self.episodes)]

    def __call__(self, policy) -> list[list[float]]:
        pure = getattr(policy, "pure", None)  # (act, state) of a memoryless deterministic policy
        if pure is not None and self.on_device:
            return self._on_device(*pure)
        n = self.seeds * self.episodes
        obs = self.env.reset(self.env_seeds)
        if hasattr(policy, "reset"):
            policy.reset()
        returns = np.zeros(n)
        done = np.zeros(n, bool)
        while not done.all():
            actions = np.asarray(policy(obs.reshape(self.seeds, self.episodes, -1))).reshape(n, -1)
            obs, reward, terminated, truncated, _ = self.env.step(actions)
            if hasattr(policy, "observe"):
                policy.observe(np.asarray(reward, np.float32).reshape(self.seeds, self.episodes))
            returns += np.where(done, 0.0, reward)
            done |= terminated | truncated
        self.env.pop_finished()
        return returns.reshape(self.seeds, self.episodes).tolist()

    @property
    def on_device(self) -> bool:
        """Whether a memoryless policy's episodes run on the device (a ``playground:`` env scored as one task)."""
        return isinstance(self.env, PlaygroundVectorEnv) and self.tasks is None

    def _on_device(self, act, state) -> list[list[float]]:
        """``__call__`` as one device program: the same resets, actions and steps, summed on the host as above."""
        run = _device_episodes(self.env.pg, act, self.seeds, self.episodes)
        rewards, ended = jax.device_get(run(state, env_keys(self.env_seeds)))
        returns = np.zeros(self.seeds * self.episodes)
        done = np.zeros_like(returns, bool)
        for reward, end in zip(rewards, ended):  # (T, n): until every episode has ended, as the host loop
            if done.all():
                break
            returns += np.where(done, 0.0, reward)
            done |= end
        return returns.reshape(self.seeds, self.episodes).tolist()


@functools.lru_cache(maxsize=16)
def _device_episodes(pg, act, seeds: int, episodes: int):
    """``run(states, keys) -> (rewards, ended)``, each (episode length, seeds x episodes): ``pg``'s envs
    reset from ``keys`` and stepped for one episode length under ``act(states, obs)`` (obs shaped
    (seeds, episodes, obs_dim), as the host evaluation calls the policy); ended envs reset as on the host."""
    n = seeds * episodes

    def run(states, keys):
        def body(env, _):
            obs = env.inner.obs.astype(jnp.float32).reshape(seeds, episodes, -1)
            action = act(states, obs).reshape(n, -1).astype(jnp.float32)
            env, out = pg.step(env, action)
            return env, (out.reward, out.terminated | out.truncated)

        _, out = jax.lax.scan(body, pg.reset(keys), None, pg.episode_length)
        return out

    return jax.jit(run)


def eval_tasks(env_id: str) -> tuple[str, ...] | None:
    """The tasks each evaluation scores apart: an ``mt:`` env's members, a chain's distinct tasks with
    ``eval=all``; None for an env evaluated as one task."""
    if is_multitask(env_id):
        return member_ids(env_id)
    return nonstationary.eval_tasks(env_id)


def eval_block(cfg) -> int:
    """Evaluation episodes per seed of a run: ``--eval-episodes``, times the number of tasks ``eval_tasks`` scores."""
    tasks = eval_tasks(cfg.env)
    return cfg.eval_episodes * (len(tasks) if tasks else 1)


def eval_base_seed(cfg) -> int:
    """The env seed of a run's first evaluation episode (seed 0, episode 0)."""
    return cfg.seed * 10_000 + EVAL_SEED_OFFSET


def run_evaluator(
    cfg,
    action_mode: str,
    env_id: str | None = None,
    episodes: int | None = None,
    seeds: int | None = None,
    first_seed: int = 0,
) -> Evaluator:
    """The evaluator of a run (``cfg``; ``action_mode``: how its loop's envs map actions, the loop's
    ``action_mode(cfg, agent)``): on ``env_id`` (default ``cfg.env``), ``episodes``
    per seed (per task and seed on an ``mt:`` env; default ``cfg.eval_episodes``), for ``seeds`` seeds
    (default ``cfg.seeds``) starting at seed index ``first_seed``.  Seed ``j``'s episode ``k`` resets
    with the env seed ``eval_base_seed(cfg) + j * eval_block(cfg) + k``, so the run's own evaluation
    episodes come first."""
    episodes = cfg.eval_episodes if episodes is None else episodes
    seeds = cfg.seeds if seeds is None else seeds
    block = eval_block(cfg)
    return Evaluator(
        cfg.env if env_id is None else env_id,
        seeds,
        episodes,
        eval_base_seed(cfg) + first_seed * block,
        cfg.action_repeat,
        action_mode,
        stride=block,
        env_impl=env_impl(cfg),
    )


def env_impl(cfg) -> str:
    """The run's Playground physics backend (configs written before the field existed: jax)."""
    return getattr(cfg, "env_impl", "jax")


@cached_per_config
def deterministic_act(agent):
    """``act(states, obs)``: the agent's deterministic action, vmapped over the seed axis (as ``Driver.evaluate``)."""
    return jax.jit(jax.vmap(lambda s, o: agent.act(s, o, None, explore=False)))


def is_recurrent(agent) -> bool:
    """Whether the agent acts from the episode's history (``agents.api.RecurrentAgent``)."""
    from plasticity_zoo.agents.api import RecurrentAgent

    return isinstance(agent, RecurrentAgent)


@cached_per_config
def recurrent_fns(agent):
    """(memory(states, n), step(states, memory, obs, prev_action, prev_reward, start), action_shape(states,
    obs)): the recurrent agent's zero memory and deterministic step, vmapped over the seed axis and
    jitted, and the shape of its actions (abstract, nothing computed)."""
    memory = jax.jit(jax.vmap(lambda s, n: agent.initial_memory(s, n), in_axes=(0, None)), static_argnums=1)
    step = jax.jit(jax.vmap(lambda s, m, o, a, r, st: agent.act_step(s, m, o, a, r, st, None, False)))
    act = jax.vmap(lambda s, o: agent.act(s, o, None, False))
    return memory, step, lambda state, obs: jax.eval_shape(act, state, obs)


class RecurrentPolicy:
    """A recurrent agent's deterministic policy for ``Evaluator``: it carries each episode's memory,
    its previous action (the policy's own, in [-1, 1]) and reward (``observe``), and marks the first
    step after ``reset()`` as the episodes' start."""

    def __init__(self, state, fns):
        self.state, (self._memory, self._step, self._action_shape) = state, fns
        self.reset()

    def reset(self):
        self.memory = self.prev_action = self.prev_reward = None

    def __call__(self, obs):
        obs = jnp.asarray(obs, jnp.float32)
        start = self.memory is None
        if start:  # zero memory, previous action and reward (ignored at a start, shaped as the actions)
            self.memory = self._memory(self.state, obs.shape[1])
            self.prev_action = jnp.zeros(self._action_shape(self.state, obs).shape, jnp.float32)
            self.prev_reward = jnp.zeros(obs.shape[:2], jnp.float32)
        action, self.memory = self._step(
            self.state, self.memory, obs, self.prev_action, self.prev_reward, jnp.full(obs.shape[:2], start)
        )
        self.prev_action = action
        return action

    def observe(self, reward):
        self.prev_reward = jnp.asarray(reward, jnp.float32)


def policy_maker(agent):
    """``make(states) -> policy`` for ``Evaluator``: the deterministic policy of a vmapped agent state,
    a ``RecurrentPolicy`` for a recurrent agent (the jitted functions are built once, here)."""
    if is_recurrent(agent):
        fns = recurrent_fns(agent)
        return lambda state: RecurrentPolicy(state, fns)
    act = deterministic_act(agent)
    return lambda state: DeterministicPolicy(state, act)


class DeterministicPolicy:
    """A memoryless agent's deterministic policy for ``Evaluator``: ``act(state, obs)`` (jitted and pure,
    vmapped over the seed axis) on a vmapped agent ``state``.  Pure, so an evaluation on the device
    runs it inside its own program."""

    def __init__(self, state, act):
        self.state, self.act = state, act
        self.pure = (act, state)

    def __call__(self, obs):
        return self.act(self.state, jnp.asarray(obs))


class SeedPolicy:
    """The deterministic policy of seeds ``seeds`` (indices) of a vmapped agent ``state``, for ``Evaluator``.

    ``obs``: (len(seeds), n, obs_dim).  Each call acts for all the state's seeds on arrays of the
    run's own evaluation shape, (seeds, ``block``, obs_dim) with ``block`` its episodes per seed, as
    the run's evaluation does: the same program on the same shapes, with each episode of the run in
    its own place, gives the same actions to the bit (XLA's results can differ in the last bit
    between shapes, and an episode's return with them).  Rows of seeds not asked for, and the
    padding of the last block, hold zeros and are dropped.  For a recurrent agent each block of
    episodes keeps its own memory (``reset`` / ``observe`` as ``Evaluator`` calls them).
    """

    def __init__(self, agent, state, seeds, block: int | None = None):
        self.state, self.seeds, self.block = state, list(seeds), block
        self.total = jax.tree.leaves(state)[0].shape[0]
        make = policy_maker(agent)
        self.recurrent = is_recurrent(agent)
        self._make = lambda: make(state)  # noqa: E731
        self.parts: dict = {}  # one policy per block of episodes (a recurrent one carries its episodes' memory)
        # memoryless: the same actions as a pure function, for an evaluation on the device
        self.pure = None if self.recurrent else (_seed_act(agent, self.total, tuple(self.seeds), block), state)

    def reset(self):
        self.parts = {}

    def _blocks(self, n):
        block = self.block or n
        return [(start, min(n, start + block), block) for start in range(0, n, block)]

    def _full(self, x, block):
        full = np.zeros((self.total, block) + x.shape[2:], np.float32)
        full[self.seeds, : x.shape[1]] = x
        return full

    def __call__(self, obs):
        obs = np.asarray(obs, np.float32)
        out = []
        for start, end, block in self._blocks(obs.shape[1]):
            policy = self.parts.setdefault(start, self._make())
            actions = np.asarray(policy(jnp.asarray(self._full(obs[:, start:end], block))))
            out.append(actions[self.seeds, : end - start])
        return np.concatenate(out, axis=1)

    def observe(self, reward):
        """A step's rewards (len(seeds), n), for a recurrent agent's next inputs."""
        reward = np.asarray(reward, np.float32)
        if self.recurrent:
            for start, end, block in self._blocks(reward.shape[1]):
                self.parts[start].observe(jnp.asarray(self._full(reward[:, start:end], block)))


@functools.lru_cache(maxsize=16)
def _seed_act(agent, total: int, seeds: tuple, block: int | None):
    """``SeedPolicy``'s actions as a pure function ``act(state, obs)`` of a memoryless agent: ``obs``
    (len(seeds), n, obs_dim) placed in zero arrays of the run's evaluation shape, block by block, as
    ``SeedPolicy.__call__`` does."""
    act, rows = deterministic_act(agent), jnp.asarray(seeds)

    def run(state, obs):
        n, out = obs.shape[1], []
        for start in range(0, n, block or n):
            end = min(n, start + (block or n))
            full = jnp.zeros((total, block or n) + obs.shape[2:], jnp.float32)
            actions = act(state, full.at[rows, : end - start].set(obs[:, start:end]))
            out.append(actions[rows, : end - start])
        return jnp.concatenate(out, axis=1)

    return run
