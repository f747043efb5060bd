"""`python scripts/train.py` with a mistaken command line: a short message naming the problem, a
non-zero exit, no traceback, and no run directory left behind (issue #17, command-line errors).

The cases all run in one module fixture, and every case is then its own test.  A few
(``IN_OWN_PROCESS``: no arguments, a tyro error, --help, the debug variable) run as their own
``train.py`` process; the rest run one after another through ``train.cli`` inside a single Python
process (``DRIVER``), as the script's ``__main__`` calls it, with their output captured and an
escaping exception printed as Python's top level would.  The errors come before any training or
compilation, so each separate process cost about one JAX import: 40 of them took 114 s of the suite.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "scripts" / "train.py")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV.pop("RLZOO_DEBUG", None)

RUN, DATA, GARBAGE, EMPTY = "{run}", "{data}", "{garbage}", "{empty}"
NOCONF, BADCONF, NOCKPT, HASCKPT, HASLOGS = "{noconf}", "{badconf}", "{nockpt}", "{hasckpt}", "{haslogs}"
DIRS = ("noconf", "badconf", "nockpt", "hasckpt", "haslogs")  # named by the commands: left exactly as they were

# id -> (argv, what the message must contain).  RUN is a fresh path that must not exist afterwards;
# the run directories given to --resume / --run-dir must be left exactly as they were.
CASES = {
    # what to train
    "no-arguments": ([], "no agent given"),
    "unknown-agent": (
        ["dqn", "--run-dir", RUN],
        "unknown agent 'dqn'; available agents: mrq, mrq-mt, neubay, ppo, ravl, sac",
    ),
    "flag-before-agent": (["--env", "Pendulum-v1", "--run-dir", RUN], "the first argument must be an agent (mrq"),
    # env ids
    "unknown-gymnasium-id": (["sac", "--env", "HalfCheetah-v99", "--run-dir", RUN], "unknown env id 'HalfCheetah-v99'"),
    "discrete-actions": (["sac", "--env", "CartPole-v1", "--run-dir", RUN], "has a Discrete action space"),
    "mt-unknown-suite": (["sac", "--env", "mt:dmc99", "--run-dir", RUN], "unknown multitask suite 'dmc99'"),
    "mt-envs-not-a-multiple": (
        ["sac", "--env", "mt:cartpole2", "--num-envs", "3", "--run-dir", RUN],
        "--num-envs must be a multiple of 2",
    ),
    "mt-agent-on-one-task": (
        ["mrq-mt", "--env", "dmc:cartpole-balance", "--run-dir", RUN],
        "mrq-mt needs a multitask env id",
    ),
    "dmc-without-task": (["sac", "--env", "dmc:cheetah", "--run-dir", RUN], "malformed Control Suite id 'dmc:cheetah'"),
    "dmc-unknown-task": (
        ["sac", "--env", "dmc:cheetah-fly", "--run-dir", RUN],
        "unknown Control Suite task dmc:cheetah-fly; valid tasks: dmc:acrobot-swingup",
    ),
    "ns-without-base": (
        ["sac", "--env", "ns:reward_flip", "--run-dir", RUN],
        "malformed non-stationary id 'ns:reward_flip': missing the base env",
    ),
    "ns-unknown-mode": (
        ["sac", "--env", "ns:bogus:Pendulum-v1", "--run-dir", RUN],
        "unknown non-stationary mode 'bogus'",
    ),
    "ns-chain-of-one": (
        ["sac", "--env", "ns:chain:Pendulum-v1", "--run-dir", RUN],
        "a chain needs at least two env ids",
    ),
    "ns-bad-option": (
        ["sac", "--env", "ns:reward_flip:Pendulum-v1:every=soon", "--run-dir", RUN],
        "option every='soon' must be an integer",
    ),
    # flags and values (tyro reports unknown flags and unparsable values itself)
    "unknown-flag": (["sac", "--total-step", "5", "--run-dir", RUN], "Unrecognized options: --total-step"),
    "not-an-integer": (["sac", "--seeds", "two", "--run-dir", RUN], "Error parsing --seeds"),
    "negative-total-steps": (["sac", "--total-steps", "-5", "--run-dir", RUN], "--total-steps must be >= 1, got -5"),
    "zero-seeds": (["sac", "--seeds", "0", "--run-dir", RUN], "--seeds must be >= 1, got 0"),
    "zero-eval-every": (["sac", "--eval-every", "0", "--run-dir", RUN], "--eval-every must be >= 1, got 0"),
    "zero-envs": (["ppo", "--num-envs", "0", "--run-dir", RUN], "--num-envs must be >= 1, got 0"),
    "ppo-minibatches-do-not-divide": (
        ["ppo", "--num-steps", "10", "--num-minibatches", "3", "--run-dir", RUN],
        "must be divisible by --num-minibatches 3",
    ),
    "ppo-shorter-than-a-rollout": (["ppo", "--total-steps", "100", "--run-dir", RUN], "is less than one rollout"),
    "mrq-option-below-one": (["mrq", "--enc-horizon", "0", "--run-dir", RUN], "--enc-horizon must be >= 1, got 0"),
    # values out of range, and values that cannot work together (issue #23 item 4)
    "sac-gamma-above-one": (["sac", "--gamma", "1.5", "--run-dir", RUN], "--gamma must be in [0, 1], got 1.5"),
    "mrq-gamma-negative": (["mrq", "--gamma", "-0.1", "--run-dir", RUN], "--gamma must be in [0, 1], got -0.1"),
    "ppo-gamma-above-one": (["ppo", "--gamma", "1.01", "--run-dir", RUN], "--gamma must be in [0, 1], got 1.01"),
    "ppo-gae-lambda-above-one": (
        ["ppo", "--gae-lambda", "1.5", "--run-dir", RUN],
        "--gae-lambda must be in [0, 1], got 1.5",
    ),
    "ravl-gamma-above-one": (
        ["ravl", "--dataset", DATA, "--gamma", "2", "--run-dir", RUN],
        "--gamma must be in [0, 1], got 2.0",
    ),
    "sac-batch-larger-than-buffer": (
        ["sac", "--batch-size", "512", "--buffer-size", "256", "--run-dir", RUN],
        "--batch-size 512 is larger than --buffer-size 256",
    ),
    "mrq-batch-larger-than-buffer": (
        ["mrq", "--buffer-size", "100", "--run-dir", RUN],
        "--batch-size 256 is larger than --buffer-size 100",
    ),
    "sac-zero-updates-per-step": (
        ["sac", "--updates-per-step", "0", "--run-dir", RUN],
        "--updates-per-step must be >= 1, got 0",
    ),
    "sac-negative-learning-starts": (
        ["sac", "--learning-starts", "-1", "--run-dir", RUN],
        "--learning-starts must be >= 0, got -1",
    ),
    "sac-learning-starts-beyond-total-steps": (
        ["sac", "--total-steps", "1000", "--learning-starts", "5000", "--run-dir", RUN],
        "--learning-starts 5000 is not below --total-steps 1000: the run "
        "would only take random actions and train nothing",
    ),
    "mrq-total-steps-within-learning-starts": (
        ["mrq", "--total-steps", "10000", "--run-dir", RUN],
        "--learning-starts 10000 is not below --total-steps 10000",
    ),
    # each config's RANGES table (issue #47 item 8: these were accepted)
    "sac-negative-actor-lr": (["sac", "--actor-lr", "-1", "--run-dir", RUN], "--actor-lr must be > 0, got -1.0"),
    "sac-tau-above-one": (["sac", "--tau", "2", "--run-dir", RUN], "--tau must be in (0, 1], got 2.0"),
    "sac-tau-zero": (["sac", "--tau", "0", "--run-dir", RUN], "--tau must be in (0, 1], got 0.0"),
    "sac-unreachable-target-entropy": (
        ["sac", "--target-entropy", "5", "--run-dir", RUN],
        "--target-entropy must be <= 0.6931 for a 1-dimensional action (1 x log 2: "
        "the entropy of the uniform distribution on [-1, 1]^1",
    ),
    "ppo-negative-learning-rate": (
        ["ppo", "--learning-rate", "-3e-4", "--run-dir", RUN],
        "--learning-rate must be > 0, got -0.0003",
    ),
    "ppo-negative-clip-coef": (["ppo", "--clip-coef", "-0.2", "--run-dir", RUN], "--clip-coef must be > 0, got -0.2"),
    "negative-redo-tau": (
        ["sac", "--plasticity.redo-tau", "-1", "--run-dir", RUN],
        "--plasticity.redo-tau must be in [0, 1), got -1.0",
    ),
    # interventions that do not apply
    "ppo-least": (["ppo", "--plasticity.least", "--run-dir", RUN], "--plasticity.least does not apply to agent 'ppo'"),
    "mrq-ne-with-review": (
        ["mrq", "--plasticity.ne", "--plasticity.ne-review", "--run-dir", RUN],
        "pass --plasticity.no-ne-review",
    ),
    "ravl-least": (
        ["ravl", "--dataset", DATA, "--plasticity.least", "--run-dir", RUN],
        "--plasticity.least does not apply to agent 'ravl'",
    ),
    "redo-and-regrama": (
        ["sac", "--plasticity.redo", "--plasticity.regrama", "--run-dir", RUN],
        "--plasticity.redo and --plasticity.regrama are alternatives",
    ),
    "sac-least-noise": (
        ["sac", "--plasticity.least", "--plasticity.least-noise-max", "0.1", "--run-dir", RUN],
        "--plasticity.least-noise-max does not apply to agent 'sac'",
    ),
    # offline datasets
    "ravl-no-dataset": (["ravl", "--run-dir", RUN], "give --dataset PATH or --env ENV --kind KIND"),
    "ravl-kind-without-env": (["ravl", "--kind", "medium", "--run-dir", RUN], "--kind needs --env"),
    # an explicit --env equal to RunConfig's default is given, not "missing" (issue #23 item 4)
    "ravl-kind-with-the-default-env": (
        ["ravl", "--env", "Pendulum-v1", "--kind", "medium", "--dataset-root", EMPTY, "--run-dir", RUN],
        "no medium dataset for Pendulum-v1",
    ),
    "ravl-missing-dataset": (
        ["ravl", "--dataset", "/nope.hdf5", "--run-dir", RUN],
        "--dataset /nope.hdf5: no such file",
    ),
    "ravl-not-hdf5": (["ravl", "--dataset", GARBAGE, "--run-dir", RUN], "unreadable or corrupt HDF5 file"),
    "ravl-option-below-one": (
        ["ravl", "--dataset", DATA, "--horizon", "0", "--run-dir", RUN],
        "--horizon must be >= 1, got 0",
    ),
    "ravl-steps-not-whole-epochs": (
        ["ravl", "--dataset", DATA, "--total-steps", "1500", "--run-dir", RUN],
        "must be a multiple of --updates-per-epoch (1000)",
    ),
    # resuming
    "resume-without-dir": (["--resume"], "--resume needs the run directory"),
    "resume-dir-without-config": (["--resume", NOCONF], "config.json not found (is this a run directory?)"),
    "resume-unreadable-config": (["--resume", BADCONF], "is not a readable run config"),
    "resume-without-checkpoint": (["--resume", NOCKPT, "--total-steps", "500"], "no checkpoint found"),
    "resume-as-another-agent": (["ppo", "--resume", NOCKPT], "that run trained 'sac', not 'ppo'"),
    "resume-with-overwrite": (
        ["--resume", HASCKPT, "--overwrite"],
        "--overwrite starts a new run; it cannot be combined with --resume",
    ),
    # a run directory receives one run (issue #23 item 1)
    "run-dir-holds-a-run": (["sac", "--run-dir", HASCKPT], "already holds a run; continue it with --resume"),
    "run-dir-holds-logs-without-a-checkpoint": (
        ["sac", "--run-dir", HASLOGS, "--total-steps", "500"],
        "already holds a run that stopped before its first checkpoint "
        "(config.json, metrics.csv, eval.csv; nothing to resume): pass "
        "--overwrite to move its files into",
    ),
    "run-dir-holds-only-a-config": (["ppo", "--run-dir", NOCKPT], "already holds a run that stopped before"),
}

# Not user errors of the command line: --debug / RLZOO_DEBUG=1 show the traceback, --help succeeds.
EXTRA = {
    "debug-flag": (["sac", "--seeds", "0", "--debug", "--run-dir", RUN], {}),
    "debug-env-var": (["dqn", "--run-dir", RUN], {"RLZOO_DEBUG": "1"}),
    "help": (["--help"], {}),
}


IN_OWN_PROCESS = {"no-arguments", "unknown-flag", "help", "debug-env-var"}
# Runs [key, argv] pairs (JSON on stdin) through train.cli in this one process; prints {key: [code, output]}.
DRIVER = """
import contextlib, io, json, sys, traceback
sys.path.insert(0, sys.argv[1])
import train
out = {}
for key, argv in json.load(sys.stdin):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            train.cli(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    out[key] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def _files(d: Path) -> dict:
    """Every entry under ``d``: its bytes (None for a folder) and its modification time."""
    return {
        str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(d.rglob("*"))
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run every case once; -> {id: (returncode, stdout + stderr, the RUN path)}."""
    base = tmp_path_factory.mktemp("cli_errors")
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script

    from plasticity_zoo.envs import datasets
    from plasticity_zoo.envs.collect import collect
    from plasticity_zoo.training.config import to_json

    data = base / "pendulum.hdf5"
    rng = np.random.default_rng(0)
    ds = collect("Pendulum-v1", lambda o: rng.uniform(-1, 1, (o.shape[0], 1)), 400, 0, record_state=False)
    ds.metadata.update({"env_id": "Pendulum-v1", "kind": "random"})
    datasets.save(data, ds)
    (base / "garbage.hdf5").write_bytes(b"this is not an HDF5 file\n" * 10)
    (base / "empty").mkdir()
    for name in DIRS:
        (base / name).mkdir()
    (base / "badconf" / "config.json").write_text("{not json")
    for name in ("nockpt", "hasckpt", "haslogs"):  # sac runs: stopped before a checkpoint / with one / with logs
        cfg = train_script.parse(["sac", "--run-dir", str(base / name)])
        (base / name / "config.json").write_text(json.dumps(to_json(cfg)))
    (base / "hasckpt" / "ckpt" / "step_000000001000").mkdir(parents=True)
    (base / "haslogs" / "metrics.csv").write_text("step,seed,perf/sps\n1000,0,250.0\n")
    (base / "haslogs" / "eval.csv").write_text(
        "step,seed,return_mean,return_std,episode_returns\n0,0,-1200.0,0.0,-1200.0\n"
    )
    subs = {
        DATA: str(data),
        GARBAGE: str(base / "garbage.hdf5"),
        EMPTY: str(base / "empty"),
        **{f"{{{name}}}": str(base / name) for name in DIRS},
    }
    before = {name: _files(base / name) for name in DIRS}

    def args(key, argv):
        return [str(base / "runs" / key) if a == RUN else subs.get(a, a) for a in argv]

    def own_process(item):
        key, (argv, extra_env) = item
        out = subprocess.run(
            [sys.executable, TRAIN, *args(key, argv)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**ENV, **extra_env},
            timeout=300,
        )
        return key, (out.returncode, out.stdout + out.stderr)

    def driven(items):
        out = subprocess.run(
            [sys.executable, "-c", DRIVER, str(ROOT / "scripts")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=ENV,
            timeout=600,
            input=json.dumps([[k, args(k, a)] for k, (a, _) in items]),
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return {k: tuple(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}

    items = [(k, (argv, {})) for k, (argv, _) in CASES.items()] + list(EXTRA.items())
    alone = [item for item in items if item[0] in IN_OWN_PROCESS]
    together = [item for item in items if item[0] not in IN_OWN_PROCESS]
    assert all(not extra_env for _, (_, extra_env) in together)
    with ThreadPoolExecutor(max_workers=len(alone) + 1) as pool:
        rest = pool.submit(driven, together)
        results = dict(pool.map(own_process, alone))
        results.update(rest.result())
    results = {k: (*v, base / "runs" / k) for k, v in results.items()}
    results["_unchanged"] = {name: _files(base / name) == files for name, files in before.items()}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_one_message_without_a_traceback_or_run_dir(outcomes, case):
    code, output, run_dir = outcomes[case]
    expected = CASES[case][1]
    assert code != 0, output
    assert "Traceback" not in output, output
    assert expected in output, output
    assert not run_dir.exists(), f"{run_dir} was created"
    if "Unrecognized" not in expected and "Error parsing" not in expected:  # tyro's own errors exit 2 as well
        assert code == 2 and "\nerror: " in "\n" + output, output


@pytest.mark.slow
def test_run_directories_named_by_the_command_are_left_alone(outcomes):
    """Bytes and modification times of every file (and folder) of each directory given to --resume or --run-dir."""
    assert outcomes["_unchanged"] == {name: True for name in DIRS}


@pytest.mark.slow
def test_debug_shows_the_traceback(outcomes):
    for case, error in (("debug-flag", "ValueError: --seeds must be >= 1"), ("debug-env-var", "unknown agent 'dqn'")):
        code, output, run_dir = outcomes[case]
        assert code != 0 and "Traceback" in output and error in output, output
        assert not run_dir.exists()


@pytest.mark.slow
def test_help_exits_zero_and_names_the_agents(outcomes):
    code, output, _ = outcomes["help"]
    assert code == 0, output
    assert "agents: mrq, mrq-mt, neubay, ppo, ravl, sac" in output and "--resume" in output


def test_at_least_25_bad_command_lines():
    assert len(CASES) >= 25


def test_a_non_finite_loss_stops_with_one_line_naming_it_and_exit_1(monkeypatch, capsys):
    """The NaN stop's own message (statistic, step, last good checkpoint), without a traceback."""
    from plasticity_zoo.training.loop import NonFiniteLossError

    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script

    def diverge(argv):
        raise NonFiniteLossError(
            "non-finite losses/critic at env step 350; training stopped, the last good "
            "checkpoint is runs/x/ckpt/step_000000000300"
        )

    monkeypatch.setattr(train_script, "main", diverge)
    with pytest.raises(SystemExit) as stop:
        train_script.cli(["sac"])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("stopped: non-finite losses/critic at env step 350") and "Traceback" not in err
    monkeypatch.setenv("RLZOO_DEBUG", "1")
    with pytest.raises(NonFiniteLossError):  # --debug / RLZOO_DEBUG: the exception itself
        train_script.cli(["sac"])


def test_the_nan_stop_names_the_loss_first_then_the_other_statistics(tmp_path):
    """Issue #23 item 7: the message began with whatever statistic came first by name (e.g.
    values/q_std_random) rather than the loss; now the losses/* entries come first."""
    from plasticity_zoo.training.loop import NonFiniteLossError, raise_non_finite

    nan = np.full(2, np.nan)
    metrics = {
        "charts/alpha": np.ones(2),
        "values/q_std_random": nan,
        "losses/critic": nan,
        "losses/actor": np.array([1.0, np.inf]),
        "losses/alpha": np.ones(2),
        "entropy": nan,
    }
    with pytest.raises(NonFiniteLossError) as stop:
        raise_non_finite(metrics, 350, tmp_path / "r")
    assert str(stop.value) == (
        "non-finite losses/actor at env step 350; also non-finite: losses/critic, "
        "entropy, values/q_std_random; training stopped, no checkpoint was written yet"
    )
    with pytest.raises(NonFiniteLossError, match=r"^non-finite values/q at update 7; training stopped"):
        raise_non_finite({"values/q": nan, "losses/critic": np.ones(2)}, 7, tmp_path / "r", unit="update")


def test_kron_without_psgdax_is_one_error_line_and_creates_nothing(monkeypatch, capsys, tmp_path):
    """Issue #47 item 8: without psgdax, --plasticity.kron printed a 41-line ImportError traceback (exit 1)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script

    monkeypatch.setitem(sys.modules, "psgdax", None)  # as if not installed: the import fails, find_spec finds none
    monkeypatch.delenv("RLZOO_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        train_script.cli(["sac", "--plasticity.kron", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --plasticity.kron needs psgdax: pip install 'plasticity-zoo[kron]'"), err
    assert not (tmp_path / "run").exists()


def test_every_config_range_names_its_flag_and_range_and_takes_its_ends():
    """The RANGES tables (networks.config.check_ranges): a value just outside is refused with the flag and
    the range, the ends a range includes are taken, None (the code's default) is not checked."""
    import dataclasses
    import math
    import re

    from plasticity_zoo import agents
    from plasticity_zoo.networks.config import Range, check_ranges, ranges_of
    from plasticity_zoo.plasticity.config import PlasticityConfig

    assert [
        str(r) for r in (Range(1), Range(0, low_open=True), Range(0, 1), Range(0, 1, high_open=True), Range(high=3))
    ] == [">= 1", "> 0", "in [0, 1]", "in [0, 1)", "<= 3"]
    configs = [agents.get(name).CONFIG() for name in sorted(agents.AGENTS)] + [PlasticityConfig()]
    checked = 0
    for cfg in configs:
        prefix = "--plasticity." if isinstance(cfg, PlasticityConfig) else "--"
        check_ranges(cfg, prefix)  # the defaults are valid
        for name, valid in ranges_of(cfg).items():
            flag = prefix + name.replace("_", "-")
            for end, is_open in ((valid.low, valid.low_open), (valid.high, valid.high_open)):
                if math.isinf(end):
                    continue
                check_ranges(
                    dataclasses.replace(cfg, **{name: end + (1e-9 if end == valid.low else -1e-9) if is_open else end}),
                    prefix,
                )
                outside = end - 0.5 if end == valid.low else end + 0.5
                with pytest.raises(ValueError, match="^" + re.escape(f"{flag} must be {valid}, got {outside}")):
                    check_ranges(dataclasses.replace(cfg, **{name: outside}), prefix)
                checked += 1
    assert checked >= 60
    sac = agents.get("sac")
    sac.check_target_entropy(-6.0, 6)
    sac.check_target_entropy(6 * math.log(2), 6)  # the uniform's entropy: the bound itself is taken
    with pytest.raises(ValueError, match=r"--target-entropy must be <= 4\.159 for a 6-dimensional action"):
        sac.check_target_entropy(4.2, 6)


def test_ravl_takes_an_explicit_env_equal_to_the_default(tmp_path):
    """Issue #23 item 4: ``--env Pendulum-v1`` (RunConfig's default) was taken as "not given"."""
    from plasticity_zoo.envs import datasets
    from plasticity_zoo.envs.collect import collect
    from plasticity_zoo.training.run import preflight

    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script

    rng = np.random.default_rng(0)
    ds = collect("Pendulum-v1", lambda o: rng.uniform(-1, 1, (o.shape[0], 1)), 300, 0, record_state=False)
    del ds.metadata["env_id"]  # a file that does not record its env
    datasets.save(tmp_path / "anon.hdf5", ds)
    cfg = train_script.parse(["ravl", "--dataset", str(tmp_path / "anon.hdf5")])
    with pytest.raises(SystemExit, match="does not record its environment: pass --env"):
        preflight(cfg)
    cfg = train_script.parse(["ravl", "--dataset", str(tmp_path / "anon.hdf5"), "--env", "Pendulum-v1"])
    assert cfg.env == "Pendulum-v1"
    preflight(cfg)  # no error: the env is given


# ----------------------------------------------------------------------------- the last safety net


def _failing_loop(monkeypatch, write_checkpoint=False):
    """Replace the off-policy loop by one that opens its run directory, then fails like a user error."""
    from plasticity_zoo.training.logger import RunLogger
    from plasticity_zoo.training.loops import offpolicy

    def train(cfg, agent, run_dir, resume=False, stop_at=None):
        logger = RunLogger(run_dir, cfg.tensorboard)
        logger.write_config({"agent_name": cfg.agent_name})
        if write_checkpoint:
            (Path(run_dir) / "ckpt" / "step_000000000001").mkdir(parents=True)
        raise ValueError("--something does not apply")

    monkeypatch.setattr(offpolicy, "train", train)


def _config(run_dir):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script

    return train_script.parse(["sac", "--run-dir", str(run_dir), "--no-progress"])


def test_a_user_error_inside_the_loop_removes_the_fresh_empty_run_dir(monkeypatch, tmp_path):
    from plasticity_zoo.training.run import run

    _failing_loop(monkeypatch)
    with pytest.raises(ValueError, match="does not apply"):
        run(_config(tmp_path / "run"), check=False)
    assert not (tmp_path / "run").exists()


def test_the_safety_net_keeps_checkpoints_and_directories_that_existed(monkeypatch, tmp_path):
    from plasticity_zoo.training.run import run

    _failing_loop(monkeypatch, write_checkpoint=True)
    with pytest.raises(ValueError):
        run(_config(tmp_path / "a"), check=False)
    assert (tmp_path / "a" / "ckpt").is_dir()
    _failing_loop(monkeypatch)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError):
        run(_config(tmp_path / "b"), check=False)
    assert (tmp_path / "b" / "notes.txt").read_text() == "mine"
