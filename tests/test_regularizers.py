"""L2, L2 Init, Parseval and Normalize-and-Project (plasticity/regularizers.py) against hand-derived values.

The added gradients are checked three ways: the hand formula in numpy, ``jax.grad`` of the regulariser
written out here (Parseval in the authors' torch layout, W = K^T), and the transformation itself.
"""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from plasticity_zoo.networks import MLPHead, TrunkSpec, build
from plasticity_zoo.networks.core import path_names
from plasticity_zoo.plasticity import optim
from plasticity_zoo.plasticity import regularizers as R
from plasticity_zoo.plasticity.config import PlasticityConfig
from plasticity_zoo.plasticity.hooks import check_optimizers, regularizer_spec

ROOT = Path(__file__).resolve().parents[1]


def _net(ensemble=0, layer_norm=True, key=0):
    return build(
        "critic",
        lambda r: MLPHead(3, 2, TrunkSpec(4, 2, layer_norm=layer_norm), rngs=r),
        jax.random.key(key),
        ensemble=ensemble,
    )


def _named(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(map(str, path_names(p))): np.asarray(x) for p, x in flat}


def _jiggle(params, seed=1, scale=0.3):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _added(spec, params, init_params, ensemble=False):
    """What add_regularizer_grads adds to a zero gradient."""
    tx = R.add_regularizer_grads(spec, ensemble)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.jit(tx.update)(zeros, tx.init(init_params), params)[0]


# ----------------------------------------------------------------------------- L2 and L2 Init


def test_l2_and_l2_init_add_the_gradient_of_lambda_squared_norms():
    _, theta0 = _net()
    theta = _jiggle(theta0)
    spec = R.RegSpec(l2=0.1, l2_init=0.3)
    got = _named(_added(spec, theta, theta0))
    t, t0 = _named(theta), _named(theta0)
    for k in t:  # every parameter, biases and LayerNorm included: 2 * 0.1 * theta + 2 * 0.3 * (theta - theta_0)
        np.testing.assert_allclose(got[k], 0.2 * t[k] + 0.6 * (t[k] - t0[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    # the penalty as written in the paper: lambda ||theta||^2 + lambda' ||theta - theta_0||^2
    value = R.penalty(spec, theta, tuple(jax.tree.leaves(theta0)))
    want = sum(0.1 * np.sum(t[k] ** 2) + 0.3 * np.sum((t[k] - t0[k]) ** 2) for k in t)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    by_grad = jax.jit(jax.grad(lambda p: R.penalty(spec, p, tuple(jax.tree.leaves(theta0)))))(theta)
    for k, v in _named(by_grad).items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_the_factory_puts_the_regulariser_before_the_base_optimizer():
    """SGD through ``optimizer``: u = -lr (g + 2 lambda (theta - theta_0)), theta_0 = the params at init."""
    _, theta0 = _net()
    theta = _jiggle(theta0)
    g = _jiggle(jax.tree.map(jnp.zeros_like, theta0), seed=2)
    tx = optim.optimizer(0.5, "critic", make=optax.sgd, spec=optim.OptimSpec(reg=R.RegSpec(l2_init=0.25)))
    u, state = tx.update(g, tx.init(theta0), theta)
    for k, (uk, gk, tk, t0k) in {
        k: (v, _named(g)[k], _named(theta)[k], _named(theta0)[k]) for k, v in _named(u).items()
    }.items():
        np.testing.assert_allclose(uk, -0.5 * (gk + 0.5 * (tk - t0k)), rtol=1e-5, atol=1e-7, err_msg=k)
    # theta_0 is in the optimizer state, unchanged by the update, and not param-shaped (tuple of leaves)
    reg = R.find(state, R.RegState)
    assert isinstance(reg.init, tuple)
    for a, b in zip(reg.init, jax.tree.leaves(theta0)):
        np.testing.assert_array_equal(a, b)


def test_theta0_survives_moment_resets_and_a_checkpoint_round_trip(tmp_path):
    from plasticity_zoo.plasticity.resets import zero_moments
    from plasticity_zoo.training import checkpoint

    _, theta0 = _net(ensemble=2)
    tx = optim.optimizer(1e-3, "critic", ensemble=True, spec=optim.OptimSpec(reg=R.RegSpec(l2_init=0.1, nap=True)))
    state = tx.init(theta0)
    # ReDo / NE / layer resets zero every param-shaped subtree where touched: Adam's moments, never theta_0
    state = zero_moments(state, theta0, jax.tree.map(lambda x: jnp.ones(x.shape, bool), theta0))
    for a, b in zip(R.find(state, R.RegState).init, jax.tree.leaves(theta0)):
        np.testing.assert_array_equal(a, b)
    path = checkpoint.save(tmp_path, 1, {"critic_opt": state}, {"step": 1})
    template = {"critic_opt": tx.init(_net(ensemble=2, key=7)[1])}
    restored, _, _ = checkpoint.load(path, template)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves({"critic_opt": state})):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(R.find(restored, R.NaPState).norms, R.initial_norms(theta0, ensemble=True)):
        assert (a is None) == (b is None)


# ----------------------------------------------------------------------------- Parseval


def test_parseval_penalty_and_gradient_by_hand():
    """K (in 3, out 2) = [[1, 0], [0, 2], [1, 1]]: W W^T = K^T K = [[2, 1], [1, 5]]; minus 2 I: [[0, 1], [1, 3]];
    squared Frobenius norm 11.  lambda = 1 at width 2: lambda_l = (64 / 2)^2 = 1024."""
    k = jnp.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    assert float(R.parseval_penalty(k, 2.0)) == 11.0
    assert R.parseval_coef(1.0, k) == 1024.0
    # gradient 4 K (K^T K - 2 I) = 4 [[0, 1], [2, 6], [1, 4]]
    np.testing.assert_array_equal(np.asarray(R.parseval_grad(k, 2.0)), 4 * np.array([[0, 1], [2, 6], [1, 4]]))


def _parseval_torch_layout(params, coef, s):
    """The authors' loss: sum over hidden layers of ||W W^T - s I||_F^2, W = kernel^T (out, in)."""
    total = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = path_names(path)
        if names[-1] == "kernel" and names[0] != "out":
            w = x.T
            total = total + coef * (64 / w.shape[0]) ** 2 * jnp.sum((w @ w.T - s * jnp.eye(w.shape[0])) ** 2)
    return total


def test_parseval_adds_the_gradient_of_its_penalty_on_hidden_kernels_only():
    _, theta = _net()
    spec = R.RegSpec(parseval=1e-3, parseval_scale=2.0)
    got = _named(_added(spec, theta, theta))
    want = _named(jax.grad(_parseval_torch_layout)(theta, 1e-3, 2.0))
    np.testing.assert_allclose(
        float(R.penalty(spec, theta)), float(_parseval_torch_layout(theta, 1e-3, 2.0)), rtol=1e-5
    )
    assert set(k for k, v in got.items() if np.any(v != 0)) == {"trunk/layers/0/kernel", "trunk/layers/1/kernel"}
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-8, err_msg=k)
        if k.endswith("kernel") and not k.startswith("out"):  # the hand formula, 4 lambda_l K (K^T K - s I)
            kk = _named(theta)[k]
            hand = 4e-3 * (64 / kk.shape[1]) ** 2 * kk @ (kk.T @ kk - 2.0 * np.eye(kk.shape[1]))
            np.testing.assert_allclose(got[k], hand, rtol=1e-4, atol=1e-8, err_msg=k)


def test_parseval_treats_ensemble_members_separately():
    _, theta = _net(ensemble=2)
    spec = R.RegSpec(parseval=1e-3)
    got = _added(spec, theta, theta, ensemble=True)
    total = 0.0
    for m in range(2):
        member = jax.tree.map(lambda x: x[m], theta)
        alone = _named(_added(spec, member, member))
        for k, v in _named(got).items():
            np.testing.assert_allclose(v[m], alone[k], rtol=1e-5, atol=1e-8, err_msg=(m, k))
        total += float(R.penalty(spec, member))
    np.testing.assert_allclose(float(R.penalty(spec, theta, ensemble=True)), total, rtol=1e-5)


# ----------------------------------------------------------------------------- Normalize-and-Project


def _layer_norms(params, ensemble=False):
    """{layer: norm} with layers as NaP reads them, computed here in numpy."""
    sq = {}
    for k, x in _named(params).items():
        mod, leaf = k.rsplit("/", 1)
        if mod == "out":
            continue
        x = x.reshape(x.shape[0], -1) if ensemble else x.reshape(1, -1)
        sq[mod] = sq.get(mod, 0.0) + np.sum(x.astype(np.float64) ** 2, axis=1)
    return {m: np.sqrt(v) for m, v in sq.items()}


def test_nap_restores_every_hidden_layer_norm_per_member_and_leaves_the_output_layer_alone():
    net, theta0 = _net(ensemble=2)
    tx = R.nap_projection(ensemble=True)
    state = tx.init(theta0)
    theta = jax.tree.map(lambda x: x * jnp.array([1.5, 0.7]).reshape((2,) + (1,) * (x.ndim - 1)), _jiggle(theta0))
    u = _jiggle(jax.tree.map(jnp.zeros_like, theta0), seed=3, scale=0.2)
    u2, _ = tx.update(u, state, theta)
    new = optax.apply_updates(theta, u2)
    before, after = _layer_norms(theta0, True), _layer_norms(new, True)
    assert set(before) == {"trunk/layers/0", "trunk/layers/1", "trunk/norms/0", "trunk/norms/1"}
    for m in before:
        np.testing.assert_allclose(after[m], before[m], rtol=1e-5, err_msg=m)
    for leaf in ("out/kernel", "out/bias"):  # the output layer: theta + u, untouched
        np.testing.assert_array_equal(_named(new)[leaf], _named(theta)[leaf] + _named(u)[leaf])
    # the projection is a pure rescaling of each layer: directions kept
    for k in ("trunk/layers/0/kernel", "trunk/norms/1/scale"):
        a, b = _named(new)[k][0].ravel(), (_named(theta)[k] + _named(u)[k])[0].ravel()
        np.testing.assert_allclose(a @ b / np.linalg.norm(a) / np.linalg.norm(b), 1.0, rtol=1e-6)


def test_nap_rescaling_a_layer_that_feeds_a_layernorm_leaves_the_function_unchanged():
    """The layer's kernel and bias are scaled together: LN(c (W x + b)) = LN(W x + b)."""
    net, theta0 = _net()
    grown = jax.tree_util.tree_map_with_path(
        lambda p, x: x * (3.0 if path_names(p)[1:2] == ("layers",) else 1.0), theta0
    )
    back = R.project(grown, R.initial_norms(theta0))
    x = jax.random.normal(jax.random.key(5), (16, 3))
    np.testing.assert_allclose(net(back, x), net(theta0, x), rtol=1e-4, atol=1e-5)
    for k, v in _named(back).items():
        np.testing.assert_allclose(v, _named(theta0)[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_constrain_projects_after_the_callers_own_lr_scaling():
    """``post_scaled`` (PPO): the chain passes updates through, ``constrain`` projects the new params."""
    _, theta0 = _net()
    tx = optim.optimizer(1.0, "actor", make=optax.sgd, spec=optim.OptimSpec(reg=R.RegSpec(nap=True)), post_scaled=True)
    state = tx.init(theta0)
    g = _jiggle(jax.tree.map(jnp.zeros_like, theta0), seed=4)
    u, state = tx.update(g, state, theta0)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(g)):
        np.testing.assert_array_equal(a, -b)
    new = optim.constrain(state, optax.apply_updates(theta0, jax.tree.map(lambda x: 0.1 * x, u)))
    for m, v in _layer_norms(theta0).items():
        np.testing.assert_allclose(_layer_norms(new)[m], v, rtol=1e-5, err_msg=m)


def test_with_ne_masks_pruned_weights_get_no_regulariser_gradient_and_stay_zero():
    """The regulariser's gradient is added outside NE's mask: L2 Init would pull a pruned weight toward its
    theta_0, the mask removes that before Adam, and the step keeps it at exactly 0."""
    _, theta0 = _net()
    spec = optim.OptimSpec(ne=optim.NESpec(0.5), reg=R.RegSpec(l2_init=1.0, parseval=1e-2))
    tx = optim.optimizer(1e-2, "critic", spec=spec)
    state = tx.init(theta0)
    theta = optim.apply_mask(state, theta0)  # NE's sparse start
    u, state = tx.update(jax.tree.map(jnp.zeros_like, theta), state, theta)
    new = optax.apply_updates(theta, u)
    masks = optim.find_masked(state).masks
    pruned = 0
    for x, m, mu in zip(jax.tree.leaves(new), masks, jax.tree.leaves(optim.find_masked(state).inner[0].mu)):
        if m is not None:
            np.testing.assert_array_equal(np.asarray(x)[~np.asarray(m)], 0.0)
            np.testing.assert_array_equal(np.asarray(mu)[~np.asarray(m)], 0.0)  # no moment either
            pruned += int((~np.asarray(m)).sum())
    assert pruned > 0 and any(
        np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(theta))
    )


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("psgdax") is None, reason="the kron extra (psgdax) is not installed")
@pytest.mark.usefixtures("no_compilation_cache_writes")  # as every Kron test (tests/conftest.py)
def test_kron_takes_the_regularised_gradient_and_nap_projects_its_step():
    _, theta0 = _net(ensemble=2)
    spec = optim.OptimSpec(kron=True, reg=R.RegSpec(l2_init=0.1, parseval=1e-3, nap=True))
    tx = optim.optimizer(1e-2, "critic", ensemble=True, spec=spec)
    u, state = tx.update(_jiggle(jax.tree.map(jnp.zeros_like, theta0), seed=3), tx.init(theta0), theta0)
    new = optax.apply_updates(theta0, u)
    assert R.find(state, R.RegState).init and not optim.regularizers.find(state, optax.ScaleByAdamState)
    for m, v in _layer_norms(theta0, True).items():
        np.testing.assert_allclose(_layer_norms(new, True)[m], v, rtol=1e-5, err_msg=m)


# ----------------------------------------------------------------------------- refusals


def test_negative_coefficients_and_nap_with_ne_are_refused_naming_the_flag():
    for name in ("l2", "l2_init", "parseval"):
        with pytest.raises(ValueError, match=rf"^--plasticity\.{name.replace('_', '-')} must be >= 0, got -0.1$"):
            PlasticityConfig(**{name: -0.1}).validate()
    with pytest.raises(ValueError, match=r"^--plasticity\.parseval-scale must be > 0"):
        PlasticityConfig(parseval=1e-3, parseval_scale=0.0).validate()
    with pytest.raises(ValueError, match="--plasticity.nap does not combine with --plasticity.ne"):
        PlasticityConfig(nap=True, ne=True).validate()
    assert regularizer_spec(PlasticityConfig()) is None


def test_neubay_and_agents_that_ignore_the_factory_refuse_the_regularisers():
    import types

    from plasticity_zoo import agents

    with pytest.raises(
        ValueError,
        match=r"^--plasticity.l2-init, --plasticity.nap does not apply to agent 'neubay': "
        r"its networks take plasticity metrics only",
    ):
        check_optimizers(PlasticityConfig(l2_init=0.1, nap=True), agents.get("neubay"), "neubay", None)
    _, params = _net()
    bare = types.SimpleNamespace(
        PLASTIC={"critic": ("critic_params", "critic_opt")},
        SIGREG_NETWORKS=(),
        plastic_params=print,
        plastic_nets=print,
        plastic_losses=print,
    )
    state = types.SimpleNamespace(critic_params=params, critic_opt=optax.adam(1e-3).init(params))
    with pytest.raises(ValueError, match="the optimizers of critic are not built with plasticity.optim.optimizer"):
        check_optimizers(PlasticityConfig(parseval=1e-3), bare, "bare", state)


def test_nap_without_layer_norm_is_one_error_line(capsys, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script

    monkeypatch.delenv("RLZOO_DEBUG", raising=False)
    for argv, message in (
        (
            ["ppo", "--plasticity.nap"],
            "error: --plasticity.nap needs a LayerNorm before each nonlinearity, and the networks actor, critic of "
            "agent 'ppo' have none: add --network.layer-norm",
        ),
        (["sac", "--plasticity.l2-init", "-1"], "error: --plasticity.l2-init must be >= 0, got -1.0"),
    ):
        with pytest.raises(SystemExit) as stop:
            train_script.cli([*argv, "--env", "Pendulum-v1", "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and err == [message], err
        assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- agents


def _spec():
    return PlasticityConfig(l2=1e-4, l2_init=1e-2, parseval=1e-3, nap=True)


def _check_after_step(state, fields, agent, name):
    """Every plastic network: finite, theta_0 = its initial params, hidden layers at their initial norms."""
    for net, (p_field, o_field) in fields.items():
        params, opt = getattr(state, p_field), getattr(state, o_field)
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params)), (name, net)
        ensemble = getattr(agent.plastic_nets(state)[net], "ensemble", 0) > 0
        nap = R.find(opt, R.NaPState)
        for now, target in zip(R.initial_norms(params, ensemble), nap.norms):
            if target is not None:
                np.testing.assert_allclose(now, target, rtol=1e-5, err_msg=(name, net))
        assert R.find(opt, R.RegState).init  # theta_0 kept


@pytest.mark.slow
def test_a_sac_update_with_every_flag():
    from plasticity_zoo.agents import sac
    from plasticity_zoo.buffers.replay import Transition
    from plasticity_zoo.networks.config import NetworkConfig
    from plasticity_zoo.plasticity.hooks import static_plasticity

    cfg = _spec()
    # lr 1e-2: without NaP one step moves the layer norms by ~1e-2 (at the default 3e-4, by ~1e-4)
    state = sac.init(
        jax.random.key(0),
        3,
        1,
        sac.SACConfig(actor_lr=1e-2, critic_lr=1e-2),
        NetworkConfig(width=16, layer_norm=True),
        static_plasticity(cfg, sac),
    )
    check_optimizers(cfg, sac, "sac", state)
    theta0 = jax.tree.leaves(state.critic_params)
    rng = np.random.default_rng(0)
    batch = Transition(
        rng.normal(size=(8, 3)).astype(np.float32),
        rng.uniform(-1, 1, (8, 1)).astype(np.float32),
        rng.normal(size=8).astype(np.float32),
        rng.normal(size=(8, 3)).astype(np.float32),
        np.zeros(8, bool),
        np.zeros(8, bool),
    )
    new, metrics = jax.jit(sac.update)(state, batch, jax.random.key(1))
    assert np.isfinite(float(metrics["losses/critic"]))
    _check_after_step(new, sac.PLASTIC, sac, "sac")
    for a, b in zip(R.find(new.critic_opt, R.RegState).init, theta0):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(jax.tree.leaves(new.critic_params), theta0))


@pytest.mark.slow
def test_a_ppo_update_with_every_flag():
    """PPO scales Adam's direction by its annealed lr after the chain: NaP projects through ``constrain``."""
    import dataclasses

    from plasticity_zoo.agents import ppo
    from plasticity_zoo.networks.config import NetworkConfig
    from plasticity_zoo.plasticity.hooks import static_plasticity

    cfg = _spec()
    agent_cfg = dataclasses.replace(
        ppo.PPOConfig(), num_steps=8, num_minibatches=2, update_epochs=1, learning_rate=1e-2
    )
    state = ppo.init(
        jax.random.key(0), 3, 1, agent_cfg, NetworkConfig(width=16, layer_norm=True), static_plasticity(cfg, ppo)
    )
    check_optimizers(cfg, ppo, "ppo", state)
    T, E = 8, 2
    rng = np.random.default_rng(0)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    batch = ppo.Rollout(
        f(T + 1, E, 3),
        f(T + 1, E, 1),
        f(T + 1, E),
        f(T + 1, E),
        f(T, E),
        np.zeros((T, E), bool),
        np.zeros((T, E), bool),
        f(T, E),
    )
    new, metrics = jax.jit(ppo.update)(state, batch, jax.random.key(1))
    assert np.isfinite(float(metrics["losses/total"]))
    _check_after_step(new, ppo.PLASTIC, ppo, "ppo")
