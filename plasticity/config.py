"""``PlasticityConfig``: plasticity metrics and interventions by flag (``--plasticity.*``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PlasticityConfig:
    """Plasticity metrics and interventions (ReDo, ReGraMa, NE, SIGReg, LEAST, Kron); periods count updates."""

    metrics_every: int = 10_000
    """log plasticity metrics every K gradient updates on a fixed held-out batch (0: off)"""
    metrics_batch: int = 256
    """size of the fixed held-out metrics batch"""
    redo: bool = False
    """ReDo: reset tau-dormant neurons (activation scores)"""
    regrama: bool = False
    """ReGraMa: reset neurons with small gradient magnitude (GraMa scores)"""
    reset_every: int = 1_000
    """reset period F in updates (ReDo and ReGraMa papers: 1000)"""
    redo_tau: float = 0.025
    regrama_tau: float = 0.01
    reset_max_fraction: float = 1.0
    """cap on the share of a layer's neurons reset per event (GraMa's SAC runs: 0.05)"""
    reset_layer_norm: bool = True
    """also restore the LayerNorm gain/bias of reset units (ReGraMa's code)"""
    reset_batch: int = 256
    """replay samples used to score neurons at each reset (and for gradients / FAU at each NE event)"""
    sigreg_coef: float = 0.0
    """SIGReg coefficient lambda on the representation feeding the heads (0: off; RL paper sweeps 0.2, 1.0)"""
    sigreg_variant: Literal["rl", "lejepa"] = "rl"
    sigreg_slices: int = 16
    least: bool = False
    """LEAST early episode termination (off-policy agents only)"""
    least_window: int = 250
    """K: episodes of Q / TD-loss history"""
    least_warmup: float = 0.1
    """share of total steps before LEAST may stop episodes (spec: 10-20% MuJoCo, 5-15% DMC)"""
    least_max_len: int = 1000
    """longest episode the histories track"""
    least_noise_max: float = 0.0
    """sigma-bar: raise the exploration noise toward this as more episodes stop early (0: off; spec 0.25-0.35 TD3)"""
    least_coef: float = 0.5
    """the 'omega coefficient' c scaling the TD-loss weight (spec: 0.3-0.6)"""
    ne: bool = False
    """Neuroplastic Expansion: start sparse, grow by gradient, prune dormant connections (spec 3)"""
    ne_every: int = 100
    """NE topology update period delta in updates (reference: 100 in train.py, 10000 in its README)"""
    ne_initial_sparsity: float = 0.8
    """NE sparsity at init, Erdős–Rényi per-layer densities"""
    ne_target_sparsity: float = 0.25
    """NE stops growing at this sparsity; then plain dynamic sparse training"""
    ne_schedule: Literal["cosine", "uniform"] = "uniform"
    """NE growth per event as a share r of the initial empty space: uniform r = 0.008 (the reference run's
    default), or cosine r = 0.25 (1 + cos(pi t / T)) (its --zeta 0.5 option: dense after 2-3 events)"""
    ne_init_space: Literal["reference", "full"] = "reference"
    """a layer's initial empty space that growth counts are a share of: reference = initial_sparsity x
    n_total - n_ones (the reference code's formula), full = n_total - n_ones"""
    ne_prune: Literal["magnitude", "redo"] = "magnitude"
    """NE pruning (0.4 x the grown count): smallest |w| (what the reference runs: its ReDo-score lookup
    never finds the activations), or ReDo-dormant units' incoming connections first"""
    ne_review: bool = False
    """NE experience review (the reference's --recall, off by default): sample from the oldest 30% of the
    buffer while the critic's FAU < 0.4 (off-policy agents on the shared uniform replay only)"""
    ne_auto_batch: Literal["auto", "on", "off"] = "auto"
    """NE auto batch (the reference's --auto_batch, on by default): while the critic's FAU < 0.36 the
    updates use half a batch (static shapes: each row of the first half counted twice).  auto = on
    for agents on the shared uniform replay (SAC family), off where it does not apply (PPO, MR.Q, RAVL)"""
    kron: bool = False
    """PSGD-Kron optimizer instead of Adam (lr / 3; needs the kron extra: psgdax)"""

    def validate(self):
        if self.redo and self.regrama:
            raise ValueError("--plasticity.redo and --plasticity.regrama are alternatives; pick one")
        for name in ("metrics_every", "reset_every", "metrics_batch", "reset_batch", "sigreg_slices"):
            if getattr(self, name) < 0:
                raise ValueError(f"--plasticity.{name.replace('_', '-')} must be >= 0")
        if not 0.0 < self.reset_max_fraction <= 1.0:
            raise ValueError("--plasticity.reset-max-fraction must be in (0, 1]")
        if not 0.0 <= self.least_warmup <= 1.0:
            raise ValueError("--plasticity.least-warmup must be in [0, 1]")
        if self.sigreg_coef < 0:
            raise ValueError("--plasticity.sigreg-coef must be >= 0")
        if self.ne:
            if self.ne_every < 1:
                raise ValueError("--plasticity.ne-every must be >= 1")
            if not 0.0 <= self.ne_target_sparsity < self.ne_initial_sparsity < 1.0:
                raise ValueError("NE needs 0 <= --plasticity.ne-target-sparsity < --plasticity.ne-initial-sparsity < 1")
            if self.ne_schedule not in ("cosine", "uniform"):
                raise ValueError("--plasticity.ne-schedule must be cosine or uniform")
            if self.ne_prune not in ("redo", "magnitude"):
                raise ValueError("--plasticity.ne-prune must be redo or magnitude")
            if self.ne_init_space not in ("reference", "full"):
                raise ValueError("--plasticity.ne-init-space must be reference or full")
            if self.ne_auto_batch not in ("auto", "on", "off"):
                raise ValueError("--plasticity.ne-auto-batch must be auto, on or off")
