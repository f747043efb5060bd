"""Value and dynamics diagnostics of an offline run's last checkpoint (analysis/offline_diagnostics.py).

    python scripts/diagnose_offline.py RUN_DIR [--episodes 3] [--samples 4096]

Prints the critics' values and spreads at dataset / policy / random actions against the dataset's
discounted returns-to-go, the value drift along model rollouts, and the policy's real episodes with
the dynamics model's error and spread and the distance to the nearest dataset state along them;
for a NeuBay run, imagination from start states and real prefixes beside the real episodes, with
the critics' Q against the return that followed and the world-model posterior's error,
uncertainty and open-loop replay along them (``analysis/offline_diagnostics.py:
diagnose_posterior``); writes RUN_DIR/diagnostics.json.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plasticity_zoo.analysis import offline_diagnostics  # noqa: E402


@dataclass
class Args:
    run_dir: tyro.conf.Positional[str]
    """an offline run directory (written by scripts/train.py ravl|neubay ...)"""
    episodes: int = 3
    """deterministic real-env episodes of the policy per seed"""
    samples: int = 4096
    """dataset rows and model-FIFO rows the value checks average over"""
    seed: int = 0


def main(argv=None):
    args = tyro.cli(Args, args=argv)
    if args.episodes < 1 or args.samples < 1:
        raise SystemExit("--episodes and --samples must be >= 1")
    d = offline_diagnostics.diagnose(args.run_dir, args.episodes, args.samples, args.seed)
    print(offline_diagnostics.report(d))
    print(f"wrote {offline_diagnostics.write(args.run_dir, d)}")
    return d


if __name__ == "__main__":
    main()
