"""Minari datasets for the offline agents (envs/minari_data.py, ``--dataset minari:<id>``; issue #47 item 6).

The datasets are written here, in a temporary Minari data path, by Minari's own ``DataCollector`` on
Hopper-v5 (a 40-step time limit): episodes that fall (terminated), reach the limit (truncated) and
one reset after 10 steps (Minari marks it truncated).  Nothing is downloaded.
"""

import csv
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

minari = pytest.importorskip("minari")

from plasticity_zoo.envs import datasets as D  # noqa: E402
from plasticity_zoo.envs import minari_data as M  # noqa: E402
from plasticity_zoo.envs import scores as S  # noqa: E402

ID = "zoo-test/hopper/medium-v0"
# (action scale, steps before a reset, or None: until the env ends the episode); seeds 0..4
EPISODES = [(1.0, None), (0.0, None), (1.0, None), (0.0, 10), (1.0, None)]


class _States(minari.StepDataCallback):
    """Records the simulator state in the infos (at the reset and after each step)."""

    def __call__(self, env, **kw):
        step = super().__call__(env, **kw)
        step["info"] = {"qpos": env.unwrapped.data.qpos.copy(), "qvel": env.unwrapped.data.qvel.copy()}
        return step


def build(root: Path, dataset_id: str = ID, episodes=EPISODES, ref_max: float = 3000.0):
    """A Minari dataset written by Minari's DataCollector into the data path ``root``."""
    import gymnasium as gym

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("MINARI_DATASETS_PATH", str(root))
        warnings.simplefilter("ignore")  # minari's notes on a missing author, permalink, ...
        env = minari.DataCollector(
            gym.make("Hopper-v5", max_episode_steps=40), record_infos=True, step_data_callback=_States
        )
        rng = np.random.default_rng(0)
        for seed, (scale, cut) in enumerate(episodes):
            env.reset(seed=seed)
            for t in range(1000):
                _, _, terminated, truncated, _ = env.step((scale * rng.uniform(-1, 1, 3)).astype(np.float32))
                if terminated or truncated or t + 1 == cut:
                    break
        env.create_dataset(
            dataset_id, eval_env="Hopper-v5", algorithm_name="uniform", ref_min_score=-20.0, ref_max_score=ref_max
        )
        env.close()
    return root / dataset_id / "data"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("minari")
    build(root)
    return root


@pytest.fixture
def paths(source, tmp_path, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(source))
    monkeypatch.setenv("RLZOO_DATASETS", str(tmp_path / "cache"))
    return source, tmp_path / "cache"


def _episodes(source):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINARI_DATASETS_PATH", str(source))
        return list(minari.load_dataset(ID).iterate_episodes())


# --------------------------------------------------------------------------------------------
# the conversion
# --------------------------------------------------------------------------------------------
def test_conversion_matches_the_minari_episodes_row_by_row(paths):
    source, cache = paths
    logs = []
    path = M.convert(f"minari:{ID}", log=logs.append)
    assert path == cache / "minari" / "zoo-test" / "hopper" / "medium-v0.hdf5" and "converting" in logs[0]
    ds = D.load(path, env_id="Hopper-v5")
    eps = _episodes(source)
    ends = [(bool(e.terminations[-1]), bool(e.truncations[-1])) for e in eps]
    assert ends == [(True, False), (False, True), (False, True), (False, True), (True, False)]  # what the test needs
    assert [len(e) for e in eps][1:4] == [40, 40, 10]  # the time limit twice, then the reset
    ends_at = np.cumsum([len(e) for e in eps])
    assert ds.episode_slices() == [slice(int(a), int(b)) for a, b in zip(np.r_[0, ends_at[:-1]], ends_at)]
    for e, rows in zip(eps, ds.episode_slices()):
        t = len(e)
        assert e.observations.shape == (t + 1, 11)
        np.testing.assert_array_equal(ds.observations[rows], e.observations[:-1].astype(np.float32))
        np.testing.assert_array_equal(ds.next_observations[rows], e.observations[1:].astype(np.float32))  # final obs
        np.testing.assert_array_equal(ds.actions[rows], e.actions)
        np.testing.assert_array_equal(ds.rewards[rows], e.rewards.astype(np.float32))
        np.testing.assert_array_equal(ds.terminals[rows], e.terminations)
        cut = not (e.terminations[-1] or e.truncations[-1])
        np.testing.assert_array_equal(ds.timeouts[rows], e.truncations | (np.arange(t) == t - 1) & cut)
        np.testing.assert_array_equal(ds.infos["qpos"][rows], e.infos["qpos"][:-1])  # the reset's state first
    assert ds.terminals.sum() == 2 and ds.timeouts.sum() == 3 and not (ds.terminals & ds.timeouts).any()
    # infos are aligned with the observations: Hopper's observation starts with qpos[1:]
    np.testing.assert_allclose(ds.infos["qpos"][:, 1:], ds.observations[:, :5], rtol=1e-6, atol=1e-6)
    assert len(D.check_continuity(ds, atol=0)) == 0
    # every episode's last row (fall, time limit, reset) replays in the simulator to its stored next observation
    assert len(D.check_transitions(ds, rows=np.r_[ds.episode_ends(), 0, 17, 50])) == 0
    m = ds.metadata
    assert (m["env_id"], m["kind"], m["minari_dataset_id"], m["minari_episodes"], m["minari_cut_episodes"]) == (
        "Hopper-v5",
        "medium",
        ID,
        5,
        0,
    )
    assert (m["ref_min_score"], m["ref_max_score"], m["ref_max_source"]) == (-20.0, 3000.0, "minari")
    assert S.normalized_score(3000.0, metadata=m, reference="dataset") == pytest.approx(100.0)
    np.testing.assert_array_equal(m["action_low"], -np.ones(3, np.float32))
    assert json.loads(m["minari_env_spec"])["max_episode_steps"] == 40 and "minari_eval_note" not in m
    assert m["minari_source"] == str(source / ID / "data")
    # the h5py-only reader of envs/datasets.py reads the same rows
    plain = M.load_minari(ID, root=source)
    for k in D.KEYS:
        np.testing.assert_array_equal(getattr(plain, k), getattr(ds, k))


def test_a_second_conversion_is_reused_and_a_changed_source_redone(paths):
    source, _ = paths
    logs = []
    path = M.convert(f"minari:{ID}", log=logs.append)
    stamp = path.stat().st_mtime_ns
    assert M.convert(f"minari:{ID}", log=logs.append) == path and len(logs) == 2  # no new line: reused
    assert path.stat().st_mtime_ns == stamp
    assert M.convert("minari:zoo-test/hopper/medium", log=logs.append) == path  # no version: the newest present
    model = Path(f"{path}.dynamics-0.npz")  # what RAVL caches beside the dataset
    model.write_bytes(b"a model of the old data")
    # the same id in another data path, with other references: a changed source
    other = build(source.parent / "other-root", ref_max=3100.0).parent.parent.parent.parent
    assert M.convert(f"minari:{ID}", root=other, log=logs.append) == path
    assert "source changed" in logs[2] and any("removed 1 file" in x for x in logs) and not model.exists()
    assert D.load(path).metadata["ref_max_score"] == 3100.0
    n = len(logs)
    assert M.convert(f"minari:{ID}", root=other, log=logs.append) == path and len(logs) == n
    meta = source.parent / "other-root" / ID / "data" / "metadata.json"  # a file of the source rewritten
    raw = json.loads(meta.read_text())
    meta.write_text(json.dumps({**raw, "ref_max_score": 3200.0}))
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 10**9))
    M.convert(f"minari:{ID}", root=other, log=logs.append)
    assert D.load(path).metadata["ref_max_score"] == 3200.0 and len(logs) > n


def test_episode_flags_both_cut_and_malformed():
    ep = lambda obs_rows=4, term=(0, 0, 0), trunc=(0, 0, 0), obs=None: minari.EpisodeData(  # noqa: E731
        id=7,
        observations=np.arange(obs_rows * 2, dtype=np.float64).reshape(obs_rows, 2) if obs is None else obs,
        actions=np.zeros((3, 1), np.float32),
        rewards=np.ones(3),
        terminations=np.array(term, bool),
        truncations=np.array(trunc, bool),
        infos={"x": np.arange(4), "y": np.arange(3), "n": {"z": np.ones((4, 2))}},
    )
    rows, cut = M.episode_rows(ep(term=(0, 0, 1), trunc=(0, 0, 1)))  # both on the time limit's last step
    assert rows.terminals.tolist() == [0, 0, 1] and rows.timeouts.tolist() == [0, 0, 0] and not cut
    rows, cut = M.episode_rows(ep())  # stopped mid-episode: closed with a timeout
    assert rows.timeouts.tolist() == [0, 0, 1] and rows.terminals.sum() == 0 and cut
    np.testing.assert_array_equal(rows.next_observations, [[2, 3], [4, 5], [6, 7]])
    assert rows.infos["x"].tolist() == [0, 1, 2] and "y" not in rows.infos and rows.infos["n"]["z"].shape == (3, 2)
    with pytest.raises(D.DatasetError, match="flagged terminated / truncated at step 0 of 3, before its last"):
        M.episode_rows(ep(term=(1, 0, 0)))
    with pytest.raises(D.DatasetError, match="3 observations for 3 steps, expected 4"):
        M.episode_rows(ep(obs_rows=3))
    with pytest.raises(D.DatasetError, match="Dict or Tuple spaces are not supported"):
        M.episode_rows(ep(obs={"a": np.zeros((4, 2))}))


def test_an_id_without_version_takes_the_newest_of_that_name_and_bad_data_are_refused(
    source, tmp_path, capsys, monkeypatch
):
    import shutil

    import gymnasium as gym

    root = tmp_path / "root"
    shutil.copytree(source / ID, root / ID)
    shutil.copytree(source / ID, root / "zoo-test/hopper/medium-replay-v7")  # not a version of "medium"
    assert M.locate("zoo-test/hopper/medium", root) == (ID, root / ID / "data")
    shutil.copytree(source / ID, root / "zoo-test/hopper/medium-v2")
    assert M.locate("zoo-test/hopper/medium", root)[0] == "zoo-test/hopper/medium-v2"
    assert M.local_ids(root) == [
        "zoo-test/hopper/medium-replay-v7",
        "zoo-test/hopper/medium-v0",
        "zoo-test/hopper/medium-v2",
    ]
    (root / ID / "data" / "main_data.hdf5").write_bytes(b"not hdf5" * 100)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    monkeypatch.setenv("RLZOO_DATASETS", str(tmp_path / "cache"))
    err = _cli_error(["ravl", "--dataset", f"minari:{ID}", "--run-dir", str(tmp_path / "r")], capsys)
    assert f"Minari dataset {ID} ({root / ID / 'data'}): unreadable or corrupt" in err
    assert not (tmp_path / "cache" / "minari" / f"{ID}.hdf5").exists()
    with pytest.raises(D.DatasetError, match="its observation space is Dict.*flat Box observations only"):
        M._check_space(gym.spaces.Dict({"x": gym.spaces.Box(-1, 1, (2,))}), "observation", ID)


def test_the_eval_env_comes_from_the_spec_and_a_different_spec_is_noted():
    spec = {"id": "Hopper-v5", "max_episode_steps": 1000, "kwargs": {}}
    assert M.eval_env({"env_spec": json.dumps(spec)}) == ("Hopper-v5", None)
    env_id, note = M.eval_env({"env_spec": json.dumps({**spec, "max_episode_steps": 40})})
    assert env_id == "Hopper-v5" and "max_episode_steps 40 (registered: 1000)" in note
    _, note = M.eval_env({"env_spec": json.dumps({**spec, "kwargs": {"frame_skip": 2}})})
    assert 'kwargs {"frame_skip": 2}' in note
    # eval_env_spec wins over the collection's spec
    assert M.eval_env(
        {
            "env_spec": json.dumps({**spec, "max_episode_steps": 40}),
            "eval_env_spec": json.dumps({**spec, "id": "Walker2d-v5"}),
        }
    ) == ("Walker2d-v5", None)
    assert M.eval_env({}) == (None, None)
    assert M.dataset_id("minari:D4RL/door/human-v2") == "D4RL/door/human-v2"
    for bad in ("minari:", "minari:../x-v0", "minari:a b"):
        with pytest.raises(D.DatasetError, match="not a Minari dataset id"):
            M.dataset_id(bad)


# --------------------------------------------------------------------------------------------
# the command line: errors
# --------------------------------------------------------------------------------------------
def _cli_error(argv, capsys) -> str:
    from scripts.train import cli

    with pytest.raises(SystemExit) as stop:
        cli(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


def test_an_absent_id_names_the_path_searched_and_creates_nothing(tmp_path, monkeypatch, capsys):
    root, cache, run = tmp_path / "no-minari", tmp_path / "cache", tmp_path / "run"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    monkeypatch.setenv("RLZOO_DATASETS", str(cache))
    err = _cli_error(["ravl", "--dataset", "minari:mujoco/hopper/medium-v0", "--run-dir", str(run)], capsys)
    assert f"looked for {root}/mujoco/hopper/medium-v0/data ($MINARI_DATASETS_PATH" in err
    assert "minari download mujoco/hopper/medium-v0" in err and "nothing is downloaded" in err
    assert not root.exists() and not cache.exists() and not run.exists()
    monkeypatch.delenv("MINARI_DATASETS_PATH")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # Minari's default data path, absent too
    err = _cli_error(["neubay", "--dataset", "minari:mujoco/hopper/medium-v0", "--run-dir", str(run)], capsys)
    assert f"{tmp_path}/home/.minari/datasets/mujoco/hopper/medium-v0/data (Minari's default data path" in err
    assert not (tmp_path / "home").exists() and not cache.exists() and not run.exists()


def test_other_datasets_present_are_listed(paths, tmp_path, capsys):
    err = _cli_error(
        ["ravl", "--dataset", "minari:zoo-test/hopper/expert-v0", "--run-dir", str(tmp_path / "r")], capsys
    )
    assert "looked for" in err and f"(present: {ID})" in err


def test_without_the_minari_package_the_error_names_the_extra(paths, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "minari", None)  # `import minari` fails as if it were not installed
    err = _cli_error(["ravl", "--dataset", f"minari:{ID}", "--run-dir", str(tmp_path / "r")], capsys)
    assert "need the minari package" in err and "pip install -e '.[minari]'" in err
    assert not paths[1].exists()


def test_a_minari_file_given_as_a_path_says_to_use_its_id(paths, tmp_path, monkeypatch, capsys):
    source, _ = paths
    file = source / ID / "data" / "main_data.hdf5"
    err = _cli_error(["ravl", "--dataset", str(file), "--run-dir", str(tmp_path / "r")], capsys)
    assert "a Minari dataset" in err and f"--dataset minari:{ID} (converted once" in err and "missing key" not in err
    for folder in (source / ID, source / ID / "data"):  # its folders say the same
        err = _cli_error(["ravl", "--dataset", str(folder), "--run-dir", str(tmp_path / "r")], capsys)
        assert f"--dataset minari:{ID} (converted once" in err and "corrupt" not in err
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "elsewhere"))  # the root must then be named
    err = _cli_error(["ravl", "--dataset", str(file), "--run-dir", str(tmp_path / "r")], capsys)
    assert f"--dataset minari:{ID} with MINARI_DATASETS_PATH={source.resolve()}" in err


# --------------------------------------------------------------------------------------------
# training on it
# --------------------------------------------------------------------------------------------
TINY = [
    "--network.width",
    "16",
    "--critics",
    "2",
    "--rollout-batch",
    "64",
    "--horizon",
    "2",
    "--updates-per-epoch",
    "20",
    "--batch-size",
    "32",
    "--total-steps",
    "40",
    "--eval-every",
    "20",
    "--eval-episodes",
    "2",
    "--log-every",
    "20",
    "--checkpoint-every",
    "40",
    "--no-progress",
    "--dynamics.members",
    "2",
    "--dynamics.elites",
    "1",
    "--dynamics.width",
    "16",
    "--dynamics.depth",
    "1",
    "--dynamics.min-epochs",
    "2",
    "--dynamics.max-epochs",
    "2",
    "--dynamics.batch-size",
    "64",
]


@pytest.mark.slow
def test_ravl_trains_on_a_minari_id_end_to_end_and_evaluates(paths, tmp_path, capsys):
    from plasticity_zoo.training.run import load_config
    from scripts.evaluate import main as evaluate
    from scripts.train import cli

    run = tmp_path / "run"
    out = cli(["ravl", "--dataset", f"minari:{ID}", "--run-dir", str(run), *TINY])
    printed = capsys.readouterr().out
    assert out["step"] == 40 and printed.count("converting Minari dataset") == 1  # once: checks and loop share it
    converted = paths[1] / "minari" / f"{ID}.hdf5"
    assert Path(f"{converted}.dynamics-0.npz").exists()  # RAVL's model, cached beside the conversion
    cfg = load_config(run)  # what --resume, evaluate.py and report.py read
    assert cfg.env == "Hopper-v5" and cfg.agent.dataset == f"minari:{ID}"
    assert json.loads((run / "dataset.json").read_text())["dataset"] == str(converted)
    rows = list(csv.DictReader(open(run / "eval.csv")))
    assert [r["step"] for r in rows] == ["0", "20", "40"]
    for r in rows:  # the dataset's own references from Minari (-20, 3000), and D4RL's for hopper
        assert float(r["score_dataset"]) == pytest.approx(100 * (float(r["return_mean"]) + 20) / 3020, rel=1e-6)
        assert float(r["score_d4rl"]) == pytest.approx(S.normalized_score(float(r["return_mean"]), "Hopper-v5"))
    got = evaluate([str(run), "--out", str(tmp_path / "evaluate.csv")])
    assert got["env"] == "Hopper-v5" and got["step"] == 40
    assert "the same returns" in capsys.readouterr().out  # as the run's own evaluation at step 40
    logs = []
    assert M.convert(f"minari:{ID}", log=logs.append) == converted and logs == []  # a second run reuses it


def test_neubay_takes_a_minari_id_with_the_kind_from_its_name(paths):
    from plasticity_zoo.agents import neubay
    from plasticity_zoo.training.loops.offline import dataset_config, resolve_dataset
    from plasticity_zoo.training.run import preflight
    from scripts.train import parse

    cfg = parse(["neubay", "--dataset", f"minari:{ID}"])
    preflight(cfg)  # the dataset, its env, the agent's options (traced, nothing compiled)
    path, ds, env_id = resolve_dataset(cfg)
    assert env_id == "Hopper-v5" and path == paths[1] / "minari" / f"{ID}.hdf5"
    got = dataset_config(cfg, neubay, ds, env_id).agent
    assert got == neubay.with_dataset(cfg.agent, "Hopper-v5", {"kind": "medium"}, cfg.total_steps)  # hopper-medium
