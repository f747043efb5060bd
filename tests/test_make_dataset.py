"""scripts/make_dataset.py --kind random alone: the uniform policy only, no SAC (issue #24 item 5).

The SAC path itself (medium / medium-replay, reusing a finished training for random) is tested end
to end in tests/test_datasets.py.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from plasticity_zoo.envs import datasets as D
from plasticity_zoo.envs import scores as S

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--size", "300", "--ref-episodes", "3", "--num-envs", "3", "--max-episode-steps", "20", "--no-progress"]
SAC_KEYS = ("train_steps", "algorithm", "sac_run_dir", "sac_config", "network_config", "ref_policy_step")


@pytest.fixture(scope="module")
def make_dataset():
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_dataset

    return make_dataset


@pytest.fixture
def no_sac(make_dataset, monkeypatch):
    """Any SAC build or training step fails the test."""
    from plasticity_zoo.agents import sac
    from plasticity_zoo.training import run
    from plasticity_zoo.training.loops import offpolicy

    def boom(*args, **kwargs):
        raise AssertionError("a random-only dataset built or trained SAC")

    monkeypatch.setattr(make_dataset.SacRun, "__init__", boom)
    monkeypatch.setattr(make_dataset.SacRun, "ensure_trained", boom)
    monkeypatch.setattr(offpolicy, "train", boom)
    monkeypatch.setattr(run, "run", boom)
    monkeypatch.setattr(sac, "init", boom)
    monkeypatch.setattr(sac, "update", boom)


def test_random_only_trains_no_sac_and_takes_ref_max_from_the_flag_then_from_d4rl(
    make_dataset, no_sac, tmp_path, capsys
):
    flag = make_dataset.main(
        ["--env", "Hopper-v5", "--kind", "random", "--ref-max", "3000", "--out", str(tmp_path / "flag.hdf5"), *SMALL]
    )["random"]
    d4rl = make_dataset.main(["--env", "Hopper-v5", "--kind", "random", "--out", str(tmp_path), *SMALL])["random"]
    assert d4rl == tmp_path / "hopper-random-v5.hdf5" and not (tmp_path / "runs").exists()  # no SAC run dir
    a, b = D.load(flag, env_id="Hopper-v5"), D.load(d4rl, env_id="Hopper-v5")
    for ds in (a, b):
        assert len(ds) == 300 and ds.terminals.any() and ds.timeouts.any()  # falls, and the 20-step cap
        assert len(D.check_continuity(ds)) == 0
        m = ds.metadata
        assert (m["kind"], m["size"], m["requested_size"], m["env_id"]) == ("random", 300, 300, "Hopper-v5")
        assert (m["behaviour_policy"], m["behaviour_sampling"]) == ("uniform", "uniform") and "policy" not in m
        assert m["collection_seed"] == 6_000  # 10_000 * seed + 6_000 + 100 * KINDS.index("random"), as before
        assert m["behaviour_return"] == pytest.approx(ds.episode_returns().mean())
        assert m["ref_min_source"] == "uniform-random" and (m["ref_episodes"], m["ref_seed"]) == (3, 123)
        assert m["ref_min_score"] == pytest.approx(make_dataset.random_reference("Hopper-v5", 3, 20))
        assert (m["d4rl_ref_min_score"], m["d4rl_ref_max_score"]) == S.D4RL_REF["hopper"]
        assert not [k for k in SAC_KEYS if k in m]
    for k in D.KEYS:  # the rows do not depend on where ref_max comes from
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    assert (a.metadata["ref_max_score"], a.metadata["ref_max_source"]) == (3000.0, "--ref-max")
    assert (b.metadata["ref_max_score"], b.metadata["ref_max_source"]) == (S.D4RL_REF["hopper"][1], "d4rl")
    assert "v2" in b.metadata["ref_max_note"] and "D4RL" in capsys.readouterr().out
    m = a.metadata
    assert S.normalized_score(3000.0, metadata=m, reference="dataset") == pytest.approx(100.0)


def test_random_only_without_any_ref_max_records_nan_and_warns(make_dataset, no_sac, tmp_path, capsys):
    from plasticity_zoo.training.loops.offline import scores

    path = make_dataset.main(["--env", "Pendulum-v1", "--kind", "random", "--out", str(tmp_path / "p.hdf5"), *SMALL])[
        "random"
    ]
    assert "warning: no ref_max_score for Pendulum-v1" in capsys.readouterr().out
    ds = D.load(path, env_id="Pendulum-v1")
    m = ds.metadata
    assert len(ds) == 300 and ds.timeouts.sum() == 15 and "d4rl_name" not in m
    assert np.isfinite(m["ref_min_score"]) and np.isnan(m["ref_max_score"]) and m["ref_max_source"] == "missing"
    with pytest.raises(ValueError, match="no usable ref_max_score .*ref_max_source = 'missing'.*unavailable"):
        S.normalized_score(-500.0, metadata=m, reference="dataset")
    assert scores(-500.0, "Pendulum-v1", m) == {}  # the offline loop's eval columns: none known
    hopper = dict(m, env_id="Hopper-v5")  # a D4RL env: the D4RL score stays, the dataset one is left out
    assert set(scores(100.0, "Hopper-v5", hopper)) == {"score_d4rl"}
    with pytest.raises(ValueError, match="no usable ref_max_score.*use reference='d4rl'"):
        S.normalized_score(100.0, metadata=dict(hopper, ref_max_score=None), reference="dataset")


def test_ref_max_flag_is_checked(make_dataset, no_sac, tmp_path):
    out = ["--out", str(tmp_path / "r.hdf5"), *SMALL]
    with pytest.raises(SystemExit, match="not above ref_min_score"):
        make_dataset.main(["--kind", "random", "--ref-max", "-1000", *out])
    with pytest.raises(SystemExit, match="--ref-max must be a finite number"):
        make_dataset.main(["--kind", "random", "--ref-max", "nan", *out])
    with pytest.raises(SystemExit, match="--ref-max applies to a request of only --kind random"):
        make_dataset.main(["--kind", "random", "--kind", "expert", "--ref-max", "3000", "--out", str(tmp_path), *SMALL])
    assert not list(tmp_path.iterdir())


def test_random_with_a_sac_kind_still_trains_sac(make_dataset, tmp_path, monkeypatch):
    class Trained(Exception):
        pass

    def ensure_trained(self):
        raise Trained(self.run_dir)

    monkeypatch.setattr(make_dataset.SacRun, "ensure_trained", ensure_trained)
    with pytest.raises(Trained):
        make_dataset.main(
            [
                "--kind",
                "random",
                "--kind",
                "medium",
                "--out",
                str(tmp_path),
                *SMALL,
                "--train-steps",
                "600",
                "--sac.learning-starts",
                "200",
            ]
        )
    assert not list(tmp_path.glob("*.hdf5"))


def test_a_dataset_written_into_runs_names_the_sac_run_dir_without_runs_runs(
    make_dataset, no_sac, tmp_path, capsys, monkeypatch
):
    """Issue #47 item 8: `--out runs/...` printed the SAC reference run's path as runs/runs/<env>-sac-seed0."""
    monkeypatch.chdir(tmp_path)
    make_dataset.main(["--env", "Pendulum-v1", "--kind", "random", "--out", "runs/p.hdf5", *SMALL])
    out = capsys.readouterr().out
    assert f"in {tmp_path / 'runs' / 'Pendulum-v1-sac-seed0'}," in out and "runs/runs" not in out, out
    assert (
        make_dataset.default_run_dir(tmp_path / "data", "dmc:cheetah-run", 2)
        == tmp_path / "data" / "runs" / "dmc_cheetah-run-sac-seed2"
    )  # any other out dir keeps its runs/ folder
