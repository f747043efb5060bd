"""Adding a loop kind touches what docs/architecture.md ("A loop kind") says, and no more: one module
exporting the functions ``training/loops/__init__.py`` lists, and one line in ``loops.LOOPS``.

A loop kind written only for this test (``toy_loop``, a module object) is registered from the test
under a new kind, with an agent of that kind (``tests/example_agent.py``'s learner, ``KIND = "toy"``);
``loop_for``, the preflight's ``check``, ``checkpoint_template``, ``final_step``, the evaluation's action
mode and ``run`` then reach it with no other change.  Nothing trains: the toy loop's ``train`` returns
at once and its checkpoint tree is only traced.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo import agents
from plasticity_zoo.analysis.restore import checkpoint_template
from plasticity_zoo.plasticity.config import PlasticityConfig
from plasticity_zoo.training import loops, run
from plasticity_zoo.training.config import RunConfig
from plasticity_zoo.training.loop import RunTree

KIND = "toy"
STEPS_PER_ITERATION = 10


def toy_loop() -> types.ModuleType:
    """A loop kind: iterations of ``STEPS_PER_ITERATION`` steps; its checkpoint tree holds the agent
    states (a leading seed axis), one counter per seed and the run key."""
    loop = types.ModuleType("tests.toy_loop")

    def check(cfg, agent):
        if cfg.total_steps % STEPS_PER_ITERATION:
            raise ValueError(f"the toy loop runs whole iterations of 10 steps, not --total-steps {cfg.total_steps}")
        return cfg.total_steps // STEPS_PER_ITERATION

    def resolve(cfg, agent):
        return cfg, 3, 1  # the toy env's observation and action sizes

    def train(cfg, agent, run_dir, resume=False, stop_at=None):
        return {"step": last_step(cfg, agent), "last_eval": 0.0, "run_dir": str(run_dir), "loop": KIND}

    def template_tree(cfg, agent, obs_dim, act_dim):
        keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 1)
        states = jax.vmap(lambda k: agent.init(k, obs_dim, act_dim, cfg.agent))(keys[1:])
        return RunTree(states, jnp.zeros(cfg.seeds, jnp.int32), keys[0])

    def last_step(cfg, agent):
        return STEPS_PER_ITERATION * check(cfg, agent)

    def action_mode(cfg, agent):
        return "clip"

    for fn in (check, resolve, train, template_tree, last_step, action_mode):
        setattr(loop, fn.__name__, fn)
    return loop


def toy_agent() -> types.ModuleType:
    """``tests/example_agent.py`` (DDPG) as an agent of the toy kind."""
    from tests import example_agent

    agent = types.ModuleType("tests.toy_agent")
    agent.__dict__.update({k: v for k, v in vars(example_agent).items() if not k.startswith("__")})
    agent.KIND = KIND
    return agent


@pytest.fixture
def toy(monkeypatch):
    """The toy kind registered (its line in ``loops.LOOPS``) with its agent (its line in ``agents.AGENTS``)."""
    loop, agent = toy_loop(), toy_agent()
    monkeypatch.setitem(loops.LOOPS, KIND, loop)
    monkeypatch.setitem(sys.modules, "tests.toy_agent", agent)
    monkeypatch.setitem(agents.AGENTS, "toy-ddpg", "tests.toy_agent")
    return loop, agent


def toy_config(**kw) -> RunConfig:
    from tests.example_agent import ExampleConfig

    return RunConfig(agent_name="toy-ddpg", agent=ExampleConfig(), env="toy-env", total_steps=60, seeds=2, **kw)


def test_a_registered_loop_kind_is_the_one_every_dispatch_reaches(toy):
    loop, agent = toy
    cfg = toy_config()
    assert loops.loop_for(cfg, agent) is loop
    assert loops.check(cfg, agent) == 6
    run.preflight(cfg, agent)  # the loop's check and resolve, then the agent's own (traced) init
    with pytest.raises(ValueError, match="the toy loop runs whole iterations"):
        run.preflight(dataclasses.replace(cfg, total_steps=65), agent)
    assert run.final_step(cfg) == 60
    assert loops.eval_action_mode(cfg, agent) == "clip"

    template = checkpoint_template(cfg, agent, 3, 1)
    assert isinstance(template, RunTree)
    assert template.agent.actor_params is not None
    for leaf in jax.tree.leaves(template.agent):
        assert leaf.shape[0] == 2 and not np.any(np.asarray(leaf))  # per seed, zeros
    assert template.data.shape == (2,) and jnp.issubdtype(template.key.dtype, jax.dtypes.prng_key)


def test_run_trains_a_registered_kind_in_its_loop(toy, tmp_path):
    out = run.run(toy_config(run_dir=str(tmp_path / "toy")))
    assert out["loop"] == KIND and out["step"] == 60
    assert (tmp_path / "toy" / "config.json").is_file()  # the run directory was claimed as for any kind


def test_an_unknown_kind_is_refused_naming_the_kinds(toy):
    agent = types.ModuleType("tests.nowhere")
    agent.KIND = "nowhere"
    cfg = toy_config()
    message = r"agent 'tests.nowhere' has unknown kind 'nowhere'; kinds: offpolicy, onpolicy, offline, toy"
    for call in (
        lambda: loops.loop_for(cfg, agent),
        lambda: loops.check(cfg, agent),
        lambda: loops.eval_action_mode(cfg, agent),
        lambda: checkpoint_template(cfg, agent, 3, 1),
    ):
        with pytest.raises(ValueError, match=message):
            call()


def test_the_built_in_kinds_take_their_loops():
    """By ``agent.KIND``, except the device loop: ``--loop device``, or ``auto`` on a playground: env with
    an online agent and no LEAST."""
    from plasticity_zoo.agents import api
    from plasticity_zoo.training.loops import device, offline, offpolicy, onpolicy

    assert set(loops.LOOPS) == set(api.KINDS)  # every agent kind's Protocol has its loop

    sac = types.SimpleNamespace(__name__="sac", KIND="offpolicy")
    ppo = types.SimpleNamespace(__name__="ppo", KIND="onpolicy")
    ravl = types.SimpleNamespace(__name__="ravl", KIND="offline")
    pg = "playground:CartpoleBalance"
    cases = [
        (RunConfig(), sac, offpolicy),
        (RunConfig(), ppo, onpolicy),
        (RunConfig(env=None), ravl, offline),
        (RunConfig(env=pg), sac, device),
        (RunConfig(env=pg), ppo, device),
        (RunConfig(env=pg, loop="host"), sac, offpolicy),
        (RunConfig(env=pg, plasticity=PlasticityConfig(least=True)), sac, offpolicy),  # LEAST cuts from the host
        (RunConfig(env=pg), ravl, offline),
        (RunConfig(loop="device"), sac, device),
        (RunConfig(env=pg, loop="device"), ravl, device),  # whose check refuses it
    ]
    for cfg, agent, module in cases:
        assert loops.loop_for(cfg, agent) is module, (cfg.env, cfg.loop, agent.KIND)
    with pytest.raises(ValueError, match="--loop device runs on-policy .* agents; ravl is offline"):
        loops.check(RunConfig(env=pg, loop="device"), ravl)
