"""Every plasticity flag on MR.Q (off-policy, own train_block) and PPO (on-policy), end to end.

Tiny widths and few steps: each test is one short training run through the real loop.
"""

import csv
import dataclasses
import importlib.util

import jax
import numpy as np
import pytest

from plasticity_zoo.plasticity import optim
from plasticity_zoo.training.config import NetworkConfig, PlasticityConfig, RunConfig

HAS_KRON = importlib.util.find_spec("psgdax") is not None  # the kron extra


def _rows(path, key):
    return [r for r in csv.DictReader(open(path / "metrics.csv")) if r.get(key)]


def _finite(tree):
    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree))


def _masked_exactly(st, fields):
    """Every weight masked out in the optimizer state is exactly 0 in the params."""
    for p_field, o_field in fields:
        params, opt = getattr(st, p_field), getattr(st, o_field)
        assert optim.find_masked(opt) is not None, o_field
        for a, b in zip(jax.tree.leaves(optim.apply_mask(opt, params)), jax.tree.leaves(params)):
            np.testing.assert_array_equal(a, b)


def _mrq_cfg(plasticity, env="Pendulum-v1", total_steps=120, **agent):
    from plasticity_zoo.agents import mrq

    agent_cfg = mrq.MRQConfig(batch_size=16, buffer_size=512, learning_starts=40, target_update_freq=10, **agent)
    return RunConfig(
        env=env,
        total_steps=total_steps,
        eval_every=total_steps,
        eval_episodes=1,
        log_every=20,
        checkpoint_every=total_steps,
        progress=False,
        network=NetworkConfig(width=16, depth=1),
        plasticity=plasticity,
        agent_name="mrq",
        agent=agent_cfg,
    )


@pytest.mark.slow
def test_mrq_least_sigreg_and_metrics(tmp_path):
    from plasticity_zoo.agents import mrq
    from plasticity_zoo.training.loops.offpolicy import train

    pcfg = PlasticityConfig(
        metrics_every=20,
        metrics_batch=32,
        sigreg_coef=0.2,
        least=True,
        least_max_len=5,
        least_window=8,
        least_warmup=0.0,
        least_noise_max=0.3,
    )
    out = train(_mrq_cfg(pcfg, env="ToyChain-v0", total_steps=160), mrq, tmp_path / "r")
    st = out["state"]
    assert _finite(mrq.plastic_params(st)) and int(st.encoder_updates[0]) > 0
    rows = _rows(tmp_path / "r", "plasticity/state_encoder/dormant_0.0")
    assert rows
    for r in rows:
        for name in mrq.PLASTIC:
            assert 0.0 <= float(r[f"plasticity/{name}/dormant_0.0"]) <= 1.0, name
    stops = _rows(tmp_path / "r", "plasticity/least_stops")
    assert stops and all(float(r["plasticity/least_stops"]) >= 0 for r in stops)
    # LEAST's optional noise increase: sigma between MR.Q's 0.2 and sigma-bar 0.3, and in the state
    noise = [float(r["plasticity/least_noise"]) for r in _rows(tmp_path / "r", "plasticity/least_noise")]
    assert noise and all(0.2 <= n <= 0.3 for n in noise)
    assert float(st.exploration_noise[0]) == pytest.approx(noise[-1], rel=1e-5)
    assert all(np.isfinite(float(r["losses/encoder"])) for r in _rows(tmp_path / "r", "losses/encoder"))


@pytest.mark.slow
def test_mrq_least_signals_and_sigreg_on_the_state_encoder():
    from plasticity_zoo.agents import mrq
    from plasticity_zoo.buffers.replay import Transition
    from plasticity_zoo.plasticity.api import StaticPlasticity
    from plasticity_zoo.plasticity.sigreg import SIGRegSpec

    state = mrq.init(jax.random.key(0), 3, 1, mrq.MRQConfig(), NetworkConfig(width=16, depth=1))
    rng = np.random.default_rng(0)
    tr = Transition(
        rng.normal(size=(4, 3)).astype(np.float32),
        rng.uniform(-1, 1, (4, 1)).astype(np.float32),
        rng.normal(size=4).astype(np.float32),
        rng.normal(size=(4, 3)).astype(np.float32),
        np.array([False, True, False, False]),
        np.zeros(4, bool),
    )
    q, g = jax.jit(mrq.least_signals)(state, tr, jax.random.key(1))
    assert q.shape == (4,) and g.shape == (4,) and np.all(np.asarray(g) >= 0) and _finite((q, g))
    # SIGReg changes L_enc (and so the encoder step) only when switched on
    win = mrq.lap.Window(
        tr.obs,
        tr.action[:, None].repeat(5, 1),
        tr.reward[:, None].repeat(5, 1),
        tr.next_obs[:, None].repeat(5, 1),
        np.zeros((4, 5), bool),
        np.zeros((4, 5), bool),
    )
    encoder_step = jax.jit(lambda s, w, k: mrq.encoder_update(s, w, 1.0, k))
    _, plain = encoder_step(state, win, jax.random.key(2))
    # the same jitted function: the SIGReg choice is a static field of the state, so it retraces
    _, reg = encoder_step(state.replace(plasticity=StaticPlasticity(sigreg=SIGRegSpec(1.0))), win, jax.random.key(2))
    assert encoder_step._cache_size() == 2
    assert float(reg[0]) > float(plain[0])  # the logged L_enc includes the penalty
    np.testing.assert_allclose(reg[1:], plain[1:], rtol=1e-6)  # its parts do not


@pytest.mark.slow
def test_mrq_regrama_and_ne(tmp_path):
    from plasticity_zoo.agents import mrq
    from plasticity_zoo.training.loops.offpolicy import train

    pcfg = PlasticityConfig(metrics_every=0, regrama=True, reset_every=20, ne=True, ne_every=20, ne_review=False)
    out = train(_mrq_cfg(pcfg), mrq, tmp_path / "r")
    st = out["state"]
    assert _finite(mrq.plastic_params(st))
    _masked_exactly(st, mrq.PLASTIC.values())
    rows = _rows(tmp_path / "r", "plasticity/value/sparsity")
    assert rows and all(0.0 < float(r[f"plasticity/{n}/sparsity"]) < 0.8 + 1e-6 for r in rows for n in mrq.PLASTIC)
    resets = _rows(tmp_path / "r", "plasticity/value/reset_fraction")
    assert resets and all(0.0 <= float(r[f"plasticity/{n}/reset_fraction"]) <= 1.0 for r in resets for n in mrq.PLASTIC)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_KRON, reason="needs psgdax (the kron extra)")
@pytest.mark.usefixtures("no_compilation_cache_writes")  # see the fixture: a cache write segfaulted here in CI
def test_mrq_kron_with_ne_masks_one_encoder_and_rl_step():
    """Kron (+ NE masks) through MR.Q's optimizer chain: finite steps, LayerNorms stay frozen, pruned
    weights stay 0.  (Unit-level: a full loop run with Kron on MR.Q's four nets compiles for ~45 s.)"""
    from plasticity_zoo.agents import mrq
    from plasticity_zoo.plasticity.api import StaticPlasticity

    spec = optim.OptimSpec(kron=True, ne=optim.NESpec(), ne_networks=tuple(mrq.PLASTIC))
    state = mrq.init(
        jax.random.key(0), 3, 1, mrq.MRQConfig(), NetworkConfig(width=16, depth=1), StaticPlasticity(optim=spec)
    )
    assert all(optim.find_masked(getattr(state, o)) is not None for _, o in mrq.PLASTIC.values())
    for p, o in mrq.PLASTIC.values():  # NE's sparse start (the hooks do this in the loop)
        state = state.replace(**{p: optim.apply_mask(getattr(state, o), getattr(state, p))})
    rng = np.random.default_rng(0)
    win = mrq.lap.Window(
        rng.normal(size=(8, 3)).astype(np.float32),
        rng.uniform(-1, 1, (8, 5, 1)).astype(np.float32),
        rng.normal(size=(8, 5)).astype(np.float32),
        rng.normal(size=(8, 5, 3)).astype(np.float32),
        np.zeros((8, 5), bool),
        np.zeros((8, 5), bool),
    )

    @jax.jit
    def step(state, key):
        state, _ = mrq.encoder_update(state, win, 1.0)
        state, _, metrics = mrq.rl_update(state, mrq._first(win, 3), key)
        return state, metrics

    for k in range(2):
        state, metrics = step(state, jax.random.key(k))
    assert _finite(mrq.plastic_params(state)) and _finite(metrics)
    _masked_exactly(state, mrq.PLASTIC.values())
    frozen = [x for p, x in jax.tree_util.tree_flatten_with_path(mrq.plastic_params(state))[0] if mrq._is_frozen(p)]
    assert frozen and all(np.all((np.asarray(x) == 1.0) | (np.asarray(x) == 0.0)) for x in frozen)


def test_mrq_refuses_ne_review(tmp_path):
    from plasticity_zoo.agents import mrq
    from plasticity_zoo.training.loops.offpolicy import train

    with pytest.raises(ValueError, match="ne-review does not apply to agent 'mrq'"):
        train(_mrq_cfg(PlasticityConfig(ne=True, ne_review=True)), mrq, tmp_path / "r")


@pytest.mark.parametrize("name", ["mrq", "ppo", "ravl"])
def test_ne_replay_controls_are_refused_the_same_way_for_every_kind_without_uniform_replay(name):
    from plasticity_zoo import agents
    from plasticity_zoo.plasticity.hooks import auto_batch_on, check_applicable

    agent = agents.get(name)
    with pytest.raises(ValueError, match=f"ne-review does not apply to agent '{name}'.*--plasticity.no-ne-review"):
        check_applicable(PlasticityConfig(ne=True, ne_review=True), agent, name)
    with pytest.raises(ValueError, match=f"ne-auto-batch on does not apply to agent '{name}'"):
        check_applicable(PlasticityConfig(ne=True, ne_auto_batch="on"), agent, name)
    check_applicable(PlasticityConfig(ne=True), agent, name)  # the defaults: growth and pruning alone apply
    assert not auto_batch_on(PlasticityConfig(ne=True), agent)  # auto: off where there is no uniform replay
    sac = agents.get("sac")
    check_applicable(PlasticityConfig(ne=True, ne_review=True, ne_auto_batch="on"), sac, "sac")
    assert auto_batch_on(PlasticityConfig(ne=True), sac) and not auto_batch_on(PlasticityConfig(), sac)


@pytest.mark.slow
@pytest.mark.usefixtures("no_compilation_cache_writes")  # Kron: see test_mrq_kron_with_ne_masks_one_encoder_and_rl_step
def test_ppo_ne_kron(tmp_path):
    from plasticity_zoo.agents import ppo
    from plasticity_zoo.training.loops.onpolicy import train

    agent_cfg = dataclasses.replace(ppo.PPOConfig(), num_steps=64, num_minibatches=4, update_epochs=2)
    pcfg = PlasticityConfig(metrics_every=8, ne=True, ne_every=8, kron=HAS_KRON, ne_review=False)  # PPO: no replay
    cfg = RunConfig(
        env="Pendulum-v1",
        total_steps=384,
        num_envs=2,
        eval_every=384,
        eval_episodes=1,
        log_every=64,
        checkpoint_every=384,
        progress=False,
        network=NetworkConfig(width=16),
        plasticity=pcfg,
        agent_name="ppo",
        agent=agent_cfg,
    )
    out = train(cfg, ppo, tmp_path / "r")
    st = out["state"]
    assert _finite(ppo.plastic_params(st))
    _masked_exactly(st, ppo.PLASTIC.values())  # the manual lr scaling keeps pruned weights at 0
    rows = _rows(tmp_path / "r", "plasticity/critic/sparsity")
    assert rows and all(0.0 < float(r[f"plasticity/{n}/sparsity"]) < 0.8 + 1e-6 for r in rows for n in ppo.PLASTIC)
    assert "plasticity/review_prob" not in rows[0]
    assert all(
        0.0 <= float(r["plasticity/actor/dormant_0.0"]) <= 1.0
        for r in _rows(tmp_path / "r", "plasticity/actor/dormant_0.0")
    )
