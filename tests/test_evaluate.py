"""`python scripts/evaluate.py RUN_DIR` (issue #22, evaluate.py): a run's checkpoint evaluated again.

On the run's env it gives the same episode returns as the run's own evaluation at that step (eval.csv),
for every kind of loop (SAC, PPO with its observation normaliser and clipped actions, RAVL offline, a
non-stationary dmc: run that follows its schedule); ``--step`` and ``--seed`` select; videos have one
frame at the reset and one per agent step; mistakes give one ``error:`` line and exit status 2; the
run's own files are never written.  Runs are tiny (Pendulum / ToyReach / cartpole, width 16).
"""

import csv
import dataclasses
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "evaluate.py"
_spec = importlib.util.spec_from_file_location("evaluate_script", SCRIPT)
evaluate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(evaluate)
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV.pop("RLZOO_DEBUG", None)


def _sac_config(run_dir, **kw):
    """tests/conftest.py's tiny_sac_config (its shapes, so the compilations are shared), with two seeds."""
    from plasticity_zoo.agents.sac import SACConfig
    from plasticity_zoo.training.config import NetworkConfig, RunConfig

    agent = SACConfig(buffer_size=5000, batch_size=32, learning_starts=kw.pop("learning_starts", 200))
    base = dict(
        env="Pendulum-v1",
        total_steps=600,
        eval_every=300,
        eval_episodes=2,
        log_every=100,
        checkpoint_every=300,
        progress=False,
        network=NetworkConfig(width=16),
        agent_name="sac",
        agent=agent,
    )
    return RunConfig(**{**base, **kw}, run_dir=str(run_dir))


def _own_eval(run_dir, step=None) -> dict:
    """eval.csv at ``step`` (default: its last step) -> {seed: [episode returns]}."""
    rows = list(csv.DictReader(open(Path(run_dir) / "eval.csv")))
    step = max(int(r["step"]) for r in rows) if step is None else step
    return {int(r["seed"]): [float(x) for x in r["episode_returns"].split()] for r in rows if int(r["step"]) == step}


def _digest(run_dir) -> dict:
    """sha256 and modification time of the run's own files and of everything in its checkpoints."""
    d = Path(run_dir)
    files = [d / n for n in ("config.json", "eval.csv", "metrics.csv")] + sorted((d / "ckpt").rglob("*"))
    return {
        str(p.relative_to(d)): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None,
            p.stat().st_mtime_ns,
        )
        for p in files
    }


def _gif(path):
    """(frames, total duration in ms, size) of a GIF; Pillow merges identical consecutive frames, adding
    their durations, so the total duration counts every frame written."""
    from PIL import Image

    with Image.open(path) as im:
        total = 0
        for i in range(im.n_frames):
            im.seek(i)
            total += im.info["duration"]
        return im.n_frames, total, im.size


@pytest.fixture(scope="module")
def sac_run(tmp_path_factory):
    """SAC on Pendulum, 2 seeds, 600 steps: evaluations and checkpoints at steps 300 and 600."""
    from plasticity_zoo.training.run import run

    d = tmp_path_factory.mktemp("evaluate") / "sac"
    run(_sac_config(d, seeds=2, keep_checkpoints=3))
    assert evaluate_steps(d) == [300, 600]
    return d


def evaluate_steps(d):
    from plasticity_zoo.analysis.restore import checkpoint_steps

    return checkpoint_steps(d)


# ------------------------------------------------------------------------------------------- the returns
@pytest.mark.slow
def test_returns_are_the_runs_own_final_evaluation_and_the_run_is_not_written(sac_run, tmp_path, capsys):
    before = _digest(sac_run)
    out = evaluate.main([str(sac_run), "--out", str(tmp_path / "e.csv")])
    own = _own_eval(sac_run)
    assert out["step"] == 600 and out["seeds"] == [0, 1]
    assert out["returns"] == [own[0], own[1]]  # exact: the same program on the same inputs
    assert "the run's own evaluation at step 600 (eval.csv): the same returns" in capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "e.csv")))
    assert [(r["step"], r["seed"], r["env"]) for r in rows] == [
        ("600", "0", "Pendulum-v1"),
        ("600", "1", "Pendulum-v1"),
    ]
    eval_rows = [r for r in csv.DictReader(open(sac_run / "eval.csv")) if r["step"] == "600"]
    for mine, theirs in zip(rows, eval_rows):  # the same columns as eval.csv, written the same way
        assert [mine[k] for k in ("return_mean", "return_std", "episode_returns")] == [
            theirs[k] for k in ("return_mean", "return_std", "episode_returns")
        ]
    # the default output is RUN_DIR/evaluate.csv, appended to; nothing else in the run changes
    evaluate.main([str(sac_run), "--seed", "1"])
    evaluate.main([str(sac_run), "--seed", "1", "--episodes", "1"])
    rows = list(csv.DictReader(open(sac_run / "evaluate.csv")))
    assert [r["episode_returns"].count(" ") + 1 for r in rows] == [2, 1]
    assert [float(x) for x in rows[0]["episode_returns"].split()] == own[1]
    assert float(rows[1]["episode_returns"]) == own[1][0]  # episode k of a seed keeps its env seed
    assert _digest(sac_run) == before


def test_step_selects_that_checkpoint(sac_run, tmp_path):
    out = evaluate.main([str(sac_run), "--step", "300", "--seed", "1", "--out", str(tmp_path / "e.csv")])
    assert out["step"] == 300 and Path(out["checkpoint"]).name == "step_000000000300"
    assert out["returns"] == [_own_eval(sac_run, 300)[1]]
    assert out["returns"] != [_own_eval(sac_run, 600)[1]]


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(sac_run, tmp_path, capsys):
    d = tmp_path / "run"
    shutil.copytree(sac_run, d)
    arrays = d / "ckpt" / "step_000000000600" / "arrays.npz"
    blob = bytearray(arrays.read_bytes())
    blob[len(blob) // 2] ^= 1
    arrays.write_bytes(bytes(blob))
    out = evaluate.main([str(d), "--out", str(tmp_path / "e.csv")])
    assert out["step"] == 300 and out["returns"] == [_own_eval(d, 300)[0], _own_eval(d, 300)[1]]
    err = capsys.readouterr().err
    assert "warning: skipping checkpoint" in err and "sha256 mismatch" in err and "; evaluating " in err
    with pytest.raises(SystemExit) as e:
        evaluate.cli([str(d), "--step", "600", "--out", str(tmp_path / "e.csv")])
    assert e.value.code == 2 and "arrays.npz sha256 mismatch" in capsys.readouterr().err


@pytest.mark.slow
def test_ppo_evaluates_with_its_observation_normaliser_and_clipped_actions(tmp_path):
    from plasticity_zoo.training.run import run
    from tests import golden

    cfg = dataclasses.replace(golden.CASES["ppo_clip_actions"](tmp_path), run_dir=str(tmp_path / "ppo"))
    run(cfg)
    out = evaluate.main([str(tmp_path / "ppo"), "--out", str(tmp_path / "e.csv")])
    assert out["step"] == 512 and out["returns"] == [_own_eval(tmp_path / "ppo")[0]]


@pytest.mark.slow
def test_offline_ravl_evaluates_on_the_datasets_env(tmp_path):
    from plasticity_zoo.training.run import run
    from tests import golden

    cfg = dataclasses.replace(golden.CASES["ravl_toy"](tmp_path), run_dir=str(tmp_path / "ravl"))
    run(cfg)
    dataset = Path(cfg.agent.dataset)
    moved = dataset.rename(tmp_path / "elsewhere.hdf5")  # the checkpoint alone is enough: no dataset, no model
    out = evaluate.main([str(tmp_path / "ravl"), "--out", str(tmp_path / "e.csv")])
    assert moved.exists() and out["env"] == "ToyReach-v0"
    assert out["step"] == 300 and out["returns"] == [_own_eval(tmp_path / "ravl")[0]]


# ------------------------------------------------------------------------------------------- videos
def test_video_of_a_pendulum_episode_has_a_frame_per_step(sac_run, tmp_path):
    before = _digest(sac_run)
    gif = tmp_path / "v" / "pendulum.gif"
    out = evaluate.main(
        [str(sac_run), "--seed", "1", "--out", str(tmp_path / "e.csv"), "--video", str(gif), "--video-size", "64x48"]
    )
    v = out["video"]
    assert (v["steps"], v["frames"], v["seed"]) == (200, 201, 1)  # the reset and each of the 200 steps
    assert v["return"] == out["returns"][0][0] == _own_eval(sac_run)[1][0]  # the evaluation's own episode
    frames, ms, size = _gif(gif)
    assert size == (64, 48) and frames <= 201 and ms == 201 * 50  # real time: Pendulum's dt is 0.05 s
    assert _digest(sac_run) == before


def test_mp4_needs_imageio_ffmpeg_or_says_what_to_install(sac_run, tmp_path, monkeypatch, capsys):
    mp4 = tmp_path / "p.mp4"
    if importlib.util.find_spec("imageio_ffmpeg") is not None:
        import imageio_ffmpeg

        out = evaluate.main(
            [
                str(sac_run),
                "--out",
                str(tmp_path / "e.csv"),
                "--video",
                str(mp4),
                "--video-size",
                "64x48",
                "--fps",
                "50",
            ]
        )
        assert out["video"]["frames"] == 201
        assert imageio_ffmpeg.count_frames_and_secs(str(mp4))[0] == 201
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a)
    )
    with pytest.raises(SystemExit) as e:
        evaluate.cli([str(sac_run), "--out", str(tmp_path / "e.csv"), "--video", str(tmp_path / "q.mp4")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --video") and "pip install imageio imageio-ffmpeg" in err[0]
    assert not (tmp_path / "q.mp4").exists()


def _cli(args, tmp_path):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600
    )


def _rendered(done) -> bool:
    """False (the test skips) where MuJoCo has no OpenGL backend here: the script then says so and exits 2."""
    if done.returncode == 2 and "MuJoCo cannot render here" in done.stderr:
        return False
    assert done.returncode == 0, done.stderr
    return True


@pytest.mark.slow
def test_video_of_a_nonstationary_dmc_run_follows_its_schedule(tmp_path):
    """cartpole with an action repeat of 8: 1000 control steps are 125 agent steps (126 frames); the
    reward flips every 100 steps, and the run's last evaluation (step 300, phase 3) is flipped."""
    from plasticity_zoo.training.run import run

    d = tmp_path / "dmc"
    run(
        _sac_config(
            d,
            env="ns:reward_flip:dmc:cartpole-balance:term=all,every=100",
            action_repeat=8,
            total_steps=300,
            learning_starts=100,
            eval_episodes=1,
        )
    )
    own = _own_eval(d)[0]
    assert own[0] < 0  # flipped
    before = _digest(d)
    done = _cli([str(d), "--video", str(tmp_path / "cartpole.gif"), "--video-size", "64x48"], tmp_path)
    if not _rendered(done):
        pytest.skip(done.stderr)
    assert "the same returns" in done.stdout and "MUJOCO_GL=" in done.stdout
    row = list(csv.DictReader(open(d / "evaluate.csv")))[-1]
    assert [float(x) for x in row["episode_returns"].split()] == own
    frames, ms, size = _gif(tmp_path / "cartpole.gif")
    assert size == (64, 48) and ms == 126 * 80  # 12.5 fps: one frame per 8 x 0.01 s
    assert _digest(d) == before


@pytest.mark.slow
def test_video_of_a_gymnasium_mujoco_env(tmp_path):
    from plasticity_zoo.training.run import run

    d = tmp_path / "ip"
    run(
        _sac_config(
            d,
            env="InvertedPendulum-v5",
            total_steps=200,
            learning_starts=100,
            eval_every=200,
            eval_episodes=1,
            checkpoint_every=200,
        )
    )
    done = _cli([str(d), "--video", str(tmp_path / "ip.gif"), "--video-size", "64x48", "--fps", "10"], tmp_path)
    if not _rendered(done):
        pytest.skip(done.stderr)
    assert "the same returns" in done.stdout and "(evaluation:" not in done.stdout  # the video's return is the same
    steps = int(done.stdout.split(" steps, ")[0].rsplit(" ", 1)[1])  # the pole falls: the episode ends early
    assert f"{steps} steps, {steps + 1} frames at 10 fps" in done.stdout
    frames, ms, size = _gif(tmp_path / "ip.gif")
    assert size == (64, 48) and ms == (steps + 1) * 100


# ------------------------------------------------------------------------------------------- mistakes
def _config_only(tmp_path, sac_run):
    d = tmp_path / "fresh"
    d.mkdir()
    shutil.copy(sac_run / "config.json", d / "config.json")
    return d


CASES = {
    "no-such-dir": (lambda t, r: [str(t / "nope")], "no such run directory"),
    "not-a-run": (lambda t, r: [str(t)], "not a run directory (no config.json)"),
    "no-checkpoint": (lambda t, r: [str(_config_only(t, r))], "no checkpoint in"),
    "missing-step": (lambda t, r: [str(r), "--step", "123"], "no checkpoint at step 123; checkpoints: 300, 600"),
    "other-shapes": (
        lambda t, r: [str(r), "--env", "MountainCarContinuous-v0"],
        "--env MountainCarContinuous-v0 does not fit the run: its observations are (2,)",
    ),
    "unknown-env": (lambda t, r: [str(r), "--env", "Nope-v3"], "unknown env id 'Nope-v3'"),
    "seed-out-of-range": (lambda t, r: [str(r), "--seed", "2"], "--seed 2: the run has 2 seed(s)"),
    "no-episodes": (lambda t, r: [str(r), "--episodes", "0"], "--episodes must be >= 1"),
    "out-is-eval-csv": (lambda t, r: [str(r), "--out", str(r / "eval.csv")], "is the run's own eval.csv"),
    "out-not-a-file": (lambda t, r: [str(r), "--out", str(t)], "is not a regular file"),
    "video-in-ckpt": (
        lambda t, r: [str(r), "--video", str(r / "ckpt" / "v.gif")],
        "inside the run's checkpoint folder",
    ),
    "video-format": (lambda t, r: [str(r), "--video", str(t / "v.avi")], "write a .gif"),
    "video-size": (lambda t, r: [str(r), "--video", str(t / "v.gif"), "--video-size", "big"], "expected WIDTHxHEIGHT"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_mistake_is_one_error_line_and_exit_status_2(case, sac_run, tmp_path, capsys):
    argv, message = CASES[case]
    before = _digest(sac_run)
    with pytest.raises(SystemExit) as e:
        evaluate.cli(argv(tmp_path, sac_run))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert _digest(sac_run) == before and not (sac_run / "ckpt" / "v.gif").exists()


@pytest.mark.slow
def test_the_command_line_reports_a_mistake_without_a_traceback(tmp_path):
    done = _cli([str(tmp_path / "nope")], tmp_path)
    assert done.returncode == 2 and done.stderr == f"error: {tmp_path / 'nope'}: no such run directory\n"
