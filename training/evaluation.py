"""Deterministic evaluation at fixed evaluation seeds, and a run's policy restored from a checkpoint.

Every loop builds its evaluator as ``run_evaluator(cfg, agent)`` does: seed ``j``'s evaluation
episode ``k`` resets its env with seed ``eval_base_seed(cfg) + j * eval_block(cfg) + k``, the action
repeat is the run's and the action mode the loop's (``eval_action_mode``).  For a multitask
(``mt:``) env ``--eval-episodes K`` counts episodes per task: a seed's block is K x T episodes
(``eval_block``), episode ``k`` runs task ``k % T``, and ``task_results`` summarises them per task
(``task_max_return`` normalises).  ``restore_policy``
loads a run directory's checkpoint into the structure the loop would build
(``checkpoint_template``) without building the loop, and ``SeedPolicy`` acts with it as
``Driver.evaluate`` does, so ``scripts/evaluate.py`` reproduces a run's own evaluations.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.envs import make_vector_env
from plasticity_zoo.networks.runtime import cached_per_config
from plasticity_zoo.envs.multitask import is_multitask, member_ids
from plasticity_zoo.training.logger import AGGREGATE_TASK

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

    def __init__(self, env_id: str, seeds: int, episodes: int, base_seed: int, action_repeat=None,
                 action_mode: str = "rescale", stride: int | None = None, env_impl: str = "jax"):
        self.tasks = member_ids(env_id) if is_multitask(env_id) else None
        self.seeds, self.episodes = seeds, episodes * (len(self.tasks) if self.tasks else 1)
        self.env = make_vector_env(env_id, seeds * self.episodes, base_seed, action_repeat, action_mode=action_mode,
                                   env_impl=env_impl)
        stride = self.episodes if stride is None else stride
        self.env_seeds = [base_seed + j * stride + k for j in range(seeds) for k in range(self.episodes)]

    def __call__(self, policy) -> list[list[float]]:
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


def task_max_return(member_id: str) -> float | None:
    """The largest return an episode of a multitask member can earn, for normalised scores:
    1000 for ``dmc:`` tasks (Control Suite rewards are in [0, 1] per control step over 1000 steps;
    the action repeat sums the rewards of the steps it repeats, so the episode's total is the same);
    None for any other member (no known maximum: its score, and the aggregate's, stay empty)."""
    return 1000.0 if member_id.startswith("dmc:") else None


def task_results(returns, tasks) -> list[dict]:
    """One seed's evaluation of an ``mt:`` env summarised per task, then over tasks.

    ``returns``: the seed's episode returns in episode order (episode ``k`` ran task ``k % T``);
    ``tasks``: the member ids.  -> T + 1 dicts ``{task, returns, return_mean, return_std, score}``:
    one per task (its episodes; ``score`` = return_mean / ``task_max_return``, None without a known
    maximum), then ``task="all"``: ``return_mean`` the mean over tasks of the per-task means,
    ``score`` the mean over tasks of the per-task scores (None if any task has none), and
    ``returns`` / ``return_std`` all the seed's episodes (in episode order) and their std."""
    r, T = np.asarray(returns, float), len(tasks)
    if r.size % T:
        raise ValueError(f"{r.size} evaluation returns do not split over {T} tasks")
    rows = []
    for t, name in enumerate(tasks):
        own, top = r[t::T], task_max_return(name)
        mean = float(own.mean())
        rows.append({"task": name, "returns": own.tolist(), "return_mean": mean, "return_std": float(own.std()),
                     "score": None if top is None else mean / top})
    scores = [row["score"] for row in rows]
    mean = float(np.mean([row["return_mean"] for row in rows]))
    rows.append({"task": AGGREGATE_TASK, "returns": r.tolist(), "return_mean": mean, "return_std": float(r.std()),
                 "score": None if None in scores else float(np.mean(scores))})
    return rows


def eval_block(cfg) -> int:
    """Evaluation episodes per seed of a run: ``--eval-episodes``, times the number of tasks of an ``mt:`` env."""
    return cfg.eval_episodes * (len(member_ids(cfg.env)) if is_multitask(cfg.env) else 1)


def eval_base_seed(cfg) -> int:
    """The env seed of a run's first evaluation episode (seed 0, episode 0)."""
    return cfg.seed * 10_000 + EVAL_SEED_OFFSET


def eval_action_mode(cfg, agent) -> str:
    """How the evaluation envs map actions: the on-policy loop's ``--action-mode``; ``rescale`` otherwise."""
    return cfg.agent.action_mode if agent.KIND == "onpolicy" else "rescale"


def run_evaluator(cfg, agent, env_id: str | None = None, episodes: int | None = None, seeds: int | None = None,
                  first_seed: int = 0) -> Evaluator:
    """The evaluator of a run (``cfg``, ``agent``): on ``env_id`` (default ``cfg.env``), ``episodes``
    per seed (per task and seed on an ``mt:`` env; default ``cfg.eval_episodes``), for ``seeds`` seeds
    (default ``cfg.seeds``) starting at seed index ``first_seed``.  Seed ``j``'s episode ``k`` resets
    with the env seed ``eval_base_seed(cfg) + j * eval_block(cfg) + k``, so the run's own evaluation
    episodes come first."""
    episodes = cfg.eval_episodes if episodes is None else episodes
    seeds = cfg.seeds if seeds is None else seeds
    block = eval_block(cfg)
    return Evaluator(cfg.env if env_id is None else env_id, seeds, episodes,
                     eval_base_seed(cfg) + first_seed * block, cfg.action_repeat,
                     eval_action_mode(cfg, agent), stride=block, env_impl=env_impl(cfg))


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
        action, self.memory = self._step(self.state, self.memory, obs, self.prev_action, self.prev_reward,
                                         jnp.full(obs.shape[:2], start))
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
    return lambda state: (lambda obs: act(state, jnp.asarray(obs)))


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
        self.parts = {}  # one policy per block of episodes (a recurrent one carries its episodes' memory)

    def reset(self):
        self.parts = {}

    def _blocks(self, n):
        block = self.block or n
        return [(start, min(n, start + block), block) for start in range(0, n, block)]

    def _full(self, x, block):
        full = np.zeros((self.total, block) + x.shape[2:], np.float32)
        full[self.seeds, :x.shape[1]] = x
        return full

    def __call__(self, obs):
        obs = np.asarray(obs, np.float32)
        out = []
        for start, end, block in self._blocks(obs.shape[1]):
            policy = self.parts.setdefault(start, self._make())
            actions = np.asarray(policy(jnp.asarray(self._full(obs[:, start:end], block))))
            out.append(actions[self.seeds, :end - start])
        return np.concatenate(out, axis=1)

    def observe(self, reward):
        """A step's rewards (len(seeds), n), for a recurrent agent's next inputs."""
        reward = np.asarray(reward, np.float32)
        if self.recurrent:
            for start, end, block in self._blocks(reward.shape[1]):
                self.parts[start].observe(jnp.asarray(self._full(reward[:, start:end], block)))


# ----------------------------------------------------------------------------------------------
# A run's policy from its checkpoint
# ----------------------------------------------------------------------------------------------
def checkpoint_template(cfg, agent, obs_dim: int, act_dim: int):
    """A tree with the structure, shapes and dtypes of the device tree the run's loop checkpoints
    (``iteration.tree()``), built abstractly from the loop's own initialisers (nothing is computed;
    the arrays are zeros, which the OS allocates lazily, so a large replay capacity costs nothing
    until the checkpoint's rows are read).  The agent state is its first element."""
    kind = agent.KIND
    from plasticity_zoo.training import device

    if kind != "offline" and device.uses_device_loop(cfg, agent):
        build = lambda: device.initial_tree(cfg, agent)  # noqa: E731  (the device loop's carry)
    elif kind == "offpolicy":
        from plasticity_zoo.training.offpolicy import init_state

        build = lambda: init_state(agent, cfg, obs_dim, act_dim)  # noqa: E731  (state, buffer, key)
    elif kind == "onpolicy":
        from plasticity_zoo.training.onpolicy import init_state

        build = lambda: init_state(agent, cfg, obs_dim, act_dim)  # noqa: E731  (state, loop, key)
    elif kind == "offline":
        from plasticity_zoo.buffers.replay import Transition
        from plasticity_zoo.training.offline import _buffers, initial_state

        class _Shapes:  # the dataset as initial_state reads it; its rows are not checkpointed
            def __init__(self, real):
                self.obs_dim, self.act_dim, self.real = obs_dim, act_dim, real

            def transitions(self, unit_actions=False):
                return self.real

        def build():
            real = Transition(jnp.zeros((1, obs_dim)), jnp.zeros((1, act_dim)), jnp.zeros(1), jnp.zeros((1, obs_dim)),
                              jnp.zeros(1, bool), jnp.zeros(1, bool))
            keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 2)
            state, data = initial_state(cfg, agent, _Shapes(real), keys[2:])
            return state, _buffers(data), keys[1]  # OfflineIteration.tree()
    else:
        raise ValueError(f"agent {cfg.agent_name!r} has unknown kind {kind!r}")
    abstract = jax.eval_shape(build)

    def zeros(leaf):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jnp.zeros(leaf.shape, leaf.dtype)
        return np.zeros(leaf.shape, leaf.dtype)

    return jax.tree.map(zeros, abstract)


@dataclass
class RestoredRun:
    """A run's agent at one checkpoint: ``state`` is vmapped over the run's seeds."""

    run_dir: Path
    cfg: object          # training.config.RunConfig
    agent: object        # the agent module
    state: object
    step: int
    path: Path           # the checkpoint directory
    env_id: str          # the env the run evaluates on
    counter: object = None  # ns: ids: the training envs' step counter at the checkpoint (evaluations follow it)

    def evaluator(self, env_id: str | None = None, episodes: int | None = None, seed: int | None = None) -> Evaluator:
        """The run's evaluator (``run_evaluator``) on ``env_id`` (default: the run's, following its
        non-stationary schedule as the run does), for one seed index or all (``seed=None``)."""
        ev = run_evaluator(self.cfg, self.agent, env_id or self.env_id, episodes,
                           seeds=None if seed is None else 1, first_seed=seed or 0)
        if env_id in (None, self.env_id) and self.counter is not None:
            from plasticity_zoo.envs import nonstationary

            nonstationary.follow(ev.env, self.counter)
        return ev

    def policy(self, seed: int | None = None) -> SeedPolicy:
        """The deterministic policy of one seed index or all, acting as the run's evaluation acts."""
        return SeedPolicy(self.agent, self.state, range(self.cfg.seeds) if seed is None else [seed],
                          block=eval_block(self.cfg))


def run_env_id(run_dir, cfg) -> str:
    """The env a run evaluates on: ``cfg.env``, else (offline runs) the dataset's env from dataset.json."""
    if cfg.env:
        return cfg.env
    meta = Path(run_dir) / "dataset.json"
    if meta.is_file():
        return json.loads(meta.read_text())["env_id"]
    raise SystemExit(f"{run_dir}: config.json names no env and there is no dataset.json")


def checkpoint_steps(run_dir) -> list[int]:
    """The steps of the checkpoints in ``run_dir/ckpt``, ascending."""
    return sorted(int(p.name.split("_")[1]) for p in (Path(run_dir) / "ckpt").glob("step_*")
                  if p.name.split("_")[1].isdigit())


def restore_policy(run_dir, step: int | None = None, warn=None) -> RestoredRun:
    """The agent of run directory ``run_dir`` at its newest intact checkpoint (``checkpoint.load_latest``,
    skipping damaged ones with a warning), or at ``step``; nothing in the directory is written.

    Raises SystemExit (a message) for a directory that is not a run or has no such checkpoint, and
    ``checkpoint.CheckpointError`` (a ValueError) for a checkpoint that cannot be read."""
    from plasticity_zoo import agents
    from plasticity_zoo.envs import make_env
    from plasticity_zoo.training import checkpoint
    from plasticity_zoo.training.run import load_config

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SystemExit(f"{run_dir}: no such run directory")
    if not (run_dir / "config.json").is_file():
        raise SystemExit(f"{run_dir}: not a run directory (no config.json)")
    cfg = load_config(run_dir)
    agent = agents.get(cfg.agent_name)
    env_id = run_env_id(run_dir, cfg)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise SystemExit(f"{run_dir}: no checkpoint in {run_dir / 'ckpt'} (the run stopped before its first one)")
    if step is not None and step not in steps:
        raise SystemExit(f"{run_dir}: no checkpoint at step {step}; checkpoints: {', '.join(map(str, steps))}")
    env = make_env(env_id, 0, cfg.action_repeat, action_mode=eval_action_mode(cfg, agent), env_impl=env_impl(cfg))
    obs_dim, act_dim = int(np.prod(env.observation_space.shape)), int(np.prod(env.action_space.shape))
    env.close()
    template = checkpoint_template(cfg, agent, obs_dim, act_dim)
    if step is None:
        tree, host, _, path = checkpoint.load_latest(run_dir, template, warn=warn)
    else:
        path = checkpoint.path_for(run_dir, step)
        tree, host, _ = checkpoint.load(path, template)
    counter = getattr(host.get("env"), "step_counter", None)
    return RestoredRun(run_dir, cfg, agent, tree[0], int(host["step"]), path, env_id, counter)
