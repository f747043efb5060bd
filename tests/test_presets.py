"""--preset NAME: a paper's flags applied under the user's, stored in config.json, refused where they do not fit."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train as train_script  # noqa: E402

from plasticity_zoo import agents  # noqa: E402
from plasticity_zoo.training import config as config_lib  # noqa: E402
from plasticity_zoo.training.cli import parse  # noqa: E402
from plasticity_zoo.training.presets import PRESETS  # noqa: E402


def _value(cfg, flag: str):
    """The config value a flag name refers to, e.g. --plasticity.redo-tau -> cfg.plasticity.redo_tau."""
    name = flag[2:]
    obj = cfg
    if "." in name:
        group, name = name.split(".", 1)
        obj = getattr(cfg, group)
    name = name.replace("-", "_")
    for candidate in (cfg.agent, obj) if obj is cfg else (obj,):
        if hasattr(candidate, name):
            return getattr(candidate, name)
    raise AssertionError(f"no field for {flag}")


def _env_args(preset, agent):
    if agent == "ravl":
        return ["--dataset", "unused.hdf5"]
    return [
        "--env",
        {"dmc": "dmc:cartpole-balance", "playground": "playground:CartpoleBalance"}.get(
            preset.env_family, "Pendulum-v1"
        ),
    ]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_parses_for_its_agents_and_sets_its_flags(name):
    preset = PRESETS[name]
    for agent in preset.agents or ("sac", "mrq", "ppo"):
        cfg = parse([agent, "--preset", name, *_env_args(preset, agent)])
        assert cfg.preset == name
        flags = list(preset.flags)
        for i, flag in enumerate(flags):
            if not flag.startswith("--"):
                continue
            value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
            if value is None:  # a boolean switch: --x is True, --no-x / --group.no-x is False
                negated = flag.startswith("--no-") or ".no-" in flag
                plain = flag.replace("--no-", "--").replace(".no-", ".")
                assert _value(cfg, plain) is (not negated), (name, agent, flag)
            else:
                got = _value(cfg, flag)
                assert str(got) == value or float(got) == float(value), (name, agent, flag, got)


def test_user_flags_win_over_the_preset_and_presets_compose_in_order():
    cfg = parse(
        [
            "mrq",
            "--env",
            "dmc:cartpole-balance",
            "--preset",
            "mrq-dmc",
            "--total-steps",
            "2000",
            "--preset=redo-sokar",
            "--plasticity.redo-tau",
            "0.1",
        ]
    )
    assert cfg.total_steps == 2000 and cfg.action_repeat == 2 and cfg.eval_episodes == 10  # user, preset, preset
    assert cfg.plasticity.redo and cfg.plasticity.redo_tau == 0.1 and cfg.plasticity.reset_every == 1000
    assert cfg.preset == "mrq-dmc,redo-sokar"
    # later presets override earlier ones flag by flag
    cfg = parse(["sac", "--preset", "regrama-bro,regrama-sac"])
    assert cfg.plasticity.regrama_tau == 0.0 and cfg.plasticity.reset_max_fraction == 0.05


def test_the_preset_names_and_values_are_stored_in_config_json_and_read_back():
    cfg = parse(["sac", "--preset", "sigreg-rl", "--env", "Pendulum-v1"])
    d = json.loads(config_lib.dump(cfg))
    assert d["preset"] == "sigreg-rl" and d["plasticity"]["sigreg_coef"] == 0.2
    back = config_lib.from_json(d, agents.get("sac").CONFIG)
    assert back.preset == "sigreg-rl" and back.plasticity == cfg.plasticity


def test_no_preset_leaves_the_defaults_and_preset_none():
    import dataclasses

    plain = parse(["sac"])
    assert plain.preset is None
    undone = parse(["sac", "--preset", "ne-reference", "--plasticity.no-ne"])  # the user's flag undoes the preset's
    assert config_lib.to_json(dataclasses.replace(undone, preset=None)) == config_lib.to_json(plain)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sac", "--preset", "nope"], "unknown preset 'nope'; presets: mrq-gym"),
        (["sac", "--preset"], "--preset needs a name"),
        (["sac", "--preset", "mrq-gym"], "preset 'mrq-gym' is for mrq, not 'sac'"),
        (
            ["mrq", "--preset", "mrq-dmc", "--env", "Hopper-v5"],
            "is the DMC protocol; --env Hopper-v5 is not a dmc: env",
        ),
        (["mrq", "--preset", "mrq-gym", "--env", "dmc:cheetah-run"], "is not a Gymnasium env"),
        (["ppo", "--preset", "ppo-playground", "--env", "dmc:cheetah-run"], "is not a playground: env"),
    ],
)
def test_a_preset_that_does_not_exist_or_fit_is_refused_with_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        train_script.cli(argv + ["--run-dir", str(tmp_path / "r")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_preset_list_prints_every_preset_with_its_source(capsys):
    with pytest.raises(SystemExit) as e:
        train_script.cli(["--preset", "list"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for p in PRESETS.values():
        assert p.name in out and p.source in out


def test_resume_refuses_a_preset(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(config_lib.dump(parse(["sac"])))
    with pytest.raises(SystemExit, match="--resume cannot apply --preset redo-sokar"):
        parse(["--resume", str(run), "--preset", "redo-sokar"])
