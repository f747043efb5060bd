"""Fast second runs: the persistent compilation cache the entry points switch on, and the notices of what a
run waits on while XLA compiles (networks/runtime.py: use_persistent_cache; training/loop.py: CompileNotices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from plasticity_zoo.training import loop

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import json, jax; from plasticity_zoo.networks.runtime import use_persistent_cache; d = use_persistent_cache(); "
    "c = jax.config; print(json.dumps([d, c.jax_compilation_cache_dir, "
    "c.jax_persistent_cache_min_compile_time_secs]))"
)


def _probe(tmp_path, **env):
    base = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("JAX_COMPILATION_CACHE_DIR", "RLZOO_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**base, "HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": "", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_cache_is_on_by_default_per_user_and_a_variable_moves_or_disables_it(tmp_path):
    default = str(tmp_path / "home" / ".cache" / "plasticity-zoo" / "jax")
    assert _probe(tmp_path) == [default, default, 0.5]
    assert Path(default).is_dir()
    moved = str(tmp_path / "elsewhere")
    assert _probe(tmp_path, RLZOO_COMPILATION_CACHE=moved)[:2] == [moved, moved]
    assert _probe(tmp_path, RLZOO_COMPILATION_CACHE="off")[:2] == [None, None]
    # a cache the user gave JAX is kept with its own settings
    mine = str(tmp_path / "mine")
    assert _probe(tmp_path, JAX_COMPILATION_CACHE_DIR=mine, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="3") == [
        mine,
        mine,
        3.0,
    ]


class _Bar:
    def __init__(self):
        self.lines, self.statuses = [], []

    def __call__(self, step, status=None, **kw):
        self.statuses.append(status)

    def write(self, line):
        self.lines.append(line)


@pytest.mark.slow
def test_a_compile_shows_on_the_bar_while_it_runs_and_is_reported_then_loaded_from_the_cache(monkeypatch):
    assert jax.config.jax_compilation_cache_dir  # the suite's own (conftest)
    monkeypatch.setattr(loop, "SAY_COMPILES_FROM_SECS", 0.0)
    key = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, key)
    jax.config.update(key, 0.0)
    try:

        def program(x):
            return jnp.tanh(x @ x.T + 0.123456)  # a program no other test compiles

        x = jnp.ones((5, 5))
        bar = _Bar()
        with loop.CompileNotices(bar, lambda: 7, "/some/dir"):
            jax.jit(program)(x).block_until_ready()
        assert "compiling" in bar.statuses and bar.statuses[-1] == ""
        assert any(line.startswith("compiled jit(program) in") and "/some/dir" in line for line in bar.lines), bar.lines
        jax.clear_caches()  # the process forgets it: the next call goes to the persistent cache
        bar = _Bar()
        with loop.CompileNotices(bar, lambda: 7):
            jax.jit(program)(x).block_until_ready()
        assert any(line.startswith("loaded jit(program) from the compilation cache") for line in bar.lines), bar.lines
    finally:
        jax.config.update(key, before)
    # the listeners went with the context: a compile now reaches neither bar
    n = len(bar.lines)
    jax.jit(lambda x: x * 3.5)(jnp.ones(3)).block_until_ready()
    assert len(bar.lines) == n


@pytest.mark.slow
def test_a_second_run_of_a_command_loads_its_programs_and_reproduces_the_first(tmp_path):
    env = {**os.environ, "RLZOO_COMPILATION_CACHE": str(tmp_path / "cache")}
    evals = []
    for name in ("first", "second"):
        out = subprocess.run(
            [
                sys.executable,
                "scripts/train.py",
                "sac",
                "--env",
                "Pendulum-v1",
                "--total-steps",
                "300",
                "--learning-starts",
                "100",
                "--eval-every",
                "300",
                "--eval-episodes",
                "1",
                "--network.width",
                "16",
                "--no-progress",
                "--run-dir",
                str(tmp_path / name),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        evals.append((tmp_path / name / "eval.csv").read_text())
    assert any(p.name.startswith("jit_learn_and_act") for p in (tmp_path / "cache").iterdir())
    assert evals[0] == evals[1]
