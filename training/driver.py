"""The one loop driver: everything a training run does around its iterations, written once.

Each kind of agent supplies an *iteration* (``training/offpolicy.py``: one vector-env step;
``training/onpolicy.py``: one rollout and its update; ``training/offline.py``: one epoch); the
``Driver`` owns the rest: the run directory's logs, starting fresh or resuming from the last
checkpoint, the evaluation / log / checkpoint schedule, the plasticity hooks' events and the rows
they log, the NaN stop, Ctrl-C / SIGTERM (checkpoint at the iteration's end), the progress bar
and the final evaluation.

An iteration object provides:

- ``fresh()``: set up a new run (reset envs, first actions); ``load(tree, host)``: continue from
  a checkpoint's device tree and host dict;
- ``tree()``: the device pytree a checkpoint stores (agent states, buffers, rng);
  ``host()``: the kind's own host-side state (envs, counters), merged into the checkpoint's dict;
- ``eval_state()``: the vmapped agent state to evaluate now;
- ``run_one(driver)``: one iteration.  It advances ``driver.step`` and calls back, in its own
  order: ``driver.evaluate_if_due(step, state_fn)`` where an evaluation may fall,
  ``driver.stop_if_non_finite`` on the learning step's flag, ``driver.plasticity(...)`` after
  updates, ``driver.episodes(env, E)`` after env steps, ``driver.advance(n)`` for the speed
  counter, and ``driver.log_if_due(step, metrics, extra)`` where a log row may fall.

Host work (logs, evaluation, checkpoints) happens only at those points, so an iteration whose
whole body runs on the device (a later, accelerator-side env) fits the same driver.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

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

    # ------------------------------------------------------------------------- within an iteration
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

    def stop_if_non_finite(self, finite, metrics: dict, step: int):
        """Stop the run naming the non-finite statistics and the last good checkpoint."""
        if not bool(finite):
            raise_non_finite(metrics, step, self.run_dir, unit=self.unit)

    def plasticity(self, before: int, after: int, state, data, key):
        """The plasticity events due between update counts ``before`` and ``after`` -> state.

        Their per-seed rows wait in ``pending`` for the next log row (none is dropped)."""
        state, rows = self.hooks.after_updates(before, after, state, data, key)
        if rows is not None:
            self.pending = rows if self.pending is None else [{**p, **r} for p, r in zip(self.pending, rows)]
        return state

    def episodes(self, env, envs_per_seed: int):
        """Collect the finished training episodes of a vector env of ``seeds x envs_per_seed`` envs."""
        assert self.episode_log is not None, "a loop that counts episodes itself has no episode log"
        for i, ret, length in env.pop_finished():
            self.episode_log[i // envs_per_seed].append((ret, length))

    def episode_totals(self, return_sums, length_sums, counts):
        """Per seed, the summed returns and lengths of ``counts`` finished episodes (a device loop's
        totals since it last reported); the next log row shows their means with every episode
        weighted once."""
        for j, (r, n, c) in enumerate(zip(np.asarray(return_sums), np.asarray(length_sums), np.asarray(counts))):
            if c > 0 and self.episode_log is not None:
                self.episode_log[j].append((float(r), float(n), int(c)))

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
                iteration.run_one(self)
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
