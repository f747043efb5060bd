"""The agent contract: what an agent module exports, as ``typing.Protocol``s, one per kind.

An agent is a module (registered in ``agents/__init__.py: AGENTS``) of pure functions over a pytree
state (a ``flax.struct`` dataclass holding params, target params, optimizer states, counters and its
static ``cfg``).  The loops in ``training/`` call exactly these names, with these signatures, and
nothing else; ``tests/test_agent_contract.py`` checks every registered agent against its kind.

Every agent (``Agent``):
    CONFIG                    the agent's config dataclass (its fields become ``train.py`` flags)
    KIND                      "offpolicy" | "onpolicy" | "offline": which loop trains it
    EXPERIENCE_REVIEW         whether NE's experience review (old uniform-replay samples) applies
    init(key, obs_dim, act_dim, cfg, network, plasticity) -> state
                              ``plasticity``: a ``plasticity.api.StaticPlasticity`` (Kron / NE masks in
                              the plastic optimizers, SIGReg in the losses), kept as a static state field
    act(state, obs, key, explore) -> action in [-1, 1]   (key None and explore False for evaluation)

Only the on-policy loop (``training/loops/onpolicy.py: seed_fns``, which the device loop runs too) calls
``update`` itself, so only ``OnPolicyAgent`` requires it.  An off-policy or offline agent's gradient
step (``update(state, batch, key) -> (state, metrics)`` in every agent so far) is its own, run inside
its ``train_block`` / ``make_epoch``; ``scripts/benchmark.py`` counts an off-policy ``update``'s FLOPs
where the agent has no ``work_per_env_step``.

Off-policy (``OffPolicyAgent``): a device-side replay of the agent's choice.
    buffer_init(capacity, obs_dim, act_dim, cfg) -> buffer (cfg: the agent config);
    buffer_add(buffer, transitions, valid=None) -> buffer (``valid``: bool per row, rows to keep)
    sample_batch(state, buffer, key, n) -> batch         (plasticity metrics / resets use it too)
    train_block(state, buffer, key, num_updates, replay_control) -> (state, buffer, metrics)
                              the updates of one vector step as one scan (``updates_per_vector_step``);
                              ``replay_control``: NE's ``plasticity.expansion.ReplayControl``
                              (review probability, half batch; None: off)

On-policy (``OnPolicyAgent``): rollouts with observation / reward normalisers in the state.
    Rollout                   the rollout buffer type (T + 1 observation slots per env)
    observe, normalize_obs, scale_reward, sample_action, value, reset_normalizers,
    rollout_split / rollout_join / rollout_merge   (see ``training/loops/onpolicy.py: FlatStep``)
    sample_batch(state, rollout, key, n) -> minibatch
    update(state, rollout, key) -> (state, metrics)      one iteration's learning on a seed's rollout
                              (the loop's one call per iteration: GAE, epochs x minibatches)

Offline (``OfflineAgent``): a fixed dataset.
    prepare(key, dataset, dataset_path, cfg, seed, log) -> aux     once per run (e.g. a dynamics model)
    data_init(real_transitions, cfg) -> data                       what one seed learns from
    make_epoch(cfg, env_id) -> epoch(state, data, aux, key) -> (state, data, metrics)
    sample_batch(state, data, key, n) -> batch

    An offline agent may also define ``with_dataset(cfg, env_id, metadata, total_updates) -> cfg``:
    the config a run on this dataset trains with (e.g. per-task presets read from the dataset's
    kind); the offline loop calls it before ``init`` and writes the result to config.json.

Recurrent (``RecurrentAgent``, optional, e.g. ``neubay``): an agent whose policy depends on the
episode's history.  Evaluation then carries a memory per episode instead of calling ``act``:
    initial_memory(state, batch) -> memory               zero memory for ``batch`` episodes
    act_step(state, memory, obs, prev_action, prev_reward, start, key, explore) -> (action, memory)
                              ``start`` (batch,) marks an episode's first step (its previous
                              action and reward are ignored there)

Multitask (``TaskConditionedAgent``, optional, e.g. ``mrq-mt``): an agent that needs the env's task
layout (``envs.multitask.TaskSpec`` of an ``mt:`` id: tasks, their widths, episode lengths) defines
    with_tasks(cfg, spec) -> cfg   the config ``init`` takes (``spec`` None: a single-task env id,
                                   which the agent may refuse); the loops call it through
                                   ``training.loop.agent_config`` before every ``init``.
    protocol(spec, num_envs) -> dict   optional: the run schedule of the agent's paper for a config
                                   that leaves ``learning_starts`` unset (None): values for
                                   ``learning_starts`` and for ``RunConfig`` fields (``eval_every``,
                                   ``eval_episodes``) the user did not set; ``training.run.protocol_defaults``
                                   applies them before the run's checks.

Plastic networks (``plasticity.api.PlasticAgent``: PLASTIC, SIGREG_NETWORKS, plastic_params,
plastic_nets, plastic_losses; or, for metrics without interventions, ``MeasuredAgent``:
metric_params, metric_losses) and LEAST's optional signals (``plasticity.api.LEASTAgent``,
``ExplorationNoiseAgent``) are declared beside these; plasticity sits below the agents, so its
Protocols live there and are re-exported here.

``OffPolicyConfig`` holds the replay and schedule settings every off-policy agent's config has.

An agent config declares the valid values of its numeric fields beside them, in a ``RANGES`` class
table of ``networks.config.Range`` (merged along the config's bases: ``OffPolicyConfig.RANGES`` holds
the replay's); the agent's ``init`` checks them with ``networks.config.check_ranges`` (one ``error:``
line naming the flag and its range), and checks the relations between values itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from plasticity_zoo.networks.config import AT_LEAST_ONE, NON_NEGATIVE
from plasticity_zoo.plasticity.api import (
    ExplorationNoiseAgent,
    LEASTAgent,
    MeasuredAgent,
    PlasticAgent,
    StaticPlasticity,
)

__all__ = [
    "Agent",
    "TaskConditionedAgent",
    "RecurrentAgent",
    "OffPolicyAgent",
    "OnPolicyAgent",
    "OfflineAgent",
    "PlasticAgent",
    "MeasuredAgent",
    "LEASTAgent",
    "ExplorationNoiseAgent",
    "StaticPlasticity",
    "KINDS",
    "OffPolicyConfig",
    "protocol_for",
    "updates_per_vector_step",
]


@runtime_checkable
class Agent(Protocol):
    CONFIG: type
    KIND: str
    EXPERIENCE_REVIEW: bool

    def init(self, key, obs_dim: int, act_dim: int, cfg, network, plasticity): ...

    def act(self, state, obs, key, explore: bool): ...


@runtime_checkable
class OffPolicyAgent(Agent, Protocol):
    def buffer_init(self, capacity: int, obs_dim: int, act_dim: int, cfg): ...

    def buffer_add(self, buffer, batch, valid=None): ...

    def sample_batch(self, state, buffer, key, batch_size: int): ...

    def train_block(self, state, buffer, key, num_updates: int, replay_control=None): ...


@runtime_checkable
class OnPolicyAgent(Agent, Protocol):
    Rollout: type

    def observe(self, state, raw_obs): ...

    def normalize_obs(self, state, obs): ...

    def scale_reward(self, state, returns, reward, terminated): ...

    def sample_action(self, state, obs_n, key): ...

    def value(self, state, obs_n): ...

    def reset_normalizers(self, state): ...

    def rollout_split(self, state): ...

    def rollout_join(self, skeleton, frozen, mutable): ...

    def rollout_merge(self, state, mutable): ...

    def sample_batch(self, state, batch, key, size: int): ...

    def update(self, state, batch, key): ...


@runtime_checkable
class OfflineAgent(Agent, Protocol):
    def prepare(self, key, dataset, dataset_path, cfg, seed: int, log: Any = print): ...

    def data_init(self, real, cfg): ...

    def make_epoch(self, cfg, env_id: str): ...

    def sample_batch(self, state, data, key, batch_size: int): ...


@runtime_checkable
class RecurrentAgent(Protocol):
    def initial_memory(self, state, batch: int): ...

    def act_step(self, state, memory, obs, prev_action, prev_reward, start, key, explore: bool): ...


@runtime_checkable
class TaskConditionedAgent(Protocol):
    def with_tasks(self, cfg, spec): ...


KINDS = {"offpolicy": OffPolicyAgent, "onpolicy": OnPolicyAgent, "offline": OfflineAgent}


def protocol_for(agent) -> type:
    """The Protocol of the agent's ``KIND`` (a ValueError naming the kinds for an unknown one)."""
    kind = getattr(agent, "KIND", None)
    if kind not in KINDS:
        raise ValueError(f"agent {getattr(agent, '__name__', agent)!r} has KIND {kind!r}; kinds: {', '.join(KINDS)}")
    return KINDS[kind]


@dataclass(frozen=True)
class OffPolicyConfig:
    """Replay and schedule settings every off-policy agent has."""

    buffer_size: int = 1_000_000
    """replay capacity per seed"""
    batch_size: int = 256
    learning_starts: int = 5_000
    """uniform-random env steps before learning starts"""
    updates_per_step: int = 1
    """gradient steps per env step (update-to-data ratio)"""
    updates_per_vector_step: Optional[int] = None
    """device loop: gradient steps per vector step of all --num-envs envs, whatever their number (Playground's
    SAC, FastSAC: many envs, a few large-batch updates); None: --updates-per-step x --num-envs"""

    RANGES = {
        "buffer_size": AT_LEAST_ONE,
        "batch_size": AT_LEAST_ONE,
        "learning_starts": NON_NEGATIVE,
        "updates_per_step": AT_LEAST_ONE,
        "updates_per_vector_step": AT_LEAST_ONE,
    }  # learning_starts None: the agent's protocol sets it; updates_per_vector_step None: per env step


def updates_per_vector_step(cfg: OffPolicyConfig, num_envs: int) -> int:
    """Gradient updates after each vector step of ``num_envs`` envs: ``--updates-per-vector-step`` where
    set (independent of the env count, as Brax's SAC ``grad_updates_per_step`` and FastSAC / FastTD3's
    ``num_updates``), else ``--updates-per-step`` per env step, ``updates_per_step x num_envs``."""
    k = cfg.updates_per_vector_step
    return cfg.updates_per_step * num_envs if k is None else k


@dataclass(frozen=True)
class OfflineDataConfig:
    """Where an offline agent's dataset comes from: a file, or an env and kind in the cache."""

    dataset: Optional[str] = None
    """a D4RL-layout HDF5 file (envs/datasets.py); or give --env and --kind to use the cache"""
    kind: Optional[str] = None
    """dataset kind looked up in the cache with --env: random, medium, medium-replay, expert, medium-expert"""
    dataset_root: Optional[str] = None
    """dataset cache directory (default: $RLZOO_DATASETS or ~/.cache/rlzoo/datasets)"""


def check_replay(cfg: OffPolicyConfig):
    """Replay settings that are each valid (``OffPolicyConfig.RANGES``, checked by ``check_ranges``) but
    cannot work together (a ValueError naming the flags)."""
    if cfg.batch_size > cfg.buffer_size:
        raise ValueError(
            f"--batch-size {cfg.batch_size} is larger than --buffer-size {cfg.buffer_size}: "
            "every batch would repeat rows of a replay smaller than itself"
        )
    if cfg.updates_per_vector_step is not None and cfg.updates_per_step != 1:
        raise ValueError(
            f"--updates-per-vector-step {cfg.updates_per_vector_step} sets the updates per vector step itself; "
            f"--updates-per-step {cfg.updates_per_step} would be ignored: leave it at 1"
        )
