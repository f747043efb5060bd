"""CReLU and deep Fourier features as the activation of every trunk (networks/blocks.py: PAIRED_ACTIVATIONS).

A layer of width W has W/2 Linear units; unit i's two features sit at [..., 0, i] and [..., 1, i] of its
tap and at i and i + W/2 of the concatenated output the next layer reads."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from plasticity_zoo.networks import MLPHead, TrunkSpec, build, instrument
from plasticity_zoo.networks.blocks import PAIRED_ACTIVATIONS, concat, crelu, fourier
from plasticity_zoo.networks.config import NetworkConfig
from plasticity_zoo.plasticity import expansion, metrics, resets

PAIRED = ["crelu", "fourier"]


def _np_pair(act, z):
    """The two features of each unit, (..., 2, U), by hand."""
    if act == "crelu":
        return np.stack([np.maximum(z, 0), np.maximum(-z, 0)], axis=-2)
    return np.stack([np.sin(z), np.cos(z)], axis=-2)


def _leaf(p, *path):
    node = p
    for k in path:
        node = node[k]
    return np.asarray(node[...])


def _set(p, path, value):
    node = p
    for k in path[:-1]:
        node = node[k]
    node[path[-1]][...] = jnp.asarray(value, jnp.float32)


def test_the_functions_concatenate_the_two_halves():
    x = jnp.array([[1.5, -2.0, 0.0]])
    np.testing.assert_array_equal(crelu(x), [[1.5, 0.0, 0.0, 0.0, 2.0, 0.0]])
    np.testing.assert_allclose(fourier(x), np.concatenate([np.sin(x), np.cos(x)], -1), rtol=1e-6)
    pair = PAIRED_ACTIVATIONS["crelu"](x)
    assert pair.shape == (1, 2, 3)
    np.testing.assert_array_equal(concat(pair), crelu(x))


@pytest.mark.parametrize("act", PAIRED)
def test_a_tiny_layer_with_fixed_weights_against_hand_values(act):
    """in 3 -> width 4 (2 units) -> 1 output; loss = sum(y), so dL/dh = the head's kernel."""
    spec = TrunkSpec(width=4, depth=1, activation=act)
    net, p = build("critic", lambda r: MLPHead(3, 1, spec, rngs=r), jax.random.key(0))
    p = jax.tree.map(lambda a: a, p)
    K = np.array([[1.0, -1.0], [0.5, 2.0], [-1.0, 0.0]])
    b = np.array([0.1, -0.2])
    w_out = np.array([1.0, 2.0, 3.0, 4.0])
    _set(p, ("trunk", "layers", 0, "kernel"), K)
    _set(p, ("trunk", "layers", 0, "bias"), b)
    _set(p, ("out", "kernel"), w_out[:, None])
    _set(p, ("out", "bias"), [0.5])
    x = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], np.float32)
    y, taps = net.apply(p, jnp.asarray(x))
    z = np.array([[1.1, -1.2], [-0.4, 1.8]])  # x K + b by hand
    np.testing.assert_allclose(x @ K + b, z, atol=1e-12)
    if act == "crelu":
        pair = np.array([[[1.1, 0.0], [0.0, 1.2]], [[0.0, 1.8], [0.4, 0.0]]])  # [relu(z); relu(-z)]
        np.testing.assert_allclose(y, [1.1 * 1 + 1.2 * 4 + 0.5, 1.8 * 2 + 0.4 * 3 + 0.5], rtol=1e-6)  # 6.4, 5.3
    else:
        pair = np.stack([np.sin(z), np.cos(z)], axis=1)
        np.testing.assert_allclose(pair[0], [[0.89120736, -0.93203909], [0.45359612, 0.36235775]], rtol=1e-7)
    assert taps["layer0"].shape == (2, 2, 2)  # (batch, pair, units)
    np.testing.assert_allclose(taps["layer0"], pair, rtol=1e-6, atol=1e-7)
    features = pair.reshape(2, 4)  # [f(z_0), f(z_1), g(z_0), g(z_1)]
    np.testing.assert_allclose(taps["features"], features, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y, features @ w_out + 0.5, rtol=1e-6)
    # probes: dL/dh in the pair layout; dL/dz_i = w_i f'(z_i) + w_{U+i} g'(z_i), once per feature row
    acts, grads = instrument.activation_grads(lambda: jnp.sum(net(p, jnp.asarray(x))), ["critic"], at="both")
    np.testing.assert_allclose(acts["critic"]["layer0"], pair.reshape(4, 2), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grads["critic"]["layer0"]["post"], np.tile([[1.0, 2.0], [3.0, 4.0]], (2, 1)))
    if act == "crelu":
        dz = np.where(z > 0, w_out[:2], 0.0) - np.where(-z > 0, w_out[2:], 0.0)
        np.testing.assert_allclose(dz, [[1.0, -4.0], [-3.0, 2.0]])
    else:
        dz = w_out[:2] * np.cos(z) - w_out[2:] * np.sin(z)
    np.testing.assert_allclose(grads["critic"]["layer0"]["pre"], np.repeat(dz, 2, axis=0), rtol=1e-5, atol=1e-6)


def _np_ln(x, scale, bias, eps=1e-6):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * scale + bias


def _np_forward(block, act, p, x, depth):
    """Each trunk by hand, with the activation's concatenated output [f(z), g(z)]."""
    lin = lambda v, *path: v @ _leaf(p, "trunk", *path, "kernel") + _leaf(p, "trunk", *path, "bias")  # noqa: E731
    ln = lambda v, *path: _np_ln(v, _leaf(p, "trunk", *path, "scale"), _leaf(p, "trunk", *path, "bias"))  # noqa: E731
    cat = lambda z: _np_pair(act, z).reshape(*z.shape[:-1], -1)  # noqa: E731
    taps = []
    if block == "mlp":
        h = x
        for i in range(depth):
            z = ln(lin(h, "layers", i), "norms", i)
            taps.append(_np_pair(act, z))
            h = cat(z)
    elif block == "simba":
        h = lin(x, "proj")
        for i in range(depth):
            z = lin(ln(h, "pre_norms", i), "up", i)
            taps.append(_np_pair(act, z))
            h = h + lin(cat(z), "down", i)
        h = ln(h, "out_norm")
    else:
        g = ln(lin(x, "proj"), "proj_norm")
        h = g
        for i in range(depth):
            z = ln(lin(cat(h), "fc1", i), "ln1", i)  # the residual stream's activation: 2W features
            taps.append(_np_pair(act, z))
            h = h + ln(lin(cat(z), "fc2", i), "ln2", i) + g
    return h, taps


@pytest.mark.parametrize("block", ["mlp", "simba", "multiskip"])
@pytest.mark.parametrize("act", PAIRED)
def test_every_trunk_builds_and_runs_with_the_halved_units(block, act):
    w, d = 8, 2
    spec = TrunkSpec(width=w, depth=d, block=block, activation=act, layer_norm=True)
    net, p = build("critic", lambda r: MLPHead(5, 1, spec, rngs=r), jax.random.key(0))
    x = np.asarray(jax.random.normal(jax.random.key(1), (4, 5)))
    y, taps = net.apply(p, jnp.asarray(x))
    units = 2 * w if block == "simba" else w // 2
    incoming = {"mlp": "layers", "simba": "up", "multiskip": "fc1"}[block]
    fan_in = {"mlp": [5, w], "simba": [w, w], "multiskip": [2 * w, 2 * w]}[block]
    for i in range(d):
        assert _leaf(p, "trunk", incoming, i, "kernel").shape == (fan_in[i], units)
        assert taps[f"layer{i}"].shape == (4, 2, units)
    assert taps["features"].shape == (4, w) and y.shape == (4,)
    h, want = _np_forward(block, act, p, x, d)
    for i in range(d):
        np.testing.assert_allclose(taps[f"layer{i}"], want[i], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(taps["features"], h, rtol=1e-4, atol=1e-5)
    head = h @ _leaf(p, "out", "kernel")[:, 0] + _leaf(p, "out", "bias")[0]
    np.testing.assert_allclose(y, head, rtol=1e-4, atol=1e-5)
    layout = net.module(p).trunk.neuron_layers()
    assert all(paths["unit_outputs"] == 2 for paths in layout.values())


def _n_params(block, act, n=5, w=8, d=2, o=1):
    """Hand count (no LayerNorm in mlp): a paired activation halves the units of the Linear feeding it."""
    k = 2 if act in PAIRED else 1
    if block == "mlp":
        u = w // k
        return (n * u + u) + (d - 1) * (w * u + u) + (w * o + o)
    if block == "simba":  # proj, then per block LN(w), up w -> 4w/k, down 4w -> w; out LN; head
        return (n * w + w) + d * (2 * w + (w * 4 * w // k + 4 * w // k) + (4 * w * w + w)) + 2 * w + (w * o + o)
    # multiskip: proj + LN; per block fc1 (k w -> w/k) + LN(w/k), fc2 (w -> w) + LN(w); head
    u = w // k
    return (n * w + w) + 2 * w + d * ((k * w * u + u) + 2 * u + (w * w + w) + 2 * w) + (w * o + o)


@pytest.mark.parametrize("block", ["mlp", "simba", "multiskip"])
def test_parameter_count_against_relu_at_the_same_width(block):
    want = {"mlp": (129, 69), "simba": (1209, 921), "multiskip": (425, 401)}[block]  # (relu, paired)
    for act, expected in zip(["relu", "crelu", "fourier"], [want[0], want[1], want[1]]):
        assert _n_params(block, act) == expected
        spec = TrunkSpec(width=8, depth=2, block=block, activation=act)
        _, p = build("critic", lambda r: MLPHead(5, 1, spec, rngs=r), jax.random.key(0))
        assert sum(x.size for x in jax.tree.leaves(p)) == expected, (block, act)


def test_odd_widths_and_unknown_names_are_refused():
    for act in PAIRED:
        with pytest.raises(ValueError, match=f"activation '{act}' needs an even network width.*got 7"):
            TrunkSpec(width=7, activation=act)
        with pytest.raises(ValueError, match="even network width"):
            NetworkConfig(width=15, activation=act).trunk(TrunkSpec(256, 2))
        TrunkSpec(width=7, block="simba", activation=act)  # its 4 x 7 = 28-wide expansion has 14 units
    with pytest.raises(ValueError, match=r"unknown activation 'swishy'.*'crelu'.*'fourier'"):
        TrunkSpec(activation="swishy")


def _one_dead_unit_net(act):
    """in 2 -> width 4 (2 units): unit 0 has zero weights and bias (z = 0: crelu outputs 0, 0), unit 1
    z = x_0 + 5 > 0 (crelu outputs z, 0: its negative half is 0, the unit is not dormant)."""
    spec = TrunkSpec(width=4, depth=1, activation=act)
    net, p = build("critic", lambda r: MLPHead(2, 1, spec, rngs=r), jax.random.key(0))
    p = jax.tree.map(lambda a: a, p)
    _set(p, ("trunk", "layers", 0, "kernel"), [[0.0, 1.0], [0.0, 0.0]])
    _set(p, ("trunk", "layers", 0, "bias"), [0.0, 5.0])
    _set(p, ("out", "kernel"), [[1.0], [2.0], [-1.0], [0.5]])
    return net, p


@pytest.mark.parametrize("act", PAIRED)
def test_metrics_count_units_and_read_both_halves(act):
    net, p = _one_dead_unit_net(act)
    x = jax.random.uniform(jax.random.key(1), (64, 2), minval=-1, maxval=1)
    out = jax.jit(lambda p: metrics.compute({"critic": lambda q: jnp.mean(net(q, x) ** 2)}, {"critic": p}))(p)
    z1 = np.asarray(x[:, 0]) + 5.0
    pre = "plasticity/critic/layer0"
    if act == "crelu":
        # unit 0 dormant (both halves 0); unit 1 not, though its negative half is 0 on every input:
        # a per-feature count would give 3/4 at tau 0
        assert float(out[f"{pre}/dormant_0.0"]) == 0.5 and float(out[f"{pre}/dormant_0.1"]) == 0.5
        assert float(out[f"{pre}/grama_0.01"]) == 0.5  # relu'(0) = 0: unit 0's dL/dz is 0
        assert float(out[f"{pre}/active_fraction"]) == 0.25  # only unit 1's first half is > 0
    else:
        # sin 0 = 0 but cos 0 = 1: a Fourier unit is never dormant; d(loss)/dz_0 = w_0 cos 0 - w_2 sin 0 != 0
        assert float(out[f"{pre}/dormant_0.0"]) == 0.0 and float(out[f"{pre}/grama_0.01"]) == 0.0
        fau = np.mean(np.concatenate([[0.0, 1.0] * 64, np.sin(z1) > 0, np.cos(z1) > 0]))  # (sin 0, cos 0)
        np.testing.assert_allclose(float(out[f"{pre}/active_fraction"]), fau, rtol=1e-6)
    for metric in ("srank", "effective_rank", "feature_rank"):
        assert np.isfinite(float(out[f"{pre}/{metric}"]))
    # the representation the head reads is the W-wide output: feature rank 1 for crelu ([0, z1, 0, 0])
    if act == "crelu":
        assert float(out["plasticity/critic/features/feature_rank"]) == 1.0


@pytest.mark.slow
def test_redo_reset_on_a_crelu_network_zeroes_both_outgoing_rows_of_a_unit():
    """width 8 (4 units per layer): layer0 unit 1 and layer1 unit 3 have zero weights and bias, so both
    their halves are 0; ReDo (and ReGraMa) flag exactly them; the reset redraws their incoming columns and
    zeroes rows (1, 5) of layers[1] and rows (3, 7) of the head, and their Adam moments."""
    spec = TrunkSpec(width=8, depth=2, activation="crelu")
    net, p = build("critic", lambda r: MLPHead(3, 1, spec, rngs=r), jax.random.key(0))
    p = jax.tree.map(lambda a: a, p)
    for layer, unit in ((0, 1), (1, 3)):
        _set(
            p,
            ("trunk", "layers", layer, "kernel"),
            _leaf(p, "trunk", "layers", layer, "kernel").copy() * (np.arange(4) != unit),
        )
        _set(p, ("trunk", "layers", layer, "bias"), _leaf(p, "trunk", "layers", layer, "bias") * (np.arange(4) != unit))
    x = jax.random.normal(jax.random.key(1), (64, 3))
    loss = lambda: jnp.mean(net(p, x) ** 2)  # noqa: E731
    for method in ("redo", "regrama"):
        flagged = {
            tap: np.flatnonzero(np.asarray(resets.select(s, 0.0)))
            for tap, s in resets.scores(method, loss, "critic").items()
        }
        assert {tap: f.tolist() for tap, f in flagged.items()} == {"layer0": [1], "layer1": [3]}, method
    acts = instrument.activations(loss, ["critic"])["critic"]
    dormant = expansion.dormant_units(net, p, acts, 0.0)  # NE's dormant-first pruning reads the same units
    assert sorted(np.flatnonzero(np.asarray(m)).tolist() for m in dormant.values()) == [[1], [3]]

    opt = optax.adam(1e-3).init(p)
    ones = jax.tree.map(jnp.ones_like, opt[0].mu)
    opt = (opt[0]._replace(mu=ones, nu=ones),) + tuple(opt[1:])  # moments 1 everywhere: the reset's zeros show
    masks = {"layer0": jnp.arange(4) == 1, "layer1": jnp.arange(4) == 3}
    new, new_opt = jax.jit(lambda p, o, k: resets.reset_neurons(net, p, o, masks, k))(p, opt, jax.random.key(7))
    np.testing.assert_allclose(net(new, x), net(p, x), rtol=1e-6, atol=1e-6)  # output unchanged at reset
    fresh = net.init(jax.random.key(7))
    k0, k0_new = _leaf(p, "trunk", "layers", 0, "kernel"), _leaf(new, "trunk", "layers", 0, "kernel")
    np.testing.assert_array_equal(k0_new[:, 1], _leaf(fresh, "trunk", "layers", 0, "kernel")[:, 1])
    np.testing.assert_array_equal(np.delete(k0_new, 1, 1), np.delete(k0, 1, 1))
    assert _leaf(new, "trunk", "layers", 0, "bias")[1] == 0.0
    k1, k1_new = _leaf(p, "trunk", "layers", 1, "kernel"), _leaf(new, "trunk", "layers", 1, "kernel")  # (8, 4)
    assert np.all(k1_new[[1, 5]] == 0.0)  # layer0 unit 1's two features: rows 1 and 1 + 4
    keep = [0, 2, 3, 4, 6, 7]
    np.testing.assert_array_equal(k1_new[keep][:, 3], _leaf(fresh, "trunk", "layers", 1, "kernel")[keep, 3])
    np.testing.assert_array_equal(k1_new[keep][:, [0, 1, 2]], k1[keep][:, [0, 1, 2]])
    head, head_new = _leaf(p, "out", "kernel"), _leaf(new, "out", "kernel")  # (8, 1)
    assert np.all(head_new[[3, 7]] == 0.0) and np.any(head[[3, 7]] != 0.0)
    np.testing.assert_array_equal(np.delete(head_new, [3, 7], 0), np.delete(head, [3, 7], 0))
    # Adam moments zeroed exactly at the touched weights: by hand, 0 where reset, 1 elsewhere
    touched = {
        ("trunk", "layers", 0, "kernel"): (slice(None), 1),
        ("trunk", "layers", 0, "bias"): 1,
        ("trunk", "layers", 1, "kernel"): ([1, 5], slice(None)),
        ("trunk", "layers", 1, "bias"): 3,
        ("out", "kernel"): ([3, 7], slice(None)),
    }
    for moments in (new_opt[0].mu, new_opt[0].nu):
        for path, leaf in jax.tree_util.tree_flatten_with_path(moments)[0]:
            keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path if not hasattr(k, "name"))
            want = np.ones(leaf.shape)
            if keys in touched:
                want[touched[keys]] = 0.0
            if keys == ("trunk", "layers", 1, "kernel"):
                want[:, 3] = 0.0  # layer1 unit 3's incoming column
            np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=str(keys))


@pytest.mark.slow
@pytest.mark.parametrize("act", PAIRED)
def test_a_sac_update_and_its_plasticity_metrics_run_with_each(act):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.buffers.replay import Transition

    state = sac.init(jax.random.key(0), 3, 2, sac.SACConfig(), NetworkConfig(width=16, activation=act))
    assert _leaf(state.actor_params, "trunk", "layers", 0, "kernel").shape == (3, 8)
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    batch = Transition(
        f(32, 3),
        jnp.asarray(rng.uniform(-1, 1, (32, 2)), jnp.float32),
        f(32),
        f(32, 3),
        jnp.zeros(32, bool),
        jnp.zeros(32, bool),
    )
    new, m = jax.jit(sac.update)(state, batch, jax.random.key(1))
    for field in ("actor_params", "critic_params"):
        before, after = jax.tree.leaves(getattr(state, field)), jax.tree.leaves(getattr(new, field))
        assert all(np.all(np.isfinite(a)) for a in after)
        assert any(not np.allclose(a, b) for a, b in zip(before, after)), field
    assert all(np.isfinite(float(m[k])) for k in ("losses/critic", "losses/actor", "values/q_mean"))
    out = jax.jit(
        lambda s: metrics.compute(
            sac.plastic_losses(s, batch, jax.random.key(2)), {"critic": s.critic_params, "actor": s.actor_params}
        )
    )(new)
    assert out and all(np.all(np.isfinite(np.asarray(v))) for v in out.values())
    assert "plasticity/critic/layer1/dormant_0.0" in out


@pytest.mark.parametrize("activation", ["crelu", "fourier"])
def test_mrq_encoders_output_zs_dim_features_from_half_as_many_units(activation):
    """MR.Q's state encoder applies the activation to its output too: a paired one from zs_dim / 2 units."""
    from plasticity_zoo.agents import mrq
    from plasticity_zoo.training.config import NetworkConfig

    def build(act):
        return jax.jit(lambda k: mrq.init(k, 3, 2, mrq.MRQConfig(), NetworkConfig(width=16, activation=act)))(
            jax.random.key(0)
        )

    zs_dim = build("relu").encoder_params["out"]["kernel"].shape[-1]
    state = build(activation)
    assert state.encoder_params["out"]["kernel"].shape[-1] == zs_dim // 2
    zs, taps = jax.jit(lambda p, x: state.state_encoder.apply(p, x))(state.encoder_params, jnp.ones((5, 3)))
    assert zs.shape == (5, zs_dim) and taps["features"].shape == (5, zs_dim)
    action = jax.jit(lambda s, o, k: mrq.act(s, o, k, False))(state, jnp.zeros(3), jax.random.key(1))
    assert action.shape == (2,) and bool(jnp.all(jnp.abs(action) <= 1))
