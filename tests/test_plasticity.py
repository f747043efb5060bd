import csv
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from plasticity_zoo.networks import MLPHead, TrunkSpec, build
from plasticity_zoo.plasticity import resets
from plasticity_zoo.plasticity.hooks import check_applicable
from plasticity_zoo.plasticity.sigreg import SIGRegSpec, regularized, sigreg
from plasticity_zoo.training.config import PlasticityConfig


def _net_with_dead_units(ensemble=0):
    """A 2-layer ReLU critic whose layer0 unit 2 and layer1 unit 4 never fire (weights 0, bias -1)."""
    spec = TrunkSpec(width=6, depth=2)
    net, p = build("critic", lambda r: MLPHead(3, 1, spec, rngs=r), jax.random.key(0), ensemble=ensemble)

    def kill(p, layer, unit):
        lay = p["trunk"]["layers"][layer]
        lay["kernel"][...] = lay["kernel"][...].at[..., :, unit].set(0.0)
        lay["bias"][...] = lay["bias"][...].at[..., unit].set(-1.0)

    p = jax.tree.map(lambda x: x, p)
    kill(p, 0, 2)
    kill(p, 1, 4)
    return net, p


def _adam_state(net, p, x):
    tx = optax.adam(1e-3)
    state = tx.init(p)
    g = jax.grad(lambda p: jnp.sum(net(p, x) ** 2))(p)
    _, state = tx.update(g, state, p)
    return state


def _leaf(p, *path):
    node = p
    for k in path:
        node = node[k]
    return np.asarray(node[...])


@pytest.mark.slow
def test_dead_units_are_flagged_by_redo_and_regrama():
    net, p = _net_with_dead_units()
    x = jax.random.normal(jax.random.key(1), (64, 3))
    loss = lambda: jnp.mean(net(p, x) ** 2)  # noqa: E731
    for method in ("redo", "regrama"):
        sc = resets.scores(method, loss, "critic")
        flagged = {tap: np.flatnonzero(np.asarray(resets.select(s, 0.0))) for tap, s in sc.items()}
        assert 2 in flagged["layer0"] and 4 in flagged["layer1"], (method, flagged)


@pytest.mark.slow
def test_reset_keeps_output_redraws_incoming_zeroes_outgoing_and_moments():
    net, p = _net_with_dead_units()
    x = jax.random.normal(jax.random.key(1), (16, 3))
    opt = _adam_state(net, p, x)
    masks = {"layer0": jnp.zeros(6, bool).at[2].set(True), "layer1": jnp.zeros(6, bool).at[4].set(True)}
    new_p, new_opt = jax.jit(lambda p, o, k: resets.reset_neurons(net, p, o, masks, k))(p, opt, jax.random.key(7))
    # the network's output is unchanged at the moment of reset (the units were dead)
    np.testing.assert_allclose(net(new_p, x), net(p, x), rtol=1e-6, atol=1e-6)
    fresh = net.init(jax.random.key(7))
    k0_old, k0_new = _leaf(p, "trunk", "layers", 0, "kernel"), _leaf(new_p, "trunk", "layers", 0, "kernel")
    # exactly the flagged unit's incoming column is re-drawn from the initialiser; the rest is untouched
    np.testing.assert_array_equal(k0_new[:, 2], _leaf(fresh, "trunk", "layers", 0, "kernel")[:, 2])
    np.testing.assert_array_equal(np.delete(k0_new, 2, axis=1), np.delete(k0_old, 2, axis=1))
    assert _leaf(new_p, "trunk", "layers", 0, "bias")[2] == 0.0
    # outgoing rows zeroed: layer0 unit 2 -> row 2 of layer1's kernel; layer1 unit 4 -> row 4 of the head
    k1_new = _leaf(new_p, "trunk", "layers", 1, "kernel")
    assert np.all(k1_new[2, [0, 1, 2, 3, 5]] == 0.0)
    assert _leaf(new_p, "out", "kernel")[4, 0] == 0.0
    np.testing.assert_array_equal(
        np.delete(_leaf(new_p, "out", "kernel"), 4, 0), np.delete(_leaf(p, "out", "kernel"), 4, 0)
    )
    # Adam moments zeroed exactly where weights were touched; elsewhere unchanged; step count kept
    touched = resets.touched_mask(p, resets.neuron_layout(net, p), masks)
    for m_old, m_new, t in zip(
        jax.tree.leaves((opt[0].mu, opt[0].nu)),
        jax.tree.leaves((new_opt[0].mu, new_opt[0].nu)),
        jax.tree.leaves((touched, touched)),
    ):
        m_old, m_new, t = map(np.asarray, (m_old, m_new, t))
        assert np.all(m_new[t] == 0) and np.array_equal(m_new[~t], m_old[~t])
    assert int(new_opt[0].count) == int(opt[0].count)


def test_reset_on_ensemble_touches_only_the_flagged_member():
    net, p = _net_with_dead_units(ensemble=3)
    masks = {"layer0": jnp.zeros((3, 6), bool).at[1, 2].set(True), "layer1": jnp.zeros((3, 6), bool)}
    new_p, _ = resets.reset_neurons(net, p, None, masks, jax.random.key(0))
    old, new = _leaf(p, "trunk", "layers", 0, "kernel"), _leaf(new_p, "trunk", "layers", 0, "kernel")
    changed = np.argwhere(old != new)
    assert set(map(tuple, changed[:, [0, 2]])) == {(1, 2)}


def test_select_caps_the_fraction_reset():
    s = jnp.array([0.0, 0.5, 0.001, 2.0, 0.002, 0.0])
    assert np.asarray(resets.select(s, 0.01)).tolist() == [True, False, True, False, True, True]
    capped = np.asarray(resets.select(s, 0.01, max_fraction=0.34))  # at most 2 of 6: the two lowest
    assert capped.sum() == 2 and capped[0] and capped[5]


def _numpy_sigreg(z, a, variant):
    y = z @ (a / np.linalg.norm(a, axis=0, keepdims=True))
    if variant == "rl":
        t = np.linspace(-5, 5, 8)
        w, scale = np.full(8, 1 / 8), 1.0
    else:
        t = np.linspace(0, 3, 17)
        dt = t[1] - t[0]
        w = np.full(17, 2 * dt)
        w[0] = w[-1] = dt
        w, scale = w * np.exp(-(t**2) / 2), len(z)
    err = np.array(
        [
            [
                (np.cos(tt * y[:, s]).mean() - np.exp(-(tt**2) / 2)) ** 2 + np.sin(tt * y[:, s]).mean() ** 2
                for s in range(y.shape[1])
            ]
            for tt in t
        ]
    )
    return scale * np.mean((w[:, None] * err).sum(0)) if variant == "lejepa" else err.mean()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["rl", "lejepa"])
def test_sigreg_matches_numpy_and_separates_gaussian_from_collapsed(variant):
    key = jax.random.key(3)
    z = np.asarray(jax.random.normal(jax.random.key(4), (512, 8)), np.float64)
    a = np.asarray(jax.random.normal(key, (8, 16)), np.float64)
    np.testing.assert_allclose(
        sigreg(jnp.asarray(z, jnp.float32), key, variant), _numpy_sigreg(z, a, variant), rtol=2e-3, atol=1e-6
    )
    big = jax.random.normal(jax.random.key(5), (8192, 16))
    gaussian = float(sigreg(big, key, variant))
    collapsed = float(sigreg(jnp.outer(big[:, 0], jnp.ones(16)) / 4.0, key, variant))  # rank 1
    anisotropic = float(sigreg(big * jnp.linspace(0.1, 3.0, 16), key, variant))
    assert collapsed > 20 * gaussian and anisotropic > 20 * gaussian


def test_sigregs_cos_and_sin_match_numpy_in_every_quadrant_up_to_1e5():
    """SIGReg's own argument-reduced cos / sin (one elementwise pass) against float64 numpy."""
    from plasticity_zoo.plasticity.sigreg import _cos_sin

    quarter = np.pi / 2
    edges = np.array([q * quarter + d for q in range(-8, 9) for d in (-1e-3, 0.0, 1e-3)])  # around each quadrant switch
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [edges, *(rng.normal(size=2000) * scale for scale in (1, 30, 1e3)), rng.uniform(-1e5, 1e5, 2000)]
    ).astype(np.float32)
    exact = x.astype(np.float64)
    for fn in (_cos_sin, jax.jit(_cos_sin)):  # op by op, and fused as in the update (where XLA may contract to FMAs)
        cos, sin = fn(jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(cos), np.cos(exact), rtol=0, atol=2e-7)
        np.testing.assert_allclose(np.asarray(sin), np.sin(exact), rtol=0, atol=2e-7)


def test_regularized_loss_adds_coef_times_sigreg_of_the_first_call_features():
    spec = TrunkSpec(width=8, depth=2)
    net, p = build("critic", lambda r: MLPHead(3, 1, spec, rngs=r), jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 3))

    def loss(p, x):
        return jnp.mean(net(p, x) ** 2), net(p, x + 1.0)  # second call must not be the regularised one

    k = jax.random.key(2)
    plain = regularized(loss, "critic")(p, x, reg_key=k)[0]  # no spec: unchanged
    assert float(plain) == float(loss(p, x)[0])
    off = regularized(loss, "critic")(p, x, reg_key=k, sigreg=SIGRegSpec(0.0))[0]  # coefficient 0: unchanged
    assert float(off) == float(loss(p, x)[0])
    reg = jax.jit(lambda p: regularized(loss, "critic")(p, x, reg_key=k, sigreg=SIGRegSpec(0.5))[0])(p)
    feats = net.apply(p, x)[1]["features"]
    np.testing.assert_allclose(reg, loss(p, x)[0] + 0.5 * sigreg(feats, k), rtol=1e-5)


def test_interventions_are_refused_where_they_do_not_apply():
    bare = types.SimpleNamespace(init=None, act=None, update=None)
    with pytest.raises(ValueError, match="--plasticity.redo does not apply to agent 'bare'"):
        check_applicable(PlasticityConfig(redo=True, metrics_every=0), bare, "bare")
    declared = types.SimpleNamespace(PLASTIC={}, plastic_params=None, plastic_losses=None)
    with pytest.raises(ValueError, match="sigreg-coef does not apply"):
        check_applicable(PlasticityConfig(sigreg_coef=0.2), declared, "x")
    with pytest.raises(ValueError, match="alternatives"):
        PlasticityConfig(redo=True, regrama=True).validate()


@pytest.mark.slow
@pytest.mark.parametrize("flags", [dict(redo=True, redo_tau=0.1), dict(regrama=True, sigreg_coef=0.2)])
def test_flags_work_on_sac_and_log_metrics(tiny_sac_config, tmp_path, flags):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.loops.offpolicy import train

    pcfg = PlasticityConfig(metrics_every=100, reset_every=100, **flags)
    out = train(tiny_sac_config(total_steps=500, seeds=2, plasticity=pcfg), sac, tmp_path / "r")
    rows = list(csv.DictReader(open(tmp_path / "r" / "metrics.csv")))
    logged = [r for r in rows if r.get("plasticity/critic/dormant_0.0")]
    assert {r["seed"] for r in logged} == {"0", "1"} and len(logged) >= 4
    for r in logged:
        for k in (
            "plasticity/critic/dormant_0.025",
            "plasticity/actor/grama_0.01",
            "plasticity/critic/active_fraction",
        ):
            assert 0.0 <= float(r[k]) <= 1.0
        assert float(r["plasticity/critic/features/srank"]) >= 1
    fractions = [
        float(r["plasticity/critic/reset_fraction"]) for r in rows if r.get("plasticity/critic/reset_fraction")
    ]
    assert fractions and all(0.0 <= f <= 1.0 for f in fractions)
    assert np.all(np.isfinite(jax.tree.leaves(out["state"].critic_params)[0]))


@pytest.mark.slow
def test_flags_work_on_ppo_and_least_is_refused(tmp_path):
    import dataclasses

    from plasticity_zoo.agents import ppo
    from plasticity_zoo.training.config import NetworkConfig, RunConfig
    from plasticity_zoo.training.loops.onpolicy import train as train_onpolicy

    agent_cfg = dataclasses.replace(ppo.PPOConfig(), num_steps=64, num_minibatches=4, update_epochs=2)
    pcfg = PlasticityConfig(metrics_every=8, regrama=True, reset_every=8, sigreg_coef=0.2)
    cfg = RunConfig(
        env="Pendulum-v1",
        total_steps=256,
        num_envs=2,
        eval_every=256,
        eval_episodes=1,
        log_every=64,
        checkpoint_every=256,
        progress=False,
        network=NetworkConfig(width=16),
        plasticity=pcfg,
        agent_name="ppo",
        agent=agent_cfg,
    )
    train_onpolicy(cfg, ppo, tmp_path / "r")
    rows = [r for r in csv.DictReader(open(tmp_path / "r" / "metrics.csv")) if r.get("plasticity/actor/dormant_0.0")]
    assert rows and all(0.0 <= float(r["plasticity/critic/grama_0.01"]) <= 1.0 for r in rows)
    assert all(0.0 <= float(r["plasticity/actor/reset_fraction"]) <= 1.0 for r in rows)
    with pytest.raises(ValueError, match="least does not apply to agent 'ppo'"):
        train_onpolicy(dataclasses.replace(cfg, plasticity=PlasticityConfig(least=True)), ppo, tmp_path / "s")


def _numpy_sigreg_grad(z, a, variant):
    """d SIGReg / d z by hand: with y = z a_n (unit directions), R_ts = mean_n cos(t y_ns), I_ts = mean_n
    sin(t y_ns), d err_ts / d y_ns = (2 t / N) [-(R_ts - e^{-t^2/2}) sin(t y_ns) + I_ts cos(t y_ns)]."""
    an = a / np.linalg.norm(a, axis=0, keepdims=True)
    y = z @ an
    n, num_slices = y.shape
    if variant == "rl":
        t = np.linspace(-5, 5, 8)
        w = np.full(8, 1 / 8)
    else:
        t = np.linspace(0, 3, 17)
        dt = t[1] - t[0]
        w = np.full(17, 2 * dt)
        w[0] = w[-1] = dt
        w = w * np.exp(-(t**2) / 2) * n
    dy = np.zeros_like(y)
    for tt, wt in zip(t, w):
        re, im = np.cos(tt * y).mean(0), np.sin(tt * y).mean(0)
        dy += wt / num_slices * (2 * tt / n) * (-(re - np.exp(-(tt**2) / 2)) * np.sin(tt * y) + im * np.cos(tt * y))
    return dy @ an.T


@pytest.mark.parametrize("variant", ["rl", "lejepa"])
def test_sigreg_gradient_matches_the_hand_derived_one(variant):
    """SIGReg's backward pass is written out (a custom VJP): it must equal the derivative by hand."""
    key = jax.random.key(3)
    z = np.asarray(jax.random.normal(jax.random.key(6), (256, 8)) * 0.7 + 0.2, np.float64)
    a = np.asarray(jax.random.normal(key, (8, 16)), np.float64)
    grad = jax.grad(lambda z: sigreg(z, key, variant))(jnp.asarray(z, jnp.float32))
    expected = _numpy_sigreg_grad(z, a, variant)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max())
    members = jnp.stack([jnp.asarray(z, jnp.float32), jnp.asarray(z[::-1] * 1.5, jnp.float32)])  # ensemble: mean
    grad2 = jax.grad(lambda m: sigreg(m, key, variant))(members)
    np.testing.assert_allclose(np.asarray(grad2[0]), expected / 2, rtol=2e-3, atol=1e-3 * np.abs(expected).max())
