import csv
import sys
from pathlib import Path

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import gtr, ppo
from plasticity_zoo.envs import make_vector_env
from plasticity_zoo.networks import distributions
from plasticity_zoo.networks.distributions import gaussian_log_prob
from plasticity_zoo.training import checkpoint
from plasticity_zoo.training.config import NetworkConfig, RunConfig
from plasticity_zoo.training.loops.onpolicy import init_state, make_fns, train


def tiny(**kw):
    agent_kw = {k: kw.pop(k) for k in list(kw) if k in ppo.PPOConfig.__dataclass_fields__}
    agent = ppo.PPOConfig(**{"num_steps": 32, "num_minibatches": 4, "update_epochs": 2, **agent_kw})
    return RunConfig(
        **{
            "env": "Pendulum-v1",
            "total_steps": 256,
            "eval_every": 128,
            "eval_episodes": 1,
            "log_every": 64,
            "checkpoint_every": 64,
            "progress": False,
            "network": NetworkConfig(width=16),
            "agent_name": "ppo",
            "agent": agent,
            **kw,
        }
    )


# ----------------------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------------------
def gae_reference(r, v, term, trunc, final_v, last_v, gamma, lam):
    """Plain loop over one env: termination -> next value 0; truncation -> V(final obs), trace cut."""
    T = len(r)
    adv, a = np.zeros(T), 0.0
    for t in reversed(range(T)):
        if term[t]:
            nv = 0.0
        elif trunc[t]:
            nv = final_v[t]
        else:
            nv = v[t + 1] if t + 1 < T else last_v
        delta = r[t] + gamma * nv - v[t]
        a = delta + gamma * lam * (0.0 if (term[t] or trunc[t]) else 1.0) * a
        adv[t] = a
    return adv


def test_gae_hand_computed_truncation_bootstraps_from_final_obs_and_cuts_the_trace():
    g, lam = 0.9, 0.5
    r = jnp.array([[1.0], [2.0], [3.0]])
    v = jnp.array([[10.0], [20.0], [30.0]])
    trunc = jnp.array([[False], [True], [False]])
    term = jnp.zeros((3, 1), bool)
    final_v = jnp.array([[0.0], [100.0], [0.0]])
    adv, ret = ppo.gae(r, v, term, trunc, final_v, jnp.array([40.0]), g, lam)
    d2 = 3 + g * 40 - 30  # last step bootstraps from last_value
    d1 = 2 + g * 100 - 20  # truncated: V(final obs) = 100, not V(reset obs) = 30
    d0 = 1 + g * 20 - 10
    expected = [d0 + g * lam * d1, d1, d2]  # the trace stops at the truncation (d2 does not flow into d1)
    np.testing.assert_allclose(adv[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(ret[:, 0], np.array(expected) + [10, 20, 30], rtol=1e-6)
    # the same step terminated instead: next value 0
    adv_t, _ = ppo.gae(r, v, trunc, term, final_v, jnp.array([40.0]), g, lam)
    assert float(adv_t[1, 0]) == pytest.approx(2 - 20)


def test_gae_matches_numpy_reference_with_terminations_and_truncations():
    rng = np.random.default_rng(0)
    T, E = 50, 3
    r = rng.normal(size=(T, E)).astype(np.float32)
    v = rng.normal(size=(T, E)).astype(np.float32)
    term = rng.random((T, E)) < 0.1
    trunc = (rng.random((T, E)) < 0.1) & ~term
    term[7, 0] = trunc[7, 0] = True  # both: termination wins
    final_v = np.where(trunc, rng.normal(size=(T, E)), 0.0).astype(np.float32)
    last_v = rng.normal(size=E).astype(np.float32)
    adv, ret = ppo.gae(
        jnp.asarray(r),
        jnp.asarray(v),
        jnp.asarray(term),
        jnp.asarray(trunc),
        jnp.asarray(final_v),
        jnp.asarray(last_v),
        0.99,
        0.95,
    )
    for e in range(E):
        ref = gae_reference(r[:, e], v[:, e], term[:, e], trunc[:, e], final_v[:, e], last_v[e], 0.99, 0.95)
        np.testing.assert_allclose(adv[:, e], ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ret, np.asarray(adv) + v, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Surrogate, value clipping
# ----------------------------------------------------------------------------------------------
def test_clipped_surrogate_hand_computed():
    ratio = jnp.array([0.5, 1.0, 1.5, 1.5])
    adv = jnp.array([1.0, -1.0, 1.0, -1.0])
    # per sample max(-A r, -A clip(r)): -0.5, 1, -1.2, 1.5
    assert float(ppo.policy_surrogate(ratio, adv, 0.2)) == pytest.approx(0.2)
    assert float(ppo.policy_surrogate(ratio, adv, 0.2, clip=False)) == pytest.approx(0.125)


def test_value_clipping_hand_computed():
    new, old, ret = jnp.array([1.0, 3.0]), jnp.array([0.9, 1.0]), jnp.array([2.0, 3.0])
    # sample 1: unclipped 0, clipped (1.2 - 3)^2 = 3.24 -> the pessimistic max keeps 3.24
    assert float(ppo.value_loss(new, old, ret, 0.2)) == pytest.approx(0.5 * (1.0 + 3.24) / 2)
    assert float(ppo.value_loss(new, old, ret, 0.2, clip_vloss=False)) == pytest.approx(0.25)


# ----------------------------------------------------------------------------------------------
# GTR
# ----------------------------------------------------------------------------------------------
def test_gaussian_kl_closed_form_matches_monte_carlo():
    mp, lp = jnp.array([0.3, -0.2]), jnp.array([-0.5, 0.1])
    mq, lq = jnp.array([0.0, 0.4]), jnp.array([0.2, -0.3])
    x = mp + jnp.exp(lp) * jax.random.normal(jax.random.key(0), (400_000, 2))
    mc = (ppo.gaussian_log_prob(x, mp, lp) - ppo.gaussian_log_prob(x, mq, lq)).mean()
    assert float(distributions.gaussian_kl(mp, lp, mq, lq)) == pytest.approx(float(mc), abs=3e-3)
    assert float(distributions.gaussian_kl(mp, lp, mp, lp)) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("mode", ["recency", "uniform", "ema"])
def test_anchor_weights_sum_to_one_and_skip_unfilled_slots(mode):
    for count in range(0, 5):
        w = np.asarray(gtr.anchor_weights(jnp.int32(count), 4, mode, 0.5))
        assert w.sum() == pytest.approx(1.0) and np.all(w >= 0)
        assert np.all(w[max(count, 1) :] == 0)
    w = np.asarray(gtr.anchor_weights(jnp.int32(4), 4, mode, 0.5))
    expected = {"recency": np.array([8, 4, 2, 1]) / 15, "uniform": np.full(4, 0.25), "ema": np.array([1, 0, 0, 0])}
    np.testing.assert_allclose(w, expected[mode], rtol=1e-6)


def test_gtr_penalty_bounded_local_kl_and_redescending_force():
    beta, s2 = 0.3, 0.01
    w = gtr.anchor_weights(jnp.int32(3), 3, "recency", 0.8)
    d = jnp.asarray(np.random.default_rng(0).uniform(0, 1e3, (1000, 3)), jnp.float32)
    p, k = gtr.gtr_penalty(d, w, beta, s2)
    assert float(p.min()) >= 0 and float(p.max()) <= beta + 1e-7 and float(k.max()) <= 1 + 1e-7
    assert float(gtr.gtr_penalty(jnp.full((1, 3), 1e6), w, beta, s2)[0][0]) == pytest.approx(beta)
    # near the anchors: a KL penalty with coefficient beta / (2 sigma^2)
    small = jnp.full((1, 3), 1e-4)
    assert float(gtr.gtr_penalty(small, w, beta, s2)[0][0]) == pytest.approx(beta * 1e-4 / (2 * s2), rel=1e-2)

    # one anchor, the policy mean shifted by x: D = KL(anchor || current) = x^2 / 2 (unit std)
    def penalty(x):
        kl = distributions.gaussian_kl(jnp.zeros(1), jnp.zeros(1), jnp.array([x]), jnp.zeros(1))
        return gtr.gtr_penalty(kl[None, None], jnp.ones(1), beta, s2)[0][0]

    force = lambda x: abs(float(jax.grad(penalty)(x)))  # noqa: E731
    xs = [0.01, 0.05, 0.1, 0.2, 0.5, 1.0]
    f = [force(x) for x in xs]
    assert f[0] == pytest.approx(beta / (2 * s2) * 0.01, rel=1e-2)  # = grad of the KL penalty
    peak = int(np.argmax(f))
    assert 0 < peak < len(xs) - 1  # rises, peaks near sigma (x ~ 0.14), then decays
    assert f[-1] < 1e-6 * max(f)  # far from the anchor the penalty no longer resists


def _rollout(T=16, E=2, obs_dim=3, act_dim=2, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    term = jnp.asarray(rng.random((T, E)) < 0.1)
    return ppo.Rollout(
        f(T + 1, E, obs_dim),
        f(T + 1, E, act_dim),
        f(T + 1, E) - 3.0,
        f(T + 1, E),
        f(T, E),
        term,
        jnp.asarray(rng.random((T, E)) < 0.1) & ~term,
        f(T, E),
    )


def _update(cfg, n=2):
    state = ppo.init(jax.random.key(0), 3, 2, cfg, NetworkConfig(width=16))
    state = state.replace(num_iterations=jnp.int32(10))
    fn = jax.jit(ppo.update)
    metrics = None
    for i in range(n):
        state, metrics = fn(state, _rollout(seed=i), jax.random.key(i))
    return state, metrics


@pytest.mark.slow
def test_gtr_with_zero_beta_is_plain_ppo_and_target_kl_stops_early():
    base = dict(num_steps=16, num_minibatches=4, update_epochs=3, target_kl=1e-9)
    ppo_state, m_ppo = _update(ppo.PPOConfig(**base))
    gtr0, m0 = _update(ppo.PPOConfig(**base, trust_region="gtr", gtr_beta=0.0))
    for a, b in zip(jax.tree.leaves(ppo_state.actor_params), jax.tree.leaves(gtr0.actor_params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(m0["gtr/penalty"]) == 0.0
    assert float(m_ppo["charts/epochs_run"]) == 1.0  # the first epoch's approx_kl exceeds 1e-9: stop
    # the anchors rotate: slot 0 = the last rollout policy, slot 1 = the first (the init params)
    assert int(gtr0.anchor_count) == 2
    init = ppo.init(jax.random.key(0), 3, 2, ppo.PPOConfig(**base, trust_region="gtr"), NetworkConfig(width=16))
    for a, b in zip(jax.tree.leaves(gtr0.anchors), jax.tree.leaves(init.actor_params)):
        np.testing.assert_array_equal(a[1], b)
    assert np.isfinite(float(m0["gtr/kl_anchor1"])) and np.isnan(float(m0["gtr/kl_anchor2"]))
    assert float(m0["gtr/kl_anchor1"]) > float(m0["gtr/kl_anchor0"]) > 0  # the older anchor is further away
    for name in (
        "diag/update_cosine",
        "diag/directional_efficiency",
        "charts/approx_kl",
        "charts/clipfrac",
        "charts/explained_variance",
    ):
        assert np.isfinite(float(m0[name])), name
    assert 0 < float(m0["diag/directional_efficiency"]) <= 1 + 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("form", ["kl", "logratio"])
def test_actor_loss_adds_the_gtr_penalty_of_either_form(form):
    cfg = ppo.PPOConfig(
        trust_region="gtr", gtr_form=form, gtr_beta=0.5, gtr_sigma2=0.02, gtr_logratio_sigma=0.3, clip=False
    )
    state = ppo.init(jax.random.key(0), 3, 2, cfg, NetworkConfig(width=16))
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    B, M = 8, 3
    mb = ppo.Minibatch(
        f(B, 3),
        f(B, 2),
        f(B) - 3,
        f(B),
        f(B),
        f(B),
        anchor_mean=0.1 * f(B, M, 2),
        anchor_log_std=0.1 * f(B, M, 2),
        anchor_logp=f(B, M) - 3,
    )
    w = gtr.anchor_weights(jnp.int32(M), M, "recency", 0.8)
    loss, aux = ppo.actor_loss(state.actor_params, state, mb, w)
    plain, _ = ppo.actor_loss(state.actor_params, state.replace(cfg=ppo.PPOConfig(clip=False)), mb)
    mean, log_std = (np.asarray(x) for x in state.actor(state.actor_params, mb.obs))
    if form == "kl":  # KL(anchor || current), closed form, summed over action dims
        am, al = np.asarray(mb.anchor_mean), np.asarray(mb.anchor_log_std)
        d = np.sum(
            log_std[:, None]
            - al
            + (np.exp(2 * al) + (am - mean[:, None]) ** 2) / (2 * np.exp(2 * log_std[:, None]))
            - 0.5,
            axis=-1,
        )
        width2 = 0.02
    else:  # squared log-ratio against each anchor
        logp = np.asarray(ppo.gaussian_log_prob(mb.actions, mean, log_std))
        d = (logp[:, None] - np.asarray(mb.anchor_logp)) ** 2
        width2 = 0.3**2
    penalty = 0.5 * (1 - (np.asarray(w) * np.exp(-d / (2 * width2))).sum(-1))
    assert float(aux["gtr/penalty"]) == pytest.approx(penalty.mean(), rel=1e-5)
    assert float(loss) == pytest.approx(float(plain) + penalty.mean(), rel=1e-5)
    assert 0 < float(aux["gtr/penalty"]) < 0.5


def test_advantages_are_normalised_per_minibatch_inside_the_actor_loss():
    """CleanRL's norm_adv: each minibatch's advantages are standardised (ddof 1) in the loss, so the loss
    of a minibatch does not change when its advantages become 5 A + 7; normalising once over the whole
    rollout instead would not give that.  Checked against a numpy reference of the clipped surrogate."""
    state = ppo.init(jax.random.key(0), 3, 2, ppo.PPOConfig(), NetworkConfig(width=16))
    rng = np.random.default_rng(2)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    B = 16
    mb = ppo.Minibatch(f(B, 3), f(B, 2), f(B) - 3, f(B), f(B), f(B))
    loss, aux = ppo.actor_loss(state.actor_params, state, mb)
    shifted, _ = ppo.actor_loss(state.actor_params, state, mb._replace(advantages=5 * mb.advantages + 7))
    assert float(shifted) == pytest.approx(float(loss), rel=1e-5)
    mean, log_std = state.actor(state.actor_params, mb.obs)
    ratio = np.exp(np.asarray(ppo.gaussian_log_prob(mb.actions, mean, log_std)) - np.asarray(mb.logp))
    a = np.asarray(mb.advantages, np.float64)
    a = (a - a.mean()) / (a.std(ddof=1) + 1e-8)
    eps = state.cfg.clip_coef
    pg = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - eps, 1 + eps)).mean()
    assert float(aux["losses/policy"]) == pytest.approx(pg, rel=1e-4)
    raw = state.replace(cfg=ppo.PPOConfig(norm_adv=False))  # the check can fail: without it the loss moves
    assert float(
        ppo.actor_loss(state.actor_params, raw, mb._replace(advantages=5 * mb.advantages + 7))[0]
    ) != pytest.approx(float(ppo.actor_loss(state.actor_params, raw, mb)[0]), rel=1e-3)


def test_directional_efficiency_of_a_straight_and_a_zigzag_path():
    cfg = ppo.PPOConfig(diag_window=4)
    state = ppo.init(jax.random.key(0), 3, 2, cfg, NetworkConfig(width=16))
    p0 = state.actor_params
    shift = lambda c: jax.tree.map(lambda x: x + c, p0)  # noqa: E731
    s = state
    for i in range(1, 4):
        s, m = ppo._diagnostics(s, shift(0.1 * i))
    assert float(m["diag/directional_efficiency"]) == pytest.approx(1.0, rel=1e-4)
    assert float(m["diag/update_cosine"]) == pytest.approx(1.0, rel=1e-4)
    s = state
    for c in (0.1, 0.0, 0.1, 0.0):
        s, m = ppo._diagnostics(s, shift(c))
    assert float(m["diag/update_cosine"]) == pytest.approx(-1.0, rel=1e-4)
    assert float(m["diag/directional_efficiency"]) == pytest.approx(0.0, abs=1e-4)


# ----------------------------------------------------------------------------------------------
# Normalisation and the loop
# ----------------------------------------------------------------------------------------------
def test_running_statistics_and_reward_scaling():
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, (300, 4)).astype(np.float32)
    rms = ppo.rms_init((4,))
    for chunk in np.split(data, 6):
        rms = ppo.rms_update(rms, jnp.asarray(chunk))
    np.testing.assert_allclose(rms.mean, data.mean(0), rtol=1e-4)
    np.testing.assert_allclose(rms.var, data.var(0), rtol=1e-3)
    state = ppo.init(jax.random.key(0), 3, 2, ppo.PPOConfig(gamma=0.5), NetworkConfig(width=16))
    g = jnp.zeros(2)
    for r, term in ((1.0, False), (1.0, True), (2.0, False)):
        state, g, scaled = ppo.scale_reward(state, g, jnp.full(2, r), jnp.full(2, term))
    np.testing.assert_allclose(g, [2.5, 2.5])  # G = 1 -> (terminated) 0 + 1 -> 0.5 * 1 + 2
    np.testing.assert_allclose(scaled, 2.0 / np.sqrt(np.asarray(state.ret_rms.var) + 1e-8), rtol=1e-5)


@pytest.mark.slow
def test_loop_step_writes_terminations_truncations_and_final_values():
    """The loop's per-step call at the resume test's shapes (2 seeds x 2 envs, Pendulum-sized)."""
    cfg = tiny(seeds=2, num_envs=2)
    state, loop, key = init_state(ppo, cfg, 3, 1)
    start, step = make_fns(ppo, 32)[:2]
    rng = np.random.default_rng(0)
    obs = lambda: jnp.asarray(rng.normal(size=(2, 2, 3)), jnp.float32)  # noqa: E731
    state, loop, _ = start(state, loop, obs(), key)
    term = np.zeros((3, 2, 2), bool)
    trunc = np.zeros((3, 2, 2), bool)
    term[1, 0, 0] = True  # seed 0 env 0 terminates at t = 1
    trunc[2, 1, 1] = True  # seed 1 env 1 is truncated at t = 2
    term[2, 1, 0] = trunc[2, 1, 0] = True  # both at once: a termination
    for t in range(3):
        next_obs, new_obs = obs(), obs()
        ff, fm = step.flatten(state, loop)
        fm, _ = step(
            ff, fm, np.int32(t), np.ones((2, 2), np.float32), term[t], trunc[t], next_obs, new_obs, jax.random.key(t)
        )
        state, loop = step.unflatten(fm)
        s1 = jax.tree.map(lambda x: x[1], state)
        if t == 2:
            final = float(ppo.value(s1, ppo.normalize_obs(s1, next_obs[1]))[1])
            np.testing.assert_allclose(loop.buffer.obs[1, 3], ppo.normalize_obs(s1, new_obs[1]), rtol=1e-6)
    b = jax.tree.map(lambda x: np.asarray(x), loop.buffer)
    np.testing.assert_array_equal(b.terminated[:, :3], term.transpose(1, 0, 2))
    np.testing.assert_array_equal(b.truncated[:, :3], trunc.transpose(1, 0, 2))
    assert b.final_values[1, 2, 1] == pytest.approx(final, rel=1e-5)  # V(true final obs) where truncated
    assert np.count_nonzero(b.final_values) == 1  # 0 elsewhere (terminated: unused)
    assert float(state.obs_rms.count[0]) == pytest.approx(8, abs=1e-3)  # start + 3 steps, 2 envs each
    assert np.all(b.rewards[:, :3] > 0)


class ActionRecorder(gym.Env):
    """Bounds [-0.4, 0.4] x [-2, 3] (Humanoid-like +-0.4 in the first dim); records every action it receives."""

    received: list = []
    low = np.array([-0.4, -2.0], np.float32)
    high = np.array([0.4, 3.0], np.float32)

    def __init__(self):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = gym.spaces.Box(self.low, self.high, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.normal(size=3).astype(np.float32), {}

    def step(self, action):
        ActionRecorder.received.append(np.array(action, copy=True))
        return self.np_random.normal(size=3).astype(np.float32), 0.0, False, False, {}


if "ActionRecorder-v0" not in gym.registry:
    gym.register("ActionRecorder-v0", entry_point=ActionRecorder, max_episode_steps=50)


@pytest.mark.parametrize("mode", ["clip", "rescale"])
def test_action_modes_send_the_documented_map_of_the_agent_action(mode):
    ActionRecorder.received.clear()
    env = make_vector_env("ActionRecorder-v0", 1, 0, action_mode=mode)
    env.reset()
    agent_actions = np.array([[0.5, -5.0], [-0.3, 2.5], [-1.7, 0.9], [0.39, 3.2]], np.float32)
    for a in agent_actions:
        env.step(a[None])
    got = np.stack(ActionRecorder.received)
    if mode == "clip":  # CleanRL's ClipAction: the sample in env units, clipped to the bounds
        np.testing.assert_array_equal(got, np.clip(agent_actions, ActionRecorder.low, ActionRecorder.high))
    else:  # [-1, 1] onto [low, high], by hand: 0.5 -> 0.2 in [-0.4, 0.4]; -5 -> -1 -> -2; 0.9 -> 2.75 in [-2, 3]
        np.testing.assert_allclose(got, [[0.2, -2.0], [-0.12, 3.0], [-0.4, 2.75], [0.156, 3.0]], rtol=1e-6)
    assert got.dtype == np.float32


@pytest.mark.slow
def test_ppo_clip_mode_stores_the_unclipped_sample_and_its_log_prob_and_sends_the_clipped_one():
    """CleanRL: the env gets clip(sample, low, high); the rollout keeps the sample and log pi(sample)."""
    assert ppo.PPOConfig().action_mode == "clip"  # PPO's default follows CleanRL's protocol
    cfg = tiny(env="ActionRecorder-v0", seeds=1, num_envs=2)
    ActionRecorder.received.clear()
    env = make_vector_env(cfg.env, 2, 0, action_mode=cfg.agent.action_mode)
    state, loop, key = init_state(ppo, cfg, 3, 2)
    start, step = make_fns(ppo, 32)[:2]
    obs = env.reset()
    state, loop, action = start(state, loop, jnp.asarray(obs)[None], key)
    sent = []
    for t in range(6):
        sent.append(np.asarray(action)[0])
        new_obs, reward, term, trunc, next_obs = env.step(np.asarray(action)[0])
        ff, fm = step.flatten(state, loop)
        fm, action = step(
            ff,
            fm,
            np.int32(t),
            reward[None],
            term[None],
            trunc[None],
            jnp.asarray(next_obs)[None],
            jnp.asarray(new_obs)[None],
            key,
        )
        state, loop = step.unflatten(fm)
    sent = np.stack(sent)  # (T, E, 2) what the agent sampled
    stored = np.asarray(loop.buffer.actions[0, :6])
    np.testing.assert_array_equal(stored, sent)  # the rollout keeps the unclipped sample
    assert np.any(np.abs(stored[..., 0]) > 0.4)  # (std 1 at init: clipping happens)
    got = np.stack(ActionRecorder.received).reshape(6, 2, 2)
    np.testing.assert_array_equal(got, np.clip(stored, ActionRecorder.low, ActionRecorder.high))
    s0 = jax.tree.map(lambda x: x[0], state)
    mean, log_std = s0.actor(s0.actor_params, loop.buffer.obs[0, :6])
    logp = gaussian_log_prob(jnp.asarray(stored), mean, log_std)  # of the unclipped sample
    np.testing.assert_allclose(np.asarray(loop.buffer.logp[0, :6]), np.asarray(logp), rtol=1e-5, atol=1e-5)
    clipped = gaussian_log_prob(jnp.asarray(got), mean, log_std)
    assert not np.allclose(np.asarray(clipped), np.asarray(logp))  # (the clipped action's would differ)


@pytest.mark.slow
def test_the_on_policy_loop_builds_its_envs_with_the_agents_action_mode(monkeypatch, tmp_path):
    import plasticity_zoo.training.evaluation as evaluation
    import plasticity_zoo.training.loops.onpolicy as onpolicy

    modes = []
    real_vec, real_eval = onpolicy.make_vector_env, evaluation.Evaluator
    monkeypatch.setattr(
        onpolicy, "make_vector_env", lambda *a, **k: modes.append(("train", k["action_mode"])) or real_vec(*a, **k)
    )
    # the loop builds its evaluator with evaluation.run_evaluator (its sixth argument: the action mode)
    monkeypatch.setattr(evaluation, "Evaluator", lambda *a, **k: modes.append(("eval", a[5])) or real_eval(*a, **k))
    for mode in ("rescale", "clip"):
        train(tiny(total_steps=32, eval_every=32, action_mode=mode), ppo, tmp_path / mode)
    assert modes == [("train", "rescale"), ("eval", "rescale"), ("train", "clip"), ("eval", "clip")]


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_uninterrupted_with_normalizers(tmp_path, assert_same_logs):
    cfg = tiny(seeds=2, num_envs=2, total_steps=256, checkpoint_every=64)
    full = train(cfg, ppo, tmp_path / "full")
    part = train(cfg, ppo, tmp_path / "part", stop_at=100)  # stops at the iteration boundary 128
    assert part["step"] == 128
    saved, _, _ = checkpoint.load(checkpoint.latest(tmp_path / "part"), init_state(ppo, cfg, 3, 1))
    assert float(saved[0].obs_rms.count[0]) > 100  # the normaliser statistics are in the checkpoint
    np.testing.assert_array_equal(saved[0].obs_rms.mean, part["state"].obs_rms.mean)
    np.testing.assert_array_equal(saved[0].ret_rms.var, part["state"].ret_rms.var)
    resumed = train(cfg, ppo, tmp_path / "part", resume=True)
    assert resumed["step"] == 256
    for field in ("actor_params", "critic_params", "obs_rms", "ret_rms", "actor_opt"):
        for x, y in zip(
            jax.tree.leaves(getattr(full["state"], field)), jax.tree.leaves(getattr(resumed["state"], field))
        ):
            np.testing.assert_array_equal(x, y)
    assert_same_logs(tmp_path / "full", tmp_path / "part")
    # seeds differ
    a0, a1 = (jax.tree.map(lambda x: x[j], full["state"].actor_params) for j in (0, 1))
    assert all(not np.allclose(x, y) for x, y in zip(jax.tree.leaves(a0), jax.tree.leaves(a1)))


@pytest.mark.slow
def test_nonstationary_switch_resets_the_normalizers(tmp_path):
    # the same shapes and config as the resume test: the loop's compilations are reused
    cfg = tiny(
        env="ns:obs_permute:Pendulum-v1:every=96",
        seeds=2,
        num_envs=2,
        total_steps=256,
        eval_every=1000,
        checkpoint_every=1000,
    )
    out = train(cfg, ppo, tmp_path / "r")
    # the last switch is at step 192; the statistics since then hold the steps 192, 194, .., 256 (2 envs)
    assert float(out["state"].obs_rms.count[0]) == pytest.approx(66, abs=1e-3)
    rows = list(csv.DictReader(open(tmp_path / "r" / "metrics.csv")))
    assert [int(float(r["ns/phase"])) for r in rows if r["seed"] == "0"] == [0, 1, 2, 2]


def test_cli_flags_reach_the_ppo_config():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import train as train_script

    cfg = train_script.parse(
        [
            "ppo",
            "--env",
            "HalfCheetah-v5",
            "--trust-region",
            "gtr",
            "--no-clip",
            "--gtr-beta",
            "0.1",
            "--gtr-form",
            "logratio",
            "--backend",
            "envpool",
            "--num-envs",
            "4",
            "--seeds",
            "2",
            "--num-steps",
            "512",
        ]
    )
    a = cfg.agent
    assert (a.trust_region, a.clip, a.gtr_beta, a.gtr_form, a.backend, a.num_steps) == (
        "gtr",
        False,
        0.1,
        "logratio",
        "envpool",
        512,
    )
    assert (cfg.num_envs, cfg.seeds) == (4, 2)
    with pytest.raises(ValueError, match="divisible by --num-minibatches"):
        train(tiny(num_steps=30), ppo, "/tmp/never")


@pytest.mark.slow
def test_plastic_interface():
    state = ppo.init(jax.random.key(0), 3, 2, ppo.PPOConfig(), NetworkConfig(width=16))
    assert set(ppo.plastic_params(state)) == set(ppo.PLASTIC) == {"actor", "critic"}
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    mb = ppo.Minibatch(f(8, 3), f(8, 2), f(8) - 3, f(8), f(8), f(8))
    losses = ppo.plastic_losses(state, mb, jax.random.key(0))
    for name, fn in losses.items():
        g = jax.grad(fn)(ppo.plastic_params(state)[name])
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(g))


def test_orthogonal_init_as_cleanrl():
    state = ppo.init(jax.random.key(0), 3, 2, ppo.PPOConfig(), NetworkConfig(width=16))
    k0 = np.asarray(state.actor_params["trunk"]["layers"][1]["kernel"][...])
    np.testing.assert_allclose(k0.T @ k0, 2.0 * np.eye(16), atol=1e-4)  # orthogonal, gain sqrt 2
    head = np.asarray(state.actor_params["out"]["kernel"][...])
    np.testing.assert_allclose(np.linalg.svd(head, compute_uv=False), 0.01, rtol=1e-4)
    np.testing.assert_allclose(
        np.linalg.svd(np.asarray(state.critic_params["out"]["kernel"][...]), compute_uv=False), 1.0, rtol=1e-4
    )
    assert np.all(np.asarray(state.actor_params["log_std"][...]) == 0)


@pytest.mark.optimized
@pytest.mark.slow
def test_ppo_learns_inverted_pendulum(tmp_path):
    # 2 vmapped seeds x 4 envs; PPO balances the pendulum (~800-1000 of 1000) within 10k steps; random ~ 20
    cfg = RunConfig(
        env="InvertedPendulum-v5",
        seeds=2,
        num_envs=4,
        total_steps=10240,
        eval_every=10240,
        eval_episodes=2,
        log_every=2048,
        checkpoint_every=10240,
        progress=False,
        agent_name="ppo",
        agent=ppo.PPOConfig(num_steps=128, num_minibatches=16, learning_rate=1e-3),
    )
    train(cfg, ppo, tmp_path / "r")
    rows = list(csv.DictReader(open(tmp_path / "r" / "eval.csv")))
    start = [float(r["return_mean"]) for r in rows if r["step"] == "0"]
    end = [float(r["return_mean"]) for r in rows if r["step"] == "10240"]
    assert max(start) < 100
    assert min(end) > 500, f"PPO did not learn InvertedPendulum: eval returns {end}"
