import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import sac
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.training.config import NetworkConfig


def test_td_target_hand_computed():
    # y = r + gamma * (1 - d) * (min_i Q'_i - alpha * log pi)
    r = jnp.array([1.0, 1.0, -2.0])
    d = jnp.array([False, True, False])
    next_q_min = jnp.array([3.0, 3.0, 10.0])
    next_lp = jnp.array([-1.0, -1.0, 2.0])
    y = sac.td_target(r, d, next_q_min, next_lp, alpha=0.5, gamma=0.99)
    np.testing.assert_allclose(y, [1 + 0.99 * 3.5, 1.0, -2 + 0.99 * 9.0], rtol=1e-6)


def _state(critics=3, eta=0.0, obs_dim=3, act_dim=2):
    cfg = sac.SACConfig(critics=critics, eta=eta)
    return sac.init(jax.random.key(0), obs_dim, act_dim, cfg, NetworkConfig(width=16))


def _batch(n=8, obs_dim=3, act_dim=2, seed=0):
    rng = np.random.default_rng(seed)
    return Transition(
        jnp.asarray(rng.normal(size=(n, obs_dim)), jnp.float32),
        jnp.asarray(rng.uniform(-1, 1, (n, act_dim)), jnp.float32),
        jnp.asarray(rng.normal(size=n), jnp.float32),
        jnp.asarray(rng.normal(size=(n, obs_dim)), jnp.float32),
        jnp.asarray(rng.random(n) < 0.3),
        jnp.asarray(rng.random(n) < 0.3),
    )


@pytest.mark.slow
def test_critic_loss_uses_min_over_all_target_critics_and_ignores_truncation():
    state = _state(critics=3)
    state = state.replace(target_critic_params=jax.tree.map(lambda x: x * 1.7, state.critic_params))
    batch = _batch()
    key = jax.random.key(5)
    loss, (q, td, _, next_q) = sac.critic_loss(state.critic_params, state, state.actor_params, batch, 0.3, key)
    # reference: same next actions (same key), min over the 3 target critics, mask by terminated only
    mean, log_std = state.actor(state.actor_params, batch.next_obs)
    a2, lp2 = sac.tanh_gaussian_sample(key, mean, log_std)
    q_next = np.asarray(state.critic(state.target_critic_params, batch.next_obs, a2))
    y = np.asarray(batch.reward) + 0.99 * (1 - np.asarray(batch.terminated)) * (q_next.min(0) - 0.3 * np.asarray(lp2))
    q_ref = np.asarray(state.critic(state.critic_params, batch.obs, batch.action))
    np.testing.assert_allclose(td, ((q_ref - y) ** 2).mean(axis=1).sum(), rtol=1e-5)
    np.testing.assert_allclose(next_q, q_next.min(0).mean(), rtol=1e-5)  # the logged target value
    # flipping `truncated` changes nothing; flipping `terminated` does
    flipped = batch._replace(truncated=~batch.truncated)
    assert float(sac.critic_loss(state.critic_params, state, state.actor_params, flipped, 0.3, key)[0]) == float(loss)
    flipped = batch._replace(terminated=~batch.terminated)
    assert float(sac.critic_loss(state.critic_params, state, state.actor_params, flipped, 0.3, key)[0]) != float(loss)


@pytest.mark.slow
def test_edac_diversity_against_per_member_gradients():
    state = _state(critics=4, eta=1.0)
    batch = _batch(n=5)
    got = sac.diversity_loss(state.critic, state.critic_params, batch.obs, batch.action)
    grads = []
    for i in range(4):
        p_i = jax.tree.map(lambda x: x[i], state.critic_params)
        member = lambda a: state.critic.apply(jax.tree.map(lambda x: x[None], p_i), batch.obs, a)[0][0].sum()  # noqa
        grads.append(np.asarray(jax.grad(member)(batch.action)))
    g = np.stack(grads, 1)  # (B, N, A)
    g = g / (np.linalg.norm(g, axis=-1, keepdims=True) + 1e-10)
    cos = np.einsum("bna,bma->bnm", g, g)
    ref = np.mean([(c.sum() - np.trace(c)) for c in cos]) / 3
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)
    assert -1.0 <= float(got) <= 3.0


@pytest.mark.slow
def test_update_changes_all_parts_and_temperature_moves_toward_target_entropy():
    state = _state(critics=2)
    batch = _batch(n=32)
    new, m = jax.jit(sac.update)(state, batch, jax.random.key(1))
    for field in ("actor_params", "critic_params", "target_critic_params"):
        before, after = jax.tree.leaves(getattr(state, field)), jax.tree.leaves(getattr(new, field))
        assert any(not np.allclose(a, b) for a, b in zip(before, after)), field
    # Polyak: target moved by exactly tau toward the new online params
    t = jax.tree.map(lambda o, tg: 0.005 * o + 0.995 * tg, new.critic_params, state.target_critic_params)
    for a, b in zip(jax.tree.leaves(t), jax.tree.leaves(new.target_critic_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # entropy above target (-|A| = -2) => alpha decreases
    assert float(m["charts/entropy"]) > -2 and float(new.log_alpha) < float(state.log_alpha)
    assert int(new.updates) == 1


def test_eta_needs_two_critics():
    with pytest.raises(ValueError, match="at least 2 critics"):
        sac.init(jax.random.key(0), 3, 2, sac.SACConfig(critics=1, eta=1.0))


@pytest.mark.slow
def test_ensemble_spread_metrics_are_zero_for_identical_critics_and_positive_otherwise():
    """values/q_std_policy and values/q_std_random: the critics' spread at policy / random actions."""
    state = _state(critics=3)
    batch = _batch()
    _, m = sac.update(state, batch, jax.random.key(1))
    assert float(m["values/q_std_policy"]) > 0 and float(m["values/q_std_random"]) > 0
    same = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), state.critic_params)
    state = state.replace(critic_params=same, target_critic_params=same, critic_opt=state.critic_opt)
    # identical members get identical gradients (same targets), so they stay identical after the update
    _, m = sac.update(state, batch, jax.random.key(1))
    assert float(m["values/q_std_policy"]) < 1e-5 and float(m["values/q_std_random"]) < 1e-5
