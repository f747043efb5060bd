"""SAC speed beside its fastest peers: the zoo's `train.py sac`, SBX's SAC and CleanRL's SAC, same settings.

    python scripts/benchmark_peers.py \\
        --sbx-python /tmp/sbxvenv/bin/python \\
        --cleanrl-python /tmp/cleanrlvenv/bin/python --cleanrl-script /tmp/cleanrl/sac_continuous_action.py \\
        --out runs/peers                                   # HalfCheetah-v5, 12000 steps per run, 3 rounds
    python scripts/benchmark_peers.py --sbx-python /tmp/sbxvenv/bin/python --rounds 5    # CleanRL skipped
    python scripts/benchmark_peers.py ... --zoo-flag=--plasticity.metrics-every=0       # extra train.py flags
    python scripts/benchmark_peers.py ... --zoo-variant rolled:RLZOO_UNROLLED_THREEFRY=0  # a second zoo run per round

What is measured: env steps per second of one SAC training run (1 seed, 1 env, 1M-row replay buffer,
HalfCheetah-v5 unless --env), over the steps of a window after learning starts: from
``learning_starts + 1000`` (the warm-up: compiling, the first updates; shortened to half the learning steps
when --steps leaves fewer than 2000 of them, rounded up to a multiple of 100) to the last step the run
reports.  Each round runs the zoo, then SBX, then CleanRL, one process at a time and nothing else of ours;
the rounds alternate them, so a change in the machine's load reaches all three.  Rates are printed per
round; the summary gives each implementation's median over the rounds and the zoo / SBX and zoo /
CleanRL ratios of the medians (above 1: the zoo is faster).  --out DIR writes peers.json (everything:
settings, machine, versions, every run) and peers.md, and keeps each run's output in DIR/logs.

Run it on an otherwise idle machine.  For each run it measures the share of the CPUs that other processes
took meanwhile (/proc/stat's busy time less the run's own, ``others_share``) and flags runs above 10%:
on a shared 2-core machine torch's default two OpenMP threads slow down by far more than the others'
share (a 256 x 256 critic update: 4.4 ms with one thread, 190 ms with two, while another process kept a
core busy), so such a run measures the contention, not the implementation.  --cleanrl-threads N gives
CleanRL's process OMP_NUM_THREADS=MKL_NUM_THREADS=N to see this (default: torch's own, one per core).

How each rate is read (all three: (s_b - s_a) / (t_b - t_a), a = the first point at or after the window's
start, b = the last point; ``window``):

* zoo: ``sys.executable scripts/train.py sac --env ENV --total-steps STEPS --learning-starts LS
  --log-every 100 --eval-every STEPS+1 --eval-episodes 1 --checkpoint-every STEPS+1 --no-progress
  --run-dir TMP --overwrite [--zoo-flag ...]`` -- the zoo's defaults otherwise.  metrics.csv's
  ``perf/sps`` is the env steps since the previous row over the seconds since it (training/driver.py
  ``log_if_due``); the points are the rows' steps with their cumulated seconds (``zoo_points``).  Evaluation
  (at step 0 and after the last step only) and the final checkpoint fall outside the window; the row
  writes' own milliseconds are not counted.  Plasticity metrics (every 10000 updates by default) fall in
  the window only when STEPS - LS >= 10000.
* SBX: our driver (``sbx_driver()``, run with ``--sbx-python -c``) trains ``sbx.SAC("MlpPolicy",
  gym.make(ENV), ...)`` with a callback that records (num_timesteps, perf_counter) every 100 steps and at
  the last, and prints the window (the same ``window`` function) as one JSON line.
* CleanRL: ``sac_continuous_action.py`` with its flags set as below, run in a temporary directory (it
  writes runs/ there).  After learning starts it prints ``SPS: int(global_step / elapsed)`` at every
  global_step that is a multiple of 100, so point i is (s, s / SPS) with s = the i-th such step
  (``cleanrl_points``): the rate is (s_b - s_a) / (s_b / SPS_b - s_a / SPS_a).  SPS is truncated to an
  integer, so the time of a point is known to s / SPS^2 (~1% at 100 steps/s); peers.json gives the
  bounds (``cleanrl_bounds``).  Its window ends at its last print, the last multiple of 100 below STEPS.

Settings (the zoo's SAC defaults, agents/sac.py and agents/api.py OffPolicyConfig), matched in all three:
actor and 2 critics 2 x 256 ReLU MLPs; clipped double Q (min of 2 target critics); batch 256; gamma 0.99;
Polyak tau 0.005 after every update; 1 gradient step per env step; Adam 3e-4 for actor, critics and
temperature; learned temperature from alpha = 1 with target entropy -|A|; tanh-squashed Gaussian policy;
uniform-random actions for the first LS steps; 1M-row replay; seed 0.  CleanRL is run with
``--q-lr 3e-4`` (default 1e-3; it is also its temperature's rate) and ``--policy-frequency 1`` (default 2:
two actor and temperature updates every second step), the others at its defaults or given explicitly.
Not matched (each implementation's own, none changes the updates' count or sizes): the order of the
losses within an update (zoo: temperature, actor, critics, Polyak; SBX: critics, Polyak, then actor
and temperature; CleanRL: critics, actor, temperature, targets); log-std bounds (zoo and CleanRL [-5, 2], SBX
[-20, 2]); loss scaling; CleanRL's temperature loss runs the actor once more, and it writes TensorBoard
scalars every 100 steps; threads and devices are each framework's defaults (XLA's CPU threads, torch's
intra-op threads = cores; each run's device is recorded).  The zoo logs every 100 steps (default 1000),
which only reads the logged statistics more often.

Peers live in their own virtual environments; the zoo never imports them.  Setup used (HalfCheetah's
physics pinned to the zoo's MuJoCo, so the env steps cost the same; the script warns when versions of
mujoco or gymnasium differ between the three)::

    python3 -m venv /tmp/sbxvenv
    /tmp/sbxvenv/bin/pip install "sbx-rl==0.28.*" "jax==0.10.2" "jaxlib==0.10.2" "gymnasium[mujoco]>=1.4,<1.5"
    python3 -m venv /tmp/cleanrlvenv
    /tmp/cleanrlvenv/bin/pip install torch==2.13.0 "gymnasium[mujoco]>=1.4,<1.5" tyro tensorboard numpy
    for v in sbxvenv cleanrlvenv; do   # the zoo's MuJoCo (mujoco 4 installs as mujoco-core + mujoco-studio)
        /tmp/$v/bin/pip uninstall -y mujoco-studio mujoco-core mujoco
        /tmp/$v/bin/pip install --no-deps mujoco==3.17.0
    done
    # CleanRL (github.com/vwxyzjn/cleanrl; tried at fe8d8a03c41a, 2026-04-20): the script and the replay
    # buffer it imports, side by side
    git --git-dir=CLEANRL show HEAD:cleanrl/sac_continuous_action.py > /tmp/cleanrl/sac_continuous_action.py
    git --git-dir=CLEANRL show HEAD:cleanrl_utils/buffers.py > /tmp/cleanrl/cleanrl_utils/buffers.py
    touch /tmp/cleanrl/cleanrl_utils/__init__.py

CleanRL's script targets gymnasium 0.29; on gymnasium 1.x it needs three edits in that copy (not in this
repository): ``SyncVectorEnv(..., autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)`` (0.29's
autoreset), ``infos["final_obs"]`` for ``infos["final_observation"]``, and the episode print reading
``infos["final_info"]["episode"]["r"][i]`` (a dict of arrays now, masked by ``["_episode"]``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import inspect
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 1000  # steps after learning starts left out of the window: compiling, the first updates
GRID = 100  # the zoo's log rows, SBX's recorded points and CleanRL's SPS prints fall every GRID steps
BUFFER_SIZE = 1_000_000
BUSY = 0.1  # a run during which other processes took more of the CPUs than this is flagged
JSON_PREFIX = "PEER_RESULT "  # the SBX driver's result line


def window_start(steps: int, learning_starts: int, warmup: int = WARMUP, grid: int = GRID) -> int:
    """The first step of the timed window: ``warmup`` steps after learning starts (at most half of the
    learning steps), rounded up to a multiple of ``grid``."""
    skip = min(warmup, max(steps - learning_starts, 0) // 2)
    return -(-(learning_starts + skip) // grid) * grid


def window(points, start):
    """Env steps per second between the first point at or after step ``start`` and the last point.

    ``points``: (env step, seconds) pairs, any order.  Returns a dict: rate, first and last (the steps
    bounding the window) and seconds (its length).  Raises ValueError when fewer than two points with
    distinct steps lie in the window or its time does not advance.  (The SBX driver runs this function's
    own source.)"""
    inside = sorted(p for p in points if p[0] >= start)
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        raise ValueError(f"fewer than two points at or after step {start}: raise --steps or lower --learning-starts")
    (s_a, t_a), (s_b, t_b) = inside[0], inside[-1]
    if not t_b > t_a:
        raise ValueError(f"time does not advance between steps {s_a} and {s_b}")
    return {"rate": (s_b - s_a) / (t_b - t_a), "first": s_a, "last": s_b, "seconds": t_b - t_a}


def zoo_points(rows, seeds: int = 1) -> list[tuple[int, float]]:
    """(step, seconds) points from metrics.csv rows (step, perf/sps) of one seed: row k covers the steps
    since row k-1 at ``perf/sps`` env steps (of all ``seeds``) per second; seconds count from the first row."""
    rows = sorted(rows)
    points = [(rows[0][0], 0.0)] if rows else []
    for (prev, _), (step, sps) in zip(rows, rows[1:]):
        points.append((step, points[-1][1] + seeds * (step - prev) / sps))
    return points


def read_zoo_metrics(path: Path) -> list[tuple[int, float]]:
    """(step, perf/sps) of seed 0's rows of a run's metrics.csv (rows without a speed are skipped)."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("seed", "0") == "0" and r.get("perf/sps"):
                rows.append((int(r["step"]), float(r["perf/sps"])))
    return rows


SPS_LINE = re.compile(r"^SPS:\s*(\d+)\s*$")


def cleanrl_sps(text: str, learning_starts: int, total_steps: int) -> list[tuple[int, int]]:
    """(global_step, SPS) of each ``SPS:`` line of sac_continuous_action.py's output.

    It prints at every global_step > learning_starts with global_step % 100 == 0 (global_step counts
    0 .. total_steps - 1), the line itself giving no step: the i-th line is the i-th such step.  Raises
    ValueError if the number of lines is not that of those steps (another script version or a crash)."""
    values = [int(m.group(1)) for line in text.splitlines() if (m := SPS_LINE.match(line.strip()))]
    steps = list(range((learning_starts // 100 + 1) * 100, total_steps, 100))
    if len(values) != len(steps):
        raise ValueError(
            f"expected {len(steps)} 'SPS:' lines (one per 100 global steps from {steps[0] if steps else '-'} to "
            f"{steps[-1] if steps else '-'}), found {len(values)}"
        )
    return list(zip(steps, values))


def cleanrl_points(sps: list[tuple[int, int]]) -> list[tuple[int, float]]:
    """(step, step / SPS): the seconds since its start_time at each print (SPS 0 tells nothing: skipped)."""
    return [(s, s / v) for s, v in sps if v > 0]


def cleanrl_bounds(sps: list[tuple[int, int]], first: int, last: int) -> tuple[float, float]:
    """The least and greatest rate over steps first..last that the printed SPS values allow: each true
    SPS lies in [SPS, SPS + 1) (int() truncates)."""
    by_step = dict(sps)
    (s_a, v_a), (s_b, v_b) = (first, by_step[first]), (last, by_step[last])
    low = (s_b - s_a) / (s_b / v_b - s_a / (v_a + 1))
    high = (s_b - s_a) / (s_b / (v_b + 1) - s_a / v_a)
    return low, high


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine from /proc/stat, CPU seconds of our finished children)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = children.ru_utime + children.ru_stime
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return math.nan, mine
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK"), mine


def others_share(before: tuple[float, float], after: tuple[float, float], wall: float, cores: int) -> float:
    """The share of the machine's CPU time that processes other than the run (and its children) used
    during it: the machine's busy seconds less the run's, over wall x cores (NaN without /proc/stat)."""
    busy, mine = after[0] - before[0], after[1] - before[1]
    return max(busy - mine, 0.0) / (wall * cores) if wall > 0 and cores > 0 else math.nan


# --------------------------------------------------------------------------------------------- the runs
SBX_BODY = """
import json, sys, time
import gymnasium as gym
import jax
import sbx
from stable_baselines3.common.callbacks import BaseCallback

env_id, steps, learning_starts, start, grid = sys.argv[1], *map(int, sys.argv[2:6])


class Clock(BaseCallback):
    def __init__(self):
        super().__init__()
        self.points = []

    def _on_step(self):
        n = self.num_timesteps
        if n % grid == 0 or n == steps:
            self.points.append((n, time.perf_counter()))
        return True


model = sbx.SAC(
    "MlpPolicy", gym.make(env_id), learning_starts=learning_starts, buffer_size=BUFFER_SIZE, batch_size=256,
    learning_rate=3e-4, qf_learning_rate=3e-4, gamma=0.99, tau=0.005, train_freq=1, gradient_steps=1,
    policy_delay=1, ent_coef="auto", target_entropy="auto",
    policy_kwargs=dict(net_arch=[256, 256], n_critics=2), seed=0, verbose=0,
)
clock = Clock()
model.learn(total_timesteps=steps, callback=clock)
result = window(clock.points, start)
result["device"] = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
print(JSON_PREFIX + json.dumps(result), flush=True)
"""


def sbx_driver() -> str:
    """The code the SBX interpreter runs (``-c``): ``window``'s own source, then the training."""
    consts = f"BUFFER_SIZE = {BUFFER_SIZE}\nJSON_PREFIX = {JSON_PREFIX!r}\n"
    return consts + inspect.getsource(window) + SBX_BODY


VERSIONS_PROBE = """
import importlib.metadata as m, json, sys
out = {"python": sys.version.split()[0]}
for p in sys.argv[1:]:
    try:
        out[p] = m.version(p)
    except m.PackageNotFoundError:
        pass
print(json.dumps(out))
"""
TORCH_PROBE = (
    "import json, torch; print(json.dumps({'cuda': torch.cuda.is_available(), 'threads': torch.get_num_threads()}))"
)


@dataclass
class Impl:
    """One implementation: ``run(workdir, args) -> result dict`` (rate etc.), or ``skipped`` saying why not."""

    name: str
    label: str
    python: Optional[str]
    packages: tuple[str, ...]
    run: Optional[Callable[[Path, argparse.Namespace], dict]] = None
    skipped: Optional[str] = None


def _call(argv: list[str], workdir: Path, timeout: float, env: Optional[dict] = None) -> tuple[int, str, str]:
    """Run ``argv`` in ``workdir`` (environment: ours, updated with ``env``); (return code, stdout, stderr)."""
    environ = None if env is None else {**os.environ, **env}
    p = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=environ)
    return p.returncode, p.stdout, p.stderr


def _failed(rc: int, out: str, err: str) -> RuntimeError:
    tail = "\n".join((out + "\n" + err).strip().splitlines()[-15:])
    return RuntimeError(f"exit status {rc}:\n{tail}")


def zoo_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """train.py at its defaults but for the run's length and what keeps evaluation and checkpoints out of
    the window (and log rows every GRID steps to read the window's rate from)."""
    after = str(args.steps + 1)
    return [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "sac",
        "--env",
        args.env,
        "--total-steps",
        str(args.steps),
        "--learning-starts",
        str(args.learning_starts),
        "--log-every",
        str(GRID),
        "--eval-every",
        after,
        "--eval-episodes",
        "1",
        "--checkpoint-every",
        after,
        "--no-progress",
        "--run-dir",
        str(run_dir),
        "--overwrite",
        *args.zoo_flag,
    ]


def run_zoo(workdir: Path, args: argparse.Namespace, env: Optional[dict] = None, name: str = "zoo") -> dict:
    """The zoo's run (``env``: environment variables it runs with, a ``--zoo-variant``'s)."""
    run_dir = workdir / "run"
    rc, out, err = _call(zoo_argv(args, run_dir), workdir, args.timeout, env)
    _keep_log(args, name, out, err)
    if rc != 0:
        raise _failed(rc, out, err)
    config = json.loads((run_dir / "config.json").read_text())
    seeds = int(config.get("seeds", 1))
    result = window(zoo_points(read_zoo_metrics(run_dir / "metrics.csv"), seeds), args.window_start)
    result["rate"] *= seeds  # env steps of all seeds per second, as perf/sps
    device = config.get("provenance", {}).get("device", {})
    result["device"] = f"{device.get('platform', '?')} ({device.get('kind', '?')})"
    return result


def run_sbx(workdir: Path, args: argparse.Namespace) -> dict:
    argv = [args.sbx_python, "-c", sbx_driver(), args.env, str(args.steps), str(args.learning_starts)]
    argv += [str(args.window_start), str(GRID)]
    rc, out, err = _call(argv, workdir, args.timeout)
    _keep_log(args, "sbx", out, err)
    lines = [line for line in out.splitlines() if line.startswith(JSON_PREFIX)]
    if rc != 0 or not lines:
        raise _failed(rc, out, err)
    return json.loads(lines[-1][len(JSON_PREFIX) :])


def cleanrl_argv(args: argparse.Namespace) -> list[str]:
    """sac_continuous_action.py with the zoo's SAC settings (its defaults where they already agree)."""
    flags = {
        "--env-id": args.env,
        "--total-timesteps": args.steps,
        "--learning-starts": args.learning_starts,
        "--buffer-size": BUFFER_SIZE,
        "--batch-size": 256,
        "--gamma": 0.99,
        "--tau": 0.005,
        "--policy-lr": 3e-4,
        "--q-lr": 3e-4,
        "--policy-frequency": 1,
        "--target-network-frequency": 1,
        "--seed": 0,
    }
    argv = [args.cleanrl_python, args.cleanrl_script]
    for k, v in flags.items():
        argv += [k, str(v)]
    return argv + ["--autotune", "--no-track", "--no-capture-video"]


def cleanrl_env(args: argparse.Namespace) -> Optional[dict]:
    """--cleanrl-threads N: torch's intra-op threads (OMP_NUM_THREADS, MKL_NUM_THREADS); None: its default."""
    n = args.cleanrl_threads
    return None if n is None else {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


def run_cleanrl(workdir: Path, args: argparse.Namespace) -> dict:
    rc, out, err = _call(cleanrl_argv(args), workdir, args.timeout, cleanrl_env(args))
    _keep_log(args, "cleanrl", out, err)
    if rc != 0:
        raise _failed(rc, out, err)
    sps = cleanrl_sps(out, args.learning_starts, args.steps)
    result = window(cleanrl_points(sps), args.window_start)
    result["rate_bounds"] = cleanrl_bounds(sps, result["first"], result["last"])
    return result


def _keep_log(args: argparse.Namespace, name: str, out: str, err: str):
    if args.out is not None:
        logs = Path(args.out) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"round{args.current_round}_{name}.log").write_text(out + "\n--- stderr ---\n" + err)


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME:VAR=VALUE[,VAR=VALUE...]`` (a ``--zoo-variant``) -> (NAME, {VAR: VALUE})."""
    name, sep, spec = text.partition(":")
    pairs = [p.partition("=") for p in spec.split(",") if p]
    if not sep or not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise ValueError(f"--zoo-variant {text!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]")
    return name, {k: v for k, _, v in pairs}


def build_impls(args: argparse.Namespace) -> list[Impl]:
    """The zoo (then its ``--zoo-variant`` runs) and the peers, in the order every round runs them; a peer
    without its interpreter (or, for CleanRL, its script) is skipped, saying so."""
    packages = ("plasticity-zoo", "jax", "jaxlib", "mujoco", "gymnasium", "numpy")
    impls = [Impl("zoo", "zoo (train.py sac)", sys.executable, packages, run_zoo)]
    for name, env in map(parse_variant, args.zoo_variant):
        run = lambda workdir, a, env=env, name=f"zoo-{name}": run_zoo(workdir, a, env, name)  # noqa: E731
        impls.append(Impl(f"zoo-{name}", f"zoo {name}", sys.executable, packages, run))
    sbx = Impl(
        "sbx",
        "SBX SAC",
        args.sbx_python,
        ("sbx-rl", "stable_baselines3", "jax", "jaxlib", "flax", "optax", "mujoco", "gymnasium", "numpy"),
    )
    if args.sbx_python:
        sbx.run = run_sbx
    else:
        sbx.skipped = "no --sbx-python given"
    cleanrl = Impl(
        "cleanrl", "CleanRL SAC (torch)", args.cleanrl_python, ("torch", "mujoco", "gymnasium", "numpy", "tyro")
    )
    if args.cleanrl_python and args.cleanrl_script:
        cleanrl.run = run_cleanrl
    else:
        missing = [
            f
            for f, v in (("--cleanrl-python", args.cleanrl_python), ("--cleanrl-script", args.cleanrl_script))
            if not v
        ]
        cleanrl.skipped = f"no {' and '.join(missing)} given"
    return impls + [sbx, cleanrl]


# --------------------------------------------------------------------------------------------- reports
def machine_info() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return {
        "cpu": model,
        "cores": cores,
        "usable_cores": usable,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
    }


def probe_versions(impl: Impl) -> dict:
    """Package versions in the implementation's interpreter (and torch's device and threads for CleanRL)."""
    if impl.python is None:
        return {}
    try:
        rc, out, _ = _call([impl.python, "-c", VERSIONS_PROBE, *impl.packages], ROOT, 120)
        versions = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {"error": f"exit status {rc}"}
        if impl.name == "cleanrl" and rc == 0:
            rc, out, _ = _call([impl.python, "-c", TORCH_PROBE], ROOT, 120)
            if rc == 0:
                versions["torch_runtime"] = json.loads(out.strip().splitlines()[-1])
        return versions
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}


def mismatched(versions: dict[str, dict], packages=("mujoco", "gymnasium")) -> list[str]:
    """Packages whose version differs between the implementations that have it."""
    out = []
    for p in packages:
        seen = {name: v[p] for name, v in versions.items() if p in v}
        if len(set(seen.values())) > 1:
            out.append(f"{p}: " + ", ".join(f"{n} {v}" for n, v in seen.items()))
    return out


def summarize(impls: list[Impl], rounds: list[dict]) -> dict:
    """Median rate per implementation over its successful rounds, the zoo / peer ratios of the medians,
    the skipped peers with their reasons, and the runs during which other processes were busy."""
    medians: dict[str, Optional[float]] = {}
    for impl in impls:
        rates = [r[impl.name]["rate"] for r in rounds if impl.name in r and "rate" in r[impl.name]]
        medians[impl.name] = statistics.median(rates) if rates else None
    ratios = {}
    for zoo in [impl.name for impl in impls if impl.name.startswith("zoo")]:
        for peer in ("sbx", "cleanrl"):
            z, p = medians.get(zoo), medians.get(peer)
            ratios[f"{zoo}/{peer}"] = z / p if z is not None and p else None
    return {
        "median_rate": medians,
        "ratios": ratios,
        "skipped": {impl.name: impl.skipped for impl in impls if impl.skipped},
        "busy_runs": [
            f"round {k + 1} {name}: others {r['others_cpu']:.0%}"
            for k, results in enumerate(rounds)
            for name, r in results.items()
            if r.get("others_cpu", 0.0) > BUSY
        ],
    }


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def round_table(impls: list[Impl], results: dict) -> list[str]:
    lines = [
        f"  {'implementation':<22} {'steps/s':>9}  {'window':>13}  {'seconds':>8}  {'wall s':>7}  {'others':>6}  device"
    ]
    for impl in impls:
        if impl.skipped:
            lines.append(f"  {impl.label:<22} skipped: {impl.skipped}")
            continue
        r = results.get(impl.name, {})
        if "rate" not in r:
            lines.append(f"  {impl.label:<22} failed: {r.get('error', '?').splitlines()[0]}")
            continue
        span = f"{r['first']}-{r['last']}"
        lines.append(
            f"  {impl.label:<22} {r['rate']:>9.1f}  {span:>13}  {r['seconds']:>8.1f}  {r['wall_s']:>7.1f}"
            f"  {r['others_cpu']:>6.0%}  {r.get('device', '')}"
        )
        if "rate_bounds" in r:
            lo, hi = r["rate_bounds"]
            lines.append(f"  {'':<22} (SPS truncation: {lo:.1f} .. {hi:.1f})")
        if r["others_cpu"] > BUSY:
            lines.append(f"  {'':<22} (other processes used {r['others_cpu']:.0%} of the CPUs: not representative)")
    return lines


def summary_lines(impls: list[Impl], summary: dict) -> list[str]:
    lines = ["summary (median env steps/s over the rounds):"]
    for impl in impls:
        if impl.skipped:
            lines.append(f"  {impl.label:<22} skipped: {impl.skipped}")
        else:
            lines.append(f"  {impl.label:<22} {_fmt(summary['median_rate'][impl.name]):>9}")
    for k, v in summary["ratios"].items():
        lines.append(f"  {k:<22} {_fmt(v, 3):>9}")
    if summary["busy_runs"]:
        lines.append(
            f"WARNING: other processes took over {BUSY:.0%} of the CPUs during "
            + "; ".join(summary["busy_runs"])
            + ": those rates, and the medians and ratios, do not measure the implementations alone"
        )
    return lines


def markdown(report: dict, impls: list[Impl]) -> str:
    m, s = report["machine"], report["settings"]
    names = [i for i in impls if not i.skipped]
    out = [
        "# SAC speed beside its peers (scripts/benchmark_peers.py)",
        "",
        f"{m['date']}; {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable); {m['platform']}",
        "",
        f"{s['env']}, {s['steps']} env steps per run, learning starts at {s['learning_starts']}, window from "
        f"step {s['window_start']} to each run's last report; {s['rounds']} rounds (zoo, SBX, CleanRL in each). "
        f"Rate: env steps per second over the window.  zoo flags: {' '.join(s['zoo_flags']) or '(none)'}.",
        "",
        "| round | " + " | ".join(i.label for i in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for k, r in enumerate(report["rounds"]):
        cells = [_fmt(r.get(i.name, {}).get("rate")) if "rate" in r.get(i.name, {}) else "failed" for i in names]
        out.append(f"| {k + 1} | " + " | ".join(cells) + " |")
    sm = report["summary"]
    out.append("| median | " + " | ".join(_fmt(sm["median_rate"][i.name]) for i in names) + " |")
    out += ["", *[f"- {k}: {_fmt(v, 3)}" for k, v in sm["ratios"].items()]]
    out += [f"- {k} skipped: {v}" for k, v in sm["skipped"].items()]
    out += [f"- WARNING: other processes were busy (over {BUSY:.0%} of the CPUs): {b}" for b in sm["busy_runs"]]
    out += ["", "Versions:", ""]
    out += [f"- {k}: {json.dumps(v)}" for k, v in report["versions"].items()]
    out += [f"- WARNING: versions differ: {w}" for w in report["version_mismatches"]]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--steps", type=int, default=12000, help="env steps per run (default 12000)")
    p.add_argument(
        "--learning-starts", type=int, default=5000, help="uniform-random steps before learning (default 5000)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of zoo, SBX, CleanRL (default 3)")
    p.add_argument("--sbx-python", help="interpreter of a venv with sbx-rl (SBX skipped without it)")
    p.add_argument(
        "--cleanrl-python", help="interpreter of a venv with torch, tyro, tensorboard (CleanRL skipped without it)"
    )
    p.add_argument("--cleanrl-script", help="CleanRL's sac_continuous_action.py (with cleanrl_utils/ beside it)")
    p.add_argument("--out", help="directory for peers.json, peers.md and logs/")
    p.add_argument("--zoo-flag", action="append", default=[], help="extra train.py flag (repeatable: --zoo-flag=--x=1)")
    p.add_argument(
        "--zoo-variant",
        action="append",
        default=[],
        help="a second zoo run per round with environment variables set: NAME:VAR=VALUE[,VAR=VALUE] (repeatable)",
    )
    p.add_argument(
        "--cleanrl-threads",
        type=int,
        help="torch threads of CleanRL's run (OMP_NUM_THREADS, MKL_NUM_THREADS; default: torch's, one per core)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take (default 3600)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or not 0 <= args.learning_starts < args.steps:
        p.error("need --rounds >= 1 and 0 <= --learning-starts < --steps")
    for flag in ("sbx_python", "cleanrl_python", "cleanrl_script"):
        path = getattr(args, flag)
        if path is not None and not Path(path).exists():
            p.error(f"--{flag.replace('_', '-')} {path}: no such file")
    if args.cleanrl_script is not None:
        args.cleanrl_script = str(Path(args.cleanrl_script).resolve())
    for v in args.zoo_variant:
        try:
            parse_variant(v)
        except ValueError as e:
            p.error(str(e))
    args.window_start = window_start(args.steps, args.learning_starts)
    args.current_round = 0
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    impls = build_impls(args)
    machine = machine_info()
    versions = {i.name: probe_versions(i) for i in impls if not i.skipped}
    if args.cleanrl_script:
        digest = hashlib.sha256(Path(args.cleanrl_script).read_bytes()).hexdigest()[:16]
        versions.setdefault("cleanrl", {})["script_sha256"] = digest
    warnings = mismatched(versions)
    torch_rt = versions.get("cleanrl", {}).get("torch_runtime", {})
    threads = args.cleanrl_threads or torch_rt.get("threads", "?")
    devices = {
        "cleanrl": f"{'cuda' if torch_rt.get('cuda') else 'cpu'} (torch, {threads} thread{'' if threads == 1 else 's'})"
    }
    print(f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), {machine['date']}")
    print(
        f"{args.env}: {args.steps} steps per run, learning starts at {args.learning_starts}, "
        f"window from step {args.window_start}; {args.rounds} rounds"
    )
    for i in impls:
        print(f"  {i.label}: " + (f"skipped ({i.skipped})" if i.skipped else json.dumps(versions.get(i.name, {}))))
    for w in warnings:
        print(f"WARNING: versions differ between the implementations: {w}")
    rounds: list[dict] = []
    for k in range(args.rounds):
        args.current_round = k + 1
        results: dict = {}
        for impl in impls:
            if impl.skipped or impl.run is None:
                continue
            before, t0 = cpu_seconds(), time.perf_counter()
            with tempfile.TemporaryDirectory(prefix=f"peers-{impl.name}-") as work:
                try:
                    r = impl.run(Path(work), args)
                except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
                    r = {"error": str(e)}
            r["wall_s"] = wall = time.perf_counter() - t0
            r["others_cpu"] = others_share(before, cpu_seconds(), wall, machine["usable_cores"] or 1)
            r.setdefault("device", devices.get(impl.name, ""))
            results[impl.name] = r
            print(
                f"round {k + 1} {impl.name}: "
                + (f"{r['rate']:.1f} steps/s" if "rate" in r else "failed: " + r["error"].splitlines()[0]),
                flush=True,
            )
        rounds.append(results)
        print(f"round {k + 1}/{args.rounds}:")
        print("\n".join(round_table(impls, results)), flush=True)
    summary = summarize(impls, rounds)
    print("\n".join(summary_lines(impls, summary)))
    report = {
        "settings": {
            "env": args.env,
            "steps": args.steps,
            "learning_starts": args.learning_starts,
            "window_start": args.window_start,
            "rounds": args.rounds,
            "zoo_flags": args.zoo_flag,
            "zoo_variants": args.zoo_variant,
            "cleanrl_threads": args.cleanrl_threads,
            "zoo_argv": zoo_argv(args, Path("RUN_DIR"))[1:],
            "cleanrl_argv": cleanrl_argv(args)[1:] if args.cleanrl_python and args.cleanrl_script else None,
        },
        "machine": machine,
        "versions": versions,
        "version_mismatches": warnings,
        "rounds": rounds,
        "summary": summary,
    }
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "peers.md").write_text(markdown(report, impls))
        print(f"wrote {out / 'peers.json'} and {out / 'peers.md'}")
    return report


if __name__ == "__main__":
    main()
