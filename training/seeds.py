"""Seeds as a batch axis: ``over_seeds`` maps a one-seed function over the leading axis.

With one seed (train.py's default) the function runs on the squeezed arrays instead of through
``jax.vmap`` over an axis of size 1.  XLA on CPU does not drop such an axis everywhere: a vmapped
MR.Q update at 1 seed took 101 ms against 81 ms unmapped (HalfCheetah sizes, medians of 4 rounds;
the dots and gathers keep a batch dimension), and the loops pay it every env step.  The random
numbers are the same (a key's bits do not depend on vmap); float results can differ in the last
bits, as between any two compiled programs.
"""

from __future__ import annotations

import jax

from plasticity_zoo.networks.runtime import cached_per_config


def over_seeds(fn, in_axes=0):
    """``jax.vmap(fn, in_axes)``, or, when every mapped argument's seed axis has size 1, ``fn`` on
    the arguments without that axis and the outputs with it put back.  The choice is made while
    tracing (shapes are static), so a jitted caller compiles one program per seed count."""

    def mapped(*args):
        axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        leaves = [x for a, ax in zip(args, axes) if ax is not None for x in jax.tree.leaves(a)]
        if not leaves or any(x.shape[0] != 1 for x in leaves):
            return jax.vmap(fn, in_axes=in_axes)(*args)
        squeezed = [a if ax is None else jax.tree.map(lambda x: x[0], a) for a, ax in zip(args, axes)]
        return jax.tree.map(lambda x: x[None], fn(*squeezed))

    return mapped


def add_over_seeds(add):
    """A replay's ``add(buffer, transitions)`` vmapped over seeds, at every seed count (never squeezed).

    Squeezed to one seed, XLA on CPU no longer wrote MR.Q's LAP buffer in place: it copied the
    written arrays (slot steps, priorities, truncation flags, validity) several times per call,
    7.5-9 ms per env step at 1M rows against 0.18-0.25 ms vmapped (the add alone, jitted and
    donated; ``lap.add`` reads the slots it has just written).  A write moves data and does no
    arithmetic, so the mapped and squeezed programs store the same bits."""
    return jax.vmap(add)


def init_over_seeds(agent, keys, obs_dim: int, act_dim: int, agent_cfg, net_cfg, static):
    """``jax.vmap(agent.init)`` over ``keys`` (one per seed) as one jitted program.

    Run op by op, an init compiled every random draw and elementwise op as its own small program
    (SAC: about 60, 7 s of a short run's start on a 2-core CPU); jitted it is one program, compiled
    once per configuration in a process (cached here) and kept in JAX's persistent compilation
    cache where one is set.  The values are bit-identical to the op-by-op ones (the random bits do
    not depend on jit; checked for SAC, MR.Q and PPO)."""
    return _jitted_init(agent, obs_dim, act_dim, agent_cfg, net_cfg, static)(keys)


@cached_per_config
def _jitted_init(agent, obs_dim, act_dim, agent_cfg, net_cfg, static):
    return jax.jit(jax.vmap(lambda k: agent.init(k, obs_dim, act_dim, agent_cfg, net_cfg, static)))
