"""Termination functions ``next_obs (..., O) -> bool (...)`` of the MuJoCo env families, for
model rollouts (a learned dynamics model predicts the next state; the env's own rule says whether
it is terminal).  Env facts, so they live with the envs; the offline agents import them.

Rules from Gymnasium's v5 envs (``healthy`` conditions), as in the hand-coded done functions of
MOPO's and RAVL's code (Sims et al. 2024; anyasims/edge-of-reach ``rollout_generation.py``) and
D4RL's hopper / walker2d datasets.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp


def hopper_done(next_obs):
    """Hopper-v5 (Gymnasium's v5 rule): healthy while z = s[0] > 0.7, |angle| = |s[1]| < 0.2, every value
    is finite and |s[1:]| < 100.  Observations start at z (x excluded, the v5 default).

    Gymnasium tests |state| < 100 on the unclipped velocities while the observation clips them to
    +-10, so a velocity above 100 terminates the env but not this function (unobservable from s')."""
    z, angle = next_obs[..., 0], next_obs[..., 1]
    healthy = (
        jnp.isfinite(next_obs).all(-1)
        & (jnp.abs(next_obs[..., 1:]) < 100.0).all(-1)
        & (z > 0.7)
        & (jnp.abs(angle) < 0.2)
    )
    return ~healthy


def walker2d_done(next_obs):
    """Walker2d-v5 (Gymnasium's v5 rule): healthy while 0.8 < z < 2 and -1 < angle < 1 (NaN -> done)."""
    z, angle = next_obs[..., 0], next_obs[..., 1]
    return ~((z > 0.8) & (z < 2.0) & (angle > -1.0) & (angle < 1.0))


def never_done(next_obs):
    """Envs that only truncate: HalfCheetah, Pendulum (used by the small offline tests)."""
    return jnp.zeros(next_obs.shape[:-1], bool)


halfcheetah_done = never_done
TERMINATION_FNS = {"hopper": hopper_done, "walker2d": walker2d_done, "halfcheetah": never_done, "pendulum": never_done}


def register_termination(name: str, fn: Callable):
    """Add the done function of another env family (``name`` = the id's lower-cased part before '-')."""
    TERMINATION_FNS[name.lower()] = fn


def termination_fn(env_id: str) -> Callable:
    """The done function ``next_obs (..., O) -> bool (...)`` for an env id or D4RL name:
    'Hopper-v5', 'hopper', 'hopper-medium-v2', 'Walker2d-v5', 'walker2d', 'HalfCheetah-v5', ..."""
    name = str(env_id).strip().lower()
    base = name.split("-")[0]
    if ":" in name or base not in TERMINATION_FNS:
        raise ValueError(
            f"no termination function for env {env_id!r}; supported: "
            f"{', '.join(sorted(TERMINATION_FNS))} (ids such as 'Hopper-v5' or D4RL names such as "
            f"'hopper-medium-v2'); add one with envs.termination.register_termination"
        )
    return TERMINATION_FNS[base]
