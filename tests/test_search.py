"""scripts/sweep.py searches: ranges and their sampling, the plan of a (re)launch, the searcher and
schedulers handed to Ray Tune, bad input, and end-to-end searches on a local Ray.

The end-to-end tests run real train.py trials (SAC on Pendulum-v1, 200 steps, 16-unit networks) one
at a time on a 1-CPU local Ray.  Their metric is eval.csv's ``return_std`` over ``eval-episodes``
chosen from [1, 3], with goal "max": a one-episode evaluation has a spread of exactly 0, below any
three-episode one, so which trial a scheduler stops is decided by the trials' order alone, whatever
the returns (the seeds below put a three-episode trial first, then a one-episode one).
"""

import csv
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from plasticity_zoo.training import sweep as sw

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "scripts" / "sweep.py"
TINY = {
    "total-steps": 200,
    "learning-starts": 100,
    "eval-every": 100,
    "eval-episodes": 1,
    "checkpoint-every": 100,
    "network.width": 16,
    "plasticity.metrics-every": 0,
}
SPACE = {
    "actor-lr": {"low": 1e-4, "high": 1e-2, "log": True},
    "tau": {"low": 0.001, "high": 0.01},
    "critics": {"low": 2, "high": 10},
    "batch-size": {"low": 16, "high": 256, "log": True},
    "network.width": [16, 32, 64],
    "plasticity.redo": [True, False],
}


def _spec(search: dict, **kw):
    d = {
        "agents": ["sac"],
        "envs": ["Pendulum-v1"],
        "flags": dict(TINY),
        "search": {"mode": "random", "num_trials": 4, "metric": "return_mean", "space": SPACE, **search},
    }
    d.update(kw)
    return sw.make_spec(d)


def _script():
    """scripts/sweep.py as a module (its Ray Tune searcher and schedulers)."""
    spec = importlib.util.spec_from_file_location("sweep_script", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- ranges and sampling ------------------------------------------------------------------------------


def test_ranges_are_read_as_float_int_log_and_choice():
    search = sw.parse_search(_spec({}))
    kinds = {r.name: (r.kind, r.log) for r in search.space}
    assert kinds == {
        "actor-lr": ("float", True),
        "tau": ("float", False),
        "critics": ("int", False),
        "batch-size": ("int", True),
        "network.width": ("choice", False),
        "plasticity.redo": ("choice", False),
    }
    assert next(r for r in search.space if r.name == "network.width").choices == (16, 32, 64)
    assert (search.goal, search.early_stopping, search.seed) == ("max", "none", 0)


def test_random_trials_are_the_same_for_the_same_seed_and_lie_within_their_ranges():
    search = sw.parse_search(_spec({}))
    draws = [dict(sw.random_params(search, i)) for i in range(400)]
    assert draws == [dict(sw.random_params(sw.parse_search(_spec({})), i)) for i in range(400)]
    other = [dict(sw.random_params(sw.parse_search(_spec({"seed": 1})), i)) for i in range(400)]
    assert sum(a == b for a, b in zip(draws, other)) < 5  # another seed, other trials
    for d in draws:
        assert 1e-4 <= d["actor-lr"] <= 1e-2 and 0.001 <= d["tau"] <= 0.01
        assert type(d["critics"]) is int and 2 <= d["critics"] <= 10
        assert type(d["batch-size"]) is int and 16 <= d["batch-size"] <= 256
        assert d["network.width"] in (16, 32, 64) and d["plasticity.redo"] in (True, False)
        assert d["actor-lr"] == float(f"{d['actor-lr']:.4g}")  # kept to 4 significant digits
    # every int and every choice is drawn; a log range is uniform in log (half below the geometric mean),
    # a linear one uniform (half below the middle)
    assert {d["critics"] for d in draws} == set(range(2, 11))
    assert {d["network.width"] for d in draws} == {16, 32, 64} and {d["plasticity.redo"] for d in draws} == {
        True,
        False,
    }
    below = sum(d["actor-lr"] < 1e-3 for d in draws) / len(draws)
    assert 0.4 < below < 0.6
    assert 0.4 < sum(d["tau"] < 0.0055 for d in draws) / len(draws) < 0.6
    assert 0.4 < sum(d["batch-size"] < 64 for d in draws) / len(draws) < 0.6
    # trial i does not depend on the number of trials, nor on the other ranges
    fewer = sw.parse_search(_spec({"num_trials": 2, "space": {"actor-lr": SPACE["actor-lr"]}}))
    assert [dict(sw.random_params(fewer, i))["actor-lr"] for i in range(2)] == [d["actor-lr"] for d in draws[:2]]


def test_a_search_trial_is_labelled_by_its_number_and_carries_its_values():
    spec = _spec({})
    search = sw.parse_search(spec)
    t = sw.search_trial(spec, 7, sw.random_params(search, 7))
    values = dict(t.params)
    assert (t.name, t.label, t.index) == ("Pendulum-v1__sac__t007__seed0", "t007", 7)
    argv = list(t.argv)
    assert argv[:9] == ["sac", "--env", "Pendulum-v1", "--seeds", "1", "--seed", "0", "--label", "t007"]
    assert argv[argv.index("--actor-lr") + 1] == str(values["actor-lr"])
    assert argv[argv.index("--critics") + 1] == str(values["critics"])
    assert ("--plasticity.redo" if values["plasticity.redo"] else "--plasticity.no-redo") in argv
    assert argv[argv.index("--total-steps") + 1] == "200"
    named = _spec({}, variants={"redo": {"preset": "redo-sokar"}})
    t = sw.search_trial(named, 3, ())
    assert (t.label, t.name) == ("redo,t003", "Pendulum-v1__sac__redo-t003__seed0") and "--preset" in t.argv


def test_the_optuna_space_has_the_same_ranges():
    pytest.importorskip("optuna")
    from optuna import distributions as od

    space = sw.optuna_space(sw.parse_search(_spec({"mode": "optuna"})))
    assert space["actor-lr"] == od.FloatDistribution(1e-4, 1e-2, log=True)
    assert space["critics"] == od.IntDistribution(2, 10)
    assert space["batch-size"] == od.IntDistribution(16, 256, log=True)
    assert space["network.width"] == od.CategoricalDistribution((16, 32, 64))


@pytest.mark.parametrize(
    "search, kw, message",
    [
        ({"mode": "grid"}, {}, "unknown search mode 'grid'; modes: random, optuna"),
        ({"mode": None}, {}, "search.mode is missing"),
        (
            {"space": {"actor-lr": {"low": 1e-3, "high": 1e-4}}},
            {},
            "search.space.actor-lr: low (0.001) must be below high",
        ),
        ({"space": {"critics": {"low": 5, "high": 2}}}, {}, "search.space.critics: low (5) must be below high (2)"),
        ({"space": {"actor-lr": {"low": 0.0, "high": 1e-3, "log": True}}}, {}, "a log range needs low > 0"),
        ({"space": {"actor-lr": {"low": 1e-4}}}, {}, "needs both low and high"),
        ({"space": {"actor-lr": {"low": 1e-4, "high": 1e-3, "step": 2}}}, {}, "unknown range keys ['step']"),
        ({"space": {"critics": 3}}, {}, "give a range"),
        ({"space": {"critics": []}}, {}, "an empty list of choices"),
        ({"space": {}}, {}, "search.space is missing or empty"),
        ({"space": {"seed": [0, 1]}}, {}, "the sweep sets --seed itself"),
        ({"metric": None}, {}, "search.metric is missing"),
        ({"metric": "return"}, {}, "search.metric 'return' is not an eval.csv column"),
        ({"metric": "score"}, {}, "written by multitask (mt:) runs only"),
        ({"num_trials": 0}, {}, "search.num_trials must be an integer >= 1, got 0"),
        ({"num_trials": None}, {}, "search.num_trials is missing"),
        ({"goal": "maximize"}, {}, "search.goal must be 'max' or 'min'"),
        ({"early_stopping": "hyperband"}, {}, "unknown search.early_stopping 'hyperband'"),
        ({"reduction_factor": 2}, {}, "search.reduction_factor applies to early_stopping = 'asha', not 'none'"),
        ({"early_stopping": "asha", "reduction_factor": 1}, {}, "reduction_factor must be a number > 1"),
        ({"early_stopping": "asha", "min_trials": 2}, {}, "search.min_trials applies to early_stopping = 'median'"),
        ({"early_stopping": "asha", "space": {"total-steps": [100, 200]}}, {}, "total-steps cannot be searched"),
        ({"trials": 3}, {}, "unknown search keys ['trials']"),
        ({}, {"envs": ["Pendulum-v1", "dmc:cartpole-balance"]}, "a search tunes one agent on one env"),
        ({}, {"grid": {"tau": [0.01, 0.02]}}, "a search has no [grid]"),
        ({}, {"variants": {"a": {}, "b": {}}}, "a search takes one variant"),
        ({}, {"seeds": 4, "seeds_per_trial": 2}, "a search runs all its seeds in each trial"),
    ],
)
def test_a_malformed_search_is_refused(search, kw, message):
    d = {
        "agents": ["sac"],
        "envs": ["Pendulum-v1"],
        "search": {"mode": "random", "num_trials": 4, "metric": "return_mean", "space": {"tau": [0.01]}},
    }
    d["search"].update(search)
    d["search"] = {k: v for k, v in d["search"].items() if v is not None}
    d.update(kw)
    with pytest.raises(sw.SweepError) as e:
        sw.make_spec(d)
    assert message in str(e.value)


# ---- the sweep directory: what a (re)launch runs ----------------------------------------------------------


def _eval_csv(run_dir: Path, rows, columns=("step", "seed", "return_mean", "return_std", "episode_returns")):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "eval.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def test_a_relaunch_keeps_finished_trials_and_runs_the_rest(tmp_path):
    spec = _spec({"num_trials": 4})
    search = sw.parse_search(spec)
    ledger = sw.Ledger(tmp_path / "s")
    plan = sw.plan_search(spec, search, ledger)
    assert [t.index for t in plan.todo] == [0, 1, 2, 3] and not plan.finished and plan.new == 0
    ledger.record(plan.trials, sw.spec_dict(spec))
    for t, state in zip(plan.trials, ("done", "stopped", "interrupted", "failed")):
        ledger.set_status(t.name, state=state)
    again = sw.plan_search(spec, search, ledger)
    assert [t.index for t in again.finished] == [0, 1] and [t.index for t in again.todo] == [2, 3]
    assert again.trials == plan.trials  # the same values: drawn from the seed
    more = sw.plan_search(_spec({"num_trials": 6}), sw.parse_search(_spec({"num_trials": 6})), ledger)
    assert [t.index for t in more.todo] == [2, 3, 4, 5] and more.trials[:4] == plan.trials


def test_an_optuna_relaunch_resumes_recorded_trials_with_their_values_then_asks_for_more(tmp_path):
    spec = _spec({"mode": "optuna", "num_trials": 5})
    search = sw.parse_search(spec)
    ledger = sw.Ledger(tmp_path / "s")
    plan = sw.plan_search(spec, search, ledger)
    assert (plan.trials, plan.todo, plan.new, plan.next_index) == ([], [], 5, 0)
    chosen = [sw.search_trial(spec, i, sw.random_params(search, i + 50)) for i in range(3)]
    ledger.record(chosen, sw.spec_dict(spec))
    ledger.set_status(chosen[0].name, state="done")
    ledger.set_status(chosen[1].name, state="stopped")
    ledger.set_status(chosen[2].name, state="interrupted")
    again = sw.plan_search(spec, search, ledger)
    assert again.finished == chosen[:2] and again.todo == chosen[2:] and (again.new, again.next_index) == (2, 3)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seed": 1}, "holds a search with other seed"),
        ({"space": {"actor-lr": SPACE["actor-lr"]}}, "holds a search with other space"),
        ({"mode": "optuna"}, "holds a search with other mode"),
    ],
)
def test_a_search_directory_refuses_a_search_whose_trials_would_change(tmp_path, change, message):
    spec = _spec({})
    ledger = sw.Ledger(tmp_path / "s")
    ledger.record(sw.plan_search(spec, sw.parse_search(spec), ledger).trials, sw.spec_dict(spec))
    changed = _spec(change)
    with pytest.raises(sw.SweepError, match=message):
        sw.plan_search(changed, sw.parse_search(changed), ledger)
    sw.plan_search(
        _spec({"num_trials": 9, "early_stopping": "asha"}),
        sw.parse_search(_spec({"num_trials": 9, "early_stopping": "asha"})),
        ledger,
    )  # more trials, early stopping: fine
    with pytest.raises(sw.SweepError, match="holds a random search; give this grid sweep another --dir"):
        sw.check_search_dir(ledger, None)


def test_a_grid_directory_refuses_a_search(tmp_path):
    grid = sw.make_spec({"agents": ["sac"], "envs": ["Pendulum-v1"], "flags": dict(TINY)})
    ledger = sw.Ledger(tmp_path / "s")
    ledger.record(sw.expand(grid), sw.spec_dict(grid))
    spec = _spec({})
    with pytest.raises(sw.SweepError, match="holds a grid sweep; give this search another --dir"):
        sw.plan_search(spec, sw.parse_search(spec), ledger)


def test_evaluations_are_read_when_every_seed_has_written_them(tmp_path):
    d = tmp_path / "run"
    _eval_csv(
        d, [(0, 0, -10, 1, ""), (0, 1, -20, 2, ""), (100, 0, -5, 1, ""), (100, 1, -7, 3, ""), (200, 0, -1, 0, "")]
    )  # step 200: one of two seeds so far
    with open(d / "eval.csv", "a") as f:
        f.write("200,1,-3")  # a line still being written
    assert sw.eval_points(d, "return_mean", 2) == [(0, -15.0), (100, -6.0)]
    assert sw.eval_points(d, "return_std", 2) == [(0, 1.5), (100, 2.0)]
    with open(d / "eval.csv", "a") as f:
        f.write(",4,\n100,0,-9,1,\n100,1,-11,1,\n")  # step 200 complete; step 100 again after a resume
    assert sw.eval_points(d, "return_mean", 2) == [(0, -15.0), (100, -10.0), (200, -2.0)]
    mt = tmp_path / "mt"
    _eval_csv(
        mt,
        [(0, 0, "a", 5, 0, "", 0.1), (0, 0, "all", 6, 0, "", 0.2)],
        ("step", "seed", "task", "return_mean", "return_std", "episode_returns", "score"),
    )
    assert sw.eval_points(mt, "score", 1) == [(0, 0.2)]
    assert sw.eval_points(tmp_path / "none", "return_mean", 1) == []


def test_a_feed_reports_each_evaluation_once_and_the_last_only_when_the_run_has_ended(tmp_path):
    d = tmp_path / "run"
    _eval_csv(d, [(0, 0, -10, 0, ""), (100, 0, -8, 0, "")])
    feed = sw.EvalFeed(d, "return_mean", 1, total_steps=200)
    assert feed.new() == [(0, -10.0), (100, -8.0)] and feed.new() == []
    with open(d / "eval.csv", "a") as f:
        f.write("200,0,-6,0,\n")
    assert feed.new() == []  # the run's last evaluation: held back while it runs
    assert feed.new(final=True) == [(200, -6.0)] and feed.new(final=True) == []


def test_a_stopped_trial_records_why_and_the_table_lists_it_apart_from_complete_ones(tmp_path):
    spec = _spec({"num_trials": 4, "early_stopping": "asha", "reduction_factor": 2})
    search = sw.parse_search(spec)
    ledger = sw.Ledger(tmp_path / "s")
    trials = sw.plan_search(spec, search, ledger).trials
    ledger.record(trials, sw.spec_dict(spec))
    for t, rows in zip(
        trials,
        (
            [(100, 0, -900, 0, ""), (300, 0, -400, 0, "")],
            [(100, 0, -800, 0, ""), (300, 0, -300, 0, "")],
            [(100, 0, -100, 0, ""), (200, 0, -1500, 0, "")],  # its last eval is after the stop
            [],
        ),
    ):
        _eval_csv(ledger.run_dir(t), rows)
    ledger.set_status(trials[0].name, state="done", total_steps=300)
    ledger.set_status(trials[1].name, state="done", total_steps=300)
    why = sw.record_stop(ledger, trials[2], search, 100, -100.0, 300)
    ledger.set_status(trials[3].name, state="interrupted")
    assert why["stopped_by"] == "asha" and "ASHA (reduction factor 2)" in why["reason"]
    assert json.loads((ledger.run_dir(trials[2]) / "stopped.json").read_text())["step"] == 100
    assert "stopped early at step 100 of 300: ASHA" in ledger.log(trials[2]).read_text()
    assert ledger.status(trials[2].name)["state"] == "stopped"
    assert sw.last_value(ledger, trials[2], "return_mean") == (100, -100.0)  # where it was stopped
    rows = sw.search_rows(ledger, trials, search)
    assert [(r["trial"], r["state"]) for r in rows] == [
        ("t001", "done"),
        ("t000", "done"),
        ("t002", "stopped"),
        ("t003", "interrupted"),
    ]
    table = sw.search_table(ledger, trials, search).splitlines()
    assert table[0].split() == ["trial", "state", "step", "return_mean", "values"]
    assert table[3].startswith("t002") and "stopped early (asha)" in table[3] and "100" in table[3]
    with open(sw.write_search_summary(ledger, trials, search), newline="") as f:
        summary = list(csv.DictReader(f))
    assert [(r["trial"], r["state"], r["stopped_by"], r["step"]) for r in summary] == [
        ("t001", "done", "", "300"),
        ("t000", "done", "", "300"),
        ("t002", "stopped", "asha", "100"),
        ("t003", "interrupted", "", ""),
    ]
    assert float(summary[0]["actor-lr"]) == dict(trials[1].params)["actor-lr"]


# ---- what scripts/sweep.py hands to Ray Tune ---------------------------------------------------------------


@pytest.mark.slow
def test_the_searcher_resumes_unfinished_trials_first_then_asks_optuna_told_of_the_finished_ones(tmp_path):
    pytest.importorskip("ray.tune")
    pytest.importorskip("optuna")
    from ray.tune.search import Searcher

    spec = _spec(
        {"mode": "optuna", "num_trials": 4, "space": {"actor-lr": SPACE["actor-lr"], "critics": SPACE["critics"]}}
    )
    search = sw.parse_search(spec)
    ledger = sw.Ledger(tmp_path / "s")
    done = sw.search_trial(spec, 0, (("actor-lr", 2e-4), ("critics", 3)))
    stopped = sw.search_trial(spec, 1, (("actor-lr", 5e-3), ("critics", 9)))
    halfway = sw.search_trial(spec, 2, (("actor-lr", 1e-3), ("critics", 4)))
    ledger.record([done, stopped, halfway], sw.spec_dict(spec))
    _eval_csv(ledger.run_dir(done), [(100, 0, -500, 0, ""), (300, 0, -200, 0, "")])
    _eval_csv(ledger.run_dir(stopped), [(100, 0, -900, 0, ""), (200, 0, -950, 0, "")])
    ledger.set_status(done.name, state="done")
    ledger.set_status(stopped.name, state="stopped", stopped_at=100)
    ledger.set_status(halfway.name, state="interrupted")
    searcher = _script()._searcher(spec, search, ledger, sw.plan_search(spec, search, ledger))
    study = searcher.inner._ot_study
    assert sorted(t.value for t in study.trials) == [-900.0, -200.0]  # told: each at its last (or stopping) step
    first = searcher.suggest("a")["trial"]
    assert (first["name"], first["params"]) == (halfway.name, [["actor-lr", 1e-3], ["critics", 4]])
    new = searcher.suggest("b")["trial"]
    assert new["index"] == 3 and new["name"] == "Pendulum-v1__sac__t003__seed0"
    values = dict(new["params"])
    assert 1e-4 <= values["actor-lr"] <= 1e-2 and 2 <= values["critics"] <= 10
    assert ledger.recorded()[new["name"]]["params"] == values  # recorded as it starts
    assert ledger.status(new["name"])["state"] == "queued"
    assert searcher.suggest("c") == Searcher.FINISHED
    searcher.on_trial_result("b", {"step": 100, "return_mean": -400.0, "training_iteration": 1})
    searcher.on_trial_complete("b", {"step": 300, "return_mean": -100.0, "training_iteration": 2})
    searcher.on_trial_complete("a", {"step": 300, "return_mean": -50.0, "training_iteration": 1})
    assert sorted(t.value for t in study.trials) == [-900.0, -200.0, -100.0, -50.0]


@pytest.mark.slow
def test_a_relaunched_optuna_search_does_not_suggest_the_first_launchs_trials_again(tmp_path):
    """Optuna's first trials are random draws: a relaunch told of the finished trials draws anew."""
    pytest.importorskip("ray.tune")
    pytest.importorskip("optuna")
    script = _script()
    spec = _spec(
        {"mode": "optuna", "num_trials": 4, "space": {"actor-lr": SPACE["actor-lr"], "critics": SPACE["critics"]}}
    )
    search = sw.parse_search(spec)
    ledger = sw.Ledger(tmp_path / "s")
    first = script._searcher(spec, search, ledger, sw.plan_search(spec, search, ledger))
    names = [first.suggest(str(i))["trial"]["name"] for i in range(2)]
    for i, name in enumerate(names):
        _eval_csv(ledger.run_dir(name), [(300, 0, -100 * (i + 1), 0, "")])
        ledger.set_status(name, state="done")
    plan = sw.plan_search(spec, search, ledger)
    assert [t.name for t in plan.finished] == names and plan.new == 2
    again = script._searcher(spec, search, ledger, plan)
    told = [dict(t.params) for t in plan.finished]
    new = [dict(again.suggest(str(i))["trial"]["params"]) for i in range(2)]
    assert all(v not in told for v in new) and new[0] != new[1]
    same = script._searcher(spec, search, ledger, plan)  # the same history: the same continuation
    assert [dict(same.suggest(str(i))["trial"]["params"]) for i in range(2)] == new


class _Trial:
    def __init__(self, trial_id):
        self.trial_id, self.config = trial_id, {"trial": {"name": trial_id}}


@pytest.mark.slow
@pytest.mark.parametrize("stopping", ["asha", "median"])
def test_the_scheduler_stops_a_poor_trial_and_says_so(stopping):
    pytest.importorskip("ray.tune")
    from ray.tune.schedulers import TrialScheduler

    extra = {"reduction_factor": 2} if stopping == "asha" else {"min_trials": 1}
    search = sw.parse_search(_spec({"early_stopping": stopping, **extra}))
    stops = []
    scheduler = _script()._scheduler(
        search, 300, 100, lambda config, result: stops.append((config["trial"]["name"], result["step"]))
    )
    good, poor, early = _Trial("good"), _Trial("poor"), _Trial("early")
    for t in (good, poor, early):
        scheduler.on_trial_add(None, t)
    assert scheduler.on_trial_result(None, good, {"step": 100, "return_mean": -100.0}) == TrialScheduler.CONTINUE
    assert scheduler.on_trial_result(None, early, {"step": 0, "return_mean": -5000.0}) == TrialScheduler.CONTINUE
    assert scheduler.on_trial_result(None, poor, {"step": 100, "return_mean": -900.0}) == TrialScheduler.STOP
    assert stops == [("poor", 100)]


def test_the_sweep_waits_for_the_train_py_of_a_stopped_trial_to_end(tmp_path):
    """A trial stopped by Tune ends its actor first; its train.py finishes the iteration (with a
    checkpoint) on its own, and the sweep waits for it before it exits."""
    script = _script()
    ledger = sw.Ledger(tmp_path)
    (tmp_path / "status").mkdir()
    # named like a trial's process; it ends once a file appears (a fixed sleep raced a loaded machine, and
    # waiting for its stdin to close hung when another process of the worker held the pipe's write end)
    stop = tmp_path / "stop"
    child = subprocess.Popen(["bash", "-c", 'while [ ! -e "$0" ]; do sleep 0.05; done', str(stop), "train.py"])
    other = subprocess.Popen(["sleep", "30"])
    try:
        ledger.set_status("t", pid=child.pid, host=os.uname().nodename)
        assert script._alive(child.pid) and not script._alive(other.pid)  # not a train.py
        start = time.time()
        threading.Timer(1.0, stop.touch).start()
        script._wait_for_children(ledger, ["t"], timeout=60)
        assert 0.5 < time.time() - start < 30
        assert not script._alive(child.pid)  # ended (a zombie until this test reaps it)
    finally:
        for proc in (other, child):  # never left running, never waited on forever
            proc.kill()
            proc.wait(timeout=30)


def test_the_example_search_file_is_a_valid_search():
    spec = sw.make_spec(sw.read_spec(ROOT / "sweeps" / "search.toml"))
    search = sw.parse_search(spec)
    assert (search.mode, search.early_stopping, search.metric) == ("optuna", "asha", "return_mean")
    assert [r.name for r in search.space] == ["actor-lr", "critic-lr", "critics", "network.width"]


# ---- the command line ------------------------------------------------------------------------------------------


def _cli(args, env=None, **kw):
    env = dict(os.environ, RLZOO_DEBUG="0", **(env or {}))
    return subprocess.run(
        [sys.executable, str(SWEEP), *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT, **kw
    )


def _write(path: Path, search: dict, space: str, flags=TINY) -> Path:
    lines = ['agents = ["sac"]', 'envs = ["Pendulum-v1"]', "[flags]"]
    lines += [f'"{k}" = {json.dumps(v)}' for k, v in flags.items()]
    lines += ["[search]"] + [f"{k} = {json.dumps(v)}" for k, v in search.items()] + ["[search.space]", space]
    path.write_text("\n".join(lines) + "\n")
    return path


SEARCH = {"mode": "random", "num_trials": 2, "metric": "return_mean"}


@pytest.mark.parametrize(
    "search, space, args, message",
    [
        ({**SEARCH, "mode": "bayes"}, '"actor-lr" = [1e-4]', [], "unknown search mode 'bayes'"),
        (SEARCH, '"actor-lr" = { low = 1e-3, high = 1e-4 }', [], "low (0.001) must be below high (0.0001)"),
        ({k: v for k, v in SEARCH.items() if k != "metric"}, '"actor-lr" = [1e-4]', [], "search.metric is missing"),
        (SEARCH, '"actor-lr" = [1e-4]', ["--num-trials", "0"], "search.num_trials must be an integer >= 1, got 0"),
        (SEARCH, '"actor-lr" = [1e-4]', ["--search", "grid"], "unknown search mode 'grid'"),
        (SEARCH, '"actor-lr" = [1e-4]', ["--early-stopping", "hyperband"], "unknown search.early_stopping"),
    ],
)
def test_a_bad_search_is_one_error_line_and_creates_nothing(tmp_path, search, space, args, message):
    spec = _write(tmp_path / "s.toml", search, space)
    out = _cli([spec, "--dir", tmp_path / "sweep", *args])
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("error: ") == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_a_search_without_its_extra_says_how_to_install_it_and_creates_nothing(tmp_path):
    hidden = tmp_path / "hidden"  # pandas (which Ray Tune needs) and optuna, as if not installed
    for name in ("pandas", "optuna"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(f"raise ImportError('no module named {name} (hidden)')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])}
    for mode, needs in (("random", "Ray Tune, which is"), ("optuna", "Ray Tune and Optuna, which are")):
        spec = _write(tmp_path / f"{mode}.toml", {**SEARCH, "mode": mode}, '"actor-lr" = [1e-4]')
        out = _cli([spec, "--dir", tmp_path / "sweep"], env=env)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stderr.strip() == (
            f"error: search mode {mode!r} needs {needs} not installed: pip install -e '.[search]'"
        )
        assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_a_range_on_a_flag_train_py_lacks_is_one_error_line_naming_it(tmp_path):
    spec = _write(tmp_path / "s.toml", SEARCH, "critcs = { low = 2, high = 4 }")
    out = _cli([spec, "--dir", tmp_path / "sweep"])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert out.stderr.strip() == "error: search.space.critcs: train.py sac has no flag --critcs (perhaps --critics?)"
    assert not (tmp_path / "sweep").exists()
    out = _cli([spec, "--dir", tmp_path / "sweep", "--dry-run", "--grid", "tau=0.1,0.2"])
    assert out.returncode == 2 and "a search has no [grid]" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "space, message",
    [
        (
            {"critics": {"low": 1.5, "high": 4}},
            "search.space.critics: train.py sac refuses --critics 1.5: Error parsing "
            "--critics: invalid literal for int()",
        ),
        (
            {"plasticity.redo": [True, "yes"]},
            "search.space.plasticity.redo: train.py sac refuses --plasticity.redo yes: Unrecognized options: yes",
        ),
        ({"network.width": [16, "wide"]}, "search.space.network.width: train.py sac refuses --network.width wide: "),
    ],
)
def test_a_value_train_py_refuses_is_named_with_its_range(space, message):
    spec = _spec({"space": space})
    with pytest.raises(sw.SweepError) as e:
        sw.check_space(spec, sw.parse_search(spec))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    ok = _spec({"space": {"critics": {"low": 2, "high": 4}, "plasticity.redo": [True, False]}})
    sw.check_space(ok, sw.parse_search(ok))  # no error


# ---- end to end on a local Ray ------------------------------------------------------------------------------------


def _status(d: Path, name: str) -> dict:
    return json.loads((d / "status" / f"{name}.json").read_text())


def _steps(run_dir: Path) -> list[int]:
    with open(run_dir / "eval.csv", newline="") as f:
        return sorted({int(r["step"]) for r in csv.DictReader(f)})


# The stopping tests' runs go on for 500 steps after the stop at step 100 (about 3 s here): time for
# the trial to see the step-100 evaluation (run_trial polls eval.csv 4 times a second) and for Tune to
# decide before train.py finishes.  With 200 steps, the poor trial finished first once in a CI run.
STOPPABLE = {**TINY, "total-steps": 600}


def _stamps(d: Path) -> dict:
    return {p.name: (p / "eval.csv").stat().st_mtime_ns for p in (d / "runs").iterdir()}


@pytest.mark.slow
def test_a_random_search_runs_on_ray_tune_stops_a_poor_trial_by_median_and_a_relaunch_skips_both(tmp_path):
    pytest.importorskip("ray.tune")
    # seed 0 draws eval-episodes 3 for t000, then 1 for t001 (a spread of 0, below t000's)
    spec = _write(
        tmp_path / "s.toml",
        {
            "mode": "random",
            "num_trials": 2,
            "seed": 0,
            "metric": "return_std",
            "early_stopping": "median",
            "min_trials": 1,
        },
        '"eval-episodes" = [1, 3]\n"actor-lr" = { low = 1e-4, high = 1e-3, log = true }',
        STOPPABLE,
    )
    d = tmp_path / "sweep"
    out = _cli([spec, "--dir", d, "--num-cpus", "1"], timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "random search, 2 trials, 0 finished before, 2 to run" in out.stdout
    first, poor = "Pendulum-v1__sac__t000__seed0", "Pendulum-v1__sac__t001__seed0"
    recorded = json.loads((d / "sweep.json").read_text())["trials"]
    assert recorded[first]["params"]["eval-episodes"] == 3 and recorded[poor]["params"]["eval-episodes"] == 1
    assert 1e-4 <= recorded[poor]["params"]["actor-lr"] <= 1e-3
    assert _status(d, first)["state"] == "done" and _steps(d / "runs" / first)[-1] == 600
    cfg = json.loads((d / "runs" / poor / "config.json").read_text())
    assert (cfg["label"], cfg["eval_episodes"]) == ("t001", 1)
    assert cfg["agent"]["actor_lr"] == recorded[poor]["params"]["actor-lr"]
    s = _status(d, poor)
    assert (s["state"], s["stopped_by"], s["stopped_at"]) == ("stopped", "median", 100)
    assert json.loads((d / "runs" / poor / "stopped.json").read_text())["reason"].startswith("median stopping")
    assert "stopped t001 early at step 100 of 600" in out.stdout
    assert "1 stopped early by median: t001" in out.stdout and "best complete trial: t000" in out.stdout
    with open(d / "search.csv", newline="") as f:
        assert [(r["trial"], r["state"]) for r in csv.DictReader(f)] == [("t000", "done"), ("t001", "stopped")]
    stamps = _stamps(d)
    again = _cli([spec, "--dir", d, "--num-cpus", "1"], timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 finished before, 0 to run" in again.stdout and "Ray:" not in again.stdout
    assert _stamps(d) == stamps


@pytest.mark.slow
def test_an_optuna_search_with_asha_stops_a_poor_trial_and_a_relaunch_keeps_the_finished_ones(tmp_path):
    """(A relaunch that continues an optuna study, telling it the finished trials, is checked above on
    the searcher itself.)"""
    pytest.importorskip("ray.tune")
    pytest.importorskip("optuna")
    # Optuna's first trials are random draws from its seed: seed 0 gives eval-episodes 3, then 1
    search = {
        "mode": "optuna",
        "num_trials": 2,
        "seed": 0,
        "metric": "return_std",
        "early_stopping": "asha",
        "reduction_factor": 2,
        "grace_steps": 100,
    }
    spec = _write(
        tmp_path / "s.toml",
        search,
        '"eval-episodes" = [1, 3]\n"actor-lr" = { low = 1e-4, high = 1e-3, log = true }',
        STOPPABLE,
    )
    d = tmp_path / "sweep"
    out = _cli([spec, "--dir", d, "--num-cpus", "1"], timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "optuna search, 2 trials, 0 finished before, 2 to run" in out.stdout
    assert "early stopping: ASHA on return_std (max), rungs from step 100 by a factor 2 up to 600" in out.stdout
    recorded = json.loads((d / "sweep.json").read_text())["trials"]
    first, poor = "Pendulum-v1__sac__t000__seed0", "Pendulum-v1__sac__t001__seed0"
    assert [recorded[name]["params"]["eval-episodes"] for name in (first, poor)] == [3, 1]
    assert recorded[first]["params"]["actor-lr"] != recorded[poor]["params"]["actor-lr"]
    for name in (first, poor):
        assert 1e-4 <= recorded[name]["params"]["actor-lr"] <= 1e-3
        cfg = json.loads((d / "runs" / name / "config.json").read_text())
        assert cfg["agent"]["actor_lr"] == recorded[name]["params"]["actor-lr"]
    assert _status(d, first)["state"] == "done" and _steps(d / "runs" / first)[-1] == 600
    s = _status(d, poor)
    assert (s["state"], s["stopped_by"], s["stopped_at"]) == ("stopped", "asha", 100)
    assert "stopped t001 early at step 100 of 600" in out.stdout and "1 stopped early by asha: t001" in out.stdout
    assert "ASHA (reduction factor 2)" in json.loads((d / "runs" / poor / "stopped.json").read_text())["reason"]
    with open(d / "search.csv", newline="") as f:
        assert [(r["trial"], r["state"], r["stopped_by"]) for r in csv.DictReader(f)] == [
            ("t000", "done", ""),
            ("t001", "stopped", "asha"),
        ]
    stamps = _stamps(d)
    again = _cli([spec, "--dir", d, "--num-cpus", "1"], timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "optuna search, 2 trials, 2 finished before, 0 to run" in again.stdout and "Ray:" not in again.stdout
    assert _stamps(d) == stamps
