"""Evaluation, eval.csv, evaluate.py, plots and reports of multitask (``mt:``) runs (issue #20).

``--eval-episodes K`` on an ``mt:`` env of T tasks is K episodes per task: each seed's block of K x T
episodes runs task ``k % T`` in episode ``k`` with env seed ``eval_base_seed + j * K * T + k``.  Each
evaluation writes per seed one eval.csv row per task and a ``task=all`` row (mean over tasks of the
per-task means and of return / 1000 for ``dmc:`` tasks); single-task runs keep their columns.  Runs are
tiny (SAC, width 16, 300 steps, one episode per task).
"""

import collections
import csv
import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from plasticity_zoo.training.evaluation import Evaluator, eval_base_seed, run_evaluator
from plasticity_zoo.training.logger import EVAL_COLUMNS, MT_EVAL_COLUMNS, RunLogger, task_max_return, task_results

ROOT = Path(__file__).resolve().parents[1]
MT = "mt:cartpole2"
TASKS = ("dmc:cartpole-balance", "dmc:cartpole-swingup")


def _script(name):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mt_config(run_dir, **kw):
    from plasticity_zoo.agents.sac import SACConfig
    from plasticity_zoo.training.config import NetworkConfig, RunConfig

    agent = SACConfig(buffer_size=5000, batch_size=32, learning_starts=100)
    base = dict(
        env=MT,
        seeds=2,
        num_envs=2,
        total_steps=300,
        eval_every=150,
        eval_episodes=1,
        log_every=150,
        checkpoint_every=150,
        progress=False,
        network=NetworkConfig(width=16),
        agent_name="sac",
        agent=agent,
    )
    return RunConfig(**{**base, **kw}, run_dir=str(run_dir))


def _rows(run_dir):
    with open(Path(run_dir) / "eval.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def mt_run(tmp_path_factory):
    """SAC on mt:cartpole2, 2 seeds x 2 envs (one per task), evaluations at 0, 150 and 300."""
    from plasticity_zoo.training.run import run

    d = tmp_path_factory.mktemp("mt") / "sac"
    out = run(_mt_config(d))
    return d, out


# ------------------------------------------------------------------------------------------ pure parts
def test_task_max_return_and_per_task_summary_against_hand_values():
    assert task_max_return("dmc:cheetah-run") == 1000.0
    assert task_max_return("Pendulum-v1") is None
    # episode k ran task k % 2: task a got 100 and 300, task b 10 and 30
    a, b, total = task_results([100.0, 10.0, 300.0, 30.0], ("dmc:a-x", "dmc:b-y"))
    assert a == {"task": "dmc:a-x", "returns": [100.0, 300.0], "return_mean": 200.0, "return_std": 100.0, "score": 0.2}
    assert b["returns"] == [10.0, 30.0] and b["return_mean"] == 20.0 and b["score"] == pytest.approx(0.02)
    assert total["task"] == "all" and total["return_mean"] == 110.0 and total["score"] == pytest.approx(0.11)
    assert total["returns"] == [100.0, 10.0, 300.0, 30.0]
    assert total["return_std"] == pytest.approx(np.std([100, 10, 300, 30]))
    # a member without a known maximum: its score and the aggregate's are empty
    rows = task_results([500.0, -200.0], ("dmc:a-x", "Pendulum-v1"))
    assert [r["score"] for r in rows] == [0.5, None, None]
    with pytest.raises(ValueError, match="split"):
        task_results([1.0, 2.0, 3.0], ("dmc:a-x", "dmc:b-y"))


def test_logger_writes_task_rows_empty_scores_without_a_maximum_and_tensorboard_scalars(tmp_path):
    class Recorder:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, tag, value, step):
            self.scalars[tag] = value

    log = RunLogger(tmp_path, multitask=True)
    log.tb = collections.defaultdict(Recorder)  # seed -> writer
    log.log_eval(10, [[500.0, -200.0, 700.0, -400.0]], tasks=("dmc:a-x", "Pendulum-v1"))
    with open(tmp_path / "eval.csv", newline="") as f:
        assert next(csv.reader(f)) == MT_EVAL_COLUMNS
    rows = _rows(tmp_path)
    assert [(r["step"], r["seed"], r["task"]) for r in rows] == [
        ("10", "0", "dmc:a-x"),
        ("10", "0", "Pendulum-v1"),
        ("10", "0", "all"),
    ]
    assert [r["episode_returns"] for r in rows] == ["500.0 700.0", "-200.0 -400.0", "500.0 -200.0 700.0 -400.0"]
    assert [r["score"] for r in rows] == ["0.6", "", ""]
    assert float(rows[2]["return_mean"]) == (600.0 - 300.0) / 2
    assert list(log.tb) == [0] and log.tb[0].scalars == {
        "eval_tasks/dmc_a-x/return": 600.0,
        "eval_tasks/dmc_a-x/score": 0.6,
        "eval_tasks/Pendulum-v1/return": -300.0,
        "eval/return": 150.0,
    }
    log.truncate_after(5)  # resume: the rows after the checkpoint go, the header stays
    assert _rows(tmp_path) == []
    with open(tmp_path / "eval.csv", newline="") as f:
        assert next(csv.reader(f)) == MT_EVAL_COLUMNS


def test_the_evaluator_gives_each_task_k_episodes_per_seed_at_the_fixed_env_seeds():
    """Episode k of seed j runs task k % T from env seed base + j * K * T + k: each return equals that
    task's env, reset with that seed, driven by the same policy."""
    from plasticity_zoo.envs import make_env

    env_id, K, S, base = "mt:Pendulum-v1,ToyChain-v0", 2, 2, 700
    ev = Evaluator(env_id, S, K, base)
    assert ev.tasks == ("Pendulum-v1", "ToyChain-v0") and ev.episodes == K * 2
    assert list(ev.env.task_index) == [0, 1] * (S * K)
    assert ev.env_seeds == [base + j * K * 2 + k for j in range(S) for k in range(K * 2)]

    def policy(obs):  # deterministic, state dependent: pushes by the first coordinate
        return np.tanh(obs[..., :1]) * 0.7

    returns = np.asarray(ev(policy))
    assert returns.shape == (S, K * 2)
    for j in range(S):
        for k in range(K * 2):
            env = make_env(env_id, 0, task=k % 2)
            obs, _ = env.reset(seed=base + j * K * 2 + k)
            total, done = 0.0, False
            while not done:
                obs, r, term, trunc, _ = env.step(policy(obs[None])[0])
                total += float(np.float32(r))
                done = term or trunc
            assert returns[j, k] == pytest.approx(total, rel=1e-6), (j, k)
    per_task = [task_results(r, ev.tasks) for r in returns]
    assert all(len(rows[t]["returns"]) == K for rows in per_task for t in range(2))


def test_run_evaluator_strides_by_the_runs_block_of_k_times_t_episodes(tmp_path):
    cfg = _mt_config(tmp_path, eval_episodes=2, seeds=3)
    ev = run_evaluator(cfg, "rescale", seeds=1, first_seed=2)
    assert ev.episodes == 4 and ev.env_seeds == [eval_base_seed(cfg) + 2 * 4 + k for k in range(4)]
    ev = run_evaluator(cfg, "rescale")
    assert ev.env_seeds == [eval_base_seed(cfg) + j * 4 + k for j in range(3) for k in range(4)]


# ------------------------------------------------------------------------------------------ a run
@pytest.mark.slow
def test_an_mt_run_writes_a_row_per_task_and_the_mean_over_tasks(mt_run):
    d, out = mt_run
    with open(d / "eval.csv", newline="") as f:
        assert next(csv.reader(f)) == MT_EVAL_COLUMNS
    rows = _rows(d)
    assert [(int(r["step"]), int(r["seed"]), r["task"]) for r in rows] == [
        (step, seed, task) for step in (0, 150, 300) for seed in (0, 1) for task in (*TASKS, "all")
    ]
    finals = []
    for i in range(0, len(rows), 3):
        *per_task, total = rows[i : i + 3]
        for r in per_task:
            returns = [float(x) for x in r["episode_returns"].split()]
            assert len(returns) == 1 and float(r["return_mean"]) == returns[0]  # K = 1 episode per task
            assert float(r["score"]) == pytest.approx(float(r["return_mean"]) / 1000.0)
        means = [float(r["return_mean"]) for r in per_task]
        assert float(total["return_mean"]) == pytest.approx(np.mean(means))
        assert float(total["score"]) == pytest.approx(np.mean([float(r["score"]) for r in per_task]))
        assert [float(x) for x in total["episode_returns"].split()] == means  # episode k ran task k % 2
        if total["step"] == "300":
            finals.append(float(total["return_mean"]))
    assert out["last_eval"] == pytest.approx(np.mean(finals))  # the run's figure: the aggregate


@pytest.mark.slow
def test_a_resumed_mt_run_writes_the_same_eval_csv(mt_run, tmp_path, assert_same_logs):
    """Stopped at 200 and resumed from the checkpoint at 150, which precedes the evaluation at 150:
    resuming drops that evaluation's task and aggregate rows and writes them again."""
    import shutil

    from plasticity_zoo.training import checkpoint
    from plasticity_zoo.training.run import run

    d = tmp_path / "part"
    run(_mt_config(d), stop_at=200)
    assert [r["step"] for r in _rows(d)] == ["0"] * 6 + ["150"] * 6
    shutil.rmtree(checkpoint.path_for(d, 200))
    assert checkpoint.latest(d) == checkpoint.path_for(d, 150)
    run(dataclasses.replace(_mt_config(d), resume=str(d)))
    assert_same_logs(mt_run[0], d)


@pytest.mark.slow
def test_evaluate_py_reports_per_task_returns_equal_to_the_runs_own(mt_run, tmp_path, capsys):
    evaluate = _script("evaluate")
    d = mt_run[0]
    res = evaluate.main([str(d), "--out", str(tmp_path / "e.csv")])
    printed = capsys.readouterr().out
    assert "per task and seed" in printed and "the same returns" in printed
    own = [r for r in _rows(d) if r["step"] == "300"]
    mine = list(csv.DictReader(open(tmp_path / "e.csv", newline="")))
    assert [(r["seed"], r["task"], r["return_mean"], r["score"]) for r in mine] == [
        (r["seed"], r["task"], r["return_mean"], r["score"]) for r in own
    ]
    assert res["returns"] == [[float(x) for x in r["episode_returns"].split()] for r in own if r["task"] == "all"]


@pytest.mark.slow
def test_a_single_task_run_keeps_its_eval_columns(tiny_sac_config, tmp_path):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.loops.offpolicy import train

    train(tiny_sac_config(total_steps=300, eval_every=300, learning_starts=100), sac, tmp_path / "r")
    with open(tmp_path / "r" / "eval.csv", newline="") as f:
        assert next(csv.reader(f)) == EVAL_COLUMNS == ["step", "seed", "return_mean", "return_std", "episode_returns"]
    assert [r["step"] for r in _rows(tmp_path / "r")] == ["0", "300"]


# ------------------------------------------------------------------------------------------ plots, reports
@pytest.mark.slow
def test_plot_draws_the_aggregate_by_default_and_a_panel_per_task_with_per_task(mt_run, tmp_path, capsys):
    from plasticity_zoo.analysis import plot as plot_lib

    plot = _script("plot")  # the command line; its functions are plot_lib's
    d = mt_run[0]
    rows = _rows(d)
    final = [float(r["return_mean"]) for r in rows if r["step"] == "300" and r["task"] == "all"]
    plot.main([str(d), "--out", str(tmp_path / "all.png")])
    lines = capsys.readouterr().out.splitlines()
    assert (tmp_path / "all.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [line for line in lines if line.startswith(MT)]
    assert len(table) == 1 and f"{np.mean(final):.3f}" in table[0]

    run = plot_lib.load_run(d)
    assert list(run.by_task) == list(TASKS) and set(run.eval["task"]) == {"all"}
    agg = plot_lib.aggregate(plot_lib.group_curves([run], "score", "eval"))
    np.testing.assert_allclose(agg.mean[-1], np.mean(final) / 1000.0)

    plot.main(
        [str(d), "--out", str(tmp_path / "tasks.png"), "--per-task", "--y", "score", "--metrics", "losses/critic"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert (tmp_path / "tasks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for task in TASKS:
        scores = [float(r["score"]) for r in rows if r["step"] == "300" and r["task"] == task]
        row = next(line for line in lines if line.startswith(f"{MT}: {task}"))
        assert f"{np.mean(scores):.3f}" in row
    panels = plot_lib.task_panels(plot_lib.group_runs([plot_lib.load_run(d, with_metrics=True)]), ["losses/critic"])
    assert [p[0] for p in panels] == [f"{MT} (all tasks)", *(f"{MT}: {t}" for t in TASKS), f"{MT}: losses/critic"]


@pytest.mark.slow
def test_reports_and_sweeps_read_the_aggregate_rows(mt_run, tmp_path):
    from plasticity_zoo.analysis import aggregate as agg
    from plasticity_zoo.training.sweep import latest_return

    d = mt_run[0]
    rows = [r for r in _rows(d) if r["task"] == "all"]
    per_seed = agg.read_eval(d, "score")
    for seed, (steps, values) in per_seed.items():
        mine = [r for r in rows if int(r["seed"]) == seed]
        assert list(steps) == [int(r["step"]) for r in mine] and list(values) == [float(r["score"]) for r in mine]
    assert agg.reference(MT, {}, "score")[0] == (0.0, 1.0)
    assert agg.reference(MT, {})[0] == (0.0, 1000.0)  # dmc: tasks only: their mean return is in 0-1000
    assert agg.reference("mt:dmc:cartpole-balance,Pendulum-v1", {})[0] is None
    step, value = latest_return(d)
    finals = [float(r["return_mean"]) for r in rows if r["step"] == "300"]
    assert step == 300 and value == pytest.approx(np.mean(finals))

    report = _script("report")
    out = report.main([str(d), "--out", str(tmp_path / "rep"), "--y", "score"])
    (row,) = out["per_env"]
    assert row["env"] == MT and row["normalised"] == pytest.approx(row["mean"])
    assert row["mean"] == pytest.approx(np.mean([float(r["score"]) for r in rows if r["step"] == "300"]))
    assert json.loads((d / "config.json").read_text())["env"] == MT
