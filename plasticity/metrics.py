"""Plasticity metrics: ReDo's dormant score (Sokar et al., ICML 2023), GraMa (Liu et al., NeurIPS 2025), FAU,
srank, ranks, norms.

Pure ``jnp`` functions, safe under ``jit``, ``grad`` and ``vmap``.  Activations and
activation gradients come from ``networks.instrument.activation_grads``: one array per
hidden layer ("tap"), shaped ``(batch, units)`` for a single network or
``(members, batch, units)`` for an ensemble (``Net.ensemble > 0``).  The output layer is
never a tap, so every ratio below already excludes it, as ReDo does (Sokar et al. 2023).

Conventions:

* neuron scores are per member: ``(B, H) -> (H,)`` and ``(M, B, H) -> (M, H)``;
* ratios (dormant, GraMa-inactive, FAU) pool the neurons of all members;
* rank metrics take ``(..., B, H)`` and return one value per leading index; network
  metrics average them over ensemble members.
"""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp

from plasticity_zoo.networks import instrument
from plasticity_zoo.networks.runtime import one_call_per_matrix

EPS = 1e-9
DORMANT_TAUS = (0.0, 0.025, 0.1)  # tau = 0 and ReDo's 0.025 / 0.1 (Sokar et al. 2023; timoklein/redo)
GRAMA_TAUS = (0.01,)  # GraMa's tau = 0.01 (Liu et al. 2025, arXiv 2505.24061, App. A)


def _check(x):
    if x.ndim not in (2, 3):
        raise ValueError(f"expected (batch, units) or (members, batch, units), got shape {x.shape}")


def _normalised_mean_abs(x, eps: float = EPS):
    """E_x|x_i| / ((1/H) sum_k E_x|x_k| + eps), the batch axis being ``-2``."""
    _check(x)
    m = jnp.mean(jnp.abs(x), axis=-2)
    return m / (jnp.mean(m, axis=-1, keepdims=True) + eps)


def neuron_scores(acts, eps: float = EPS):
    """ReDo tau-dormant score per neuron (Sokar et al. 2023, arXiv 2302.12902; google/dopamine
    ``labs/redo/weight_recyclers.py``).

    s_i = E_x|h_i(x)| / ((1/H) sum_k E_x|h_k(x)| + eps), with h the post-activation output
    of the layer and the expectation over the batch.  ``(B, H) -> (H,)``; an ensemble
    ``(M, B, H) -> (M, H)`` (each member normalised by its own layer mean).
    """
    return _normalised_mean_abs(acts, eps)


def dormant_ratio(acts, tau: float):
    """Share of tau-dormant neurons, s_i <= tau (Sokar et al. 2023, arXiv 2302.12902).

    ``<=`` makes tau = 0 count exactly the neurons whose mean |activation| is zero.
    Ensemble members' neurons are pooled.
    """
    return jnp.mean((neuron_scores(acts) <= tau).astype(jnp.float32))


def grama_scores(grads, eps: float = EPS):
    """GraMa score per neuron (Liu et al. 2025, arXiv 2505.24061, Eq. 2).

    G_i = E_x|dL/dz_i(x)| / ((1/H) sum_k E_x|dL/dz_k(x)| + eps): the ReDo normalisation applied
    to the loss gradient at the neuron's *pre-activation* z (the output of its Linear or
    LayerNorm layer), where a dead ReLU unit has gradient 0; callers pass
    ``networks.instrument.activation_grads(..., at="pre")``.  Those probes give the gradient for
    the whole batch, whose per-sample rows are the per-sample gradients up to the loss's 1/B
    factor, which the normalisation cancels.
    Shapes as ``neuron_scores``.
    """
    return _normalised_mean_abs(grads, eps)


def grama_inactive_ratio(grads, tau: float = 0.01):
    """Share of GraMa-inactive neurons, G_i <= tau (Liu et al. 2025, Eq. 2)."""
    return jnp.mean((grama_scores(grads) <= tau).astype(jnp.float32))


def active_fraction(acts):
    """Fraction of active units, FAU (Neuroplastic Expansion, Liu et al., ICLR 2025): share of
    (sample, unit) entries > 0.

    Meaningful for ReLU-like activations; pooled over ensemble members.
    """
    return jnp.mean((acts > 0).astype(jnp.float32))


# Singular values, one matrix per LAPACK call, under any ``vmap`` too (batched CPU LAPACK calls can
# deadlock: ``networks/runtime.py: one_call_per_matrix``; here seen as the plasticity-metrics hang of
# docs/benchmarks.md, on full-size MR.Q with 3 seeds); the explicit JVP keeps ``grad`` working.
@one_call_per_matrix
def _sv_one(x):
    return jnp.linalg.svd(x, compute_uv=False)


@one_call_per_matrix
def _svd_one(x):
    return jnp.linalg.svd(x, full_matrices=False)


def _one_matrix_per_call(fn, x):
    """``fn`` on each ``(B, H)`` matrix of ``x`` (leading axes flattened), one after another."""
    out = jax.lax.map(fn, x.reshape((-1,) + x.shape[-2:]))
    return jax.tree.map(lambda o: o.reshape(x.shape[:-2] + o.shape[1:]), out)


@jax.custom_jvp
def _singular_values(features):
    """``(..., B, H) -> (..., min(B, H))``, descending."""
    return _one_matrix_per_call(_sv_one, features)


@_singular_values.defjvp
def _singular_values_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    u, s, vt = _one_matrix_per_call(_svd_one, x)
    return s, jnp.einsum("...ji,...jk,...ik->...i", u, dx, vt)  # d sigma_i = u_i^T dX v_i


def srank(features, delta: float = 0.01):
    """Effective feature rank srank_delta (Kumar et al. 2021, arXiv 2010.14498).

    The smallest k with sum_{i<=k} sigma_i >= (1 - delta) sum_i sigma_i, over the singular
    values (descending) of the ``(B, H)`` feature matrix.  ``(..., B, H) -> (...)``; an
    all-zero matrix has srank 0.
    """
    return _srank(_singular_values(features), delta)


def _srank(s, delta):
    c = jnp.cumsum(s, axis=-1)
    total = c[..., -1:]
    k = jnp.sum(c < (1.0 - delta) * total, axis=-1) + 1
    return jnp.where(total[..., 0] > 0, k, 0).astype(jnp.float32)


def effective_rank(features):
    """Effective rank (Roy & Vetterli 2007; RankMe, Garrido et al. 2023).

    exp(-sum_i p_i log p_i) with p_i = sigma_i / sum_j sigma_j (0 log 0 = 0).
    ``(..., B, H) -> (...)``; an all-zero matrix gets 0.
    """
    return _effective_rank(_singular_values(features))


def _effective_rank(s):
    total = jnp.sum(s, axis=-1, keepdims=True)
    p = s / jnp.where(total > 0, total, 1.0)
    ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    return jnp.where(total[..., 0] > 0, jnp.exp(ent), 0.0)


def feature_rank(features, eps: float = 0.01):
    """Feature rank (Lyle et al. 2022, arXiv 2204.09560).

    #{j : sigma_j(Phi / sqrt(B)) > eps}: the number of singular values of the ``(B, H)``
    feature matrix, scaled by 1/sqrt(batch), above eps (0.01).  The 1/sqrt(B) scaling makes
    the count comparable across batch sizes (sigma_j^2 / B are the eigenvalues of the
    feature second-moment matrix Phi^T Phi / B).  ``(..., B, H) -> (...)``.
    """
    return _feature_rank(_singular_values(features), features.shape[-2], eps)


def _feature_rank(s, batch: int, eps: float = 0.01):
    s = s / jnp.sqrt(jnp.asarray(batch, s.dtype))
    return jnp.sum(s > eps, axis=-1).astype(jnp.float32)


def rank_metrics(features) -> dict:
    """``srank``, ``effective_rank`` and ``feature_rank`` of ``(..., B, H)`` features, averaged over
    the leading axes (ensemble members), from one SVD per matrix."""
    s = _singular_values(features)
    return {
        "srank": jnp.mean(_srank(s, 0.01)),
        "effective_rank": jnp.mean(_effective_rank(s)),
        "feature_rank": jnp.mean(_feature_rank(s, features.shape[-2])),
    }


def _sq_norm(tree):
    return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)), jnp.zeros(()))


def weight_norm(params):
    """Global L2 norm of all parameters, sqrt(sum_leaves ||theta||^2)."""
    return jnp.sqrt(_sq_norm(params))


def grad_norm(grads_tree):
    """Global L2 norm of a gradient pytree (before any clipping)."""
    return jnp.sqrt(_sq_norm(grads_tree))


def weight_norm_ratio(params, init_params):
    """||theta|| / ||theta_0||: the global weight norm relative to its value at init."""
    return weight_norm(params) / jnp.maximum(weight_norm(init_params), EPS)


def _count(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))


def weight_magnitude(params):
    """Root mean square of all parameters, sqrt(sum_i theta_i^2 / N): Plasticine's weight magnitude
    (Yuan et al. 2025, arXiv 2504.17490; ``compute_weight_magnitude``), a width-free ``weight_norm``."""
    return jnp.sqrt(_sq_norm(params) / max(_count(params), 1))


def weight_distance(params, init_params):
    """Root mean square distance from the initial parameters, sqrt(sum_i (theta_i - theta0_i)^2 / N):
    Plasticine's L2 norm difference from the saved initial state (``compute_l2_norm_difference``)."""
    diff = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), params, init_params)
    return jnp.sqrt(_sq_norm(diff) / max(_count(params), 1))


def feature_stats(features) -> dict:
    """Plasticine's feature norm and feature variance of ``(..., B, H)`` features, averaged over the
    leading (ensemble) axes: ``feature_norm`` the mean over samples of ||f_b||_2, ``feature_variance``
    the mean over samples of the variance across the H features (Bessel-corrected, as ``torch.var``)."""
    f = features.astype(jnp.float32)
    return {
        "feature_norm": jnp.mean(jnp.linalg.norm(f, axis=-1)),
        "feature_variance": jnp.mean(jnp.var(f, axis=-1, ddof=1)),
    }


def _tap_order(name: str):
    """Natural order of tap names (layer2 before layer10); dict pytrees come back key-sorted."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def network_metrics(
    acts: dict,
    act_grads: dict,
    params,
    init_params=None,
    param_grads=None,
    prefix: str = "plasticity/net",
    dormant_taus=DORMANT_TAUS,
    grama_taus=GRAMA_TAUS,
) -> dict:
    """Flat dict of scalar plasticity metrics of one network.

    ``acts`` / ``act_grads``: ``{tap: (B, H) or (M, B, H)}`` of this network.  Per layer:
    ``{prefix}/{tap}/dormant_{tau}``, ``grama_{tau}``, ``active_fraction``, ``srank``,
    ``effective_rank``, ``feature_rank`` (rank metrics of that layer's activations,
    averaged over ensemble members).  Network totals: ``{prefix}/dormant_{tau}`` and
    ``{prefix}/grama_{tau}`` (weighted by neuron count over all layers and members),
    ``{prefix}/active_fraction`` (over all entries), ``{prefix}/weight_norm`` and ``weight_magnitude``,
    plus ``weight_norm_ratio`` and ``weight_distance`` if ``init_params`` and ``grad_norm`` if
    ``param_grads`` is given.
    """
    out = {}
    n_total = 0
    dormant = {t: jnp.zeros(()) for t in dormant_taus}
    inactive = {t: jnp.zeros(()) for t in grama_taus}
    active, entries = jnp.zeros(()), 0
    for tap in sorted(acts, key=_tap_order):
        a = acts[tap]
        _check(a)
        p = f"{prefix}/{tap}"
        s = neuron_scores(a)
        n = s.size
        n_total += n
        for t in dormant_taus:
            d = jnp.sum((s <= t).astype(jnp.float32))
            dormant[t] = dormant[t] + d
            out[f"{p}/dormant_{t}"] = d / n
        if tap in act_grads:
            g = grama_scores(act_grads[tap])
            for t in grama_taus:
                k = jnp.sum((g <= t).astype(jnp.float32))
                inactive[t] = inactive[t] + k
                out[f"{p}/grama_{t}"] = k / n
        fau = active_fraction(a)
        out[f"{p}/active_fraction"] = fau
        active, entries = active + fau * a.size, entries + a.size
        out.update({f"{p}/{metric}": v for metric, v in rank_metrics(a).items()})
    if n_total:
        for t in dormant_taus:
            out[f"{prefix}/dormant_{t}"] = dormant[t] / n_total
        if all(tap in act_grads for tap in acts):
            for t in grama_taus:
                out[f"{prefix}/grama_{t}"] = inactive[t] / n_total
        out[f"{prefix}/active_fraction"] = active / entries
    out[f"{prefix}/weight_norm"] = weight_norm(params)
    out[f"{prefix}/weight_magnitude"] = weight_magnitude(params)
    if init_params is not None:
        out[f"{prefix}/weight_norm_ratio"] = weight_norm_ratio(params, init_params)
        out[f"{prefix}/weight_distance"] = weight_distance(params, init_params)
    if param_grads is not None:
        out[f"{prefix}/grad_norm"] = grad_norm(param_grads)
    return out


def compute(
    loss_fns: dict[str, Callable], params: dict, init_params: dict | None = None, prefix: str = "plasticity", **kw
) -> dict:
    """Plasticity metrics of every network in ``loss_fns`` -> one flat dict of scalars.

    ``loss_fns[name](p) -> scalar`` is that network's training loss as a function of its
    params ``p = params[name]`` (e.g. ``agents.sac.plastic_losses``); the network must be
    the one called ``name`` (``Net.name``) and its first call inside the loss must be the
    online forward pass.  Parameter gradients come from ``jax.grad`` of the loss, activation
    gradients (at the pre-activation, where a dead ReLU unit's gradient is exactly 0) from
    ``networks.instrument.activation_grads``.  Call it inside ``jit`` (and
    ``vmap`` over seeds if wanted); the batch the losses close over is the metric batch.
    """
    out = {}
    for name, loss in loss_fns.items():
        p = params[name]
        param_grads = jax.grad(loss)(p)
        # GraMa scores a neuron by the gradient at its Linear/LN output (Liu et al. 2025, arXiv 2505.24061)
        acts, grads = instrument.activation_grads(lambda: loss(p), [name], at="pre")
        init = None if init_params is None else init_params[name]
        out.update(network_metrics(acts[name], grads[name], p, init, param_grads, prefix=f"{prefix}/{name}", **kw))
        # rank of the representation the head reads (penultimate features, as in srank, Kumar et al. 2021)
        feats = instrument.features(lambda: loss(p), [name])[name]
        stats = {**rank_metrics(feats), **feature_stats(feats)}
        out.update({f"{prefix}/{name}/features/{metric}": v for metric, v in stats.items()})
    return out
