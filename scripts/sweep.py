"""Run a grid of train.py runs on Ray:  python scripts/sweep.py SPEC.toml --dir SWEEP_DIR [options]

    python scripts/sweep.py sweeps/plasticity.toml --dir sweeps/plasticity          # local Ray, all CPUs/GPUs
    python scripts/sweep.py --dir sweeps/quick --agents sac --envs Pendulum-v1 \\
        --flag total-steps=5000 --variant none --variant redo:preset=redo-sokar --seeds 3
    python scripts/sweep.py sweeps/plasticity.toml --dir /shared/sweeps/p --address auto   # join a Ray cluster
    python scripts/report.py sweeps/plasticity --out sweeps/plasticity/report               # the figures and tables

The sweep file's keys are described in training/sweep.py; the flags below set or override them.
Each trial is `train.py` in SWEEP_DIR/runs/<trial>/, its output in SWEEP_DIR/logs/<trial>.log.
Running the same command again skips finished trials and resumes interrupted ones from their
last checkpoint; a failed trial is retried (`retries`) and then reported with the end of its log.
Ctrl-C (or SIGTERM) stops the running trials at the end of their current iteration with a
checkpoint; run the command again to continue.  Exit status: 0 when every trial finished, 1 when
some failed, 2 for a mistaken sweep (nothing is created or started), 130 when interrupted.

Needs Ray: pip install -e '.[sweep]'.
"""
from __future__ import annotations

import argparse
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
    p = argparse.ArgumentParser(prog="sweep.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
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
    p.add_argument("--grid", action="append", metavar="NAME=V1,V2",
                   help="a train.py flag crossed over its values, e.g. plasticity.redo=false,true")
    p.add_argument("--variant", action="append", metavar="NAME[:FLAG=VALUE,...]",
                   help="a named variant and its flags, e.g. redo:preset=redo-sokar or none")
    p.add_argument("--address", help="join this Ray cluster (e.g. auto, or ray://HOST:10001); default: start a "
                                     "local Ray on this machine")
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
        d["grid"] = {**d.get("grid", {}), **{k: [_value(x) for x in v.split(",")]
                                            for k, v in _pairs(args.grid, "--grid").items()}}
    if args.variant:
        variants = {}
        for item in args.variant:
            name, _, rest = item.partition(":")
            variants[name] = {k: _value(v) for k, v in _pairs([x for x in rest.split(",") if x], "--variant").items()}
        d["variants"] = variants
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


def run_trial(python: str, train: str, argv: list[str], log: str, status: str, gpus: float, cwd: str) -> int:
    """One attempt of one trial, in a Ray worker: train.py in a child process, output to ``log``, run in
    ``cwd`` (the sweep's own directory, wherever Ray starts its workers: relative paths and a user's
    ``--env <module>:<id>`` resolve as on the command line).

    Stopping the task (Ctrl-C of the sweep) sends the child SIGTERM, on which train.py stops at the
    end of its iteration with a checkpoint; the task waits for it."""
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
    s.update(state="running", started=time.strftime("%Y-%m-%d %H:%M:%S"), host=os.uname().nodename)
    with open(status + ".tmp", "w") as f:
        json.dump(s, f, indent=2, sort_keys=True)
    os.replace(status + ".tmp", status)
    with open(log, "a") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} on {os.uname().nodename}: train.py "
                  f"{' '.join(argv)}\n")
        out.flush()
        child = subprocess.Popen([python, train, *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                 preexec_fn=_die_with_parent)
        try:
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


def run_sweep(args, trials, ledger: sw.Ledger, spec: sw.Spec) -> int:
    import ray

    todo = [t for t in trials if ledger.status(t.name)["state"] != "done"]
    done = len(trials) - len(todo)
    print(f"sweep {ledger.root}: {len(trials)} trials, {done} finished before, {len(todo)} to run")
    if not todo:
        print(sw.table(ledger, trials))
        return 0
    init = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    if args.address:
        ray.init(address=args.address, **init)
    else:
        ray.init(num_cpus=args.num_cpus or os.cpu_count(), num_gpus=args.num_gpus, **init)
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    if cpus < spec.cpus_per_trial or gpus < spec.gpus_per_trial:  # else Ray would wait for them forever
        ray.shutdown()
        raise sw.SweepError(f"a trial asks for {spec.cpus_per_trial:g} CPUs and {spec.gpus_per_trial:g} GPUs, but the "
                            f"Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs in all (cpus_per_trial / gpus_per_trial, "
                            "or --num-cpus / --num-gpus for a local Ray)")
    print(f"Ray: {cpus:g} CPUs, {gpus:g} GPUs; each trial takes {spec.cpus_per_trial:g} CPU and "
          f"{spec.gpus_per_trial:g} GPU")
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
        ledger.set_status(t.name, state="queued", attempts=tries[t.name], action=how,
                          total_steps=_total_steps(t))
        ref = task.remote(sys.executable, str(TRAIN), argv, str(ledger.log(t)), str(ledger.status_path(t.name)),
                          spec.gpus_per_trial, os.getcwd())
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
                    print(f"{t.name} FAILED after {tries[t.name]} tries ({why}); the end of "
                          f"{ledger.log(t)}:\n{_indent(sw.log_tail(ledger.log(t)))}")
            now = time.time()
            if now - last_table >= args.refresh and (queue or running):
                last_table = now
                text = sw.table(ledger, trials)
                print(("\x1b[2J\x1b[H" if tty else "\n") + text, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(f"\nstopping {len(running)} running trials at the end of their iteration (with a checkpoint) ...",
              flush=True)
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
        print(f"{len(failed)} of {len(trials)} trials failed: {', '.join(t.name for t in failed)} "
              f"(logs in {ledger.root / 'logs'}); fix the cause and run the same command again to retry them")
        return 1
    print(f"all {len(trials)} trials finished; report: python scripts/report.py {ledger.root} "
          f"--out {ledger.root / 'report'}")
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
    trials = sw.expand(spec)
    ledger = sw.Ledger(args.dir)
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
    rc = run_sweep(args, trials, ledger, spec)
    if rc == 0 and args.report:
        rc = subprocess.call([sys.executable, str(REPORT), str(ledger.root), "--out", str(ledger.root / "report")])
    return rc


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
