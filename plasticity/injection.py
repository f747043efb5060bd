"""Plasticity injection (Nikishin, Oh, Ostrovski, Lyle, Pascanu, Dabney, Barreto 2023, "Deep
reinforcement learning with plasticity injection", NeurIPS, arXiv 2305.15555, sec. 3).

At an update step the network is split into an encoder phi and a head h_theta (its last
``InjectionSpec.layers`` layers, as a layer reset counts them: ``perturb.layers``); theta is frozen and
two copies of a freshly initialised head theta' are added, one trained and one frozen (Expression (1)):

    y = h_theta(phi(x)) + h_theta'(phi(x)) - h_theta'_frozen(phi(x))

so the output is unchanged at the injection and, after it, only theta' and the encoder train (Figure 2:
the encoder keeps learning, through all three heads).  The new trainable params get a fresh optimizer
state: ``tx.init`` of theta' at the first update after the injection (Adam's moments and step count,
Kron's preconditioners, theta_0 of L2 Init, NaP's norms, TRAC's reference point: all theta''s own).

The pieces, all pure functions of pytrees with static shapes (jit and vmap over seeds):

- the network: ``injectable(net, params, plasticity)``, called by an agent's ``init`` on each network
  it offers, makes a ``networks.residual.ResidualHeadNet`` with a zero residual pair when the agent is
  built with ``StaticPlasticity.injection``; the structure is there from the start (checkpoints,
  restored policies and jitted programs keep one shape), and while the pair is zero the network computes
  exactly what it did without it;
- the optimizer: ``frozen_head(tx)`` (``plasticity.optim.optimizer`` applies it) keeps ``tx``'s state over
  the network's own params and a second one over theta', and zeroes the updates of what is frozen:
  before the injection the pair (zero, and kept zero), after it theta and theta'_frozen;
- the event: ``inject(net, params, opt_state, key)`` draws theta' from the network's own initialiser
  (``Net.init``), sets both copies to it and marks the optimizer state injected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from plasticity_zoo.networks.core import Net, path_names
from plasticity_zoo.networks.residual import ResidualHeadNet, head_part, head_paths, join, split
from plasticity_zoo.plasticity import perturb


@dataclass(frozen=True)
class InjectionSpec:
    """What an agent is built with when injection is on (``StaticPlasticity.injection``)."""

    layers: int = 2
    """the head: the last ``layers`` layers of each network (0: the whole network)"""


class InjectState(NamedTuple):
    """The optimizer state of a network with a residual head (``frozen_head``)."""

    stage: jax.Array
    """int32: 0 before the injection; 1 injected, theta''s optimizer state built at the next update; 2 after"""
    inner: Any
    """``tx``'s state over the network's own params (encoder and head theta)"""
    fresh: Any
    """``tx``'s state over theta', the residual's trained copy"""


def head_of(net: Net, params, layers: int) -> tuple:
    """The param-path prefixes of the network's last ``layers`` layers (0: all of them), output layer included."""
    return tuple(prefix for layer in perturb.layers(net, params)[-layers:] for prefix in layer)


def injectable(net: Net, params, plasticity):
    """(net, params) as the agent is built: with a zero residual head when ``plasticity.injection`` is set
    (a ``StaticPlasticity``), else unchanged."""
    spec: Optional[InjectionSpec] = getattr(plasticity, "injection", None)
    if spec is None:
        return net, params
    return ResidualHeadNet.wrap(net, params, head_of(net, params, spec.layers))


def _select(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _hold(tree, paths: set, frozen):
    """``tree`` with every leaf at one of ``paths`` set to 0 where ``frozen`` (a traced bool)."""

    def leaf(path, x):
        return jnp.where(frozen, jnp.zeros_like(x), x) if path_names(path) in paths else x

    return jax.tree_util.tree_map_with_path(leaf, tree)


def frozen_head(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` for a network with a residual head (params without one: ``tx`` itself).

    Before the injection the network's own params train as without the pair and the pair gets no
    update; from the injection on, theta' trains with its own state of ``tx`` (built by ``tx.init`` at
    the first update after the injection) and the head theta and theta'_frozen get none.  Frozen leaves'
    gradients are zeroed before ``tx`` and their updates after it (a weight decay or regulariser inside
    ``tx`` would move them otherwise).
    """

    def init(params):
        base, pair = split(params)
        if pair is None:
            return tx.init(params)
        return InjectState(jnp.zeros((), jnp.int32), tx.init(base), tx.init(pair["fresh"]))

    def update(updates, state, params=None):
        if not isinstance(state, InjectState):
            return tx.update(updates, state, params)
        if params is None:
            raise ValueError("the plasticity-injection optimizer needs params in update()")
        g, g_pair = split(updates)
        p, p_pair = split(params)
        head = head_paths(p_pair)
        injected = state.stage > 0
        u, inner = tx.update(_hold(g, head, injected), state.inner, p)
        u = _hold(u, head, injected)

        def trained(_):  # theta' after the injection: its own state, fresh at the first update
            fresh_state = _select(state.stage == 1, tx.init(p_pair["fresh"]), state.fresh)
            return tx.update(g_pair["fresh"], fresh_state, p_pair["fresh"])

        def held(_):  # before it: no update and the state kept (a branch: no work at one seed)
            return jax.tree.map(jnp.zeros_like, p_pair["fresh"]), state.fresh

        u_fresh, fresh = jax.lax.cond(injected, trained, held, None)
        zero = jax.tree.map(jnp.zeros_like, p_pair["frozen"])
        stage = jnp.where(state.stage == 1, 2, state.stage).astype(jnp.int32)
        return join(u, {"fresh": u_fresh, "frozen": zero}), InjectState(stage, inner, fresh)

    return optax.GradientTransformation(init, update)


def find(opt_state) -> Optional[InjectState]:
    """The ``InjectState`` inside an optimizer state, or None."""
    is_state = lambda n: isinstance(n, InjectState)  # noqa: E731
    found = [n for n in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(n)]
    return found[0] if found else None


def _with_stage(opt_state, stage: int):
    is_state = lambda n: isinstance(n, InjectState)  # noqa: E731
    fix = lambda n: n._replace(stage=jnp.full_like(n.stage, stage)) if is_state(n) else n  # noqa: E731
    return jax.tree.map(fix, opt_state, is_leaf=is_state)


def inject(net: ResidualHeadNet, params, opt_state, key):
    """The injection for one network -> (params, opt_state): theta' drawn from the network's own initialiser
    (``net.init(key)``'s head), both copies set to it, the optimizer state marked injected."""
    base, _ = split(params)
    fresh = head_part(split(net.init(key))[0], net.head)
    return join(base, {"fresh": fresh, "frozen": jax.tree.map(jnp.copy, fresh)}), _with_stage(opt_state, 1)


def with_pair_of(target, params):
    """``target`` (a copy of the network's params, e.g. a target network) with ``params``' residual pair."""
    return join(split(target)[0], jax.tree.map(jnp.copy, split(params)[1]))


def constrain(state: InjectState, params, constrain_one: Callable):
    """``optim.constrain`` for a network with a residual head: ``constrain_one(opt_state, params)`` on the
    network's own params with its own state and on theta' with theta''s, frozen leaves as they came."""
    p, pair = split(params)
    injected = state.stage > 0
    head = head_paths(pair)
    c = constrain_one(state.inner, p)
    keep = jax.tree_util.tree_map_with_path(
        lambda path, new, old: jnp.where(injected, old, new) if path_names(path) in head else new, c, p
    )
    fresh = _select(injected, constrain_one(state.fresh, pair["fresh"]), pair["fresh"])
    return join(keep, {"fresh": fresh, "frozen": pair["frozen"]})
