"""A recurrent core any agent can use: stacked linear recurrent units (LRU) behind a pre-block.

The LRU (Orvieto et al., "Resurrecting Recurrent Neural Networks for Long Sequences", ICML 2023,
sections 3.1-3.3) is a diagonal complex linear recurrence with a nonlinear read-out:

    h_t = lambda * h_{t-1} + gamma * (B x_t),        y_t = Re(C h_t) + D * x_t        (eq. 3)

with lambda = exp(-exp(nu) + i exp(theta)) (section 3.3, "stable exponential parameterisation":
|lambda| = exp(-exp(nu)) < 1 for every real nu, so the recurrence cannot blow up), |lambda| drawn
uniformly on the ring [r_min, r_max] at initialisation, the phase uniformly in [0, max_phase], and
gamma = sqrt(1 - |lambda|^2) (a trainable "normalisation", section 3.3) so a unit-variance input
gives a unit-variance state.  B and C are complex, N(0, 1/(2 d_model)) and N(0, 1/d_hidden) per
part (Glorot-style, section 3.2); D is real, N(0, 1).

Because the recurrence is linear, a whole sequence runs as a parallel (associative) scan over time
(section 3.1); acting runs the same function on sequences of length one, carrying the state.  An
episode start (``start[t]``) drops the carried state: h_t = gamma B x_t.

Each layer is the paper's block (Fig. 1): pre-LayerNorm -> LRU -> GELU -> GLU (W1 g * sigmoid(W2 g))
-> residual.  NeuBay (Ni et al., arXiv 2512.04341, section 4 and its appendix's architecture table)
puts a pre-block (Linear -> LayerNorm -> leaky-ReLU to d_model) before two such layers, d_model 256,
d_hidden 128, r_min 0, r_max 0.9 (its reference configs), which are ``RecurrentSpec``'s defaults.

    net, params = build_recurrent("encoder", in_dim, RecurrentSpec(), key)
    state = net.initial_state((batch,))                        # (batch, layers, d_hidden) complex64
    ys, state = net(params, xs, state, starts)                 # xs (batch, T, in_dim), starts (batch, T)
    y, state = net.step(params, x, state, start)               # one step: x (batch, in_dim)

Hidden activations are reported as for ``networks.core.Net`` (taps ``pre``, ``layer0``, ...; the
output as ``features``), so the plasticity metrics read them; the recurrent parameters have no
per-neuron reset rule, so resets (ReDo, ReGraMa) do not apply to this core.
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
class RecurrentSpec:
    """Shape of the recurrent core (defaults: NeuBay's, arXiv 2512.04341)."""

    d_model: int = 256
    d_hidden: int = 128
    layers: int = 2
    r_min: float = 0.0
    r_max: float = 0.9
    max_phase: float = 2 * math.pi

    def __post_init__(self):
        if self.d_model < 1 or self.d_hidden < 1 or self.layers < 1:
            raise ValueError(
                f"recurrent core sizes must be positive, got d_model={self.d_model}, "
                f"d_hidden={self.d_hidden}, layers={self.layers}"
            )
        if not 0.0 <= self.r_min < self.r_max < 1.0:
            raise ValueError(f"LRU eigenvalue ring needs 0 <= r_min < r_max < 1, got [{self.r_min}, {self.r_max}]")
        if not self.max_phase > 0:
            raise ValueError(f"LRU max_phase must be positive, got {self.max_phase}")


def linear_recurrence(a, b, h0):
    """h_t = a_t * h_{t-1} + b_t over axis 0, from h_{-1} = h0, as one associative scan.

    The pairs (a, b) compose as (a_i, b_i) then (a_j, b_j) -> (a_j a_i, a_j b_i + b_j); folding
    h0 into b_0 makes the scan's b-part the states themselves.  a, b: (T, H); h0: (H,).
    """
    b = b.at[0].add(a[0] * h0)

    def compose(first, second):
        a_i, b_i = first
        a_j, b_j = second
        return a_j * a_i, a_j * b_i + b_j

    return jax.lax.associative_scan(compose, (a, b))[1]


class LRU(nnx.Module):
    """One linear recurrent unit (Orvieto et al. 2023, eq. 3 and section 3.3's initialisation)."""

    def __init__(self, d_model: int, spec: RecurrentSpec, *, rngs: nnx.Rngs):
        k_r, k_phase, k_b, k_c, k_d = jax.random.split(rngs.params(), 5)
        h = spec.d_hidden
        u = jax.random.uniform(k_r, (h,))
        # |lambda|^2 uniform on [r_min^2, r_max^2] -> |lambda| uniform on the ring's area (section 3.3)
        self.nu_log = nnx.Param(jnp.log(-0.5 * jnp.log(u * (spec.r_max**2 - spec.r_min**2) + spec.r_min**2)))
        self.theta_log = nnx.Param(jnp.log(spec.max_phase * jax.random.uniform(k_phase, (h,))))
        modulus = jnp.exp(-jnp.exp(self.nu_log[...]))
        self.gamma_log = nnx.Param(jnp.log(jnp.sqrt(1.0 - modulus**2)))
        b = jax.random.normal(k_b, (2, h, d_model)) / math.sqrt(2 * d_model)
        c = jax.random.normal(k_c, (2, d_model, h)) / math.sqrt(h)
        self.B_re, self.B_im = nnx.Param(b[0]), nnx.Param(b[1])
        self.C_re, self.C_im = nnx.Param(c[0]), nnx.Param(c[1])
        self.D = nnx.Param(jax.random.normal(k_d, (d_model,)))

    def eigenvalues(self):
        """lambda = exp(-exp(nu) + i exp(theta)), modulus below 1 for any parameters."""
        return jnp.exp(-jnp.exp(self.nu_log[...]) + 1j * jnp.exp(self.theta_log[...]))

    def __call__(self, x, h0, start):
        """x (T, d_model), h0 (d_hidden,) complex, start (T,) bool -> (y (T, d_model), h_T)."""
        lam = self.eigenvalues()
        gamma = jnp.exp(self.gamma_log[...])
        b = gamma * (x @ self.B_re[...].T + 1j * (x @ self.B_im[...].T))  # (T, H): gamma * B x_t
        a = lam * (1.0 - start.astype(x.dtype))[:, None]  # an episode start forgets h_{t-1}
        hs = linear_recurrence(a, b, h0.astype(b.dtype))
        y = hs.real @ self.C_re[...].T - hs.imag @ self.C_im[...].T + self.D[...] * x  # Re(C h) + D x
        return y, hs[-1]


class LRULayer(nnx.Module):
    """Orvieto et al.'s block (Fig. 1): x + GLU(GELU(LRU(LayerNorm(x))))."""

    def __init__(self, d_model: int, spec: RecurrentSpec, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.lru = LRU(d_model, spec, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, rngs=rngs)
        self.gate = nnx.Linear(d_model, d_model, rngs=rngs)

    def __call__(self, x, h0, start, probe=None):
        z, h = self.lru(self.norm(x), h0, start)
        if probe is not None:
            z = z + probe["pre"]
        g = jax.nn.gelu(z)
        if probe is not None:
            g = g + probe["post"]
        return x + self.out(g) * jax.nn.sigmoid(self.gate(g)), h, g


class RecurrentCore(nnx.Module):
    """Pre-block (Linear -> LayerNorm -> leaky-ReLU) then ``spec.layers`` LRU layers, over one sequence."""

    def __init__(self, in_dim: int, spec: RecurrentSpec, *, rngs: nnx.Rngs):
        self.spec = spec
        self.pre = nnx.Linear(in_dim, spec.d_model, rngs=rngs)
        self.pre_norm = nnx.LayerNorm(spec.d_model, rngs=rngs)
        self.layers = nnx.List([LRULayer(spec.d_model, spec, rngs=rngs) for _ in range(spec.layers)])

    def tap_names(self) -> list[str]:
        return ["pre"] + [f"layer{i}" for i in range(self.spec.layers)]

    def __call__(self, x, state, start, probes=None):
        """x (T, in_dim), state (layers, d_hidden), start (T,) -> (y (T, d_model), new state, taps)."""
        z = self.pre_norm(self.pre(x))
        if probes is not None:
            z = z + probes["pre"]["pre"]
        h = jax.nn.leaky_relu(z)
        if probes is not None:
            h = h + probes["pre"]["post"]
        taps, last = {"pre": h}, []
        for i, layer in enumerate(self.layers):
            h, h_last, g = layer(h, state[i], start, None if probes is None else probes[f"layer{i}"])
            taps[f"layer{i}"] = g
            last.append(h_last)
        taps["features"] = h
        return h, jnp.stack(last), taps


@dataclass(frozen=True)
class RecurrentNet:
    """Functional handle on a ``RecurrentCore``: ``net(params, x, state, start) -> (y, state)``.

    Leading axes of ``x`` before (T, in_dim) are batch axes (``state`` and ``start`` share them).
    """

    name: str
    graphdef: Any
    spec: RecurrentSpec
    make: Callable | None = field(default=None, compare=False, hash=False, repr=False)
    # (params, key) -> params applied to freshly made params (e.g. ``networks.core.fan_in_uniform_init``)
    initializer: Callable | None = field(default=None, compare=False, hash=False, repr=False)

    def init(self, key):
        """Freshly initialised params, drawn as ``build_recurrent`` draws them."""
        params = nnx.split(self.make(nnx.Rngs(key)), nnx.Param)[1]
        return params if self.initializer is None else self.initializer(params, key)

    def initial_state(self, batch_shape: tuple = ()):
        """Zero recurrent state: (*batch_shape, layers, d_hidden) complex64."""
        return jnp.zeros((*batch_shape, self.spec.layers, self.spec.d_hidden), jnp.complex64)

    def apply(self, params, x, state, start, probes=None):
        """-> (y, new state, taps); vmapped over the batch axes."""

        def one(x, state, start, probes):
            return nnx.merge(self.graphdef, params)(x, state, start, probes)

        fn = one
        for _ in range(x.ndim - 2):
            fn = jax.vmap(fn, in_axes=(0, 0, 0, None if probes is None else 0))
        return fn(x, state, start.astype(bool), probes)

    def __call__(self, params, x, state, start):
        rec = instrument.active()
        if rec is not None and rec.wants(self.name):
            y, state, taps = self.apply(params, x, state, start, probes=rec.probe_for(self.name))
            rec.store(self.name, taps)
            return y, state
        y, state, _ = self.apply(params, x, state, start)
        return y, state

    def step(self, params, x, state, start):
        """One time step, for acting: x (*batch, in_dim), start (*batch,) -> (y (*batch, d_model), state)."""
        y, state = self(params, x[..., None, :], state, jnp.asarray(start)[..., None])
        return y[..., 0, :], state


def build_recurrent(
    name: str, in_dim: int, spec: RecurrentSpec, key, initializer: Callable | None = None
) -> tuple[RecurrentNet, Any]:
    """Create a recurrent core -> (RecurrentNet, params).

    ``initializer(params, key) -> params`` (optional) maps the freshly made params, e.g.
    ``networks.core.fan_in_uniform_init`` for the Linear layers (the LRU's own parameters have no
    ``kernel`` and keep section 3.3's initialisation)."""
    make = lambda rngs: RecurrentCore(in_dim, spec, rngs=rngs)  # noqa: E731
    graphdef, params = nnx.split(make(nnx.Rngs(key)), nnx.Param)
    net = RecurrentNet(name, graphdef, spec, make, initializer)
    return net, params if initializer is None else initializer(params, key)


@dataclass(frozen=True)
class Memoryless:
    """The ``RecurrentNet`` interface over no recurrence: the output at each position is the first
    ``out_dim`` features of its input (e.g. the state s_t of [s_t, a_{t-1}, r_{t-1}]), the memory an
    empty (*batch, 0) array and the params an empty dict.  An agent written against ``RecurrentNet``
    becomes its Markov (MLP) ablation with this in place of its encoders."""

    name: str
    out_dim: int

    def init(self, key):
        return {}

    def initial_state(self, batch_shape: tuple = ()):
        return jnp.zeros((*batch_shape, 0), jnp.float32)

    def __call__(self, params, x, state, start):
        return x[..., : self.out_dim], state

    def step(self, params, x, state, start):
        return x[..., : self.out_dim], state
