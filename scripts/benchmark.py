"""Speed benchmark: env steps/s of an off-policy agent's full training step, and compile time.

    python scripts/benchmark.py                       # SAC on HalfCheetah-v5, 1 and 4 vmapped seeds
    python scripts/benchmark.py --env dmc:cheetah-run --seeds 1 2 4 8 --steps 500

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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", default="sac", choices=sorted(agents.AGENTS))
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=1000, help="timed env steps per seed")
    p.add_argument("--width", type=int, default=None, help="hidden width (default: the agent's paper value)")
    args = p.parse_args(argv)
    print(f"agent={args.agent} env={args.env} backend={jax.default_backend()} devices={jax.devices()}")
    print(f"{'seeds':>5} {'env steps/s (all seeds)':>24} {'per seed':>9} {'compile s':>10}")
    rows = []
    for s in args.seeds:
        r = measure(args.agent, args.env, s, args.steps, args.width)
        rows.append(r)
        print(f"{r['seeds']:>5} {r['env_steps_per_s']:>24.1f} {r['per_seed']:>9.1f} {r['compile_s']:>10.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
