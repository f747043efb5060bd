"""The ensemble itself: the network (``GaussianDynamics``, one per member), its loss, the early-stopping
rule and the training (``train`` -> ``DynamicsModel``, the elites chosen by holdout MSE).

Reading order: network -> loss -> early stopping -> training (and its resumable state).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from plasticity_zoo.agents.dynamics.config import DynamicsConfig
from plasticity_zoo.networks import Net, Trunk, TrunkSpec
from plasticity_zoo.networks.core import path_names, uniform_fan_in

_VAL_CHUNK = 8192  # holdout rows per forward pass when computing validation MSE (memory bound only)


# ============================================================================ network


def soft_clamp(logvar, max_logvar, min_logvar):
    """RAVL's soft bounds (``dynamics_training/net.py``, from PETS): lv <- max - softplus(max - lv);
    lv <- min + softplus(lv - min).

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
    (Δs, r), with learned per-dimension log-variance bounds (RAVL's ``net.py``).

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
    """RAVL's ``GaussianMSELoss`` (``net.py``): mean over batch and dimensions of logvar + err^2 e^-logvar
    (no constants).

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
    """RAVL's rule (``train_dynamics_model.py``) over per-member validation MSEs (host side, one call per
    epoch).

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
    one bootstrap index per member (RAVL's ``ensemble.py``); without: each member its own permutation
    of the whole split (NeuBay's ``cont_ensemble.py``).  The last partial minibatch is dropped (our reading; rows
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

    ``"zscore"`` (NeuBay's ``modules.py: Scaler``): the next state z-scored with the state's statistics and predicted as
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


# ============================================================================ resumable fit

_RESUME_FORMAT = 1  # partial-fit file format version


def _is_typed(key) -> bool:
    return jnp.issubdtype(key.dtype, jax.dtypes.prng_key)


def _key_data(key) -> np.ndarray:
    """The uint32 words of a typed (``jax.random.key``) or raw (``jax.random.PRNGKey``) key."""
    return np.asarray(jax.random.key_data(key) if _is_typed(key) else key)


def _fit_fingerprint(key, cfg: DynamicsConfig, arrays) -> dict[str, str]:
    """What identifies a fit, one string each: ``config`` (every field, as JSON), ``data`` (the
    shapes and a SHA-256 of the float32 arrays ``train`` fits: ~0.3 s per 100 MB) and ``key``
    (its implementation and words)."""
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(np.ascontiguousarray(a).data)
    impl = str(jax.random.key_impl(key)) if _is_typed(key) else "raw"
    return {
        "config": json.dumps(asdict(cfg), sort_keys=True),
        "data": " ".join(str(a.shape) for a in arrays) + " sha256 " + digest.hexdigest(),
        "key": f"{impl} {_key_data(key).tolist()}",
    }


def _write_fit_state(path: Path, fingerprint, epoch, key, params, best, opt_state, stopper, val_curve, losses):
    """The loop's state after ``epoch`` as one ``.npz`` (no pickles), written atomically: a
    temporary file in the same folder, then ``os.replace``."""
    arrays = {f"fingerprint/{k}": np.array(v) for k, v in fingerprint.items()}
    for name, tree in (("params", params), ("best", best), ("opt_state", opt_state)):
        arrays.update({f"{name}/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(tree))})
    arrays.update(
        {
            "format": np.array(_RESUME_FORMAT),
            "epoch": np.array(epoch),
            "key": _key_data(key),
            "stopper/best": np.asarray(stopper.best),
            "stopper/stall": np.array(stopper.stall),
            "stopper/lr_cut_at": np.array(-1 if stopper.lr_cut_at is None else stopper.lr_cut_at),
            "val_curve": np.stack(val_curve),
            "losses": np.stack(losses),
        }
    )
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_fit_state(path: Path, fingerprint: dict[str, str]) -> dict:
    """The arrays of a partial fit at ``path`` whose fingerprint is ``fingerprint``; SystemExit (a
    message naming the file) for an unreadable file or another fit's."""
    start_over = "delete it to start the fit over"
    try:
        with np.load(path, allow_pickle=False) as f:
            data = {k: f[k] for k in f.files}
        if int(data["format"]) != _RESUME_FORMAT:
            raise ValueError(f"format {int(data['format'])}, expected {_RESUME_FORMAT}")
        stored = {k: str(data[f"fingerprint/{k}"]) for k in fingerprint}
    except Exception as e:  # a truncated zip, a missing entry, not an npz at all ...
        raise SystemExit(
            f"{path} is not a readable partial dynamics fit ({type(e).__name__}: {e}): {start_over}"
        ) from None
    differs = []
    if stored["config"] != fingerprint["config"]:
        old, new = json.loads(stored["config"]), json.loads(fingerprint["config"])
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        differs.append(f"another config ({', '.join(changed)})")
    if stored["data"] != fingerprint["data"]:
        differs.append("other data")
    if stored["key"] != fingerprint["key"]:
        differs.append("another key (seed)")
    if differs:
        raise SystemExit(f"{path} holds a partial dynamics fit with {', '.join(differs)} than this one: {start_over}")
    return data


def _restore_fit_state(path: Path, data: dict, key, params, opt_state, stopper: EarlyStopping):
    """Rebuild the loop's state from ``_read_fit_state``'s arrays on the fresh ``key``, ``params``
    and ``opt_state`` (their kind, tree structure, shapes and dtypes); sets ``stopper``'s fields.
    -> (epoch, key, params, best, opt_state, val_curve, losses)."""

    def tree(name, template):
        leaves, treedef = jax.tree.flatten(template)
        stored = [data[f"{name}/{i}"] for i in range(len(leaves))]
        if f"{name}/{len(leaves)}" in data or any(
            s.shape != t.shape or s.dtype != t.dtype for s, t in zip(stored, leaves)
        ):
            raise ValueError(f"{name} does not match the config's shapes")
        return jax.tree.unflatten(treedef, [jnp.asarray(s) for s in stored])

    try:
        epoch = int(data["epoch"])
        words = data["key"]
        if _is_typed(key):
            key = jax.random.wrap_key_data(jnp.asarray(words, jnp.uint32), impl=jax.random.key_impl(key))
        else:
            key = jnp.asarray(words, key.dtype)
        params, best, opt_state = tree("params", params), tree("best", params), tree("opt_state", opt_state)
        val_curve, losses = list(data["val_curve"]), list(data["losses"])
        if len(val_curve) != epoch + 1 or len(losses) != epoch or data["stopper/best"].shape != stopper.best.shape:
            raise ValueError(f"curves of {len(val_curve)} / {len(losses)} rows at epoch {epoch}")
        stopper.best = data["stopper/best"]
        stopper.stall = int(data["stopper/stall"])
        stopper.lr_cut_at = None if int(data["stopper/lr_cut_at"]) < 0 else int(data["stopper/lr_cut_at"])
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(
            f"{path} is not a readable partial dynamics fit ({type(e).__name__}: {e}): delete it to start the fit over"
        ) from None
    return epoch, key, params, best, opt_state, val_curve, losses


def train(
    key,
    obs,
    actions,
    rewards,
    next_obs,
    cfg: DynamicsConfig = DynamicsConfig(),
    log: Optional[Callable[[int, dict], None]] = None,
    resume_path: Union[str, os.PathLike, None] = None,
    checkpoint_interval_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
    on_resume: Optional[Callable[[int], None]] = None,
) -> tuple[DynamicsModel, dict]:
    """Fit the ensemble to (s, a) -> (s' - s, r) and pick elites (RAVL's ``ensemble.py``).

    ``next_obs`` must be the dataset's true ``next_observations`` (not D4RL's ``qlearning_dataset``), not
    the next row.
    Holdout: a random ``holdout`` fraction (capped by ``max_holdout``); input statistics come from all
    the observations and actions (our reading).  Every epoch is one jitted scan (``_train_epoch``);
    after it, each member's holdout MSE decides progress, best params and stopping
    (``EarlyStopping``).  The returned model holds each member's best params; elites = the lowest
    holdout MSEs.  ``log(epoch, scalars)``, if given, is called after every epoch.

    Resuming: with ``resume_path``, the loop's state is written there after an epoch (atomically:
    a temporary file, then ``os.replace``) once ``checkpoint_interval_s`` have passed on ``clock``
    since the last write (the first: since the loop started), never after the last epoch.  It holds
    the epoch, the current and the kept (best) params, the optimizer state (the learning rate
    included), the key for the next epoch, ``EarlyStopping``'s bests, stall count and lr-cut epoch,
    the validation and loss curves, and the fit's fingerprint (config, data hash, key).  A call
    with the same key, data and config finds the file, continues from the epoch after the stored
    one (``on_resume(epoch)``, if given, hears which) and returns what an uninterrupted fit returns,
    bit for bit (the holdout split, bootstrap resamples and normalisation are recomputed from the
    key and the data).  Another fit's file, or an unreadable one: SystemExit, naming the file.
    The caller deletes the file once the model is saved.

    ``info``: ``val_mse`` (M,), ``elites`` (E,), ``epochs`` run, ``train_loss`` (epochs,) mean NLL over
    members, ``train_loss_members`` (epochs, M), ``val_curve`` (epochs + 1, M) including epoch 0,
    ``lr_cut_epoch`` (or None), ``stopped_early``, ``holdout_idx`` / ``train_idx`` (row indices),
    ``seconds`` (this call's), ``resumed_from_epoch`` (0 unless resumed).
    """
    t0, last_write = time.perf_counter(), clock()
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
    partial_file = None if resume_path is None else Path(resume_path)
    saved: Optional[dict] = None
    fingerprint: dict[str, str] = {}
    if partial_file is not None:
        fingerprint = _fit_fingerprint(key, cfg, (obs, actions, rewards, next_obs))
        if partial_file.exists():
            saved = _read_fit_state(partial_file, fingerprint)
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
    if saved is not None and partial_file is not None:
        epoch, key, params, best, opt_state, val_curve, losses = _restore_fit_state(
            partial_file, saved, key, params, opt_state, stopper
        )
        if on_resume is not None:
            on_resume(epoch)
    resumed_from = epoch
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
        if partial_file is not None and action != "stop":
            now = clock()
            if now - last_write >= checkpoint_interval_s:
                _write_fit_state(
                    partial_file, fingerprint, epoch, key, params, best, opt_state, stopper, val_curve, losses
                )
                last_write = now
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
        "resumed_from_epoch": resumed_from,
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
