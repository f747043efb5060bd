import csv
import json
import signal
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import sac
from plasticity_zoo.training import checkpoint
from plasticity_zoo.training.logger import RunLogger
from plasticity_zoo.training.loop import StopAtIterationEnd, StopSignals
from plasticity_zoo.training.loops.offpolicy import NonFiniteLossError, seed_slice, train


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves((state.actor_params, state.critic_params, state.log_alpha))]


@pytest.mark.slow
def test_seeds_differ_and_a_fixed_seed_reproduces_exactly(tiny_sac_config, tmp_path):
    cfg = tiny_sac_config(seeds=2, total_steps=400)
    a = train(cfg, sac, tmp_path / "a")["state"]
    b = train(cfg, sac, tmp_path / "b")["state"]
    for x, y in zip(leaves(a), leaves(b)):
        np.testing.assert_array_equal(x, y)
    s0, s1 = seed_slice(a, 0), seed_slice(a, 1)
    assert all(not np.allclose(x, y) for x, y in zip(leaves(s0), leaves(s1)))
    evals = list(csv.DictReader(open(tmp_path / "a" / "eval.csv")))
    assert {r["seed"] for r in evals} == {"0", "1"}
    first = [float(r["return_mean"]) for r in evals if r["step"] == "0"]
    assert first[0] != first[1]  # different initial policies and evaluation envs


def test_stop_signals_defer_sigterm_to_the_iteration_end_and_a_second_ctrl_c_stops_at_once():
    before = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    stop = StopSignals.install()
    try:
        stop.check()  # nothing requested: a no-op
        signal.raise_signal(signal.SIGTERM)  # a scheduler's SIGTERM only records itself ...
        assert stop.requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            stop.check()  # ... and stops the loop at its next iteration boundary
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # once a stop is pending, Ctrl-C stops at once
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in StopSignals.SIGNALS} == before


def test_stop_at_iteration_end_checkpoints_only_between_iterations(tmp_path, capsys):
    """A deferred SIGTERM stops the loop at ``end(step)`` with a checkpoint there; an interrupt mid-iteration
    (begin() without end()) saves nothing and, with no checkpoint yet, says there is nothing to resume;
    handlers are restored either way."""
    saved, closed = [], []

    class Logger:
        def close(self):
            closed.append(True)

    def save(step):
        saved.append(step)
        return f"ckpt-{step}"

    before = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    steps_run = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with StopAtIterationEnd(save, tmp_path, lambda *a: None, Logger(), 0) as stop:
            for step in range(1, 10):
                stop.begin()
                if step == 3:
                    signal.raise_signal(signal.SIGTERM)  # mid-iteration: the iteration still finishes
                steps_run.append(step)
                stop.end(step)
    assert steps_run == [1, 2, 3] and saved == [3] and closed == [True]
    assert "saved a checkpoint at step 3 (ckpt-3)" in capsys.readouterr().out
    assert {s: signal.getsignal(s) for s in StopSignals.SIGNALS} == before

    with pytest.raises(KeyboardInterrupt):
        with StopAtIterationEnd(save, tmp_path, lambda *a: None, Logger(), 5) as stop:
            stop.begin()
            raise KeyboardInterrupt  # e.g. a second Ctrl-C inside an update
    assert saved == [3]  # nothing written from a half-done iteration
    assert "interrupted before the first checkpoint" in capsys.readouterr().out
    assert {s: signal.getsignal(s) for s in StopSignals.SIGNALS} == before


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_uninterrupted(tiny_sac_config, tmp_path, monkeypatch, assert_same_logs):
    """A SIGTERM during the evaluation at step 300 (periodic checkpoint at 250): the loop finishes that
    iteration, checkpoints at 301 and stops; resuming from there reproduces the uninterrupted run."""
    cfg = tiny_sac_config(total_steps=600, checkpoint_every=250)
    full = train(cfg, sac, tmp_path / "full")
    log_eval = RunLogger.log_eval

    def log_eval_then_sigterm(self, step, *args, **kw):
        log_eval(self, step, *args, **kw)
        if step == 300:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(RunLogger, "log_eval", log_eval_then_sigterm)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        train(cfg, sac, tmp_path / "part")
    assert checkpoint.latest(tmp_path / "part") == checkpoint.path_for(tmp_path / "part", 301)
    monkeypatch.setattr(RunLogger, "log_eval", log_eval)
    resumed = train(cfg, sac, tmp_path / "part", resume=True)
    assert resumed["step"] == 600
    for x, y in zip(leaves(full["state"]), leaves(resumed["state"])):
        np.testing.assert_array_equal(x, y)
    assert_same_logs(tmp_path / "full", tmp_path / "part")


@pytest.mark.slow
def test_extending_a_finished_run_redoes_its_final_evaluation_once(tiny_sac_config, tmp_path):
    """A run finished at 300 steps (final evaluation at 300) and extended to 600 with --resume
    has the same eval.csv rows and parameters as a 600-step run: the evaluation at 300 is not doubled."""
    full = train(tiny_sac_config(total_steps=600), sac, tmp_path / "full")
    train(tiny_sac_config(total_steps=300), sac, tmp_path / "ext")
    short = [r["step"] for r in csv.DictReader(open(tmp_path / "ext" / "eval.csv"))]
    assert short == ["0", "300"]  # one seed: the evaluation at 0 and the final one at 300
    extended = train(tiny_sac_config(total_steps=600), sac, tmp_path / "ext", resume=True)
    rows_full = list(csv.DictReader(open(tmp_path / "full" / "eval.csv")))
    rows_ext = list(csv.DictReader(open(tmp_path / "ext" / "eval.csv")))
    assert [r["step"] for r in rows_ext] == [r["step"] for r in rows_full] == ["0", "300", "600"]
    assert [r["return_mean"] for r in rows_ext] == [r["return_mean"] for r in rows_full]
    for x, y in zip(leaves(full["state"]), leaves(extended["state"])):
        np.testing.assert_array_equal(x, y)
    # config.json says what the run became: the new total, the start's provenance, the resume
    saved = json.loads((tmp_path / "ext" / "config.json").read_text())
    assert saved["total_steps"] == 600 and saved["provenance"]["versions"]["jax"] == jax.__version__
    assert [(r["step"], r["total_steps"]) for r in saved["resumes"]] == [(300, 600)]


@pytest.mark.slow
def test_checkpoint_from_another_config_is_refused(tiny_sac_config, tmp_path):
    cfg = tiny_sac_config(total_steps=300)
    train(cfg, sac, tmp_path / "r")
    path = checkpoint.latest(tmp_path / "r")
    from plasticity_zoo.training.loops.offpolicy import init_state

    other = init_state(sac, tiny_sac_config(critics=4), 3, 1)
    with pytest.raises(ValueError, match="config"):
        checkpoint.load(path, other)
    (path / "arrays.npz").write_bytes(b"corrupt")
    with pytest.raises(ValueError, match="unreadable"):
        checkpoint.load(path, init_state(sac, cfg, 3, 1))


@pytest.mark.slow
def test_non_finite_loss_stops_with_step_and_name_and_keeps_last_checkpoint(tiny_sac_config, tmp_path):
    def bad_update(state, batch, key):
        new, m = sac.update(state, batch, key)
        m["losses/critic"] = jnp.where(new.updates > 150, jnp.nan, m["losses/critic"])
        return new, m

    from plasticity_zoo.buffers import replay

    def bad_train_block(state, buffer, key, num_updates, replay_control=None):
        return replay.scan_updates(bad_update, state, buffer, key, num_updates, state.cfg.batch_size, replay_control)

    contract = {k: getattr(sac, k) for k in dir(sac) if not k.startswith("_")}
    broken = types.SimpleNamespace(**{**contract, "update": bad_update, "train_block": bad_train_block})
    cfg = tiny_sac_config(total_steps=600, checkpoint_every=300)
    # learning starts at step 200 with update 1, so update 151 (the first NaN) happens at step 350
    with pytest.raises(NonFiniteLossError, match=r"losses/critic at env step 350;.*step_000000000300"):
        train(cfg, broken, tmp_path / "r")
    assert checkpoint.latest(tmp_path / "r").name == "step_000000000300"


@pytest.mark.optimized
@pytest.mark.slow
def test_sac_learns_to_swing_up_pendulum(tiny_sac_config, tmp_path):
    from plasticity_zoo.training.config import NetworkConfig

    # 64-wide networks (a quarter of the paper's 256, 3x faster here; seeds 0-3 end at -96 to -219),
    # 2 vmapped seeds; SAC swings Pendulum up within ~4-6k steps
    cfg = tiny_sac_config(
        seeds=2,
        total_steps=6000,
        eval_every=6000,
        eval_episodes=5,
        log_every=1000,
        checkpoint_every=6000,
        network=NetworkConfig(width=64),
        buffer_size=10_000,
        batch_size=256,
        learning_starts=1000,
    )
    out = train(cfg, sac, tmp_path / "r")
    rows = list(csv.DictReader(open(tmp_path / "r" / "eval.csv")))
    start = [float(r["return_mean"]) for r in rows if r["step"] == "0"]
    end = [float(r["return_mean"]) for r in rows if r["step"] == "6000"]
    assert max(start) < -900  # an untrained policy does not swing up
    assert np.mean(end) > -400 and min(end) > -600, f"SAC did not learn Pendulum: eval returns {end}"
    cfg_json = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg_json["agent"]["critics"] == 2 and out["step"] == 6000


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sac_uniform", "sac_ne_review_and_half_batch", "mrq_lap"])
def test_an_env_step_needs_no_memory_that_grows_with_the_buffer_capacity(case):
    """Issue: with a 1M buffer XLA copied every buffer array once per env step (the batch gathers
    fused with the in-place write of the new row).  XLA's own memory analysis of the two compiled
    per-step programs must not depend on the capacity: only the donated buffer itself does.

    MR.Q's LAP buffer (one seed, as train.py runs it) had three such copies: the add squeezed to
    one seed copied the slot steps, priorities and flags; the unrolled sum-tree descent made XLA
    copy the tree before the priority update; and the sync's mean |reward| was computed on every
    step (hoisted out of its 0/1-trip loop).  262,144 slots make one per-slot float (1 MB) stand
    out above the small programs' other temporaries; the sum trees' log2(capacity) depth may add
    a little."""
    from plasticity_zoo import agents
    from plasticity_zoo.buffers import replay
    from plasticity_zoo.plasticity.expansion import ReplayControl
    from plasticity_zoo.training.config import NetworkConfig, RunConfig
    from plasticity_zoo.training.loops import offpolicy

    name = case.split("_")[0]
    agent = agents.get(name)
    temps, capacities = [], (4_096, 262_144 if name == "mrq" else 65_536)
    for capacity in capacities:
        a = agent.CONFIG(buffer_size=capacity, batch_size=32)
        cfg = RunConfig(env="Pendulum-v1", agent=a, agent_name=name, network=NetworkConfig(width=16, depth=1))
        state, buffer, _ = offpolicy.init_state(agent, cfg, 3, 1)
        step = offpolicy.make_step_fn(agent, a, 1, 1)
        transition = replay.Transition(
            np.zeros((1, 3), np.float32),
            np.zeros((1, 1), np.float32),
            np.zeros(1, np.float32),
            np.zeros((1, 3), np.float32),
            np.zeros(1, bool),
            np.zeros(1, bool),
        )
        obs = np.zeros((1, 1, 3), np.float32)
        review = case == "sac_ne_review_and_half_batch"
        control = ReplayControl(jnp.full((1,), 0.5, jnp.float32), jnp.ones((1,), bool)) if review else None
        learn = step.learn_and_act.lower(
            state, buffer, obs, jax.random.key(0), random_actions=False, train=True, replay_control=control
        ).compile()
        store = step.store.lower(buffer, transition, obs).compile()
        temps.append((learn.memory_analysis().temp_size_in_bytes, store.memory_analysis().temp_size_in_bytes))
    # LAP's sum trees are log2(capacity) levels deep, and the paths its add rewrites grow with that
    # (about 1 KB here); a copy of any per-slot array would add at least a byte per slot.
    allowed = 0 if name == "sac" else (capacities[1] - capacities[0]) // 64
    for program, (small, large) in zip(("learn_and_act", "store"), zip(*temps)):
        assert large - small <= allowed, f"{program}'s temporaries grow with the capacity: {small} -> {large} bytes"


def test_a_host_env_step_draws_its_keys_in_one_jitted_call(tiny_sac_config, monkeypatch):
    """The off-policy step's keys (the run's next key, the step's, the events') come from one jitted call,
    ``step_keys``: op by op, ``jax.random.split`` and ``fold_in`` on the host cost 0.4 ms per env step
    (docs/benchmarks.md, SAC's profile).  After the first steps compile, a step calls neither."""
    from plasticity_zoo.training.loops import offpolicy

    cfg = tiny_sac_config(learning_starts=2, batch_size=8)
    it = offpolicy.OffPolicyIteration(cfg, sac)
    it.fresh()
    for at in range(4):
        it.step(at, 1)
    calls = []
    for name in ("split", "fold_in"):
        real = getattr(jax.random, name)
        monkeypatch.setattr(
            jax.random, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    key = it.key
    report = it.step(4, 1)
    assert calls == []
    want_key, want_k = jax.random.split(key)
    np.testing.assert_array_equal(jax.random.key_data(it.key), jax.random.key_data(want_key))
    np.testing.assert_array_equal(  # the events' key: fold_in(step key, 1), as before
        jax.random.key_data(report.key), jax.random.key_data(jax.random.fold_in(want_k, 1))
    )
