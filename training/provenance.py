"""Where and with what a run ran: the zoo's git commit, the packages, the device, the command.

``config.json`` keeps it beside the run's flags (``"provenance"``, written when the run starts) and
adds one entry per ``--resume`` to ``"resumes"`` (when, from which step, to which total, with the
provenance of that process), so a figure can name the exact code and versions behind it
(``training/logger.py: RunLogger.write_config`` / ``record_resume``; ``training/config.py:
from_json`` reads the flags back and leaves these two keys aside).
"""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout the zoo runs from (its `pip install -e .` source)
PACKAGES = (
    "plasticity-zoo",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "chex",
    "numpy",
    "gymnasium",
    "mujoco",
    "dm-control",
    "tyro",
    "psgdax",
    "playground",
    "mujoco-mjx",
    "ray",
)
PROVENANCE_KEYS = ("provenance", "resumes")


def git_state(root: Path = ROOT) -> dict:
    """``{"commit": sha, "dirty": bool}`` of the checkout at ``root``; ``{"commit": None}`` outside git."""
    try:
        run = lambda *a: (  # noqa: E731
            subprocess.run(
                ["git", "-C", str(root), *a],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
        )
        commit = run("rev-parse", "HEAD").strip()
        dirty = bool(run("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def versions(names=PACKAGES) -> dict:
    """Installed versions of ``names`` (those present)."""
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def device() -> dict:
    """The JAX backend the run computes on: platform, device kind and count."""
    import jax

    devs = jax.devices()
    return {"platform": devs[0].platform, "kind": devs[0].device_kind, "count": len(devs)}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def provenance(argv=None) -> dict:
    """Everything above for this process, with the time, the host and the command line."""
    return {
        "time": now(),
        "git": git_state(),
        "versions": versions(),
        "device": device(),
        "host": platform.node(),
        "platform": platform.platform(),
        "argv": list(sys.argv if argv is None else argv),
    }
