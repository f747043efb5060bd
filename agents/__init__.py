"""Agent registry: name -> agent module (the contract of its kind: ``agents/api.py``)."""

from __future__ import annotations

import importlib

AGENTS = {
    "sac": "plasticity_zoo.agents.sac",
    "mrq": "plasticity_zoo.agents.mrq",
    "ppo": "plasticity_zoo.agents.ppo",
    "ravl": "plasticity_zoo.agents.ravl",
    "mrq-mt": "plasticity_zoo.agents.mrq_mt",
    "neubay": "plasticity_zoo.agents.neubay",
}


def get(name: str):
    if name not in AGENTS:
        raise ValueError(f"unknown agent {name!r}; available agents: {', '.join(sorted(AGENTS))}")
    return importlib.import_module(AGENTS[name])
