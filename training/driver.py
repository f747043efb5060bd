"""The one loop driver: everything a training run does around its iterations, written once.

Each kind of agent supplies an *iteration* (``training/loops/offpolicy.py``: one vector-env step;
``training/loops/onpolicy.py``: one rollout and its update, a vector step per call; ``training/loops/offline.py``:
one epoch; ``training/loops/device.py``: a chunk of iterations in one jitted call); the ``Driver`` owns the
rest: the run directory's logs, starting fresh or resuming from the last checkpoint, the evaluation /
log / checkpoint schedule, the step counter, the plasticity hooks' events and the rows they log, the
NaN stop, Ctrl-C / SIGTERM (checkpoint at the iteration's end), the progress bar and the final
evaluation.

An iteration object provides:

- ``fresh()``: set up a new run (reset envs, first actions); ``load(tree, host)``: continue from
  a checkpoint's device tree and host dict;
- ``tree()``: the device pytree a checkpoint stores (agent states, buffers, rng);
  ``host()``: the kind's own host-side state (envs, counters), merged into the checkpoint's dict;
- ``eval_state()``: the vmapped agent state to evaluate now; ``state``: the agent state the
  plasticity events read and replace (an attribute or property);
- ``step(at, room) -> StepReport``: advance from step ``at``, with ``room`` steps to the next host event
  (log row, evaluation, checkpoint or the loop's end; ``Schedule.room``: a device chunk ends there),
  and say what happened in a ``StepReport``.  It never calls the driver;
- optionally ``log_columns()``: per-seed extra columns of a log row, called only when one is written.

Per call the driver evaluates if due (before the call), then from the report: advances its step
counter and speed count, stops on a non-finite statistic, runs the plasticity events due in the
updates the call made, collects the finished episodes and writes a log row if due (the on-policy
host loop's update comes after its rollout's last row: ``StepReport.learn_after_log``).  Checkpoints and
Ctrl-C fall only where ``StepReport.whole`` says the iteration is whole.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from plasticity_zoo.training import checkpoint
from plasticity_zoo.training.config import RunConfig, to_json
from plasticity_zoo.training.evaluation import policy_maker
from plasticity_zoo.training.logger import RunLogger, task_results, wandb_settings
from plasticity_zoo.training.loop import (
    CompileNotices,
    Schedule,
    StopAtIterationEnd,
    finish,
    progress,
    raise_non_finite,
    restore,
)
from plasticity_zoo.training.provenance import provenance


class StepReport(NamedTuple):
    """What one ``iteration.step`` call did, for the driver's host work.

    ``steps``: the run's units per seed it advanced (env steps, or an offline run's updates); ``work``:
    the units of all seeds (the logged speed); ``metrics``: the per-seed arrays a log row at this step
    shows; ``episodes``: per seed, the training episodes that ended (``(return, length)`` each, or a
    device loop's ``(return sum, length sum, count)``), None for a loop without episodes; ``finite``:
    whether the statistics ``stats`` of this call's learning stayed finite (None: it did not learn);
    ``updates``: the update counts ``(before, after)`` of this call's learning, whose plasticity events
    run on samples of ``data`` with ``key`` (None: no updates); ``learn_after_log``: the learning comes
    after this step's log row (the on-policy host loop's rollout, whose rows show the last update's
    metrics); ``last_log``: a log row falls at this step or past it whatever the schedule; ``whole``:
    the iteration is whole after this call (a checkpoint or a stop may follow)."""

    steps: int
    work: int
    metrics: dict | None = None
    episodes: list | None = None
    finite: Any = None
    stats: dict | None = None
    updates: tuple[int, int] | None = None
    data: Any = None
    key: Any = None
    learn_after_log: bool = False
    last_log: int | None = None
    whole: bool = True


class Driver:
    """Time, logs, checkpoints and plasticity events of one run (N vmapped seeds).

    ``unit``: what ``--total-steps`` counts ("env step" or "update"); ``speed_key``: the metric
    the speed is logged as (``perf/sps`` counts env steps of all seeds per second);
    ``episodes``: whether the run has training episodes to log (online agents).
    ``eval_extras(returns) -> list[dict]``: per-seed extra evaluation columns (e.g. normalised
    scores); ``on_eval(step, state, returns)``: called right after each evaluation.
    """

    def __init__(
        self,
        cfg: RunConfig,
        agent,
        run_dir,
        hooks,
        evaluator,
        *,
        unit: str = "env step",
        speed_key: str = "perf/sps",
        episodes: bool = True,
        eval_extras=None,
        on_eval=None,
    ):
        self.cfg, self.run_dir, self.hooks, self.evaluator = cfg, Path(run_dir), hooks, evaluator
        self.unit, self.speed_key, self.eval_extras, self.on_eval = unit, speed_key, eval_extras, on_eval
        self.seeds = cfg.seeds
        self.tasks = getattr(evaluator, "tasks", None)  # an mt: env's member ids: eval.csv gets per-task rows
        self.logger = RunLogger(run_dir, cfg.tensorboard, multitask=self.tasks is not None, wandb=wandb_settings(cfg))
        self.eval_policy = policy_maker(agent)  # vmapped agent state -> the deterministic policy
        self.step, self.pending = 0, None
        self.schedule: Schedule  # set by begin(), from the step the run starts at
        self.episode_log: list[list] | None = [[] for _ in range(cfg.seeds)] if episodes else None
        self.last_eval, self.last_return = math.nan, math.nan
        self._count, self._t_log, self._step_log = 0, time.perf_counter(), 0

    # ------------------------------------------------------------------------- start and resume
    def begin(self, iteration, resume: bool, on_fresh=None):
        """Start a new run (config.json, ``iteration.fresh()``, ``on_fresh()``) or resume the last checkpoint."""
        host = None
        if resume:
            tree, host, _ = restore(
                self.run_dir, iteration.tree(), self.logger, unit="update" if self.unit == "update" else "step"
            )
            iteration.load(tree, host)
            self.step, self.pending = host["step"], host.get("pending")
            if self.episode_log is not None:
                self.episode_log = host["episode_log"]
            self.hooks.restore(host["plasticity"])
            self.logger.record_resume(to_json(self.cfg), self.step, provenance())
        else:
            self.logger.write_config(to_json(self.cfg), provenance())
            if on_fresh is not None:
                on_fresh()
            iteration.fresh()
        self.schedule = Schedule(self.cfg, self.step, host)
        return host

    # ------------------------------------------------------------------------- host work around a step
    def evaluate(self, step: int, state) -> float:
        returns = self.evaluator(self.eval_policy(state))
        extras = None if self.eval_extras is None else self.eval_extras(returns)
        if self.tasks is None:
            if extras is None:
                self.logger.log_eval(step, returns)
            else:
                self.logger.log_eval(step, returns, extras)
            self.last_eval = float(np.mean(returns))
        else:  # per-task rows; the run's figure is the aggregate: the mean over tasks of the per-task means
            self.logger.log_eval(step, returns, extras, tasks=self.tasks)
            self.last_eval = float(np.mean([task_results(r, self.tasks)[-1]["return_mean"] for r in returns]))
        if self.on_eval is not None:
            self.on_eval(step, state, returns)
        bar = getattr(self, "bar", None)  # set by run(); shows the evaluation now, not at the next log row
        if bar is not None:
            bar(step, ev=self.last_eval)
        return self.last_eval

    def evaluate_if_due(self, step: int, state_fn):
        """Evaluate ``state_fn()`` if an evaluation falls at ``step``."""
        if self.schedule.eval_due(step):
            self.evaluate(step, state_fn())

    def record(self, iteration, report: StepReport):
        """The host work of one ``iteration.step`` call, from its report: the step counter and speed
        count, the NaN stop, the plasticity events, the finished episodes and the log row (if due)."""
        self.step += report.steps
        self.advance(report.work)
        if not report.learn_after_log:
            self._learned(iteration, report)
        if report.episodes is not None and self.episode_log is not None:
            for log, finished in zip(self.episode_log, report.episodes):
                log.extend(finished)
        self.log_if_due(self.step, report.metrics, getattr(iteration, "log_columns", None), last=report.last_log)
        if report.learn_after_log:
            self._learned(iteration, report)

    def _learned(self, iteration, report: StepReport):
        """Stop on a non-finite statistic (naming it and the last good checkpoint), then run the
        plasticity events due in the call's updates on ``iteration.state``."""
        if report.finite is not None and not bool(report.finite):
            raise_non_finite(report.stats or {}, self.step, self.run_dir, unit=self.unit)
        if report.updates is not None:
            before, after = report.updates
            iteration.state = self.plasticity(before, after, iteration.state, report.data, report.key)

    def plasticity(self, before: int, after: int, state, data, key):
        """The plasticity events due between update counts ``before`` and ``after`` -> state.

        Their per-seed rows wait in ``pending`` for the next log row (none is dropped)."""
        state, rows = self.hooks.after_updates(before, after, state, data, key)
        if rows is not None:
            self.pending = rows if self.pending is None else [{**p, **r} for p, r in zip(self.pending, rows)]
        return state

    def advance(self, n: int):
        """Count ``n`` units of work (env steps of all seeds, or updates) for the logged speed."""
        self._count += n

    def log_if_due(self, step: int, metrics: dict | None, extra=None, last: int | None = None) -> bool:
        """Write one metrics row per seed if a log falls at ``step`` (or ``step`` reaches ``last``).

        A row holds the speed, ``extra()``'s per-seed dicts (called only when a row is written), the
        training episodes' mean return and length since the last row, ``metrics`` (per-seed arrays)
        and the plasticity rows pending since the last row."""
        if not self.schedule.log_due(step, last):
            return False
        elapsed = time.perf_counter() - self._t_log
        speed = self._count / elapsed
        rate = (step - self._step_log) / elapsed  # the bar's count (one seed's steps or updates) per second
        extras = extra() if extra is not None else None
        rows = []
        for j in range(self.seeds):
            row = {self.speed_key: speed, **(extras[j] if extras is not None else {})}
            if self.episode_log is not None and self.episode_log[j]:
                row["charts/episodic_return"], row["charts/episode_length"] = _means(self.episode_log[j])
            if metrics is not None:
                row.update({k: float(v[j]) for k, v in metrics.items()})
            if self.pending is not None:
                row.update(self.pending[j])
            rows.append(row)
        self.pending = None
        if self.episode_log is not None:
            recent = [e for log in self.episode_log for e in log]
            self.last_return = float(_means(recent)[0]) if recent else self.last_return
            self.episode_log = [[] for _ in range(self.seeds)]
        else:
            self.last_return = self.last_eval
        self.logger.log_metrics(step, rows)
        self.bar(step, rate, self.last_return, self.last_eval)
        self._count, self._t_log, self._step_log = 0, time.perf_counter(), step
        return True

    # ------------------------------------------------------------------------- the loop
    def save(self, iteration, step: int) -> Path:
        host = {
            "step": step,
            **self.schedule.host(),
            "plasticity": self.hooks.host_state(),
            "pending": self.pending,
            **({"episode_log": self.episode_log} if self.episode_log is not None else {}),
            **iteration.host(),
        }
        return checkpoint.save(
            self.run_dir, step, iteration.tree(), host, {"config": to_json(self.cfg)}, keep=self.cfg.keep_checkpoints
        )

    def run(self, iteration, end: int, last: int) -> float:
        """Iterate until ``step >= end`` (``last``: the run's final step, for the final evaluation)
        with checkpoints on schedule and at interruptions; returns the last evaluation's mean return."""
        self.end, self.bar = end, progress(self.cfg, self.step, "update" if self.unit == "update" else "step")
        self._t_log, self._step_log = time.perf_counter(), self.step
        save = lambda step: self.save(iteration, step)  # noqa: E731
        import jax

        with (
            CompileNotices(self.bar, lambda: self.step, jax.config.values["jax_compilation_cache_dir"]),
            StopAtIterationEnd(save, self.run_dir, self.bar, self.logger, self.step) as stop,
        ):
            while self.step < end:
                stop.begin()
                whole = False
                while not whole:  # one call, or (an on-policy host rollout) one per vector step
                    self.evaluate_if_due(self.step, iteration.eval_state)
                    report = iteration.step(self.step, self.schedule.room(self.step, end))
                    self.record(iteration, report)
                    whole = report.whole
                if self.schedule.checkpoint_due(self.step, end):
                    save(self.step)
                stop.end(self.step)
        return finish(
            self.schedule,
            self.step,
            last,
            lambda step: self.evaluate(step, iteration.eval_state()),
            self.last_eval,
            self.bar,
            self.logger,
        )


def _means(entries) -> tuple[float, float]:
    """Mean return and length over episode-log entries: ``(return, length)`` for one episode,
    ``(return sum, length sum, count)`` for a device loop's totals (each episode weighted once)."""
    if all(len(e) == 2 for e in entries):
        return np.mean([e[0] for e in entries]), np.mean([e[1] for e in entries])
    count = sum(e[2] if len(e) == 3 else 1 for e in entries)
    return sum(e[0] for e in entries) / count, sum(e[1] for e in entries) / count
