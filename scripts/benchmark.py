"""Speed benchmark: env steps/s of an off-policy agent's full training step, and compile time.

    python scripts/benchmark.py                       # SAC on HalfCheetah-v5, 1 and 4 vmapped seeds
    python scripts/benchmark.py --env dmc:cheetah-run --seeds 1 2 4 8 --steps 500
    python scripts/benchmark.py --agent mrq --steps 250 --warmup 1   # MR.Q: time whole 250-step sync periods

MR.Q's encoder burst runs once every 250 steps, so its timed window must span a multiple of 250
steps, or the rate (and the share of peak, which counts the burst amortised) is overstated.

Each measurement times the real loop body (env step on the host, transfer, one jitted call
that stores the transition, does the gradient step(s) and picks the next action) after the
buffer holds enough data, with paper-default network sizes unless --width is given.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    import agents
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import agents
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from envs import VectorEnv
from training import replay
from training.config import NetworkConfig, RunConfig
from training.offpolicy import init_state, make_step_fn


def measure(agent_name: str, env_id: str, seeds: int, steps: int, width: int | None, warmup: int = 300):
    agent = agents.get(agent_name)
    acfg = dataclasses.replace(agent.CONFIG(), buffer_size=max(10 * (steps + warmup), 10_000), learning_starts=0)
    cfg = RunConfig(env=env_id, seeds=seeds, agent_name=agent_name, agent=acfg, network=NetworkConfig(width=width))
    env = VectorEnv(env_id, seeds, 0)
    state, buffer, key = init_state(agent, cfg, env.obs_dim, env.act_dim)
    step_fn = make_step_fn(agent, acfg, acfg.updates_per_step, env.act_dim)
    obs = env.reset()
    action = np.zeros((seeds, 1, env.act_dim), np.float32)

    def one(state, buffer, obs, action, key, random_actions=False):
        new_obs, r, term, trunc, next_obs = env.step(np.asarray(action).reshape(seeds, -1))
        tr = replay.Transition(obs, np.asarray(action).reshape(seeds, -1), r, next_obs, term, trunc)
        key, k = jax.random.split(key)
        state, buffer, action, _, finite = step_fn(state, buffer, tr, new_obs.reshape(seeds, 1, -1), k,
                                                   random_actions=random_actions, train=not random_actions)
        bool(finite)
        return state, buffer, new_obs, action, key

    for _ in range(acfg.batch_size):  # fill a batch worth of random data (compiles the collect-only variant)
        state, buffer, obs, action, key = one(state, buffer, obs, action, key, random_actions=True)
    t0 = time.perf_counter()
    state, buffer, obs, action, key = one(state, buffer, obs, action, key)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, buffer, obs, action, key = one(state, buffer, obs, action, key)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, buffer, obs, action, key = one(state, buffer, obs, action, key)
    jax.block_until_ready(state)
    dt = time.perf_counter() - t0
    return {"seeds": seeds, "env_steps_per_s": steps * seeds / dt, "per_seed": steps / dt, "compile_s": compile_s}


def matmul_peak(n: int = 2048, repeat: int = 20) -> float:
    """The machine's measured float32 matmul throughput (FLOP/s) on the default JAX device."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            out = f(a)
        jax.block_until_ready(out)
        best = max(best, 2 * n**3 * repeat / (time.perf_counter() - t0))
    return best


def flops_per_env_step(agent_name: str, env_id: str, width: int | None) -> float:
    """XLA's FLOP count of one env step's training work for one seed: the agent's
    ``work_per_env_step`` (MR.Q: value/policy update + one amortised encoder step) or one
    ``update`` x ``updates_per_step``, plus the exploration forward pass."""
    agent = agents.get(agent_name)
    acfg = dataclasses.replace(agent.CONFIG(), buffer_size=10_000, learning_starts=0)
    cfg = RunConfig(env=env_id, agent_name=agent_name, agent=acfg, network=NetworkConfig(width=width))
    env = VectorEnv(env_id, 1, 0)
    state, buffer, key = init_state(agent, cfg, env.obs_dim, env.act_dim)
    state, buffer = jax.tree.map(lambda x: x[0], (state, buffer))
    rng = np.random.default_rng(0)
    n = 600
    tr = replay.Transition(rng.normal(size=(n, env.obs_dim)).astype(np.float32),
                           rng.uniform(-1, 1, (n, env.act_dim)).astype(np.float32), rng.normal(size=n).astype(np.float32),
                           rng.normal(size=(n, env.obs_dim)).astype(np.float32), np.zeros(n, bool), np.zeros(n, bool))
    buffer = _fill(agent, buffer, tr)
    batch = getattr(agent, "sample_batch", replay.sample)(buffer, key, acfg.batch_size)
    work = getattr(agent, "work_per_env_step", None)
    if work is None:
        work = lambda s, b, k: agent.update(s, b, k)[0]  # noqa: E731
        repeats = acfg.updates_per_step
    else:
        repeats = 1
    cost = jax.jit(work).lower(state, batch, key).compile().cost_analysis()
    act = jax.jit(lambda s, o, k: agent.act(s, o, k, explore=True)).lower(
        state, jnp.zeros((1, env.obs_dim)), key).compile().cost_analysis()
    return repeats * float(cost["flops"]) + float(act["flops"])


def _fill(agent, buffer, tr):
    """Add transitions one env step at a time (the agent's own buffer may track per-env streams)."""
    add = jax.jit(getattr(agent, "buffer_add", replay.add))
    for i in range(tr.reward.shape[0]):
        buffer = add(buffer, jax.tree.map(lambda x: jnp.asarray(x[i:i + 1]), tr))
    return buffer


def plasticity_overhead(agent_name: str, env_id: str, width: int | None, updates: int = 200):
    """Cost of plasticity metrics, resets and SIGReg as a fraction of update time at default periods."""
    from plasticity.hooks import Hooks, sigreg_spec
    from training.config import PlasticityConfig

    agent = agents.get(agent_name)
    acfg = dataclasses.replace(agent.CONFIG(), buffer_size=10_000, learning_starts=0)
    env = VectorEnv(env_id, 1, 0)
    rng = np.random.default_rng(0)

    def timed(fn, *args, repeat=3):
        jax.block_until_ready(fn(*args))  # compile
        t0 = time.perf_counter()
        for _ in range(repeat):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / repeat

    def setup(pcfg):
        cfg = RunConfig(env=env_id, agent_name=agent_name, agent=acfg, network=NetworkConfig(width=width),
                        plasticity=pcfg)
        state, buffer, key = init_state(agent, cfg, env.obs_dim, env.act_dim)
        n = 2000
        tr = replay.Transition(rng.normal(size=(1, n, env.obs_dim)), rng.uniform(-1, 1, (1, n, env.act_dim)),
                               rng.normal(size=(1, n)), rng.normal(size=(1, n, env.obs_dim)),
                               np.zeros((1, n), bool), np.zeros((1, n), bool))
        buffer = jax.vmap(replay.add)(buffer, jax.tree.map(jnp.asarray, tr))
        return cfg, state, buffer, key

    from training.offpolicy import make_train_block
    from plasticity import sigreg as sigreg_lib

    results = {}
    for label, pcfg in (("plain", PlasticityConfig(metrics_every=0)),
                        ("sigreg", PlasticityConfig(metrics_every=0, sigreg_coef=0.2))):
        cfg, state, buffer, key = setup(pcfg)
        block = make_train_block(agent, acfg, updates)
        spec = sigreg_spec(pcfg)

        def run(state, buffer, key, block=block, spec=spec):
            with sigreg_lib.active(spec):
                return jax.vmap(block)(state, buffer, key[None])

        fn = jax.jit(run)
        results[label] = timed(fn, state, buffer, key) / updates
    t_update = results["plain"]
    pcfg = PlasticityConfig(metrics_every=10_000, regrama=True)
    cfg, state, buffer, key = setup(pcfg)
    hooks = Hooks(pcfg, agent, agent_name, getattr(agent, "sample_batch", replay.sample), total_updates=10**6)
    state = hooks.start(state)
    keys = jax.random.split(key, 1)
    batch = hooks._sample(buffer, keys)
    t_metrics = timed(lambda: hooks._metrics(state, batch, hooks.init_params, keys))
    from plasticity.hooks import reset_step
    from functools import partial
    rows = {}
    for method in ("redo", "regrama"):
        rc = dataclasses.replace(pcfg, regrama=method == "regrama", redo=method == "redo")
        fn = jax.jit(jax.vmap(partial(reset_step, agent, rc, getattr(agent, "sample_batch", replay.sample))))
        rows[method] = timed(fn, state, buffer, keys)
    print(f"per update: {t_update * 1e3:.2f} ms (plain), {results['sigreg'] * 1e3:.2f} ms (SIGReg)")
    print(f"SIGReg overhead: {100 * (results['sigreg'] / t_update - 1):.1f}% of update time")
    print(f"metrics event: {t_metrics * 1e3:.1f} ms = {100 * t_metrics / (10_000 * t_update):.2f}% at every 10,000 updates")
    for method, t in rows.items():
        print(f"{method} event: {t * 1e3:.1f} ms = {100 * t / (1_000 * t_update):.2f}% at every 1,000 updates")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", default="sac", choices=sorted(agents.AGENTS))
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=1000, help="timed env steps per seed")
    p.add_argument("--width", type=int, default=None, help="hidden width (default: the agent's paper value)")
    p.add_argument("--warmup", type=int, default=300, help="untimed training steps after compilation")
    p.add_argument("--plasticity", action="store_true",
                   help="instead: overhead of plasticity metrics, ReDo/ReGraMa resets and SIGReg vs update time")
    args = p.parse_args(argv)
    if args.plasticity:
        return plasticity_overhead(args.agent, args.env, args.width)
    print(f"agent={args.agent} env={args.env} backend={jax.default_backend()} devices={jax.devices()}")
    flops = flops_per_env_step(args.agent, args.env, args.width)
    peak = matmul_peak()
    print(f"model FLOPs per env step (one seed, XLA count): {flops / 1e9:.3f} GFLOP; "
          f"measured float32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"{'seeds':>5} {'env steps/s (all seeds)':>24} {'per seed':>9} {'compile s':>10} {'GFLOP/s':>8} {'of peak':>8}")
    rows = []
    for s in args.seeds:
        r = measure(args.agent, args.env, s, args.steps, args.width, args.warmup)
        r["flops_per_step"], r["achieved_flops"] = flops, flops * r["env_steps_per_s"]
        r["fraction_of_peak"] = r["achieved_flops"] / peak
        rows.append(r)
        print(f"{r['seeds']:>5} {r['env_steps_per_s']:>24.1f} {r['per_seed']:>9.1f} {r['compile_s']:>10.2f} "
              f"{r['achieved_flops'] / 1e9:>8.1f} {100 * r['fraction_of_peak']:>7.1f}%", flush=True)
    return rows


if __name__ == "__main__":
    main()
