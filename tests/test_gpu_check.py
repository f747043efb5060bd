"""scripts/gpu_check.py: its orchestration (item order, the JSON and markdown rewritten after every
item, a failing item keeping the others, ``--only``, the budget) with stand-in items, and every real
item at ``--tiny``'s CPU sizes landing in the JSON and the markdown table.

The zoo's device-loop items (``ppo_device``, ``sac_device``, ``mrq_device``) run on
``playground:ToyPointMass`` (``tests/device_toy.py``: the zoo's real Playground wrapper around
two-line physics; MuJoCo's physics compiles for seconds into every program that steps it on CPU, and
what these items measure does not depend on it).  ``brax_ppo`` runs Brax's own trainer on Playground's
registry, which has no toy: it runs on ``--tiny``'s ``playground:CartpoleBalance``.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from tests import device_toy

ROOT = Path(__file__).resolve().parents[1]
ORDER = [  # the module docstring's order: the replay's memory first, Brax last
    "mrq_replay_memory",
    "ppo_device",
    "sac_device",
    "mrq_device",
    "mrq_host",
    "neubay_update",
    "sigreg_share",
    "brax_ppo",
]


def _script(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up
    spec.loader.exec_module(script)  # in this process: the worker's loaded tasks and cached programs serve it
    return script


def _report(out: Path) -> list[dict]:
    return json.loads((out / "gpu_check.json").read_text())["rows"]


def test_items_run_in_order_each_rewrites_the_json_and_table_and_a_failing_item_keeps_the_others(
    tmp_path, capsys, monkeypatch
):
    """Stand-in items (each one row, ``sac_device`` raising): every item runs, in the documented order,
    at ``--tiny``'s sizes; each finds the JSON and the table holding exactly the rows of the items
    before it; the failure is a row with its error, and the exit status is 1."""
    script = _script(monkeypatch)
    assert list(script.ITEMS) == ORDER
    seen: list[str] = []

    def stand_in(name):
        def item(z):
            assert z is script.TINY  # --tiny's sizes
            if seen:  # what the files held when this item started: every earlier item's rows
                assert [r["item"] for r in _report(tmp_path)] == seen
                assert (tmp_path / "gpu_check.md").read_text().count("\n| ") == len(seen) + 1
            else:
                assert not (tmp_path / "gpu_check.json").exists()
            seen.append(name)
            if name == "sac_device":
                raise RuntimeError("boom")
            return [script.row(name, f"{name} setting", 2.0, "things/s")]

        return item

    monkeypatch.setattr(script, "ITEMS", {name: stand_in(name) for name in ORDER})
    assert script.main(["--tiny", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert seen == ORDER
    rows = _report(tmp_path)
    assert [r["item"] for r in rows] == ORDER and all("seconds" in r for r in rows)
    failed = [r for r in rows if "error" in r]
    assert [(r["item"], r["setting"], r["error"]) for r in failed] == [("sac_device", "failed", "RuntimeError: boom")]
    assert all(r["value"] == 2.0 for r in rows if r["item"] != "sac_device")
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("GPU check on cpu") and table.count("\n| ") == len(rows) + 1
    assert "| sac_device | failed | - |  (RuntimeError: boom) |" in table
    assert table.splitlines()[-1] in out


def test_only_runs_the_items_named_in_their_order_and_the_budget_skips_items_not_started_in_time(
    tmp_path, capsys, monkeypatch
):
    script = _script(monkeypatch)
    ran: list[str] = []

    def stand_in(name):
        def item(z):
            ran.append(name)
            time.sleep(0.2)
            return [script.row(name, "s", 1.0, "u")]

        return item

    monkeypatch.setattr(script, "ITEMS", {name: stand_in(name) for name in ORDER})
    assert script.main(["--tiny", "--out", str(tmp_path / "a"), "--only", "neubay_update", "ppo_device"]) == 0
    assert ran == ["neubay_update", "ppo_device"]
    assert [r["item"] for r in _report(tmp_path / "a")] == ["neubay_update", "ppo_device"]
    ran.clear()
    assert script.main(["--tiny", "--out", str(tmp_path / "b"), "--budget-s", "0.1"]) == 0
    assert ran == ["mrq_replay_memory"]  # the first item starts at once; it ends past the budget
    rows = _report(tmp_path / "b")
    assert [r["item"] for r in rows] == ORDER
    assert all(r["setting"] == "skipped" and "budget" in r["note"] for r in rows[1:])
    with pytest.raises(SystemExit):
        script.main(["--tiny", "--out", str(tmp_path / "c"), "--only", "no_such_item"])
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("mujoco_playground") is None, reason="MuJoCo Playground (extra .[mjx]) is not installed"
)
def test_the_gpu_check_runs_every_item_at_tiny_sizes_and_writes_its_table(tmp_path, capsys, monkeypatch):
    """Every real item at ``--tiny``'s sizes (the device-loop items on the toy task, see above): no
    error, every measured value positive, each item's rows and settings in the JSON and the table."""
    script = _script(monkeypatch)
    device_toy.use_toy(monkeypatch)
    assert script.TINY.playground == "playground:CartpoleBalance" and script.TINY.ppo_envs == (8,)
    zoo = [name for name in ORDER if name != "brax_ppo"]
    assert script.main(["--tiny", "--out", str(tmp_path), "--env", device_toy.ENV, "--only", *zoo]) == 0, (
        capsys.readouterr().out[-3000:]
    )
    out = capsys.readouterr()
    rows = _report(tmp_path)
    assert [r["item"] for r in rows] == zoo  # in the documented order
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("GPU check on cpu") and table.count("\n| ") == len(rows) + 1
    assert table.splitlines()[-1] in out.out
    brax_dir = tmp_path / "brax"
    assert script.main(["--tiny", "--out", str(brax_dir), "--only", "brax_ppo"]) == 0, capsys.readouterr().out[-3000:]
    brax = _report(brax_dir)
    rows += brax
    assert {r["item"] for r in rows} == set(ORDER)
    measured = [r for r in rows if r["setting"] != "skipped"]  # Brax (Playground's dependency) where installed
    assert not any("error" in r for r in rows)
    assert all(r["value"] > 0 for r in measured if r["item"] != "sigreg_share"), measured
    assert [r["setting"] for r in rows if r["item"] == "ppo_device"] == [f"{device_toy.ENV} x8 envs, impl jax"]
    assert [r["setting"] for r in brax] in (["skipped"], ["playground:CartpoleBalance x8 envs, impl jax"])
    assert [r["setting"] for r in rows if r["item"] == "mrq_host"] == ["Pendulum-v1, 2 vmapped seed(s)"]
    memory = next(r for r in rows if r["item"] == "mrq_replay_memory")
    assert memory["value"] * 2**20 > 10_000 * (2 * 3 + 1) * 4  # at least obs, next obs and action rows as float32
