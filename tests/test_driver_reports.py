"""The driver / iteration contract (issue #46 item 2): an iteration's ``step`` returns a ``StepReport``
and the driver alone advances the step counter and does the host work from it."""

from __future__ import annotations

import csv
import types

import numpy as np
import pytest

from plasticity_zoo.training.driver import Driver, StepReport
from plasticity_zoo.training.loop import NonFiniteLossError, Schedule


def test_room_is_the_steps_to_the_nearest_log_evaluation_checkpoint_or_end():
    cfg = types.SimpleNamespace(eval_every=50, log_every=30, checkpoint_every=70)
    s = Schedule(cfg)  # next evaluation 0, log 30, checkpoint 70
    assert s.room(0, 1000) == 30  # the evaluation at 0 is not past step 0
    assert s.room(0, 20) == 20  # the loop's end comes first
    assert s.eval_due(0) and s.room(10, 1000) == 20  # evaluation next at 50, log at 30
    assert s.log_due(30) and s.room(30, 1000) == 20  # log next at 60, evaluation at 50
    assert s.room(65, 1000) == 5 and s.room(70, 70) == 0  # checkpoint at 70; nothing past 70 and no end


class _Scripted:
    """An iteration that replays ``reports`` (one per call) and records the ``at`` the driver passes."""

    def __init__(self, reports):
        self.reports, self.calls, self.state = list(reports), [], np.zeros(1)

    def fresh(self):
        pass

    def tree(self):
        return {"x": self.state}

    def host(self):
        return {}

    def eval_state(self):
        return self.state

    def step(self, at, room):
        self.calls.append(at)
        return self.reports.pop(0)


def _driver(cfg, tmp_path, events):
    """A driver whose plasticity events add 1 to the state and give a row naming their update counts."""

    def after_updates(before, after, state, data, key):
        events.append((before, after, data, key))
        return state + 1, [{"plasticity/at": float(after)}]

    hooks = types.SimpleNamespace(after_updates=after_updates, host_state=lambda: {}, restore=lambda h: None)
    agent = types.SimpleNamespace(act=lambda s, o, k, explore: o[..., :1])
    driver = Driver(cfg, agent, tmp_path, hooks, evaluator=None)
    driver.evaluate = lambda step, state: 0.0
    return driver


def _rows(tmp_path):
    return list(csv.DictReader(open(tmp_path / "metrics.csv")))


def test_the_driver_counts_steps_runs_events_and_logs_from_the_reports(tiny_sac_config, tmp_path):
    """Learning before the log row puts its events' columns in that row; ``learn_after_log`` (the
    on-policy host rollout) in the next; a report that is not ``whole`` continues the iteration."""
    cfg = tiny_sac_config(seeds=1, total_steps=6, log_every=2, eval_every=100, checkpoint_every=100)
    m = {"losses/x": np.array([1.5])}
    reports = [
        StepReport(2, 2, m, [[(3.0, 4)]], finite=True, stats=m, updates=(0, 5), data="d", key="k"),
        StepReport(2, 2, m, [[]], finite=True, stats=m, updates=(5, 9), learn_after_log=True, whole=False),
        StepReport(2, 2, None, [[(1.0, 2), (5.0, 6)]]),
    ]
    events: list = []
    driver, it = _driver(cfg, tmp_path, events), _Scripted(reports)
    driver.begin(it, resume=False)
    driver.run(it, 6, 6)
    assert it.calls == [0, 2, 4] and driver.step == 6
    assert events == [(0, 5, "d", "k"), (5, 9, None, None)] and it.state[0] == 2.0
    rows = _rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [2, 4, 6]
    assert [r["plasticity/at"] for r in rows] == ["5.0", "", "9.0"]  # the second event waits for the next row
    assert [r["charts/episodic_return"] for r in rows] == ["3.0", "", "3.0"]
    assert [r["losses/x"] for r in rows] == ["1.5", "1.5", ""]


@pytest.mark.parametrize("after_log, rows", [(False, 0), (True, 1)])
def test_a_non_finite_report_stops_the_run_naming_the_statistic(tiny_sac_config, tmp_path, after_log, rows):
    cfg = tiny_sac_config(seeds=1, total_steps=6, log_every=2, eval_every=100, checkpoint_every=100)
    bad = {"losses/x": np.array([np.nan]), "values/q": np.array([np.inf])}
    events: list = []
    driver = _driver(cfg, tmp_path, events)
    it = _Scripted([StepReport(2, 2, bad, finite=False, stats=bad, updates=(0, 1), learn_after_log=after_log)])
    driver.begin(it, resume=False)
    with pytest.raises(NonFiniteLossError, match="non-finite losses/x at env step 2; also non-finite: values/q"):
        driver.run(it, 6, 6)
    assert events == []  # no plasticity event after a non-finite update
    assert len(_rows(tmp_path)) == rows  # learning after the log row: that row was written first
