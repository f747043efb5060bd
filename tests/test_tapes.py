"""The tape buffer (buffers/tapes.py): whole trajectories back to back, sampled as tapes of uniformly
drawn episodes; constructed cases for the layout, the sampling, eviction and the previous-step inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.buffers import tapes


def _episodes(lengths, first_id=0, horizon=4):
    """Episodes whose obs encode (episode id, position): obs[b, t] = [10 * id + t]; actions 100 + t."""
    b = len(lengths)
    ids = np.arange(first_id, first_id + b)[:, None]
    obs = (10.0 * ids + np.arange(horizon + 1)[None])[..., None].astype(np.float32)
    action = (100.0 + np.arange(horizon)[None].repeat(b, 0))[..., None].astype(np.float32)
    reward = np.ones((b, horizon), np.float32)
    terminated = np.zeros((b, horizon), bool)
    real = np.zeros((b, horizon), bool)
    real[:, 0] = True
    return (
        jnp.asarray(obs),
        jnp.asarray(action),
        jnp.asarray(reward),
        jnp.asarray(terminated),
        jnp.asarray(real),
        jnp.asarray(lengths, jnp.int32),
    )


def test_episodes_are_laid_back_to_back_with_their_final_state():
    buf = tapes.add(tapes.init(20, 1, 1), *_episodes([2, 3]))
    obs = np.asarray(buf.steps.obs[:, 0])
    # episode 0: s0 s1 s2 at positions 0-2; episode 1: s0 .. s3 at positions 3-6
    np.testing.assert_array_equal(obs[:7], [0, 1, 2, 10, 11, 12, 13])
    np.testing.assert_array_equal(np.asarray(buf.steps.action[:7, 0]), [100, 101, 0, 100, 101, 102, 0])
    np.testing.assert_array_equal(np.asarray(buf.steps.reward[:7]), [1, 1, 0, 1, 1, 1, 0])
    np.testing.assert_array_equal(np.asarray(buf.steps.real[:7]), [1, 0, 0, 1, 0, 0, 0])
    assert (int(buf.written), int(buf.episodes), int(buf.first)) == (7, 2, 0)
    np.testing.assert_array_equal(np.asarray(buf.episode_start[:2]), [0, 3])
    np.testing.assert_array_equal(np.asarray(buf.episode_length[:2]), [3, 4])


def test_kept_episodes_only_and_never_an_empty_one():
    buf = tapes.add(tapes.init(20, 1, 1), *_episodes([2, 0, 1]), keep=jnp.array([False, True, True]))
    assert (int(buf.written), int(buf.episodes)) == (2, 1)  # only episode 2 (1 transition): 2 positions
    np.testing.assert_array_equal(np.asarray(buf.steps.obs[:2, 0]), [20, 21])


@pytest.mark.slow
def test_a_tape_concatenates_whole_episodes_from_their_starts():
    buf = tapes.add(tapes.init(20, 1, 1), *_episodes([2]))
    tape = tapes.sample(buf, jax.random.key(0), 7)
    # one stored episode of 3 positions, repeated: s0 s1 s2 | s0 s1 s2 | s0 (cut)
    np.testing.assert_array_equal(np.asarray(tape.obs[:, 0]), [0, 1, 2, 0, 1, 2, 0])
    np.testing.assert_array_equal(np.asarray(tape.start), [1, 0, 0, 1, 0, 0, 1])
    buf = tapes.add(buf, *_episodes([1, 3], first_id=1))
    for k in range(5):
        tape = tapes.sample(buf, jax.random.key(k), 16)
        obs, start = np.asarray(tape.obs[:, 0]), np.asarray(tape.start)
        assert start[0]
        ids, pos = obs // 10, obs % 10
        np.testing.assert_array_equal(pos[start], 0)  # every episode enters at its first position
        inner = ~start[1:]
        np.testing.assert_array_equal(ids[1:][inner], ids[:-1][inner])  # and runs on in order
        np.testing.assert_array_equal(pos[1:][inner], pos[:-1][inner] + 1)


def test_episodes_are_drawn_uniformly_not_by_length():
    buf = tapes.add(tapes.init(200, 1, 1), *_episodes([1, 4], horizon=4))
    starts = []
    for k in range(200):
        tape = tapes.sample(buf, jax.random.key(k), 2)  # the first episode of each tape
        starts.append(int(tape.obs[0, 0]) // 10)
    share = np.mean(np.array(starts) == 0)
    assert 0.4 < share < 0.6  # 2 positions vs 5: by length it would be 2/7


def test_overwritten_episodes_are_dropped_whole():
    buf = tapes.init(10, 1, 1)
    buf = tapes.add(buf, *_episodes([3], first_id=0))  # positions 0-3
    buf = tapes.add(buf, *_episodes([3], first_id=1))  # 4-7
    buf = tapes.add(buf, *_episodes([3], first_id=2))  # 8, 9, 0, 1: episode 0 is gone, episode 1 intact
    assert (int(buf.first), int(buf.episodes), int(tapes.stored_episodes(buf))) == (1, 3, 2)
    assert int(tapes.stored_positions(buf)) == 10
    np.testing.assert_array_equal(np.asarray(buf.steps.obs[:, 0]), [22, 23, 2, 3, 10, 11, 12, 13, 20, 21])
    seen = set()
    for k in range(30):
        tape = tapes.sample(buf, jax.random.key(k), 8)
        seen |= set((np.asarray(tape.obs[:, 0]) // 10).astype(int).tolist())
    assert seen == {1, 2}  # wrapped episode 2 reads across the ring's end; episode 0 never comes back
    tape = tapes.sample(buf, jax.random.key(3), 8)
    obs = np.asarray(tape.obs[:, 0])
    for i in np.flatnonzero(np.asarray(tape.start)):
        assert obs[i] in (10, 20)


def test_previous_step_inputs_reset_at_episode_starts():
    x = jnp.array([[1.0], [2.0], [3.0], [4.0]])
    start = jnp.array([True, False, True, False])
    np.testing.assert_array_equal(np.asarray(tapes.previous(x, start)[:, 0]), [0, 1, 0, 3])
    np.testing.assert_array_equal(np.asarray(tapes.previous(x[:, 0], start)), [0, 1, 0, 3])


@pytest.mark.slow
def test_buffers_vmap_over_seeds():
    bufs = jax.vmap(lambda _: tapes.init(20, 1, 1))(jnp.arange(2))
    eps = _episodes([2, 3])
    bufs = jax.vmap(lambda b, keep: tapes.add(b, *eps, keep=keep))(bufs, jnp.array([[True, True], [False, True]]))
    np.testing.assert_array_equal(np.asarray(bufs.written), [7, 4])
    tape = jax.vmap(lambda b, k: tapes.sample(b, k, 5))(bufs, jax.random.split(jax.random.key(0), 2))
    np.testing.assert_array_equal(np.asarray(tape.obs[1, :, 0]), [10, 11, 12, 13, 10])


def test_transitions_are_drawn_uniformly_with_their_successor():
    buf = tapes.add(tapes.init(20, 1, 1), *_episodes([2, 3]))  # positions 0-2 and 3-6; 2 and 6 final states
    np.testing.assert_array_equal(np.asarray(buf.steps.has_next[:7]), [1, 1, 0, 1, 1, 1, 0])
    pair = tapes.sample_transitions(buf, jax.random.key(0), 6000)
    first, second = np.asarray(pair.obs[:, 0, 0]), np.asarray(pair.obs[:, 1, 0])
    start = np.asarray(pair.start)
    assert start[:, 0].all()
    kept = ~start[:, 1]
    # a kept row is a transition s_t -> s_{t+1} of one episode, with that transition's action
    np.testing.assert_array_equal(second[kept], first[kept] + 1)
    np.testing.assert_array_equal(np.asarray(pair.action[:, 0, 0])[kept], 100 + first[kept] % 10)
    # the masked rows are exactly the draws of an episode's final state (s2 of episode 0; position 6,
    # the newest, has no successor and is never drawn)
    np.testing.assert_array_equal(np.unique(first[~kept]), [2])
    counts = np.array([np.sum(first == v) for v in (0, 1, 2, 10, 11, 12)])
    assert counts.sum() == 6000 and np.all(np.abs(counts / 6000 - 1 / 6) < 0.02), counts


def test_transitions_come_from_the_live_part_of_a_wrapped_ring():
    buf = tapes.init(8, 1, 1)
    for k in range(4):  # 4 episodes of 2 transitions (3 positions each): 12 written into 8
        buf = tapes.add(buf, *_episodes([2], first_id=k))
    pair = tapes.sample_transitions(buf, jax.random.key(1), 2000)
    first, second = np.asarray(pair.obs[:, 0, 0]), np.asarray(pair.obs[:, 1, 0])
    kept = ~np.asarray(pair.start[:, 1])
    # live positions 4..11: episode 1's s1 s2, episodes 2 and 3 whole; 11 (the newest) is never drawn
    assert set(np.unique(first)) == {11, 12, 20, 21, 22, 30, 31}
    np.testing.assert_array_equal(second[kept], first[kept] + 1)
    assert set(np.unique(first[~kept])) == {12, 22}
