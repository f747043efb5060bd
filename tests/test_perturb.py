"""Shrink & Perturb and layer resets (plasticity/perturb.py, plasticity/hooks.py): the update against
its formula, exactly the chosen layers re-drawn from their initialisers with fresh Adam moments,
targets following, every agent that declares plastic networks, refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from plasticity_zoo import agents
from plasticity_zoo.networks.core import path_names
from plasticity_zoo.plasticity import hooks, perturb
from plasticity_zoo.plasticity.config import PlasticityConfig
from plasticity_zoo.training.config import NetworkConfig, RunConfig

NET = NetworkConfig(width=16, depth=2)


def _state(name, network=NET, seed=0):
    agent = agents.get(name)
    cfg = agent.CONFIG()
    return agent, agent.init(jax.random.key(seed), 3, 2, cfg, network)


def _leaves(tree):
    return {path_names(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _adam(opt_state):
    (adam,) = [
        n
        for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
        if isinstance(n, optax.ScaleByAdamState)
    ]
    return adam


def test_shrink_perturb_is_lambda_theta_plus_sigma_phi():
    params = {"a": jnp.array([1.0, -2.0, 4.0]), "b": {"k": jnp.array([[0.5]])}}
    fresh = {"a": jnp.array([10.0, 20.0, -30.0]), "b": {"k": jnp.array([[-8.0]])}}
    out = perturb.shrink_perturb(params, fresh, 0.8, 0.1)
    np.testing.assert_allclose(out["a"], [0.8 * 1 + 1.0, 0.8 * -2 + 2.0, 0.8 * 4 - 3.0], rtol=1e-6)
    np.testing.assert_allclose(out["b"]["k"], [[0.8 * 0.5 - 0.8]], rtol=1e-6)


def test_a_shrink_perturb_event_mixes_each_network_with_a_fresh_draw_of_its_initialiser():
    agent, state = _state("sac")
    key = jax.random.key(7)
    cfg = PlasticityConfig(shrink_perturb=True, sp_shrink=0.5, sp_perturb=0.25)
    new = hooks.shrink_perturb_step(agent, cfg, state, key)
    for i, (name, (p_field, _)) in enumerate(agent.PLASTIC.items()):
        fresh = agent.plastic_nets(state)[name].init(jax.random.fold_in(key, i))
        want = jax.tree.map(lambda p, f: 0.5 * p + 0.25 * f, getattr(state, p_field), fresh)
        for a, b in zip(jax.tree.leaves(getattr(new, p_field)), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # the noise is a new draw: not the initial params, and other keys give other noise
    again = hooks.shrink_perturb_step(agent, cfg, state, jax.random.key(8))
    assert not np.allclose(_leaves(again.actor_params)[("out", "kernel")], _leaves(new.actor_params)[("out", "kernel")])
    # the optimizer state, the targets and the temperature are left alone
    for field in ("actor_opt", "critic_opt", "target_critic_params", "log_alpha"):
        for a, b in zip(jax.tree.leaves(getattr(new, field)), jax.tree.leaves(getattr(state, field))):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layer_norm", [False, True])
def test_the_last_k_layers_are_the_output_layer_then_the_hidden_ones_from_the_top(layer_norm):
    agent, state = _state("sac", NetworkConfig(width=16, depth=2, layer_norm=layer_norm))
    net, params = state.actor, state.actor_params
    hit = lambda last: {k for k, m in _leaves(perturb.layer_mask(net, params, last)).items() if m.all()}  # noqa: E731
    some = lambda last: {k for k, m in _leaves(perturb.layer_mask(net, params, last)).items() if m.any()}  # noqa: E731
    assert hit(1) == some(1) == {k for k in _leaves(params) if k[0] == "out"}
    (top,) = perturb.layers(net, params)[-2:-1]
    two = hit(2) - hit(1)
    assert two and all(any(k[: len(p)] == p for p in top) for k in two)
    assert len(top) == (2 if layer_norm else 1)  # the layer's LayerNorm goes with its Linear
    assert hit(0) == set(_leaves(params))  # 0: the whole network
    assert hit(3) > hit(2) > hit(1)


def test_a_layer_reset_redraws_exactly_the_chosen_layers_with_fresh_adam_moments_and_targets_follow():
    agent, state = _state("sac")
    # give Adam some history, so zeroed moments and counts are visible
    state = state.replace(
        critic_opt=jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.number) else x, state.critic_opt),
        target_critic_params=jax.tree.map(lambda x: x + 3.0, state.target_critic_params),
    )
    key = jax.random.key(11)
    cfg = PlasticityConfig(layer_reset=True, layer_reset_layers=1)
    new, out = hooks.layer_reset_step(agent, cfg, state, key)
    i = list(agent.PLASTIC).index("critic")
    fresh = _leaves(state.critic.init(jax.random.fold_in(key, i)))
    before, after, target = _leaves(state.critic_params), _leaves(new.critic_params), _leaves(new.target_critic_params)
    mu_before, mu_after = _leaves(_adam(state.critic_opt).mu), _leaves(_adam(new.critic_opt).mu)
    for k in before:
        if k[0] == "out":  # re-drawn, moments zeroed, the target takes the new values
            np.testing.assert_array_equal(after[k], fresh[k])
            np.testing.assert_array_equal(mu_after[k], 0.0)
            np.testing.assert_array_equal(target[k], after[k])
        else:  # untouched
            np.testing.assert_array_equal(after[k], before[k])
            np.testing.assert_array_equal(mu_after[k], mu_before[k])
            np.testing.assert_array_equal(target[k], _leaves(state.target_critic_params)[k])
    assert int(_adam(new.critic_opt).count) == int(_adam(state.critic_opt).count)  # shared with the kept layers
    assert 0.0 < float(out["plasticity/critic/layer_reset_fraction"]) < 0.1

    full, out = hooks.layer_reset_step(agent, dataclasses.replace(cfg, layer_reset_layers=0), state, key)
    for name, (p_field, o_field) in agent.PLASTIC.items():
        fresh = _leaves(agent.plastic_nets(state)[name].init(jax.random.fold_in(key, list(agent.PLASTIC).index(name))))
        for k, v in _leaves(getattr(full, p_field)).items():
            np.testing.assert_array_equal(v, fresh[k])
        adam = _adam(getattr(full, o_field))
        assert int(adam.count) == 0 and all(np.all(x == 0) for x in jax.tree.leaves((adam.mu, adam.nu)))
        assert float(out[f"plasticity/{name}/layer_reset_fraction"]) == 1.0
    for a, b in zip(jax.tree.leaves(full.target_critic_params), jax.tree.leaves(full.critic_params)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(full.log_alpha, state.log_alpha)  # the temperature is not a network


@pytest.mark.parametrize("name", ["sac", "mrq", "ppo"])
def test_both_events_run_jitted_over_seeds_on_every_agent_with_plastic_networks(name):
    agent = agents.get(name)
    cfg = PlasticityConfig(shrink_perturb=True, sp_shrink=0.9, sp_perturb=0.1, layer_reset=True, layer_reset_layers=2)
    hooks.check_applicable(cfg, agent, name)
    states = jax.vmap(lambda k: agent.init(k, 3, 2, agent.CONFIG(), NET))(jax.random.split(jax.random.key(0), 2))
    sp, lr = hooks._perturb_programs(agent, cfg)
    keys = jax.random.split(jax.random.key(1), 2)
    p_field = next(iter(agent.PLASTIC.values()))[0]
    before = [np.asarray(x) for x in jax.tree.leaves(getattr(states, p_field))]
    states = sp(states, keys)
    states, out = lr(states, keys)
    after = jax.tree.leaves(getattr(states, p_field))
    assert all(np.all(np.isfinite(a)) for a in after)
    assert any(not np.allclose(a, b) for a, b in zip(after, before))
    assert set(out) == {f"plasticity/{n}/layer_reset_fraction" for n in agent.PLASTIC}
    for v in out.values():
        assert v.shape == (2,) and np.all((v > 0) & (v < 1))
    for net_name, t_field in getattr(agent, "PLASTIC_TARGETS", {}).items():  # targets declared are real fields
        assert jax.tree.structure(getattr(states, t_field)) == jax.tree.structure(
            getattr(states, agent.PLASTIC[net_name][0])
        )


@pytest.mark.slow
def test_events_fire_on_their_periods_in_the_hooks():
    agent = agents.get("sac")
    cfg = PlasticityConfig(
        metrics_every=0,
        shrink_perturb=True,
        sp_every=5,
        sp_shrink=0.5,
        sp_perturb=0.0,
        layer_reset=True,
        layer_reset_every=7,
        layer_reset_layers=1,
    )
    h = hooks.Hooks(cfg, agent, "sac")
    states = jax.vmap(lambda k: agent.init(k, 3, 2, agent.CONFIG(), NET))(jax.random.split(jax.random.key(0), 1))
    states = h.start(states)
    first = _leaves(states.actor_params)
    states, rows = h.after_updates(0, 4, states, None, jax.random.key(2))
    assert rows is None and all(np.array_equal(v, _leaves(states.actor_params)[k]) for k, v in first.items())
    states, rows = h.after_updates(4, 5, states, None, jax.random.key(2))  # S&P with sigma 0 halves every weight
    for k, v in _leaves(states.actor_params).items():
        np.testing.assert_allclose(v, 0.5 * first[k], rtol=1e-6)
    assert rows is None
    states, rows = h.after_updates(5, 7, states, None, jax.random.key(3))  # the layer reset at 7
    assert rows is not None and "plasticity/actor/layer_reset_fraction" in rows[0]


def test_refused_where_it_does_not_apply_and_out_of_range_values_are_named():
    neubay = agents.get("neubay")
    for flag, cfg in (
        ("--plasticity.shrink-perturb", PlasticityConfig(shrink_perturb=True)),
        ("--plasticity.layer-reset", PlasticityConfig(layer_reset=True)),
    ):
        with pytest.raises(ValueError, match=f"{flag} does not apply to agent 'neubay'"):
            hooks.check_applicable(cfg, neubay, "neubay")
    for bad, msg in (
        (dict(sp_shrink=0.0), "sp-shrink"),
        (dict(sp_shrink=1.5), "sp-shrink"),
        (dict(sp_perturb=-0.1), "sp-perturb"),
        (dict(sp_every=0), "sp-every"),
        (dict(layer_reset_every=0), "layer-reset-every"),
        (dict(layer_reset_layers=-1), "layer-reset-layers"),
    ):
        with pytest.raises(ValueError, match=msg):
            PlasticityConfig(shrink_perturb=True, layer_reset=True, **bad).validate()


@pytest.mark.slow
def test_sac_trains_with_shrink_perturb_and_layer_resets_through_the_loop(tmp_path):
    import csv

    from plasticity_zoo.agents import sac
    from plasticity_zoo.training.loops.offpolicy import train

    cfg = RunConfig(
        env="Pendulum-v1",
        total_steps=160,
        eval_every=160,
        eval_episodes=1,
        log_every=40,
        checkpoint_every=160,
        progress=False,
        network=NetworkConfig(width=16),
        plasticity=PlasticityConfig(
            metrics_every=0,
            shrink_perturb=True,
            sp_every=10,
            sp_shrink=0.9,
            sp_perturb=0.1,
            layer_reset=True,
            layer_reset_every=50,
        ),
        agent_name="sac",
        agent=sac.SACConfig(batch_size=16, buffer_size=512, learning_starts=40),
    )
    out = train(cfg, sac, tmp_path / "r")
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(sac.plastic_params(out["state"])))
    rows = [
        r
        for r in csv.DictReader(open(tmp_path / "r" / "metrics.csv"))
        if r.get("plasticity/critic/layer_reset_fraction")
    ]
    assert rows and all(float(r["plasticity/critic/layer_reset_fraction"]) == 1.0 for r in rows)
