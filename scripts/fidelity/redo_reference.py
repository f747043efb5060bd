"""Fixture generator: ReDo's dormant-neuron scores, tau masks and neuron reset from the official code.

Runs the *official* ReDo code on fixed weights, a fixed batch, fixed Adam moments and a fixed key, and
writes inputs and outputs to ``tests/fixtures/redo_reference.npz``, which
``tests/test_fidelity_interventions.py`` compares against ``plasticity/resets.py`` and
``plasticity/metrics.py`` without the reference installed.

Reference (read from a fetched snapshot, never copied into this repository): google/dopamine,
``dopamine/labs/redo/weight_recyclers.py`` (Sokar et al. 2023, "The Dormant Neuron Phenomenon in Deep
RL").  Its ``NeuronRecycler`` class (with its ``BaseRecycler`` base and the module's helper functions)
runs as it stands: ``estimate_neuron_score`` for the scores, ``_score2mask`` for the tau masks, and
``recycle_dead_neurons`` (``init_method_outgoing='zero'``, no weight scaling: the ReDo paper's setting)
for the reset of params and Adam moments.  ``IdentityLayer`` is taken from ``dopamine/labs/redo/
networks.py``; the rest of that module (Atari conv nets, ``atari_lib``) is not executed.

The network is a small dense ReLU MLP written here in the reference's convention (flax linen ``Dense_i``
layers, each followed by ``IdentityLayer(name=f'{layer.name}_act')``, output ``final_layer``); the
intermediates are captured as ``RecycledDQNAgent.get_intermediates`` does (``capture_intermediates`` on
layers whose name contains ``act``, ``jax.vmap`` over the batch).  Hidden units are set up so that each
hidden layer has one dead unit (score 0), one unit under tau and one between 0.025 and tau; every score
is asserted at least 1e-3 away from each tau checked.

Usage, in a venv of its own with the reference's JAX stack (never the project's venv)::

    python3 -m venv /tmp/redovenv
    /tmp/redovenv/bin/pip install jax==0.10.2 flax==0.12.8 optax==0.2.8 gin-config numpy
    /tmp/redovenv/bin/python scripts/fidelity/redo_reference.py --dopamine /work/.mirror/google+dopamine/repo

``--dopamine``: a git directory (bare or work tree) of the fetched snapshot; the files are read at
``HEAD`` with ``git show`` and the commit is recorded in the fixture.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from snapshot import fixture_path, load_definitions, read_snapshot

RECYCLERS_FILE = "dopamine/labs/redo/weight_recyclers.py"
NETWORKS_FILE = "dopamine/labs/redo/networks.py"
OBS_DIM, WIDTH, DEPTH, OUT_DIM, BATCH = 4, 16, 3, 2, 32
TAU = 0.1  # the reset's threshold (the zoo's default is 0.025; 0.1 flags more units in a 16-wide layer)
MASK_TAUS = (0.0, 0.025, 0.1)  # masks recorded at the zoo's logged taus (plasticity/metrics.py DORMANT_TAUS)
KEY_SEED = 42
LAYERS = [f"Dense_{i}" for i in range(DEPTH)] + ["final_layer"]


def make_mlp(identity_layer):
    """A dense ReLU MLP in the reference's naming convention (``ScalableNatureDQNNetwork``'s dense part)."""

    class DenseMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(DEPTH):
                layer = nn.Dense(WIDTH, name=f"Dense_{i}")
                x = nn.relu(layer(x))
                x = identity_layer(name=f"{layer.name}_act")(x)
            layer = nn.Dense(OUT_DIM, name="final_layer")
            return identity_layer(name=f"{layer.name}_act")(layer(x))

    return DenseMLP()


def get_intermediates(net, params, batch):
    """As ``RecycledDQNAgent.get_intermediates``: per-sample apply under ``jax.vmap``, capturing the
    outputs of the layers whose name contains ``act``."""

    def apply_data(x):
        filter_rep = lambda l, _: l.name is not None and "act" in l.name  # noqa: E731,E741
        return net.apply(params, x, capture_intermediates=filter_rep, mutable=["intermediates"])

    _, state = jax.vmap(apply_data)(batch)
    return state["intermediates"]


def weights(rng, x):
    """Random weights with, in each hidden layer, unit 1 dead (score 0), unit 5 scaled to score ~0.04 and
    unit 9 to ~0.06 (under tau = 0.1; 0.04 and 0.06 straddle nothing else), unit 12 to ~0.3."""
    targets = {1: 0.0, 5: 0.04, 9: 0.06, 12: 0.3}
    p, h, dims = {}, x, [OBS_DIM] + [WIDTH] * DEPTH
    for i in range(DEPTH):
        k = rng.normal(size=(dims[i], WIDTH)) / np.sqrt(dims[i])
        b = rng.normal(size=WIDTH) * 0.1
        for unit, target in targets.items():
            if target == 0.0:
                k[:, unit], b[unit] = 0.0, -1.0
                continue
            b[unit] = 0.5  # active on every sample before scaling
            acts = np.maximum(h @ k + b, 0.0)
            m = np.abs(acts).mean(0)
            others = (m.sum() - m[unit]) / WIDTH
            # s = c m_u / (others + c m_u / H) = target  ->  c = target others / (m_u (1 - target / H))
            c = target * others / (m[unit] * (1 - target / WIDTH))
            k[:, unit], b[unit] = k[:, unit] * c, b[unit] * c
        h = np.maximum(h @ k + b, 0.0)
        p[f"Dense_{i}"] = {"kernel": k, "bias": b}
    p["final_layer"] = {
        "kernel": rng.normal(size=(WIDTH, OUT_DIM)) / np.sqrt(WIDTH),
        "bias": rng.normal(size=OUT_DIM) * 0.1,
    }
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), {"params": p})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dopamine", required=True, help="git dir of the fetched google/dopamine snapshot")
    ap.add_argument("--out", default=fixture_path("redo_reference.npz"))
    a = ap.parse_args()
    rec_src, commit = read_snapshot(a.dopamine, RECYCLERS_FILE)
    net_src, _ = read_snapshot(a.dopamine, NETWORKS_FILE)
    ref = load_definitions(
        rec_src,
        RECYCLERS_FILE,
        {
            "leastk_mask",
            "reset_momentum",
            "weight_reinit_zero",
            "weight_reinit_random",
            "_weight_normalization_per_neuron_norm",
            "_get_norm_per_neuron",
            "BaseRecycler",
            "NeuronRecycler",
        },
    )
    identity_layer = load_definitions(net_src, NETWORKS_FILE, {"IdentityLayer"})["IdentityLayer"]

    rng = np.random.default_rng(7)
    x = np.asarray(rng.normal(size=(BATCH, OBS_DIM)), np.float32)
    net = make_mlp(identity_layer)
    params = weights(rng, x)
    # the network's own init gives the same tree structure (checked), so the reference sees a real flax tree
    init = net.init(jax.random.PRNGKey(0), x[0])
    assert jax.tree.structure(init) == jax.tree.structure(params), (jax.tree.structure(init),)
    # Adam state as the reference's agent holds it (optax.adam's chain: (ScaleByAdamState, EmptyState)),
    # with moments that are not zero, so that zeroing shows
    # FrozenDicts, as flax's init returned when the reference was written (it freezes its params and masks,
    # and maps them together with the optimizer's moments, so these must be FrozenDicts too)
    params = flax.core.freeze(params)
    opt_state = optax.adam(6.25e-5).init(params)
    mu = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    nu = jax.tree.map(lambda p: jnp.asarray(rng.uniform(0.1, 1.0, size=p.shape), jnp.float32), params)
    opt_state = (optax.ScaleByAdamState(jnp.asarray(3, jnp.int32), mu=mu, nu=nu), *opt_state[1:])

    intermediates = get_intermediates(net, params, jnp.asarray(x))
    acts = flax.traverse_util.flatten_dict(intermediates, sep="/")
    recycler = ref["NeuronRecycler"](LAYERS, dead_neurons_threshold=TAU, init_method_outgoing="zero")
    out = {"inputs/x": x}
    for path, leaf in flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/").items():
        out[f"inputs/{path}"] = np.asarray(leaf)
    for name, tree in (("mu", mu), ("nu", nu)):
        for path, leaf in flax.traverse_util.flatten_dict(flax.core.unfreeze(tree), sep="/").items():
            out[f"inputs/{name}/{path}"] = np.asarray(leaf)
    for layer in LAYERS[:-1]:
        act = acts[f"{layer}_act/__call__"][0]
        assert act.shape == (BATCH, WIDTH), act.shape
        out[f"acts/{layer}"] = np.asarray(act)
        score = np.asarray(recycler.estimate_neuron_score(act))
        out[f"scores/{layer}"] = score
        for tau in MASK_TAUS:
            gap = np.min(np.abs(score - tau))
            assert gap > 1e-3 or tau == 0.0, (layer, tau, gap)  # no float32 rounding can flip a mask
            recycler.dead_neurons_threshold = tau
            out[f"masks/{tau}/{layer}"] = np.asarray(recycler._score2mask(act, None, None, None))
        recycler.dead_neurons_threshold = TAU

    # signed activations (as a tanh or leaky layer gives; ReLU's are >= 0, where |h| = h hides a missing abs):
    # the reference's score of a fixed (batch, units) array with mixed signs and mostly-negative units
    signed = rng.normal(size=(BATCH, WIDTH)) * rng.uniform(0.01, 2.0, size=WIDTH) - rng.uniform(0, 1.5, size=WIDTH)
    out["signed/acts"] = signed.astype(np.float32)
    out["signed/scores"] = np.asarray(recycler.estimate_neuron_score(jnp.asarray(out["signed/acts"])))

    key = jax.random.PRNGKey(KEY_SEED)
    new_params, new_opt = recycler.recycle_dead_neurons(intermediates, params, key, opt_state)
    # the raw redraws (before the outgoing zeroing): the reference's own weight_reinit_random with an all-ones
    # mask and the per-layer keys its create_masks splits from the same key
    _, _, in_keys, _, _ = recycler.create_masks(flax.traverse_util.flatten_dict(params, sep="/"), acts, key)
    for layer in LAYERS[:-1]:
        kernel = params["params"][layer]["kernel"]
        out[f"draws/{layer}/kernel"] = np.asarray(
            ref["weight_reinit_random"](kernel, jnp.ones_like(kernel), in_keys[f"params/{layer}/kernel"])
        )
    for path, leaf in flax.traverse_util.flatten_dict(flax.core.unfreeze(new_params), sep="/").items():
        out[f"reset/{path}"] = np.asarray(leaf)
    for name, tree in (("mu", new_opt[0].mu), ("nu", new_opt[0].nu)):
        for path, leaf in flax.traverse_util.flatten_dict(flax.core.unfreeze(tree), sep="/").items():
            out[f"reset/{name}/{path}"] = np.asarray(leaf)
    assert int(new_opt[0].count) == 3
    # the redrawn incoming columns differ from the old ones (a draw, not a copy; the entries that stay equal
    # are 0 = 0, where a dead unit's zero column meets the previous layer's zeroed outgoing rows)
    for layer in LAYERS[:-1]:
        m = out[f"masks/{TAU}/{layer}"]
        old, new = out[f"inputs/params/{layer}/kernel"][:, m], out[f"reset/params/{layer}/kernel"][:, m]
        assert m.sum() >= 2 and np.all((old != new) | (old == 0)), layer
        draw = out[f"draws/{layer}/kernel"][:, m]
        assert np.all((new == draw) | (new == 0)), layer  # the recorded draws are the ones the reset used

    command = "/tmp/redovenv/bin/python scripts/fidelity/redo_reference.py --dopamine " + shlex.quote(a.dopamine)
    meta = {
        "generator": "scripts/fidelity/redo_reference.py",
        "command": command,
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "dopamine": {
            "repository": "https://github.com/google/dopamine",
            "commit": commit,
            "files": [RECYCLERS_FILE, NETWORKS_FILE],
        },
        "call": (
            f"NeuronRecycler({LAYERS}, dead_neurons_threshold={TAU}, init_method_outgoing='zero')"
            f".recycle_dead_neurons(intermediates, params, jax.random.PRNGKey({KEY_SEED}), opt_state); "
            "estimate_neuron_score(act) and _score2mask(act, ...) per hidden layer"
        ),
        "sizes": {"obs": OBS_DIM, "width": WIDTH, "depth": DEPTH, "out": OUT_DIM, "batch": BATCH},
        "tau": TAU,
        "mask_taus": list(MASK_TAUS),
        "layers": LAYERS,
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; dopamine {commit}")
    for layer in LAYERS[:-1]:
        print(layer, np.round(out[f"scores/{layer}"], 4), np.flatnonzero(out[f"masks/{TAU}/{layer}"]))


if __name__ == "__main__":
    main()
