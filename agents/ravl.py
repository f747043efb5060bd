"""RAVL: SAC-N with EDAC's diversity term, trained on real data mixed with short model rollouts.

Sims, Lu, Foerster, Teh, "The Edge-of-Reach Problem in Offline Model-Based RL", NeurIPS 2024
(arXiv 2402.12527) and its code (anyasims/edge-of-reach).
Rollouts truncated at k steps reach "edge-of-reach" states that are bootstrapped from but never
updated; RAVL drops the dynamics penalty of MOPO/MOBILE and lets the pessimism of a Q-ensemble
(min over N critics, EDAC's gradient diversity) absorb the resulting overestimation.

Algorithm (one epoch; the paper runs 3000 epochs of 1000 updates):

  0. once: fit the probabilistic dynamics ensemble on the dataset's true next observations
     (``agents/dynamics/``; 7 members, 5 elites) -- cached next to the dataset and reused
  1. sample ``rollout_batch`` (50k) states uniformly from the dataset
  2. roll the *stochastic* current policy out for k (5) steps in the model, a random elite per
     row; a branch stops after its first termination (the terminating transition is kept)
  3. push the valid transitions into a FIFO of ``retain_epochs`` (5) epochs of rollouts
  4. ``updates_per_epoch`` (1000) SAC-N/EDAC updates (agents/sac.py: temperature, actor,
     critics with min over N target critics + eta * diversity, Polyak), each on a batch of
     int(r * 256) dataset transitions and the rest from the model FIFO (r = 0.05 -> 12 real)

No reward penalty: the rollouts' rewards are the model's sampled rewards.

Defaults are the reference README's halfcheetah-medium setting (N = 10, eta = 1, k = 5,
r = 0.05); the paper tunes N, eta, k, r per task (its table is an image; not transcribed).
Measured here (docs/benchmarks.md): on our Hopper-v5 medium set k = 5 collapses below the
behaviour policy while ``--horizon 20`` beats it 2.4x (3 seeds, 150k-300k updates; on
medium-replay 4.0x against 3.3x with k = 5).
Networks are 3 x 256 ReLU with EDAC's initialisation (An et al., NeurIPS 2021, arXiv 2110.01548, as
in the reference's ``agent_training/agent.py``).  ``--network.*`` flags change them as for every
agent.  The dataset is given by ``--dataset PATH`` (D4RL HDF5 layout, envs/datasets.py) or
``--env hopper --kind medium`` (looked up in the dataset cache).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from plasticity_zoo.agents import dynamics as dynamics_lib
from plasticity_zoo.agents import sac
from plasticity_zoo.agents.api import OfflineDataConfig
from plasticity_zoo.agents.dynamics import DynamicsConfig
from plasticity_zoo.buffers import replay
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.envs import termination
from plasticity_zoo.networks.config import AT_LEAST_ONE, UNIT, NetworkConfig
from plasticity_zoo.plasticity.api import StaticPlasticity


@dataclass(frozen=True)
class RAVLConfig(sac.SACHyperparams, OfflineDataConfig):
    """RAVL (the paper and the reference README): SAC-N/EDAC hyperparameters, the data mix and the model rollouts."""

    critics: int = 10
    """N: critics in the Q-ensemble (the paper tunes over {10, 50})"""
    eta: float = 1.0
    """EDAC gradient-diversity coefficient"""
    edac_init: bool = True
    model: Optional[str] = None
    """a trained dynamics model (.npz from agents/dynamics/); default: <dataset>.dynamics-<seed>.npz,
    trained on first use and then reused"""
    batch_size: int = 256
    horizon: int = 5
    """k: model rollout length"""
    dataset_ratio: float = 0.05
    """r: share of each batch drawn from the real dataset (int(r * batch_size) rows)"""
    rollout_batch: int = 50_000
    """dataset states rolled out per epoch"""
    retain_epochs: int = 5
    """epochs of rollouts the model FIFO keeps (capacity rollout_batch * horizon * retain_epochs)"""
    updates_per_epoch: int = 1000
    dynamics: DynamicsConfig = field(default_factory=DynamicsConfig)
    """the dynamics ensemble (the reference's ``dynamics_training/``), as --dynamics.<field>"""

    RANGES = {
        "batch_size": AT_LEAST_ONE,
        "horizon": AT_LEAST_ONE,
        "dataset_ratio": UNIT,
        "rollout_batch": AT_LEAST_ONE,
        "retain_epochs": AT_LEAST_ONE,
        "updates_per_epoch": AT_LEAST_ONE,
    }

    def __post_init__(self):
        if isinstance(self.dynamics, dict):  # from config.json
            object.__setattr__(self, "dynamics", DynamicsConfig(**self.dynamics))


CONFIG = RAVLConfig
KIND = "offline"


class Data(NamedTuple):
    """What one seed learns from: the dataset and the FIFO of model rollouts."""

    real: Transition
    model: replay.Buffer


def init(
    key,
    obs_dim: int,
    act_dim: int,
    cfg: RAVLConfig,
    network: NetworkConfig = NetworkConfig(),
    plasticity: StaticPlasticity = StaticPlasticity(),
):
    """SAC-N/EDAC state with the reference's 3 x 256 networks (unless ``--network.depth`` says otherwise); ``sac.init``
    checks the ranges of both tables (``RAVLConfig.RANGES`` and SAC's)."""
    network = dataclasses.replace(network, depth=3 if network.depth is None else network.depth)
    return sac.init(key, obs_dim, act_dim, cfg, network, plasticity)


act = sac.act
update = sac.update
PLASTIC = sac.PLASTIC
PLASTIC_TARGETS = sac.PLASTIC_TARGETS
plastic_params = sac.plastic_params
plastic_nets = sac.plastic_nets
EXPERIENCE_REVIEW = False  # a fixed dataset: no online stream to review
plastic_losses = sac.plastic_losses
SIGREG_NETWORKS = sac.SIGREG_NETWORKS


def model_capacity(cfg: RAVLConfig) -> int:
    return cfg.rollout_batch * cfg.horizon * cfg.retain_epochs


def data_init(real: Transition, cfg: RAVLConfig) -> Data:
    obs_dim, act_dim = real.obs.shape[-1], real.action.shape[-1]
    return Data(real, replay.init(model_capacity(cfg), obs_dim, act_dim))


def real_count(cfg: RAVLConfig, batch_size: int | None = None) -> int:
    """Rows of a batch taken from the dataset: int(r * batch) (the reference's ``train_ravl_agent.py``;
    12 of 256 at r = 0.05)."""
    return int(cfg.dataset_ratio * (cfg.batch_size if batch_size is None else batch_size))


def sample_batch(state, data: Data, key, batch_size: int) -> Transition:
    """int(r * batch) uniform dataset rows followed by the rest from the model FIFO (r: ``state.cfg``)."""
    n_real = real_count(state.cfg, batch_size)
    k_real, k_model = jax.random.split(key)
    idx = jax.random.randint(k_real, (n_real,), 0, data.real.reward.shape[0])
    real = jax.tree.map(lambda x: x[idx], data.real)
    if n_real == batch_size:
        return real
    model = replay.sample(data.model, k_model, batch_size - n_real)
    return jax.tree.map(lambda a, b: jnp.concatenate([a.astype(b.dtype), b]), real, model)


def prepare(key, dataset, dataset_path, cfg: RAVLConfig, seed: int, log=print):
    """Step 0: the dynamics ensemble for this dataset (loaded from ``cfg.model`` / the cache or trained)."""
    return dynamics_lib.load_or_train(key, dataset, cfg.dynamics, model_path(dataset_path, seed), cfg.model, log)


def model_path(dataset_path, seed: int) -> Path:
    return Path(f"{dataset_path}.dynamics-{seed}.npz")


def rollouts(state, data: Data, model, key, cfg: RAVLConfig, done_fn):
    """Steps 1-3: k-step rollouts of the stochastic policy from dataset states into the FIFO."""
    k_start, k_roll = jax.random.split(key)
    idx = jax.random.randint(k_start, (cfg.rollout_batch,), 0, data.real.reward.shape[0])
    policy = lambda obs, k: sac.act(state, obs, k, explore=True)  # noqa: E731
    batch, valid = dynamics_lib.flatten(
        *dynamics_lib.rollout(model, policy, data.real.obs[idx], cfg.horizon, k_roll, done_fn)
    )
    stats = {
        "rollout/valid_fraction": valid.mean(),
        "rollout/terminated_fraction": (batch.terminated & valid).sum() / cfg.rollout_batch,
        "rollout/reward_mean": (batch.reward * valid).sum() / jnp.maximum(valid.sum(), 1),
    }
    return data._replace(model=replay.add_masked(data.model, batch, valid)), stats


def train_epoch(state, data: Data, model, key, cfg: RAVLConfig, done_fn):
    """One RAVL epoch for one seed: rollouts, then ``updates_per_epoch`` SAC-N/EDAC updates (one scan)."""
    k_roll, k_train = jax.random.split(key)
    data, stats = rollouts(state, data, model, k_roll, cfg, done_fn)

    def one(state, k):
        k_sample, k_update = jax.random.split(k)
        return update(state, sample_batch(state, data, k_sample, cfg.batch_size), k_update)

    state, metrics = jax.lax.scan(one, state, jax.random.split(k_train, cfg.updates_per_epoch))
    return state, data, {**jax.tree.map(lambda m: m.mean(), metrics), **stats}


def make_epoch(cfg: RAVLConfig, env_id: str):
    """The loop's per-seed epoch function, with the env's termination function (as in the reference's
    ``agent_training/rollout_generation.py``) bound."""
    done_fn = termination.termination_fn(env_id)
    return lambda state, data, model, key: train_epoch(state, data, model, key, cfg, done_fn)
