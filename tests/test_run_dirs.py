"""A run directory receives one run (issue #23 item 1), and what a stopped run leaves in it (item 7).

A new run into a directory that holds a run's files is refused without touching a byte or a
modification time, whether the old run has a checkpoint (``--resume`` continues it) or stopped
before its first one; ``--overwrite`` starts over after moving the old files, unchanged, into
``DIR/.replaced-<time>/``.  Runs claim their directory by creating config.json exclusively.
Then: Ctrl-C twice stops at once and keeps the last periodic checkpoint; the progress bar's last
line shows the final evaluation.
"""

import csv
import json
import os
import signal
import types
from pathlib import Path

import numpy as np
import pytest

from plasticity_zoo.training import checkpoint
from plasticity_zoo.training.run import claim, run

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(d: Path) -> dict:
    """Bytes (None for a folder) and modification time of ``d`` and of everything under it."""
    return {
        str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in [d, *sorted(d.rglob("*"))]
    }


def _old_run(d: Path, checkpoint_too=False) -> Path:
    """A sac run that logged rows and then died (before its first checkpoint unless ``checkpoint_too``)."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"agent_name": "sac", "env": "Pendulum-v1", "total_steps": 999}))
    (d / "metrics.csv").write_text("step,seed,perf/sps\n1000,0,250.0\n")
    (d / "eval.csv").write_text("step,seed,return_mean,return_std,episode_returns\n0,0,-1500.0,0.0,-1500.0\n")
    (d / "notes.txt").write_text("mine\n")
    if checkpoint_too:
        (d / "ckpt" / "step_000000001000").mkdir(parents=True)
    return d


@pytest.mark.parametrize("check", [True, False], ids=["preflight", "claim"])
def test_a_rerun_into_logs_without_a_checkpoint_is_refused_and_changes_no_file(tiny_sac_config, tmp_path, check):
    """The issue: the rerun exited 0, appended a second step-0 row to eval.csv and replaced config.json."""
    d = _old_run(tmp_path / "r")
    before = _snapshot(d)
    with pytest.raises(SystemExit) as refused:
        run(tiny_sac_config(run_dir=str(d)), check=check)
    message = str(refused.value.code)
    assert message.startswith(
        f"run directory {d} already holds a run that stopped before its first checkpoint "
        "(config.json, metrics.csv, eval.csv; nothing to resume): pass --overwrite to move "
        f"its files into {d}/.replaced-<time>/ and start a new run there"
    ), message
    assert _snapshot(d) == before


@pytest.mark.parametrize("check", [True, False], ids=["preflight", "claim"])
def test_a_new_run_into_a_directory_with_a_checkpoint_is_refused_naming_resume(tiny_sac_config, tmp_path, check):
    d = _old_run(tmp_path / "r", checkpoint_too=True)
    before = _snapshot(d)
    with pytest.raises(SystemExit, match=f"already holds a run; continue it with --resume {d}, or pass --overwrite"):
        run(tiny_sac_config(run_dir=str(d)), check=check)
    assert _snapshot(d) == before


def test_the_command_line_refuses_with_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    d = _old_run(tmp_path / "r")
    before = _snapshot(d)
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "sac", "--run-dir", str(d)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 2 and out.stderr.startswith("error: run directory") and "--overwrite" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert _snapshot(d) == before


@pytest.mark.slow
def test_overwrite_moves_the_old_run_aside_unchanged_and_starts_a_clean_one(tmp_path, capsys):
    from scripts.train import main

    d = _old_run(tmp_path / "r")
    (d / ".replaced-20000101-000000").mkdir()  # an earlier --overwrite: stays where it is
    (d / ".replaced-20000101-000000" / "eval.csv").write_text("step\n")
    old = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    out = main(
        [
            "sac",
            "--run-dir",
            str(d),
            "--overwrite",
            "--total-steps",
            "200",
            "--learning-starts",
            "100",
            "--eval-every",
            "100",
            "--eval-episodes",
            "1",
            "--log-every",
            "100",
            "--checkpoint-every",
            "200",
            "--network.width",
            "16",
            "--buffer-size",
            "500",
            "--batch-size",
            "16",
            "--no-progress",
        ]
    )
    assert out["step"] == 200
    moved = [p for p in d.iterdir() if p.name.startswith(".replaced-") and p.name != ".replaced-20000101-000000"]
    assert len(moved) == 1
    assert {p.name: p.read_bytes() for p in moved[0].iterdir()} == old  # every old file, byte for byte
    assert (
        f"--overwrite: moved the previous run's files (config.json, eval.csv, metrics.csv, notes.txt) into "
        f"{moved[0]}/" in capsys.readouterr().out
    )
    assert (d / ".replaced-20000101-000000" / "eval.csv").read_text() == "step\n"
    rows = list(csv.DictReader(open(d / "eval.csv")))
    assert [r["step"] for r in rows] == ["0", "100", "200"]  # one run's rows, not two
    assert json.loads((d / "config.json").read_text())["total_steps"] == 200
    assert not (d / "notes.txt").exists() and checkpoint.latest(d).name == "step_000000000200"


def test_overwrite_cannot_resume(tiny_sac_config, tmp_path):
    d = _old_run(tmp_path / "r", checkpoint_too=True)
    before = _snapshot(d)
    with pytest.raises(SystemExit, match="--overwrite starts a new run; it cannot be combined with --resume"):
        run(tiny_sac_config(resume=str(d)), overwrite=True)
    assert _snapshot(d) == before


def test_a_run_claims_its_directory_and_the_default_one_steps_aside(tiny_sac_config, tmp_path):
    """Two runs started in the same second share the default name (runs/<env>__<agent>__<seed>__<time>)."""
    cfg = tiny_sac_config()
    first, existed = claim(tmp_path / "runs" / "x", cfg, default=True)
    second, _ = claim(tmp_path / "runs" / "x", cfg, default=True)
    assert (first, second, existed) == (tmp_path / "runs" / "x", tmp_path / "runs" / "x-1", False)
    assert json.loads((first / "config.json").read_text())["total_steps"] == cfg.total_steps
    with pytest.raises(SystemExit, match="already holds a run"):  # a --run-dir given twice: the second is refused
        claim(tmp_path / "runs" / "x", cfg, default=False)


def test_a_user_error_in_the_loop_after_overwrite_keeps_the_moved_run_and_drops_the_empty_new_one(
    tiny_sac_config, tmp_path, monkeypatch
):
    from plasticity_zoo.training.logger import RunLogger
    from plasticity_zoo.training.loops import offpolicy

    def train(cfg, agent, run_dir, resume=False, stop_at=None):
        RunLogger(run_dir).write_config({"agent_name": cfg.agent_name})
        raise ValueError("--something does not apply")

    monkeypatch.setattr(offpolicy, "train", train)
    d = _old_run(tmp_path / "r")
    with pytest.raises(ValueError):
        run(tiny_sac_config(run_dir=str(d)), check=False, overwrite=True)
    (moved,) = d.iterdir()
    assert moved.name.startswith(".replaced-") and (moved / "notes.txt").read_text() == "mine\n"


def test_an_offline_run_without_env_is_named_after_its_dataset(tmp_path, monkeypatch):
    """train.py passes env None for an offline agent without --env: the default run directory (and the
    config.json written when it is claimed) name the dataset's env, not RunConfig's Pendulum-v1 default."""
    from plasticity_zoo.envs import datasets
    from plasticity_zoo.envs.collect import collect
    from plasticity_zoo.training.loops import offline
    from scripts.train import parse

    rng = np.random.default_rng(0)
    ds = collect("MountainCarContinuous-v0", lambda o: rng.uniform(-1, 1, (o.shape[0], 1)), 300, 0, record_state=False)
    datasets.save(tmp_path / "car.hdf5", ds)
    seen = {}
    monkeypatch.setattr(
        offline,
        "train",
        lambda cfg, agent, run_dir, resume, stop_at: seen.update(
            env=cfg.env, run_dir=run_dir, config=json.loads((run_dir / "config.json").read_text())
        ),
    )
    monkeypatch.chdir(tmp_path)
    cfg = parse(["ravl", "--dataset", str(tmp_path / "car.hdf5"), "--no-progress"])
    assert cfg.env is None
    run(cfg)
    assert seen["env"] == seen["config"]["env"] == "MountainCarContinuous-v0"
    assert seen["run_dir"].name.startswith("MountainCarContinuous-v0__ravl__0__")


# ----------------------------------------------------------------------------- stopping a run


class _Counting:
    """An iteration that counts steps and sends itself SIGINT: ``kill[step]`` times at ``step``, and once
    more from ``tree()`` (inside a checkpoint's save) at step ``kill_in_save``."""

    def __init__(self, kill, kill_in_save=None):
        import jax.numpy as jnp

        self.kill, self.kill_in_save, self.at, self.x = kill, kill_in_save, 0, jnp.zeros(3)

    def fresh(self):
        pass

    def tree(self):
        if self.at == self.kill_in_save:
            os.kill(os.getpid(), signal.SIGINT)
        return {"x": self.x}

    def host(self):
        return {}

    def eval_state(self):
        return self.x

    def step(self, at, room):
        from plasticity_zoo.training.driver import StepReport

        self.at = at + 1
        for _ in range(self.kill.get(self.at, 0)):
            os.kill(os.getpid(), signal.SIGINT)
        return StepReport(1, 1)


def _interrupted(cfg, run_dir, iteration, capsys):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.driver import Driver

    hooks = types.SimpleNamespace(host_state=lambda: {}, restore=lambda host: None)
    driver = Driver(cfg, sac, run_dir, hooks, evaluator=None)
    driver.evaluate = lambda step, state: 0.0  # (no policy to evaluate)
    driver.begin(iteration, resume=False)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        driver.run(iteration, cfg.total_steps, cfg.total_steps)
    assert signal.getsignal(signal.SIGINT) is handler  # the loop's handlers are gone
    return capsys.readouterr().out


def test_one_ctrl_c_checkpoints_at_the_end_of_the_iteration(tiny_sac_config, tmp_path, capsys):
    cfg = tiny_sac_config(total_steps=20, checkpoint_every=5)
    out = _interrupted(cfg, tmp_path / "r", _Counting({7: 1}), capsys)
    assert checkpoint.latest(tmp_path / "r").name == "step_000000000007"
    assert "saved a checkpoint at step 7" in out and f"--resume {tmp_path / 'r'}" in out


def test_a_second_ctrl_c_within_the_iteration_stops_at_once_keeping_the_periodic_checkpoint(
    tiny_sac_config, tmp_path, capsys
):
    cfg = tiny_sac_config(total_steps=20, checkpoint_every=5)
    out = _interrupted(cfg, tmp_path / "r", _Counting({7: 2}), capsys)
    assert checkpoint.latest(tmp_path / "r").name == "step_000000000005"
    assert f"the last checkpoint is {tmp_path / 'r' / 'ckpt' / 'step_000000000005'}" in out


def test_a_second_ctrl_c_during_the_stop_checkpoint_abandons_it_and_keeps_the_periodic_one(
    tiny_sac_config, tmp_path, capsys
):
    """What a second Ctrl-C meets in practice: one env step ends long before a person presses again, so
    it lands in the save that the first one asked for.  That save is atomic; the last periodic one stays."""
    cfg = tiny_sac_config(total_steps=20, checkpoint_every=5)
    out = _interrupted(cfg, tmp_path / "r", _Counting({7: 1}, kill_in_save=7), capsys)
    assert checkpoint.latest(tmp_path / "r").name == "step_000000000005"
    assert "stopped during the checkpoint at step 7; the last checkpoint is" in out
    assert f"continue with: python scripts/train.py --resume {tmp_path / 'r'}" in out


def test_an_evaluation_shows_on_the_progress_bar_at_once(tiny_sac_config, tmp_path):
    """Issue #23 item 7: during a run the bar's eval= showed an evaluation only at the next log row."""
    import jax.numpy as jnp

    from plasticity_zoo.training.driver import Driver

    agent = types.SimpleNamespace(act=lambda s, o, k, explore: o[..., :1])
    drv = Driver(tiny_sac_config(seeds=1), agent, tmp_path, hooks=None, evaluator=lambda policy: [[1.0, 3.0]])
    seen = []
    drv.bar = lambda step, *a, **k: seen.append((step, a, k))
    assert drv.evaluate(300, jnp.zeros(1)) == 2.0
    assert seen == [(300, (), {"ev": 2.0})]


def test_the_progress_bar_ends_showing_the_final_evaluation(tiny_sac_config, capsys):
    """Issue #23 item 7: the bar's eval= lagged one evaluation behind the final `done:` line."""
    from plasticity_zoo.training.loop import Schedule, finish, progress

    cfg = tiny_sac_config(total_steps=600, progress=True)
    bar = progress(cfg, 0)
    bar(600, 123.0, -300.0, -900.0)  # the last log row, before the final evaluation
    last = finish(Schedule(cfg), 600, 600, lambda step: -150.0, -900.0, bar, types.SimpleNamespace(close=lambda: None))
    err = capsys.readouterr().err
    assert last == -150.0
    assert err.rsplit("eval=", 1)[1].startswith("-150.0"), err


def test_the_progress_bar_shows_one_rate_that_of_its_own_count(tiny_sac_config, tmp_path, capsys):
    """Issue #47 item 8: the bar showed two rates that disagreed: tqdm's own (an average over its updates,
    in one seed's steps) and sps= (every seed's env steps per second over the last log interval).  It shows
    one: the rate of what it counts (one seed's steps, or an offline run's updates) since the last log row,
    and the time left at that rate; metrics.csv keeps perf/sps (all seeds)."""
    import time

    from plasticity_zoo.training.driver import Driver
    from plasticity_zoo.training.loop import Schedule, progress

    cfg = tiny_sac_config(seeds=3, total_steps=600, progress=True)
    agent = types.SimpleNamespace(act=lambda s, o, k, explore: o[..., :1])
    drv = Driver(cfg, agent, tmp_path, hooks=None, evaluator=lambda policy: [[1.0]] * 3)
    drv.schedule, seen = Schedule(cfg), []
    drv.bar = lambda step, *a, **k: seen.append((step, a))
    drv._t_log, drv._step_log = time.perf_counter() - 2.0, 0  # the last log row: 2 s ago, at step 0
    drv.advance(300 * 3)  # 300 env steps of each of the 3 seeds
    assert drv.log_if_due(300, None)
    ((step, (rate, _, _)),) = seen
    assert step == 300 and rate == pytest.approx(150.0, rel=0.05)  # one seed's 300 steps in 2 s
    sps = [float(r["perf/sps"]) for r in csv.DictReader(open(tmp_path / "metrics.csv"))]
    assert sps == pytest.approx([450.0] * 3, rel=0.05)  # the log's speed counts every seed
    bar = progress(cfg, 0)
    bar(300, 150.0, -3.0, -2.0)
    bar(None)
    shown = capsys.readouterr().err.split("\r")[-1]
    assert "300/600" in shown and "150 steps/s, 00:02 left, return=-3.0, eval=-2.0" in shown, shown
    assert shown.count("/s") == 1 and "sps" not in shown, shown  # no second rate (tqdm's step/s, it/s)
