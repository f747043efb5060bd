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
    cfg = train_script.parse(
        [
            "sac",
            "--env",
            "HalfCheetah-v5",
            "--seeds",
            "3",
            "--critics",
            "10",
            "--eta",
            "1.0",
            "--network.width",
            "64",
            "--network.block",
            "simba",
            "--total-steps",
            "7",
        ]
    )
    assert (cfg.env, cfg.seeds, cfg.total_steps) == ("HalfCheetah-v5", 3, 7)
    assert (cfg.agent.critics, cfg.agent.eta) == (10, 1.0)
    assert (cfg.network.width, cfg.network.block) == (64, "simba")


@pytest.mark.slow
def test_unknown_env_id_fails_clearly_from_the_command_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            "sac",
            "--env",
            "Nope-v3",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert "unknown env id 'Nope-v3'" in out.stderr and "dmc:<domain>-<task>" in out.stderr


@pytest.mark.slow
def test_resume_refuses_config_changes(tiny_sac_config, tmp_path):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.loops.offpolicy import train

    train(tiny_sac_config(total_steps=200), sac, tmp_path / "r")
    cfg = train_script.parse(["--resume", str(tmp_path / "r"), "--total-steps", "400"])
    assert cfg.total_steps == 400 and cfg.agent_name == "sac"
    cfg = train_script.parse(["--resume", str(tmp_path / "r"), "--plasticity.metrics-every", "0"])
    assert cfg.plasticity.metrics_every == 0  # the metrics hook only reads the state: it may be switched off
    with pytest.raises(SystemExit, match="cannot change agent.critics"):
        train_script.parse(["sac", "--resume", str(tmp_path / "r"), "--critics", "5"])


def test_network_layer_norm_is_a_switch_and_unset_keeps_the_agents_default():
    """Issue #47 item 8: the README's `--network.block multiskip --network.layer-norm` failed with
    "Missing value" (the flag wanted True/False/None)."""
    on = train_script.parse(["sac", "--network.block", "multiskip", "--network.layer-norm"])
    off = train_script.parse(["mrq", "--network.no-layer-norm"])
    assert (on.network.block, on.network.layer_norm, off.network.layer_norm) == ("multiskip", True, False)
    assert train_script.parse(["mrq"]).network.layer_norm is None  # MR.Q's own LayerNorm stays


def _help_text(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        train_script.parse(argv)
    assert e.value.code in (0, None)
    return " ".join(capsys.readouterr().out.replace("│", " ").split())  # tyro's boxes and line breaks out


def test_agent_help_mentions_presets_and_every_env_id_form(capsys):
    """Issue #47 item 8: `train.py sac --help` never mentioned --preset, and --env's help omitted ns: and mt:."""
    text = _help_text(capsys, ["sac", "--help"])
    for part in (
        "--preset NAME",
        "--preset list",
        "dmc:<domain>-<task>",
        "playground:<Name>",
        "mt:<suite>",
        "mt:<id>,<id>,...",
        "ns:<mode>:<env id>",
        "<module>:<id>",
    ):
        assert part in text, part


def test_benchmark_offers_only_the_agents_it_times_and_points_ppo_to_its_own(capsys):
    """Issue #47 item 8: `benchmark.py --agent ppo`, offered by its --help, ended in an AttributeError."""
    import importlib.util

    from plasticity_zoo import agents

    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    timed = bench.timed_agents()
    assert "sac" in timed and "ppo" not in timed and "mrq-mt" not in timed
    assert all(agents.get(name).KIND == "offpolicy" for name in timed)
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "--agent {" + ",".join(timed) + "}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench.main(["--agent", "ppo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            ": error: argument --agent: 'ppo' is not timed here (PPO's benchmark "
            f"is scripts/benchmark_ppo.py); choose from {', '.join(timed)}"
        )
    )
