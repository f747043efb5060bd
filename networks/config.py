"""``NetworkConfig``: the backbone overrides every agent accepts (``--network.*``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from plasticity_zoo.networks.blocks import TrunkSpec


@dataclass(frozen=True)
class NetworkConfig:
    """Backbone overrides; ``None`` keeps the agent's paper default."""

    width: Optional[int] = None
    """hidden width (scales every hidden layer of the agent's networks)"""
    depth: Optional[int] = None
    """hidden layers (mlp) or residual blocks (simba, multiskip)"""
    block: Optional[Literal["mlp", "simba", "multiskip"]] = None
    """backbone block type"""
    activation: Optional[str] = None
    """hidden activation: relu, elu, gelu, silu, tanh, mish"""
    layer_norm: Optional[bool] = None
    """LayerNorm after every hidden Linear (mlp block)"""

    def trunk(self, default: TrunkSpec) -> TrunkSpec:
        """The agent's default trunk with these overrides applied."""
        changes = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return dataclasses.replace(default, **changes)
