"""Neuroplastic Expansion (plasticity/expansion.py, plasticity/optim.py masks) and the Kron option."""

import csv
import importlib.util
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from plasticity_zoo.buffers import replay
from plasticity_zoo.plasticity import expansion, optim
from plasticity_zoo.plasticity.hooks import check_applicable, check_optimizers
from plasticity_zoo.training.config import NetworkConfig, PlasticityConfig

HAS_KRON = importlib.util.find_spec("psgdax") is not None  # the kron extra (make test installs it)


def _params(key=0, shapes=((3, 8), (8, 8), (8, 2))):
    """A plain MLP-shaped param tree: layers/<i>/{kernel, bias}."""
    keys = jax.random.split(jax.random.key(key), len(shapes))
    return {
        "layers": {
            i: {"kernel": jax.random.normal(k, s), "bias": jnp.zeros(s[1])}
            for i, (k, s) in enumerate(zip(keys, shapes))
        }
    }


def _kron(state):
    return next(
        n
        for n in jax.tree.leaves(state, is_leaf=lambda n: type(n).__name__ == "KronState")
        if type(n).__name__ == "KronState"
    )


def _kernel_masks(state):
    return [m for m in optim.find_masked(state).masks if m is not None]


def test_er_densities_give_overall_sparsity_and_larger_layers_sparser():
    shapes = [(17, 256), (256, 256), (256, 256), (256, 6)]
    d = optim.er_densities(shapes, 0.8)
    n = np.array([i * o for i, o in shapes])
    assert abs(1 - (np.array(d) * n).sum() / n.sum() - 0.8) < 1e-9
    assert d[1] == d[2] < d[0] and d[1] < d[3]  # the big square layers are the sparsest
    # a layer whose density would exceed 1 stays dense and the rest make up for it
    d = optim.er_densities([(4, 16), (16, 16), (16, 1)], 0.8)
    assert d[2] == 1.0 and abs(1 - (np.array(d) * [64, 256, 16]).sum() / 336 - 0.8) < 1e-9
    # the masks the optimizer starts from: the largest |w| of each kernel, per ensemble member
    p = _params(shapes=((2, 17, 64), (2, 64, 64), (2, 64, 1)))
    masks = _kernel_masks(optim.masked(optax.adam(1e-3)).init(p))
    active = sum(m.sum() for m in masks)
    assert abs(1 - active / sum(m.size for m in masks) - 0.8) < 0.005
    for m, (_, leaf) in zip(masks, sorted(p["layers"].items())):
        w = np.abs(np.asarray(leaf["kernel"]))
        for j in range(2):  # each member keeps its own top-|w|
            kept, dropped = w[j][np.asarray(m[j])], w[j][~np.asarray(m[j])]
            assert dropped.size == 0 or kept.min() >= dropped.max()


def test_masked_weights_stay_exactly_zero_under_many_steps():
    p = _params()
    for make in (lambda: optax.adam(1e-2),):  # Kron inside the mask: test_kron_trains_sac_with_finite_losses
        tx = optim.masked(make())
        state = tx.init(p)
        params = optim.apply_mask(state, p)

        @jax.jit
        def step(params, state, key):
            g = jax.tree.map(lambda x: jax.random.normal(key, x.shape), params)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state

        for i in range(30):
            params, state = step(params, state, jax.random.key(i))
        for w, m, w0 in zip(
            [layer["kernel"] for _, layer in sorted(params["layers"].items())],
            _kernel_masks(state),
            [layer["kernel"] for _, layer in sorted(p["layers"].items())],
        ):
            assert np.all(np.asarray(w)[~np.asarray(m)] == 0.0)
            assert np.all(np.asarray(w)[np.asarray(m)] != np.asarray(w0)[np.asarray(m)])  # the active ones learn


@jax.jit
def _adam_stepped(p):
    tx = optim.masked(optax.adam(1e-2))
    state = tx.init(p)
    params = optim.apply_mask(state, p)
    g = jax.tree.map(lambda x: jnp.ones_like(x), params)
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state


def test_growth_picks_the_top_gradient_inactive_connections():
    params, state = _adam_stepped(_params())
    grads = jax.tree.map(lambda x: jax.random.uniform(jax.random.key(3), x.shape), params)
    grow = np.array([5, 7, 2], np.int32)
    new_p, new_state, stats = jax.jit(expansion.update_topology)(
        params, state, grads, grow, np.zeros(3, np.int32), np.bool_(True)
    )
    for i, (old, new) in enumerate(zip(_kernel_masks(state), _kernel_masks(new_state))):
        old, new = np.asarray(old), np.asarray(new)
        g = np.asarray(grads["layers"][i]["kernel"])
        assert np.array_equal(new & old, old)  # nothing pruned
        grown = new & ~old
        assert grown.sum() == grow[i]
        assert g[grown].min() > g[~new].max()  # exactly the largest |g| among the inactive
        w = np.asarray(new_p["layers"][i]["kernel"])
        assert np.all(w[grown] == 0.0) and np.array_equal(w[old], np.asarray(params["layers"][i]["kernel"])[old])
        mu = np.asarray(optim.find_masked(new_state).inner[0].mu["layers"][i]["kernel"])
        assert np.all(mu[grown] == 0.0)
    assert abs(float(stats["grown"]) - grow.sum() / sum(m.size for m in _kernel_masks(state))) < 1e-6


@pytest.mark.parametrize("mode", ["magnitude", "redo"])
def test_pruning_removes_dormant_or_smallest_and_zeroes_their_moments(mode):
    params, state = _adam_stepped(_params())
    grads = jax.tree.map(jnp.zeros_like, params)
    prune = np.array([3, 4, 2], np.int32)
    # layer 1 (leaf index 3: layers/1/{bias, kernel}) has output units 0 and 5 dormant
    dormant = {3: jnp.zeros(8, bool).at[jnp.array([0, 5])].set(True)}
    new_p, new_state, _ = jax.jit(expansion.update_topology)(
        params, state, grads, np.zeros(3, np.int32), prune, np.bool_(mode == "magnitude"), dormant
    )
    inner_old, inner_new = optim.find_masked(state).inner[0], optim.find_masked(new_state).inner[0]
    for i, (old, new) in enumerate(zip(_kernel_masks(state), _kernel_masks(new_state))):
        old, new = np.asarray(old), np.asarray(new)
        w = np.abs(np.asarray(params["layers"][i]["kernel"]))
        pruned = old & ~new
        assert pruned.sum() == prune[i] and not (new & ~old).any()
        if mode == "redo" and i == 1:
            units = np.zeros_like(old)
            units[:, [0, 5]] = True
            first = old & units  # the dormant units' incoming connections go first, then the smallest |w|
            assert 0 < first.sum() < prune[i] and np.all(pruned >= first)
            rest = pruned & ~first
            assert w[rest].max() <= w[old & ~pruned].min()
        else:
            assert w[pruned].max() <= w[old & ~pruned].min()  # the smallest |w| among the active
        assert np.all(np.asarray(new_p["layers"][i]["kernel"])[pruned] == 0.0)
        for moment_old, moment_new in ((inner_old.mu, inner_new.mu), (inner_old.nu, inner_new.nu)):
            a, b = np.asarray(moment_old["layers"][i]["kernel"]), np.asarray(moment_new["layers"][i]["kernel"])
            assert np.all(b[pruned] == 0.0) and np.all(a[pruned] != 0.0) and np.array_equal(a[~pruned], b[~pruned])


def test_cosine_schedule_grows_to_the_target_then_keeps_it():
    """The options --plasticity.ne-schedule cosine --ne-init-space full --ne-prune redo (the zoo's first defaults)."""
    p = _params(shapes=((2, 16, 64), (2, 64, 64), (2, 64, 1)))
    plan = expansion.plan(p, 0.8, "full")
    assert plan.dense == [False, False, True]  # ER density of the 64x1 head exceeds 1
    sched = expansion.Schedule({"critic": plan}, total_updates=1000, target_sparsity=0.25, kind="cosine", prune="redo")
    seen = []
    for t in range(100, 1000, 100):
        grow, prune, magnitude = sched.step(t)["critic"]
        assert np.all(prune <= np.floor(0.4 * grow) + (not plan.growing) * grow)
        seen.append((plan.sparsity, plan.growing, bool(magnitude)))
    assert seen[0][0] < 0.8 and seen[0][1] and not seen[0][2]  # grows, prunes by ReDo
    reached = next(i for i, (_, growing, _) in enumerate(seen) if not growing)  # the last growth event
    assert reached < 4 and all(abs(s - 0.25) < 1e-3 for s, _, _ in seen[reached:])
    assert all(m for _, _, m in seen[reached + 1 :])  # then magnitude-based dynamic sparse training
    uniform = expansion.Schedule({"critic": expansion.plan(p, 0.8, "full")}, 1000, 0.25, kind="uniform")
    g, q, _ = uniform.step(100)["critic"]
    assert list(g[:2]) == [int(0.008 * s) for s in plan.init_space[:2]] and list(q) == [int(0.4 * x) for x in g]


def test_default_schedule_is_the_reference_runs_uniform_growth_from_its_initial_space_event_by_event():
    """Reference (STL_Scheduler defaults, train.py delta 100): n_init_space = 0.8 n_total - n_ones,
    n_grow = int(0.008 n_init_space), n_prune = int(0.4 n_grow), magnitude pruning, every event."""
    cfg = PlasticityConfig(ne=True)
    assert (cfg.ne_every, cfg.ne_schedule, cfg.ne_init_space, cfg.ne_prune, cfg.ne_review, cfg.ne_auto_batch) == (
        100,
        "uniform",
        "reference",
        "magnitude",
        False,
        "auto",
    )
    shapes = ((2, 23, 256), (2, 256, 256), (2, 256, 1))  # a SAC critic ensemble on HalfCheetah (17 + 6 inputs)
    p = _params(shapes=shapes)
    plan = expansion.plan(p, cfg.ne_initial_sparsity, cfg.ne_init_space)
    n_total = [i * o for _, i, o in shapes]
    ones = optim.initial_counts(p, 0.8)
    assert plan.init_space == [max(0.0, 0.8 * t - o) for t, o in zip(n_total, ones)]
    assert plan.init_space[2] == 0.0 and plan.dense[2]  # the 256x1 head: ER keeps it dense
    sched = expansion.Schedule(
        {"critic": plan},
        total_updates=1_000_000,
        target_sparsity=cfg.ne_target_sparsity,
        kind=cfg.ne_schedule,
        prune=cfg.ne_prune,
    )
    grow = [int(0.008 * s) for s in plan.init_space]
    prune = [int(0.4 * g) for g in grow]
    per_event = sum(2 * (g - q) for g, q in zip(grow, prune))
    target = round(0.75 * 2 * sum(n_total))
    active, t, events = 2 * sum(ones), 0, 0
    while plan.growing:
        t += cfg.ne_every
        g, q, magnitude = sched.step(t)["critic"]
        events += 1
        if plan.growing:  # every event but the last: exactly the reference's counts
            assert list(g) == grow and list(q) == prune and bool(magnitude)
            active += per_event
            assert plan.active == active
    assert abs(plan.sparsity - 0.25) < 1e-4
    assert events == -(-(target - 2 * sum(ones)) // per_event)  # the last event is clipped onto the target
    assert 15_000 <= t <= 22_000  # the reference's pace: dense to 75% in ~17-19k updates (not 2-3k)


def test_auto_batch_halves_the_batch_while_the_critics_fau_is_below_036():
    batch = replay.Transition(
        *(jnp.arange(8.0).reshape(8, *s) for s in ((1,), (1,), (), (1,))), jnp.zeros(8, bool), jnp.zeros(8, bool)
    )
    halved = replay.half_batch(batch, jnp.bool_(True))
    np.testing.assert_array_equal(halved.reward, [0, 1, 2, 3, 0, 1, 2, 3])
    assert float(halved.reward.mean()) == float(batch.reward[:4].mean())  # a row mean = the 4-row batch's
    np.testing.assert_array_equal(replay.half_batch(batch, jnp.bool_(False)).reward, batch.reward)
    # scan_updates applies it to every sampled batch (an update that returns its batch's rewards)
    buf = replay.add(replay.init(64, 1, 1), jax.tree.map(lambda x: jnp.concatenate([x] * 8), batch))
    last, _, _ = replay.scan_updates(
        lambda s, b, k: (b.reward, {}),
        jnp.zeros(8),
        buf,
        jax.random.key(0),
        3,
        8,
        expansion.ReplayControl(half=jnp.bool_(True)),
    )
    np.testing.assert_array_equal(last[:4], last[4:])
    assert expansion.AUTO_BATCH_FAU == pytest.approx(0.36)


@pytest.mark.slow
@pytest.mark.parametrize("fau,half", [(0.30, True), (0.35, True), (0.37, False), (0.9, False)])
def test_an_ne_event_sets_the_half_batch_flag_from_the_critics_fau(monkeypatch, tiny_sac_config, fau, half):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.plasticity import hooks
    from plasticity_zoo.training.loops import offpolicy

    p_cfg = PlasticityConfig(ne=True, metrics_every=0, reset_batch=16)
    state, buffer, _ = offpolicy.init_state(sac, tiny_sac_config(plasticity=p_cfg), 3, 1)
    one = jax.tree.map(lambda x: x[0], (state, buffer))
    monkeypatch.setattr(expansion, "pooled_active_fraction", lambda acts: jnp.float32(fau))
    sched = expansion.Schedule({n: expansion.plan(sac.plastic_params(one[0])[n], 0.8) for n in sac.PLASTIC}, 1000)
    counts = sched.step(100)
    _, out, control = hooks.ne_step(sac, p_cfg, *one, jax.random.key(0), counts)
    assert control.review is None and bool(control.half) is half and float(out["plasticity/half_batch"]) == half
    _, _, control = hooks.ne_step(
        sac, PlasticityConfig(ne=True, ne_auto_batch="off", ne_review=True), *one, jax.random.key(0), counts
    )
    assert control.half is None and control.review is not None


def test_review_samples_only_the_oldest_30_percent():
    buf = replay.init(100, 1, 1)
    for start in range(0, 130, 10):  # 130 transitions into 100 slots: the oldest stored one is #30
        n = np.arange(start, start + 10, dtype=np.float32)
        buf = replay.add(
            buf, replay.Transition(n[:, None], n[:, None], n, n[:, None], np.zeros(10, bool), np.zeros(10, bool))
        )
    sample = jax.jit(lambda k, p: replay.sample_with_review(buf, k, 4096, p))
    old = np.asarray(sample(jax.random.key(0), 1.0).reward)
    assert old.min() == 30 and old.max() == 59  # transitions 30..59: the oldest 30 of 100
    mixed = np.asarray(sample(jax.random.key(1), 0.0).reward)
    assert mixed.min() == 30 and mixed.max() == 129
    assert 0.6 < np.mean(np.asarray(sample(jax.random.key(2), 0.5).reward) < 60) < 0.75  # 0.5 + 0.5 * 0.3
    # g = 1 / (1 + e^(0.4 - FAU) 0.9): review only below awaken = 0.4
    assert float(expansion.review_probability(0.5)) == 0.0
    fau = 0.2
    assert abs(float(expansion.review_probability(fau)) - (1 - 1 / (1 + np.exp(0.4 - fau) * 0.9))) < 1e-6


def test_ne_and_kron_are_refused_where_they_do_not_apply():
    bare = types.SimpleNamespace(KIND="offpolicy")
    with pytest.raises(ValueError, match="--plasticity.ne does not apply"):
        check_applicable(PlasticityConfig(ne=True, metrics_every=0), bare, "bare")
    with pytest.raises(ValueError, match="ne-target-sparsity"):
        PlasticityConfig(ne=True, ne_target_sparsity=0.9).validate()
    # the factory is plain Adam without a spec; Kron / NE-masked for the networks the spec names
    p = _params()
    adam = optim.optimizer(1e-3, "actor").init(p)
    assert isinstance(adam[0], optax.ScaleByAdamState)
    spec = optim.OptimSpec(kron=HAS_KRON, ne=optim.NESpec(), ne_networks=("actor",))
    s = optim.optimizer(1e-3, "actor", spec=spec).init(p)
    assert optim.find_masked(s) is not None and (not HAS_KRON or _kron(s) is not None)
    assert optim.find_masked(optim.optimizer(1e-3, "critic", spec=spec).init(p)) is None
    # an agent whose plastic optimizers ignore the spec is refused, naming the network
    built_with_adam = types.SimpleNamespace(critic_opt=adam)
    bare = types.SimpleNamespace(KIND="offpolicy", PLASTIC={"critic": ("critic_params", "critic_opt")})
    with pytest.raises(ValueError, match="--plasticity.kron does not apply.*critic"):
        check_optimizers(PlasticityConfig(kron=True), bare, "bare", built_with_adam)
    with pytest.raises(ValueError, match="--plasticity.ne does not apply.*critic"):
        check_optimizers(PlasticityConfig(ne=True), bare, "bare", built_with_adam)
    check_optimizers(PlasticityConfig(ne=True), bare, "bare", types.SimpleNamespace(critic_opt=s))


@pytest.fixture
def counted_train(monkeypatch):
    """training.loops.offpolicy.train, recording the jitted step function and the hooks it built."""
    from plasticity_zoo.training.loops import offpolicy

    seen = {}
    make, hooks_cls = offpolicy.make_step_fn, offpolicy.Hooks

    def make_step_fn(*a, **k):
        seen["step"] = make(*a, **k)
        return seen["step"]

    class Hooks(hooks_cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen["hooks"] = self

    monkeypatch.setattr(offpolicy, "make_step_fn", make_step_fn)
    monkeypatch.setattr(offpolicy, "Hooks", Hooks)
    return offpolicy, seen


@pytest.mark.slow
def test_ne_with_kron_reaches_the_target_on_schedule_in_sac_without_recompiling(
    tiny_sac_config, tmp_path, counted_train, compile_counts
):
    """One SAC run with --plasticity.ne --plasticity.kron (one run: Kron's XLA compile is the slow part).

    Without psgdax installed (the kron extra) it runs NE with Adam.
    """
    from plasticity_zoo.agents import sac
    from plasticity_zoo.training import checkpoint

    offpolicy, seen = counted_train
    cfg = tiny_sac_config(
        total_steps=400,
        learning_starts=100,
        eval_every=400,
        eval_episodes=1,
        log_every=40,
        checkpoint_every=400,
        network=NetworkConfig(width=16, depth=1),
        # the cosine options (fast growth: the target within the short run), review and auto batch on
        plasticity=PlasticityConfig(
            metrics_every=0,
            ne=True,
            ne_every=40,
            kron=HAS_KRON,
            ne_schedule="cosine",
            ne_init_space="full",
            ne_prune="redo",
            ne_review=True,
            ne_auto_batch="on",
        ),
    )
    out = offpolicy.train(cfg, sac, tmp_path / "r")
    st = out["state"]
    if HAS_KRON:  # Kron: 301 finite updates; the opt state is PSGD-Kron's, not Adam's
        from plasticity_zoo.plasticity.api import StaticPlasticity

        adam = sac._optimizers(cfg.agent, StaticPlasticity())[0].init(jax.tree.map(lambda x: x[0], st.actor_params))
        assert isinstance(adam[0], optax.ScaleByAdamState)
        assert jax.tree.structure(optim.find_masked(st.actor_opt).inner) != jax.tree.structure(adam)
        assert int(_kron(st.critic_opt).count[0]) == 301 and int(_kron(st.actor_opt).count[0]) == 301
    hooks = seen["hooks"]
    assert hooks.ne_traces == 1 and compile_counts["jit(event)"] == 1, compile_counts  # 7 events, one compilation
    # random-action warm-up + learning; growth never recompiles.  (At most: the step functions are cached per
    # agent config in the process, so a SAC run of an earlier test may already hold store's executable.)
    assert compile_counts["jit(learn_and_act)"] <= 2 and compile_counts["jit(store)"] <= 1, compile_counts
    # the same schedule on the host: the logged (device) sparsity follows it exactly
    plans = {
        n: expansion.plan(jax.tree.map(lambda x: x[0], getattr(st, f)), 0.8, "full")
        for n, (f, _) in sac.PLASTIC.items()
    }
    # 0.8 up to the ER counts' rounding: n - int(S n) keeps ceil(d n), one connection more per kernel at most
    assert all(abs(p.sparsity - 0.8) < 0.02 for p in plans.values())
    host = expansion.Schedule(plans, total_updates=301, target_sparsity=0.25, kind="cosine", prune="redo")
    rows = [r for r in csv.DictReader(open(tmp_path / "r" / "metrics.csv")) if r.get("plasticity/critic/sparsity")]
    assert len(rows) == 7
    for k, row in enumerate(rows):
        host.step(40 * (k + 1))
        for name, plan in host.plans.items():
            assert abs(float(row[f"plasticity/{name}/sparsity"]) - plan.sparsity) < 1e-5, (k, name)
        assert 0.0 <= float(row["plasticity/review_prob"]) < 1.0
        assert float(row["plasticity/half_batch"]) in (0.0, 1.0)
    sparsity = [float(r["plasticity/critic/sparsity"]) for r in rows]
    assert 0.25 < sparsity[0] < 0.8 and sparsity[1] < sparsity[0]
    assert all(abs(s - 0.25) < 2e-3 for s in sparsity[3:])  # target reached by the 3rd event, then kept
    # the final nets are sparse exactly where the masks say; the target critic shares the critic's masks
    for p_field, o_field in (
        ("actor_params", "actor_opt"),
        ("critic_params", "critic_opt"),
        ("target_critic_params", "critic_opt"),
    ):
        masked = optim.apply_mask(getattr(st, o_field), getattr(st, p_field))
        for a, b in zip(jax.tree.leaves(masked), jax.tree.leaves(getattr(st, p_field))):
            np.testing.assert_array_equal(a, b)
    # the final checkpoint holds the state's leaves first, the masks among them
    ckpt = checkpoint.latest(tmp_path / "r")
    saved, names = np.load(ckpt / "arrays.npz"), json.loads((ckpt / "meta.json").read_text())["arrays"]
    leaves = jax.tree.leaves(st)
    assert sum(x.dtype == bool and x.ndim >= 3 for x in leaves) == 2 * 2  # actor and critic: a mask per kernel
    for i, x in enumerate(leaves):
        if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert names[i].startswith("agent/")  # arrays are named by their path in the checkpointed tree
            np.testing.assert_array_equal(saved[names[i]], x)
    losses = [
        float(r[k])
        for r in csv.DictReader(open(tmp_path / "r" / "metrics.csv"))
        for k in ("losses/critic", "losses/actor")
        if r.get(k)
    ]
    assert len(losses) >= 14 and np.all(np.isfinite(losses))


@pytest.mark.slow
def test_an_ne_run_with_review_and_auto_batch_resumes_bit_identically(tiny_sac_config, tmp_path, assert_same_logs):
    """The schedule, masks and replay controls (review probability, half-batch flag) are checkpointed."""
    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.loops import offpolicy

    cfg = tiny_sac_config(
        total_steps=600,
        learning_starts=100,
        checkpoint_every=300,
        log_every=100,
        network=NetworkConfig(width=16, depth=1),
        plasticity=PlasticityConfig(
            metrics_every=0, ne=True, ne_every=50, ne_review=True, ne_auto_batch="on", reset_batch=16
        ),
    )
    full = offpolicy.train(cfg, sac, tmp_path / "full")
    part = offpolicy.train(cfg, sac, tmp_path / "part", stop_at=350)
    assert part["step"] < 600
    resumed = offpolicy.train(cfg, sac, tmp_path / "part", resume=True)
    assert resumed["step"] == 600
    for x, y in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(x, y)
    assert_same_logs(tmp_path / "full", tmp_path / "part")
    rows = list(csv.DictReader(open(tmp_path / "full" / "metrics.csv")))
    assert any(r.get("plasticity/half_batch") not in (None, "") for r in rows)
