import pickle

import numpy as np
import pytest

from plasticity_zoo.envs import make_env, make_vector_env
from plasticity_zoo.envs import nonstationary as ns
from plasticity_zoo.envs.vector import CountingVectorEnv


def run(env, actions, reset_seed=0):
    """Step ``env`` through ``actions`` with same-step resets; per step (obs, r, term, trunc, info)."""
    env.reset(seed=reset_seed)
    out = []
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        out.append((obs, r, term, trunc, info))
        if term or trunc:
            env.reset()
    return out


# ----------------------------------------------------------------------------------------------
# Grammar
# ----------------------------------------------------------------------------------------------
def test_grammar_parses_modes_options_and_dmc_bases():
    s = ns.parse("ns:chain:dmc:walker-stand,dmc:walker-walk,dmc:walker-run:every=1000000,switch=hard")
    assert s.mode == "chain" and s.bases == ("dmc:walker-stand", "dmc:walker-walk", "dmc:walker-run")
    assert (s.every, s.switch, s.seed) == (1_000_000, "hard", 0)
    s = ns.parse("ns:chain:dmc:walker-stand,dmc:walker-walk")  # no options: the last field is part of the base
    assert s.bases == ("dmc:walker-stand", "dmc:walker-walk") and s.every == 1_000_000
    s = ns.parse("ns:dynamics:Ant-v5:every=2e6,params=friction+mass,seed=3")
    assert (s.every, s.params, s.seed) == (2_000_000, ("friction", "mass"), 3)
    assert ns.parse("ns:task_chain:A-v0,B-v0").mode == "chain"
    assert ns.parse("ns:obs_permute:Hopper-v5:signs=1").signs
    assert ns.parse("ns:reward_flip:dmc:cheetah-run:term=all").term == "all"


def test_plasticine_scenarios_expand_to_their_task_lists_with_the_protocols_defaults():
    s = ns.parse("ns:chain:plasticine-walker")
    assert s.bases == ("dmc:walker-stand", "dmc:walker-walk", "dmc:walker-run")
    assert (s.every, s.switch, s.eval) == (1_000_000, "hard", "all")
    s = ns.parse("ns:chain:plasticine-quadruped:every=5000,eval=current,switch=lazy")  # options override
    assert s.bases == ("dmc:quadruped-walk", "dmc:quadruped-run", "dmc:quadruped-walk")
    assert (s.every, s.switch, s.eval) == (5000, "lazy", "current")
    assert len(ns.parse("ns:chain:plasticine-dog").bases) == 4
    assert ns.parse("ns:chain:A-v0,B-v0").eval == "current"  # a chain of ids keeps the old defaults
    assert ns.eval_tasks("ns:chain:plasticine-quadruped") == ("dmc:quadruped-walk", "dmc:quadruped-run")
    assert ns.eval_tasks("ns:chain:plasticine-walker:eval=current") is None
    assert ns.eval_tasks("dmc:walker-walk") is None


@pytest.mark.parametrize(
    "env_id,match",
    [
        ("ns:wobble:HalfCheetah-v5", "unknown non-stationary mode 'wobble'"),
        ("ns:reward_flip", "missing the base env"),
        (
            "ns:reward_flip:HalfCheetah-v5:every=10,color=red",
            "unknown option.*color.*valid options: every, seed, switch, term",
        ),
        ("ns:reward_flip:HalfCheetah-v5:every=ten", "every='ten' must be an integer"),
        ("ns:reward_flip:HalfCheetah-v5:every=0", "every must be >= 1"),
        ("ns:reward_flip:HalfCheetah-v5:every", "malformed"),
        ("ns:chain:HalfCheetah-v5", "at least two env ids"),
        ("ns:reward_flip:HalfCheetah-v5,Hopper-v5", "only mode 'chain'"),
        ("ns:dynamics:Hopper-v5:params=wind", "params must be"),
        ("ns:obs_permute:Hopper-v5:switch=soon", "switch must be lazy or hard"),
        ("ns:reward_flip:ns:reward_flip:Hopper-v5", "cannot be nested"),
        ("ns:chain:plasticine-cheetah", "unknown scenario 'plasticine-cheetah'; scenarios: plasticine-walker"),
        ("ns:chain:plasticine-walker:eval=some", "eval must be current or all"),
        ("ns:reward_flip:HalfCheetah-v5:eval=all", "unknown option.*eval"),
    ],
)
def test_grammar_errors_are_clear(env_id, match):
    with pytest.raises(ValueError, match=match):
        ns.parse(env_id)


def test_make_env_delegates_and_reports_bad_bases_and_mismatched_chains():
    with pytest.raises(ValueError, match="a chain needs identical spaces.*'HalfCheetah-v5'.*\\(17,\\).*'Hopper-v5'"):
        make_env("ns:chain:HalfCheetah-v5,Hopper-v5")
    with pytest.raises(ValueError, match="unknown env id 'Nope-v1'"):
        make_env("ns:reward_flip:Nope-v1")
    with pytest.raises(ValueError, match="needs a MuJoCo env"):
        make_env("ns:dynamics:Pendulum-v1")
    env = make_env("ns:reward_flip:Pendulum-v1:every=10")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="reward_forward.*use term=all"):
        env.step(np.zeros(1, np.float32))


# ----------------------------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------------------------
def test_reward_flip_hard_switch_flips_only_the_forward_term_and_truncates():
    env = make_env("ns:reward_flip:HalfCheetah-v5:every=5,switch=hard", seed=0)
    rng = np.random.default_rng(0)
    out = run(env, [rng.uniform(-1, 1, 6).astype(np.float32) for _ in range(12)])
    for t, (_, r, term, trunc, info) in enumerate(out, start=1):
        sign = -1.0 if (t - 1) // 5 % 2 else 1.0  # steps 1..5 phase 0, 6..10 phase 1, 11.. phase 2
        assert r == pytest.approx(sign * info["reward_forward"] + info["reward_ctrl"], rel=1e-6, abs=1e-9)
        assert info["task_id"] == (0 if sign > 0 else 1) and info["ns_phase"] == (t - 1) // 5
        assert trunc == (t in (5, 10)) and not term  # the hard switch cuts the episode; never a termination


def test_lazy_switch_waits_for_the_episode_reset():
    # ToyChain (conftest): reward 1 per step, actions 0 never terminate, time limit 5 -> episodes of 5 steps
    env = make_env("ns:reward_flip:ToyChain-v0:every=4,term=all", seed=0)
    out = run(env, [np.zeros(1, np.float32)] * 12)
    rewards = [r for _, r, *_ in out]
    # the switch falls after step 4 but applies at the reset after step 5; phase 2 (count 8) at the reset after 10
    assert rewards == [1.0] * 5 + [-1.0] * 5 + [1.0] * 2
    assert [o[3] for o in out] == [t % 5 == 0 for t in range(1, 13)]  # only the time limit truncates


def test_chain_switches_tasks_at_the_right_step():
    env = make_env("ns:chain:InvertedPendulum-v5,InvertedPendulum-v4:every=4,switch=hard", seed=1)
    out = run(env, [np.zeros(1, np.float32)] * 9)
    assert [o[4]["task_id"] for o in out] == [0, 0, 0, 0, 1, 1, 1, 1, 0]
    assert env.unwrapped.spec.id == "InvertedPendulum-v5"  # the chain cycles after its last task


def test_dynamics_schedule_applies_seeded_factors_and_is_reproducible():
    env = make_env("ns:dynamics:Hopper-v5:every=4,switch=hard,seed=7", seed=0)
    model = env.unwrapped.model
    nominal = (model.geom_friction[:, 0].copy(), float(model.opt.gravity[2]), model.body_mass.copy())
    run(env, [np.zeros(3, np.float32)] * 5)
    f = ns.dynamics_factors(env.spec_ns, 1, len(nominal[2]))
    assert 0.1 <= f["friction"] <= 10**0.5 and 0.5 <= f["gravity"] <= 1.5
    assert np.all((f["mass"] >= 0.5) & (f["mass"] <= 2))
    np.testing.assert_allclose(model.geom_friction[:, 0], nominal[0] * f["friction"])
    assert float(model.opt.gravity[2]) == pytest.approx(nominal[1] * f["gravity"])
    np.testing.assert_allclose(model.body_mass, nominal[2] * f["mass"])
    # the schedule is a function of (seed, phase) only
    again = ns.dynamics_factors(ns.parse("ns:dynamics:Hopper-v5:seed=7"), 1, len(nominal[2]))
    other = ns.dynamics_factors(ns.parse("ns:dynamics:Hopper-v5:seed=8"), 1, len(nominal[2]))
    assert again["friction"] == f["friction"] and other["friction"] != f["friction"]
    np.testing.assert_allclose(ns.dynamics_factors(env.spec_ns, 0, 3)["mass"], 1.0)  # phase 0 is nominal
    only = ns.dynamics_factors(ns.parse("ns:dynamics:Hopper-v5:seed=7,params=friction"), 1, len(nominal[2]))
    assert only["friction"] == f["friction"] and only["gravity"] == 1.0 and np.all(only["mass"] == 1.0)


def test_dynamics_env_pickles_bit_exactly_with_its_shifted_model():
    env = make_env("ns:dynamics:Hopper-v5:every=4,switch=hard", seed=0)
    rng = np.random.default_rng(0)
    run(env, [rng.uniform(-1, 1, 3).astype(np.float32) for _ in range(6)])
    clone = pickle.loads(pickle.dumps(env))
    np.testing.assert_array_equal(clone.unwrapped.model.body_mass, env.unwrapped.model.body_mass)
    assert clone.phase == env.phase == 1
    for _ in range(30):  # crosses the next hard switch (count 8) and its reset
        a = rng.uniform(-1, 1, 3).astype(np.float32)
        x, y = env.step(a), clone.step(a)
        for p, q in zip(x[:4], y[:4]):
            np.testing.assert_array_equal(p, q)
        if x[2] or x[3]:
            np.testing.assert_array_equal(env.reset()[0], clone.reset()[0])


def test_obs_permute_is_invertible_and_reproducible():
    env = make_env("ns:obs_permute:Hopper-v5:every=3,switch=hard,signs=1", seed=0)
    base = make_env("Hopper-v5", seed=0)
    env.reset(seed=0)
    base.reset(seed=0)
    for t in range(1, 8):
        a = np.full(3, 0.1, np.float32)
        obs, _, _, trunc, info = env.step(a)
        b_obs = base.step(a)[0]
        perm, signs = ns.permutation(env.spec_ns, info["ns_phase"], 11)
        np.testing.assert_allclose(obs, signs * b_obs[perm], rtol=1e-6)
        np.testing.assert_allclose(env.inverse_obs(obs), b_obs, rtol=1e-6)
        if trunc:
            o1, o2 = env.reset()[0], base.reset()[0]
            np.testing.assert_allclose(env.inverse_obs(o1), o2, rtol=1e-6)
    assert info["ns_phase"] == 2 and sorted(perm) == list(range(11)) and set(signs) <= {-1.0, 1.0}
    p2, s2 = ns.permutation(ns.parse("ns:obs_permute:Hopper-v5:signs=1"), 2, 11)
    np.testing.assert_array_equal(p2, perm)


# ----------------------------------------------------------------------------------------------
# The shared counter in vector envs
# ----------------------------------------------------------------------------------------------
def test_vector_env_members_share_one_counter_switch_together_and_pickle():
    env = make_vector_env("ns:reward_flip:ToyChain-v0:every=6,switch=hard,term=all", 3, seed=0)
    assert isinstance(env, CountingVectorEnv)
    env.steps_per_call = 2  # e.g. 2 envs per seed: the counter counts per-seed steps
    env.reset()
    assert all(e.counter is env.step_counter for e in env.envs)
    rewards, truncs = [], []
    for _ in range(5):
        _, r, _, trunc, _ = env.step(np.zeros((3, 1), np.float32))
        rewards.append(r.tolist())
        truncs.append(trunc.tolist())
    # counts 2, 4, 6 (hard switch: truncated), 8, 10 -> phase 1 from the 4th call on, for every member
    assert truncs[2] == [True] * 3 and rewards[3] == [-1.0] * 3 and rewards[2] == [1.0] * 3
    assert env.task_ids() == [1, 1, 1] and env.global_phase() == 1 and env.step_counter.value == 10
    clone = pickle.loads(pickle.dumps(env))
    assert all(e.counter is clone.step_counter for e in clone.envs) and clone.step_counter.value == 10
    # an evaluation env follows the training counter without advancing it
    ev = make_vector_env("ns:reward_flip:ToyChain-v0:every=6,term=all", 1, seed=5)
    ns.follow(ev, env.step_counter)
    ev.reset()
    assert ev.envs[0].task_id == 1 and ev.step(np.zeros((1, 1), np.float32))[1][0] == -1.0
    assert env.step_counter.value == 10


def test_plain_vector_env_members_switch_together_with_private_counters():
    from plasticity_zoo.envs import VectorEnv

    env = VectorEnv("ns:reward_flip:ToyChain-v0:every=4,switch=hard,term=all", 2, seed=0)
    env.reset()
    trunc = [env.step(np.zeros((2, 1), np.float32))[3].tolist() for _ in range(4)]
    assert trunc == [[False, False]] * 3 + [[True, True]]


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_async_backend_same_step_semantics_and_exact_pickle():
    env = make_vector_env("Hopper-v5", 2, seed=0, backend="async")
    try:
        env.reset()
        rng = np.random.default_rng(0)
        for _ in range(300):
            obs, r, term, trunc, next_obs = env.step(rng.uniform(-1, 1, (2, 3)).astype(np.float32))
            if term.any():
                break
        i = int(np.argmax(term))
        assert not np.allclose(obs[i], next_obs[i]) and abs(obs[i, 0] - 1.25) < 0.01  # reset obs; true final obs
        assert len(env.pop_finished()) >= 1
        clone = pickle.loads(pickle.dumps(env))
        try:
            for _ in range(20):
                a = rng.uniform(-1, 1, (2, 3)).astype(np.float32)
                for x, y in zip(env.step(a), clone.step(a)):
                    np.testing.assert_array_equal(x, y)
        finally:
            clone.close()
    finally:
        env.close()


def test_envpool_backend_emulates_same_step_autoreset():
    pytest.importorskip("envpool")
    env = make_vector_env("Hopper-v5", 2, seed=0, backend="envpool")
    obs = env.reset()
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = rng.uniform(-1, 1, (2, 3)).astype(np.float32)
        obs, r, term, trunc, next_obs = env.step(a)
        if term.any():
            break
    i = int(np.argmax(term))
    assert not np.allclose(obs[i], next_obs[i]) and abs(obs[i, 0] - 1.25) < 0.01  # reset height ~1.25
    # the next step is a real step from the reset state (EnvPool's own next-step reset is never seen)
    _, r2, _, _, n2 = env.step(np.zeros((2, 3), np.float32))
    assert r2[i] != 0.0 and abs(n2[i, 0] - obs[i, 0]) < 0.05
    assert len(env.pop_finished()) >= 1
    with pytest.raises(ValueError, match="has no env"):
        make_vector_env("NoSuchEnv-v0", 1, 0, backend="envpool")
    with pytest.raises(ValueError, match="Gymnasium ids only"):
        make_vector_env("ns:reward_flip:Hopper-v5", 1, 0, backend="envpool")
    restored = pickle.loads(pickle.dumps(env))
    assert restored.restored_fresh and restored.step(np.zeros((2, 3), np.float32))[0].shape == (2, 11)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown vector-env backend 'gpu'"):
        make_vector_env("Pendulum-v1", 1, 0, backend="gpu")


# ----------------------------------------------------------------------------------------------
# A chain scored on every task (eval=all)
# ----------------------------------------------------------------------------------------------
CARTPOLES = "ns:chain:dmc:cartpole-balance,dmc:cartpole-swingup:every=7"


@pytest.mark.slow
def test_a_chain_evaluated_on_all_tasks_runs_each_task_as_its_own_env_would():
    from plasticity_zoo.training.evaluation import Evaluator

    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, 1))
    policy = lambda obs: np.tanh(obs @ w)  # noqa: E731  (a fixed policy on (seeds, episodes, obs_dim))
    ev = Evaluator(CARTPOLES + ",eval=all", seeds=2, episodes=1, base_seed=100, action_repeat=8)
    assert ev.tasks == ("dmc:cartpole-balance", "dmc:cartpole-swingup") and ev.episodes == 2
    counter = ns.StepCounter(123, auto=False)  # the training schedule is in task 1's phase...
    ns.follow(ev.env, counter)
    returns = ev(policy)  # ...but every evaluation env stays on its own task
    for j, k in ((0, 1), (1, 0)):  # seed j's episode k ran task k % 2 at the env seed of its slot
        alone = Evaluator(ev.tasks[k], seeds=1, episodes=1, base_seed=ev.env_seeds[2 * j + k], action_repeat=8)
        assert returns[j][k] == alone(policy)[0][0], (j, k)
    assert returns[0][0] != returns[0][1]  # the two tasks differ
    current = Evaluator(CARTPOLES, seeds=1, episodes=1, base_seed=100, action_repeat=8)
    assert current.tasks is None and current.episodes == 1  # eval=current: one task, the one trained


@pytest.mark.slow
def test_a_chain_run_with_eval_all_writes_a_row_per_task_and_their_mean(tiny_sac_config, tmp_path):
    import csv

    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.loops.offpolicy import train

    cfg = tiny_sac_config(
        env=CARTPOLES.replace("every=7", "every=25,eval=all"),
        total_steps=50,
        eval_every=50,
        eval_episodes=1,
        learning_starts=50,  # the rows are the point, not the learning
        action_repeat=8,
    )
    train(cfg, sac, tmp_path / "r")
    with open(tmp_path / "r" / "eval.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["task"]) for r in rows] == [
        (step, task) for step in ("0", "50") for task in ("dmc:cartpole-balance", "dmc:cartpole-swingup", "all")
    ]
    for step in ("0", "50"):
        own = {r["task"]: float(r["return_mean"]) for r in rows if r["step"] == step}
        assert own["all"] == pytest.approx((own["dmc:cartpole-balance"] + own["dmc:cartpole-swingup"]) / 2)
        assert float(next(r["score"] for r in rows if r["step"] == step and r["task"] == "all")) == pytest.approx(
            own["all"] / 1000
        )
