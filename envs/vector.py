"""Vector envs stepped on the host: ``VectorEnv`` (same-step autoreset, true final observations,
exact pickling of the MuJoCo state, one task per env for ``mt:`` ids) and ``CountingVectorEnv``
(non-stationary members on one clock)."""

from __future__ import annotations

import numpy as np

from plasticity_zoo.envs import nonstationary
from plasticity_zoo.envs.multitask import is_multitask, task_spec
from plasticity_zoo.envs.single import make_env


class VectorEnv:
    """Synchronous vector env with same-step autoreset.

    ``step(actions)`` returns ``(obs, reward, terminated, truncated, next_obs)``: ``next_obs`` is
    the true next observation of each transition (the final one where an episode ended) and
    ``obs`` the observation to act on next (a fresh reset where an episode ended).  Finished
    episodes' (return, length) pairs accumulate in ``finished`` until ``pop_finished()``.
    The whole object pickles (MuJoCo state included), which checkpoints use to resume exactly.
    For an ``mt:`` id env ``i`` runs task ``i % num_tasks`` (``num_envs`` a multiple of it);
    ``task_index`` holds each env's task (zeros for a single-task id).
    """

    def __init__(
        self, env_id: str, num_envs: int, seed: int, action_repeat: int | None = None, action_mode: str = "rescale"
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.env_id, self.num_envs, self.seed = env_id, num_envs, seed
        self.task_index = np.zeros(num_envs, np.int64)
        if is_multitask(env_id):
            tasks = task_spec(env_id, action_repeat).num_tasks
            if num_envs % tasks:
                raise ValueError(
                    f"{env_id} has {tasks} tasks: the vector env needs a multiple of {tasks} envs "
                    f"(one env per task: --num-envs {tasks})"
                )
            self.task_index = np.arange(num_envs, dtype=np.int64) % tasks
        self.envs = [
            make_env(env_id, seed + i, action_repeat, action_mode=action_mode, task=int(self.task_index[i]))
            for i in range(num_envs)
        ]
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
        state.setdefault("task_index", np.zeros(state["num_envs"], np.int64))  # pickled before mt: ids
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


# ----------------------------------------------------------------------------------------------
# Vector envs with one shared counter
# ----------------------------------------------------------------------------------------------
class CountingVectorEnv(VectorEnv):
    """A ``VectorEnv`` of non-stationary members that share one ``StepCounter``.

    Each ``step()`` first advances the counter by ``steps_per_call`` (1 by default; the on-policy
    loop sets it to its envs per seed), so all members see the same count during a step and
    switch together.
    """

    def __init__(
        self, env_id: str, num_envs: int, seed: int, action_repeat: int | None = None, action_mode: str = "rescale"
    ):
        super().__init__(env_id, num_envs, seed, action_repeat, action_mode)
        self.step_counter = nonstationary.StepCounter(auto=False)
        self.steps_per_call = 1
        for e in self.envs:
            e.bind_counter(self.step_counter)

    def step(self, actions):
        self.step_counter.value += self.steps_per_call
        return super().step(actions)

    def global_phase(self) -> int:
        return self.envs[0].phase_at(self.step_counter.value)

    def task_ids(self) -> list[int]:
        return [e.task_id for e in self.envs]
