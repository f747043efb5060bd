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
- **A hung test is ended, with its stacks.**  At ``faulthandler_timeout`` pytest's faulthandler (a C
  watchdog) prints every thread's Python stack; a watchdog thread in the xdist controller, which
  reads which test each worker is running from a heartbeat file, then ends the worker with SIGABRT
  (core file: native stacks; gdb attached from the controller first where no core will be written).
  pytest-timeout's thread method stays as the backstop of runs without xdist.
- **Every collected test ran.**  With ``--max-worker-restart=0`` a crashed worker's remaining
  files never run; the summary counts the tests that never reported and fails the run if any.
- **Where the time went.**  The summary lists the costliest files (setup, call and teardown of
  every test in the file, summed).
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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
    "test_search.py",
    "test_plasticity_injection_trac.py",
    "test_agent_contract.py",
    "test_gpu_check.py",
)
GDB_TIMEOUT_S = 120
HUNG_AFTER_S = 480.0  # when faulthandler_timeout (pyproject.toml) is unset
KILL_AFTER_HUNG_S = (
    80.0  # the controller ends a hung worker this long after faulthandler's dump (before pytest-timeout)
)
WATCHDOG_POLL_S = 5.0
_CONFIG: list = []  # this process's pytest config (hooks without a config argument need it)
# what the controller saw (each xdist worker is its own process, with its own copy)
_STATE = {"start": time.time(), "collected": set(), "reported": set(), "file_s": defaultdict(float), "crashes": []}


def pytest_addoption(parser):
    parser.addoption(
        "--file-order",
        default="random",
        metavar="SEED|random|collected",
        help="order of the test files: heavy files first, each group shuffled by SEED "
        "(random: a fresh seed, printed in the header), or 'collected' (pytest's order)",
    )


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
    _CONFIG[:] = [config]
    if hasattr(config, "workerinput"):
        _allow_core_dumps()
    elif getattr(config.option, "dist", "no") != "no":  # the xdist controller
        _start_watchdog(config)


def pytest_report_header(config):
    seed = config._file_order_seed
    if seed is None:
        return "file order: as collected"
    return f"file order: heavy files first, shuffled by seed {seed} (replay with --file-order {seed})"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["file_order_seed"] = node.config._file_order_seed
    if getattr(node.config, "_heartbeat_dir", None) is not None:
        node.workerinput["heartbeat_dir"] = str(node.config._heartbeat_dir)


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
    cmd = [
        gdb,
        "-q",
        "-batch",
        "-nx",
        "-iex",
        "set auto-load off",
        "-iex",
        "set debuginfod enabled off",
        "-ex",
        "thread apply all bt 20",
        sys.executable,
        str(core),
    ]
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=GDB_TIMEOUT_S, env={**os.environ, "DEBUGINFOD_URLS": ""}
        ).stdout
    except subprocess.TimeoutExpired:
        return f"(gdb did not finish in {GDB_TIMEOUT_S} s: the core file {core} is kept for inspection)"
    core.unlink(missing_ok=True)
    return "\n".join(line for line in out.splitlines() if not line.startswith(("[New LWP", "warning:")))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "its exit status is unknown"
    if code < 0:
        sig = signal.Signals(-code)
        why = {
            signal.SIGKILL: " (nothing inside a process can print a stack on SIGKILL: the kernel's OOM killer "
            "sends it, and the suite's watchdog when SIGABRT did not end a hung worker)",
            signal.SIGABRT: " (the suite's watchdog ends a hung worker this way: see its lines above)",
        }.get(sig, "")
        return f"it was killed by {sig.name}{why}"
    return (
        f"it exited with status {code} (pytest-timeout ends a hung test's process this way: its Python "
        f"stacks are printed above, at faulthandler_timeout)"
    )


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
        lines.append(
            "no core file was written (core dumps off, or the kernel pipes them elsewhere); "
            "the Python stacks faulthandler printed are above"
        )
    state["crashes"].append(lines[0])
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)


def native_stacks_of(pid: int) -> str:
    """Every thread's native stack of the live process ``pid``: gdb attaches, prints and detaches.

    Run from another process (the controller), never from ``pid`` itself: gdb stops every thread of
    the process it attaches to, so a timer inside the worker waiting for gdb would be frozen with it.
    gdb's debuginfod lookups (network) are off, it is killed after GDB_TIMEOUT_S, and the process is
    sent SIGCONT afterwards in case gdb died with it stopped."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb is not installed: no native stacks)"
    cmd = [
        gdb,
        "-q",
        "-batch",
        "-nx",
        "-iex",
        "set auto-load off",
        "-iex",
        "set debuginfod enabled off",
        "-p",
        str(pid),
        "-ex",
        "thread apply all bt 25",
    ]
    env = {**os.environ, "DEBUGINFOD_URLS": ""}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=GDB_TIMEOUT_S, env=env)
        text = out.stdout + out.stderr
    except subprocess.TimeoutExpired:
        text = f"(gdb did not finish in {GDB_TIMEOUT_S} s)"
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass
    return "\n".join(
        line
        for line in text.splitlines()
        if not line.startswith(("[New LWP", "warning:", "[Thread debugging", "Using host"))
    )


# ------------------------------------------------------------------------------------------------
# Hung tests: a watchdog in the controller
# ------------------------------------------------------------------------------------------------
# Each worker writes which test it is running (pid, start time, node id) to a file of its own; a
# thread of the controller reads them.  It must live outside the worker: a worker wedged in C code
# holding the GIL (XLA's CPU runtime has deadlocked in the suite) runs none of its own Python threads,
# so neither pytest-timeout's thread nor any timer of this plugin would ever fire there; only
# faulthandler's C watchdog (faulthandler_timeout) still prints its Python stacks.
def _heartbeat_file(config) -> Path | None:
    folder = getattr(config, "workerinput", {}).get("heartbeat_dir")
    return Path(folder) / config.workerinput["workerid"] if folder else None


def _beat(config, nodeid: str):
    path = _heartbeat_file(config)
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{os.getpid()}\t{time.time()}\t{nodeid}")
    tmp.replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_runtest_logstart(nodeid, location):
    if _CONFIG and hasattr(_CONFIG[0], "workerinput"):
        _beat(_CONFIG[0], nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_runtest_logfinish(nodeid, location):
    if _CONFIG and hasattr(_CONFIG[0], "workerinput"):
        _beat(_CONFIG[0], "")


def read_heartbeats(folder: Path) -> dict[str, tuple[int, float, str]]:
    """``{worker id: (pid, start time, node id of the running test, or "" between tests)}``."""
    beats = {}
    for path in folder.iterdir():
        if path.suffix == ".tmp":
            continue
        try:
            pid, started, nodeid = path.read_text().split("\t", 2)
            beats[path.name] = (int(pid), float(started), nodeid)
        except (OSError, ValueError):
            continue
    return beats


class Watchdog(threading.Thread):
    """In the controller: a test running ``hung_after`` seconds gets its worker's native stacks (gdb,
    unless the worker will leave a core file, whose backtrace the crash report prints); at
    ``kill_after`` its worker is sent SIGABRT (faulthandler prints its Python stacks, the kernel writes
    the core) and, if it is still there 30 s later, SIGKILL.  xdist then reports the crashed worker."""

    def __init__(self, folder: Path, hung_after: float, kill_after: float, write, live_gdb: bool):
        super().__init__(name="suite-watchdog", daemon=True)
        self.folder, self.hung_after, self.kill_after = folder, hung_after, kill_after
        self.write, self.live_gdb = write, live_gdb
        self.done = threading.Event()
        self.acted: dict[tuple, float] = {}  # (pid, start, node id) -> when SIGABRT was sent, or 0 after the dump

    def run(self):
        while not self.done.wait(WATCHDOG_POLL_S):
            self.check(time.time())

    def check(self, now: float):
        for worker, (pid, started, nodeid) in read_heartbeats(self.folder).items():
            if not nodeid:
                continue
            key, age = (pid, started, nodeid), now - started
            if age >= self.hung_after and key not in self.acted:
                self.acted[key] = 0.0
                text = native_stacks_of(pid) if self.live_gdb else "(its native stacks: from its core file, below)"
                self.write(
                    f"\n+++ worker {worker} (pid {pid}) has run {nodeid} for {age:.0f} s; it has probably "
                    f"hung (its Python stacks: from faulthandler, above) +++\n{text}\n+++\n"
                )
            if age >= self.kill_after and not self.acted.get(key):
                self.acted[key] = now
                self.write(
                    f"+++ {nodeid} still running after {age:.0f} s: ending worker {worker} "
                    f"(pid {pid}) with SIGABRT +++\n"
                )
                _signal(pid, signal.SIGCONT)
                _signal(pid, signal.SIGABRT)
            elif self.acted.get(key) and now - self.acted[key] > 30:
                _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _start_watchdog(config):
    folder = Path(tempfile.mkdtemp(prefix="pytest-heartbeats-"))
    config._heartbeat_dir = folder
    hung = config._hung_after_s
    reporter = config.pluginmanager.get_plugin("terminalreporter")

    def write(text: str):
        if reporter is not None:
            reporter.write_line(text, red=True)
            reporter._tw.flush()
        else:
            sys.stderr.write(text + "\n")

    watchdog = Watchdog(folder, hung, hung + min(KILL_AFTER_HUNG_S, hung), write, live_gdb=not _plain_core_pattern())
    watchdog.start()
    config._watchdog = watchdog


def pytest_unconfigure(config):
    watchdog = getattr(config, "_watchdog", None)
    if watchdog is not None:
        watchdog.done.set()
        shutil.rmtree(config._heartbeat_dir, ignore_errors=True)


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
        terminalreporter.write_sep(
            "!", f"{len(missing)} of {len(state['collected'])} collected tests never ran", red=True
        )
        terminalreporter.write_line(f"their files: {', '.join(files)}", red=True)
        for crash in state["crashes"]:
            terminalreporter.write_line(crash, red=True)
