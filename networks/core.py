"""Functional handle on an NNX network: split once, apply pure functions over params.

``build(name, make_module, key, ensemble=N)`` creates the module (or N vmapped members with
a leading axis on every parameter) and returns ``(net, params)``.  ``net`` is a small
hashable object (name + graph definition) that lives as static data beside the params;
``net(params, *inputs)`` concatenates the inputs and runs the forward pass.  Inside
``networks.instrument.record`` it also reports hidden activations and adds probes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from networks import instrument


@dataclass(frozen=True)
class Net:
    name: str
    graphdef: Any
    ensemble: int = 0  # 0: a single network; N: N members vmapped over a leading axis
    make: Callable | None = field(default=None, compare=False, hash=False, repr=False)

    def init(self, key):
        """Freshly initialised params (every member for an ensemble), e.g. to re-draw reset neurons."""
        if self.make is None:
            raise ValueError(f"network {self.name!r} was not built with networks.build; cannot re-initialise")
        if self.ensemble:
            return jax.vmap(lambda k: nnx.split(self.make(nnx.Rngs(k)), nnx.Param)[1])(
                jax.random.split(key, self.ensemble))
        return nnx.split(self.make(nnx.Rngs(key)), nnx.Param)[1]

    def module(self, params):
        """The NNX module (member 0 of an ensemble), to inspect its structure."""
        if self.ensemble:
            params = jax.tree.map(lambda x: x[0], params)
        return nnx.merge(self.graphdef, params)

    def apply(self, params, *inputs, probes=None, member_inputs: bool = False):
        """Forward pass -> (output, taps).  ``member_inputs``: inputs carry a leading member axis."""
        x = inputs[0] if len(inputs) == 1 else jnp.concatenate(inputs, axis=-1)
        if not self.ensemble:
            return nnx.merge(self.graphdef, params)(x, probes)
        one = lambda p, x, pr: nnx.merge(self.graphdef, p)(x, pr)  # noqa: E731
        axes = (0, 0 if member_inputs else None, None if probes is None else 0)
        return jax.vmap(one, in_axes=axes)(params, x, probes)

    def __call__(self, params, *inputs, member_inputs: bool = False):
        rec = instrument.active()
        if rec is not None and rec.wants(self.name):
            out, taps = self.apply(params, *inputs, probes=rec.probe_for(self.name), member_inputs=member_inputs)
            rec.store(self.name, taps)
            return out
        return self.apply(params, *inputs, member_inputs=member_inputs)[0]


def build(name: str, make_module: Callable[[nnx.Rngs], nnx.Module], key, ensemble: int = 0):
    """Create a network (or a vmapped ensemble of ``ensemble`` members) -> (Net, params)."""
    if ensemble:
        keys = jax.random.split(key, ensemble)
        states = jax.vmap(lambda k: nnx.split(make_module(nnx.Rngs(k)), nnx.Param)[1])(keys)
        graphdef = nnx.split(make_module(nnx.Rngs(0)), nnx.Param)[0]
        return Net(name, graphdef, ensemble, make_module), states
    graphdef, params = nnx.split(make_module(nnx.Rngs(key)), nnx.Param)
    return Net(name, graphdef, 0, make_module), params
