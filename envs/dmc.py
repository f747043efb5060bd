"""DeepMind Control Suite as a Gymnasium env: flattened float32 observations, actions in [-1, 1]
(``action_mode="clip"``: in the task's own units, clipped to its bounds; see ``envs.wrappers``).

Control Suite episodes end by the time limit (1000 physics-control steps), which is a
truncation; a last time step with discount 0 is a termination.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from plasticity_zoo.envs.actions import agent_action_space, check_action_mode, to_env_action


def _flat_size(spec) -> int:
    return int(sum(np.prod(s.shape) if s.shape else 1 for s in spec.values()))


class DMCEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    mode = "rescale"  # class default for envs pickled before action modes existed

    def __init__(self, domain: str, task: str, seed: int = 0, render_mode=None, action_mode: str = "rescale"):
        from dm_control import suite  # imported lazily: dm_control is slow to import

        if (domain, task) not in suite.ALL_TASKS:
            valid = ", ".join(f"dmc:{d}-{t}" for d, t in suite.ALL_TASKS)
            raise ValueError(f"unknown Control Suite task dmc:{domain}-{task}; valid tasks: {valid}")
        self._env = suite.load(domain, task, task_kwargs={"random": seed})
        self.domain, self.task = domain, task
        self.render_mode = render_mode
        spec = self._env.action_spec()
        self._low, self._high = spec.minimum.astype(np.float64), spec.maximum.astype(np.float64)
        dim = _flat_size(self._env.observation_spec())
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (dim,), np.float32)
        self.mode = check_action_mode(action_mode)
        self.action_space = agent_action_space(self._low, self._high, self.mode)

    def _obs(self, ts) -> np.ndarray:
        return np.concatenate([np.asarray(v, np.float32).ravel() for v in ts.observation.values()])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self._env.task._random = np.random.RandomState(seed)
        return self._obs(self._env.reset()), {}

    def step(self, action):
        a = to_env_action(action, self._low, self._high, self.mode)
        ts = self._env.step(a)
        terminated = bool(ts.last() and ts.discount == 0.0)
        truncated = bool(ts.last() and not terminated)
        return self._obs(ts), float(ts.reward or 0.0), terminated, truncated, {}

    def render(self):
        return self._env.physics.render(height=480, width=480, camera_id=0)
