"""NeuBay's long-horizon imagination (agents/imagination.py) on constructed worlds."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import dynamics as dyn
from plasticity_zoo.agents import imagination as im
from plasticity_zoo.networks.core import path_names
from plasticity_zoo.networks.recurrent import RecurrentSpec, build_recurrent

OBS, ACT = 2, 1
LENGTHS = (5, 8, 6)  # ends: a timeout, a termination, the dataset's last row


def dataset():
    rng = np.random.default_rng(0)
    n = sum(LENGTHS)
    obs = rng.normal(size=(n, OBS)).astype(np.float32)
    next_obs = obs + 0.1
    actions = rng.uniform(-1, 1, (n, ACT)).astype(np.float32)
    rewards = rng.normal(size=n).astype(np.float32)
    terminals, timeouts = np.zeros(n, bool), np.zeros(n, bool)
    timeouts[4], terminals[12] = True, True
    return obs, actions, rewards, next_obs, terminals, timeouts


def test_histories_cut_trajectories_and_keep_their_end_flags():
    h = im.histories(*dataset(), max_horizon=100)
    assert h.start.tolist() == [0, 5, 13] and h.length.tolist() == list(LENGTHS)
    assert np.flatnonzero(np.asarray(h.terminated)).tolist() == [12]
    assert np.flatnonzero(np.asarray(h.truncated)).tolist() == [4, 18]  # timeout, dataset end
    cut = im.histories(*dataset(), max_horizon=6)  # the 8-step trajectory keeps its first 6
    assert cut.length.tolist() == [5, 6, 6] and cut.start.tolist() == [0, 5, 11]
    assert not np.asarray(cut.terminated).any()  # its termination was cut off
    assert np.flatnonzero(np.asarray(cut.truncated)).tolist() == [4, 10, 16]
    np.testing.assert_array_equal(np.asarray(cut.obs[5:11]), dataset()[0][5:11])


def test_prefixes_cover_every_state_of_every_trajectory():
    h = im.histories(*dataset(), max_horizon=100)
    traj, t0 = jax.jit(partial(im.sample_prefixes, batch=20000))(h, jax.random.key(0))
    traj, t0 = np.asarray(traj), np.asarray(t0)
    for k, length in enumerate(LENGTHS):
        seen = np.bincount(t0[traj == k], minlength=length + 1)
        assert len(seen) == length + 1 and (seen > 0).all()  # t0 = 0 .. L, the whole trajectory included
    share = np.bincount(traj) / len(traj)  # picked in proportion to L + 1 states
    np.testing.assert_allclose(share, (np.array(LENGTHS) + 1) / (sum(LENGTHS) + 3), atol=0.02)
    _, t0 = im.sample_prefixes(h, jax.random.key(1), 50, from_start=True)
    assert not np.asarray(t0).any()


def test_agent_inputs_are_state_previous_action_previous_reward():
    obs = jnp.arange(3 * OBS, dtype=jnp.float32).reshape(3, OBS)
    x = im.agent_inputs(obs, jnp.array([[5.0], [6.0]]), jnp.array([7.0, 8.0]))
    np.testing.assert_array_equal(np.asarray(x), [[0, 1, 0, 0], [2, 3, 5, 7], [4, 5, 6, 8]])


def constant_world(means, members=3):
    """A posterior whose member m adds ``means[m]`` = (Δs, r) every step, with no noise."""
    cfg = dyn.neubay_config(members=members, elites=members, width=4, depth=1)
    model = dyn.init_model(jax.random.key(0), OBS, ACT, cfg)

    def put(path, x):
        name = "/".join(map(str, path_names(path)))
        if name == "mean/kernel":
            return jnp.zeros_like(x)
        if name == "mean/bias":
            return jnp.asarray(means, x.dtype)
        if name in ("min_logvar", "max_logvar"):  # sigma ~ 1e-9: deterministic
            return jnp.full_like(x, -41.0 if name == "min_logvar" else -40.0)
        return x

    return model.replace(params=jax.tree_util.tree_map_with_path(put, model.params))


@pytest.mark.slow
def test_each_tape_keeps_its_member_and_stops_at_termination_or_the_horizon():
    means = np.array([[0.1, 0.0, 1.0], [0.5, 0.0, 2.0], [0.9, 0.0, 3.0]], np.float32)
    model = constant_world(means)
    h = im.histories(*dataset(), max_horizon=30)
    done_fn = lambda s: s[:, 0] > 4.0  # noqa: E731
    run = jax.jit(
        lambda key: im.imagine(
            model,
            h,
            lambda c, x, s, k: (jnp.zeros((x.shape[0], ACT)), c),
            jnp.zeros(30),
            key,
            batch=30,
            max_horizon=30,
            threshold=jnp.inf,
            done_fn=done_fn,
        )
    )
    tape, stats = run(jax.random.key(3))
    tape, stats = jax.tree.map(np.asarray, (tape, stats))
    traj, t0 = (np.asarray(a) for a in im.sample_prefixes(h, jax.random.split(jax.random.key(3), 3)[0], 30))
    np.testing.assert_array_equal(tape.prefix, t0)
    lengths = np.asarray(h.length)
    for b in range(30):
        m, L, p = b % 3, lengths[traj[b]], t0[b]
        assert tape.member[b] == m
        assert tape.real[b, :p].all() and not tape.real[b, p:].any()
        if p == L:  # a whole trajectory: nothing imagined
            assert tape.length[b] == L and stats["horizon"][b] == 0
            continue
        # by hand: s0 += means[m, 0] each step until s0 > 4 (terminated) or the tape holds 30 steps
        s, n, terminated = tape.obs[b, p, 0], 0, False
        while p + n < 30:
            s, n = s + means[m, 0], n + 1
            if s > 4.0:
                terminated = True
                break
        assert tape.length[b] == p + n and stats["horizon"][b] == n, (b, tape.length[b], p, n)
        steps = slice(p, p + n)
        np.testing.assert_allclose(np.diff(tape.obs[b, p : p + n + 1, 0]), means[m, 0], atol=1e-4)
        np.testing.assert_allclose(tape.reward[b, steps], means[m, 2], atol=1e-4)
        assert tape.valid[b, : p + n].all() and not tape.valid[b, p + n :].any()
        assert tape.terminated[b, p + n - 1] == terminated and tape.truncated[b, p + n - 1] == (not terminated)
        assert not tape.terminated[b, p : p + n - 1].any() and not tape.truncated[b, p : p + n - 1].any()
        assert stats["ended_terminated"][b] == terminated and stats["ended_horizon"][b] == (not terminated)
    assert stats["ended_terminated"].any() and stats["ended_horizon"].any()  # both endings happened


@pytest.mark.slow
def test_truncation_at_the_first_step_whose_uncertainty_exceeds_the_threshold():
    cfg = dyn.neubay_config(members=4, elites=4, width=16, depth=2)
    model = dyn.init_model(jax.random.key(1), OBS, ACT, cfg)  # untrained members disagree, more so far out
    h = im.histories(*dataset(), max_horizon=60)
    policy = lambda c, x, s, k: (jnp.tanh(x[:, -1, :1] + 0.5), c)  # noqa: E731  (deterministic)
    run = jax.jit(
        lambda threshold: im.imagine(
            model,
            h,
            policy,
            jnp.zeros(40),
            jax.random.key(0),
            batch=40,
            max_horizon=60,
            threshold=threshold,
            done_fn=lambda s: jnp.zeros(len(s), bool),
        )
    )
    free, _ = run(jnp.inf)  # no cut: the uncertainties along full-length tapes
    imagined = np.asarray(free.valid & ~free.real)
    threshold = float(np.quantile(np.asarray(free.uncertainty)[imagined], 0.95))
    tape, stats = run(threshold)
    tape, stats = jax.tree.map(np.asarray, (tape, stats))
    cut = 0
    for b in range(40):
        p, end = tape.prefix[b], tape.length[b]
        if end == p:
            continue
        s, a = tape.obs[b, p:end], tape.action[b, p:end]
        unc = np.asarray(dyn.epistemic_uncertainty(model, s, a))
        np.testing.assert_allclose(tape.uncertainty[b, p:end], unc, rtol=1e-4, atol=1e-6)
        assert (unc[:-1] <= threshold).all()  # every earlier step was within the threshold
        if end < 60:
            assert unc[-1] > threshold and tape.truncated[b, end - 1] and stats["ended_uncertainty"][b]
            cut += 1
        else:
            assert tape.truncated[b, end - 1] and (unc[-1] > threshold) == stats["ended_uncertainty"][b]
    assert cut > 0  # the threshold did cut some tapes short
    assert (stats["horizon"] > 1).any()  # and let some run on


@pytest.mark.slow
def test_warm_up_and_stepping_equal_one_pass_of_the_recurrence_over_the_tape():
    """The actions of the imagined steps are what the recurrent actor gives on the whole history at once."""
    net, params = build_recurrent("actor", OBS + ACT + 1, RecurrentSpec(d_model=8, d_hidden=4), jax.random.key(2))

    def actor(carry, x, start, key):
        y, carry = net(params, x, carry, start)
        return jnp.tanh(y[:, -1, :ACT]), carry

    means = np.array([[0.05, 0.0, 1.0], [0.1, 0.0, 2.0], [0.15, 0.0, 3.0]], np.float32)
    model = constant_world(means)
    h = im.histories(*dataset(), max_horizon=25)
    tape, stats = jax.jit(
        lambda key: im.imagine(
            model,
            h,
            actor,
            net.initial_state((12,)),
            key,
            batch=12,
            max_horizon=25,
            threshold=jnp.inf,
            done_fn=lambda s: s[:, 0] > 100.0,
        )
    )(jax.random.key(4))
    x = im.agent_inputs(tape.obs, tape.action, tape.reward)  # (B, H + 1, I)
    start = jnp.zeros(x.shape[:2], bool).at[:, 0].set(True)
    y, _ = net(params, x, net.initial_state((12,)), start)
    expected = np.asarray(jnp.tanh(y[..., :ACT]))[:, :-1]  # the action at step t from inputs 0 .. t
    tape = jax.tree.map(np.asarray, tape)
    assert (np.asarray(stats["horizon"]) > 0).sum() >= 6
    for b in range(12):
        steps = slice(tape.prefix[b], tape.length[b])
        np.testing.assert_allclose(tape.action[b, steps], expected[b, steps], rtol=1e-4, atol=1e-5)
    # the padded warm-up window gives the prefix's own final state, whatever the padding length
    inputs = jax.random.normal(jax.random.key(5), (3, 10, OBS + ACT + 1))
    t0 = jnp.array([0, 4, 9])
    padded, starts = im._left_padded(inputs, t0)
    _, warm = net(params, padded, net.initial_state((3,)), starts)
    for b, p in enumerate([0, 4, 9]):
        prefix = inputs[b : b + 1, : p + 1]
        _, direct = net(params, prefix, net.initial_state((1,)), jnp.zeros((1, p + 1), bool).at[:, 0].set(True))
        np.testing.assert_allclose(np.asarray(warm[b]), np.asarray(direct[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tapes_keep_the_model_reward_and_each_step_uncertainty():
    """The tape's reward is the model's (a reward penalty is the learner's: agents/neubay.py), and
    each imagined step records its epistemic uncertainty; real steps record none."""
    means = np.array([[0.1, 0.0, 1.0], [0.2, 0.0, 2.0]], np.float32)
    model = constant_world(means, members=2)
    h = im.histories(*dataset(), max_horizon=10)
    zero = lambda c, x, s, k: (jnp.zeros((x.shape[0], ACT)), c)  # noqa: E731
    tape, _ = im.imagine(
        model,
        h,
        zero,
        jnp.zeros(8),
        jax.random.key(0),
        batch=8,
        max_horizon=10,
        threshold=jnp.inf,
        done_fn=lambda s: jnp.zeros(len(s), bool),
    )
    imagined = np.asarray(tape.valid & ~tape.real)
    assert imagined.any()
    unc = np.sqrt(means.var(0).mean())  # constant members: the same uncertainty everywhere
    np.testing.assert_allclose(np.asarray(tape.uncertainty)[imagined], unc, rtol=1e-5)
    assert (np.asarray(tape.uncertainty)[~imagined] == 0).all()
    member_reward = means[np.asarray(tape.member), 2][:, None].repeat(10, 1)
    np.testing.assert_allclose(np.asarray(tape.reward)[imagined], member_reward[imagined], atol=1e-4)
