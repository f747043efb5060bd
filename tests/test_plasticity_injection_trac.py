"""Plasticity injection (plasticity/injection.py, networks/residual.py) and TRAC (plasticity/trac.py): the
residual head's function and exactness, the injection leaving every output unchanged, what trains after it
and with which optimizer state, nothing changed before it, resume, TRAC's first steps by hand and its
post-scaled form, every agent, refusals.  TRAC against the authors' package: tests/test_fidelity_interventions.py.

Everything runs jitted (op by op, each new shape of each primitive compiles on its own)."""

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from plasticity_zoo import agents
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.envs.multitask import TaskSpec
from plasticity_zoo.networks import GaussianPolicyHead, MLPHead, TrunkSpec, build
from plasticity_zoo.networks.core import path_names
from plasticity_zoo.networks.residual import RESIDUAL, ResidualHeadNet, head_part, join, override, split
from plasticity_zoo.plasticity import hooks, injection, resets, trac
from plasticity_zoo.plasticity import optim as optim_lib
from plasticity_zoo.plasticity.config import PlasticityConfig
from plasticity_zoo.training.config import NetworkConfig

NET = NetworkConfig(width=16, depth=2)
MT_SPEC = TaskSpec("mt:test", ("a", "b"), (4, 3), (2, 1), (100, 100))
INJECT = PlasticityConfig(metrics_every=0, injection_step=3)
HEADS = ("actor", "critic", "value", "policy")  # the networks the agents offer for injection


def _leaves(tree):
    return {path_names(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _built(make, key):
    """``networks.build`` with its params drawn under jit -> (Net, params)."""
    made = {}

    def params(k):
        made["net"], p = build("net", make, k)
        return p

    p = jax.jit(params)(key)
    return made["net"], p


def _state(name, pc=INJECT, network=NET, seed=0, abstract=False):
    """(agent, its state built as a run with ``pc`` builds it: ``hooks.static_plasticity``, checked)."""
    agent = agents.get(name)
    cfg, obs, act = agent.CONFIG(), 3, 2
    if name == "mrq-mt":
        cfg, obs, act = agent.with_tasks(agent.CONFIG(model_size="S"), MT_SPEC), MT_SPEC.obs_dim, MT_SPEC.act_dim
    static = hooks.static_plasticity(pc, agent)
    init = lambda k: agent.init(k, obs, act, cfg, network, static)  # noqa: E731
    state = jax.eval_shape(init, jax.random.key(seed)) if abstract else jax.jit(init)(jax.random.key(seed))
    hooks.check_optimizers(pc, agent, name, state)
    return agent, state


def _steps_fn(name, agent, state):
    """A jitted ``(state, key) -> state``: two optimizer steps of every injected network through the agent's own
    optimizers on random gradients (PPO as its update applies them: lr x update, then ``optim.constrain``)."""
    names = ("state_encoder", "sa_encoder", "table", "value", "policy") if name == "mrq-mt" else agent.PLASTIC
    txs = dict(zip(names, agent._optimizers(state.cfg, state.plasticity)))

    def steps(state, key):
        for t in range(2):
            for j, (net, (p_field, o_field)) in enumerate(agent.PLASTIC.items()):
                if net not in HEADS:
                    continue
                params, opt = getattr(state, p_field), getattr(state, o_field)
                leaves, treedef = jax.tree.flatten(params)
                keys = jax.random.split(jax.random.fold_in(key, 10 * t + j), len(leaves))
                grads = treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
                u, opt = txs[net].update(grads, opt, params)
                if name == "ppo":
                    params = optim_lib.constrain(opt, optax.apply_updates(params, jax.tree.map(lambda v: 3e-4 * v, u)))
                else:
                    params = optax.apply_updates(params, u)
                state = state.replace(**{p_field: params, o_field: opt})
        return state

    return jax.jit(steps)


def _head_keys(params):
    """(encoder, head theta, theta', theta'_frozen) leaf paths of a network with a residual head."""
    base, pair = split(params)
    head = set(_leaves(pair["fresh"]))
    pre = lambda part: {(RESIDUAL, part, *k) for k in head}  # noqa: E731
    return set(_leaves(base)) - head, head, pre("fresh"), pre("frozen")


def _input(params, n=5):
    """Inputs for a network whose first trunk layer is ``trunk/layers/0``."""
    kernel = _leaves(split(params)[0])[("trunk", "layers", 0, "kernel")]
    return np.random.default_rng(1).normal(size=(n, kernel.shape[-2])).astype(np.float32)


# ----------------------------------------------------------------------------- the residual head


def test_a_zero_pair_keeps_no_activations_of_the_skipped_terms_for_the_backward_pass():
    # regression guard: before the injection the two residual terms are skipped, and the backward pass keeps
    # only their inputs, not zeros shaped like their activations (a plain lax.cond under grad keeps those)
    net, params = _built(lambda r: MLPHead(4, 3, TrunkSpec(16, 2), rngs=r), jax.random.key(0))
    rnet, rparams = ResidualHeadNet.wrap(net, params, (("trunk", "layers", 1), ("out",)))
    x = jnp.ones((512, 4))

    def kept(net, params):  # bytes the backward pass holds on to (the VJP's residuals)
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(jax.vjp(lambda p: net(p, x), params)[1]))

    pair_and_input = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(split(rparams)[1])) + x.size * 4
    assert kept(rnet, rparams) <= kept(net, params) + pair_and_input + 1024


def test_an_ensembles_residual_heads_give_each_members_expression_1_gradients_when_only_some_are_live():
    # the members' vmap decides the branch once for all members (live if any member's theta' is not zero), so
    # every member gets Expression (1)'s gradients, theta' and the shared input's, its pair zero or not
    made = {}

    def draw(k):
        made["net"], p = build("q", lambda r: MLPHead(5, 1, TrunkSpec(8, 2), rngs=r), k, ensemble=2)
        return p

    params = jax.jit(draw)(jax.random.key(0))
    net, head = made["net"], (("trunk", "layers", 1), ("out",))
    rnet, rparams = ResidualHeadNet.wrap(net, params, head)
    # member 0 injected and trained on (theta'_frozen != theta'), member 1's pair zero
    a, b = (jax.tree.map(lambda v: v.at[1].set(0.0), head_part(net.init(jax.random.key(k)), head)) for k in (1, 4))
    x = jax.random.normal(jax.random.key(2), (7, 5))
    loss = lambda p, x: jnp.sum(rnet(join(params, {"fresh": p, "frozen": b}), x) ** 2)  # noqa: E731
    g_fresh, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, x)

    member = lambda tree, i: jax.tree.map(lambda v: v[i], tree)  # noqa: E731
    one, _ = build("one", lambda r: MLPHead(5, 1, TrunkSpec(8, 2), rngs=r), jax.random.key(3))

    def explicit(f, x, i):  # member i by hand, theta's head and theta'_frozen held
        p = member(params, i)
        held, frozen = override(p, jax.lax.stop_gradient(head_part(p, head))), override(p, member(b, i))
        return jnp.sum((one(held, x) + one(override(p, f), x) - one(jax.lax.stop_gradient(frozen), x)) ** 2)

    want_x = 0.0
    for i in range(2):
        gf, gx = jax.grad(explicit, argnums=(0, 1))(member(a, i), x, i)
        for k, v in _leaves(gf).items():
            np.testing.assert_allclose(_leaves(member(g_fresh, i))[k], v, rtol=1e-5, atol=1e-6)
        want_x = want_x + gx
    np.testing.assert_allclose(g_x, want_x, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_residual_head_computes_h_theta_plus_h_fresh_minus_h_frozen_and_is_exact_while_zero():
    net, params = _built(lambda r: MLPHead(4, 3, TrunkSpec(8, 2, layer_norm=True), rngs=r), jax.random.key(0))
    head = (("trunk", "layers", 1), ("trunk", "norms", 1), ("out",))
    rnet, rparams = ResidualHeadNet.wrap(net, params, head)
    x = jax.random.normal(jax.random.key(1), (6, 4))
    draw = jax.jit(lambda k: head_part(net.init(k), head))
    a, b = draw(jax.random.key(2)), draw(jax.random.key(3))

    @jax.jit
    def run(params, rparams, a, b):
        loss = lambda n: lambda p: jnp.sum(n(p, x) ** 2)  # noqa: E731
        return (
            net(params, x),
            rnet(rparams, x),
            jax.grad(loss(net))(params),
            jax.grad(loss(rnet))(rparams),
            rnet(join(params, {"fresh": a, "frozen": b}), x),
            net(params, x) + (net(override(params, a), x) - net(override(params, b), x)),
            rnet(join(params, {"fresh": a, "frozen": a}), x),
            jax.grad(loss(rnet))(join(params, {"fresh": a, "frozen": b})),
            jax.grad(explicit, argnums=(0, 1, 3))(params, a, b, x),
            jax.grad(lambda x: jnp.sum(rnet(join(params, {"fresh": a, "frozen": b}), x) ** 2))(x),
        )

    def explicit(params, a, b, x):  # Expression (1) by hand: theta's head and theta'_frozen held
        held = override(params, jax.lax.stop_gradient(head_part(params, head)))
        frozen = override(params, jax.lax.stop_gradient(b))
        return jnp.sum((net(held, x) + net(override(params, a), x) - net(frozen, x)) ** 2)

    y, ry, g, rg, both, want, same, g_after, (g_encoder, g_fresh, g_x), rg_x = run(params, rparams, a, b)
    # a zero pair: the wrapped network's outputs and gradients, bit for bit, and none for the pair
    np.testing.assert_array_equal(ry, y)
    for k, v in _leaves(g).items():
        np.testing.assert_array_equal(_leaves(split(rg)[0])[k], v)
    assert all(np.all(v == 0) for v in jax.tree.leaves(split(rg)[1]))
    # after an injection: gradients for theta' and the encoder only (theta's head and theta'_frozen are frozen)
    ga, heads = _leaves(g_after), set(_leaves(a))
    for k, v in ga.items():
        if k in heads or k[:2] == (RESIDUAL, "frozen"):
            np.testing.assert_array_equal(v, 0.0, err_msg=str(k))
        elif k[-1] == "kernel":  # theta' and the encoder
            assert np.any(v != 0), k
    # ... and they are Expression (1)'s gradients (the residual terms' custom VJP recomputes their forward pass)
    want_grads = {**{k: v for k, v in _leaves(g_encoder).items() if k not in heads}}
    want_grads.update({(RESIDUAL, "fresh", *k): v for k, v in _leaves(g_fresh).items()})
    for k, v in want_grads.items():
        np.testing.assert_allclose(ga[k], v, rtol=1e-5, atol=1e-6, err_msg=str(k))
    np.testing.assert_allclose(rg_x, g_x, rtol=1e-5, atol=1e-6)  # and the input's (a critic's action)
    # any pair: Expression (1), every head on the same encoder output (MLPHead: the output layer is the output)
    np.testing.assert_allclose(both, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(both, y)
    np.testing.assert_array_equal(same, y)  # theta' = theta'_frozen: exactly unchanged
    # the module's transform after the output layer applies to the sum (a Gaussian head's log-std clip at 2)
    gnet, gparams = _built(lambda r: GaussianPolicyHead(4, 2, TrunkSpec(8, 2), rngs=r), jax.random.key(4))
    grnet, _ = ResidualHeadNet.wrap(gnet, gparams, (("out",),))
    big = jax.tree.map(lambda v: 50.0 * v + 1.0, head_part(gparams, (("out",),)))
    zero = jax.tree.map(jnp.zeros_like, big)
    _, log_std = jax.jit(grnet.__call__)(join(gparams, {"fresh": big, "frozen": zero}), x)
    assert float(jnp.max(log_std)) == 2.0


def test_the_frozen_head_optimizer_is_the_plain_one_before_the_injection():
    """With the pair zero and the injection not done, ``frozen_head(tx)``'s update of the network's own params is
    ``tx``'s, bit for bit (here Adam with L2 Init and NaP), and the pair gets none: with the forward pass and
    gradients above, the network trains exactly as without the pair until the injection."""
    net, params = _built(lambda r: MLPHead(4, 1, TrunkSpec(8, 2, layer_norm=True), rngs=r), jax.random.key(0))
    _, rparams = ResidualHeadNet.wrap(net, params, (("trunk", "layers", 1), ("out",)))
    reg = optim_lib.regularizers.RegSpec(l2_init=0.01, nap=True)
    tx = optim_lib.optimizer(1e-2, "net", spec=optim_lib.OptimSpec(reg=reg))
    rtx = optim_lib.optimizer(1e-2, "net", spec=optim_lib.OptimSpec(reg=reg, injection=True))
    grads = jax.tree.map(lambda v: jnp.cos(7.0 * v) + 0.5, rparams)

    @jax.jit
    def run(params, rparams, grads):
        def step(carry, _):
            params, rparams, s, rs = carry
            u, s = tx.update(split(grads)[0], s, params)
            ru, rs = rtx.update(grads, rs, rparams)
            params, rparams = optax.apply_updates(params, u), optax.apply_updates(rparams, ru)
            return (params, rparams, s, rs), (params, rparams)

        (_, _, _, rs), outs = jax.lax.scan(step, (params, rparams, tx.init(params), rtx.init(rparams)), length=3)
        return outs, rs

    (ps, rps), rs = run(params, rparams, grads)
    assert int(rs.stage) == 0
    base, pair = split(rps)
    for k, v in _leaves(ps).items():  # the same program twice: equal up to XLA fusing them differently
        np.testing.assert_allclose(_leaves(base)[k], v, rtol=1e-6, atol=1e-9)
    assert all(np.all(v == 0) for v in jax.tree.leaves(pair))
    assert not np.allclose(_leaves(ps)[("out", "kernel")][-1], _leaves(params)[("out", "kernel")])


# ----------------------------------------------------------------------------- the injection on every agent


def _check_agent(name, pc):
    """Two steps, the injection, two steps: the pair zero before; every injected network's outputs exactly
    unchanged by the injection, theta' a draw of the network's own initialiser in both copies, targets given
    the pair; after it theta and theta'_frozen fixed, theta' and the encoder training."""
    agent, state = _state(name, pc)
    steps = _steps_fn(name, agent, state)
    heads = {n for n, (p, _) in agent.PLASTIC.items() if split(getattr(state, p))[1] is not None}
    assert heads == ({"value", "policy"} if name.startswith("mrq") else {"actor", "critic"})
    nets = agent.plastic_nets(state)
    outputs = jax.jit(
        lambda s: {
            n: nets[n](getattr(s, agent.PLASTIC[n][0]), _input(getattr(state, agent.PLASTIC[n][0]))) for n in heads
        }
    )
    state = steps(state, jax.random.key(0))
    for n in heads:
        assert all(np.all(v == 0) for v in jax.tree.leaves(split(getattr(state, agent.PLASTIC[n][0]))[1])), n
    before = outputs(state)
    new, out = jax.jit(lambda s, k: hooks.injection_event(agent, s, k))(state, jax.random.key(9))
    assert set(out) == {f"plasticity/{n}/injected" for n in heads}
    for a, b in zip(jax.tree.leaves(outputs(new)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)  # exactly unchanged
    draws = jax.jit(
        lambda k: {
            n: head_part(split(nets[n].init(jax.random.fold_in(k, i)))[0], nets[n].head)
            for i, n in enumerate(agent.PLASTIC)
            if n in heads
        }
    )(jax.random.key(9))
    for n in heads:
        p_field, o_field = agent.PLASTIC[n]
        pair = split(getattr(new, p_field))[1]
        for k, v in _leaves(draws[n]).items():  # the draw fused into the event may differ in the last bit
            np.testing.assert_allclose(_leaves(pair["fresh"])[k], v, rtol=1e-6, atol=1e-8)
            np.testing.assert_array_equal(_leaves(pair["frozen"])[k], _leaves(pair["fresh"])[k])
        assert any(np.abs(v).max() > 0 for v in _leaves(draws[n]).values())
        assert int(injection.find(getattr(new, o_field)).stage) == 1
        t_field = getattr(agent, "PLASTIC_TARGETS", {}).get(n)
        if t_field:
            for a, b in zip(jax.tree.leaves(split(getattr(new, t_field))[1]), jax.tree.leaves(pair)):
                np.testing.assert_array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(split(getattr(new, t_field))[0]), jax.tree.leaves(split(getattr(state, t_field))[0])
            ):
                np.testing.assert_array_equal(a, b)
    after = steps(new, jax.random.key(1))
    for n in heads:
        p_field, o_field = agent.PLASTIC[n]
        a, b = _leaves(getattr(new, p_field)), _leaves(getattr(after, p_field))
        encoder, head, fresh, frozen = _head_keys(getattr(new, p_field))
        for k in head | frozen:
            np.testing.assert_array_equal(b[k], a[k], err_msg=f"{n} {k} is frozen")
        assert all(not np.array_equal(b[k], a[k]) for k in fresh if k[-1] == "kernel"), n
        assert any(not np.array_equal(b[k], a[k]) for k in encoder if k[-1] == "kernel"), f"{n}: the encoder trains"
        assert int(injection.find(getattr(after, o_field)).stage) == 2
    return agent, new, after


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sac", "mrq", "ppo"])  # mrq-mt: MR.Q's networks and optimizers (abstract test below)
def test_injection_on_every_agent(name):
    """``_check_agent``; on SAC (Adam, with L2 Init) also: theta''s optimizer state is a fresh one built at its
    first step (its Adam has counted the 2 steps since the injection, the network's own all 4), and L2 Init's
    theta_0 for theta' is theta' as injected."""
    pc = PlasticityConfig(metrics_every=0, injection_step=3, l2_init=1e-6 if name == "sac" else 0.0)
    _, new, after = _check_agent(name, pc)
    if name != "sac":
        return
    inj = injection.find(after.critic_opt)

    def adam(s):
        is_adam = lambda n: isinstance(n, optax.ScaleByAdamState)  # noqa: E731
        return [n for n in jax.tree.leaves(s, is_leaf=is_adam) if is_adam(n)][0]

    assert int(adam(inj.fresh).count) == 2 and int(adam(inj.inner).count) == 4
    reg = optim_lib.regularizers.find(inj.fresh, optim_lib.regularizers.RegState)
    for got, want in zip(reg.init, jax.tree.leaves(split(new.critic_params)[1]["fresh"])):
        np.testing.assert_array_equal(got, want)


def test_before_its_step_injection_changes_nothing_and_it_fires_once():
    """The hooks' schedule: nothing before update 3 (the state as it was), the injection when update 3 is
    passed, never again; ``--plasticity.injection-at`` as a share of the run's updates."""
    agent, state = _state("sac")
    h = hooks.Hooks(INJECT, agent, "sac")
    seeds = jax.jit(lambda s: jax.tree.map(lambda v: v[None], s))(state)
    same, rows = h.after_updates(0, 2, seeds, None, jax.random.key(1))
    assert rows is None
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(seeds)):
        np.testing.assert_array_equal(a, b)
    x = _input(state.critic_params)
    first = lambda t: jax.tree.map(lambda v: v[0], t)  # noqa: E731  (seed 0)
    q = jax.jit(lambda s: (s.critic(first(s.critic_params), x), s.critic(first(s.target_critic_params), x)))
    q_before = q(same)
    done, rows = h.after_updates(2, 3, same, None, jax.random.key(1))
    assert rows[0]["plasticity/critic/injected"] == 1.0 and int(injection.find(done.critic_opt).stage[0]) == 1
    assert not np.all(_leaves(split(done.critic_params)[1]["fresh"])[("out", "kernel")] == 0)
    for a, b in zip(q(done), q_before):  # the critic and its target: exactly unchanged
        np.testing.assert_array_equal(a, b)
    _, rows = h.after_updates(3, 9, done, None, jax.random.key(1))
    assert rows is None
    at = hooks.Hooks(PlasticityConfig(metrics_every=0, injection_at=0.25), agent, "sac", total_updates=400)
    assert at.injection_update == 100


@pytest.mark.slow
def test_before_its_step_sac_updates_as_without_injection():
    """The constructed case through SAC's own update: built for an injection at update 3, and plain, on the same
    batches and keys: the same params and Q values (to float32 rounding: XLA may merge the pair's matrix
    products with the network's), the pair still exactly zero."""
    agent = agents.get("sac")
    plain = jax.jit(lambda k: agent.init(k, 3, 2, agent.CONFIG(), NET))(jax.random.key(0))
    _, built = _state("sac")
    rng = np.random.default_rng(0)
    obs, act, rew, nxt = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((16, 3), (16, 2), (16,), (16, 3)))
    batch = Transition(obs, jnp.tanh(act), rew, nxt, jnp.zeros(16, bool), jnp.zeros(16, bool))
    update = jax.jit(agent.update)
    for t in range(2):
        plain, _ = update(plain, batch, jax.random.key(t))
        built, _ = update(built, batch, jax.random.key(t))
    for field in ("actor_params", "critic_params", "target_critic_params"):
        a, (b, pair) = _leaves(getattr(plain, field)), split(getattr(built, field))
        for k, v in _leaves(b).items():
            np.testing.assert_allclose(v, a[k], rtol=1e-6, atol=1e-7, err_msg=f"{field} {k}")
        assert all(np.all(v == 0) for v in jax.tree.leaves(pair))


def test_redo_on_an_injected_network_zeroes_a_reset_encoder_units_rows_in_every_head():
    """A ReDo reset of an encoder unit zeroes its outgoing rows in theta, theta' and theta'_frozen (and theta''s
    Adam moments there); a unit of the head's hidden layer is theta''s alone: the copies keep their rows."""
    agent, state = _state("sac")
    state, _ = jax.jit(lambda s, k: hooks.injection_event(agent, s, k))(state, jax.random.key(2))
    state = state.replace(critic_opt=jax.tree.map(lambda v: v + 1 if v.dtype == jnp.float32 else v, state.critic_opt))
    masks = {
        "layer0": jnp.zeros((2, 16), bool).at[:, 3].set(True),
        "layer1": jnp.zeros((2, 16), bool).at[:, 5].set(True),
    }
    reset = jax.jit(lambda p, o, m, k: resets.reset_neurons(state.critic, p, o, m, k))
    params, opt = reset(state.critic_params, state.critic_opt, masks, jax.random.key(4))
    p = _leaves(params)
    for part in ((), (RESIDUAL, "fresh"), (RESIDUAL, "frozen")):
        np.testing.assert_array_equal(p[(*part, "trunk", "layers", 1, "kernel")][:, 3, :], 0.0)
        assert np.all(p[(*part, "trunk", "layers", 1, "kernel")][:, 4, :] != 0)
    np.testing.assert_array_equal(p[("out", "kernel")][:, 5, :], 0.0)
    for part in ((RESIDUAL, "fresh"), (RESIDUAL, "frozen")):
        assert np.all(p[(*part, "out", "kernel")][:, 5, :] != 0)
    inj = injection.find(opt)
    mu = [
        n.mu
        for n in jax.tree.leaves(inj.fresh, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
        if isinstance(n, optax.ScaleByAdamState)
    ][0]
    np.testing.assert_array_equal(_leaves(mu)[("trunk", "layers", 1, "kernel")][:, 3, :], 0.0)
    assert np.all(_leaves(mu)[("out", "kernel")][:, 5, :] == 1.0)


def test_injection_and_trac_are_refused_where_they_do_not_apply(capsys):
    for bad, msg in (
        (dict(injection_step=5, injection_at=0.5), "pick one"),
        (dict(injection_step=5, ne=True), "does not combine with --plasticity.ne"),
        (dict(injection_at=0.5, layer_reset=True), "are alternatives"),
        (dict(injection_at=1.0), "--plasticity.injection-at must be in"),
        (dict(injection_layers=-1), "--plasticity.injection-layers must be >= 0"),
        (dict(trac=True, trac_s_init=0.0), "--plasticity.trac-s-init must be > 0"),
    ):
        with pytest.raises(ValueError, match=msg):
            PlasticityConfig(**bad).validate()
    neubay = agents.get("neubay")
    for flag, pc in (
        ("--plasticity.injection-step", INJECT),
        ("--plasticity.injection-at", PlasticityConfig(injection_at=0.5)),
        ("--plasticity.trac", PlasticityConfig(trac=True)),
    ):
        with pytest.raises(ValueError, match=f"{flag} does not apply to agent 'neubay'"):
            hooks.check_applicable(pc, neubay, "neubay")
    # an agent that offers no network for injection (built without plasticity.injection.injectable)
    agent = agents.get("sac")
    plain = jax.eval_shape(lambda k: agent.init(k, 3, 2, agent.CONFIG(), NET), jax.random.key(0))
    with pytest.raises(ValueError, match="none of its networks is built with a residual head"):
        hooks.check_injection(INJECT, agent, "sac", plain)
    with pytest.raises(ValueError, match="--plasticity.trac does not apply to agent 'sac'"):
        hooks.check_trac(agent, "sac", plain)
    # the command line: one error line, no traceback
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import train as train_script

    for argv, msg in (
        (["sac", "--plasticity.injection-step", "5", "--plasticity.ne"], "does not combine with --plasticity.ne"),
        (["ppo", "--plasticity.injection-at", "0.5", "--plasticity.layer-reset"], "are alternatives"),
    ):
        with pytest.raises(SystemExit) as e:
            train_script.cli([*argv, "--run-dir", "/nonexistent/never-made"])
        assert e.value.code != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], err


@pytest.mark.slow
def test_resume_after_the_injection_is_exact_and_the_checkpoint_restores_the_policy(tiny_sac_config, tmp_path):
    from plasticity_zoo.agents import sac
    from plasticity_zoo.analysis.restore import restore_policy
    from plasticity_zoo.training.loops.offpolicy import train

    pc = PlasticityConfig(metrics_every=0, injection_step=30, trac=True)
    cfg = tiny_sac_config(total_steps=180, learning_starts=40, checkpoint_every=90, eval_every=90, plasticity=pc)
    full = train(cfg, sac, tmp_path / "full")
    part = train(cfg, sac, tmp_path / "part", stop_at=90)  # checkpointed at 90: 50 updates, injected at 30
    assert int(injection.find(part["state"].critic_opt).stage[0]) == 2
    resumed = train(cfg, sac, tmp_path / "part", resume=True)
    for a, b in zip(jax.tree.leaves(full["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(a, b)
    restored = restore_policy(tmp_path / "part", step=90)
    assert split(restored.state.critic_params)[1] is not None
    # the exported policy of an injected run loads with its residual heads and acts as the run's own
    from plasticity_zoo.analysis.export import export_policy, load_policy

    policy = load_policy(export_policy(tmp_path / "part", tmp_path / "policy.npz", step=90))
    assert split(policy.state.actor_params)[1] is not None
    obs = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    np.testing.assert_array_equal(policy(obs), restored.env_policy()(obs))


# ----------------------------------------------------------------------------- TRAC


def _series_erfi(x: float) -> float:
    return 2 / math.sqrt(math.pi) * sum(x ** (2 * n + 1) / (math.factorial(n) * (2 * n + 1)) for n in range(40))


def test_trac_first_two_steps_by_hand():
    """Step 1 from theta_ref: Delta_0 = 0, so h = 0, v = 0, sigma_beta = beta 1e-8 and s_beta = s_init erfi(beta
    1e-8 / eps) / erfi(1 / sqrt 2) = s_init erfi(beta) / erfi(1 / sqrt 2); theta_1 = theta_ref + sum(s) u, u Adam's
    first step -lr sign(g).  Step 2: Delta_1 = u, h = <g_2, u>, v = h^2, sigma = beta^2 1e-8 - h."""
    params = {"w": jnp.array([[0.5, -1.0], [2.0, 0.0]]), "b": jnp.array([0.1, -0.3])}
    grads = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([-1.0, 4.0])}
    g2 = jax.tree.map(lambda g: -2.0 * g, grads)
    tx = trac.trac(optax.adam(0.1), trac.TracSpec(s_init=1e-3))

    @jax.jit
    def run(params):
        u, state = tx.update(grads, tx.init(params), params)
        return u, state, tx.update(g2, state, optax.apply_updates(params, u))[1]

    u, state, state2 = run(params)
    s = [1e-3 * _series_erfi(b) / _series_erfi(1 / math.sqrt(2)) for b in trac.BETAS]
    np.testing.assert_allclose(state.s, s, rtol=2e-6)
    np.testing.assert_allclose(state.sigma, [b * 1e-8 for b in trac.BETAS], rtol=1e-6)
    np.testing.assert_array_equal(state.variance, 0.0)
    for k in params:  # theta_ref + S u rounds to theta's float32 grid: an ulp of 2.0 is 2.4e-7
        np.testing.assert_allclose(u[k], -sum(s) * 0.1 * np.sign(grads[k]), rtol=1e-6, atol=2.5e-7)
    h = sum(float(jnp.vdot(-0.1 * jnp.sign(grads[k]), g2[k])) for k in params)
    np.testing.assert_allclose(state2.variance, h**2, rtol=2e-3)
    np.testing.assert_allclose(state2.sigma, np.array(trac.BETAS) ** 2 * 1e-8 - h, rtol=2e-3)


def test_trac_post_scaled_is_trac_over_the_scaled_step():
    """PPO's path (an lr-1 descent direction that the caller scales by its lr, then ``optim.constrain``) plays
    the same params as TRAC over the same direction at that lr."""
    spec = optim_lib.OptimSpec(trac=trac.TracSpec(s_init=1e-3))
    direction = lambda lr, **_: optax.chain(optax.scale_by_adam(), optax.scale(-lr))  # noqa: E731
    post = optim_lib.optimizer(1.0, "actor", make=direction, spec=spec, post_scaled=True)
    plain = optim_lib.optimizer(0.05, "actor", make=direction, spec=spec)
    p0 = {"w": jnp.array([[0.001, -0.002], [0.0, 0.003]]), "b": jnp.zeros(2)}

    @jax.jit
    def run(p):
        def step(carry, t):
            p, q, sp, sq = carry
            g = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]) + 0.3 * t, "b": jnp.array([-1.0, 4.0])}
            u, sp = post.update(g, sp, p)
            p = optim_lib.constrain(sp, optax.apply_updates(p, jax.tree.map(lambda v: 0.05 * v, u)))
            v, sq = plain.update(g, sq, q)
            return (p, optax.apply_updates(q, v), sp, sq), None

        (p, q, _, sq), _ = jax.lax.scan(step, (p, p, post.init(p), plain.init(p)), jnp.arange(12.0))
        return p, q, jnp.sum(trac.find(sq).s)

    p, q, scale = run(p0)
    assert float(scale) > 1e-2  # the scale grew by orders of magnitude: TRAC is doing something
    for k in p:
        np.testing.assert_allclose(p[k], q[k], rtol=1e-5, atol=1e-9)
        assert not np.allclose(p[k], p0[k])


@pytest.mark.parametrize("name", ["sac", "ravl", "mrq", "mrq-mt", "ppo"])
def test_trac_and_injection_are_built_into_every_agents_optimizers(name):
    pc = PlasticityConfig(metrics_every=0, trac=True, injection_step=5)
    agent, state = _state(name, pc, abstract=True)  # check_optimizers passes
    for n, (p_field, o_field) in agent.PLASTIC.items():
        assert trac.find(getattr(state, o_field)) is not None, n
        assert (injection.find(getattr(state, o_field)) is not None) == (n in HEADS), n
        assert (split(getattr(state, p_field))[1] is not None) == (n in HEADS), n


def test_the_metrics_event_logs_tracs_played_scale_for_each_network():
    agent, state = _state("sac", PlasticityConfig(trac=True))
    is_trac = lambda n: isinstance(n, trac.TracState)  # noqa: E731

    def with_s(opt, s):  # the tuner's scales s_beta set by hand
        return jax.tree.map(
            lambda n: n._replace(s=jnp.asarray(s, n.s.dtype)) if is_trac(n) else n, opt, is_leaf=is_trac
        )

    n_beta = trac.find(state.critic_opt).s.shape
    critic_s = np.linspace(-0.1, 0.3, int(np.prod(n_beta))).reshape(n_beta)
    state = state.replace(
        critic_opt=with_s(state.critic_opt, critic_s), actor_opt=with_s(state.actor_opt, -np.ones(n_beta))
    )
    scales = jax.jit(lambda st: hooks.trac_scales(agent, st))(state)
    assert set(scales) == {f"plasticity/{n}/trac_scale" for n in agent.PLASTIC}
    # S_t = max(sum_beta s_beta, 0) (Muppidi et al. 2024, Algorithm 1; the package's max(s_sum, 0))
    np.testing.assert_allclose(float(scales["plasticity/critic/trac_scale"]), critic_s.sum(), rtol=1e-6)
    assert float(scales["plasticity/actor/trac_scale"]) == 0.0
    plain_agent, plain = _state("sac", PlasticityConfig(), abstract=True)
    assert jax.eval_shape(lambda s: hooks.trac_scales(plain_agent, s), plain) == {}


@pytest.mark.slow
@pytest.mark.parametrize("kron", [False, True])
def test_trac_and_injection_combine_with_kron_nap_and_l2_init(kron):
    """The whole chain on one small network with a residual head: Adam or Kron under TRAC under L2 Init and NaP,
    under the frozen head: two steps, the injection, two steps; finite, the frozen parts fixed, theta' trained."""
    if kron:
        pytest.importorskip("psgdax")
    net, params = _built(lambda r: MLPHead(4, 1, TrunkSpec(8, 2, layer_norm=True), rngs=r), jax.random.key(0))
    rnet, rparams = ResidualHeadNet.wrap(net, params, (("trunk", "layers", 1), ("trunk", "norms", 1), ("out",)))
    reg = optim_lib.regularizers.RegSpec(l2_init=0.01, nap=True)
    spec = optim_lib.OptimSpec(kron=kron, reg=reg, trac=trac.TracSpec(s_init=1e-3), injection=True)
    tx = optim_lib.optimizer(1e-2, "net", spec=spec)
    x = jax.random.normal(jax.random.key(1), (8, 4))

    @jax.jit
    def run(params):
        def step(carry, _):
            p, s = carry
            g = jax.grad(lambda p: jnp.mean((rnet(p, x) - 1.0) ** 2))(p)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, s), _ = jax.lax.scan(step, (params, tx.init(params)), length=2)
        injected, s = injection.inject(rnet, p, s, jax.random.key(2))
        (after, s), _ = jax.lax.scan(step, (injected, s), length=2)
        return injected, after, s

    injected, after, s = run(rparams)
    assert int(injection.find(s).stage) == 2
    encoder, head, fresh, frozen = _head_keys(injected)
    a, b = _leaves(injected), _leaves(after)
    assert all(np.all(np.isfinite(v)) for v in b.values())
    for k in head | frozen:
        np.testing.assert_array_equal(b[k], a[k])
    assert any(not np.array_equal(b[k], a[k]) for k in fresh)
