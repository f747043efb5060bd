"""Agent registry: name -> module exposing CONFIG, init, act, update, PLASTIC."""
from __future__ import annotations

import importlib

AGENTS = {"sac": "agents.sac", "mrq": "agents.mrq", "ppo": "agents.ppo", "ravl": "agents.ravl",
          "mrq-mt": "agents.mrq_mt", "neubay": "agents.neubay"}


def get(name: str):
    if name not in AGENTS:
        raise ValueError(f"unknown agent {name!r}; available agents: {', '.join(sorted(AGENTS))}")
    return importlib.import_module(AGENTS[name])
