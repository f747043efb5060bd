"""The layers point down (docs/architecture.md): a test that parses every import, function-level
imports included, and fails on an upward arrow or an import cycle in any package."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("networks", "buffers", "envs", "plasticity", "agents", "training", "analysis", "scripts")
# what each layer may import (besides itself and third-party packages)
ALLOWED = {
    "networks": set(),
    "buffers": set(),
    "envs": {"buffers"},
    "plasticity": {"networks"},
    "agents": {"networks", "buffers", "envs", "plasticity"},
    "training": {"networks", "buffers", "envs", "plasticity", "agents"},
    "analysis": {"networks", "buffers", "envs", "plasticity", "agents", "training"},
    "scripts": {"networks", "buffers", "envs", "plasticity", "agents", "training", "analysis"},
}


NAMESPACE = "plasticity_zoo."  # the installed import name of every top-level folder (pyproject.toml)


def raw_imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, as written (absolute imports; the project uses no relative ones)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from envs import datasets`
    return out


def imports(path: Path) -> set[str]:
    """The project modules ``path`` imports, named by folder (``plasticity_zoo.envs.x`` -> ``envs.x``)."""
    return {name.removeprefix(NAMESPACE) for name in raw_imports(path)}


def project_modules() -> set[str]:
    """Every module of the packages, subpackages included (``training/loops/device.py``: ``training.loops.device``)."""
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
    }


def test_imports_point_down():
    upward = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for name in imports(path):
                top = name.split(".")[0]
                if top in PACKAGES and top != pkg and top not in ALLOWED[pkg]:
                    upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(set(upward)))


def test_every_import_of_the_project_goes_through_its_namespace():
    """A bare ``import envs`` would find a user's own ``envs`` package first (or fail once installed)."""
    bare = [
        f"{path.relative_to(ROOT)} imports {name}"
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
        for name in raw_imports(path)
        if name.split(".")[0] in PACKAGES and name.split(".")[0] != "scripts"
    ]
    assert not bare, "imports outside the plasticity_zoo namespace:\n" + "\n".join(sorted(set(bare)))


def module_graph() -> dict[str, set[str]]:
    """Every project module (scripts aside) -> the project modules it imports, function-level imports
    included.  ``from pkg import name`` depends on ``pkg.name`` where that is a module, else on ``pkg``;
    an edge to a module's own package is left out (Python runs a package's ``__init__`` before any of
    its modules, whatever they import)."""
    modules = {m for m in project_modules() if not m.startswith("scripts")}

    def path(m):
        p = ROOT / (m.replace(".", "/") + ".py")
        return p if p.is_file() else ROOT / m.replace(".", "/") / "__init__.py"

    graph = {}
    for m in modules:
        deps = set()
        for name in imports(path(m)):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != m and not m.startswith(name + "."):
                deps.add(name)
        graph[m] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(node, stack):
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            cycle = visit(nxt, stack + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for m in sorted(graph):
        cycle = visit(m, [])
        if cycle:
            return cycle
    return None


def test_no_package_has_an_import_cycle():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Inside training/ (docs/architecture.md, "Layers"): the services know no loop kind, and neither the
# services nor the loops (with the machinery they share) know how a run is started.
STARTING = {"training.run", "training.cli", "training.presets", "training.sweep"}
SERVICES = {"training.evaluation", "training.logger", "training.checkpoint", "training.provenance"}
LOOP_MACHINERY = {"training.driver", "training.loop", "training.seeds"}


def test_inside_training_the_services_and_loops_import_nothing_above_them():
    graph = module_graph()
    loops = {m for m in graph if m == "training.loops" or m.startswith("training.loops.")}
    assert {"training.loops", "training.loops.offpolicy", "training.loops.device"} <= loops
    wrong = [f"{m} imports {d}" for m in sorted(SERVICES | LOOP_MACHINERY | loops) for d in graph[m] & STARTING]
    wrong += [f"{m} imports {d}" for m in sorted(SERVICES) for d in graph[m] & (loops | LOOP_MACHINERY)]
    assert not wrong, "imports against the order inside training/:\n" + "\n".join(wrong)


def test_the_cycle_finder_finds_a_cycle_through_function_level_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_checker_sees_function_level_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def f():\n    from plasticity_zoo.training.replay import Transition\n    import plasticity_zoo.agents.sac\n"
    )
    assert {"training.replay", "training.replay.Transition", "agents.sac"} <= imports(src)


def test_the_suites_file_order_puts_heavy_files_first_and_is_drawn_from_its_seed():
    from tests.suite_guards import HEAVY, order_files

    files = [f"tests/test_{i}.py" for i in range(12)] + [f"tests/{name}" for name in HEAVY[:3]]
    first = order_files(files, seed=1)
    assert sorted(first) == sorted(files)  # every file once
    assert {f.split("/")[-1] for f in first[:3]} == set(HEAVY[:3])  # the heavy ones start
    assert order_files(files, seed=1) == first  # a seed replays its order
    assert len({tuple(order_files(files, seed=s)) for s in range(5)}) > 1  # and seeds differ


def test_the_suites_watchdog_ends_a_worker_stuck_on_one_test_and_leaves_the_others(tmp_path):
    import signal
    import subprocess
    import time

    from tests.suite_guards import Watchdog

    # no core file on SIGABRT; no preexec_fn (it would fork with JAX's threads running)
    stuck, idle, busy = (subprocess.Popen(["sh", "-c", "ulimit -c 0; exec sleep 60"]) for _ in range(3))
    now = time.time()
    for worker, proc, started, nodeid in (
        ("gw0", stuck, now - 100, "tests/test_x.py::test_hangs"),
        ("gw1", idle, now - 100, ""),  # between tests
        ("gw2", busy, now - 10, "tests/test_y.py::test_runs"),
    ):
        (tmp_path / worker).write_text(f"{proc.pid}\t{started}\t{nodeid}")
    lines = []
    watchdog = Watchdog(tmp_path, hung_after=50, kill_after=90, write=lines.append, live_gdb=False)
    try:
        watchdog.check(now - 55)  # nothing has run 50 s yet
        assert lines == []
        watchdog.check(now - 40)  # the stuck test passed 50 s: its stacks are announced, nothing killed
        assert len(lines) == 1 and "gw0" in lines[0] and "test_hangs" in lines[0] and stuck.poll() is None
        watchdog.check(now)  # past 90 s: SIGABRT, once
        assert stuck.wait(timeout=10) == -signal.SIGABRT and "SIGABRT" in lines[-1]
        watchdog.check(now + 1)
        assert len(lines) == 2 and idle.poll() is None and busy.poll() is None
    finally:
        for proc in (stuck, idle, busy):
            proc.kill()
            proc.wait()
