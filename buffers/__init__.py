"""Replay storage on the device, below the agents: ``Transition``, the uniform ring buffer
(``buffers.replay``) and loss-adjusted prioritised replay over subtrajectories (``buffers.lap``)."""

from plasticity_zoo.buffers.replay import Transition

__all__ = ["Transition"]
