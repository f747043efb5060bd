"""Aggregate statistics (Agarwal et al. 2021) against hand values and brute force, analysis/report.py and its
command line, scripts/report.py, end to end."""

import csv
import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from plasticity_zoo.analysis import aggregate as agg
from plasticity_zoo.analysis import report, stats


def _load_report_cli():
    """Import scripts/report.py by path (scripts/ is not a package): the command line over analysis.report."""
    spec = importlib.util.spec_from_file_location(
        "report_script", Path(__file__).resolve().parents[1] / "scripts" / "report.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report_cli = _load_report_cli()


def test_iqm_mean_median_and_optimality_gap_match_hand_values():
    # IQM pools run-task scores: 1..8 sorted, int(0.25 * 8) = 2 cut from each end -> mean(3, 4, 5, 6) = 4.5
    assert stats.iqm_of([np.array([[1, 2, 3, 4.0]]), np.array([[5, 6, 7, 8.0]])]) == pytest.approx([4.5])
    # mean and median are over the per-task means: tasks [1, 3], [2, 2], [10, 0] -> means 2, 2, 5
    tasks = [np.array([[1, 3.0]]), np.array([[2, 2.0]]), np.array([[10, 0.0]])]
    assert stats.mean_of(tasks) == pytest.approx([3.0]) and stats.median_of(tasks) == pytest.approx([2.0])
    # optimality gap: task 1 max(1 - [0.5, 1.2], 0) = [0.5, 0] -> 0.25; task 2 [0.1, 0.9] -> 0.5; mean 0.375
    assert stats.optimality_gap_of([np.array([[0.5, 1.2]]), np.array([[0.9, 0.1]])]) == pytest.approx([0.375])


def test_on_a_rectangular_matrix_the_aggregates_are_rliables_flat_definitions():
    scores = np.random.default_rng(0).normal(0.5, 0.3, size=(7, 4))  # (runs, tasks)
    tasks = [scores[None, :, j] for j in range(4)]
    flat = np.sort(scores.ravel())
    assert stats.iqm_of(tasks)[0] == pytest.approx(flat[7:21].mean())  # 28 scores, 7 cut from each end
    assert stats.mean_of(tasks)[0] == pytest.approx(scores.mean())
    assert stats.median_of(tasks)[0] == pytest.approx(np.median(scores.mean(axis=0)))
    assert stats.optimality_gap_of(tasks)[0] == pytest.approx(np.maximum(1 - scores, 0).mean())


def test_performance_profile_is_the_share_of_runs_above_tau_averaged_over_tasks():
    tasks = [np.array([0.2, 0.6]), np.array([0.4, 0.8, 1.0])]
    point, low, high = stats.performance_profile(tasks, [0.0, 0.5, 1.0], n_boot=200, rng=0)
    # tau 0: every run; tau 0.5: task 1 1/2, task 2 2/3 -> 7/12; tau 1.0: none strictly above
    assert point == pytest.approx([1.0, 7 / 12, 0.0])
    assert np.all(low <= point + 1e-12) and np.all(point <= high + 1e-12)


def test_probability_of_improvement_is_the_mann_whitney_statistic_averaged_over_tasks():
    # x = [1, 2] vs y = [2, 0]: pairs 1>2 0, 1>0 1, 2=2 0.5, 2>0 1 -> 2.5 / 4
    assert stats.probability_of_improvement([[1, 2]], [[2, 0]], n_boot=50, rng=0)[0] == pytest.approx(0.625)
    rng = np.random.default_rng(1)
    xs = [rng.integers(0, 4, size=n).astype(float) for n in (3, 5)]  # ties on purpose, ragged tasks
    ys = [rng.integers(0, 4, size=n).astype(float) for n in (4, 2)]
    brute = np.mean(
        [
            np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(x, y)])
            for x, y in zip(xs, ys)
        ]
    )
    p, low, high = stats.probability_of_improvement(xs, ys, n_boot=500, rng=0)
    assert p == pytest.approx(brute) and low <= p <= high
    # X vs Y and Y vs X add up to 1 (ties counted half to each)
    assert stats.probability_of_improvement(ys, xs, n_boot=10, rng=0)[0] == pytest.approx(1 - brute)


def test_the_stratified_bootstrap_resamples_runs_within_their_task():
    # All runs of task 1 score 0 and of task 2 score 1: a resample that mixed tasks would move these
    tasks = [np.zeros(3), np.ones(2)]
    assert stats.stratified_interval(tasks, stats.mean_of, n_boot=300, rng=0) == pytest.approx((0.5, 0.5, 0.5))
    # pooled IQM of three 0s and two 1s: cut one at each end -> mean(0, 0, 1) = 1/3, in every resample
    assert stats.stratified_interval(tasks, stats.iqm_of, n_boot=300, rng=0) == pytest.approx((1 / 3,) * 3)
    # and with spread within tasks the interval is a real interval that holds the point
    rng = np.random.default_rng(2)
    point, low, high = stats.stratified_interval(
        [rng.normal(size=6), rng.normal(1, 1, size=4)], stats.iqm_of, n_boot=1000, rng=0
    )
    assert low < point < high


def test_against_rliable_where_it_imports():
    rly_metrics = pytest.importorskip("rliable.metrics")
    scores = np.random.default_rng(3).uniform(0, 1.3, size=(10, 5))
    tasks = [scores[:, j] for j in range(5)]
    for ours, theirs in [
        (stats.iqm_of, rly_metrics.aggregate_iqm),
        (stats.mean_of, rly_metrics.aggregate_mean),
        (stats.median_of, rly_metrics.aggregate_median),
        (stats.optimality_gap_of, rly_metrics.aggregate_optimality_gap),
    ]:
        assert stats.stratified_interval(tasks, ours, n_boot=10, rng=0)[0] == pytest.approx(float(theirs(scores)))
    other = np.random.default_rng(4).uniform(0, 1.3, size=(10, 5))
    assert stats.probability_of_improvement(tasks, [other[:, j] for j in range(5)], n_boot=10, rng=0)[
        0
    ] == pytest.approx(float(rly_metrics.probability_of_improvement(scores, other)))
    from rliable.library import create_performance_profile

    taus = np.linspace(0, 1.3, 14)
    profiles, _ = create_performance_profile({"x": scores}, taus, reps=10)
    assert stats.score_distribution(tasks, taus) == pytest.approx(np.asarray(profiles["x"]))


def test_normalisation_references():
    assert agg.reference("dmc:cheetah-run", {})[0] == (0.0, 1000.0)
    low, high = agg.reference("HalfCheetah-v5", {})[0]
    assert (low, high) == (-289.4, 10574.0) and agg.normalise(10574.0, low, high) == pytest.approx(1.0)
    assert agg.reference("Pendulum-v1", {})[0] is None
    assert agg.reference("Pendulum-v1", agg.parse_norm(["Pendulum-v1=-1600:0"]))[0] == (-1600.0, 0.0)
    assert agg.reference("ns:reward_flip:dmc:cheetah-run:every=10", {})[0] is None  # rewards change: --norm
    # a chain scored on all its tasks reads as a multitask run: DMC's range, or the score's
    assert agg.reference("ns:chain:plasticine-walker", {})[0] == (0.0, 1000.0)
    assert agg.reference("ns:chain:plasticine-walker", {}, y="score")[0] == agg.SCORE_RANGE
    assert agg.reference("ns:chain:plasticine-walker:eval=current", {})[0] is None  # the trained task's rewards


def _run(root: Path, name, env, label, finals, steps=(1000, 2000)):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"env": env, "label": label, "agent_name": "sac"}))
    with open(d / "eval.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "seed", "return_mean", "return_std", "episode_returns"])
        for step in steps:
            for seed, final in enumerate(finals):
                value = final if step == steps[-1] else final - 50
                w.writerow([step, seed, value, 0.0, value])
    with open(d / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "seed", "plasticity/critic/dormant_0.0"])
        for step in steps:
            for seed in range(len(finals)):
                w.writerow([step, seed, 0.1 * seed])
    return d


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep" / "runs"
    _run(root, "a", "dmc:cartpole-balance", "none", [100, 200, 300])
    _run(root, "b", "dmc:cartpole-balance", "redo", [400, 500, 600])
    _run(root, "c", "Pendulum-v1", "none", [-900, -800, -700])
    _run(root, "d", "Pendulum-v1", "redo", [-600, -500, -400])
    _run(root / ".replaced-20260101-000000", "old", "Pendulum-v1", "redo", [0, 0, 0])  # moved aside: skipped
    return tmp_path / "sweep"


@pytest.mark.slow
def test_report_over_a_sweep_writes_figures_and_tables_with_the_hand_computed_numbers(sweep, tmp_path):
    out = report_cli.main(
        [
            str(sweep),
            "--out",
            str(tmp_path / "rep"),
            "--norm",
            "Pendulum-v1=-1000:0",
            "--metrics",
            "plasticity/critic/dormant*",
        ]
    )
    rep = tmp_path / "rep"
    for name in (
        "report.md",
        "per_env.csv",
        "aggregate.csv",
        "improvement.csv",
        "curves.png",
        "curves.pdf",
        "metrics.png",
        "aggregate.png",
        "aggregate.pdf",
        "profiles.png",
        "improvement.png",
    ):
        assert (rep / name).is_file(), name
    rows = {r["label"]: r for r in csv.DictReader(open(rep / "aggregate.csv"))}
    # none: dmc 100..300 / 1000 = .1 .2 .3, Pendulum (-900..-700 + 1000) / 1000 = .1 .2 .3: IQM of
    # [.1 .1 .2 .2 .3 .3] cuts one at each end -> mean(.1 .2 .2 .3) = 0.2; redo: every score +0.3
    assert float(rows["none"]["IQM"]) == pytest.approx(0.2) and float(rows["redo"]["IQM"]) == pytest.approx(0.5)
    assert float(rows["none"]["optimality gap"]) == pytest.approx(0.8)
    imp = list(csv.DictReader(open(rep / "improvement.csv")))
    # redo beats none on every pair but (.4 vs .3)... redo's .4 .5 .6 against none's .1 .2 .3: all 9 pairs -> 1
    assert [(r["label"], r["baseline"], float(r["P(label > baseline)"])) for r in imp] == [("redo", "none", 1.0)]
    per_env = {(r["env"], r["label"]): r for r in csv.DictReader(open(rep / "per_env.csv"))}
    assert float(per_env[("Pendulum-v1", "redo")]["mean"]) == pytest.approx(-500.0)
    assert per_env[("Pendulum-v1", "redo")]["seeds"] == "3"  # the moved-aside run is not pooled
    assert len(out["groups"]) == 4


@pytest.mark.slow
def test_final_window_averages_each_seeds_last_evaluations(sweep, tmp_path):
    out = report.write_report(sweep / "runs" / "a", tmp_path / "rep", final_window=2)
    assert out["groups"][0].scores == pytest.approx([75.0, 175.0, 275.0])  # mean of (final - 50, final)


@pytest.mark.slow
def test_without_a_reference_an_env_is_left_out_of_the_aggregates_and_says_so(sweep, tmp_path):
    out = report.write_report([sweep], tmp_path / "rep")
    assert all(r["envs"] == 1 for r in out["aggregate"])  # dmc only
    assert "left out of the aggregates" in (tmp_path / "rep" / "report.md").read_text()
    assert "Pendulum-v1=LOW:HIGH" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/nothing"], "no such file or directory"),
        (["{tmp}"], "no run directory (config.json and eval.csv)"),
        (["{sweep}", "--baseline", "nope"], "--baseline 'nope' is not a label of these runs; labels: none, redo"),
        (["{sweep}", "--norm", "Pendulum-v1"], "write ENV=LOW:HIGH"),
        (["{sweep}", "--norm", "Pendulum-v1=3:3"], "LOW and HIGH must be finite and differ"),
        (["{sweep}", "--y", "score_d4rl"], "has no column 'score_d4rl'"),
    ],
)
def test_mistakes_are_one_error_line(sweep, tmp_path, capsys, args, message):
    (tmp_path / "empty").mkdir()
    args = [a.format(tmp=tmp_path / "empty", sweep=sweep) for a in args]
    with pytest.raises(SystemExit) as e:
        report_cli.cli([*args, "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_an_empty_eval_csv_is_refused(tmp_path, capsys):
    d = _run(tmp_path, "r", "dmc:cartpole-balance", "none", [1])
    (d / "eval.csv").write_text("step,seed,return_mean,return_std,episode_returns\n")
    with pytest.raises(SystemExit):
        report_cli.cli([str(d), "--out", str(tmp_path / "rep")])
    assert "has no evaluations yet" in capsys.readouterr().err


def _full_run(root: Path, name, agent_name, total_steps, eval_steps, seed=0, **agent_flags):
    """A run directory with the config.json train.py writes (every flag) and a linear eval.csv."""
    from plasticity_zoo import agents
    from plasticity_zoo.training.config import RunConfig, to_json

    agent_cfg = agents.get(agent_name).CONFIG(**agent_flags)
    d = root / name
    d.mkdir(parents=True)
    cfg = RunConfig(
        env="Pendulum-v1", total_steps=total_steps, seed=seed, run_dir=str(d), agent_name=agent_name, agent=agent_cfg
    )
    (d / "config.json").write_text(json.dumps(to_json(cfg)))
    lines = ["step,seed,return_mean,return_std,episode_returns"] + [
        f"{s},0,{-1000 + s / 200},0.0,{-1000 + s / 200}" for s in eval_steps
    ]
    (d / "eval.csv").write_text("\n".join(lines) + "\n")
    return d


@pytest.mark.slow
def test_a_run_stopped_before_its_last_step_is_marked_in_the_report(tmp_path, capsys):
    """Issue #47 item 8: report.py silently pooled a run stopped at 43k of 100k steps with finished ones."""
    _full_run(tmp_path / "runs", "done", "sac", 100_000, range(0, 100_001, 5000))
    _full_run(tmp_path / "runs", "cut", "sac", 100_000, range(0, 43_001, 5000), seed=1)  # evaluations to 40k
    with open(tmp_path / "runs" / "cut" / "eval.csv", "a") as f:
        f.write("43000,0,-785.0,0.0,-785.0\n")  # stopped (Ctrl-C) at 43k: its last evaluation
    # PPO ends at its last whole rollout: 48 x 2048 = 98,304 of 100,000 steps is a finished run
    _full_run(tmp_path / "runs", "ppo", "ppo", 100_000, [*range(0, 98_001, 7000), 98_304])
    out = report.write_report([tmp_path / "runs"], tmp_path / "rep")
    notes = {(r["label"], r["note"]) for r in out["per_env"]}
    assert notes == {("sac", "cut stopped at 43k of 100k"), ("ppo", "")}, notes
    sac = next(r for r in out["per_env"] if r["label"] == "sac")
    assert sac["seeds"] == 2 and sac["mean"] == pytest.approx((-500 + -785) / 2)  # kept, and said so
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warning == [
        "warning: Pendulum-v1 sac: cut stopped at 43k of 100k (kept: its score is its last "
        "evaluation; marked in report.md and per_env.csv)"
    ]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| note |" in md and "| cut stopped at 43k of 100k |" in md
    assert {r["label"]: r["note"] for r in csv.DictReader(open(tmp_path / "rep" / "per_env.csv"))} == {
        "sac": "cut stopped at 43k of 100k",
        "ppo": "",
    }
