"""Loss-adjusted prioritised replay (LAP) over per-env subtrajectories, kept on the device.

Pure functions over a ``LAPBuffer`` NamedTuple, so ``add`` and the samplers vmap over seeds
and run inside ``jit``/``scan``.  Used by MR.Q (Fujimoto et al. 2025; LAP: Fujimoto et al. 2020,
arXiv 2007.06049; sampling as in facebookresearch/MRQ ``buffer.py``); nothing in
here is MR.Q-specific.

Storage and per-env streams
    The buffer is one ring of ``capacity`` slots.  Every ``add`` call writes one transition
    per env, env ``e`` at slot ``(ptr + e) % capacity``, and advances ``ptr`` by ``E`` (the
    number of envs, fixed for a run, recorded in ``num_envs``).  So env ``e``'s next
    transition always sits ``E`` slots further on (mod capacity), whatever the capacity:
    the ring holds ``E`` interleaved per-env streams.  ``step[slot]`` is the index of the
    ``add`` call that wrote the slot (-1: never written), which makes a window check exact:
    the ``H`` slots ``s, s+E, ..., s+(H-1)E`` are ``H`` consecutive transitions of one env
    iff ``step[s+kE] == step[s] + k`` for every ``k`` (an overwritten or not yet written
    slot fails the test).  Each transition stores its own ``obs`` and true ``next_obs``
    (observations are held twice, as in ``buffers.replay``; the reference stores each frame
    once through index arrays, which only saves memory).

Validity mask (``window_mask``)
    A window of length ``H`` may start at slot ``s`` iff its ``H`` slots are consecutive
    transitions of one env and none of its first ``H-1`` transitions is truncated: a window
    never runs past a truncation (a truncation on its last transition is fine, that
    transition's stored ``next_obs`` is the true final observation).  Windows may run past
    a *termination*; the losses mask what follows it (``multistep_return``).

LAP (Fujimoto et al. 2020, arXiv 2007.06049)
    A window start is drawn with probability proportional to ``priority[s] * valid[s]``.
    The buffer keeps, for its validity horizon (``init(..., horizon)``), the mask ``valid`` and
    two sum trees over the slots, ``weights`` (priority x valid) and ``counts`` (valid), up to
    date: ``add`` re-checks only the ``horizon x envs`` windows that contain a written slot and
    ``update_priorities`` only the updated slots, each touching ``log2(capacity)`` tree nodes, and
    ``draw_tree`` descends the tree, O(batch log capacity).  So no step of the training loop costs
    O(capacity).  ``window_mask`` / ``cdf`` / ``draw`` compute the same from scratch (O(capacity):
    a reference, and the path for a horizon other than the buffer's); from the same key both
    draws map the same uniform numbers to slots, and pick the same slots whenever the partial
    sums are exact.  New transitions get the running
    maximum priority; ``priority(|delta|) = max(|delta|, min_priority) ** alpha``.  There
    are no importance weights (the Huber loss plays their role in LAP).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from plasticity_zoo.buffers.replay import Transition


class LAPBuffer(NamedTuple):
    data: Transition  # every field has leading axis ``capacity``
    step: jax.Array  # (capacity,) int32: the add call that wrote the slot, -1 if empty
    priority: jax.Array  # (capacity,) float32
    max_priority: jax.Array  # () running maximum priority (new transitions get it)
    ptr: jax.Array  # () next slot to write
    size: jax.Array  # () number of written slots
    calls: jax.Array  # () number of add calls so far
    num_envs: jax.Array  # () transitions per add call (the stride of an env's stream)
    ever_terminated: jax.Array  # () bool: a terminal transition has been stored
    valid: jax.Array  # (capacity,) bool: window_mask(buffer, horizon), kept up to date
    weights: jax.Array  # (2 P,) sum tree over priority * valid; leaf of slot s at P + s (P: power of 2 >= capacity)
    counts: jax.Array  # (2 P,) sum tree over valid (uniform sampling over valid windows)
    horizon: jax.Array  # (H,) arange(H): its static length is the validity horizon H


class Window(NamedTuple):
    """A batch of subtrajectories s_t, a_t, r_t, s_{t+1}, ..., a_{t+H-1}, r_{t+H-1}, s_{t+H}."""

    obs: jax.Array  # (B, D): s_t
    action: jax.Array  # (B, H, A): a_{t+k}
    reward: jax.Array  # (B, H): r_{t+k}
    next_obs: jax.Array  # (B, H, D): s_{t+k+1} (true next observation of transition t+k)
    terminated: jax.Array  # (B, H) bool: s_{t+k+1} is terminal
    truncated: jax.Array  # (B, H) bool


def init(capacity: int, obs_dim: int, act_dim: int, initial_priority: float = 1.0, horizon: int = 1) -> LAPBuffer:
    """An empty buffer whose validity mask and sum trees are kept for windows of ``horizon``."""
    f = lambda *s: jnp.zeros((capacity, *s), jnp.float32)  # noqa: E731
    data = Transition(f(obs_dim), f(act_dim), f(), f(obs_dim), jnp.zeros(capacity, bool), jnp.zeros(capacity, bool))
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    leaves = 1 << max(capacity - 1, 0).bit_length()
    return LAPBuffer(
        data,
        jnp.full(capacity, -1, jnp.int32),
        jnp.zeros(capacity, jnp.float32),
        jnp.asarray(initial_priority, jnp.float32),
        i32(0),
        i32(0),
        i32(0),
        i32(0),
        jnp.asarray(False),
        jnp.zeros(capacity, bool),
        jnp.zeros(2 * leaves, jnp.float32),
        jnp.zeros(2 * leaves, jnp.float32),
        jnp.arange(horizon, dtype=jnp.int32),
    )


def capacity(buffer: LAPBuffer) -> int:
    return buffer.step.shape[-1]


def add(buffer: LAPBuffer, batch: Transition, valid=None) -> LAPBuffer:
    """Store one transition per env (leading axis = envs, in env order) at the running max priority.

    ``valid`` (bool per env, optional): an invalid row's slot is marked never written (``step`` -1),
    so no window holds it (it is never sampled) and every env's stream keeps its stride."""
    cap = capacity(buffer)
    n = batch.reward.shape[0]
    if n > cap:
        raise ValueError(f"cannot add {n} transitions per step to a buffer of capacity {cap}")
    idx = (buffer.ptr + jnp.arange(n)) % cap
    data = jax.tree.map(lambda d, x: d.at[idx].set(x.astype(d.dtype)), buffer.data, batch)
    buffer = buffer._replace(
        data=data,
        step=buffer.step.at[idx].set(buffer.calls if valid is None else jnp.where(valid, buffer.calls, -1)),
        priority=buffer.priority.at[idx].set(buffer.max_priority),
        ptr=(buffer.ptr + n) % cap,
        size=jnp.minimum(buffer.size + n, cap),
        calls=buffer.calls + 1,
        num_envs=jnp.asarray(n, jnp.int32),
        ever_terminated=buffer.ever_terminated
        | jnp.any(batch.terminated if valid is None else batch.terminated & valid),
    )
    # the windows whose validity a write can change: those holding a written slot, starting H-1 .. 0 steps before it
    starts = ((idx[None, :] - n * buffer.horizon[:, None]) % cap).reshape(-1)
    return _refresh(buffer, starts)


def _window_ok(buffer: LAPBuffer, starts, horizon: int) -> jax.Array:
    """Whether a window of ``horizon`` may start at each of ``starts`` (the rule of ``window_mask``)."""
    cap = capacity(buffer)
    t0 = buffer.step[starts]
    ok = t0 >= 0
    for k in range(horizon):
        sk = (starts + k * buffer.num_envs) % cap
        if k > 0:
            ok &= buffer.step[sk] == t0 + k
        if k < horizon - 1:
            ok &= ~buffer.data.truncated[sk]
    return ok


def _set_leaves(tree: jax.Array, slots, values) -> jax.Array:
    """Set the leaves of ``slots`` (repeats allowed if their values agree) and recompute their ancestors."""
    leaves = tree.shape[0] // 2
    node = leaves + slots
    tree = tree.at[node].set(values)
    for _ in range(leaves.bit_length() - 1):
        node = node // 2
        tree = tree.at[node].set(tree[2 * node] + tree[2 * node + 1])
    return tree


def _refresh(buffer: LAPBuffer, starts) -> LAPBuffer:
    """Re-check the windows at ``starts`` and update ``valid`` and both trees there."""
    ok = _window_ok(buffer, starts, buffer.horizon.shape[0])
    valid = buffer.valid.at[starts].set(ok)
    ok = valid[starts]  # where a start repeats, the value the scatter kept
    return buffer._replace(
        valid=valid,
        weights=_set_leaves(buffer.weights, starts, buffer.priority[starts] * ok),
        counts=_set_leaves(buffer.counts, starts, ok.astype(jnp.float32)),
    )


def slots(buffer: LAPBuffer, start, horizon: int):
    """Slots of the ``horizon`` consecutive transitions of start's env: (..., horizon)."""
    return (start[..., None] + jnp.arange(horizon) * buffer.num_envs) % capacity(buffer)


def window_mask(buffer: LAPBuffer, horizon: int) -> jax.Array:
    """(capacity,) bool: a window of ``horizon`` transitions may start at this slot.

    Its slots hold ``horizon`` consecutive transitions of one env (none overwritten or
    missing) and none of the first ``horizon - 1`` is truncated.  O(capacity * horizon).
    """
    return _window_ok(buffer, jnp.arange(capacity(buffer)), horizon)


def cdf(buffer: LAPBuffer, valid, prioritized: bool = True) -> jax.Array:
    """Cumulative sampling weights: priority (or 1 if not prioritised) times the validity mask."""
    w = buffer.priority if prioritized else jnp.ones_like(buffer.priority)
    return jnp.cumsum(jnp.where(valid, w, 0.0))


def draw(cdf_: jax.Array, key, n: int) -> jax.Array:
    """``n`` slots drawn with probability proportional to their weight (cdf increments)."""
    total = cdf_[-1]
    u = jax.random.uniform(key, (n,), cdf_.dtype) * total
    idx = jnp.searchsorted(cdf_, u, side="right")
    # u rounding up to ``total`` would land past the last positive weight: take that one instead
    last = jnp.searchsorted(cdf_, total, side="left")
    return jnp.minimum(idx, last).astype(jnp.int32)


def draw_tree(tree: jax.Array, key, n: int) -> jax.Array:
    """``n`` slots drawn with probability proportional to the tree's leaves, O(n log capacity).

    The uniform numbers are ``draw``'s (same key, same values); a descent never enters a subtree
    whose sum is 0, so a rounding error cannot land on a slot of weight 0.

    The descent is a ``fori_loop``, not unrolled: unrolled, XLA on CPU copied the whole tree
    before the priority update that follows a draw (``update_priorities`` writes the tree in
    place), 8 bytes per slot on every training step."""
    leaves = tree.shape[0] // 2
    u = jax.random.uniform(key, (n,), tree.dtype) * tree[1]

    def level(_, carry):
        u, node = carry
        left, right = tree[2 * node], tree[2 * node + 1]
        go_right = (u >= left) & (right > 0)
        return jnp.where(go_right, u - left, u), 2 * node + go_right.astype(jnp.int32)

    _, node = jax.lax.fori_loop(0, leaves.bit_length() - 1, level, (u, jnp.ones(n, jnp.int32)))
    return node - leaves


def valid_windows(buffer: LAPBuffer) -> jax.Array:
    """How many windows of the buffer's horizon may be drawn (the count tree's root)."""
    return buffer.counts[1]


def window(buffer: LAPBuffer, start, horizon: int) -> Window:
    """Gather the subtrajectories of length ``horizon`` starting at slots ``start`` (B,)."""
    sl = slots(buffer, start, horizon)  # (B, H)
    d = buffer.data
    return Window(d.obs[start], d.action[sl], d.reward[sl], d.next_obs[sl], d.terminated[sl], d.truncated[sl])


def sample(
    buffer: LAPBuffer, key, batch_size: int, horizon: int, prioritized: bool = True, mask_horizon: int | None = None
):
    """Draw ``batch_size`` windows -> (start slots, Window).  ``mask_horizon``: validity horizon (>= horizon).

    For the buffer's own validity horizon this descends its sum trees; for another it builds the
    mask and cumulative sum from scratch (O(capacity))."""
    mask_horizon = max(horizon, mask_horizon or horizon)
    if mask_horizon == buffer.horizon.shape[-1]:
        idx = draw_tree(buffer.weights if prioritized else buffer.counts, key, batch_size)
    else:
        idx = draw(cdf(buffer, window_mask(buffer, mask_horizon), prioritized), key, batch_size)
    return idx, window(buffer, idx, horizon)


def priority(td_abs, alpha: float = 0.4, min_priority: float = 1.0):
    """LAP priority max(|delta|, min_priority) ** alpha."""
    return jnp.maximum(td_abs, min_priority) ** alpha


def update_priorities(buffer: LAPBuffer, idx, new_priority) -> LAPBuffer:
    """Set the sampled slots' priorities (and their leaves of the weight tree) and raise the running maximum."""
    priority = buffer.priority.at[idx].set(new_priority)
    return buffer._replace(
        priority=priority,
        max_priority=jnp.maximum(buffer.max_priority, jnp.max(new_priority)),
        weights=_set_leaves(buffer.weights, idx, priority[idx] * buffer.valid[idx]),
    )


def reward_scale(buffer: LAPBuffer, eps: float = 1e-8) -> jax.Array:
    """Mean |reward| over every stored transition (at least ``eps``).

    One variadic reduction over (|reward|, written): ``jnp.sum(jnp.where(...))`` made XLA on CPU
    write the masked rewards out first, a temporary of 4 bytes per slot."""

    def add_written(x, y):
        return jnp.where(x[1], x[0], 0.0) + jnp.where(y[1], y[0], 0.0), jnp.bool_(True)

    total = jax.lax.reduce(
        (jnp.abs(buffer.data.reward), buffer.step >= 0),
        (jnp.float32(0), jnp.bool_(True)),
        add_written,
        (buffer.step.ndim - 1,),
    )[0]
    return jnp.maximum(total / jnp.maximum(buffer.size, 1), eps)


def multistep_return(reward, terminated, gamma: float):
    """Masked H-step return of windows (our correction of MR.Q's reference ``buffer.py``) -> (R, c_H).

    c_0 = 1, c_i = prod_{j<i} (1 - d_{t+j});  R = sum_{i<H} gamma^i c_i r_{t+i}.
    The terminating transition's reward counts (c_i is 1 up to and including it) and
    nothing after it does; c_H = 0 when the window terminates, so the caller's bootstrap
    gamma^H c_H Q' vanishes.  ``reward``, ``terminated``: (B, H).
    """
    nd = 1.0 - terminated.astype(reward.dtype)
    survive = jnp.cumprod(nd, axis=1)  # c_1 .. c_H
    c = jnp.concatenate([jnp.ones_like(survive[:, :1]), survive[:, :-1]], axis=1)  # c_0 .. c_{H-1}
    discounts = gamma ** jnp.arange(reward.shape[1], dtype=reward.dtype)
    return jnp.sum(discounts * c * reward, axis=1), survive[:, -1]
