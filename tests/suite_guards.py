"""The suite's own guards, a pytest plugin loaded by ``tests/conftest.py``.

- **File order.**  Test files run in an order drawn from a seed (``--file-order SEED``, or
  ``random``: a fresh seed each run, printed in the header; ``collected``: pytest's order).  The
  files that cost minutes go first (``HEAVY``), shuffled among themselves, so the two xdist workers
  finish together; the rest follow, shuffled.  Every ``make test`` is thus a check that no test
  depends on what ran before it in the same process (beyond the compilation cache); a failure
  names its seed, and ``--file-order SEED`` replays that order.
- **A crashed worker is never silent.**  Python's faulthandler prints every thread's Python stack
  when a worker dies of a signal (pytest enables it).  The native stack comes from a core dump:
  workers raise their soft core-size limit (where the kernel writes plain core files into the
  working directory), and when one dies the controller names its signal and prints ``gdb``'s
  backtrace of the core (then deletes it).  A worker killed by SIGKILL (the kernel's OOM killer)
  leaves no stack, and the report says so.
- **Every collected test ran.**  With ``--max-worker-restart=0`` a crashed worker's remaining
  files never run; the summary counts the tests that never reported and fails the run if any.
- **Where the time went.**  The summary lists the costliest files (setup, call and teardown of
  every test in the file, summed).
"""
from __future__ import annotations

import os
import random
import resource
import signal
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

# Files that take minutes on a 2-core machine (end-to-end subprocesses, learning runs, Ray): started
# first so that neither worker is left with one of them at the end.  Ordered among themselves by the seed.
HEAVY = (  # each 2-8 minutes of one worker in a suite run (the summary's costliest files)
    "test_device_loop.py",
    "test_mrq_mt.py",
    "test_neubay.py",
    "test_plasticity_agents.py",
    "test_golden.py",
    "test_mrq.py",
    "test_training.py",
    "test_sweep.py",
)
GDB_TIMEOUT_S = 180
HUNG_AFTER_S = 480.0  # = faulthandler_timeout in pyproject.toml (pytest-timeout ends the test at 600 s)
# what the controller saw (each xdist worker is its own process, with its own copy)
_STATE = {"start": time.time(), "collected": set(), "reported": set(), "file_s": defaultdict(float), "crashes": []}


def pytest_addoption(parser):
    parser.addoption("--file-order", default="random", metavar="SEED|random|collected",
                     help="order of the test files: heavy files first, each group shuffled by SEED "
                          "(random: a fresh seed, printed in the header), or 'collected' (pytest's order)")


def _seed(config) -> int | None:
    if hasattr(config, "workerinput"):  # an xdist worker runs the controller's order
        return config.workerinput.get("file_order_seed")
    choice = config.getoption("file_order")
    if choice == "collected":
        return None
    if choice == "random":
        return random.SystemRandom().randrange(2**31)
    try:
        return int(choice)
    except ValueError:
        raise pytest.UsageError(f"--file-order: expected an integer seed, 'random' or 'collected', got {choice!r}")


def pytest_configure(config):
    config._file_order_seed = _seed(config)
    hung = float(config.getini("faulthandler_timeout") or 0.0)
    config._hung_after_s = hung if hung > 0 else HUNG_AFTER_S
    if hasattr(config, "workerinput"):
        _allow_core_dumps()


def pytest_report_header(config):
    seed = config._file_order_seed
    if seed is None:
        return "file order: as collected"
    return f"file order: heavy files first, shuffled by seed {seed} (replay with --file-order {seed})"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["file_order_seed"] = node.config._file_order_seed


def order_files(files: list[str], seed: int) -> list[str]:
    """``files`` (each once) with the HEAVY ones first; each group in an order drawn from ``seed``."""
    rng = random.Random(seed)
    heavy = [f for f in files if Path(f).name in HEAVY]
    light = [f for f in files if Path(f).name not in HEAVY]
    rng.shuffle(heavy)
    rng.shuffle(light)
    return heavy + light


def pytest_collection_modifyitems(config, items):
    seed = config._file_order_seed
    if seed is None:
        return
    by_file: dict[str, list] = {}
    for item in items:  # a file's tests keep their order (module fixtures are built once per file)
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    items[:] = [item for f in order_files(list(by_file), seed) for item in by_file[f]]


# ------------------------------------------------------------------------------------------------
# Crashed workers
# ------------------------------------------------------------------------------------------------
def _plain_core_pattern() -> bool:
    try:
        pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
    except OSError:
        return False
    return bool(pattern) and not pattern.startswith("|") and "/" not in pattern


def _allow_core_dumps():
    """In a worker: let the kernel write a core file on a crash (when it writes them into the working
    directory as plain files), so that the controller can print the native stack."""
    if os.environ.get("RLZOO_TEST_CORE_DUMPS", "1") == "0" or not _plain_core_pattern():
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def _exit_code(node) -> int | None:
    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)
    if popen is None:
        return None
    try:
        return popen.wait(timeout=60)
    except (subprocess.TimeoutExpired, OSError):
        return None


def _core_file(pid: int | None, since: float) -> Path | None:
    for name in ([f"core.{pid}"] if pid else []) + ["core"]:
        path = Path.cwd() / name
        if path.is_file() and path.stat().st_mtime >= since:
            return path
    return None


def native_stack(core: Path) -> str:
    """gdb's backtrace of the crashing thread, then one line per thread, from ``core``."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return f"(gdb is not installed: the core file {core} is kept for inspection)"
    cmd = [gdb, "-q", "-batch", "-iex", "set auto-load off", "-ex", "bt 60", "-ex", "info threads", sys.executable, str(core)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=GDB_TIMEOUT_S).stdout
    except subprocess.TimeoutExpired:
        return f"(gdb did not finish in {GDB_TIMEOUT_S} s: the core file {core} is kept for inspection)"
    core.unlink(missing_ok=True)
    return "\n".join(line for line in out.splitlines() if not line.startswith(("[New LWP", "warning:")))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "its exit status is unknown"
    if code < 0:
        sig = signal.Signals(-code)
        why = (" (nothing inside a process can print a stack on SIGKILL: the kernel's OOM killer sends it)"
               if sig == signal.SIGKILL else "")
        return f"it was killed by {sig.name}{why}"
    return (f"it exited with status {code} (pytest-timeout ends a hung test's process this way: its Python and "
            f"native stacks are printed above, at faulthandler_timeout)")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    if not error:
        return
    state = _STATE
    popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
    pid = getattr(popen, "pid", None)
    code = _exit_code(node)
    lines = [f"worker {node.gateway.id} (pid {pid}) crashed: {describe_exit(code)}."]
    core = _core_file(pid, state["start"])
    if core is not None:
        lines += [f"native stack from {core.name}:", native_stack(core)]
    elif code is not None and code < 0 and code != -signal.SIGKILL:
        lines.append("no core file was written (core dumps off, or the kernel pipes them elsewhere); "
                     "the Python stacks faulthandler printed are above")
    state["crashes"].append(lines[0])
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)


def _real_stderr(config) -> int:
    """The worker's stderr as pytest's faulthandler keeps it: outside pytest's capture (a test's own
    fd 2 goes to a capture file, which is lost if the process then ends)."""
    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        return config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):
        return 2


def native_stacks_of(pid: int) -> str:
    """Every thread's native stack of the live process ``pid`` (gdb attaches, prints, detaches)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb is not installed: no native stacks)"
    cmd = [gdb, "-q", "-batch", "-iex", "set auto-load off", "-p", str(pid), "-ex", "thread apply all bt 30"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=GDB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"(gdb did not finish in {GDB_TIMEOUT_S} s)"
    return "\n".join(line for line in (out.stdout + out.stderr).splitlines()
                     if not line.startswith(("[New LWP", "warning:", "[Thread debugging", "Using host")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """A test still running after faulthandler_timeout seconds has probably hung (XLA's CPU runtime has
    deadlocked here before): pytest's faulthandler prints every thread's Python stack then, and this
    prints their native stacks (gdb), both to the real stderr, before pytest-timeout ends the process."""
    import threading

    fd = _real_stderr(item.config)

    def dump():
        text = (f"\n+++ {item.nodeid} has run {item.config._hung_after_s:.0f} s: native stacks of pid "
                f"{os.getpid()} +++\n{native_stacks_of(os.getpid())}\n+++ end of native stacks +++\n")
        os.write(fd, text.encode(errors="replace"))

    timer = threading.Timer(item.config._hung_after_s + 1.0, dump)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# ------------------------------------------------------------------------------------------------
# Every collected test ran; where the time went
# ------------------------------------------------------------------------------------------------
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _STATE["collected"].update(ids)


def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput"):
        _STATE["collected"].update(item.nodeid for item in session.items)


def pytest_runtest_logreport(report):
    _STATE["reported"].add(report.nodeid)
    _STATE["file_s"][report.nodeid.split("::")[0]] += getattr(report, "duration", 0.0) or 0.0


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """A run in which collected tests never reported fails, whatever else it counted."""
    if hasattr(session.config, "workerinput") or session.shouldfail or session.shouldstop:
        return
    if _STATE["collected"] - _STATE["reported"] and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    state = _STATE
    if hasattr(config, "workerinput"):
        return
    seed = config._file_order_seed
    if seed is not None:
        terminalreporter.write_line(f"file order: seed {seed} (replay it with --file-order {seed})")
    costs = sorted(state["file_s"].items(), key=lambda kv: -kv[1])
    if costs:
        terminalreporter.write_sep("-", "the costliest test files (seconds in one worker: setup + call + teardown)")
        for name, seconds in costs[:15]:
            terminalreporter.write_line(f"{seconds:8.1f}  {name}")
    missing = state["collected"] - state["reported"]
    if missing:
        files = sorted({m.split("::")[0] for m in missing})
        terminalreporter.write_sep("!", f"{len(missing)} of {len(state['collected'])} collected tests never ran", red=True)
        terminalreporter.write_line(f"their files: {', '.join(files)}", red=True)
        for crash in state["crashes"]:
            terminalreporter.write_line(crash, red=True)
