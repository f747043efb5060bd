"""NeuBay's learner (agents/neubay.py): losses against hand cases, a learning step, acting."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents import dynamics as dyn
from agents import imagination as im
from agents import neubay

OBS, ACT = 3, 2
SMALL = neubay.NeuBayConfig(critics=4, sampled_critics=2, head_width=16, d_model=16, d_hidden=8, lru_layers=1,
                            encoder_lr=1e-3, head_lr=1e-3, updates=1000, tape_len=32)
# the one other config the tests compile: all weight on real data, alpha fixed (as for hopper)
REAL_FIXED = neubay.NeuBayConfig(**{**SMALL.__dict__, "real_weight": 1.0, "fixed_alpha": True})
STEP = jax.jit(neubay.update)


def test_real_imagined_weighting_hand_case():
    loss = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 1]], bool)
    real = jnp.array([[1, 1, 0, 0], [0, 0, 0, 1]], bool)
    # real & mask: 1, 2, 8 -> 11/3; imagined & mask: 3, 5, 6 -> 14/3
    total, (r, i) = neubay.real_imagined_mean(loss, mask, real, 0.8)
    assert float(r) == pytest.approx(11 / 3) and float(i) == pytest.approx(14 / 3)
    assert float(total) == pytest.approx(0.8 * 11 / 3 + 0.2 * 14 / 3)
    only_imagined, (r, _) = neubay.real_imagined_mean(loss, mask, jnp.zeros_like(real), 0.3)
    assert float(r) == 0.0 and float(only_imagined) == pytest.approx(0.7 * 25 / 6)  # all six masked steps


def test_redq_target_hand_case():
    next_qs = jnp.array([[1.0, 5.0], [3.0, 2.0], [0.5, 9.0], [4.0, 4.0]])  # 4 heads x 2 transitions
    heads = jnp.array([1, 3])  # drawn: min(3, 4) = 3 and min(2, 4) = 2; head 2's 0.5 is not drawn
    y = neubay.redq_target(next_qs, heads, reward=jnp.array([1.0, -1.0]), terminated=jnp.array([False, True]),
                           next_log_prob=jnp.array([-2.0, 0.7]), alpha=0.5, gamma=0.9)
    np.testing.assert_allclose(np.asarray(y), [1.0 + 0.9 * (3.0 + 0.5 * 2.0), -1.0], rtol=1e-6)


def test_huber():
    np.testing.assert_allclose(np.asarray(neubay.huber(jnp.array([-3.0, -0.5, 0.0, 0.9, 2.0]))),
                               [2.5, 0.125, 0.0, 0.405, 1.5], rtol=1e-6)


def test_task_settings_and_their_overrides():
    cfg = neubay.task_config(neubay.NeuBayConfig(), "hopper", "medium-replay")
    assert (cfg.encoder_lr, cfg.real_weight, cfg.fixed_alpha) == (3e-7, 0.5, True)
    cfg = neubay.task_config(neubay.NeuBayConfig(), "HalfCheetah-v5", "medium-replay", real_weight=0.3)
    assert (cfg.encoder_lr, cfg.real_weight, cfg.fixed_alpha) == (1e-5, 0.3, False)
    assert neubay.task_config(neubay.NeuBayConfig(), "ant", "medium") == neubay.NeuBayConfig()
    with pytest.raises(ValueError, match="sampled-critics"):
        neubay.NeuBayConfig(critics=2, sampled_critics=3)


@pytest.fixture(scope="module")
def tape():
    return toy_tapes(jax.random.key(0))


def toy_tapes(key, batch=4, horizon=12):
    """Imagined tapes from a small random posterior and an untrained actor."""
    rng = np.random.default_rng(0)
    n = 60
    obs = rng.normal(size=(n, OBS)).astype(np.float32)
    actions = rng.uniform(-1, 1, (n, ACT)).astype(np.float32)
    rewards = obs[:, 0] + actions[:, 0]
    terminals, timeouts = np.zeros(n, bool), np.zeros(n, bool)
    timeouts[[19, 39, 59]] = True
    hist = im.histories(obs, actions, rewards, obs + 0.1 * actions[:, :1], terminals, timeouts, horizon)
    model = dyn.init_model(jax.random.key(1), OBS, ACT, dyn.neubay_config(members=3, elites=3, width=8, depth=1))
    state = neubay.init(jax.random.key(2), OBS, ACT, SMALL)
    tape, _ = im.imagine(model, hist, neubay.rollout_policy(state), neubay.initial_memory(state, batch), key,
                         batch=batch, max_horizon=horizon, threshold=jnp.inf,
                         done_fn=lambda s: jnp.zeros(len(s), bool))
    return tape


def test_tape_batches_mask_padding_and_the_dummy_last_transition(tape):
    batch = neubay.tape_batch(tape)
    assert batch.inputs.shape == (4, 13, OBS + ACT + 1)
    mask = np.asarray(neubay.transition_mask(batch))
    length = np.asarray(tape.length)
    for b in range(4):
        assert mask[b, :length[b]].all() and not mask[b, length[b]:].any()
    np.testing.assert_array_equal(np.asarray(batch.real[:, :-1]), np.asarray(tape.real))


def run(state, batch, n, key):
    losses = []
    for k in jax.random.split(key, n):
        state, m = STEP(state, batch, k)
        losses.append(float(m["losses/critic"]))
    return state, losses, m


@pytest.mark.slow
def test_updates_fit_a_fixed_tape_and_the_same_seed_repeats(tape):
    batch = neubay.tape_batch(tape)
    state = neubay.init(jax.random.key(3), OBS, ACT, SMALL)
    after, losses, m = run(state, batch, 40, jax.random.key(4))
    assert all(np.isfinite(v) for v in jax.tree.leaves(jax.tree.map(float, m)))
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert float(m["charts/alpha"]) != pytest.approx(SMALL.init_alpha)  # auto-alpha moved
    _, again, _ = run(state, batch, 10, jax.random.key(4))
    assert again == losses[:10]
    _, other, _ = run(state, batch, 5, jax.random.key(5))
    assert other != losses[:5]


@pytest.mark.slow
def test_the_real_weight_decides_which_data_the_critic_fits(tape):
    batch = neubay.tape_batch(tape)
    counted = np.asarray(neubay.transition_mask(batch))
    real = np.asarray(batch.real[:, :-1])
    assert (counted & real).any() and (counted & ~real).any()
    results = {}
    for cfg in (SMALL, REAL_FIXED):
        state, _, m = run(neubay.init(jax.random.key(3), OBS, ACT, cfg), batch, 40, jax.random.key(6))
        results[cfg.real_weight] = (float(m["losses/critic_real"]), float(m["losses/critic_imagined"]))
        if cfg.fixed_alpha:
            assert float(m["charts/alpha"]) == pytest.approx(cfg.init_alpha)
    assert results[1.0][0] < results[0.05][0]  # weight on real data: the real part fits better
    assert results[0.05][1] < results[1.0][1]  # and the other way round


def test_stepping_the_actor_equals_running_it_over_the_sequence():
    state = neubay.init(jax.random.key(7), OBS, ACT, SMALL)
    x = jax.random.normal(jax.random.key(8), (3, 9, OBS + ACT + 1))
    start = jnp.zeros((3, 9), bool).at[:, 0].set(True).at[1, 5].set(True)
    memory, stepped = neubay.initial_memory(state, 3), []
    act = jax.jit(neubay.act_step, static_argnames="explore")
    for t in range(9):
        a, memory = act(state, memory, x[:, t], start[:, t], None, explore=False)
        stepped.append(a)
    policy = jax.jit(neubay.rollout_policy(state, explore=False))
    for t in (4, 8):
        a, _ = policy(neubay.initial_memory(state, 3), x[:, :t + 1], start[:, :t + 1], jax.random.key(0))
        np.testing.assert_allclose(np.asarray(a), np.asarray(stepped[t]), rtol=1e-4, atol=1e-5)
