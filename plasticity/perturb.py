"""Shrink & Perturb and layer resets: whole-network interventions on a fixed period.

Shrink & Perturb (Ash & Adams 2020, "On warm-starting neural network training", section 4): every
parameter is shrunk toward zero and perturbed by a fresh draw of the network's own initialiser,

    theta <- lambda * theta + sigma * phi,    phi ~ the network's initialisation (a new draw each event),

which is the form of the authors' code (a fresh model's parameters as the noise) and of Plasticine's
(Yuan et al. 2025, which runs it after every policy update with lambda = 1 - 1e-6, sigma = 1 - lambda).
The optimizer state is left as it is, as both do.

Layer resets (Nikishin, Schwarzer, D'Oro, Bacon, Courville 2022, "The primacy bias in deep RL",
section 4): every K updates the last k layers of each network are re-drawn from their initialisers
(k = 0: the whole network, the paper's SAC setting), with fresh optimizer state for them: Adam's
moments zeroed, and for a whole-network reset its step count too, so the next steps are a fresh
Adam's.  (A partial reset shares the step count with the layers kept, so only their moments go.)
Target networks the agent declares (``PLASTIC_TARGETS``) take the reset layers' new values, as the
paper's reset agent starts its targets from the new networks.  The temperature and any other
non-network state are kept.

Everything is a pure function of pytrees with static shapes (jit and vmap over seeds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from plasticity_zoo.networks.core import Net, path_names
from plasticity_zoo.plasticity.resets import neuron_layout, zero_moments


def shrink_perturb(params, fresh, shrink: float, perturb: float):
    """``shrink * params + perturb * fresh``, leaf by leaf."""
    return jax.tree.map(lambda p, f: shrink * p + perturb * f, params, fresh)


def layers(net: Net, params) -> list[tuple[tuple, ...]]:
    """The network's Linear layers from input to output, each as the param-path prefixes it owns: a
    hidden layer its Linear and the LayerNorm on its units (if any), the last one the output layer."""
    layout = neuron_layout(net, params)
    hidden = [
        tuple(p for p in (tuple(paths["incoming"]), paths["norm"] and tuple(paths["norm"])) if p)
        for paths in layout.values()
    ]
    return hidden + [(("out",),)]


def layer_mask(net: Net, params, last: int):
    """Bool pytree like ``params``: True on every parameter of the last ``last`` layers (0: all of them)."""
    if last == 0:
        return jax.tree.map(lambda x: jnp.ones(x.shape, bool), params)
    chosen = [prefix for layer in layers(net, params)[-last:] for prefix in layer]

    def hit(path, x):
        keys = path_names(path)
        return jnp.full(x.shape, any(keys[: len(p)] == p for p in chosen), bool)

    return jax.tree_util.tree_map_with_path(hit, params)


def restart_adam_counts(opt_state):
    """Every Adam step count in ``opt_state`` back to 0 (a fresh Adam's bias correction)."""

    def fresh(node):
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(count=jnp.zeros_like(node.count))
        return node

    return jax.tree.map(fresh, opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))


def reset_layers(net: Net, params, opt_state, key, last: int):
    """Re-draw the last ``last`` layers (0: the whole network) -> (params, opt_state, mask of what changed)."""
    mask = layer_mask(net, params, last)
    fresh = net.init(key)
    new = jax.tree.map(lambda m, f, p: jnp.where(m, f, p), mask, fresh, params)
    opt_state = zero_moments(opt_state, params, mask)
    if last == 0:
        opt_state = restart_adam_counts(opt_state)
    return new, opt_state, mask
