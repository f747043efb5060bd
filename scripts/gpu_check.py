"""The GPU check: one command that fits a short accelerator loan (under 8 minutes on an H100 or H200).

    python scripts/gpu_check.py --out gpu_check            # on the accelerator: JSON + markdown table
    python scripts/gpu_check.py --tiny --out /tmp/check    # the same items at CPU sizes (a minute or two)

It measures, in this order (each item is timed and its failure recorded, so one broken item does not
cost the others; items not started within ``--budget-s`` are listed as skipped):

1. ``mrq_replay_memory``: the bytes of MR.Q's LAP replay at 1M rows on HalfCheetah's widths, and the
   device's peak memory in use after building it (where the backend reports it; first, so that the peak
   is the buffer's and not an earlier item's).
2. ``ppo_device``: the device loop's PPO env steps/s on ``playground:CheetahRun`` at 1,024 / 4,096 / 8,192
   envs (``scripts/benchmark_ppo.measure_device_ppo``: one jitted chunk of whole iterations, 32-step
   unrolls), with physics ``--env-impl jax`` and, where the backend is a GPU and ``warp`` imports, ``warp``.
3. ``sac_device`` / ``mrq_device``: SAC and MR.Q in the off-policy device loop at 128 and 1,024 envs with
   8 updates per vector step (``--updates-per-vector-step 8``), env steps/s and updates/s.
4. ``mrq_host``: MR.Q at full size on a host env (HalfCheetah-v5) with 1 and 10 vmapped seeds
   (``scripts/benchmark.measure``: train.py's loop body, whole 250-step sync periods).
5. ``neubay_update``: NeuBay's jitted update (default sizes: 2,048-position tape, Hopper's widths) per second.
6. ``sigreg_share``: SIGReg's share of a SAC update (``scripts/benchmark.plasticity_overhead``, plain and
   SIGReg training blocks alternated).
7. ``brax_ppo``: Brax's own PPO trainer (``brax.training.agents.ppo.train`` on Playground's env, MJX
   physics as ``ppo_device``'s first rows) at the same env counts, when Brax is installed (it is not a
   dependency of the zoo); env steps/s of its last training epoch. Last: it compiles its epoch program twice
   per size, the longest item.

The JSON and the table are rewritten after every item, so a run stopped by its loan's end keeps what it
measured.
``--tiny`` runs every item at CPU sizes (``playground:CartpoleBalance``, one size per item, width-16
networks, Pendulum-v1, short windows) so the suite checks the script on every change
(``tests/test_gpu_check.py``).  Outputs: ``<out>/gpu_check.json`` (every row with its settings) and
``<out>/gpu_check.md`` (the table, also printed), with the device named.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import sys
import time
import traceback
from pathlib import Path

try:
    from plasticity_zoo import agents
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plasticity_zoo import agents

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402  (scripts/benchmark.py)
import benchmark_ppo  # noqa: E402  (scripts/benchmark_ppo.py)

from plasticity_zoo.training.config import NetworkConfig, RunConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each item runs at: the accelerator's sizes, or ``--tiny``'s CPU ones."""

    playground: str = "playground:CheetahRun"
    ppo_envs: tuple[int, ...] = (1024, 4096, 8192)
    ppo_steps: int = 32
    ppo_iterations: int = 4
    brax_epochs: int = 3  # Brax compiles its epoch program twice: the third epoch is the first steady one
    offpolicy_envs: tuple[int, ...] = (128, 1024)
    offpolicy_vector_steps: int = 50
    updates_per_vector_step: int = 8
    width: int | None = None
    host_env: str = "HalfCheetah-v5"
    host_seeds: tuple[int, ...] = (1, 10)
    host_steps: int = 250
    host_warmup: int = 250
    buffer_size: int | None = None
    neubay_dims: tuple[int, int] = (11, 3)  # Hopper's
    neubay_updates: int = 20
    sigreg_rounds: int = 3
    replay_rows: int = 1_000_000
    replay_dims: tuple[int, int] = (17, 6)  # HalfCheetah's


TINY = Sizes(  # one size per item: every size is its own compilation, and compiling is all a CPU run does here
    playground="playground:CartpoleBalance",
    ppo_envs=(8,),
    ppo_steps=8,
    ppo_iterations=1,
    brax_epochs=1,
    offpolicy_envs=(4,),
    offpolicy_vector_steps=4,
    updates_per_vector_step=2,
    width=16,
    host_env="Pendulum-v1",
    host_seeds=(2,),
    host_steps=250,
    host_warmup=0,
    buffer_size=10_000,
    neubay_updates=2,
    sigreg_rounds=1,
    replay_rows=10_000,
)


def row(item: str, setting: str, value: float, unit: str, **extra) -> dict:
    return {"item": item, "setting": setting, "value": float(value), "unit": unit, **extra}


# ------------------------------------------------------------------------------------------ the items
def physics_impls() -> list[str]:
    """MJX (``jax``) always; MuJoCo Warp too where the backend is a GPU and ``warp`` imports."""
    if jax.default_backend() != "gpu":
        return ["jax"]
    return ["jax", "warp"] if importlib.util.find_spec("warp") is not None else ["jax"]


def ppo_device(z: Sizes) -> list[dict]:
    out = []
    for impl in physics_impls():
        for n in z.ppo_envs:
            setting = f"{z.playground} x{n} envs, impl {impl}"
            try:
                r = benchmark_ppo.measure_device_ppo(
                    z.playground, n, iterations=z.ppo_iterations, num_steps=z.ppo_steps, width=z.width, env_impl=impl
                )
            except Exception as e:  # one size or physics failing keeps the others' rows
                traceback.print_exc()
                out.append(row("ppo_device", setting, float("nan"), "", error=f"{type(e).__name__}: {e}"[:300]))
                continue
            out.append(
                row("ppo_device", setting, r["env_steps_per_s"], "env steps/s", compile_s=r["first_iteration_s"])
            )
    if jax.default_backend() == "gpu" and "warp" not in physics_impls():
        out.append(row("ppo_device", f"{z.playground}, impl warp", float("nan"), "", note="warp-lang is not installed"))
    return out


def brax_ppo(z: Sizes) -> list[dict]:
    """Brax's PPO trainer on Playground's env (Playground's own wrapper) at the device PPO's settings: one
    unroll of ``ppo_steps`` from every env per training step, 10 epochs of 32 minibatches (fewer with fewer
    envs), 64x64 tanh networks, observations normalised, physics ``impl`` as the zoo's (Playground's own
    default config picks MuJoCo Warp, which on a CPU steps about 45x slower than MJX).  Brax's own
    ``training/sps`` of its last training epoch (``brax_epochs``; the first compiles, and so does the
    second: Brax's epoch program is traced again once its inputs are outputs of the first), evaluations
    off: the training alone, as ``ppo_device`` times it."""
    try:
        import functools

        from brax.training.agents.ppo import networks as brax_networks
        from brax.training.agents.ppo import train as brax_train
        from mujoco_playground import registry, wrapper
    except ImportError as e:
        return [row("brax_ppo", "skipped", float("nan"), "", note=f"Brax is not installed ({e})")]
    if not hasattr(jax, "device_put_replicated"):  # Brax 0.14 calls it; JAX 0.10 has dropped it
        jax.device_put_replicated = lambda x, devices: jax.tree.map(  # type: ignore[attr-defined]
            lambda a: jnp.stack([jnp.asarray(a)] * len(devices)), x
        )
    env_name = z.playground.split(":", 1)[1]
    networks = functools.partial(
        brax_networks.make_ppo_networks,
        policy_hidden_layer_sizes=(z.width or 64,) * 2,
        value_hidden_layer_sizes=(z.width or 64,) * 2,
        activation=jax.nn.tanh,
    )
    impl = "jax"  # MJX, as ppo_device's first rows (Playground's own default config would pick Warp)
    out = []
    for n in z.ppo_envs:
        minibatches = min(32, n)
        rates: list[float] = []
        brax_train.train(
            environment=registry.load(env_name, config_overrides={"impl": impl}),
            num_timesteps=z.brax_epochs * n * z.ppo_steps * z.ppo_iterations,
            num_evals=z.brax_epochs + 1,  # brax_epochs training epochs of ppo_iterations training steps each
            run_evals=False,
            episode_length=1000,
            num_envs=n,
            batch_size=n // minibatches,
            num_minibatches=minibatches,
            unroll_length=z.ppo_steps,
            num_updates_per_batch=10,
            normalize_observations=True,
            network_factory=networks,
            wrap_env_fn=wrapper.wrap_for_brax_training,
            progress_fn=lambda step, metrics: rates.append(float(metrics["training/sps"])),
            seed=0,
        )
        if len(rates) < z.brax_epochs:
            raise RuntimeError(f"Brax reported {len(rates)} training epochs, expected {z.brax_epochs}")
        out.append(row("brax_ppo", f"{z.playground} x{n} envs, impl {impl}", rates[-1], "env steps/s", epoch_sps=rates))
    return out


def offpolicy_device(agent_name: str, z: Sizes) -> list[dict]:
    from plasticity_zoo.training.loops.device import DeviceOffPolicyIteration

    agent = agents.get(agent_name)
    out = []
    for n in z.offpolicy_envs:
        acfg = dataclasses.replace(agent.CONFIG(), updates_per_vector_step=z.updates_per_vector_step, learning_starts=n)
        if z.buffer_size is not None:
            acfg = dataclasses.replace(acfg, buffer_size=z.buffer_size)
        total = n * (z.offpolicy_vector_steps + 2)
        cfg = RunConfig(
            env=z.playground,
            num_envs=n,
            total_steps=total,
            agent_name=agent_name,
            agent=acfg,
            network=NetworkConfig(width=z.width),
            progress=False,
        )
        it = DeviceOffPolicyIteration(cfg, agent)
        it.fresh()
        t0 = time.perf_counter()
        it.carry, report = it.chunk_fn(it.carry, jnp.int32(1), jnp.int32(0))  # compiles; learns from step n
        jax.block_until_ready(report)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        it.carry, report = it.chunk_fn(it.carry, jnp.int32(z.offpolicy_vector_steps), jnp.int32(n))
        jax.block_until_ready(report)
        seconds = time.perf_counter() - t0
        if not bool(report.finite):
            raise RuntimeError("a loss became non-finite")
        setting = f"{z.playground} x{n} envs, {z.updates_per_vector_step} updates/vector step"
        out.append(
            row(
                f"{agent_name}_device",
                setting,
                z.offpolicy_vector_steps * n / seconds,
                "env steps/s",
                updates_per_s=z.offpolicy_vector_steps * z.updates_per_vector_step / seconds,
                compile_s=compile_s,
            )
        )
    return out


def mrq_host(z: Sizes) -> list[dict]:
    out = []
    for seeds in z.host_seeds:
        r = benchmark.measure("mrq", z.host_env, seeds, z.host_steps, z.width, z.host_warmup, z.buffer_size)
        out.append(
            row(
                "mrq_host",
                f"{z.host_env}, {seeds} vmapped seed(s)",
                r["env_steps_per_s"],
                "env steps/s (all seeds)",
                ms_per_step=r["ms_per_step"],
                compile_s=r["compile_s"],
            )
        )
    return out


def neubay_update(z: Sizes) -> list[dict]:
    from plasticity_zoo.agents import neubay

    obs_dim, act_dim = z.neubay_dims
    cfg = neubay.CONFIG()
    if z.width is not None:
        cfg = dataclasses.replace(cfg, head_width=z.width, d_model=z.width, d_hidden=z.width, tape_len=64)
    cfg = dataclasses.replace(cfg, updates=1_000)
    state = neubay.init(jax.random.key(0), obs_dim, act_dim, cfg)
    rng = np.random.default_rng(0)
    T = cfg.tape_len
    start = np.zeros((1, T), bool)
    start[0, :: max(1, T // 8)] = True  # trajectories of T/8 positions
    tape = neubay.TapeBatch(
        jnp.asarray(rng.normal(size=(1, T, obs_dim + act_dim + 1)), jnp.float32),
        jnp.asarray(start),
        jnp.asarray(rng.uniform(-1, 1, (1, T, act_dim)), jnp.float32),
        jnp.asarray(rng.normal(size=(1, T)), jnp.float32),
        jnp.zeros((1, T), bool),
        jnp.asarray(rng.random((1, T)) < 0.5),
    )
    update = jax.jit(neubay.update)
    t0 = time.perf_counter()
    state, metrics = update(state, tape, jax.random.key(1))
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(z.neubay_updates):
        state, metrics = update(state, tape, jax.random.key(2 + i))
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    if not all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(metrics)):
        raise RuntimeError("a NeuBay loss became non-finite")
    return [
        row(
            "neubay_update",
            f"tape of {T} positions, obs {obs_dim} / act {act_dim}",
            z.neubay_updates / seconds,
            "updates/s",
            compile_s=compile_s,
        )
    ]


def sigreg_share(z: Sizes) -> list[dict]:
    r = benchmark.plasticity_overhead(
        "sac", z.host_env, z.width, z.buffer_size, rounds=z.sigreg_rounds, labels=("sigreg",), events=False
    )
    share = r["sigreg_update_s"] / r["plain_update_s"] - 1
    return [
        row(
            "sigreg_share",
            f"SAC on {z.host_env}, coefficient 0.2",
            100 * share,
            "% of a plain update",
            plain_update_ms=1e3 * r["plain_update_s"],
        )
    ]


def mrq_replay_memory(z: Sizes) -> list[dict]:
    mrq = agents.get("mrq")
    obs_dim, act_dim = z.replay_dims
    buffer = mrq.buffer_init(z.replay_rows, obs_dim, act_dim, mrq.CONFIG())
    jax.block_until_ready(buffer)
    nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(buffer))
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return [
        row(
            "mrq_replay_memory",
            f"{z.replay_rows:,} rows, obs {obs_dim} / act {act_dim}",
            nbytes / 2**20,
            "MiB (the buffer's arrays)",
            device_peak_mib=None if peak is None else peak / 2**20,
        )
    ]


ITEMS = {  # in this order: the replay's memory first (the device's peak is then the buffer's), Brax last
    "mrq_replay_memory": mrq_replay_memory,
    "ppo_device": ppo_device,
    "sac_device": lambda z: offpolicy_device("sac", z),
    "mrq_device": lambda z: offpolicy_device("mrq", z),
    "mrq_host": mrq_host,
    "neubay_update": neubay_update,
    "sigreg_share": sigreg_share,
    "brax_ppo": brax_ppo,
}


# ------------------------------------------------------------------------------------------ the report
def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', '?')} ({platform.processor() or platform.machine()})"


def table(rows: list[dict], device: str) -> str:
    lines = [
        f"GPU check on {device}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| item | setting | value | unit | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        value = "-" if not np.isfinite(r["value"]) else f"{r['value']:,.1f}"
        note = r.get("note") or r.get("error")
        unit = r["unit"] + (f" ({note})" if note else "")
        lines.append(f"| {r['item']} | {r['setting']} | {value} | {unit} | {r.get('seconds', 0):.1f} |")
    return "\n".join(lines)


def write(out: Path, device: str, tiny: bool, sizes: Sizes, rows: list[dict]) -> str:
    """``out/gpu_check.json`` (every row with its settings) and ``out/gpu_check.md`` (the table, returned)."""
    report = {"device": device, "tiny": tiny, "sizes": dataclasses.asdict(sizes), "rows": rows}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = table(rows, device)
    (out / "gpu_check.md").write_text(md + "\n")
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--tiny", action="store_true", help="CPU sizes: checks the script, measures nothing useful")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no item after this many seconds")
    p.add_argument("--only", nargs="+", choices=list(ITEMS), help="run these items only")
    p.add_argument("--env", help="the playground: env of the device items (default: playground:CheetahRun)")
    p.add_argument("--ppo-envs", type=int, nargs="+", help="env counts of ppo_device and brax_ppo")
    args = p.parse_args(argv)
    sizes = TINY if args.tiny else Sizes()
    if args.env:
        sizes = dataclasses.replace(sizes, playground=args.env)
    if args.ppo_envs:
        sizes = dataclasses.replace(sizes, ppo_envs=tuple(args.ppo_envs))
    args.out.mkdir(parents=True, exist_ok=True)
    device = device_name()
    print(f"device: {device}; sizes: {'tiny (CPU)' if args.tiny else 'accelerator'}", flush=True)
    rows: list[dict] = []
    start = time.perf_counter()
    for name in args.only or list(ITEMS):
        if time.perf_counter() - start > args.budget_s:
            rows.append(row(name, "skipped", float("nan"), "", note=f"past the {args.budget_s:.0f} s budget"))
            continue
        t0 = time.perf_counter()
        try:
            got = ITEMS[name](sizes)
        except Exception as e:  # recorded, and the next item runs
            traceback.print_exc()
            got = [row(name, "failed", float("nan"), "", error=f"{type(e).__name__}: {e}"[:300])]
        seconds = time.perf_counter() - t0
        for r in got:
            r["seconds"] = seconds
        rows.extend(got)
        print("\n".join(table(got, device).splitlines()[4:]), flush=True)
        write(args.out, device, args.tiny, sizes, rows)  # after every item: a run cut short keeps what it measured
    print(write(args.out, device, args.tiny, sizes, rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
