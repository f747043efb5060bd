"""Probabilistic dynamics ensemble for the offline model-based agents (RAVL, MOPO-style, NeuBay-like).

Follows the ensemble of RAVL (Sims et al., NeurIPS 2024; adapted there from MBPO, Janner et al. 2019)
with the variants of Unifloral (Jackson et al., NeurIPS 2025, ``algorithms/dynamics.py``) and NeuBay
(Ni et al., arXiv 2512.04341) as config options; it trains on the dataset's true next observations
(never ``observations[i+1]``, D4RL's ``qlearning_dataset`` pitfall), ends rollouts with Gymnasium
v5's termination rules (``envs/termination.py``) and rolls out as RAVL's and Unifloral's model-based
loops do.  Anything marked "our reading" is not fixed by those papers; most of it follows the RAVL
reference code (anyasims/edge-of-reach, ``dynamics_training/{net,ensemble}.py``,
``train_dynamics_model.py``).
Bare "section N" tags below name topics of the project's offline implementation notes: 1.2 true
next observations, 3.1 RAVL's ensemble, 3.2 Unifloral's, 3.3 the variants compared, 6.3 Unifloral's
model-based loop, 7.1 NeuBay's world model.

Reading order: config (``unifloral_config``, ``neubay_config``) -> network -> loss -> early stopping
-> ``train`` -> ``DynamicsModel``, ``predict``, ``epistemic_uncertainty``, ``uncertainty_threshold``,
``step`` -> ``rollout`` -> ``save`` / ``load``.

Shapes: M = members, B = batch, O = obs dim, A = action dim, D = O + 1 (target (Δs, r)).

    model, info = train(key, obs, actions, rewards, next_obs, DynamicsConfig())
    mean, logvar = predict(model, obs, action)               # (M, B, D) each, raw target units
    next_obs, reward = step(model, obs, action, key)         # (B, O), (B,)
    done_fn = envs.termination.termination_fn("Hopper-v5")   # next_obs (B, O) -> bool (B,)
    batch, valid = rollout(model, policy, start, 5, key, done_fn)   # (H, B, ...) and (H, B)
    save("model.npz", model); model = load("model.npz")
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.networks import Net, Trunk, TrunkSpec
from plasticity_zoo.networks.blocks import ACTIVATIONS
from plasticity_zoo.networks.core import path_names, uniform_fan_in

ELITE_SAMPLING = ("row", "step", "trajectory")
TARGET_SCALING = ("none", "zscore")
INITS = ("trunc_normal", "uniform")
_VAL_CHUNK = 8192  # holdout rows per forward pass when computing validation MSE (memory bound only)
_FORMAT = 1  # save-file format version


# ============================================================================ config


SPEC_WEIGHT_DECAY = (2.5e-5, 5e-5, 7.5e-5, 7.5e-5, 1e-4)


@dataclass(frozen=True)
class DynamicsConfig:
    """Ensemble hyperparameters.  Defaults: the RAVL version (its reference code, anyasims/edge-of-reach).

    Unifloral (section 3.2): ``unifloral_config()``; NeuBay's world-model posterior (section 7.1):
    ``neubay_config(kind)``.
    """

    members: int = 7
    elites: int = 5
    width: int = 200
    depth: int = 4
    """hidden Linear layers per member (section 3.1: 4 x 200)"""
    activation: str = "silu"
    """section 3.1 SiLU; section 3.2 (Unifloral) ReLU; any name in networks.blocks.ACTIVATIONS"""
    layer_norm: bool = False
    """LayerNorm after each hidden Linear (NeuBay's blocks, section 7.1; off in RAVL / Unifloral)"""
    normalize_inputs: bool = True
    """standardise (s, a) with the dataset's mean / std and clip to +-10 (section 3.1); off in Unifloral"""
    input_clip: float = 10.0
    weight_decay: tuple = SPEC_WEIGHT_DECAY
    """per hidden layer, then one value for both heads (RAVL's reference code); weights only, as
    0.5 * wd * ||W||^2 added to the loss (= torch Adam's coupled weight_decay, which the
    reference uses).  A single float applies to every layer.  Length must be depth + 1; the
    default (the reference's 4-layer values) adapts to another depth (our reading): the first
    ``depth`` hidden values, the last hidden one repeated if deeper, then the heads' 1e-4."""
    adamw_weight_decay: float = 0.0
    """decoupled AdamW decay on every parameter (Unifloral, section 3.2: 2.5e-5); 0 = plain Adam"""
    lr: float = 1e-3
    batch_size: int = 256
    holdout: float = 0.2
    """fraction of the transitions held out for validation (section 3.1)"""
    max_holdout: Optional[int] = None
    """cap on the number of held-out transitions (NeuBay: min(20%, 1000), section 7.1)"""
    bootstrap: bool = True
    """each member trains on a bootstrap resample of the training split (section 3.1); the M resamples are
    dealt to the members anew each epoch, as the RAVL reference's ``train_dynamics_model.py`` does"""
    min_epochs: int = 350
    max_epochs: int = 2000
    patience: int = 5
    improvement: float = 0.01
    """relative val-MSE improvement of any member that counts as progress (section 3.1)"""
    lr_cut: float = 0.3
    """lr multiplier applied once when progress stalls before min_epochs (section 3.1); 1 = never"""
    max_logvar_init: float = 0.5
    min_logvar_init: float = -10.0
    logvar_range_coef: float = 0.01
    target_scaling: str = "none"
    """"none": targets (Δs, r) in raw units (sections 3.1, 3.2); "zscore": NeuBay's (section 7.1), the
    next state z-scored and predicted as a residual on the z-scored state, i.e. Δs / std(s), and
    (r - mean r) / std(r).  The loss, the holdout MSE (so elites and early stopping) and the
    uncertainty are in these training units; ``predict`` and ``step`` return raw units either way."""
    learn_logvar_bounds: bool = True
    """True: per-dimension log-variance bounds are parameters trained with the ``logvar_range_coef``
    penalty (section 3.1).  False: the bounds stay at (min_logvar_init, max_logvar_init) and the same
    soft clamp is applied to log sigma = logvar / 2, as NeuBay clamps log sigma to [-5, 0.25]
    (section 7.1; the bounds get no gradient and no weight decay)"""
    head_output: str = "logvar"
    """with fixed bounds (``learn_logvar_bounds`` False), what the variance head's raw output is: "log_sigma"
    (NeuBay's reference code: log sigma, soft-clamped; ``neubay_config``) or "logvar" (2 log sigma, halved
    before the clamp: NeuBay models saved before the zoo matched the reference's head, which load with it)"""
    init: str = "trunc_normal"
    """Linear layers' initial weights: "trunc_normal" = the RAVL reference's N(0, 1/(2 sqrt(fan_in)))
    truncated at 2 std with zero biases; "uniform" = U(+-1/sqrt(fan_in)) for weights and biases
    (PyTorch's / Equinox's default, which NeuBay's reference code keeps)"""
    elite_sampling: str = "row"
    """which member produces each model step: "row" = a random elite per row per step (RAVL,
    section 3.1); "step" = one random elite per step for the whole batch (Unifloral, section 6.3);
    "trajectory" = one random elite per rollout row for the whole rollout (NeuBay-like, 7.2)"""

    def __post_init__(self):
        wd = self.weight_decay
        wd = (float(wd),) * (self.depth + 1) if isinstance(wd, (int, float)) else tuple(float(w) for w in wd)
        if wd == SPEC_WEIGHT_DECAY and self.depth != len(wd) - 1:
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
    """Section 3.2: 4 x 200 ReLU, no input normalisation, AdamW (1e-3, wd 2.5e-5), a fixed 400
    epochs, elite resampled every step (section 6.3).  No coupled L2 term (our reading)."""
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
"""Section 7.1: NeuBay's epoch caps by dataset kind (None: early stopping alone ends training)."""


def neubay_config(kind: Optional[str] = None, **overrides) -> DynamicsConfig:
    """NeuBay's world-model posterior (Ni et al., arXiv 2512.04341; section 7.1).

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


# ============================================================================ network


def soft_clamp(logvar, max_logvar, min_logvar):
    """Section 3.1's soft bounds: lv <- max - softplus(max - lv); lv <- min + softplus(lv - min).

    The result lies in [min, max + log(1 + exp(-(max - min)))]: the second softplus can lift a value
    pinned at ``max`` by at most log1p(exp(min - max)) (2.7e-5 at the initial 0.5 / -10 bounds).
    """
    logvar = max_logvar - jax.nn.softplus(max_logvar - logvar)
    return min_logvar + jax.nn.softplus(logvar - min_logvar)


def _trunc_normal(key, shape, fan_in):
    """The reference's init (our reading of the reference code): N(0, s) truncated at +-2s, s = 1/(2 sqrt(fan_in))."""
    std = 1.0 / (2.0 * math.sqrt(fan_in))
    return std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)


def _init_linear(layer, cfg: "DynamicsConfig", rngs: nnx.Rngs):
    """Re-draw one Linear layer's params by ``cfg.init``."""
    fan_in = layer.kernel[...].shape[0]
    if cfg.init == "uniform":
        layer.kernel[...] = uniform_fan_in(rngs.params(), layer.kernel[...].shape, fan_in)
        layer.bias[...] = uniform_fan_in(rngs.params(), layer.bias[...].shape, fan_in)
    else:
        layer.kernel[...] = _trunc_normal(rngs.params(), layer.kernel[...].shape, fan_in)
        layer.bias[...] = jnp.zeros_like(layer.bias[...])


class GaussianDynamics(nnx.Module):
    """One member: instrumented trunk -> separate linear heads for the mean and the log-variance of
    (Δs, r), with learned per-dimension log-variance bounds (section 3.1).

    ``__call__(x, probes) -> ((mean, logvar), taps)``; ``taps`` as every ``networks`` head (hidden
    activations + ``"features"``), so plasticity metrics can read the dynamics trunk too.  Each
    member has its own bounds (our reading: the RAVL reference shares one pair across members).
    """

    def __init__(self, in_dim: int, out_dim: int, cfg: DynamicsConfig, *, rngs: nnx.Rngs):
        spec = TrunkSpec(cfg.width, cfg.depth, "mlp", cfg.activation, cfg.layer_norm)
        self.trunk = Trunk(in_dim, spec, rngs=rngs)
        if cfg.init == "trunc_normal":  # (the draws of the reference-RAVL default, in their original order)
            for layer in self.trunk.layers:  # zero biases already (hidden_bias_init = 0)
                layer.kernel[...] = _trunc_normal(rngs.params(), layer.kernel[...].shape, layer.kernel[...].shape[0])
            zeros = nnx.initializers.zeros
            head = lambda: nnx.Linear(  # noqa: E731
                cfg.width,
                out_dim,
                rngs=rngs,
                bias_init=zeros,
                kernel_init=lambda k, s, d=jnp.float32: _trunc_normal(k, s, s[0]).astype(d),
            )
            self.mean = head()
            self.logvar = head()
        else:
            self.mean = nnx.Linear(cfg.width, out_dim, rngs=rngs)
            self.logvar = nnx.Linear(cfg.width, out_dim, rngs=rngs)
            for layer in (*self.trunk.layers, self.mean, self.logvar):
                _init_linear(layer, cfg, rngs)
        self.max_logvar = nnx.Param(jnp.full((out_dim,), cfg.max_logvar_init, jnp.float32))
        self.min_logvar = nnx.Param(jnp.full((out_dim,), cfg.min_logvar_init, jnp.float32))
        self.learn_bounds, self.head_output = cfg.learn_logvar_bounds, cfg.head_output

    def __call__(self, x, probes=None):
        h, taps = self.trunk(x, probes)
        raw = self.logvar(h)
        if self.learn_bounds:
            logvar = soft_clamp(raw, self.max_logvar[...], self.min_logvar[...])
        else:  # NeuBay: log sigma soft-clamped to [min / 2, max / 2] with fixed bounds
            hi, lo = jax.lax.stop_gradient(self.max_logvar[...]), jax.lax.stop_gradient(self.min_logvar[...])
            log_sigma = raw if self.head_output == "log_sigma" else 0.5 * raw
            logvar = 2.0 * soft_clamp(log_sigma, 0.5 * hi, 0.5 * lo)
        return (self.mean(h), logvar), {**taps, "features": h}


@functools.lru_cache(maxsize=32)
def _initializer(obs_dim: int, act_dim: int, cfg: DynamicsConfig):
    """(Net, jitted key -> params), cached per shape and config.

    The same construction as ``networks.build(..., ensemble=members)`` (one module for the graph
    definition, ``Net.init`` vmapped over split keys, identical params), but jitted and reused:
    building an NNX ensemble eagerly under ``vmap`` costs seconds per call on a CPU.
    """
    make = lambda r: GaussianDynamics(obs_dim + act_dim, obs_dim + 1, cfg, rngs=r)  # noqa: E731
    graphdef = nnx.split(make(nnx.Rngs(0)), nnx.Param)[0]
    net = Net("dynamics", graphdef, cfg.members, make)
    return net, jax.jit(net.init)


def _build(key, obs_dim: int, act_dim: int, cfg: DynamicsConfig):
    """-> (Net named "dynamics", params with a leading member axis M)."""
    shape_cfg = DynamicsConfig(
        members=cfg.members,
        elites=1,
        width=cfg.width,
        depth=cfg.depth,
        activation=cfg.activation,
        layer_norm=cfg.layer_norm,
        weight_decay=0.0,
        max_logvar_init=cfg.max_logvar_init,
        min_logvar_init=cfg.min_logvar_init,
        learn_logvar_bounds=cfg.learn_logvar_bounds,
        head_output=cfg.head_output,
        init=cfg.init,
    )
    net, init = _initializer(obs_dim, act_dim, shape_cfg)  # only the fields the module reads
    return net, init(key)


def decay_coefficients(params, cfg: DynamicsConfig):
    """A pytree like ``params``: each Linear kernel's coefficient (hidden layer i: wd[i]; both heads:
    wd[-1]), 0 for biases, LayerNorm and the log-variance bounds."""

    def coef(path, _):
        names = path_names(path)
        if names[-1] != "kernel":
            return 0.0
        if names[0] == "trunk":
            return cfg.weight_decay[names[2]]
        return cfg.weight_decay[-1]

    return jax.tree_util.tree_map_with_path(coef, params)


def _leaf(params, name):
    """The (M, D) array of a top-level parameter (``max_logvar`` / ``min_logvar``)."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if path_names(path) == (name,):
            return x
    raise KeyError(name)


# ============================================================================ loss


def gaussian_nll(mean, logvar, target):
    """Section 3.1: mean over batch and dimensions of logvar + err^2 e^-logvar (no constants).

    ``mean``, ``logvar``, ``target``: (..., B, D) -> (...,)."""
    return (logvar + (target - mean) ** 2 * jnp.exp(-logvar)).mean(axis=(-2, -1))


def ensemble_loss(params, net: Net, x, y, cfg: DynamicsConfig):
    """Summed over members (each member's gradient only sees its own term) -> (total, per-member NLL).

    Per member: gaussian_nll + logvar_range_coef * (sum max_lv - sum min_lv) + sum_l 0.5 wd_l ||W_l||^2.
    ``x``: (M, B, O + A) normalised inputs, one batch per member; ``y``: (M, B, D) raw (Δs, r).
    """
    mean, logvar = net(params, x, member_inputs=True)
    nll = gaussian_nll(mean, logvar, y)  # (M,)
    bounds = cfg.logvar_range_coef * (_leaf(params, "max_logvar").sum(-1) - _leaf(params, "min_logvar").sum(-1))
    if not cfg.learn_logvar_bounds:
        bounds = 0.0
    decay = jax.tree.map(
        lambda w, c: 0.5 * c * (w**2).reshape(w.shape[0], -1).sum(-1), params, decay_coefficients(params, cfg)
    )
    l2 = sum(jax.tree.leaves(decay))
    return (nll + bounds + l2).sum(), nll


# ============================================================================ early stopping


class EarlyStopping:
    """Section 3.1's rule over per-member validation MSEs (host side, one call per epoch).

    ``update(epoch, val_mse) -> (improved, action)``: ``improved[m]`` when member m's MSE is more than
    ``improvement`` (relative) below its best so far; its best (and, in ``train``, its kept params) is
    then replaced.  As in the reference, smaller gains neither count as progress nor replace the best.
    Epoch 0 (before training) only sets the bests.  After ``patience`` epochs in a row without any
    member improving: ``"stop"`` once ``epoch > min_epochs``; before that, ``"cut_lr"`` the first
    time (our reading of "cut the lr once"), then keep going; ``"stop"`` also at ``max_epochs``.
    """

    def __init__(self, cfg: DynamicsConfig, members: int):
        self.cfg = cfg
        self.best = np.full(members, np.inf)
        self.stall = 0
        self.lr_cut_at: Optional[int] = None

    def update(self, epoch: int, val_mse) -> tuple[np.ndarray, str]:
        cfg = self.cfg
        val = np.asarray(val_mse, np.float64)
        improved = val < self.best * (1.0 - cfg.improvement)  # (best - val) / best > improvement; NaN never
        self.best = np.where(improved, val, self.best)
        if epoch == 0:
            return improved, "continue"
        self.stall = 0 if improved.any() else self.stall + 1
        if epoch >= cfg.max_epochs:
            return improved, "stop"
        if self.stall >= cfg.patience:
            if epoch > cfg.min_epochs:  # the reference's 0-based ``i >= min_epochs``
                return improved, "stop"
            if self.lr_cut_at is None and cfg.lr_cut < 1.0:
                self.lr_cut_at, self.stall = epoch, 0
                return improved, "cut_lr"
        return improved, "continue"


# ============================================================================ training


def _decayed(params):
    """AdamW's mask when the log-variance bounds are fixed: every parameter but the bounds."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: path_names(path)[-1] not in ("max_logvar", "min_logvar"), params
    )


def _optimizer(cfg: DynamicsConfig):
    if cfg.adamw_weight_decay <= 0:
        return optax.inject_hyperparams(optax.adam)(learning_rate=cfg.lr)
    mask = None if cfg.learn_logvar_bounds else _decayed
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=cfg.lr, weight_decay=cfg.adamw_weight_decay, mask=mask
    )


def _epoch_cfg(cfg: DynamicsConfig) -> DynamicsConfig:
    """``cfg`` with the fields the jitted epoch never reads set to fixed values, so models that differ
    only in stopping / holdout / sampling settings share one compiled epoch."""
    return replace(
        cfg,
        elites=1,
        min_epochs=0,
        max_epochs=1,
        patience=1,
        improvement=0.0,
        lr_cut=1.0,
        holdout=0.5,
        max_holdout=None,
        elite_sampling="row",
        lr=1e-3,
        target_scaling="none",
        normalize_inputs=True,
        input_clip=10.0,
        max_logvar_init=0.5,
        min_logvar_init=-10.0,
    )


def _normalize(x, mean, std, cfg: DynamicsConfig):
    if not cfg.normalize_inputs:
        return x
    return jnp.clip((x - mean) / std, -cfg.input_clip, cfg.input_clip)


@partial(jax.jit, static_argnames=("net", "cfg"))
def _train_epoch(params, opt_state, key, x, y, boot, net: Net, cfg: DynamicsConfig):
    """One pass over the training split, then a ``lax.scan`` over minibatches; all members step
    together, each on its own batch.  With ``bootstrap``: one shuffle of the rows, each row holding
    one bootstrap index per member (section 3.1); without: each member its own permutation of the
    whole split (NeuBay, section 7.1).  The last partial minibatch is dropped (our reading; rows
    move every epoch)."""
    tx = _optimizer(cfg)
    m, n = boot.shape
    bsz = min(cfg.batch_size, n)
    steps = n // bsz
    if cfg.bootstrap:
        perm = jax.random.permutation(key, n)[: steps * bsz]
        idx = boot[:, perm]
    else:
        perms = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(key, m))
        idx = jnp.take_along_axis(boot, perms, axis=1)[:, : steps * bsz]
    idx = idx.reshape(m, steps, bsz).transpose(1, 0, 2)  # (steps, M, B)

    def one(carry, ids):
        params, opt_state = carry
        (_, nll), grads = jax.value_and_grad(ensemble_loss, has_aux=True)(params, net, x[ids], y[ids], cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), nll

    (params, opt_state), nll = jax.lax.scan(one, (params, opt_state), idx)
    return params, opt_state, nll.mean(axis=0)


@partial(jax.jit, static_argnames=("net", "n"))
def _validation_mse(params, x, y, net: Net, n: int):
    """Per-member mean squared error of the mean prediction, over the first ``n`` rows of the
    chunked (C, chunk, ...) holdout and every target dimension, in the training target units."""

    def chunk(xy):
        mean, _ = net(params, xy[0])
        return ((mean - xy[1][None]) ** 2).sum(-1)  # (M, chunk)

    se = jax.lax.map(chunk, (x, y))  # (C, M, chunk)
    mask = (jnp.arange(x.shape[0] * x.shape[1]) < n).reshape(x.shape[0], 1, x.shape[1])
    return jnp.where(mask, se, 0.0).sum(axis=(0, 2)) / (n * y.shape[-1])


@jax.jit
def _keep_best(best, params, improved):
    pick = lambda b, p: jnp.where(improved.reshape((-1,) + (1,) * (p.ndim - 1)), p, b)  # noqa: E731
    return jax.tree.map(pick, best, params)


def _chunked(a: np.ndarray, size: int):
    pad = (-len(a)) % size
    a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
    return jnp.asarray(a.reshape(-1, size, *a.shape[1:]))


def select_elites(val_mse, elites: int) -> np.ndarray:
    """Indices of the ``elites`` members with the lowest validation MSE, best first (ties: lower index)."""
    return np.argsort(np.asarray(val_mse), kind="stable")[:elites].astype(np.int32)


def _as_arrays(obs, actions, rewards, next_obs):
    obs, actions, next_obs = (np.asarray(a, np.float32) for a in (obs, actions, next_obs))
    rewards = np.asarray(rewards, np.float32).reshape(len(rewards), -1)
    n = len(obs)
    if (
        obs.ndim != 2
        or actions.ndim != 2
        or next_obs.shape != obs.shape
        or len(actions) != n
        or rewards.shape != (n, 1)
    ):
        raise ValueError(
            f"expected obs (N, O), actions (N, A), rewards (N,), next_obs (N, O); got "
            f"{obs.shape}, {actions.shape}, {rewards.shape}, {next_obs.shape}"
        )
    for name, a in (("obs", obs), ("actions", actions), ("rewards", rewards), ("next_obs", next_obs)):
        if not np.isfinite(a).all():
            raise ValueError(f"{name} contains non-finite values")
    return obs, actions, rewards, next_obs


@struct.dataclass
class DynamicsModel:
    """A trained ensemble (a pytree; ``net``, ``cfg`` and the dims are static).

    ``params``: every leaf has a leading member axis M.  ``input_mean`` / ``input_std``: (O + A,)
    statistics of (s, a) (0 / 1 with ``normalize_inputs=False``).  ``elites``: (E,) int32 member
    indices, best first.  ``val_mse``: (M,) holdout MSE of each member's kept params (training
    units).  ``target_mean`` / ``target_std``: (O + 1,) the network predicts
    (target - target_mean) / target_std (0 / 1 unless ``target_scaling="zscore"``).
    """

    params: object
    input_mean: jax.Array
    input_std: jax.Array
    elites: jax.Array
    val_mse: jax.Array
    target_mean: jax.Array
    target_std: jax.Array
    net: Net = struct.field(pytree_node=False)
    cfg: DynamicsConfig = struct.field(pytree_node=False)
    obs_dim: int = struct.field(pytree_node=False)
    act_dim: int = struct.field(pytree_node=False)


def init_model(
    key,
    obs_dim: int,
    act_dim: int,
    cfg: DynamicsConfig = DynamicsConfig(),
    input_mean=None,
    input_std=None,
    target_mean=None,
    target_std=None,
) -> DynamicsModel:
    """An untrained model: fresh params, identity normalisation unless given, elites = members 0..E-1."""
    net, params = _build(key, obs_dim, act_dim, cfg)

    def stat(value, dim, fill):
        return jnp.full(dim, fill, jnp.float32) if value is None else jnp.asarray(value, jnp.float32)

    d_in, d_out = obs_dim + act_dim, obs_dim + 1
    return DynamicsModel(
        params,
        stat(input_mean, d_in, 0.0),
        stat(input_std, d_in, 1.0),
        jnp.arange(cfg.elites, dtype=jnp.int32),
        jnp.full(cfg.members, jnp.nan, jnp.float32),
        stat(target_mean, d_out, 0.0),
        stat(target_std, d_out, 1.0),
        net,
        cfg,
        obs_dim,
        act_dim,
    )


def target_statistics(obs, rewards, cfg: DynamicsConfig):
    """(mean, std) of the (Δs, r) targets the network is trained on, (O + 1,) each.

    ``"zscore"`` (section 7.1): the next state z-scored with the state's statistics and predicted as
    a residual on the z-scored state, so Δs is divided by std(s) and not centred; the reward is
    z-scored.  A constant dimension keeps std 1.  ``"none"``: 0 and 1.
    """
    dim = obs.shape[1] + 1
    if cfg.target_scaling == "none":
        return np.zeros(dim), np.ones(dim)
    std = np.concatenate([obs.std(0, dtype=np.float64), rewards.std(0, dtype=np.float64)])
    mean = np.concatenate([np.zeros(obs.shape[1]), rewards.mean(0, dtype=np.float64)])
    return mean, np.where(std < 1e-12, 1.0, std)


def _scaled_targets(model: DynamicsModel, obs, rewards, next_obs) -> np.ndarray:
    targets = np.concatenate([next_obs - obs, rewards], axis=1)
    if model.cfg.target_scaling == "none":
        return targets
    return ((targets - np.asarray(model.target_mean)) / np.asarray(model.target_std)).astype(np.float32)


def train(
    key,
    obs,
    actions,
    rewards,
    next_obs,
    cfg: DynamicsConfig = DynamicsConfig(),
    log: Optional[Callable[[int, dict], None]] = None,
) -> tuple[DynamicsModel, dict]:
    """Fit the ensemble to (s, a) -> (s' - s, r) and pick elites (section 3.1).

    ``next_obs`` must be the dataset's true ``next_observations`` (section 1.2), not the next row.
    Holdout: a random ``holdout`` fraction (capped by ``max_holdout``); input statistics come from all
    the observations and actions (our reading).  Every epoch is one jitted scan (``_train_epoch``);
    after it, each member's holdout MSE decides progress, best params and stopping
    (``EarlyStopping``).  The returned model holds each member's best params; elites = the lowest
    holdout MSEs.  ``log(epoch, scalars)``, if given, is called after every epoch.

    ``info``: ``val_mse`` (M,), ``elites`` (E,), ``epochs`` run, ``train_loss`` (epochs,) mean NLL over
    members, ``train_loss_members`` (epochs, M), ``val_curve`` (epochs + 1, M) including epoch 0,
    ``lr_cut_epoch`` (or None), ``stopped_early``, ``holdout_idx`` / ``train_idx`` (row indices),
    ``seconds``.
    """
    t0 = time.perf_counter()
    obs, actions, rewards, next_obs = _as_arrays(obs, actions, rewards, next_obs)
    n, obs_dim, act_dim = len(obs), obs.shape[1], actions.shape[1]
    n_val = int(n * cfg.holdout)
    if cfg.max_holdout is not None:
        n_val = min(n_val, cfg.max_holdout)
    if n_val < 1 or n - n_val < 1:
        raise ValueError(
            f"{n} transitions cannot be split into training and holdout rows "
            f"(holdout={cfg.holdout}, max_holdout={cfg.max_holdout})"
        )
    k_split, k_boot, k_init, key = jax.random.split(key, 4)
    perm = np.asarray(jax.random.permutation(k_split, n))
    val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])

    inputs = np.concatenate([obs, actions], axis=1)
    if cfg.normalize_inputs:
        mean = inputs.mean(0, dtype=np.float64)
        std = inputs.std(0, dtype=np.float64)
        std = np.where(std < 1e-6, 1.0, std)  # constant inputs: centre only (as the reference's filter)
    else:
        mean, std = np.zeros(inputs.shape[1]), np.ones(inputs.shape[1])
    model = init_model(k_init, obs_dim, act_dim, cfg, mean, std, *target_statistics(obs, rewards, cfg))
    targets = _scaled_targets(model, obs, rewards, next_obs)
    x = np.asarray(_normalize(jnp.asarray(inputs), model.input_mean, model.input_std, cfg))
    x_train, y_train = jnp.asarray(x[train_idx]), jnp.asarray(targets[train_idx])
    chunk = min(_VAL_CHUNK, n_val)
    x_val, y_val = _chunked(x[val_idx], chunk), _chunked(targets[val_idx], chunk)
    n_train = len(train_idx)
    if cfg.bootstrap:
        boot = jax.random.randint(k_boot, (cfg.members, n_train), 0, n_train, jnp.int32)
    else:
        boot = jnp.tile(jnp.arange(n_train, dtype=jnp.int32), (cfg.members, 1))

    net, params = model.net, model.params
    opt_state = _optimizer(cfg).init(params)
    stopper = EarlyStopping(cfg, cfg.members)
    val = np.asarray(_validation_mse(params, x_val, y_val, net, n_val))
    stopper.update(0, val)
    best = jax.tree.map(jnp.copy, params)
    val_curve, losses = [val], []
    epoch, action = 0, "continue"
    while action != "stop":
        epoch += 1
        key, k_epoch = jax.random.split(key)
        dealt = boot
        if cfg.bootstrap:  # the resamples dealt to the members anew each epoch, as the RAVL reference does
            k_epoch, k_deal = jax.random.split(k_epoch)
            dealt = boot[jax.random.permutation(k_deal, cfg.members)]
        params, opt_state, nll = _train_epoch(params, opt_state, k_epoch, x_train, y_train, dealt, net, _epoch_cfg(cfg))
        val = np.asarray(_validation_mse(params, x_val, y_val, net, n_val))
        improved, action = stopper.update(epoch, val)
        if improved.any():
            best = _keep_best(best, params, jnp.asarray(improved))
        losses.append(np.asarray(nll))
        val_curve.append(val)
        lr = float(opt_state.hyperparams["learning_rate"])
        if action == "cut_lr":
            opt_state.hyperparams["learning_rate"] = jnp.asarray(lr * cfg.lr_cut, jnp.float32)
        if log is not None:
            log(
                epoch,
                {
                    "train_loss": float(losses[-1].mean()),
                    "val_mse": val,
                    "best_val_mse": stopper.best.copy(),
                    "lr": lr,
                    "progress": bool(improved.any()),
                    "action": action,
                },
            )

    val_mse = stopper.best.astype(np.float32)  # the holdout MSE of each member's kept params
    elites = select_elites(val_mse, cfg.elites)
    model = model.replace(params=best, elites=jnp.asarray(elites), val_mse=jnp.asarray(val_mse))
    info = {
        "val_mse": val_mse,
        "elites": elites,
        "epochs": epoch,
        "train_loss": np.array([loss.mean() for loss in losses]),
        "train_loss_members": np.stack(losses),
        "val_curve": np.stack(val_curve),
        "lr_cut_epoch": stopper.lr_cut_at,
        "stopped_early": epoch < cfg.max_epochs,
        "holdout_idx": val_idx,
        "train_idx": train_idx,
        "seconds": time.perf_counter() - t0,
    }
    return model, info


def validation_mse(model: DynamicsModel, obs, actions, rewards, next_obs) -> np.ndarray:
    """Per-member MSE of the mean prediction of (Δs, r) on the given transitions -> (M,), in the
    training units (raw, or z-scored with ``target_scaling="zscore"``)."""
    obs, actions, rewards, next_obs = _as_arrays(obs, actions, rewards, next_obs)
    x = _normalize(jnp.asarray(np.concatenate([obs, actions], 1)), model.input_mean, model.input_std, model.cfg)
    y = _scaled_targets(model, obs, rewards, next_obs)
    size = min(_VAL_CHUNK, len(obs))
    return np.asarray(
        _validation_mse(model.params, _chunked(np.asarray(x), size), _chunked(y, size), model.net, len(obs))
    )


def with_elites(model: DynamicsModel, val_mse) -> DynamicsModel:
    """``model`` with ``val_mse`` recorded and its elites re-chosen from it (e.g. on a new holdout)."""
    return model.replace(
        elites=jnp.asarray(select_elites(val_mse, model.cfg.elites)), val_mse=jnp.asarray(val_mse, jnp.float32)
    )


# ============================================================================ model step


@jax.jit
def predict(model: DynamicsModel, obs, action):
    """Every member's Gaussian over (Δs, r): ``(mean, logvar)``, each (M, B, O + 1), raw target units.

    ``obs`` (B, O) and ``action`` (B, A) are raw; normalisation happens here.  Jitted (inlined when
    called inside another jit; a ``networks.instrument.record`` block should wrap ``ensemble_loss``,
    which calls the network directly, rather than this cached function).
    """
    x = _normalize(jnp.concatenate([obs, action], axis=-1), model.input_mean, model.input_std, model.cfg)
    mean, logvar = model.net(model.params, x)
    if model.cfg.target_scaling == "none":
        return mean, logvar
    return mean * model.target_std + model.target_mean, logvar + 2.0 * jnp.log(model.target_std)


def elite_params(model: DynamicsModel):
    """The elites' params, in elite order (best first): every leaf (E, ...)."""
    return jax.tree.map(lambda p: p[model.elites], model.params)


@jax.jit
def epistemic_uncertainty(model: DynamicsModel, obs, action):
    """NeuBay's epistemic uncertainty (section 7.1) of each row -> (B,): the std across the elite
    members of the predicted mean, root-mean-square over the target dimensions, in the training
    units (z-scored with ``target_scaling="zscore"``, where every dimension weighs alike)."""
    x = _normalize(jnp.concatenate([obs, action], axis=-1), model.input_mean, model.input_std, model.cfg)
    mean, _ = model.net(elite_params(model), x)  # (E, B, D)
    return jnp.sqrt(mean.var(axis=0).mean(axis=-1))


def dataset_uncertainties(model: DynamicsModel, obs, actions, chunk: int = _VAL_CHUNK) -> np.ndarray:
    """``epistemic_uncertainty`` of every (s, a) row of a dataset, in chunks -> (N,) numpy."""
    obs, actions = np.asarray(obs, np.float32), np.asarray(actions, np.float32)
    return np.concatenate(
        [
            np.asarray(
                epistemic_uncertainty(model, jnp.asarray(obs[i : i + chunk]), jnp.asarray(actions[i : i + chunk]))
            )
            for i in range(0, len(obs), chunk)
        ]
    )


def uncertainty_threshold(
    model: DynamicsModel, obs, actions, quantile: Optional[float] = 1.0, chunk: int = _VAL_CHUNK, uncertainties=None
) -> float:
    """The rollout truncation threshold (section 7.2): the ``quantile`` of ``epistemic_uncertainty``
    over the dataset's (s, a) rows (or of ``uncertainties``, already computed); NeuBay's default 1.0
    is its maximum.  ``None``: no truncation (inf)."""
    if quantile is None:
        return math.inf
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"uncertainty quantile must be in [0, 1] (or None: no truncation), got {quantile}")
    unc = dataset_uncertainties(model, obs, actions, chunk) if uncertainties is None else np.asarray(uncertainties)
    return float(np.quantile(unc.astype(np.float64), quantile))


@jax.jit
def step(model: DynamicsModel, obs, action, key, member=None):
    """One model step (section 3.1): sample (Δs, r) from every member, keep one member per row.

    The member is ``member`` when given (an int array (B,) or a scalar; for "trajectory" sampling),
    else an elite drawn by ``cfg.elite_sampling``: per row ("row", and "trajectory" without
    ``member``) or one for the whole batch ("step").  -> ``(next_obs (B, O), reward (B,))`` with
    s' = s + Δs.  Jitted.
    """
    mean, logvar = predict(model, obs, action)
    k_noise, k_pick = jax.random.split(key)
    sample = mean + jnp.exp(0.5 * logvar) * jax.random.normal(k_noise, mean.shape, mean.dtype)
    b = obs.shape[0]
    if member is None:
        shape = () if model.cfg.elite_sampling == "step" else (b,)
        member = model.elites[jax.random.randint(k_pick, shape, 0, model.elites.shape[0])]
    member = jnp.broadcast_to(jnp.asarray(member, jnp.int32), (b,))
    picked = sample[member, jnp.arange(b)]  # (B, D)
    return obs + picked[:, : model.obs_dim], picked[:, model.obs_dim]


# ============================================================================ rollouts


def rollout(model: DynamicsModel, policy: Callable, start_obs, horizon: int, key, done_fn: Callable):
    """``horizon`` model steps from each start state (sections 3.1, 5.3, 6.3) in one ``lax.scan``.

    ``policy(obs (B, O), key) -> action (B, A)`` in [-1, 1] (the stochastic current policy);
    ``done_fn(next_obs) -> bool (B,)``, e.g. ``termination_fn(env_id)``.  With
    ``elite_sampling="trajectory"`` each row draws one elite at the start and keeps it.

    Returns ``(batch, valid)``: a ``Transition`` with fields shaped (horizon, B, ...)
    (``terminated`` = done_fn's result, ``truncated`` = False) and ``valid`` (horizon, B).  Step t of a
    row is valid iff no earlier step of that row terminated: the terminating transition itself is
    valid (stored with terminated=True), nothing after it.  A terminated row is never stepped from
    its terminal state; its later (invalid) entries are recomputed from its last valid state to keep
    shapes static, and must be dropped with ``valid`` (``flatten`` does the reshape).

    Traceable: call it inside the caller's ``jax.jit`` (``horizon``, ``policy`` and ``done_fn`` are
    Python values there; a policy closing over traced params is fine).
    """
    b = start_obs.shape[0]
    k_member, k_steps = jax.random.split(key)
    member = None
    if model.cfg.elite_sampling == "trajectory":
        member = model.elites[jax.random.randint(k_member, (b,), 0, model.elites.shape[0])]

    def one(carry, k):
        obs, alive = carry
        k_act, k_model = jax.random.split(k)
        action = policy(obs, k_act)
        next_obs, reward = step(model, obs, action, k_model, member)
        done = jnp.asarray(done_fn(next_obs), bool)
        batch = Transition(obs, action, reward, next_obs, done, jnp.zeros_like(done))
        still = alive & ~done
        return (jnp.where(still[:, None], next_obs, obs), still), (batch, alive)

    _, (batch, valid) = jax.lax.scan(
        one, (jnp.asarray(start_obs), jnp.ones(b, bool)), jax.random.split(k_steps, horizon)
    )
    return batch, valid


def flatten(batch: Transition, valid):
    """(horizon, B, ...) rollout output -> (horizon * B, ...) rows, step-major, and the (horizon * B,) mask."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), batch), valid.reshape(-1)


# ============================================================================ save / load


def _named_leaves(params) -> dict:
    return {"/".join(str(k) for k in path_names(p)): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def save(path, model: DynamicsModel) -> None:
    """One ``.npz``: every param leaf (by path), the input statistics, elites, val MSE and the config
    as JSON, so a model trained on a dataset can be cached beside it."""
    meta = {"format": _FORMAT, "obs_dim": model.obs_dim, "act_dim": model.act_dim, "config": asdict(model.cfg)}
    arrays = {f"params/{k}": np.asarray(v) for k, v in _named_leaves(model.params).items()}
    arrays.update(
        input_mean=np.asarray(model.input_mean),
        input_std=np.asarray(model.input_std),
        elites=np.asarray(model.elites),
        val_mse=np.asarray(model.val_mse),
        target_mean=np.asarray(model.target_mean),
        target_std=np.asarray(model.target_std),
    )
    with open(path, "wb") as f:
        np.savez(f, __meta__=np.array(json.dumps(meta)), **arrays)


def load(path) -> DynamicsModel:
    """Inverse of ``save``; checks every array against a freshly built template and fails clearly."""
    with np.load(path, allow_pickle=False) as data:
        if "__meta__" not in data.files:
            raise ValueError(f"{path} is not a saved dynamics model (no __meta__ entry)")
        meta = json.loads(str(data["__meta__"]))
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path}: unsupported dynamics-model format {meta.get('format')!r} (expected {_FORMAT})")
        known = {f.name for f in fields(DynamicsConfig)}
        unknown = set(meta["config"]) - known
        if unknown:
            raise ValueError(f"{path}: unknown config fields {sorted(unknown)}")
        cfg_kw = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()}
        cfg = DynamicsConfig(**cfg_kw)
        template = init_model(jax.random.key(0), int(meta["obs_dim"]), int(meta["act_dim"]), cfg)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template.params)
        stored = {k[len("params/") :] for k in data.files if k.startswith("params/")}
        expected = _named_leaves(template.params)
        problems = [f"missing {k}" for k in expected if k not in stored]
        problems += [f"unexpected {k}" for k in stored if k not in expected]
        problems += [
            f"{k}: shape {data['params/' + k].shape}, expected {v.shape}"
            for k, v in expected.items()
            if k in stored and data["params/" + k].shape != v.shape
        ]
        m, d = cfg.members, template.obs_dim + template.act_dim
        d_out = template.obs_dim + 1
        checks = [("input_mean", (d,)), ("input_std", (d,)), ("elites", (cfg.elites,)), ("val_mse", (m,))]
        targets = {"target_mean": np.asarray(template.target_mean), "target_std": np.asarray(template.target_std)}
        if "target_mean" in data.files or cfg.target_scaling != "none":  # files before target scaling: 0 / 1
            checks += [("target_mean", (d_out,)), ("target_std", (d_out,))]
            targets = {k: data[k] for k in targets if k in data.files}
        for name, shape in checks:
            if name not in data.files or data[name].shape != shape:
                problems.append(f"{name}: expected shape {shape}")
        if problems:
            raise ValueError(f"{path} does not match its config: " + "; ".join(problems))
        names = list(expected)
        params = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(data["params/" + k]) for k in names])
        return template.replace(
            params=params,
            input_mean=jnp.asarray(data["input_mean"]),
            input_std=jnp.asarray(data["input_std"]),
            elites=jnp.asarray(data["elites"], jnp.int32),
            val_mse=jnp.asarray(data["val_mse"]),
            target_mean=jnp.asarray(targets["target_mean"], jnp.float32),
            target_std=jnp.asarray(targets["target_std"], jnp.float32),
        )


# ============================================================================ a run's model


def epoch_progress(
    log: Callable[[str], None],
    max_epochs: int,
    every: int = 25,
    interval_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[int, dict], None]:
    """A ``train(log=...)`` callback that reports an epoch line to ``log``: the first epoch, every
    ``every``-th, any epoch whose action is not "continue" (stop, lr cut), and any epoch ending
    ``interval_s`` or more after the last line, so a slow fit (a 128-member NeuBay posterior on 40k
    rows takes 30-40 s an epoch on a 2-core CPU) is never silent for long.  Each line gives the seconds per
    epoch so far and the epoch cap (early stopping usually ends sooner)."""
    start = last = clock()

    def progress(epoch: int, row: dict) -> None:
        nonlocal last
        now = clock()
        action = row.get("action") or ""
        if not (epoch == 1 or epoch % every == 0 or action not in ("", "continue") or now - last >= interval_s):
            return
        last = now
        cap = "no cap" if max_epochs >= NO_EPOCH_CAP else f"cap {max_epochs}"
        log(
            f"  dynamics epoch {epoch} ({cap}; {(now - start) / epoch:.1f} s/epoch): train loss "
            f"{row['train_loss']:.4f}, best validation MSE {np.min(row['best_val_mse']):.5f}"
            + ("" if action in ("", "continue") else f" ({action})")
        )

    return progress


def load_or_train(
    key, dataset, cfg: DynamicsConfig, cache_path, explicit_path: Optional[str] = None, log=print
) -> DynamicsModel:
    """The dynamics model an offline run uses: ``explicit_path`` (``--model``), else the model cached
    at ``cache_path`` (it must have been trained with ``cfg``), else one trained now on the dataset's
    true next observations (``dataset``: an ``envs.datasets.Dataset``, actions in [-1, 1]) and saved
    at ``cache_path``.  Raises SystemExit (a message) for a missing ``--model``, a model of other
    dimensions, or a cached one trained with other settings."""
    from pathlib import Path

    path = Path(explicit_path) if explicit_path else Path(cache_path)
    if path.exists():
        log(f"dynamics model: {path}")
        model = load(path)
        if (model.obs_dim, model.act_dim) != (dataset.obs_dim, dataset.act_dim):
            raise SystemExit(
                f"dynamics model {path} is for obs/act dims {model.obs_dim}/{model.act_dim}, the "
                f"dataset has {dataset.obs_dim}/{dataset.act_dim}"
            )
        if not explicit_path and model.cfg != cfg:
            changed = [f.name for f in fields(DynamicsConfig) if getattr(model.cfg, f.name) != getattr(cfg, f.name)]
            raise SystemExit(
                f"the cached dynamics model {path} was trained with other --dynamics settings "
                f"({', '.join(changed)}): delete it to retrain, or pass --model {path} to use it"
            )
        return model
    if explicit_path:
        raise SystemExit(f"--model {path}: no such file")
    log(f"training the dynamics ensemble on {len(dataset)} transitions (cached at {path}) ...")
    t = dataset.transitions(unit_actions=True)

    model, info = train(key, t.obs, t.action, t.reward, t.next_obs, cfg, log=epoch_progress(log, cfg.max_epochs))
    save(path, model)
    val = np.asarray(info["val_mse"])
    log(
        f"dynamics: {info['epochs']} epochs, validation MSE per member {[float(f'{v:.3g}') for v in val]}, "
        f"elites {np.asarray(info['elites']).tolist()}"
    )
    return model
