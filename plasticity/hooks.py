"""Where the training loop calls plasticity: metrics and resets every K updates, SIGReg in the loss.

An agent takes part by declaring its plastic networks: ``PLASTIC = {name: (params_field,
opt_state_field)}``, ``plastic_params(state)``, ``plastic_losses(state, batch, key)`` (each
network's training loss as a function of its params) and a state field ``name`` holding the
``Net`` (or ``plastic_nets(state)``).  SIGReg additionally needs the agent to wrap those
losses with ``plasticity.sigreg.regularized`` and list them in ``SIGREG_NETWORKS``.
Interventions an agent cannot take are refused with a clear error.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from plasticity import metrics as metrics_lib
from plasticity import resets
from plasticity.sigreg import SIGRegSpec
from training.config import PlasticityConfig

DECLARATIONS = ("PLASTIC", "plastic_params", "plastic_losses")


def check_applicable(cfg: PlasticityConfig, agent, agent_name: str):
    """Raise a clear error for any requested intervention the agent cannot take."""
    cfg.validate()
    wanted = [flag for flag, on in (("--plasticity.metrics-every", cfg.metrics_every > 0),
                                    ("--plasticity.redo", cfg.redo), ("--plasticity.regrama", cfg.regrama),
                                    ("--plasticity.sigreg-coef", cfg.sigreg_coef > 0)) if on]
    missing = [d for d in DECLARATIONS if not hasattr(agent, d)]
    if wanted and missing:
        raise ValueError(f"{', '.join(wanted)} does not apply to agent {agent_name!r}: it declares no plastic "
                         f"networks ({', '.join(missing)} missing)")
    if cfg.least and (getattr(agent, "KIND", None) != "offpolicy" or not hasattr(agent, "least_signals")):
        raise ValueError(f"--plasticity.least does not apply to agent {agent_name!r}: LEAST stops episodes of "
                         "online off-policy agents from their Q and TD-loss histories (not on-policy or offline)")
    if cfg.sigreg_coef > 0 and not getattr(agent, "SIGREG_NETWORKS", ()):
        raise ValueError(f"--plasticity.sigreg-coef does not apply to agent {agent_name!r}: its losses "
                         "expose no representation to regularise")


def sigreg_spec(cfg: PlasticityConfig) -> SIGRegSpec | None:
    return SIGRegSpec(cfg.sigreg_coef, cfg.sigreg_variant, cfg.sigreg_slices) if cfg.sigreg_coef > 0 else None


def _net(agent, state, name):
    if hasattr(agent, "plastic_nets"):
        return agent.plastic_nets(state)[name]
    return getattr(state, name)


def reset_step(agent, cfg: PlasticityConfig, sample, state, buffer, key):
    """One ReDo/ReGraMa event for one seed -> (state, {plasticity/<net>/reset_fraction})."""
    method, tau = ("redo", cfg.redo_tau) if cfg.redo else ("regrama", cfg.regrama_tau)
    k_batch, k_loss, k_init = jax.random.split(key, 3)
    batch = sample(buffer, k_batch, cfg.reset_batch)
    losses = agent.plastic_losses(state, batch, k_loss)
    params = agent.plastic_params(state)
    out = {}
    for i, (name, (p_field, o_field)) in enumerate(agent.PLASTIC.items()):
        loss = losses[name]
        net_params = params[name]
        scores = resets.scores(method, lambda: loss(net_params), name)
        masks = {tap: resets.select(s, tau, cfg.reset_max_fraction) for tap, s in scores.items()}
        new_params, new_opt = resets.reset_neurons(_net(agent, state, name), net_params, getattr(state, o_field),
                                                   masks, jax.random.fold_in(k_init, i), cfg.reset_layer_norm)
        state = state.replace(**{p_field: new_params, o_field: new_opt})
        n = sum(m.size for m in masks.values())
        out[f"plasticity/{name}/reset_fraction"] = sum(m.sum() for m in masks.values()) / n
    return state, out


def metrics_step(agent, state, batch, init_params, key):
    """Plasticity metrics of every plastic network for one seed on ``batch``."""
    return metrics_lib.compute(agent.plastic_losses(state, batch, key), agent.plastic_params(state), init_params)


class Hooks:
    """Host-side scheduling of the plasticity events, for N vmapped seeds."""

    def __init__(self, cfg: PlasticityConfig, agent, agent_name: str, sample):
        check_applicable(cfg, agent, agent_name)
        self.cfg, self.agent, self.sample = cfg, agent, sample
        self.resetting = cfg.redo or cfg.regrama
        self.metrics_batch = None
        self.init_params = None
        if self.resetting:
            self._reset = jax.jit(jax.vmap(partial(reset_step, agent, cfg, sample)), donate_argnums=(0,))
        if cfg.metrics_every:
            self._metrics = jax.jit(jax.vmap(partial(metrics_step, agent)))
            self._sample = jax.jit(jax.vmap(lambda b, k: sample(b, k, cfg.metrics_batch)))

    def start(self, state):
        if self.cfg.metrics_every:
            self.init_params = jax.tree.map(jnp.copy, self.agent.plastic_params(state))

    def after_updates(self, before: int, after: int, state, buffer, key):
        """Run the events due between update counts ``before`` and ``after`` -> (state, per-seed rows)."""
        rows = None
        every = self.cfg.reset_every
        if self.resetting and every and after // every > before // every:
            keys = jax.random.split(key, jax.tree.leaves(state)[0].shape[0])
            state, out = self._reset(state, buffer, keys)
            rows = _rows(out)
        every = self.cfg.metrics_every
        if every and after // every > before // every:
            n = jax.tree.leaves(state)[0].shape[0]
            k_batch, k_metrics = jax.random.split(jax.random.fold_in(key, 1))
            if self.metrics_batch is None:  # the fixed held-out batch, drawn once per run
                self.metrics_batch = self._sample(buffer, jax.random.split(k_batch, n))
            out = self._metrics(state, self.metrics_batch, self.init_params, jax.random.split(k_metrics, n))
            rows = _merge(rows, _rows(out))
        return state, rows

    def host_state(self):
        return {"metrics_batch": None if self.metrics_batch is None else jax.tree.map(np.asarray, self.metrics_batch)}

    def restore(self, host):
        batch = host.get("metrics_batch")
        self.metrics_batch = None if batch is None else jax.tree.map(jnp.asarray, batch)


def _rows(out: dict) -> list[dict]:
    out = {k: np.asarray(v) for k, v in out.items()}
    n = len(next(iter(out.values())))
    return [{k: float(v[j]) for k, v in out.items()} for j in range(n)]


def _merge(a, b):
    if a is None:
        return b
    return [{**x, **y} for x, y in zip(a, b)]
