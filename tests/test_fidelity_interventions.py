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


# ----------------------------------------------------------------------------- GraMa / ReGraMa
# ``tests/fixtures/grama_reference.npz`` (generator ``scripts/fidelity/grama_reference.py``): the GraMa authors'
# ``utils/ReDo.py: GradientReDo`` (Liu et al. 2025, arXiv 2505.24061; snapshot rippl-svg/grad-based-plasticity-metrics,
# a fork whose ReDo.py is torressliu's last version) on two critics with fixed weights, a batch of 32 (s, a) and the
# MSE to fixed targets: ``mlp`` is the reference's own ``SoftQNetwork`` at width 16, 8 -> 16 -> 16 -> 16 -> 1 (in each
# hidden layer a dead unit, a unit with outgoing weights x 0.003 and one active on 2 samples); ``ln`` adds LayerNorm
# after each of two hidden Linears.  Recorded: the loss, weight gradients, layer inputs and output gradients dL/dz,
# the reference's per-layer ``grad_magnitude`` and ``normalized_grad``, its threshold masks at tau = 0, 0.01, 0.1, 0.3
# and (mlp) its percentage / hybrid masks, and its reset at tau = 0.1 (LeCun option, torch Adam state given).
#
# The reference's score is not the paper's Eq. 2 (docs/fidelity.md, GraMa): it reads the weight gradient's rows,
# mean_j |dL/dW_ij| = mean_j |sum_b dL/dz_bi x_bj|, where Eq. 2 and the zoo take E_b |dL/dz_bi| at the unit's
# pre-activation.  So the zoo's scores are checked against Eq. 2 on the reference's own backward pass, the reference's
# score against its formula on the same pass, and what follows the score (normalisation, tau, caps, reset) against
# the reference given the reference's own scores and masks; how many units the two scores classify differently is
# pinned as measured (GRAMA_DISAGREE).  Tolerances as ReDo's (``RTOL, ATOL``); masks and resets exactly.
GRAMA_LINEARS = {"mlp": ["fc1", "hidden_layers.0", "hidden_layers.1", "fc_out"], "ln": ["fc1", "fc2", "fc_out"]}
GRAMA_TAPS = {"mlp": ["fc1", "hidden_layers.0", "hidden_layers.1"], "ln": ["ln1", "ln2"]}  # the zoo's layer<i>
# hidden units that Eq. 2 (the zoo) and the reference's score flag differently, per tau, summed over the hidden
# layers; the ln case against the reference's masks of the LayerNorms, and of the Linears before them
GRAMA_DISAGREE = {"mlp": (0, 1, 2, 6), "ln": (0, 0, 3, 5), "ln_linear": (2, 3, 4, 5)}
# the population of 200 weight draws (mean per draw, of 48 hidden units): flagged by the reference, by Eq. 2, by one
GRAMA_POPULATION = {
    0.0: (4.12, 4.12, 0.0),
    0.01: (7.15, 7.17, 0.38),
    0.1: (9.34, 10.13, 1.45),
    0.3: (13.24, 14.16, 2.81),
}


@pytest.fixture(scope="module")
def grama():
    fx = _load("grama_reference.npz")
    meta, sizes = fx["meta"], fx["meta"]["sizes"]
    x = np.concatenate([fx["inputs/obs"], fx["inputs/act"]], axis=1)
    cases = {}
    for case, depth, ln in (("mlp", meta["mlp_depth"], False), ("ln", meta["ln_depth"], True)):
        spec = TrunkSpec(width=sizes["width"], depth=depth, layer_norm=ln)
        net, template = build(
            "critic", lambda r, spec=spec: MLPHead(sizes["obs"] + sizes["act"], 1, spec, rngs=r), jax.random.key(0)
        )
        paths = {n: ("out",) if n == "fc_out" else ("trunk", "layers", i) for i, n in enumerate(GRAMA_LINEARS[case])}
        if ln:
            paths.update({"ln1": ("trunk", "norms", 0), "ln2": ("trunk", "norms", 1)})

        def ours(fmt, case=case, paths=paths, default=None):
            """Reference arrays ``fx[f"{case}/" + fmt.format(p=<torch param name>)]`` -> our param paths (a missing
            one: ``default`` shaped like it, when given)."""
            tree = {}
            for name, path in paths.items():
                leaves = ("scale", "bias") if name.startswith("ln") else ("kernel", "bias")
                for leaf, torch_leaf in zip(leaves, ("weight", "bias")):
                    key = f"{case}/" + fmt.format(p=f"{name}.{torch_leaf}")
                    if key not in fx and default is not None:
                        value = np.full_like(fx[f"{case}/inputs/{name}.{torch_leaf}"], default)
                    else:
                        value = fx[key]
                    tree[(*path, leaf)] = value.T if leaf == "kernel" else value
            return tree

        cases[case] = dict(net=net, template=template, ours=ours, params=load_into(template, ours("inputs/{p}")))
    inputs = {case: {n: fx.get(f"{case}/layer_inputs/{n}", x) for n in meta["layers"][case]} for case in cases}
    return dict(fx=fx, meta=meta, x=jnp.asarray(x), y=jnp.asarray(fx["inputs/y"]), cases=cases, inputs=inputs)


def _grama_loss(g, case):
    net, x, y = g["cases"][case]["net"], g["x"], g["y"]
    return lambda p: jnp.mean((net(p, x) - y) ** 2)  # F.mse_loss(q, y), the reference's critic loss


def _grama_zoo_scores(g, case):
    loss = _grama_loss(g, case)
    return jax.jit(lambda p: resets.scores("regrama", lambda: loss(p), "critic"))(g["cases"][case]["params"])


def _grama_mask(g, case, name, tau):
    """The reference's threshold mask of layer ``name`` at ``tau``."""
    return g["fx"][f"{case}/masks/threshold/{name}"][g["meta"]["mask_taus"].index(tau)]


@pytest.mark.parametrize("case", ["mlp", "ln"])
def test_grama_backward_pass_matches_reference(grama, case):
    """The same loss, weight gradients, pre-activation gradients dL/dz (our probes) and activations as torch's."""
    fx, c = grama["fx"], grama["cases"][case]
    loss = _grama_loss(grama, case)
    value, grads = jax.jit(jax.value_and_grad(loss))(c["params"])
    np.testing.assert_allclose(value, fx[f"{case}/loss"], rtol=RTOL, atol=ATOL)
    ref = c["ours"]("grads/{p}")
    for path, got in flat(grads).items():
        np.testing.assert_allclose(got, ref[path], rtol=RTOL, atol=ATOL, err_msg=str(path))
    acts, pre = instrument.activation_grads(lambda: loss(c["params"]), ["critic"], at="pre")
    linears = GRAMA_LINEARS[case]
    for i, tap in enumerate(GRAMA_TAPS[case]):
        np.testing.assert_allclose(pre["critic"][f"layer{i}"], fx[f"{case}/out_grads/{tap}"], rtol=RTOL, atol=ATOL)
        nxt = grama["inputs"][case][linears[i + 1]]  # the post-activation output is the next Linear's input
        np.testing.assert_allclose(acts["critic"][f"layer{i}"], nxt, rtol=RTOL, atol=ATOL, err_msg=tap)


@pytest.mark.parametrize("case", ["mlp", "ln"])
def test_grama_zoo_scores_are_eq2_on_the_reference_backward_pass(grama, case):
    """Eq. 2: G_i = E_b|dL/dz_bi| / (mean_k E_b|dL/dz_bk| + 1e-9), dL/dz torch's at the unit's pre-activation."""
    fx, scores = grama["fx"], _grama_zoo_scores(grama, case)
    assert sorted(scores) == [f"layer{i}" for i in range(len(GRAMA_TAPS[case]))]
    dead = grama["meta"]["engineered_units"]["dead"]
    for i, tap in enumerate(GRAMA_TAPS[case]):
        dz = fx[f"{case}/out_grads/{tap}"]
        m = np.abs(dz.astype(np.float64)).mean(0)
        eq2 = m / (m.mean() + 1e-9)
        np.testing.assert_allclose(scores[f"layer{i}"], eq2, rtol=RTOL, atol=ATOL, err_msg=tap)
        assert scores[f"layer{i}"][dead] == 0.0
        for tau in grama["meta"]["mask_taus"]:  # the logged GraMa-inactive share
            share = metrics.grama_inactive_ratio(jnp.asarray(dz), tau)
            assert float(share) == pytest.approx(float(np.mean(eq2 <= tau)), abs=1e-7)


@pytest.mark.parametrize("case", ["mlp", "ln"])
def test_grama_reference_score_is_the_weight_gradients_row_mean(grama, case):
    """The reference's ``grad_magnitude``: mean_j |dL/dW_ij| = mean_j |sum_b dL/dz_bi x_bj| for a Linear, |dL/dgain_i|
    for a LayerNorm, from the fixture's own gradients and inputs, and (plain critic) from our own probes."""
    fx = grama["fx"]
    for name in grama["meta"]["layers"][case]:
        gm, w_grad, inp = (
            fx[f"{case}/grad_magnitude/{name}"],
            fx[f"{case}/grads/{name}.weight"],
            grama["inputs"][case][name],
        )
        if name.startswith("ln"):
            np.testing.assert_array_equal(gm, np.abs(w_grad))
            xhat = (inp - inp.mean(1, keepdims=True)) / np.sqrt(inp.var(1, keepdims=True) + grama["meta"]["ln_eps"])
            np.testing.assert_allclose(gm, np.abs((fx[f"ln/out_grads/{name}"] * xhat).sum(0)), rtol=RTOL, atol=ATOL)
            continue
        np.testing.assert_allclose(gm, np.abs(w_grad).mean(1), rtol=RTOL, atol=0.0, err_msg=name)
        if case == "mlp":
            dz = fx[f"mlp/out_grads/{name}"].astype(np.float64)
            np.testing.assert_allclose(gm, np.abs(dz.T @ inp).mean(1), rtol=RTOL, atol=ATOL, err_msg=name)
    # the same formulas on our own probes: dL/dz at each tap with the layer's input (mlp), or with the normalised
    # input x_hat (ln, from the LayerNorm's recorded input)
    c, loss = grama["cases"][case], _grama_loss(grama, case)
    acts, pre = instrument.activation_grads(lambda: loss(c["params"]), ["critic"], at="pre")
    inputs = [np.asarray(grama["x"])] + [np.asarray(acts["critic"][f"layer{i}"]) for i in range(2)]
    for i, name in enumerate(GRAMA_TAPS[case]):
        dz, gm = np.asarray(pre["critic"][f"layer{i}"], np.float64), fx[f"{case}/grad_magnitude/{name}"]
        if case == "ln":
            inp = grama["inputs"]["ln"][name]
            xhat = (inp - inp.mean(1, keepdims=True)) / np.sqrt(inp.var(1, keepdims=True) + grama["meta"]["ln_eps"])
            np.testing.assert_allclose(np.abs((dz * xhat).sum(0)), gm, rtol=RTOL, atol=ATOL, err_msg=name)
        else:
            np.testing.assert_allclose(np.abs(dz.T @ inputs[i]).mean(1), gm, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("case", ["mlp", "ln"])
def test_regrama_normalisation_and_threshold_masks_match_reference_given_its_scores(grama, case):
    """Given the reference's ``grad_magnitude``: our normalisation (``grama_scores`` of it as one row) is its
    ``normalized_grad``, and ``resets.select`` at each tau is its threshold mask, layer by layer (the head's one
    unit normalises to 1 and is never flagged, in either)."""
    fx, taus = grama["fx"], grama["meta"]["mask_taus"]
    for name in grama["meta"]["layers"][case]:
        gm, ref = fx[f"{case}/grad_magnitude/{name}"], fx[f"{case}/normalized/{name}"]
        np.testing.assert_allclose(metrics.grama_scores(jnp.asarray(gm)[None, :]), ref, rtol=RTOL, atol=ATOL)
        for tau in taus:
            got = np.asarray(resets.select(jnp.asarray(ref), tau))
            np.testing.assert_array_equal(got, _grama_mask(grama, case, name, tau), err_msg=f"{name} {tau}")
        if name == "fc_out":
            assert ref.shape == (1,) and not fx[f"{case}/masks/threshold/fc_out"].any()
    # what the taus exercise: the dead units (and nothing else) at tau = 0, more units at each larger tau
    counts = [sum(int(_grama_mask(grama, case, n, t).sum()) for n in GRAMA_TAPS[case]) for t in taus]
    assert counts[0] == len(GRAMA_TAPS[case]) and counts == sorted(counts) and counts[-1] > counts[1]


def test_regrama_capped_masks_match_reference_hybrid_and_percentage_modes(grama):
    """``select(scores, tau, max_fraction)`` against the reference's ``hybrid`` mode (threshold, then at most
    max_percentage of the layer, lowest first) and, with no threshold, its ``percentage`` mode (the k lowest)."""
    fx, meta = grama["fx"], grama["meta"]
    row = {mode: i for i, mode in enumerate(meta["capped_modes"])}
    for name in GRAMA_TAPS["mlp"]:
        ref, capped = jnp.asarray(fx[f"mlp/normalized/{name}"]), fx[f"mlp/masks/capped/{name}"]
        got = resets.select(ref, meta["hybrid"]["tau"], meta["hybrid"]["max_percentage"] / 100)
        np.testing.assert_array_equal(np.asarray(got), capped[row["hybrid"]], err_msg=name)
        assert capped[row["hybrid"]].sum() < _grama_mask(grama, "mlp", name, meta["hybrid"]["tau"]).sum()  # it binds
        got = resets.select(ref, np.inf, meta["percentage"] / 100)
        np.testing.assert_array_equal(np.asarray(got), capped[row["percentage"]], err_msg=name)
    # the reference's percentage mode always flags a one-unit layer (its k is max(1, int(1 x 0.25))): the head
    assert fx["mlp/masks/capped/fc_out"][row["percentage"]].tolist() == [True]


def test_regrama_small_layer_cap_differs_from_reference(grama):
    """Deliberate difference 4: the reference's cap is max(1, int(H p)), ours int(H p).  At the paper's SAC setting
    (tau 0, at most 5%) a 16-unit layer's dead unit is reset by the reference and by none of ours (int(0.8) = 0)."""
    fx, meta = grama["fx"], grama["meta"]
    tau, cap = meta["hybrid_sac"]["tau"], meta["hybrid_sac"]["max_percentage"] / 100
    for name in GRAMA_TAPS["mlp"]:
        ref = fx[f"mlp/masks/capped/{name}"][meta["capped_modes"].index("hybrid_sac")]
        np.testing.assert_array_equal(ref, _grama_mask(grama, "mlp", name, 0.0))  # the dead unit, one per layer
        assert ref.sum() == 1
        scores = jnp.asarray(fx[f"mlp/normalized/{name}"])
        assert not np.asarray(resets.select(scores, tau, cap)).any()
        np.testing.assert_array_equal(np.asarray(resets.select(scores, tau, 1 / 16)), ref)  # a cap of one unit agrees


@pytest.mark.parametrize("case", ["mlp", "ln"])
def test_grama_eq2_and_reference_score_disagreement_is_as_measured(grama, case):
    """How many units the two scores classify differently at each tau (docs/fidelity.md, GraMa, difference 1)."""
    fx, scores, taus = grama["fx"], _grama_zoo_scores(grama, case), grama["meta"]["mask_taus"]
    for tau, want, want_linear in zip(taus, GRAMA_DISAGREE[case], GRAMA_DISAGREE["ln_linear"]):
        ours = [np.asarray(resets.select(scores[f"layer{i}"], tau)) for i in range(len(GRAMA_TAPS[case]))]
        diff = sum(int((m != _grama_mask(grama, case, n, tau)).sum()) for m, n in zip(ours, GRAMA_TAPS[case]))
        assert diff == want, (tau, diff)
        if case == "ln":  # against the reference's masks of the Linear before each LayerNorm
            linear = sum(int((m != _grama_mask(grama, "ln", n, tau)).sum()) for m, n in zip(ours, GRAMA_LINEARS["ln"]))
            assert linear == want_linear, (tau, linear)
    if case == "mlp":  # the population measurement quoted in docs/fidelity.md
        population = [fx[f"population/{k}"].mean(0) for k in ("ref_flagged", "eq2_flagged", "disagree")]
        for i, tau in enumerate(taus):
            assert tuple(round(float(p[i]), 2) for p in population) == GRAMA_POPULATION[tau], tau


def _grama_adam(g, case):
    """optax Adam state with the reference's moments (those it did not record: 0) and count 3."""
    c = g["cases"][case]
    state = optax.adam(3e-4).init(c["params"])
    mu, nu = (load_into(c["params"], c["ours"]("inputs/adam/{p}/" + m, default=0.0)) for m in ("exp_avg", "exp_avg_sq"))
    return (state[0]._replace(count=jnp.asarray(3, jnp.int32), mu=mu, nu=nu), *state[1:])


def test_regrama_reset_matches_reference_given_the_same_masks_and_fresh_weights(grama):
    """The reference's reset at tau = 0.1 (LeCun option: flagged rows redrawn, their biases 0, the Adam moments of
    both zeroed) against ``resets.reset_neurons`` given its masks and its draws (the sentinel elsewhere, as in the
    ReDo test).  Deliberate difference 3: ours also zeroes the flagged units' outgoing rows and their moments."""
    fx, c, tau = grama["fx"], grama["cases"]["mlp"], grama["meta"]["tau"]
    taps, linears = GRAMA_TAPS["mlp"], GRAMA_LINEARS["mlp"]
    masks = {f"layer{i}": jnp.asarray(_grama_mask(grama, "mlp", n, tau)) for i, n in enumerate(taps)}
    assert all(int(m.sum()) >= 2 for m in masks.values()) and not _grama_mask(grama, "mlp", "fc_out", tau).any()
    ref_p, before = c["ours"]("reset/{p}"), c["ours"]("inputs/{p}")
    fresh = {k: np.full_like(v, SENTINEL) for k, v in before.items()}
    for i in range(len(taps)):
        k, m = ("trunk", "layers", i, "kernel"), np.asarray(masks[f"layer{i}"])
        fresh[k][:, m] = ref_p[k][:, m]
    fresh_tree = load_into(c["template"], fresh)
    net = dataclasses.replace(c["net"], initializer=lambda params, key: fresh_tree)
    reset = jax.jit(lambda p, o: resets.reset_neurons(net, p, o, masks, jax.random.key(0), True))
    new_p, new_opt = reset(c["params"], _grama_adam(grama, "mlp"))
    adam = new_opt[0]
    assert int(adam.count) == 3

    ref_mu, ref_nu = c["ours"]("reset/adam/{p}/exp_avg"), c["ours"]("reset/adam/{p}/exp_avg_sq")
    old_mu = c["ours"]("inputs/adam/{p}/exp_avg")
    got_mu, got_nu = flat(adam.mu), flat(adam.nu)
    for path, value in flat(new_p).items():
        want = [ref_p[path], ref_mu[path], ref_nu[path]]
        if path[-1] == "kernel" and path != ("trunk", "layers", 0, "kernel"):
            i = len(taps) if path[0] == "out" else path[2]
            rows = np.asarray(masks[f"layer{i - 1}"])  # the flagged units of the layer below: outgoing rows
            cols = np.asarray(masks[f"layer{i}"]) if path[0] == "trunk" else np.zeros(want[0].shape[1], bool)
            # the reference leaves them and their moments as they were (but in the columns it redrew)
            np.testing.assert_array_equal(want[0][rows][:, ~cols], before[path][rows][:, ~cols])
            np.testing.assert_array_equal(want[1][rows][:, ~cols], old_mu[path][rows][:, ~cols])
            want = [np.where(rows[:, None], 0.0, w) for w in want]
        np.testing.assert_array_equal(value, want[0], err_msg=str(path))
        np.testing.assert_array_equal(got_mu[path], want[1], err_msg=f"mu {path}")
        np.testing.assert_array_equal(got_nu[path], want[2], err_msg=f"nu {path}")
    for i, name in enumerate(linears[:-1]):  # the flagged biases: 0 in both, their moments zeroed in both
        m, b = np.asarray(masks[f"layer{i}"]), ("trunk", "layers", i, "bias")
        assert np.all(ref_p[b][m] == 0.0) and np.all(ref_mu[b][m] == 0.0) and np.all(ref_nu[b][m] == 0.0)
        assert np.all(c["ours"]("inputs/{p}")[b][m] != 0.0)
    # difference 2, the reference's default (kaiming, as its main.py runs it): the same rows redrawn, the flagged
    # biases drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), not zeroed; the other biases and the head untouched
    for i, name in enumerate(linears[:-1]):
        m = np.asarray(masks[f"layer{i}"])
        np.testing.assert_array_equal(fx[f"mlp/kaiming/rows_changed/{name}"], m)
        kb, fan_in = fx[f"mlp/kaiming/{name}.bias"], fx[f"mlp/inputs/{name}.weight"].shape[1]
        np.testing.assert_array_equal(kb[~m], fx[f"mlp/inputs/{name}.bias"][~m])
        assert np.all(kb[m] != 0.0) and np.all(np.abs(kb[m]) <= 1 / np.sqrt(fan_in))
    assert bool(fx["mlp/kaiming/fc_out_untouched"])
    # difference 3's effect on this batch (mean |Q| 0.57): the reference's fresh units reach Q through their old
    # outgoing weights (mean |dQ| 0.21); ours only lose what the flagged units contributed before (0.014)
    q0, q_ref, q_ours = (
        np.asarray(c["net"](p, grama["x"])) for p in (c["params"], load_into(c["template"], ref_p), new_p)
    )
    assert np.abs(q_ref - q0).mean() == pytest.approx(0.2126, abs=1e-3)
    assert np.abs(q_ours - q0).mean() == pytest.approx(0.01425, abs=1e-4)


def test_regrama_layernorm_reset_matches_reference_given_its_masks(grama):
    """LayerNorm units flagged by the reference's masks of its LayerNorm layers: gain 1, bias 0 and their Adam
    moments zeroed, in both (``reset_norm``).  The reference's default init raises on a LayerNorm (its 1-D weight
    has no fan-in), so only its LeCun option runs there."""
    c, tau = grama["cases"]["ln"], grama["meta"]["tau"]
    masks = {f"layer{i}": jnp.asarray(_grama_mask(grama, "ln", n, tau)) for i, n in enumerate(GRAMA_TAPS["ln"])}
    assert all(int(m.sum()) >= 1 for m in masks.values())
    reset = jax.jit(lambda p, o: resets.reset_neurons(c["net"], p, o, masks, jax.random.key(0), True))
    new_p, new_opt = reset(c["params"], _grama_adam(grama, "ln"))
    ref = [c["ours"](f, default=np.nan) for f in ("reset/{p}", "reset/adam/{p}/exp_avg", "reset/adam/{p}/exp_avg_sq")]
    before = c["ours"]("inputs/{p}")
    for i, tap in enumerate(GRAMA_TAPS["ln"]):
        m = np.asarray(masks[f"layer{i}"])
        for leaf in ("scale", "bias"):
            path = ("trunk", "norms", i, leaf)
            for got, want in zip((new_p, new_opt[0].mu, new_opt[0].nu), ref):
                np.testing.assert_array_equal(flat(got)[path], want[path], err_msg=str(path))
            assert np.all(before[path][m] != ref[0][path][m])  # the flagged units did change
    assert "fan" in grama["meta"]["kaiming_error"]["ln"].lower()
