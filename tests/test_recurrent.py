"""The LRU recurrent core (networks/recurrent.py) against a step-by-step numpy recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from plasticity_zoo.networks import instrument
from plasticity_zoo.networks.recurrent import LRU, RecurrentSpec, build_recurrent, linear_recurrence

SMALL = RecurrentSpec(d_model=8, d_hidden=6, layers=2)


def numpy_lru(unit: LRU, x, h0, start):
    """Orvieto et al. (2023) eq. 3, one step at a time in complex128: h = lam h + gamma B x, y = Re(C h) + D x."""
    p = {k: np.asarray(v[...], np.float64) for k, v in vars(unit).items() if isinstance(v, nnx.Param)}
    lam = np.exp(-np.exp(p["nu_log"]) + 1j * np.exp(p["theta_log"]))
    gamma = np.exp(p["gamma_log"])
    b, c = p["B_re"] + 1j * p["B_im"], p["C_re"] + 1j * p["C_im"]
    h, ys = np.asarray(h0, np.complex128), []
    for t in range(len(x)):
        h = (0.0 if start[t] else lam * h) + gamma * (b @ x[t])
        ys.append((c @ h).real + p["D"] * x[t])
    return np.stack(ys), h


def test_lru_parallel_scan_matches_the_sequential_numpy_recurrence():
    unit = LRU(5, RecurrentSpec(d_model=5, d_hidden=7), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(13, 5)).astype(np.float32)
    h0 = (rng.normal(size=7) + 1j * rng.normal(size=7)).astype(np.complex64)
    start = np.zeros(13, bool)
    start[[4, 9]] = True  # two episode starts inside the sequence
    y, h_last = unit(jnp.asarray(x), jnp.asarray(h0), jnp.asarray(start))
    y_ref, h_ref = numpy_lru(unit, x, h0, start)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(h_last), h_ref, rtol=1e-4, atol=1e-4)


def test_linear_recurrence_against_a_loop():
    rng = np.random.default_rng(1)
    a = rng.uniform(-1, 1, size=(9, 3)).astype(np.float32)
    b = rng.normal(size=(9, 3)).astype(np.float32)
    h0 = rng.normal(size=3).astype(np.float32)
    hs, h = [], h0
    for t in range(9):
        h = a[t] * h + b[t]
        hs.append(h)
    np.testing.assert_allclose(
        np.asarray(linear_recurrence(jnp.asarray(a), jnp.asarray(b), jnp.asarray(h0))),
        np.stack(hs),
        rtol=1e-5,
        atol=1e-5,
    )


def test_eigenvalues_start_on_the_ring_and_stay_stable():
    spec = RecurrentSpec(d_model=4, d_hidden=4096, r_min=0.4, r_max=0.9)
    unit = LRU(4, spec, rngs=nnx.Rngs(0))
    modulus = np.abs(np.asarray(unit.eigenvalues()))
    assert modulus.min() >= 0.4 - 1e-6 and modulus.max() <= 0.9 + 1e-6
    assert modulus.min() < 0.45 and modulus.max() > 0.85  # spread over the ring, not a point
    # |lambda|^2 is uniform on [r_min^2, r_max^2]: its mean is the interval's midpoint
    assert abs(np.mean(modulus**2) - (0.16 + 0.81) / 2) < 0.01
    phase = np.angle(np.asarray(unit.eigenvalues()))
    assert phase.min() < -3.0 and phase.max() > 3.0  # phases cover the circle (max_phase 2 pi)
    np.testing.assert_allclose(np.exp(np.asarray(unit.gamma_log[...])), np.sqrt(1 - modulus**2), rtol=1e-4)
    # the exponential parameterisation keeps |lambda| <= 1 for any nu (here far outside the init range)
    unit.nu_log[...] = jnp.linspace(-20.0, 5.0, 4096)
    assert np.abs(np.asarray(unit.eigenvalues())).max() <= 1.0 + 1e-6  # (float32 cos / sin rounding)
    default = LRU(4, RecurrentSpec(d_model=4, d_hidden=512), rngs=nnx.Rngs(1))
    assert np.abs(np.asarray(default.eigenvalues())).max() < 0.9 + 1e-6


@pytest.mark.slow
def test_the_core_over_a_sequence_equals_stepping_it_and_an_episode_start_forgets():
    net, params = build_recurrent("core", 3, SMALL, jax.random.key(0))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 10, 3)).astype(np.float32))  # 2 sequences of 10 steps
    start = np.zeros((2, 10), bool)
    start[:, 0] = True
    start[1, 6] = True
    state0 = net.initial_state((2,))
    assert state0.shape == (2, SMALL.layers, SMALL.d_hidden) and state0.dtype == jnp.complex64
    ys, state = jax.jit(net.__call__)(params, x, state0, jnp.asarray(start))
    assert ys.shape == (2, 10, SMALL.d_model)

    step = jax.jit(net.step)
    s, stepped = state0, []
    for t in range(10):
        y, s = step(params, x[:, t], s, jnp.asarray(start[:, t]))
        stepped.append(y)
    np.testing.assert_allclose(np.asarray(ys), np.stack(stepped, 1), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(state), np.asarray(s), rtol=2e-5, atol=2e-5)

    # sequence 1 restarts at t = 6: what came before cannot reach its outputs from there on
    x2 = x.at[:, :6].set(100.0)
    ys2, _ = net(params, x2, state0, jnp.asarray(start))
    np.testing.assert_allclose(np.asarray(ys2[1, 6:]), np.asarray(ys[1, 6:]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(ys2[1, :6]), np.asarray(ys[1, :6]))
    assert not np.allclose(np.asarray(ys2[0, 6:]), np.asarray(ys[0, 6:]))  # no reset there: it remembers


@pytest.mark.slow
def test_warming_up_on_a_prefix_gives_the_state_of_the_whole_sequence():
    """The state after a prefix, carried into the rest, reproduces one pass over both."""
    net, params = build_recurrent("core", 4, SMALL, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (17, 4))
    start = jnp.zeros(17, bool).at[0].set(True)
    state0 = net.initial_state()
    whole, end = net(params, x, state0, start)
    head, warm = net(params, x[:7], state0, start[:7])
    tail, end2 = net(params, x[7:], warm, start[7:])
    np.testing.assert_allclose(np.asarray(jnp.concatenate([head, tail])), np.asarray(whole), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(end2), np.asarray(end), rtol=2e-5, atol=2e-5)
    cold, _ = net(params, x[7:], state0, start[7:])  # without the warm-up the outputs differ
    assert not np.allclose(np.asarray(cold), np.asarray(tail), atol=1e-3)


@pytest.mark.slow
def test_the_core_reports_its_layers_and_takes_gradients():
    net, params = build_recurrent("core", 3, SMALL, jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (4, 6, 3))
    start = jnp.zeros((4, 6), bool).at[:, 0].set(True)

    def loss(params):
        y, _ = net(params, x, net.initial_state((4,)), start)
        return jnp.mean(y**2)

    grads = jax.grad(loss)(params)
    norms = {jax.tree_util.keystr(k): float(jnp.linalg.norm(g)) for k, g in jax.tree_util.tree_leaves_with_path(grads)}
    assert all(np.isfinite(v) for v in norms.values())
    assert all(v > 0 for k, v in norms.items() if "nu_log" in k or "theta_log" in k or "B_re" in k)
    acts, act_grads = jax.jit(lambda p: instrument.activation_grads(lambda: loss(p), ["core"], at="both"))(params)
    assert sorted(acts["core"]) == ["layer0", "layer1", "pre"]
    # a batch of sequences comes back as rows (batch x time, units), the layout the metrics read
    assert acts["core"]["layer0"].shape == act_grads["core"]["layer0"]["pre"].shape == (4 * 6, SMALL.d_model)
    ys = net(params, x, net.initial_state((4,)), start)[0]
    assert float(jnp.abs(act_grads["core"]["layer1"]["pre"]).sum()) > 0
    # one side of the probes: the same taps, the core's own tap named "pre" included
    _, pre_grads = instrument.activation_grads(lambda: loss(params), ["core"], at="pre")
    assert sorted(pre_grads["core"]) == ["layer0", "layer1", "pre"]
    np.testing.assert_allclose(
        np.asarray(pre_grads["core"]["pre"]), np.asarray(act_grads["core"]["pre"]["pre"]), rtol=1e-5, atol=1e-8
    )
    feats = instrument.features(lambda: loss(params), ["core"])
    np.testing.assert_allclose(np.asarray(feats["core"]), np.asarray(ys).reshape(24, -1), rtol=1e-6)


def test_seeds_differ_and_repeat():
    a = build_recurrent("core", 3, SMALL, jax.random.key(0))[1]
    b = build_recurrent("core", 3, SMALL, jax.random.key(0))[1]
    c = build_recurrent("core", 3, SMALL, jax.random.key(1))[1]
    same = jax.tree.map(lambda u, v: bool(jnp.array_equal(u, v)), a, b)
    assert all(jax.tree.leaves(same))
    differ = jax.tree.map(lambda u, v: bool(jnp.array_equal(u, v)), a, c)
    assert not all(jax.tree.leaves(differ))


@pytest.mark.parametrize("bad", [dict(r_min=0.9, r_max=0.5), dict(r_max=1.0), dict(d_hidden=0), dict(layers=0)])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="LRU|recurrent"):
        RecurrentSpec(**bad)
