"""Device-side uniform replay buffer: a pytree of fixed-size arrays plus a pointer.

Transitions hold the true next observation, so a truncated episode's last transition
bootstraps from its real final state (``terminated`` masks the bootstrap, ``truncated``
does not).  With ``--seeds N`` the loop vmaps ``add`` and ``sample`` over a leading axis.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    next_obs: jax.Array
    terminated: jax.Array
    truncated: jax.Array


class Buffer(NamedTuple):
    data: Transition  # every field has leading axis ``capacity``
    ptr: jax.Array  # next write index
    size: jax.Array  # number of valid rows


def init(capacity: int, obs_dim: int, act_dim: int) -> Buffer:
    f = lambda *s: jnp.zeros((capacity, *s), jnp.float32)  # noqa: E731
    data = Transition(f(obs_dim), f(act_dim), f(), f(obs_dim),
                      jnp.zeros(capacity, bool), jnp.zeros(capacity, bool))
    return Buffer(data, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def capacity(buffer: Buffer) -> int:
    return buffer.data.reward.shape[-1]


def add(buffer: Buffer, batch: Transition) -> Buffer:
    """Append a batch of transitions (leading axis = number of envs), overwriting the oldest."""
    cap = capacity(buffer)
    n = batch.reward.shape[0]
    idx = (buffer.ptr + jnp.arange(n)) % cap
    data = jax.tree.map(lambda d, x: d.at[idx].set(x.astype(d.dtype)), buffer.data, batch)
    return Buffer(data, (buffer.ptr + n) % cap, jnp.minimum(buffer.size + n, cap))


def sample(buffer: Buffer, key, batch_size: int) -> Transition:
    """Uniform sample of ``batch_size`` stored transitions (with replacement)."""
    idx = jax.random.randint(key, (batch_size,), 0, jnp.maximum(buffer.size, 1))
    return jax.tree.map(lambda d: d[idx], buffer.data)
