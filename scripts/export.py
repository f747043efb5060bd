"""Export a run's policy alone:  python scripts/export.py RUN_DIR --out policy.npz [--step N] [--seed K]

    python scripts/export.py runs/<dir> --out pendulum-sac.npz              # newest checkpoint, seed 0
    python scripts/export.py runs/<dir> --step 50000 --seed 1 --out p.npz

Writes the deterministic policy of seed index ``--seed`` (default 0) at the run's newest intact
checkpoint (or ``--step N``): the actor's parameters (with the encoder or observation statistics
the agent acts through), the env's action bounds and what is needed to act (agent and network
config, observation and action sizes, env id, action repeat), named by path; no optimizer state,
replay or host state.  Load and run it without the run:

    from plasticity_zoo.analysis.export import load_policy
    pi = load_policy("policy.npz")
    action = pi(obs)   # in the env's units; the run's own evaluation actions

See docs/export.md.  A mistake (no run, no checkpoint or step, a seed out of range, an agent or env
that cannot be exported) stops with one ``error:`` line and exit status 2; ``--debug`` (or
RLZOO_DEBUG=1) shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as scripts/train.py

try:
    from plasticity_zoo import training  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python scripts/export.py",
        description=__doc__.strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="a run directory (written by scripts/train.py)")
    p.add_argument("--out", required=True, help="the policy file to write (.npz)")
    p.add_argument(
        "--step", type=int, default=None, help="the checkpoint of this step (default: the newest intact one)"
    )
    p.add_argument("--seed", type=int, default=0, help="the seed index whose policy is exported (default 0)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    from plasticity_zoo.analysis.export import export_policy, read_meta

    out = export_policy(
        args.run_dir,
        args.out,
        args.step,
        args.seed,
        warn=lambda m: print(m.replace("; resuming from ", "; exporting "), file=sys.stderr),
    )
    meta = read_meta(out)
    print(
        f"wrote {args.out}: {meta['agent']} policy of seed {meta['seed']} at step {meta['step']} "
        f"({meta['checkpoint']}), env {meta['env']}, {len(meta['arrays'])} arrays, actions in env units"
    )
    return meta


def cli(argv=None):
    """``main`` with a user error reported as one ``error: <message>`` line on stderr and exit status 2."""
    from plasticity_zoo.training.cli import run_script

    return run_script(main, argv)


if __name__ == "__main__":
    cli()
