import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents import sac
from plasticity import metrics as M
from training.config import NetworkConfig
from buffers.replay import Transition

WIDTH = 8


# ---------------------------------------------------------------- neuron scores / ReDo


def test_neuron_scores_hand_computed():
    # E|h| per unit = [1, 0, 2]; layer mean = 1 -> s = [1, 0, 2]
    h = jnp.array([[1.0, 0.0, 3.0], [-1.0, 0.0, 1.0]])
    np.testing.assert_allclose(M.neuron_scores(h), [1.0, 0.0, 2.0], rtol=1e-6)
    # E|h| = [0.5, 1.5, 1]; mean = 1 -> s = [0.5, 1.5, 1]
    h2 = jnp.array([[0.0, 1.0, 2.0], [1.0, 2.0, 0.0]])
    np.testing.assert_allclose(M.neuron_scores(h2), [0.5, 1.5, 1.0], rtol=1e-6)
    assert float(M.dormant_ratio(h2, 0.5)) == pytest.approx(1 / 3)  # s <= tau (inclusive)
    assert float(M.dormant_ratio(h2, 0.49)) == 0.0


def test_zero_unit_is_dormant_at_tau_zero_and_others_are_not():
    h = jnp.array([[1.0, 0.0, 3.0], [2.0, 0.0, 0.5]])
    s = M.neuron_scores(h)
    assert s[1] == 0.0 and s[0] > 0 and s[2] > 0
    assert float(M.dormant_ratio(h, 0.0)) == pytest.approx(1 / 3)
    # an all-zero layer: every unit dormant, the eps keeps scores finite
    z = jnp.zeros((4, 3))
    assert np.all(np.isfinite(M.neuron_scores(z)))
    assert float(M.dormant_ratio(z, 0.0)) == 1.0


def test_ensemble_shapes_and_per_member_normalisation():
    a = jnp.array([[1.0, 0.0, 3.0], [-1.0, 0.0, 1.0]])  # s = [1, 0, 2]
    b = 10.0 * jnp.array([[0.0, 1.0, 2.0], [1.0, 2.0, 0.0]])  # s = [0.5, 1.5, 1] (scale cancels)
    ens = jnp.stack([a, b])  # (M=2, B=2, H=3)
    s = M.neuron_scores(ens)
    assert s.shape == (2, 3)
    np.testing.assert_allclose(s, [[1.0, 0.0, 2.0], [0.5, 1.5, 1.0]], rtol=1e-6)
    assert float(M.dormant_ratio(ens, 0.0)) == pytest.approx(1 / 6)  # pooled over members
    assert float(M.dormant_ratio(ens, 0.5)) == pytest.approx(2 / 6)
    assert M.neuron_scores(jnp.ones((5, 7))).shape == (7,)
    with pytest.raises(ValueError):
        M.neuron_scores(jnp.ones((2, 3, 4, 5)))


# ---------------------------------------------------------------- GraMa


def test_grama_scores_hand_computed_and_zero_gradient_inactive():
    g = jnp.array([[0.2, 0.0, -0.4], [-0.2, 0.0, 0.0]])  # E|g| = [0.2, 0, 0.2]; mean = 0.4/3
    np.testing.assert_allclose(M.grama_scores(g), [1.5, 0.0, 1.5], rtol=1e-5)
    assert float(M.grama_inactive_ratio(g)) == pytest.approx(1 / 3)
    assert float(M.grama_inactive_ratio(g, tau=0.0)) == pytest.approx(1 / 3)
    # loss scale cancels
    np.testing.assert_allclose(M.grama_scores(1e-3 * g), M.grama_scores(g), rtol=1e-4)
    assert M.grama_scores(jnp.stack([g, g])).shape == (2, 3)


# ---------------------------------------------------------------- FAU


def test_active_fraction_hand_case():
    h = jnp.array([[0.0, 1.0, 2.0, 0.0], [3.0, 0.0, -1.0, 0.5]])
    assert float(M.active_fraction(h)) == pytest.approx(4 / 8)
    assert float(M.active_fraction(jnp.stack([h, jnp.ones_like(h)]))) == pytest.approx(12 / 16)


# ---------------------------------------------------------------- rank metrics


def _np_srank(x, delta):
    s = np.linalg.svd(x, compute_uv=False)
    c = np.cumsum(s) / s.sum()
    return int(np.argmax(c >= 1 - delta)) + 1


def _np_erank(x):
    s = np.linalg.svd(x, compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def test_rank_metrics_match_numpy_on_random_matrix():
    x = np.random.default_rng(0).normal(size=(32, 12)).astype(np.float32)
    for delta in (0.01, 0.1, 0.5):
        assert float(M.srank(jnp.asarray(x), delta)) == _np_srank(x, delta)
    assert float(M.effective_rank(jnp.asarray(x))) == pytest.approx(_np_erank(x), rel=1e-4)
    s = np.linalg.svd(x, compute_uv=False) / np.sqrt(32)
    for eps in (0.01, 0.5, 1.0):
        assert float(M.feature_rank(jnp.asarray(x), eps)) == int((s > eps).sum())


def test_rank_metrics_on_constructed_matrices():
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(20, 2)) @ rng.normal(size=(2, 6))).astype(np.float32)  # rank 2
    assert float(M.srank(jnp.asarray(x), 0.01)) == 2
    assert float(M.feature_rank(jnp.asarray(x))) == 2
    assert float(M.effective_rank(jnp.eye(4))) == pytest.approx(4.0, rel=1e-5)
    assert float(M.srank(jnp.eye(4), 0.01)) == 4
    assert float(M.feature_rank(jnp.eye(4))) == 4  # sigma / sqrt(4) = 0.5 > 0.01
    # a single direction has effective rank 1; the all-zero matrix rank 0 (no NaN)
    assert float(M.effective_rank(jnp.ones((5, 3)))) == pytest.approx(1.0, rel=1e-4)
    for f in (M.srank, M.effective_rank, M.feature_rank):
        assert float(f(jnp.zeros((5, 3)))) == 0.0
    # batched over members
    ens = jnp.stack([jnp.eye(4), jnp.asarray(np.diag([1.0, 0, 0, 0]), jnp.float32)])
    np.testing.assert_allclose(M.srank(ens), [4, 1])
    np.testing.assert_allclose(M.effective_rank(ens), [4, 1], rtol=1e-5)


def test_norms():
    p = {"a": jnp.array([3.0, 0.0]), "b": {"c": jnp.array([[4.0]])}}
    assert float(M.weight_norm(p)) == pytest.approx(5.0)
    assert float(M.grad_norm(p)) == pytest.approx(5.0)
    q = jax.tree.map(lambda x: 2 * x, p)
    assert float(M.weight_norm_ratio(q, p)) == pytest.approx(2.0)


def test_network_metrics_totals_are_neuron_weighted():
    l0 = jnp.array([[1.0, 0.0, 3.0], [-1.0, 0.0, 1.0]])  # 1 of 3 dormant at tau 0
    l1 = jnp.array([[0.0, 1.0], [0.0, 2.0]])  # 1 of 2 dormant
    acts = {"layer0": l0, "layer1": l1}
    grads = {"layer0": jnp.ones((2, 3)), "layer1": jnp.array([[0.0, 1.0], [0.0, 1.0]])}
    out = M.network_metrics(acts, grads, {"w": jnp.ones(4)}, {"w": 2 * jnp.ones(4)}, {"w": jnp.zeros(4)},
                            prefix="plasticity/x")
    assert float(out["plasticity/x/layer0/dormant_0.0"]) == pytest.approx(1 / 3)
    assert float(out["plasticity/x/layer1/dormant_0.0"]) == pytest.approx(1 / 2)
    assert float(out["plasticity/x/dormant_0.0"]) == pytest.approx(2 / 5)
    assert float(out["plasticity/x/grama_0.01"]) == pytest.approx(1 / 5)
    assert float(out["plasticity/x/active_fraction"]) == pytest.approx(5 / 10)
    assert float(out["plasticity/x/weight_norm"]) == pytest.approx(2.0)
    assert float(out["plasticity/x/weight_norm_ratio"]) == pytest.approx(0.5)
    assert float(out["plasticity/x/grad_norm"]) == 0.0


# ---------------------------------------------------------------- on the SAC agent


def _batch(n=16, obs_dim=3, act_dim=1, seed=0):
    rng = np.random.default_rng(seed)
    return Transition(jnp.asarray(rng.normal(size=(n, obs_dim)), jnp.float32),
                      jnp.asarray(rng.uniform(-1, 1, (n, act_dim)), jnp.float32),
                      jnp.asarray(rng.normal(size=n), jnp.float32),
                      jnp.asarray(rng.normal(size=(n, obs_dim)), jnp.float32),
                      jnp.asarray(rng.random(n) < 0.3), jnp.asarray(rng.random(n) < 0.3))


def _init(key):
    return sac.init(key, 3, 1, sac.SACConfig(), NetworkConfig(width=WIDTH))


def _sac_metrics(state, batch, key, init=None):
    return M.compute(sac.plastic_losses(state, batch, key), sac.plastic_params(state), init)


_jit_metrics = jax.jit(_sac_metrics)  # one wrapper: calls with equal signatures share the compile


def _check_values(out, with_init=True):
    for net in ("actor", "critic"):
        for layer in ("layer0", "layer1"):
            for m in ("dormant_0.0", "dormant_0.025", "grama_0.01", "active_fraction",
                      "srank", "effective_rank", "feature_rank"):
                assert f"plasticity/{net}/{layer}/{m}" in out
        for m in ("dormant_0.0", "dormant_0.025", "grama_0.01", "active_fraction", "weight_norm", "grad_norm"):
            assert f"plasticity/{net}/{m}" in out
        assert (f"plasticity/{net}/weight_norm_ratio" in out) == with_init
    for k, v in out.items():
        v = np.asarray(v)
        assert np.all(np.isfinite(v)), k
        if any(t in k for t in ("dormant", "grama", "active_fraction")):
            assert np.all((0 <= v) & (v <= 1)), k
        if "rank" in k and "ratio" not in k:
            assert np.all((0 <= v) & (v <= WIDTH)), k


@pytest.fixture(scope="module")
def sac_setup():
    return _init(jax.random.key(0)), _batch(), jax.random.key(1)


def test_compute_on_sac_under_jit(sac_setup):
    state, batch, key = sac_setup
    out = _jit_metrics(state, batch, key, sac.plastic_params(state))
    _check_values(out)
    assert float(out["plasticity/critic/weight_norm_ratio"]) == pytest.approx(1.0)
    assert float(out["plasticity/critic/grad_norm"]) > 0
    # param grad norm equals that of an explicit jax.grad of the critic loss
    g = jax.grad(lambda p: sac.critic_loss(p, state, state.actor_params, batch, jnp.exp(state.log_alpha),
                                           jax.random.split(key)[1])[0])(state.critic_params)
    assert float(out["plasticity/critic/grad_norm"]) == pytest.approx(float(M.grad_norm(g)), rel=1e-4)


def test_compute_under_vmap_over_seeds():
    states = jax.jit(jax.vmap(_init))(jax.random.split(jax.random.key(3), 2))
    batch = _batch(seed=1)
    keys = jax.random.split(jax.random.key(4), 2)
    out = jax.jit(jax.vmap(lambda s, k: _sac_metrics(s, batch, k)))(states, keys)
    _check_values(out, with_init=False)
    for k in ("plasticity/critic/weight_norm", "plasticity/actor/weight_norm",
              "plasticity/critic/grad_norm", "plasticity/critic/layer0/effective_rank"):
        v = np.asarray(out[k])
        assert v.shape == (2,) and v[0] != v[1], k
    # per-seed values equal those of each seed computed alone
    one = jax.tree.map(lambda x: x[1], states)
    single = _jit_metrics(one, batch, keys[1])
    for k in ("plasticity/critic/weight_norm", "plasticity/critic/layer1/effective_rank",
              "plasticity/actor/dormant_0.025"):
        assert float(out[k][1]) == pytest.approx(float(single[k]), rel=1e-4, abs=1e-6)


def test_zeroed_critic_unit_is_dormant(sac_setup):
    state, batch, key = sac_setup
    p = jax.tree.map(lambda x: x, state.critic_params)  # fresh Variable containers
    layer = p["trunk"]["layers"][0]
    assert layer["kernel"].shape == (2, 4, WIDTH)  # (members, obs + act, width)
    layer["kernel"][...] = layer["kernel"][...].at[..., :, 0].set(0.0)
    layer["bias"][...] = layer["bias"][...].at[..., 0].set(0.0)
    zeroed = state.replace(critic_params=p)
    out = _jit_metrics(zeroed, batch, key)
    assert float(out["plasticity/critic/layer0/dormant_0.0"]) >= 1 / WIDTH
    assert float(out["plasticity/critic/dormant_0.0"]) >= 2 / (2 * 2 * WIDTH)
    # the original state is untouched
    assert float(jnp.abs(state.critic_params["trunk"]["layers"][0]["kernel"][..., :, 0]).sum()) > 0
    # GraMa scores at the pre-activation: the dead ReLU unit has exactly zero gradient there
    assert float(out["plasticity/critic/layer0/grama_0.01"]) >= 1 / WIDTH
