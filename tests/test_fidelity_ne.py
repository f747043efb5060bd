"""Neuroplastic Expansion against its official code, number by number (docs/fidelity.md).

``tests/fixtures/ne_reference.npz`` (generator ``scripts/fidelity/ne_reference.py``): torressliu/neuroplastic-
expansion's ``STL_Scheduler`` (Liu et al., ICLR 2025), built as its ``stl/TD3.py`` builds it with ``train.py``'s
defaults, on its own ``MLPActor`` 4 -> 32 -> 32 -> 2 with fixed weights, fixed dense gradients fed through its
gradient hooks and a fixed stand-in for training between events, over a 40k-update run (delta 100): ER
densities and initial mask counts (three actor shapes), the initial masks, every event's n_grow / n_prune
per layer (read from ``_dst_step``'s locals), the active connections after each event, and four events in
full (first growth event, last growth event, first and second DST events): weights, masks and gradient
before, weights and masks after.  Plus three events of a 20 -> 256 -> 256 -> 1 actor whose first layer has
a negative initial space, and Adam's ``step`` after the first event.

The zoo functions run are the ones the training loop runs: ``optim.er_densities`` / ``initial_counts`` /
``masked(...).init`` (the masks the optimizer starts from), ``expansion.plan`` and ``expansion.Schedule.step``
(the host-side counts ``Hooks.after_updates`` passes) and ``expansion.update_topology`` (what ``ne_step``
calls), jitted.

No seam: the reference makes no random draw, and every function above runs unpatched.

Tolerances: every count, mask and weight exactly (the event only selects and zeroes weights; no arithmetic);
ER densities ``rtol 1e-12`` (float64 on both sides).

Deliberate differences, each asserted as such:

1. The last growth event is clipped so the network lands on the target (round(0.75 n) active); the
   reference's last event is a full one and overshoots (here by 2 connections).  The DST comparison then
   starts both from the reference's counts at the end of growth.
2. A layer whose initial space 0.8 n - n_ones is negative: the zoo clips it at 0 (no growth); the reference
   computes negative n_grow / n_prune, and a negative n_prune keeps |n_prune| extra connections each event
   (picked among zero weights by ``torch.topk``'s tie order).
3. Adam: the zoo zeroes the moments of pruned and newly grown connections and never touches Adam's count;
   the reference leaves the moments alone but resets the kernels' Adam ``step`` to 0 at every growth event
   (``_reset_adam_moments``, run because ``use_simple_metric=False``; recorded, not reproduced).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from plasticity_zoo.plasticity import expansion, optim

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def fx():
    with np.load(FIXTURES / "ne_reference.npz") as f:
        out = {k: f[k] for k in f.files}
    out["meta"] = json.loads(str(out["meta"]))
    return out


def _shapes(dims):
    """(fan_in, fan_out) of MLPActor(obs, act, hidden)'s l1, l2, l3."""
    obs, act, hidden = (int(x) for x in dims)
    return [(obs, hidden), (hidden, hidden), (hidden, act)]


def _tree(kernels, biases=None):
    """A plain MLP param tree layers/<i>/{kernel, bias} (torch [out, in] weights -> flax [in, out] kernels)."""
    return {
        "layers": {
            i: {
                "kernel": jnp.asarray(np.asarray(w).T, jnp.float32),
                "bias": jnp.zeros(w.shape[0], jnp.float32) if biases is None else jnp.asarray(biases[i]),
            }
            for i, w in enumerate(kernels)
        }
    }


def _zeros(shapes):
    return _tree([np.zeros((o, i), np.float32) for i, o in shapes])


# ----------------------------------------------------------------------------- ER densities, initial masks
def test_er_densities_match_reference(fx):
    for i in range(len(fx["meta"]["er_shapes"])):
        d = optim.er_densities(_shapes(fx[f"er/{i}/dims"]), fx["meta"]["initial"])
        np.testing.assert_allclose(d, 1.0 - fx[f"er/{i}/S"], rtol=1e-12, err_msg=str(fx[f"er/{i}/dims"]))


def test_er_initial_counts_match_reference(fx):
    for i in range(len(fx["meta"]["er_shapes"])):
        shapes = _shapes(fx[f"er/{i}/dims"])
        assert optim.initial_counts(_zeros(shapes), fx["meta"]["initial"]) == list(fx[f"er/{i}/n_ones"]), shapes


def test_initial_masks_are_the_references_top_magnitude_weights(fx):
    layers = fx["meta"]["layers"]
    params = _tree([fx[f"init/{n}.weight"] for n in layers], [fx[f"init/{n}.bias"] for n in layers])
    masks = [m for m in optim.find_masked(optim.masked(optax.adam(3e-4), 0.8).init(params)).masks if m is not None]
    assert len(masks) == len(layers)
    for m, name in zip(masks, layers):
        np.testing.assert_array_equal(np.asarray(m), fx[f"init/{name}.mask"].T, err_msg=name)


# ----------------------------------------------------------------------------- the host-side schedule
def _schedule(fx, dims, total):
    plan = expansion.plan(_zeros(_shapes(dims)), fx["meta"]["initial"], "reference")
    return plan, expansion.Schedule({"actor": plan}, total, fx["meta"]["target"], "uniform", "magnitude")


def test_schedule_counts_match_reference_event_by_event(fx):
    meta, counts, ones = fx["meta"], fx["events/counts"], fx["events/n_ones"]
    plan, sched = _schedule(fx, fx["er/0/dims"], meta["t_end"])
    last = meta["growth_events"]  # the reference's last growth event (1-based)
    assert plan.n_ones == list(fx["er/0/n_ones"]) and not any(plan.dense)
    # n_init_space = 0.8 n_total - n_ones (the reference keeps it unclipped; here all are > 0 but the head's)
    np.testing.assert_allclose(np.maximum(fx["events/n_init_space"], 0.0), plan.init_space, rtol=1e-12)
    assert fx["events/n_init_space"][2] < 0 and plan.init_space[2] == 0.0 and counts[0, 2].tolist() == [0, 0]
    for e in range(1, meta["events"] + 1):
        t = e * meta["delta"]
        assert plan.growing == (e <= last), e  # growth ends at the same event
        assert not fx["events/end_grow"][e - 1] == (e <= last), e
        grow, prune, magnitude = sched.step(t)["actor"]
        assert bool(magnitude)
        if e == last:
            # difference 1: the zoo's last growth event lands on the target, the reference's overshoots
            target = round((1 - meta["target"]) * plan.total)
            assert plan.active == target < int(ones[e - 1].sum()), (plan.active, ones[e - 1])
            assert np.all(grow <= counts[e - 1, :, 0]) and np.all(prune <= counts[e - 1, :, 1])
            plan.n_ones = [int(n) for n in ones[e - 1]]  # DST from the reference's state at the end of growth
            continue
        np.testing.assert_array_equal(grow, counts[e - 1, :, 0], err_msg=f"grow, event {e} (t = {t})")
        np.testing.assert_array_equal(prune, counts[e - 1, :, 1], err_msg=f"prune, event {e} (t = {t})")
        assert plan.n_ones == ones[e - 1].tolist(), e
    assert counts[last:, 1, 1].max() > counts[-1, 1, 1] > 0  # the DST cosine moved the counts


def test_negative_initial_space_is_clipped_where_the_reference_grows_by_negative_counts(fx):
    """Difference 2 on a (20, 1, 256) actor: layer 0 (ER density 0.95) has 0.8 n - n_ones < 0; its other
    sparse layer's counts are the reference's."""
    meta = fx["meta"]
    plan, sched = _schedule(fx, fx["er/2/dims"], meta["t_end"])
    space = fx["negative/n_init_space"]
    assert space[0] < -125 and plan.init_space[0] == 0.0 and plan.dense == [False, False, True]
    np.testing.assert_allclose(plan.init_space[1], space[1], rtol=1e-12)
    for e in range(1, meta["negative_events"] + 1):
        grow, prune, _ = sched.step(e * meta["delta"])["actor"]
        ref = fx["negative/counts"][e - 1]
        assert ref[0].tolist() == [int(0.008 * space[0]), int(0.4 * int(0.008 * space[0]))] == [-6, -2]
        assert (grow[0], prune[0]) == (0, 0)
        assert (grow[1], prune[1]) == tuple(ref[1])
        assert plan.n_ones[1] == fx["negative/n_ones"][e, 1]
        # the reference's layer 0 gains -n_prune = 2 connections per event; the zoo's stays at its initial count
        assert fx["negative/n_ones"][e, 0] - fx["negative/n_ones"][e - 1, 0] == 2
        assert plan.n_ones[0] == fx["negative/n_ones"][0, 0]


# ----------------------------------------------------------------------------- one event on device
_update = jax.jit(expansion.update_topology)


def _event(fx, tag):
    layers, pre = fx["meta"]["layers"], f"detail/{tag}"
    params = _tree([fx[f"{pre}/before/{n}.weight"] for n in layers])
    grads = _tree([fx[f"{pre}/grad/{n}.weight"] for n in layers])
    state = optim.masked(optax.adam(3e-4), 0.8).init(params)
    ms = optim.find_masked(state)
    masks = iter([jnp.asarray(fx[f"{pre}/before/{n}.mask"].T) for n in layers])
    adam = ms.inner[0]
    # moments that are not zero (as after training), so that zeroing shows; count as after 1000 steps
    ones = jax.tree.map(jnp.ones_like, params)
    inner = (adam._replace(count=jnp.asarray(1000, jnp.int32), mu=ones, nu=ones), *ms.inner[1:])
    state = optim.replace_masked(
        state, optim.MaskedState(tuple(None if m is None else next(masks) for m in ms.masks), inner)
    )
    e = int(fx[f"{pre}/event"])
    grow, prune = fx["events/counts"][e - 1, :, 0], fx["events/counts"][e - 1, :, 1]
    new_p, new_state, stats = _update(
        params, state, grads, grow.astype(np.int32), prune.astype(np.int32), np.bool_(True)
    )
    return params, state, new_p, new_state, stats, grow, prune


@pytest.mark.parametrize("tag", ["first", "last_growth", "first_dst", "second_dst"])
def test_event_masks_and_weights_match_reference(fx, tag):
    """One event with the reference's counts: pruned = the n_prune smallest |w| among the active, grown = the
    n_grow largest |dense grad| among the rest (just-pruned included), new weights 0, the rest untouched."""
    layers = fx["meta"]["layers"]
    params, state, new_p, new_state, stats, grow, prune = _event(fx, tag)
    new_masks = [m for m in optim.find_masked(new_state).masks if m is not None]
    adam = optim.find_masked(new_state).inner[0]
    assert int(adam.count) == 1000  # difference 3: the reference resets its kernels' Adam step
    for i, name in enumerate(layers):
        before = fx[f"detail/{tag}/before/{name}.mask"].T
        after = fx[f"detail/{tag}/after/{name}.mask"].T
        np.testing.assert_array_equal(np.asarray(new_masks[i]), after, err_msg=f"{tag} {name} mask")
        np.testing.assert_array_equal(
            np.asarray(new_p["layers"][i]["kernel"]),
            fx[f"detail/{tag}/after/{name}.weight"].T,
            err_msg=f"{tag} {name} weight",
        )
        np.testing.assert_array_equal(np.asarray(new_p["layers"][i]["bias"]), 0.0)
        assert int(after.sum()) == int(before.sum()) + int(grow[i]) - int(prune[i])
        # difference 3: the moments of connections that changed state are zeroed, the rest kept
        changed = before != after
        for moment in (adam.mu, adam.nu):
            np.testing.assert_array_equal(np.asarray(moment["layers"][i]["kernel"]), np.where(changed, 0.0, 1.0))
    n_total = sum(int(m.size) for m in new_masks)
    assert abs(float(stats["sparsity"]) - (1 - sum(int(m.sum()) for m in new_masks) / n_total)) < 1e-6


def test_reference_facts_the_comparison_relies_on(fx):
    """The fixture covers what it should: just-pruned connections regrown at once (DST), grown weights at 0,
    Adam's step reset by the reference at a growth event (difference 3)."""
    assert fx["detail/first_dst/regrown"].sum() > 0 and fx["detail/second_dst/regrown"].sum() > 0
    for tag in fx["meta"]["detail"]:
        for name in fx["meta"]["layers"]:
            before, after = fx[f"detail/{tag}/before/{name}.mask"], fx[f"detail/{tag}/after/{name}.mask"]
            w = fx[f"detail/{tag}/after/{name}.weight"]
            assert np.all(w[after & ~before] == 0.0) and np.all(w[~after] == 0.0)
    np.testing.assert_array_equal(fx["adam/step_after_first_event"], [0.0, 1000.0] * 3)
    assert fx["adam/exp_avg_unchanged"].all()
