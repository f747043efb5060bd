"""A trained ensemble in use: its prediction (``predict``), NeuBay's epistemic uncertainty and the
rollout truncation threshold drawn from it, one model step (``step``) and ``rollout``.

Reading order: ``predict``, ``epistemic_uncertainty``, ``uncertainty_threshold``, ``step`` -> ``rollout``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.agents.dynamics.ensemble import _VAL_CHUNK, DynamicsModel, _normalize
from plasticity_zoo.buffers.replay import Transition

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
    """NeuBay's epistemic uncertainty (its ``modules.py``) of each row -> (B,): the std across the elite
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
    """The rollout truncation threshold (NeuBay's ``unc_quantile``): the ``quantile`` of ``epistemic_uncertainty``
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
    """One model step (RAVL's ``rollout_generation.py``): sample (Δs, r) from every member, keep one member
    per row.

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
    """``horizon`` model steps from each start state (RAVL's ``rollout_generation.py``, Unifloral's
    ``mopo.py``) in one ``lax.scan``.

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
