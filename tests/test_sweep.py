"""scripts/sweep.py: the grid a sweep expands to, its checks, and end-to-end runs on a local Ray.

The Ray tests run real train.py trials (SAC on Pendulum-v1, a few hundred steps, 16-unit
networks) as Ray tasks on a 2-CPU local Ray: a 2 x 2 sweep end to end (and its report), a sweep
interrupted mid-way and run again (finished trials are skipped, the interrupted one resumes from
its checkpoint), and a failing trial that is retried and then reported.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plasticity_zoo.training import checkpoint
from plasticity_zoo.training import sweep as sw

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "scripts" / "sweep.py"
TINY = {
    "total-steps": 300,
    "learning-starts": 100,
    "eval-every": 150,
    "eval-episodes": 1,
    "checkpoint-every": 150,
    "network.width": 16,
    "plasticity.metrics-every": 0,
}


def _spec(**kw):
    d = {"agents": ["sac"], "envs": ["Pendulum-v1"], "flags": dict(TINY)}
    d.update(kw)
    return sw.make_spec(d)


def test_a_sweep_expands_to_agents_x_envs_x_variants_x_grid_x_seed_groups():
    spec = _spec(
        agents=["sac", "mrq"],
        envs=["Pendulum-v1", "dmc:cartpole-balance"],
        seeds=5,
        seeds_per_trial=2,
        variants={"none": {}, "redo": {"preset": "redo-sokar"}},
        grid={"tau": [0.005, 0.01]},
    )
    trials = sw.expand(spec)
    assert len(trials) == 2 * 2 * 2 * 2 * 3  # seeds 5 in groups of 2: (0, 1), (2, 3), (4)
    assert len({t.name for t in trials}) == len(trials)
    groups = [
        (t.seed, t.seeds)
        for t in trials
        if t.agent == "sac" and t.env == "Pendulum-v1" and t.label == "sac none,tau=0.005"
    ]
    assert groups == [(0, 2), (2, 2), (4, 1)]
    t = next(
        t
        for t in trials
        if t.agent == "mrq" and t.env == "Pendulum-v1" and t.label == "mrq redo,tau=0.01" and t.seed == 4
    )
    argv = list(t.argv)
    assert argv[:9] == ["mrq", "--env", "Pendulum-v1", "--seeds", "1", "--seed", "4", "--label", "mrq redo,tau=0.01"]
    assert argv[argv.index("--preset") + 1] == "redo-sokar" and argv[argv.index("--tau") + 1] == "0.01"
    assert t.name == "Pendulum-v1__mrq__redo-tau=0.01__seed4"
    assert argv[argv.index("--total-steps") + 1] == "300"


def test_flags_become_train_py_arguments():
    assert sw.to_args(
        {
            "plasticity.redo": True,
            "plasticity.ne": False,
            "edac-init": False,
            "seeds": None,
            "critics": 10,
            "preset": ["redo-sokar", "sigreg-rl"],
            "lr_list": [1, 2],
        }
    ) == [
        "--plasticity.redo",
        "--plasticity.no-ne",
        "--no-edac-init",
        "--critics",
        "10",
        "--preset",
        "redo-sokar,sigreg-rl",
        "--lr-list",
        "1",
        "2",
    ]


def test_the_base_seed_and_the_agent_flags_reach_only_their_trials():
    spec = _spec(
        agents=["sac", "ppo"],
        flags={**TINY, "seed": 10},
        seeds=2,
        agent_flags={"sac": {"critics": 3}, "ppo": {"num-steps": 64}},
    )
    for t in sw.expand(spec):
        argv = list(t.argv)
        assert argv[argv.index("--seed") + 1] == "10" and "--seeds" in argv
        assert ("--critics" in argv) == (t.agent == "sac") and ("--num-steps" in argv) == (t.agent == "ppo")


@pytest.mark.parametrize(
    "d, message",
    [
        ({"agents": ["sac"], "envs": ["Pendulum-v1"], "seed": 3}, "unknown sweep keys ['seed']"),
        ({"agents": [], "envs": ["Pendulum-v1"]}, "'agents' must be a non-empty list"),
        ({"agents": ["sac"], "envs": ["Pendulum-v1"], "seeds": 0}, "'seeds' must be an integer >= 1"),
        ({"agents": ["sac"], "envs": ["Pendulum-v1"], "flags": {"run-dir": "x"}}, "the sweep sets --run-dir itself"),
        (
            {"agents": ["sac"], "envs": ["Pendulum-v1"], "grid": {"critics": []}},
            "grid.critics must be a non-empty list",
        ),
        ({"agents": ["sac"], "envs": ["Pendulum-v1"], "variants": {"a b": {}}}, "variant name 'a b'"),
        ({"agents": ["sac"], "envs": ["Pendulum-v1"], "agent_flags": {"ppo": {}}}, "'ppo' is not among"),
        ({"agents": ["sac"], "envs": ["Pendulum-v1"], "gpus_per_trial": 1.5}, "whole GPUs"),
    ],
)
def test_a_malformed_sweep_is_refused(d, message):
    with pytest.raises(sw.SweepError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        sw.make_spec(d)


def test_a_sweep_directory_refuses_a_trial_whose_command_changed(tmp_path):
    ledger = sw.Ledger(tmp_path / "s")
    trials = sw.expand(_spec())
    ledger.record(trials, {})
    ledger.check_compatible(trials)  # the same sweep again: fine
    more = sw.expand(_spec(variants={"base": {}, "other": {"critics": 3}}))
    ledger.check_compatible(more)  # a new trial beside the old ones: fine
    changed = sw.expand(_spec(flags={**TINY, "total-steps": 400}))
    with pytest.raises(sw.SweepError, match="already holds trial Pendulum-v1__sac__base__seed0 with other flags"):
        ledger.check_compatible(changed)


def _cli(args, **kw):
    env = dict(os.environ, RLZOO_DEBUG="0")
    return subprocess.run([sys.executable, str(SWEEP), *args], capture_output=True, text=True, env=env, cwd=ROOT, **kw)


def _write_spec(path: Path, variants: str, extra: str = "", flags=TINY) -> Path:
    lines = ['agents = ["sac"]', extra, "[flags]"]
    lines += [f'"{k}" = {json.dumps(v)}' for k, v in flags.items()]
    path.write_text("\n".join(lines) + "\n[variants]\n" + variants)
    return path


def _cli_in_process(args, capsys, monkeypatch):
    """scripts/sweep.py's command line called in this process (its ``cli``: the exit status, the
    error line), as ``_cli`` runs it, without a new Python's start: (returncode, stdout, stderr)."""
    import importlib.util

    monkeypatch.setenv("RLZOO_DEBUG", "0")
    spec = importlib.util.spec_from_file_location("sweep_script", SWEEP)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        script.cli(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize(
    "variants, message, in_a_subprocess",
    [
        ('none = {}\nbad = { "critcs" = 3 }\n', "trial Pendulum-v1__sac__bad__seed0: train.py", True),
        ('none = {}\nbad = { "gamma" = 1.5 }\n', "trial Pendulum-v1__sac__bad__seed0: ", False),
        ('none = { preset = "nope" }\n', "unknown preset 'nope'", False),
    ],
)
@pytest.mark.slow
def test_a_sweep_with_a_bad_trial_is_refused_before_anything_is_created(
    tmp_path, variants, message, in_a_subprocess, capsys, monkeypatch
):
    """The first case runs scripts/sweep.py as a command; the others call its command line in this
    process (the same refusal path, without a Python start each)."""
    spec = _write_spec(tmp_path / "s.toml", variants, 'envs = ["Pendulum-v1"]')
    args = [str(spec), "--dir", str(tmp_path / "sweep")]
    if in_a_subprocess:
        out = _cli(args)
    else:
        out = subprocess.CompletedProcess(args, *_cli_in_process(args, capsys, monkeypatch))
    assert out.returncode == 2, out.stderr
    assert "error: " in out.stderr and message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_an_unknown_env_is_refused_naming_the_trial(tmp_path):
    out = _cli(
        ["--dir", str(tmp_path / "sweep"), "--agents", "sac", "--envs", "Pendulum-v1", "NoSuchEnv-v0", "--dry-run"]
    )
    assert out.returncode == 2 and "trial NoSuchEnv-v0__sac__base__seed0" in out.stderr, out.stderr
    assert not (tmp_path / "sweep").exists()


def _eval_rows(run_dir):
    with open(Path(run_dir) / "eval.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_sweep_runs_end_to_end_on_a_local_ray_and_a_rerun_skips_it(tmp_path):
    """Two variants of one env, two trials side by side on a local Ray (the expansion over agents, envs,
    variants, grid and seeds is checked above without Ray)."""
    pytest.importorskip("ray")
    spec = _write_spec(
        tmp_path / "s.toml",
        'none = {}\nredo = { preset = "redo-sokar", "plasticity.reset-every" = 50 }\n',
        'envs = ["Pendulum-v1"]\ncpus_per_trial = 1',
    )
    d = tmp_path / "sweep"
    out = _cli([str(spec), "--dir", str(d), "--num-cpus", "2", "--refresh", "2"], timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all 2 trials finished" in out.stdout
    names = sorted(p.name for p in (d / "runs").iterdir())
    assert names == sorted(f"Pendulum-v1__sac__{v}__seed0" for v in ("none", "redo"))
    for name in names:
        cfg = json.loads((d / "runs" / name / "config.json").read_text())
        assert cfg["label"] == name.split("__")[2] and cfg["total_steps"] == 300
        assert (cfg["plasticity"]["redo"], cfg["preset"]) == ((True, "redo-sokar") if "redo" in name else (False, None))
        assert max(int(r["step"]) for r in _eval_rows(d / "runs" / name)) == 300
        assert json.loads((d / "status" / f"{name}.json").read_text())["state"] == "done"
    stamps = {n: (d / "runs" / n / "eval.csv").stat().st_mtime_ns for n in names}
    again = _cli([str(spec), "--dir", str(d)], timeout=300)
    assert again.returncode == 0 and "2 finished before, 0 to run" in again.stdout, again.stdout + again.stderr
    assert stamps == {n: (d / "runs" / n / "eval.csv").stat().st_mtime_ns for n in names}
    report = ROOT / "scripts" / "report.py"
    if report.exists():  # the sweep's report: one figure and table over its runs
        rep = subprocess.run(
            [sys.executable, str(report), str(d), "--out", str(tmp_path / "report")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert rep.returncode == 0, rep.stdout + rep.stderr
        assert (tmp_path / "report" / "report.md").is_file()


@pytest.mark.slow
def test_a_sweep_interrupted_midway_resumes_the_interrupted_trial_and_skips_the_finished_one(tmp_path):
    pytest.importorskip("ray")
    # the long trial is interrupted after its first checkpoint (500 steps), 1500 steps before its end
    flags = {**TINY, "total-steps": 2000, "checkpoint-every": 500, "eval-every": 1000}
    spec = _write_spec(
        tmp_path / "s.toml",
        'a = { "total-steps" = 300, "checkpoint-every" = 150, "eval-every" = 150 }\nb = {}\n',
        'envs = ["Pendulum-v1"]',
        flags,
    )
    d = tmp_path / "sweep"
    args = [
        sys.executable,
        str(SWEEP),
        str(spec),
        "--dir",
        str(d),
        "--num-cpus",
        "2",
        "--max-concurrent",
        "1",
        "--refresh",
        "1",
    ]
    # Ctrl-C's default action in the sweep, whatever this process inherited: a suite started in the
    # background from a non-interactive shell runs with SIGINT ignored, and children keep that.  The
    # child sets it itself before running the script: a preexec_fn would run Python between fork and
    # exec of this multithreaded process (JAX's threads), which can deadlock.
    interruptible = [
        sys.executable,
        "-c",
        "import runpy, signal, sys; "
        "signal.signal(signal.SIGINT, signal.default_int_handler); sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')",
        *args[1:],
    ]
    proc = subprocess.Popen(interruptible, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    short, long = "Pendulum-v1__sac__a__seed0", "Pendulum-v1__sac__b__seed0"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if checkpoint.latest(d / "runs" / long) is not None:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the sweep ended before the long trial's first checkpoint:\n" + proc.stdout.read()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 130, out
    assert json.loads((d / "status" / f"{short}.json").read_text())["state"] == "done"
    assert json.loads((d / "status" / f"{long}.json").read_text())["state"] == "interrupted"
    saved = checkpoint.latest(d / "runs" / long)
    assert saved is not None
    stamp = (d / "runs" / short / "eval.csv").stat().st_mtime_ns

    again = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 finished before, 1 to run" in again.stdout
    assert (d / "runs" / short / "eval.csv").stat().st_mtime_ns == stamp  # not run again
    log = (d / "logs" / f"{long}.log").read_text()
    assert f"train.py --resume {d / 'runs' / long}" in log and "resumed " in log
    assert max(int(r["step"]) for r in _eval_rows(d / "runs" / long)) == 2000
    assert not list((d / "runs" / long).glob(".replaced-*"))  # resumed, not started over


@pytest.mark.slow
def test_a_failing_trial_is_retried_then_reported_with_its_log(tmp_path):
    pytest.importorskip("ray")
    spec = _write_spec(
        tmp_path / "s.toml", 'diverges = { "critic-lr" = 1e30 }\n', 'envs = ["Pendulum-v1"]\nretries = 1'
    )
    d = tmp_path / "sweep"
    out = _cli([str(spec), "--dir", str(d), "--num-cpus", "2"], timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    name = "Pendulum-v1__sac__diverges__seed0"
    assert f"{name} failed (exit status 1); retry 1 of 1" in out.stdout
    assert f"{name} FAILED after 2 tries (exit status 1)" in out.stdout
    assert "non-finite" in out.stdout  # the log's tail, shown with the report
    status = json.loads((d / "status" / f"{name}.json").read_text())
    assert status["state"] == "failed" and status["attempts"] == 2 and status["returncode"] == 1
    assert (d / "logs" / f"{name}.log").read_text().count("=== ") == 2


@pytest.mark.slow
def test_a_trial_asking_for_more_than_the_cluster_has_is_refused_instead_of_waiting_forever(tmp_path):
    pytest.importorskip("ray")
    spec = _write_spec(tmp_path / "s.toml", "none = {}\n", 'envs = ["Pendulum-v1"]\ngpus_per_trial = 1')
    out = _cli([str(spec), "--dir", str(tmp_path / "sweep"), "--num-cpus", "1", "--num-gpus", "0"], timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "error: a trial asks for 1 CPUs and 1 GPUs, but the Ray cluster has 1 CPUs and 0 GPUs" in out.stderr
    assert not (tmp_path / "sweep" / "sweep.json").exists()
