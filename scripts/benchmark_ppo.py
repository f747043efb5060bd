"""PPO throughput: env steps/s of the on-policy loop end to end, beside the raw simulator's steps/s.

    python scripts/benchmark_ppo.py                          # HalfCheetah-v5: 1 env, then 8 envs (sync)
    python scripts/benchmark_ppo.py --num-envs 1 8 --backend envpool --iterations 3
    python scripts/benchmark_ppo.py --xla-single-thread    # XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
    python scripts/benchmark_ppo.py --env playground:CheetahRun --num-envs 1 64 256 1024 --num-steps 32
        # the device loop (extra .[mjx]); --loop host: the host loop

``measure_ppo`` times whole PPO iterations of the real loop body (``training.loops.onpolicy.make_fns``:
vector-env step on the host + one jitted call per vector step, then the jitted update of
``update_epochs`` x ``num_minibatches`` gradient steps), after one warm-up iteration that compiles;
logging, evaluation and checkpoints are left out.  The batch is kept at CleanRL's 2048 per seed
(``num_steps = 2048 // num_envs``), so the update cost is the same in every setting.
``measure_simulator`` steps the env alone with random actions: the bare Gymnasium env, the zoo's
wrapped env, and the vector env of the chosen backend.

For ``playground:`` envs the default is the device loop (``training/loops/device.py``): ``measure_device_ppo``
times one jitted chunk of ``--iterations`` whole iterations (env steps, rollout bookkeeping and
updates on the device), after a first chunk of one iteration that compiles; ``measure_device_simulator``
times the env's own batched step (``jit(step)`` over ``num_envs`` envs, random actions, in a scan).
``--num-steps`` fixes the rollout length instead of the 2048-step batch (Playground's PPO unrolls 30
steps of 2048 envs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

if "--xla-single-thread" in sys.argv:  # must be set before JAX starts its CPU client
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    ).strip()

try:
    from plasticity_zoo import agents
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plasticity_zoo import agents
import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.envs import make_env, make_vector_env
from plasticity_zoo.envs.playground import is_playground
from plasticity_zoo.training.config import NetworkConfig, RunConfig
from plasticity_zoo.training.loops.onpolicy import init_state, make_fns


def measure_device_simulator(env_id: str, num_envs: int, steps: int = 256, env_impl: str = "jax") -> dict:
    """A ``playground:`` env's batched step alone: ``steps`` steps of ``num_envs`` envs in one jitted scan."""
    from plasticity_zoo.envs.playground import env_keys, make

    env = make(env_id, impl=env_impl)

    @jax.jit
    def run(state, key):
        def one(state, k):
            a = jax.random.uniform(k, (num_envs, env.act_dim), minval=-1.0, maxval=1.0)
            return env.step(state, a)[0], None

        return jax.lax.scan(one, state, jax.random.split(key, steps))[0]

    state = jax.jit(env.reset)(env_keys(range(num_envs)))  # jitted: its arrays committed, as run's outputs
    t0 = time.perf_counter()
    state = jax.block_until_ready(run(state, jax.random.key(0)))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(run(state, jax.random.key(1)))
    return {f"device_env_x{num_envs}": steps * num_envs / (time.perf_counter() - t0), "compile_s": compile_s}


def measure_device_ppo(
    env_id: str,
    num_envs: int = 1,
    seeds: int = 1,
    iterations: int = 2,
    batch: int = 2048,
    num_steps: int | None = None,
    width: int | None = None,
    trust_region: str = "clip",
    env_impl: str = "jax",
) -> dict:
    """Env steps/s (all seeds) of the device loop: one jitted chunk of ``iterations`` PPO iterations."""
    from plasticity_zoo.training.loops.device import DeviceOnPolicyIteration

    ppo = agents.get("ppo")
    if num_steps is None and batch % num_envs:
        raise ValueError(f"batch {batch} must be divisible by num_envs {num_envs}")
    T = num_steps or batch // num_envs
    acfg = dataclasses.replace(ppo.PPOConfig(), num_steps=T, trust_region=trust_region)
    cfg = RunConfig(
        env=env_id,
        seeds=seeds,
        num_envs=num_envs,
        total_steps=T * num_envs * (iterations + 1),
        agent_name="ppo",
        agent=acfg,
        network=NetworkConfig(width=width),
        env_impl=env_impl,
    )
    it = DeviceOnPolicyIteration(cfg, ppo, iterations + 1)
    it.fresh()
    t0 = time.perf_counter()
    it.carry, report = it.chunk_fn(it.carry, jnp.int32(1))  # compiles
    jax.block_until_ready(report)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    it.carry, report = it.chunk_fn(it.carry, jnp.int32(iterations))
    jax.block_until_ready(report)
    seconds = time.perf_counter() - t0
    if not bool(report.finite):
        raise RuntimeError("a loss became non-finite during the benchmark")
    steps = iterations * T * num_envs * seeds
    return {
        "num_envs": num_envs,
        "seeds": seeds,
        "num_steps": T,
        "loop": "device",
        "env_steps_per_s": steps / seconds,
        "first_iteration_s": compile_s,
    }


def measure_simulator(
    env_id: str = "HalfCheetah-v5", num_envs: int = 1, steps: int = 2000, backend: str = "sync"
) -> dict:
    """Raw env steps/s with random actions (no agent): bare Gymnasium, zoo-wrapped, vector env."""
    import gymnasium as gym

    out = {}
    rng = np.random.default_rng(0)
    if not env_id.startswith(("dmc:", "ns:")):
        env = gym.make(env_id)
        env.reset(seed=0)
        acts = rng.uniform(-1, 1, (steps, *env.action_space.shape)).astype(np.float32)
        t0 = time.perf_counter()
        for a in acts:
            if any(env.step(a)[2:4]):
                env.reset()
        out["gymnasium_env"] = steps / (time.perf_counter() - t0)
    env = make_env(env_id, 0)
    env.reset(seed=0)
    acts = rng.uniform(-1, 1, (steps, *env.action_space.shape)).astype(np.float32)
    t0 = time.perf_counter()
    for a in acts:
        if any(env.step(a)[2:4]):
            env.reset()
    out["zoo_env"] = steps / (time.perf_counter() - t0)
    vec = make_vector_env(env_id, num_envs, 0, backend=backend)
    vec.reset()
    n = max(steps // num_envs, 10)
    acts = rng.uniform(-1, 1, (n, num_envs, vec.act_dim)).astype(np.float32)
    t0 = time.perf_counter()
    for a in acts:
        vec.step(a)
    out[f"vector_env_{backend}_x{num_envs}"] = n * num_envs / (time.perf_counter() - t0)
    vec.close()
    return out


def measure_ppo(
    env_id: str = "HalfCheetah-v5",
    num_envs: int = 1,
    seeds: int = 1,
    iterations: int = 2,
    backend: str = "sync",
    batch: int = 2048,
    width: int | None = None,
    trust_region: str = "clip",
    num_steps: int | None = None,
) -> dict:
    """Env steps/s (all seeds) of whole PPO iterations of the host loop, and the split between rollout and update."""
    ppo = agents.get("ppo")
    if num_steps is None and batch % num_envs:
        raise ValueError(f"batch {batch} must be divisible by num_envs {num_envs}")
    T = num_steps or batch // num_envs
    batch = T * num_envs
    acfg = dataclasses.replace(ppo.PPOConfig(), num_steps=T, backend=backend, trust_region=trust_region)
    cfg = RunConfig(
        env=env_id,
        seeds=seeds,
        num_envs=num_envs,
        total_steps=batch * (iterations + 1),
        agent_name="ppo",
        agent=acfg,
        network=NetworkConfig(width=width),
    )
    S, E = seeds, num_envs
    env = make_vector_env(env_id, S * E, 0, backend=backend)
    state, loop, key = init_state(ppo, cfg, env.obs_dim, env.act_dim)
    state = state.replace(num_iterations=jnp.full((S,), iterations + 1, jnp.int32))
    start, step_fn, iterate, _, _ = make_fns(ppo, T)
    shaped = lambda x: np.asarray(x).reshape(S, E, *np.shape(x)[1:])  # noqa: E731
    state, loop, action = start(state, loop, shaped(env.reset()), key)

    def iteration(state, loop, action, key):
        t0 = time.perf_counter()
        key, k_roll = jax.random.split(key)
        ff, fm = step_fn.flatten(state, loop)
        for t in range(T):
            new_obs, r, term, trunc, next_obs = env.step(np.asarray(action).reshape(S * E, -1))
            fm, action = step_fn(
                ff, fm, np.int32(t), shaped(r), shaped(term), shaped(trunc), shaped(next_obs), shaped(new_obs), k_roll
            )
            env.pop_finished()
        state, loop = step_fn.unflatten(fm)
        jax.block_until_ready(action)
        t1 = time.perf_counter()
        key, k = jax.random.split(key)
        state, loop, action, metrics, finite = iterate(state, loop, k)
        bool(finite)
        return state, loop, action, key, t1 - t0, time.perf_counter() - t1

    t0 = time.perf_counter()
    state, loop, action, key, _, _ = iteration(state, loop, action, key)  # compiles
    compile_s = time.perf_counter() - t0
    rollout = update = 0.0
    for _ in range(iterations):
        state, loop, action, key, r_s, u_s = iteration(state, loop, action, key)
        rollout += r_s
        update += u_s
    env.close()
    steps = iterations * batch * S
    return {
        "num_envs": E,
        "seeds": S,
        "num_steps": T,
        "loop": "host",
        "backend": backend,
        "env_steps_per_s": steps / (rollout + update),
        "rollout_steps_per_s": steps / rollout,
        "update_s_per_iteration": update / iterations,
        "first_iteration_s": compile_s,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--num-envs", type=int, nargs="+", default=[1, 8], help="envs per seed (1 = CleanRL)")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--backend", default="sync", choices=["sync", "async", "envpool"])
    p.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "host", "device"],
        help="auto: the device loop for playground: envs, the host loop otherwise",
    )
    p.add_argument(
        "--num-steps",
        type=int,
        default=None,
        help="rollout length per env (default: 2048 // num_envs, CleanRL's batch)",
    )
    p.add_argument("--env-impl", default="jax", choices=["jax", "warp"])
    p.add_argument("--iterations", type=int, default=2, help="timed PPO iterations (2048 steps per seed each)")
    p.add_argument("--trust-region", default="clip", choices=["clip", "gtr"])
    p.add_argument(
        "--xla-single-thread",
        action="store_true",
        help="single-threaded XLA CPU kernels (faster per-step calls at these network sizes)",
    )
    args = p.parse_args(argv)
    device = args.loop == "device" or (args.loop == "auto" and is_playground(args.env))
    if device and not is_playground(args.env):
        p.error("--loop device needs a playground: env")
    print(
        f"env={args.env} loop={'device' if device else 'host'} backend={args.backend} jax={jax.default_backend()} "
        f"xla_single_thread={args.xla_single_thread} (a shared machine: numbers are "
        f"indicative; CleanRL PPO on CPU runs ~650-700 steps/s)"
    )
    if is_playground(args.env):
        for e in args.num_envs:
            sim = measure_device_simulator(args.env, e, env_impl=args.env_impl)
            print(
                f"  raw simulator (jitted scan, compile {sim.pop('compile_s'):.1f} s) "
                + ", ".join(f"{k}: {v:.0f} steps/s" for k, v in sim.items())
            )
    else:
        sim = measure_simulator(args.env, max(args.num_envs), backend=args.backend)
        for k, v in sim.items():
            print(f"  raw simulator {k:>26}: {v:9.0f} steps/s")
    print(
        f"{'envs':>5} {'seeds':>5} {'steps':>5} {'PPO env steps/s':>16} {'rollout steps/s':>16} {'update s/iter':>14} "
        f"{'1st iter s':>10}"
    )
    rows = []
    for e in args.num_envs:
        if device:
            r = measure_device_ppo(
                args.env,
                e,
                args.seeds,
                args.iterations,
                num_steps=args.num_steps,
                trust_region=args.trust_region,
                env_impl=args.env_impl,
            )
        else:
            r = measure_ppo(
                args.env,
                e,
                args.seeds,
                args.iterations,
                args.backend,
                trust_region=args.trust_region,
                num_steps=args.num_steps,
            )
        rows.append(r)
        print(
            f"{e:>5} {args.seeds:>5} {r['num_steps']:>5} {r['env_steps_per_s']:>16.0f} "
            f"{r.get('rollout_steps_per_s', float('nan')):>16.0f} "
            f"{r.get('update_s_per_iteration', float('nan')):>14.2f} {r['first_iteration_s']:>10.1f}"
        )
    return {"simulator": sim, "ppo": rows}


if __name__ == "__main__":
    main()
