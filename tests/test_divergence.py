"""Non-finite env states on the device: a diverged env resets, is counted (``env/diverged``) and is kept out
of the replay (``envs/playground.py``, ``training/loops/device.py``, ``buffers``)."""

import csv
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import device_toy

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mujoco_playground") is None, reason="MuJoCo Playground (extra .[mjx]) is not installed"
)


@pytest.fixture
def toy(monkeypatch):
    device_toy.use_toy(monkeypatch)


def test_a_diverged_step_resets_its_env_reads_reward_zero_and_the_last_finite_observation(toy):
    from plasticity_zoo.envs.playground import env_keys, make

    pg = make(device_toy.EXPLODING)
    state = pg.reset(env_keys([0, 1]))
    before = np.asarray(state.inner.obs)
    state, out = pg.step(state, jnp.asarray([[0.95], [0.5]]))  # env 0 pushed with 1.95 > 1.9: NaN physics
    assert out.diverged.tolist() == [True, False]
    assert out.terminated.tolist() == [True, False] and not out.truncated.any()  # nothing bootstraps from it
    assert out.finished.tolist() == [False, False]  # not a finished episode: no return or length reported
    assert float(out.reward[0]) == 0.0 and float(out.ep_return[0]) == 0.0 and int(out.ep_length[0]) == 0
    np.testing.assert_array_equal(out.next_obs[0], before[0])
    assert np.isfinite(np.asarray(out.obs)).all() and int(state.t[0]) == 0  # env 0 reset in the same step
    assert float(out.reward[1]) > 0 and int(state.t[1]) == 1


def test_the_replays_keep_out_invalid_rows():
    from plasticity_zoo.buffers import lap, replay

    def batch(values, terminated=(False, False, False)):
        v = jnp.asarray(values, jnp.float32)
        return replay.Transition(v[:, None], v[:, None], v, v[:, None], jnp.asarray(terminated), jnp.zeros(3, bool))

    valid = jnp.asarray([True, False, True])
    uniform = replay.add(replay.init(8, 1, 1), batch([1.0, np.nan, 3.0]), valid)
    assert int(uniform.size) == 2 and int(uniform.ptr) == 2
    np.testing.assert_array_equal(uniform.data.reward[:2], [1.0, 3.0])

    buf = lap.init(12, 1, 1, horizon=2)  # 3 env streams, windows of 2
    buf = lap.add(buf, batch([1.0, 2.0, 3.0]))
    buf = lap.add(buf, batch([4.0, np.nan, 6.0], terminated=(False, True, False)), valid)
    buf = lap.add(buf, batch([7.0, 8.0, 9.0]))
    assert buf.step.tolist()[:9] == [0, 0, 0, 1, -1, 1, 2, 2, 2]  # env 1's slot at call 1: never written
    # windows of 2 start at env 0's and env 2's first two slots only: none holds env 1's invalid slot
    assert np.nonzero(np.asarray(buf.valid))[0].tolist() == [0, 2, 3, 5]
    assert not bool(buf.ever_terminated)  # the invalid row's termination does not count


def _rows(run_dir, name):
    return list(csv.DictReader(open(run_dir / name)))


@pytest.mark.slow
def test_sac_on_a_diverging_env_keeps_the_diverged_steps_out_of_its_replay_and_counts_them(
    toy, tiny_sac_config, tmp_path
):
    """SAC in the device loop, 2 seeds x 4 envs, 152 env steps per seed (the first 52 random, where 5% of
    the actions blow the toy's physics up): every stored transition is finite, each seed's replay holds
    its env steps less its diverged ones, and the count is logged."""
    from plasticity_zoo import agents
    from plasticity_zoo.training.loops import device

    cfg = tiny_sac_config(
        env=device_toy.EXPLODING,
        seeds=2,
        num_envs=4,
        total_steps=152,
        learning_starts=52,
        batch_size=8,
        buffer_size=1024,
        eval_every=152,
        log_every=152,
        checkpoint_every=152,
    )
    out = device.train(cfg, agents.get("sac"), tmp_path / "run")
    rows = _rows(tmp_path / "run", "metrics.csv")
    diverged = np.asarray([float(r["env/diverged"]) for r in rows if r["step"] == "152"])
    assert diverged.shape == (2,) and (diverged > 0).all(), diverged
    assert all(np.isfinite(float(r["losses/qf_loss"])) for r in rows if r.get("losses/qf_loss"))
    data, size = out["buffer"].data, np.asarray(out["buffer"].size)
    np.testing.assert_array_equal(size, 152 - diverged)  # 152 env steps per seed (38 of 4 envs), less the diverged
    for name, x in zip(data._fields, data):
        assert np.isfinite(np.asarray(x, np.float32)).all(), name


@pytest.mark.slow
def test_ppo_on_a_diverging_env_stays_finite_and_counts_them(toy, tmp_path):
    from plasticity_zoo.agents import ppo
    from plasticity_zoo.training.config import NetworkConfig, RunConfig
    from plasticity_zoo.training.loops import device

    cfg = RunConfig(
        env=device_toy.EXPLODING,
        seeds=2,
        num_envs=4,
        total_steps=64,
        eval_every=64,
        eval_episodes=1,
        log_every=32,
        checkpoint_every=64,
        progress=False,
        network=NetworkConfig(width=16),
        agent_name="ppo",
        agent=ppo.PPOConfig(num_steps=8, num_minibatches=2, update_epochs=2),
    )
    out = device.train(cfg, ppo, tmp_path / "run")
    rows = _rows(tmp_path / "run", "metrics.csv")
    last = [r for r in rows if r["step"] == "64"]
    assert len(last) == 2 and all(float(r["env/diverged"]) > 0 for r in last)
    assert all(np.isfinite(float(r["losses/value"])) for r in rows)
    leaves = jax.tree.leaves(out["state"])
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))


@pytest.mark.slow
def test_the_host_loop_on_a_diverging_playground_env_keeps_the_diverged_steps_out_of_its_replay(toy, tiny_sac_config):
    """``--loop host``: the host vector env flags the rows of a step where an env diverged, and the off-policy
    loop's store keeps them out of the replay (2 seeds x 4 envs, 38 vector steps, 5% of random actions blow up)."""
    from plasticity_zoo import agents
    from plasticity_zoo.training.loops.offpolicy import OffPolicyIteration

    cfg = tiny_sac_config(env=device_toy.EXPLODING, seeds=2, num_envs=4, learning_starts=140, buffer_size=1024)
    host = OffPolicyIteration(cfg, agents.get("sac"))
    host.fresh()
    step = 0
    while step < 152:
        report = host.step(step, 0)
        step += report.steps
        assert report.finite is None or bool(report.finite)
    assert host.env.diverged > 0
    assert int(np.sum(np.asarray(host.buffer.size))) == 2 * 152 - host.env.diverged
    for name, x in zip(host.buffer.data._fields, host.buffer.data):
        assert np.isfinite(np.asarray(x, np.float32)).all(), name
