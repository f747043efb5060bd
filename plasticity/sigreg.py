"""SIGReg: sketched isotropic-Gaussian regularisation of a representation (LeJEPA and its RL variant).

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

from plasticity_zoo.networks import instrument


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
    and sin once per k and per output (with XLA's own cos and sin: 90 us for K = 4 on 256 x 16
    projections against 32 us computed once).  A loop's results are buffers; this one runs once, and
    XLA cannot prove that (twice if the first element is NaN, giving the same values), so it keeps
    the loop."""
    trips = 1 + jnp.isnan(x.reshape(-1)[0]).astype(jnp.int32)
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, x))
    return jax.lax.fori_loop(0, trips, lambda i, out: fn(x), init)


# pi / 2 split in three for Cody and Waite's argument reduction: the first two have 8 significant
# bits, so q * part is exact in float32 for |q| < 2^16 (|x| < 1e5); the three sum to pi / 2 within 6e-15.
_HALF_PI_PARTS = (1.5703125, 4.84466552734375e-4, -6.397578431460715e-7)


def _cos_sin(x):
    """cos x and sin x in float32 within 1e-7 of the exact values for |x| < 1e5, in one elementwise pass.

    x = q pi/2 + r with |r| <= pi/4 (Cody-Waite reduction), then the minimax polynomials of Moshier's
    Cephes ``sinf`` / ``cosf`` in r, swapped and negated by q mod 4.  XLA's CPU ``sin`` and ``cos`` each
    reduce the argument on their own and cost about 10 times an ``exp``; they were a third of SIGReg's
    kernel time in a SAC update.  Past |x| = 1e5 the reduction loses accuracy (the projections of
    features that large have no meaningful characteristic function at these t anyway).
    """
    q = jnp.round(x * (2 / np.pi))
    r = ((x - q * _HALF_PI_PARTS[0]) - q * _HALF_PI_PARTS[1]) - q * _HALF_PI_PARTS[2]
    z = r * r
    sin_r = r + r * z * ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1)
    cos_r = 1.0 - 0.5 * z + z * z * ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2)
    quadrant = q.astype(jnp.int32) & 3
    odd = (quadrant & 1) == 1
    cos = jnp.where(odd, sin_r, cos_r)
    sin = jnp.where(odd, cos_r, sin_r)
    return jnp.where(((quadrant + 1) & 2) == 2, -cos, cos), jnp.where((quadrant & 2) == 2, -sin, sin)


def _power_series(one, ks):
    """(cos(k theta), sin(k theta)) for each k in ``ks``, from ``one`` = (cos theta, sin theta).

    e^{i k theta} by complex multiplication (the grid points are integer multiples of one base), so
    each projection needs one cos and one sin whatever the number of grid points.
    """

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
    z = (jnp.ones_like(one[0]), jnp.zeros_like(one[0])) if ks[0] == 0 else power(ks[0])
    for i in range(len(ks)):
        if i:
            z = mul(z, z_step)
        yield z


def _ecf_moments(y, base: float, ks):
    """Re and Im of the empirical characteristic function at t_k = k * base, each slice: (..., K, S),
    and (cos, sin) of the scaled projections (the backward pass's residuals)."""
    one = _computed_once(_cos_sin, base * y)
    re, im = zip(*_power_series(one, ks))
    return jnp.stack(re, axis=-3).mean(axis=-2), jnp.stack(im, axis=-3).mean(axis=-2), one


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _ecf_errors(y, base: float, ks: tuple):
    """(Re phi(t_k) - e^{-t_k^2/2})^2 + (Im phi(t_k))^2 for t_k = k * base, each slice: (..., K, S).

    The gradient is written out (``_ecf_errors_bwd``) so that the backward pass is one fused kernel
    over the projections instead of autodiff's chain through every power and mean.
    """
    re, im, _ = _ecf_moments(y, base, ks)
    return (re - _gaussian_cf(base, ks, y.dtype)) ** 2 + im**2


def _gaussian_cf(base, ks, dtype):
    return jnp.asarray(np.exp(-0.5 * (np.asarray(ks) * base) ** 2)[:, None], dtype)  # (K, 1)


def _ecf_errors_fwd(y, base, ks):
    re, im, one = _ecf_moments(y, base, ks)
    return (re - _gaussian_cf(base, ks, y.dtype)) ** 2 + im**2, (one, re, im)


def _ecf_errors_bwd(base, ks, residuals, g):
    """d err_k / d y_n = (2 t_k / N) [-(Re phi_k - e^{-t_k^2/2}) sin(t_k y_n) + Im phi_k cos(t_k y_n)],
    summed over k term by term from the forward pass's cos and sin (one elementwise pass, no
    (K, N, S) intermediate)."""
    one, re, im = residuals
    n = one[0].shape[-2]
    t = jnp.asarray(np.asarray(ks, np.float64) * base, re.dtype)[:, None]  # (K, 1)
    c = (2.0 / n) * t * g * (re - _gaussian_cf(base, ks, re.dtype))  # (..., K, S)
    s = (2.0 / n) * t * g * im
    grad = None
    for i, (cos, sin) in enumerate(_power_series(one, ks)):
        term = s[..., i, None, :] * cos - c[..., i, None, :] * sin
        grad = term if grad is None else grad + term
    return (grad,)


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
