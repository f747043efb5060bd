"""Every registered agent against the contract of its kind (agents/api.py): the names and their
signatures, one init / act / update on a tiny problem, and its plastic-network declarations.
An agent written only for this test (tests/example_agent.py) shows that adding an agent of an
existing kind is one file plus one registry line."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo import agents
from plasticity_zoo.agents import api
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.envs.multitask import TaskSpec
from plasticity_zoo.networks.config import NetworkConfig

OBS, ACT = 3, 1
TINY = NetworkConfig(width=16, depth=1)


@pytest.fixture
def registry(monkeypatch):
    """The registry with the example agent added as one line would add it."""
    monkeypatch.setitem(agents.AGENTS, "example", "tests.example_agent")
    return agents.AGENTS


def _positional(fn):
    params = inspect.signature(fn).parameters.values()
    names = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len([p for p in names if p.default is p.empty]), len(names)


def _protocol_methods(proto):
    return {
        name: fn
        for klass in proto.__mro__
        if klass.__module__ == api.__name__
        for name, fn in vars(klass).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }


def _transitions(n, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=(n, *s)), jnp.float32)  # noqa: E731
    return Transition(f(OBS), jnp.clip(f(ACT), -1, 1), f(), f(OBS), jnp.zeros(n, bool), jnp.zeros(n, bool))


# a one-task layout whose padded observation (2) + one-hot (1) is OBS wide, for multitask agents
ONE_TASK = TaskSpec("mt:contract", ("contract",), (OBS - 1,), (ACT,), (100,))


def _config(agent, **kw):
    """The agent's config (``kw`` set), bound to ``ONE_TASK`` for an agent that takes a task layout."""
    if hasattr(agent, "with_tasks"):
        return agent.with_tasks(agent.CONFIG(**{"utd": 1.0, **kw}), ONE_TASK)
    return agent.CONFIG(**kw)


def _init(agent, cfg, net=TINY, *extra):
    """``agent.init`` jitted, as the loops run it (op by op it compiles every random draw on its own)."""
    return jax.jit(lambda k: agent.init(k, OBS, ACT, cfg, net, *extra))(jax.random.key(0))


def _finite(metrics):
    return all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(metrics))


def test_every_registered_agent_is_checked_here():
    assert set(agents.AGENTS) == {"sac", "mrq", "mrq-mt", "ppo", "ravl", "neubay"}


@pytest.mark.parametrize("name", ["sac", "mrq", "mrq-mt", "ppo", "ravl", "neubay", "example"])
def test_agent_exports_the_contract_of_its_kind(name, registry):
    agent = agents.get(name)
    proto = api.protocol_for(agent)
    missing = [m for m in _protocol_methods(proto) if not callable(getattr(agent, m, None))]
    assert not missing and isinstance(agent, proto), f"{name} lacks {missing}"
    for method, fn in _protocol_methods(proto).items():
        need, allow = _positional(getattr(agent, method))
        n = _positional(fn)[1] - 1  # without self
        assert need <= n <= allow, f"{name}.{method} takes {need}..{allow} positional arguments, the contract {n}"
    assert isinstance(agent.EXPERIENCE_REVIEW, bool) and agent.KIND in api.KINDS


@pytest.mark.parametrize("name", ["sac", "mrq", "mrq-mt", "ppo", "ravl", "example"])
def test_plastic_declarations_name_the_same_networks_and_give_scalar_losses(name, registry):
    agent = agents.get(name)
    assert isinstance(agent, api.PlasticAgent)
    state = _init(agent, _config(agent))
    params, nets = agent.plastic_params(state), agent.plastic_nets(state)
    assert set(params) == set(nets) == set(agent.PLASTIC)
    assert set(agent.SIGREG_NETWORKS) <= set(agent.PLASTIC)
    for net_name, (p_field, o_field) in agent.PLASTIC.items():
        assert params[net_name] is getattr(state, p_field) and getattr(state, o_field) is not None
        assert nets[net_name].name  # a networks.Net: resets and NE re-initialise through it


@pytest.mark.parametrize(
    "name",
    ["sac", pytest.param("mrq", marks=pytest.mark.slow), pytest.param("mrq-mt", marks=pytest.mark.slow), "example"],
)
def test_off_policy_agent_runs_init_act_update_on_a_tiny_problem(name, registry):
    agent = agents.get(name)
    cfg = _config(agent, batch_size=8)
    state = _init(agent, cfg)
    buffer = agent.buffer_init(64, OBS, ACT, _config(agent))
    add = jax.jit(agent.buffer_add)
    for t in range(12):  # one env: 12 consecutive transitions (MR.Q's windows need several)
        buffer = add(buffer, _transitions(1, seed=t))
    obs = jnp.zeros((4, OBS))
    for explore, key in ((True, jax.random.key(1)), (False, None)):
        action = jax.jit(lambda s, o, k: agent.act(s, o, k, explore))(state, obs, key)
        assert action.shape == (4, ACT) and bool(jnp.all(jnp.abs(action) <= 1.0))
    batch = jax.jit(lambda s, b, k: agent.sample_batch(s, b, k, 8))(state, buffer, jax.random.key(2))
    new, metrics = jax.jit(agent.update)(state, batch, jax.random.key(3))
    assert _finite(metrics) and jax.tree.structure(new) == jax.tree.structure(state)
    new, buffer, metrics = jax.jit(lambda s, b, k: agent.train_block(s, b, k, 2, None))(
        state, buffer, jax.random.key(4)
    )
    assert _finite(metrics)
    moved = [
        not np.allclose(a, b)
        for a, b in zip(jax.tree.leaves(agent.plastic_params(new)), jax.tree.leaves(agent.plastic_params(state)))
    ]
    assert any(moved)
    shapes = jax.eval_shape(
        lambda s, b, k: {n: loss(agent.plastic_params(s)[n]) for n, loss in agent.plastic_losses(s, b, k).items()},
        state,
        batch,
        jax.random.key(5),
    )
    assert shapes and set(shapes) <= set(agent.PLASTIC) and all(x.shape == () for x in shapes.values())


def test_on_policy_agent_runs_a_rollout_update():
    from plasticity_zoo.training.loops.onpolicy import empty_loop

    agent = agents.get("ppo")
    cfg = agent.CONFIG(num_steps=8, num_minibatches=2, update_epochs=1)
    state = _init(agent, cfg).replace(num_iterations=jnp.int32(1))
    state, obs_n = jax.jit(agent.observe)(state, jnp.ones((2, OBS)))
    action, logp, value = jax.jit(agent.sample_action)(state, obs_n, jax.random.key(1))
    assert action.shape == (2, ACT) and logp.shape == value.shape == (2,)
    loop = empty_loop(agent, 8, 2, OBS, ACT)
    rng = np.random.default_rng(0)
    rollout = loop.buffer._replace(
        obs=jnp.asarray(rng.normal(size=loop.buffer.obs.shape), jnp.float32),
        rewards=jnp.asarray(rng.normal(size=loop.buffer.rewards.shape), jnp.float32),
    )
    new, metrics = jax.jit(agent.update)(state, rollout, jax.random.key(2))
    assert _finite({k: v for k, v in metrics.items() if k.startswith("losses/")})  # what the loop checks
    mb = jax.jit(lambda s, r, k: agent.sample_batch(s, r, k, 4))(state, rollout, jax.random.key(3))
    assert mb.obs.shape == (4, OBS)


@pytest.mark.slow
def test_offline_agent_samples_its_data_and_updates():
    agent = agents.get("ravl")
    cfg = agent.CONFIG(batch_size=8, critics=3, dataset_ratio=0.25)
    state = _init(agent, cfg)
    data = agent.data_init(_transitions(50), cfg)
    batch = jax.jit(lambda s, d, k: agent.sample_batch(s, d, k, 8))(state, data, jax.random.key(1))
    assert batch.obs.shape == (8, OBS)
    _, metrics = jax.jit(agent.update)(state, batch, jax.random.key(2))
    assert _finite(metrics)


@pytest.mark.parametrize("name", ["sac", "mrq", "mrq-mt", "ppo", "ravl", "neubay"])
def test_every_agent_takes_the_plasticity_metrics(name):
    """Each registered agent declares networks the metrics read: plastic ones (which interventions may
    rewrite) or, failing that, measured ones (``MeasuredAgent``) with a reason interventions are refused."""
    from plasticity_zoo.plasticity.api import measured

    agent = agents.get(name)
    assert measured(agent)
    if not isinstance(agent, api.PlasticAgent):
        assert isinstance(agent, api.MeasuredAgent) and agent.INTERVENTIONS_REFUSED


@pytest.mark.slow
def test_recurrent_agent_acts_step_by_step_with_its_memory():
    """``agents.api.RecurrentAgent``: the names and signatures, and one step from a zero memory
    equals the memoryless ``act`` (an episode's first step)."""
    agent = agents.get("neubay")
    assert isinstance(agent, api.RecurrentAgent)
    for method, fn in _protocol_methods(api.RecurrentAgent).items():
        need, allow = _positional(getattr(agent, method))
        assert need <= _positional(fn)[1] - 1 <= allow
    cfg = agent.CONFIG(critics=2, head_width=8, d_model=8, d_hidden=4, lru_layers=1)
    state = jax.jit(lambda k: agent.init(k, OBS, ACT, cfg))(jax.random.key(0))
    obs = jnp.ones((4, OBS))
    step = jax.jit(lambda s, m, o, a, r, st: agent.act_step(s, m, o, a, r, st, None, False))
    action, memory = step(
        state, agent.initial_memory(state, 4), obs, jnp.ones((4, ACT)), jnp.ones(4), jnp.ones(4, bool)
    )
    assert action.shape == (4, ACT) and bool(jnp.all(jnp.abs(action) <= 1.0))
    act = jax.jit(lambda s, o: agent.act(s, o, None, False))(state, obs)
    np.testing.assert_allclose(np.asarray(action), np.asarray(act), rtol=1e-6)
    later, _ = step(state, memory, obs, jnp.ones((4, ACT)), jnp.ones(4), jnp.zeros(4, bool))
    assert not np.allclose(np.asarray(later), np.asarray(action))  # the memory changes what it does
    assert not isinstance(agents.get("sac"), api.RecurrentAgent)


@pytest.mark.slow
def test_an_agent_of_an_existing_kind_trains_through_the_registry(registry, tmp_path):
    """The example agent trains end to end through the same entry point as train.py."""
    from plasticity_zoo.agents.api import OffPolicyConfig  # noqa: F401  (its config extends the shared replay settings)
    from plasticity_zoo.training.config import PlasticityConfig, RunConfig
    from plasticity_zoo.training.run import run

    agent = agents.get("example")
    cfg = RunConfig(
        env="Pendulum-v1",
        total_steps=300,
        eval_every=300,
        eval_episodes=1,
        log_every=100,
        checkpoint_every=300,
        progress=False,
        network=TINY,
        run_dir=str(tmp_path / "run"),
        plasticity=PlasticityConfig(metrics_every=50, metrics_batch=16),
        agent_name="example",
        agent=agent.CONFIG(buffer_size=500, batch_size=16, learning_starts=100),
    )
    out = run(cfg)
    assert out["step"] == 300 and np.isfinite(out["last_eval"])
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]
    assert "losses/critic" in header and "plasticity/critic" in header


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sac", "mrq", "mrq-mt", "ppo", "ravl", "example"])
def test_plasticity_is_built_into_the_agent_state_not_read_from_a_context(name, registry):
    """Kron / NE masks and SIGReg are static configuration the agent is built with: the choice is
    a static field of the state (part of every jitted program's cache key), NE masks sit in the
    plastic optimizers' states, and nothing changes without it."""
    from plasticity_zoo.plasticity import optim
    from plasticity_zoo.plasticity.api import StaticPlasticity
    from plasticity_zoo.plasticity.sigreg import SIGRegSpec

    agent = agents.get(name)
    spec = StaticPlasticity(optim.OptimSpec(ne=optim.NESpec(0.8), ne_networks=tuple(agent.PLASTIC)), SIGRegSpec(0.2))
    plain = _init(agent, _config(agent))
    built = _init(agent, _config(agent), TINY, spec)
    assert plain.plasticity == StaticPlasticity() and built.plasticity == spec
    assert jax.tree.structure(plain) != jax.tree.structure(built)  # the static choice is in the treedef
    for _, o_field in agent.PLASTIC.values():
        assert optim.find_masked(getattr(built, o_field)) is not None
        assert optim.find_masked(getattr(plain, o_field)) is None


@pytest.mark.parametrize(
    "name, block",
    [(n, b) for n in ("sac", "mrq", "mrq-mt", "ppo", "ravl") for b in ("mlp", "simba")] + [("neubay", None)],
)  # neubay takes no --network.* flags (its own sizes)
def test_no_agent_inits_its_seeds_with_a_batched_lapack_call(name, block):
    """jaxlib 0.10's batched CPU LAPACK kernels can deadlock (networks/runtime.py: one_call_per_matrix);
    every agent's init over 2 seeds, as the loops vmap it, lowers to unbatched LAPACK calls only."""
    import re

    agent = agents.get(name)
    cfg = _config(agent)
    net = NetworkConfig() if block is None else NetworkConfig(width=16, depth=1, block=block)
    keys = jax.random.split(jax.random.key(0), 2)
    text = jax.jit(jax.vmap(lambda k: agent.init(k, OBS, ACT, cfg, net))).lower(keys).as_text()
    batch_dims = re.findall(r'custom_call @lapack_\w+.*?num_batch_dims = "(\d+)"', text)
    assert set(batch_dims) <= {"0"}, (name, block, batch_dims)
