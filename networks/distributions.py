"""Hand-written distributions: diagonal Gaussian and tanh-squashed Gaussian."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG_2PI = jnp.log(2.0 * jnp.pi)


def gaussian_log_prob(x, mean, log_std):
    """log N(x; mean, exp(log_std)^2), summed over the last axis."""
    z = (x - mean) * jnp.exp(-log_std)
    return jnp.sum(-0.5 * z**2 - log_std - 0.5 * LOG_2PI, axis=-1)


def gaussian_kl(mean_p, log_std_p, mean_q, log_std_q):
    """KL(N(mean_p, std_p^2) || N(mean_q, std_q^2)) for diagonal Gaussians, summed over the last axis."""
    var_p, var_q = jnp.exp(2.0 * log_std_p), jnp.exp(2.0 * log_std_q)
    return jnp.sum(log_std_q - log_std_p + (var_p + (mean_p - mean_q) ** 2) / (2.0 * var_q) - 0.5, axis=-1)


def tanh_log_det_jacobian(u):
    """log |d tanh(u) / du| = log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)), summed."""
    return jnp.sum(2.0 * (jnp.log(2.0) - u - jax.nn.softplus(-2.0 * u)), axis=-1)


def tanh_gaussian_sample(key, mean, log_std):
    """a = tanh(u), u ~ N(mean, std^2); returns (a, log pi(a)) with the change of variables."""
    u = mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape, mean.dtype)
    log_prob = gaussian_log_prob(u, mean, log_std) - tanh_log_det_jacobian(u)
    return jnp.tanh(u), log_prob


def tanh_gaussian_log_prob(action, mean, log_std, eps: float = 1e-6):
    """log pi(a) for a given squashed action a in (-1, 1) (clipped to stay finite)."""
    u = jnp.arctanh(jnp.clip(action, -1.0 + eps, 1.0 - eps))
    return gaussian_log_prob(u, mean, log_std) - tanh_log_det_jacobian(u)


def tanh_gaussian_mode(mean):
    """The deterministic (evaluation) action tanh(mean)."""
    return jnp.tanh(mean)


def tanh_max_entropy(act_dim: int) -> float:
    """The most entropy a tanh-squashed policy over ``act_dim`` dimensions can have: its actions lie in
    [-1, 1]^act_dim, where the uniform distribution, of entropy act_dim x log 2, has the most (a
    squashed Gaussian only approaches it).  A SAC entropy target above it can never be met: the
    temperature would grow without bound."""
    return act_dim * math.log(2.0)
