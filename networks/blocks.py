"""Hidden trunks: plain MLP, SimBa residual, multi-skip residual (all with optional LayerNorm).

Each trunk maps ``x -> h`` and reports every hidden layer's post-activation output under a
tap name.  Probes (zeros) can be added before and after each activation, so a loss's
gradient is readable both at the neuron's pre-activation (the Linear/LayerNorm output, where
GraMa scores neurons) and at its post-activation output.  A tap is a layer of *neurons*: the output units of one Linear layer, whose
incoming weights are that layer's kernel columns and whose outgoing weights are the next
Linear layer's kernel rows.  ``neuron_layers()`` returns that map, which resets use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from plasticity_zoo.networks.runtime import one_call_per_matrix

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "elu": jax.nn.elu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
    "leaky_relu": jax.nn.leaky_relu,  # negative slope 0.01 (NeuBay's world-model blocks)
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
}
Block = Literal["mlp", "simba", "multiskip"]


@dataclass(frozen=True)
class TrunkSpec:
    """Shape of a hidden trunk.  ``depth`` counts Linear layers (mlp) or residual blocks."""

    width: int = 256
    depth: int = 2
    block: Block = "mlp"
    activation: str = "relu"
    layer_norm: bool = False
    hidden_bias_init: float = 0.0  # EDAC initialises hidden biases to 0.1

    def __post_init__(self):
        if self.block not in ("mlp", "simba", "multiskip"):
            raise ValueError(f"unknown network block {self.block!r}; choose mlp, simba or multiskip")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; choose from {sorted(ACTIVATIONS)}")
        if self.width < 1 or self.depth < 1:
            raise ValueError(f"network width and depth must be positive, got {self.width}, {self.depth}")


def orthogonal(scale: float = 1.0):
    """flax's orthogonal initializer (Saxe et al. 2014, the QR of a Gaussian matrix), its QR run one
    matrix per call under any ``vmap`` (``networks/runtime.py: one_call_per_matrix``: jaxlib's
    batched CPU LAPACK kernels can deadlock); the values are flax's."""
    base = nnx.initializers.orthogonal(scale)

    def init(key, shape, dtype=jnp.float32):
        return one_call_per_matrix(lambda k: base(k, shape, dtype))(key)

    return init


def _linear(i, o, rngs, spec: TrunkSpec, kernel_init=None):
    kw = {} if kernel_init is None else {"kernel_init": kernel_init}
    return nnx.Linear(i, o, rngs=rngs, bias_init=nnx.initializers.constant(spec.hidden_bias_init), **kw)


class Trunk(nnx.Module):
    """Hidden layers selected by ``spec.block``; ``__call__(x, probes) -> (h, taps)``."""

    def __init__(self, in_dim: int, spec: TrunkSpec, *, rngs: nnx.Rngs):
        self.spec = spec
        w, d = spec.width, spec.depth
        ln = lambda n: nnx.LayerNorm(n, rngs=rngs) if spec.layer_norm else None  # noqa: E731
        if spec.block == "mlp":
            self.layers = nnx.List([_linear(in_dim if i == 0 else w, w, rngs, spec) for i in range(d)])
            self.norms = nnx.List([ln(w) for _ in range(d)]) if spec.layer_norm else None
        elif spec.block == "simba":
            # SimBa (Lee et al. 2025): orthogonal input projection, blocks x + W2 relu(W1 LN(x)), final LN.
            self.proj = _linear(in_dim, w, rngs, spec, orthogonal())
            he = nnx.initializers.he_normal()
            self.pre_norms = nnx.List([nnx.LayerNorm(w, rngs=rngs) for _ in range(d)])
            self.up = nnx.List([_linear(w, 4 * w, rngs, spec, he) for _ in range(d)])
            self.down = nnx.List([_linear(4 * w, w, rngs, spec, he) for _ in range(d)])
            self.out_norm = nnx.LayerNorm(w, rngs=rngs)
        else:
            # Multi-skip residual (Castanyer et al. 2025): g = LN(W x); h <- h + F(h) + g,
            # F = act -> Linear -> LN -> act -> Linear -> LN.
            self.proj = _linear(in_dim, w, rngs, spec)
            self.proj_norm = nnx.LayerNorm(w, rngs=rngs)
            self.fc1 = nnx.List([_linear(w, w, rngs, spec) for _ in range(d)])
            self.ln1 = nnx.List([nnx.LayerNorm(w, rngs=rngs) for _ in range(d)])
            self.fc2 = nnx.List([_linear(w, w, rngs, spec) for _ in range(d)])
            self.ln2 = nnx.List([nnx.LayerNorm(w, rngs=rngs) for _ in range(d)])

    @property
    def out_dim(self) -> int:
        return self.spec.width

    def tap_names(self) -> list[str]:
        return [f"layer{i}" for i in range(self.spec.depth)]

    def neuron_layers(self) -> dict[str, dict[str, tuple]]:
        """Tap name -> param paths of its incoming Linear, LayerNorm (or None) and outgoing Linear.

        The outgoing Linear of the last tap is ``None`` here: it belongs to the head.
        """
        b, d = self.spec.block, self.spec.depth
        out = {}
        for i in range(d):
            if b == "mlp":
                nxt = ("layers", i + 1) if i + 1 < d else None
                norm = ("norms", i) if self.spec.layer_norm else None
                out[f"layer{i}"] = {"incoming": ("layers", i), "norm": norm, "outgoing": nxt}
            elif b == "simba":
                out[f"layer{i}"] = {"incoming": ("up", i), "norm": None, "outgoing": ("down", i)}
            else:
                out[f"layer{i}"] = {"incoming": ("fc1", i), "norm": ("ln1", i), "outgoing": ("fc2", i)}
        return out

    def __call__(self, x, probes=None):
        act = ACTIVATIONS[self.spec.activation]
        taps = {}

        def tap(name, z):
            """Neuron layer ``name``: z (Linear/LN output) -> act(z).  Probes sit on both sides."""
            if probes is not None:
                z = z + probes[name]["pre"]
            h = act(z)
            if probes is not None:
                h = h + probes[name]["post"]
            taps[name] = h
            return h

        if self.spec.block == "mlp":
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if self.norms is not None:
                    x = self.norms[i](x)
                x = tap(f"layer{i}", x)
            return x, taps
        if self.spec.block == "simba":
            x = self.proj(x)
            for i in range(self.spec.depth):
                h = tap(f"layer{i}", self.up[i](self.pre_norms[i](x)))
                x = x + self.down[i](h)
            return self.out_norm(x), taps
        g = self.proj_norm(self.proj(x))
        h = g
        for i in range(self.spec.depth):
            z = tap(f"layer{i}", self.ln1[i](self.fc1[i](act(h))))
            h = h + self.ln2[i](self.fc2[i](z)) + g
        return h, taps
