"""Multitask env ids (``mt:``, envs/multitask.py): parsing, TaskSpec, padding, the vector env."""

import pickle

import gymnasium as gym
import numpy as np
import pytest

from plasticity_zoo.envs import make_env, make_vector_env
from plasticity_zoo.envs.dmc import DMCEnv
from plasticity_zoo.envs.multitask import SUITES, TaskSpec, is_multitask, member_ids, task_spec

CART_PEND = "mt:dmc:cartpole-balance,dmc:pendulum-swingup"
CART_REACH = "mt:dmc:cartpole-balance,dmc:reacher-easy"


class _NoLimit(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)


if "MtNoLimit-v0" not in gym.registry:
    gym.register("MtNoLimit-v0", entry_point=_NoLimit)


def test_suites_and_explicit_lists_parse():
    assert is_multitask("mt:dmc4") and not is_multitask("dmc:cartpole-balance") and not is_multitask(None)
    dmc21 = SUITES["dmc21"]
    assert len(dmc21) == 21 and len(set(dmc21)) == 21
    assert dmc21[:3] == ("dmc:walker-stand", "dmc:walker-walk", "dmc:walker-run") and dmc21[-1] == "dmc:quadruped-run"
    assert {
        "dmc:cartpole-balance_sparse",
        "dmc:cartpole-swingup_sparse",
        "dmc:ball_in_cup-catch",
        "dmc:finger-turn_easy",
        "dmc:finger-turn_hard",
    } <= set(dmc21)
    assert SUITES["dmc6"] == SUITES["dmc4"] + ("dmc:cheetah-run", "dmc:walker-walk")
    assert member_ids("mt:cartpole2") == ("dmc:cartpole-balance", "dmc:cartpole-swingup")
    assert member_ids(CART_PEND) == ("dmc:cartpole-balance", "dmc:pendulum-swingup")
    assert member_ids("mt:dmc:cartpole-balance") == ("dmc:cartpole-balance",)
    assert member_ids("mt:Pendulum-v1") == ("Pendulum-v1",)


@pytest.mark.parametrize(
    "env_id,words",
    [
        ("mt:", "empty task list"),
        ("mt:a,,b", "empty member"),
        ("mt:dmc99", "unknown multitask suite 'dmc99'.*mt:<id>,<id>.*dmc21"),
        ("mt:mt:dmc4", "nested"),
        ("mt:dmc:cartpole-balance,ns:reward_flip:Pendulum-v1", "ns: ids are not supported in a multitask env"),
        ("mt:playground:CartpoleBalance", "playground: ids are not supported in a multitask env"),
        (
            "mt:dmc:cartpole-balance,dmc:pendulum-swingup,dmc:cartpole-balance",
            "duplicate member 'dmc:cartpole-balance'",
        ),
        (
            "mt:dmc:cartpole-balance,dmc:cheetah-fly",
            "^'mt:dmc:cartpole-balance,dmc:cheetah-fly': unknown Control Suite task",
        ),
        ("mt:dmc:cheetah,dmc:cartpole-balance", "^'mt:dmc:cheetah,dmc:cartpole-balance': malformed Control Suite id"),
        ("mt:NotAnEnv-v9,Pendulum-v1", "unknown env id 'NotAnEnv-v9'"),
        ("mt:Pendulum-v1,MtNoLimit-v0", "'MtNoLimit-v0' has no finite episode limit"),
    ],
)
def test_bad_ids_are_refused_by_name(env_id, words):
    with pytest.raises(ValueError, match=words):
        task_spec(env_id)
    with pytest.raises(ValueError, match=words):
        make_env(env_id)


def test_task_spec_against_hand_values():
    spec = task_spec("mt:cartpole2")
    assert spec == TaskSpec(
        "mt:cartpole2", ("dmc:cartpole-balance", "dmc:cartpole-swingup"), (5, 5), (1, 1), (500, 500)
    )
    assert (spec.num_tasks, spec.obs_dim, spec.act_dim) == (2, 7, 1)
    mt = "mt:dmc:cartpole-balance,dmc:pendulum-swingup,dmc:reacher-easy"
    spec = task_spec(mt)
    assert (spec.obs_dims, spec.act_dims, spec.episode_lengths) == ((5, 3, 6), (1, 1, 2), (500, 500, 500))
    assert (spec.max_obs_dim, spec.max_act_dim, spec.obs_dim, spec.act_dim) == (6, 2, 9, 2)
    np.testing.assert_array_equal(spec.action_mask(), np.array([[1, 0], [1, 0], [1, 1]], np.float32))
    assert spec.action_mask().dtype == np.float32 and hash(spec) == hash(task_spec(mt))
    assert task_spec(mt, 1).episode_lengths == (1000, 1000, 1000)
    assert task_spec("mt:Pendulum-v1,ToyChain-v0").episode_lengths == (200, 5)


def test_all_21_dmc_tasks_build():
    spec = task_spec("mt:dmc21")
    assert spec.num_tasks == 21 and set(spec.episode_lengths) == {500}
    assert (spec.max_obs_dim, spec.max_act_dim) == (78, 12)  # quadruped


def test_member_gets_only_its_own_action_dims_and_obs_is_padded_member_obs():
    mt = make_env(CART_REACH, seed=3, task=0)
    alone = make_env("dmc:cartpole-balance", seed=3)
    assert mt.task == 0 and mt.spec_mt is mt.task_spec and isinstance(mt.unwrapped, DMCEnv)
    assert mt.observation_space.shape == (8,) and mt.action_space.shape == (2,)
    received = []
    member_step = mt.env.step
    mt.env.step = lambda a: (received.append(np.array(a)), member_step(a))[1]
    obs, _ = mt.reset(seed=7)
    ref, _ = alone.reset(seed=7)
    rng = np.random.default_rng(0)
    for t in range(6):
        np.testing.assert_array_equal(obs[:5], ref)
        assert obs.dtype == np.float32 and np.all(obs[5:6] == 0) and list(obs[6:]) == [1.0, 0.0]
        action = rng.uniform(-1, 1, 2).astype(np.float32)
        obs, r, term, trunc, _ = mt.step(action)
        ref, r_ref, term_ref, trunc_ref, _ = alone.step(action[:1])
        assert (r, term, trunc) == (r_ref, term_ref, trunc_ref)
        np.testing.assert_array_equal(received[-1], action[:1])
    assert len(received) == 6 and all(a.shape == (1,) for a in received)
    reacher = make_env(CART_REACH, seed=3, task=1)
    obs, _ = reacher.reset(seed=7)
    assert list(obs[6:]) == [0.0, 1.0]


def test_task_argument_is_checked():
    with pytest.raises(ValueError, match=r"task must be an int in \[0, 2\)"):
        make_env(CART_PEND, task=2)
    with pytest.raises(ValueError, match="mt:"):
        make_env("Pendulum-v1", task=1)


def test_vector_env_runs_one_task_per_env_and_pickles_exactly():
    env = make_vector_env(CART_PEND, 4, seed=0)
    np.testing.assert_array_equal(env.task_index, [0, 1, 0, 1])
    assert [e.task for e in env.envs] == [0, 1, 0, 1] and (env.obs_dim, env.act_dim) == (7, 1)
    obs = env.reset()
    assert obs.shape == (4, 7)
    np.testing.assert_array_equal(obs[:, 5:], [[1, 0], [0, 1], [1, 0], [0, 1]])
    np.testing.assert_array_equal(obs[1::2, 3:5], 0)  # pendulum's padding
    rng = np.random.default_rng(0)
    for _ in range(5):
        env.step(env.sample_actions(rng))
    clone = pickle.loads(pickle.dumps(env))
    np.testing.assert_array_equal(clone.task_index, env.task_index)
    for _ in range(10):
        a = env.sample_actions(rng)
        for x, y in zip(env.step(a), clone.step(a)):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(make_vector_env("Pendulum-v1", 2, seed=0).task_index, [0, 0])


def test_vector_env_refusals():
    with pytest.raises(ValueError, match=r"has 2 tasks: the vector env needs a multiple of 2 envs .*--num-envs 2"):
        make_vector_env(CART_PEND, 3, seed=0)
    for backend in ("async", "envpool"):
        with pytest.raises(ValueError, match="sync backend only"):
            make_vector_env(CART_PEND, 2, seed=0, backend=backend)
