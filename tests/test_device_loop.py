"""playground: envs (envs/playground.py) and the device loop (training/loops/device.py)."""

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import ppo
from plasticity_zoo.plasticity.config import PlasticityConfig
from plasticity_zoo.training.config import NetworkConfig, RunConfig
from tests import device_toy

ROOT = Path(__file__).resolve().parents[1]
needs_playground = pytest.mark.skipif(
    importlib.util.find_spec("mujoco_playground") is None, reason="MuJoCo Playground (extra .[mjx]) is not installed"
)
ENV = "playground:CartpoleBalance"  # the cheapest task to compile on CPU
TOY = device_toy.ENV  # the loop's mechanics, on Playground's wrapper around two-line physics (tests/device_toy.py)


@pytest.fixture
def toy(monkeypatch):
    device_toy.use_toy(monkeypatch)


def tiny(**kw):
    agent_kw = {k: kw.pop(k) for k in list(kw) if k in ppo.PPOConfig.__dataclass_fields__}
    agent = ppo.PPOConfig(**{"num_steps": 8, "num_minibatches": 2, "update_epochs": 2, **agent_kw})
    return RunConfig(
        **{
            "env": ENV,
            "seeds": 2,
            "num_envs": 2,
            "total_steps": 64,
            "eval_every": 32,
            "eval_episodes": 1,
            "log_every": 16,
            "checkpoint_every": 32,
            "progress": False,
            "network": NetworkConfig(width=16),
            "agent_name": "ppo",
            "agent": agent,
            **kw,
        }
    )


def short_episodes(limit: int, name: str = "CartpoleBalance"):
    """A Playground task whose episodes are truncated after ``limit`` agent steps (to see ends quickly)."""
    from plasticity_zoo.envs.playground import Playground

    @dataclass(frozen=True)
    class Short(Playground):
        limit: int = 5

        @property
        def episode_length(self) -> int:
            return self.limit

    return Short(name, limit=limit)


@pytest.fixture(scope="module")
def short_cartpole():
    """CartpoleBalance with episodes of 3 steps, one object for the file: the env tests below step it
    through ``envs.playground.jitted`` (the host vector env's programs), so MuJoCo's physics compiles
    into one reset and one step program of 2 envs that they share."""
    return short_episodes(3)


# ----------------------------------------------------------------------------------------------
# The env
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_playground
def test_an_episode_limit_truncates_keeps_the_true_final_obs_and_resets_in_the_same_step(short_cartpole):
    from plasticity_zoo.envs.playground import env_keys, jitted

    env = short_cartpole  # episodes of 3 steps
    raw = env.env
    reset, step = jitted(env)  # jax.jit(env.reset), jax.jit(env.step)
    state = reset(env_keys([0, 1]))
    raw_step = jax.jit(jax.vmap(raw.step))
    inner, rewards = state.inner, []
    for t in range(3):
        a = jnp.array([[0.3], [-0.7]])
        before = state
        state, out = step(state, a)
        inner = raw_step(inner, a)  # the physics by hand, without the wrapper
        rewards.append(np.asarray(out.reward))
        np.testing.assert_allclose(out.next_obs, inner.obs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.reward, inner.reward, rtol=1e-5, atol=1e-6)
        assert not out.terminated.any()
        if t < 2:
            assert not out.truncated.any()
            np.testing.assert_array_equal(out.obs, out.next_obs)
            np.testing.assert_array_equal(out.ep_return, 0.0)
    assert out.truncated.all()  # the limit is a truncation, never a termination
    # the observation to act on is a fresh episode's, reset from each env's own next key
    reset_keys = jax.vmap(jax.random.split)(before.key)[:, 0]
    np.testing.assert_allclose(out.obs, jax.jit(jax.vmap(raw.reset))(reset_keys).obs, rtol=1e-6)
    assert not np.allclose(out.obs, out.next_obs)
    np.testing.assert_allclose(out.ep_return, np.sum(rewards, axis=0), rtol=1e-6)
    np.testing.assert_array_equal(out.ep_length, 3)
    np.testing.assert_array_equal(state.t, 0)
    np.testing.assert_array_equal(state.ep_return, 0.0)
    assert not np.array_equal(jax.random.key_data(state.key), jax.random.key_data(before.key))


@pytest.mark.slow
@needs_playground
@pytest.mark.parametrize("mode", ["clip", "rescale"])
def test_actions_reach_the_physics_inside_the_control_range(mode):
    from plasticity_zoo.envs.actions import to_env_action
    from plasticity_zoo.envs.playground import make

    env = make(ENV, action_mode=mode)
    low, high = env.bounds()
    a = np.array([[-2.5], [-0.3], [0.8], [4.0]], np.float32)
    np.testing.assert_allclose(env.to_env_action(a), to_env_action(a, low, high, mode), rtol=1e-6)
    assert np.all(np.asarray(env.to_env_action(a)) >= low) and np.all(np.asarray(env.to_env_action(a)) <= high)


@pytest.mark.slow
@needs_playground
def test_the_host_vector_env_pickles_exactly_and_reports_finished_episodes(short_cartpole):
    import pickle

    from plasticity_zoo.envs import make_vector_env

    env = make_vector_env(ENV, 2, 7)
    env.pg = short_cartpole  # episodes of 3 steps: they end in the steps compared below
    env.reset()
    for _ in range(2):
        env.step(np.full((2, 1), 0.2))
    copy = pickle.loads(pickle.dumps(env))
    copy.pg = env.pg
    a = [env.step(np.full((2, 1), -0.4)) for _ in range(2)]
    b = [copy.step(np.full((2, 1), -0.4)) for _ in range(2)]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    finished = env.pop_finished()
    assert sorted(i for i, _, _ in finished) == [0, 1] and all(n == 3 for _, _, n in finished)


def test_without_the_extra_a_playground_id_names_the_extra(monkeypatch):
    from plasticity_zoo.envs import playground

    monkeypatch.setitem(sys.modules, "mujoco_playground", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"\.\[mjx\]"):
        playground._registry()


@pytest.mark.slow
@needs_playground
def test_unknown_tasks_and_loops_that_cannot_run_are_refused_before_anything_is_created(tmp_path):
    from plasticity_zoo.training import run

    with pytest.raises(ValueError, match="unknown Playground task playground:Nope.*playground:CheetahRun"):
        run.preflight(tiny(env="playground:Nope"))
    with pytest.raises(ValueError, match="loop device runs on-policy .* and off-policy"):
        run.preflight(
            RunConfig(
                env=ENV,
                loop="device",
                agent_name="ravl",
                agent=importlib.import_module("plasticity_zoo.agents.ravl").RAVLConfig(),
            )
        )
    with pytest.raises(ValueError, match="least cuts episodes from the host"):
        run.preflight(
            RunConfig(
                env=ENV,
                loop="device",
                agent_name="sac",
                agent=importlib.import_module("plasticity_zoo.agents.sac").SACConfig(),
                plasticity=PlasticityConfig(least=True),
            )
        )
    with pytest.raises(ValueError, match="needs an env that steps on the device"):
        run.preflight(tiny(env="Pendulum-v1", loop="device"))
    with pytest.raises(ValueError, match="backend"):
        run.preflight(tiny(backend="async"))
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "ppo", "--env", "playground:Nope", "--run-dir", str(tmp_path / "r")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "unknown Playground task" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------------------------
# The device loop
# ----------------------------------------------------------------------------------------------
def _iterate(iteration, step: int = 0) -> int:
    """One whole iteration of a host loop's ``step`` calls without the driver's host work (for comparing
    the loops' arithmetic): every loss finite; -> the step after it."""
    while True:
        report = iteration.step(step, 0)
        step += report.steps
        assert report.finite is None or bool(report.finite)
        if report.whole:
            return step


@pytest.mark.slow
@needs_playground
def test_the_device_loop_does_the_host_loops_rollout_gae_and_update_on_the_same_transitions(toy):
    """Two iterations of 2 seeds x 2 envs with episodes of 5 steps (truncations inside the rollouts):
    the host loop stepping the same envs from Python and the device loop agree on every stored
    transition (final values at truncations included) and on the updated agents."""
    from plasticity_zoo.envs.playground import PlaygroundVectorEnv
    from plasticity_zoo.training.loops.device import DeviceOnPolicyIteration, make_chunk
    from plasticity_zoo.training.loops.onpolicy import OnPolicyIteration

    cfg = tiny(env=TOY)
    env = short_episodes(5, device_toy.NAME)
    host = OnPolicyIteration(cfg, ppo, 4)
    host.env = PlaygroundVectorEnv(TOY, 4, cfg.seed * 10_000)
    host.env.pg = env
    host.counter = None  # (set by begin(): the shared clock of ns: envs)
    host.fresh()
    device = DeviceOnPolicyIteration(cfg, ppo, 4)
    device.env, device.chunk_fn = env, make_chunk(ppo, env, 2, 2, 8)
    device.fresh()
    step = 0
    for _ in range(2):
        step = _iterate(host, step)
    device.carry, report = device.chunk_fn(device.carry, jnp.int32(2))
    hb, db = host.loop.buffer, device.carry.loop.buffer
    assert bool(jnp.any(hb.truncated)) and bool(jnp.any(hb.final_values != 0))
    np.testing.assert_array_equal(hb.truncated, db.truncated)
    np.testing.assert_array_equal(hb.terminated, db.terminated)
    for name in ("obs", "actions", "logp", "values", "rewards", "final_values"):
        np.testing.assert_allclose(getattr(hb, name), getattr(db, name), rtol=1e-4, atol=1e-5, err_msg=name)
    for field in ("actor_params", "critic_params", "obs_rms", "ret_rms"):
        for x, y in zip(
            jax.tree.leaves(getattr(host.state, field)), jax.tree.leaves(getattr(device.carry.state, field))
        ):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5, err_msg=field)
    for k in ("losses/policy", "losses/value", "charts/approx_kl"):
        np.testing.assert_allclose(host.metrics[k], report.metrics[k], rtol=1e-3, atol=1e-6, err_msg=k)
    # 8 steps x 2 envs per seed and iteration, episodes of 5: 3 ended per env, each of return <= 5
    np.testing.assert_array_equal(report.episodes, [6, 6])
    np.testing.assert_array_equal(report.length_sum, [30, 30])
    assert np.all(np.asarray(report.return_sum) > 0) and np.all(np.asarray(report.return_sum) <= 30)


@pytest.mark.slow
@needs_playground
def test_a_resumed_device_run_and_a_differently_chunked_one_equal_the_uninterrupted_run(
    tmp_path, assert_same_logs, toy
):
    from plasticity_zoo.training.loops import device

    cfg = tiny(env=TOY)
    full = device.train(cfg, ppo, tmp_path / "full")
    part = device.train(cfg, ppo, tmp_path / "part", stop_at=30)
    assert part["step"] == 32  # the first iteration boundary at or past 30
    resumed = device.train(cfg, ppo, tmp_path / "part", resume=True)
    one = device.train(RunConfig(**{**cfg.__dict__, "device_chunk": 1}), ppo, tmp_path / "one")
    assert full["step"] == resumed["step"] == one["step"] == 64
    for other in (resumed, one):
        for x, y in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(other["state"])):
            np.testing.assert_array_equal(x, y)
    assert_same_logs(tmp_path / "full", tmp_path / "part")
    assert_same_logs(tmp_path / "full", tmp_path / "one")
    from plasticity_zoo.analysis.restore import restore_policy
    from plasticity_zoo.envs.playground import make

    restored = restore_policy(tmp_path / "full")  # what scripts/evaluate.py loads: the device carry's agent
    assert restored.step == 64
    for x, y in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(restored.state)):
        np.testing.assert_array_equal(x, y)
    # one program for every chunk length, fresh or resumed (a weakly typed reset state would add one)
    assert device.make_chunk(ppo, make(TOY, action_mode=cfg.agent.action_mode), 2, 2, 8)._cache_size() == 1
    import csv

    rows = list(csv.DictReader(open(tmp_path / "full" / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r["seed"] == "0"] == [16, 32, 48, 64]
    assert all(np.isfinite(float(r["losses/value"])) for r in rows)
    evals = list(csv.DictReader(open(tmp_path / "full" / "eval.csv")))
    assert [int(r["step"]) for r in evals if r["seed"] == "0"] == [0, 32, 64]
    # the run evaluated on the device; scripts/evaluate.py's evaluator and policy reproduce its last evaluation
    logged = [[float(x) for x in r["episode_returns"].split()] for r in evals if r["step"] == "64"]
    assert restored.evaluator().on_device and restored.evaluator()(restored.policy()) == logged
    a0, a1 = (jax.tree.map(lambda x: x[j], full["state"].actor_params) for j in (0, 1))
    assert all(not np.allclose(x, y) for x, y in zip(jax.tree.leaves(a0), jax.tree.leaves(a1)))  # seeds differ


@pytest.mark.slow
@needs_playground
def test_plasticity_events_fall_at_chunk_ends_in_the_device_loop(tmp_path, toy):
    """PPO, 4 updates per iteration of 16 env steps: metrics and ReDo every 8 updates fall after
    iterations 2 and 4 (steps 32 and 64); the device chunks end there, and the events' columns reach
    the log rows at those steps."""
    import csv

    from plasticity_zoo.training.loops import device

    cfg = tiny(
        env=TOY,
        plasticity=PlasticityConfig(metrics_every=8, redo=True, reset_every=8),
        eval_every=1000,
        checkpoint_every=1000,
    )
    device.train(cfg, ppo, tmp_path / "run")
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv")) if r["seed"] == "0"]
    assert [int(r["step"]) for r in rows] == [16, 32, 48, 64]
    metric = next(k for k in rows[0] if k.startswith("plasticity/") and "dormant" in k)
    reset = next(k for k in rows[0] if k.startswith("plasticity/") and "reset" in k)
    assert [bool(r[metric]) for r in rows] == [False, True, False, True]
    assert [bool(r[reset]) for r in rows] == [False, True, False, True]


@pytest.mark.slow
@needs_playground
def test_the_off_policy_device_loop_stores_and_learns_as_the_host_loop(tiny_sac_config, toy):
    """SAC, 2 seeds x 2 envs, episodes of 5 steps, learning from env step 12: 10 vector steps of the
    host loop (env stepped from Python, ``store`` and ``learn_and_act`` per step) and one device
    chunk of 10 agree on every replay row (truncations included) and on the updated agents."""
    from plasticity_zoo.envs.playground import PlaygroundVectorEnv
    from plasticity_zoo.training.loops.device import DeviceOffPolicyIteration, make_offpolicy_chunk
    from plasticity_zoo.training.loops.offpolicy import OffPolicyIteration

    cfg = tiny_sac_config(
        env=TOY, seeds=2, num_envs=2, learning_starts=12, batch_size=8, buffer_size=64, total_steps=40
    )
    env = short_episodes(5, device_toy.NAME)
    host = OffPolicyIteration(cfg, importlib.import_module("plasticity_zoo.agents.sac"))
    host.env = PlaygroundVectorEnv(TOY, 4, cfg.seed * 10_000)
    host.env.pg = env
    host.fresh()
    step = 0
    for _ in range(10):
        step = _iterate(host, step)
    device = DeviceOffPolicyIteration(cfg, importlib.import_module("plasticity_zoo.agents.sac"))
    device.env = env
    device.chunk_fn = make_offpolicy_chunk(device.agent, cfg.agent, env, 2, 2)
    device.fresh()
    device.carry, report = device.chunk_fn(device.carry, jnp.int32(10), jnp.int32(0), None)
    assert bool(report.learned) and int(report.episodes.sum()) == 8  # 10 steps x 4 envs, episodes of 5
    hb, db = host.buffer, device.carry.buffer
    assert int(hb.size[0]) == int(db.size[0]) == 20 and bool(jnp.any(hb.data.truncated))
    for name in hb.data._fields:
        np.testing.assert_allclose(getattr(hb.data, name), getattr(db.data, name), rtol=1e-4, atol=1e-5, err_msg=name)
    for x, y in zip(
        jax.tree.leaves((host.state.actor_params, host.state.critic_params, host.state.log_alpha)),
        jax.tree.leaves(
            (device.carry.state.actor_params, device.carry.state.critic_params, device.carry.state.log_alpha)
        ),
    ):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@needs_playground
@pytest.mark.parametrize("agent_name", ["sac", "mrq"])
def test_a_resumed_off_policy_device_run_and_a_chunked_one_equal_the_uninterrupted_run(
    agent_name, tmp_path, tiny_sac_config, assert_same_logs, toy
):
    from plasticity_zoo import agents
    from plasticity_zoo.training.loops import device

    if agent_name == "sac":
        cfg = tiny_sac_config(
            env=TOY,
            seeds=2,
            num_envs=2,
            total_steps=48,
            learning_starts=16,
            eval_every=24,
            eval_episodes=1,
            log_every=8,
            checkpoint_every=24,
        )
    else:
        from plasticity_zoo.agents.mrq import MRQConfig

        cfg = RunConfig(
            env=TOY,
            seeds=2,
            num_envs=2,
            total_steps=48,
            eval_every=24,
            eval_episodes=1,
            log_every=8,
            checkpoint_every=24,
            progress=False,
            network=NetworkConfig(width=16),
            agent_name="mrq",
            agent=MRQConfig(buffer_size=256, batch_size=8, learning_starts=16, target_update_freq=4),
        )
    agent = agents.get(agent_name)
    full = device.train(cfg, agent, tmp_path / "full")
    part = device.train(cfg, agent, tmp_path / "part", stop_at=20)
    assert part["step"] == 20  # an iteration is one vector step of 2 envs
    resumed = device.train(cfg, agent, tmp_path / "part", resume=True)
    one = device.train(RunConfig(**{**cfg.__dict__, "device_chunk": 1}), agent, tmp_path / "one")
    for other in (resumed, one):
        assert other["step"] == 48
        for x, y in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(other["state"])):
            np.testing.assert_array_equal(x, y)
    assert_same_logs(tmp_path / "full", tmp_path / "part")
    assert_same_logs(tmp_path / "full", tmp_path / "one")
    import csv

    rows = [r for r in csv.DictReader(open(tmp_path / "full" / "metrics.csv")) if r["seed"] == "0"]
    assert [int(r["step"]) for r in rows] == list(range(8, 49, 8))
    assert all(r.get("charts/episodic_return", "") == "" for r in rows)  # no episode of 100 steps ended
    assert np.isfinite(float(rows[-1][next(k for k in rows[-1] if k.startswith("losses/"))]))


@pytest.mark.slow
@needs_playground
def test_an_off_policy_device_chunk_needs_no_memory_that_grows_with_the_replay_capacity(tiny_sac_config, toy):
    """The replay is carried through the chunk's loop and written in place: XLA's memory analysis of
    the compiled chunk must not depend on the capacity (a copy of the buffer per step would)."""
    from plasticity_zoo import agents
    from plasticity_zoo.training.loops.device import DeviceOffPolicyIteration

    temps = []
    for capacity in (4_096, 65_536):
        cfg = tiny_sac_config(
            env=TOY, seeds=1, num_envs=2, buffer_size=capacity, batch_size=32, network=NetworkConfig(width=16, depth=1)
        )
        it = DeviceOffPolicyIteration(cfg, agents.get("sac"))
        it.fresh()
        compiled = it.chunk_fn.lower(it.carry, jnp.int32(1), jnp.int32(0), None).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    assert temps[0] == temps[1], f"chunk temporaries grow with the capacity: {temps}"


@pytest.mark.optimized
@needs_playground
@pytest.mark.slow
def test_ppo_on_the_device_learns_to_balance_the_cartpole(tmp_path):
    """Playground CartpoleBalance, 2 seeds x 64 envs, 1M env steps per seed, Playground's discount and
    entropy bonus (about 15 s of device-loop training on 2 CPU cores).  The untrained policy's pole
    falls (evaluation return about 600 of 1000).  PPO is seed-sensitive here: in the runs behind this
    test one seed balanced by 500k steps (999) and the other sat near 500 at 1M; so both seeds' training
    returns must rise and one seed must balance."""
    import csv

    from plasticity_zoo.training.loops import device

    cfg = RunConfig(
        env=ENV,
        seeds=2,
        num_envs=64,
        total_steps=1_000_000,
        eval_every=1_000_000,
        eval_episodes=2,
        log_every=200_000,
        checkpoint_every=1_000_000,
        progress=False,
        agent_name="ppo",
        agent=ppo.PPOConfig(
            num_steps=32, num_minibatches=4, update_epochs=4, learning_rate=1e-3, gamma=0.995, ent_coef=0.01
        ),
    )
    out = device.train(cfg, ppo, tmp_path / "run")
    rows = list(csv.DictReader(open(tmp_path / "run" / "eval.csv")))
    first = [float(r["return_mean"]) for r in rows if int(r["step"]) == 0]
    last = [float(r["return_mean"]) for r in rows if int(r["step"]) == out["step"]]
    assert len(first) == len(last) == 2 and max(first) < 800
    assert max(last) > 950, (first, last)
    logs = [r for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv")) if r["charts/episodic_return"]]
    for seed in ("0", "1"):
        returns = [float(r["charts/episodic_return"]) for r in logs if r["seed"] == seed]
        assert returns[-1] > returns[0] + 100, (seed, returns)


@pytest.mark.optimized
@needs_playground
@pytest.mark.slow
def test_sac_on_the_device_learns_a_little_on_the_cartpole(tmp_path):
    """SAC on Playground CartpoleBalance in the device loop as FastSAC-style runs scale: 1 seed x 128 envs,
    16 updates of batch 256 per vector step (not 128), 200k env steps (about a minute on 2 CPU cores;
    vmapped seeds are tested above): the best later evaluation beats the untrained policy's (278) by 200
    (the run behind this test: 900 at 100k steps, 907 at 200k).  The evaluations ran on the device, and
    the final one runs there again to the bit."""
    import csv

    from plasticity_zoo import agents
    from plasticity_zoo.agents.sac import SACConfig
    from plasticity_zoo.training.loops import device

    cfg = RunConfig(
        env=ENV,
        seeds=1,
        num_envs=128,
        total_steps=200_000,
        eval_every=100_000,
        eval_episodes=2,
        log_every=20_000,
        checkpoint_every=200_000,
        progress=False,
        network=NetworkConfig(width=64),
        agent_name="sac",
        agent=SACConfig(buffer_size=200_000, learning_starts=5_000, updates_per_vector_step=16, batch_size=256),
    )
    out = device.train(cfg, agents.get("sac"), tmp_path / "run")
    rows = list(csv.DictReader(open(tmp_path / "run" / "eval.csv")))
    returns = {int(r["step"]): float(r["return_mean"]) for r in rows}
    assert sorted(returns) == [0, 100_096, 200_064] and len(rows) == 3  # the first vector steps at or past
    assert max(returns[100_096], returns[200_064]) > returns[0] + 200, returns
    assert int(out["state"].updates[0]) == 16 * 1524  # vector steps 40 .. 1563 learn (env steps 5,120 .. 200,064)

    from plasticity_zoo.training.evaluation import policy_maker, run_evaluator

    evaluator, policy = run_evaluator(cfg, "rescale"), policy_maker(agents.get("sac"))(out["state"])
    assert evaluator.on_device and policy.pure is not None
    logged = [float(x) for x in rows[-1]["episode_returns"].split()]
    assert evaluator(policy) == [logged]  # the run's own evaluation, again on the device
