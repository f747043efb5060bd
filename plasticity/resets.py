"""ReDo and ReGraMa neuron resets for any instrumented network.

ReDo (Sokar et al., ICML 2023, arXiv 2302.12902): neuron i of hidden layer l is tau-dormant when
its normalised mean |activation| s_i <= tau.  ReGraMa (Liu et al., NeurIPS 2025, arXiv 2505.24061,
Eq. 2): the same score with the gradient magnitude at the neuron's Linear output, G_i <= tau.

A reset of neuron i (dopamine's ``labs/redo/weight_recyclers.py``; ReGraMa's code):
  - incoming weights re-drawn from the network's own initialiser, bias set to 0;
  - outgoing weights (row i of the next Linear, or of the head) set to 0, so the network's
    output is unchanged at the moment of reset (exactly so when no LayerNorm sits inside the
    neuron layer; a LayerNorm couples the units of its layer);
  - LayerNorm gain/bias of the unit restored to 1/0 (ReGraMa's code; ``reset_norm``);
  - Adam's first and second moments of every touched weight set to 0 (the step count is kept);
  - the output layer is never reset.
Everything is a pure function of pytrees with static shapes, so it runs under jit and vmap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from plasticity_zoo.networks import instrument
from plasticity_zoo.networks.core import Net, path_names
from plasticity_zoo.networks.residual import RESIDUAL, head_paths, split
from plasticity_zoo.plasticity.metrics import grama_scores, neuron_scores


def neuron_layout(net: Net, params) -> dict[str, dict[str, tuple]]:
    """Tap -> param paths (incoming Linear, LayerNorm or None, outgoing Linear) in the network."""
    module = net.module(params)
    if not hasattr(module, "trunk") or not hasattr(module, "out"):
        raise ValueError(f"network {net.name!r} has no trunk/out structure that resets understand")
    layout = {}
    for tap, paths in module.trunk.neuron_layers().items():
        layout[tap] = {
            "incoming": ("trunk", *paths["incoming"]),
            "norm": None if paths["norm"] is None else ("trunk", *paths["norm"]),
            "outgoing": ("out",) if paths["outgoing"] is None else ("trunk", *paths["outgoing"]),
            "unit_outputs": paths.get("unit_outputs", 1),
        }
    return layout


def _outgoing_rows(mask, layout, tap):
    """A tap's unit mask (..., U) over its outgoing kernel's rows: a paired activation's unit i
    (``unit_outputs`` 2, ``networks/blocks.py``) feeds rows i and i + U, so the mask is tiled."""
    k = layout[tap].get("unit_outputs", 1)
    return mask if k == 1 else jnp.concatenate([mask] * k, axis=-1)


def _roles(layout):
    """Param path of a Linear/LayerNorm -> [(role, tap), ...]: a hidden Linear is the incoming
    layer of its own units and the outgoing layer of the previous layer's units.  Outgoing roles
    come last, so a weight from one reset unit to another is zeroed after its redraw (ReDo's code,
    ``NeuronRecycler.recycle_dead_neurons``: incoming redraws first, then outgoing zeros)."""
    roles: dict[tuple, list] = {}
    for role in ("incoming", "norm", "outgoing"):
        for tap, paths in layout.items():
            if paths[role] is not None:
                roles.setdefault(tuple(paths[role]), []).append((role, tap))
    return roles


def _map_roles(params, layout, fn):
    """Fold ``fn(keys, role, tap, leaf_name, leaf)`` over every (role, tap) of each leaf.

    A network with a residual head (plasticity injection, ``networks.residual``): the copies of its
    head's first layer also read the encoder's units, so a reset encoder unit's outgoing rows are zeroed
    in them too (the output stays unchanged); the copies' own units are not the network's and keep theirs."""
    roles = _roles(layout)
    _, pair = split(params)
    head = {p[:-1] for p in head_paths(pair)} if pair is not None else set()

    def visit(path, leaf):
        keys = path_names(path)
        if keys[0] == RESIDUAL:
            for role, tap in roles.get(keys[2:-1], []):
                if role == "outgoing" and tuple(layout[tap]["incoming"]) not in head:
                    leaf = fn(keys[2:], role, tap, keys[-1], leaf)
            return leaf
        for role, tap in roles.get(keys[:-1], []):
            leaf = fn(keys, role, tap, keys[-1], leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(visit, params)


def reset_neurons(net: Net, params, opt_state, masks: dict, key, reset_norm: bool = True):
    """Reset the neurons flagged in ``masks`` ({tap: bool (H,) or (members, H)}) -> (params, opt_state)."""
    layout = neuron_layout(net, params)
    fresh = {path_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(net.init(key))[0]}

    def new_value(keys, role, tap, name, leaf):
        mask = masks[tap]
        if role == "incoming":
            if name == "kernel":  # (..., in, H): the flagged units' columns re-drawn from the initialiser
                return jnp.where(mask[..., None, :], fresh[keys], leaf)
            return jnp.where(mask, 0.0, leaf)  # their biases
        if role == "norm":
            return jnp.where(mask, 1.0 if name == "scale" else 0.0, leaf) if reset_norm else leaf
        if name == "kernel":  # outgoing (..., H, out): the flagged units' rows zeroed (both of a pair's)
            return jnp.where(_outgoing_rows(mask, layout, tap)[..., :, None], 0.0, leaf)
        return leaf  # the next layer's bias belongs to other units

    new_params = _map_roles(params, layout, new_value)
    return new_params, zero_moments(opt_state, params, touched_mask(params, layout, masks, reset_norm))


def touched_mask(params, layout, masks, reset_norm: bool = True):
    """Bool pytree like ``params``: True at every weight a reset of ``masks`` changes."""
    none = jax.tree.map(lambda x: jnp.zeros(x.shape, bool), params)

    def fn(keys, role, tap, name, touched):
        mask = masks[tap]
        if role == "incoming":
            hit = mask[..., None, :] if name == "kernel" else mask
        elif role == "norm":
            hit = mask if reset_norm else jnp.zeros((), bool)
        else:
            hit = _outgoing_rows(mask, layout, tap)[..., :, None] if name == "kernel" else jnp.zeros((), bool)
        return touched | jnp.broadcast_to(hit, touched.shape)

    return _map_roles(none, layout, fn)


def zero_moments(opt_state, params, touched):
    """Zero every optimizer-state subtree shaped like ``params`` (Adam's mu, nu) where ``touched``.

    With a residual head (plasticity injection) the optimizer keeps one state over the network's own
    params and one over the trained copy theta': subtrees shaped like either are zeroed where their
    part of ``touched`` is."""
    base, pair = split(params)
    if pair is None:
        parts = {jax.tree.structure(params): touched}
    else:
        t_base, t_pair = split(touched)
        parts = {jax.tree.structure(base): t_base, jax.tree.structure(pair["fresh"]): t_pair["fresh"]}

    def is_param_tree(node):
        try:
            return jax.tree.structure(node) in parts
        except Exception:
            return False

    def fn(node):
        if is_param_tree(node):
            mask = parts[jax.tree.structure(node)]
            return jax.tree.map(lambda x, t: jnp.where(t, jnp.zeros_like(x), x), node, mask)
        return node

    return jax.tree.map(fn, opt_state, is_leaf=is_param_tree)


def select(scores, tau: float, max_fraction: float = 1.0):
    """Flag units with score <= tau, at most ``max_fraction`` of the layer (lowest scores first)."""
    flagged = scores <= tau
    if max_fraction >= 1.0:
        return flagged
    h = scores.shape[-1]
    k = int(max_fraction * h)
    rank = jnp.argsort(jnp.argsort(jnp.where(flagged, scores, jnp.inf), axis=-1), axis=-1)
    return flagged & (rank < k)


def scores(method: str, loss_fn, name: str):
    """Per-tap neuron scores of network ``name`` under ``loss_fn()``: ReDo or ReGraMa."""
    if method == "redo":
        acts = instrument.activations(loss_fn, [name])[name]
        return {tap: neuron_scores(a) for tap, a in acts.items()}
    if method == "regrama":
        _, grads = instrument.activation_grads(loss_fn, [name], at="pre")
        return {tap: grama_scores(g) for tap, g in grads[name].items()}
    raise ValueError(f"unknown reset method {method!r}; choose redo or regrama")
