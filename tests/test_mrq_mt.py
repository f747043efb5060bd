"""Multitask MR.Q (agents/mrq_mt.py, ScaleMRL): hand values for the per-task discount, the
discrete regression, RunningScale and the masked multi-step target with two sampled heads; the
task embedding's gradient, action masks, the UTD credit, and runs through train.py."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import mrq_mt
from plasticity_zoo.buffers.lap import Window
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.envs.multitask import TaskSpec
from plasticity_zoo.networks.config import NetworkConfig

TINY = NetworkConfig(width=16)
# three tasks: observation widths 4 / 2 / 3, action widths 1 / 2 / 1, episodes 500 / 1000 / 50 steps
SPEC = TaskSpec("mt:test", ("a", "b", "c"), (4, 2, 3), (1, 2, 1), (500, 1000, 50))


def _cfg(**kw):
    return mrq_mt.with_tasks(mrq_mt.CONFIG(model_size="S", batch_size=8, buffer_size=512, **kw), SPEC)


def _state(**kw):
    cfg = _cfg(**kw)
    return jax.jit(lambda k: mrq_mt.init(k, SPEC.obs_dim, SPEC.act_dim, cfg, TINY))(jax.random.key(0))


_update = jax.jit(mrq_mt.update)


@pytest.fixture(scope="module")
def state():
    """``_state()`` (the default config's agent), initialised once for the tests that only read it."""
    return _state()


def _obs(rng, tasks):
    """mt: observations of the given tasks: each task's own dims random, zero padding, one-hot."""
    obs = np.zeros((len(tasks), SPEC.obs_dim), np.float32)
    for i, t in enumerate(tasks):
        obs[i, : SPEC.obs_dims[t]] = rng.normal(size=SPEC.obs_dims[t])
        obs[i, SPEC.max_obs_dim + t] = 1.0
    return obs


def _windows(tasks, h=5, seed=0, terminated=None):
    rng = np.random.default_rng(seed)
    b = len(tasks)
    nxt = np.stack([_obs(rng, tasks) for _ in range(h)], axis=1)
    term = np.zeros((b, h), bool) if terminated is None else terminated
    return Window(
        jnp.asarray(_obs(rng, tasks)),
        jnp.asarray(rng.uniform(-1, 1, (b, h, SPEC.act_dim)), jnp.float32),
        jnp.asarray(rng.normal(size=(b, h)), jnp.float32),
        jnp.asarray(nxt),
        jnp.asarray(term),
        jnp.zeros((b, h), bool),
    )


def test_the_per_task_discount_follows_scalemrls_episode_length_heuristic(state):
    # f = L / 5; gamma = clip((f - 1) / f, 0.95, 0.995)
    cfg = _cfg()
    got = mrq_mt.task_discounts(cfg, [500, 1000, 50, 200, 100_000])
    np.testing.assert_allclose(got, [99 / 100, 199 / 200, 0.95, 39 / 40, 0.995], rtol=1e-6)
    np.testing.assert_allclose(mrq_mt.task_discounts(_cfg(gamma=0.9), [500, 50]), [0.9, 0.9])
    np.testing.assert_allclose(state.discounts, [0.99, 0.995, 0.95], rtol=1e-6)


def test_the_two_hot_of_symlog_puts_its_mass_on_the_two_neighbouring_bins_and_decodes_back():
    n, lo, hi = 101, -10.0, 10.0  # bins 0.2 apart in symlog space
    x = jnp.asarray([0.0, np.expm1(1.05), -np.expm1(0.3), 1e9])
    th = np.asarray(mrq_mt.two_hot_symlog(x, n, lo, hi))
    np.testing.assert_allclose(th.sum(-1), 1.0, rtol=1e-6)
    assert th[0, 50] == pytest.approx(1.0)  # symlog 0 sits on bin 50
    assert th[1, 55] == pytest.approx(0.75, abs=1e-4) and th[1, 56] == pytest.approx(
        0.25, abs=1e-4
    )  # 1.05 = 1.0 + 0.25 x 0.2
    assert th[2, 48] == pytest.approx(0.5, abs=1e-4) and th[2, 48] == pytest.approx(th[2, 49], abs=1e-4)  # -0.3
    assert th[3, 100] == pytest.approx(1.0)  # clipped at vmax
    logits = jnp.log(jnp.asarray(th[:3]) + 1e-12)
    np.testing.assert_allclose(mrq_mt.two_hot_symlog_decode(logits, n, lo, hi), x[:3], rtol=1e-4, atol=1e-5)
    ce = mrq_mt.soft_cross_entropy(jnp.zeros((1, n)), jnp.asarray([3.0]), n, lo, hi)
    assert float(ce[0]) == pytest.approx(np.log(n), rel=1e-6)  # uniform prediction: CE = log n


def test_running_scale_moves_towards_the_5_95_percentile_range_at_rate_tau():
    q = jnp.arange(101, dtype=jnp.float32)  # P5 = 5, P95 = 95
    assert float(mrq_mt.running_scale(jnp.float32(1.0), q, 0.01)) == pytest.approx(1.0 + 0.01 * (90 - 1))
    assert float(mrq_mt.running_scale(jnp.float32(2.0), q * 0.001, 0.5)) == pytest.approx(1.5)  # range < 1 -> 1


@pytest.mark.slow
def test_the_masked_multistep_target_uses_each_tasks_discount_and_the_min_of_two_sampled_heads(state):
    term = np.zeros((3, 5), bool)
    term[1, 2] = True  # task 1's window ends at its third transition
    win = _windows([0, 1, 2], terminated=term)
    key = jax.random.key(7)
    y = np.asarray(mrq_mt.value_target(state, win, key))

    # by hand: R = sum_i gamma^i c_i r_i, bootstrap gamma^5 c_5 min(Q'_i, Q'_j) with the drawn heads
    gammas = np.array([0.99, 0.995, 0.95])
    r = np.asarray(win.reward, np.float64)
    alive = np.ones((3, 6))
    alive[1, 3:] = 0.0  # c_0..c_2 = 1 (the terminating reward counts), c_3.. = 0
    ret = np.sum(gammas[:, None] ** np.arange(5) * alive[:, :5] * r, axis=1)
    k_noise, k_heads = jax.random.split(key)
    heads = np.asarray(mrq_mt.two_heads(state, k_heads))
    assert heads.shape == (2,) and heads[0] != heads[1]
    next_zs, task = mrq_mt.encode(state, state.target_encoder_params, state.task_params, win.next_obs[:, -1])
    a, _ = mrq_mt.policy_action(state, state.target_policy_params, next_zs, task)
    noise = jnp.clip(0.2 * jax.random.normal(k_noise, a.shape, a.dtype), -0.3, 0.3)
    a = jnp.clip(a + noise, -1, 1) * state.action_mask[task]
    zsa, _ = state.sa_encoder(state.target_sa_encoder_params, next_zs, a)
    q_all = np.asarray(mrq_mt.q_values(state, state.target_value_params, zsa))  # (K, B)
    expect = ret + gammas**5 * alive[:, 5] * q_all[heads].min(axis=0)
    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-6)
    # the heads matter: another pair of heads gives another target
    others = [p for p in ((0, 1), (0, 2), (1, 2)) if set(p) != set(heads.tolist())]
    assert any(
        not np.allclose(ret + gammas**5 * alive[:, 5] * q_all[list(p)].min(axis=0), y, atol=1e-7) for p in others
    )


@pytest.mark.slow
def test_the_task_embedding_gradient_reaches_only_the_rows_of_tasks_in_the_batch(state):
    grad = np.asarray(jax.jit(mrq_mt.task_embedding_grad)(state, _windows([0, 2, 2, 0])))
    assert grad.shape == (3, 96)
    assert np.all(grad[1] == 0.0)
    assert np.abs(grad[0]).sum() > 0 and np.abs(grad[2]).sum() > 0
    # one update moves exactly those rows (weight decay aside, row 1's Adam update is 0)
    batch = _windows([0, 2, 2, 0, 0, 2, 0, 2])
    new, _ = _update(state, batch, jax.random.key(1))
    moved = np.abs(np.asarray(new.task_params) - np.asarray(state.task_params)).max(axis=1)
    decay_only = np.abs(np.asarray(state.task_params[1])).max() * 0.3 * 3e-4 * 1e-4 * 1.01
    assert moved[0] > 1e-6 and moved[2] > 1e-6 and moved[1] <= decay_only


@pytest.mark.slow
def test_fixed_embeddings_from_a_file_are_used_and_never_trained(tmp_path):
    rows = np.arange(3 * 5, dtype=np.float32).reshape(3, 5) / 10
    np.save(tmp_path / "e.npy", rows)
    state = _state(task_embeddings=str(tmp_path / "e.npy"))
    assert not state.learned_tasks and mrq_mt.param_count(state)["task_embedding"] == 0
    new, _ = _update(state, _windows([0, 1, 2, 0, 1, 2, 0, 1]), jax.random.key(1))
    np.testing.assert_array_equal(new.task_params, rows)
    (tmp_path / "bad.json").write_text('{"a": [1, 2], "b": [3, 4]}')
    with pytest.raises(ValueError, match="no embedding for task"):
        _state(task_embeddings=str(tmp_path / "bad.json"))
    np.save(tmp_path / "short.npy", rows[:2])
    with pytest.raises(ValueError, match="3 x D"):
        _state(task_embeddings=str(tmp_path / "short.npy"))


@pytest.mark.slow
def test_actions_are_zero_on_every_padded_dimension_exploring_or_not(state):
    obs = jnp.asarray(_obs(np.random.default_rng(0), [0, 1, 2] * 20))
    for explore in (False, True):
        a = np.asarray(mrq_mt.act(state, obs, jax.random.key(3), explore))
        assert np.all(a[0::3, 1] == 0.0) and np.all(a[2::3, 1] == 0.0)  # tasks 0 and 2 have one action
        assert np.all(np.abs(a) <= 1.0) and np.any(a[1::3, 1] != 0.0)


def _filled_buffer(cfg, n=64):
    rng = np.random.default_rng(0)
    buf = mrq_mt.buffer_init(cfg.buffer_size, SPEC.obs_dim, SPEC.act_dim, cfg)
    add = jax.jit(mrq_mt.buffer_add)
    for _ in range(n):
        obs = _obs(rng, [0, 1, 2])
        tr = Transition(
            jnp.asarray(obs),
            jnp.asarray(rng.uniform(-1, 1, (3, 2)), jnp.float32),
            jnp.asarray(rng.normal(size=3), jnp.float32),
            jnp.asarray(obs + 0.01),
            jnp.zeros(3, bool),
            jnp.zeros(3, bool),
        )
        buf = add(buf, tr)
    return buf


@pytest.mark.slow
def test_updates_follow_the_utd_credit_exactly_and_the_same_seed_reproduces():
    cfg = _cfg(utd=0.3)
    state = jax.jit(lambda k: mrq_mt.init(k, SPEC.obs_dim, SPEC.act_dim, cfg, TINY))(jax.random.key(0))
    buf = _filled_buffer(cfg)
    block = jax.jit(mrq_mt.train_block, static_argnums=(3,))
    counts, s = [], state
    for i in range(7):
        s, buf, m = block(s, buf, jax.random.key(i), 3)  # 3 env steps (one per task) per call
        counts.append(int(s.updates))
    assert counts == [int(np.floor(0.3 * 3 * (i + 1) + 1e-6)) for i in range(7)]  # 0, 1, 2, 3, 4, 5, 6
    assert 0.0 <= float(s.update_credit) < 1.0 and np.isfinite(float(m["losses/value"]))
    again, _, _ = block(s, buf, jax.random.key(0), 3)  # a 0.3 credit + 0.9 owed: one update
    twice, _, _ = block(s, buf, jax.random.key(0), 3)
    other, _, _ = block(s, buf, jax.random.key(1), 3)
    same = jax.tree.leaves(again.value_params)[0], jax.tree.leaves(twice.value_params)[0]
    np.testing.assert_array_equal(*same)
    assert not np.array_equal(same[0], jax.tree.leaves(other.value_params)[0])


@pytest.mark.parametrize("tasks,envs", [(1, 1), (2, 2), (2, 4), (3, 3), (21, 21)])
def test_learning_starts_after_five_random_episodes_per_env_as_scalemrl_seeds(tasks, envs):
    # ScaleMRL trainer.py: random actions while step < seeding_coef (5) x num_envs x episode_length, the
    # step counting every env's steps; evaluation every 20 x 500 x num_envs steps, 2 episodes per env.
    spec = TaskSpec("mt:x", ("t",) * tasks, (3,) * tasks, (1,) * tasks, (500,) * tasks)
    assert mrq_mt.protocol(spec, envs) == {
        "learning_starts": 2_500 * envs,
        "eval_every": 10_000 * envs,
        "eval_episodes": 2,
    }
    if tasks == 21:
        assert mrq_mt.protocol(spec, envs)["learning_starts"] == 52_500  # mt:dmc21
    # tasks of unequal length: the longest episode (ScaleMRL's cfg.episode_length is their max)
    assert mrq_mt.protocol(SPEC, 3)["learning_starts"] == 5 * 3 * 1000


def test_the_schedule_fills_only_what_the_command_line_and_the_config_leave_unset():
    from plasticity_zoo.training.cli import parse
    from plasticity_zoo.training.config import RunConfig
    from plasticity_zoo.training.run import protocol_defaults

    env = "mt:dmc:cartpole-balance,dmc:cartpole-swingup"  # two tasks of 500 agent steps
    cfg = parse(["mrq-mt", "--env", env, "--run-dir", "/nonexistent/x"])
    assert (cfg.num_envs, cfg.agent.learning_starts, cfg.eval_every, cfg.eval_episodes) == (2, 5_000, 20_000, 2)
    cfg = parse(["mrq-mt", "--env", env, "--num-envs", "4", "--eval-every=5000", "--run-dir", "/nonexistent/x"])
    assert (cfg.agent.learning_starts, cfg.eval_every, cfg.eval_episodes) == (10_000, 5_000, 2)
    cfg = parse(["mrq-mt", "--env", env, "--learning-starts", "300", "--run-dir", "/nonexistent/x"])
    assert (cfg.agent.learning_starts, cfg.eval_every, cfg.eval_episodes) == (300, 5_000, 10)
    cfg = parse(["mrq-mt", "--preset", "mrq-mt-scalemrl", "--env", env, "--run-dir", "/nonexistent/x"])
    assert (cfg.total_steps, cfg.agent.learning_starts, cfg.eval_every, cfg.eval_episodes) == (
        10_000_000,
        5_000,
        20_000,
        2,
    )
    # a config built in Python: fields left at RunConfig's defaults take the schedule; applying it twice is a no-op
    lib = RunConfig(env=env, num_envs=2, eval_episodes=4, agent_name="mrq-mt", agent=mrq_mt.CONFIG())
    done = protocol_defaults(lib, mrq_mt, log=lambda _: None)
    assert (done.agent.learning_starts, done.eval_every, done.eval_episodes) == (5_000, 20_000, 4)
    assert protocol_defaults(done, mrq_mt, log=lambda _: None) == done


def test_bad_settings_are_refused_with_the_flag_named():
    for kw, msg in (
        (dict(updates_per_step=2), "--utd"),
        (dict(utd=0.0), "--utd"),
        (dict(num_q=1), "--num-q"),
        (dict(tau=1.5), "--tau"),
    ):
        with pytest.raises(ValueError, match=msg):
            _state(**kw)
    with pytest.raises(ValueError, match="mt:"):
        mrq_mt.with_tasks(mrq_mt.CONFIG(), None)


@pytest.mark.parametrize("size,heads", [("S", 3), ("B", 5), ("L", 5), ("XL", 7)])
def test_model_sizes_follow_scalemrls_table(size, heads):
    cfg = dataclasses.replace(_cfg(), model_size=size)
    state = jax.eval_shape(lambda k: mrq_mt.init(k, SPEC.obs_dim, SPEC.act_dim, cfg), jax.random.key(0))
    widths = mrq_mt.MODEL_SIZES[size]
    assert jax.tree.leaves(state.value_params)[0].shape[0] == heads
    f = state.encoder_params
    assert f["out"]["kernel"].shape == (widths["enc_dim"], widths["latent_dim"])
    assert len(f["trunk"]["layers"]) == max(widths["enc_layers"] - 1, 1)
    assert state.policy_params["trunk"]["layers"][0]["kernel"].shape == (widths["latent_dim"] + 96, widths["mlp_dim"])


def _run_config(**kw):
    from plasticity_zoo.training.config import PlasticityConfig, RunConfig

    agent = mrq_mt.CONFIG(
        **{
            "model_size": "S",
            "buffer_size": 512,
            "batch_size": 8,
            "learning_starts": 20,
            "utd": 0.5,
            **kw.pop("agent", {}),
        }
    )
    return RunConfig(
        **{
            "env": "mt:cartpole2",
            "seeds": 2,
            "num_envs": 2,
            "total_steps": 80,
            "eval_every": 40,
            "eval_episodes": 1,
            "log_every": 20,
            "checkpoint_every": 40,
            "progress": False,
            "network": NetworkConfig(width=16),
            "agent_name": "mrq-mt",
            "agent": agent,
            "plasticity": PlasticityConfig(metrics_every=20, metrics_batch=8, redo=True, reset_every=20, reset_batch=8),
            **kw,
        }
    )


@pytest.mark.slow
def test_a_resumed_run_with_plasticity_metrics_and_redo_equals_the_uninterrupted_one(tmp_path, assert_same_logs):
    """Two seeds on two cartpole tasks with the plasticity metrics and ReDo on: stopped at step 40
    and resumed, the run ends bit-identical to an uninterrupted one, with per-task eval rows."""
    import csv

    from plasticity_zoo.training.loops import offpolicy

    agent = importlib.import_module("plasticity_zoo.agents").get("mrq-mt")
    cfg = _run_config()
    full = offpolicy.train(cfg, agent, tmp_path / "full")
    part = offpolicy.train(cfg, agent, tmp_path / "part", stop_at=40)
    assert part["step"] == 40
    resumed = offpolicy.train(cfg, agent, tmp_path / "part", resume=True)
    assert resumed["step"] == 80
    for x, y in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(x, y)
    assert_same_logs(tmp_path / "full", tmp_path / "part")
    rows = list(csv.DictReader(open(tmp_path / "full" / "eval.csv")))
    assert {r["task"] for r in rows} == {"dmc:cartpole-balance", "dmc:cartpole-swingup", "all"}
    metrics = list(csv.DictReader(open(tmp_path / "full" / "metrics.csv")))
    assert any(r.get("plasticity/value/dormant_0.025", "") != "" for r in metrics) or any(
        k.startswith("plasticity/state_encoder") and r[k] != "" for r in metrics for k in r
    )
    assert int(float(metrics[-1]["charts/updates"])) == 31  # 0.5 x 2 env steps x 31 learning iterations (steps 20..80)
    seeds = [jax.tree.leaves(full["state"].value_params)[0][j] for j in range(2)]
    assert not np.array_equal(*seeds)  # the two seeds differ


@pytest.mark.optimized
@pytest.mark.slow
def test_a_short_run_on_two_tasks_beats_its_untrained_policy_on_each(tmp_path):
    """mrq-mt at size S (width 64) on Pendulum-v1 and dmc:cartpole-swingup side by side (observations
    3 and 5 wide, one action each; 200- and 500-step episodes, so discounts 0.975 and 0.99), one
    update per env step on batches of 64: after 3000 steps per task the final evaluation beats the
    untrained policy's on each task (mean of 4 episodes per task of one seed; the run behind this test:
    Pendulum -1397 -> -1004, cartpole-swingup 14 -> 138; about 100 s on 2 cores)."""
    import csv

    from plasticity_zoo.training.config import PlasticityConfig
    from plasticity_zoo.training.loops import offpolicy

    agent = importlib.import_module("plasticity_zoo.agents").get("mrq-mt")
    env = "mt:Pendulum-v1,dmc:cartpole-swingup"
    cfg = _run_config(
        env=env,
        seeds=1,
        total_steps=6000,
        eval_every=6000,
        eval_episodes=4,
        log_every=1000,
        checkpoint_every=100_000,
        network=NetworkConfig(width=64),
        plasticity=PlasticityConfig(),
        agent={"batch_size": 64, "buffer_size": 10_000, "learning_starts": 1000, "utd": 1.0},
    )
    offpolicy.train(cfg, agent, tmp_path / "run")
    rows = list(csv.DictReader(open(tmp_path / "run" / "eval.csv")))

    def mean(step, task):
        return np.mean([float(r["return_mean"]) for r in rows if r["step"] == str(step) and r["task"] == task])

    for task, margin in (("Pendulum-v1", 150.0), ("dmc:cartpole-swingup", 50.0)):
        assert mean(6000, task) > mean(0, task) + margin, (task, mean(0, task), mean(6000, task))
