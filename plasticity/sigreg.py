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

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from networks import instrument


def _projections(z, key, num_slices: int):
    d = z.shape[-1]
    a = jax.random.normal(key, (d, num_slices), z.dtype)
    a = a / jnp.linalg.norm(a, axis=0, keepdims=True)
    return z @ a  # (..., N, slices)


def _ecf_error(y, t):
    """(Re phi(t) - e^{-t^2/2})^2 + (Im phi(t))^2 for each t and slice: shape (..., T, slices)."""
    ty = t[:, None, None] * y[..., None, :, :]  # (..., T, N, S)
    re = jnp.cos(ty).mean(axis=-2)
    im = jnp.sin(ty).mean(axis=-2)
    return (re - jnp.exp(-0.5 * t**2)[:, None]) ** 2 + im**2


def sigreg(z, key, variant: str = "rl", num_slices: int = 16, num_points: int | None = None):
    """SIGReg of features ``z`` shaped (N, D) (or (M, N, D) for an ensemble: mean over members)."""
    if variant == "rl":
        t = jnp.linspace(-5.0, 5.0, num_points or 8)
        err = _ecf_error(_projections(z, key, num_slices), t)
        value = err.mean(axis=(-2, -1))
    elif variant == "lejepa":
        n_pts = num_points or 17
        if n_pts % 2 == 0:
            raise ValueError("the LeJEPA quadrature needs an odd number of points")
        t = jnp.linspace(0.0, 3.0, n_pts)
        dt = t[1] - t[0]
        w = jnp.full(n_pts, 2 * dt).at[0].set(dt).at[-1].set(dt) * jnp.exp(-0.5 * t**2)
        err = _ecf_error(_projections(z, key, num_slices), t)
        value = z.shape[-2] * jnp.einsum("t,...ts->...s", w, err).mean(axis=-1)
    else:
        raise ValueError(f"unknown SIGReg variant {variant!r}; choose rl or lejepa")
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
