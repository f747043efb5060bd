"""Reading hidden activations and their gradients from any network, without agent code.

Every instrumented network (``networks.core.Net``) reports the post-activation output of
each hidden layer ("taps") and accepts an additive zero "probe" per tap: the gradient of a
loss with respect to a probe equals the gradient with respect to that activation.

The agent's loss functions are written as usual.  Plasticity code wraps a call to them in
``record(...)``; every call of a named network inside the wrapped code is recorded in call
order.  Only the first call is probed, which is the online forward pass in every agent's
loss (target networks are called after it and under ``stop_gradient``).

Taps come back as rows of units: ``(rows, units)`` for a single network and ``(members, rows,
units)`` for an ensemble (``Net.ensemble``), every other leading axis (a batch of sequences, a time
axis: e.g. a recurrent core over (batch, T, in)) flattened into the rows, so metrics read one
layout whatever the network's input shape.

The context lives in Python and is read at trace time, so it works under ``jit``, ``grad``
and ``vmap`` as long as the ``record`` block is opened inside the same transformation as the
network calls (calling a network inside an inner ``vmap``/``scan`` of the loss would leak
tracers and raises JAX's UnexpectedTracerError, never a silent wrong value).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax
import jax.numpy as jnp

_ACTIVE: contextvars.ContextVar["Recorder | None"] = contextvars.ContextVar("taps", default=None)


class Recorder:
    """Collects activations of the named networks; adds probes to their first call."""

    def __init__(self, names, probes=None):
        self.names = set(names)
        self.probes = probes or {}
        self.activations: dict[str, dict[str, jax.Array]] = {}
        self.features: dict[str, jax.Array] = {}
        self.members: dict[str, bool] = {}  # whether a network's taps lead with an ensemble axis

    def wants(self, name: str) -> bool:
        return name in self.names and name not in self.activations

    def probe_for(self, name: str):
        return self.probes.get(name)

    def store(self, name: str, taps, members: bool = False):
        """Hidden-layer activations go to ``activations``; the head's input to ``features``, as the
        network computed them (``members``: they lead with an ensemble axis)."""
        taps = dict(taps)
        if "features" in taps:
            self.features[name] = taps.pop("features")
        self.activations[name] = taps
        self.members[name] = members


def rows(x, members: bool):
    """A tap as ``(rows, units)``, or ``(members, rows, units)`` where ``members``: every axis
    between the member axis and the units flattened into rows."""
    if members:
        return x.reshape(x.shape[0], -1, x.shape[-1])
    return x.reshape(-1, x.shape[-1])


def _as_rows(members: dict, tree: dict):
    """{name: {tap: x}} (or {name: x}) with every array in ``rows`` layout (``members``: ``Recorder.members``)."""
    return {name: jax.tree.map(lambda x: rows(x, members[name]), taps) for name, taps in tree.items()}


@contextlib.contextmanager
def record(names, probes=None):
    """Record the hidden activations of the networks named in ``names`` (first call each)."""
    rec = Recorder(names, probes)
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


def active() -> Recorder | None:
    return _ACTIVE.get()


def activations(fn: Callable[[], Any], names) -> dict[str, dict[str, jax.Array]]:
    """Hidden activations of the named networks during ``fn()`` (call inside jit), as ``rows``."""
    rec, acts = _recorded(fn, names)
    return _as_rows(rec.members, acts)


def _recorded(fn, names):
    """(recorder, its raw activations) of ``fn()``."""
    with record(names) as rec:
        fn()
    missing = set(names) - set(rec.activations)
    if missing:
        raise ValueError(f"networks {sorted(missing)} were not called by the function")
    return rec, rec.activations


def features(fn: Callable[[], Any], names) -> dict[str, jax.Array]:
    """The representation each named network's head reads (trunk output), during ``fn()``, as ``rows``."""
    with record(names) as rec:
        fn()
    missing = set(names) - set(rec.features)
    if missing:
        raise ValueError(f"networks {sorted(missing)} were not called by the function (or have no features)")
    return _as_rows(rec.members, rec.features)


def activation_grads(loss_fn: Callable[[], jax.Array], names, at: str = "post"):
    """(activations, d loss / d activation) for each hidden layer of the named networks.

    ``at="post"``: gradient w.r.t. the post-activation output h = act(z) (what ReDo's
    activations are); ``at="pre"``: w.r.t. the pre-activation z, the output of the neuron's
    Linear (or LayerNorm) layer, which is where GraMa scores neurons (a dead ReLU unit has
    dL/dz = 0 but generally dL/dh != 0).  ``at="both"`` returns ``{"pre": ..., "post": ...}``
    per layer.  ``loss_fn()`` returns a scalar; any agent loss built from ``Net`` calls works.
    """
    if at not in ("pre", "post", "both"):
        raise ValueError(f"at must be 'pre', 'post' or 'both', got {at!r}")
    shapes = jax.eval_shape(lambda: _recorded(loss_fn, names)[1])  # the probes take the taps' own shapes
    zeros = jax.tree.map(lambda s: {"pre": jnp.zeros(s.shape, s.dtype), "post": jnp.zeros(s.shape, s.dtype)}, shapes)
    members = {}

    def probed(probes):
        with record(names, probes) as rec:
            loss = loss_fn()
        members.update(rec.members)
        return loss, rec.activations

    grads, acts = jax.grad(probed, has_aux=True)(zeros)
    if at != "both":
        # a leaf is one tap's {"pre": array, "post": array} (a network may name a tap "pre" itself)
        grads = jax.tree.map(
            lambda g: g[at],
            grads,
            is_leaf=lambda x: isinstance(x, dict) and set(x) == {"pre", "post"} and not isinstance(x["pre"], dict),
        )
    return _as_rows(members, acts), _as_rows(members, grads)
