"""Long-horizon imagination in a world-model posterior: NeuBay's rollouts (Ni et al., arXiv 2512.04341).

Offline RL as an epistemic POMDP (NeuBay, sections 3-4): every imagined trajectory draws one member
of the dynamics ensemble (``agents/dynamics/``, ``neubay_config``) and keeps it for its whole
length, so a history-dependent agent that acts well across trajectories acts well across plausible
worlds.  One collection (section 4, "rollouts"; the reference's ``ContCollector``):

  1. pick ``batch`` prefixes of real dataset trajectories, each ending at a uniform timestep t0
     (0 <= t0 <= its length; a prefix may be a whole trajectory, which then is not extended)
  2. warm the agent's recurrent state up on the prefix, its inputs left-padded to a fixed length
     (padding marked as episode starts, so it carries nothing), which also gives the first action
  3. from s_t0, step trajectory b with member ``elites[b % E]`` (one per member when batch = E)
     until the first of: the termination function fires (that transition is kept, terminated);
     the epistemic uncertainty of the step's (s, a) exceeds ``threshold`` (that transition is
     kept, truncated); the tape reaches ``max_horizon`` transitions (the env's limit, 1000 for
     the MuJoCo tasks; truncated)
  4. store the tape: real prefix then imagined suffix, a real/imagined flag per transition

Agent inputs are [s_t, a_{t-1}, r_{t-1}] (zeros at t = 0; ``agent_inputs``), with the model's
sampled reward as r_{t-1}.  The tape stores that reward and each step's uncertainty; a reward
penalty (one of the paper's ablations, MOPO-style: NeuBay uses none) is the learner's to apply to
its targets, c * uncertainty off the reward, while its inputs keep the reward the agent saw when
acting (as in the reference code, twni2016/neubay, where observations carry the raw reward and
only the reward the critic learns is penalised).

The whole collection is one traceable function (a ``lax.while_loop`` that stops when every
trajectory has ended): call it inside the caller's ``jax.jit`` with the policy and done function
bound.  Shapes: B = batch, H = max_horizon, O / A = obs / action dims, I = O + A + 1.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.agents import dynamics as dynamics_lib


class Histories(NamedTuple):
    """The dataset's trajectories on the device, each cut to at most ``max_horizon`` transitions.

    Rows are the dataset's transitions in order; trajectory k owns rows [start[k], start[k] + length[k]).
    ``truncated[i]``: row i ends its trajectory without a termination (a timeout, the horizon cut,
    or the dataset's last row).
    """

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    next_obs: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    start: jax.Array
    length: jax.Array


class Tape(NamedTuple):
    """B trajectories of fixed capacity H (transitions past ``length`` are padding, ``valid`` False).

    ``obs`` (B, H + 1, O): slot t holds s_t, the state step t acts in (slot ``length`` the last
    next state).  ``action`` / ``reward`` / ``terminated`` / ``truncated`` / ``real`` / ``valid`` /
    ``uncertainty``: (B, H, ...) per transition; ``reward`` is the dataset's or the model's sampled
    one (never penalised); ``uncertainty`` is 0 on real steps.  ``member``
    (B,): the world-model member of the imagined part; ``prefix`` (B,): real transitions.
    """

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    real: jax.Array
    valid: jax.Array
    uncertainty: jax.Array
    member: jax.Array
    prefix: jax.Array
    length: jax.Array


def histories(obs, actions, rewards, next_obs, terminals, timeouts, max_horizon: int) -> Histories:
    """Cut a D4RL-layout dataset into trajectories (ends: terminals | timeouts | the last row), each
    kept up to its first ``max_horizon`` transitions (the rest is dropped, as the reference does for
    agent training: the agent is history-dependent, so tapes must match the test env's horizon)."""
    obs, next_obs = np.asarray(obs, np.float32), np.asarray(next_obs, np.float32)
    actions, rewards = np.asarray(actions, np.float32), np.asarray(rewards, np.float32).reshape(-1)
    terminals, timeouts = np.asarray(terminals, bool).reshape(-1), np.asarray(timeouts, bool).reshape(-1)
    n = len(obs)
    if n == 0:
        raise ValueError("the dataset has no transitions")
    if max_horizon < 1:
        raise ValueError(f"max_horizon must be >= 1, got {max_horizon}")
    ends = np.flatnonzero(terminals | timeouts)
    if len(ends) == 0 or ends[-1] != n - 1:
        ends = np.append(ends, n - 1)
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = np.minimum(ends - starts + 1, max_horizon)
    keep = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    new_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    last = np.zeros(len(keep), bool)
    last[new_starts + lengths - 1] = True
    term = terminals[keep] & last  # a termination cut off by the horizon is no longer the tape's end
    return Histories(
        jnp.asarray(obs[keep]),
        jnp.asarray(actions[keep]),
        jnp.asarray(rewards[keep]),
        jnp.asarray(next_obs[keep]),
        jnp.asarray(term),
        jnp.asarray(last & ~term),
        jnp.asarray(new_starts, jnp.int32),
        jnp.asarray(lengths, jnp.int32),
    )


def sample_prefixes(hist: Histories, key, batch: int, from_start: bool = False):
    """(trajectory, t0) per row: t0 uniform over every state of the dataset's trajectories (a
    trajectory of length L offers L + 1: s_0 .. s_L), so longer trajectories are picked more often;
    ``from_start``: t0 = 0 and a uniform trajectory."""
    k = hist.start.shape[0]
    if from_start:
        return jax.random.randint(key, (batch,), 0, k), jnp.zeros(batch, jnp.int32)
    sizes = hist.length + 1
    cum = jnp.cumsum(sizes)
    pos = jax.random.randint(key, (batch,), 0, cum[-1])
    traj = jnp.searchsorted(cum, pos, side="right").astype(jnp.int32)
    return traj, (pos - (cum[traj] - sizes[traj])).astype(jnp.int32)


def agent_inputs(obs, action, reward):
    """[s_t, a_{t-1}, r_{t-1}] for t = 0 .. T (zeros before the first step): obs (..., T + 1, O),
    action (..., T, A), reward (..., T) -> (..., T + 1, O + A + 1)."""
    prev_a = jnp.concatenate([jnp.zeros_like(action[..., :1, :]), action], axis=-2)
    prev_r = jnp.concatenate([jnp.zeros_like(reward[..., :1]), reward], axis=-1)[..., None]
    return jnp.concatenate([obs, prev_a, prev_r.astype(obs.dtype)], axis=-1)


def _real_prefix(hist: Histories, traj, t0, horizon: int) -> Tape:
    """The tape's real part: transitions 0 .. t0 - 1 of each picked trajectory and the state s_t0."""
    b = traj.shape[0]
    steps = jnp.arange(horizon)
    first, length = hist.start[traj], hist.length[traj]
    rows = first[:, None] + jnp.minimum(steps[None], length[:, None] - 1)  # (B, H)
    real = steps[None] < t0[:, None]
    slot = jnp.arange(horizon + 1)
    slot_rows = first[:, None] + jnp.minimum(slot[None], length[:, None] - 1)
    state = jnp.where((slot[None] < length[:, None])[..., None], hist.obs[slot_rows], hist.next_obs[slot_rows])
    obs = jnp.where((slot[None] <= t0[:, None])[..., None], state, 0.0)
    zero_f = jnp.zeros((b, horizon), jnp.float32)
    return Tape(
        obs=obs,
        action=jnp.where(real[..., None], hist.action[rows], 0.0),
        reward=jnp.where(real, hist.reward[rows], 0.0),
        terminated=real & hist.terminated[rows],
        truncated=real & hist.truncated[rows],
        real=real,
        valid=real,
        uncertainty=zero_f,
        member=jnp.zeros(b, jnp.int32),
        prefix=t0,
        length=t0,
    )


def _left_padded(inputs, t0):
    """Inputs of steps 0 .. t0 moved to the end of a fixed window (H + 1 slots); the padding in front
    is zeros marked as episode starts (each resets the recurrence), and step 0 starts the episode."""
    window = inputs.shape[1]
    pos = jnp.arange(window)[None] - (window - 1 - t0[:, None])  # source step of each slot
    padded = jnp.take_along_axis(inputs, jnp.clip(pos, 0, window - 1)[..., None], axis=1)
    padded = jnp.where((pos >= 0)[..., None], padded, 0.0)
    return padded, pos <= 0


def imagine(
    model,
    hist: Histories,
    policy: Callable,
    carry,
    key,
    *,
    batch: int,
    max_horizon: int,
    threshold,
    done_fn: Callable,
    from_start: bool = False,
    active=True,
):
    """One collection of ``batch`` tapes (steps 1-4 of the module docstring) -> (Tape, stats).

    ``policy(carry, inputs (B, T, I), start (B, T), key) -> (action (B, A) at the last step, carry)``
    runs the agent's (recurrent) actor over T steps; ``carry`` is its initial state for B rows.
    ``threshold``: the epistemic-uncertainty cut (``dynamics.uncertainty_threshold``; inf: none).
    ``done_fn(next_obs (B, O)) -> bool (B,)``: the env's termination function.
    ``stats``: imagined steps per tape (``horizon``), how each ended, the imagined return (the
    model's rewards, unpenalised).
    ``active`` (a traced bool): False imagines nothing (every tape is its real prefix and the loop
    takes no step), so a caller under ``vmap`` can skip a collection without a ``cond``.
    """
    k_prefix, k_warm, k_loop = jax.random.split(key, 3)
    traj, t0 = sample_prefixes(hist, k_prefix, batch, from_start)
    tape = _real_prefix(hist, traj, t0, max_horizon)
    rows = jnp.arange(batch)
    member = model.elites[rows % model.elites.shape[0]]
    tape = tape._replace(member=member)
    prefix_done = t0 == hist.length[traj]  # a whole trajectory: nothing to imagine

    padded, start = _left_padded(agent_inputs(tape.obs, tape.action, tape.reward), t0)
    action, carry = policy(carry, padded, start, k_warm)
    state = tape.obs[rows, t0]

    def alive_steps(loop):
        return (loop[0] < max_horizon) & jnp.any(loop[5])

    def one(loop):
        k, tape, s, a, carry, alive, key = loop
        key, k_model, k_act = jax.random.split(key, 3)
        pos = jnp.minimum(t0 + k, max_horizon - 1)
        unc = dynamics_lib.epistemic_uncertainty(model, s, a)
        s2, r = dynamics_lib.step(model, s, a, k_model, member)
        term = jnp.asarray(done_fn(s2), bool)
        trunc = ~term & ((t0 + k + 1 >= max_horizon) | (unc > threshold))

        def put(field, value, at=pos):
            old = field[rows, at]
            keep = alive.reshape((-1,) + (1,) * (value.ndim - 1))
            return field.at[rows, at].set(jnp.where(keep, value.astype(field.dtype), old))

        tape = tape._replace(
            action=put(tape.action, a),
            reward=put(tape.reward, r),
            terminated=put(tape.terminated, term),
            truncated=put(tape.truncated, trunc),
            valid=put(tape.valid, jnp.ones_like(alive)),
            uncertainty=put(tape.uncertainty, unc),
            obs=put(tape.obs, s2, pos + 1),
            length=jnp.where(alive, pos + 1, tape.length),
        )
        still = alive & ~term & ~trunc
        x = jnp.concatenate([s2, a, r[:, None]], axis=-1)[:, None]  # the next step's input [s', a, r]
        a2, carry = policy(carry, x, jnp.zeros((batch, 1), bool), k_act)
        return (k + 1, tape, jnp.where(still[:, None], s2, s), jnp.where(still[:, None], a2, a), carry, still, key)

    loop = (jnp.int32(0), tape, state, action, carry, ~prefix_done & active, k_loop)
    _, tape, *_ = jax.lax.while_loop(alive_steps, one, loop)
    horizon = tape.length - tape.prefix
    last = jnp.maximum(tape.length - 1, 0)
    imagined = tape.valid & ~tape.real
    ended_unc = ~prefix_done & tape.truncated[rows, last] & (tape.uncertainty[rows, last] > threshold)
    stats = {
        "horizon": horizon,
        "prefix": tape.prefix,
        "ended_terminated": ~prefix_done & tape.terminated[rows, last],
        "ended_uncertainty": ended_unc,
        "ended_horizon": ~prefix_done & tape.truncated[rows, last] & ~ended_unc,
        "imagined_return": jnp.where(imagined, tape.reward, 0.0).sum(-1),
        "uncertainty_mean": jnp.where(imagined, tape.uncertainty, 0.0).sum() / jnp.maximum(imagined.sum(), 1),
    }
    return tape, stats
