"""The wrappers every env id goes through, and the base envs (Gymnasium ids and ``dmc:<domain>-<task>``).

Agents see flat float32 observations.  Actions reach the env through one of two maps
(``ACTION_MODES``, see ``to_env_action``): ``rescale`` (the default) takes agent actions in [-1, 1] onto
the env's bounds; ``clip`` takes them in the env's own units and clips them to its bounds, as
CleanRL's PPO does (``gym.wrappers.ClipAction``).  The lowest layer of ``envs``:
``nonstationary`` builds on it, ``make`` dispatches over it, ``vector`` and ``backends`` step it.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from plasticity_zoo.envs.actions import agent_action_space, check_action_mode, to_env_action

ID_FORMS = (
    "valid env ids: a Gymnasium id such as 'HalfCheetah-v5', 'Hopper-v5' or 'Pendulum-v1', "
    "a DeepMind Control Suite task as 'dmc:<domain>-<task>', e.g. 'dmc:cheetah-run', "
    "a multitask set as 'mt:<id>,<id>,...' or 'mt:<suite>', e.g. 'mt:dmc4' (envs/multitask.py), "
    "a MuJoCo Playground task on the device as 'playground:<Name>', e.g. 'playground:CheetahRun' (extra .[mjx]), "
    "or an env a module registers with Gymnasium on import as '<module>:<id>' (Gymnasium's form), "
    "e.g. 'my_package.envs:MyEnv-v0'"
)
DMC_ACTION_REPEAT = 2  # MR.Q's DMC protocol


class ActionRepeat(gym.Wrapper):
    """Repeat each action ``k`` times, summing rewards and stopping early at episode end."""

    def __init__(self, env, k: int):
        super().__init__(env)
        self.k = k

    def step(self, action):
        total = 0.0
        for _ in range(self.k):
            obs, r, terminated, truncated, info = self.env.step(action)
            total += r
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, info


class UnitActions(gym.ActionWrapper):
    """Agent actions mapped onto the env's Box bounds by ``to_env_action`` (picklable)."""

    mode = "rescale"  # class default: checkpoints pickled before action modes existed rescale

    def __init__(self, env, mode: str = "rescale"):
        super().__init__(env)
        space = env.action_space
        if not (np.all(np.isfinite(space.low)) and np.all(np.isfinite(space.high))):
            raise ValueError("action space must be bounded to map actions onto it")
        self.mode = check_action_mode(mode)
        self._low = np.asarray(space.low, np.float64)
        self._high = np.asarray(space.high, np.float64)
        self.action_space = agent_action_space(self._low, self._high, self.mode)

    def action(self, action):
        return to_env_action(action, self._low, self._high, self.mode).astype(self.env.action_space.dtype)


class FlatFloat32(gym.ObservationWrapper):
    def __init__(self, env):
        super().__init__(env)
        low = np.asarray(env.observation_space.low, np.float32).ravel()
        high = np.asarray(env.observation_space.high, np.float32).ravel()
        self.observation_space = gym.spaces.Box(low, high, low.shape, np.float32)

    def observation(self, obs):
        return np.asarray(obs, np.float32).ravel()


_REGISTERED_BY: dict[str, list[str]] = {}  # module -> the env ids its first import registered


def import_env_module(env_id: str) -> str:
    """``'<module>:<id>'`` (Gymnasium's form): import the module, which registers the env, and return the
    id.  The module is looked up on ``sys.path`` and, after it, in the current directory (as ``python -m``
    would), so a user's package beside the run works from ``scripts/train.py``, ``evaluate.py`` and a
    ``--resume``: ``config.json`` keeps the whole id, and each of them imports the module again."""
    import importlib
    import os
    import sys

    module, _, name = env_id.rpartition(":")
    if not module or not name:
        raise ValueError(f"malformed env id {env_id!r}; {ID_FORMS}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    before = set(gym.registry)
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(
            f"env {env_id!r}: cannot import module {module!r} ({e}); it must be importable from "
            "the current directory or PYTHONPATH"
        ) from None
    registered = _REGISTERED_BY.setdefault(module, sorted(set(gym.registry) - before))
    if name not in gym.registry:
        mine = registered
        raise ValueError(
            f"env {env_id!r}: module {module!r} registers no env {name!r}"
            + (f"; it registers {', '.join(mine)}" if mine else "")
        )
    return name


def _gym_make(env_id: str, **kwargs) -> gym.Env:
    if ":" in env_id:
        env_id = import_env_module(env_id)
    if env_id not in gym.registry:
        raise ValueError(f"unknown env id {env_id!r}; {ID_FORMS}")
    env = gym.make(env_id, **kwargs)
    if not isinstance(env.action_space, gym.spaces.Box):
        raise ValueError(
            f"env {env_id!r} has a {type(env.action_space).__name__} action space; "
            "this zoo is for continuous (Box) actions"
        )
    return env


def make_base_env(
    env_id: str, seed: int = 0, action_repeat: int | None = None, render_mode=None, action_mode: str = "rescale"
) -> gym.Env:
    """A Gymnasium or ``dmc:`` env with flat float32 observations and actions mapped by ``action_mode``
    (``envs.make_env`` also dispatches ``ns:`` ids)."""
    check_action_mode(action_mode)
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"env id must be a non-empty string; {ID_FORMS}")
    if env_id.startswith("ns:"):
        raise ValueError(f"{env_id!r} is a non-stationary id: build it with envs.make_env")
    if env_id.startswith("mt:"):
        raise ValueError(f"{env_id!r} is a multitask id: build it with envs.make_env")
    if env_id.startswith("dmc:"):
        from plasticity_zoo.envs.dmc import DMCEnv

        name = env_id[4:]
        if "-" not in name:
            raise ValueError(f"malformed Control Suite id {env_id!r}; {ID_FORMS}")
        domain, task = name.split("-", 1)
        env = DMCEnv(domain, task, seed=seed, render_mode=render_mode, action_mode=action_mode)
        repeat = DMC_ACTION_REPEAT if action_repeat is None else action_repeat
    else:
        env = _gym_make(env_id, **({} if render_mode is None else {"render_mode": render_mode}))
        repeat = 1 if action_repeat is None else action_repeat
        env = UnitActions(env, action_mode)
    env = FlatFloat32(env)
    if repeat < 1:
        raise ValueError(f"action repeat must be >= 1, got {repeat}")
    if repeat > 1:
        env = ActionRepeat(env, repeat)
    env.action_space.seed(seed)
    return env
