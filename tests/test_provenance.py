"""config.json names the code and versions a run ran with, and every resume (training/provenance.py)."""

from __future__ import annotations

import json
import shutil
import subprocess

import jax
import pytest

from plasticity_zoo.agents import sac
from plasticity_zoo.training import config as config_lib
from plasticity_zoo.training import provenance as prov
from plasticity_zoo.training.config import RunConfig
from plasticity_zoo.training.logger import RunLogger


def test_provenance_names_the_commit_the_versions_and_the_device():
    p = prov.provenance(["train.py", "sac"])
    assert p["argv"] == ["train.py", "sac"] and p["device"]["platform"] == "cpu" and p["device"]["count"] >= 1
    assert p["versions"]["jax"] == jax.__version__ and "numpy" in p["versions"] and "python" in p["versions"]
    if shutil.which("git") and (prov.ROOT / ".git").exists():
        head = subprocess.run(
            ["git", "-C", str(prov.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        assert p["git"]["commit"] == head and isinstance(p["git"]["dirty"], bool)
    assert prov.git_state(prov.ROOT / "no-such-dir") == {"commit": None, "dirty": None}


def test_config_json_keeps_the_start_and_appends_each_resume_and_still_reads_as_flags(tmp_path):
    cfg = RunConfig(total_steps=1500, agent=sac.CONFIG())
    log = RunLogger(tmp_path)
    log.write_config(config_lib.to_json(cfg), {"time": "t0", "git": {"commit": "abc"}})
    log.record_resume(config_lib.to_json(RunConfig(total_steps=2000, agent=sac.CONFIG())), 1500, {"time": "t1"})
    log.record_resume(config_lib.to_json(RunConfig(total_steps=3000, agent=sac.CONFIG())), 2000, {"time": "t2"})
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["total_steps"] == 3000 and saved["provenance"] == {"time": "t0", "git": {"commit": "abc"}}
    assert saved["resumes"] == [
        {"step": 1500, "total_steps": 2000, "time": "t1"},
        {"step": 2000, "total_steps": 3000, "time": "t2"},
    ]
    back = config_lib.from_json(saved, sac.CONFIG)
    assert back.total_steps == 3000 and back.agent == cfg.agent
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then moved into place


def test_tensorboard_has_one_run_per_seed_with_untagged_names_and_the_flags_as_hparams(tmp_path):
    import pytest

    pytest.importorskip("tensorboardX")
    from plasticity_zoo.training.logger import hparams

    log = RunLogger(tmp_path, tensorboard=True)
    log.write_config(config_lib.to_json(RunConfig(agent=sac.CONFIG())))
    log.log_metrics(10, [{"losses/critic": 1.0}, {"losses/critic": 2.0}])
    log.log_eval(10, [[1.0, 3.0], [5.0]])
    assert log.last_eval == {0: 2.0, 1: 5.0}
    log.close()
    for j in (0, 1):  # seeds overlay in TensorBoard as the runs tb/seed0, tb/seed1
        assert list((tmp_path / "tb" / f"seed{j}").rglob("events.out.tfevents.*"))
    flat = hparams({"env": "Pendulum-v1", "agent": {"gamma": 0.99, "hidden": [256, 256]}, "x": None})
    assert flat == {"env": "Pendulum-v1", "agent.gamma": 0.99}


@pytest.mark.slow
def test_wandb_offline_writes_one_run_per_seed_with_config_metrics_and_commit(tiny_sac_config, tmp_path, monkeypatch):
    """``--wandb --wandb-mode offline`` with the real wandb package: nothing leaves the machine."""
    import pytest

    pytest.importorskip("wandb")
    from plasticity_zoo.training.run import run

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # not the user's ~/.config/wandb
    cfg = tiny_sac_config(
        total_steps=300,
        learning_starts=100,
        eval_every=300,
        eval_episodes=1,
        seeds=2,
        wandb=True,
        wandb_mode="offline",
        wandb_tags=("smoke",),
        run_dir=str(tmp_path / "r"),
    )
    run(cfg)
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["wandb"] and saved["wandb_tags"] == ["smoke"]
    runs = sorted((tmp_path / "r" / "wandb").glob("offline-run-*"), key=lambda d: d.name.split("-seed")[-1])
    assert len(runs) == 2  # one per seed
    for j, d in enumerate(runs):
        assert d.name.endswith(f"-seed{j}")
        # offline, the config and the history are records of the run's .wandb file (`wandb sync` uploads it);
        # their keys and string values are stored as UTF-8 in it
        data = b"".join(p.read_bytes() for p in d.glob("*.wandb"))
        for text in (
            "Pendulum-v1",
            "seed_index",
            "eval/return",
            "losses/critic",
            "smoke",
            saved["provenance"]["git"]["commit"] or "commit",
        ):
            assert text.encode() in data, (d.name, text)
    # evaluate.py --video on the tracked run: the video goes to seed 1's W&B run (continued, offline)
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "evaluate.py"
    spec = importlib.util.spec_from_file_location("evaluate_script", script)
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    gif = tmp_path / "pendulum.gif"
    out = evaluate.main([str(tmp_path / "r"), "--seed", "1", "--out", str(tmp_path / "e.csv"), "--video", str(gif)])
    later = [d for d in (tmp_path / "r" / "wandb").glob("offline-run-*-seed1") if d not in runs]
    assert len(later) == 1  # the same W&B run id as training's seed 1, continued
    media = list(later[0].rglob("media/videos/eval/video_*.gif"))
    assert len(media) == 1 and media[0].read_bytes() == gif.read_bytes()
    data = b"".join(p.read_bytes() for p in later[0].glob("*.wandb"))
    assert b"eval/video_return" in data and b"eval/video_step" in data and out["video"]["seed"] == 1
    nothing = tmp_path / "nothing"
    shutil.copytree(tmp_path / "r", nothing, ignore=shutil.ignore_patterns("wandb"))
    evaluate.main([str(nothing), "--seed", "1", "--out", str(tmp_path / "e2.csv"), "--video", str(gif), "--no-wandb"])
    assert not (nothing / "wandb").exists()
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[wandb\]', or pass --no-wandb"):
        evaluate.main([str(tmp_path / "r"), "--out", str(tmp_path / "e3.csv"), "--video", str(tmp_path / "v3.gif")])
    assert not (tmp_path / "e3.csv").exists() and not (tmp_path / "v3.gif").exists()


def test_wandb_without_the_package_is_one_clear_line_before_anything_is_created(tiny_sac_config, tmp_path, monkeypatch):
    import importlib.util

    import pytest

    from plasticity_zoo.training.run import preflight

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    with pytest.raises(SystemExit, match=r"--wandb needs the wandb package: pip install -e '\.\[wandb\]'"):
        preflight(tiny_sac_config(wandb=True, run_dir=str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()
