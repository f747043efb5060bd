import pickle

import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import sac
from plasticity_zoo.buffers import replay
from plasticity_zoo.envs import make_env, make_vector_env


def test_truncation_and_termination_reach_the_buffer_and_the_target():
    """ToyChain: x += a, terminated at x >= 3, time limit 5.  Actions 1.0 terminate at t=3; 0.1 truncate at t=5."""
    env = make_vector_env("ToyChain-v0", 2, seed=0)
    obs = env.reset()
    buf = replay.init(16, 2, 1)
    actions = np.array([[1.0], [0.1]], np.float32)
    for t in range(5):
        new_obs, r, term, trunc, next_obs = env.step(actions)
        buf = replay.add(buf, replay.Transition(obs, actions, r, next_obs, term, trunc))
        obs = new_obs
    d = buf.data
    n = int(buf.size)
    assert n == 10
    rows = {(int(round(float(d.obs[i, 0]))), i % 2): i for i in range(n)}
    # env 0 terminates on its 3rd step: stored next_obs is the true final state (t=3, x=3), terminated
    i = rows[(2, 0)]
    np.testing.assert_allclose(d.next_obs[i], [3.0, 3.0])
    assert bool(d.terminated[i]) and not bool(d.truncated[i])
    # after the reset, env 0's next transition starts from the fresh state (t=0)
    assert float(d.obs[rows[(0, 0)], 0]) == 0.0 and sum(1 for k in rows if k == (0, 0)) == 1
    # env 1 is cut by the time limit at t=5: truncated, not terminated, next_obs is the real final state
    i = rows[(4, 1)]
    np.testing.assert_allclose(d.next_obs[i], [5.0, 0.5], rtol=1e-6)
    assert bool(d.truncated[i]) and not bool(d.terminated[i])
    # the returned observation to act on after truncation is the reset one
    np.testing.assert_allclose(obs[1], [0.0, 0.0])
    # TD targets: the truncated transition bootstraps, the terminated one does not
    y = sac.td_target(
        jnp.array([1.0, 1.0]),
        d.terminated[jnp.array([rows[(2, 0)], rows[(4, 1)]])],
        jnp.array([10.0, 10.0]),
        jnp.zeros(2),
        0.0,
        0.9,
    )
    np.testing.assert_allclose(y, [1.0, 10.0])
    assert [ret for _, ret, _ in env.pop_finished()] == [3.0, 5.0]


def test_replay_wraps_around_and_samples_only_stored_rows():
    buf = replay.init(5, 1, 1)
    for k in range(3):
        x = jnp.full((2, 1), float(k))
        buf = replay.add(buf, replay.Transition(x, x, jnp.full(2, float(k)), x, jnp.zeros(2, bool), jnp.zeros(2, bool)))
    assert int(buf.size) == 5 and int(buf.ptr) == 1
    np.testing.assert_allclose(buf.data.reward, [2, 0, 1, 1, 2])  # 6 rows into 5 slots: row 5 overwrote row 0
    small = replay.add(
        replay.init(100, 1, 1),
        replay.Transition(
            jnp.ones((3, 1)),
            jnp.ones((3, 1)),
            jnp.array([7.0, 8.0, 9.0]),
            jnp.ones((3, 1)),
            jnp.zeros(3, bool),
            jnp.zeros(3, bool),
        ),
    )
    import jax

    s = replay.sample(small, jax.random.key(0), 1000)
    assert set(np.asarray(s.reward).tolist()) == {7.0, 8.0, 9.0}


@pytest.mark.parametrize(
    "env_id,obs_dim,act_dim,horizon",
    [("Pendulum-v1", 3, 1, 200), ("HalfCheetah-v5", 17, 6, 1000), ("dmc:cartpole-balance", 5, 1, 500)],
)
def test_env_ids_shapes_action_range_and_time_limits(env_id, obs_dim, act_dim, horizon):
    env = make_env(env_id, seed=0)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (obs_dim,) and obs.dtype == np.float32
    assert env.action_space.shape == (act_dim,)
    assert np.all(env.action_space.low == -1) and np.all(env.action_space.high == 1)
    steps, done = 0, False
    while not done:
        obs, r, term, trunc, _ = env.step(np.zeros(act_dim, np.float32))
        steps += 1
        done = term or trunc
        assert steps <= horizon
    if env_id != "dmc:cartpole-balance":  # a balancing cart with zero force may stay up the whole episode
        assert trunc and not term and steps == horizon
    else:
        assert steps == horizon and trunc  # 1000 frames with action repeat 2, cut by the time limit


def test_dmc_action_repeat_sums_rewards():
    one = make_env("dmc:cartpole-swingup", seed=3, action_repeat=1)
    two = make_env("dmc:cartpole-swingup", seed=3, action_repeat=2)
    one.reset(seed=3)
    two.reset(seed=3)
    a = np.array([0.5], np.float32)
    r1 = one.step(a)[1] + one.step(a)[1]
    obs1 = one.step(a)[0]
    r2 = two.step(a)[1]
    obs2 = two.step(a)[0]
    assert r2 == pytest.approx(r1, rel=1e-6)
    assert not np.allclose(obs1, obs2)  # 3 frames vs 4 frames


def test_unknown_ids_fail_with_the_valid_forms():
    with pytest.raises(ValueError, match="dmc:<domain>-<task>"):
        make_env("NotAnEnv-v9")
    with pytest.raises(ValueError, match="valid tasks"):
        make_env("dmc:cheetah-fly")
    with pytest.raises(ValueError, match="malformed"):
        make_env("dmc:cheetah")


def test_mujoco_vector_env_pickles_bit_exactly_across_a_reset():
    env = make_vector_env("Hopper-v5", 2, seed=1)
    env.reset()
    rng = np.random.default_rng(0)
    for _ in range(10):
        env.step(env.sample_actions(rng))
    clone = pickle.loads(pickle.dumps(env))
    for _ in range(300):  # Hopper falls and resets within this window
        a = env.sample_actions(rng)
        for x, y in zip(env.step(a), clone.step(a)):
            np.testing.assert_array_equal(x, y)
    assert len(env.pop_finished()) > 0
