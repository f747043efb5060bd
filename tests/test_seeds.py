"""training.seeds.over_seeds: one seed runs unmapped, more seeds through vmap, same results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.training.seeds import over_seeds


def _update(params, x, key, scale):
    """A small 'update': a matmul, a random draw and a shared (unmapped) scale."""
    y = jnp.tanh(x @ params["w"] + params["b"]) * scale
    noise = jax.random.normal(key, y.shape)
    return {"w": params["w"] - 0.1 * x.T @ y / x.shape[0], "b": params["b"]}, y + noise


def _args(seeds):
    k = jax.random.split(jax.random.key(3), 3)
    params = {"w": jax.random.normal(k[0], (seeds, 4, 5)), "b": jax.random.normal(k[1], (seeds, 5))}
    x = jax.random.normal(k[2], (seeds, 8, 4))
    return params, x, jax.random.split(jax.random.key(7), seeds), jnp.float32(0.5)


def _dot_batch_dims(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [len(e.params["dimension_numbers"][1][0]) for e in jaxpr.eqns if e.primitive.name == "dot_general"]


def test_one_seed_runs_unmapped_and_matches_vmap():
    args = _args(1)
    mapped = over_seeds(_update, in_axes=(0, 0, 0, None))
    vmapped = jax.vmap(_update, in_axes=(0, 0, 0, None))
    got, want = jax.jit(mapped)(*args), jax.jit(vmapped)(*args)
    assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    # the squeezed program: no dot keeps a batch dimension; the vmapped one batches its dots over the seed
    assert _dot_batch_dims(mapped, *args) and not any(_dot_batch_dims(mapped, *args))
    assert all(_dot_batch_dims(vmapped, *args))


def test_several_seeds_are_vmapped_and_each_seed_equals_its_own_one_seed_run():
    args = _args(3)
    got = jax.jit(over_seeds(_update, in_axes=(0, 0, 0, None)))(*args)
    for j in range(3):
        one = jax.tree.map(lambda a: a[j : j + 1], args[:3]) + (args[3],)
        alone = over_seeds(_update, in_axes=(0, 0, 0, None))(*one)
        for g, a in zip(jax.tree.leaves(got), jax.tree.leaves(alone)):
            np.testing.assert_allclose(np.asarray(g[j]), np.asarray(a[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_seeds_initial_states_are_one_program_with_the_op_by_op_values():
    """init_over_seeds: jitted, the same bits as jax.vmap(agent.init) run op by op, one seed's
    state per key (the seeds differ), and the program is built once per configuration."""
    from plasticity_zoo import agents
    from plasticity_zoo.agents.sac import SACConfig
    from plasticity_zoo.networks.config import NetworkConfig
    from plasticity_zoo.plasticity.api import StaticPlasticity
    from plasticity_zoo.training import seeds

    sac, cfg, net = agents.get("sac"), SACConfig(), NetworkConfig(width=8, depth=1)
    keys = jax.random.split(jax.random.key(0), 2)
    jitted = seeds.init_over_seeds(sac, keys, 3, 1, cfg, net, StaticPlasticity())
    eager = jax.vmap(lambda k: sac.init(k, 3, 1, cfg, net, StaticPlasticity()))(keys)
    floats = lambda tree: [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]  # noqa: E731
    for x, y in zip(floats(jitted), floats(eager), strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(*x) for x in jax.tree.leaves(jitted.actor_params))  # the seeds differ
    again = seeds._jitted_init(sac, 3, 1, SACConfig(), NetworkConfig(width=8, depth=1), StaticPlasticity())
    assert again is seeds._jitted_init(sac, 3, 1, cfg, net, StaticPlasticity())  # equal configs: one program


def test_program_builders_are_cached_on_hashable_arguments_and_rebuild_otherwise():
    from plasticity_zoo.networks.runtime import cached_per_config

    calls = []

    @cached_per_config
    def build(agent, cfg, n=1):
        calls.append((agent, cfg, n))
        return object()

    assert build("sac", (1, 2)) is build("sac", (1, 2)) and len(calls) == 1
    assert build("sac", (1, 3)) is not build("sac", (1, 2)) and len(calls) == 2
    assert build("sac", (1, 2), n=2) is build("sac", (1, 2), n=2) and len(calls) == 3
    assert build("sac", {"a": 1}) is not build("sac", {"a": 1}) and len(calls) == 5  # a dict: built each time
    build.cache_clear()
    build("sac", (1, 2))
    assert len(calls) == 6
