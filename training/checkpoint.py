"""Checkpoints that resume a run exactly.

A checkpoint is a directory ``ckpt/step_<N>/`` holding

- ``arrays.npz``: every leaf of the device pytrees (agent state with optimizer states and
  counters, replay buffer, rng key), flattened in a fixed order and restored into a template
  built by the same ``init`` (shapes and dtypes are checked leaf by leaf);
- ``host.pkl``: host-side state (vector envs with their MuJoCo state and generators, the
  pending observation and action, step counters, episode statistics);
- ``meta.json``: step, leaf count and the config.

It is written to a temporary directory and renamed, so a crash mid-save never leaves a
half-written checkpoint; the newest ``keep`` checkpoints are kept.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_numpy(leaf):
    return np.asarray(jax.random.key_data(leaf)) if _is_key(leaf) else np.asarray(leaf)


def path_for(run_dir, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (``run_dir/ckpt/step_000000001000``)."""
    return Path(run_dir) / "ckpt" / f"step_{step:012d}"


def save(run_dir, step: int, tree, host: dict, meta: dict | None = None, keep: int = 2) -> Path:
    final = path_for(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    leaves = jax.tree.leaves(tree)
    np.savez(tmp / "arrays.npz", **{f"leaf_{i:05d}": _to_numpy(x) for i, x in enumerate(leaves)})
    with open(tmp / "host.pkl", "wb") as f:
        pickle.dump(host, f, protocol=pickle.HIGHEST_PROTOCOL)
    with open(tmp / "meta.json", "w") as f:
        json.dump({"step": step, "leaves": len(leaves), **(meta or {})}, f, indent=2)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(p for p in root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir) -> Path | None:
    found = sorted((Path(run_dir) / "ckpt").glob("step_*"))
    return found[-1] if found else None


def load(path, template):
    """Restore (tree, host, meta) from checkpoint ``path`` into the structure of ``template``."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        arrays = np.load(path / "arrays.npz")
        with open(path / "host.pkl", "rb") as f:
            host = pickle.load(f)
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"checkpoint {path} is unreadable or incomplete: {e}") from e
    leaves, treedef = jax.tree.flatten(template)
    if meta["leaves"] != len(leaves):
        raise ValueError(f"checkpoint {path} holds {meta['leaves']} arrays but this config expects "
                         f"{len(leaves)}: was it written with another agent or network config?")
    restored = []
    for i, ref in enumerate(leaves):
        x = arrays[f"leaf_{i:05d}"]
        ref_np = _to_numpy(ref)
        if x.shape != ref_np.shape or x.dtype != ref_np.dtype:
            raise ValueError(f"checkpoint {path} array {i} is {x.dtype}{x.shape}, expected "
                             f"{ref_np.dtype}{ref_np.shape}: config mismatch")
        restored.append(jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(ref))
                        if _is_key(ref) else jnp.asarray(x))
    return jax.tree.unflatten(treedef, restored), host, meta
