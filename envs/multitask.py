"""Multitask envs: ``mt:<id>,<id>,...`` or ``mt:<suite>``, one task per env, all with the same spaces.

An explicit list names the members (Gymnasium ids or ``dmc:<domain>-<task>``; no ``ns:``,
``playground:`` or nested ``mt:`` members, no duplicates), e.g.
``mt:dmc:cartpole-balance,dmc:cartpole-swingup,dmc:pendulum-swingup``; one member is allowed.
Named suites (``SUITES``):

- ``dmc21``: the 21 standard Control Suite tasks of ScaleMRL's ``dmcontrol`` domain, in its order;
- ``dmc6``: ``dmc4`` + cheetah-run, walker-walk;
- ``dmc4``: cartpole-balance, cartpole-swingup, pendulum-swingup, reacher-easy (small, for CPUs);
- ``cartpole2``: cartpole-balance, cartpole-swingup.

Every member presents the same spaces (``TaskSpec``): the observation is the member's own, zero
padded to the largest member observation, followed by a one-hot of the task index; the action
is a Box(-1, 1) of the largest member action dimension, of which task ``t`` passes only its own
first ``act_dims[t]`` components to its env.  Rewards, ``terminated``, ``truncated`` and infos
pass through unchanged.  ``MultitaskEnv`` wraps the member built by ``make_base_env``, so
``env.unwrapped`` is the member's own env (MuJoCo state pickling in ``envs.vector`` works as for
a single task).  ``envs.vector.VectorEnv`` runs task ``i % num_tasks`` in env ``i``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from plasticity_zoo.envs.dmc import DMCEnv
from plasticity_zoo.envs.wrappers import ActionRepeat, make_base_env

PREFIX = "mt:"
UNSUPPORTED = ("ns:", "playground:")  # member forms a multitask env cannot hold

# ScaleMRL (Obando-Ceron et al. 2026), johanobandoc/ScaleMRL tdmpc2/common/__init__.py,
# TASK_SET['dmcontrol'], in its order, as the zoo's dm_control ids (cup = ball_in_cup).
_DMC21 = (
    "walker-stand",
    "walker-walk",
    "walker-run",
    "cheetah-run",
    "reacher-easy",
    "reacher-hard",
    "acrobot-swingup",
    "pendulum-swingup",
    "cartpole-balance",
    "cartpole-balance_sparse",
    "cartpole-swingup",
    "cartpole-swingup_sparse",
    "ball_in_cup-catch",
    "finger-spin",
    "finger-turn_easy",
    "finger-turn_hard",
    "fish-swim",
    "hopper-stand",
    "hopper-hop",
    "quadruped-walk",
    "quadruped-run",
)
_DMC4 = ("dmc:cartpole-balance", "dmc:cartpole-swingup", "dmc:pendulum-swingup", "dmc:reacher-easy")
SUITES: dict[str, tuple[str, ...]] = {
    "dmc21": tuple(f"dmc:{t}" for t in _DMC21),
    "dmc6": _DMC4 + ("dmc:cheetah-run", "dmc:walker-walk"),
    "dmc4": _DMC4,
    "cartpole2": _DMC4[:2],
}
FORMS = (
    f"a multitask id is 'mt:<id>,<id>,...' (Gymnasium or dmc: ids) or 'mt:<suite>' with a suite in {', '.join(SUITES)}"
)


def is_multitask(env_id) -> bool:
    return isinstance(env_id, str) and env_id.startswith(PREFIX)


def member_ids(env_id: str) -> tuple[str, ...]:
    """The member ids of an ``mt:`` id (a suite's or the explicit list), checked for form only."""
    if not is_multitask(env_id):
        raise ValueError(f"{env_id!r} is not a multitask id; {FORMS}")
    body = env_id[len(PREFIX) :].strip()
    if not body:
        raise ValueError(f"{env_id!r}: empty task list; {FORMS}")
    if "," not in body and ":" not in body and body not in gym.registry:  # a suite name
        if body not in SUITES:
            raise ValueError(f"{env_id!r}: unknown multitask suite {body!r}; {FORMS}")
        return SUITES[body]
    ids = tuple(m.strip() for m in body.split(","))
    for m in ids:
        if not m:
            raise ValueError(f"{env_id!r}: empty member id in the task list; {FORMS}")
        if m.startswith(PREFIX):
            raise ValueError(f"{env_id!r}: nested multitask member {m!r}; {FORMS}")
        if m.startswith(UNSUPPORTED):
            raise ValueError(f"{env_id!r}: member {m!r}: {m.split(':')[0]}: ids are not supported in a multitask env")
    duplicates = sorted({m for m in ids if ids.count(m) > 1})
    if duplicates:
        raise ValueError(f"{env_id!r}: duplicate member {', '.join(map(repr, duplicates))}")
    return ids


@dataclass(frozen=True)
class TaskSpec:
    """The shapes of an ``mt:`` env's members (hashable: every field a str, int or tuple)."""

    env_id: str
    tasks: tuple[str, ...]
    obs_dims: tuple[int, ...]
    act_dims: tuple[int, ...]
    episode_lengths: tuple[int, ...]  # agent steps in a full episode (after action repeat)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def max_obs_dim(self) -> int:
        return max(self.obs_dims)

    @property
    def max_act_dim(self) -> int:
        return max(self.act_dims)

    @property
    def obs_dim(self) -> int:
        """Padded observation + one-hot task index."""
        return self.max_obs_dim + self.num_tasks

    @property
    def act_dim(self) -> int:
        return self.max_act_dim

    def action_mask(self) -> np.ndarray:
        """(num_tasks, max_act_dim) float32: 1 on each task's own action dimensions, 0 on padding."""
        return (np.arange(self.max_act_dim) < np.asarray(self.act_dims)[:, None]).astype(np.float32)


def _member(
    env_id: str,
    member: str,
    seed: int = 0,
    action_repeat: int | None = None,
    render_mode=None,
    action_mode: str = "rescale",
) -> gym.Env:
    try:
        return make_base_env(member, seed, action_repeat, render_mode, action_mode)
    except ValueError as e:
        raise ValueError(f"{env_id!r}: {e}") from None


def _episode_length(env: gym.Env) -> float:
    """Agent steps in a full episode of a ``make_base_env`` env: its time limit (Gymnasium's
    TimeLimit or dm_control's step limit) over the action repeat, rounded up; inf where none."""
    repeat, limit = 1, math.inf
    while isinstance(env, gym.Wrapper):
        if isinstance(env, ActionRepeat):
            repeat = env.k
        if isinstance(env, gym.wrappers.TimeLimit):
            limit = min(limit, env._max_episode_steps or math.inf)
        env = env.env
    if isinstance(env, DMCEnv):
        limit = min(limit, env._env._step_limit)
    return math.ceil(round(limit) / repeat) if math.isfinite(limit) else math.inf


@functools.lru_cache(maxsize=None)
def task_spec(env_id: str, action_repeat: int | None = None) -> TaskSpec:
    """Build each member once (default action repeat: 2 for ``dmc:``, 1 for Gymnasium) and read its shapes."""
    tasks = member_ids(env_id)
    obs, act, lengths = [], [], []
    for m in tasks:
        env = _member(env_id, m, 0, action_repeat)
        try:
            obs.append(int(env.observation_space.shape[0]))
            act.append(int(env.action_space.shape[0]))
            lengths.append(_episode_length(env))
        finally:
            env.close()
        if not math.isfinite(lengths[-1]):
            raise ValueError(
                f"{env_id!r}: member {m!r} has no finite episode limit (a Gymnasium id needs max_episode_steps)"
            )
    return TaskSpec(env_id, tasks, tuple(obs), tuple(act), tuple(lengths))


class MultitaskEnv(gym.Wrapper):
    """Task ``task`` of an ``mt:`` id: the member env with padded spaces and a one-hot task index."""

    def __init__(
        self,
        env_id: str,
        task: int,
        seed: int = 0,
        action_repeat: int | None = None,
        render_mode=None,
        action_mode: str = "rescale",
    ):
        spec = task_spec(env_id, action_repeat)
        if not (isinstance(task, (int, np.integer)) and 0 <= task < spec.num_tasks):
            raise ValueError(f"{env_id!r}: task must be an int in [0, {spec.num_tasks}), got {task!r}")
        super().__init__(_member(env_id, spec.tasks[task], seed, action_repeat, render_mode, action_mode))
        space = self.env.action_space
        if action_mode == "clip" and not (np.all(space.low == -1) and np.all(space.high == 1)):
            raise ValueError(
                f"{env_id!r}: member {spec.tasks[task]!r} has action bounds other than [-1, 1], "
                "which a multitask env cannot share in action mode 'clip'; use 'rescale'"
            )
        self.task, self.task_spec = int(task), spec
        self._act_dim = spec.act_dims[task]
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (spec.obs_dim,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (spec.act_dim,), np.float32)
        self.action_space.seed(seed)

    @property
    def spec_mt(self) -> TaskSpec:
        return self.task_spec

    def _obs(self, obs) -> np.ndarray:
        out = np.zeros(self.task_spec.obs_dim, np.float32)
        out[: len(obs)] = obs
        out[self.task_spec.max_obs_dim + self.task] = 1.0
        return out

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        return self._obs(obs), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(np.asarray(action)[: self._act_dim])
        return self._obs(obs), reward, terminated, truncated, info
