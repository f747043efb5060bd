"""``NetworkConfig``: the backbone overrides every agent accepts (``--network.*``); and ``Range`` /
``check_ranges``, the valid values of a config's fields, which every config of the zoo declares with
them (networks is the lowest layer, so the plasticity, agent and run configs all reach it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import tyro

from plasticity_zoo.networks.blocks import TrunkSpec


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: from ``low`` to ``high``, each end included unless open.

    ``str(Range(0, 1, low_open=True))`` is ``in (0, 1]``; a one-sided range reads ``>= 1`` or ``> 0``."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def holds(self, value) -> bool:
        """Whether ``value`` lies in the range (NaN never does)."""
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return bool(above and below)

    def __str__(self) -> str:
        low, high = f"{self.low:g}", f"{self.high:g}"
        if math.isinf(self.high):
            return f"{'>' if self.low_open else '>='} {low}"
        if math.isinf(self.low):
            return f"{'<' if self.high_open else '<='} {high}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
UNIT = Range(0, 1)
"""A share or a discount: [0, 1]."""
RATE = Range(0, 1, low_open=True)
"""A soft-update rate: (0, 1] (0 would never move the target)."""


def ranges_of(cfg) -> dict[str, Range]:
    """The ``RANGES`` tables of ``cfg``'s class and its bases, merged (a subclass's entry wins)."""
    out: dict[str, Range] = {}
    for klass in reversed(type(cfg).__mro__):
        out.update(vars(klass).get("RANGES", {}))
    return out


def check_ranges(cfg, prefix: str = "--", ranges: Mapping[str, Range] | None = None):
    """Raise a ValueError naming the flag and its valid range for the first field of ``cfg`` outside its
    range: ``--tau must be in (0, 1], got 2.0``.  ``ranges``: default ``ranges_of(cfg)``, the ``RANGES``
    class tables a config declares beside its fields.  A field left None (the code's own default) is not
    checked; ``prefix`` is the flags' (``--plasticity.`` for ``PlasticityConfig``)."""
    for name, valid in (ranges_of(cfg) if ranges is None else ranges).items():
        value: Any = getattr(cfg, name)
        if value is not None and not valid.holds(value):
            raise ValueError(f"{prefix}{name.replace('_', '-')} must be {valid}, got {value}")


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
    """hidden activation: relu, elu, gelu, silu, tanh, leaky_relu, mish; or crelu / fourier (CReLU, deep Fourier
    features: each Linear unit gives 2 features, so a layer of width W has W/2 units; W must be even)"""
    layer_norm: tyro.conf.DisallowNone[Optional[bool]] = None
    """LayerNorm after every hidden Linear (mlp block); neither switch: the agent's default"""

    def trunk(self, default: TrunkSpec) -> TrunkSpec:
        """The agent's default trunk with these overrides applied."""
        changes = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return dataclasses.replace(default, **changes)
