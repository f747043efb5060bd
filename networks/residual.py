"""Frozen + residual heads: a network with a second and third copy of its head beside it.

``ResidualHeadNet`` wraps a ``Net`` whose module has a root output layer ``out`` (every head in
``networks.heads`` and the agents' own modules do).  Its params are the network's own tree plus, under
``RESIDUAL``, two trees shaped like the head's part of it (``head``: the param-path prefixes of the
head's layers, e.g. ``("trunk", "layers", 1)`` and ``("out",)``): ``fresh`` and ``frozen``.  The
forward pass is

    y = out_theta(z) + (out_fresh(z) - out_frozen(z))

at the output of ``out``, where each term runs the network's layers with the head's params taken from
the network's own tree, ``fresh`` or ``frozen`` (the layers before the head, the encoder, are the same
params in all three, so ``z`` is the same), and the module's own output transform (tanh, the split into
mean and log-std, their clip) applies to the sum.  That is the function of plasticity injection
(Nikishin et al. 2023, "Deep RL with plasticity injection", NeurIPS, arXiv 2305.15555, sec. 3,
Expression (1)); which params train is the optimizer's business (``plasticity.injection``).

Two exact properties the mechanism relies on:

- while ``fresh`` and ``frozen`` are zero, a zero output layer gives exactly 0 for any finite input, so
  both extra terms are 0 and their gradients into the encoder are 0: the network computes what the
  wrapped one computes, bit for bit, and so does its gradient with respect to the wrapped params;
- while ``fresh`` equals ``frozen``, ``out_fresh(z) - out_frozen(z)`` is exactly 0 (the same operations
  on the same numbers), so the output is unchanged.

Gradients follow what trains, read from the params themselves: ``frozen`` never gets one; while ``fresh``
is zero (before an injection) it gets none and the head's own params do, once it is not, the other way
round.  So the pair is inert before an injection (an agent's global-norm clip sees the gradients it saw
without it) and, after it, gradient norms count only what trains.  The values are untouched.

The two extra terms are computed only while the pair is not zero (a ``lax.cond`` on the pair itself,
decided over all of an ensemble's members at once, inside a custom VJP whose only residuals are its inputs:
``ResidualHeadNet._residual``), so before an injection a one-seed update does little beyond what it does
without the pair; under vmap over seeds JAX turns the branch into a select and both sides run.

Hidden-layer taps (metrics, ReDo / ReGraMa scores) are those of the network's own pass; the copies are
neither recorded nor probed.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from plasticity_zoo.networks.core import Net, path_names

RESIDUAL = "residual"  # the params key of the residual pair: {"fresh": head tree, "frozen": head tree}


def has_residual(params) -> bool:
    """Whether ``params`` carry a residual pair (``ResidualHeadNet`` params)."""
    return isinstance(params, nnx.State) and RESIDUAL in params.raw_mapping


def _raw(tree):
    """A tree's nested mappings as plain dicts (the layout ``nnx.split`` gives below the root ``State``)."""
    if isinstance(tree, nnx.State):
        tree = tree.raw_mapping
    if isinstance(tree, dict):
        return {k: _raw(v) for k, v in tree.items()}
    return tree


def _state(tree) -> nnx.State:
    """``tree`` as a root ``State`` over plain dicts: one pytree structure per layout, whatever built it."""
    return nnx.State(_raw(tree))


def split(params):
    """(the network's own params, the residual pair {"fresh", "frozen"}); the pair is None without one."""
    if not has_residual(params):
        return params, None
    raw = params.raw_mapping
    return nnx.State({k: v for k, v in raw.items() if k != RESIDUAL}), raw[RESIDUAL]


def join(base, pair):
    """The inverse of ``split``."""
    if pair is None:
        return base
    return nnx.State({**_raw(base), RESIDUAL: {"fresh": _state(pair["fresh"]), "frozen": _state(pair["frozen"])}})


def head_part(params, head: tuple):
    """The sub-tree of ``params`` under the prefixes in ``head`` (param-path prefixes), as an ``nnx.State``."""
    raw = _raw(params)
    out: dict = {}
    for prefix in head:
        node = raw
        for k in prefix:
            node = node[k]
        d = out
        for k in prefix[:-1]:
            d = d.setdefault(k, {})
        d[prefix[-1]] = node
    return nnx.State(out)


def override(params, part):
    """``params`` with every leaf that ``part`` holds (same path) taken from ``part``."""
    leaves = {path_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(part)[0]}
    return jax.tree_util.tree_map_with_path(lambda p, x: leaves.get(path_names(p), x), params)


def head_paths(pair) -> set:
    """The param paths (``path_names``) the residual copies cover, i.e. the head's leaves."""
    return {path_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(pair["fresh"])[0]}


def _any_nonzero(tree) -> jax.Array:
    """Whether any entry of any leaf of ``tree`` is not zero (a bool scalar)."""
    return jnp.any(jnp.stack([jnp.any(v != 0) for v in jax.tree.leaves(tree)]))


def _without(params, head: tuple) -> nnx.State:
    """``params`` without the leaves under the prefixes in ``head``: the encoder's part (``head_part``'s complement)."""
    raw = _raw(params)
    for prefix in head:
        node = raw
        for k in prefix[:-1]:
            node = node[k]
        del node[prefix[-1]]
    return nnx.State(raw)


def _merged(a, b) -> nnx.State:
    """Two disjoint parts of one tree (``_without`` and ``head_part``) as the whole tree."""

    def merge(x, y):
        if not isinstance(x, dict):
            return x
        return {k: merge(x[k], y[k]) if k in x and k in y else (x[k] if k in x else y[k]) for k in {**x, **y}}

    return nnx.State(merge(_raw(a), _raw(b)))


@jax.custom_vjp
def _gated(v, on):
    """``v`` itself, with its gradient multiplied by ``on`` (0 or 1).  A custom VJP: the forward pass does
    no arithmetic (``stop_gradient(v) + on (v - stop_gradient(v))``, the same value and gradient, passed
    over every weight of the head in each forward pass)."""
    return v


def _gated_fwd(v, on):
    return v, on


def _gated_bwd(on, g):
    return g * on.astype(g.dtype), jnp.zeros_like(on)


_gated.defvjp(_gated_fwd, _gated_bwd)


@dataclass(frozen=True)
class ResidualHeadNet(Net):
    """A ``Net`` whose head (the layers under ``head``) has a residual pair beside it (module docstring)."""

    head: tuple = ()

    @classmethod
    def wrap(cls, net: Net, params, head: tuple):
        """(ResidualHeadNet, params with a zero residual pair) for a built network and its params."""
        if not hasattr(net.module(params), "out"):
            raise ValueError(f"network {net.name!r} has no root output layer 'out' for a residual head")
        wrapped = cls(net.name, net.graphdef, net.ensemble, net.make, net.initializer, tuple(head))
        return wrapped, wrapped.with_zero_pair(params)

    def with_zero_pair(self, params):
        """The network's own ``params`` with a zero residual pair added."""
        zeros = jax.tree.map(jnp.zeros_like, head_part(params, self.head))
        return join(params, {"fresh": zeros, "frozen": jax.tree.map(jnp.copy, zeros)})

    def init(self, key):
        """A fresh draw of the network's own params (``Net.init``) with a zero residual pair."""
        return self.with_zero_pair(super().init(key))

    def module(self, params):
        return super().module(split(params)[0])

    def apply(self, params, *inputs, probes=None, member_inputs: bool = False):
        # whether any member's theta' is not zero (the injection has happened), decided once outside the
        # members' vmap, so that it stays a branch in an ensemble (a zero pair's terms are exactly 0, so
        # computing them for all is exact).  theta'_frozen equals theta' at the injection and never moves,
        # and a fresh draw is never all zero, so theta' alone decides
        live = _any_nonzero(split(params)[1]["fresh"])
        forward = lambda p, x, pr: self._forward(p, x, pr, live)  # noqa: E731
        return self._map(forward, params, inputs, probes, member_inputs)

    def _forward(self, params, x, probes, live=None):
        base, pair = split(params)
        live = _any_nonzero(pair["fresh"]) if live is None else live
        # the injection has happened iff theta' is not zero (a fresh draw never is); gradients reach theta'
        # only then (the backward branch of ``_residual``), theta's head only before (``_gated``),
        # theta'_frozen never; values pass through unchanged
        on = live.astype(jnp.float32)
        base = override(base, jax.tree.map(lambda v: _gated(v, 1.0 - on), head_part(base, self.head)))
        delta = self._residual(on, _without(base, self.head), pair["fresh"], pair["frozen"], x)
        return self._with_out(base, lambda y: y + delta)(x, probes)

    def _residual(self, on, encoder, fresh, frozen, x):
        """``out_fresh(z) - out_frozen(z)`` while ``on`` (theta' live), else exact zeros, with ``encoder`` the
        network's params below the head.

        While the pair is zero its two terms are exactly 0 (module docstring), so they are skipped: a
        ``lax.cond``, and a custom VJP whose only residuals are its inputs.  Plain ``lax.cond`` under
        ``grad`` would save each term's activations and make the skipping branch fill zeros of their
        shapes on every pass; here the skipping side of the forward and of the backward pass computes
        nothing but the zeros of the cotangents (the encoder's, theta''s and the input's), and after the
        injection the backward pass recomputes the two terms' forward pass.  Unmapped (one seed) these
        are branches, so an update before the injection costs about what it costs without the pair;
        under vmap over seeds JAX evaluates both sides and selects.  theta'_frozen gets no gradient.
        """

        def terms(encoder, fresh, frozen, x):
            return self._out(_merged(encoder, fresh), x) - self._out(_merged(encoder, frozen), x)

        def skipped(encoder, fresh, frozen, x):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(terms, encoder, fresh, frozen, x))

        @jax.custom_vjp
        def delta(on, encoder, fresh, frozen, x):
            return jax.lax.cond(on > 0, terms, skipped, encoder, fresh, frozen, x)

        def delta_fwd(on, encoder, fresh, frozen, x):
            return delta(on, encoder, fresh, frozen, x), (on, encoder, fresh, frozen, x)

        def delta_bwd(res, ct):
            on, encoder, fresh, frozen, x = res

            def grads(ct, encoder, fresh, x):
                return jax.vjp(lambda e, f, xx: terms(e, f, frozen, xx), encoder, fresh, x)[1](ct)

            def none(ct, encoder, fresh, x):
                return jax.tree.map(jnp.zeros_like, (encoder, fresh, x))

            d_encoder, d_fresh, d_x = jax.lax.cond(on > 0, grads, none, ct, encoder, fresh, x)
            return jnp.zeros_like(on), d_encoder, d_fresh, jax.tree.map(jnp.zeros_like, frozen), d_x

        delta.defvjp(delta_fwd, delta_bwd)
        return delta(on, encoder, fresh, frozen, x)

    def _with_out(self, params, fn):
        """The merged module with its output layer's result passed through ``fn``."""
        module = nnx.merge(self.graphdef, params)
        layer = module.out
        module.out = lambda h: fn(layer(h))
        return module

    def _out(self, params, x):
        """The output layer's result (before the module's output transform) under ``params``."""
        seen = {}

        def keep(y):
            seen["y"] = y
            return y

        self._with_out(params, keep)(x, None)
        return seen["y"]
