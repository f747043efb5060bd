"""RAVL: the model FIFO, the real/model batch mix, the offline loop and a short learning run."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import ravl
from plasticity_zoo.buffers import replay
from plasticity_zoo.buffers.replay import Transition


def _transitions(n, obs_dim=3, act_dim=2, reward=0.0, start=0):
    obs = np.arange(start, start + n, dtype=np.float32)[:, None] * np.ones((1, obs_dim), np.float32)
    return Transition(
        jnp.asarray(obs),
        jnp.zeros((n, act_dim)),
        jnp.full((n,), reward, jnp.float32),
        jnp.asarray(obs + 1),
        jnp.zeros(n, bool),
        jnp.zeros(n, bool),
    )


def test_add_masked_keeps_valid_rows_in_order_and_wraps():
    buf = replay.init(5, 3, 2)
    batch = _transitions(4)
    buf = replay.add_masked(buf, batch, jnp.array([True, False, True, True]))
    assert int(buf.size) == 3 and int(buf.ptr) == 3
    np.testing.assert_array_equal(np.asarray(buf.data.obs[:3, 0]), [0, 2, 3])
    buf = replay.add_masked(buf, _transitions(4, start=10), jnp.array([True, True, True, False]))
    # 3 more rows: slots 3, 4, then wrap to 0 (the oldest, obs 0, is overwritten)
    assert int(buf.size) == 5 and int(buf.ptr) == 1
    np.testing.assert_array_equal(np.asarray(buf.data.obs[:, 0]), [12, 2, 3, 10, 11])
    untouched = replay.add_masked(buf, _transitions(4, start=20), jnp.zeros(4, bool))
    np.testing.assert_array_equal(np.asarray(untouched.data.obs), np.asarray(buf.data.obs))
    assert int(untouched.ptr) == 1


@pytest.mark.parametrize("ratio,batch", [(0.05, 256), (0.5, 64), (0.0, 32), (1.0, 16)])
def test_batch_mix_has_the_requested_ratio(ratio, batch):
    cfg = ravl.RAVLConfig(dataset_ratio=ratio, batch_size=batch, rollout_batch=10, horizon=2, retain_epochs=5)
    data = ravl.data_init(_transitions(50, reward=1.0), cfg)
    data = data._replace(model=replay.add(data.model, _transitions(40, reward=-1.0)))
    holder = types.SimpleNamespace(cfg=cfg)  # sample_batch reads the ratio from the agent state's cfg
    out = jax.jit(lambda d, k: ravl.sample_batch(holder, d, k, batch))(data, jax.random.key(0))
    assert out.reward.shape == (batch,)
    n_real = int((np.asarray(out.reward) == 1.0).sum())
    assert n_real == int(ratio * batch) == ravl.real_count(cfg)
    assert int((np.asarray(out.reward) == -1.0).sum()) == batch - n_real
    # real rows are dataset rows, model rows come from the FIFO
    obs = np.asarray(out.obs[:, 0])
    assert np.all(obs[:n_real] < 50) and np.all(obs[n_real:] < 40)


def test_model_fifo_holds_retain_epochs_of_rollouts():
    cfg = ravl.RAVLConfig(rollout_batch=100, horizon=5, retain_epochs=5)
    assert ravl.model_capacity(cfg) == 100 * 5 * 5
    data = ravl.data_init(_transitions(10), cfg)
    assert replay.capacity(data.model) == 2500


def test_config_checks():
    with pytest.raises(ValueError, match="dataset-ratio"):
        ravl.init(jax.random.key(0), 3, 2, ravl.RAVLConfig(dataset_ratio=1.5))
    with pytest.raises(ValueError, match="horizon"):
        ravl.init(jax.random.key(0), 3, 2, ravl.RAVLConfig(horizon=0))
    cfg = ravl.RAVLConfig(dynamics={"members": 3, "elites": 2})
    assert cfg.dynamics.members == 3 and dataclasses.is_dataclass(cfg.dynamics)


# ----------------------------------------------------------------------------- the offline loop end to end


def _toy_dataset(path, n=2000):
    """Uniform-random actions on ToyReach-v0, with reference returns (random 0-ish, 'expert' 30)."""
    from plasticity_zoo.envs import datasets
    from plasticity_zoo.envs.collect import collect

    rng = np.random.default_rng(0)
    ds = collect("ToyReach-v0", lambda o: rng.uniform(-1, 1, (o.shape[0], 1)), n, 0, num_envs=4, record_state=False)
    ds.metadata.update({"env_id": "ToyReach-v0", "kind": "random", "ref_min_score": 0.0, "ref_max_score": 30.0})
    datasets.save(path, ds)
    return ds


def _ravl_config(dataset, run_dir, total=2000, **kw):
    from plasticity_zoo.agents.dynamics import DynamicsConfig
    from plasticity_zoo.training.config import NetworkConfig, RunConfig

    dyn = DynamicsConfig(members=3, elites=2, width=32, depth=2, min_epochs=15, max_epochs=30, batch_size=128)
    agent_kw = {
        "dataset": str(dataset),
        "critics": 3,
        "eta": 1.0,
        "rollout_batch": 400,
        "horizon": 5,
        "updates_per_epoch": 200,
        "batch_size": 64,
        "dataset_ratio": 0.25,
        "dynamics": dyn,
        **{k: kw.pop(k) for k in list(kw) if k in ravl.RAVLConfig.__dataclass_fields__},
    }
    agent = ravl.RAVLConfig(**agent_kw)
    return RunConfig(
        **{
            "env": None,
            "total_steps": total,
            "eval_every": 1000,
            "eval_episodes": 4,
            "log_every": 200,
            "checkpoint_every": 1000,
            "progress": False,
            "run_dir": str(run_dir),
            "network": NetworkConfig(width=32),
            "agent_name": "ravl",
            "agent": agent,
            **kw,
        }
    )


@pytest.fixture(scope="module")
def toy_dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("offline") / "toyreach-random.hdf5"
    _toy_dataset(path)
    return path


@pytest.mark.optimized
@pytest.mark.slow
def test_short_ravl_run_beats_its_untrained_policy(toy_dataset, tmp_path):
    import csv

    from plasticity_zoo.training.run import run

    out = run(_ravl_config(toy_dataset, tmp_path / "run", seeds=2))
    rows = list(csv.DictReader(open(tmp_path / "run" / "eval.csv")))
    first = [float(r["return_mean"]) for r in rows if r["step"] == "0"]
    last = [float(r["return_mean"]) for r in rows if r["step"] == "2000"]
    assert len(first) == len(last) == 2
    assert np.mean(last) > np.mean(first) + 10.0 and np.mean(last) > 15.0, (first, last)
    # normalised score against the dataset's own references (0 and 30): 100 * R / 30
    for r in rows:
        assert float(r["score_dataset"]) == pytest.approx(100 * float(r["return_mean"]) / 30.0, rel=1e-6)
    # the model was cached next to the dataset and the rollouts filled the FIFO
    assert ravl.model_path(toy_dataset, 0).exists()
    assert np.all(np.asarray(out["state"].updates) == 2000)


@pytest.mark.slow
def test_offline_resume_equals_uninterrupted(toy_dataset, tmp_path):
    from plasticity_zoo.training.run import run

    full = run(
        _ravl_config(
            toy_dataset, tmp_path / "a", total=400, updates_per_epoch=100, checkpoint_every=200, eval_every=200
        )
    )
    run(
        _ravl_config(
            toy_dataset, tmp_path / "b", total=400, updates_per_epoch=100, checkpoint_every=200, eval_every=200
        ),
        stop_at=200,
    )
    resumed = run(
        dataclasses.replace(
            _ravl_config(
                toy_dataset, tmp_path / "b", total=400, updates_per_epoch=100, checkpoint_every=200, eval_every=200
            ),
            resume=str(tmp_path / "b"),
        )
    )
    for x, y in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    from plasticity_zoo.training.run import load_config  # what `train.py --resume DIR` reads

    assert load_config(tmp_path / "b").agent.dataset == str(toy_dataset)
    ea = (tmp_path / "a" / "eval.csv").read_text()
    eb = (tmp_path / "b" / "eval.csv").read_text()
    assert ea == eb


def test_offline_cli_errors(toy_dataset, tmp_path):
    from scripts.train import main

    with pytest.raises(SystemExit, match="give --dataset PATH or --env ENV --kind KIND"):
        main(["ravl", "--run-dir", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="does not match the dataset's env"):
        main(["ravl", "--dataset", str(toy_dataset), "--env", "Hopper-v5", "--run-dir", str(tmp_path / "y")])
    # an explicit --env equal to RunConfig's default (Pendulum-v1) is held against the dataset too (#23)
    with pytest.raises(SystemExit, match="--env Pendulum-v1 does not match the dataset's env ToyReach-v0"):
        main(["ravl", "--dataset", str(toy_dataset), "--env", "Pendulum-v1", "--run-dir", str(tmp_path / "v")])
    assert not (tmp_path / "v").exists()
    with pytest.raises(ValueError, match="plasticity.least does not apply"):
        main(["ravl", "--dataset", str(toy_dataset), "--plasticity.least", "--run-dir", str(tmp_path / "z")])
    with pytest.raises(SystemExit, match="no such file"):
        main(["ravl", "--dataset", str(tmp_path / "missing.hdf5"), "--run-dir", str(tmp_path / "w")])


@pytest.mark.slow
def test_cached_dynamics_model_must_match_the_settings_and_the_data(toy_dataset, tmp_path):
    from plasticity_zoo.agents import dynamics
    from plasticity_zoo.envs import datasets

    ds = datasets.load(toy_dataset)
    path = tmp_path / "model.npz"
    small = dynamics.DynamicsConfig(members=2, elites=1, width=8, depth=1)
    dynamics.save(path, dynamics.init_model(jax.random.key(0), 1, 1, small))
    cfg = ravl.RAVLConfig(dynamics=small)
    model = ravl.prepare(
        jax.random.key(0), ds, tmp_path / "data.hdf5", dataclasses.replace(cfg, model=str(path)), 0, log=lambda *_: None
    )
    assert model.cfg == small
    # the default cache location holds a model trained with other settings -> refuse, say which
    dynamics.save(ravl.model_path(tmp_path / "data.hdf5", 0), dynamics.init_model(jax.random.key(0), 1, 1, small))
    with pytest.raises(SystemExit, match="other --dynamics settings .*members"):
        ravl.prepare(jax.random.key(0), ds, tmp_path / "data.hdf5", ravl.RAVLConfig(), 0, log=lambda *_: None)
    dynamics.save(path, dynamics.init_model(jax.random.key(0), 3, 1, small))
    with pytest.raises(SystemExit, match="obs/act dims 3/1"):
        ravl.prepare(
            jax.random.key(0),
            ds,
            tmp_path / "x.hdf5",
            dataclasses.replace(cfg, model=str(path)),
            0,
            log=lambda *_: None,
        )


# ----------------------------------------------------------------------------- diagnostics


def test_returns_to_go_restart_at_episode_ends():
    from plasticity_zoo.analysis.offline_diagnostics import episode_ends, returns_to_go

    # hand-derived, gamma 0.5: episode [1, 2] -> [1 + 0.5 * 2, 2]; episode [3, 4] -> [5, 4]
    np.testing.assert_allclose(returns_to_go([1, 2, 3, 4], [False, True, False, True], 0.5), [2, 2, 5, 4])

    class Rows:  # a dataset whose chain breaks after row 1 (no terminal or timeout there) and is cut after row 3
        observations = np.array([[0.0], [1.0], [5.0], [6.0]])
        next_observations = np.array([[1.0], [2.0], [6.0], [7.0]])
        terminals = np.zeros(4, bool)
        timeouts = np.zeros(4, bool)

    np.testing.assert_array_equal(episode_ends(Rows), [False, True, False, True])


def test_episode_values_locate_the_peak_of_min_q():
    from plasticity_zoo.analysis.offline_diagnostics import episode_values

    q = np.array(
        [
            [1.0, 5.0, 9.0, 2.0],  # critic 0 along a 4-step episode
            [3.0, 4.0, 7.0, 8.0],
        ]
    )  # critic 1; min-Q per step: 1, 4, 7, 2
    e = episode_values(q)
    assert (e["q_min_first"], e["q_min_max"], e["q_min_max_at"], e["q_min_last"]) == (1.0, 7.0, 2, 2.0)
    np.testing.assert_allclose(e["q_std"], np.mean([1.0, 0.5, 1.0, 3.0]))


def test_nearest_distances_scale_chunk_and_skip_the_points_own_episode():
    from plasticity_zoo.analysis.offline_diagnostics import episode_coverage, nearest_distances

    reference = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    points = np.array([[0.0, 0.0], [3.0, 4.0]])
    # hand-derived: (3, 4) is 5 from (0, 0), 4 from (3, 0) and 3 from (0, 4)
    np.testing.assert_allclose(nearest_distances(points, reference, np.ones(2), chunk=1), [0.0, 3.0])
    # dimension 1 divided by 2: (3, 2) is 2 from (3, 0) and 3 from (0, 2)
    np.testing.assert_allclose(nearest_distances(points, reference, np.array([1.0, 2.0]), chunk=2), [0.0, 2.0])
    # reference episodes [0, 1, 1]: point 0 (episode 1) only sees row 0, point 1 (episode 0) only rows 1-2
    np.testing.assert_allclose(
        nearest_distances(points, reference, np.ones(2), np.array([0, 1, 1]), np.array([1, 0]), chunk=1), [0.0, 3.0]
    )
    assert episode_coverage([0.5, 2.0, 1.0]) == {
        "data_distance_first": 0.5,
        "data_distance_max": 2.0,
        "data_distance_last": 1.0,
    }


@pytest.mark.slow
def test_offline_diagnostics_report_values_model_and_real_episodes(toy_dataset, tmp_path, capsys):
    import json

    from plasticity_zoo.training.run import run
    from scripts.diagnose_offline import main

    run(
        _ravl_config(
            toy_dataset, tmp_path / "run", total=200, updates_per_epoch=100, checkpoint_every=200, eval_every=200
        )
    )
    d = main([str(tmp_path / "run"), "--episodes", "2", "--samples", "256"])
    assert "dataset discounted return-to-go" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "diagnostics.json").read_text()) == json.loads(json.dumps(d))
    assert d["step"] == 200 and d["env_id"] == "ToyReach-v0" and len(d["seeds"]) == 1
    s = d["seeds"][0]
    for where in ("data_actions", "policy_actions", "random_actions"):
        assert s[where]["q_min"] <= s[where]["q_mean"] and s[where]["q_std"] > 0
    assert np.isfinite(s["drift_real"]) and np.isfinite(s["drift_model"])
    assert len(s["episodes"]) == 2 and all(e["length"] >= 1 and np.isfinite(e["model_error"]) for e in s["episodes"])
    assert all(0 <= e["q_min_max_at"] < e["length"] for e in s["episodes"])
    assert d["data_distance"] > 0 and all(
        0 <= e["data_distance_first"] <= e["data_distance_max"] < np.inf for e in s["episodes"]
    )
    # ToyReach episodes are time-limited: the return-to-go is positive, the model's error on data is small
    assert d["mc_return"] != 0 and d["model_on_data"]["model_error"] < 1.0
    with pytest.raises(SystemExit, match="no checkpoint"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text((tmp_path / "run" / "config.json").read_text())
        main([str(tmp_path / "empty")])
