"""What the fidelity tests (``tests/test_fidelity_*.py``, docs/fidelity.md) share: reference weights from a
fixture mapped into the zoo's parameter trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.networks.core import path_names


def torch_linear(fx, prefix: str, name: str):
    """torch nn.Linear (weight [out, in]) -> flax (kernel [in, out], bias)."""
    return fx[f"{prefix}/{name}.weight"].T, fx[f"{prefix}/{name}.bias"]


def load_into(params, tree: dict):
    """Our param tree with every leaf replaced by ``tree[path]`` (shapes checked, every entry used)."""
    used = set()

    def leaf(path, x):
        name = path_names(path)
        assert name in tree, f"no reference array for {name}"
        assert tree[name].shape == x.shape, (name, tree[name].shape, x.shape)
        used.add(name)
        return jnp.asarray(tree[name], jnp.float32)

    out = jax.tree_util.tree_map_with_path(leaf, params)
    assert used == set(tree), set(tree) - used
    return out


def flat(params) -> dict:
    """``{path: array}`` of a parameter tree (paths as ``path_names`` gives them)."""
    return {path_names(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
