"""SIGReg: sketched isotropic-Gaussian regularisation of a representation (spec section 4).

Project the features on random unit directions and compare each 1-D projection's empirical
characteristic function phi(t) = mean_n exp(i t y_n) with the standard normal's exp(-t^2/2).

- ``rl`` (Saheb et al. 2026, arXiv 2602.19373): 16 slices, 8 points uniform on [-5, 5], no
  window, no factor N: mean over t and slices of (Re phi - e^{-t^2/2})^2 + (Im phi)^2.
- ``lejepa`` (Balestriero & LeCun 2025, arXiv 2511.08544): the Epps-Pulley statistic
  N * int_0^{t_max} |phi(t) - e^{-t^2/2}|^2 w(t) dt with a 17-point trapezoid on [0, 3]
  (weights 2 dt, dt at the ends), window w(t) = e^{-t^2/2}, averaged over slices.

Directions are re-drawn every call from the given key.  ``regularized(loss_fn, name)`` adds
``coef * SIGReg(features of network name)`` to a loss when called with ``sigreg=`` a
``SIGRegSpec`` (the agent passes the one it was built with, ``state.plasticity.sigreg``, a static
field of its state, so the setting is part of every jitted program's cache key).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from networks import instrument


def _projections(z, key, num_slices: int):
    d = z.shape[-1]
    a = jax.random.normal(key, (d, num_slices), z.dtype)
    a = a / jnp.linalg.norm(a, axis=0, keepdims=True)
    return z @ a  # (..., N, slices)


def _grid(variant: str, num_points: int | None):
    """The t grid as integer multiples of one base: (base, ks, weights) with sum_k weights_k err(k base)
    equal to the variant's average / quadrature over its points.

    ``rl``: t = linspace(-5, 5, n), symmetric, so err(-t) = err(t) (cos is even, sin odd) and only
    t >= 0 is evaluated, each with its multiplicity / n.  ``lejepa``: t = linspace(0, 3, n), trapezoid
    weights times the window e^{-t^2/2}.
    """
    if variant == "rl":
        n = num_points or 8
        step = 10.0 / (n - 1)
        if n % 2 == 0:  # +-(2j + 1) step / 2
            base, ks = step / 2, np.arange(1, n, 2)
            weights = np.full(len(ks), 2.0 / n)
        else:  # 0, +-j step
            base, ks = step, np.arange(0, (n + 1) // 2)
            weights = np.where(ks == 0, 1.0, 2.0) / n
    elif variant == "lejepa":
        n = num_points or 17
        if n % 2 == 0:
            raise ValueError("the LeJEPA quadrature needs an odd number of points")
        base, ks = 3.0 / (n - 1), np.arange(n)
        t = base * ks
        weights = np.full(n, 2 * base)
        weights[0] = weights[-1] = base
        weights = weights * np.exp(-0.5 * t**2)
    else:
        raise ValueError(f"unknown SIGReg variant {variant!r}; choose rl or lejepa")
    return base, ks, weights


def _computed_once(fn, x):
    """``fn(x)`` held in buffers of its own.

    XLA's CPU fusion evaluates an elementwise producer again inside each of its consumers: here cos
    and sin once per k and per output (90 us for K = 4 on 256 x 16 projections against 32 us
    computed once).  A loop's results are buffers; this one runs once, and XLA cannot prove that
    (twice if the first element is NaN, giving the same values), so it keeps the loop."""
    trips = 1 + jnp.isnan(x.reshape(-1)[0]).astype(jnp.int32)
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, x))
    return jax.lax.fori_loop(0, trips, lambda i, out: fn(x), init)


def _powers(theta, ks):
    """cos(k theta), sin(k theta) for each k in ``ks``, stacked at axis -3: two (..., K, N, S) arrays.

    One cos and one sin per projection: e^{i k theta} for the other k by complex multiplication with
    e^{i theta} (the grid points are integer multiples of one base), which matters because the
    transcendentals were most of SIGReg's cost on CPU.
    """
    one = _computed_once(lambda t: (jnp.cos(t), jnp.sin(t)), theta)

    def mul(u, v):
        return u[0] * v[0] - u[1] * v[1], u[0] * v[1] + u[1] * v[0]

    def power(k):  # e^{i k theta} by repeated squaring (k >= 1)
        out, sq = None, one
        while k:
            if k & 1:
                out = sq if out is None else mul(out, sq)
            k >>= 1
            if k:
                sq = mul(sq, sq)
        return out

    step = ks[1] - ks[0] if len(ks) > 1 else 1  # the grids are evenly spaced in k
    z_step = power(step)
    z = (jnp.ones_like(theta), jnp.zeros_like(theta)) if ks[0] == 0 else power(ks[0])
    re, im = [], []
    for i in range(len(ks)):
        if i:
            z = mul(z, z_step)
        re.append(z[0])
        im.append(z[1])
    return jnp.stack(re, axis=-3), jnp.stack(im, axis=-3)


def _ecf_moments(y, base: float, ks):
    """Re and Im of the empirical characteristic function at t_k = k * base, each slice: (..., K, S)."""
    cos, sin = _powers(base * y, ks)
    return cos.mean(axis=-2), sin.mean(axis=-2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _ecf_errors(y, base: float, ks: tuple):
    """(Re phi(t_k) - e^{-t_k^2/2})^2 + (Im phi(t_k))^2 for t_k = k * base, each slice: (..., K, S).

    The gradient is written out (``_ecf_errors_bwd``) so that the backward pass is one fused kernel
    over the projections instead of autodiff's chain through every power and mean.
    """
    re, im = _ecf_moments(y, base, ks)
    return (re - _gaussian_cf(base, ks, y.dtype)) ** 2 + im**2


def _gaussian_cf(base, ks, dtype):
    return jnp.asarray(np.exp(-0.5 * (np.asarray(ks) * base) ** 2)[:, None], dtype)  # (K, 1)


def _ecf_errors_fwd(y, base, ks):
    re, im = _ecf_moments(y, base, ks)
    return (re - _gaussian_cf(base, ks, y.dtype)) ** 2 + im**2, (y, re, im)


def _ecf_errors_bwd(base, ks, residuals, g):
    """d err_k / d y_n = (2 t_k / N) [-(Re phi_k - e^{-t_k^2/2}) sin(t_k y_n) + Im phi_k cos(t_k y_n)]."""
    y, re, im = residuals
    n = y.shape[-2]
    t = jnp.asarray(np.asarray(ks, np.float64) * base, y.dtype)[:, None]  # (K, 1)
    c = (2.0 / n) * t * g * (re - _gaussian_cf(base, ks, y.dtype))  # (..., K, S)
    s = (2.0 / n) * t * g * im
    cos, sin = _powers(base * y, ks)  # (..., K, N, S)
    return (jnp.sum(s[..., None, :] * cos - c[..., None, :] * sin, axis=-3),)


_ecf_errors.defvjp(_ecf_errors_fwd, _ecf_errors_bwd)


def sigreg(z, key, variant: str = "rl", num_slices: int = 16, num_points: int | None = None):
    """SIGReg of features ``z`` shaped (N, D) (or (M, N, D) for an ensemble: mean over members)."""
    base, ks, weights = _grid(variant, num_points)
    err = _ecf_errors(_projections(z, key, num_slices), base, tuple(int(k) for k in ks))  # (..., K, S)
    value = jnp.sum(jnp.asarray(weights[:, None], err.dtype) * err, axis=-2).mean(axis=-1)  # no dot: one fused kernel
    if variant == "lejepa":
        value = z.shape[-2] * value
    return jnp.mean(value)


sketched_isotropy = sigreg  # the statistic, under a name the wrapper's ``sigreg=`` argument does not shadow


@dataclass(frozen=True)
class SIGRegSpec:
    coef: float
    variant: str = "rl"
    num_slices: int = 16


def regularized(loss_fn, name: str):
    """``loss_fn(params, ...)`` plus ``coef * SIGReg`` of network ``name``'s features when ``sigreg`` is given.

    The features are those of the network's first call inside the loss (its online forward
    pass).  Pass ``sigreg=`` the ``SIGRegSpec`` (None or coef 0: off) and ``reg_key=`` for the
    random directions.  Returns the loss unchanged (same structure, including any aux) when off.
    """

    def wrapped(params, *args, reg_key=None, sigreg: SIGRegSpec | None = None, **kwargs):
        spec = sigreg
        if spec is None or spec.coef <= 0:
            return loss_fn(params, *args, **kwargs)
        if reg_key is None:
            raise ValueError(f"SIGReg on {name!r} needs reg_key")
        with instrument.record([name]) as rec:
            out = loss_fn(params, *args, **kwargs)
        if name not in rec.features:
            raise ValueError(f"SIGReg: network {name!r} was not called inside its loss")
        penalty = spec.coef * sketched_isotropy(rec.features[name], reg_key, spec.variant, spec.num_slices)
        if isinstance(out, tuple):
            return (out[0] + penalty, *out[1:])
        return out + penalty

    return wrapped
