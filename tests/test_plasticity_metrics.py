import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import sac
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.plasticity import metrics as M
from plasticity_zoo.training.config import NetworkConfig

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


@pytest.mark.slow
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
    assert float(M.weight_magnitude(p)) == pytest.approx(np.sqrt(25 / 3))  # 3 parameters
    assert float(M.weight_distance(q, p)) == pytest.approx(np.sqrt(25 / 3))  # q - p = p
    assert float(M.weight_distance(p, p)) == 0.0


def test_feature_norm_and_variance_against_numpy():
    f = np.random.default_rng(0).normal(size=(2, 7, 5)).astype(np.float32)  # (members, batch, features)
    out = M.feature_stats(jnp.asarray(f))
    assert float(out["feature_norm"]) == pytest.approx(np.sqrt((f**2).sum(-1)).mean(), rel=1e-6)
    assert float(out["feature_variance"]) == pytest.approx(f.var(-1, ddof=1).mean(), rel=1e-6)
    one = M.feature_stats(jnp.array([[3.0, 4.0, 0.0]]))  # hand values: ||f|| = 5, var = (4/9+25/9+49/9)/2
    assert float(one["feature_norm"]) == pytest.approx(5.0)
    assert float(one["feature_variance"]) == pytest.approx(78 / 18)


def test_network_metrics_totals_are_neuron_weighted():
    l0 = jnp.array([[1.0, 0.0, 3.0], [-1.0, 0.0, 1.0]])  # 1 of 3 dormant at tau 0
    l1 = jnp.array([[0.0, 1.0], [0.0, 2.0]])  # 1 of 2 dormant
    acts = {"layer0": l0, "layer1": l1}
    grads = {"layer0": jnp.ones((2, 3)), "layer1": jnp.array([[0.0, 1.0], [0.0, 1.0]])}
    out = M.network_metrics(
        acts, grads, {"w": jnp.ones(4)}, {"w": 2 * jnp.ones(4)}, {"w": jnp.zeros(4)}, prefix="plasticity/x"
    )
    assert float(out["plasticity/x/layer0/dormant_0.0"]) == pytest.approx(1 / 3)
    assert float(out["plasticity/x/layer1/dormant_0.0"]) == pytest.approx(1 / 2)
    assert float(out["plasticity/x/dormant_0.0"]) == pytest.approx(2 / 5)
    assert float(out["plasticity/x/grama_0.01"]) == pytest.approx(1 / 5)
    assert float(out["plasticity/x/active_fraction"]) == pytest.approx(5 / 10)
    assert float(out["plasticity/x/weight_norm"]) == pytest.approx(2.0)
    assert float(out["plasticity/x/weight_norm_ratio"]) == pytest.approx(0.5)
    assert float(out["plasticity/x/weight_magnitude"]) == pytest.approx(1.0)
    assert float(out["plasticity/x/weight_distance"]) == pytest.approx(1.0)
    assert float(out["plasticity/x/grad_norm"]) == 0.0


# ---------------------------------------------------------------- on the SAC agent


def _batch(n=16, obs_dim=3, act_dim=1, seed=0):
    rng = np.random.default_rng(seed)
    return Transition(
        jnp.asarray(rng.normal(size=(n, obs_dim)), jnp.float32),
        jnp.asarray(rng.uniform(-1, 1, (n, act_dim)), jnp.float32),
        jnp.asarray(rng.normal(size=n), jnp.float32),
        jnp.asarray(rng.normal(size=(n, obs_dim)), jnp.float32),
        jnp.asarray(rng.random(n) < 0.3),
        jnp.asarray(rng.random(n) < 0.3),
    )


def _init(key):
    return sac.init(key, 3, 1, sac.SACConfig(), NetworkConfig(width=WIDTH))


def _sac_metrics(state, batch, key, init=None):
    return M.compute(sac.plastic_losses(state, batch, key), sac.plastic_params(state), init)


_jit_metrics = jax.jit(_sac_metrics)  # one wrapper: calls with equal signatures share the compile


def _check_values(out, with_init=True):
    for net in ("actor", "critic"):
        for layer in ("layer0", "layer1"):
            for m in (
                "dormant_0.0",
                "dormant_0.025",
                "grama_0.01",
                "active_fraction",
                "srank",
                "effective_rank",
                "feature_rank",
            ):
                assert f"plasticity/{net}/{layer}/{m}" in out
        for m in ("dormant_0.0", "dormant_0.025", "grama_0.01", "active_fraction", "weight_norm", "grad_norm"):
            assert f"plasticity/{net}/{m}" in out
        assert (f"plasticity/{net}/weight_norm_ratio" in out) == with_init
        assert (f"plasticity/{net}/weight_distance" in out) == with_init
        for m in ("weight_magnitude", "features/feature_norm", "features/feature_variance"):
            assert f"plasticity/{net}/{m}" in out
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


@pytest.mark.slow
def test_compute_on_sac_under_jit(sac_setup):
    state, batch, key = sac_setup
    out = _jit_metrics(state, batch, key, sac.plastic_params(state))
    _check_values(out)
    assert float(out["plasticity/critic/weight_norm_ratio"]) == pytest.approx(1.0)
    assert float(out["plasticity/critic/weight_distance"]) == 0.0  # at its initial weights
    assert float(out["plasticity/critic/grad_norm"]) > 0
    # param grad norm equals that of an explicit jax.grad of the critic loss
    g = jax.grad(
        lambda p: sac.critic_loss(
            p, state, state.actor_params, batch, jnp.exp(state.log_alpha), jax.random.split(key)[1]
        )[0]
    )(state.critic_params)
    assert float(out["plasticity/critic/grad_norm"]) == pytest.approx(float(M.grad_norm(g)), rel=1e-4)


@pytest.mark.slow
def test_compute_under_vmap_over_seeds():
    states = jax.jit(jax.vmap(_init))(jax.random.split(jax.random.key(3), 2))
    batch = _batch(seed=1)
    keys = jax.random.split(jax.random.key(4), 2)
    out = jax.jit(jax.vmap(lambda s, k: _sac_metrics(s, batch, k)))(states, keys)
    _check_values(out, with_init=False)
    for k in (
        "plasticity/critic/weight_norm",
        "plasticity/actor/weight_norm",
        "plasticity/critic/grad_norm",
        "plasticity/critic/layer0/effective_rank",
    ):
        v = np.asarray(out[k])
        assert v.shape == (2,) and v[0] != v[1], k
    # per-seed values equal those of each seed computed alone
    one = jax.tree.map(lambda x: x[1], states)
    single = _jit_metrics(one, batch, keys[1])
    for k in (
        "plasticity/critic/weight_norm",
        "plasticity/critic/layer1/effective_rank",
        "plasticity/actor/dormant_0.025",
    ):
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


# ---------------------------------------------------------------- LAPACK calls: one matrix each (the metrics hang)


def _lapack_batch_dims(hlo: str) -> set[int]:
    """``num_batch_dims`` of every LAPACK custom call in a lowered program."""
    calls = re.findall(r"custom_call @lapack_\w+(.*)", hlo)
    assert calls, "no LAPACK call in the program"
    return {int(re.search(r'num_batch_dims = "(\d+)"', c).group(1)) for c in calls}


@pytest.mark.slow
def test_singular_values_take_one_matrix_per_lapack_call_under_vmap_and_grad():
    # jaxlib 0.10's batched LAPACK kernels block an XLA pool thread waiting for chunks they schedule on
    # the same pool; as many concurrent batched SVDs as pool threads deadlock (docs/benchmarks.md, MR.Q)
    x = jax.random.normal(jax.random.key(0), (3, 2, 6, 4))  # (seeds, members, B, H)
    ref = np.linalg.svd(np.asarray(x), compute_uv=False)
    f = jax.jit(jax.vmap(jax.vmap(M._singular_values)))
    np.testing.assert_allclose(f(x), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(M._singular_values(x), ref, rtol=1e-5, atol=1e-6)
    assert _lapack_batch_dims(f.lower(x).as_text()) == {0}
    # grad through the loop of SVDs equals grad through jnp's batched SVD, also vmapped
    g = jax.grad(lambda x: M.effective_rank(x).sum())(x)
    g_ref = jax.grad(lambda x: M._effective_rank(jnp.linalg.svd(x, compute_uv=False)).sum())(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6)
    gv = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(M._singular_values(x) ** 2))))
    np.testing.assert_allclose(gv(x), 2 * x, rtol=1e-4, atol=1e-5)  # sum sigma^2 = ||X||_F^2
    assert _lapack_batch_dims(gv.lower(x).as_text()) == {0}
    # the three rank metrics from one SVD agree with the separate functions
    r = M.rank_metrics(x[0])
    assert float(r["srank"]) == float(jnp.mean(M.srank(x[0])))
    assert float(r["effective_rank"]) == pytest.approx(float(jnp.mean(M.effective_rank(x[0]))))
    assert float(r["feature_rank"]) == float(jnp.mean(M.feature_rank(x[0])))


@pytest.fixture(scope="module")
def mrq_hook():
    """A full-size (512-wide) MR.Q state, 1 seed, built as the off-policy loop builds it, with a small
    replay of random rows, and the metrics hook as the loop calls it (``--plasticity.metrics-every 1``)."""
    from plasticity_zoo.agents import mrq
    from plasticity_zoo.buffers import lap
    from plasticity_zoo.plasticity.config import PlasticityConfig
    from plasticity_zoo.plasticity.hooks import Hooks
    from plasticity_zoo.training.config import RunConfig
    from plasticity_zoo.training.loops.offpolicy import init_state

    cfg = RunConfig(
        env="dmc:cartpole-balance",
        seeds=1,
        agent_name="mrq",
        agent=mrq.MRQConfig(buffer_size=512),
        network=NetworkConfig(),
        plasticity=PlasticityConfig(metrics_every=1),
    )
    obs_dim, act_dim, envs = 5, 1, 32
    state, buffer, key = init_state(mrq, cfg, obs_dim, act_dim)
    assert state.value_params["trunk"]["layers"][0]["kernel"].shape[-1] == 512  # the paper's width
    rng = np.random.default_rng(0)
    add = jax.jit(jax.vmap(lap.add))
    for _ in range(8):  # 8 consecutive transitions per env stream: windows of H_enc = 5 are valid
        f = lambda *shape: jnp.asarray(rng.normal(size=(1, envs, *shape)), jnp.float32)  # noqa: E731
        no = jnp.zeros((1, envs), bool)
        buffer = add(buffer, Transition(f(obs_dim), jnp.clip(f(act_dim), -1, 1), f(), f(obs_dim), no, no))
    hooks = Hooks(cfg.plasticity, mrq, "mrq", total_updates=100)
    state = hooks.start(state)
    return mrq, hooks, state, buffer, key


@pytest.mark.slow
def test_metrics_program_of_full_size_mrq_has_no_batched_lapack_call(mrq_hook):
    _, hooks, state, buffer, key = mrq_hook
    batch = hooks._sample(state, buffer, jax.random.split(key, 1))
    lowered = hooks._metrics.lower(state, batch, hooks.init_params, jax.random.split(key, 1))
    assert _lapack_batch_dims(lowered.as_text()) == {0}


@pytest.mark.slow
def test_metrics_hook_on_full_size_mrq(mrq_hook):
    mrq, hooks, state, buffer, key = mrq_hook
    for before in (0, 1):  # the first event draws the fixed metrics batch and compiles; the second reuses both
        out_state, rows = hooks.after_updates(before, before + 1, state, buffer, jax.random.fold_in(key, before))
        assert out_state is state and len(rows) == 1
    row = rows[0]
    for net in mrq.PLASTIC:
        for m in (
            "dormant_0.0",
            "dormant_0.025",
            "dormant_0.1",
            "grama_0.01",
            "active_fraction",
            "weight_norm",
            "weight_norm_ratio",
            "grad_norm",
            "features/srank",
            "features/effective_rank",
            "features/feature_rank",
        ):
            assert f"plasticity/{net}/{m}" in row, (net, m)
        assert any(k.startswith(f"plasticity/{net}/layer") and k.endswith("/srank") for k in row), net
    for k, v in row.items():
        assert np.isfinite(v), k
        if any(t in k for t in ("dormant", "grama", "active_fraction")):
            assert 0 <= v <= 1, k
        if "rank" in k and "ratio" not in k:
            assert 0 <= v <= 512, k
    assert row["plasticity/value/weight_norm_ratio"] == pytest.approx(1.0)  # no update since start()
    assert row["plasticity/value/features/srank"] > 1 and row["plasticity/value/grad_norm"] > 0
