"""GTR: the Gaussian trust region PPO adds with ``--trust-region gtr`` (arXiv 2606.03382).

**The paper's words** (Liu, Liu, Obando-Ceron, Castro, Courville, Wang, Liu, Pan, arXiv 2606.03382,
abstract only): GTR "reshapes the trust region using a Gaussian kernel"; the constraint is bounded
and non-monotonic, strongly stabilising locally and relaxing "under sustained high-advantage
updates"; a "Mixture Gaussian Anchor" adapts to recent policy trajectories to reduce the variance of
stale references.

**Our reconstruction** (our reading: the abstract does not state the objective; to be replaced if
the paper's objective becomes known): per state, D_k(s) = KL(pi_k(.|s) || pi_theta(.|s)) in closed
form for diagonal Gaussians, a kernel K_mix(s) = sum_k w_k exp(-D_k(s) / (2 sigma^2)) over the last
M iteration-end policies (``gtr_anchors``; slot 0 is the rollout policy pi_old) with recency weights
w_k ∝ lambda^age (``gtr_weights``: ``recency``, ``uniform``, or ``ema``: one anchor that is an EMA
of the rollout policies' parameters), and the penalty P(s) = beta (1 - K_mix(s)) added to the loss
as its batch mean.  P is bounded by beta, equals beta D / (2 sigma^2) to first order near an anchor
(a KL penalty with coefficient beta / (2 sigma^2)) and its pull vanishes far from the anchors.
``gtr_form=logratio`` is our per-sample variant (also our reading): D_k = (log pi_theta(a|s) - log
pi_k(a|s))^2 with width ``gtr_logratio_sigma``.  The clip stays on by default (``--no-clip`` removes
it; ``--target-kl`` gives a safety early stop, our choice).  With beta = 0 GTR is plain PPO.  The
anchors' per-state means/log-stds (or log-probs) are computed once per iteration, before the epochs.

Its settings are the ``gtr_*`` fields of ``agents/ppo.py: PPOConfig`` (``cfg`` below); PPO calls
``init_anchors`` in ``init``, ``push_anchor`` / ``anchor_stats`` / ``anchor_weights`` at the start of
each iteration's ``update``, ``actor_penalty`` in ``actor_loss`` and ``anchor_metrics`` after the epochs.

Diagnostics per iteration (our choice, following the abstract's argument about local updates):
``gtr/kl_anchor{k}`` (mean KL from anchor k to the updated policy), ``gtr/weight0``, ``gtr/kernel``
(K_mix), ``gtr/penalty``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from plasticity_zoo.networks import distributions
from plasticity_zoo.networks.distributions import gaussian_log_prob


def anchor_weights(count, num_anchors: int, mode: str = "recency", decay: float = 0.8):
    """Mixture weights over anchor slots (slot k has age k); zero on unfilled slots; they sum to one."""
    age = jnp.arange(num_anchors)
    filled = age < jnp.maximum(count, 1)
    if mode == "ema":
        w = (age == 0).astype(jnp.float32)
    elif mode == "uniform":
        w = filled.astype(jnp.float32)
    else:
        w = jnp.where(filled, decay ** age.astype(jnp.float32), 0.0)
    return w / w.sum()


def gtr_penalty(divergence, weights, beta: float, width2: float):
    """P = beta (1 - sum_k w_k exp(-D_k / (2 width2))) per sample; ``divergence`` is (..., M).

    Returns (penalty, kernel K_mix)."""
    kernel = jnp.sum(weights * jnp.exp(-divergence / (2.0 * width2)), axis=-1)
    return beta * (1.0 - kernel), kernel


def init_anchors(actor_params, num_anchors: int):
    """The anchor stack at the start: ``num_anchors`` copies of the initial actor params (slot 0 newest)."""
    return jax.tree.map(lambda p: jnp.broadcast_to(p, (num_anchors, *p.shape)).copy(), actor_params)


def push_anchor(cfg, anchors, anchor_count, actor_params):
    """Add the rollout policy pi_old (``actor_params``) as the newest anchor (slot 0), or fold it into
    the EMA anchor -> (anchors, anchor_count)."""
    if cfg.gtr_weights == "ema":
        tau = jnp.where(anchor_count == 0, 1.0, cfg.gtr_ema_tau)
        anchors = jax.tree.map(lambda a, p: a.at[0].set((1 - tau) * a[0] + tau * p), anchors, actor_params)
        return anchors, jnp.ones((), jnp.int32)
    anchors = jax.tree.map(lambda a, p: jnp.concatenate([p[None], a[:-1]], axis=0), anchors, actor_params)
    return anchors, jnp.minimum(anchor_count + 1, cfg.gtr_anchors)


def anchor_stats(cfg, actor, anchors, obs, actions) -> dict:
    """Per-sample anchor statistics for the flat batch (computed once per iteration): the anchors'
    means and log-stds (kl form) or their log-probabilities of ``actions`` (logratio form), keyed by
    the ``Minibatch`` fields that carry them.  ``actor``: the actor network, (params, obs) -> (mean, log_std)."""
    means, log_stds = jax.vmap(lambda p: actor(p, obs))(anchors)  # (M, N, A)
    if cfg.gtr_form == "logratio":
        return {"anchor_logp": gaussian_log_prob(actions[None], means, log_stds).T}  # (N, M)
    return {"anchor_mean": jnp.swapaxes(means, 0, 1), "anchor_log_std": jnp.swapaxes(log_stds, 0, 1)}


def gtr_divergence(cfg, mb, mean, log_std, new_logp):
    """(D (B, M), kernel width^2) for the configured form; ``mb`` carries ``anchor_stats``' fields."""
    if cfg.gtr_form == "logratio":
        rho = new_logp[:, None] - mb.anchor_logp
        return rho**2, cfg.gtr_logratio_sigma**2
    kl = distributions.gaussian_kl(mb.anchor_mean, mb.anchor_log_std, mean[:, None], log_std[:, None])
    return kl, cfg.gtr_sigma2


def actor_penalty(cfg, mb, mean, log_std, new_logp, weights):
    """GTR's term of the actor loss, per sample: (penalty P, kernel K_mix) of the current policy
    (``mean``, ``log_std``, ``new_logp`` on the minibatch ``mb``) against the anchors, weighted by ``weights``."""
    div, width2 = gtr_divergence(cfg, mb, mean, log_std, new_logp)
    return gtr_penalty(div, weights, cfg.gtr_beta, width2)


def anchor_metrics(cfg, actor, anchors, anchor_count, actor_params, obs, weights) -> dict:
    """``gtr/kl_anchor{k}``: the mean KL from anchor k to the updated policy ``actor_params`` over
    ``obs`` (NaN for an unfilled slot), and ``gtr/weight0``, the newest anchor's weight."""
    mean, log_std = actor(actor_params, obs)
    m_a, s_a = jax.vmap(lambda p: actor(p, obs))(anchors)
    kl = distributions.gaussian_kl(m_a, s_a, mean[None], log_std[None]).mean(axis=1)  # (M,)
    metrics = {}
    for k in range(cfg.gtr_anchors):
        metrics[f"gtr/kl_anchor{k}"] = jnp.where(k < anchor_count, kl[k], jnp.nan)
    metrics["gtr/weight0"] = weights[0]
    return metrics
