"""One id scheme for every agent: Gymnasium ids, ``dmc:<domain>-<task>``, ``ns:...``, ``mt:...``
and ``playground:<Name>``.

Agents always see flat float32 observations and actions in [-1, 1].  ``terminated`` and
``truncated`` stay separate, and vector envs return the true next observation of every
transition (``next_obs``) beside the observation to act on (reset where an episode ended).
"""

from __future__ import annotations

from plasticity_zoo.envs import backends
from plasticity_zoo.envs.multitask import is_multitask
from plasticity_zoo.envs.playground import PlaygroundVectorEnv, is_playground
from plasticity_zoo.envs.single import make_env  # noqa: F401  (re-exported: plasticity_zoo.envs.make_env)
from plasticity_zoo.envs.vector import CountingVectorEnv, VectorEnv
from plasticity_zoo.envs.wrappers import DMC_ACTION_REPEAT, ID_FORMS, ActionRepeat, FlatFloat32, UnitActions  # noqa: F401

BACKENDS = ("sync", "async", "envpool")


def make_vector_env(
    env_id: str,
    num_envs: int,
    seed: int,
    action_repeat: int | None = None,
    backend: str = "sync",
    action_mode: str = "rescale",
    env_impl: str = "jax",
):
    """A vector env with ``VectorEnv``'s interface (same-step autoreset, true final observations).

    ``backend``: ``"sync"`` (this module's ``VectorEnv``; ``"gymnasium"`` is an alias), ``"async"``
    (Gymnasium ``AsyncVectorEnv`` subprocesses) or ``"envpool"`` (optional, where EnvPool has the
    id); see ``envs/backends.py``.  A ``ns:`` id on ``"sync"`` gives a ``CountingVectorEnv`` whose
    members share one step counter (see ``envs/nonstationary.py``).  A ``playground:`` id gives a
    ``PlaygroundVectorEnv`` (all envs in one jitted step on the device; ``env_impl``: Playground's
    physics backend) whatever the backend.  A ``mt:`` id (``envs/multitask.py``) runs on ``"sync"`` only.
    """
    if is_playground(env_id):
        return PlaygroundVectorEnv(env_id, num_envs, seed, action_repeat, action_mode, env_impl)
    if backend == "gymnasium":
        backend = "sync"
    if backend not in BACKENDS:
        raise ValueError(f"unknown vector-env backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if is_multitask(env_id) and backend != "sync":
        raise ValueError(f"{env_id}: mt: ids run on the sync backend only, not {backend!r}")
    if backend == "sync":
        if isinstance(env_id, str) and env_id.startswith("ns:"):
            return CountingVectorEnv(env_id, num_envs, seed, action_repeat, action_mode)
        return VectorEnv(env_id, num_envs, seed, action_repeat, action_mode)
    if backend == "async":
        return backends.AsyncVectorEnv(env_id, num_envs, seed, action_repeat, action_mode)
    return backends.EnvPoolVectorEnv(env_id, num_envs, seed, action_repeat, action_mode)
