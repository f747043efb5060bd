"""Train an agent:  python scripts/train.py AGENT --env ID [--seeds N] [--total-steps T] ...

    python scripts/train.py sac --env Pendulum-v1 --total-steps 20000
    python scripts/train.py sac --env dmc:cheetah-run --seeds 3
    python scripts/train.py sac --env HalfCheetah-v5 --critics 10 --eta 1.0   # EDAC
    python scripts/train.py --resume runs/<dir>                              # continue a run

`python scripts/train.py AGENT --help` lists every flag with its default.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

try:
    import agents
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import agents
import tyro

from training import config as config_lib
from training.run import load_config, run


def parse(argv: list[str]):
    """argv -> RunConfig.  Resuming reuses the run's config.json; only a few flags may change."""
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__.strip() + f"\n\nagents: {', '.join(sorted(agents.AGENTS))}")
    if argv[0].startswith("-"):
        if "--resume" not in argv:
            raise SystemExit(f"the first argument must be an agent ({', '.join(sorted(agents.AGENTS))}) "
                             "or --resume RUN_DIR")
        saved = load_config(argv[argv.index("--resume") + 1])
        name, rest = saved.agent_name, argv
    else:
        name, rest = argv[0], argv[1:]
        if name not in agents.AGENTS:
            raise SystemExit(f"unknown agent {name!r}; available agents: {', '.join(sorted(agents.AGENTS))}")
        saved = None
        if "--resume" in rest:
            saved = load_config(rest[rest.index("--resume") + 1])
            if saved.agent_name != name:
                raise SystemExit(f"--resume: that run trained {saved.agent_name!r}, not {name!r}")
    agent = agents.get(name)
    cls = config_lib.cli_type(name, agent.CONFIG)
    if saved is None:
        return tyro.cli(cls, args=rest, prog=f"train.py {name}")
    default = cls(**{f.name: getattr(saved, f.name) for f in dataclasses.fields(saved)})
    cfg = tyro.cli(cls, args=rest, default=default, prog=f"train.py {name}")
    changed = [name for name in _changed(cfg, saved) if name not in config_lib.RESUME_MUTABLE]
    if changed:
        raise SystemExit(f"--resume cannot change {', '.join(changed)}: the run's config.json fixes them")
    return cfg


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


def main(argv=None):
    cfg = parse(sys.argv[1:] if argv is None else list(argv))
    try:
        out = run(cfg)
    except KeyboardInterrupt as stopped:  # the loop has checkpointed and said how to resume
        raise SystemExit(143 if stopped.args == ("SIGTERM",) else 130) from None
    unit = "updates" if agents.get(cfg.agent_name).KIND == "offline" else "steps"
    print(f"done: {out['step']} {unit}, last evaluation return {out['last_eval']:.1f}; run directory: {out['run_dir']}")
    return out


if __name__ == "__main__":
    main()
