"""Run a grid of train.py runs on Ray:  python scripts/sweep.py SPEC.toml --dir SWEEP_DIR [options]

    python scripts/sweep.py sweeps/plasticity.toml --dir sweeps/plasticity          # local Ray, all CPUs/GPUs
    python scripts/sweep.py --dir sweeps/quick --agents sac --envs Pendulum-v1 \\
        --flag total-steps=5000 --variant none --variant redo:preset=redo-sokar --seeds 3
    python scripts/sweep.py sweeps/plasticity.toml --dir /shared/sweeps/p --address auto   # join a Ray cluster
    python scripts/report.py sweeps/plasticity --out sweeps/plasticity/report               # the figures and tables
    python scripts/sweep.py sweeps/search.toml --dir sweeps/search          # a search (random / optuna) over ranges

The sweep file's keys are described in training/sweep.py; the flags below set or override them.
Each trial is `train.py` in SWEEP_DIR/runs/<trial>/, its output in SWEEP_DIR/logs/<trial>.log.
Running the same command again skips finished trials and resumes interrupted ones from their
last checkpoint; a failed trial is retried (`retries`) and then reported with the end of its log.
Ctrl-C (or SIGTERM) stops the running trials at the end of their current iteration with a
checkpoint; run the command again to continue.  Exit status: 0 when every trial finished, 1 when
some failed, 2 for a mistaken sweep (nothing is created or started), 130 when interrupted.

A sweep file with a [search] table draws its trials from ranges instead (random, or Optuna's TPE
through Ray Tune's OptunaSearch), each trial's evaluations reported to Ray Tune as they appear so
that ASHA or median stopping can stop poor trials early (training/sweep.py, docs/sweeps.md); the
flags --search, --num-trials, --metric and --early-stopping set or override its keys.  Its table
(SWEEP/search.csv) lists the trials best first, those stopped early marked.

Needs Ray: pip install -e '.[sweep]'; a search needs Ray Tune (and Optuna): pip install -e '.[search]'.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

try:
    from plasticity_zoo import training  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plasticity_zoo.training import sweep as sw

TRAIN = Path(__file__).resolve().parent / "train.py"
REPORT = Path(__file__).resolve().parent / "report.py"


def _value(text: str):
    """A flag value written on the command line, read as TOML would: true/false, numbers, else a string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _pairs(items, what) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise sw.SweepError(f"{what} {item!r}: write NAME=VALUE")
        key, value = item.split("=", 1)
        out[key] = value
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="sweep.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("spec", nargs="?", help="a TOML sweep file (optional when the flags below say everything)")
    p.add_argument("--dir", required=True, help="the sweep directory (created; re-use it to continue the sweep)")
    p.add_argument("--agents", nargs="+")
    p.add_argument("--envs", nargs="+")
    p.add_argument("--seeds", type=int, help="seeds per (agent, env, variant)")
    p.add_argument("--seeds-per-trial", type=int, help="seeds vmapped in one trial (default: all)")
    p.add_argument("--retries", type=int, help="tries after a trial's first failure (default 1)")
    p.add_argument("--cpus-per-trial", type=float)
    p.add_argument("--gpus-per-trial", type=float, help="e.g. 0.25: four trials share a GPU")
    p.add_argument("--flag", action="append", metavar="NAME=VALUE", help="a train.py flag for every trial")
    p.add_argument(
        "--grid",
        action="append",
        metavar="NAME=V1,V2",
        help="a train.py flag crossed over its values, e.g. plasticity.redo=false,true",
    )
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME[:FLAG=VALUE,...]",
        help="a named variant and its flags, e.g. redo:preset=redo-sokar or none",
    )
    p.add_argument("--search", metavar="MODE", help="random or optuna: a search over the file's [search.space] ranges")
    p.add_argument("--num-trials", type=int, help="a search's number of trials")
    p.add_argument("--metric", help="the eval.csv column a search optimises and stops early on (e.g. return_mean)")
    p.add_argument("--early-stopping", metavar="RULE", help="a search's early stopping: none, asha or median")
    p.add_argument(
        "--address",
        help="join this Ray cluster (e.g. auto, or ray://HOST:10001); default: start a local Ray on this machine",
    )
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: all)")
    p.add_argument("--num-gpus", type=int, help="GPUs of the local Ray (default: those Ray detects)")
    p.add_argument("--max-concurrent", type=int, help="at most this many trials at once")
    p.add_argument("--refresh", type=float, default=10.0, help="seconds between live-table refreshes")
    p.add_argument("--report", action="store_true", help="run scripts/report.py on the sweep when it finishes")
    p.add_argument("--dry-run", action="store_true", help="check and list the trials, run nothing")
    return p.parse_args(argv)


def build_spec(args) -> dict:
    d = sw.read_spec(args.spec) if args.spec else {}
    for key in ("agents", "envs", "seeds", "seeds_per_trial", "retries", "cpus_per_trial", "gpus_per_trial"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    if args.flag:
        d["flags"] = {**d.get("flags", {}), **{k: _value(v) for k, v in _pairs(args.flag, "--flag").items()}}
    if args.grid:
        d["grid"] = {
            **d.get("grid", {}),
            **{k: [_value(x) for x in v.split(",")] for k, v in _pairs(args.grid, "--grid").items()},
        }
    if args.variant:
        variants = {}
        for item in args.variant:
            name, _, rest = item.partition(":")
            variants[name] = {k: _value(v) for k, v in _pairs([x for x in rest.split(",") if x], "--variant").items()}
        d["variants"] = variants
    search = dict(d.get("search", {}))
    for key, flag in (
        ("mode", "search"),
        ("num_trials", "num_trials"),
        ("metric", "metric"),
        ("early_stopping", "early_stopping"),
    ):
        if getattr(args, flag) is not None:
            search[key] = getattr(args, flag)
    if search:
        d["search"] = search
    for key in ("agents", "envs"):
        if key not in d:
            raise sw.SweepError(f"no {key}: give them in the sweep file or with --{key}")
    return d


def _die_with_parent():
    """In the trial's process: get SIGTERM when the Ray worker that started it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_trial(
    python: str, train: str, argv: list[str], log: str, status: str, gpus: float, cwd: str, watch=None
) -> int:
    """One attempt of one trial, in a Ray worker: train.py in a child process, output to ``log``, run in
    ``cwd`` (the sweep's own directory, wherever Ray starts its workers: relative paths and a user's
    ``--env <module>:<id>`` resolve as on the command line).  ``watch``, if given, is called 4 times
    a second while the child runs (a search reports the run's new evaluations to Ray Tune).

    Stopping the task (Ctrl-C of the sweep), or an exception out of ``watch`` (Tune stopping a
    trial), sends the child SIGTERM, on which train.py stops at the end of its iteration with a
    checkpoint; the task waits for it."""
    import json
    import os
    import subprocess
    import time

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if gpus == 0:
        env["JAX_PLATFORMS"] = "cpu"
    elif gpus < 1:  # trials sharing a GPU: each takes its share of the memory instead of JAX's 75%
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 * gpus:.3f}"
    try:
        s = json.loads(open(status).read())
    except (OSError, ValueError):
        s = {}

    def put(**values):
        s.update(values)
        with open(status + ".tmp", "w") as f:
            json.dump(s, f, indent=2, sort_keys=True)
        os.replace(status + ".tmp", status)

    put(state="running", started=time.strftime("%Y-%m-%d %H:%M:%S"), host=os.uname().nodename)
    with open(log, "a") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} on {os.uname().nodename}: train.py {' '.join(argv)}\n")
        out.flush()
        child = subprocess.Popen(
            [python, train, *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, preexec_fn=_die_with_parent
        )
        try:
            put(pid=child.pid)
            while watch is not None:
                try:
                    return child.wait(timeout=0.25)
                except subprocess.TimeoutExpired:
                    watch()
            return child.wait()
        except BaseException:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=300)
            except subprocess.TimeoutExpired:
                child.kill()
            raise


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


def _start_ray(args, spec: sw.Spec) -> int:
    """A local Ray (or the cluster of --address) with room for one trial, else a SweepError; how many
    trials it holds at once."""
    import ray

    init = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    if args.address:
        ray.init(address=args.address, **init)
    else:
        ray.init(num_cpus=args.num_cpus or os.cpu_count(), num_gpus=args.num_gpus, **init)
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    if cpus < spec.cpus_per_trial or gpus < spec.gpus_per_trial:  # else Ray would wait for them forever
        ray.shutdown()
        raise sw.SweepError(
            f"a trial asks for {spec.cpus_per_trial:g} CPUs and {spec.gpus_per_trial:g} GPUs, but the "
            f"Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs in all (cpus_per_trial / gpus_per_trial, "
            "or --num-cpus / --num-gpus for a local Ray)"
        )
    print(
        f"Ray: {cpus:g} CPUs, {gpus:g} GPUs; each trial takes {spec.cpus_per_trial:g} CPU and "
        f"{spec.gpus_per_trial:g} GPU"
    )
    return int(min(cpus // spec.cpus_per_trial, gpus // spec.gpus_per_trial if spec.gpus_per_trial else cpus))


def run_sweep(args, trials, ledger: sw.Ledger, spec: sw.Spec) -> int:
    import ray

    todo = [t for t in trials if ledger.status(t.name)["state"] != "done"]
    done = len(trials) - len(todo)
    print(f"sweep {ledger.root}: {len(trials)} trials, {done} finished before, {len(todo)} to run")
    if not todo:
        print(sw.table(ledger, trials))
        return 0
    _start_ray(args, spec)
    ledger.record(trials, sw.spec_dict(spec))
    task = ray.remote(run_trial).options(num_cpus=spec.cpus_per_trial, num_gpus=spec.gpus_per_trial, max_retries=0)
    queue = list(todo)
    running: dict = {}
    failed: list[sw.Trial] = []
    tries = {t.name: 0 for t in todo}
    for t in todo:
        ledger.set_status(t.name, state="queued", attempts=0)

    def submit(t: sw.Trial):
        argv, how = sw.attempt_argv(ledger, t)
        tries[t.name] += 1
        ledger.set_status(t.name, state="queued", attempts=tries[t.name], action=how, total_steps=_total_steps(t))
        ref = task.remote(
            sys.executable,
            str(TRAIN),
            argv,
            str(ledger.log(t)),
            str(ledger.status_path(t.name)),
            spec.gpus_per_trial,
            os.getcwd(),
        )
        running[ref] = t

    tty = sys.stdout.isatty()
    last_table = 0.0
    interrupted = False
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        while queue or running:
            while queue and (args.max_concurrent is None or len(running) < args.max_concurrent):
                submit(queue.pop(0))
            ready, _ = ray.wait(list(running), num_returns=1, timeout=min(args.refresh, 2.0))
            for ref in ready:
                t = running.pop(ref)
                try:
                    rc = ray.get(ref)
                    why = f"exit status {rc}"
                except Exception as e:  # the worker died (e.g. out of memory) or the task raised
                    rc, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if rc == 0:
                    ledger.set_status(t.name, state="done", returncode=0)
                    print(f"finished {t.name}" + _ret(ledger, t))
                elif tries[t.name] <= spec.retries:
                    ledger.set_status(t.name, state="retrying", returncode=rc, error=why)
                    print(f"{t.name} failed ({why}); retry {tries[t.name]} of {spec.retries}")
                    queue.append(t)
                else:
                    ledger.set_status(t.name, state="failed", returncode=rc, error=why)
                    failed.append(t)
                    print(
                        f"{t.name} FAILED after {tries[t.name]} tries ({why}); the end of "
                        f"{ledger.log(t)}:\n{_indent(sw.log_tail(ledger.log(t)))}"
                    )
            now = time.time()
            if now - last_table >= args.refresh and (queue or running):
                last_table = now
                text = sw.table(ledger, trials)
                print(("\x1b[2J\x1b[H" if tty else "\n") + text, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(
            f"\nstopping {len(running)} running trials at the end of their iteration (with a checkpoint) ...",
            flush=True,
        )
        for ref in running:
            ray.cancel(ref)
        for ref, t in running.items():
            try:
                ray.get(ref, timeout=330)
            except Exception:
                pass
            ledger.set_status(t.name, state="interrupted")
        for t in queue:
            ledger.set_status(t.name, state="interrupted")
    finally:
        signal.signal(signal.SIGTERM, old)
        ray.shutdown()
    print(sw.table(ledger, trials))
    if interrupted:
        print(f"interrupted; continue with the same command (finished trials are kept): {_command()}")
        return 130
    if failed:
        print(
            f"{len(failed)} of {len(trials)} trials failed: {', '.join(t.name for t in failed)} "
            f"(logs in {ledger.root / 'logs'}); fix the cause and run the same command again to retry them"
        )
        return 1
    print(
        f"all {len(trials)} trials finished; report: python scripts/report.py {ledger.root} "
        f"--out {ledger.root / 'report'}"
    )
    return 0


# ---- search: random or Optuna trials on Ray Tune, stopped early by ASHA / median stopping ------------


def search_main(args, spec: sw.Spec) -> int:
    """Check a search, plan what this launch runs (finished trials are kept), then run it on Ray Tune."""
    search = sw.parse_search(spec)
    ledger = sw.Ledger(args.dir)
    plan = sw.plan_search(spec, search, ledger)
    if not args.dry_run:
        missing = sw.search_missing(search.mode)
        if missing:
            raise sw.SweepError(missing)
    runs = len(plan.todo) + plan.new
    if not runs and not args.dry_run:
        print(
            f"search {ledger.root}: {search.mode} search, {search.num_trials} trials, {len(plan.finished)} finished "
            "before, 0 to run"
        )
        return _search_end(ledger, plan.trials, search, interrupted=False)
    sw.check_space(spec, search)
    probes = sw.probe_trials(spec, search) if plan.new else []
    what = [f"the {len(plan.todo)} trials to run"] if plan.todo else []
    what += ["the corners of the space"] if probes else []
    print(f"checking {' and '.join(what)} ...", flush=True)
    sw.preflight(plan.todo + probes, ledger)
    total_steps, eval_every = sw.run_budget((plan.trials or probes)[0])
    grace = search.grace_steps or eval_every
    if search.early_stopping != "none" and grace > total_steps:
        raise sw.SweepError(f"search.grace_steps {grace} is beyond the trials' {total_steps} steps")
    if args.dry_run:
        for t in plan.trials:
            print(f"{t.name}: train.py {' '.join(t.argv)}")
        if plan.new:
            print(
                f"{'and ' if plan.trials else ''}{plan.new} trials that Optuna chooses as the search runs, over: "
                + ", ".join(_range_text(r) for r in search.space)
            )
        return 0
    print(
        f"search {ledger.root}: {search.mode} search, {search.num_trials} trials, {len(plan.finished)} finished "
        f"before, {runs} to run"
    )
    if search.early_stopping != "none":
        print(f"early stopping: {_stopping_text(search, grace, total_steps)}")
    return run_search(args, spec, search, ledger, plan, total_steps, grace)


def _range_text(r: sw.Range) -> str:
    if r.kind == "choice":
        return f"{r.name} in {list(r.choices)}"
    return f"{r.name} in [{r.low}, {r.high}]{' (log)' if r.log else ''}"


def _stopping_text(search: sw.Search, grace: int, total_steps: int) -> str:
    if search.early_stopping == "asha":
        return (
            f"ASHA on {search.metric} ({search.goal}), rungs from step {grace} by a factor "
            f"{search.reduction_factor:g} up to {total_steps}"
        )
    return (
        f"median stopping on {search.metric} ({search.goal}) from step {grace}, once {search.min_trials} trials "
        "have reached a step"
    )


def tune_trial(config: dict, ctx: dict):
    """One search trial, as a Ray Tune function trainable in a Tune actor: train.py in a child process
    (``run_trial``, retried like a grid's trials), each evaluation reported to Tune as it appears in the
    run's eval.csv (``step`` and the metric) so that the scheduler can stop the trial; a stop ends the
    report call, and ``run_trial`` then stops train.py with a checkpoint.  A resumed trial first reports
    the evaluations it has."""
    from ray import tune

    from plasticity_zoo.training import sweep as sw

    c = config["trial"]
    t = sw.Trial(**{**c, "argv": tuple(c["argv"]), "params": tuple(map(tuple, c["params"]))})
    ledger = sw.Ledger(ctx["root"])
    total_steps = config["total_steps"]
    feed = sw.EvalFeed(ledger.run_dir(t), ctx["metric"], t.seeds, total_steps)

    def report(final: bool = False):
        for step, value in feed.new(final):
            tune.report({"step": step, ctx["metric"]: value})

    report()
    rc = None
    for attempt in range(1, ctx["retries"] + 2):
        argv, how = sw.attempt_argv(ledger, t)
        ledger.set_status(t.name, state="queued", attempts=attempt, action=how, total_steps=total_steps)
        rc = run_trial(
            ctx["python"],
            ctx["train"],
            argv,
            str(ledger.log(t)),
            str(ledger.status_path(t.name)),
            ctx["gpus"],
            ctx["cwd"],
            watch=report,
        )
        if rc == 0:
            ledger.set_status(t.name, state="done", returncode=0)
            report(final=True)
            return
        last = attempt > ctx["retries"]
        ledger.set_status(t.name, state="failed" if last else "retrying", returncode=rc, error=f"exit status {rc}")
    raise RuntimeError(f"train.py ended with exit status {rc} in each of its {ctx['retries'] + 1} tries")


def _tune_name(trial) -> str:
    return trial.config["trial"]["name"]


def _trial_config(t: sw.Trial) -> dict:
    """A Tune trial's config: the trial (for ``tune_trial``) and its run's length."""
    return {
        "trial": {**dataclasses.asdict(t), "argv": list(t.argv), "params": [list(p) for p in t.params]},
        "total_steps": sw.run_budget(t)[0],
    }


def _searcher(spec: sw.Spec, search: sw.Search, ledger: sw.Ledger, plan: sw.SearchPlan):
    """A Ray Tune searcher over the sweep directory: the plan's trials first (resumed or new random
    ones), then, in an optuna search, the trials Ray Tune's OptunaSearch suggests (recorded in
    sweep.json as they start).  OptunaSearch is first told the finished trials' results, and later
    those of the trials it did not suggest, so a relaunch continues the same study."""
    from ray.tune.search import Searcher

    inner = None
    if search.mode == "optuna":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # TPE's first trials are random draws from its seed: a relaunch draws from another one, or it
        # would suggest the first launch's trials again
        seed = (search.seed + 7919 * plan.next_index) % 2**32
        inner = OptunaSearch(space=sw.optuna_space(search), metric=search.metric, mode=search.goal, seed=seed)
        for t in plan.finished:
            ev = sw.last_value(ledger, t, search.metric)
            inner.add_evaluated_point(dict(t.params), None if ev is None else ev[1], pruned=ev is None)

    class LedgerSearcher(Searcher):
        def __init__(self):
            super().__init__(metric=search.metric, mode=search.goal)
            self.inner = inner  # Ray Tune's OptunaSearch (None in a random search)
            self.queue, self.new, self.next_index = list(plan.todo), plan.new, plan.next_index
            self.trials: dict = {}  # Tune's trial id -> (Trial, whether OptunaSearch suggested it)

        def set_search_properties(self, metric, mode, config, **kwargs) -> bool:
            return True

        def suggest(self, trial_id: str):
            if self.queue:
                t, asked = self.queue.pop(0), False
            elif self.new > 0:
                values = inner.suggest(trial_id)
                t = sw.search_trial(spec, self.next_index, tuple((r.name, values[r.name]) for r in search.space))
                self.next_index, self.new, asked = self.next_index + 1, self.new - 1, True
                ledger.record([t], sw.spec_dict(spec))
            else:
                return Searcher.FINISHED
            ledger.set_status(t.name, state="queued", attempts=0)
            self.trials[trial_id] = (t, asked)
            return _trial_config(t)

        def on_trial_result(self, trial_id: str, result: dict):
            if self.trials[trial_id][1]:
                inner.on_trial_result(trial_id, result)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
            t, asked = self.trials[trial_id]
            if inner is None:
                return
            if asked:
                inner.on_trial_complete(trial_id, result, error)
                return
            value = (result or {}).get(search.metric)
            inner.add_evaluated_point(dict(t.params), value, error=error, pruned=value is None and not error)

    return LedgerSearcher()


def _scheduler(search: sw.Search, total_steps: int, grace: int, on_stop):
    """Ray Tune's ASHAScheduler or MedianStoppingRule over env steps, calling ``on_stop(config,
    result)`` when it stops a trial (None without early stopping: Tune's FIFO)."""
    if search.early_stopping == "none":
        return None
    from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule, TrialScheduler

    common = dict(time_attr="step", metric=search.metric, mode=search.goal, grace_period=grace)
    if search.early_stopping == "asha":
        base, kwargs = (
            ASHAScheduler,
            dict(max_t=total_steps, reduction_factor=search.reduction_factor, stop_last_trials=False),
        )
    else:
        # min_time_slice inf: never PAUSE a trial while too few others have reached its step (a paused
        # trial's train.py would stop and start again); it goes on instead
        base, kwargs = (
            MedianStoppingRule,
            dict(min_samples_required=search.min_trials, hard_stop=True, min_time_slice=float("inf")),
        )

    class Recording(base):
        def on_trial_result(self, tune_controller, trial, result: dict) -> str:
            action = super().on_trial_result(tune_controller, trial, result)
            if action == TrialScheduler.STOP:
                on_stop(trial.config, result)
            return action

    return Recording(**common, **kwargs)


def run_search(
    args, spec: sw.Spec, search: sw.Search, ledger: sw.Ledger, plan: sw.SearchPlan, total_steps: int, grace: int
) -> int:
    import logging

    import ray
    from ray import tune
    from ray.tune import Callback
    from ray.tune.stopper import Stopper

    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # Ctrl-C: the Stopper below ends the trials
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # verbose=0 silences Tune's own tables only in this mode
    # A trial that Tune stops ends its actor; by default Ray then kills the actor's child processes, and
    # train.py could not finish its iteration and checkpoint (it gets SIGTERM from _die_with_parent, and
    # _wait_for_children waits for it).  Read by the local Ray started below (not by a cluster's).
    os.environ.setdefault("RAY_kill_child_processes_on_worker_exit", "0")
    for name in ("ray.tune", "ray.train", "ray.air"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the sweep prints its own lines
    room = _start_ray(args, spec)
    ledger.record(plan.trials, sw.spec_dict(spec))
    known = {t.name: t for t in plan.trials}  # the search's trials, with those Optuna suggests
    launched: set[str] = set()

    def trial_of(config) -> sw.Trial:
        c = config["trial"]
        return known.setdefault(c["name"], sw.search_trial(spec, c["index"], tuple(map(tuple, c["params"]))))

    def on_stop(config, result):
        t = trial_of(config)
        if result["step"] < total_steps and ledger.status(t.name)["state"] not in sw.FINISHED:
            sw.record_stop(ledger, t, search, result["step"], result[search.metric], total_steps)
            print(
                f"stopped {t.label} early at step {result['step']} of {total_steps}: "
                f"{search.metric} {result[search.metric]:.1f}",
                flush=True,
            )

    class Interrupt(Stopper):
        requested = False

        def __call__(self, trial_id, result) -> bool:
            return False

        def stop_all(self) -> bool:
            return self.requested

    class Progress(Callback):
        last_table = time.time()

        def on_trial_start(self, iteration, trials, trial, **info):
            t = trial_of(trial.config)
            launched.add(t.name)
            print(f"started {t.label}: {sw.values_text(t.params)}", flush=True)

        def on_trial_complete(self, iteration, trials, trial, **info):
            t = trial_of(trial.config)
            if ledger.status(t.name)["state"] == "done":
                ev = sw.last_value(ledger, t, search.metric)
                print(
                    f"finished {t.label}" + ("" if ev is None else f": {search.metric} {ev[1]:.1f} at step {ev[0]}"),
                    flush=True,
                )

        def on_trial_error(self, iteration, trials, trial, **info):
            t = trial_of(trial.config)
            s = ledger.status(t.name)
            if s["state"] != "failed":  # the worker died (e.g. out of memory): the trial could not say so
                s = ledger.set_status(t.name, state="failed", error="its Ray worker ended")
            print(
                f"{t.label} FAILED after {s.get('attempts', 0)} tries ({s.get('error', '')}); the end of "
                f"{ledger.log(t)}:\n{_indent(sw.log_tail(ledger.log(t)))}",
                flush=True,
            )

        def on_step_end(self, iteration, trials, **info):
            if time.time() - self.last_table >= args.refresh:
                self.last_table = time.time()
                text = sw.search_table(ledger, [known[n] for n in sorted(known)], search)
                print(("\x1b[2J\x1b[H" if sys.stdout.isatty() else "\n") + text, flush=True)

    stopper = Interrupt()

    def on_signal(signum, frame):
        if stopper.requested:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        stopper.requested = True
        print("\nstopping the running trials at the end of their iteration (with a checkpoint) ...", flush=True)

    ctx = dict(
        python=sys.executable,
        train=str(TRAIN),
        root=str(ledger.root.resolve()),
        metric=search.metric,
        retries=spec.retries,
        gpus=spec.gpus_per_trial,
        cwd=os.getcwd(),
    )
    trainable = tune.with_resources(
        tune.with_parameters(tune_trial, ctx=ctx), {"cpu": spec.cpus_per_trial, "gpu": spec.gpus_per_trial}
    )
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=_searcher(spec, search, ledger, plan),
            scheduler=_scheduler(search, total_steps, grace, on_stop),
            # a trial is suggested when it can start: in order, and Optuna
            # knows every trial that has finished by then
            num_samples=len(plan.todo) + plan.new,
            max_concurrent_trials=args.max_concurrent or max(1, room),
            reuse_actors=True,
            trial_name_creator=_tune_name,
            trial_dirname_creator=_tune_name,
        ),
        run_config=tune.RunConfig(
            storage_path=str((ledger.root / "tune").resolve()),
            name=time.strftime("launch-%Y%m%d-%H%M%S"),
            stop=stopper,
            callbacks=[Progress()],
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        tuner.fit()
    except KeyboardInterrupt:  # a second Ctrl-C: stop now (train.py still checkpoints, see _wait_for_children)
        stopper.requested = True
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        ray.shutdown()
        _wait_for_children(ledger, sorted(launched))
    # every trial of the search so far, with those Optuna suggested (recorded as they were)
    return _search_end(ledger, sw.plan_search(spec, search, ledger).trials, search, stopper.requested)


def _wait_for_children(ledger: sw.Ledger, names: list[str], timeout: float = 330.0):
    """Wait for the train.py processes of this launch's trials on this machine (a stopped trial's run
    ends its iteration and writes its checkpoint after its Tune actor has gone)."""
    host = os.uname().nodename
    pids = [s["pid"] for s in map(ledger.status, names) if s.get("host") == host and "pid" in s]
    deadline = time.time() + timeout
    waiting = [pid for pid in pids if _alive(pid)]
    if waiting:
        print(f"waiting for {len(waiting)} stopped trials to write their checkpoint ...", flush=True)
    while waiting and time.time() < deadline:
        time.sleep(0.2)
        waiting = [pid for pid in waiting if _alive(pid)]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running train.py (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, IndexError):
        return False
    return state != "Z" and TRAIN.name.encode() in cmdline


def _search_end(ledger: sw.Ledger, trials: list[sw.Trial], search: sw.Search, interrupted: bool) -> int:
    """The search's table and search.csv, unfinished trials marked; the exit status."""
    for t in trials:
        if ledger.status(t.name)["state"] in ("queued", "running", "retrying"):
            ledger.set_status(t.name, state="interrupted")
    print(sw.search_table(ledger, trials, search))
    path = sw.write_search_summary(ledger, trials, search)
    rows = sw.search_rows(ledger, trials, search)
    stopped = [r["trial"] for r in rows if r["state"] == "stopped"]
    failed = [r["trial"] for r in rows if r["state"] == "failed"]
    best = next((r for r in rows if r["state"] == "done" and r[search.metric] is not None), None)
    if best:
        print(
            f"best complete trial: {best['trial']} ({best['name']}), {search.metric} {best[search.metric]:.1f}: "
            + sw.values_text(best["params"])
        )
    if stopped:
        print(
            f"{len(stopped)} stopped early by {search.early_stopping}: {', '.join(stopped)} "
            "(runs/<trial>/stopped.json says why)"
        )
    print(f"table: {path}")
    if interrupted:
        print(f"interrupted; continue with the same command (finished trials are kept): {_command()}")
        return 130
    if failed:
        print(
            f"{len(failed)} of {len(trials)} trials failed: {', '.join(failed)} (logs in {ledger.root / 'logs'}); "
            "fix the cause and run the same command again to retry them"
        )
        return 1
    print(
        f"all {len(trials)} trials finished; report: python scripts/report.py {ledger.root} "
        f"--out {ledger.root / 'report'}"
    )
    return 0


def _total_steps(t: sw.Trial):
    argv = list(t.argv)
    return int(argv[argv.index("--total-steps") + 1]) if "--total-steps" in argv else None


def _ret(ledger, t) -> str:
    ev = sw.latest_return(ledger.run_dir(t))
    return "" if ev is None else f": return {ev[1]:.1f} at step {ev[0]}"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _command() -> str:
    return " ".join(["python", "scripts/sweep.py", *sys.argv[1:]])


def main(argv=None) -> int:
    args = parse_args(argv)
    d = build_spec(args)
    spec = sw.make_spec(dict(d))
    if spec.search:
        rc = search_main(args, spec)
    else:
        rc = grid_main(args, spec)
    if rc == 0 and args.report:
        rc = subprocess.call([sys.executable, str(REPORT), str(args.dir), "--out", str(Path(args.dir) / "report")])
    return rc


def grid_main(args, spec: sw.Spec) -> int:
    trials = sw.expand(spec)
    ledger = sw.Ledger(args.dir)
    sw.check_search_dir(ledger, None)
    ledger.check_compatible(trials)
    try:
        import ray  # noqa: F401
    except ImportError:
        if not args.dry_run:
            raise sw.SweepError("scripts/sweep.py needs Ray: pip install -e '.[sweep]'") from None
    pending = [t for t in trials if ledger.status(t.name)["state"] != "done"]
    print(f"checking the {len(pending)} trials to run ...", flush=True)
    sw.preflight(pending, ledger)
    if args.dry_run:
        for t in trials:
            print(f"{t.name}: train.py {' '.join(t.argv)}")
        return 0
    return run_sweep(args, trials, ledger, spec)


def cli(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("RLZOO_DEBUG", "").strip() not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        code = main(argv)
    except sw.SweepError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        code = 2
    raise SystemExit(code)


if __name__ == "__main__":
    cli()
