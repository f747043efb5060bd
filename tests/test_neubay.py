"""NeuBay's learner (agents/neubay.py): losses against hand cases, a learning step, acting."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import dynamics as dyn
from plasticity_zoo.agents import imagination as im
from plasticity_zoo.agents import neubay
from plasticity_zoo.agents.neubay_config import NeuBayConfig, resolved, task_config, with_dataset

OBS, ACT = 3, 2
SMALL = NeuBayConfig(
    critics=4,
    sampled_critics=2,
    head_width=16,
    d_model=16,
    d_hidden=8,
    lru_layers=1,
    encoder_lr=1e-3,
    head_lr=1e-3,
    updates=1000,
    tape_len=32,
    real_weight=0.05,
    fixed_alpha=False,
)
# the one other config the tests compile: all weight on real data, alpha fixed (as for hopper)
REAL_FIXED = NeuBayConfig(**{**SMALL.__dict__, "real_weight": 1.0, "fixed_alpha": True})
STEP = jax.jit(neubay.update)


def test_real_imagined_weighting_hand_case():
    loss = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 1]], bool)
    real = jnp.array([[1, 1, 0, 0], [0, 0, 0, 1]], bool)
    # real & mask: 1, 2, 8 -> 11/3; imagined & mask: 3, 5, 6 -> 14/3
    total, (r, i) = neubay.real_imagined_mean(loss, mask, real, 0.8)
    assert float(r) == pytest.approx(11 / 3) and float(i) == pytest.approx(14 / 3)
    assert float(total) == pytest.approx(0.8 * 11 / 3 + 0.2 * 14 / 3)
    only_imagined, (r, _) = neubay.real_imagined_mean(loss, mask, jnp.zeros_like(real), 0.3)
    assert float(r) == 0.0 and float(only_imagined) == pytest.approx(0.7 * 25 / 6)  # all six masked steps


def test_redq_target_hand_case():
    next_qs = jnp.array([[1.0, 5.0], [3.0, 2.0], [0.5, 9.0], [4.0, 4.0]])  # 4 heads x 2 transitions
    heads = jnp.array([1, 3])  # drawn: min(3, 4) = 3 and min(2, 4) = 2; head 2's 0.5 is not drawn
    y = neubay.redq_target(
        next_qs,
        heads,
        reward=jnp.array([1.0, -1.0]),
        terminated=jnp.array([False, True]),
        next_log_prob=jnp.array([-2.0, 0.7]),
        alpha=0.5,
        gamma=0.9,
    )
    np.testing.assert_allclose(np.asarray(y), [1.0 + 0.9 * (3.0 + 0.5 * 2.0), -1.0], rtol=1e-6)


@pytest.mark.slow
def test_the_critic_loss_targets_the_drawn_heads_of_all_the_target_heads():
    """critic_loss runs only the drawn target heads: its loss equals a reference that evaluates every
    target head and takes the min over the same drawn pair (and differs for another pair)."""
    state = neubay.init(jax.random.key(3), OBS, ACT, SMALL)
    noise = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(4), x.shape), state.target_critic_params)
    state = state.replace(target_critic_params=jax.tree.map(jnp.add, state.target_critic_params, noise))
    r = np.random.default_rng(0)
    b, t = 2, 12
    start = np.zeros((b, t), bool)
    start[:, 0] = start[0, 7] = True
    tape = neubay.TapeBatch(
        jnp.asarray(r.normal(size=(b, t, OBS + ACT + 1)), jnp.float32),
        jnp.asarray(start),
        jnp.asarray(r.uniform(-1, 1, (b, t, ACT)), jnp.float32),
        jnp.asarray(r.normal(size=(b, t)), jnp.float32),
        jnp.asarray(r.uniform(size=(b, t)) < 0.2),
        jnp.asarray(r.uniform(size=(b, t)) < 0.5),
    )
    alpha, key = 0.2, jax.random.key(5)
    loss = neubay.critic_loss(state.critic_params, state, tape, alpha, key)[0]

    def reference(pick):
        k_next, k_heads = jax.random.split(key)
        h = neubay._encode(state.critic_encoder, state.critic_params["encoder"], tape)
        q = neubay._q(state, state.critic_params["heads"], h[:, :-1], tape.action[:, :-1])
        mean, log_std = neubay._policy(state, state.actor_params, tape)
        next_action, next_log_prob = neubay.tanh_gaussian_sample(k_next, mean, log_std)
        target_h = neubay._encode(state.critic_encoder, state.target_critic_params["encoder"], tape)
        all_heads = neubay._q(state, state.target_critic_params["heads"], target_h[:, 1:], next_action[:, 1:])
        assert all_heads.shape[0] == SMALL.critics
        heads = pick(jax.random.choice(k_heads, SMALL.critics, (SMALL.sampled_critics,), replace=False))
        y = neubay.redq_target(
            all_heads, heads, tape.reward[:, :-1], tape.terminated[:, :-1], next_log_prob[:, 1:], alpha, SMALL.gamma
        )
        per_step = neubay.huber(q - y[None]).mean(axis=0)
        return neubay.real_imagined_mean(per_step, neubay.transition_mask(tape), tape.real[:, :-1], SMALL.real_weight)[
            0
        ]

    np.testing.assert_allclose(float(loss), float(reference(lambda heads: heads)), rtol=1e-5)
    others = lambda heads: jnp.setdiff1d(jnp.arange(SMALL.critics), heads, size=SMALL.sampled_critics)  # noqa: E731
    assert abs(float(loss) - float(reference(others))) > 1e-4


@pytest.mark.slow
def test_networks_start_as_the_reference_codes_layers():
    """Equinox's default U(+-1/sqrt(fan_in)) for every Linear (weights and biases), the critics'
    output at U(+-sqrt(0.01 / fan_in)) with a zero bias, LayerNorms at 1 / 0, the LRU's own init."""
    from plasticity_zoo.networks.core import path_names

    state = neubay.init(jax.random.key(0), OBS, ACT, SMALL)
    fans = {"pre": OBS + ACT + 1, "out": 16, "gate": 16}
    for owner, params in (("actor", state.actor_params), ("critic", state.critic_params)):
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            names, x = path_names(path), np.asarray(x)
            if "norm" in names or "norms" in names or "pre_norm" in names:
                np.testing.assert_array_equal(x, 1.0 if names[-1] == "scale" else 0.0)
            elif names[0] == "heads" and names[1] == "out":  # the critics' output layer, scale 0.01
                assert np.all(np.abs(x) <= np.sqrt(0.01 / 16)) and (names[-1] == "kernel") == bool(np.any(x))
            elif names[-1] in ("kernel", "bias"):
                fan_in = fans.get(names[-2], 16)
                if names[:3] == ("heads", "trunk", "layers") and names[3] == 0:
                    fan_in = 16 + ACT
                assert np.all(np.abs(x) <= 1 / np.sqrt(fan_in)) and np.any(x), (owner, names)
                if x.size >= 64:  # not a narrower law
                    assert np.abs(x).max() > 0.8 / np.sqrt(fan_in), (owner, names)
    lam = jnp.exp(-jnp.exp(state.actor_params["encoder"]["layers"][0]["lru"]["nu_log"][...]))
    assert float(lam.max()) < SMALL.recurrent.r_max


def test_huber():
    np.testing.assert_allclose(
        np.asarray(neubay.huber(jnp.array([-3.0, -0.5, 0.0, 0.9, 2.0]))), [2.5, 0.125, 0.0, 0.405, 1.5], rtol=1e-6
    )


def test_task_settings_and_their_overrides():
    cfg = task_config(NeuBayConfig(), "hopper", "medium-replay")
    assert (cfg.encoder_lr, cfg.real_weight, cfg.fixed_alpha) == (3e-7, 0.5, True)
    cfg = task_config(NeuBayConfig(), "HalfCheetah-v5", "medium-replay", real_weight=0.3)
    assert (cfg.encoder_lr, cfg.real_weight, cfg.fixed_alpha) == (1e-5, 0.3, False)
    # a value set in the config (a flag) is kept; a task outside the table keeps the base values
    cfg = task_config(NeuBayConfig(encoder_lr=2e-4), "Hopper-v5", "medium")
    assert (cfg.encoder_lr, cfg.real_weight) == (2e-4, 0.8)
    assert resolved(task_config(NeuBayConfig(), "ant", "medium")) == resolved(NeuBayConfig())
    with pytest.raises(ValueError, match="sampled-critics"):
        NeuBayConfig(critics=2, sampled_critics=3)


def test_a_run_resolves_presets_from_the_dataset():
    cfg = with_dataset(NeuBayConfig(), "Hopper-v5", {"kind": "medium-replay"}, 50_000)
    assert (cfg.encoder_lr, cfg.real_weight, cfg.fixed_alpha, cfg.updates, cfg.max_horizon) == (
        3e-7,
        0.5,
        True,
        50_000,
        1000,
    )
    assert cfg.dynamics.max_epochs == dyn.NO_EPOCH_CAP  # medium-replay: no cap
    cfg = with_dataset(NeuBayConfig(kind="medium"), "Walker2d-v5", {}, 10)
    assert (cfg.encoder_lr, cfg.real_weight, cfg.fixed_alpha, cfg.dynamics.max_epochs) == (3e-6, 0.5, False, 1200)
    given = NeuBayConfig(dynamics=dyn.neubay_config(max_epochs=7), updates=99)
    cfg = with_dataset(given, "Hopper-v5", {"kind": "medium"}, 10)
    assert (cfg.dynamics.max_epochs, cfg.updates) == (7, 99)  # flags win over the presets
    assert with_dataset(cfg, "Hopper-v5", {"kind": "medium"}, 10) == cfg  # a resumed run: unchanged
    cfg = with_dataset(NeuBayConfig(), "ToyReach-v0", {"kind": "random"}, 10)
    assert (cfg.encoder_lr, cfg.real_weight, cfg.max_horizon) == (1e-5, 0.05, 20)  # base values; its 20-step limit


@pytest.fixture(scope="module")
def tape():
    return toy_tapes(jax.random.key(0))


def toy_tapes(key, batch=4, horizon=12):
    """Imagined tapes from a small random posterior and an untrained actor."""
    rng = np.random.default_rng(0)
    n = 60
    obs = rng.normal(size=(n, OBS)).astype(np.float32)
    actions = rng.uniform(-1, 1, (n, ACT)).astype(np.float32)
    rewards = obs[:, 0] + actions[:, 0]
    terminals, timeouts = np.zeros(n, bool), np.zeros(n, bool)
    timeouts[[19, 39, 59]] = True
    hist = im.histories(obs, actions, rewards, obs + 0.1 * actions[:, :1], terminals, timeouts, horizon)
    model = dyn.init_model(jax.random.key(1), OBS, ACT, dyn.neubay_config(members=3, elites=3, width=8, depth=1))
    state = neubay.init(jax.random.key(2), OBS, ACT, SMALL)
    tape, _ = im.imagine(
        model,
        hist,
        neubay.rollout_policy(state),
        neubay.initial_memory(state, batch),
        key,
        batch=batch,
        max_horizon=horizon,
        threshold=jnp.inf,
        done_fn=lambda s: jnp.zeros(len(s), bool),
    )
    return tape


def test_tape_batches_mask_padding_and_the_dummy_last_transition(tape):
    batch = neubay.tape_batch(tape)
    assert batch.inputs.shape == (4, 13, OBS + ACT + 1)
    mask = np.asarray(neubay.transition_mask(batch))
    length = np.asarray(tape.length)
    for b in range(4):
        assert mask[b, : length[b]].all() and not mask[b, length[b] :].any()
    np.testing.assert_array_equal(np.asarray(batch.real[:, :-1]), np.asarray(tape.real))


def run(state, batch, n, key):
    losses = []
    for k in jax.random.split(key, n):
        state, m = STEP(state, batch, k)
        losses.append(float(m["losses/critic"]))
    return state, losses, m


@pytest.mark.slow
def test_updates_fit_a_fixed_tape_and_the_same_seed_repeats(tape):
    batch = neubay.tape_batch(tape)
    state = neubay.init(jax.random.key(3), OBS, ACT, SMALL)
    after, losses, m = run(state, batch, 80, jax.random.key(4))  # the critics start near 0 (output scale 0.01)
    assert all(np.isfinite(v) for v in jax.tree.leaves(jax.tree.map(float, m)))
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert float(m["charts/alpha"]) != pytest.approx(SMALL.init_alpha)  # auto-alpha moved
    _, again, _ = run(state, batch, 10, jax.random.key(4))
    assert again == losses[:10]
    _, other, _ = run(state, batch, 5, jax.random.key(5))
    assert other != losses[:5]


@pytest.mark.slow
def test_the_real_weight_decides_which_data_the_critic_fits(tape):
    batch = neubay.tape_batch(tape)
    counted = np.asarray(neubay.transition_mask(batch))
    real = np.asarray(batch.real[:, :-1])
    assert (counted & real).any() and (counted & ~real).any()
    results = {}
    for cfg in (SMALL, REAL_FIXED):
        state, _, m = run(neubay.init(jax.random.key(3), OBS, ACT, cfg), batch, 40, jax.random.key(6))
        results[cfg.real_weight] = (float(m["losses/critic_real"]), float(m["losses/critic_imagined"]))
        if cfg.fixed_alpha:
            assert float(m["charts/alpha"]) == pytest.approx(cfg.init_alpha)
    assert results[1.0][0] < results[0.05][0]  # weight on real data: the real part fits better
    assert results[0.05][1] < results[1.0][1]  # and the other way round


def test_stepping_the_actor_equals_running_it_over_the_sequence():
    state = neubay.init(jax.random.key(7), OBS, ACT, SMALL)
    x = jax.random.normal(jax.random.key(8), (3, 9, OBS + ACT + 1))
    start = jnp.zeros((3, 9), bool).at[:, 0].set(True).at[1, 5].set(True)
    x = jnp.where(start[..., None] & (jnp.arange(OBS + ACT + 1) >= OBS), 0.0, x)  # no previous step at a start
    memory, stepped = neubay.initial_memory(state, 3), []
    act = jax.jit(neubay.act_step, static_argnames="explore")
    for t in range(9):
        a, memory = act(
            state, memory, x[:, t, :OBS], x[:, t, OBS : OBS + ACT], x[:, t, -1], start[:, t], None, explore=False
        )
        stepped.append(a)
    policy = jax.jit(neubay.rollout_policy(state, explore=False))
    for t in (4, 8):
        a, _ = policy(neubay.initial_memory(state, 3), x[:, : t + 1], start[:, : t + 1], jax.random.key(0))
        np.testing.assert_allclose(np.asarray(a), np.asarray(stepped[t]), rtol=1e-4, atol=1e-5)


MARKOV = NeuBayConfig(**{**SMALL.__dict__, "markov": True})


@pytest.mark.slow
def test_the_markov_ablation_acts_on_the_state_alone(tape):
    state = neubay.init(jax.random.key(7), OBS, ACT, MARKOV)
    assert state.actor_params["encoder"] == {} and state.critic_params["encoder"] == {}
    first = state.actor_params["head"]["trunk"]["layers"][0]["kernel"].value
    assert first.shape[0] == OBS  # the actor's first layer reads s_t (not a d_model feature)
    critic_first = state.critic_params["heads"]["trunk"]["layers"][0]["kernel"].value
    assert critic_first.shape[-2] == OBS + ACT  # the critics read [s_t, a_t]
    obs = jax.random.normal(jax.random.key(8), (3, OBS))
    memory = neubay.initial_memory(state, 3)
    a1, m1 = neubay.act_step(state, memory, obs, jnp.ones((3, ACT)), jnp.ones(3), jnp.zeros(3, bool), None, False)
    a0, _ = neubay.act_step(state, memory, obs, jnp.zeros((3, ACT)), jnp.zeros(3), jnp.ones(3, bool), None, False)
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a0))  # no history: the previous step is ignored
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(neubay.act(state, obs, None, False)))
    assert m1.shape == (3, 0)
    # trained on uniform transitions from the tape buffer: rows of two positions, the tail state masked
    buf = neubay.tapes_lib.add(
        neubay.tapes_lib.init(200, OBS, ACT),
        tape.obs,
        tape.action,
        tape.reward,
        tape.terminated,
        tape.real,
        tape.length,
    )
    data = neubay.Data((), buf, jnp.zeros((), jnp.int32), {})
    batch = neubay.sample_batch(state, data, jax.random.key(9), 64)
    assert batch.inputs.shape == (64, 2, OBS + ACT + 1)
    step = jax.jit(neubay.update)
    losses = []
    for k in jax.random.split(jax.random.key(10), 120):
        state, m = step(state, neubay.sample_batch(state, data, k, 64), k)
        losses.append(float(m["losses/critic"]))
    assert np.isfinite(losses).all() and np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), losses


@pytest.mark.slow
@pytest.mark.parametrize("markov", [False, True])
def test_plasticity_metrics_read_the_encoders_and_the_heads(tape, markov):
    from plasticity_zoo.plasticity import hooks
    from plasticity_zoo.plasticity.api import MeasuredAgent, PlasticAgent
    from plasticity_zoo.plasticity.config import PlasticityConfig

    assert isinstance(neubay, MeasuredAgent) and not isinstance(neubay, PlasticAgent)
    hooks.check_applicable(PlasticityConfig(metrics_every=10), neubay, "neubay")  # metrics: accepted
    with pytest.raises(
        ValueError, match="regrama does not apply to agent 'neubay': its networks take plasticity metrics only"
    ):
        hooks.check_applicable(PlasticityConfig(regrama=True), neubay, "neubay")
    cfg = MARKOV if markov else SMALL
    state = neubay.init(jax.random.key(3), OBS, ACT, cfg)
    batch = neubay.tape_batch(tape)
    params = neubay.metric_params(state)
    nets = ["actor", "critic"] if markov else ["actor", "actor_encoder", "critic", "critic_encoder"]
    assert sorted(params) == nets
    losses = neubay.metric_losses(state, batch, jax.random.key(4))
    # each loss is its owner's training loss, the network's params swapped in
    critic_full = neubay.critic_loss(
        state.critic_params, state, batch, jnp.exp(state.log_alpha), jax.random.split(jax.random.key(4))[0]
    )[0]
    np.testing.assert_allclose(float(losses["critic"](params["critic"])), float(critic_full), rtol=1e-6)
    out = jax.jit(lambda s, b, k: hooks.metrics_step(neubay, s, b, params, k))(state, batch, jax.random.key(4))
    assert all(np.isfinite(float(v)) for v in out.values())
    for n in nets:
        assert 0.0 <= float(out[f"plasticity/{n}/dormant_0.025"]) <= 1.0
        assert float(out[f"plasticity/{n}/weight_norm_ratio"]) == pytest.approx(1.0)
        assert float(out[f"plasticity/{n}/grad_norm"]) > 0
    if not markov:  # the LRU layers are measured over the tape's positions (rows = positions)
        assert {"plasticity/actor_encoder/pre/srank", "plasticity/critic_encoder/layer0/grama_0.01"} <= set(out)
        assert 1 <= float(out["plasticity/critic_encoder/features/feature_rank"]) <= SMALL.d_model


# ----------------------------------------------------------------------------- the offline run end to end


def _run_config(dataset, run_dir, total=400, **kw):
    from plasticity_zoo.plasticity.config import PlasticityConfig
    from plasticity_zoo.training.config import RunConfig

    world = dyn.neubay_config(members=4, elites=3, width=32, depth=2, max_epochs=30, batch_size=128)
    agent = NeuBayConfig(
        dataset=str(dataset),
        critics=4,
        head_width=32,
        d_model=32,
        d_hidden=16,
        lru_layers=1,
        encoder_lr=1e-3,
        head_lr=1e-3,
        real_weight=0.5,
        tape_len=128,
        rollout_batch=8,
        planning_members=3,
        updates_per_epoch=100,
        dynamics=world,
    )
    return RunConfig(
        **{
            "env": None,
            "total_steps": total,
            "eval_every": 200,
            "eval_episodes": 4,
            "log_every": 100,
            "checkpoint_every": 200,
            "progress": False,
            "run_dir": str(run_dir),
            "agent_name": "neubay",
            "agent": agent,
            "plasticity": PlasticityConfig(metrics_every=200, metrics_batch=64),
            **kw,
        }
    )


@pytest.fixture(scope="module")
def toy_dataset(tmp_path_factory):
    from tests.test_ravl import _toy_dataset

    path = tmp_path_factory.mktemp("neubay") / "toyreach-random.hdf5"
    _toy_dataset(path)
    return path


@pytest.fixture(scope="module")
def finished_run(toy_dataset, tmp_path_factory):
    from plasticity_zoo.training.run import run

    run_dir = tmp_path_factory.mktemp("neubay-run") / "a"
    return run(_run_config(toy_dataset, run_dir)), run_dir


def _eval_rows(run_dir):
    import csv

    return {int(r["step"]): r for r in csv.DictReader(open(run_dir / "eval.csv"))}


@pytest.mark.slow
def test_a_short_run_beats_its_untrained_policy(finished_run, toy_dataset):
    import json

    out, run_dir = finished_run
    rows = _eval_rows(run_dir)
    first, last = float(rows[0]["return_mean"]), float(rows[400]["return_mean"])
    assert last > first + 4.0 and last > 8.0, (first, last)
    assert np.all(np.asarray(out["state"].updates) == 400)
    saved = json.loads((run_dir / "config.json").read_text())["agent"]
    # config.json holds the settings the run trained with: the cosine over the run, ToyReach's 20-step limit
    assert (saved["updates"], saved["max_horizon"], saved["fixed_alpha"]) == (400, 20, False)
    metrics = (run_dir / "metrics.csv").read_text().splitlines()[0]
    for name in (
        "rollout/horizon_p50",
        "rollout/ended_uncertainty",
        "buffer/trajectories",
        "losses/critic_real",
        "plasticity/critic_encoder/dormant_0.025",
        "plasticity/actor/active_fraction",
    ):
        assert name in metrics
    assert Path(neubay.model_path(toy_dataset, 0)).exists()  # the world model is cached beside the dataset


@pytest.mark.slow
def test_resume_is_bit_identical_and_evaluate_reproduces_the_run(finished_run, toy_dataset, tmp_path):
    import dataclasses

    from plasticity_zoo.analysis.restore import restore_policy
    from plasticity_zoo.training.run import run

    full, full_dir = finished_run
    run(_run_config(toy_dataset, tmp_path / "b"), stop_at=200)
    resumed = run(dataclasses.replace(_run_config(toy_dataset, tmp_path / "b"), resume=str(tmp_path / "b")))
    for x, y in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (full_dir / "eval.csv").read_text() == (tmp_path / "b" / "eval.csv").read_text()
    # the checkpoint's recurrent policy, evaluated as scripts/evaluate.py does, gives the run's own returns
    restored = restore_policy(full_dir)
    returns = restored.evaluator()(restored.policy())
    logged = [float(x) for x in _eval_rows(full_dir)[400]["episode_returns"].split()]
    np.testing.assert_allclose(returns[0], logged, rtol=1e-6)


@pytest.mark.slow
def test_evaluation_feeds_the_previous_action_and_reward(finished_run):
    """The evaluator's recurrent policy against a hand-written loop over one env with act_step."""
    import gymnasium as gym

    from plasticity_zoo.training.evaluation import Evaluator, policy_maker

    out, _ = finished_run
    state = out["state"]
    returns = Evaluator("ToyReach-v0", 1, 2, base_seed=123)(policy_maker(neubay)(state))[0]
    one = jax.tree.map(lambda x: x[0], state)
    step = jax.jit(neubay.act_step, static_argnames="explore")
    for k, expected in enumerate(returns):
        env = gym.make("ToyReach-v0")
        obs, _ = env.reset(seed=123 + k)
        memory, prev_a, prev_r, total, start = neubay.initial_memory(one, 1), jnp.zeros((1, 1)), jnp.zeros(1), 0.0, True
        done = False
        while not done:
            action, memory = step(
                one,
                memory,
                jnp.asarray(obs, jnp.float32)[None],
                prev_a,
                prev_r,
                jnp.array([start]),
                None,
                explore=False,
            )
            obs, reward, terminated, truncated, _ = env.step(np.asarray(action[0]))
            prev_a, prev_r, start = action, jnp.array([reward], jnp.float32), False
            total += float(np.float32(reward))
            done = terminated or truncated
        assert total == pytest.approx(expected, rel=1e-5, abs=1e-5)
    # and the memory matters: acting from a fresh memory at every step (``act``) gives other returns
    forgetful = Evaluator("ToyReach-v0", 1, 2, base_seed=123)(
        lambda o: jax.vmap(lambda s, x: neubay.act(s, x, None, False))(state, jnp.asarray(o))
    )[0]
    assert not np.allclose(forgetful, returns)


def toy_world(n=30):
    """A random 4-member posterior and a dataset of ``n`` rows in trajectories of 10 (cut at 12)."""
    model = dyn.init_model(jax.random.key(0), OBS, ACT, dyn.neubay_config(members=4, elites=4, width=8, depth=1))
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(n, OBS)).astype(np.float32)
    hist = im.histories(
        obs, rng.uniform(-1, 1, (n, ACT)), rng.normal(size=n), obs + 0.1, np.zeros(n, bool), np.arange(n) % 10 == 9, 12
    )
    return model, hist, n


@pytest.mark.slow
@pytest.mark.parametrize("markov", [False, True])
def test_one_collection_owes_utd_times_its_transitions(markov):
    from plasticity_zoo.envs import termination

    cfg = resolved(
        NeuBayConfig(
            **{**SMALL.__dict__, "rollout_batch": 4, "max_horizon": 12, "utd": 0.25, "updates": 100, "markov": markov}
        )
    )
    model, hist, n = toy_world()
    world = neubay.World(model, hist, jnp.float32(np.inf), jnp.float32(0.0))
    state = neubay.init(jax.random.key(1), OBS, ACT, cfg)
    data = neubay.data_init(types_real(n), cfg)
    data = neubay.collect(state, data, world, jax.random.key(2), cfg, termination.never_done)
    transitions = int(data.tapes.written) - int(data.tapes.episodes)  # positions = transitions + one per tape
    assert int(data.debt) == int(np.ceil(0.25 * transitions)) and int(data.tapes.episodes) == 4
    skipped = neubay.collect(state, data, world, jax.random.key(3), cfg, termination.never_done, active=False)
    assert int(skipped.tapes.written) == int(data.tapes.written) and int(skipped.debt) == int(data.debt)
    epoch = jax.jit(neubay.make_epoch(dataclasses_replace(cfg, updates_per_epoch=7), "ToyReach-v0"))
    state2, data2, metrics = epoch(state, data, world, jax.random.key(4))
    assert int(state2.updates) == 7  # exactly the epoch's updates, collections falling where the debt is paid
    assert int(data2.tapes.episodes) >= 4 and np.isfinite(float(metrics["losses/critic"]))


@pytest.mark.slow
def test_a_reward_penalty_comes_off_the_learned_rewards_not_the_inputs():
    """--penalty (the paper's ablation): the buffer stores the model's rewards and c * uncertainty per
    transition; a training tape's inputs r_{t-1} are the rewards the agent saw when acting, its
    rewards to learn those less the penalty.  Without a penalty the buffer holds no penalty array,
    so its checkpoints keep their layout."""
    from plasticity_zoo.envs import termination

    plain = resolved(NeuBayConfig(**{**SMALL.__dict__, "rollout_batch": 4, "max_horizon": 12}))
    penalised = dataclasses_replace(plain, penalty=0.5)
    model, hist, n = toy_world()
    coef = 0.7  # World.penalty: --penalty over the dataset's mean uncertainty
    world = neubay.World(model, hist, jnp.float32(np.inf), jnp.float32(coef))
    state = neubay.init(jax.random.key(1), OBS, ACT, plain)
    key = jax.random.key(2)
    tape, _ = im.imagine(
        model,
        hist,
        neubay.rollout_policy(state),
        neubay.initial_memory(state, 4),
        key,
        batch=4,
        max_horizon=12,
        threshold=jnp.inf,
        done_fn=termination.never_done,
    )
    bufs = {}
    for name, cfg in (("plain", plain), ("penalised", penalised)):
        data = neubay.collect(state, neubay.data_init(types_real(n), cfg), world, key, cfg, termination.never_done)
        bufs[name] = data.tapes
    assert bufs["plain"].steps.penalty is None and len(jax.tree.leaves(bufs["plain"].steps)) == 6
    # the buffer's layout: each tape's transitions, then its final state with a zero transition
    length = np.asarray(tape.length)
    expected = np.concatenate(
        [np.append(coef * np.asarray(tape.uncertainty)[b, : length[b]], 0.0) for b in range(4) if length[b] >= 1]
    )
    written = int(bufs["penalised"].written)
    imagined = ~np.asarray(bufs["penalised"].steps.real[:written]) & np.asarray(
        bufs["penalised"].steps.has_next[:written]
    )
    assert written == len(expected) and imagined.any() and (expected[imagined] > 0).all()
    np.testing.assert_allclose(np.asarray(bufs["penalised"].steps.penalty[:written]), expected, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(bufs["penalised"].steps.reward), np.asarray(bufs["plain"].steps.reward))
    k = jax.random.key(3)
    batches = {
        name: neubay.sample_batch(state, neubay.Data((), buf, jnp.zeros((), jnp.int32), {}), k, 32)
        for name, buf in bufs.items()
    }
    np.testing.assert_array_equal(np.asarray(batches["penalised"].inputs), np.asarray(batches["plain"].inputs))
    sampled = neubay.tapes_lib.sample(bufs["penalised"], k, 32).penalty
    np.testing.assert_allclose(
        np.asarray(batches["penalised"].reward[0]),
        np.asarray(batches["plain"].reward[0]) - np.asarray(sampled),
        rtol=1e-6,
    )
    assert float(jnp.abs(sampled).sum()) > 0
    # imagination's tapes as training tapes: the same split
    direct, off = neubay.tape_batch(tape), neubay.tape_batch(tape, coef)
    np.testing.assert_array_equal(np.asarray(off.inputs), np.asarray(direct.inputs))
    np.testing.assert_allclose(
        np.asarray(off.reward[:, :-1]),
        np.asarray(direct.reward[:, :-1]) - coef * np.asarray(tape.uncertainty),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="stores no reward penalty"):
        neubay.tapes_lib.add(
            bufs["plain"],
            tape.obs,
            tape.action,
            tape.reward,
            tape.terminated,
            tape.real,
            tape.length,
            penalty=tape.uncertainty,
        )


def types_real(n):
    from plasticity_zoo.buffers.replay import Transition

    z = jnp.zeros
    return Transition(z((n, OBS)), z((n, ACT)), z(n), z((n, OBS)), z(n, bool), z(n, bool))


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_refusals_name_what_does_not_apply(toy_dataset, tmp_path):
    from scripts.train import main

    with pytest.raises(ValueError, match="--network.* flags do not apply to agent 'neubay'"):
        main(["neubay", "--dataset", str(toy_dataset), "--network.width", "64", "--run-dir", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="plasticity.redo does not apply to agent 'neubay'"):
        main(["neubay", "--dataset", str(toy_dataset), "--plasticity.redo", "--run-dir", str(tmp_path / "b")])
    with pytest.raises(ValueError, match="planning-members 200 is more than"):
        main(["neubay", "--dataset", str(toy_dataset), "--planning-members", "200", "--run-dir", str(tmp_path / "c")])
    assert not any((tmp_path / d).exists() for d in "abc")


# ------------------------------------------------------------------------ diagnostics (scripts/diagnose_offline.py)


@pytest.mark.slow
def test_history_values_are_the_training_critics_and_read_only_the_past():
    state = neubay.init(jax.random.key(3), OBS, ACT, SMALL)
    rng = np.random.default_rng(1)
    obs, action = rng.normal(size=(7, OBS)).astype(np.float32), rng.uniform(-1, 1, (7, ACT)).astype(np.float32)
    reward = rng.normal(size=7).astype(np.float32)
    q = np.asarray(neubay.history_values(state, obs, action, reward))
    assert q.shape == (SMALL.critics, 7)
    # the same episode as a training tape: inputs [s_t, a_{t-1}, r_{t-1}], zeros before the start
    inputs = np.concatenate(
        [obs, np.vstack([np.zeros((1, ACT)), action[:-1]]), np.concatenate([[0.0], reward[:-1]])[:, None]], axis=1
    )[None].astype(np.float32)
    start = np.arange(7)[None] == 0
    h = neubay._encode(
        state.critic_encoder,
        state.critic_params["encoder"],
        neubay.TapeBatch(inputs, start, action[None], reward[None], start, start),
    )
    np.testing.assert_allclose(
        q, np.asarray(neubay._q(state, state.critic_params["heads"], h, action[None]))[:, 0], rtol=1e-5, atol=1e-6
    )
    # changing step 4 leaves the values of steps 0-3 and changes the later ones
    obs2 = obs.copy()
    obs2[4] += 1.0
    q2 = np.asarray(neubay.history_values(state, obs2, action, reward))
    np.testing.assert_allclose(q2[:, :4], q[:, :4], rtol=1e-6, atol=1e-6)
    assert np.all(np.abs(q2[:, 4:] - q[:, 4:]).max(axis=0) > 1e-6)


def test_first_true_and_open_loop_replay_against_a_step_by_step_loop():
    from plasticity_zoo.analysis.offline_diagnostics import first_true, open_loop_ends

    assert first_true([[False, True, True], [False, False, False], [True, False, True]]).tolist() == [2, 0, 1]
    model = dyn.init_model(jax.random.key(4), OBS, ACT, dyn.neubay_config(members=5, elites=4, width=8, depth=1))
    model = model.replace(elites=jnp.array([3, 0, 4, 1]))
    rng = np.random.default_rng(2)
    s0, actions = rng.normal(size=OBS).astype(np.float32), rng.uniform(-1, 1, (30, ACT)).astype(np.float32)
    # the reference: each elite alone, its own mean prediction fed back; ends where |s_0| first exceeds 2
    expected = []
    for e in np.asarray(model.elites):
        s, end = s0[None], 0
        for t, a in enumerate(actions):
            mean, _ = dyn.predict(model, jnp.asarray(s), jnp.asarray(a[None]))
            s = s + np.asarray(mean)[e, :, :OBS]
            if end == 0 and abs(s[0, 0]) > 2.0:
                end = t + 1
        expected.append(end)
    got = open_loop_ends(model, s0, actions, lambda s: jnp.abs(s[..., 0]) > 2.0)
    assert got.tolist() == expected
    assert all(expected) and len(set(expected)) > 1  # the case: every elite ends, not all at one step


@pytest.mark.slow
def test_diagnostics_compare_imagination_with_the_real_episodes(finished_run, capsys):
    import json

    from scripts.diagnose_offline import main

    _, run_dir = finished_run
    d = main([str(run_dir), "--episodes", "2", "--samples", "256"])
    assert "world-model posterior of 3 elites" in capsys.readouterr().out
    assert json.loads((run_dir / "diagnostics.json").read_text()) == json.loads(json.dumps(d))
    assert d["kind"] == "posterior" and d["step"] == 400 and d["threshold"] > 0
    # quantile 1: the threshold is the largest uncertainty over the dataset, these rows are a sample of it
    m = d["model_on_data"]
    assert m["uncertainty_median"] < m["uncertainty_max"] <= d["threshold"] * (1 + 1e-6)
    s = d["seeds"][0]
    start = s["imagination"]["from_start_deterministic"]
    assert start["horizon_p10"] <= start["horizon_p50"] <= start["horizon_p90"] <= start["horizon_max"] <= 20
    # from the start states no prefix is a whole trajectory: every tape ends one way
    assert start["ended_terminated"] + start["ended_uncertainty"] + start["ended_horizon"] == pytest.approx(1.0)
    for e in s["episodes"]:
        assert e["length"] == 20 and not e["terminated"]  # ToyReach: 20 steps, never terminal
        assert e["reward_per_step"] == pytest.approx(e["return"] / 20)
        assert np.isfinite(e["q_first"]) and e["q_std"] > 0 and e["state_mse_median"] > 0
        assert e["open_loop_ended"] == 0.0  # ToyReach's termination function never fires
