"""scripts/gpu_check.py at CPU sizes: every item runs and lands in the JSON and the markdown table."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("mujoco_playground") is None, reason="MuJoCo Playground (extra .[mjx]) is not installed"
)
def test_the_gpu_check_runs_every_item_at_tiny_sizes_and_writes_its_table(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up
    spec.loader.exec_module(script)  # in this process: the worker's loaded tasks and cached programs serve it
    assert script.main(["--tiny", "--out", str(tmp_path)]) == 0, capsys.readouterr().out[-3000:]
    out = capsys.readouterr()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    items = {r["item"] for r in rows}
    assert items == {
        "ppo_device",
        "brax_ppo",
        "sac_device",
        "mrq_device",
        "mrq_host",
        "neubay_update",
        "sigreg_share",
        "mrq_replay_memory",
    }
    measured = [r for r in rows if r["setting"] != "skipped"]  # Brax (Playground's dependency) where installed
    assert not any("error" in r for r in rows)
    assert all(r["value"] > 0 for r in measured if r["item"] != "sigreg_share"), measured
    assert [r["setting"] for r in rows if r["item"] == "ppo_device"] == ["playground:CartpoleBalance x8 envs, impl jax"]
    assert [r["setting"] for r in rows if r["item"] == "mrq_host"] == ["Pendulum-v1, 2 vmapped seed(s)"]
    memory = next(r for r in rows if r["item"] == "mrq_replay_memory")
    assert memory["value"] * 2**20 > 10_000 * (2 * 3 + 1) * 4  # at least obs, next obs and action rows as float32
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("GPU check on cpu") and table.count("\n| ") == len(rows) + 1
    assert table.splitlines()[-1] in out.out
