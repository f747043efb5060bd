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
    data = Transition(f(obs_dim), f(act_dim), f(), f(obs_dim), jnp.zeros(capacity, bool), jnp.zeros(capacity, bool))
    return Buffer(data, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def capacity(buffer: Buffer) -> int:
    return buffer.data.reward.shape[-1]


def add(buffer: Buffer, batch: Transition, valid=None) -> Buffer:
    """Append a batch of transitions (leading axis = number of envs), overwriting the oldest; with
    ``valid`` (bool per row) only its valid rows, in order (``add_masked``)."""
    if valid is not None:
        return add_masked(buffer, batch, valid)
    cap = capacity(buffer)
    n = batch.reward.shape[0]
    idx = (buffer.ptr + jnp.arange(n)) % cap
    data = jax.tree.map(lambda d, x: d.at[idx].set(x.astype(d.dtype)), buffer.data, batch)
    return Buffer(data, (buffer.ptr + n) % cap, jnp.minimum(buffer.size + n, cap))


def add_masked(buffer: Buffer, batch: Transition, valid) -> Buffer:
    """Append only the rows of ``batch`` where ``valid`` is true, in order, overwriting the oldest.

    Static shapes under jit: invalid rows are scattered out of bounds and dropped.  The number of
    valid rows must not exceed the capacity (a model-rollout FIFO is sized for several batches).
    """
    cap = capacity(buffer)
    valid = valid.astype(bool)
    n = valid.sum().astype(jnp.int32)
    slot = jnp.cumsum(valid) - 1
    idx = jnp.where(valid, (buffer.ptr + slot) % cap, cap)
    data = jax.tree.map(lambda d, x: d.at[idx].set(x.astype(d.dtype), mode="drop"), buffer.data, batch)
    return Buffer(data, (buffer.ptr + n) % cap, jnp.minimum(buffer.size + n, cap))


def sample(buffer: Buffer, key, batch_size: int) -> Transition:
    """Uniform sample of ``batch_size`` stored transitions (with replacement)."""
    idx = jax.random.randint(key, (batch_size,), 0, jnp.maximum(buffer.size, 1))
    return jax.tree.map(lambda d: d[idx], buffer.data)


def sample_with_review(buffer: Buffer, key, batch_size: int, p_old, old_fraction: float = 0.3) -> Transition:
    """Uniform sample where each index comes instead from the oldest ``old_fraction`` of the stored
    transitions with probability ``p_old`` (NE's experience review, torressliu/neuroplastic-expansion; a traced scalar).

    The oldest transition sits at ``(ptr - size) % capacity`` (index 0 until the buffer wraps).
    """
    cap = capacity(buffer)
    size = jnp.maximum(buffer.size, 1)
    k_uni, k_old, k_pick = jax.random.split(key, 3)
    uniform = jax.random.randint(k_uni, (batch_size,), 0, size)
    n_old = jnp.maximum(jnp.floor(old_fraction * size).astype(jnp.int32), 1)
    oldest = (buffer.ptr - buffer.size) % cap
    old = (oldest + jax.random.randint(k_old, (batch_size,), 0, n_old)) % cap
    idx = jnp.where(jax.random.uniform(k_pick, (batch_size,)) < p_old, old, uniform)
    return jax.tree.map(lambda d: d[idx], buffer.data)


def half_batch(batch: Transition, half) -> Transition:
    """Where ``half``: a batch of B rows made of its first B/2 rows, each twice (B even).

    Every loss that is a mean over rows then equals its value on the B/2-row batch exactly, with
    static shapes (NE's auto batch halves the batch; a masked half batch, as a JAX version needs)."""
    n = batch.reward.shape[0]
    rows = jnp.arange(n) % (n // 2)
    return jax.tree.map(lambda x: jnp.where(jnp.reshape(half, (1,) * x.ndim), x[rows], x), batch)


def scan_updates(update, state, buffer: Buffer, key, num_updates: int, batch_size: int, replay_control=None):
    """``num_updates`` gradient steps on uniform batches as one ``lax.scan`` -> (state, buffer, mean metrics).

    ``update(state, batch, key) -> (state, metrics)`` is the agent's.  ``replay_control`` (NE's
    ``plasticity.expansion.ReplayControl``, or None): with a ``review`` probability the batches come
    from ``sample_with_review`` (experience review); with ``half`` they are halved by ``half_batch``
    (auto batch).  A None field is off.
    """
    review = getattr(replay_control, "review", None)
    half = getattr(replay_control, "half", None)

    def one(state, key):
        k_sample, k_update = jax.random.split(key)
        if review is None:
            batch = sample(buffer, k_sample, batch_size)
        else:
            batch = sample_with_review(buffer, k_sample, batch_size, review)
        if half is not None:
            batch = half_batch(batch, half)
        return update(state, batch, k_update)

    state, metrics = jax.lax.scan(one, state, jax.random.split(key, num_updates))
    return state, buffer, jax.tree.map(lambda m: m.mean(), metrics)
