"""ReDo and SIGReg against their official code, number by number (docs/fidelity.md).

``tests/fixtures/redo_reference.npz`` (generator ``scripts/fidelity/redo_reference.py``): google/dopamine
``dopamine/labs/redo/weight_recyclers.py`` (Sokar et al. 2023) run on a dense 4 -> 16 -> 16 -> 16 -> 2 ReLU
MLP with fixed weights (in each hidden layer a dead unit and units scaled to scores around tau), a batch
of 32 inputs, fixed Adam moments and ``jax.random.PRNGKey(42)``: the layers' activations, the reference's
``estimate_neuron_score`` per hidden layer, its ``_score2mask`` masks at tau = 0, 0.025 and 0.1, and
``NeuronRecycler.recycle_dead_neurons`` at tau = 0.1 (``init_method_outgoing='zero'``): the params and
Adam moments after the reset.

``tests/fixtures/sigreg_reference.npz`` (generator ``scripts/fidelity/sigreg_reference.py``):
rbalestr-lab/lejepa ``SlicingUnivariateTest(EppsPulley(t_max=3, n_points=P))`` (Balestriero & LeCun
2025) on fixed non-Gaussian embeddings and fixed Gaussian direction matrices G: the statistic (mean over
slices and, for an (M, N, D) input, members), the per-slice statistics and the gradient with respect to
the embeddings, each also in float64.

Repository, commit and the generator's exact command are in each fixture's ``meta`` field.  Neither
reference is needed here.  The zoo functions run are the ones the training loop runs
(``plasticity.hooks.reset_step``: ``resets.scores``, ``resets.select``, ``resets.reset_neurons``; the loss
wrapper ``plasticity.sigreg.regularized``: ``sketched_isotropy``), jitted.

Seams (no plasticity code changed):

* ReDo's redraw: the reference draws new incoming weights with ``xavier_uniform`` from its own key
  splits; ours from the network's initialiser via ``Net.init``.  Those draws cannot agree (different
  initialisers), so for the reset comparison the test builds a ``Net`` whose ``initializer`` returns
  "fresh" params equal to the reference's post-reset incoming kernels (with a sentinel 99.0 everywhere
  else, so that any fresh value used outside a flagged unit's incoming column shows); everything after
  ``Net.init`` is then ours and is compared exactly.  A second test checks with a real key that the
  redrawn columns are ``Net.init(key)``'s (to float32 rounding: the draw fused inside the jitted reset can
  differ from an eager one in the last bit).
* SIGReg's directions: ``plasticity.sigreg._projections`` draws them with ``jax.random.normal(key, (D,
  S))``; the test replaces ``jax.random.normal`` by one that returns the float array passed as the key
  (any other call goes to JAX's), and passes the reference's G where the loop passes a key.  Both sides
  normalise G themselves.

Tolerances (float32, ``|ours - ref| <= ATOL + RTOL |ref|``): activations and scores ``RTOL, ATOL = 1e-5,
1e-6``; masks, the reset params and the reset moments exactly (``assert_array_equal``); SIGReg value,
per-slice values and gradient ``RTOL, ATOL = 1e-5, 1e-6``, after checking the float32 reference against its
own float64 run.

Deliberate differences:

1. Bias moments: the reference resets Adam's mu and nu of the reset weights' *kernels* only (its masks
   are ``None`` for 1-D params, and ``reset_momentum(m, None)`` is the identity); the zoo also zeroes the
   moments of the flagged units' incoming biases (the bias itself is zeroed by both).  Checked as
   ours = where(mask, 0, reference) on the bias moments, equal elsewhere.
2. The redraw's initialiser (above): xavier_uniform in the reference, the network's own in the zoo.
3. ReDo scores: the reference captures activations per sample under ``jax.vmap`` (matrix-vector), ours
   for the batch (one matrix product); equal within float32 rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from plasticity_zoo.networks import MLPHead, TrunkSpec, build, instrument
from plasticity_zoo.plasticity import metrics, resets
from plasticity_zoo.plasticity.sigreg import sketched_isotropy
from tests.fidelity import flat, load_into

FIXTURES = Path(__file__).parent / "fixtures"
RTOL, ATOL = 1e-5, 1e-6
SENTINEL = 99.0


def _load(name):
    with np.load(FIXTURES / name) as f:
        out = {k: f[k] for k in f.files}
    out["meta"] = json.loads(str(out["meta"]))
    return out


# ----------------------------------------------------------------------------- ReDo
@pytest.fixture(scope="module")
def redo():
    fx = _load("redo_reference.npz")
    sizes = fx["meta"]["sizes"]
    spec = TrunkSpec(width=sizes["width"], depth=sizes["depth"])
    net, params = build("critic", lambda r: MLPHead(sizes["obs"], sizes["out"], spec, rngs=r), jax.random.key(0))
    layers = fx["meta"]["layers"]

    def ours(prefix):  # reference layer names -> our param paths
        tree = {}
        for i, layer in enumerate(layers):
            path = ("out",) if layer == "final_layer" else ("trunk", "layers", i)
            for leaf in ("kernel", "bias"):
                tree[(*path, leaf)] = fx[f"{prefix}/{layer}/{leaf}"]
        return tree

    taps = [f"layer{i}" for i in range(len(layers) - 1)]
    return dict(
        fx=fx,
        net=net,
        template=params,
        ours=ours,
        layers=layers,
        taps=taps,
        params=load_into(params, ours("inputs/params")),
        x=jnp.asarray(fx["inputs/x"]),
    )


def _zoo_scores(r):
    net, x = r["net"], r["x"]
    loss = lambda p: jnp.mean(net(p, x) ** 2)  # noqa: E731  (any loss: ReDo reads the forward pass)
    return jax.jit(lambda p: resets.scores("redo", lambda: loss(p), "critic"))(r["params"])


def test_redo_activations_and_scores_match_reference(redo):
    net, x, fx = redo["net"], redo["x"], redo["fx"]
    acts = instrument.activations(lambda: jnp.mean(net(redo["params"], x) ** 2), ["critic"])["critic"]
    scores = _zoo_scores(redo)
    assert sorted(scores) == redo["taps"]
    for tap, layer in zip(redo["taps"], redo["layers"]):
        np.testing.assert_allclose(acts[tap], fx[f"acts/{layer}"], rtol=RTOL, atol=ATOL, err_msg=tap)
        np.testing.assert_allclose(scores[tap], fx[f"scores/{layer}"], rtol=RTOL, atol=ATOL, err_msg=tap)
        np.testing.assert_allclose(metrics.neuron_scores(acts[tap]), fx[f"scores/{layer}"], rtol=RTOL, atol=ATOL)
        assert np.any(fx[f"scores/{layer}"] == 0.0) and np.any(fx[f"scores/{layer}"] > 1.0)


def test_redo_score_of_signed_activations_matches_reference(redo):
    """The score is of |h|: on activations with both signs (tanh, leaky units) it is not that of h."""
    fx = redo["fx"]
    np.testing.assert_allclose(
        metrics.neuron_scores(jnp.asarray(fx["signed/acts"])), fx["signed/scores"], rtol=RTOL, atol=ATOL
    )


def test_redo_tau_masks_and_dormant_ratios_match_reference(redo):
    fx, scores = redo["fx"], _zoo_scores(redo)
    net, x = redo["net"], redo["x"]
    acts = instrument.activations(lambda: jnp.mean(net(redo["params"], x) ** 2), ["critic"])["critic"]
    for tau in fx["meta"]["mask_taus"]:
        for tap, layer in zip(redo["taps"], redo["layers"]):
            ref = fx[f"masks/{tau}/{layer}"].astype(bool)
            np.testing.assert_array_equal(np.asarray(resets.select(scores[tap], tau)), ref, err_msg=f"{tau} {tap}")
            assert float(metrics.dormant_ratio(acts[tap], tau)) == pytest.approx(ref.mean(), abs=1e-7)
    assert any(fx[f"masks/0.025/{layer}"].sum() < fx[f"masks/0.1/{layer}"].sum() for layer in redo["layers"][:-1])


def _adam_state(r, prefix):
    params = r["params"]
    state = optax.adam(6.25e-5).init(params)
    mu, nu = (load_into(params, r["ours"](f"{prefix}/{m}/params")) for m in ("mu", "nu"))
    return (state[0]._replace(count=jnp.asarray(3, jnp.int32), mu=mu, nu=nu), *state[1:])


def _reset(r, net, key):
    tau = r["fx"]["meta"]["tau"]
    masks = {tap: resets.select(s, tau, 1.0) for tap, s in _zoo_scores(r).items()}
    fn = jax.jit(lambda p, o, k: resets.reset_neurons(net, p, o, masks, k, True))
    return masks, *fn(r["params"], _adam_state(r, "inputs"), key)


def test_redo_reset_matches_reference_given_the_same_fresh_weights(redo):
    fx, layers, tau = redo["fx"], redo["layers"], redo["fx"]["meta"]["tau"]
    # fresh params: the reference's own redraws (xavier_uniform from its key splits, before its outgoing
    # zeroing) in the columns of the units its masks flag, 99 elsewhere
    fresh = {k: np.full_like(v, SENTINEL) for k, v in redo["ours"]("inputs/params").items()}
    for i, layer in enumerate(layers[:-1]):
        m = fx[f"masks/{tau}/{layer}"].astype(bool)
        fresh[("trunk", "layers", i, "kernel")][:, m] = fx[f"draws/{layer}/kernel"][:, m]
    fresh_tree = load_into(redo["template"], fresh)
    net = dataclasses.replace(redo["net"], initializer=lambda params, key: fresh_tree)
    masks, new_p, new_opt = _reset(redo, net, jax.random.key(0))
    for tap, layer in zip(redo["taps"], layers):
        np.testing.assert_array_equal(np.asarray(masks[tap]), fx[f"masks/{tau}/{layer}"].astype(bool))

    ref_p = redo["ours"]("reset/params")
    for path, value in flat(new_p).items():
        np.testing.assert_array_equal(value, ref_p[path], err_msg=str(path))
    adam = new_opt[0]
    assert int(adam.count) == 3
    for name in ("mu", "nu"):
        ref = redo["ours"](f"reset/{name}/params")
        for path, value in flat(getattr(adam, name)).items():
            expected = ref[path]
            if path[-1] == "bias" and path[0] == "trunk":  # difference 1: ours also zeroes the flagged biases' moments
                expected = np.where(fx[f"masks/{tau}/{layers[path[2]]}"].astype(bool), 0.0, expected)
                before = redo["ours"](f"inputs/{name}/params")[path]
                np.testing.assert_array_equal(ref[path], before, err_msg="reference leaves bias moments alone")
            np.testing.assert_array_equal(value, expected, err_msg=f"{name} {path}")


def test_redo_reset_redraws_from_the_networks_initialiser(redo):
    """With a real key: flagged units' incoming columns are Net.init(key)'s, to float32 rounding (but for
    the rows from flagged units of the layer below, zeroed as their outgoing weights), their biases 0,
    outgoing rows 0, every other
    weight untouched.  (The output is not unchanged: units with 0 < score <= tau did contribute.)"""
    key = jax.random.key(5)
    masks, new_p, _ = _reset(redo, redo["net"], key)
    old, new, init = flat(redo["params"]), flat(new_p), flat(redo["net"].init(key))
    n = len(redo["taps"])
    for i, tap in enumerate(redo["taps"]):
        m = np.asarray(masks[tap])
        k, b = ("trunk", "layers", i, "kernel"), ("trunk", "layers", i, "bias")
        below = np.asarray(masks[f"layer{i - 1}"]) if i else np.zeros(new[k].shape[0], bool)
        # the draw inside the jitted reset may differ from an eager Net.init in the last bit (XLA's fusion of the
        # initialiser's truncated normal), hence a float32-rounding tolerance here only
        np.testing.assert_allclose(new[k][:, m], np.where(below[:, None], 0.0, init[k])[:, m], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(new[k][:, ~m], np.where(below[:, None], 0.0, old[k])[:, ~m])
        np.testing.assert_array_equal(new[b], np.where(m, 0.0, old[b]))
        nxt = ("out", "kernel") if i == n - 1 else ("trunk", "layers", i + 1, "kernel")
        assert np.all(new[nxt][m, :] == 0.0)
    np.testing.assert_array_equal(new[("out", "bias")], old[("out", "bias")])


# ----------------------------------------------------------------------------- SIGReg
@pytest.fixture(scope="module")
def sigreg_fx():
    return _load("sigreg_reference.npz")


@pytest.fixture
def fixed_directions(monkeypatch):
    """``jax.random.normal(key, shape, dtype)`` returns ``key`` when it is a float array (the directions)."""
    original = jax.random.normal

    def normal(key, shape=(), dtype=float, *args, **kwargs):
        if jnp.issubdtype(jnp.result_type(key), jnp.floating):
            assert tuple(key.shape) == tuple(shape), (key.shape, shape)
            return key.astype(dtype)
        return original(key, shape, dtype, *args, **kwargs)

    monkeypatch.setattr(jax.random, "normal", normal)


@pytest.mark.parametrize("case", ["single", "ensemble"])
def test_sigreg_lejepa_value_and_gradient_match_reference(sigreg_fx, fixed_directions, case):
    fx = sigreg_fx
    (cfg,) = [c for c in fx["meta"]["cases"] if c["name"] == case]
    z, g = jnp.asarray(fx[f"{case}/z"]), jnp.asarray(fx[f"{case}/directions"])
    # the float32 reference is itself within the bound of its float64 run
    for k in ("value", "per_slice", "grad"):
        np.testing.assert_allclose(fx[f"{case}/{k}"], fx[f"{case}/{k}_float64"], rtol=RTOL / 10, atol=ATOL / 10)
    points = None if cfg["n_points"] == 17 else cfg["n_points"]  # 17: the loop's call (no num_points)

    def stat(z, g):
        if points is None:
            return sketched_isotropy(z, g, "lejepa", cfg["num_slices"])
        return sketched_isotropy(z, g, "lejepa", cfg["num_slices"], points)

    value, grad = jax.jit(jax.value_and_grad(stat))(z, g)
    np.testing.assert_allclose(value, fx[f"{case}/value"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, fx[f"{case}/grad"], rtol=RTOL, atol=ATOL)
    assert np.abs(fx[f"{case}/grad"]).max() > 0.1 and float(fx[f"{case}/value"]) > 1.0


@pytest.mark.parametrize("case", ["single", "ensemble"])
def test_sigreg_lejepa_per_slice_statistics_match_reference(sigreg_fx, fixed_directions, case):
    """Each slice alone (a one-column direction matrix) against the reference's ``reduction=None``."""
    fx = sigreg_fx
    (cfg,) = [c for c in fx["meta"]["cases"] if c["name"] == case]
    z, g = jnp.asarray(fx[f"{case}/z"]), jnp.asarray(fx[f"{case}/directions"])
    ref = fx[f"{case}/per_slice"]  # (..., S)
    fn = jax.jit(
        lambda z, a: jax.vmap(lambda z1: sketched_isotropy(z1, a, "lejepa", 1, cfg["n_points"]))(
            z.reshape((-1,) + z.shape[-2:])
        )
    )
    for s in range(cfg["num_slices"]):
        ours = fn(z, g[:, s : s + 1])
        np.testing.assert_allclose(ours, ref[..., s].reshape(-1), rtol=RTOL, atol=ATOL, err_msg=f"slice {s}")


# ----------------------------------------------------------------------------- TRAC
# ``tests/fixtures/trac_reference.npz`` (generator ``scripts/fidelity/trac_reference.py``): the authors' package
# ``trac-optimizer`` 0.0.2 (Muppidi, Zhang, Yang 2024, Algorithm 1), ``start_trac(log, torch.optim.Adam)(params,
# lr=1e-2)``, run on a 4 x 3 weight and a 3-vector for 60 steps of fixed gradients: the params and the tuner's
# s, sigma, v after every step.  Cases: ``drift`` (params near 0, a consistent gradient: S grows from 1e-7 to
# about 12), ``reversal`` (the drift, then three times its opposite: the scales turn negative and the played
# scale is clipped at 0, which puts the params back on theta_ref), ``weights`` (params ~ N(0, 0.5): S Delta
# below half an ulp of theta_ref is absorbed, so the params stay on theta_ref and only the tuner moves).
# The zoo side is ``plasticity.optim.optimizer`` with TRAC on, as every agent builds it (over optax's Adam).
#
# Deliberate difference: erfi.  The package's erfi (a port of Weideman's complex erf) is low by up to 1.1%
# for small arguments; the zoo sums erfi's series, within 2e-6 of mpmath's.  The generator therefore also runs
# the package with its module's ``erfi`` replaced by mpmath's (mode ``exact_erfi``; everything else as
# published), which is what the trajectories are compared against.
#
# Tolerances (float32): the tuner's sigma and v within 1e-4 of their largest entry, s within 5e-4 of its
# largest entry, params within 5e-4 of their largest displacement from theta_ref so far (S multiplies
# Delta, and S itself grows through erfi's exponential, so float32 rounding compounds over the 60 steps:
# observed 1.4e-5, 3.9e-5 and 9.4e-5); in ``weights`` the params are equal exactly.
TRAC_LR, TRAC_TOL, TRAC_TUNER_TOL = 1e-2, 5e-4, 1e-4


@pytest.fixture(scope="module")
def trac_fx():
    return _load("trac_reference.npz")


def _trac_run(fx, case: str):
    """The zoo's TRAC-over-Adam on the fixture's case -> per step (params, TracState)."""
    from plasticity_zoo.plasticity import optim as optim_lib
    from plasticity_zoo.plasticity import trac

    tx = optim_lib.optimizer(TRAC_LR, "net", spec=optim_lib.OptimSpec(trac=trac.TracSpec()))
    params = {n: jnp.asarray(fx[f"{case}/init/{n}"]) for n in ("w", "b")}
    state = tx.init(params)
    step = jax.jit(tx.update)
    out = []
    for t in range(fx["meta"]["steps"]):
        grads = {n: jnp.asarray(fx[f"{case}/grads/{n}"][t]) for n in ("w", "b")}
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append((params, trac.find(state)))
    return out


def test_trac_erfi_is_exact_where_the_packages_is_not(trac_fx):
    from plasticity_zoo.plasticity.trac import erfi

    x, exact, package = trac_fx["erfi/x"], trac_fx["erfi/exact"], trac_fx["erfi/package"]
    np.testing.assert_allclose(np.asarray(jax.jit(erfi)(jnp.asarray(x))), exact, rtol=2e-6, atol=1e-7)
    small = (np.abs(x) > 0) & (np.abs(x) <= 1)
    assert np.all(np.abs(package[small] / exact[small] - 1) > 4e-3)  # the deviation the exact_erfi mode removes


@pytest.mark.parametrize("case", ["drift", "reversal", "weights"])
def test_trac_steps_match_the_authors_package(trac_fx, case):
    fx, ref = trac_fx, f"{case}/exact_erfi"
    displacement, run = 0.0, _trac_run(fx, case)
    for t, (params, state) in enumerate(run):
        for k in ("sigma", "variance"):
            want = fx[f"{ref}/{k}"][t]
            np.testing.assert_allclose(getattr(state, k), want, atol=TRAC_TUNER_TOL * np.abs(want).max(), rtol=0)
        s = fx[f"{ref}/s"][t]
        np.testing.assert_allclose(state.s, s, atol=TRAC_TOL * np.abs(s).max(), rtol=0, err_msg=f"{case} s, step {t}")
        for n in ("w", "b"):
            want, init = fx[f"{ref}/params/{n}"][t], fx[f"{case}/init/{n}"]
            displacement = max(displacement, float(np.abs(want - init).max()))
            if case == "weights":
                np.testing.assert_array_equal(params[n], want)
            else:
                np.testing.assert_allclose(params[n], want, atol=TRAC_TOL * displacement, rtol=0, err_msg=f"step {t}")
    s_sum = fx[f"{ref}/s"].sum(axis=1)
    # what each case exercises: S grown by orders of magnitude; a negative S clipped (params back on theta_ref)
    if case == "drift":
        assert s_sum[-1] > 1e7 * s_sum[0]
    if case == "reversal":
        assert s_sum[-1] < 0
        for n in ("w", "b"):
            np.testing.assert_array_equal(run[-1][0][n], fx[f"{case}/init/{n}"])
