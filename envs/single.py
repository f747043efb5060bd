"""``make_env``: one env for any id of the scheme (Gymnasium, ``dmc:``, ``ns:``, ``mt:``, ``playground:``)."""

from __future__ import annotations

import gymnasium as gym

from plasticity_zoo.envs import multitask, nonstationary, playground
from plasticity_zoo.envs.wrappers import ID_FORMS, make_base_env


def make_env(
    env_id: str,
    seed: int = 0,
    action_repeat: int | None = None,
    render_mode=None,
    action_mode: str = "rescale",
    env_impl: str = "jax",
    task: int = 0,
) -> gym.Env:
    """A single env with flat float32 observations and actions mapped by ``action_mode``
    (``envs.actions``: ``rescale`` from [-1, 1], ``clip`` in the env's units); for an ``mt:`` id,
    task ``task`` of it (``envs.multitask.MultitaskEnv``: padded spaces, one-hot task index)."""
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"env id must be a non-empty string; {ID_FORMS}")
    if multitask.is_multitask(env_id):
        return multitask.MultitaskEnv(env_id, task, seed, action_repeat, render_mode, action_mode)
    if task != 0:
        raise ValueError(f"task={task!r} applies to multitask (mt:) ids only, not {env_id!r}")
    if env_id.startswith("ns:"):  # non-stationary variants: see envs/nonstationary.py for the grammar
        return nonstationary.make(env_id, seed, action_repeat, action_mode)
    if playground.is_playground(env_id):
        if render_mode is not None:
            raise ValueError(f"{env_id}: rendering Playground envs is not supported")
        return playground.PlaygroundGymEnv(env_id, seed, action_repeat, action_mode, env_impl)
    return make_base_env(env_id, seed, action_repeat, render_mode, action_mode)
