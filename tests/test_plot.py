"""Tests for analysis/stats.py, analysis/plot.py and its command line, scripts/plot.py."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from plasticity_zoo.analysis import plot, stats
from plasticity_zoo.analysis.aggregate import run_labels

ROOT = Path(__file__).resolve().parents[1]


def _load_plot_cli():
    """Import scripts/plot.py by path (scripts/ is not a package): the command line over analysis.plot."""
    spec = importlib.util.spec_from_file_location("plot_script", ROOT / "scripts" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot_cli = _load_plot_cli()


# ---------------------------------------------------------------- bootstrap_ci


def test_bootstrap_ci_constant_values_collapse():
    assert stats.bootstrap_ci(np.full(5, 3.5), rng=0) == (3.5, 3.5, 3.5)


def test_bootstrap_ci_single_value():
    assert stats.bootstrap_ci([7.0]) == (7.0, 7.0, 7.0)


def test_bootstrap_ci_brackets_mean():
    values = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    point, low, high = stats.bootstrap_ci(values, rng=0)
    assert point == pytest.approx(values.mean())
    assert values.min() <= low < point < high <= values.max()


def test_bootstrap_ci_reproducible_with_seed():
    values = np.arange(10.0)
    assert stats.bootstrap_ci(values, rng=3) == stats.bootstrap_ci(values, rng=3)


def test_bootstrap_ci_shrinks_with_more_samples():
    rng = np.random.default_rng(0)
    widths = []
    for n in (10, 1000):
        _, low, high = stats.bootstrap_ci(rng.normal(size=n), rng=1)
        widths.append(high - low)
    assert widths[1] < widths[0] / 3  # ~ sqrt(100) = 10x narrower in expectation


def test_bootstrap_ci_other_statistic():
    values = np.array([0.0, 1.0, 2.0, 100.0])
    point, _, _ = stats.bootstrap_ci(values, rng=0, statistic=np.median)
    assert point == 1.5


# ------------------------------------------------------------------------- iqm


def test_iqm_divisible_by_four():
    assert stats.iqm(np.arange(1.0, 9.0)) == pytest.approx(4.5)  # mean(3, 4, 5, 6)


def test_iqm_not_divisible_by_four():
    # n = 7: int(0.25 * 7) = 1 value cut from each end, as scipy.trim_mean.
    values = [3.0, 100.0, -50.0, 0.0, 7.0, 2.0, 1.0]
    assert stats.iqm(values) == pytest.approx(np.mean([0.0, 1.0, 2.0, 3.0, 7.0]))
    # n = 3: int(0.75) = 0, nothing is trimmed.
    assert stats.iqm([1.0, 2.0, 9.0]) == pytest.approx(4.0)


def test_iqm_along_axis():
    x = np.array([np.arange(1.0, 9.0), np.arange(1.0, 9.0) * 2])
    np.testing.assert_allclose(stats.iqm(x, axis=1), [4.5, 9.0])
    # Flattened, sorted: 1 2 2 3 | 4 4 5 6 6 7 8 8 | 10 12 14 16.
    assert stats.iqm(x) == pytest.approx(np.mean([4, 4, 5, 6, 6, 7, 8, 8]))


# ------------------------------------------------------ stratified_bootstrap_ci


def test_stratified_bootstrap_resamples_within_tasks():
    # 4 runs x 2 tasks with disjoint ranges. Any within-task resample has 4
    # values in [0, 3] and 4 in [100, 103]; the IQM trims the 2 lowest (task 0)
    # and 2 highest (task 1), keeping 2 of each: IQM in [50, 53]. A pooled,
    # non-stratified bootstrap would often draw mostly one task and fall outside.
    scores = np.array([[0.0, 100.0], [1.0, 101.0], [2.0, 102.0], [3.0, 103.0]])
    point, low, high = stats.stratified_bootstrap_ci(scores, ci=1.0, rng=0)
    assert point == pytest.approx(stats.iqm(scores))
    assert 50.0 <= low < point < high <= 53.0


def test_stratified_bootstrap_single_run_collapses():
    scores = np.array([[1.0, 2.0, 3.0, 4.0]])
    assert stats.stratified_bootstrap_ci(scores, rng=0) == (2.5, 2.5, 2.5)


# ------------------------------------------------------------------ plot CLI

STEPS = [1000, 2000, 3000, 4000, 5000]


def _eval_return(agent_offset, seed, step):
    return agent_offset + 10.0 * seed + step / 100.0


def _write_run(run_dir, agent, offset, label=None, settings=None):
    """A synthetic run: 2 seeds, 5 eval steps, metrics with a plasticity column; ``settings`` go into its
    config.json beside the agent and env."""
    run_dir.mkdir()
    config = {"agent_name": agent, "env": "Pendulum-v1", **(settings or {})}
    if label:
        config["label"] = label
    (run_dir / "config.json").write_text(json.dumps(config))
    eval_lines = ["step,seed,return_mean,return_std,episode_returns"]
    metric_lines = ["step,seed,charts/episodic_return,losses/critic,plasticity/critic/dormant_0.0"]
    for step in STEPS:
        for seed in range(2):
            ret = _eval_return(offset, seed, step)
            eval_lines.append(f"{step},{seed},{ret},1.0,{ret - 1} {ret + 1}")
            critic_loss = "" if step == 3000 else f"{1.0 / step}"
            metric_lines.append(f"{step},{seed},{ret},{critic_loss},{0.1 * seed + step / 1e5}")
    (run_dir / "eval.csv").write_text("\n".join(eval_lines) + "\n")
    (run_dir / "metrics.csv").write_text("\n".join(metric_lines) + "\n")
    return run_dir


def _final_mean(offset, seeds=(0, 1)):
    return np.mean([_eval_return(offset, s, STEPS[-1]) for s in seeds])


def test_plot_end_to_end(tmp_path, capsys):
    sac = _write_run(tmp_path / "sac", "sac", offset=-500.0)
    td3 = _write_run(tmp_path / "td3", "td3", offset=-300.0)
    out = tmp_path / "figs" / "fig.png"
    plot_cli.main(
        [
            str(sac),
            str(td3),
            "--out",
            str(out),
            "--smooth",
            "2",
            "--title",
            "t",
            "--metrics",
            "plasticity/critic/dormant*",
            "losses/*",
        ]
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[-1] == str(out)
    sac_row = next(line for line in lines if line.startswith("Pendulum-v1  sac"))
    td3_row = next(line for line in lines if line.startswith("Pendulum-v1  td3"))
    assert f"{_final_mean(-500.0):.3f}" in sac_row
    assert f"{_final_mean(-300.0):.3f}" in td3_row
    assert sac_row.split()[2:4] == ["2", "5000"]


def test_plot_pools_seeds_with_same_label(tmp_path, capsys):
    a = _write_run(tmp_path / "a", "sac", offset=0.0, label="mine")
    b = _write_run(tmp_path / "b", "td3", offset=100.0, label="mine")
    plot_cli.main([str(a), str(b), "--out", str(tmp_path / "fig.pdf")])
    rows = [line for line in capsys.readouterr().out.splitlines() if "mine" in line]
    assert len(rows) == 1
    assert rows[0].split()[2] == "4"
    assert f"{np.mean([_final_mean(0.0), _final_mean(100.0)]):.3f}" in rows[0]
    assert (tmp_path / "fig.pdf").read_bytes()[:4] == b"%PDF"


def test_group_aggregate_matches_bootstrap(tmp_path):
    run = plot.load_run(_write_run(tmp_path / "r", "sac", offset=0.0))
    agg = plot.aggregate(plot.group_curves([run], "return_mean", "eval"))
    np.testing.assert_array_equal(agg.steps, STEPS)
    expected = [np.mean([_eval_return(0.0, s, step) for s in (0, 1)]) for step in STEPS]
    np.testing.assert_allclose(agg.mean, expected)
    assert np.all(agg.low <= agg.mean) and np.all(agg.mean <= agg.high)


def test_aggregate_uses_common_steps_else_union():
    common = plot.aggregate([{1: 1.0, 2: 2.0}, {2: 4.0, 3: 5.0}])
    np.testing.assert_array_equal(common.steps, [2])
    assert common.mean[0] == 3.0
    disjoint = plot.aggregate([{1: 1.0}, {2: 4.0}])
    np.testing.assert_array_equal(disjoint.steps, [1, 2])
    np.testing.assert_array_equal(disjoint.n_seeds, [1, 1])


def test_smooth_trailing_average():
    assert plot.smooth({1: 1.0, 2: 3.0, 3: 5.0}, 2) == {1: 1.0, 2: 2.0, 3: 4.0}


def test_missing_eval_csv_is_named(tmp_path):
    run = _write_run(tmp_path / "run", "sac", offset=0.0)
    (run / "eval.csv").unlink()
    with pytest.raises(SystemExit) as err:
        plot_cli.main([str(run), "--out", str(tmp_path / "fig.png")])
    assert str(run / "eval.csv") in str(err.value)


def test_missing_config_is_named(tmp_path):
    run = _write_run(tmp_path / "run", "sac", offset=0.0)
    (run / "config.json").unlink()
    with pytest.raises(SystemExit) as err:
        plot_cli.main([str(run), "--out", str(tmp_path / "fig.png")])
    assert str(run / "config.json") in str(err.value)


def test_eval_without_rows_is_rejected(tmp_path):
    run = _write_run(tmp_path / "run", "sac", offset=0.0)
    (run / "eval.csv").write_text("step,seed,return_mean,return_std,episode_returns\n")
    with pytest.raises(SystemExit, match="no rows"):
        plot_cli.main([str(run), "--out", str(tmp_path / "fig.png")])


def test_missing_metric_is_named(tmp_path):
    run = _write_run(tmp_path / "run", "sac", offset=0.0)
    with pytest.raises(SystemExit) as err:
        plot_cli.main([str(run), "--out", str(tmp_path / "fig.png"), "--metrics", "perf/sps"])
    assert "perf/sps" in str(err.value) and "metrics.csv" in str(err.value)


def test_missing_y_column_is_named(tmp_path):
    run = _write_run(tmp_path / "run", "sac", offset=0.0)
    with pytest.raises(SystemExit, match="normalized_score"):
        plot_cli.main([str(run), "--out", str(tmp_path / "fig.png"), "--y", "normalized_score"])


# ------------------------------------------------------------ pooled runs' step grids


def _write_grid_run(run_dir, steps, label="mine", slope=0.01, seeds=2, column_values=None):
    """A run evaluated at ``steps``: return = seed + slope * step (linear, so interpolation is exact)."""
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"agent_name": "sac", "env": "Pendulum-v1", "label": label}))
    lines = ["step,seed,return_mean,return_std,episode_returns"]
    for step in steps:
        for seed in range(seeds):
            ret = seed + slope * step if column_values is None else column_values
            lines.append(f"{step},{seed},{ret},0.0,{ret}")
    (run_dir / "eval.csv").write_text("\n".join(lines) + "\n")
    return run_dir


def test_runs_on_different_evaluation_grids_are_refused_naming_both(tmp_path, capsys):
    """Issue #23 item 5: eval-every 5000 and 2000 pooled kept only step 0 (an empty figure, exit 0)."""
    a = _write_grid_run(tmp_path / "a", range(0, 10_001, 5000))
    b = _write_grid_run(tmp_path / "b", range(0, 10_001, 2000))
    out = tmp_path / "fig.png"
    with pytest.raises(SystemExit) as err:
        plot_cli.main([str(a), str(b), "--out", str(out)])
    message = str(err.value)
    assert message.startswith("error: ") and "evaluated at different steps" in message and "--align" in message
    assert f"{a}: 3 steps from 0 to 10000, every 5000" in message
    assert f"{b}: 6 steps from 0 to 10000, every 2000" in message
    assert not out.exists() and "final_step" not in capsys.readouterr().out


def test_the_refusal_exits_non_zero_from_the_command_line(tmp_path):
    import subprocess
    import sys

    a = _write_grid_run(tmp_path / "a", range(0, 10_001, 5000))
    b = _write_grid_run(tmp_path / "b", range(0, 10_001, 2000))
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot.py"), str(a), str(b), "--out", str(tmp_path / "fig.png")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode != 0 and "evaluated at different steps" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "fig.png").exists()


def test_align_interpolates_every_seed_onto_the_shared_steps(tmp_path, capsys):
    a = _write_grid_run(tmp_path / "a", range(0, 10_001, 5000))
    b = _write_grid_run(tmp_path / "b", range(0, 12_001, 2000))  # runs longer: aligned up to 10000
    out = tmp_path / "fig.png"
    plot_cli.main([str(a), str(b), "--out", str(out), "--align"])
    row = next(line for line in capsys.readouterr().out.splitlines() if "mine" in line)
    assert row.split()[2:5] == ["4", "10000", f"{0.5 + 0.01 * 10_000:.3f}"]  # 4 seeds, mean of seeds 0, 1, 0, 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    agg = plot.aggregate(plot.group_curves([plot.load_run(a), plot.load_run(b)], "return_mean", "eval", align=True))
    np.testing.assert_array_equal(agg.steps, [0, 2000, 4000, 5000, 6000, 8000, 10000])
    np.testing.assert_allclose(agg.mean, 0.5 + 0.01 * agg.steps)  # linear curves: interpolation is exact
    np.testing.assert_array_equal(agg.n_seeds, 4)


def test_runs_of_different_lengths_on_one_grid_pool_up_to_the_shorter(tmp_path, capsys):
    """Not a grid mismatch: a shorter run (with its final evaluation off the grid) ends the pooled curve."""
    a = _write_grid_run(tmp_path / "a", [0, 3000, 6000, 9000, 10_000])
    b = _write_grid_run(tmp_path / "b", range(0, 12_001, 3000))
    plot_cli.main([str(a), str(b), "--out", str(tmp_path / "fig.png")])
    row = next(line for line in capsys.readouterr().out.splitlines() if "mine" in line)
    assert row.split()[2:4] == ["4", "9000"]


def test_non_overlapping_runs_cannot_be_aligned(tmp_path):
    a = _write_grid_run(tmp_path / "a", [0, 1000])
    b = _write_grid_run(tmp_path / "b", [2000, 3000])
    with pytest.raises(SystemExit, match="do not overlap"):
        plot_cli.main([str(a), str(b), "--out", str(tmp_path / "fig.png"), "--align"])


def test_a_log_holding_two_runs_is_refused(tmp_path):
    """Two runs appended to one eval.csv (two step-0 rows per seed) are not pooled as one."""
    run = _write_grid_run(tmp_path / "r", [0, 1000, 2000])
    with open(run / "eval.csv", "a") as f:
        f.write("0,0,5.0,0.0,5.0\n")
    with pytest.raises(SystemExit, match=r"line 8: seed 0 goes back from step 2000 to 0; the file holds more"):
        plot_cli.main([str(run), "--out", str(tmp_path / "fig.png")])


def test_a_metric_without_values_is_refused_not_drawn_empty(tmp_path):
    run = _write_run(tmp_path / "run", "sac", offset=0.0)
    text = (run / "metrics.csv").read_text().splitlines()
    rows = [line.split(",") for line in text[1:]]
    (run / "metrics.csv").write_text("\n".join([text[0]] + [",".join(r[:3] + [""] + r[4:]) for r in rows]) + "\n")
    out = tmp_path / "fig.png"
    with pytest.raises(SystemExit, match="no values in column 'losses/critic' of metrics.csv"):
        plot_cli.main([str(run), "--out", str(out), "--metrics", "losses/critic"])
    assert not out.exists()


def test_a_single_evaluation_is_drawn_as_a_point(tmp_path):
    run = _write_grid_run(tmp_path / "r", [0])
    fig = plot.make_figure(plot.group_runs([plot.load_run(run)]), "return_mean")
    (line,) = fig.axes[0].get_lines()
    assert line.get_marker() == "o" and len(line.get_xdata()) == 1


# --------------------------------------------------------------- from Python (a notebook), and the labels


def test_the_plot_functions_work_from_python_without_the_command_line(tmp_path):
    """Issue #47 item 3: plots are importable (plasticity_zoo.analysis.plot), their CLI a thin wrapper."""
    from matplotlib.figure import Figure

    import plasticity_zoo as pz

    a = _write_run(tmp_path / "a", "sac", offset=0.0)
    b = _write_run(tmp_path / "b", "td3", offset=100.0)
    fig = pz.plot.learning_curves([a, b], metrics=["losses/*"])
    assert isinstance(fig, Figure) and len(fig.axes) == 2  # the return, then the metric's row
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["sac", "td3"]
    table = plot.final_table([a, b])
    assert table.splitlines()[0].split()[:3] == ["env", "label", "seeds"] and f"{_final_mean(100.0):.3f}" in table
    assert plot.save_figure([a, b], tmp_path / "f" / "fig.png") == table
    assert (tmp_path / "f" / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (a / "config.json").unlink()
    with pytest.raises(plot.PlotError, match="missing config.json") as err:  # a ValueError, not an exit
        plot.learning_curves([a, b])
    assert isinstance(err.value, ValueError) and not isinstance(err.value, SystemExit)


REDO = {"plasticity": {"redo": True, "redo_tau": 0.025}, "agent": {"tau": 0.005}}
PLAIN = {"plasticity": {"redo": False, "redo_tau": 0.025}, "agent": {"tau": 0.005}}


def test_a_redo_run_is_not_pooled_with_plain_runs_of_the_same_agent(tmp_path, capsys):
    """Issue #47 item 8: `plot.py --align` drew a ReDo run and two plain SAC runs as one curve "sac, 3 seeds"
    (the default label was the agent's name).  Runs now pool only when their configs match but for the seed
    and the run's name; the default label names the settings that differ."""
    a = _write_run(tmp_path / "a", "sac", offset=0.0, settings={**PLAIN, "seed": 0, "run_dir": "runs/a"})
    b = _write_run(tmp_path / "b", "sac", offset=0.0, settings={**PLAIN, "seed": 1, "run_dir": "runs/b"})
    redo = _write_run(tmp_path / "redo", "sac", offset=50.0, settings={**REDO, "seed": 2, "run_dir": "runs/redo"})
    plot_cli.main([str(a), str(b), str(redo), "--out", str(tmp_path / "fig.png"), "--align"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Pendulum-v1")]
    assert len(lines) == 2, lines
    plain = next(line.split() for line in lines if "  sac plasticity.redo=false  " in line)
    redo = next(line.split() for line in lines if "  sac plasticity.redo=true  " in line)
    assert plain[3] == "4" and redo[3] == "2"  # seeds: 2 runs x 2 seeds pooled; the ReDo run's own 2
    assert float(plain[5]) == pytest.approx(_final_mean(0.0)) and float(redo[5]) == pytest.approx(_final_mean(50.0))


def test_run_labels_name_what_differs_and_keep_explicit_labels():
    sac = {"agent_name": "sac", "env": "Pendulum-v1"}
    runs = [
        {**sac, "seed": 0, "run_dir": "x", "progress": True, **PLAIN},
        {**sac, "seed": 3, "run_dir": "y", "progress": False, "wandb": True, **PLAIN},  # bookkeeping only
        {**sac, **REDO, "agent": {"tau": 0.01}},
        {**sac, **REDO, "label": "mine"},
        {"agent_name": "ppo", "env": "Pendulum-v1", "agent": {"clip_coef": 0.2}},
    ]
    assert run_labels(runs) == [
        "sac plasticity.redo=false, tau=0.005",
        "sac plasticity.redo=false, tau=0.005",
        "sac plasticity.redo=true, tau=0.01",
        "mine",
        "ppo",
    ]
    # a setting that differs only between envs (each env's own) does not split a label across envs
    per_env = [
        {**sac, "env": env, "action_repeat": repeat, **cfg}
        for env, repeat in (("dmc:a-b", 2), ("Pendulum-v1", 1))
        for cfg in (PLAIN, REDO)
    ]
    assert run_labels(per_env) == ["sac plasticity.redo=false", "sac plasticity.redo=true"] * 2
    assert run_labels([sac, {**sac, "seed": 1}]) == ["sac", "sac"]  # old config.json files: the agent's name
