"""Aggregate report over a sweep or any run directories: the figures and tables papers use.

    python scripts/report.py sweeps/plasticity --out sweeps/plasticity/report
    python scripts/report.py runs/a runs/b runs/c --out report --norm Pendulum-v1=-1600:0 --baseline none
    python scripts/report.py sweeps/p --out r --metrics 'plasticity/critic/dormant*' --final-window 3

The command line of ``plasticity_zoo.analysis.report.write_report`` (whose docstring says what is
written and how runs are grouped, scored and normalised): finds every run directory (config.json +
eval.csv) at or under the paths, writes curves.png/.pdf, aggregate.png/.pdf, profiles.png/.pdf,
improvement.png/.pdf, report.md, per_env.csv, aggregate.csv and improvement.csv into --out, and
prints report.md.  A run stopped before its last step is marked (``stopped at 43k of 100k``) with a
``warning:`` line.  A mistake is one ``error:`` line and exit status 2 (--debug: the traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from plasticity_zoo.analysis import report
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plasticity_zoo.analysis import report


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="report.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("paths", nargs="+", metavar="DIR", help="sweep directories or run directories")
    p.add_argument("--out", required=True, type=Path, help="the report's directory")
    p.add_argument("--y", default="return_mean", help="the eval.csv column scored (default return_mean)")
    p.add_argument("--final-window", type=int, default=1, metavar="K", help="a seed's score: its last K evaluations")
    p.add_argument("--norm", action="append", metavar="ENV=LOW:HIGH", help="normalise ENV's scores to [0, 1]")
    p.add_argument("--baseline", help="the label the others are compared with (probability of improvement)")
    p.add_argument(
        "--metrics",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="metrics.csv columns to draw over time beside the return (glob patterns)",
    )
    p.add_argument("--align", action="store_true", help="curves: interpolate runs evaluated on different grids")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Write the report, print report.md and a line saying what was written; returns ``write_report``'s dict."""
    args = parse_args(argv)
    out = report.write_report(
        args.paths,
        args.out,
        y=args.y,
        final_window=args.final_window,
        norm=args.norm,
        baseline=args.baseline,
        metrics=args.metrics,
        align=args.align,
        seed=args.seed,
    )
    print(out["text"])
    print(out["summary"])
    return out


def cli(argv=None):
    from plasticity_zoo.training.cli import report_user_error, take_debug

    debug, argv = take_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        return main(argv)
    except BaseException as e:  # ReportError (a ValueError), a bad path: one line; argparse's exits, bugs: through
        report_user_error(e, debug)


if __name__ == "__main__":
    cli()
