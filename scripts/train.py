"""Train an agent:  python scripts/train.py AGENT --env ID [--seeds N] [--total-steps T] ...

    python scripts/train.py sac --env Pendulum-v1 --total-steps 20000
    python scripts/train.py sac --env dmc:cheetah-run --seeds 3
    python scripts/train.py sac --env HalfCheetah-v5 --critics 10 --eta 1.0   # EDAC
    python scripts/train.py --resume runs/<dir>                              # continue a run
    python scripts/train.py sac --run-dir runs/x --overwrite                  # start runs/x over

`python scripts/train.py AGENT --help` lists every flag with its default.  A mistaken command
line (unknown agent, env id or flag, a bad value or two that cannot work together, an
intervention the agent cannot take, a missing dataset or checkpoint) stops with one `error:`
line before a run directory is created; `--debug` (or RLZOO_DEBUG=1) shows the full traceback
instead.  A --run-dir that already holds a run is refused: continue it with --resume, or pass
--overwrite to move its files into RUN_DIR/.replaced-<time>/ and start a new run there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# OpenBLAS (the LAPACK behind the plasticity metrics' SVDs) starts its own threads inside each call,
# and they fight XLA's for the cores: one full-size MR.Q metrics event took 32-103 s on a 2-core CPU
# with them and 3.6-5 s without (docs/benchmarks.md).  Set before numpy / jax load; a user's value wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

try:
    from plasticity_zoo import agents
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plasticity_zoo import agents
from plasticity_zoo.networks.runtime import use_persistent_cache
from plasticity_zoo.training.cli import parse, report_user_error, take_debug  # tests call train.parse
from plasticity_zoo.training.loop import NonFiniteLossError
from plasticity_zoo.training.run import preflight, run

_stage = ["checks"]  # "run" once the checks passed: cli() then notes that --debug shows where an error arose


def main(argv=None):
    """Parse, check and train; errors propagate (``cli`` turns the user's mistakes into one line).

    ``--overwrite`` (anywhere in argv) lets a new run replace the one in its --run-dir, whose files
    are moved into RUN_DIR/.replaced-<time>/ (``training.run.move_aside``)."""
    _stage[0] = "checks"
    use_persistent_cache()  # a second run of a command loads its compiled programs (networks/runtime.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + f"\n\nagents: {', '.join(sorted(agents.AGENTS))}")
        raise SystemExit(0)
    overwrite = "--overwrite" in argv
    cfg = parse([a for a in argv if a != "--overwrite"])
    preflight(cfg, overwrite=overwrite)
    _stage[0] = "run"
    try:
        out = run(cfg, check=False, overwrite=overwrite)
    except KeyboardInterrupt as stopped:  # the loop has checkpointed and said how to resume
        raise SystemExit(143 if stopped.args == ("SIGTERM",) else 130) from None
    unit = "updates" if agents.get(cfg.agent_name).KIND == "offline" else "steps"
    print(f"done: {out['step']} {unit}, last evaluation return {out['last_eval']:.1f}; run directory: {out['run_dir']}")
    return out


def cli(argv=None):
    """The command line: ``main``, with a user error (bad flag value, env id, dataset, checkpoint, ...)
    reported as ``error: <message>`` on stderr and exit status 2 instead of a traceback.

    ``--debug`` (anywhere in argv) or RLZOO_DEBUG=1 lets the exception through with its traceback.
    """
    debug, argv = take_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        return main(argv)
    except NonFiniteLossError as e:  # the message names the statistic, the step and the last good checkpoint
        if debug:
            raise
        print(f"stopped: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except BaseException as e:
        # a check's message is enough; an error raised while training may be a bug: say how to see where
        late = _stage[0] == "run" and not isinstance(e, SystemExit)
        report_user_error(
            e, debug, "(raised after the checks; --debug or RLZOO_DEBUG=1 shows the traceback)" if late else None
        )


if __name__ == "__main__":
    cli()
