"""scripts/benchmark_peers.py without training anything: the window rate, the zoo's and CleanRL's rates
from constructed logs, and peers without an interpreter reported as skipped."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("benchmark_peers_script", ROOT / "scripts" / "benchmark_peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_window_rate_from_points(peers):
    points = [(2000, 17.0), (0, 0.0), (500, 10.0), (1000, 12.0), (1500, 14.5)]  # any order
    w = peers.window(points, 1000)
    assert w == {"rate": 1000 / 5.0, "first": 1000, "last": 2000, "seconds": 5.0}
    assert peers.window(points, 900)["first"] == 1000  # the first point at or after the start
    assert peers.window(points, 0)["rate"] == pytest.approx(2000 / 17.0)
    with pytest.raises(ValueError, match="fewer than two points"):
        peers.window(points, 1600)


def test_window_start(peers):
    assert peers.window_start(12000, 5000) == 6000  # 1000 warm-up steps after learning starts
    assert peers.window_start(1500, 500) == 1000  # a tiny run: half its learning steps
    assert peers.window_start(1550, 500) == 1100  # rounded up to the 100-step grid


def test_zoo_rate_from_metrics_csv(peers, tmp_path):
    # perf/sps of a row: the steps since the previous row over its seconds; seed 1's rows and rows
    # without a speed are ignored
    (tmp_path / "metrics.csv").write_text(
        "step,seed,perf/sps,losses/actor\n"
        "100,0,10.0,\n100,1,99.0,\n200,0,50.0,1.0\n200,1,99.0,1.0\n300,0,25.0,1.0\n400,0,,1.0\n"
        "400,0,100.0,1.0\n"
    )
    rows = peers.read_zoo_metrics(tmp_path / "metrics.csv")
    assert rows == [(100, 10.0), (200, 50.0), (300, 25.0), (400, 100.0)]
    points = peers.zoo_points(rows)
    assert points == [(100, 0.0), (200, 2.0), (300, 6.0), (400, 7.0)]
    assert peers.window(points, 200)["rate"] == pytest.approx(200 / 5.0)
    assert peers.zoo_points(rows, seeds=2)[-1] == (400, 14.0)  # perf/sps counts all seeds' steps


def test_cleanrl_rate_from_sps_lines(peers):
    # learning_starts 500, 1000 steps: it prints at global steps 600, 700, 800, 900
    out = "\n".join(
        [
            "UserWarning: WARN: The obs returned by the `step()` method ...",
            "SPS: 100",  # 600 / 100 -> 6 s
            "SPS: 100",  # 700 / 100 -> 7 s
            "global_step=799, episodic_return=-245.8",
            "SPS: 80",  # 800 / 80 -> 10 s
            "SPS: 75",  # 900 / 75 -> 12 s
        ]
    )
    sps = peers.cleanrl_sps(out, learning_starts=500, total_steps=1000)
    assert sps == [(600, 100), (700, 100), (800, 80), (900, 75)]
    w = peers.window(peers.cleanrl_points(sps), 700)
    assert (w["first"], w["last"]) == (700, 900)
    assert w["rate"] == pytest.approx(40.0)  # (900 - 700) / (900/75 - 700/100) = 200 / 5
    low, high = peers.cleanrl_bounds(sps, 700, 900)
    assert low == pytest.approx(200 / (900 / 75 - 700 / 101))
    assert high == pytest.approx(200 / (900 / 76 - 700 / 100))
    assert low < w["rate"] < high
    with pytest.raises(ValueError, match="expected 5 'SPS:' lines .* from 500 to 900"):
        peers.cleanrl_sps(out, learning_starts=400, total_steps=1000)


def test_missing_peers_are_skipped(peers):
    args = peers.parse_args([])
    impls = peers.build_impls(args)
    assert [i.name for i in impls] == ["zoo", "sbx", "cleanrl"]
    skipped = {i.name: i.skipped for i in impls}
    assert skipped == {
        "zoo": None,
        "sbx": "no --sbx-python given",
        "cleanrl": "no --cleanrl-python and --cleanrl-script given",
    }
    summary = peers.summarize(impls, [{"zoo": {"rate": 90.0}}, {"zoo": {"rate": 110.0}}, {"zoo": {"error": "x"}}])
    assert summary["median_rate"] == {"zoo": 100.0, "sbx": None, "cleanrl": None}
    assert summary["ratios"] == {"zoo/sbx": None, "zoo/cleanrl": None}
    assert summary["skipped"] == {"sbx": "no --sbx-python given", "cleanrl": skipped["cleanrl"]}
    text = "\n".join(peers.summary_lines(impls, summary))
    assert "SBX SAC" in text and "skipped: no --sbx-python given" in text


def test_others_share_and_busy_runs(peers):
    # the machine was busy 30 s of CPU in a 10 s run on 2 cores, the run's children 20 s: others used 10 s
    assert peers.others_share((100.0, 10.0), (130.0, 30.0), wall=10.0, cores=2) == pytest.approx(0.5)
    assert peers.others_share((100.0, 10.0), (115.0, 30.0), wall=10.0, cores=2) == 0.0  # never negative
    impls = peers.build_impls(peers.parse_args([]))
    rounds = [{"zoo": {"rate": 1.0, "others_cpu": 0.02}}, {"zoo": {"rate": 1.0, "others_cpu": 0.5}}]
    summary = peers.summarize(impls, rounds)
    assert summary["busy_runs"] == ["round 2 zoo: others 50%"]
    assert "WARNING: other processes took over 10%" in "\n".join(peers.summary_lines(impls, summary))


def test_main_reports_skipped_peers(peers, tmp_path, monkeypatch, capsys):
    """main with the zoo's run replaced (no training) and no peer interpreter: the rounds, the summary
    and the files say the peers were skipped."""
    monkeypatch.setattr(
        peers, "run_zoo", lambda workdir, args: {"rate": 100.0, "first": 6000, "last": 12000, "seconds": 60.0}
    )
    monkeypatch.setattr(peers, "probe_versions", lambda impl: {"python": "3"})
    report = peers.main(["--rounds", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "SBX SAC" in out and "skipped (no --sbx-python given)" in out
    assert report["summary"]["median_rate"]["zoo"] == 100.0
    assert json.loads((tmp_path / "peers.json").read_text())["summary"]["skipped"]["sbx"] == "no --sbx-python given"
    assert "sbx skipped: no --sbx-python given" in (tmp_path / "peers.md").read_text()


def test_peer_commands(peers):
    args = peers.parse_args(["--steps", "1500", "--learning-starts", "500"])
    args.cleanrl_python, args.cleanrl_script = "py", "sac.py"
    argv = peers.cleanrl_argv(args)
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert flags["--q-lr"] == "0.0003" and flags["--policy-frequency"] == "1" and flags["--buffer-size"] == "1000000"
    assert argv[-3:] == ["--autotune", "--no-track", "--no-capture-video"]
    zoo = peers.zoo_argv(args, Path("run"))
    assert zoo[zoo.index("--eval-every") + 1] == "1501" and zoo[zoo.index("--checkpoint-every") + 1] == "1501"
    compile(peers.sbx_driver(), "<sbx driver>", "exec")  # the driver's code (window's source + training) parses


def test_zoo_variants_run_with_their_environment(peers, tmp_path, monkeypatch):
    """--zoo-variant NAME:VAR=VALUE adds a zoo run per round with those environment variables, after the
    plain one, and a ratio to each peer; a malformed one is refused."""
    assert peers.parse_variant("unrolled:RLZOO_UNROLLED_THREEFRY=1,XLA_FLAGS=--a=b") == (
        "unrolled",
        {"RLZOO_UNROLLED_THREEFRY": "1", "XLA_FLAGS": "--a=b"},
    )
    for bad in ("unrolled", "unrolled:", ":A=1", "x:A", "x:=1"):
        with pytest.raises(ValueError, match="expected NAME:VAR=VALUE"):
            peers.parse_variant(bad)
    with pytest.raises(SystemExit):
        peers.parse_args(["--zoo-variant", "x:A"])
    calls = []

    def fake_zoo(workdir, args, env=None, name="zoo"):
        calls.append((name, env))
        return {"rate": 120.0 if env else 100.0, "first": 6000, "last": 12000, "seconds": 60.0}

    monkeypatch.setattr(peers, "run_zoo", fake_zoo)
    monkeypatch.setattr(peers, "probe_versions", lambda impl: {"python": "3"})
    report = peers.main(["--rounds", "2", "--zoo-variant", "fast:A=1", "--out", str(tmp_path)])
    assert calls == [("zoo", None), ("zoo-fast", {"A": "1"})] * 2
    assert report["summary"]["median_rate"]["zoo-fast"] == 120.0
    assert set(report["summary"]["ratios"]) == {"zoo/sbx", "zoo/cleanrl", "zoo-fast/sbx", "zoo-fast/cleanrl"}
    assert report["settings"]["zoo_variants"] == ["fast:A=1"]


def test_the_plasticity_benchmark_refuses_an_unknown_intervention(capsys):
    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as e:
        module.main(["--plasticity", "--interventions", "plain,injection,nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("error: argument --interventions: unknown nope; choose from " + ", ".join(module.IN_UPDATE))
