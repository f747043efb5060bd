"""Fault drill: kill -9 training runs at random points, resume each to the end, compare with an uninterrupted run.

    python scripts/fault_drill.py --runs 35 --out /tmp/drill     # 5 trials per entry
    python scripts/fault_drill.py --runs 6 --agents sac ravl device

One entry in ``AGENTS`` per loop kind, each tiny and with several checkpoints in its run:

- ``sac``, ``mrq``: the host off-policy loop (Pendulum-v1);
- ``ppo``: the host on-policy loop (Pendulum-v1);
- ``ravl``, ``neubay``: the offline loop on a 5000-row uniform-random Hopper-v5 dataset the drill
  makes in ``--out`` (``make_dataset.py --kind random``, no SAC trained); the reference run fits
  the small world model once and caches it beside the dataset, the trials load it;
- ``device``: the device loop (PPO on ``playground:CartpoleBalance``, 8 envs; the first run
  compiles for about a minute on a CPU, later ones load the persistent compilation cache);
- ``mt``: multitask (MR.Q-MT, model size S, on ``mt:cartpole2``).

For each entry in ``--agents`` (default: all) one uninterrupted reference run; then ``--runs``
trials cycling over the entries and over two kill modes:

- ``ckpt``: SIGKILL as soon as a checkpoint write has begun (its ``ckpt/.tmp_*`` directory
  appears), so the kill lands inside the write;
- ``random``: SIGKILL at a random moment: once the run has logged a step drawn uniformly from
  5-95% of its length, after a further random 0-1 s (env steps, updates, evaluations and
  checkpoint writes alike; independent of the machine's speed).

Each killed run is continued with ``train.py --resume DIR`` (repeated if a resume is itself cut
short) and compared with its reference: every row of ``eval.csv`` and ``metrics.csv`` (timing
columns ``perf/*`` aside) and every array of the final checkpoint must be identical.  Steps lost
= the last step logged before the kill minus the step the resume started from (at most one
checkpoint interval when checkpoints work).  Exit code 1 if any trial differs.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(ROOT / "scripts" / "train.py")]
# the offline entries' dataset, made by the drill itself in --out (uniform-random Hopper, no SAC trained)
DATASET = "{out}/hopper-random.hdf5"
MAKE_DATASET = [sys.executable, str(ROOT / "scripts" / "make_dataset.py"), "--env", "Hopper-v5", "--kind", "random"]
DATASET_SIZE = 5000
PENDULUM = ["--env", "Pendulum-v1", "--no-progress", "--eval-episodes", "5", "--network.width", "32"]
# one entry per loop kind; offline --total-steps / --eval-every / --checkpoint-every / --log-every count updates
AGENTS = {
    # host off-policy
    "sac": [
        "sac",
        *PENDULUM,
        "--total-steps",
        "3000",
        "--learning-starts",
        "500",
        "--eval-every",
        "500",
        "--checkpoint-every",
        "400",
        "--log-every",
        "100",
        "--buffer-size",
        "100000",
    ],
    # host on-policy
    "ppo": [
        "ppo",
        *PENDULUM,
        "--total-steps",
        "8192",
        "--num-steps",
        "512",
        "--eval-every",
        "1024",
        "--checkpoint-every",
        "1024",
        "--log-every",
        "512",
    ],
    "mrq": [
        "mrq",
        *PENDULUM,
        "--total-steps",
        "1500",
        "--learning-starts",
        "300",
        "--eval-every",
        "300",
        "--checkpoint-every",
        "300",
        "--log-every",
        "100",
        "--buffer-size",
        "20000",
        "--batch-size",
        "32",
    ],
    # offline, RAVL: a 3-member ensemble fitted for 5 epochs by the reference run, cached beside the
    # dataset (<dataset>.dynamics-0.npz) and loaded by every trial
    "ravl": [
        "ravl",
        "--dataset",
        DATASET,
        "--no-progress",
        "--eval-episodes",
        "2",
        "--network.width",
        "32",
        "--total-steps",
        "4000",
        "--eval-every",
        "1000",
        "--checkpoint-every",
        "400",
        "--log-every",
        "100",
        "--critics",
        "3",
        "--batch-size",
        "32",
        "--rollout-batch",
        "100",
        "--horizon",
        "3",
        "--updates-per-epoch",
        "100",
        "--dynamics.members",
        "3",
        "--dynamics.elites",
        "2",
        "--dynamics.width",
        "32",
        "--dynamics.depth",
        "2",
        "--dynamics.min-epochs",
        "5",
        "--dynamics.max-epochs",
        "5",
        "--dynamics.batch-size",
        "128",
    ],
    # offline, NeuBay: a 4-member world model (<dataset>.neubay-0.npz) fitted once as for RAVL
    "neubay": [
        "neubay",
        "--dataset",
        DATASET,
        "--no-progress",
        "--eval-episodes",
        "2",
        "--total-steps",
        "2000",
        "--eval-every",
        "1000",
        "--checkpoint-every",
        "250",
        "--log-every",
        "100",
        "--critics",
        "4",
        "--head-width",
        "32",
        "--d-model",
        "32",
        "--d-hidden",
        "16",
        "--lru-layers",
        "1",
        "--encoder-lr",
        "1e-3",
        "--head-lr",
        "1e-3",
        "--real-weight",
        "0.5",
        "--tape-len",
        "128",
        "--rollout-batch",
        "8",
        "--planning-members",
        "3",
        "--max-horizon",
        "100",
        "--updates-per-epoch",
        "100",
        "--dynamics.members",
        "4",
        "--dynamics.elites",
        "3",
        "--dynamics.width",
        "32",
        "--dynamics.depth",
        "2",
        "--dynamics.weight-decay",
        "0",
        "0",
        "0",
        "--dynamics.max-epochs",
        "5",
        "--dynamics.batch-size",
        "128",
    ],
    # the device loop (PPO on a MuJoCo Playground env, chunks jitted whole); the first run compiles
    # (about a minute on a CPU), later processes load the persistent compilation cache
    "device": [
        "ppo",
        "--env",
        "playground:CartpoleBalance",
        "--loop",
        "device",
        "--no-progress",
        "--eval-episodes",
        "2",
        "--network.width",
        "32",
        "--num-envs",
        "8",
        "--num-steps",
        "16",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "1",
        "--total-steps",
        "2048",
        "--eval-every",
        "1024",
        "--checkpoint-every",
        "256",
        "--log-every",
        "128",
    ],
    # multitask: MR.Q-MT, model size S, on the two DMC cartpole tasks
    "mt": [
        "mrq-mt",
        "--env",
        "mt:cartpole2",
        "--model-size",
        "S",
        "--no-progress",
        "--eval-episodes",
        "1",
        "--batch-size",
        "32",
        "--learning-starts",
        "200",
        "--total-steps",
        "1000",
        "--eval-every",
        "500",
        "--checkpoint-every",
        "200",
        "--log-every",
        "100",
    ],
}


def command(agent: str, out: Path, run_dir: Path) -> list[str]:
    return TRAIN + [a.replace("{out}", str(out)) for a in AGENTS[agent]] + ["--run-dir", str(run_dir)]


def make_dataset(out: Path) -> int:
    """The offline entries' dataset, made once in --out; 0 when it exists or was made."""
    path = Path(DATASET.replace("{out}", str(out)))
    if path.exists():
        return 0
    return run(MAKE_DATASET + ["--size", str(DATASET_SIZE), "--out", str(path)], out / "dataset.log")


def run(args: list[str], log: Path) -> int:
    with open(log, "a") as f:
        return subprocess.call(args, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in csv.DictReader(f)]


def total_steps(agent: str) -> int:
    args = AGENTS[agent]
    return int(args[args.index("--total-steps") + 1])


def last_step(run_dir: Path) -> int:
    r = rows(run_dir / "metrics.csv")
    return int(r[-1]["step"]) if r else 0


def final_arrays(run_dir: Path) -> dict:
    ckpts = sorted((run_dir / "ckpt").glob("step_*"))
    with np.load(ckpts[-1] / "arrays.npz") as z:
        return {k: z[k] for k in z.files}


def differences(ref: Path, got: Path) -> list[str]:
    out = []
    for name in ("eval.csv", "metrics.csv"):
        a, b = rows(ref / name), rows(got / name)
        if a != b:
            bad = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(f"{name}: {len(a)} vs {len(b)} rows, first difference at row {bad}")
    a, b = final_arrays(ref), final_arrays(got)
    if a.keys() != b.keys():
        out.append("final checkpoint: different arrays")
    else:
        out += [f"final checkpoint: {k} differs" for k in a if not np.array_equal(a[k], b[k])]
    return out


def kill_during_checkpoint(proc: subprocess.Popen, run_dir: Path, skip: int) -> None:
    """SIGKILL once the (skip+1)-th checkpoint write has begun (a ckpt/.tmp_* directory exists)."""
    seen: set = set()
    while proc.poll() is None:
        tmp = [p.name for p in (run_dir / "ckpt").glob(".tmp_*")] if (run_dir / "ckpt").exists() else []
        new = [t for t in tmp if t not in seen]
        if new:
            if len(seen) >= skip:
                proc.send_signal(signal.SIGKILL)
                return
            seen.update(new)
        time.sleep(0.0005)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default="/tmp/fault-drill")
    p.add_argument("--agents", nargs="+", default=list(AGENTS), choices=list(AGENTS))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    if any("--dataset" in AGENTS[agent] for agent in a.agents) and make_dataset(out) != 0:
        print(f"making the dataset failed; see {out}/dataset.log")
        return 1
    refs = {}
    for agent in a.agents:
        refs[agent] = out / f"ref-{agent}"
        if not (refs[agent] / "done.json").exists():
            t0 = time.time()
            rc = run(command(agent, out, refs[agent]), out / f"ref-{agent}.log")
            if rc != 0:
                print(f"reference run {agent} failed (exit {rc}); see {out}/ref-{agent}.log")
                return 1
            (refs[agent] / "done.json").write_text(json.dumps({"wall_s": time.time() - t0}))
    failures = 0
    print("| trial | agent | kill | killed at step | resumed from step | steps lost | resumes | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for i in range(a.runs):
        agent = a.agents[i % len(a.agents)]
        mode = ("ckpt", "random")[(i // len(a.agents)) % 2]
        run_dir = out / f"trial-{i:02d}-{agent}-{mode}"
        log = out / f"trial-{i:02d}.log"
        for stale in (run_dir, log):
            if stale.exists():
                subprocess.call(["rm", "-rf", str(stale)])
        proc = subprocess.Popen(
            command(agent, out, run_dir),
            cwd=ROOT,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        if mode == "ckpt":
            kill_during_checkpoint(proc, run_dir, skip=rng.randrange(3))
        else:
            target = rng.uniform(0.05, 0.95) * total_steps(agent)
            while proc.poll() is None and last_step(run_dir) < target:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.0))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = last_step(run_dir)
        ckpts = sorted((run_dir / "ckpt").glob("step_*")) if (run_dir / "ckpt").exists() else []
        resumed_from = int(ckpts[-1].name.split("_")[1]) if ckpts else 0
        resumes = 0
        rc = proc.returncode
        while rc != 0 and resumes < 3:
            resumes += 1
            args = TRAIN + ["--resume", str(run_dir)] if ckpts else command(agent, out, run_dir) + ["--overwrite"]
            rc = run(args, log)
        diffs = differences(refs[agent], run_dir) if rc == 0 else [f"resume failed (exit {rc}); see {log}"]
        failures += bool(diffs)
        lost = max(0, killed_at - resumed_from)
        print(
            f"| {i} | {agent} | {mode} (exit {proc.returncode}) | {killed_at} | {resumed_from} | {lost} | "
            f"{resumes} | {'yes' if not diffs else 'NO: ' + '; '.join(diffs)} |",
            flush=True,
        )
    print(f"{a.runs - failures} of {a.runs} trials identical to the uninterrupted run")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
