"""Machinery every training loop shares: argument checks, the evaluate / log / checkpoint
cadence, resuming from the last checkpoint, NaN stops, Ctrl-C / SIGTERM and the progress bar.

The loops (``training/loops/``: ``offpolicy``, ``onpolicy``, ``offline``, ``device``) count time in
their own unit (env steps per seed, or gradient updates); everything here works in that unit.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from plasticity_zoo.training import checkpoint


class RunTree(NamedTuple):
    """The device arrays a host loop checkpoints: the agent states (a leading seed axis), the loop's data
    (replay buffer, rollout, or an offline run's model buffers) and the run key.  Checkpoint arrays are
    named by their path in it (``agent/critic_params/...``, ``data/...``, ``key``)."""

    agent: Any
    data: Any
    key: Any


def finished_episodes(env, seeds: int, envs_per_seed: int) -> list[list]:
    """Per seed, ``(return, length)`` of the training episodes a host vector env of ``seeds x
    envs_per_seed`` envs finished since it was last asked (``env.pop_finished()``)."""
    out: list[list] = [[] for _ in range(seeds)]
    for i, ret, length in env.pop_finished():
        out[i // envs_per_seed].append((ret, length))
    return out


class NonFiniteLossError(RuntimeError):
    """A loss or training statistic became NaN/inf; the run stops and keeps its last checkpoint."""


def check_positive(**values: int):
    """Raise a ValueError naming the flag of the first value below 1 (``total_steps`` -> ``--total-steps``)."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def agent_config(agent, cfg):
    """The agent's config as ``agent.init`` takes it: bound to the env's task layout
    (``envs.multitask.TaskSpec``, None for a single-task env id) where the agent declares
    ``with_tasks`` (multitask agents, ``agents.api.TaskConditionedAgent``)."""
    if not hasattr(agent, "with_tasks"):
        return cfg.agent
    from plasticity_zoo.envs.multitask import is_multitask, task_spec

    spec = task_spec(cfg.env, cfg.action_repeat) if is_multitask(cfg.env) else None
    return agent.with_tasks(cfg.agent, spec)


def run_counts(cfg) -> dict:
    """The RunConfig counts every loop needs to be positive."""
    return {
        name: getattr(cfg, name)
        for name in (
            "seeds",
            "num_envs",
            "total_steps",
            "eval_every",
            "log_every",
            "checkpoint_every",
            "eval_episodes",
            "keep_checkpoints",
        )
    }


def env_resolve(cfg, agent):
    """``resolve`` of a loop whose envs come from ``--env`` (``training/loops/__init__.py``): the config
    as given, and the observation and action sizes of its env, built once and closed (an unknown or
    malformed env id fails here)."""
    from plasticity_zoo.envs import make_env

    env = make_env(cfg.env, 0, cfg.action_repeat, env_impl=cfg.env_impl)
    try:
        return cfg, int(np.prod(env.observation_space.shape)), int(np.prod(env.action_space.shape))
    finally:
        env.close()


class Schedule:
    """When to evaluate, log and checkpoint.

    Evaluations and log rows fall on the grids ``0, eval_every, ...`` and ``log_every, 2 log_every, ...``
    (at the first loop step at or past each point); checkpoints at the first step past each
    multiple of ``checkpoint_every`` and at the end.  An iteration that steps past several points of
    a grid (a device-loop iteration of 2048 envs x 30 steps is 61,440 steps) gets one evaluation or
    log row, and the schedule moves past all of them (``_next``), as it always did for checkpoints;
    where iterations are shorter than the intervals nothing changes.  ``host()`` is what a
    checkpoint stores, and ``Schedule(cfg, step, host)`` continues from it.
    """

    def __init__(self, cfg, step: int = 0, host: dict | None = None):
        self.eval_every, self.log_every, self.checkpoint_every = cfg.eval_every, cfg.log_every, cfg.checkpoint_every
        self.next_eval = host["next_eval"] if host else 0
        self.next_log = host["next_log"] if host else cfg.log_every
        self.next_ckpt = (step // cfg.checkpoint_every + 1) * cfg.checkpoint_every

    @staticmethod
    def _next(point: int, every: int, step: int) -> int:
        """The grid's next point after ``point`` that lies past ``step`` (``point + every`` unless the
        loop stepped past more than one point at once)."""
        return max(point + every, (step // every + 1) * every)

    def eval_due(self, step: int) -> bool:
        if step < self.next_eval:
            return False
        self.next_eval = self._next(self.next_eval, self.eval_every, step)
        return True

    def log_due(self, step: int, last: int | None = None) -> bool:
        """Due at each ``log_every`` point, and at ``last`` if given (the run's final step)."""
        if step < self.next_log and (last is None or step < last):
            return False
        if step >= self.next_log:
            self.next_log = self._next(self.next_log, self.log_every, step)
        return True

    def checkpoint_due(self, step: int, end: int) -> bool:
        if step < self.next_ckpt and step < end:
            return False
        self.next_ckpt = (step // self.checkpoint_every + 1) * self.checkpoint_every
        return True

    def room(self, step: int, end: int) -> int:
        """Steps from ``step`` to the next host event: log row, evaluation, checkpoint or ``end`` (0 if
        none lies past ``step``).  The device loop ends its chunks there (``training/loops/device.py``)."""
        return min((t - step for t in (self.next_log, self.next_eval, self.next_ckpt, end) if t > step), default=0)

    def final_eval_due(self, step: int, last: int) -> bool:
        """After the loop: evaluate the finished agent unless an evaluation already ran at this step."""
        return step >= last and self.next_eval - self.eval_every < step

    def host(self) -> dict:
        return {"next_eval": self.next_eval, "next_log": self.next_log}


def restore(run_dir, template, logger, unit: str = "step"):
    """Load the newest intact checkpoint of ``run_dir`` (``checkpoint.load_latest``) into ``template``'s
    structure, and cut the logs back to it.

    Metric rows after the checkpoint are dropped, and so are evaluation rows the resumed run will
    redo (those at or past the checkpoint's next evaluation: a finished run's final evaluation is
    redone when the run is extended, not written twice).  Returns ``(tree, host, path)``.
    """
    if checkpoint.latest(run_dir) is None:
        raise SystemExit(f"--resume {run_dir}: no checkpoint found in {run_dir}/ckpt")
    tree, host, _, path = checkpoint.load_latest(run_dir, template)  # verified; skips damaged ones, saying so
    logger.truncate_after(host["step"], evals_before=host["next_eval"])
    print(f"resumed {run_dir} at {unit} {host['step']} from {path.name}")
    return tree, host, path


def finish(schedule: Schedule, step: int, last: int, evaluate, last_eval: float, bar, logger) -> float:
    """End of a loop: the final evaluation (if due), close the bar (showing that evaluation) and the
    logs; the last eval return."""
    if schedule.final_eval_due(step, last):
        last_eval = evaluate(step)
    bar(step, ev=last_eval)
    bar(None)
    logger.close()
    return last_eval


class StopSignals:
    """SIGINT / SIGTERM while a loop runs: finish the iteration, checkpoint there, then stop.

    A signal only records itself (``requested``); the loop calls ``check()`` at the end of each
    iteration, where its state is consistent, and that raises KeyboardInterrupt so that the Ctrl-C
    path (``report_interrupt``) writes the checkpoint.  A job scheduler's SIGTERM or a first Ctrl-C
    therefore loses no finished work; a second SIGINT stops at once, keeping the last periodic
    checkpoint.  ``install()`` works in the main thread only (elsewhere it does nothing);
    ``restore()`` puts the previous handlers back.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    @classmethod
    def install(cls) -> "StopSignals":
        stop = cls()
        if threading.current_thread() is threading.main_thread():
            stop._previous = {s: signal.signal(s, stop._handle) for s in cls.SIGNALS}
        return stop

    def restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt(name)  # the second Ctrl-C: stop now
        if self.requested is None:
            print(
                f"\n{name}: stopping at the end of this iteration with a checkpoint "
                "(Ctrl-C again to stop now, keeping the last periodic checkpoint)",
                flush=True,
            )
        self.requested = name

    def check(self):
        """At an iteration boundary: raise KeyboardInterrupt(signal name) if a stop was requested."""
        if self.requested is not None:
            raise KeyboardInterrupt(self.requested)


class StopAtIterationEnd:
    """A loop's interrupt handling in one place: ``with StopAtIterationEnd(save, run_dir, bar, logger, step) as stop``
    around the loop, ``stop.begin()`` when an iteration starts changing state and ``stop.end(step)``
    when it is whole again (after any periodic checkpoint).

    Inside, SIGINT / SIGTERM only record themselves (``StopSignals``); ``end`` then stops the loop
    with KeyboardInterrupt.  On any KeyboardInterrupt out of the block (a deferred signal, or a
    second Ctrl-C mid-iteration) the loop's state is checkpointed if it sits between iterations
    (reusing a periodic checkpoint written at that step), the progress bar and logs are closed and
    the resume command is printed; the interrupt then propagates (scripts/train.py exits 130 / 143).
    """

    def __init__(self, save, run_dir, bar, logger, step: int):
        self.save, self.run_dir, self.bar, self.logger = save, run_dir, bar, logger
        self.step, self.consistent = step, True
        self.signals: StopSignals  # installed by __enter__

    def __enter__(self) -> "StopAtIterationEnd":
        self.signals = StopSignals.install()
        return self

    def begin(self):
        self.consistent = False  # half an iteration done: an interrupt now must not checkpoint

    def end(self, step: int):
        self.step, self.consistent = step, True
        self.signals.check()

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                report_interrupt(self.consistent, self.save, self.step, self.run_dir, self.bar, self.logger)
        finally:
            self.signals.restore()  # after the checkpoint: a SIGTERM during it is still deferred
        return False


def report_interrupt(consistent: bool, save, step: int, run_dir, bar, logger):
    """On Ctrl-C: checkpoint if the loop sits between iterations, close the logs, say how to resume."""
    here, latest = checkpoint.path_for(run_dir, step), checkpoint.latest(run_dir)
    where: str | None
    if consistent and latest == here:
        where = f"the checkpoint at step {step} is {here}"  # just written by the periodic save
    elif consistent:
        try:
            where = f"saved a checkpoint at step {step} ({save(step)})"
        except KeyboardInterrupt:  # a second Ctrl-C during that save: stop now (the save is atomic)
            latest = checkpoint.latest(run_dir)
            where = f"stopped during the checkpoint at step {step}; the last checkpoint is {latest}" if latest else None
    elif latest is not None:
        where = f"the last checkpoint is {latest}"
    else:
        where = None
    bar(None)
    logger.close()
    if where is None:
        print(
            f"\ninterrupted before the first checkpoint of {run_dir}: nothing to resume; start the run again "
            "with --overwrite (its files move aside) or in another --run-dir"
        )
    else:
        print(f"\ninterrupted; {where}; continue with: python scripts/train.py --resume {run_dir}")


def raise_non_finite(metrics, step, run_dir, unit: str = "env step"):
    """Stop the run naming the non-finite losses (``losses/*``) first, then the other non-finite
    statistics (each group by name), the step and the last good checkpoint.

    A diverged loss makes statistics computed from the same networks non-finite too (e.g.
    ``values/q_std_random``); the losses say where to look.  Losses that went non-finite in the
    same update (SAC's actor right after its critic) cannot be told apart: all are listed."""
    bad = sorted(k for k, v in metrics.items() if not np.all(np.isfinite(np.asarray(v))))
    bad = [k for k in bad if k.startswith("losses/")] + [k for k in bad if not k.startswith("losses/")]
    last = checkpoint.latest(run_dir)
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    also = f"also non-finite: {', '.join(bad[1:])}; " if len(bad) > 1 else ""
    raise NonFiniteLossError(f"non-finite {bad[0] if bad else 'loss'} at {unit} {step}; {also}training stopped, {kept}")


# tqdm's default format, without its own rate (an average of its updates) and the time left drawn from it
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def progress(cfg, start: int, unit: str = "step"):
    """A tqdm bar over ``cfg.total_steps`` (a no-op with ``--no-progress``); call ``bar(None)`` to close.

    The bar counts what ``--total-steps`` counts (one seed's env steps, or ``unit`` "update": an offline
    run's updates) and shows one rate, that count's: ``bar(step, rate=...)`` with the units per second
    since the last log row (``Driver.log_if_due``), and the time left at that rate.  (``perf/sps`` in
    metrics.csv counts the env steps of all seeds.)  ``bar(step, status="compiling")`` shows a status
    beside the numbers at once (``status=""`` clears it); ``bar.write(line)`` prints a line above the
    bar (``print`` without one)."""
    if not cfg.progress:

        def quiet(*a, **k):
            return None

        setattr(quiet, "write", print)  # noqa: B010  (the bar's line printer)
        return quiet
    from tqdm import tqdm

    bar = tqdm(
        total=cfg.total_steps, initial=start, unit=unit, dynamic_ncols=True, mininterval=1.0, bar_format=BAR_FORMAT
    )
    pos, shown = [start], {}

    def update(step, rate=None, ret=None, ev=None, status=None):
        """Move to ``step``; the values not given keep what the bar shows (``finish`` sets the last eval)."""
        if step is None:
            bar.close()
            return
        bar.update(step - pos[0])
        pos[0] = step
        if rate is not None:
            shown["rate"] = f"{rate:,.0f} {unit}s/s"
            left = max(cfg.total_steps - step, 0) / rate if rate > 0 else None
            shown["left"] = f"{tqdm.format_interval(left)} left" if left is not None else "? left"
        for key, value in (("return", ret), ("eval", ev)):
            if value is not None:
                shown[key] = f"{key}={value:.1f}"
        if status is not None:
            shown.pop("status", None)
            if status:
                shown["status"] = status
        bar.set_postfix_str(
            ", ".join(shown[k] for k in ("rate", "left", "return", "eval", "status") if k in shown),
            refresh=status is not None,
        )

    setattr(update, "write", tqdm.write)  # noqa: B010
    return update


COMPILE_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"  # JAX: a program goes to the cache / XLA
COMPILE_DONE = "/jax/core/compile/backend_compile_duration"  # JAX: compiled or loaded, with its time
CACHE_HIT = "/jax/compilation_cache/cache_hits"
SAY_COMPILES_FROM_SECS = 2.0


class CompileNotices:
    """What a run waits on while XLA compiles: the bar reads "compiling" from the moment a program is sent
    to the persistent cache / XLA (JAX's monitoring events; with the cache off only the lines below), and
    each program that took ``SAY_COMPILES_FROM_SECS`` or more is reported as it finishes: ``compiled
    jit(learn_and_act) in 41.2 s`` or ``loaded jit(learn_and_act) from the compilation cache in 0.9 s``.
    A context manager: the listeners are JAX's process-wide ones and go when the run ends."""

    def __init__(self, bar, step_fn, cache_dir: str | None = None):
        self.bar, self.step_fn, self.cache_dir, self.hits = bar, step_fn, cache_dir, 0
        self.compiles: list[tuple[str, float, bool]] = []  # (program, seconds, from the cache)

    def _request(self, event, **kw):
        if event == COMPILE_REQUEST:
            self.bar(self.step_fn(), status="compiling")
        elif event == CACHE_HIT:
            self.hits += 1

    def _done(self, event, secs, **kw):
        if event != COMPILE_DONE:
            return
        hit, self.hits = self.hits > 0, 0
        self.compiles.append((kw.get("fun_name", "a program"), secs, hit))
        self.bar(self.step_fn(), status="")
        if secs >= SAY_COMPILES_FROM_SECS:
            name = kw.get("fun_name", "a program")
            where = ""
            if not hit and self.cache_dir and not any(s >= SAY_COMPILES_FROM_SECS for _, s, h in self.compiles[:-1]):
                where = f" (kept in {self.cache_dir}: later runs load it)"
            self.bar.write(
                f"loaded {name} from the compilation cache in {secs:.1f} s"
                if hit
                else f"compiled {name} in {secs:.1f} s{where}"
            )

    def __enter__(self):
        import jax.monitoring as monitoring

        monitoring.register_event_listener(self._request)
        monitoring.register_event_duration_secs_listener(self._done)
        return self

    def __exit__(self, *exc):
        import jax.monitoring as monitoring

        monitoring.unregister_event_listener(self._request)
        monitoring.unregister_event_duration_listener(self._done)
        return False


def default_run_dir(cfg) -> Path:
    """``runs/<env>__<agent>__<seed>__<time>``."""
    import time

    env = cfg.env.replace(":", "_").replace("/", "_")
    return Path("runs") / f"{env}__{cfg.agent_name}__{cfg.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
