from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.networks import GaussianPolicyHead, MLPHead, TrunkSpec, build, instrument


@pytest.mark.parametrize("block", ["mlp", "simba", "multiskip"])
def test_blocks_shapes_and_taps(block):
    spec = TrunkSpec(width=8, depth=3, block=block, layer_norm=True)
    net, params = build("critic", lambda r: MLPHead(5, 1, spec, rngs=r), jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 5))
    y, taps = net.apply(params, x)
    assert y.shape == (4,)
    assert list(taps) == ["layer0", "layer1", "layer2", "features"]
    width = 32 if block == "simba" else 8
    assert all(taps[f"layer{i}"].shape == (4, width) for i in range(3))
    assert taps["features"].shape == (4, 8)  # the trunk output the head reads


def test_mlp_taps_equal_a_manual_forward_pass():
    spec = TrunkSpec(width=6, depth=2, activation="relu")
    net, p = build("critic", lambda r: MLPHead(3, 1, spec, rngs=r), jax.random.key(0))
    x = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    W = [np.asarray(p["trunk"]["layers"][i]["kernel"]) for i in range(2)]
    b = [np.asarray(p["trunk"]["layers"][i]["bias"]) for i in range(2)]
    h0 = np.maximum(x @ W[0] + b[0], 0)
    h1 = np.maximum(h0 @ W[1] + b[1], 0)
    y = h1 @ np.asarray(p["out"]["kernel"]) + np.asarray(p["out"]["bias"])
    out, taps = net.apply(p, jnp.asarray(x))
    np.testing.assert_allclose(taps["layer0"], h0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(taps["layer1"], h1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, y[:, 0], rtol=1e-5, atol=1e-6)


def test_activation_gradients_match_a_hand_derived_gradient():
    """For loss = sum(y^2), dL/dh1 = 2 y w_out^T; dL/dh0 = (dL/dh1 * relu'(z1)) W1^T."""
    spec = TrunkSpec(width=6, depth=2)
    net, p = build("critic", lambda r: MLPHead(3, 1, spec, rngs=r), jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (5, 3))

    def loss():
        return jnp.sum(net(p, x) ** 2)

    acts, grads = jax.jit(lambda: instrument.activation_grads(loss, ["critic"]))()
    y, taps = net.apply(p, x)
    w_out = np.asarray(p["out"]["kernel"])[:, 0]
    g1 = 2 * np.asarray(y)[:, None] * w_out[None]
    z1 = np.asarray(taps["layer0"]) @ np.asarray(p["trunk"]["layers"][1]["kernel"]) + np.asarray(
        p["trunk"]["layers"][1]["bias"]
    )
    g0 = (g1 * (z1 > 0)) @ np.asarray(p["trunk"]["layers"][1]["kernel"]).T
    np.testing.assert_allclose(grads["critic"]["layer1"], g1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["critic"]["layer0"], g0, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(acts["critic"]["layer1"], taps["layer1"], rtol=1e-6)


def test_ensemble_members_differ_and_instrumentation_has_member_axis():
    spec = TrunkSpec(width=8, depth=2)
    net, p = build("critic", lambda r: MLPHead(4, 1, spec, rngs=r), jax.random.key(0), ensemble=5)
    x = jnp.ones((3, 4))
    q = net(p, x)
    assert q.shape == (5, 3)
    assert len(np.unique(np.asarray(q[:, 0]).round(6))) == 5
    acts = instrument.activations(lambda: net(p, x), ["critic"])
    assert acts["critic"]["layer0"].shape == (5, 3, 8)
    # member i of the ensemble equals a single network built from member i's params
    single, _ = build("c", lambda r: MLPHead(4, 1, spec, rngs=r), jax.random.key(9))
    np.testing.assert_allclose(single(jax.tree.map(lambda a: a[2], p), x), q[2], rtol=1e-6)


def test_only_the_first_call_is_recorded():
    spec = TrunkSpec(width=4, depth=1)
    net, p = build("critic", lambda r: MLPHead(2, 1, spec, rngs=r), jax.random.key(0))
    a, b = jnp.zeros((1, 2)), jnp.ones((1, 2))
    acts = instrument.activations(lambda: (net(p, a), net(p, b)), ["critic"])
    np.testing.assert_allclose(acts["critic"]["layer0"], net.apply(p, a)[1]["layer0"])
    with pytest.raises(ValueError, match="not called"):
        instrument.activations(lambda: net(p, a), ["actor"])


def test_policy_log_std_is_clipped_and_bad_specs_are_refused():
    spec = TrunkSpec(width=4, depth=1)
    net, p = build(
        "actor", lambda r: GaussianPolicyHead(2, 3, spec, rngs=r, log_std_min=-1, log_std_max=0.5), jax.random.key(0)
    )
    p = jax.tree.map(lambda x: x * 1000.0, p)
    (_, log_std), _ = net.apply(p, jnp.ones((2, 2)))
    assert float(log_std.min()) >= -1 and float(log_std.max()) <= 0.5
    with pytest.raises(ValueError, match="block"):
        TrunkSpec(block="transformer")
    with pytest.raises(ValueError, match="activation"):
        TrunkSpec(activation="swishy")


def test_edac_output_init_range():
    spec = TrunkSpec(width=8, depth=1, hidden_bias_init=0.1)
    _, p = build("critic", lambda r: MLPHead(3, 1, spec, rngs=r, out_init_scale=3e-3), jax.random.key(0))
    k = np.asarray(p["out"]["kernel"])
    assert np.all(np.abs(k) <= 3e-3) and k.std() > 1e-4
    np.testing.assert_allclose(p["trunk"]["layers"][0]["bias"], 0.1)


def test_threefry_unrolled_on_request_gives_the_same_bits_as_jaxs_rolled_loop(tmp_path):
    """The zoo keeps JAX's rolled Threefry loop on CPU by default; ``RLZOO_UNROLLED_THREEFRY=1`` registers
    the unrolled lowering (checked in a process of its own), which computes the same bits."""
    import os
    import subprocess
    import sys

    from jax._src.random import threefry2x32 as threefry

    from plasticity_zoo.networks import runtime

    assert not runtime.THREEFRY_UNROLLED  # the default
    rng = np.random.default_rng(0)
    k1, k2 = (jnp.asarray(rng.integers(0, 2**32, (), dtype=np.uint32)) for _ in range(2))
    x1, x2 = (jnp.asarray(rng.integers(0, 2**32, 4096, dtype=np.uint32)) for _ in range(2))
    unrolled = jax.jit(lambda *a: threefry._threefry2x32_lowering(*a, use_rolled_loops=False))
    rolled = jax.jit(lambda *a: threefry._threefry2x32_lowering(*a, use_rolled_loops=True))
    assert "while" not in unrolled.lower(k1, k2, x1, x2).as_text()
    assert "while" in rolled.lower(k1, k2, x1, x2).as_text()
    for a, b in zip(unrolled(k1, k2, x1, x2), rolled(k1, k2, x1, x2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check = (
        "import jax, numpy as np; from plasticity_zoo.networks import runtime; assert runtime.THREEFRY_UNROLLED; "
        "draw = jax.jit(lambda key: jax.random.normal(key, (256, 16))); "
        "assert 'while' not in draw.lower(jax.random.key(0)).compile().as_text(); "
        f"np.save({str(tmp_path / 'draws.npy')!r}, np.asarray(draw(jax.random.key(3))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", check],
        env={**os.environ, "RLZOO_UNROLLED_THREEFRY": "1"},
        capture_output=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    draws = np.load(tmp_path / "draws.npy")
    np.testing.assert_array_equal(draws, np.asarray(jax.random.normal(jax.random.key(3), (256, 16))))


def test_dots_only_library_fusion_keeps_reductions_out_of_ynnpack_on_cpu():
    """The offline epoch programs' compiler options: on CPU with a jaxlib that knows the option, a
    reduction over a leading axis is no longer a YNNPACK fusion (a dot still is) and gives the same sums."""
    from plasticity_zoo.networks.runtime import DOTS_ONLY_LIBRARY_FUSION, dots_only_library_fusion

    x = np.random.default_rng(0).normal(size=(2048, 256)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(256, 64)).astype(np.float32)
    options = dots_only_library_fusion()
    if jax.default_backend() != "cpu":
        assert options is None
        return
    if options is None:  # this jaxlib refuses the option: the fallback must be because of that
        with pytest.raises(Exception):
            jax.jit(lambda a: a.sum(0), compiler_options=DOTS_ONLY_LIBRARY_FUSION).lower(x).compile()
        return

    def hlo(fn, *args, opts=None):
        return jax.jit(fn, compiler_options=opts).lower(*args).compile().as_text()

    def ynn_fusions(text):
        return [line for line in text.splitlines() if "__ynn_fusion" in line and " fusion(" in line]

    reduce_sum = lambda a: a.sum(0)  # noqa: E731
    assert not ynn_fusions(hlo(reduce_sum, x, opts=options))
    assert ynn_fusions(hlo(lambda a, b: a @ b, x, w, opts=options))  # dots still go to the library
    np.testing.assert_allclose(
        np.asarray(jax.jit(reduce_sum, compiler_options=options)(x)), x.sum(0, dtype=np.float64), rtol=1e-4, atol=1e-3
    )


@pytest.mark.slow
def test_fan_in_uniform_redraws_linear_layers_only():
    from plasticity_zoo.networks import fan_in_uniform_init
    from plasticity_zoo.networks.core import path_names

    spec = TrunkSpec(width=64, depth=2, layer_norm=True)
    make = lambda r: MLPHead(40, 3, spec, rngs=r)  # noqa: E731
    net, before = build("q", make, jax.random.key(0), ensemble=2)
    after = fan_in_uniform_init(before, jax.random.key(1))
    again = fan_in_uniform_init(before, jax.random.key(1))
    seen = set()
    for (path, x), (_, y), (_, z) in zip(*(jax.tree_util.tree_flatten_with_path(t)[0] for t in (before, after, again))):
        names, x, y = path_names(path), np.asarray(x), np.asarray(y)
        np.testing.assert_array_equal(y, np.asarray(z))  # same key, same draw
        if "norms" in names:  # LayerNorm scale 1 and bias 0 untouched
            np.testing.assert_array_equal(x, y)
            continue
        fan_in = {("trunk", "layers", 0): 40, ("trunk", "layers", 1): 64, ("out",): 64}[names[:-1]]
        bound = 1 / np.sqrt(fan_in)
        assert np.all(np.abs(y) <= bound) and not np.array_equal(x, y)
        if y.size > 1000:  # U(-b, b): std b / sqrt(3), mean 0
            assert abs(y.std() - bound / np.sqrt(3)) < 0.05 * bound and abs(y.mean()) < 0.02 * bound
        assert not np.array_equal(y[0], y[1])  # members differ
        seen.add(names)
    assert len(seen) == 6  # 3 Linear layers x (kernel, bias)


def _lapack_calls(lowered_text: str) -> list[str]:
    import re

    return re.findall(r"custom_call @(lapack_\w+).*?num_batch_dims = \"(\d+)\"", lowered_text)


def test_lapack_calls_run_one_matrix_each_under_vmap_with_the_batched_values():
    """jaxlib 0.10's batched CPU LAPACK kernels deadlock when XLA runs as many of them at once as its
    thread pool has threads (networks/runtime.py: one_call_per_matrix; PPO's init over 2 seeds hung
    the suite on 2 cores).  The orthogonal initializer (PPO, SimBa), vmapped over seeds, lowers to
    unbatched LAPACK calls only, with the values of the batched ones (the metrics' singular values:
    tests/test_plasticity_metrics.py)."""
    from flax import nnx

    from plasticity_zoo import agents
    from plasticity_zoo.networks import orthogonal
    from plasticity_zoo.networks.config import NetworkConfig

    keys = jax.random.split(jax.random.key(3), 2)
    ppo = agents.get("ppo")
    programs = {
        "ppo init": jax.jit(jax.vmap(lambda k: ppo.init(k, 5, 2, ppo.PPOConfig(), NetworkConfig(width=16)))),
        "simba trunk": jax.jit(
            jax.vmap(lambda k: build("q", lambda r: MLPHead(5, 1, TrunkSpec(16, 1, block="simba"), rngs=r), k)[1])
        ),
    }
    for name, fn in programs.items():
        calls = _lapack_calls(fn.lower(keys).as_text())
        assert calls and all(batch == "0" for _, batch in calls), (name, calls)
    # flax's own initializer lowers to one batched call (so the check above can fail) ...
    plain = jax.jit(jax.vmap(lambda k: nnx.initializers.orthogonal(2.0)(k, (5, 64))))
    assert {batch for _, batch in _lapack_calls(plain.lower(keys).as_text())} == {"1"}
    # ... with the same numbers as ours, batched or not
    ours = jax.jit(jax.vmap(lambda k: orthogonal(2.0)(k, (5, 64))))(keys)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain(keys)))
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(orthogonal(2.0)(keys[1], (5, 64))))


def test_the_on_policy_host_loop_lowers_its_draws_unrolled(monkeypatch):
    """``runtime.threefry_unrolled()`` puts the unrolled Threefry rule in place for the programs lowered inside
    it and JAX's own back after; the on-policy host loop's step and update are lowered inside it (by
    default; ``RLZOO_UNROLLED_THREEFRY=0``, the suite's setting, keeps the rolled loop)."""
    import dataclasses

    from plasticity_zoo import agents
    from plasticity_zoo.networks import runtime
    from plasticity_zoo.training.config import NetworkConfig, RunConfig
    from plasticity_zoo.training.loops import onpolicy

    prim, unrolled = runtime._unrolled_threefry_rule()
    lowered = []

    def counting(*args, **kwargs):
        lowered.append(1)
        return unrolled(*args, **kwargs)

    monkeypatch.setattr(runtime, "_unrolled_threefry_rule", lambda warn=True: (prim, counting))
    draw = lambda n: jax.jit(lambda k: jax.random.normal(k, (n,)))  # noqa: E731
    monkeypatch.setenv("RLZOO_UNROLLED_THREEFRY", "0")
    with runtime.threefry_unrolled():
        draw(3)(jax.random.key(0))
    assert not lowered  # 0: the rolled loop everywhere
    monkeypatch.delenv("RLZOO_UNROLLED_THREEFRY")
    with runtime.threefry_unrolled():
        a = draw(4)(jax.random.key(0))
    assert lowered and "while" in draw(5).lower(jax.random.key(0)).compile().as_text()  # JAX's rule after
    np.testing.assert_array_equal(a, draw(4)(jax.random.key(0)))  # the same bits as the rolled loop

    ppo = agents.get("ppo")
    T = 13  # a rollout length no other test compiles
    acfg = dataclasses.replace(ppo.PPOConfig(), num_steps=T, num_minibatches=1, update_epochs=1)
    cfg = RunConfig(env="Pendulum-v1", agent_name="ppo", agent=acfg, network=NetworkConfig(width=4, depth=1))
    state, loop, key = onpolicy.init_state(ppo, cfg, 3, 1)
    start, step, iterate = onpolicy.make_fns(ppo, T)[:3]
    state, loop, action = start(state, loop, np.zeros((1, 1, 3), np.float32), key)
    ff, fm = step.flatten(state, loop)
    lowered.clear()
    z = np.zeros((1, 1), np.float32)
    fm, action = step(
        ff, fm, np.int32(0), z, z > 0, z > 0, np.zeros((1, 1, 3), np.float32), np.zeros((1, 1, 3), np.float32), key
    )
    assert lowered  # the step
    state, loop = step.unflatten(fm)
    lowered.clear()
    iterate(state, loop, key)
    assert lowered  # the update
