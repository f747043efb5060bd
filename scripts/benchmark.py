"""Speed benchmark: env steps/s of an off-policy agent at the settings train.py uses, and compile time.

    python scripts/benchmark.py                       # SAC on HalfCheetah-v5, 1M-row buffer, 1 and 4 vmapped seeds
    python scripts/benchmark.py --buffer-size 10000   # another replay capacity
    python scripts/benchmark.py --env dmc:cheetah-run --seeds 1 2 4 8 --steps 500
    python scripts/benchmark.py --agent mrq --steps 250 --warmup 1   # MR.Q: time whole 250-step sync periods
    python scripts/benchmark.py --plasticity --agent mrq             # cost of plasticity metrics, resets, SIGReg

What is timed is the body of train.py's off-policy loop (training/loops/offpolicy.py): step the envs on
the host, build the transition, call the step function from ``make_step_fn`` (store the
transition, run the gradient step(s), choose the next action) and read its finite flag.  The
replay buffer is the agent's own (``buffer_fns``) with the agent config's ``buffer_size`` (1M
rows for SAC and MR.Q) unless ``--buffer-size`` is given: a small buffer hides costs that grow
with capacity (issue #18: a copy of the whole buffer every env step; MR.Q's LAP sampling was
O(capacity) per update before it kept sum trees).  Networks have the paper's sizes unless ``--width`` is given.

Before the timed window the buffer gets ``batch_size`` uniform-random steps (train.py takes
``learning_starts``; the per-step cost does not depend on how full the buffer is: uniform
sampling gathers rows, LAP descends its sum trees), then ``--warmup`` training
steps.  Compile time (the wall time of the first collect-only and the first training step, which
compile the jitted calls) is reported apart and is not in the timed window.

The share of peak is XLA's FLOP count of one env step's training work times env steps/s,
over the float32 matmul throughput of this machine's default JAX device, measured once per
process (``matmul_peak``) and printed.  MR.Q's encoder burst runs once every 250 steps, so
its timed window must span a multiple of 250 steps, or the rate (and the share of peak, which
counts the burst amortised) is overstated.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

try:
    from plasticity_zoo import agents
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plasticity_zoo import agents

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.buffers import replay
from plasticity_zoo.envs import make_vector_env
from plasticity_zoo.networks.config import NetworkConfig
from plasticity_zoo.plasticity.config import PlasticityConfig
from plasticity_zoo.training.config import RunConfig
from plasticity_zoo.training.loops.offpolicy import buffer_fns, init_state, make_step_fn, make_train_block
from plasticity_zoo.training.seeds import over_seeds

PEAK_N, PEAK_REPEAT = 2048, 20


def setup(
    agent_name: str,
    env_id: str,
    seeds: int,
    width: int | None,
    buffer_size: int | None,
    plasticity: PlasticityConfig | None = None,
):
    """The agent, its config (``buffer_size``: None keeps the agent's default), the run config and a vector env."""
    agent = agents.get(agent_name)
    acfg = agent.CONFIG()
    if buffer_size is not None:
        acfg = dataclasses.replace(acfg, buffer_size=buffer_size)
    cfg = RunConfig(
        env=env_id,
        seeds=seeds,
        agent_name=agent_name,
        agent=acfg,
        network=NetworkConfig(width=width),
        plasticity=plasticity or PlasticityConfig(),
    )
    return agent, acfg, cfg, make_vector_env(env_id, seeds, cfg.seed * 10_000, cfg.action_repeat)


def measure(
    agent_name: str,
    env_id: str,
    seeds: int,
    steps: int,
    width: int | None,
    warmup: int = 300,
    buffer_size: int | None = None,
) -> dict:
    """Env steps/s of train.py's loop body (one env per seed), after compilation and ``warmup`` steps."""
    agent, acfg, cfg, env = setup(agent_name, env_id, seeds, width, buffer_size)
    S, E, act_dim = seeds, 1, env.act_dim
    state, buffer, key = init_state(agent, cfg, env.obs_dim, act_dim)
    step_fn = make_step_fn(agent, acfg, acfg.updates_per_step * E, act_dim)
    obs = env.reset()
    key, k0 = jax.random.split(key)
    action = jax.random.uniform(k0, (S, E, act_dim), minval=-1.0, maxval=1.0)

    def one(state, buffer, obs, action, key, learning=True):  # as in training.loops.offpolicy.train
        new_obs, reward, terminated, truncated, next_obs = env.step(np.asarray(action).reshape(S * E, act_dim))
        tr = replay.Transition(obs, np.asarray(action).reshape(S * E, act_dim), reward, next_obs, terminated, truncated)
        key, k = jax.random.split(key)
        state, buffer, action, _, finite = step_fn(
            state, buffer, tr, new_obs.reshape(S, E, -1), k, random_actions=not learning, train=learning
        )
        if learning and not bool(finite):
            raise FloatingPointError("non-finite training metrics")
        env.pop_finished()
        return state, buffer, new_obs, action, key

    t0 = time.perf_counter()  # first random step: compiles store and the collect-only variant
    state, buffer, obs, action, key = one(state, buffer, obs, action, key, learning=False)
    compile_s = time.perf_counter() - t0
    for _ in range(acfg.batch_size - 1):  # a batch worth of uniform-random data
        state, buffer, obs, action, key = one(state, buffer, obs, action, key, learning=False)
    t0 = time.perf_counter()  # first training step: compiles the training variant
    state, buffer, obs, action, key = one(state, buffer, obs, action, key)
    compile_s += time.perf_counter() - t0
    for _ in range(warmup):
        state, buffer, obs, action, key = one(state, buffer, obs, action, key)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, buffer, obs, action, key = one(state, buffer, obs, action, key)
    jax.block_until_ready((state, buffer, action))
    dt = time.perf_counter() - t0
    return {
        "seeds": seeds,
        "buffer_size": acfg.buffer_size,
        "env_steps_per_s": steps * S * E / dt,
        "per_seed": steps * E / dt,
        "ms_per_step": 1e3 * dt / steps,
        "compile_s": compile_s,
    }


@functools.lru_cache(maxsize=None)
def matmul_peak(n: int = PEAK_N, repeat: int = PEAK_REPEAT) -> float:
    """Measured float32 matmul throughput (FLOP/s) of the default JAX device: an n x n jitted
    ``x @ x``, best of 3 runs of ``repeat`` calls.  Cached: measured once per process."""
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


def random_transitions(rng: np.random.Generator, seeds: int, n: int, obs_dim: int, act_dim: int) -> replay.Transition:
    """``n`` random non-terminal transitions per seed: leaves ``(seeds, n, ...)``."""
    f = lambda *s: rng.normal(size=(seeds, n, *s)).astype(np.float32)  # noqa: E731
    return replay.Transition(
        f(obs_dim),
        rng.uniform(-1, 1, (seeds, n, act_dim)).astype(np.float32),
        f(),
        f(obs_dim),
        np.zeros((seeds, n), bool),
        np.zeros((seeds, n), bool),
    )


def fill(agent, buffer, tr: replay.Transition):
    """Store ``tr`` (leaves ``(seeds, n, ...)``) one env step at a time, as the loop does, with the
    agent's own add (MR.Q's LAP buffer tracks per-env streams): one jitted scan, buffer donated."""
    _, add = buffer_fns(agent)

    def one_seed(buf, tr):
        return jax.lax.scan(lambda b, t: (add(b, jax.tree.map(lambda x: x[None], t)), None), buf, tr)[0]

    return jax.jit(jax.vmap(one_seed), donate_argnums=0)(buffer, jax.tree.map(jnp.asarray, tr))


def flops_per_env_step(agent_name: str, env_id: str, width: int | None, buffer_size: int | None = None) -> float:
    """XLA's FLOP count of one env step's training work for one seed: the agent's
    ``work_per_env_step`` (MR.Q: value/policy update + one amortised encoder step) or one
    ``update`` x ``updates_per_step``, plus the exploration forward pass.  Counted on a sampled
    batch, so the buffer's capacity does not enter (MR.Q's O(capacity) LAP cdf is not counted)."""
    agent, acfg, cfg, env = setup(agent_name, env_id, 1, width, buffer_size)
    state, buffer, key = init_state(agent, cfg, env.obs_dim, env.act_dim)
    buffer = fill(agent, buffer, random_transitions(np.random.default_rng(0), 1, 600, env.obs_dim, env.act_dim))
    state, buffer = jax.tree.map(lambda x: x[0], (state, buffer))
    batch = agent.sample_batch(state, buffer, key, acfg.batch_size)
    work = getattr(agent, "work_per_env_step", None)
    if work is None:
        work = lambda s, b, k: agent.update(s, b, k)[0]  # noqa: E731
        repeats = acfg.updates_per_step
    else:
        repeats = 1
    cost = jax.jit(work).lower(state, batch, key).compile().cost_analysis()
    act = (
        jax.jit(lambda s, o, k: agent.act(s, o, k, explore=True))
        .lower(state, jnp.zeros((1, env.obs_dim)), key)
        .compile()
        .cost_analysis()
    )
    cost, act = (c[0] if isinstance(c, (list, tuple)) else c for c in (cost, act))  # older JAX: a list
    return repeats * float(cost["flops"]) + float(act["flops"])


# The interventions that change every update, at their presets' values, timed against the plain update.
# (Injection: a network with the residual pair, before its injection step, which lies past the run.)
IN_UPDATE = {
    "plain": PlasticityConfig(metrics_every=0),
    "sigreg": PlasticityConfig(metrics_every=0, sigreg_coef=0.2),
    "l2-init": PlasticityConfig(metrics_every=0, l2_init=0.01),
    "parseval": PlasticityConfig(metrics_every=0, parseval=1e-4, parseval_scale=2.0),
    "trac": PlasticityConfig(metrics_every=0, trac=True),
    "injection": PlasticityConfig(metrics_every=0, injection_step=10**9),
}


def plasticity_overhead(
    agent_name: str,
    env_id: str,
    width: int | None,
    buffer_size: int | None = None,
    rounds: int = 7,
    labels: tuple[str, ...] = tuple(IN_UPDATE),
    events: bool = True,
):
    """Cost of plasticity metrics, resets and the per-update interventions (``IN_UPDATE``: SIGReg, L2 Init,
    Parseval, TRAC, injection's residual heads) as a fraction of update time at default periods.
    ``labels``: the interventions timed (``plain`` always); ``events``: also time the metrics and reset events.

    The update time is that of the loop's training block (one seed, the agent's own buffer at the
    config's capacity).  MR.Q's block spans its 250-update sync period (one encoder burst), so the
    burst is counted amortised as in training.  The blocks of ``IN_UPDATE`` are timed in ``rounds``
    alternated rounds; the medians are reported."""
    from plasticity_zoo.plasticity.hooks import Hooks, reset_step

    agent = agents.get(agent_name)
    updates = getattr(agent.CONFIG(), "target_update_freq", 200)
    rng = np.random.default_rng(0)

    def timed(fn, *args, repeat=3):
        jax.block_until_ready(fn(*args))  # compile
        t0 = time.perf_counter()
        for _ in range(repeat):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / repeat

    def prepare(pcfg):
        _, acfg, cfg, env = setup(agent_name, env_id, 1, width, buffer_size, pcfg)
        state, buffer, key = init_state(agent, cfg, env.obs_dim, env.act_dim)
        buffer = fill(agent, buffer, random_transitions(rng, 1, 2000, env.obs_dim, env.act_dim))
        return acfg, state, buffer, key

    runs = {}
    timed_labels = ["plain"] + [label for label in labels if label != "plain"]
    for label in timed_labels:
        pcfg = IN_UPDATE[label]
        acfg, state, buffer, key = prepare(pcfg)
        block = make_train_block(agent, acfg, updates)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def run(state, buffer, key, block=block):  # SIGReg is built into the state (init_state)
            return over_seeds(block)(state, buffer, key[None])  # one seed: unmapped, as the loops run it

        state, buffer, _ = run(state, buffer, key)  # compile
        jax.block_until_ready(state)
        runs[label] = [run, state, buffer, key]

    def one_round(label, i, repeat=3):  # state and buffer threaded through (donated), as in training
        run, state, buffer, key = runs[label]
        t0 = time.perf_counter()
        for j in range(repeat):
            state, buffer, _ = run(state, buffer, jax.random.fold_in(key, repeat * i + j))
        jax.block_until_ready(state)
        runs[label][1:3] = state, buffer
        return (time.perf_counter() - t0) / repeat / updates

    samples: dict[str, list[float]] = {label: [] for label in timed_labels}
    for i in range(rounds):  # alternated, so a change in the machine's load hits all alike
        for label in samples:
            samples[label].append(one_round(label, i))
    block_time = {label: float(np.median(v)) for label, v in samples.items()}
    t_update = block_time["plain"]
    print(
        f"agent={agent_name} env={env_id} buffer_size={acfg.buffer_size} backend={jax.default_backend()}; "
        f"update time from {updates}-update training blocks"
    )
    print(f"per update: {t_update * 1e3:.2f} ms (plain)")
    for label in timed_labels[1:]:
        ratios = np.array([x / p - 1 for p, x in zip(samples["plain"], samples[label])])
        q25, q50, q75 = np.quantile(ratios, [0.25, 0.5, 0.75])
        print(
            f"{label} overhead: {100 * (block_time[label] / t_update - 1):.1f}% of update time "
            f"({block_time[label] * 1e3:.2f} ms; ratio of medians over {rounds} alternated rounds; median "
            f"per-round ratio {100 * q50:.1f}% [{100 * q25:.1f}, {100 * q75:.1f}]; per round: "
            f"{', '.join(f'{100 * r:.1f}%' for r in ratios)})"
        )
    if not events:
        return {"update_s": t_update, **{f"{k}_update_s": v for k, v in block_time.items()}}

    pcfg = PlasticityConfig(metrics_every=10_000, regrama=True)
    acfg, state, buffer, key = prepare(pcfg)
    hooks = Hooks(pcfg, agent, agent_name, total_updates=10**6)
    state = hooks.start(state)
    keys = jax.random.split(key, 1)
    batch = hooks._sample(state, buffer, keys)
    t_metrics = timed(lambda: hooks._metrics(state, batch, hooks.init_params, keys))
    resets = {}
    for method in ("redo", "regrama"):
        rc = dataclasses.replace(pcfg, regrama=method == "regrama", redo=method == "redo")
        fn = jax.jit(jax.vmap(functools.partial(reset_step, agent, rc)))
        resets[method] = timed(fn, state, buffer, keys)
    print(
        f"metrics event: {t_metrics * 1e3:.1f} ms = {100 * t_metrics / (10_000 * t_update):.2f}% "
        "at every 10,000 updates"
    )
    for method, t in resets.items():
        print(f"{method} event: {t * 1e3:.1f} ms = {100 * t / (1_000 * t_update):.2f}% at every 1,000 updates")
    return {
        "update_s": t_update,
        **{f"{k}_update_s": v for k, v in block_time.items()},
        "metrics_s": t_metrics,
        **resets,
    }


def timed_agents() -> list[str]:
    """The agents this benchmark times: off-policy ones on a single-task env (PPO has its own,
    scripts/benchmark_ppo.py; mrq-mt needs an mt: env with one env per task, which this loop body does not step)."""
    out = []
    for name in sorted(agents.AGENTS):
        agent = agents.get(name)
        if agent.KIND == "offpolicy" and not hasattr(agent, "with_tasks"):
            out.append(name)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    timed = timed_agents()
    p.add_argument(
        "--agent",
        default="sac",
        metavar="{" + ",".join(timed) + "}",
        help="an off-policy agent (PPO: scripts/benchmark_ppo.py)",
    )
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 4], help="vmapped seeds, one measurement each")
    p.add_argument("--steps", type=int, default=1000, help="timed env steps per seed")
    p.add_argument("--width", type=int, default=None, help="hidden width (default: the agent's paper value)")
    p.add_argument("--warmup", type=int, default=300, help="untimed training steps after compilation")
    p.add_argument(
        "--buffer-size",
        type=int,
        default=None,
        help="replay capacity per seed (default: the agent config's buffer_size, as train.py)",
    )
    p.add_argument(
        "--plasticity",
        action="store_true",
        help="instead: overhead of plasticity metrics, ReDo/ReGraMa resets and SIGReg vs update time",
    )
    p.add_argument("--rounds", type=int, default=7, help="with --plasticity: alternated rounds of each intervention")
    p.add_argument(
        "--interventions",
        default=",".join(IN_UPDATE),
        help=f"with --plasticity: the per-update interventions timed beside plain ({', '.join(IN_UPDATE)})",
    )
    p.add_argument("--no-events", action="store_true", help="with --plasticity: skip the metrics and reset events")
    args = p.parse_args(argv)
    labels = tuple(x.strip() for x in args.interventions.split(",") if x.strip())
    unknown = sorted(set(labels) - set(IN_UPDATE))
    if unknown:
        p.error(f"argument --interventions: unknown {', '.join(unknown)}; choose from {', '.join(IN_UPDATE)}")
    if args.agent not in timed:
        where = " (PPO's benchmark is scripts/benchmark_ppo.py)" if args.agent == "ppo" else ""
        p.error(f"argument --agent: {args.agent!r} is not timed here{where}; choose from {', '.join(timed)}")
    if args.plasticity:
        return plasticity_overhead(
            args.agent, args.env, args.width, args.buffer_size, args.rounds, labels, not args.no_events
        )
    buffer_size = args.buffer_size or agents.get(args.agent).CONFIG().buffer_size
    print(
        f"agent={args.agent} env={args.env} buffer_size={buffer_size:,} width={args.width or 'paper default'} "
        f"backend={jax.default_backend()} devices={jax.devices()}"
    )
    flops = flops_per_env_step(args.agent, args.env, args.width, args.buffer_size)
    peak = matmul_peak()
    print(f"model FLOPs per env step (one seed, XLA count): {flops / 1e9:.3f} GFLOP")
    print(
        f"peak used for 'of peak': measured float32 matmul throughput of the default device "
        f"({jax.default_backend()}; jitted {PEAK_N}x{PEAK_N} x @ x, best of 3 x {PEAK_REPEAT}): "
        f"{peak / 1e9:.1f} GFLOP/s"
    )
    print(
        f"{'seeds':>5} {'env steps/s (all seeds)':>24} {'per seed':>9} {'ms/step':>8} {'compile s':>10} "
        f"{'GFLOP/s':>8} {'of peak':>8}"
    )
    rows = []
    for s in args.seeds:
        r = measure(args.agent, args.env, s, args.steps, args.width, args.warmup, args.buffer_size)
        r["flops_per_step"], r["achieved_flops"] = flops, flops * r["env_steps_per_s"]
        r["peak_flops"], r["fraction_of_peak"] = peak, r["achieved_flops"] / peak
        rows.append(r)
        print(
            f"{r['seeds']:>5} {r['env_steps_per_s']:>24.1f} {r['per_seed']:>9.1f} {r['ms_per_step']:>8.2f} "
            f"{r['compile_s']:>10.2f} {r['achieved_flops'] / 1e9:>8.1f} {100 * r['fraction_of_peak']:>7.1f}%",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
