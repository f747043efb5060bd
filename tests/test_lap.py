"""LAP replay over per-env subtrajectories (buffers/lap.py): streams, masks, priorities, returns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.buffers import lap
from plasticity_zoo.buffers.replay import Transition


def _simulate(num_envs, steps, capacity, seed=0, p_term=0.08, p_trunc=0.08):
    """Fill a buffer from ``num_envs`` streams; each transition is labelled (env, time) in its obs.

    Returns the buffer and a Python model: the list of all transitions in write order as
    (env, t, terminated, truncated); the live ones are the last ``capacity``.
    """
    rng = np.random.default_rng(seed)
    buf = lap.init(capacity, 2, 1)
    add = jax.jit(lap.add)
    log = []
    for t in range(steps):
        term = rng.random(num_envs) < p_term
        trunc = (rng.random(num_envs) < p_trunc) & ~term
        obs = np.stack([np.arange(num_envs), np.full(num_envs, t)], 1).astype(np.float32)
        nxt = obs + np.array([0, 1], np.float32)
        reward = (1000 * np.arange(num_envs) + t).astype(np.float32)
        buf = add(buf, Transition(obs, obs[:, :1] * 0 + np.arange(num_envs)[:, None], reward, nxt, term, trunc))
        log += [(e, t, bool(term[e]), bool(trunc[e])) for e in range(num_envs)]
    return buf, log


def _reference_mask(log, capacity, horizon):
    """(env, t) -> window of ``horizon`` from (env, t) is sampleable, from the Python model alone."""
    live = {(e, t): (d, tr) for e, t, d, tr in log[-capacity:]}
    ok = {}
    for e, t in live:
        steps = [(e, t + k) for k in range(horizon)]
        ok[(e, t)] = all(s in live for s in steps) and not any(live[s][1] for s in steps[:-1])
    return ok


@pytest.mark.parametrize("num_envs,capacity", [(1, 30), (3, 50), (4, 64)])
def test_window_mask_matches_a_model_of_per_env_streams(num_envs, capacity):
    buf, log = _simulate(num_envs, 37, capacity)  # wraps around the ring (37 * E > capacity)
    assert int(buf.size) == capacity and int(buf.num_envs) == num_envs
    for horizon in (1, 3, 5):
        mask = np.asarray(lap.window_mask(buf, horizon))
        ref = _reference_mask(log, capacity, horizon)
        obs = np.asarray(buf.data.obs).astype(int)
        got = {(e, t): bool(m) for (e, t), m in zip(map(tuple, obs), mask)}
        assert got == ref
    # the constructed streams do exercise both rules: some windows of 5 run past a termination
    # (allowed; the losses mask what follows it) and some are excluded only by a truncation
    live = {(e, t): (d, tr) for e, t, d, tr in log[-capacity:]}
    ref5 = _reference_mask(log, capacity, 5)
    assert any(ok and any(live[(e, t + k)][0] for k in range(4)) for (e, t), ok in ref5.items())
    assert any(not ok and all((e, t + k) in live for k in range(5)) for (e, t), ok in ref5.items())


@pytest.mark.slow
def test_sampled_windows_stay_in_one_env_and_never_cross_a_truncation():
    buf, _ = _simulate(3, 60, 120, seed=1, p_term=0.1, p_trunc=0.15)
    horizon = 5
    idx, win = lap.sample(buf, jax.random.key(0), 4000, horizon)
    env = np.asarray(win.obs[:, 0]).astype(int)
    reward = np.asarray(win.reward).astype(int)
    np.testing.assert_array_equal(reward // 1000, np.repeat(env[:, None], horizon, 1))  # same env
    np.testing.assert_array_equal(np.diff(reward, axis=1), 1)  # consecutive steps
    np.testing.assert_array_equal(np.asarray(win.action)[..., 0], np.repeat(env[:, None], horizon, 1))
    assert not np.asarray(win.truncated)[:, :-1].any()  # never runs past a truncation
    # next_obs of step k is the true successor of obs at step k
    successor = np.asarray(win.obs)[:, None, 1] + 1 + np.arange(horizon)
    np.testing.assert_array_equal(np.asarray(win.next_obs)[:, :, 1], successor)
    assert np.asarray(win.terminated)[:, :-1].any()  # windows do run past terminations
    assert np.asarray(lap.window_mask(buf, horizon))[np.asarray(idx)].all()


def test_new_transitions_get_the_running_max_priority_and_priority_formula():
    buf = lap.init(8, 1, 1)
    one = Transition(
        jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros(1), jnp.zeros((1, 1)), jnp.zeros(1, bool), jnp.zeros(1, bool)
    )
    for _ in range(3):
        buf = lap.add(buf, one)
    np.testing.assert_allclose(buf.priority[:3], 1.0)  # initial running max = 1
    # priority = max(|delta|, 1) ** 0.4
    p = lap.priority(jnp.array([0.5, 10.0, 3.0]), alpha=0.4, min_priority=1.0)
    np.testing.assert_allclose(p, [1.0, 10.0**0.4, 3.0**0.4], rtol=1e-6)
    buf = lap.update_priorities(buf, jnp.array([0, 1, 2]), p)
    assert float(buf.max_priority) == pytest.approx(10.0**0.4)
    buf = lap.add(buf, one)
    assert float(buf.priority[3]) == pytest.approx(10.0**0.4)  # new transition: the running max
    buf = lap.update_priorities(buf, jnp.array([1]), jnp.array([1.0]))  # the max never decreases
    assert float(buf.max_priority) == pytest.approx(10.0**0.4)
    buf = lap.add(buf, one)
    assert float(buf.priority[4]) == pytest.approx(10.0**0.4)


def test_sampling_frequencies_are_proportional_to_priority_times_validity():
    cap = 10
    buf = lap.init(cap, 1, 1)
    batch = Transition(
        jnp.zeros((cap, 1)),
        jnp.zeros((cap, 1)),
        jnp.zeros(cap),
        jnp.zeros((cap, 1)),
        jnp.zeros(cap, bool),
        jnp.zeros(cap, bool).at[6].set(True),
    )
    buf = lap.add(buf, batch)  # one add of 10 envs: every window has length 1 per env stream
    buf = buf._replace(priority=jnp.array([1.0, 2.0, 3.0, 4.0, 0.5, 7.0, 9.0, 1.5, 2.5, 6.0]))
    valid = lap.window_mask(buf, 1)
    assert np.asarray(valid).all()
    valid = valid.at[jnp.array([2, 8])].set(False)  # excluded slots are never drawn
    n = 200_000
    idx = np.asarray(lap.draw(lap.cdf(buf, valid), jax.random.key(3), n))
    counts = np.bincount(idx, minlength=cap)
    w = np.asarray(buf.priority) * np.asarray(valid)
    assert counts[2] == counts[8] == 0
    expected = n * w / w.sum()
    keep = w > 0
    chi2 = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])
    assert chi2 < 26.1, (chi2, counts, expected)  # chi-square, 7 degrees of freedom, p = 0.0005
    # uniform (no-LAP ablation): equal frequencies over valid windows
    idx = np.asarray(lap.draw(lap.cdf(buf, valid, prioritized=False), jax.random.key(4), n))
    counts = np.bincount(idx, minlength=cap)[np.asarray(valid)]
    np.testing.assert_allclose(counts / n, 1 / 8, atol=0.005)


def test_multistep_return_with_termination_inside_the_window():
    g = 0.9
    r = jnp.array([[1.0, 2.0, 4.0]] * 4)
    d = jnp.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], bool)
    ret, c = lap.multistep_return(r, d, g)
    np.testing.assert_allclose(ret, [1 + g * 2 + g * g * 4, 1.0, 1 + g * 2, 1 + g * 2 + g * g * 4], rtol=1e-6)
    np.testing.assert_allclose(c, [1.0, 0.0, 0.0, 0.0])
    # rewards (and later terminations) after the terminal transition change nothing
    r2 = r.at[1, 1:].set(100.0).at[2, 2].set(-50.0)
    d2 = d.at[1, 2].set(True)
    ret2, c2 = lap.multistep_return(r2, d2, g)
    np.testing.assert_allclose(ret2, ret, rtol=1e-6)
    np.testing.assert_allclose(c2, c)


def test_reward_scale_is_the_mean_absolute_reward_of_stored_transitions():
    buf = lap.init(6, 1, 1)
    rewards = jnp.array([1.0, -3.0, 2.0, 0.0])
    batch = Transition(
        jnp.zeros((4, 1)), jnp.zeros((4, 1)), rewards, jnp.zeros((4, 1)), jnp.zeros(4, bool), jnp.zeros(4, bool)
    )
    buf = lap.add(buf, batch)
    assert float(lap.reward_scale(buf)) == pytest.approx(1.5)  # empty slots do not count
    buf = lap.add(buf, batch)  # wraps: 8 written into 6 slots -> the live ones are the last 6
    assert float(lap.reward_scale(buf)) == pytest.approx((2 + 0 + 1 + 3 + 2 + 0) / 6)
    assert float(lap.reward_scale(lap.init(4, 1, 1))) == pytest.approx(1e-8)


@pytest.mark.slow
def test_add_and_sample_vmap_over_seeds():
    bufs = jax.vmap(lambda _: lap.init(16, 2, 1))(jnp.arange(2))
    batch = Transition(
        jnp.ones((2, 3, 2)),
        jnp.ones((2, 3, 1)),
        jnp.array([[1.0, 2, 3], [4, 5, 6]]),
        jnp.ones((2, 3, 2)),
        jnp.zeros((2, 3), bool),
        jnp.zeros((2, 3), bool),
    )
    for _ in range(4):
        bufs = jax.vmap(lap.add)(bufs, batch)
    idx, win = jax.vmap(lambda b, k: lap.sample(b, k, 64, 3))(bufs, jax.random.split(jax.random.key(0), 2))
    assert win.reward.shape == (2, 64, 3)
    assert set(np.unique(np.asarray(win.reward[0]))) <= {1.0, 2.0, 3.0}
    assert set(np.unique(np.asarray(win.reward[1]))) <= {4.0, 5.0, 6.0}
    # 4 adds x 3 envs: windows of 3 can start at each env's first two steps only
    assert sorted(np.unique(np.asarray(idx[0])).tolist()) == [0, 1, 2, 3, 4, 5]


def _check_trees(buf, horizon):
    """The kept mask equals window_mask; tree leaves are priority x valid / valid; every node sums its children."""
    valid = np.asarray(lap.window_mask(buf, horizon))
    np.testing.assert_array_equal(np.asarray(buf.valid), valid)
    cap = valid.shape[0]
    for tree, leaves in ((buf.weights, np.asarray(buf.priority) * valid), (buf.counts, valid.astype(np.float32))):
        tree = np.asarray(tree)
        p = tree.shape[0] // 2
        np.testing.assert_allclose(tree[p : p + cap], leaves, rtol=1e-6)
        assert not tree[p + cap :].any()
        np.testing.assert_allclose(tree[1:p], tree[2 : 2 * p : 2] + tree[3 : 2 * p : 2], rtol=1e-5)
    assert float(lap.valid_windows(buf)) == valid.sum()


@pytest.mark.slow
@pytest.mark.parametrize("num_envs,capacity,horizon", [(1, 30, 3), (3, 50, 5), (4, 64, 5), (2, 7, 3)])
def test_the_kept_mask_and_sum_trees_match_a_rebuild_after_adds_wraps_and_priority_updates(num_envs, capacity, horizon):
    rng = np.random.default_rng(num_envs)
    buf = lap.init(capacity, 2, 1, horizon=horizon)
    add, upd = jax.jit(lap.add), jax.jit(lap.update_priorities)
    for t in range(45):  # wraps around the ring; truncations and terminations on random steps
        term = rng.random(num_envs) < 0.08
        trunc = (rng.random(num_envs) < 0.1) & ~term
        obs = np.stack([np.arange(num_envs), np.full(num_envs, t)], 1).astype(np.float32)
        buf = add(buf, Transition(obs, obs[:, :1], obs[:, 1], obs + 1, term, trunc))
        if t % 3 == 0:  # priorities of drawn windows change between adds, repeats included
            idx = lap.draw_tree(buf.weights, jax.random.key(t), 6)
            buf = upd(buf, idx, jnp.asarray(rng.uniform(1.0, 5.0, 6), jnp.float32))
        _check_trees(buf, horizon)


@pytest.mark.slow
def test_the_tree_draws_the_slots_the_cumulative_sum_draws_from_the_same_key():
    buf, _ = _simulate(3, 60, 128, seed=2, p_term=0.1, p_trunc=0.15)
    buf = buf._replace(weights=jnp.zeros(256), counts=jnp.zeros(256), horizon=jnp.arange(5), valid=jnp.zeros(128, bool))
    # integer priorities: every partial sum is exact in float32, so both samplers must agree slot for slot
    pri = jnp.asarray(np.random.default_rng(0).integers(1, 9, 128), jnp.float32)
    buf = buf._replace(priority=pri)
    buf = lap._refresh(buf, jnp.arange(128))  # build the mask and the trees from scratch
    _check_trees(buf, 5)
    for seed in range(3):
        key = jax.random.key(seed)
        expected = lap.draw(lap.cdf(buf, lap.window_mask(buf, 5)), key, 4000)
        np.testing.assert_array_equal(np.asarray(lap.draw_tree(buf.weights, key, 4000)), np.asarray(expected))
        expected = lap.draw(lap.cdf(buf, lap.window_mask(buf, 5), prioritized=False), key, 4000)
        np.testing.assert_array_equal(np.asarray(lap.draw_tree(buf.counts, key, 4000)), np.asarray(expected))


def test_tree_draws_never_land_on_an_invalid_window_and_follow_the_weights():
    cap = 10
    buf = lap.init(cap, 1, 1, horizon=1)
    batch = Transition(
        jnp.zeros((cap, 1)),
        jnp.zeros((cap, 1)),
        jnp.zeros(cap),
        jnp.zeros((cap, 1)),
        jnp.zeros(cap, bool),
        jnp.zeros(cap, bool),
    )
    buf = lap.add(buf, batch)
    w = np.array([1.0, 2.0, 3.0, 0.0, 0.5, 7.0, 9.0, 0.0, 2.5, 6.0], np.float32)
    buf = lap.update_priorities(buf, jnp.arange(cap), jnp.asarray(w))
    n = 200_000
    counts = np.bincount(np.asarray(lap.draw_tree(buf.weights, jax.random.key(3), n)), minlength=cap)
    assert counts[3] == counts[7] == 0
    keep = w > 0
    expected = n * w / w.sum()
    chi2 = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])
    assert chi2 < 26.1, (chi2, counts, expected)  # 7 degrees of freedom, p = 0.0005


@pytest.mark.slow
def test_a_replay_steps_work_does_not_grow_with_the_capacity():
    """Issue #18's regression check, without timing: XLA's flop count of one add + draw + priority
    update grows with the tree depth (about 3x for 256x the capacity here; XLA counts a gather's index
    arithmetic too), where the mask-and-cumsum path grows with the capacity."""
    tr = Transition(
        jnp.zeros((1, 3)), jnp.zeros((1, 1)), jnp.zeros(1), jnp.zeros((1, 3)), jnp.zeros(1, bool), jnp.zeros(1, bool)
    )

    def replay_step(buf, key):
        buf = lap.add(buf, tr)
        idx = lap.draw_tree(buf.weights, key, 256)
        return lap.update_priorities(buf, idx, jnp.full(256, 2.0))

    def rebuilt(buf, key):
        buf = lap.add(buf, tr)
        idx = lap.draw(lap.cdf(buf, lap.window_mask(buf, 5)), key, 256)
        return lap.update_priorities(buf, idx, jnp.full(256, 2.0))

    def flops(fn, cap):
        cost = jax.jit(fn).lower(lap.init(cap, 3, 1, horizon=5), jax.random.key(0)).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    small, large = 1 << 10, 1 << 18
    assert flops(replay_step, large) < 5 * flops(replay_step, small)  # 256x the capacity, 18 tree levels against 10
    assert flops(rebuilt, large) > 25 * flops(rebuilt, small)  # the check can fail: the O(capacity) path does
