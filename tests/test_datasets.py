"""D4RL-format datasets (envs/datasets.py; Fu et al. 2020, arXiv 2004.07219) and their generator
(scripts/make_dataset.py)."""

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from plasticity_zoo.envs import collect as C
from plasticity_zoo.envs import datasets as D
from plasticity_zoo.envs import minari_data as M
from plasticity_zoo.envs import scores as S

ROOT = Path(__file__).resolve().parents[1]


def _episodes(spec, obs_dim=11, act_dim=3, seed=0, metadata=None):
    """A consistent dataset from [(length, 'terminal' | 'timeout' | None), ...] (None: a partial episode)."""
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in D.KEYS}
    for length, end in spec:
        states = rng.normal(size=(length + 1, obs_dim)).astype(np.float32)
        cols["observations"].append(states[:-1])
        cols["next_observations"].append(states[1:])
        cols["actions"].append(rng.uniform(-1, 1, (length, act_dim)).astype(np.float32))
        cols["rewards"].append(rng.normal(size=length).astype(np.float32))
        flags = np.zeros(length, bool), np.zeros(length, bool)
        if end == "terminal":
            flags[0][-1] = True
        elif end == "timeout":
            flags[1][-1] = True
        cols["terminals"].append(flags[0])
        cols["timeouts"].append(flags[1])
    return D.Dataset(**{k: np.concatenate(v) for k, v in cols.items()}, metadata=dict(metadata or {}))


def _write_raw(path, arrays: dict):
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)


# --------------------------------------------------------------------------------------------
# format, round trip, rejection
# --------------------------------------------------------------------------------------------
def test_round_trip_keeps_every_key_dtype_and_metadata_type(tmp_path):
    ds = _episodes([(4, "terminal"), (5, "timeout"), (3, None)])
    n = len(ds)
    ds.infos = {
        "qpos": np.random.default_rng(1).normal(size=(n, 6)),
        "action_log_probs": np.linspace(-3, 1, n, dtype=np.float32),
    }
    weight = np.random.default_rng(2).normal(size=(4, 3)).astype(np.float32)
    ds.metadata = {
        "env_id": "Hopper-v5",
        "seed": 3,
        "big": 2**40,
        "ratio": 0.5,
        "float_int": 3.0,
        "flag": True,
        "off": False,
        "name": "medium",
        "empty": "",
        "none": None,
        "lst": [1, 2.5, "a"],
        "arr": np.arange(3, dtype=np.int16),
        "f32": np.float32(1.5),
        "strs": np.array(["a", "bc"]),
        "policy": {"fc0": {"weight": weight, "bias": np.zeros(3, np.float32)}, "nonlinearity": "relu", "depth": 2},
    }
    path = D.save(tmp_path / "sub" / "d.hdf5", ds)  # parent dirs are created
    assert not list(path.parent.glob(".*tmp*"))  # the temporary file was renamed away
    with h5py.File(path) as f:  # the flat D4RL layout
        assert set(D.KEYS) <= set(f) and "policy/fc0/weight" in f["metadata"] and "qpos" in f["infos"]
    got = D.load(path, env_id="Hopper-v5")
    for k in D.KEYS:
        np.testing.assert_array_equal(getattr(got, k), getattr(ds, k))
        assert getattr(got, k).dtype == getattr(ds, k).dtype
    assert got.observations.dtype == np.float32 and got.terminals.dtype == np.bool_
    for k, v in ds.infos.items():
        np.testing.assert_array_equal(got.infos[k], v)
        assert got.infos[k].dtype == v.dtype
    m = got.metadata
    assert set(m) == set(ds.metadata) and set(m["policy"]) == {"fc0", "nonlinearity", "depth"}
    for k in ("env_id", "seed", "big", "ratio", "float_int", "flag", "off", "name", "empty", "none", "lst"):
        assert m[k] == ds.metadata[k] and type(m[k]) is type(ds.metadata[k]), k
    assert type(m["float_int"]) is float and type(m["seed"]) is int and m["flag"] is True
    assert type(m["f32"]) is np.float32 and m["f32"] == np.float32(1.5)
    assert m["arr"].dtype == np.int16 and m["arr"].tolist() == [0, 1, 2]
    assert m["strs"].tolist() == ["a", "bc"]
    np.testing.assert_array_equal(m["policy"]["fc0"]["weight"], weight)
    assert m["policy"]["fc0"]["weight"].dtype == np.float32
    assert m["policy"]["nonlinearity"] == "relu" and type(m["policy"]["depth"]) is int
    assert got.env_id == "Hopper-v5" and (got.obs_dim, got.act_dim, len(got)) == (11, 3, 12)


def test_garbage_and_truncated_files_are_rejected_naming_the_path(tmp_path):
    garbage = tmp_path / "garbage.hdf5"
    garbage.write_bytes(b"this is not hdf5" * 100)
    with pytest.raises(D.DatasetError, match="garbage.hdf5.*corrupt"):
        D.load(garbage)
    good = D.save(tmp_path / "good.hdf5", _episodes([(50, "terminal")]))
    cut = tmp_path / "cut.hdf5"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(D.DatasetError, match="cut.hdf5"):
        D.load(cut)
    with pytest.raises(D.DatasetError, match="nope.hdf5: no such"):
        D.load(tmp_path / "nope.hdf5")


def test_obs_dim_mismatch_against_the_env_names_both_dims(tmp_path):
    path = D.save(tmp_path / "d.hdf5", _episodes([(5, "terminal")], obs_dim=7))
    D.load(path)  # no env: structure only
    with pytest.raises(D.DatasetError, match=r"d.hdf5: observations have dim 7 but Hopper-v5 has obs dim 11"):
        D.load(path, env_id="Hopper-v5")
    with pytest.raises(D.DatasetError, match="actions have dim 3 but Pendulum-v1 has act dim 1"):
        D.validate(_episodes([(5, "terminal")], obs_dim=3), "Pendulum-v1")


def test_missing_key_is_rejected_and_listed(tmp_path):
    ds = _episodes([(5, "terminal")])
    path = tmp_path / "d.hdf5"
    _write_raw(path, {k: getattr(ds, k) for k in D.KEYS if k != "timeouts"})
    with pytest.raises(D.DatasetError, match=r"d.hdf5: missing key\(s\) timeouts \(the file has: actions"):
        D.load(path)


def test_missing_next_observations_refused_unless_rebuilt_within_episodes(tmp_path):
    ds = _episodes([(4, "terminal"), (3, "timeout"), (5, None)])
    path = tmp_path / "old.hdf5"
    _write_raw(path, {k: getattr(ds, k) for k in D.KEYS if k != "next_observations"})
    with pytest.raises(D.DatasetError, match="old.hdf5: has no next_observations; the true next observations"):
        D.load(path)
    with pytest.warns(UserWarning, match="dropped 3 rows"):
        got = D.load(path, allow_missing_next=True)
    keep = [0, 1, 2, 4, 5, 7, 8, 9, 10]  # episode ends (rows 3, 6) and the last row (11) go
    np.testing.assert_array_equal(got.observations, ds.observations[keep])
    np.testing.assert_array_equal(got.next_observations, ds.next_observations[keep])  # the true ones
    assert got.terminals.sum() == 0 and got.timeouts.tolist() == [0, 0, 1, 0, 1, 0, 0, 0, 0]
    assert len(D.check_continuity(got)) == 0 and got.metadata["rows_dropped"] == 3


def test_terminal_and_timeout_on_one_row_is_rejected(tmp_path):
    ds = _episodes([(4, "terminal"), (3, None)])
    ds.timeouts[3] = True
    with pytest.raises(D.DatasetError, match=r"1 row\(s\) have both terminal and timeout set \(first: row 3\)"):
        D.validate(ds)
    path = tmp_path / "d.hdf5"
    _write_raw(path, {k: getattr(ds, k) for k in D.KEYS})
    with pytest.raises(D.DatasetError, match="d.hdf5: 1 row"):
        D.load(path)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda a: a.update(observations=a["observations"].astype(np.int32)), "observations has dtype int32"),
        (lambda a: a.update(terminals=a["terminals"] * 2.0), "terminals has dtype float64 with values other than 0/1"),
        (lambda a: a.update(rewards=a["rewards"][:-1]), "arrays disagree on the number of rows N: .*rewards=5"),
        (lambda a: a["actions"].__setitem__((2, 1), np.nan), "actions has 1 non-finite value.*row 2"),
        (
            lambda a: a["actions"].__setitem__((4, 0), 1.5),
            "1 action value\\(s\\) outside Hopper-v5's action bounds \\[-1, 1\\].*row 4, dim 0",
        ),
    ],
)
def test_bad_arrays_are_rejected_with_the_problem(tmp_path, breakage, message):
    ds = _episodes([(6, "terminal")])
    arrays = {k: getattr(ds, k).copy() for k in D.KEYS}
    breakage(arrays)
    path = tmp_path / "bad.hdf5"
    _write_raw(path, arrays)
    with pytest.raises(D.DatasetError, match="bad.hdf5: " + message):
        D.load(path, env_id="Hopper-v5")


def test_float64_and_01_flags_of_other_writers_are_converted(tmp_path):
    ds = _episodes([(6, "terminal")])
    arrays = {k: getattr(ds, k) for k in D.KEYS}
    arrays.update(
        observations=arrays["observations"].astype(np.float64), terminals=arrays["terminals"].astype(np.float32)
    )
    _write_raw(tmp_path / "d.hdf5", arrays)
    with h5py.File(tmp_path / "d.hdf5", "a") as f:  # D4RL-style metadata: byte strings, no type tags
        f["metadata/algorithm"] = np.bytes_(b"SAC")
        f["metadata/policy/nonlinearity"] = "relu"
        f["metadata/policy/fc0/weight"] = np.ones((2, 11), np.float32)
        f["metadata"].attrs["iteration"] = np.int64(7)
    got = D.load(tmp_path / "d.hdf5")
    assert got.observations.dtype == np.float32 and got.terminals.dtype == np.bool_ and got.terminals[-1]
    assert got.metadata["algorithm"] == "SAC" and got.metadata["policy"]["nonlinearity"] == "relu"
    assert got.metadata["iteration"] == 7 and got.metadata["policy"]["fc0"]["weight"].shape == (2, 11)


def test_dataset_made_on_another_env_with_the_same_dims_is_refused():
    ds = _episodes([(5, "terminal")], obs_dim=17, act_dim=6, metadata={"env_id": "Walker2d-v5"})
    D.validate(ds, "Walker2d-v4")  # same family
    with pytest.raises(D.DatasetError, match="made on 'Walker2d-v5', not 'HalfCheetah-v5'"):
        D.validate(ds, "HalfCheetah-v5")


# --------------------------------------------------------------------------------------------
# episodes, continuity, transitions
# --------------------------------------------------------------------------------------------
def test_episode_returns_with_terminal_timeout_and_trailing_partial_episode():
    ds = _episodes([(3, "terminal"), (4, "timeout"), (2, None)])
    ds.rewards = np.arange(1, 10, dtype=np.float32)
    np.testing.assert_allclose(ds.episode_returns(), [1 + 2 + 3, 4 + 5 + 6 + 7])  # rows 7-8 are partial
    assert ds.episode_slices() == [slice(0, 3), slice(3, 7)]
    assert _episodes([(3, None)]).episode_returns().size == 0
    t = ds.transitions()
    assert t.obs.dtype == np.float32 and t.terminated.dtype == np.bool_
    assert t.terminated.tolist() == ds.terminals.tolist() and t.truncated.tolist() == ds.timeouts.tolist()


def test_transitions_in_unit_actions_use_the_stored_bounds():
    ds = _episodes([(3, "terminal")], act_dim=1)
    ds.actions = np.array([[-2.0], [0.0], [1.0]], np.float32)
    ds.metadata.update(action_low=np.array([-2.0], np.float32), action_high=np.array([2.0], np.float32))
    np.testing.assert_allclose(ds.transitions(unit_actions=True).action[:, 0], [-1.0, 0.0, 0.5])


def test_continuity_check_catches_a_broken_transition_but_not_episode_ends():
    ds = _episodes([(4, "terminal"), (3, "timeout"), (3, None)])
    assert len(D.check_continuity(ds)) == 0  # at rows 3 and 6 the next row is a reset: not compared
    ds.next_observations[5] += 0.1  # a corrupted successor inside the second episode
    np.testing.assert_array_equal(D.check_continuity(ds), [5])
    ds.next_observations[5] -= 0.1
    ds.terminals[3] = False  # an episode end that is not flagged: its successor is the next reset state
    np.testing.assert_array_equal(D.check_continuity(ds), [3])


def test_collect_writes_whole_episodes_true_successors_and_both_end_flags():
    # ToyChain (tests/conftest.py): obs [t, x], x += a, terminates at x >= 3, TimeLimit 5.
    rng = np.random.default_rng(0)
    policy = lambda o: rng.choice([0.0, 1.0], size=(len(o), 1)).astype(np.float32)  # noqa: E731
    ds = C.collect("ToyChain-v0", policy, size=57, seed=3, num_envs=3, max_episode_steps=4)
    D.validate(ds, "ToyChain-v0")
    assert len(ds) == 57 and ds.terminals.any() and ds.timeouts.any()
    assert len(D.check_continuity(ds, atol=0)) == 0
    np.testing.assert_array_equal(ds.next_observations[:, 0], ds.observations[:, 0] + 1)  # true successors
    np.testing.assert_array_equal(ds.terminals, ds.next_observations[:, 1] >= 3)
    assert np.all(ds.next_observations[ds.timeouts, 0] == 4)  # the 4-step cap is a timeout
    for s in ds.episode_slices():
        assert ds.observations[s.start, 0] == 0  # each episode starts at a reset
    np.testing.assert_allclose(ds.episode_returns(), [s.stop - s.start for s in ds.episode_slices()])


# --------------------------------------------------------------------------------------------
# scores, names, cache
# --------------------------------------------------------------------------------------------
def test_normalized_score_hand_computed():
    assert S.normalized_score(3234.3, "Hopper-v5") == pytest.approx(100.0)
    assert S.normalized_score(-20.272305, "hopper-medium-v2") == pytest.approx(0.0, abs=1e-9)
    assert S.normalized_score(1000.0, "hopper") == pytest.approx(100 * 1020.272305 / 3254.572305)
    np.testing.assert_allclose(
        S.normalized_score([12135.0, -280.178953], metadata={"env_id": "HalfCheetah-v5"}), [100.0, 0.0]
    )
    assert S.normalized_score(
        60.0, metadata={"ref_min_score": 10.0, "ref_max_score": 110.0}, reference="dataset"
    ) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="no D4RL reference scores for env 'Pendulum-v1'"):
        S.normalized_score(1.0, "Pendulum-v1")
    with pytest.raises(ValueError, match="needs metadata ref_min_score and ref_max_score"):
        S.normalized_score(1.0, metadata={"env_id": "Hopper-v5"}, reference="dataset")


def test_d4rl_names():
    assert [
        S.d4rl_name(x)
        for x in (
            "Hopper-v5",
            "hopper",
            "hopper-medium-v2",
            "HalfCheetah-v5",
            "walker2d_medium_replay-v2",
            "mujoco/walker2d/expert-v0",
        )
    ] == ["hopper", "hopper", "hopper", "halfcheetah", "walker2d", "walker2d"]
    assert [S.d4rl_name(x) for x in ("Pendulum-v1", "dmc:hopper-hop", "Ant-v5", None)] == [None] * 4


def test_cache_paths_and_find_says_how_to_make_a_missing_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("RLZOO_DATASETS", str(tmp_path / "env_cache"))
    assert D.cache_dir() == tmp_path / "env_cache" and D.cache_dir(tmp_path) == tmp_path
    assert D.cached_path("Hopper-v5", "medium", tmp_path) == tmp_path / "hopper-medium-v5.hdf5"
    assert D.cached_path("Pendulum-v1", "medium-replay", tmp_path).name == "pendulum-medium-replay-v1.hdf5"
    monkeypatch.delenv("RLZOO_DATASETS")
    assert D.cache_dir() == Path.home() / ".cache" / "rlzoo" / "datasets"
    D.save(tmp_path / "hopper-random-v5.hdf5", _episodes([(3, "terminal")]))
    assert D.find("Hopper-v5", "random", tmp_path) == tmp_path / "hopper-random-v5.hdf5"
    with pytest.raises(
        D.DatasetError,
        match=r"holds: hopper-random-v5.hdf5\. Make it with: python "
        r"scripts/make_dataset.py --env Hopper-v5 --kind expert --cache",
    ):
        D.find("Hopper-v5", "expert", tmp_path)
    with pytest.raises(ValueError, match="unknown dataset kind 'mixed'"):
        D.cached_path("Hopper-v5", "mixed")


# --------------------------------------------------------------------------------------------
# Minari
# --------------------------------------------------------------------------------------------
def _minari(root, lengths, data_format="hdf5", version=0):
    data = root / "mujoco" / "hopper" / f"medium-v{version}" / "data"
    data.mkdir(parents=True)
    spec = json.dumps({"id": "Hopper-v5", "entry_point": "gymnasium.envs.mujoco.hopper_v5:HopperEnv"})
    (data / "metadata.json").write_text(
        json.dumps(
            {
                "data_format": data_format,
                "env_spec": spec,
                "ref_min_score": -19.5,
                "ref_max_score": 3400.0,
                "total_episodes": len(lengths),
                "author": None,
                "requirements": ["mujoco>=3"],
            }
        )
    )
    rng = np.random.default_rng(0)
    eps = []
    if data_format == "hdf5":
        with h5py.File(data / "main_data.hdf5", "w") as f:
            for i, t in enumerate(lengths):
                g = f.create_group(f"episode_{i}")
                ep = {
                    "observations": rng.normal(size=(t + 1, 11)),
                    "actions": rng.uniform(-1, 1, (t, 3)).astype(np.float32),
                    "rewards": rng.normal(size=t),
                    "terminations": np.arange(t) == t - 1 if i == 0 else np.zeros(t, bool),
                    "truncations": np.zeros(t, bool) if i == 0 else np.arange(t) == t - 1,
                }
                for k, v in ep.items():
                    g.create_dataset(k, data=v)
                g.create_dataset("infos/qpos", data=rng.normal(size=(t + 1, 6)))
                g.attrs.update(id=i, seed=i, total_steps=t)
                eps.append(ep)
    return data, eps


def test_minari_hdf5_layout_becomes_the_flat_layout(tmp_path, monkeypatch):
    data, eps = _minari(tmp_path, [4, 3])
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    ds = M.load_minari("mujoco/hopper/medium")  # no version: the newest present
    D.validate(ds, "Hopper-v5")
    assert len(ds) == 7 and ds.env_id == "Hopper-v5"
    np.testing.assert_allclose(ds.observations, np.concatenate([e["observations"][:-1] for e in eps]), rtol=1e-6)
    np.testing.assert_allclose(ds.next_observations, np.concatenate([e["observations"][1:] for e in eps]), rtol=1e-6)
    assert ds.terminals.tolist() == [0, 0, 0, 1, 0, 0, 0] and ds.timeouts.tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert ds.observations.dtype == np.float32 and ds.rewards.dtype == np.float32
    assert ds.infos["qpos"].shape == (7, 6)
    assert (ds.metadata["ref_min_score"], ds.metadata["ref_max_score"]) == (-19.5, 3400.0)
    assert S.normalized_score(3400.0, metadata=ds.metadata, reference="dataset") == pytest.approx(100.0)
    assert len(D.check_continuity(ds)) == 0
    same = M.load_minari(data / "main_data.hdf5")
    np.testing.assert_array_equal(same.actions, ds.actions)
    D.save(tmp_path / "flat.hdf5", ds)  # Minari metadata (None, lists) survives our format too
    assert D.load(tmp_path / "flat.hdf5").metadata["requirements"] == ["mujoco>=3"]


def test_minari_arrow_or_missing_files_say_what_was_looked_for(tmp_path):
    _minari(tmp_path, [3], data_format="arrow")
    with pytest.raises(D.DatasetError, match="main_data.hdf5 .*data_format is 'arrow'.*holds: metadata.json"):
        M.load_minari("mujoco/hopper/medium-v0", root=tmp_path)
    with pytest.raises(
        D.DatasetError, match=r"looked for .*mujoco/walker2d/expert-v0/data/main_data.hdf5 \(no such file\)"
    ):
        M.load_minari("mujoco/walker2d/expert-v0", root=tmp_path)


# --------------------------------------------------------------------------------------------
# the generator, end to end on a tiny budget
# --------------------------------------------------------------------------------------------
TINY = [
    "--env",
    "Hopper-v5",
    "--size",
    "400",
    "--train-steps",
    "600",
    "--eval-every",
    "300",
    "--eval-episodes",
    "2",
    "--ref-episodes",
    "2",
    "--num-envs",
    "4",
    "--max-episode-steps",
    "25",
    "--network.width",
    "16",
    "--sac.learning-starts",
    "200",
    "--sac.batch-size",
    "32",
    "--no-progress",
]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_dataset

    out = tmp_path_factory.mktemp("datasets")
    paths = make_dataset.main(["--kind", "medium", "--kind", "medium-replay", "--out", str(out), *TINY])
    return make_dataset, out, paths


@pytest.mark.slow
def test_make_dataset_files_load_validate_and_are_real_transitions(made):
    _, out, paths = made
    assert paths == {"medium": out / "hopper-medium-v5.hdf5", "medium-replay": out / "hopper-medium-replay-v5.hdf5"}
    ds = D.load(paths["medium"], env_id="Hopper-v5")
    assert len(ds) == 400 and ds.terminals.any() and ds.timeouts.any()  # falls, and the 25-step cap
    assert len(D.check_continuity(ds)) == 0
    # unlike D4RL's qlearning_dataset, every (obs, next_obs) is real, at episode ends too (replayed from qpos/qvel)
    ends = ds.episode_ends()
    assert len(D.check_transitions(ds, rows=np.r_[ends, np.arange(0, 400, 7)])) == 0
    assert ds.infos["action_log_probs"].shape == (400,) and np.isfinite(ds.infos["action_log_probs"]).all()
    m = ds.metadata
    assert (m["env_id"], m["kind"], m["seed"], m["size"], m["requested_size"]) == ("Hopper-v5", "medium", 0, 400, 400)
    assert m["policy_step"] in (300, 600) and isinstance(m["policy_return"], float)
    assert m["policy"]["trunk"]["layers"]["0"]["kernel"].shape == (11, 16)
    assert m["behaviour_return"] == pytest.approx(ds.episode_returns().mean())
    assert (m["d4rl_ref_min_score"], m["d4rl_ref_max_score"]) == S.D4RL_REF["hopper"]
    assert m["ref_episodes"] == 2 and m["ref_seed"] == 123
    assert isinstance(m["ref_min_score"], float) and isinstance(m["ref_max_score"], float)
    assert "--kind medium" in m["command"] and m["zoo_version"]
    refs = json.loads((Path(m["sac_run_dir"]) / "references.json").read_text())
    assert (refs["ref_min_score"], refs["ref_max_score"]) == (m["ref_min_score"], m["ref_max_score"])
    assert np.isfinite(S.normalized_score(m["behaviour_return"], metadata=m, reference="dataset"))


def test_medium_replay_is_the_start_of_the_sac_buffer(made):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.envs import VectorEnv
    from plasticity_zoo.training import checkpoint
    from plasticity_zoo.training.loops.offpolicy import init_state
    from plasticity_zoo.training.run import load_config

    _, out, paths = made
    rep = D.load(paths["medium-replay"], env_id="Hopper-v5")
    med = D.load(paths["medium"])
    n = rep.metadata["policy_step"]
    assert len(rep) == n == med.metadata["policy_step"] and rep.metadata["kind"] == "medium-replay"
    run_dir = Path(rep.metadata["sac_run_dir"])
    assert sorted(p.name for p in (run_dir / "snapshots").glob("*.npz")) == [
        f"step_{s:012d}.npz" for s in (0, 300, 600)
    ]  # the on_eval hook's snapshots
    cfg = load_config(run_dir)
    template = init_state(sac, cfg, 11, 3)
    (_, buffer, _), _, _ = checkpoint.load(checkpoint.latest(run_dir), template)
    np.testing.assert_array_equal(rep.observations, np.asarray(buffer.data.obs[0, :n]))
    np.testing.assert_array_equal(rep.next_observations, np.asarray(buffer.data.next_obs[0, :n]))
    np.testing.assert_array_equal(rep.actions, np.asarray(buffer.data.action[0, :n]))  # Hopper: env units = [-1, 1]
    np.testing.assert_array_equal(rep.terminals, np.asarray(buffer.data.terminated[0, :n]))
    np.testing.assert_array_equal(rep.timeouts, np.asarray(buffer.data.truncated[0, :n]))
    first = VectorEnv("Hopper-v5", 1, cfg.seed * 10_000).reset()[0]  # the training env's first reset
    np.testing.assert_array_equal(rep.observations[0], first)
    assert len(D.check_continuity(rep)) == 0 and rep.terminals.any()


def test_make_dataset_reuses_the_finished_training(made, capsys, monkeypatch):
    make_dataset, out, _ = made
    monkeypatch.setattr(make_dataset.SacRun, "ensure_trained", lambda self: pytest.fail("random-only trained SAC"))
    paths = make_dataset.main(["--kind", "random", "--out", str(out), *TINY])
    assert "reusing the finished SAC run" in capsys.readouterr().out
    ds = D.load(paths["random"], env_id="Hopper-v5")
    assert len(ds) == 400 and ds.metadata["behaviour_policy"] == "uniform" and "policy" not in ds.metadata
    med = D.load(out / "hopper-medium-v5.hdf5").metadata
    for k in ("ref_min_score", "ref_max_score", "ref_policy_step", "sac_run_dir", "train_steps"):
        assert ds.metadata[k] == med[k], k  # the finished run's expert gives ref_max_score, nothing trained
    assert ds.metadata["ref_max_source"] == med["ref_max_source"] == "sac-expert"
    # A finished run with other settings is not used for random: D4RL's constant, the same rows.
    other = make_dataset.main(["--kind", "random", "--out", str(out / "other.hdf5"), *TINY, "--network.width", "8"])
    assert "holds a finished SAC run with other settings (differs in network)" in capsys.readouterr().out
    o = D.load(other["random"], env_id="Hopper-v5")
    assert (o.metadata["ref_max_source"], o.metadata["ref_max_score"]) == ("d4rl", S.D4RL_REF["hopper"][1])
    assert o.metadata["ref_min_score"] == ds.metadata["ref_min_score"] and "sac_run_dir" not in o.metadata
    for k in D.KEYS:
        np.testing.assert_array_equal(getattr(o, k), getattr(ds, k))
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="another config"):  # a SAC kind needs the run itself
        make_dataset.main(["--kind", "medium", "--out", str(out), *TINY, "--network.width", "8"])
    with pytest.raises(SystemExit, match="exactly one --kind"):
        make_dataset.main(["--kind", "random", "--kind", "expert", "--out", str(out / "x.hdf5"), *TINY])
