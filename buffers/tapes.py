"""A FIFO of whole trajectories on the device, sampled as tapes: uniform episodes laid end to end.

Recurrent agents learn from sequences, not single transitions.  This buffer stores trajectories
back to back in one ring of positions; position t of an episode holds the state s_t and, for
t < its length, transition t (a_t, r_t, terminated_t, a real/imagined flag); the episode's last
position holds its final state with a zero transition.  A sample is one tape of ``T`` positions:
episodes drawn uniformly (not by length) and concatenated until the tape is full, the last one
cut (the sampling of NeuBay's tape buffer, Ni et al., arXiv 2512.04341, section 4; the design of
recurrent replay from whole episodes follows Kapturowski et al., R2D2, 2019).  ``start`` marks each
episode's first position, so a recurrent core resets there and a loss masks the transition
that would cross into the next episode.

Episodes are whole or absent: adding overwrites the oldest positions and drops every episode
whose first position was overwritten.  Positions and episodes are counted with int32 totals, so a
buffer takes at most 2**31 positions over its life.  Every function is jit- and vmap-friendly.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class Steps(NamedTuple):
    """Per position: the state, then the transition taken from it (zeros at an episode's last position)."""

    obs: jax.Array  # (C, O)
    action: jax.Array  # (C, A)
    reward: jax.Array  # (C,)
    terminated: jax.Array  # (C,) bool
    real: jax.Array  # (C,) bool: the transition is from the dataset (not imagined)
    has_next: jax.Array  # (C,) bool: a transition starts here (False at an episode's last position)
    penalty: Optional[jax.Array] = None
    """(C,) what the learner subtracts from ``reward`` (a reward penalty); None in a buffer made without
    one (no array, so such a buffer's leaves and checkpoints are those of a buffer without the field)"""


class TapeBuffer(NamedTuple):
    steps: Steps
    episode_start: jax.Array  # (E,) absolute position of episode k's first slot, at k % E
    episode_length: jax.Array  # (E,) positions of episode k (its transitions + 1)
    written: jax.Array  # positions ever written
    episodes: jax.Array  # episodes ever added (the newest is episodes - 1)
    first: jax.Array  # the oldest episode still whole


class Tape(NamedTuple):
    """One sampled tape of T positions (``Steps`` fields and ``start``: an episode begins here)."""

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    real: jax.Array
    start: jax.Array
    penalty: Optional[jax.Array] = None


def init(capacity: int, obs_dim: int, act_dim: int, penalized: bool = False) -> TapeBuffer:
    """An empty buffer of ``capacity`` positions (an episode of L transitions takes L + 1);
    ``penalized``: it also stores a reward penalty per transition (``Steps.penalty``)."""
    if capacity < 2:
        raise ValueError(f"a tape buffer needs at least 2 positions, got {capacity}")
    f = lambda *s: jnp.zeros((capacity, *s), jnp.float32)  # noqa: E731
    no = lambda: jnp.zeros(capacity, bool)  # noqa: E731
    steps = Steps(f(obs_dim), f(act_dim), f(), no(), no(), no(), f() if penalized else None)
    episodes = capacity // 2 + 1  # whole episodes take >= 2 positions each
    zero = jnp.zeros((), jnp.int32)
    return TapeBuffer(steps, jnp.zeros(episodes, jnp.int32), jnp.zeros(episodes, jnp.int32), zero, zero, zero)


def capacity(buffer: TapeBuffer) -> int:
    return buffer.steps.reward.shape[-1]


def stored_episodes(buffer: TapeBuffer):
    return buffer.episodes - buffer.first


def stored_positions(buffer: TapeBuffer):
    return jnp.minimum(buffer.written, capacity(buffer))


def add(buffer: TapeBuffer, obs, action, reward, terminated, real, length, keep=None, penalty=None) -> TapeBuffer:
    """Append B episodes in order: obs (B, H + 1, O), action (B, H, A), reward / terminated / real
    (B, H), ``length`` (B,) transitions per episode (slots past it are ignored); ``keep`` (B,) bool
    leaves out the others (and every episode of length 0).  ``penalty`` (B, H): each transition's
    reward penalty, for a buffer made ``penalized`` (None there: zeros).  One call may add at most
    ``capacity`` positions."""
    cap, n_ep = capacity(buffer), buffer.episode_start.shape[0]
    if buffer.steps.penalty is None and penalty is not None:
        raise ValueError("this tape buffer stores no reward penalty: make it with init(..., penalized=True)")
    b, horizon = reward.shape
    if b * (horizon + 1) > cap:
        raise ValueError(
            f"{b} episodes of up to {horizon} transitions need up to {b * (horizon + 1)} positions; "
            f"the buffer holds {cap}"
        )
    keep = (length >= 1) if keep is None else (keep & (length >= 1))
    size = jnp.where(keep, length + 1, 0).astype(jnp.int32)
    offset = jnp.cumsum(size) - size
    t = jnp.arange(horizon + 1)
    inside = keep[:, None] & (t[None] <= length[:, None])
    dest = jnp.where(inside, (buffer.written + offset[:, None] + t[None]) % cap, cap).reshape(-1)
    moving = t[None, :horizon] < length[:, None]

    def transitions(x):  # (B, H, ...) -> (B, H + 1, ...) with zeros at and past the episode's length
        x = jnp.where(moving.reshape(moving.shape + (1,) * (x.ndim - 2)), x, jnp.zeros_like(x))
        return jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)

    if buffer.steps.penalty is not None:
        penalty = transitions(jnp.zeros_like(reward) if penalty is None else jnp.asarray(penalty))
    new = Steps(
        obs,
        transitions(action),
        transitions(reward),
        transitions(terminated),
        transitions(real),
        transitions(jnp.ones_like(terminated, bool)),
        penalty,
    )
    steps = jax.tree.map(
        lambda d, x: d.at[dest].set(x.reshape((-1,) + d.shape[1:]).astype(d.dtype), mode="drop"), buffer.steps, new
    )
    k = buffer.episodes + jnp.cumsum(keep) - 1
    slot = jnp.where(keep, k % n_ep, n_ep)
    episode_start = buffer.episode_start.at[slot].set(buffer.written + offset, mode="drop")
    episode_length = buffer.episode_length.at[slot].set(size, mode="drop")
    written = buffer.written + size.sum()
    episodes = buffer.episodes + keep.sum().astype(jnp.int32)

    def overwritten(first):
        return (first < episodes) & (episode_start[first % n_ep] < written - cap)

    first = jax.lax.while_loop(overwritten, lambda f: f + 1, buffer.first)
    return TapeBuffer(steps, episode_start, episode_length, written, episodes, first)


def sample(buffer: TapeBuffer, key, length: int) -> Tape:
    """One tape of ``length`` positions: uniformly drawn stored episodes laid end to end, the last
    one cut.  The buffer must hold at least one episode."""
    cap, n_ep = capacity(buffer), buffer.episode_start.shape[0]
    count = jnp.maximum(stored_episodes(buffer), 1)
    # every episode takes >= 2 positions, so ``length`` draws always fill the tape
    k = (buffer.first + jax.random.randint(key, (length,), 0, count)) % n_ep
    sizes = buffer.episode_length[k]
    ends = jnp.cumsum(sizes)
    j = jnp.arange(length)
    which = jnp.searchsorted(ends, j, side="right")
    within = j - (ends[which] - sizes[which])
    pos = (buffer.episode_start[k[which]] + within) % cap
    s = jax.tree.map(lambda x: x[pos], buffer.steps)
    return Tape(s.obs, s.action, s.reward, s.terminated, s.real, within == 0, s.penalty)


def sample_transitions(buffer: TapeBuffer, key, n: int) -> Tape:
    """``n`` positions drawn uniformly from the stored ones, each with its successor: a tape of
    shape (n, 2, ...) whose second position is marked a ``start`` where the first has no transition
    (an episode's last position), so a loss masking transitions into a start drops exactly those.
    Uniform over positions, hence over the transitions kept (a Markov learner's replay; the rows
    masked out are the episodes' final states, one per episode).  The buffer must not be empty."""
    cap = capacity(buffer)
    stored = stored_positions(buffer)
    first = buffer.written - stored  # the oldest absolute position still in the ring
    p = first + jax.random.randint(key, (n,), 0, jnp.maximum(stored - 1, 1))
    pos = jnp.stack([p, p + 1], axis=1) % cap
    s = jax.tree.map(lambda x: x[pos], buffer.steps)
    start = jnp.stack([jnp.ones(n, bool), ~s.has_next[:, 0] | (p + 1 >= buffer.written)], axis=1)
    return Tape(s.obs, s.action, s.reward, s.terminated, s.real, start, s.penalty)


def previous(x, start):
    """x shifted one position later along axis 0, with zeros at every episode start (``start``):
    the previous action / reward of each position."""
    shifted = jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]], axis=0)
    mask = start.reshape(start.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, jnp.zeros_like(shifted), shifted)
