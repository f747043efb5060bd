"""The training command line: ``argv -> RunConfig`` (scripts/train.py and scripts/sweep.py parse with it).

``parse`` reads ``AGENT [FLAGS...]`` or ``--resume RUN_DIR [FLAGS...]`` with tyro over the agent's
run-config dataclass.  ``--preset NAME`` (repeatable; ``training/presets.py``) puts a paper's flags
before the user's, so the user's own flags win; ``--preset list`` prints the presets and exits.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from typing import Annotated, Optional

import tyro

from plasticity_zoo import agents
from plasticity_zoo.training import config as config_lib
from plasticity_zoo.training import presets as presets_lib
from plasticity_zoo.training.run import is_user_error, load_config, protocol_defaults

USAGE = "usage: train.py AGENT [--env ID] [FLAGS...]  |  train.py --resume RUN_DIR [FLAGS...]"
DESCRIPTION = (
    "Besides the flags below: --preset NAME (repeatable) applies a paper's flags before yours, so "
    "yours win (--preset list shows the presets); --overwrite starts a new run in a --run-dir that "
    "already holds one, moving its files into RUN_DIR/.replaced-<time>/; --debug shows the traceback "
    "of an error."
)


def _agents() -> str:
    return ", ".join(sorted(agents.AGENTS))


def _resume_dir(argv: list[str]) -> str | None:
    """The value of ``--resume DIR`` / ``--resume=DIR`` in ``argv``, or None if there is no --resume."""
    for i, a in enumerate(argv):
        if a.startswith("--resume="):
            value = a.split("=", 1)[1]
        elif a == "--resume":
            value = argv[i + 1] if i + 1 < len(argv) else ""
        else:
            continue
        if not value or value.startswith("-"):
            raise SystemExit("--resume needs the run directory to continue: --resume RUN_DIR")
        return value
    return None


def _take_presets(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``--preset NAME`` / ``--preset=NAME`` (repeatable, or comma-separated) out of ``argv``."""
    names, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--preset" or a.startswith("--preset="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            if not value or value.startswith("-"):
                raise SystemExit("--preset needs a name: --preset NAME (--preset list shows them)")
            names += [v for v in value.split(",") if v]
        else:
            rest.append(a)
            i += 1
    return names, rest


def parse(argv: list[str]):
    """argv -> RunConfig.  Resuming reuses the run's config.json; only a few flags may change.

    The flags of ``--preset`` names are parsed first and become the defaults the user's flags
    are parsed over; the names are stored in ``cfg.preset``."""
    preset_names, argv = _take_presets(list(argv))
    if "list" in preset_names:
        print(presets_lib.listing())
        raise SystemExit(0)
    if argv and argv[0] in ("-h", "--help"):
        print(
            f"{USAGE}\n\nagents: {_agents()}\n`train.py AGENT --help` lists the agent's flags; "
            "`--preset list` the named presets."
        )
        raise SystemExit(0)
    if not argv:
        raise SystemExit(f"no agent given; {USAGE}; agents: {_agents()}")
    resume = _resume_dir(argv)
    if argv[0].startswith("-"):
        if resume is None:
            raise SystemExit(f"the first argument must be an agent ({_agents()}) or --resume RUN_DIR, not {argv[0]!r}")
        saved = load_config(resume)
        name, rest = saved.agent_name, argv
    else:
        name, rest = argv[0], argv[1:]
        if name not in agents.AGENTS:
            raise SystemExit(f"unknown agent {name!r}; available agents: {_agents()}")
        saved = None
        if resume is not None:
            saved = load_config(resume)
            if saved.agent_name != name:
                raise SystemExit(f"--resume: that run trained {saved.agent_name!r}, not {name!r}")
    agent = agents.get(name)
    cls = config_lib.cli_type(name, agent.CONFIG)
    if agent.KIND == "offline":  # --env not given is None, not RunConfig's default: that may be given too
        env = Annotated[
            Optional[str],
            tyro.conf.arg(
                help="the env to evaluate on (default: the dataset's own; "
                "with --kind: the env whose cached dataset to use)"
            ),
        ]
        cls = dataclasses.make_dataclass(cls.__name__, [("env", env, dataclasses.field(default=None))], bases=(cls,))
    if saved is None:
        if not preset_names:
            return _one_env_per_task(tyro.cli(cls, args=rest, prog=f"train.py {name}", description=DESCRIPTION), rest)
        flags = presets_lib.flags(preset_names, name)
        base = tyro.cli(cls, args=flags, prog=f"train.py {name}")
        cfg = tyro.cli(cls, args=rest, default=base, prog=f"train.py {name}", description=DESCRIPTION)
        presets_lib.check_env(preset_names, cfg.env)
        return _one_env_per_task(dataclasses.replace(cfg, preset=",".join(preset_names)), [*flags, *rest])
    if preset_names:
        raise SystemExit(
            f"--resume cannot apply --preset {','.join(preset_names)}: the run's config.json fixes its flags"
        )
    default = cls(**{f.name: getattr(saved, f.name) for f in dataclasses.fields(saved)})
    cfg = tyro.cli(cls, args=rest, default=default, prog=f"train.py {name}", description=DESCRIPTION)
    changed = [name for name in _changed(cfg, saved) if name not in config_lib.RESUME_MUTABLE]
    if changed:
        raise SystemExit(f"--resume cannot change {', '.join(changed)}: the run's config.json fixes them")
    return cfg


def _given(flags: list[str]) -> frozenset:
    """The names of the ``RunConfig`` fields set by ``flags`` (``--eval-every 5`` or ``--eval-every=5``)."""
    names = {f.split("=", 1)[0][2:].replace("-", "_") for f in flags if f.startswith("--")}
    return frozenset(f.name for f in dataclasses.fields(config_lib.RunConfig) if f.name in names)


def _one_env_per_task(cfg, flags: list[str]):
    """A new run on a multitask env id (``mt:``): without ``--num-envs``, one env per task (ScaleMRL's
    layout), since the tasks step side by side and the envs must be a multiple of the tasks; then the
    agent's paper schedule for what the flags leave unset (``training.run.protocol_defaults``)."""
    from plasticity_zoo.envs.multitask import is_multitask, member_ids

    if not isinstance(cfg.env, str) or not is_multitask(cfg.env):
        return cfg
    given = _given(flags)
    if "num_envs" not in given:
        cfg = dataclasses.replace(cfg, num_envs=len(member_ids(cfg.env)))
    return protocol_defaults(cfg, agents.get(cfg.agent_name), given)


def _changed(new, old, prefix=""):
    """Names of the (nested) dataclass fields whose values differ."""
    out = []
    for f in dataclasses.fields(new):
        a, b = getattr(new, f.name), getattr(old, f.name)
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            out += _changed(a, b, f"{prefix}{f.name}.")
        elif a != b:
            out.append(prefix + f.name)
    return out


def take_debug(argv: list[str]) -> tuple[bool, list[str]]:
    """``--debug`` (anywhere in argv) or RLZOO_DEBUG=1 -> (True, argv without --debug)."""
    debug = "--debug" in argv or os.environ.get("RLZOO_DEBUG", "").strip() not in ("", "0")
    return debug, [a for a in argv if a != "--debug"]


def error_message(e: BaseException) -> str:
    """The one line a user error is reported with."""
    if isinstance(e, SystemExit):
        return str(e.code)
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


def report_user_error(e: BaseException, debug: bool, note: str | None = None):
    """A command line's user error: re-raised (not one: a bug, Ctrl-C, argparse's / tyro's own exit;
    or with ``debug``, with its traceback), else printed as ``error: <message>`` and exit status 2."""
    if not is_user_error(e):
        raise e
    if debug:
        if isinstance(e, SystemExit):  # Python prints no traceback for SystemExit
            traceback.print_exc()
        raise e
    print(f"error: {error_message(e)}", file=sys.stderr)
    if note:
        print(note, file=sys.stderr)
    raise SystemExit(2) from None


def run_script(main, argv=None):
    """A script's command line: ``main(argv)`` (default ``sys.argv[1:]``), with a user error reported as one
    ``error: <message>`` line and exit status 2; ``--debug`` (anywhere in argv) or RLZOO_DEBUG=1 shows the
    traceback instead.  argparse's own exits (it printed the error), Ctrl-C and bugs pass through."""
    debug, argv = take_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        return main(argv)
    except BaseException as e:
        report_user_error(e, debug)
