"""Hidden trunks: plain MLP, SimBa residual, multi-skip residual (all with optional LayerNorm).

Each trunk maps ``x -> h`` and reports every hidden layer's post-activation output under a
tap name.  Probes (zeros) can be added before and after each activation, so a loss's
gradient is readable both at the neuron's pre-activation (the Linear/LayerNorm output, where
GraMa scores neurons) and at its post-activation output.  A tap is a layer of *neurons*: the output units of
one Linear layer, whose
incoming weights are that layer's kernel columns and whose outgoing weights are the next
Linear layer's kernel rows.  ``neuron_layers()`` returns that map, which resets use.

Paired activations (``PAIRED_ACTIVATIONS``: ``crelu``, ``fourier``) give each Linear unit two output
features, concatenated: a unit's pre-activation z_i becomes [f(z_i), g(z_i)], and a layer of U units
hands 2U features on.  Width rule (halving the units, as Shang et al. 2016 do for CReLU models with
half the filters of their ReLU ones): an activated layer of width W has W/2 Linear units whose pair
outputs are its W features, so ``--network.width`` keeps its meaning (the features each layer hands
on, the trunk's output width) while each Linear feeding the activation has half the units (an odd W
is refused).  Plasticine's networks (W units, 2W features) are ``--network.width 2W`` here.
SimBa's expansion of 4W has 2W units; multi-skip's activation of the residual stream (width W, the
sum of block outputs, not a Linear layer's units) hands 2W features to its ``fc1``.

A *neuron* of a paired layer is its Linear unit.  Its tap holds the layer's output laid out as
``(..., 2, U)``: ``[..., 0, i]`` and ``[..., 1, i]`` are unit i's two features (f and g), and
``reshape(..., 2U)`` is the concatenated output the next layer reads.  The instrumentation's rows
(``networks.instrument.rows``) flatten every leading axis, so each unit's column holds both of its
features, and the per-neuron metrics count units: ReDo's score is E|h| over the batch and over the
unit's two features (normalised by the layer's mean, so at tau = 0 a unit is dormant exactly when
both halves are 0 on the whole batch; a Fourier unit never is, |sin| + |cos| >= 1), GraMa's gradient
is taken at the unit's pre-activation z_i (the ``pre`` probe, tap-shaped, enters z summed over the
pair axis, so both of its rows hold dL/dz_i), FAU counts output entries > 0, and per-layer ranks
count independent units (a unit's column spans its two features).  The W-wide representation the
head reads stays in ``features``.  A reset of unit i redraws its incoming column and zeroes both of
its outgoing rows, i and i + U (``neuron_layers()``: ``unit_outputs`` 2).
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


def _crelu_pair(z):
    return jnp.stack([jax.nn.relu(z), jax.nn.relu(-z)], axis=-2)


def _fourier_pair(z):
    return jnp.stack([jnp.sin(z), jnp.cos(z)], axis=-2)


PAIRED_ACTIVATIONS = {
    # Concatenated ReLU, CReLU(z) = [relu(z), relu(-z)] (Shang et al., ICML 2016, arXiv 1603.05201), the
    # mitigation of Abbas, Zhao, Modayil, White & Machado, CoLLAs 2023, arXiv 2303.07507 ("Loss of
    # plasticity in continual deep RL"); Plasticine's CReLU4Linear is the same map.
    "crelu": _crelu_pair,
    # Deep Fourier features (Lewandowski, Schuurmans & Machado, ICLR 2025, arXiv 2410.20634, section 4 and
    # abstract: "the concatenation of a sine and cosine in every layer"): [sin(z), cos(z)] of the same
    # pre-activation z, no frequency scale (Plasticine's DFF4Linear: cat(sin z, cos(-z)), the same map).
    "fourier": _fourier_pair,
}
"""Activations whose unit has two output features: name -> z (..., U) -> pair (..., 2, U); ``concat`` of
the pair is the layer's output (..., 2U).  See the module docstring for the width rule and the neuron."""


def concat(pair):
    """A paired activation's ``(..., 2, U)`` layout -> the concatenated output ``(..., 2U)`` = [f(z), g(z)]."""
    return pair.reshape(*pair.shape[:-2], 2 * pair.shape[-1])


def crelu(x):
    """CReLU: [relu(x), relu(-x)] along the last axis (twice the features of ``x``)."""
    return concat(_crelu_pair(x))


def fourier(x):
    """Deep Fourier features: [sin(x), cos(x)] along the last axis (twice the features of ``x``)."""
    return concat(_fourier_pair(x))


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
        if self.activation not in ACTIVATIONS and self.activation not in PAIRED_ACTIVATIONS:
            raise ValueError(
                f"unknown activation {self.activation!r}; choose from {sorted([*ACTIVATIONS, *PAIRED_ACTIVATIONS])}"
            )
        if self.width < 1 or self.depth < 1:
            raise ValueError(f"network width and depth must be positive, got {self.width}, {self.depth}")
        if self.paired and self.block != "simba" and self.width % 2:  # simba's 4 x width is always even
            raise ValueError(
                f"activation {self.activation!r} needs an even network width (a layer of width W has "
                f"W/2 Linear units whose {self.activation} pairs are its W features), got {self.width}"
            )

    @property
    def paired(self) -> bool:
        """Whether the activation gives each Linear unit two output features (``PAIRED_ACTIVATIONS``)."""
        return self.activation in PAIRED_ACTIVATIONS

    @property
    def unit_outputs(self) -> int:
        """Output features per Linear unit of an activated layer: 2 for a paired activation, else 1."""
        return 2 if self.paired else 1


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
        k = spec.unit_outputs  # a paired activation: an activated layer of width n has n / 2 Linear units
        ln = lambda n: nnx.LayerNorm(n, rngs=rngs) if spec.layer_norm else None  # noqa: E731
        if spec.block == "mlp":
            self.layers = nnx.List([_linear(in_dim if i == 0 else w, w // k, rngs, spec) for i in range(d)])
            self.norms = nnx.List([ln(w // k) for _ in range(d)]) if spec.layer_norm else None
        elif spec.block == "simba":
            # SimBa (Lee et al. 2025): orthogonal input projection, blocks x + W2 relu(W1 LN(x)), final LN.
            self.proj = _linear(in_dim, w, rngs, spec, orthogonal())
            he = nnx.initializers.he_normal()
            self.pre_norms = nnx.List([nnx.LayerNorm(w, rngs=rngs) for _ in range(d)])
            self.up = nnx.List([_linear(w, 4 * w // k, rngs, spec, he) for _ in range(d)])
            self.down = nnx.List([_linear(4 * w, w, rngs, spec, he) for _ in range(d)])
            self.out_norm = nnx.LayerNorm(w, rngs=rngs)
        else:
            # Multi-skip residual (Castanyer et al. 2025): g = LN(W x); h <- h + F(h) + g,
            # F = act -> Linear -> LN -> act -> Linear -> LN.  A paired act(h) hands 2w features to fc1.
            self.proj = _linear(in_dim, w, rngs, spec)
            self.proj_norm = nnx.LayerNorm(w, rngs=rngs)
            self.fc1 = nnx.List([_linear(k * w, w // k, rngs, spec) for _ in range(d)])
            self.ln1 = nnx.List([nnx.LayerNorm(w // k, rngs=rngs) for _ in range(d)])
            self.fc2 = nnx.List([_linear(w, w, rngs, spec) for _ in range(d)])
            self.ln2 = nnx.List([nnx.LayerNorm(w, rngs=rngs) for _ in range(d)])

    @property
    def out_dim(self) -> int:
        return self.spec.width

    def tap_names(self) -> list[str]:
        return [f"layer{i}" for i in range(self.spec.depth)]

    def neuron_layers(self) -> dict[str, dict[str, tuple]]:
        """Tap name -> param paths of its incoming Linear, LayerNorm (or None) and outgoing Linear,
        and ``unit_outputs``: the features each unit hands on (2 for a paired activation: unit i of U
        feeds rows i and i + U of the outgoing kernel; else 1).

        The outgoing Linear of the last tap is ``None`` here: it belongs to the head.
        """
        b, d, k = self.spec.block, self.spec.depth, self.spec.unit_outputs
        out = {}
        for i in range(d):
            if b == "mlp":
                nxt = ("layers", i + 1) if i + 1 < d else None
                norm = ("norms", i) if self.spec.layer_norm else None
                out[f"layer{i}"] = {"incoming": ("layers", i), "norm": norm, "outgoing": nxt, "unit_outputs": k}
            elif b == "simba":
                out[f"layer{i}"] = {"incoming": ("up", i), "norm": None, "outgoing": ("down", i), "unit_outputs": k}
            else:
                out[f"layer{i}"] = {
                    "incoming": ("fc1", i),
                    "norm": ("ln1", i),
                    "outgoing": ("fc2", i),
                    "unit_outputs": k,
                }
        return out

    def __call__(self, x, probes=None):
        pair = PAIRED_ACTIVATIONS.get(self.spec.activation)
        unit_act = ACTIVATIONS[self.spec.activation] if pair is None else pair
        act = unit_act if pair is None else (lambda v: concat(pair(v)))  # noqa: E731  off the taps (multiskip)
        taps = {}

        def tap(name, z):
            """Neuron layer ``name``: z (Linear/LN output) -> act(z).  Probes sit on both sides.

            A paired activation's tap (and probes) are ``(..., 2, U)``; the ``pre`` probe enters z summed
            over the pair axis (each half's probe gradient is dL/dz); the layer returns ``concat``."""
            if probes is not None:
                pre = probes[name]["pre"]
                z = z + (pre if pair is None else jnp.sum(pre, axis=-2))
            h = unit_act(z)
            if probes is not None:
                h = h + probes[name]["post"]
            taps[name] = h
            return h if pair is None else concat(h)

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
