"""Process-wide JAX settings the zoo applies when it is imported (``networks`` imports this module),
and the persistent compilation cache the entry points switch on (``use_persistent_cache``).

**Threefry on CPU: JAX's rolled loop by default, unrolled in the on-policy host loop and on request.**
Every ``jax.random`` draw hashes counters with Threefry-2x32; on CPU JAX lowers the hash's 20 rounds as
a 5-iteration rolled loop, on GPU and TPU unrolled.  Both compute the same bits (``tests/test_networks.py``
compares them).  XLA compiles the unrolled hash slowly (SAC's ``learn_and_act`` at the default width:
20 s against 5 s), and SAC's whole runs gained nothing from it (docs/benchmarks.md, SAC beside SBX), so
the rolled loop stays the default.  ``threefry_unrolled()`` lowers the programs inside it unrolled: the
on-policy host loop's step and update, small programs whose draws were a large share of each call
(docs/benchmarks.md, PPO throughput).  ``RLZOO_UNROLLED_THREEFRY=1`` registers the unrolled lowering for
every CPU program, ``=0`` keeps the rolled loop everywhere.  The unrolled rule is a private JAX function,
used only under the JAX versions it was checked with (``UNROLLED_THREEFRY_JAX``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

UNROLLED_THREEFRY_JAX = ("0.10.", "0.11.")  # JAX versions whose private lowering rule this was checked with


def _unrolled_threefry_rule(warn: bool = True):
    """(the Threefry primitive, JAX's unrolled lowering rule), or None where JAX's version or internals are
    not the ones checked (``warn``: say so)."""
    found, why = _threefry_lookup()
    if found is None and warn:
        warnings.warn(why)
    return found


@functools.lru_cache(maxsize=1)
def _threefry_lookup():
    """``_unrolled_threefry_rule``'s answer and, without one, why; looked up once per process."""
    import jax

    if not jax.__version__.startswith(UNROLLED_THREEFRY_JAX):
        checked = ", ".join(v + "x" for v in UNROLLED_THREEFRY_JAX)
        return None, (
            f"RLZOO_UNROLLED_THREEFRY: not applied under jax {jax.__version__} (checked with {checked}); "
            "JAX's rolled loop is used"
        )
    try:
        from jax._src.random import threefry2x32 as threefry

        return (threefry.threefry2x32_p, threefry._threefry2x32_lowering_rule), None
    except (ImportError, AttributeError):  # another JAX layout: keep its default lowering
        return None, "RLZOO_UNROLLED_THREEFRY: JAX's Threefry lowering moved; its rolled loop is used"


def unroll_threefry_on_cpu() -> bool:
    """With ``RLZOO_UNROLLED_THREEFRY=1``, register the unrolled Threefry lowering for the CPU platform;
    False otherwise, and where JAX's version or internals are not the ones checked (a warning says so)."""
    if os.environ.get("RLZOO_UNROLLED_THREEFRY", "") in ("", "0"):
        return False
    found = _unrolled_threefry_rule()
    if found is None:
        return False
    from jax._src.interpreters import mlir

    mlir.register_lowering(*found, platform="cpu")
    return True


@contextlib.contextmanager
def threefry_unrolled():
    """Programs lowered inside this block use the unrolled Threefry lowering on CPU; JAX's own rule after.

    For the small programs a host loop calls once per env step, which run a few draws and little else:
    there JAX's rolled loop (a 5-iteration ``while`` per draw, its carried values copied each iteration)
    is a large share of the call, and the unrolled draws compile in little time.  Wrapping each call is
    enough: only a call that lowers (the first with new shapes) reads the rule, and a call on a compiled
    program pays two dict writes.  The same bits either way.  Nothing changes under
    ``RLZOO_UNROLLED_THREEFRY=0`` (the rolled loop everywhere) or ``=1`` (unrolled everywhere already)."""
    found = _unrolled_threefry_rule(warn=False) if os.environ.get("RLZOO_UNROLLED_THREEFRY", "") == "" else None
    lowerings = _cpu_lowerings()
    if found is None or lowerings is None:
        yield
        return
    (primitive, rule), (table, entry) = found, lowerings
    before = table.get(primitive)
    table[primitive] = entry(rule, True)  # as mlir.register_lowering(primitive, rule, platform="cpu") does
    try:
        yield
    finally:
        if before is None:
            table.pop(primitive, None)
        else:
            table[primitive] = before


@functools.lru_cache(maxsize=1)
def _cpu_lowerings():
    """(JAX's table of CPU-specific lowering rules, its entry type), looked up once (``threefry_unrolled``
    runs on every host-loop step); None under another JAX layout."""
    try:
        from jax._src.interpreters import mlir

        return mlir._platform_specific_lowerings["cpu"], mlir.LoweringRuleEntry
    except (ImportError, AttributeError):
        return None


THREEFRY_UNROLLED = unroll_threefry_on_cpu()

CACHE_VARIABLE = "RLZOO_COMPILATION_CACHE"
CACHE_OFF = ("0", "off", "none", "false", "no")


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/plasticity-zoo/jax`` (``~/.cache/plasticity-zoo/jax`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "plasticity-zoo", "jax")


def use_persistent_cache(min_compile_secs: float = 0.5, max_bytes: int = 4 << 30) -> str | None:
    """Keep compiled XLA programs on disk between processes (JAX's persistent compilation cache), so a
    second run of the same command loads its programs instead of compiling them; returns the cache
    directory, or None when it is off.  A hit returns the executable of an identical program (the
    key covers the program, its compile options, the jaxlib version and the device), so results do
    not change.

    ``RLZOO_COMPILATION_CACHE``: a directory to use, or ``0`` / ``off`` to switch the cache off.  Without
    it, a cache the user already gave JAX (``JAX_COMPILATION_CACHE_DIR``, ``jax.config``) is kept with its
    own settings; otherwise ``default_cache_dir()``, holding programs that took ``min_compile_secs`` or
    more to compile, at most ``max_bytes`` (least recently used entries go first).  Idempotent; call it
    before the process's first compile (JAX fixes its cache on first use)."""
    import jax

    value = os.environ.get(CACHE_VARIABLE, "").strip()
    if value.lower() in CACHE_OFF:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    if not value and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = os.path.abspath(os.path.expanduser(value or default_cache_dir()))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only home: run without the cache rather than fail
        return None
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_secs)
        jax.config.update("jax_compilation_cache_max_size", max_bytes)
    return path


def one_call_per_matrix(fn):
    """``fn`` (a LAPACK-backed op on one matrix: QR, SVD), run one unbatched call after another under
    any ``vmap`` (``jax.custom_batching.sequential_vmap``); the values are those of the batched call.

    jaxlib 0.10's CPU LAPACK kernels split a batch (vmapped seeds, ensemble members) into chunks that
    they schedule on XLA's intra-op thread pool, then block the pool thread they run on until the
    chunks are done (``jax::ParallelBatchMap``).  When XLA runs as many independent batched LAPACK
    calls at once as the pool has threads (2 on a 2-core CPU: PPO's six orthogonal initialisers,
    vmapped over seeds, are independent), every pool thread waits for chunks no thread is free to
    run, and the process hangs with no CPU use (gdb: each ``tf_XLAEigen`` thread in
    ``BlockingCounter::Wait`` under ``ParallelBatchMap`` under ``lapack_sgeqrf_ffi``).  Upstream
    stopped parallelising LAPACK kernels in open-source builds after 0.10 (jax commit 859992407d).
    A batch of one runs inline on its thread, so nothing waits.  ``tests/test_networks.py``
    reproduces the hang in a subprocess against the plain batched call and checks this one."""
    import jax

    return jax.custom_batching.sequential_vmap(fn)


def cached_per_config(build):
    """``functools.lru_cache`` (16 entries) for a builder of jitted programs, ``build(agent, config, ...)``.

    A jitted function made afresh is traced (and looked up in the compilation cache) afresh, which
    for MR.Q's step program takes seconds; cached on its hashable arguments (the agent module, frozen
    configs, ints), runs in one process (a resumed run, a sweep's trials, the tests) reuse the traced
    and compiled programs.  Arguments that cannot be hashed (a config holding a dict) build afresh."""
    cached = functools.lru_cache(maxsize=16)(build)

    @functools.wraps(build)
    def builder(*args, **kwargs):
        try:
            hash((args, tuple(sorted(kwargs.items()))))
        except TypeError:
            return build(*args, **kwargs)
        return cached(*args, **kwargs)

    builder.cache_clear = cached.cache_clear
    return builder


# XLA CPU hands dots, elementwise ops and reductions to its YNNPACK library fusions.  Its reductions
# over a leading axis are slow: in NeuBay's update (10 critic heads on a 2048-step tape) the bias
# gradients, sums of (10, 2047, 256) over the tape, took 85 ms each, and the whole update 0.61 s
# against 0.32 s with single dots only (docs/benchmarks.md, session 22).  SAC's and MR.Q's steps,
# on batches of 256, ran the same with either setting.
DOTS_ONLY_LIBRARY_FUSION = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.cache
def dots_only_library_fusion() -> dict | None:
    """``jax.jit``'s ``compiler_options`` that keep XLA CPU's library fusions to single dots, or None
    where they do not apply: another backend, or a jaxlib that does not know the option (checked by
    compiling a one-op program once per process)."""
    import jax
    import numpy as np

    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=DOTS_ONLY_LIBRARY_FUSION).lower(np.zeros(1, np.float32)).compile()
    except Exception:  # an XLA without the option (it was added as experimental): keep the defaults
        return None
    return dict(DOTS_ONLY_LIBRARY_FUSION)
