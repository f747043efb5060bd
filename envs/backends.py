"""Alternative vector-env backends with ``envs.make.VectorEnv``'s interface.

Both adapters expose ``num_envs``, ``obs_dim``, ``act_dim``, ``reset(seeds=None) -> obs``,
``step(actions) -> (obs, reward, terminated, truncated, next_obs)`` with *same-step* autoreset
(``next_obs`` is the true final observation of an ended episode, ``obs`` the reset one),
``pop_finished()``, ``sample_actions(rng)``, ``close()``, and they pickle for checkpoints.

- ``AsyncVectorEnv``: Gymnasium's ``AsyncVectorEnv`` (one spawned subprocess per env).  Each subprocess
  runs a one-env ``VectorEnv`` built by ``make_env``, so observations, action scaling, time limits
  and autoreset are exactly the sync backend's; Gymnasium's own autoreset is disabled.  Pickling
  fetches every worker's exact state (MuJoCo state and generators), so resume is exact.
  Non-stationary (``ns:``) envs in workers each count their own steps (a private counter).
- ``EnvPoolVectorEnv``: EnvPool (optional: ``pip install -e '.[envpool]'``) for the Gymnasium ids
  it lists.  EnvPool autoresets on the *next* step (the step after an episode ends ignores the
  action and returns the reset observation); this adapter emulates same-step autoreset by
  resetting the ended envs explicitly (``reset(env_id=...)``, supported in EnvPool's sync mode)
  within the same ``step()`` call, so no transition ever spans two episodes.  EnvPool bundles its
  own MuJoCo build, so trajectories are not bit-identical to Gymnasium's.  Its simulator state
  cannot be pickled: a restored EnvPool env is rebuilt and reset (``restored_fresh`` is set), so a
  resumed run restarts the episodes that were in flight.
"""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np

from plasticity_zoo.envs.actions import check_action_mode, to_env_action
from plasticity_zoo.envs.vector import VectorEnv


def _seeds(seed: int, num_envs: int, seeds):
    return [seed + i for i in range(num_envs)] if seeds is None else [int(s) for s in seeds]


class _EpisodeStats:
    """(env index, return, length) of finished episodes, like ``VectorEnv.finished``."""

    def _init_stats(self, n):
        self._returns = np.zeros(n)
        self._lengths = np.zeros(n, np.int64)
        self.finished: list[tuple[int, float, int]] = []

    def _track(self, reward, done):
        self._returns += reward
        self._lengths += 1
        for i in np.nonzero(done)[0]:
            self.finished.append((int(i), float(self._returns[i]), int(self._lengths[i])))
            self._returns[i], self._lengths[i] = 0.0, 0

    def pop_finished(self):
        done, self.finished = self.finished, []
        return done

    def sample_actions(self, rng: np.random.Generator) -> np.ndarray:
        return rng.uniform(-1.0, 1.0, (self.num_envs, self.act_dim)).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Gymnasium AsyncVectorEnv
# ----------------------------------------------------------------------------------------------
class _Worker(gym.Env):
    """One env in a subprocess: a one-env ``VectorEnv`` (same-step autoreset, exact pickling)."""

    def __init__(self, env_id, seed, action_repeat, index, action_mode="rescale"):
        self.index = index
        self.vec = VectorEnv(env_id, 1, seed, action_repeat, action_mode)
        self.observation_space = self.vec.envs[0].observation_space
        self.action_space = self.vec.envs[0].action_space

    def reset(self, *, seed=None, options=None):
        return self.vec.reset(None if seed is None else [seed])[0], {}

    def step(self, action):
        obs, r, term, trunc, next_obs = self.vec.step(np.asarray(action)[None])
        self.vec.pop_finished()
        return obs[0], float(r[0]), bool(term[0]), bool(trunc[0]), {"next_obs": next_obs[0]}

    def get_state(self):
        return pickle.dumps(self.vec, protocol=pickle.HIGHEST_PROTOCOL)

    def set_state(self, states):
        self.vec = pickle.loads(states[self.index])


def _make_worker(env_id, seed, action_repeat, index, action_mode="rescale"):
    return _Worker(env_id, seed, action_repeat, index, action_mode)


class AsyncVectorEnv(_EpisodeStats):
    def __init__(
        self, env_id: str, num_envs: int, seed: int, action_repeat: int | None = None, action_mode: str = "rescale"
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.env_id, self.num_envs, self.seed, self.action_repeat = env_id, num_envs, seed, action_repeat
        self.action_mode = check_action_mode(action_mode)
        probe = VectorEnv(env_id, 1, seed, action_repeat, action_mode)  # fails fast (and clearly) on a bad id
        self.obs_dim, self.act_dim = probe.obs_dim, probe.act_dim
        probe.close()
        self._start()
        self._init_stats(num_envs)

    def _start(self):
        from functools import partial

        from gymnasium.vector import AutoresetMode

        fns = [
            partial(_make_worker, self.env_id, self.seed + i, self.action_repeat, i, self.action_mode)
            for i in range(self.num_envs)
        ]
        # "spawn": the workers never inherit JAX's threads (forking a process that runs JAX can deadlock)
        self._env = gym.vector.AsyncVectorEnv(fns, autoreset_mode=AutoresetMode.DISABLED, context="spawn")

    def reset(self, seeds=None) -> np.ndarray:
        obs, _ = self._env.reset(seed=_seeds(self.seed, self.num_envs, seeds))
        self._init_stats(self.num_envs)
        return np.asarray(obs, np.float32)

    def step(self, actions):
        actions = np.asarray(actions, np.float32).reshape(self.num_envs, self.act_dim)
        obs, reward, terminated, truncated, info = self._env.step(actions)
        reward = np.asarray(reward, np.float32)
        terminated, truncated = np.asarray(terminated, bool), np.asarray(truncated, bool)
        self._track(reward, terminated | truncated)
        return (np.asarray(obs, np.float32), reward, terminated, truncated, np.asarray(info["next_obs"], np.float32))

    def close(self):
        self._env.close()

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k != "_env"}
        state["_worker_states"] = list(self._env.call("get_state"))
        return state

    def __setstate__(self, state):
        worker_states = state.pop("_worker_states")
        self.__dict__.update(state)
        self._start()
        self._env.call("set_state", worker_states)


# ----------------------------------------------------------------------------------------------
# EnvPool
# ----------------------------------------------------------------------------------------------
def _envpool():
    try:
        import envpool
    except ImportError as e:
        raise ImportError(
            "the envpool backend needs EnvPool, which is not installed: "
            "pip install -e '.[envpool]' (or pip install envpool), or use --backend sync"
        ) from e
    return envpool


class EnvPoolVectorEnv(_EpisodeStats):
    def __init__(
        self, env_id: str, num_envs: int, seed: int, action_repeat: int | None = None, action_mode: str = "rescale"
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.action_mode = check_action_mode(action_mode)
        if not isinstance(env_id, str) or env_id.startswith(("ns:", "dmc:")):
            raise ValueError(
                f"the envpool backend runs Gymnasium ids only, not {env_id!r}: use --backend sync "
                "(non-stationary ns: and Control Suite dmc: envs need the zoo's own wrappers)"
            )
        envpool = _envpool()
        if env_id not in envpool.list_all_envs():
            raise ValueError(f"EnvPool {envpool.__version__} has no env {env_id!r}; use --backend sync")
        if action_repeat not in (None, 1):
            raise ValueError(f"the envpool backend does not repeat actions (got action_repeat={action_repeat})")
        self.env_id, self.num_envs, self.seed, self.action_repeat = env_id, num_envs, seed, action_repeat
        self.restored_fresh = False
        self._start()
        self._init_stats(num_envs)
        self._obs = None

    def _start(self):
        self._pool = _envpool().make_gymnasium(self.env_id, num_envs=self.num_envs, seed=self.seed)
        space = self._pool.action_space
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(
                f"env {self.env_id!r} has a {type(space).__name__} action space; "
                "this zoo is for continuous (Box) actions"
            )
        self._low = np.asarray(space.low, np.float64)
        self._high = np.asarray(space.high, np.float64)
        self._act_dtype = space.dtype
        self.obs_dim = int(np.prod(self._pool.observation_space.shape))
        self.act_dim = int(np.prod(space.shape))

    def _flat(self, obs):
        return np.asarray(obs, np.float32).reshape(len(obs), self.obs_dim)

    def reset(self, seeds=None) -> np.ndarray:
        if seeds is not None:
            # EnvPool fixes its seeds when the pool is made (env i gets seed + i) and ignores
            # reset(seed=...), so seeded resets rebuild the pool.
            seeds = _seeds(self.seed, self.num_envs, seeds)
            if seeds != list(range(seeds[0], seeds[0] + self.num_envs)):
                raise ValueError(f"the envpool backend resets with consecutive seeds only, got {seeds}")
            self.seed = seeds[0]
            self.close()
            self._start()
        obs, info = self._pool.reset()
        obs = self._flat(obs)[np.argsort(info["env_id"])]
        self._init_stats(self.num_envs)
        self._obs = obs
        return obs.copy()

    def step(self, actions):
        a = np.asarray(actions, np.float64).reshape(self.num_envs, self.act_dim)
        a = to_env_action(a, self._low, self._high, getattr(self, "action_mode", "rescale")).astype(self._act_dtype)
        obs, reward, terminated, truncated, info = self._pool.step(a, np.arange(self.num_envs))
        order = np.argsort(info["env_id"])
        next_obs = self._flat(obs)[order]
        reward = np.asarray(reward, np.float32)[order]
        terminated = np.asarray(terminated, bool)[order]
        truncated = np.asarray(truncated, bool)[order] & ~terminated
        done = terminated | truncated
        obs = next_obs.copy()
        if done.any():
            ids = np.nonzero(done)[0]
            reset_obs, reset_info = self._pool.reset(ids)
            obs[np.asarray(reset_info["env_id"])] = self._flat(reset_obs)
        self._track(reward, done)
        self._obs = obs
        return obs.copy(), reward, terminated, truncated, next_obs

    def close(self):
        if hasattr(self._pool, "close"):
            self._pool.close()

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_pool", "_obs")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._start()
        self.restored_fresh = True
        self._obs = self.reset()
