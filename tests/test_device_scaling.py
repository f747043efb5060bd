"""Many envs on the device: updates per vector step independent of the env count
(``--updates-per-vector-step``), a schedule that never lags behind large iterations, and the presets
that run Playground's and FastSAC's settings (issue #50)."""

import ast
import csv
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import sac
from plasticity_zoo.training.config import NetworkConfig, RunConfig
from plasticity_zoo.training.loop import Schedule
from plasticity_zoo.training.presets import PRESETS
from tests import device_toy

ROOT = Path(__file__).resolve().parents[1]
needs_playground = pytest.mark.skipif(
    importlib.util.find_spec("mujoco_playground") is None, reason="MuJoCo Playground (extra .[mjx]) is not installed"
)
TOY = device_toy.ENV


@pytest.fixture
def toy(monkeypatch):
    device_toy.use_toy(monkeypatch)


# ----------------------------------------------------------------------------------------------
# The schedule
# ----------------------------------------------------------------------------------------------
def _sched(eval_every, log_every, checkpoint_every):
    return Schedule(SimpleNamespace(eval_every=eval_every, log_every=log_every, checkpoint_every=checkpoint_every))


def test_an_iteration_past_several_points_evaluates_and_logs_once_and_the_schedule_moves_past_them():
    """Iterations of 61,440 steps (2048 envs x 30) against evaluations every 5,000 and log rows every
    1,000: each boundary is due once, and the next points lie past the boundary (65,000 and 62,000 after
    61,440), so what a checkpoint stores never lies behind its own step."""
    s = _sched(5_000, 1_000, 50_000)
    assert s.eval_due(0) and s.next_eval == 5_000
    assert s.eval_due(61_440) and s.next_eval == 65_000
    assert not s.eval_due(61_440)  # at most one evaluation per boundary
    assert s.log_due(61_440) and s.next_log == 62_000 and not s.log_due(61_440)
    assert s.eval_due(122_880) and s.next_eval == 125_000
    assert s.log_due(122_880) and s.next_log == 123_000
    assert s.checkpoint_due(122_880, 10**9) and s.next_ckpt == 150_000
    assert s.host() == {"next_eval": 125_000, "next_log": 123_000}
    resumed = Schedule(SimpleNamespace(eval_every=5_000, log_every=1_000, checkpoint_every=50_000), 122_880, s.host())
    assert (resumed.next_eval, resumed.next_log, resumed.next_ckpt) == (125_000, 123_000, 150_000)


def _old_rule_steps(every: int, first: int, steps) -> list[int]:
    """The steps the rule before issue #50 made due: the next point moved by one interval per call."""
    due, nxt = [], first
    for step in steps:
        if step >= nxt:
            nxt += every
            due.append(step)
    return due


@pytest.mark.parametrize("per, every", [(1, 5), (3, 10), (4, 4), (7, 25), (16, 32)])
def test_where_iterations_are_no_longer_than_the_interval_evaluations_and_logs_fall_where_they_did(per, every):
    """Host loops (one vector step of a few envs, or an offline epoch, per call): the same steps as before."""
    steps = range(0, 400, per)
    s = _sched(every, every, 10**9)
    assert [t for t in steps if s.eval_due(t)] == _old_rule_steps(every, 0, steps)
    assert [t for t in steps if s.log_due(t)] == _old_rule_steps(every, every, steps)


def test_the_old_rule_lagged_behind_and_a_resume_cut_evaluations_it_had_written():
    """Evaluations every 3 steps, iterations of 4: both rules evaluate at every boundary, but the old one's
    next point fell 1 step further behind per iteration (at step 40 it was 33), and a resume drops the
    eval rows at or past the checkpoint's next point (``loop.restore``), rows it would never redo."""
    steps = range(0, 44, 4)
    s = _sched(3, 10**9, 10**9)
    assert [t for t in steps if s.eval_due(t)] == list(steps) == _old_rule_steps(3, 0, steps)
    assert s.next_eval == 42 > 40  # the old rule's: 3 x 11 = 33


# ----------------------------------------------------------------------------------------------
# Host calls of the presets at their own sizes (the real driver and step; chunks stubbed)
# ----------------------------------------------------------------------------------------------
def _counted_iteration(kind, cfg, agent):
    """A device iteration of ``cfg``'s sizes whose chunks do no work (they only advance the step)."""
    from plasticity_zoo.agents.api import updates_per_vector_step
    from plasticity_zoo.training.loops import device

    S, E = cfg.seeds, cfg.num_envs
    it = object.__new__(device.DeviceOnPolicyIteration if kind == "onpolicy" else device.DeviceOffPolicyIteration)
    it.cfg, it.agent, it.S, it.E, it.metrics, it.updates_done = cfg, agent, S, E, None, 0
    it.diverged = np.zeros(S, np.int64)
    if kind == "onpolicy":
        it.steps_per_iteration = cfg.agent.num_steps * E
        it.updates_per_iteration = cfg.agent.update_epochs * cfg.agent.num_minibatches
        it.carry = device.OnPolicyCarry(None, SimpleNamespace(buffer=None), None, None, None)
    else:
        it.steps_per_iteration, it.updates_per_iteration = E, updates_per_vector_step(cfg.agent, E)
        it.carry = device.OffPolicyCarry(None, None, None, None, None, None)
    it.hooks = SimpleNamespace(
        after_updates=lambda before, after, state, data, key: (state, None),
        restore=lambda h: None,
        host_state=lambda: None,
        replay_control=None,
    )
    it.chunks = []
    z = np.zeros(S)
    report = device.Report({}, np.True_, jax.random.key(0), z, z, z, np.False_, z)

    def chunk(carry, n, *args):
        it.chunks.append(int(n))
        return carry, report

    it.chunk_fn = chunk
    it.fresh = lambda: None
    return it


def _host_calls(tmp_path, agent_name, preset):
    from plasticity_zoo import agents
    from plasticity_zoo.training.cli import parse
    from plasticity_zoo.training.driver import Driver
    from plasticity_zoo.training.loops import onpolicy

    cfg = parse([agent_name, "--preset", preset, "--env", "playground:CartpoleBalance", "--no-progress"])
    agent = agents.get(agent_name)
    it = _counted_iteration(agent.KIND, cfg, agent)
    if agent.KIND == "onpolicy":
        batch, iterations = onpolicy.check(cfg)
        end = batch * iterations
    else:
        end = cfg.total_steps
    drv = Driver(cfg, agent, tmp_path / preset, it.hooks, None)
    evals, ckpts = [], []
    drv.evaluate = lambda step, state: evals.append(step)
    drv.save = lambda iteration, step: ckpts.append(step)
    drv.begin(it, False)
    drv.run(it, end, end)
    return cfg, it, end, evals, ckpts


def _first_boundaries(points, per: int, end: int) -> list[int]:
    """The first iteration boundary (a multiple of ``per``) at or past each point, those before ``end``."""
    out = [-(-p // per) * per for p in points]
    return [b for b in out if b < end]


@pytest.mark.parametrize(
    "agent_name, preset, iterations, evaluations, checkpoints",
    [
        ("ppo", "ppo-brax", 61, 11, 10),
        ("ppo", "ppo-playground", 976, 11, 10),  # 60M steps: 976 whole iterations of 2048 envs x 30 steps
        ("sac", "sac-playground", 39_063, 11, 10),  # 5M steps are 39,062.5 vector steps of 128 envs
        pytest.param("sac", "sac-fastsac", 150_000, 31, 30, marks=pytest.mark.slow),  # 1,529 chunks: 4 s
    ],
)
def test_at_a_presets_sizes_the_host_evaluates_and_checkpoints_only_where_due(
    tmp_path, agent_name, preset, iterations, evaluations, checkpoints
):
    """The driver's host calls over a whole run at the preset's sizes (the chunks stubbed out): an
    evaluation at the first iteration boundary at or past each ``--eval-every`` point and at the end, a
    checkpoint at the first boundary past each ``--checkpoint-every`` point and at the end, nothing else;
    log rows likewise, one per ``--log-every`` point at most (chunks also end at plasticity metric events)."""
    cfg, it, end, evals, ckpts = _host_calls(tmp_path, agent_name, preset)
    per = it.steps_per_iteration
    last = -(-end // per) * per
    assert sum(it.chunks) == iterations == last // per
    assert evals == _first_boundaries(range(0, end, cfg.eval_every), per, end) + [last]
    assert len(evals) == evaluations == len(set(evals))
    assert ckpts == _first_boundaries(range(cfg.checkpoint_every, end, cfg.checkpoint_every), per, end) + [last]
    assert len(ckpts) == checkpoints
    rows = [int(r["step"]) for r in csv.DictReader(open(tmp_path / preset / "metrics.csv"))]
    assert rows == sorted(set(_first_boundaries(range(cfg.log_every, end, cfg.log_every), per, end))) + [last]


# ----------------------------------------------------------------------------------------------
# --updates-per-vector-step
# ----------------------------------------------------------------------------------------------
def _toy_sac(tiny_sac_config, **kw):
    return tiny_sac_config(
        **{
            "env": TOY,
            "seeds": 1,
            "num_envs": 4,
            "learning_starts": 12,
            "batch_size": 8,
            "buffer_size": 64,
            "total_steps": 40,
            "network": NetworkConfig(width=8, depth=1),
            **kw,
        }
    )


@pytest.mark.slow
@needs_playground
def test_updates_per_vector_step_replaces_updates_per_env_step_times_the_envs(tiny_sac_config, toy):
    """2 seeds x 4 envs, learning from env step 12: of 5 vector steps (env steps 4 .. 20) the last 3
    learn.  By default each makes 1 x 4 updates (12 in all: the host's count, which the plasticity hooks
    read; test_device_loop's host-loop comparison checks that the device runs as many), with
    --updates-per-vector-step 2 two (6 in all, on the device too); every env's transition of every step
    reaches the replay (20 rows per seed).  (The program is the resume test's below.)"""
    from plasticity_zoo.training.loops.device import DeviceOffPolicyIteration

    default = DeviceOffPolicyIteration(_toy_sac(tiny_sac_config, seeds=2), sac)
    assert default.updates_per_iteration == 4 and default._updates_in(0, 5) == 12
    it = DeviceOffPolicyIteration(_toy_sac(tiny_sac_config, seeds=2, updates_per_vector_step=2), sac)
    assert it.updates_per_iteration == 2 and it._updates_in(0, 5) == 6
    it.fresh()
    it.carry, report = it.chunk_fn(it.carry, jnp.int32(5), jnp.int32(0), None)
    assert bool(report.learned)
    np.testing.assert_array_equal(it.carry.state.updates, [6, 6])
    np.testing.assert_array_equal(it.carry.buffer.size, [20, 20])


@pytest.mark.slow
@needs_playground
def test_a_thousand_envs_share_eight_updates_per_vector_step(tiny_sac_config, toy):
    """FastSAC's shape: 1,024 envs, 8 updates of batch 256 per vector step (tiny networks), learning from
    env step 2,048: of 4 vector steps the last 3 learn, 24 updates in all (not 3 x 1,024), and all 4,096
    transitions reach the replay."""
    from plasticity_zoo.training.loops.device import DeviceOffPolicyIteration

    cfg = _toy_sac(
        tiny_sac_config,
        num_envs=1024,
        updates_per_vector_step=8,
        batch_size=256,
        buffer_size=8192,
        learning_starts=2048,
        total_steps=4096,
    )
    it = DeviceOffPolicyIteration(cfg, sac)
    assert it.updates_per_iteration == 8 and it._updates_in(0, 4) == 24
    it.fresh()
    it.carry, report = it.chunk_fn(it.carry, jnp.int32(4), jnp.int32(0), None)
    assert bool(report.learned) and bool(report.finite)
    np.testing.assert_array_equal(it.carry.state.updates, [24])
    np.testing.assert_array_equal(it.carry.buffer.size, [4096])


@pytest.mark.slow
@needs_playground
def test_with_updates_per_vector_step_a_resumed_and_a_chunked_run_equal_the_uninterrupted_one(
    tmp_path, tiny_sac_config, assert_same_logs, toy
):
    """2 seeds x 4 envs, 2 updates per vector step, evaluations every 3 steps (each 4-step iteration steps
    past one): stopped at step 20 and resumed, and chunked by 1, the runs end bit for bit equal with the
    same log and evaluation rows (the rule before issue #50 checkpointed 15 as the next evaluation at step
    20, and the resumed run dropped the evaluation at 16)."""
    from plasticity_zoo.training.loops import device

    cfg = _toy_sac(
        tiny_sac_config,
        seeds=2,
        total_steps=24,
        updates_per_vector_step=2,
        eval_every=3,
        eval_episodes=1,
        log_every=8,
        checkpoint_every=8,
    )
    full = device.train(cfg, sac, tmp_path / "full")
    part = device.train(cfg, sac, tmp_path / "part", stop_at=20)
    assert part["step"] == 20
    resumed = device.train(cfg, sac, tmp_path / "part", resume=True)
    one = device.train(RunConfig(**{**cfg.__dict__, "device_chunk": 1}), sac, tmp_path / "one")
    for other in (resumed, one):
        assert other["step"] == 24
        for x, y in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(other["state"])):
            np.testing.assert_array_equal(x, y)
    assert_same_logs(tmp_path / "full", tmp_path / "part")
    assert_same_logs(tmp_path / "full", tmp_path / "one")
    np.testing.assert_array_equal(full["state"].updates, [2 * 4, 2 * 4])  # vector steps at 12 .. 24 learn
    evals = [int(r["step"]) for r in csv.DictReader(open(tmp_path / "part" / "eval.csv")) if r["seed"] == "0"]
    assert evals == [0, 4, 8, 12, 16, 20, 24]


def test_updates_per_vector_step_is_refused_where_it_cannot_apply(monkeypatch, capsys, tmp_path, toy):
    """One ``error:`` line each, nothing created: below 1, beside --updates-per-step, and in the host loop."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script

    monkeypatch.delenv("RLZOO_DEBUG", raising=False)
    cases = [
        (["--env", TOY, "--updates-per-vector-step", "0"], "error: --updates-per-vector-step must be >= 1, got 0"),
        (
            ["--env", TOY, "--updates-per-vector-step", "2", "--updates-per-step", "2"],
            "error: --updates-per-vector-step 2 sets the updates per vector step itself",
        ),
        (["--env", "Pendulum-v1", "--updates-per-vector-step", "2"], "error: --updates-per-vector-step is the device"),
        (
            ["--env", TOY, "--loop", "host", "--updates-per-vector-step", "2"],
            "error: --updates-per-vector-step is the device",
        ),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as stop:
            train_script.cli(["sac", *argv, "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and err[0].startswith(expected), (argv, err)
        assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# The presets against the installed sources they cite (read, not imported: importing them takes seconds)
# ----------------------------------------------------------------------------------------------
def _source(package: str, *parts: str) -> ast.Module:
    spec = importlib.util.find_spec(package)  # a top-level package: found without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    return ast.parse(Path(spec.submodule_search_locations[0], *parts).read_text())


def _value(node):
    """A literal, a product of literals (``1048576 * 4``) or a dotted name (``linen.swish`` -> "swish")."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _value(node.left) * _value(node.right)
    if isinstance(node, ast.Attribute):
        return node.attr
    return ast.literal_eval(node)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _created(tree: ast.Module, function: str) -> dict:
    """The keywords of every ``config_dict.create(...)`` in ``function`` (the per-task overrides after it aside)."""
    return {
        k.arg: _value(k.value)
        for node in ast.walk(_function(tree, function))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "create"
        for k in node.keywords
        if not isinstance(k.value, ast.Call)
    }


def _defaults(tree: ast.Module, function: str) -> dict:
    fn = _function(tree, function)
    args = fn.args.args + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults + fn.args.kw_defaults
    out = {}
    for a, d in zip(args, defaults):
        try:
            out[a.arg] = _value(d)
        except ValueError:  # a lambda or a call: not compared
            pass
    return out


def _preset(agent_name: str, name: str):
    from plasticity_zoo.training.cli import parse

    return parse([agent_name, "--preset", name, "--env", "playground:CheetahRun"])


def test_ppo_brax_and_ppo_playground_hold_playgrounds_ppo_settings_and_brax_ppos_defaults():
    """mujoco_playground/config/dm_control_suite_params.py (brax_ppo_config) and the defaults of
    brax/training/agents/ppo/train.py and networks.py, flag by flag."""
    pg = _created(_source("mujoco_playground", "config", "dm_control_suite_params.py"), "brax_ppo_config")
    brax = _defaults(_source("brax", "training", "agents", "ppo", "train.py"), "train")
    nets = _defaults(_source("brax", "training", "agents", "ppo", "networks.py"), "make_ppo_networks")
    cfg = _preset("ppo", "ppo-brax")
    a = cfg.agent
    assert (cfg.total_steps, cfg.num_envs) == (pg["num_timesteps"], pg["num_envs"])
    # a batch: batch_size x num_minibatches unrolls of unroll_length steps, from all envs at once
    assert a.num_steps * cfg.num_envs == pg["batch_size"] * pg["num_minibatches"] * pg["unroll_length"]
    assert (a.num_minibatches, a.update_epochs) == (pg["num_minibatches"], pg["num_updates_per_batch"])
    assert (a.learning_rate, a.gamma, a.ent_coef) == (pg["learning_rate"], pg["discounting"], pg["entropy_cost"])
    assert a.anneal_lr is False and brax["learning_rate_schedule"] is None
    assert (a.clip_coef, a.gae_lambda, a.vf_coef) == (brax["clipping_epsilon"], brax["gae_lambda"], 0.5)
    assert brax["vf_loss_coefficient"] == 0.5 and a.norm_adv is brax["normalize_advantage"] is True
    assert a.clip_vloss is False and brax["clipping_epsilon_value"] is None
    assert a.max_grad_norm == float("inf") and brax["max_grad_norm"] is None
    assert a.norm_obs is pg["normalize_observations"] is True and a.norm_reward is False
    assert pg["reward_scaling"] == 10.0 and "reward scaling by 10" in PRESETS["ppo-brax"].note
    assert (cfg.network.activation, nets["activation"]) == ("silu", "swish")  # jax.nn.swish is silu
    assert cfg.eval_every == pg["num_timesteps"] // pg["num_evals"] and pg["action_repeat"] == 1
    old = _preset("ppo", "ppo-playground")  # the earlier preset: Playground's numbers on CleanRL's PPO
    assert (old.total_steps, old.num_envs, old.agent.num_steps) == (pg["num_timesteps"], 2048, pg["unroll_length"])
    assert (old.agent.update_epochs, old.agent.learning_rate) == (pg["num_updates_per_batch"], pg["learning_rate"])
    assert old.eval_every == old.checkpoint_every == pg["num_timesteps"] // pg["num_evals"]


def test_sac_playground_holds_playgrounds_sac_settings_and_brax_sacs_defaults():
    """brax_sac_config and brax/training/agents/sac/train.py: grad_updates_per_step is per vector step
    (one ``actor_step`` of all envs, then a scan of that many SGD steps)."""
    pg = _created(_source("mujoco_playground", "config", "dm_control_suite_params.py"), "brax_sac_config")

    tree = _source("brax", "training", "agents", "sac", "train.py")
    brax = _defaults(tree, "train")
    alpha_lr = next(
        _value(n.value.keywords[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "alpha_optimizer"
    )
    cfg = _preset("sac", "sac-playground")
    a = cfg.agent
    assert (cfg.total_steps, cfg.num_envs) == (pg["num_timesteps"], pg["num_envs"])
    assert (a.updates_per_vector_step, a.batch_size) == (pg["grad_updates_per_step"], pg["batch_size"])
    assert (a.buffer_size, a.learning_starts) == (pg["max_replay_size"], pg["min_replay_size"])
    assert (a.gamma, a.actor_lr, a.critic_lr) == (pg["discounting"], pg["learning_rate"], pg["learning_rate"])
    assert (a.alpha_lr, a.tau, a.init_alpha) == (alpha_lr, brax["tau"], 1.0)  # Brax's log alpha starts at 0
    assert cfg.network.layer_norm is pg["q_network_layer_norm"] is True and pg["reward_scaling"] == 1.0
    assert (cfg.eval_every, cfg.eval_episodes) == (pg["num_timesteps"] // pg["num_evals"], brax["num_eval_envs"])
