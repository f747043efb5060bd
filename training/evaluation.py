"""Deterministic evaluation at fixed evaluation seeds."""
from __future__ import annotations

import numpy as np

from envs import VectorEnv


class Evaluator:
    """``episodes`` evaluation episodes per seed; every evaluation resets to the same env seeds.

    ``policy(obs)`` maps observations shaped (seeds, episodes, obs_dim) to actions shaped
    (seeds, episodes, act_dim).  Returns per seed the list of episode returns.
    """

    def __init__(self, env_id: str, seeds: int, episodes: int, base_seed: int, action_repeat=None,
                 action_mode: str = "rescale"):
        self.seeds, self.episodes = seeds, episodes
        self.env = VectorEnv(env_id, seeds * episodes, base_seed, action_repeat, action_mode)
        self.env_seeds = [base_seed + i for i in range(seeds * episodes)]

    def __call__(self, policy) -> list[list[float]]:
        n = self.seeds * self.episodes
        obs = self.env.reset(self.env_seeds)
        returns = np.zeros(n)
        done = np.zeros(n, bool)
        while not done.all():
            actions = np.asarray(policy(obs.reshape(self.seeds, self.episodes, -1))).reshape(n, -1)
            obs, reward, terminated, truncated, _ = self.env.step(actions)
            returns += np.where(done, 0.0, reward)
            done |= terminated | truncated
        self.env.pop_finished()
        return returns.reshape(self.seeds, self.episodes).tolist()
