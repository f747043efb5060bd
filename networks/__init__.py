"""Instrumented network blocks shared by every agent."""

from plasticity_zoo.networks import runtime  # noqa: F401  (process-wide JAX settings: Threefry unrolled on CPU)
from plasticity_zoo.networks.blocks import Trunk, TrunkSpec, orthogonal
from plasticity_zoo.networks.core import Net, build, fan_in_uniform_init
from plasticity_zoo.networks.heads import DeterministicPolicyHead, GaussianPolicyHead, MLPHead
from plasticity_zoo.networks.recurrent import RecurrentNet, RecurrentSpec, build_recurrent

__all__ = [
    "Trunk",
    "TrunkSpec",
    "orthogonal",
    "Net",
    "build",
    "fan_in_uniform_init",
    "MLPHead",
    "GaussianPolicyHead",
    "DeterministicPolicyHead",
    "RecurrentNet",
    "RecurrentSpec",
    "build_recurrent",
]
