import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import train as train_script  # noqa: E402


def test_unknown_agent_names_the_available_ones():
    with pytest.raises(SystemExit, match="unknown agent .dqn.; available agents: .*sac"):
        train_script.parse(["dqn", "--env", "Pendulum-v1"])


def test_bad_flag_is_reported_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        train_script.parse(["sac", "--env", "Pendulum-v1", "--critcs", "10"])
    assert e.value.code == 2
    assert "--critcs" in capsys.readouterr().err


def test_flags_reach_the_config():
    cfg = train_script.parse(["sac", "--env", "HalfCheetah-v5", "--seeds", "3", "--critics", "10", "--eta", "1.0",
                              "--network.width", "64", "--network.block", "simba", "--total-steps", "7"])
    assert (cfg.env, cfg.seeds, cfg.total_steps) == ("HalfCheetah-v5", 3, 7)
    assert (cfg.agent.critics, cfg.agent.eta) == (10, 1.0)
    assert (cfg.network.width, cfg.network.block) == (64, "simba")


@pytest.mark.slow
def test_unknown_env_id_fails_clearly_from_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "sac", "--env", "Nope-v3",
                          "--run-dir", str(tmp_path / "r")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0
    assert "unknown env id 'Nope-v3'" in out.stderr and "dmc:<domain>-<task>" in out.stderr


@pytest.mark.slow
def test_resume_refuses_config_changes(tiny_sac_config, tmp_path):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.offpolicy import train

    train(tiny_sac_config(total_steps=200), sac, tmp_path / "r")
    cfg = train_script.parse(["--resume", str(tmp_path / "r"), "--total-steps", "400"])
    assert cfg.total_steps == 400 and cfg.agent_name == "sac"
    cfg = train_script.parse(["--resume", str(tmp_path / "r"), "--plasticity.metrics-every", "0"])
    assert cfg.plasticity.metrics_every == 0  # the metrics hook only reads the state: it may be switched off
    with pytest.raises(SystemExit, match="cannot change agent.critics"):
        train_script.parse(["sac", "--resume", str(tmp_path / "r"), "--critics", "5"])
