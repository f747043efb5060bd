"""Plot evaluation curves (and optional training metrics) of one or more runs.

Usage (from the repository root)::

    python scripts/plot.py RUN_DIR [RUN_DIR ...] --out FIG.png [--y return_mean]
        [--metrics NAME [NAME ...]] [--smooth K] [--title T] [--align] [--per-task]

Prints a table of final values (unsmoothed), saves the figure (format from the file extension) and
prints its path; a run that cannot be drawn exits non-zero with one ``error:`` line and saves
nothing.  The command line of ``plasticity_zoo.analysis.plot`` (``save_figure``), whose docstring
says how runs are grouped, pooled and aligned.
"""

import argparse
import sys
from pathlib import Path

try:
    from plasticity_zoo.analysis import plot
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from plasticity_zoo.analysis import plot


def parse_args(argv=None):
    """Parse command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories")
    parser.add_argument("--out", required=True, type=Path, help="output figure (.png, .pdf, ...)")
    parser.add_argument("--y", default="return_mean", help="eval.csv column to plot")
    parser.add_argument(
        "--metrics",
        nargs="+",
        default=[],
        metavar="NAME",
        help="metrics.csv columns or glob patterns, one subplot row each",
    )
    parser.add_argument(
        "--smooth", type=int, default=1, metavar="K", help="trailing moving average over K points per seed (plot only)"
    )
    parser.add_argument("--title", help="figure title")
    parser.add_argument(
        "--per-task",
        action="store_true",
        help="multitask (mt:) runs: a panel per task beside the aggregate (default: the aggregate)",
    )
    parser.add_argument(
        "--align",
        action="store_true",
        help="pool runs evaluated (or logged) at different steps by interpolating every seed "
        "onto their steps within the span they share (default: refuse them)",
    )
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error("--smooth must be >= 1")
    return args


def main(argv=None):
    """Save the figure, print the summary table and the figure's path; a run that cannot be drawn:
    ``SystemExit("error: PATH: ...")``."""
    args = parse_args(argv)
    try:
        table = plot.save_figure(
            args.runs,
            args.out,
            args.y,
            metrics=args.metrics,
            smooth=args.smooth,
            title=args.title,
            align=args.align,
            per_task=args.per_task,
        )
    except plot.PlotError as e:
        raise SystemExit(f"error: {e}") from None
    print(table)
    print(args.out)


if __name__ == "__main__":
    main()
