"""Networks = trunk + head.  Every ``__call__`` returns ``(output, taps)``.

``taps`` holds each hidden layer's post-activation output plus ``"features"``: the trunk's
output that feeds the head (the representation SIGReg regularises and srank measures).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from plasticity_zoo.networks.blocks import Trunk, TrunkSpec


def _head(in_dim, out_dim, rngs, out_init_scale):
    if out_init_scale is None:
        return nnx.Linear(in_dim, out_dim, rngs=rngs)
    init = nnx.initializers.uniform(2 * out_init_scale)
    shift = lambda f: lambda key, shape, dtype=jnp.float32: f(key, shape, dtype) - out_init_scale  # noqa: E731
    return nnx.Linear(in_dim, out_dim, rngs=rngs, kernel_init=shift(init), bias_init=shift(init))


class MLPHead(nnx.Module):
    """Trunk followed by a Linear output: Q(s, a) (inputs concatenated), V(s), or any regressor.

    ``out_init_scale`` draws the output layer from U(-s, s) (EDAC uses 3e-3 for critics).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        spec: TrunkSpec,
        *,
        rngs: nnx.Rngs,
        out_init_scale: float | None = None,
        squeeze: bool = True,
    ):
        self.trunk = Trunk(in_dim, spec, rngs=rngs)
        self.out = _head(spec.width, out_dim, rngs, out_init_scale)
        self.squeeze = squeeze and out_dim == 1

    def __call__(self, x, probes=None):
        h, taps = self.trunk(x, probes)
        y = self.out(h)
        return (y[..., 0] if self.squeeze else y), {**taps, "features": h}


class GaussianPolicyHead(nnx.Module):
    """Trunk -> (mean, log_std) of a diagonal Gaussian, log_std clipped to [min, max]."""

    def __init__(
        self,
        in_dim: int,
        act_dim: int,
        spec: TrunkSpec,
        *,
        rngs: nnx.Rngs,
        log_std_min: float = -5.0,
        log_std_max: float = 2.0,
        out_init_scale: float | None = None,
    ):
        self.trunk = Trunk(in_dim, spec, rngs=rngs)
        self.out = _head(spec.width, 2 * act_dim, rngs, out_init_scale)
        self.log_std_min, self.log_std_max = log_std_min, log_std_max

    def __call__(self, x, probes=None):
        h, taps = self.trunk(x, probes)
        mean, log_std = jnp.split(self.out(h), 2, axis=-1)
        return (mean, jnp.clip(log_std, self.log_std_min, self.log_std_max)), {**taps, "features": h}


class DeterministicPolicyHead(nnx.Module):
    """Trunk -> Linear -> tanh.  Also returns the pre-activation (MR.Q penalises it)."""

    def __init__(self, in_dim: int, act_dim: int, spec: TrunkSpec, *, rngs: nnx.Rngs):
        self.trunk = Trunk(in_dim, spec, rngs=rngs)
        self.out = nnx.Linear(spec.width, act_dim, rngs=rngs)

    def __call__(self, x, probes=None):
        h, taps = self.trunk(x, probes)
        pre = self.out(h)
        return (jnp.tanh(pre), pre), {**taps, "features": h}
