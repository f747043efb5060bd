"""Re-initialisation (ReDo / ReGraMa resets) draws from each network's own initialiser.

MR.Q declares Xavier-uniform x sqrt(2) with zero biases (``agents.mrq.initializer``); a reset
of an MR.Q network must draw its incoming weights from that, not from Flax's default (LeCun
normal), which SAC keeps.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import mrq, sac
from plasticity_zoo.networks import MLPHead, TrunkSpec, build
from plasticity_zoo.networks.config import NetworkConfig
from plasticity_zoo.plasticity import resets


def _leaf(p, *path):
    node = p
    for k in path:
        node = node[k]
    return np.asarray(node[...])


def _reset_each_layer(net, params, opt, key):
    """Reset every neuron of one hidden layer at a time -> {tap: new params}, layout.

    One layer at a time: a weight between two reset units is zeroed (ReDo zeroes the outgoing weights
    of a reset unit after redrawing the incoming ones), so resetting every layer at once would leave
    only the first layer's incoming weights redrawn."""
    layout = resets.neuron_layout(net, params)
    shapes = {tap: _leaf(params, *paths["incoming"], "kernel").shape for tap, paths in layout.items()}
    reset = jax.jit(lambda p, o, m, k: resets.reset_neurons(net, p, o, m, k))
    return {
        tap: reset(params, opt, {t: jnp.full(s[:-2] + s[-1:], t == tap) for t, s in shapes.items()}, key)[0]
        for tap in layout
    }, layout


def _incoming(params, paths):
    return _leaf(params, *paths["incoming"], "kernel"), _leaf(params, *paths["incoming"], "bias")


@pytest.fixture(scope="module")
def mrq_state():
    return mrq.init(jax.random.key(0), 17, 6, mrq.MRQConfig(), NetworkConfig(width=256))


@pytest.mark.parametrize("name", ["state_encoder", "value", "policy"])
def test_mrq_reset_draws_from_xavier_uniform_times_sqrt2(mrq_state, name):
    p_field, o_field = mrq.PLASTIC[name]
    net, params = mrq.plastic_nets(mrq_state)[name], getattr(mrq_state, p_field)
    assert net.initializer is mrq.initializer
    new, layout = _reset_each_layer(net, params, getattr(mrq_state, o_field), jax.random.key(3))
    for tap, paths in layout.items():
        (old_k, _), (k, b) = _incoming(params, paths), _incoming(new[tap], paths)
        fan_in, fan_out = k.shape[-2:]
        limit = math.sqrt(2.0) * math.sqrt(6.0 / (fan_in + fan_out))
        assert not np.any(k == old_k), (name, tap)  # every column re-drawn
        assert np.all(b == 0.0)
        assert np.abs(k).max() <= limit  # uniform support
        assert np.abs(k).max() > 0.99 * limit
        # Var U(-l, l) = l^2 / 3 (Flax's LeCun normal would give 1 / fan_in)
        np.testing.assert_allclose(k.var(), limit**2 / 3, rtol=0.05, err_msg=f"{name}/{tap}")
        assert abs(k.var() - 1.0 / fan_in) > 0.2 * k.var()
        assert abs(k.mean()) < 0.05 * math.sqrt(k.var())


@pytest.mark.slow
def test_sac_reset_keeps_flax_default_lecun_normal():
    state = sac.init(jax.random.key(0), 17, 6, sac.SACConfig(), NetworkConfig(width=256))
    net = state.critic
    assert net.initializer is None
    new, layout = _reset_each_layer(net, state.critic_params, state.critic_opt, jax.random.key(3))
    for tap, paths in layout.items():
        (old_k, _), (k, b) = _incoming(state.critic_params, paths), _incoming(new[tap], paths)
        fan_in = k.shape[-2]
        assert not np.any(k == old_k)
        assert np.all(b == 0.0)
        # nnx.Linear's default: LeCun normal (truncated normal scaled to variance 1 / fan_in)
        np.testing.assert_allclose(k.var(), 1.0 / fan_in, rtol=0.05, err_msg=tap)
        # truncated at 2 std of the unit normal it rescales (std 0.8796 before the correction)
        assert np.abs(k).max() <= 2.0 / (0.87962566 * math.sqrt(fan_in)) * 1.0001


@pytest.mark.parametrize("name", ["state_encoder", "sa_encoder", "policy"])
def test_net_init_is_the_declared_initializer_on_a_fresh_make(mrq_state, name):
    """``Net.init(key)`` gives exactly the params ``mrq.init`` built with the same key."""
    p_field, _ = mrq.PLASTIC[name]
    key = jax.random.split(jax.random.key(0), 4)[["state_encoder", "sa_encoder", "value", "policy"].index(name)]
    net = mrq.plastic_nets(mrq_state)[name]
    fresh = net.init(key)
    built = getattr(mrq_state, p_field)
    assert jax.tree.structure(fresh) == jax.tree.structure(built)
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(built)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... which is the initializer applied to the module's own freshly made params
    made = jax.tree.leaves(mrq.initializer(build(name, net.make, key)[1], key))
    for a, b in zip(jax.tree.leaves(fresh), made):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ensemble_init_applies_the_initializer_per_member(mrq_state):
    """The value ensemble: each member's kernels are Xavier-uniform x sqrt(2) with its own draw."""
    fresh = mrq_state.value.init(jax.random.key(5))
    for path, x in jax.tree_util.tree_flatten_with_path(fresh)[0]:
        x = np.asarray(x)
        assert x.shape[0] == 2
        if getattr(path[-1], "key", None) == "kernel":
            limit = math.sqrt(2.0) * math.sqrt(6.0 / sum(x.shape[-2:]))
            assert np.abs(x).max() <= limit
            assert not np.array_equal(x[0], x[1])
        elif getattr(path[-1], "key", None) == "bias":
            assert np.all(x == 0.0)


@pytest.mark.parametrize("ensemble", [0, 3])
def test_build_applies_the_declared_initializer_as_net_init_does(ensemble):
    spec = TrunkSpec(width=8, depth=2)
    scale = lambda p, k: jax.tree.map(lambda x: 2.0 * x + 1.0, p)  # noqa: E731
    make = lambda r: MLPHead(3, 1, spec, rngs=r)  # noqa: E731
    net, p = build("critic", make, jax.random.key(1), ensemble=ensemble, initializer=scale)
    _, plain = build("critic", make, jax.random.key(1), ensemble=ensemble)
    for a, b, c in zip(jax.tree.leaves(p), jax.tree.leaves(net.init(jax.random.key(1))), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), 2.0 * np.asarray(c) + 1.0)
    # the initializer is no part of the network's identity (static data under jit)
    assert net == build("critic", make, jax.random.key(1), ensemble=ensemble)[0]
