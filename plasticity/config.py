"""``PlasticityConfig``: plasticity metrics and interventions by flag (``--plasticity.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plasticity_zoo.networks.config import AT_LEAST_ONE, NON_NEGATIVE, UNIT, Range, check_ranges


@dataclass(frozen=True)
class PlasticityConfig:
    """Plasticity metrics and interventions (ReDo, ReGraMa, NE, SIGReg, LEAST, Kron, ...); periods count updates."""

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
    shrink_perturb: bool = False
    """Shrink & Perturb (Ash & Adams 2020): every sp-every updates theta <- sp-shrink * theta + sp-perturb *
    a fresh draw of the network's initialiser (defaults: Plasticine's, after every update)"""
    sp_every: int = 1
    """Shrink & Perturb period in updates"""
    sp_shrink: float = 0.999999
    """Shrink & Perturb lambda, in (0, 1]"""
    sp_perturb: float = 1e-6
    """Shrink & Perturb sigma, >= 0 (Plasticine: 1 - lambda)"""
    layer_reset: bool = False
    """layer resets (Nikishin et al. 2022, primacy bias): re-draw the last layer-reset-layers layers of every
    plastic network every layer-reset-every updates, with fresh optimizer moments; targets follow"""
    layer_reset_every: int = 200_000
    """layer reset period in updates (the paper's SAC on DMC: 2e5)"""
    layer_reset_layers: int = 0
    """how many layers, counted from the output, a layer reset re-draws (0: the whole network, the paper's SAC)"""
    sigreg_coef: float = 0.0
    """SIGReg coefficient lambda on the representation feeding the heads (0: off; RL paper sweeps 0.2, 1.0)"""
    sigreg_variant: Literal["rl", "lejepa"] = "rl"
    sigreg_slices: int = 16
    least: bool = False
    """LEAST early episode termination (off-policy agents only)"""
    least_window: int = 250
    """K: episodes of Q / TD-loss history"""
    least_warmup: float = 0.1
    """share of total steps before LEAST may stop episodes (LEAST's settings: 10-20% MuJoCo, 5-15% DMC)"""
    least_max_len: int = 1000
    """longest episode the histories track"""
    least_noise_max: float = 0.0
    """sigma-bar: raise the exploration noise toward this as more episodes stop early (0: off; LEAST: 0.25-0.35 TD3)"""
    least_coef: float = 0.5
    """the 'omega coefficient' c scaling the TD-loss weight (LEAST: 0.3-0.6)"""
    ne: bool = False
    """Neuroplastic Expansion: start sparse, grow by gradient, prune dormant connections (Liu et al., ICLR 2025)"""
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
    l2: float = 0.0
    """L2 toward 0 in the loss: lambda ||theta||^2 over every parameter of the plastic networks, its gradient
    2 lambda theta added before the optimizer (not decoupled weight decay; 0: off)"""
    l2_init: float = 0.0
    """L2 Init / regenerative regularisation (Kumar et al. 2023, sec. 3): lambda ||theta - theta_0||^2 toward the
    initial parameters, every parameter of the plastic networks (0: off; preset l2-init)"""
    parseval: float = 0.0
    """Parseval regularisation (Chung et al. 2024, sec. 3): lambda (64 / m)^2 ||W W^T - s I||_F^2 on every hidden
    layer, per ensemble member (0: off; the paper's continuous-control setting 1e-4: preset parseval)"""
    parseval_scale: float = 2.0
    """Parseval's s: the rows' target squared norm (2: the authors' code, their init gain sqrt 2 squared)"""
    nap: bool = False
    """Normalize-and-Project (Lyle et al. 2024, sec. 4): after every step each hidden layer (kernel and bias) and
    LayerNorm (scale and offset) is rescaled to its initial norm; needs --network.layer-norm (preset nap)"""
    injection_step: int = 0
    """Plasticity injection (Nikishin et al. 2023, sec. 3): after this many updates freeze each network's head
    theta and add a fresh head theta' minus a frozen copy of it, h_theta + h_theta' - h_theta'_frozen (0: off)"""
    injection_at: float = 0.0
    """Plasticity injection at this share of the run's updates, in (0, 1) (0: off; instead of injection-step)"""
    injection_layers: int = 2
    """the head plasticity injection replaces: the last k layers of each network, output layer included
    (0: the whole network; the paper's DQN head is its two fully connected layers)"""
    trac: bool = False
    """TRAC (Muppidi et al. 2024, Algorithm 1): a parameter-free scale tuner over every plastic network's
    optimizer (Adam), theta = theta_ref + S Delta with S from the erfi tuner over six betas (preset trac)"""
    trac_s_init: float = 1e-8
    """TRAC's s_init (the authors' package: 1e-8)"""

    # Dormancy thresholds are shares of a layer's mean score: at 1 or more, every unit at or below the
    # layer's mean counts as dormant.
    RANGES = {
        "metrics_every": NON_NEGATIVE,
        "metrics_batch": NON_NEGATIVE,
        "reset_every": NON_NEGATIVE,
        "redo_tau": Range(0, 1, high_open=True),
        "regrama_tau": Range(0, 1, high_open=True),
        "reset_max_fraction": Range(0, 1, low_open=True),
        "reset_batch": NON_NEGATIVE,
        "sigreg_coef": NON_NEGATIVE,
        "sigreg_slices": NON_NEGATIVE,
        "least_window": AT_LEAST_ONE,
        "least_warmup": UNIT,
        "least_max_len": AT_LEAST_ONE,
        "least_noise_max": NON_NEGATIVE,
        "least_coef": NON_NEGATIVE,
        "ne_every": AT_LEAST_ONE,
        "sp_every": AT_LEAST_ONE,
        "sp_shrink": Range(0, 1, low_open=True),
        "sp_perturb": NON_NEGATIVE,
        "layer_reset_every": AT_LEAST_ONE,
        "layer_reset_layers": NON_NEGATIVE,
        "injection_step": NON_NEGATIVE,
        "injection_at": Range(0, 1, high_open=True),
        "injection_layers": NON_NEGATIVE,
        "trac_s_init": Range(0, low_open=True),
    }

    @property
    def injects(self) -> bool:
        """Whether plasticity injection is on (``injection_step`` or ``injection_at``)."""
        return self.injection_step > 0 or self.injection_at > 0

    def validate(self):
        check_ranges(self, prefix="--plasticity.")
        if self.redo and self.regrama:
            raise ValueError("--plasticity.redo and --plasticity.regrama are alternatives; pick one")
        if self.ne:
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
        check_ranges(
            self,
            prefix="--plasticity.",
            ranges={
                "l2": NON_NEGATIVE,
                "l2_init": NON_NEGATIVE,
                "parseval": NON_NEGATIVE,
                "parseval_scale": Range(0, low_open=True),
            },
        )
        if self.injection_step and self.injection_at:
            raise ValueError(
                "--plasticity.injection-step and --plasticity.injection-at both set the injection's update; pick one"
            )
        if self.injects and self.ne:
            raise ValueError(
                "--plasticity.injection-step/-at does not combine with --plasticity.ne: NE grows and prunes the "
                "connections of every layer, the frozen copy theta'_frozen's included, so theta' - theta'_frozen "
                "would no longer cancel at the injection"
            )
        if self.injects and self.layer_reset:
            raise ValueError(
                "--plasticity.injection-step/-at and --plasticity.layer-reset are alternatives (Nikishin et al. "
                "2023 propose injection in place of resets): pick one"
            )
        if self.nap and self.ne:
            raise ValueError(
                "--plasticity.nap does not combine with --plasticity.ne: NaP holds each layer at its "
                "initial norm while NE changes how many connections the layer has"
            )
