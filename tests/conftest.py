import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
# The suite's two workers share two cores, so each computation's kernels run on its calling thread
# (one Eigen thread), and without asynchronous dispatch (set below, before JAX makes its CPU client)
# a hung test's Python stack names the computation that hangs, not a later call waiting behind it.
# (The hang the suite used to hit, in PPO's init over 2 seeds, was jaxlib's batched CPU LAPACK
# kernels deadlocking XLA's thread pool: fixed in the zoo, networks/runtime.py: one_call_per_matrix.)
# The same programs run; a matmul's last bits may differ from a multi-threaded one (another
# blocking), as between CPUs, which the golden fingerprints' tolerances allow.  (train.py keeps
# XLA's defaults: a single run uses every core.)
if "--xla_cpu_multi_thread_eigen" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
# Compiling is most of what the suite does, and its programs are tiny: XLA's older CPU fusion emitters
# compile them several times faster (a SAC update test: 9.5 s of XLA compilation -> 3.5 s with these
# and -O1).  Most tests run their programs a few times only, so they are compiled with JAX's
# `jax_disable_most_optimizations` (LLVM -O0 without its expensive passes); the learning runs, whose
# kernels run far longer than they compile, are marked `optimized` and keep -O1 (the MR.Q Pendulum
# learning test: 58 s at -O1, 81 s at -O0).  The level is chosen per test by `pytest_runtest_setup`
# below (the compile options are part of the persistent cache's keys; a jitted function already
# compiled in the process keeps its executable); RLZOO_TEST_XLA_OPT=N compiles every test at level N.  The
# same programs run; float results can differ in the last bits (another vectorisation), as between
# CPUs, which the golden fingerprints' tolerances allow.  train.py keeps XLA's defaults.
if "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# The on-policy host loop lowers its step and update with the unrolled Threefry hash (networks/runtime.py:
# threefry_unrolled), which compiles slower; the suite compiles far more than it runs, so it keeps JAX's
# rolled loop everywhere (the same bits: tests/test_networks.py), save the tests that unset this.
os.environ.setdefault("RLZOO_UNROLLED_THREEFRY", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as scripts/train.py: LAPACK's threads fight XLA's
# XLA compiles dominate the suite's time, and many tests (and the training subprocesses of the CLI
# tests, which inherit the variables) compile the same programs again.  A persistent compilation
# cache, empty at the start of every session and removed at its end, compiles each program once per
# session; a cache hit returns the executable of an identical program, so results do not change.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jax-compilation-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import csv

import gymnasium as gym
import jax
import numpy as np
import pytest

pytest_plugins = ["tests.suite_guards"]  # file order, crashed workers, tests that never ran, costliest files

jax.config.update("jax_cpu_enable_async_dispatch", False)  # see XLA_FLAGS above (before JAX's CPU client exists)


FIXED_XLA_OPT = os.environ.get("RLZOO_TEST_XLA_OPT")
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --xla_backend_optimization_level={FIXED_XLA_OPT or 1}"
if FIXED_XLA_OPT is None:  # -O0 from the start: test modules copy the environment for their subprocesses at import
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Compile this test's programs (and its train.py subprocesses') at -O0 unless it is marked
    ``optimized``.  Chosen before the test's fixtures are set up, so a module fixture compiles at the
    level of the first test that asks for it (tests that compare with a shared fixture's run share its
    level: none of them is marked).  ``jax_disable_most_optimizations`` is read at each compilation;
    JAX reads its environment variable at import, in the subprocesses."""
    compile_like_a_test(optimized=item.get_closest_marker("optimized") is not None)


def compile_like_a_test(optimized: bool = False):
    """The XLA level of a test (``optimized``: -O1, else -O0), for this process and its subprocesses;
    ``tests/golden.py`` records at the level its test runs at.  Nothing under ``RLZOO_TEST_XLA_OPT``."""
    if FIXED_XLA_OPT is not None:
        return
    jax.config.update("jax_disable_most_optimizations", not optimized)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0" if optimized else "1"


class ToyChain(gym.Env):
    """Deterministic toy: obs = [t, x]; x += action; terminates when x >= 3, else truncated by TimeLimit.

    reward = 1 each step; used to check terminated / truncated / final-observation handling.
    """

    def __init__(self):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.x = 0, 0.0
        return np.array([self.t, self.x], np.float32), {}

    def step(self, action):
        self.t += 1
        self.x += float(action[0])
        obs = np.array([self.t, self.x], np.float32)
        return obs, 1.0, self.x >= 3.0, False, {}


class ToyReach(gym.Env):
    """Offline-learning toy: obs = [x], x' = clip(x + 0.2 a, -2, 2), reward = x'; never terminates.

    Starts at x ~ U(-0.5, 0.5); a policy that pushes right earns about +30 in 20 steps, one that
    does nothing about 0.  Random data covers it well, and its dynamics are linear.
    """

    def __init__(self):
        self.observation_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x = float(self.np_random.uniform(-0.5, 0.5))
        return np.array([self.x], np.float32), {}

    def step(self, action):
        self.x = float(np.clip(self.x + 0.2 * float(np.clip(action[0], -1, 1)), -2.0, 2.0))
        return np.array([self.x], np.float32), self.x, False, False, {}


if "ToyChain-v0" not in gym.registry:
    gym.register("ToyChain-v0", entry_point=ToyChain, max_episode_steps=5)
if "ToyReach-v0" not in gym.registry:
    gym.register("ToyReach-v0", entry_point=ToyReach, max_episode_steps=20)
    from plasticity_zoo.envs import termination as _termination

    _termination.register_termination("toyreach", _termination.never_done)


@pytest.fixture
def no_compilation_cache_writes():
    """Compile without writing to the persistent cache for one test (reads still hit it).

    Two fresh-clone CI runs (jaxlib 0.10.2, CPU) segfaulted inside JAX's cache write
    (``compilation_cache.put_executable_and_time`` -> ``executable.serialize()``) for the Kron + NE
    MR.Q step of ``test_plasticity_agents``, about 300 tests into one pytest process; the same test
    alone, or its file alone, passes, and its entry (1.4 MB) serialises fine there.  The cause inside
    XLA was not found; these programs are compiled once per session anyway, so not caching them
    costs nothing."""
    import jax

    key = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, key)
    jax.config.update(key, float("inf"))  # read at every write (jax._src.compiler._cache_write)
    yield
    jax.config.update(key, before)


@pytest.fixture
def compile_counts():
    """{"jit(name)": how many times XLA compiled (or loaded from the persistent cache) that program
    during the test}, from JAX's backend-compile monitoring event.

    A jitted function's ``_cache_size()`` counts C++ dispatch entries, not compilations: in one suite
    run the NE + Kron SAC test's step function held 6 entries for its 2 compilations and 2 traces
    (JAX_LOG_COMPILES, JAX_EXPLAIN_CACHE_MISSES), after test_dynamics, test_envs and test_evaluate had
    run in the same process, and 2 when run alone.  "Never recompiles" is asserted on this count."""
    import collections

    import jax
    from jax._src import dispatch

    counts = collections.Counter()

    def listen(event, duration, **kw):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            counts[kw.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield counts
    jax.monitoring.unregister_event_duration_listener(listen)


RELEASE_ABOVE_MB = float(os.environ.get("RLZOO_TEST_RELEASE_ABOVE_MB", "4000"))
RELEASE_GROWTH_MB = 2000.0
_release = {"above": RELEASE_ABOVE_MB}


def _resident_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drop JAX's in-memory caches (traces, compiled executables) after a test file when the pytest
    process has grown past ``RLZOO_TEST_RELEASE_ABOVE_MB`` (4000 MB) resident, then again each time
    it has grown 2000 MB more.

    Without this the single pytest process kept every program the suite had compiled: 7.4 GB
    resident halfway through a fresh-clone run, on the way to the point where CI segfaulted inside
    an executable's serialisation (see ``no_compilation_cache_writes``).  Dropping them after every
    file recompiles what later files share (tracing and lowering are not in the persistent cache,
    nor programs under its 0.2 s threshold), so it happens a few times per session only."""
    yield
    if _resident_mb() < _release["above"]:
        return
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    try:  # hand the freed pages back to the OS (glibc keeps them in its arenas otherwise)
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    _release["above"] = _resident_mb() + RELEASE_GROWTH_MB


def pytest_terminal_summary(terminalreporter):
    """The pytest process's peak resident memory, for reading CI logs."""
    import resource

    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    terminalreporter.write_line(f"peak resident memory of the pytest process: {peak_mb:.0f} MB")


@pytest.fixture
def assert_same_logs():
    """assert_same_logs(run_a, run_b): eval.csv and metrics.csv hold the same rows, every value equal
    (the timing columns ``perf/*`` aside)."""

    def check(a, b):
        for name in ("eval.csv", "metrics.csv"):
            rows_a = list(csv.DictReader(open(a / name)))
            rows_b = list(csv.DictReader(open(b / name)))
            assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b], name
            for i, (x, y) in enumerate(zip(rows_a, rows_b)):
                diff = {k for k in set(x) | set(y) if not k.startswith("perf/") and x.get(k) != y.get(k)}
                assert not diff, f"{name} row {i} (step {x['step']}) differs in {sorted(diff)}"

    return check


@pytest.fixture
def tiny_sac_config():
    from plasticity_zoo.agents.sac import SACConfig
    from plasticity_zoo.training.config import NetworkConfig, RunConfig

    def make(**kw):
        agent_kw = {k: kw.pop(k) for k in list(kw) if k in SACConfig.__dataclass_fields__}
        agent = SACConfig(**{"buffer_size": 5000, "batch_size": 32, "learning_starts": 200, **agent_kw})
        return RunConfig(
            **{
                "env": "Pendulum-v1",
                "total_steps": 600,
                "eval_every": 300,
                "eval_episodes": 2,
                "log_every": 100,
                "checkpoint_every": 300,
                "progress": False,
                "network": NetworkConfig(width=16),
                "agent_name": "sac",
                "agent": agent,
                **kw,
            }
        )

    return make
