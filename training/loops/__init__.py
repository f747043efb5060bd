"""The loop kinds, and the one place that knows which of them runs a run.

One module per loop: ``offpolicy.py``, ``onpolicy.py`` and ``offline.py`` (the host loops, one per
agent kind) and ``device.py`` (the kinds in ``DEVICE_KINDS`` on ``playground:`` envs, whole chunks
in one jitted call).  Every loop module exports the same functions, through which starting a run
(``training/run.py``) and restoring one (``analysis/restore.py``) reach it, by ``loop_for`` alone:

- ``check(cfg, agent) -> counts``: the settings the loop cannot run with (a ValueError naming the
  flag), before any run directory exists (``training.run.preflight``);
- ``resolve(cfg, agent) -> (cfg, obs_dim, act_dim)``: the config as the loop runs it (offline: the
  dataset's env and the agent's config for that dataset) and the agent's observation and action
  sizes, found cheaply (an env built and closed, or the dataset read and checked);
- ``train(cfg, agent, run_dir, resume=False, stop_at=None) -> dict``: the run (``training.run.run``);
- ``template_tree(cfg, agent, obs_dim, act_dim)``: the device tree a fresh run checkpoints (what its
  iteration's ``tree()`` returns, agent state first), from the loop's own initialisers; callers trace
  it abstractly (``analysis/restore.py: checkpoint_template``);
- ``last_step(cfg, agent) -> int``: the step a finished run ends at (``training.run.final_step``);
- ``action_mode(cfg, agent) -> str``: how the loop's envs, its evaluation's included, map the agent's
  actions (``envs.actions``).

A new loop kind is one module exporting these and one line in ``LOOPS`` (its agents' Protocol is
``agents/api.py: KINDS``).  The loop modules are imported when a run asks for them, as
``agents.get`` imports agents, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

# agent kind (``agent.KIND``) -> the module of its host loop (a module name, or a module object)
LOOPS: dict[str, Any] = {
    "offpolicy": "plasticity_zoo.training.loops.offpolicy",
    "onpolicy": "plasticity_zoo.training.loops.onpolicy",
    "offline": "plasticity_zoo.training.loops.offline",
}
DEVICE = "plasticity_zoo.training.loops.device"  # the device loop (``--loop device``; ``auto`` on playground: envs)
DEVICE_KINDS = ("onpolicy", "offpolicy")  # the agent kinds the device loop runs


def unknown_kind(agent) -> str:
    """The refusal of an agent whose kind has no loop, listing the kinds that have one."""
    name = getattr(agent, "__name__", type(agent).__name__)
    return f"agent {name!r} has unknown kind {getattr(agent, 'KIND', None)!r}; kinds: {', '.join(LOOPS)}"


def uses_device_loop(cfg, agent) -> bool:
    """Whether a run takes the device loop: ``--loop device``, or ``auto`` on a ``playground:`` env with
    an agent kind the device loop runs (and no LEAST, which cuts episodes from the host)."""
    from plasticity_zoo.envs import playground

    loop = getattr(cfg, "loop", "auto")  # configs written before the field existed: auto
    if loop == "device":
        return True
    least = agent.KIND == "offpolicy" and cfg.plasticity.least
    return loop == "auto" and agent.KIND in DEVICE_KINDS and playground.is_playground(cfg.env) and not least


def _module(entry) -> ModuleType:
    return importlib.import_module(entry) if isinstance(entry, str) else entry


def loop_for(cfg, agent) -> ModuleType:
    """The loop module that runs ``agent`` under ``cfg``: the device loop where ``uses_device_loop``
    says so (``--loop device`` for any kind: the device loop's ``check`` refuses the kinds it cannot
    run), else the host loop of the agent's kind (``LOOPS``).  A ValueError for a kind with no loop."""
    if getattr(agent, "KIND", None) not in LOOPS:
        raise ValueError(unknown_kind(agent))
    return _module(DEVICE if uses_device_loop(cfg, agent) else LOOPS[agent.KIND])


def check(cfg, agent):
    """The run's loop's ``check``: counts below 1, the kind's own arithmetic (PPO's batch), the device
    loop's needs; returns what the loop's check returns (the on-policy loops: batch and iterations)."""
    return loop_for(cfg, agent).check(cfg, agent)


def eval_action_mode(cfg, agent) -> str:
    """How a run's evaluation envs map actions: its loop's ``action_mode`` (the on-policy loops'
    ``--action-mode``; ``rescale`` otherwise)."""
    return loop_for(cfg, agent).action_mode(cfg, agent)
