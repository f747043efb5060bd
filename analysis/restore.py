"""A finished run read back: its agent at a checkpoint, its policy as the run evaluates it, and in the
env's units.

``restore_policy`` loads a run directory's checkpoint into the structure the run's loop would build
(``checkpoint_template``) without building the loop; ``RestoredRun.policy`` acts as the run's evaluation
does (``training.evaluation.SeedPolicy``) and ``RestoredRun.env_policy`` in the env's units.  Reading
finished runs sits above starting one: nothing in ``training`` imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.training.evaluation import (
    Evaluator,
    SeedPolicy,
    env_impl,
    eval_block,
    is_recurrent,
    run_evaluator,
)
from plasticity_zoo.training.loops import eval_action_mode, loop_for


def checkpoint_template(cfg, agent, obs_dim: int, act_dim: int):
    """A tree with the structure, shapes and dtypes of the device tree the run's loop checkpoints
    (``iteration.tree()``), traced abstractly from the loop's ``template_tree`` (``training.loops.loop_for``;
    nothing is computed; the arrays are zeros, which the OS allocates lazily, so a large replay capacity
    costs nothing until the checkpoint's rows are read).  The agent state is its first element."""
    loop = loop_for(cfg, agent)
    abstract = jax.eval_shape(lambda: loop.template_tree(cfg, agent, obs_dim, act_dim))

    def zeros(leaf):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jnp.zeros(leaf.shape, leaf.dtype)
        return np.zeros(leaf.shape, leaf.dtype)

    return jax.tree.map(zeros, abstract)


# ----------------------------------------------------------------------------------------------
# A run's policy in the env's units (RestoredRun.env_policy; analysis/export.py exports it)
# ----------------------------------------------------------------------------------------------
def env_units_supported(env_id: str):
    """ValueError for env ids whose actions have no single Gymnasium Box to map onto."""
    if env_id.startswith("mt:"):
        raise ValueError(
            f"env {env_id!r}: a multitask env pads each task's actions to a common width; it has "
            "no single action Box in env units"
        )
    if env_id.startswith("playground:"):
        raise ValueError(
            f"env {env_id!r}: Playground envs map actions on the device (float32, in JAX); env-unit "
            "policies are for Gymnasium, dmc: and ns: envs"
        )


@dataclass(frozen=True, eq=False)
class EnvActions:
    """Agent actions -> the env's units, as the zoo's env wrappers map them (``envs.actions.to_env_action``,
    then the dtype the base env receives: its action space's for a Gymnasium env, float64 for ``dmc:``)."""

    low: np.ndarray  # float64, the env's Box
    high: np.ndarray
    mode: str  # "rescale" or "clip" (the run's evaluation action mode)
    dtype: np.dtype

    def __post_init__(self):
        from plasticity_zoo.envs.actions import check_action_mode

        check_action_mode(self.mode)
        object.__setattr__(self, "low", np.asarray(self.low, np.float64))
        object.__setattr__(self, "high", np.asarray(self.high, np.float64))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    def __call__(self, action):
        from plasticity_zoo.envs.actions import to_env_action

        return to_env_action(np.asarray(action, np.float32), self.low, self.high, self.mode).astype(self.dtype)


def env_actions(env) -> EnvActions:
    """The action map of ``env`` (an env made by ``envs.make_env``): the bounds, mode and dtype of
    the wrapper that maps its actions (``UnitActions`` of a Gymnasium env, ``DMCEnv``), found through
    its wrappers; a ``ns:`` env's tasks must share them."""
    from plasticity_zoo.envs.dmc import DMCEnv
    from plasticity_zoo.envs.nonstationary import NonStationaryEnv
    from plasticity_zoo.envs.wrappers import UnitActions

    e = env
    while True:
        if isinstance(e, UnitActions):
            return EnvActions(e._low, e._high, e.mode, e.env.action_space.dtype)
        if isinstance(e, DMCEnv):
            return EnvActions(e._low, e._high, e.mode, np.float64)
        if isinstance(e, NonStationaryEnv):
            maps = [env_actions(t) for t in e.tasks]
            first = maps[0]
            if any(
                not (
                    np.array_equal(m.low, first.low)
                    and np.array_equal(m.high, first.high)
                    and m.mode == first.mode
                    and m.dtype == first.dtype
                )
                for m in maps[1:]
            ):
                raise ValueError(f"{e.env_id}: its tasks have different action bounds; no single map to env units")
            return first
        if not hasattr(e, "env"):
            raise ValueError(f"{type(env).__name__}: no action map to env units found among its wrappers")
        e = e.env


def action_repeat_of(env) -> int:
    """How many env steps one agent step takes (the product of its ``ActionRepeat`` wrappers)."""
    from plasticity_zoo.envs.nonstationary import NonStationaryEnv
    from plasticity_zoo.envs.wrappers import ActionRepeat

    repeat, e = 1, env
    while True:
        if isinstance(e, ActionRepeat):
            repeat *= e.k
        if isinstance(e, NonStationaryEnv):
            e = e.tasks[e.active]
        elif hasattr(e, "env"):
            e = e.env
        else:
            return repeat


@dataclass(frozen=True)
class RunEnv:
    """What a policy needs to know of the env a run evaluates on."""

    actions: EnvActions  # agent actions -> env units
    action_repeat: int  # env steps per agent step
    obs_dim: int  # flat observation size
    act_dim: int


def run_env(cfg, agent, env_id: str) -> RunEnv:
    """The env a run evaluates on (``env_id``), built as its evaluator builds it, described."""
    from plasticity_zoo.envs import make_env

    env_units_supported(env_id)
    env = make_env(env_id, 0, cfg.action_repeat, action_mode=eval_action_mode(cfg, agent), env_impl=env_impl(cfg))
    try:
        return RunEnv(
            env_actions(env),
            action_repeat_of(env),
            int(np.prod(env.observation_space.shape)),
            int(np.prod(env.action_space.shape)),
        )
    finally:
        env.close()


class EnvPolicy:
    """A deterministic policy in the env's units: ``policy(obs)`` with one observation (``(obs_dim,)``,
    or any shape of that size, flattened as the zoo's envs flatten it) -> one action shaped as the
    env's Box; a batch ``(n, obs_dim)`` -> ``(n, *action shape)``.  ``unit(obs)``: the agent's own
    action (before the map; in [-1, 1] for ``rescale``).  ``seed_policy``: a ``SeedPolicy`` of one
    seed, which acts on arrays shaped as the run's evaluation does."""

    def __init__(self, seed_policy: SeedPolicy, obs_dim: int, actions: EnvActions, action_shape=None):
        self.seed_policy, self.obs_dim, self.actions = seed_policy, int(obs_dim), actions
        self.action_shape = tuple(np.shape(actions.low) if action_shape is None else action_shape)

    @property
    def low(self) -> np.ndarray:
        return self.actions.low

    @property
    def high(self) -> np.ndarray:
        return self.actions.high

    def _batch(self, obs) -> tuple[np.ndarray, bool]:
        obs = np.asarray(obs, np.float32)
        if obs.ndim == 2 and obs.shape[1] == self.obs_dim:
            return obs, False
        if obs.size == self.obs_dim:
            return obs.reshape(1, self.obs_dim), True
        raise ValueError(
            f"observation of shape {obs.shape}: the policy takes one observation of {self.obs_dim} "
            f"values or a batch shaped (n, {self.obs_dim})"
        )

    def unit(self, obs) -> np.ndarray:
        batch, single = self._batch(obs)
        action = np.asarray(self.seed_policy(batch[None]))[0]
        return action[0] if single else action

    def __call__(self, obs) -> np.ndarray:
        batch, single = self._batch(obs)
        action = self.actions(np.asarray(self.seed_policy(batch[None]))[0])
        action = action.reshape((len(batch),) + self.action_shape)
        return action[0] if single else action


@dataclass
class RestoredRun:
    """A run's agent at one checkpoint: ``state`` is vmapped over the run's seeds."""

    run_dir: Path
    cfg: object  # training.config.RunConfig
    agent: object  # the agent module
    state: object
    step: int
    path: Path  # the checkpoint directory
    env_id: str  # the env the run evaluates on
    counter: object = None  # ns: ids: the training envs' step counter at the checkpoint (evaluations follow it)

    def evaluator(self, env_id: str | None = None, episodes: int | None = None, seed: int | None = None) -> Evaluator:
        """The run's evaluator (``run_evaluator``) on ``env_id`` (default: the run's, following its
        non-stationary schedule as the run does), for one seed index or all (``seed=None``)."""
        ev = run_evaluator(
            self.cfg,
            eval_action_mode(self.cfg, self.agent),
            env_id or self.env_id,
            episodes,
            seeds=None if seed is None else 1,
            first_seed=seed or 0,
        )
        if env_id in (None, self.env_id) and self.counter is not None:
            from plasticity_zoo.envs import nonstationary

            nonstationary.follow(ev.env, self.counter)
        return ev

    def policy(self, seed: int | None = None) -> SeedPolicy:
        """The deterministic policy of one seed index or all, acting as the run's evaluation acts."""
        return SeedPolicy(
            self.agent, self.state, range(self.cfg.seeds) if seed is None else [seed], block=eval_block(self.cfg)
        )

    def env_policy(self, seed: int = 0):
        """Seed index ``seed``'s deterministic policy in the env's units (an ``EnvPolicy``):
        ``policy(obs)`` takes one observation of the run's env (or a batch ``(n, obs_dim)``) and returns
        the action the env's own Box takes, the run's evaluation action mapped as its env maps it
        (``rescale``: low + (a + 1) / 2 (high - low); ``clip``: clipped to [low, high]), so stepping
        the plain Gymnasium env with it reproduces the run's evaluation.  Not for recurrent agents
        (their actions depend on the episode's history) nor ``mt:`` / ``playground:`` envs (ValueError)."""
        if is_recurrent(self.agent):
            raise ValueError(
                f"agent {self.cfg.agent_name!r} is recurrent: its actions depend on the episode's "
                "history; use policy() with the run's evaluator"
            )
        if not 0 <= seed < self.cfg.seeds:
            raise ValueError(f"seed index {seed}: the run has {self.cfg.seeds} seed(s)")
        env = run_env(self.cfg, self.agent, self.env_id)
        return EnvPolicy(self.policy(seed), env.obs_dim, env.actions)


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
    return sorted(
        int(p.name.split("_")[1]) for p in (Path(run_dir) / "ckpt").glob("step_*") if p.name.split("_")[1].isdigit()
    )


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
