"""A run's policy in the env's units and exported alone (analysis/export.py, scripts/export.py, #47 items 3, 5).

``RestoredRun.env_policy`` maps the run's evaluation actions onto the env's Box as its env does;
stepping a plain Gymnasium Pendulum (bounds +-2) with it gives the evaluation's own return.  An
exported file holds the actor's arrays (named by path) and what acting needs, and ``load_policy``
acts exactly as the restored run (SAC, PPO with its observation normaliser and clipped actions,
MR.Q through its encoder).  Mistakes give one ``error:`` line.  Runs are tiny (Pendulum, width 16).
"""

import csv
import dataclasses
import importlib.util
import json
import shutil
import zipfile
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from plasticity_zoo.analysis import export, restore

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("export_script", ROOT / "scripts" / "export.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def _sac_config(run_dir, **kw):
    """tests/test_evaluate.py's tiny SAC (its shapes, so the compilations are shared), 2 seeds, 300 steps."""
    from plasticity_zoo.agents.sac import SACConfig
    from plasticity_zoo.training.config import NetworkConfig, RunConfig

    agent = SACConfig(buffer_size=5000, batch_size=32, learning_starts=200)
    base = dict(
        env="Pendulum-v1",
        seeds=2,
        total_steps=300,
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


def _own_eval(run_dir) -> dict:
    """eval.csv at its last step -> {seed: [episode returns]}."""
    rows = list(csv.DictReader(open(Path(run_dir) / "eval.csv")))
    step = max(int(r["step"]) for r in rows)
    return {int(r["seed"]): [float(x) for x in r["episode_returns"].split()] for r in rows if int(r["step"]) == step}


def _observations(n=6, seed=0):
    """Pendulum observations (cos, sin, angular velocity), the extremes included."""
    rng = np.random.default_rng(seed)
    theta = rng.uniform(-np.pi, np.pi, n)
    obs = np.stack([np.cos(theta), np.sin(theta), rng.uniform(-8, 8, n)], 1).astype(np.float32)
    obs[0] = [1.0, 0.0, 8.0]
    obs[1] = [-1.0, 0.0, -8.0]
    return obs


def _episode(policy, env_seed: int, env_id="Pendulum-v1") -> float:
    """One episode of the plain Gymnasium env (no zoo wrapper) with ``policy``, rewards summed as the
    zoo's vector envs store them (float32 each)."""
    env = gym.make(env_id)
    obs, _ = env.reset(seed=env_seed)
    total, done = 0.0, False
    while not done:
        action = policy(obs)
        assert env.action_space.contains(action), action
        obs, reward, terminated, truncated, _ = env.step(action)
        total += float(np.float32(reward))
        done = terminated or truncated
    env.close()
    return total


@pytest.fixture(scope="module")
def sac_run(tmp_path_factory):
    from plasticity_zoo.training.run import run

    d = tmp_path_factory.mktemp("export") / "sac"
    run(_sac_config(d))
    return d


# ------------------------------------------------------------------------------------------- env units
def test_env_actions_rescale_and_clip_onto_the_bounds():
    acts = restore.EnvActions(np.array([-2.0, 0.0]), np.array([2.0, 1.0]), "rescale", np.float32)
    a = np.array([[-1.0, -1.0], [1.0, 1.0], [0.25, 0.5], [-3.0, 7.0]], np.float32)
    got = acts(a)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array([[-2, 0], [2, 1], [0.5, 0.75], [-2, 1]], np.float32))
    clip = restore.EnvActions(np.array([-2.0]), np.array([2.0]), "clip", np.float64)
    np.testing.assert_array_equal(clip(np.array([[-2.5], [1.25], [3.0]])), [[-2.0], [1.25], [2.0]])
    with pytest.raises(ValueError, match="unknown action mode"):
        restore.EnvActions(np.zeros(1), np.ones(1), "squash", np.float32)


def test_the_action_map_is_found_through_the_envs_wrappers():
    from plasticity_zoo.envs import make_env

    env = make_env("Pendulum-v1", 0, 3)
    acts, repeat = restore.env_actions(env), restore.action_repeat_of(env)
    assert repeat == 3 and acts.mode == "rescale" and acts.dtype == np.float32
    assert acts.low.tolist() == [-2.0] and acts.high.tolist() == [2.0]
    env = make_env("MountainCarContinuous-v0", 0, action_mode="clip")
    acts = restore.env_actions(env)
    assert acts.mode == "clip" and acts.high.tolist() == [1.0] and restore.action_repeat_of(env) == 1
    with pytest.raises(ValueError, match="multitask env pads"):
        restore.env_units_supported("mt:dmc4")


@pytest.mark.slow
def test_env_policy_is_the_evaluation_action_on_pendulums_bounds(sac_run):
    from plasticity_zoo.analysis.restore import restore_policy

    restored = restore_policy(sac_run)
    obs = _observations()
    for seed in (0, 1):
        unit = np.asarray(restored.policy(seed)(obs[None]))[0]  # as the run's evaluation acts: [-1, 1]
        pi = restored.env_policy(seed)
        got = pi(obs)
        assert got.shape == (6, 1) and got.dtype == np.float32
        np.testing.assert_array_equal(got, (-2.0 + (unit.astype(np.float64) + 1.0) / 2.0 * 4.0).astype(np.float32))
        assert np.all(np.abs(got) <= 2.0) and np.abs(got).max() > 1.0  # in env units, not the unit box
        np.testing.assert_array_equal(pi(obs[2]), got[2])  # one observation in, one action out
        np.testing.assert_array_equal(pi.unit(obs), unit)
    with pytest.raises(ValueError, match="the policy takes one observation of 3 values"):
        pi(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="seed index 2: the run has 2 seed"):
        restored.env_policy(2)


@pytest.mark.slow
def test_stepping_the_plain_gymnasium_env_with_it_reproduces_the_evaluation(sac_run, tmp_path):
    """Seed 1's first evaluation episode, replayed on ``gym.make("Pendulum-v1")`` with env-unit actions
    from the restored run and from the exported file: the return in the run's eval.csv, to the bit."""
    from plasticity_zoo.analysis.restore import restore_policy

    restored = restore_policy(sac_run)
    evaluator = restored.evaluator(seed=1)
    try:
        returns = evaluator(restored.policy(1))
    finally:
        evaluator.env.close()
    own = _own_eval(sac_run)[1]
    assert returns == [own]
    env_seed = evaluator.env_seeds[0]
    assert _episode(restored.env_policy(1), env_seed) == own[0]
    path = export.export_policy(sac_run, tmp_path / "p.npz", seed=1)
    assert _episode(export.load_policy(path), env_seed) == own[0]


# ------------------------------------------------------------------------------------------- export
@pytest.mark.slow
def test_export_writes_the_policy_alone_and_it_acts_as_the_restored_run(sac_run, tmp_path, capsys):
    from plasticity_zoo.analysis.restore import restore_policy

    out = tmp_path / "sub" / "pendulum.npz"
    meta = script.main([str(sac_run), "--seed", "1", "--out", str(out)])
    assert f"wrote {out}: sac policy of seed 1 at step 300" in capsys.readouterr().out
    with zipfile.ZipFile(out) as z:
        members = sorted(n.removesuffix(".npy") for n in z.namelist())
    assert members == sorted(["meta", "bounds/low", "bounds/high"] + [f"params/{n}" for n in meta["arrays"]])
    assert "params/actor_params/trunk/layers/0/kernel/value" in members
    assert not any("critic" in m or "opt" in m or "alpha" in m for m in members)  # the policy alone
    assert out.stat().st_size < 20_000
    assert {
        k: meta[k]
        for k in (
            "agent",
            "env",
            "obs_dim",
            "act_dim",
            "action_repeat",
            "action_mode",
            "step",
            "seed",
            "obs_normalization",
        )
    } == {
        "agent": "sac",
        "env": "Pendulum-v1",
        "obs_dim": 3,
        "act_dim": 1,
        "action_repeat": 1,
        "action_mode": "rescale",
        "step": 300,
        "seed": 1,
        "obs_normalization": False,
    }
    assert meta["agent_config"]["critics"] == 2 and meta["network"]["width"] == 16
    # its arrays are seed 1's, to the bit
    restored = restore_policy(sac_run)
    with np.load(out) as z:
        np.testing.assert_array_equal(
            z["params/actor_params/trunk/layers/0/kernel/value"],
            np.asarray(restored.state.actor_params["trunk"]["layers"][0]["kernel"][...])[1],
        )
        np.testing.assert_array_equal(z["bounds/low"], [-2.0])
    pi = export.load_policy(out)
    obs = _observations(9, seed=1)
    np.testing.assert_array_equal(pi(obs), restored.env_policy(1)(obs))
    np.testing.assert_array_equal(pi.unit(obs), np.asarray(restored.policy(1)(obs[None]))[0])
    assert pi(obs[0]).shape == (1,) and pi.env_id == "Pendulum-v1" and pi.action_repeat == 1
    assert not np.array_equal(pi(obs), restored.env_policy(0)(obs))  # another seed, another policy
    # the file alone, moved away from the run, acts the same
    moved = shutil.move(str(out), tmp_path / "elsewhere.npz")
    assert np.array_equal(export.load_policy(moved)(obs), pi(obs))


@pytest.mark.slow
def test_ppo_export_carries_its_observation_statistics_and_clips_to_the_bounds(tmp_path):
    """PPO acting on normalised observations, in CleanRL's clip mode (the agent acts in env units, the env
    clips to +-2): the exported policy's actions are the restored run's, and its episode the evaluation's."""
    from plasticity_zoo.analysis.restore import restore_policy
    from plasticity_zoo.training.run import run
    from tests import golden

    d = tmp_path / "ppo"
    run(dataclasses.replace(golden.CASES["ppo_clip_actions"](tmp_path), run_dir=str(d)))
    restored = restore_policy(d)
    path = export.export_policy(d, tmp_path / "ppo.npz")
    meta = export.read_meta(path)
    assert meta["obs_normalization"] is True and meta["action_mode"] == "clip"
    assert {"obs_rms/mean", "obs_rms/var", "obs_rms/count"} <= set(meta["arrays"])
    with np.load(path) as z:
        np.testing.assert_array_equal(z["params/obs_rms/mean"], np.asarray(restored.state.obs_rms.mean)[0])
        assert np.abs(z["params/obs_rms/mean"]).max() > 0.01  # statistics learnt during the run
    pi = export.load_policy(path)
    obs = _observations(8, seed=2)
    unit = np.asarray(restored.policy(0)(obs[None]))[0]
    np.testing.assert_array_equal(pi(obs), np.clip(unit.astype(np.float64), -2.0, 2.0).astype(np.float32))
    np.testing.assert_array_equal(pi(obs), restored.env_policy(0)(obs))
    evaluator = restored.evaluator(seed=0)
    evaluator.env.close()
    assert _episode(pi, evaluator.env_seeds[0]) == _own_eval(d)[0][0]


def _constructed_run(tmp_path, agent_name: str, agent_cfg) -> Path:
    """A run directory whose one checkpoint (step 10) is the loop's own template (``checkpoint_template``)
    with the agent state's float arrays drawn at random (scale 0.3: actions not saturated) and its
    buffers empty: a real checkpoint of that agent's layout, nothing trained or compiled for training."""
    import jax

    from plasticity_zoo import agents
    from plasticity_zoo.analysis.restore import checkpoint_template
    from plasticity_zoo.training import checkpoint
    from plasticity_zoo.training import config as config_lib
    from plasticity_zoo.training.config import NetworkConfig, RunConfig

    d = tmp_path / agent_name
    d.mkdir()
    cfg = RunConfig(
        env="Pendulum-v1", network=NetworkConfig(width=16), agent_name=agent_name, agent=agent_cfg, eval_episodes=2
    )
    (d / "config.json").write_text(config_lib.dump(cfg))
    rng = np.random.default_rng(0)

    def fill(x):
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) or not np.issubdtype(x.dtype, np.floating):
            return x
        return (0.3 * rng.normal(size=x.shape)).astype(x.dtype)

    template = checkpoint_template(cfg, agents.get(agent_name), 3, 1)
    checkpoint.save(d, 10, template._replace(agent=jax.tree.map(fill, template.agent)), {"step": 10})
    return d


@pytest.mark.slow
@pytest.mark.parametrize(
    "agent_name, fields",
    [
        ("mrq", {"encoder_params", "policy_params"}),  # pi(f(s)): the encoder and the policy, no value nets or targets
        ("ravl", {"actor_params"}),  # an offline agent (its checkpoint holds model buffers): SAC's actor
    ],
)
def test_constructed_checkpoints_export_what_the_agent_acts_through(tmp_path, agent_name, fields):
    from plasticity_zoo import agents
    from plasticity_zoo.analysis.restore import restore_policy

    d = _constructed_run(
        tmp_path,
        agent_name,
        agents.get(agent_name).CONFIG(buffer_size=1000) if agent_name == "mrq" else agents.get(agent_name).CONFIG(),
    )
    restored = restore_policy(d)
    path = export.export_policy(d, tmp_path / f"{agent_name}.npz")
    assert {name.split("/")[0] for name in export.read_meta(path)["arrays"]} == fields
    pi = export.load_policy(path)
    obs = _observations(6, seed=4)
    got = pi(obs)
    np.testing.assert_array_equal(got, restored.env_policy(0)(obs))
    np.testing.assert_array_equal(pi.unit(obs), np.asarray(restored.policy(0)(obs[None]))[0])
    assert np.abs(got).max() < 2.0 and len(np.unique(got)) == 6  # not saturated: the test tells actions apart


# ------------------------------------------------------------------------------------------- mistakes
def _fake_run(tmp_path, agent_name: str, agent_cfg) -> Path:
    """A run directory with a config.json only (its agent's defaults): enough for the refusals."""
    from plasticity_zoo.training import config as config_lib
    from plasticity_zoo.training.config import RunConfig

    d = tmp_path / agent_name
    d.mkdir()
    (d / "config.json").write_text(config_lib.dump(RunConfig(agent_name=agent_name, agent=agent_cfg)))
    return d


def _error(args, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        script.cli(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_mistakes_stop_with_one_error_line(tmp_path, capsys):
    from plasticity_zoo.agents.neubay_config import NeuBayConfig
    from plasticity_zoo.agents.sac import SACConfig

    out = str(tmp_path / "p.npz")
    assert "no such run directory" in _error([str(tmp_path / "nope"), "--out", out], capsys)
    assert "not a run directory (no config.json)" in _error([str(tmp_path), "--out", out], capsys)
    sac_dir = _fake_run(tmp_path, "sac", SACConfig())
    assert "no checkpoint in" in _error([str(sac_dir), "--out", out], capsys)
    assert "--seed 3: the run has 1 seed(s)" in _error([str(sac_dir), "--seed", "3", "--out", out], capsys)
    assert "written as a .npz file" in _error([str(sac_dir), "--out", str(tmp_path / "p.pt")], capsys)
    assert "inside the run's checkpoint folder" in _error(
        [str(sac_dir), "--out", str(sac_dir / "ckpt" / "p.npz")], capsys
    )
    line = _error([str(_fake_run(tmp_path, "neubay", NeuBayConfig())), "--out", out], capsys)
    assert "agent 'neubay' cannot be exported: its policy is recurrent" in line
    assert not Path(out).exists()
    with pytest.raises(ValueError, match="agent 'mrq-mt' cannot be exported: its policy is conditioned on the task"):
        export.check_exportable("mrq-mt")
    (tmp_path / "junk.npz").write_bytes(b"PK junk")
    with pytest.raises(ValueError, match="junk.npz: not an exported policy"):
        export.load_policy(tmp_path / "junk.npz")


@pytest.mark.slow
def test_step_selects_the_checkpoint_and_a_missing_one_is_refused(sac_run, tmp_path, capsys):
    meta = script.main([str(sac_run), "--step", "300", "--out", str(tmp_path / "p.npz")])
    assert meta["step"] == 300 and meta["checkpoint"] == "step_000000000300" and meta["seed"] == 0
    line = _error([str(sac_run), "--step", "123", "--out", str(tmp_path / "q.npz")], capsys)
    assert "no checkpoint at step 123; checkpoints: 300" in line and not (tmp_path / "q.npz").exists()


def test_an_exported_file_that_does_not_fit_the_agents_networks_is_refused(tmp_path):
    """``fill_state`` checks names, shapes and dtypes against the networks the zoo builds from the file's config."""
    import jax

    from plasticity_zoo.agents import sac
    from plasticity_zoo.networks.config import NetworkConfig

    abstract = jax.eval_shape(lambda: sac.init(jax.random.key(0), 3, 1, sac.SACConfig(), NetworkConfig(width=8)))
    arrays = {
        name: np.zeros(x.shape, x.dtype)
        for name, x in zip(
            export.checkpoint.array_names({"actor_params": abstract.actor_params}),
            jax.tree.leaves(abstract.actor_params),
        )
    }
    state = export.fill_state(abstract, ("actor_params",), arrays, "p.npz")
    assert not np.asarray(state.actor_params["out"]["kernel"][...]).any() and state.log_alpha.shape == ()
    wide = dict(arrays, **{"actor_params/trunk/layers/0/kernel/value": np.zeros((3, 9), np.float32)})
    with pytest.raises(
        ValueError,
        match=r"p.npz: array actor_params/trunk/layers/0/kernel/value is float32\(3, 9\), "
        r"this agent's networks expect float32\(3, 8\)",
    ):
        export.fill_state(abstract, ("actor_params",), wide, "p.npz")
    renamed = {k.replace("layers/1", "layers/7"): v for k, v in arrays.items()}
    with pytest.raises(ValueError, match="do not fit this agent's networks: no array actor_params/trunk/layers/1/"):
        export.fill_state(abstract, ("actor_params",), renamed, "p.npz")
    meta = json.dumps({"kind": "something else", "format": 1})
    np.savez(tmp_path / "other.npz", meta=np.asarray(meta))
    with pytest.raises(ValueError, match="not an exported policy of format 1"):
        export.load_policy(tmp_path / "other.npz")
