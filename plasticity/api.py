"""What an agent declares to take part in plasticity metrics and interventions (Protocols).

Plasticity sits below the agents, so the agent contract (``agents/api.py``) builds on these.

- ``PlasticAgent``: the plastic networks by name.  ``PLASTIC = {name: (params_field, opt_state_field)}``
  names the state fields; ``plastic_params(state)`` and ``plastic_nets(state)`` return each network's
  params and its ``networks.Net`` (whose layers and initialisers resets and NE use), and
  ``plastic_losses(state, batch, key)`` each network's training loss as a function of its params
  (metrics, ReDo / ReGraMa scores and NE gradients come from it).  ``SIGREG_NETWORKS`` lists the
  networks whose losses are wrapped with ``plasticity.sigreg.regularized`` (empty: SIGReg refused).
- ``MeasuredAgent``: networks the plasticity metrics read but no intervention rewrites (e.g. a
  recurrent encoder and the heads on it sharing one params field and optimizer):
  ``metric_params(state)`` and ``metric_losses(state, batch, key)``, shaped like ``plastic_params``
  and ``plastic_losses``.  ``measured_params`` / ``measured_losses`` read either declaration.
- ``LEASTAgent``: LEAST's per-transition signals (Q and TD loss) for early episode termination.
- ``ExplorationNoiseAgent``: an explicit exploration noise that LEAST's noise increase can raise.

``declared_params`` / ``declared_nets`` build the two accessors from ``PLASTIC``; ``StaticPlasticity``
is what an agent is built with (its optimizers' Kron / NE masks and SIGReg).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

from plasticity_zoo.plasticity.injection import InjectionSpec
from plasticity_zoo.plasticity.optim import OptimSpec
from plasticity_zoo.plasticity.sigreg import SIGRegSpec


@dataclass(frozen=True)
class StaticPlasticity:
    """The plasticity choices that change an agent's traced program, fixed when it is built.

    ``optim``: Kron / NE masks / regularisers / TRAC in the plastic networks' optimizers
    (``plasticity.optim.optimizer(..., spec=optim)``); ``sigreg``: SIGReg in the losses wrapped with
    ``plasticity.sigreg.regularized`` (``sigreg=``); ``injection``: the residual heads of plasticity
    injection (``plasticity.injection.injectable``).  An agent's ``init(..., plasticity)`` stores it as a
    static field of its state (``state.plasticity``), so ``update`` reads it there and jit's cache keys on it.
    """

    optim: Optional[OptimSpec] = None
    sigreg: Optional[SIGRegSpec] = None
    injection: Optional[InjectionSpec] = None
    """plasticity injection: the networks an agent passes through ``plasticity.injection.injectable`` get a
    residual head of this many layers (their optimizers, from ``optim``, freeze what is frozen)"""


@runtime_checkable
class PlasticAgent(Protocol):
    PLASTIC: Mapping[str, tuple[str, str]]
    SIGREG_NETWORKS: tuple[str, ...]

    def plastic_params(self, state) -> dict: ...

    def plastic_nets(self, state) -> dict: ...

    def plastic_losses(self, state, batch, key) -> Mapping[str, Callable[[Any], Any]]: ...


@runtime_checkable
class MeasuredAgent(Protocol):
    def metric_params(self, state) -> dict: ...

    def metric_losses(self, state, batch, key) -> Mapping[str, Callable[[Any], Any]]: ...


def measured(agent) -> bool:
    """Whether the plasticity metrics apply: the agent declares plastic or measured networks."""
    return isinstance(agent, (PlasticAgent, MeasuredAgent))


def measured_params(agent, state) -> dict:
    """{network: params} the metrics read: ``metric_params`` where declared, else ``plastic_params``."""
    return agent.metric_params(state) if isinstance(agent, MeasuredAgent) else agent.plastic_params(state)


def measured_losses(agent, state, batch, key) -> Mapping[str, Callable[[Any], Any]]:
    """{network: loss(params)} the metrics read, keyed like ``measured_params``."""
    if isinstance(agent, MeasuredAgent):
        return agent.metric_losses(state, batch, key)
    return agent.plastic_losses(state, batch, key)


@runtime_checkable
class LEASTAgent(Protocol):
    def least_signals(self, state, transition, key): ...


@runtime_checkable
class ExplorationNoiseAgent(Protocol):
    def with_exploration_noise(self, state, sigma): ...


def declared_params(plastic: dict):
    """``plastic_params(state)`` built from an agent's ``PLASTIC`` declaration: {name: params}."""

    def plastic_params(state) -> dict:
        """Params of each plastic network, keyed like ``PLASTIC`` and ``plastic_losses``."""
        return {name: getattr(state, params_field) for name, (params_field, _) in plastic.items()}

    return plastic_params


def declared_nets(plastic: dict):
    """``plastic_nets(state)`` for agents whose state holds each plastic ``Net`` in a field named like the network."""

    def plastic_nets(state) -> dict:
        """The ``Net`` (module graph and initialisers) of each plastic network."""
        return {name: getattr(state, name) for name in plastic}

    return plastic_nets
