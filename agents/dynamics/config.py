"""The ensemble's hyperparameters: ``DynamicsConfig``, whose defaults are RAVL's, and the
configurations of Unifloral (``unifloral_config``) and NeuBay (``neubay_config``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from plasticity_zoo.networks.blocks import ACTIVATIONS

ELITE_SAMPLING = ("row", "step", "trajectory")
TARGET_SCALING = ("none", "zscore")
INITS = ("trunc_normal", "uniform")


# ============================================================================ config


# per-layer weight decay of the MBPO ensemble as RAVL runs it (anyasims/edge-of-reach, dynamics_training/net.py)
MBPO_WEIGHT_DECAY = (2.5e-5, 5e-5, 7.5e-5, 7.5e-5, 1e-4)


@dataclass(frozen=True)
class DynamicsConfig:
    """Ensemble hyperparameters.  Defaults: the RAVL version (its reference code, anyasims/edge-of-reach).

    Unifloral (EmptyJackson/unifloral, ``algorithms/dynamics.py``): ``unifloral_config()``; NeuBay's
    world-model posterior (twni2016/neubay, ``offline_world/``): ``neubay_config(kind)``.
    """

    members: int = 7
    elites: int = 5
    width: int = 200
    depth: int = 4
    """hidden Linear layers per member (RAVL's ``dynamics_training/net.py``: 4 x 200)"""
    activation: str = "silu"
    """SiLU (RAVL's ``net.py``); ReLU (Unifloral's ``dynamics.py``); any name in networks.blocks.ACTIVATIONS"""
    layer_norm: bool = False
    """LayerNorm after each hidden Linear (NeuBay's blocks, its ``modules.py``; off in RAVL / Unifloral)"""
    normalize_inputs: bool = True
    """standardise (s, a) with the dataset's mean / std and clip to +-10 (RAVL's input filter); off in Unifloral"""
    input_clip: float = 10.0
    weight_decay: tuple = MBPO_WEIGHT_DECAY
    """per hidden layer, then one value for both heads (RAVL's reference code); weights only, as
    0.5 * wd * ||W||^2 added to the loss (= torch Adam's coupled weight_decay, which the
    reference uses).  A single float applies to every layer.  Length must be depth + 1; the
    default (the reference's 4-layer values) adapts to another depth (our reading): the first
    ``depth`` hidden values, the last hidden one repeated if deeper, then the heads' 1e-4."""
    adamw_weight_decay: float = 0.0
    """decoupled AdamW decay on every parameter (Unifloral's ``dynamics.py``: 2.5e-5); 0 = plain Adam"""
    lr: float = 1e-3
    batch_size: int = 256
    holdout: float = 0.2
    """fraction of the transitions held out for validation (RAVL's ``ensemble.py``)"""
    max_holdout: Optional[int] = None
    """cap on the number of held-out transitions (NeuBay: min(20%, 1000), its ``cont_ensemble.py``)"""
    bootstrap: bool = True
    """each member trains on a bootstrap resample of the training split (RAVL's ``ensemble.py``); the M
    resamples are dealt to the members anew each epoch, as the RAVL reference's ``train_dynamics_model.py`` does"""
    min_epochs: int = 350
    max_epochs: int = 2000
    patience: int = 5
    improvement: float = 0.01
    """relative val-MSE improvement of any member that counts as progress (RAVL's training script)"""
    lr_cut: float = 0.3
    """lr multiplier applied once when progress stalls before min_epochs (RAVL's reference); 1 = never"""
    max_logvar_init: float = 0.5
    min_logvar_init: float = -10.0
    logvar_range_coef: float = 0.01
    target_scaling: str = "none"
    """"none": targets (Δs, r) in raw units (RAVL, Unifloral); "zscore": NeuBay's (``modules.py: Scaler``), the
    next state z-scored and predicted as a residual on the z-scored state, i.e. Δs / std(s), and
    (r - mean r) / std(r).  The loss, the holdout MSE (so elites and early stopping) and the
    uncertainty are in these training units; ``predict`` and ``step`` return raw units either way."""
    learn_logvar_bounds: bool = True
    """True: per-dimension log-variance bounds are parameters trained with the ``logvar_range_coef``
    penalty (RAVL's reference).  False: the bounds stay at (min_logvar_init, max_logvar_init) and the same
    soft clamp is applied to log sigma = logvar / 2, as NeuBay clamps log sigma to [-5, 0.25]
    (``offline_world/modules.py``; the bounds get no gradient and no weight decay)"""
    head_output: str = "logvar"
    """with fixed bounds (``learn_logvar_bounds`` False), what the variance head's raw output is: "log_sigma"
    (NeuBay's reference code: log sigma, soft-clamped; ``neubay_config``) or "logvar" (2 log sigma, halved
    before the clamp: NeuBay models saved before the zoo matched the reference's head, which load with it)"""
    init: str = "trunc_normal"
    """Linear layers' initial weights: "trunc_normal" = the RAVL reference's N(0, 1/(2 sqrt(fan_in)))
    truncated at 2 std with zero biases; "uniform" = U(+-1/sqrt(fan_in)) for weights and biases
    (PyTorch's / Equinox's default, which NeuBay's reference code keeps)"""
    elite_sampling: str = "row"
    """which member produces each model step: "row" = a random elite per row per step (RAVL's
    ``rollout_generation.py``); "step" = one random elite per step for the whole batch (Unifloral's
    ``mopo.py``); "trajectory" = one random elite per rollout row for the whole rollout (NeuBay-like,
    its ``experience/collector.py``)"""

    def __post_init__(self):
        wd = self.weight_decay
        wd = (float(wd),) * (self.depth + 1) if isinstance(wd, (int, float)) else tuple(float(w) for w in wd)
        if wd == MBPO_WEIGHT_DECAY and self.depth != len(wd) - 1:
            hidden = (wd[:-1] + (wd[-2],) * self.depth)[: self.depth]
            wd = hidden + (wd[-1],)
        elif len(set(wd)) == 1 and len(wd) != self.depth + 1:  # one value (or a uniform default): every layer
            wd = (wd[0],) * (self.depth + 1)
        object.__setattr__(self, "weight_decay", wd)
        if len(wd) != self.depth + 1:
            raise ValueError(
                f"weight_decay needs depth + 1 = {self.depth + 1} values (one per hidden layer, "
                f"then the heads), got {len(wd)}"
            )
        if not 1 <= self.elites <= self.members:
            raise ValueError(f"need 1 <= elites <= members, got elites={self.elites}, members={self.members}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; choose from {sorted(ACTIVATIONS)}")
        if self.target_scaling not in TARGET_SCALING:
            raise ValueError(f"target_scaling must be one of {TARGET_SCALING}, got {self.target_scaling!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if not self.input_clip > 0:
            raise ValueError(f"input_clip must be positive (inf: no clip), got {self.input_clip}")
        if self.elite_sampling not in ELITE_SAMPLING:
            raise ValueError(f"elite_sampling must be one of {ELITE_SAMPLING}, got {self.elite_sampling!r}")
        if self.head_output not in ("log_sigma", "logvar"):
            raise ValueError(f"head_output must be 'log_sigma' or 'logvar', got {self.head_output!r}")
        if not 0.0 < self.holdout < 1.0:
            raise ValueError(f"holdout must be a fraction in (0, 1), got {self.holdout}")
        if self.max_holdout is not None and self.max_holdout < 1:
            raise ValueError(f"max_holdout must be >= 1 (or None), got {self.max_holdout}")
        if not 0 <= self.min_epochs <= self.max_epochs or self.max_epochs < 1:
            raise ValueError(
                f"need 0 <= min_epochs <= max_epochs and max_epochs >= 1, got {self.min_epochs}, {self.max_epochs}"
            )
        if self.patience < 1 or self.batch_size < 1 or self.width < 1 or self.depth < 1:
            raise ValueError("patience, batch_size, width and depth must be positive")
        if not 0.0 < self.lr_cut <= 1.0:
            raise ValueError(f"lr_cut must be in (0, 1], got {self.lr_cut}")
        if self.min_logvar_init >= self.max_logvar_init:
            raise ValueError("min_logvar_init must be below max_logvar_init")


def unifloral_config(**overrides) -> DynamicsConfig:
    """Unifloral's ``algorithms/dynamics.py``: 4 x 200 ReLU, no input normalisation, AdamW (1e-3, wd
    2.5e-5), a fixed 400 epochs; elite resampled every step (its ``algorithms/mopo.py``).  No coupled
    L2 term (our reading)."""
    kw = dict(
        activation="relu",
        normalize_inputs=False,
        weight_decay=0.0,
        adamw_weight_decay=2.5e-5,
        min_epochs=400,
        max_epochs=400,
        lr_cut=1.0,
        elite_sampling="step",
    )
    return DynamicsConfig(**{**kw, **overrides})


NO_EPOCH_CAP = 1_000_000
NEUBAY_EPOCH_CAPS = {"random": 1200, "medium": 1200, "medium-expert": 600, "medium-replay": None}
"""NeuBay's epoch caps by dataset kind (its README's ``ensemble.total_epochs``; None: early stopping alone
ends training)."""


def neubay_config(kind: Optional[str] = None, **overrides) -> DynamicsConfig:
    """NeuBay's world-model posterior (Ni et al., arXiv 2512.04341; ``offline_world/cont_ensemble.py``).

    128 members of 4 blocks (Linear -> LayerNorm -> leaky-ReLU, 200 units); z-scored inputs (no
    clip) and z-scored residual targets; log sigma soft-clamped to [-5, 0.25]; Gaussian NLL; AdamW
    (lr 1e-3, decoupled weight decay 5e-5), batch 256; holdout min(20%, 1000); every member sees the
    whole training split in its own order each epoch (no bootstrap); stop after 5 epochs without a
    member improving its holdout MSE by more than 1%, no minimum and no lr cut; the epoch cap of the
    dataset ``kind`` (``NEUBAY_EPOCH_CAPS``; kinds outside that table get none, our reading); the
    best 100 of 128 members by holdout MSE are the elites; one member per imagined trajectory.
    """
    if kind is not None and kind not in NEUBAY_EPOCH_CAPS:
        cap = None  # e.g. "expert", "full-replay": the paper gives no cap for them
    else:
        cap = NEUBAY_EPOCH_CAPS.get(kind) if kind is not None else None
    kw = dict(
        members=128,
        elites=100,
        width=200,
        depth=4,
        activation="leaky_relu",
        layer_norm=True,
        normalize_inputs=True,
        input_clip=math.inf,
        weight_decay=0.0,
        adamw_weight_decay=5e-5,
        lr=1e-3,
        batch_size=256,
        holdout=0.2,
        max_holdout=1000,
        bootstrap=False,
        min_epochs=0,
        max_epochs=NO_EPOCH_CAP if cap is None else cap,
        patience=5,
        improvement=0.01,
        lr_cut=1.0,
        max_logvar_init=0.5,
        min_logvar_init=-10.0,
        logvar_range_coef=0.0,
        learn_logvar_bounds=False,
        target_scaling="zscore",
        init="uniform",
        elite_sampling="trajectory",
        head_output="log_sigma",
    )
    return DynamicsConfig(**{**kw, **overrides})
