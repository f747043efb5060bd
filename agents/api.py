"""The agent contract: what every agent module exports, written as Protocols (one per kind).

Placeholder: the Protocols follow below.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffPolicyConfig:
    """Replay and schedule settings every off-policy agent has."""

    buffer_size: int = 1_000_000
    """replay capacity per seed"""
    batch_size: int = 256
    learning_starts: int = 5_000
    """uniform-random env steps before learning starts"""
    updates_per_step: int = 1
    """gradient steps per env step (update-to-data ratio)"""
