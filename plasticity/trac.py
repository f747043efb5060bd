"""TRAC, a parameter-free wrapper over a base optimizer (Muppidi, Zhang, Yang 2024, "Fast TRAC: A
Parameter-Free Optimizer for Lifelong Reinforcement Learning", NeurIPS, arXiv 2405.16642, Algorithm 1).

TRAC runs the base optimizer (Adam in the paper) on an unscaled iterate Delta and plays the params
``theta_ref + S * Delta``, with the scale S tuned online by the erfi tuner of Zhang, Yang, Cutkosky,
Paschalidis 2024 over a set of discount factors beta.  One step, with g the gradient at theta_t and u the
base optimizer's update for it:

    Delta_t     = (theta_t - theta_ref) / (S_{t-1} + eps)          (S_{t-1} = sum_beta s_beta, unclipped)
    h_t         = <g, Delta_t>                                     (over every parameter of the network)
    v_beta      <- beta^2 v_beta + h_t^2
    sigma_beta  <- beta sigma_beta - h_t
    s_beta      =  s_init / erfi(1 / sqrt 2) * erfi(sigma_beta / (sqrt 2 sqrt(v_beta) + eps))
    Delta_{t+1} = Delta_t + u
    theta_{t+1} = theta_ref + max(sum_beta s_beta, 0) * Delta_{t+1}

This is the authors' package as published (``trac-optimizer`` 0.0.2, ``trac_optimizer/trac.py``:
``start_trac(log_file, torch.optim.Adam)``): betas 0.9, ..., 0.999999 (six), s_init (its ``s_prev``) 1e-8,
eps 1e-8, s_beta starting at 0, sigma_beta at 1e-8, v_beta at 0, theta_ref the params at the first step,
and the played scale clipped at 0 (the package's ``max(s_sum, 0.0)``; its experimental JAX version omits
the clip).  ``tests/test_fidelity_interventions.py`` checks this module against that package number by
number (``tests/fixtures/trac_reference.npz``).

erfi has no JAX primitive: ``erfi`` sums its Maclaurin series (every term has the sign of x, so the
float32 sum has no cancellation); it overflows to inf past |x| ~ 9.4, where erfi itself leaves float32.

theta_ref and the anchor below are kept as tuples aligned with the param leaves (as the regularisers' theta_0
is), so ``resets.zero_moments`` never mistakes them for Adam moments.  With ``post_scaled`` (PPO scales
the optimizer's update by its annealed learning rate after the chain) the update passes the base step
through and records theta_t; ``combine`` (called from ``plasticity.optim.constrain`` on the params the caller
reached) turns that base step into TRAC's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

BETAS = (0.9, 0.99, 0.999, 0.9999, 0.99999, 0.999999)  # Algorithm 1's discount factors (the package's default)
ERFI_TERMS = 160  # enough for every |x| below erfi's float32 overflow (~9.4)


@dataclass(frozen=True)
class TracSpec:
    s_init: float = 1e-8
    """s_init, the tuner's scale (the package's ``s_prev``)"""
    eps: float = 1e-8
    betas: tuple = BETAS


class TracState(NamedTuple):
    count: jax.Array
    """steps taken (int32); theta_ref is taken at step 0"""
    s: jax.Array
    """(betas,) the tuner's scales s_beta"""
    sigma: jax.Array
    """(betas,) sigma_beta"""
    variance: jax.Array
    """(betas,) v_beta"""
    ref: tuple
    """theta_ref, one array per param leaf"""
    prev: jax.Array
    """S_{t-1} = sum s_beta before the last step (Delta's divisor)"""
    anchor: tuple
    """post_scaled only: theta_t of the last step, one array per param leaf (else empty)"""
    inner: Any
    """the base optimizer's state"""


def erfi(x, terms: int = ERFI_TERMS):
    """The imaginary error function erfi(x) = -i erf(ix) = 2 / sqrt(pi) sum_n x^(2n+1) / (n! (2n+1)), elementwise."""
    x = jnp.asarray(x, jnp.float32)
    n = jnp.arange(1, terms, dtype=jnp.float32)
    powers = jnp.cumprod((x * x)[..., None] / n, axis=-1)  # x^(2n) / n!, n = 1 ...
    powers = jnp.concatenate([jnp.ones_like(x)[..., None], powers], axis=-1)
    odd = 2.0 * jnp.arange(terms, dtype=jnp.float32) + 1.0
    return (2.0 / math.sqrt(math.pi)) * x * jnp.sum(powers / odd, axis=-1)


def tune(spec: TracSpec, s, sigma, variance, h):
    """One step of the erfi tuner -> (s, sigma, variance)."""
    betas = jnp.asarray(spec.betas, jnp.float32)
    variance = betas**2 * variance + h**2
    sigma = betas * sigma - h
    csi = erfi(1.0 / math.sqrt(2.0))
    s = spec.s_init / csi * erfi(sigma / (math.sqrt(2.0) * jnp.sqrt(variance) + spec.eps))
    return s, sigma, variance


def trac(
    tx: optax.GradientTransformation, spec: TracSpec = TracSpec(), post_scaled: bool = False
) -> optax.GradientTransformation:
    """TRAC over the base transformation ``tx`` (its update is added to the params, as optax's are)."""
    n = len(spec.betas)

    def init(params):
        leaves = jax.tree.leaves(params)
        return TracState(
            jnp.zeros((), jnp.int32),
            jnp.zeros(n, jnp.float32),
            jnp.full(n, 1e-8, jnp.float32),
            jnp.zeros(n, jnp.float32),
            tuple(jnp.copy(x) for x in leaves),
            jnp.zeros((), jnp.float32),
            tuple(jnp.copy(x) for x in leaves) if post_scaled else (),
            tx.init(params),
        )

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("TRAC needs params in update()")
        u, inner = tx.update(updates, state.inner, params)
        p_leaves, treedef = jax.tree.flatten(params)
        g_leaves, u_leaves = jax.tree.leaves(updates), jax.tree.leaves(u)
        ref = tuple(jnp.where(state.count == 0, p, r) for p, r in zip(p_leaves, state.ref))
        prev = jnp.sum(state.s)
        delta = [(p - r) / (prev + spec.eps) for p, r in zip(p_leaves, ref)]
        h = sum(jnp.vdot(d, g.astype(d.dtype)) for d, g in zip(delta, g_leaves))
        s, sigma, variance = tune(spec, state.s, state.sigma, state.variance, h)
        count = optax.safe_increment(state.count)
        if post_scaled:  # the caller scales u, then ``combine`` (through optim.constrain) plays TRAC's params
            return u, TracState(count, s, sigma, variance, ref, prev, tuple(p_leaves), inner)
        scale = jnp.maximum(jnp.sum(s), 0.0)
        new = [(r + scale * (d + x) - p).astype(p.dtype) for r, d, x, p in zip(ref, delta, u_leaves, p_leaves)]
        return treedef.unflatten(new), TracState(count, s, sigma, variance, ref, prev, (), inner)

    return optax.GradientTransformation(init, update)


def find(opt_state):
    """The first ``TracState`` inside an optimizer state, or None."""
    is_state = lambda n: isinstance(n, TracState)  # noqa: E731
    found = [n for n in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(n)]
    return found[0] if found else None


def combine(state: TracState, params, spec: TracSpec = TracSpec()):
    """For ``post_scaled`` callers: the params ``theta_t + (the caller's base step)`` reached -> TRAC's
    theta_{t+1} = theta_ref + max(S, 0) ((theta_t - theta_ref) / (S_{t-1} + eps) + base step)."""
    leaves, treedef = jax.tree.flatten(params)
    scale = jnp.maximum(jnp.sum(state.s), 0.0)
    out = [
        (r + scale * ((a - r) / (state.prev + spec.eps) + (x - a))).astype(x.dtype)
        for x, a, r in zip(leaves, state.anchor, state.ref)
    ]
    return treedef.unflatten(out)
