"""--env <module>:<id>: an env a researcher's own package registers with Gymnasium on import (envs/wrappers.py:
import_env_module), trained, resumed, evaluated and reported from the package's directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

from plasticity_zoo.envs import make_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = """import gymnasium as gym

gym.register("ZooUserPendulum-v0", entry_point="gymnasium.envs.classic_control.pendulum:PendulumEnv",
             max_episode_steps=60)
gym.register("ZooUserCartPole-v0", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
             max_episode_steps=60)
"""


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "zoo_user_pkg").mkdir()
    (tmp_path / "zoo_user_pkg" / "__init__.py").write_text(PACKAGE)
    return tmp_path


@pytest.fixture
def user_project(tmp_path):
    """A researcher's project whose own packages are named like the zoo's folders: ``envs`` registers the env,
    ``training`` is theirs too.  The zoo is imported as ``plasticity_zoo.*``, so neither shadows it."""
    for pkg, text in (("envs", PACKAGE), ("training", "raise ImportError('the user\\'s own training package')\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(text)
    return tmp_path


def test_a_module_id_imports_the_module_and_makes_its_env_or_says_what_is_wrong(user_dir, monkeypatch):
    monkeypatch.chdir(user_dir)  # found in the current directory, as python -m would
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(user_dir))])
    env = make_env("zoo_user_pkg:ZooUserPendulum-v0", seed=3)
    assert isinstance(env.action_space, gym.spaces.Box) and env.observation_space.shape == (3,)
    assert env.unwrapped.max_torque == 2.0 and env.action_space.high[0] == 1.0  # actions rescaled onto +-2
    with pytest.raises(ValueError, match="cannot import module 'no_such_zoo_module'"):
        make_env("no_such_zoo_module:X-v0")
    with pytest.raises(
        ValueError, match="registers no env 'Nope-v0'; it registers ZooUserCartPole-v0, ZooUserPendulum-v0"
    ):
        make_env("zoo_user_pkg:Nope-v0")
    with pytest.raises(ValueError, match="Discrete action space"):
        make_env("zoo_user_pkg:ZooUserCartPole-v0")


@pytest.mark.slow
def test_a_users_env_trains_resumes_evaluates_and_reports_from_the_cli(user_project):
    env = {**os.environ}
    env.pop("PYTHONPATH", None)

    def cli(*args):
        out = subprocess.run(
            [sys.executable, *args], cwd=user_project, env=env, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    cli(
        str(ROOT / "scripts" / "train.py"),
        "sac",
        "--env",
        "envs:ZooUserPendulum-v0",
        "--total-steps",
        "200",
        "--learning-starts",
        "100",
        "--eval-every",
        "200",
        "--eval-episodes",
        "1",
        "--network.width",
        "16",
        "--no-progress",
        "--run-dir",
        "runs/u",
    )
    assert "done: 300 steps" in cli(
        str(ROOT / "scripts" / "train.py"), "--resume", "runs/u", "--total-steps", "300", "--no-progress"
    )
    assert "the same returns" in cli(str(ROOT / "scripts" / "evaluate.py"), "runs/u", "--episodes", "1")
    cli(str(ROOT / "scripts" / "report.py"), "runs/u", "--out", "rep")
    assert "envs:ZooUserPendulum-v0" in (user_project / "rep" / "report.md").read_text()
    bad = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "sac", "--env", "envs:Nope-v0", "--run-dir", "runs/bad"],
        cwd=user_project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].startswith("error: env 'envs:Nope-v0'")
    assert not (user_project / "runs" / "bad").exists()


@pytest.mark.slow
def test_a_sweep_over_a_users_env_runs_its_trial_where_the_sweep_was_started(user_dir):
    """The trial's train.py runs in the sweep's directory (``scripts/sweep.py: run_trial`` passes it, wherever
    Ray starts its workers), so the module is found there as on the command line."""
    pytest.importorskip("ray")
    (user_dir / "s.toml").write_text(
        'agents = ["sac"]\nenvs = ["zoo_user_pkg:ZooUserPendulum-v0"]\n[flags]\n"total-steps" = 200\n'
        '"learning-starts" = 100\n"eval-every" = 200\n"eval-episodes" = 1\n"network.width" = 16\n'
        '"plasticity.metrics-every" = 0\n[variants]\nnone = {}\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "sweep.py"),
            "s.toml",
            "--dir",
            "sweep",
            "--num-cpus",
            "1",
            "--refresh",
            "2",
        ],
        cwd=user_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (run,) = (user_dir / "sweep" / "runs").iterdir()
    assert run.name.startswith("zoo_user_pkg-ZooUserPendulum-v0__sac__none") and (run / "eval.csv").is_file()
