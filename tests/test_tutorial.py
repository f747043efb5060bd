"""docs/tutorial.py, the Python API's walk-through, runs as a user runs it (a smoke budget)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_tutorial_runs_from_a_directory_of_its_own(tmp_path):
    env = {**os.environ, "RLZOO_TUTORIAL_STEPS": "400", "RLZOO_TUTORIAL_DIR": str(tmp_path / "out")}
    env.pop("PYTHONPATH", None)  # the installed plasticity_zoo, not the checkout on the path
    (tmp_path / "envs").mkdir()  # a user's own package named like the zoo's folder
    (tmp_path / "envs" / "__init__.py").write_text("raise ImportError('the user\\'s own envs package')\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "tutorial.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for line in (
        "SAC: step 200",
        "SAC resumed: step 400",
        "one episode with the restored policy",
        "it acts as the restored policy",
    ):
        assert line in out.stdout, out.stdout
    made = tmp_path / "out"
    assert (made / "curves.png").stat().st_size > 1000 and (made / "policy.npz").is_file()
    assert (made / "sac" / "eval.csv").is_file() and (made / "sac-redo" / "eval.csv").is_file()
