"""Probabilistic dynamics ensemble (agents/dynamics/; RAVL's / MBPO's ensemble, Sims et al. 2024)."""

from dataclasses import replace

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import dynamics as dyn
from plasticity_zoo.agents.dynamics import ensemble
from plasticity_zoo.agents.dynamics import io as dynamics_io
from plasticity_zoo.envs import termination
from plasticity_zoo.networks.core import path_names

OBS, ACT = 3, 2
# Small but real: 4 members, 2 x 32 SiLU, per-layer weight decay, bootstrap, early-stopping rule active.
CFG = dyn.DynamicsConfig(
    members=4,
    elites=2,
    width=32,
    depth=2,
    weight_decay=(2.5e-5, 5e-5, 1e-4),
    batch_size=64,
    min_epochs=5,
    max_epochs=40,
)  # 40: the fit's reward error 0.03-0.055 over
# seeds 0-3 (25 epochs left it at 0.07-0.16, around test_fits_linear_system's 0.1)


def linear_system(n, seed=0, noise=0.01):
    """s' = s + A s + B a + noise, r = c . s."""
    rng = np.random.default_rng(seed)
    p = np.random.default_rng(123)
    a_mat, b_mat, c = 0.1 * p.normal(size=(OBS, OBS)), 0.5 * p.normal(size=(ACT, OBS)), p.normal(size=OBS)
    s = rng.normal(size=(n, OBS)).astype(np.float32)
    a = rng.uniform(-1, 1, (n, ACT)).astype(np.float32)
    s2 = (s + s @ a_mat + a @ b_mat + noise * rng.normal(size=(n, OBS))).astype(np.float32)
    return s, a, (s @ c).astype(np.float32), s2


@pytest.fixture(scope="module")
def data():
    return linear_system(1000)


@pytest.fixture(scope="module")
def trained(data):
    return dyn.train(jax.random.key(0), *data, CFG)


def named(params):
    return dynamics_io._named_leaves(params)


def edit(params, fn):
    """Map ``fn(name, array)`` over the param leaves (name like 'trunk/layers/0/kernel')."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn("/".join(map(str, path_names(p))), x), params)


# ----------------------------------------------------------------------------- fitting and elites


def test_fits_linear_system(data, trained):
    model, info = trained
    s, a, r, s2 = data
    target_var = np.concatenate([s2 - s, r[:, None]], 1).var(0).mean()
    assert info["val_mse"].min() < 0.05 * target_var, (info["val_mse"], target_var)
    assert info["val_mse"].max() < 0.2 * target_var
    assert info["train_loss"][-1] < info["train_loss"][0]  # the Gaussian NLL went down
    assert info["val_curve"].shape == (info["epochs"] + 1, CFG.members)
    assert info["train_loss_members"].shape == (info["epochs"], CFG.members)
    assert len(info["holdout_idx"]) == 200 and len(set(info["holdout_idx"]) & set(info["train_idx"])) == 0
    mean, logvar = dyn.predict(model, jnp.asarray(s[:7]), jnp.asarray(a[:7]))
    assert mean.shape == logvar.shape == (CFG.members, 7, OBS + 1)
    elite_mean = np.asarray(mean)[np.asarray(model.elites)]  # (E, 7, D): Δs, r of the elites
    np.testing.assert_allclose(elite_mean[..., :OBS] + s[:7], np.broadcast_to(s2[:7], (CFG.elites, 7, OBS)), atol=0.1)
    np.testing.assert_allclose(elite_mean[..., OBS], np.broadcast_to(r[:7], (CFG.elites, 7)), atol=0.1)
    next_obs, reward = dyn.step(model, jnp.asarray(s[:200]), jnp.asarray(a[:200]), jax.random.key(1))
    assert next_obs.shape == (200, OBS) and reward.shape == (200,)
    # samples: mean + learned std * noise; the learned std is small once fitted
    assert np.abs(np.asarray(next_obs) - s2[:200]).mean() < 0.1
    assert np.abs(np.asarray(reward) - r[:200]).mean() < 0.2
    assert float(jnp.exp(0.5 * logvar).mean()) < 0.2


def test_elites_are_lowest_val_mse_and_val_mse_is_of_kept_params(data, trained):
    model, info = trained
    s, a, r, s2 = data
    np.testing.assert_array_equal(info["elites"], np.argsort(info["val_mse"])[: CFG.elites])
    np.testing.assert_array_equal(np.asarray(model.elites), info["elites"])
    h = info["holdout_idx"]
    recomputed = dyn.validation_mse(model, s[h], a[h], r[h], s2[h])
    np.testing.assert_allclose(recomputed, info["val_mse"], rtol=1e-4)
    # the best weights are kept: the final val MSE is the minimum the rule recorded per member
    assert np.all(info["val_mse"] <= info["val_curve"].min(0) * (1 + CFG.improvement) + 1e-12)


def test_corrupted_members_are_not_elites(data, trained):
    model, info = trained
    s, a, r, s2 = data
    bad = info["elites"]  # corrupt the two best members: they must drop out
    bumped = edit(model.params, lambda n, x: x.at[bad].add(0.5) if n == "mean/bias" else x)
    h = info["holdout_idx"]
    val = dyn.validation_mse(model.replace(params=bumped), s[h], a[h], r[h], s2[h])
    new = dyn.with_elites(model.replace(params=bumped), val)
    assert not set(np.asarray(new.elites)) & set(bad)
    np.testing.assert_array_equal(np.asarray(new.elites), np.argsort(val)[: CFG.elites])


def test_same_key_same_model_different_key_different(data, trained):
    model, _ = trained
    again, _ = dyn.train(jax.random.key(0), *data, CFG)
    other, _ = dyn.train(jax.random.key(1), *data, CFG)
    for k, v in named(model.params).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(named(again.params)[k]))
    assert any(not np.allclose(v, named(other.params)[k]) for k, v in named(model.params).items())
    # members differ from each other (own init and own bootstrap)
    k0 = np.asarray(named(model.params)["trunk/layers/0/kernel"])
    assert not np.allclose(k0[0], k0[1])


def test_bad_inputs_are_refused(data):
    s, a, r, s2 = data
    with pytest.raises(ValueError, match="expected obs"):
        dyn.train(jax.random.key(0), s, a[:10], r, s2, CFG)
    with pytest.raises(ValueError, match="non-finite"):
        dyn.train(jax.random.key(0), s, a, np.full_like(r, np.nan), s2, CFG)
    with pytest.raises(ValueError, match="weight_decay"):  # distinct per-layer values must match the depth
        dyn.DynamicsConfig(depth=2, weight_decay=(1e-4, 2e-4))
    # the RAVL reference's default 4-layer values adapt to another depth: first hidden values, then the heads'
    assert dyn.DynamicsConfig(depth=2).weight_decay == (2.5e-5, 5e-5, 1e-4)
    assert dyn.DynamicsConfig(depth=5).weight_decay == (2.5e-5, 5e-5, 7.5e-5, 7.5e-5, 7.5e-5, 1e-4)
    with pytest.raises(ValueError, match="elite_sampling"):
        dyn.DynamicsConfig(elite_sampling="member")
    # configs round-trip through JSON (lists for tuples), and the Unifloral preset (its ``algorithms/dynamics.py``)
    assert dyn.DynamicsConfig(weight_decay=[2.5e-5, 5e-5, 7.5e-5, 7.5e-5, 1e-4]) == dyn.DynamicsConfig()
    u = dyn.unifloral_config()
    assert (u.activation, u.normalize_inputs, u.min_epochs, u.max_epochs, u.elite_sampling) == (
        "relu",
        False,
        400,
        400,
        "step",
    ) and u.adamw_weight_decay == 2.5e-5


# ----------------------------------------------------------------------------- loss and bounds


def test_soft_clamp_bounds_and_hand_values():
    lv = jnp.array([-1e4, -50.0, -10.0, -3.0, 0.0, 0.5, 3.0, 1e4])
    hi, lo = 0.5, -10.0
    out = np.asarray(dyn.soft_clamp(lv, hi, lo))
    sp = lambda z: np.logaddexp(0.0, z)  # noqa: E731
    x = np.asarray(lv, np.float64)
    hand = lo + sp((hi - sp(hi - x)) - lo)
    np.testing.assert_allclose(out, hand, rtol=1e-5, atol=1e-5)
    # within [lo, hi + log1p(exp(lo - hi))]: the second softplus can lift a value at hi by 2.7e-5
    assert np.all(out >= lo) and np.all(out <= hi + np.log1p(np.exp(lo - hi)) + 1e-6)
    assert np.all(np.diff(out) >= 0)  # monotone
    np.testing.assert_allclose(out[3], -3.0, atol=0.1)  # well inside: near identity


def test_gaussian_nll_hand_case():
    mean = jnp.array([[0.0, 1.0]])
    logvar = jnp.array([[0.0, np.log(2.0)]])
    target = jnp.array([[1.0, 3.0]])
    # (0 + 1 * 1 + log 2 + 4 / 2) / 2
    np.testing.assert_allclose(float(dyn.gaussian_nll(mean, logvar, target)), (1 + np.log(2) + 2) / 2, rtol=1e-6)


def test_ensemble_loss_matches_numpy():
    # CFG's network (cached) with larger weight decays and range coefficient, so every term shows
    cfg = replace(CFG, weight_decay=(0.1, 0.2, 0.3), logvar_range_coef=0.05)
    model = dyn.init_model(jax.random.key(3), OBS, ACT, cfg)
    rng = np.random.default_rng(0)
    params = edit(
        model.params,
        lambda n, x: (
            x + jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype) if n.endswith("logvar") or n.endswith("bias") else x
        ),
    )
    x = rng.normal(size=(CFG.members, 4, OBS + ACT)).astype(np.float32)
    y = rng.normal(size=(CFG.members, 4, OBS + 1)).astype(np.float32)
    loss = jax.jit(dyn.ensemble_loss, static_argnames=("net", "cfg"))
    total, nll = loss(params, model.net, jnp.asarray(x), jnp.asarray(y), cfg)

    p = {k: np.asarray(v, np.float64) for k, v in named(params).items()}
    sp = lambda z: np.logaddexp(0.0, z)  # noqa: E731
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    ref_total, ref_nll = 0.0, []
    for m in range(CFG.members):
        h = x[m].astype(np.float64)
        for i in range(2):
            h = silu(h @ p[f"trunk/layers/{i}/kernel"][m] + p[f"trunk/layers/{i}/bias"][m])
        mu = h @ p["mean/kernel"][m] + p["mean/bias"][m]
        raw = h @ p["logvar/kernel"][m] + p["logvar/bias"][m]
        hi, lo = p["max_logvar"][m], p["min_logvar"][m]
        lv = lo + sp((hi - sp(hi - raw)) - lo)
        n = np.mean(lv + (y[m] - mu) ** 2 * np.exp(-lv))
        ref_nll.append(n)
        wd = sum(
            0.5 * c * (p[k][m] ** 2).sum()
            for c, k in [
                (0.1, "trunk/layers/0/kernel"),
                (0.2, "trunk/layers/1/kernel"),
                (0.3, "mean/kernel"),
                (0.3, "logvar/kernel"),
            ]
        )
        ref_total += n + 0.05 * (hi.sum() - lo.sum()) + wd
    np.testing.assert_allclose(np.asarray(nll), ref_nll, rtol=1e-5)
    np.testing.assert_allclose(float(total), ref_total, rtol=1e-5)


# ----------------------------------------------------------------------------- early stopping rule


def test_bootstrap_resamples_are_dealt_to_the_members_anew_each_epoch(data, monkeypatch):
    """As the RAVL reference's ``train_dynamics_model.py`` (``x_batch[:, perm]`` with a fresh member
    permutation per epoch): each epoch's rows per member are the same M resamples, in another order."""
    dealt, epoch = [], ensemble._train_epoch

    def spy(params, opt_state, key, x, y, boot, net, cfg):
        dealt.append(np.asarray(boot))
        return epoch(params, opt_state, key, x, y, boot, net, cfg)

    monkeypatch.setattr(ensemble, "_train_epoch", spy)
    cfg = replace(CFG, members=5, elites=2, min_epochs=0, max_epochs=4)
    dyn.train(jax.random.key(0), *data, cfg)
    assert len(dealt) == 4
    first = sorted(map(tuple, dealt[0]))
    assert all(sorted(map(tuple, d)) == first for d in dealt)  # the same resamples every epoch
    assert any(not np.array_equal(d, dealt[0]) for d in dealt[1:4])  # dealt in another order
    nobs = dyn.train(jax.random.key(0), *data, replace(cfg, bootstrap=False))[1]["epochs"]
    assert all(np.array_equal(d, np.tile(np.arange(d.shape[1]), (5, 1))) for d in dealt[4 : 4 + nobs])


def test_early_stopping_rule():
    cfg = dyn.DynamicsConfig(patience=2, min_epochs=6, max_epochs=20, improvement=0.01, lr_cut=0.3)
    stop = dyn.EarlyStopping(cfg, 2)
    seq = [
        ([1.0, 1.0], "continue"),  # epoch 0: sets the bests
        ([0.9, 1.0], "continue"),  # 1: member 0 improves 10%
        ([0.895, 1.0], "continue"),  # 2: 0.6% is no progress (stall 1)
        ([0.895, 0.995], "cut_lr"),  # 3: stall 2 before min_epochs -> cut the lr once
        ([0.9, 1.0], "continue"),  # 4: stall 1
        ([0.9, 1.0], "continue"),  # 5: stall 2, lr already cut -> go on
        ([0.9, 1.0], "continue"),  # 6: stall 3, but a stop needs epoch > min_epochs (the reference's 0-based
        ([0.9, 1.0], "stop"),
    ]  # 7:   i >= min_epochs) -> stop
    for epoch, (val, want) in enumerate(seq):
        _, action = stop.update(epoch, val)
        assert action == want, (epoch, action)
    np.testing.assert_allclose(stop.best, [0.9, 1.0])  # sub-threshold gains never replace the best
    assert stop.lr_cut_at == 3

    stop = dyn.EarlyStopping(dyn.DynamicsConfig(min_epochs=0, max_epochs=3, patience=5), 1)
    actions = [stop.update(e, [1.0 / (e + 1)])[1] for e in range(4)]
    assert actions == ["continue", "continue", "continue", "stop"]  # max_epochs despite progress

    stop = dyn.EarlyStopping(dyn.DynamicsConfig(min_epochs=10, max_epochs=20, patience=1, lr_cut=1.0), 1)
    assert [stop.update(e, [1.0])[1] for e in range(13)] == ["continue"] * 11 + ["stop", "stop"]


def test_epoch_progress_reports_first_periodic_slow_and_final_epochs():
    lines, now = [], [0.0]
    progress = dyn.epoch_progress(
        lines.append, max_epochs=dyn.NO_EPOCH_CAP, every=5, interval_s=60.0, clock=lambda: now[0]
    )
    row = lambda action="continue": {  # noqa: E731
        "train_loss": -1.5,
        "best_val_mse": np.array([0.3, 0.2]),
        "action": action,
    }
    reported = []
    for epoch, (seconds, action) in enumerate(
        [
            (10, "continue"),
            (10, "continue"),
            (70, "continue"),
            (10, "continue"),
            (10, "continue"),
            (10, "continue"),
            (10, "stop"),
        ],
        start=1,
    ):
        now[0] += seconds
        before = len(lines)
        progress(epoch, row(action))
        if len(lines) > before:
            reported.append(epoch)
    # epoch 1; epoch 3 ended 80 s after epoch 1's line; epoch 5 (every 5th); epoch 7 stops
    assert reported == [1, 3, 5, 7]
    assert lines[0] == "  dynamics epoch 1 (no cap; 10.0 s/epoch): train loss -1.5000, best validation MSE 0.20000"
    assert lines[1].startswith("  dynamics epoch 3 (no cap; 30.0 s/epoch)")
    assert lines[-1].endswith(" (stop)") and "(no cap; 18.6 s/epoch)" in lines[-1]
    capped = []
    dyn.epoch_progress(capped.append, max_epochs=40, clock=lambda: 0.0)(1, row())
    assert "(cap 40; 0.0 s/epoch)" in capped[0]


# ----------------------------------------------------------------------------- rollouts


def constant_model(sampling, elites=(1, 3)):
    """Near-deterministic 4-member model: member m maps s -> s + [1, m, 0], r = 10 + m (std e^-15)."""
    cfg = dyn.DynamicsConfig(members=4, elites=len(elites), width=8, depth=1, weight_decay=0.0, elite_sampling=sampling)
    model = dyn.init_model(jax.random.key(0), 3, 1, cfg)
    members = jnp.arange(4.0)
    bias = jnp.stack([jnp.ones(4), members, jnp.zeros(4), 10 + members], 1)

    def set_leaf(n, x):
        if n == "mean/bias":
            return bias
        if n == "logvar/bias":
            return jnp.full_like(x, -30.0)
        if n == "min_logvar":
            return jnp.full_like(x, -40.0)
        return jnp.zeros_like(x) if n.endswith("kernel") else x

    return model.replace(params=edit(model.params, set_leaf), elites=jnp.asarray(elites, jnp.int32))


def uniform_policy(obs, key):
    return jax.random.uniform(key, (obs.shape[0], 1), minval=-1.0, maxval=1.0)


def done_above_3(next_obs):
    return next_obs[:, 0] > 3.0


_rollout = jax.jit(lambda m, s, k: dyn.rollout(m, uniform_policy, s, 6, k, done_above_3))


def run_rollout(model, start, key=0):
    """A 6-step rollout of 16 rows (one compile per sampling mode)."""
    start = np.concatenate([start, np.tile([[-100.0, 0, 0]], (16 - len(start), 1))])
    batch, valid = _rollout(model, jnp.asarray(start, jnp.float32), jax.random.key(key))
    return jax.tree.map(np.asarray, batch), np.asarray(valid)


def test_rollout_stops_at_first_termination():
    start = [[-0.5, 0, 0], [2.5, 0, 0], [5, 0, 0], [-10, 0, 0]]
    batch, valid = run_rollout(constant_model("row"), start)
    assert batch.obs.shape == (6, 16, 3) and batch.action.shape == (6, 16, 1) and batch.reward.shape == (6, 16)
    assert valid[:, 4:].all()  # padding rows never terminate
    batch, valid = jax.tree.map(lambda a: a[:, :4], batch), valid[:, :4]
    want = np.array(
        [
            [1, 1, 1, 1, 0, 0],  # 0.5, 1.5, 2.5, 3.5 > 3: terminates at step 3
            [1, 0, 0, 0, 0, 0],  # 3.5 > 3 at step 0
            [1, 0, 0, 0, 0, 0],  # already past: terminates at step 0
            [1, 1, 1, 1, 1, 1],
        ],
        bool,
    ).T  # never
    np.testing.assert_array_equal(valid, want)
    term = batch.terminated & valid
    np.testing.assert_array_equal(term.T, [[0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0] * 6])
    assert not batch.truncated.any()
    for row in range(4):  # no valid transition after a terminated one
        t_end = np.flatnonzero(term[:, row])
        if len(t_end):
            assert not valid[t_end[0] + 1 :, row].any()
    # valid steps chain: obs_t = next_obs_{t-1}; s' = s + [1, m, 0], r = 10 + m for an elite m
    np.testing.assert_allclose(batch.obs[1:][valid[1:]], batch.next_obs[:-1][valid[1:]], atol=1e-5)
    delta = batch.next_obs - batch.obs
    np.testing.assert_allclose(delta[..., 0][valid], 1.0, atol=1e-4)
    member = np.rint(delta[..., 1]).astype(int)
    assert set(member[valid]) <= {1, 3}
    np.testing.assert_allclose(batch.reward[valid], 10 + member[valid], atol=1e-4)
    assert np.all(np.abs(batch.action) <= 1)
    flat, mask = dyn.flatten(jax.tree.map(jnp.asarray, batch), jnp.asarray(valid))
    assert flat.obs.shape == (24, 3) and mask.shape == (24,) and int(mask.sum()) == valid.sum()


@pytest.mark.parametrize("sampling", ["row", "step", "trajectory"])
def test_elite_sampling_modes(sampling):
    batch, valid = run_rollout(constant_model(sampling), np.zeros((0, 3)), key=1)  # 16 rows at -100: never done
    assert valid.all()
    member = np.rint(batch.next_obs[..., 1] - batch.obs[..., 1]).astype(int)  # (H, B)
    assert set(member.ravel()) == {1, 3}  # only elites, and both used
    per_step_const = (member == member[:, :1]).all()
    per_row_const = (member == member[:1, :]).all()
    assert per_step_const == (sampling == "step")
    assert per_row_const == (sampling == "trajectory")


def test_step_with_given_member():
    model = constant_model("row")
    obs = jnp.zeros((3, 3))
    next_obs, reward = dyn.step(model, obs, jnp.zeros((3, 1)), jax.random.key(0), jnp.array([0, 2, 3]))
    np.testing.assert_allclose(np.asarray(next_obs[:, 1]), [0, 2, 3], atol=1e-4)
    np.testing.assert_allclose(np.asarray(reward), [10, 12, 13], atol=1e-4)


# ----------------------------------------------------------------------------- termination functions


def random_episodes(env_id, episodes, max_steps=300):
    env = gym.make(env_id)
    env.action_space.seed(0)
    next_obs, terminated = [], []
    for ep in range(episodes):
        env.reset(seed=ep)
        for _ in range(max_steps):
            o, _, term, trunc, _ = env.step(env.action_space.sample())
            next_obs.append(o)
            terminated.append(term)
            if term or trunc:
                break
    env.close()
    return np.stack(next_obs), np.array(terminated)


@pytest.mark.parametrize("env_id,episodes", [("Hopper-v5", 6), ("Walker2d-v5", 6), ("HalfCheetah-v5", 0)])
def test_termination_matches_gymnasium_v5(env_id, episodes):
    fn = termination.termination_fn(env_id)
    if episodes == 0:  # HalfCheetah: a short stretch, never terminated
        next_obs, terminated = random_episodes(env_id, 1, max_steps=30)
        assert not terminated.any() and not np.asarray(fn(jnp.asarray(next_obs))).any()
        return
    next_obs, terminated = random_episodes(env_id, episodes)
    assert terminated.sum() >= episodes - 1 and (~terminated).sum() > episodes  # both outcomes seen
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(next_obs))), terminated)


def test_termination_fn_names_and_edge_cases():
    assert (
        termination.termination_fn("hopper")
        is termination.termination_fn("Hopper-v5")
        is termination.termination_fn("hopper-medium-v2")
    )
    assert termination.termination_fn("walker2d-medium-replay-v2") is termination.walker2d_done
    assert termination.termination_fn("HalfCheetah-v5") is termination.halfcheetah_done
    for bad in ("Ant-v5", "dmc:walker-walk", "walker"):
        with pytest.raises(ValueError, match="supported: halfcheetah, hopper, pendulum, .*walker2d"):
            termination.termination_fn(bad)
    termination.register_termination("myenv", termination.never_done)
    assert termination.termination_fn("MyEnv-v1") is termination.never_done
    del termination.TERMINATION_FNS["myenv"]
    healthy = np.array([1.2, 0.0] + [0.0] * 9, np.float32)
    cases = {
        "healthy": (healthy, False),
        "low": (np.r_[0.7, healthy[1:]], True),
        "tilted": (np.r_[healthy[:1], 0.2, healthy[2:]], True),
        "huge": (np.r_[healthy[:5], 100.0, healthy[6:]], True),
        "nan": (np.r_[healthy[:5], np.nan, healthy[6:]], True),
    }
    for name, (o, want) in cases.items():
        assert bool(termination.hopper_done(jnp.asarray(o[None]))[0]) == want, name
    w = jnp.array([[1.0, 0.5], [2.0, 0.0], [0.8, 0.0], [1.0, -1.0], [np.nan, 0.0]])
    np.testing.assert_array_equal(np.asarray(termination.walker2d_done(w)), [False, True, True, True, True])


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip(tmp_path, data, trained):
    model, _ = trained
    s, a, _, _ = data
    path = tmp_path / "dyn.npz"
    dyn.save(path, model)
    back = dyn.load(path)
    assert back.cfg == model.cfg and back.obs_dim == OBS and back.act_dim == ACT
    for f in ("input_mean", "input_std", "elites", "val_mse"):
        np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(getattr(model, f)))
    for x, y in zip(dyn.predict(model, s[:50], a[:50]), dyn.predict(back, s[:50], a[:50])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    k = jax.random.key(5)
    np.testing.assert_array_equal(
        np.asarray(dyn.step(model, s[:9], a[:9], k)[0]), np.asarray(dyn.step(back, s[:9], a[:9], k)[0])
    )

    stored = dict(np.load(path))
    stored["params/mean/kernel"] = stored["params/mean/kernel"][:, :-1]
    bad = tmp_path / "bad.npz"
    np.savez(bad, **stored)
    with pytest.raises(ValueError, match="mean/kernel: shape"):
        dyn.load(bad)
    np.savez(bad, x=np.zeros(3))
    with pytest.raises(ValueError, match="not a saved dynamics model"):
        dyn.load(bad)


# ----------------------------------------------------------------------------- NeuBay's world model (cont_ensemble.py)

NEUBAY_SMALL = dict(members=6, elites=4, width=16, batch_size=64, max_epochs=4)


def test_neubay_config_is_the_papers_posterior():
    cfg = dyn.neubay_config()
    assert (cfg.members, cfg.elites, cfg.width, cfg.depth) == (128, 100, 200, 4)
    assert cfg.activation == "leaky_relu" and cfg.layer_norm and not cfg.bootstrap
    assert (cfg.adamw_weight_decay, cfg.lr, cfg.batch_size, cfg.max_holdout, cfg.holdout) == (
        5e-5,
        1e-3,
        256,
        1000,
        0.2,
    )
    assert (cfg.patience, cfg.improvement, cfg.min_epochs, cfg.lr_cut) == (5, 0.01, 0, 1.0)
    assert cfg.target_scaling == "zscore" and not cfg.learn_logvar_bounds and cfg.elite_sampling == "trajectory"
    assert (cfg.min_logvar_init / 2, cfg.max_logvar_init / 2) == (-5.0, 0.25)  # log sigma in [-5, 0.25]
    caps = {k: dyn.neubay_config(k).max_epochs for k in ("random", "medium", "medium-expert", "medium-replay")}
    assert caps == {"random": 1200, "medium": 1200, "medium-expert": 600, "medium-replay": dyn.NO_EPOCH_CAP}
    assert dyn.neubay_config("medium", members=8, elites=3).members == 8


@pytest.mark.slow
def test_zscored_targets_are_the_residual_on_the_zscored_state(data):
    s, a, r, s2 = data
    model, info = dyn.train(jax.random.key(1), s, a, r, s2, dyn.neubay_config(**{**NEUBAY_SMALL, "max_epochs": 20}))
    np.testing.assert_allclose(np.asarray(model.target_std), np.r_[s.std(0), r.std()], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.target_mean), np.r_[np.zeros(OBS), r.mean()], rtol=1e-5, atol=1e-6)
    # the network's own output is in z-scored units; predict maps it back to raw (Δs, r)
    x = (np.concatenate([s[:20], a[:20]], 1) - np.asarray(model.input_mean)) / np.asarray(model.input_std)
    raw_mean, raw_logvar = model.net(model.params, jnp.asarray(x))
    mean, logvar = dyn.predict(model, s[:20], a[:20])
    std = np.asarray(model.target_std)
    np.testing.assert_allclose(
        np.asarray(mean), np.asarray(raw_mean) * std + np.asarray(model.target_mean), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(logvar), np.asarray(raw_logvar) + 2 * np.log(std), rtol=1e-5, atol=1e-5)
    # holdout MSE is in the training (z-scored) units, and the fit is real there
    val = dyn.validation_mse(
        model, s[info["holdout_idx"]], a[info["holdout_idx"]], r[info["holdout_idx"]], s2[info["holdout_idx"]]
    )
    np.testing.assert_allclose(val, info["val_mse"], rtol=1e-4)
    scaled = (np.c_[s2 - s, r] - np.asarray(model.target_mean)) / std
    assert info["val_mse"].min() < 0.1 * scaled.var(0).mean(), (info["val_mse"], scaled.var(0).mean())
    assert info["val_curve"][-1].min() < info["val_curve"][0].min()


@pytest.mark.slow
def test_fixed_logsigma_bounds_clamp_and_never_move(data):
    s, a, r, s2 = data
    cfg = dyn.neubay_config(**NEUBAY_SMALL)
    model, _ = dyn.train(jax.random.key(2), s, a, r, s2, cfg)
    for name, value in (("max_logvar", 0.5), ("min_logvar", -10.0)):
        np.testing.assert_array_equal(np.asarray(ensemble._leaf(model.params, name)), value)
    # push the log-variance head far out: log sigma stays in [-5, 0.25]; the soft clamp's second softplus
    # can lift the top by log1p(exp(-(0.25 + 5))) (soft_clamp's docstring)
    top = 0.25 + np.log1p(np.exp(-5.25)) + 1e-5
    for scale in (1e3, -1e3):
        big = edit(model.params, lambda n, x: x * scale if n.startswith("logvar") else x)
        _, logvar = model.net(big, jnp.asarray(np.concatenate([s[:50], a[:50]], 1)))
        log_sigma = 0.5 * np.asarray(logvar)
        assert log_sigma.min() >= -5.0 - 1e-5 and log_sigma.max() <= top
        assert log_sigma.max() > 0.2 if scale > 0 else log_sigma.min() < -4.9


@pytest.mark.slow
def test_without_bootstrap_each_member_shuffles_its_own_way(data):
    """NeuBay: every member sees the whole split, in its own order.  Members that start identical
    would stay identical under one shared order; they part after one epoch."""
    s, a, r, s2 = data
    cfg = dyn.neubay_config(**NEUBAY_SMALL)
    model = dyn.init_model(jax.random.key(0), OBS, ACT, cfg)
    same = jax.tree.map(lambda p: jnp.broadcast_to(p[:1], p.shape), model.params)
    x = jnp.asarray(np.concatenate([s, a], 1))
    y = jnp.asarray(np.concatenate([s2 - s, r[:, None]], 1))
    boot = jnp.tile(jnp.arange(len(s), dtype=jnp.int32), (cfg.members, 1))
    opt = ensemble._optimizer(cfg).init(same)
    after, _, _ = ensemble._train_epoch(same, opt, jax.random.key(1), x, y, boot, model.net, ensemble._epoch_cfg(cfg))
    kernel = np.asarray(named(after)["trunk/layers/0/kernel"])
    assert not np.allclose(kernel[0], kernel[1])
    shared, _, _ = ensemble._train_epoch(
        same, opt, jax.random.key(1), x, y, boot, model.net, ensemble._epoch_cfg(replace(cfg, bootstrap=True))
    )
    kernel = np.asarray(named(shared)["trunk/layers/0/kernel"])  # one shared order, identity "bootstrap"
    np.testing.assert_allclose(kernel[0], kernel[1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_elites_are_the_best_100_of_128(data):
    s, a, r, s2 = data
    cfg = dyn.neubay_config(width=8, depth=2, batch_size=128, max_epochs=1)
    model, info = dyn.train(jax.random.key(3), s[:400], a[:400], r[:400], s2[:400], cfg)
    elites = np.asarray(model.elites)
    assert len(elites) == 100 and len(set(elites.tolist())) == 100
    val = info["val_mse"]
    others = np.setdiff1d(np.arange(128), elites)
    assert val[elites].max() <= val[others].min()
    assert (np.diff(val[elites]) >= 0).all()  # best first


def _constant_members(model, means):
    """Every member predicts the constant (M, D) ``means`` (training units): mean head = bias only."""

    def put(name, x):
        if name == "mean/kernel":
            return jnp.zeros_like(x)
        if name == "mean/bias":
            return jnp.asarray(means, x.dtype)
        return x

    return model.replace(params=edit(model.params, put))


@pytest.mark.slow
def test_epistemic_uncertainty_and_threshold_hand_case(data):
    s, a, r, s2 = data
    cfg = dyn.neubay_config(members=5, elites=3, width=8)
    model = dyn.init_model(jax.random.key(0), OBS, ACT, cfg, target_std=np.full(OBS + 1, 7.0))
    means = np.arange(5 * (OBS + 1), dtype=np.float32).reshape(5, OBS + 1) ** 1.5
    model = _constant_members(model, means).replace(elites=jnp.asarray([4, 0, 2], jnp.int32))
    unc = np.asarray(dyn.epistemic_uncertainty(model, s[:10], a[:10]))
    # std over the elites only (members 4, 0, 2), RMS over dims, in training units (target_std not applied)
    expected = np.sqrt(means[[4, 0, 2]].var(0).mean())
    np.testing.assert_allclose(unc, expected, rtol=1e-5)

    # a member whose mean grows with the action: uncertainty varies over rows; threshold = its max
    def put(name, x):
        return x.at[0].set(0.0).at[0, 0, 0].set(1.0) if name == "mean/kernel" else x

    varying = model.replace(params=edit(model.params, put), elites=jnp.asarray([0, 1], jnp.int32))
    rows = np.asarray(dyn.epistemic_uncertainty(varying, s, a))
    assert rows.std() > 0
    assert dyn.uncertainty_threshold(varying, s, a, chunk=300) == pytest.approx(rows.max(), rel=1e-6)
    assert dyn.uncertainty_threshold(varying, s, a, 0.5) == pytest.approx(np.quantile(rows, 0.5), rel=1e-5)
    assert dyn.uncertainty_threshold(varying, s, a, None) == np.inf
    with pytest.raises(ValueError, match="quantile"):
        dyn.uncertainty_threshold(varying, s, a, 1.5)


@pytest.mark.slow
def test_neubay_model_save_load_round_trip(tmp_path, data):
    s, a, r, s2 = data
    model, _ = dyn.train(jax.random.key(4), s, a, r, s2, dyn.neubay_config(**NEUBAY_SMALL))
    dyn.save(tmp_path / "m.npz", model)
    back = dyn.load(tmp_path / "m.npz")
    assert back.cfg == model.cfg
    for f in ("target_mean", "target_std", "elites", "val_mse"):
        np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(getattr(model, f)))
    for x, y in zip(dyn.predict(model, s[:30], a[:30]), dyn.predict(back, s[:30], a[:30])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    stored = dict(np.load(tmp_path / "m.npz"))
    del stored["target_std"]
    np.savez(tmp_path / "bad.npz", **stored)
    with pytest.raises(ValueError, match="target_std"):
        dyn.load(tmp_path / "bad.npz")


def test_a_single_or_uniform_weight_decay_applies_to_every_layer_at_any_depth():
    """``--dynamics.weight-decay 0`` and NeuBay's uniform default follow ``--dynamics.depth`` (a CLI run with
    ``neubay --dynamics.depth 2`` failed on the default's five values); distinct values must match the depth."""
    import dataclasses

    assert dataclasses.replace(dyn.neubay_config(), depth=2).weight_decay == (0.0, 0.0, 0.0)
    assert dyn.DynamicsConfig(depth=2, weight_decay=(0.5,)).weight_decay == (0.5, 0.5, 0.5)
    assert dyn.DynamicsConfig(depth=1, weight_decay=0.25).weight_decay == (0.25, 0.25)
    with pytest.raises(ValueError, match="depth \\+ 1 = 3 values"):
        dyn.DynamicsConfig(depth=2, weight_decay=(0.1, 0.2))


# ----------------------------------------------------------------------------- a resumable fit

# CFG's network and data (its compiled epoch) with a stopping rule that acts within 12 epochs: the lr is
# cut at epoch 2, stalls follow, and the fit stops at epoch 12 (min_epochs 8)
CFG_STOPS = replace(CFG, min_epochs=8, max_epochs=30, patience=2, improvement=0.3)


class Interrupted(Exception):
    pass


def interrupt_at(epoch, seen=None):
    """A ``train(log=...)`` callback that records the epochs it hears of and raises at ``epoch``."""

    def log(e, row):
        if seen is not None:
            seen.append(e)
        if e == epoch:
            raise Interrupted

    return log


def assert_same_fit(a, b):
    (model_a, info_a), (model_b, info_b) = a, b
    for k, v in named(model_a.params).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(named(model_b.params)[k]), err_msg=k)
    for f in ("elites", "val_mse", "input_mean", "input_std"):
        np.testing.assert_array_equal(np.asarray(getattr(model_a, f)), np.asarray(getattr(model_b, f)), err_msg=f)
    for f in ("val_mse", "elites", "val_curve", "train_loss", "train_loss_members", "holdout_idx", "train_idx"):
        np.testing.assert_array_equal(info_a[f], info_b[f], err_msg=f)
    for f in ("epochs", "lr_cut_epoch", "stopped_early"):
        assert info_a[f] == info_b[f], f


def test_an_interrupted_fit_resumes_to_the_uninterrupted_result(data, tmp_path):
    plain = dyn.train(jax.random.key(0), *data, CFG_STOPS)
    info = plain[1]
    # the stopper's state matters: an lr cut before the interruptions, an early stop after them
    assert info["lr_cut_epoch"] == 2 and info["stopped_early"] and info["epochs"] == 12
    assert info["resumed_from_epoch"] == 0
    # after epoch 5: the lr cut, 3 epochs without progress, every member's best still its initial params;
    # after epoch 11: a stall of 1 (the stop at 12 needs it), the bests of epochs 9 and 10
    for stop, stall in ((5, 3), (11, 1)):
        path = tmp_path / f"fit-{stop}.partial.npz"
        with pytest.raises(Interrupted):
            dyn.train(
                jax.random.key(0), *data, CFG_STOPS, log=interrupt_at(stop), resume_path=path, checkpoint_interval_s=0
            )
        state = np.load(path)  # written before the log callback
        assert int(state["epoch"]) == stop and int(state["stopper/stall"]) == stall
        assert int(state["stopper/lr_cut_at"]) == 2
        assert not list(tmp_path.glob("*.tmp"))
        heard, seen = [], []
        resumed = dyn.train(
            jax.random.key(0),
            *data,
            CFG_STOPS,
            log=interrupt_at(None, seen),
            resume_path=path,
            checkpoint_interval_s=0,
            on_resume=heard.append,
        )
        assert heard == [stop] and resumed[1]["resumed_from_epoch"] == stop and seen == list(range(stop + 1, 13))
        assert_same_fit(plain, resumed)
        # the final epoch is never stored: the file holds the one before the stop
        assert int(np.load(path)["epoch"]) == 11


def test_a_partial_fit_of_another_fit_or_an_unreadable_one_is_refused(data, tmp_path):
    s, a, r, s2 = data
    path = tmp_path / "fit.partial.npz"
    with pytest.raises(Interrupted):
        dyn.train(jax.random.key(0), *data, CFG_STOPS, log=interrupt_at(1), resume_path=path, checkpoint_interval_s=0)
    for key, args, cfg, what in [
        (0, data, replace(CFG_STOPS, lr=2e-3, members=5), r"another config \(lr, members\)"),
        (0, (s, a, r + 1, s2), CFG_STOPS, "other data"),
        (0, (s[:-1], a[:-1], r[:-1], s2[:-1]), CFG_STOPS, "other data"),
        (1, data, CFG_STOPS, r"another key \(seed\)"),
    ]:
        with pytest.raises(SystemExit, match=f"{path} holds a partial dynamics fit with {what} .*delete it"):
            dyn.train(jax.random.key(key), *args, cfg, resume_path=path)
    good = path.read_bytes()
    stored = dict(np.load(path))
    del stored["opt_state/3"]
    for name, content in [("truncated", good[: len(good) // 2]), ("garbage", b"not an npz")]:
        path.write_bytes(content)
        with pytest.raises(SystemExit, match=f"{path} is not a readable partial dynamics fit .*delete it"):
            dyn.train(jax.random.key(0), *data, CFG_STOPS, resume_path=path)
    np.savez(path, **stored)
    with pytest.raises(SystemExit, match="not a readable partial dynamics fit .*opt_state/3"):
        dyn.train(jax.random.key(0), *data, CFG_STOPS, resume_path=path)


def test_the_state_is_written_at_most_every_interval(data, tmp_path, monkeypatch):
    written, write = [], ensemble._write_fit_state

    def spy(path, fingerprint, epoch, *rest):
        written.append(epoch)
        return write(path, fingerprint, epoch, *rest)

    monkeypatch.setattr(ensemble, "_write_fit_state", spy)
    cfg = replace(CFG, min_epochs=7, max_epochs=7)
    path = tmp_path / "fit.partial.npz"
    for interval, want in [(1e9, []), (25.0, [3, 6]), (0.0, [1, 2, 3, 4, 5, 6])]:
        ticks = iter(range(0, 1000, 10))  # 10 s a call: at the start, then once after each epoch but the last
        written.clear()
        path.unlink(missing_ok=True)
        dyn.train(
            jax.random.key(0), *data, cfg, resume_path=path, checkpoint_interval_s=interval, clock=lambda: next(ticks)
        )
        assert written == want, interval
        assert path.exists() == bool(want)


def test_epoch_progress_after_a_resume_counts_the_epochs_run_here():
    lines, now = [], [0.0]
    progress = dyn.epoch_progress(lines.append, max_epochs=40, every=5, clock=lambda: now[0])
    row = {"train_loss": 1.0, "best_val_mse": np.array([0.5]), "action": "continue"}
    for epoch in (8, 9, 10):  # a fit resumed after epoch 7
        now[0] += 4.0
        progress(epoch, row)
    assert lines[0].startswith("  dynamics epoch 8 (cap 40; 4.0 s/epoch)")  # the first epoch heard of
    assert lines[1].startswith("  dynamics epoch 10 (cap 40; 4.0 s/epoch)") and len(lines) == 2


@pytest.mark.slow
def test_load_or_train_resumes_a_partial_fit_and_deletes_it(tmp_path):
    """NeuBay's posterior (AdamW with a mask, no bootstrap): a second run of the same command after an
    interruption resumes the fit and saves what an uninterrupted run saves."""
    from plasticity_zoo.envs.datasets import Dataset

    s, a, r, s2 = linear_system(300, seed=1)
    n = len(s)
    meta = {"action_low": [-1.0] * ACT, "action_high": [1.0] * ACT}
    ds = Dataset(s, a, r, np.zeros(n, bool), np.zeros(n, bool), s2, metadata=meta)
    cfg = dyn.neubay_config(**NEUBAY_SMALL)
    key = jax.random.key(7)
    plain = tmp_path / "plain.npz"
    dynamics_io.load_or_train(key, ds, cfg, plain, log=lambda _: None, checkpoint_interval_s=0)
    assert plain.exists() and not dyn.partial_path(plain).exists()  # written every epoch, deleted at the end

    cache = tmp_path / "data.hdf5.neubay-0.npz"
    partial = dyn.partial_path(cache)
    assert partial == tmp_path / "data.hdf5.neubay-0.partial.npz"

    def interrupting(line):
        if "dynamics epoch 1 " in line:
            raise Interrupted

    with pytest.raises(Interrupted):
        dynamics_io.load_or_train(key, ds, cfg, cache, log=interrupting, checkpoint_interval_s=0)
    assert partial.exists() and not cache.exists()
    lines = []
    model = dynamics_io.load_or_train(key, ds, cfg, cache, log=lines.append, checkpoint_interval_s=0)
    assert f"resuming the dynamics fit from epoch 1 ({partial})" in lines
    assert any(line.startswith("  dynamics epoch 2 (cap 4;") for line in lines)
    assert cache.exists() and not partial.exists()
    want = dyn.load(plain)
    for k, v in named(want.params).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(named(model.params)[k]), err_msg=k)
    np.testing.assert_array_equal(np.asarray(want.elites), np.asarray(model.elites))
    np.testing.assert_array_equal(np.asarray(want.val_mse), np.asarray(model.val_mse))
