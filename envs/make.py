"""One id scheme for every agent: Gymnasium ids and ``dmc:<domain>-<task>``.

Agents always see flat float32 observations and actions in [-1, 1].  ``terminated`` and
``truncated`` stay separate, and vector envs return the true next observation of every
transition (``next_obs``) beside the observation to act on (reset where an episode ended).
"""
from __future__ import annotations

import numpy as np
import gymnasium as gym

ID_FORMS = (
    "valid env ids: a Gymnasium id such as 'HalfCheetah-v5', 'Hopper-v5' or 'Pendulum-v1', "
    "or a DeepMind Control Suite task as 'dmc:<domain>-<task>', e.g. 'dmc:cheetah-run'"
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
    """Agent actions in [-1, 1] mapped affinely onto the env's Box bounds (picklable)."""

    def __init__(self, env):
        super().__init__(env)
        space = env.action_space
        if not (np.all(np.isfinite(space.low)) and np.all(np.isfinite(space.high))):
            raise ValueError("action space must be bounded to rescale actions to [-1, 1]")
        self._low = np.asarray(space.low, np.float64)
        self._high = np.asarray(space.high, np.float64)
        self.action_space = gym.spaces.Box(-1.0, 1.0, space.shape, np.float32)

    def action(self, action):
        a = np.clip(np.asarray(action, np.float64), -1.0, 1.0)
        return (self._low + (a + 1.0) * 0.5 * (self._high - self._low)).astype(self.env.action_space.dtype)


class FlatFloat32(gym.ObservationWrapper):
    def __init__(self, env):
        super().__init__(env)
        low = np.asarray(env.observation_space.low, np.float32).ravel()
        high = np.asarray(env.observation_space.high, np.float32).ravel()
        self.observation_space = gym.spaces.Box(low, high, low.shape, np.float32)

    def observation(self, obs):
        return np.asarray(obs, np.float32).ravel()


def _gym_make(env_id: str, **kwargs) -> gym.Env:
    if env_id not in gym.registry:
        raise ValueError(f"unknown env id {env_id!r}; {ID_FORMS}")
    env = gym.make(env_id, **kwargs)
    if not isinstance(env.action_space, gym.spaces.Box):
        raise ValueError(f"env {env_id!r} has a {type(env.action_space).__name__} action space; "
                         "this zoo is for continuous (Box) actions")
    return env


def make_env(env_id: str, seed: int = 0, action_repeat: int | None = None, render_mode=None) -> gym.Env:
    """A single env with flat float32 observations and actions rescaled to [-1, 1]."""
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"env id must be a non-empty string; {ID_FORMS}")
    if env_id.startswith("ns:"):  # non-stationary variants: see envs/nonstationary.py for the grammar
        from envs import nonstationary

        return nonstationary.make(env_id, seed, action_repeat)
    if env_id.startswith("dmc:"):
        from envs.dmc import DMCEnv

        name = env_id[4:]
        if "-" not in name:
            raise ValueError(f"malformed Control Suite id {env_id!r}; {ID_FORMS}")
        domain, task = name.split("-", 1)
        env = DMCEnv(domain, task, seed=seed, render_mode=render_mode)
        repeat = DMC_ACTION_REPEAT if action_repeat is None else action_repeat
    else:
        env = _gym_make(env_id, **({} if render_mode is None else {"render_mode": render_mode}))
        repeat = 1 if action_repeat is None else action_repeat
        env = UnitActions(env)
    env = FlatFloat32(env)
    if repeat < 1:
        raise ValueError(f"action repeat must be >= 1, got {repeat}")
    if repeat > 1:
        env = ActionRepeat(env, repeat)
    env.action_space.seed(seed)
    return env


class VectorEnv:
    """Synchronous vector env with same-step autoreset.

    ``step(actions)`` returns ``(obs, reward, terminated, truncated, next_obs)``: ``next_obs`` is
    the true next observation of each transition (the final one where an episode ended) and
    ``obs`` the observation to act on next (a fresh reset where an episode ended).  Finished
    episodes' (return, length) pairs accumulate in ``finished`` until ``pop_finished()``.
    The whole object pickles (MuJoCo state included), which checkpoints use to resume exactly.
    """

    def __init__(self, env_id: str, num_envs: int, seed: int, action_repeat: int | None = None):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.env_id, self.num_envs, self.seed = env_id, num_envs, seed
        self.envs = [make_env(env_id, seed + i, action_repeat) for i in range(num_envs)]
        self.obs_dim = int(self.envs[0].observation_space.shape[0])
        self.act_dim = int(self.envs[0].action_space.shape[0])
        self._returns = np.zeros(num_envs)
        self._lengths = np.zeros(num_envs, np.int64)
        self.finished: list[tuple[int, float, int]] = []  # (env index, return, length)
        self._obs = None

    def reset(self, seeds=None) -> np.ndarray:
        seeds = [self.seed + i for i in range(self.num_envs)] if seeds is None else list(seeds)
        self._obs = np.stack([e.reset(seed=int(s))[0] for e, s in zip(self.envs, seeds)])
        self._returns[:] = 0.0
        self._lengths[:] = 0
        return self._obs.copy()

    def step(self, actions):
        actions = np.asarray(actions, np.float32).reshape(self.num_envs, self.act_dim)
        obs = np.empty_like(self._obs)
        next_obs = np.empty_like(self._obs)
        reward = np.empty(self.num_envs, np.float32)
        terminated = np.zeros(self.num_envs, bool)
        truncated = np.zeros(self.num_envs, bool)
        for i, env in enumerate(self.envs):
            o, r, term, trunc, _ = env.step(actions[i])
            next_obs[i], reward[i], terminated[i], truncated[i] = o, r, term, trunc
            self._returns[i] += r
            self._lengths[i] += 1
            if term or trunc:
                self.finished.append((i, float(self._returns[i]), int(self._lengths[i])))
                self._returns[i], self._lengths[i] = 0.0, 0
                o, _ = env.reset()
            obs[i] = o
        self._obs = obs
        return obs.copy(), reward, terminated, truncated, next_obs

    def __getstate__(self):
        # Gymnasium's MuJoCo envs pickle by re-construction (EzPickle): save the full
        # integration state and the env's random generator so a restored env continues bit for bit.
        state = self.__dict__.copy()
        state["_mj_states"] = [_mj_state(e) for e in self.envs]
        return state

    def __setstate__(self, state):
        mj_states = state.pop("_mj_states")
        self.__dict__.update(state)
        for env, s in zip(self.envs, mj_states):
            if s is not None:
                import mujoco

                u = env.unwrapped
                mujoco.mj_setState(u.model, u.data, s[0], mujoco.mjtState.mjSTATE_INTEGRATION)
                mujoco.mj_forward(u.model, u.data)
                u.np_random.bit_generator.state = s[1]

    def sample_actions(self, rng: np.random.Generator) -> np.ndarray:
        return rng.uniform(-1.0, 1.0, (self.num_envs, self.act_dim)).astype(np.float32)

    def stop(self, i: int) -> np.ndarray:
        """End env ``i``'s episode now (an early stop, i.e. a truncation) and return its reset observation."""
        self.finished.append((i, float(self._returns[i]), int(self._lengths[i])))
        self._returns[i], self._lengths[i] = 0.0, 0
        self._obs[i] = self.envs[i].reset()[0]
        return self._obs[i].copy()

    def pop_finished(self):
        done, self.finished = self.finished, []
        return done

    def close(self):
        for e in self.envs:
            e.close()


def _mj_state(env):
    u = env.unwrapped
    if not (hasattr(u, "model") and hasattr(u, "data")):
        return None
    import mujoco

    spec = mujoco.mjtState.mjSTATE_INTEGRATION
    out = np.empty(mujoco.mj_stateSize(u.model, spec))
    mujoco.mj_getState(u.model, u.data, out, spec)
    return out, u.np_random.bit_generator.state


BACKENDS = ("sync", "async", "envpool")


def make_vector_env(env_id: str, num_envs: int, seed: int, action_repeat: int | None = None,
                    backend: str = "sync"):
    """A vector env with ``VectorEnv``'s interface (same-step autoreset, true final observations).

    ``backend``: ``"sync"`` (this module's ``VectorEnv``; ``"gymnasium"`` is an alias), ``"async"``
    (Gymnasium ``AsyncVectorEnv`` subprocesses) or ``"envpool"`` (optional, where EnvPool has the
    id); see ``envs/backends.py``.  A ``ns:`` id on ``"sync"`` gives a ``CountingVectorEnv`` whose
    members share one step counter (see ``envs/nonstationary.py``).
    """
    if backend == "gymnasium":
        backend = "sync"
    if backend not in BACKENDS:
        raise ValueError(f"unknown vector-env backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "sync":
        if isinstance(env_id, str) and env_id.startswith("ns:"):
            from envs.nonstationary import CountingVectorEnv

            return CountingVectorEnv(env_id, num_envs, seed, action_repeat)
        return VectorEnv(env_id, num_envs, seed, action_repeat)
    from envs import backends

    if backend == "async":
        return backends.AsyncVectorEnv(env_id, num_envs, seed, action_repeat)
    return backends.EnvPoolVectorEnv(env_id, num_envs, seed, action_repeat)
