"""The offline loop: a fixed dataset, N vmapped seeds, epochs of updates, evaluation in the real env.

Time is counted in gradient updates (``--total-steps``, ``--eval-every``, ``--log-every`` and
``--checkpoint-every`` are update counts, applied at epoch boundaries).  Per epoch the host makes
one jitted call, vmapped over seeds, that runs the agent's whole epoch (for RAVL: model rollouts
and ``updates_per_epoch`` updates in one scan).

An offline agent module provides, beside ``CONFIG`` (with ``dataset``, ``kind``, ``dataset_root``
and ``updates_per_epoch`` fields), ``init`` and ``act``:

- ``prepare(key, dataset, dataset_path, cfg, seed, log) -> aux``: once per run, e.g. fit or load
  a dynamics model; ``aux`` is a pytree shared by all seeds (not checkpointed: it is cached on disk);
- ``data_init(real_transitions, cfg) -> data``: what one seed learns from, a NamedTuple whose field
  ``real`` holds the dataset (the other fields, e.g. rollout buffers, are checkpointed);
- ``make_epoch(cfg, env_id) -> epoch(state, data, aux, key) -> (state, data, metrics)``;
- ``sample_batch(state, data, key, n)``: a training batch (plasticity metrics and resets use it).

``dataset.json`` in the run directory records the dataset path, env and fingerprint.
Checkpoints hold the agent states, the agent's buffers (``data`` without the dataset, which is
re-read and checked against a fingerprint on resume) and the rng, so ``--resume`` continues exactly.
Evaluation rows carry normalised scores: ``score_d4rl`` (D4RL constants, hopper / halfcheetah /
walker2d) and ``score_dataset`` (the dataset's own random / expert references), when known.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.envs import datasets
from plasticity_zoo.envs.scores import d4rl_name, gymnasium_id, normalized_score
from plasticity_zoo.networks.runtime import cached_per_config, dots_only_library_fusion
from plasticity_zoo.plasticity.hooks import Hooks, check_optimizers, static_plasticity
from plasticity_zoo.training.config import RunConfig
from plasticity_zoo.training.driver import Driver, StepReport
from plasticity_zoo.training.evaluation import run_evaluator
from plasticity_zoo.training.loop import RunTree, check_positive, run_counts
from plasticity_zoo.training.seeds import init_over_seeds, over_seeds


def resolve_dataset(cfg: RunConfig):
    """-> (path, Dataset, env id for evaluation), from ``--dataset PATH | minari:<id>`` or ``--env E --kind K``."""
    a = cfg.agent
    if a.dataset and a.dataset.startswith("minari:"):  # converted once into the dataset cache (envs/minari_data.py)
        from plasticity_zoo.envs import minari_data

        path = minari_data.resolve(a.dataset, cache_root=a.dataset_root)
    elif a.dataset:
        path = Path(a.dataset).expanduser()
    elif a.kind:
        if cfg.env is None:  # train.py's default for offline agents: --env not given
            raise SystemExit("--kind needs --env (e.g. --env hopper --kind medium) to find the dataset in the cache")
        path = datasets.find(gymnasium_id(cfg.env), a.kind, a.dataset_root)
    else:
        raise SystemExit(
            f"agent {cfg.agent_name!r} is offline: give --dataset PATH or --env ENV --kind KIND "
            f"(kinds: {', '.join(datasets.KINDS)}; make one with scripts/make_dataset.py)"
        )
    if not path.exists():
        raise SystemExit(f"--dataset {path}: no such file")
    stored = datasets.load(path, validate=False).env_id
    given = cfg.env  # None: not given (train.py's default for offline agents; env=None in code)
    if (
        stored
        and given
        and given != stored
        and not (  # hopper / Hopper-v4 match Hopper-v5
            d4rl_name(given) is not None and d4rl_name(given) == d4rl_name(stored)
        )
    ):
        raise SystemExit(
            f"--env {given} does not match the dataset's env {stored} ({path}); leave --env out "
            "to evaluate on the dataset's env (in code: RunConfig(env=None, ...))"
        )
    env_id = stored or (gymnasium_id(given) if given else None)
    if env_id is None:
        raise SystemExit(f"{path} does not record its environment: pass --env (e.g. Hopper-v5)")
    dataset = datasets.load(path, env_id=env_id)
    dataset.metadata.setdefault("env_id", env_id)  # a real D4RL file names no env: action bounds come from it
    return path, dataset, env_id


def dataset_config(cfg: RunConfig, agent, dataset, env_id: str) -> RunConfig:
    """``cfg`` with the env evaluated on and the agent's config for this dataset (``with_dataset``,
    where the agent defines it: e.g. NeuBay's per-task presets) -- what config.json records."""
    cfg = dataclasses.replace(cfg, env=env_id)
    if hasattr(agent, "with_dataset"):
        cfg = dataclasses.replace(
            cfg, agent=agent.with_dataset(cfg.agent, env_id, dict(dataset.metadata), cfg.total_steps)
        )
    return cfg


def scores(returns, env_id: str, metadata: dict) -> dict:
    """Normalised scores of a mean return under each reference that is known for this dataset."""
    out = {}
    for ref in ("d4rl", "dataset"):
        try:
            out[f"score_{ref}"] = float(normalized_score(returns, env_id=env_id, metadata=metadata, reference=ref))
        except (ValueError, KeyError):
            pass
    return out


def fingerprint(dataset) -> dict:
    return {
        "rows": len(dataset),
        "reward_sum": float(np.sum(dataset.rewards, dtype=np.float64)),
        "obs_sum": float(np.sum(dataset.observations, dtype=np.float64)),
    }


@cached_per_config
def epoch_program(agent, agent_cfg, env_id: str):
    """``agent.make_epoch`` over the seed axis, jitted; cached so runs in one process share the program.

    On CPU it is compiled with single-dot library fusions (``networks.runtime.dots_only_library_fusion``):
    the offline agents' updates on long batches reduce large arrays over their leading axis."""
    return jax.jit(
        over_seeds(agent.make_epoch(agent_cfg, env_id), in_axes=(0, 0, None, 0)),
        donate_argnums=(0, 1),
        compiler_options=dots_only_library_fusion(),
    )


def initial_state(cfg: RunConfig, agent, dataset, init_keys):
    """Fresh agent states (one per key, vmapped) and per-seed data (the dataset plus the agent's buffers)."""
    static = static_plasticity(cfg.plasticity, agent)  # Kron / NE masks, SIGReg: built into the agent
    state = init_over_seeds(agent, init_keys, dataset.obs_dim, dataset.act_dim, cfg.agent, cfg.network, static)
    check_optimizers(cfg.plasticity, agent, cfg.agent_name, state)
    real = jax.tree.map(jnp.asarray, dataset.transitions(unit_actions=True))  # the agent acts in [-1, 1]
    data = jax.vmap(lambda _: agent.data_init(real, cfg.agent))(jnp.arange(len(init_keys)))  # copied per seed
    return state, data


def train(cfg: RunConfig, agent, run_dir: Path, resume: bool = False, stop_at: int | None = None) -> dict:
    """Train (or resume) an offline run.  ``stop_at`` ends early at that update count."""
    check(cfg)
    path, dataset, env_id = resolve_dataset(cfg)
    cfg = dataset_config(cfg, agent, dataset, env_id)  # config.json (and plots) name the env evaluated on
    iteration = OfflineIteration(cfg, agent, path, dataset, env_id)
    driver = Driver(
        cfg,
        agent,
        run_dir,
        iteration.hooks,
        iteration.evaluator,
        unit="update",
        speed_key="perf/updates_per_s",
        episodes=False,
        eval_extras=lambda returns: [scores(np.mean(r), env_id, dataset.metadata) for r in returns],
    )
    host = driver.begin(
        iteration,
        resume,
        on_fresh=lambda: (Path(run_dir) / "dataset.json").write_text(json.dumps(iteration.meta, indent=2)),
    )
    if host is not None and host["dataset"] != iteration.meta["fingerprint"]:
        raise SystemExit(
            f"--resume {run_dir}: the dataset {path} changed since the run started "
            f"({host['dataset']} != {iteration.meta['fingerprint']})"
        )
    end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)
    iteration.last_log = end  # a log row at the loop's end, also where stop_at ends it early
    last_eval = driver.run(iteration, end, cfg.total_steps)
    return {
        "state": iteration.state,
        "step": driver.step,
        "last_eval": last_eval,
        "run_dir": str(run_dir),
        "env_id": env_id,
    }


def check(cfg: RunConfig, agent=None):
    """Settings the offline loop cannot run with (a ValueError naming the flag; ``agent`` is not needed)."""
    a = cfg.agent
    check_positive(**run_counts(cfg))
    if cfg.total_steps % a.updates_per_epoch:
        raise ValueError(
            f"--total-steps ({cfg.total_steps}) must be a multiple of --updates-per-epoch ({a.updates_per_epoch})"
        )
    if cfg.num_envs != 1:
        raise ValueError("--num-envs does not apply to offline agents (they collect no data)")
    if cfg.plasticity.least:
        raise ValueError(
            f"--plasticity.least does not apply to agent {cfg.agent_name!r}: offline agents collect no episodes to stop"
        )


class OfflineIteration:
    """One epoch per iteration: the agent's jitted epoch (e.g. model rollouts and updates) for every seed."""

    def __init__(self, cfg: RunConfig, agent, path, dataset, env_id: str):
        a = cfg.agent
        self.cfg, self.U, S = cfg, a.updates_per_epoch, cfg.seeds
        self.evaluator = run_evaluator(cfg, action_mode(cfg, agent), env_id)
        keys = jax.random.split(jax.random.key(cfg.seed), S + 2)
        k_prepare, self.key = keys[0], keys[1]
        self.aux = agent.prepare(k_prepare, dataset, path, a, cfg.seed, log=print)
        self.state, self.data = initial_state(cfg, agent, dataset, keys[2:])
        self.hooks = Hooks(cfg.plasticity, agent, cfg.agent_name, total_updates=cfg.total_steps)
        self.state = self.hooks.start(self.state)
        self.epoch_fn = epoch_program(agent, a, env_id)
        self.meta = {"dataset": str(path), "env_id": env_id, "fingerprint": fingerprint(dataset)}
        self.last_log = cfg.total_steps  # the step of the run's last log row (``train``: the loop's end)

    def fresh(self):
        pass

    def tree(self):
        return RunTree(self.state, _buffers(self.data), self.key)

    def load(self, tree, host):
        self.state, model_buffers, self.key = tree
        self.data = _with_buffers(self.data, model_buffers)

    def host(self) -> dict:
        return {"dataset": self.meta["fingerprint"]}

    def eval_state(self):
        return self.state

    def step(self, at: int, room: int) -> StepReport:
        """One epoch from update ``at``: ``updates_per_epoch`` updates of every seed."""
        self.key, k = jax.random.split(self.key)
        self.state, self.data, metrics = self.epoch_fn(
            self.state, self.data, self.aux, jax.random.split(k, self.cfg.seeds)
        )
        finite = all(bool(jnp.all(jnp.isfinite(m))) for m in jax.tree.leaves(metrics))
        return StepReport(
            self.U,
            self.U,
            metrics,
            finite=finite,
            stats=metrics,
            updates=(at, at + self.U),
            data=self.data,
            key=jax.random.fold_in(k, 1),
            last_log=self.last_log,
        )


def resolve(cfg: RunConfig, agent):
    """The config as the run records it (``dataset_config``: the dataset's env, the agent's config for
    this dataset) and the dataset's observation and action sizes; the dataset file must exist, be
    readable HDF5 and fit its env (``resolve_dataset``)."""
    _, dataset, env_id = resolve_dataset(cfg)
    return dataset_config(cfg, agent, dataset, env_id), dataset.obs_dim, dataset.act_dim


def last_step(cfg: RunConfig, agent) -> int:
    """The update a finished run ends at: ``--total-steps`` (a multiple of ``--updates-per-epoch``)."""
    return cfg.total_steps


def action_mode(cfg: RunConfig, agent) -> str:
    """How the evaluation envs map actions: ``rescale`` (the agent acts in [-1, 1], as the dataset's
    actions are scaled: ``Dataset.transitions(unit_actions=True)``)."""
    return "rescale"


class _Shapes:
    """A dataset as ``initial_state`` reads it, holding one row of ``real`` (the dataset's rows are not
    checkpointed, so a template needs only their shapes)."""

    def __init__(self, obs_dim: int, act_dim: int, real):
        self.obs_dim, self.act_dim, self.real = obs_dim, act_dim, real

    def transitions(self, unit_actions=False):
        return self.real


def template_tree(cfg: RunConfig, agent, obs_dim: int, act_dim: int):
    """The device tree a fresh run checkpoints (``OfflineIteration.tree()``: the agent states, the
    agent's buffers without the dataset, the key), from ``initial_state`` on a one-row stand-in for the
    dataset; trace it with ``jax.eval_shape`` for a template."""
    real = Transition(
        jnp.zeros((1, obs_dim)),
        jnp.zeros((1, act_dim)),
        jnp.zeros(1),
        jnp.zeros((1, obs_dim)),
        jnp.zeros(1, bool),
        jnp.zeros(1, bool),
    )
    keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 2)
    state, data = initial_state(cfg, agent, _Shapes(obs_dim, act_dim, real), keys[2:])
    return RunTree(state, _buffers(data), keys[1])


def _buffers(data):
    """The checkpointed part of ``data``: everything but the dataset itself (field ``real``)."""
    return data._replace(real=None)


def _with_buffers(data, buffers):
    return buffers._replace(real=data.real)
