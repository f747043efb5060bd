"""Functional handle on an NNX network: split once, apply pure functions over params.

``build(name, make_module, key, ensemble=N)`` creates the module (or N vmapped members with
a leading axis on every parameter) and returns ``(net, params)``.  ``net`` is a small
hashable object (name + graph definition) that lives as static data beside the params;
``net(params, *inputs)`` concatenates the inputs and runs the forward pass.  Inside
``networks.instrument.record`` it also reports hidden activations and adds probes.

A network's initial params come from its module's own initialisers, or, where ``build`` is
given an ``initializer`` (e.g. MR.Q's Xavier-uniform x sqrt(2)), from that function applied to
the freshly made params.  The initializer is declared with the network, so every later draw
(``Net.init``: ReDo / ReGraMa resets) uses the same initialisation as the network's first one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from plasticity_zoo.networks import instrument


@dataclass(frozen=True)
class Net:
    name: str
    graphdef: Any
    ensemble: int = 0  # 0: a single network; N: N members vmapped over a leading axis
    make: Callable | None = field(default=None, compare=False, hash=False, repr=False)
    # (params, key) -> params: the network's own initial params from freshly made ones (one member);
    # None: the module's initialisers as they are
    initializer: Callable | None = field(default=None, compare=False, hash=False, repr=False)

    def init(self, key):
        """Freshly initialised params (every member for an ensemble), e.g. to re-draw reset neurons.

        Made by ``make`` and mapped by ``initializer`` (where declared), member by member with
        keys split from ``key``, as ``build`` does.
        """
        if self.make is None:
            raise ValueError(f"network {self.name!r} was not built with networks.build; cannot re-initialise")
        if self.ensemble:
            return jax.vmap(self._member)(jax.random.split(key, self.ensemble))
        return self._member(key)

    def _member(self, key):
        params = nnx.split(self.make(nnx.Rngs(key)), nnx.Param)[1]
        return params if self.initializer is None else self.initializer(params, key)

    def module(self, params):
        """The NNX module (member 0 of an ensemble), to inspect its structure."""
        if self.ensemble:
            params = jax.tree.map(lambda x: x[0], params)
        return nnx.merge(self.graphdef, params)

    def apply(self, params, *inputs, probes=None, member_inputs: bool = False):
        """Forward pass -> (output, taps).  ``member_inputs``: inputs carry a leading member axis."""
        return self._map(self._forward, params, inputs, probes, member_inputs)

    def _map(self, forward, params, inputs, probes, member_inputs: bool):
        """``forward(params, x, probes)`` on the concatenated inputs, vmapped over an ensemble's members."""
        x = inputs[0] if len(inputs) == 1 else jnp.concatenate(inputs, axis=-1)
        if not self.ensemble:
            return forward(params, x, probes)
        axes = (0, 0 if member_inputs else None, None if probes is None else 0)
        return jax.vmap(forward, in_axes=axes)(params, x, probes)

    def _forward(self, params, x, probes):
        """One member's forward pass -> (output, taps)."""
        return nnx.merge(self.graphdef, params)(x, probes)

    def __call__(self, params, *inputs, member_inputs: bool = False):
        rec = instrument.active()
        if rec is not None and rec.wants(self.name):
            out, taps = self.apply(params, *inputs, probes=rec.probe_for(self.name), member_inputs=member_inputs)
            rec.store(self.name, taps, members=self.ensemble > 0)
            return out
        return self.apply(params, *inputs, member_inputs=member_inputs)[0]


def build(
    name: str,
    make_module: Callable[[nnx.Rngs], nnx.Module],
    key,
    ensemble: int = 0,
    initializer: Callable | None = None,
):
    """Create a network (or a vmapped ensemble of ``ensemble`` members) -> (Net, params).

    ``initializer(params, key) -> params`` (optional): the network's own initialisation, applied to
    each member's freshly made params; the Net keeps it, so ``Net.init`` draws the same way.
    """
    if ensemble:
        graphdef = nnx.split(make_module(nnx.Rngs(0)), nnx.Param)[0]
        net = Net(name, graphdef, ensemble, make_module, initializer)
        return net, net.init(key)
    graphdef, params = nnx.split(make_module(nnx.Rngs(key)), nnx.Param)
    net = Net(name, graphdef, 0, make_module, initializer)
    return net, params if initializer is None else initializer(params, key)


def path_names(path) -> tuple:
    """A param's place in its tree as plain names: dict keys and indices, attribute steps (an NNX
    Variable's trailing ``.value``) dropped, e.g. ``("trunk", "layers", 0, "kernel")``."""
    return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path if not hasattr(k, "name"))


def uniform_fan_in(key, shape, fan_in, dtype=jnp.float32, scale: float = 1.0):
    """U(+-sqrt(scale / fan_in)): at scale 1 PyTorch's and Equinox's default for Linear weights and biases."""
    bound = math.sqrt(scale) / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def fan_in_uniform_init(params, key):
    """Every Linear layer's kernel and bias drawn from U(+-1/sqrt(fan_in)); other params kept.

    The default Linear initialisation of PyTorch and Equinox (``nn.Linear`` in both), for agents
    whose reference code relies on it.  A Linear layer is a node holding both a ``kernel`` and a
    ``bias`` (a LayerNorm's bias, beside a ``scale``, is left alone); fan_in is the kernel's
    second-to-last axis, so a tree with a leading member axis gets the same per-member law.
    Usable as ``build(..., initializer=fan_in_uniform_init)``.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [path_names(path) for path, _ in leaves]
    fan_in = {name[:-1]: x.shape[-2] for name, (_, x) in zip(names, leaves) if name[-1] == "kernel"}
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, name, (_, x) in zip(keys, names, leaves):
        if name[-1] in ("kernel", "bias") and name[:-1] in fan_in:
            x = uniform_fan_in(k, x.shape, fan_in[name[:-1]], x.dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)
