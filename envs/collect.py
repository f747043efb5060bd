"""Datasets collected by rolling a policy in a vector env (after D4RL's ``scripts/generation/mujoco/``
and its wiki's Dataset Reproducibility Guide; used by scripts/make_dataset.py), and the reference
returns of a policy (Minari's protocol, ``minari/utils.py``).

``collect`` writes whole episodes in the D4RL layout of ``envs/datasets.py`` (true successors,
terminals and timeouts apart, actions in the env's units, ``qpos``/``qvel`` infos for MuJoCo envs);
``evaluate_policy`` gives the returns of episodes reset from consecutive seeds.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from plasticity_zoo.envs.datasets import KEYS, Dataset, env_spaces, to_env_units

MAX_EPISODE_STEPS = 1000  # D4RL caps episodes at 1000 steps (its scripts/generation/mujoco/)
REF_SEED = 123  # Minari's reference episodes reset from seed 123 (minari/utils.py)


def collect(
    env_id: str,
    policy: Callable,
    size: int,
    seed: int,
    num_envs: int = 1,
    max_episode_steps: int = MAX_EPISODE_STEPS,
    record_state: bool = True,
) -> Dataset:
    """Roll ``policy`` in ``num_envs`` parallel envs until ``size`` rows of whole episodes are in, then cut to ``size``.

    ``policy(obs[E, obs_dim]) -> actions[E, act_dim]`` in [-1, 1], or ``(actions, log_probs[E])``.
    Episodes are written one after another in the order they finish (so the last one may be
    partial, as in D4RL), capped at ``max_episode_steps`` (a cap counts as a timeout);
    ``terminals`` = terminated, ``timeouts`` = truncated, ``next_observations`` the true successors.
    ``infos``: ``qpos``/``qvel`` (state before the step; MuJoCo envs, ``record_state``) and
    ``action_log_probs`` when the policy returns them.  Episodes still running at the end are
    discarded, a small bias toward short episodes when ``num_envs`` is large relative to ``size``.
    """
    from plasticity_zoo.envs.make import make_vector_env

    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    venv = make_vector_env(env_id, num_envs, seed)
    sims = [e.unwrapped for e in getattr(venv, "envs", [])]
    record_state = record_state and len(sims) == num_envs and all(hasattr(s, "data") for s in sims)
    cols: dict[str, list] = {k: [] for k in KEYS}
    log_probs, qpos, qvel = [], [], []
    finished: list[tuple[int, int, int]] = []  # (env, first vector step, last vector step)
    start = np.zeros(num_envs, np.int64)
    length = np.zeros(num_envs, np.int64)
    rows, t = 0, 0
    obs = venv.reset()
    try:
        while rows < size:
            out = policy(obs)
            actions, lp = out if isinstance(out, tuple) else (out, None)
            actions = np.asarray(actions, np.float32).reshape(num_envs, -1)
            if record_state:
                qpos.append(np.stack([s.data.qpos.copy() for s in sims]))
                qvel.append(np.stack([s.data.qvel.copy() for s in sims]))
            new_obs, reward, terminated, truncated, next_obs = venv.step(actions)
            length += 1
            capped = (length >= max_episode_steps) & ~(terminated | truncated)
            truncated = truncated | capped
            for i in np.flatnonzero(capped):
                new_obs[i] = venv.stop(int(i))
            for k, v in zip(KEYS, (obs, actions, reward, terminated, truncated, next_obs)):
                cols[k].append(np.asarray(v).copy())
            if lp is not None:
                log_probs.append(np.asarray(lp, np.float32).reshape(num_envs))
            for i in np.flatnonzero(terminated | truncated):
                finished.append((int(i), int(start[i]), t))
                rows += int(length[i])
                start[i], length[i] = t + 1, 0
            obs = new_obs
            t += 1
    finally:
        venv.close()
    stacked = {k: np.stack(v) for k, v in cols.items()}  # (T, E, ...)
    if log_probs:
        stacked["action_log_probs"] = np.stack(log_probs)
    if record_state:
        stacked["qpos"], stacked["qvel"] = np.stack(qpos), np.stack(qvel)
    gathered = {k: np.concatenate([v[s : e + 1, i] for i, s, e in finished])[:size] for k, v in stacked.items()}
    gathered["actions"] = to_env_units(gathered["actions"], env_id)
    infos = {k: gathered.pop(k) for k in ("action_log_probs", "qpos", "qvel") if k in gathered}
    s = env_spaces(env_id)
    ds = Dataset(
        gathered["observations"].astype(np.float32),
        gathered["actions"],
        gathered["rewards"].astype(np.float32),
        gathered["terminals"].astype(bool),
        gathered["timeouts"].astype(bool),
        gathered["next_observations"].astype(np.float32),
        metadata={
            "env_id": env_id,
            "collection_seed": int(seed),
            "num_envs": int(num_envs),
            "max_episode_steps": int(max_episode_steps),
            "action_low": s.action_low.astype(np.float32),
            "action_high": s.action_high.astype(np.float32),
        },
        infos=infos,
    )
    return ds


def evaluate_policy(
    env_id: str, policy: Callable, episodes: int, first_seed: int = REF_SEED, max_episode_steps: int = MAX_EPISODE_STEPS
) -> np.ndarray:
    """Returns of ``episodes`` parallel episodes reset from seeds first_seed, first_seed+1, ... (Minari's
    reference protocol, ``minari/utils.py: get_average_reference_score``).
    ``policy(obs[E, obs_dim]) -> actions[E, act_dim]`` in [-1, 1]."""
    from plasticity_zoo.envs.make import VectorEnv

    venv = VectorEnv(env_id, episodes, first_seed)
    try:
        obs = venv.reset([first_seed + i for i in range(episodes)])
        returns = np.zeros(episodes)
        done = np.zeros(episodes, bool)
        steps = 0
        while not done.all() and steps < max_episode_steps:
            out = policy(obs)
            actions = out[0] if isinstance(out, tuple) else out
            obs, reward, terminated, truncated, _ = venv.step(np.asarray(actions, np.float32))
            returns += np.where(done, 0.0, reward)
            done |= terminated | truncated
            steps += 1
    finally:
        venv.close()
    return returns
