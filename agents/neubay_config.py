"""NeuBay's config and the paper's per-task presets (the learner is ``agents/neubay.py``).

Ni, Derman, Jain, Taboga, Ravanbakhsh, Bacon, "Long-Horizon Model-Based Offline RL Without
(Explicit) Conservatism" (arXiv 2512.04341): the defaults are the reference's base config for D4RL
locomotion (twni2016/neubay at 5604bad), the per-task encoder lr, ``real_weight`` and hopper's
fixed alpha come from the paper's appendix's hyperparameter table (``TASK_SETTINGS``,
``FIXED_ALPHA_ENVS``), and a run fills the fields left unset from its dataset (``with_dataset``:
the task's presets, the actor's cosine horizon, the env's episode limit, the world model's epoch
cap of the dataset kind), then ``BASE`` for the rest.  The world-model posterior's own config is
``agents/dynamics/config.py: neubay_config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from plasticity_zoo.agents import dynamics as dynamics_lib
from plasticity_zoo.agents.api import OfflineDataConfig
from plasticity_zoo.agents.dynamics import DynamicsConfig
from plasticity_zoo.envs import scores
from plasticity_zoo.networks.recurrent import RecurrentSpec

# The paper's per-task table (its appendix's hyperparameters): (encoder lr, real_weight) by D4RL task.
TASK_SETTINGS = {
    ("halfcheetah", "random"): (3e-5, 0.8),
    ("halfcheetah", "medium"): (3e-5, 0.8),
    ("halfcheetah", "medium-replay"): (1e-5, 0.05),
    ("halfcheetah", "medium-expert"): (3e-5, 0.8),
    ("hopper", "random"): (1e-5, 0.5),
    ("hopper", "medium"): (1e-6, 0.8),
    ("hopper", "medium-replay"): (3e-7, 0.5),
    ("hopper", "medium-expert"): (3e-6, 0.5),
    ("walker2d", "random"): (3e-5, 0.5),
    ("walker2d", "medium"): (3e-6, 0.5),
    ("walker2d", "medium-replay"): (1e-6, 0.5),
    ("walker2d", "medium-expert"): (1e-6, 0.8),
}
FIXED_ALPHA_ENVS = ("hopper",)  # the paper keeps alpha at 0.2 on hopper


# what an unset (None) per-task or per-run field becomes outside the tables: the reference's base config
BASE = {"encoder_lr": 1e-5, "real_weight": 0.05, "fixed_alpha": False, "updates": 2_000_000, "max_horizon": 1000}


@dataclass(frozen=True)
class NeuBayConfig(OfflineDataConfig):
    """NeuBay's hyperparameters (defaults: the reference's base config for D4RL locomotion).

    Fields left at None are set per run (``with_dataset``): the encoder lr, ``real_weight`` and
    hopper's fixed alpha from the paper's per-task table when the dataset names a D4RL-style task
    (``TASK_SETTINGS``; ``BASE`` otherwise), the actor's cosine horizon from ``--total-steps``, the
    imagination horizon from the env's episode limit.  A flag given on the command line wins."""

    critics: int = 10
    sampled_critics: int = 2
    """target heads drawn per update (REDQ's M)"""
    head_width: int = 256
    head_depth: int = 2
    d_model: int = 256
    d_hidden: int = 128
    lru_layers: int = 2
    r_max: float = 0.9
    markov: bool = False
    """the paper's Markov (MLP) ablation: actor and critics on the state, no recurrent encoder, uniform
    transitions instead of tapes"""
    encoder_lr: Optional[float] = None
    """the encoders' lr (None: the task's from the paper's table, 3e-7 .. 3e-5; else 1e-5)"""
    head_lr: float = 1e-4
    alpha_lr: float = 1e-4
    actor_lr_final_ratio: float = 0.0
    """the actor's lrs decay by a cosine to this fraction over ``updates`` steps (critic: constant)"""
    updates: Optional[int] = None
    """the actor's cosine horizon in gradient steps (None: the run's --total-steps; the paper: 2M)"""
    grad_clip: float = 1000.0
    gamma: float = 0.99
    tau: float = 0.005
    init_alpha: float = 0.2
    fixed_alpha: Optional[bool] = None
    """keep alpha at ``init_alpha`` (None: on hopper, as the paper)"""
    target_entropy: Optional[float] = None
    """None: -|A|"""
    real_weight: Optional[float] = None
    """weight of the real-data mean in every loss (None: the task's from the paper's table; else 0.05)"""
    tape_len: int = 2048
    """transitions per training batch (one tape of whole trajectories laid end to end)"""
    utd: float = 0.05
    """gradient steps per collected transition: each collection owes ceil(utd x its transitions)"""
    rollout_batch: int = 100
    """trajectories imagined per collection (one per posterior member)"""
    buffer_transitions: int = 40_000_000
    """the tape buffer's capacity (positions: transitions plus one final state per trajectory); a run
    that cannot fill it (--total-steps / utd) allocates only what it can use"""
    uncertainty_quantile: Optional[float] = 1.0
    """the truncation threshold's quantile of the dataset's uncertainties (None: no truncation)"""
    penalty: float = 0.0
    """MOPO-style reward penalty on the uncertainty (divided by its dataset mean); NeuBay: 0.  It comes
    off the rewards the critic learns; the agent's inputs keep the model's rewards, as when acting"""
    planning_members: int = 100
    """elites the imagination draws from, best first (the paper's ablation: 5, 20, 100)"""
    max_horizon: Optional[int] = None
    """trajectory length cap of tapes and imagination (None: the env's episode limit, 1000 for MuJoCo)"""
    model: Optional[str] = None
    """a trained world model (.npz from agents/dynamics/); default: <dataset>.neubay-<seed>.npz,
    trained on first use and then reused"""
    updates_per_epoch: int = 1000
    """gradient steps per jitted epoch (collections fall inside epochs, whenever the owed steps are done)"""
    dynamics: DynamicsConfig = field(default_factory=dynamics_lib.neubay_config)
    """the world-model posterior (the reference's ``offline_world/cont_ensemble.py``), as
    --dynamics.<field>; its epoch cap follows the dataset kind unless --dynamics.max-epochs is given"""

    def __post_init__(self):
        if isinstance(self.dynamics, dict):  # from config.json
            object.__setattr__(self, "dynamics", DynamicsConfig(**self.dynamics))
        if not 1 <= self.sampled_critics <= self.critics:
            raise ValueError(f"need 1 <= --sampled-critics <= --critics, got {self.sampled_critics}, {self.critics}")
        if self.real_weight is not None and not 0.0 <= self.real_weight <= 1.0:
            raise ValueError(f"--real-weight must be in [0, 1], got {self.real_weight}")
        for name in (
            "head_width",
            "head_depth",
            "d_model",
            "d_hidden",
            "lru_layers",
            "updates",
            "tape_len",
            "rollout_batch",
            "planning_members",
            "max_horizon",
            "updates_per_epoch",
            "buffer_transitions",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.tape_len < 2:
            raise ValueError("--tape-len must be >= 2 (a transition needs its next position)")
        if not 0.0 < self.utd <= 1000.0:
            raise ValueError(f"--utd must be in (0, 1000], got {self.utd}")
        if self.uncertainty_quantile is not None and not 0.0 <= self.uncertainty_quantile <= 1.0:
            raise ValueError(f"--uncertainty-quantile must be in [0, 1], got {self.uncertainty_quantile}")
        if self.planning_members > self.dynamics.elites:
            raise ValueError(
                f"--planning-members {self.planning_members} is more than the world model's "
                f"--dynamics.elites {self.dynamics.elites}"
            )

    @property
    def recurrent(self) -> RecurrentSpec:
        return RecurrentSpec(self.d_model, self.d_hidden, self.lru_layers, 0.0, self.r_max)


def resolved(cfg: NeuBayConfig) -> NeuBayConfig:
    """``cfg`` with every field still None set to its ``BASE`` value."""
    return dataclasses.replace(cfg, **{k: v for k, v in BASE.items() if getattr(cfg, k) is None})


def task_config(cfg: NeuBayConfig, env: str, kind: Optional[str], **overrides) -> NeuBayConfig:
    """``cfg`` with its unset (None) encoder lr, real_weight and fixed alpha taken from the paper's
    per-task table (``TASK_SETTINGS``; hopper: fixed alpha); ``overrides`` win, values already set in
    ``cfg`` are kept, and an env / kind outside the table leaves them unset."""
    base = (scores.d4rl_name(env) or env.split("-")[0]).lower()
    kw = {}
    if (base, kind) in TASK_SETTINGS:
        kw["encoder_lr"], kw["real_weight"] = TASK_SETTINGS[(base, kind)]
    kw["fixed_alpha"] = base in FIXED_ALPHA_ENVS
    kw = {k: v for k, v in kw.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **{**kw, **overrides})


def episode_limit(env_id: str) -> int:
    """The env's episode limit in steps (Gymnasium's registry), 1000 when it names none."""
    try:
        import gymnasium as gym

        return int(gym.spec(env_id).max_episode_steps or BASE["max_horizon"])
    except Exception:  # noqa: BLE001  (dmc:, ns: ids and unknown names: the MuJoCo default)
        return BASE["max_horizon"]


def with_dataset(cfg: NeuBayConfig, env_id: str, metadata: dict, total_updates: int) -> NeuBayConfig:
    """The config a run on this dataset trains with (``training/loops/offline.py`` calls it before ``init``):
    the per-task settings of the dataset's env and kind (``task_config``; the kind from its metadata,
    else ``--kind``), the actor's cosine over ``total_updates``, tapes cut at the env's episode
    limit, the world model's epoch cap of the kind (``dynamics.NEUBAY_EPOCH_CAPS``) unless
    --dynamics.max-epochs was given; then ``BASE`` for whatever is still unset."""
    kind = metadata.get("kind") or cfg.kind
    cfg = task_config(cfg, env_id, kind)
    if cfg.updates is None:
        cfg = dataclasses.replace(cfg, updates=int(total_updates))
    if cfg.max_horizon is None:
        cfg = dataclasses.replace(cfg, max_horizon=episode_limit(env_id))
    cap = dynamics_lib.NEUBAY_EPOCH_CAPS.get(kind)
    if cap is not None and cfg.dynamics.max_epochs == dynamics_lib.NO_EPOCH_CAP:
        cfg = dataclasses.replace(cfg, dynamics=dataclasses.replace(cfg.dynamics, max_epochs=cap))
    return resolved(cfg)
