"""How an agent's action reaches the env: ``rescale`` (the zoo's default) or ``clip`` (CleanRL's PPO).

``rescale``: the agent acts in [-1, 1] and the action is mapped affinely onto the env's Box bounds
(values outside [-1, 1] are clipped first).  ``clip``: the agent acts in the env's own units and the
action is clipped to the bounds (``gym.wrappers.ClipAction``, which CleanRL's
``ppo_continuous_action.py`` applies).  The two agree where the bounds are [-1, 1] (most MuJoCo and
Control Suite tasks) and differ elsewhere (Humanoid's are [-0.4, 0.4]).  The lowest module of
``envs``: base envs, wrappers and vector backends all map actions here.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

ACTION_MODES = ("rescale", "clip")


def check_action_mode(mode: str) -> str:
    if mode not in ACTION_MODES:
        raise ValueError(f"unknown action mode {mode!r}; choose one of {', '.join(ACTION_MODES)}")
    return mode


def agent_action_space(low, high, mode: str) -> gym.spaces.Box:
    """The Box the agent acts in: [-1, 1] (``rescale``) or the env's own bounds (``clip``)."""
    if mode == "clip":
        return gym.spaces.Box(np.asarray(low, np.float32), np.asarray(high, np.float32), np.shape(low), np.float32)
    return gym.spaces.Box(-1.0, 1.0, np.shape(low), np.float32)


def to_env_action(action, low, high, mode: str):
    """An agent action -> the env's units (float64): ``rescale`` maps [-1, 1] affinely onto
    [low, high] (values outside [-1, 1] are clipped first); ``clip`` is ``clip(action, low, high)``."""
    a = np.asarray(action, np.float64)
    if mode == "clip":
        return np.clip(a, low, high)
    a = np.clip(a, -1.0, 1.0)
    return low + (a + 1.0) * 0.5 * (high - low)
