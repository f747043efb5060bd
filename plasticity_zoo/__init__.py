"""plasticity-zoo: a JAX deep-RL agent zoo for continuous control with switchable plasticity interventions.

Every part of the zoo is imported through this one name (``plasticity_zoo.agents``, ``plasticity_zoo.training``,
...), so a user's own ``envs`` or ``training`` package never shadows it.  The installed distribution maps each
subpackage to its top-level folder of the repository (pyproject.toml's package-dir); run from a checkout that
was not installed, the same folders are found beside this one.
"""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "agents" / "__init__.py").is_file() and not (_Path(__file__).parent / "agents").exists():
    __path__.append(str(_checkout))  # a checkout: plasticity_zoo.agents is ../agents

# The Python API (plasticity_zoo/api.py; docs/python-api.md), loaded on first use so that importing a
# subpackage (``plasticity_zoo.agents``) does not pull in the run machinery.
_API = {
    "train": "api",
    "resume": "api",
    "restore": "api",
    "config": "api",
    "flags": "api",
    "Result": "api",
    "load_policy": "analysis.export",
    "export_policy": "analysis.export",
}
_MODULES = {"plot": "analysis.plot", "report": "analysis.report", "stats": "analysis.stats"}
__all__ = [*_API, *_MODULES]


def __getattr__(name):
    import importlib

    if name in _API:
        return getattr(importlib.import_module(f"{__name__}.{_API[name]}"), name)
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{_MODULES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
