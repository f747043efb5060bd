"""A trained ensemble on disk (``save`` / ``load``: one ``.npz``) and the model an offline run uses
(``load_or_train``: the given or cached model, else one trained now and cached, resuming an
interrupted fit from its ``partial_path``; ``epoch_progress`` reports the fit).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.agents.dynamics.config import NO_EPOCH_CAP, DynamicsConfig
from plasticity_zoo.agents.dynamics.ensemble import DynamicsModel, init_model, train
from plasticity_zoo.networks.core import path_names

_FORMAT = 1  # save-file format version


# ============================================================================ save / load


def _named_leaves(params) -> dict:
    return {"/".join(str(k) for k in path_names(p)): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def save(path, model: DynamicsModel) -> None:
    """One ``.npz``: every param leaf (by path), the input statistics, elites, val MSE and the config
    as JSON, so a model trained on a dataset can be cached beside it."""
    meta = {"format": _FORMAT, "obs_dim": model.obs_dim, "act_dim": model.act_dim, "config": asdict(model.cfg)}
    arrays = {f"params/{k}": np.asarray(v) for k, v in _named_leaves(model.params).items()}
    arrays.update(
        input_mean=np.asarray(model.input_mean),
        input_std=np.asarray(model.input_std),
        elites=np.asarray(model.elites),
        val_mse=np.asarray(model.val_mse),
        target_mean=np.asarray(model.target_mean),
        target_std=np.asarray(model.target_std),
    )
    with open(path, "wb") as f:
        np.savez(f, __meta__=np.array(json.dumps(meta)), **arrays)


def load(path) -> DynamicsModel:
    """Inverse of ``save``; checks every array against a freshly built template and fails clearly."""
    with np.load(path, allow_pickle=False) as data:
        if "__meta__" not in data.files:
            raise ValueError(f"{path} is not a saved dynamics model (no __meta__ entry)")
        meta = json.loads(str(data["__meta__"]))
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path}: unsupported dynamics-model format {meta.get('format')!r} (expected {_FORMAT})")
        known = {f.name for f in fields(DynamicsConfig)}
        unknown = set(meta["config"]) - known
        if unknown:
            raise ValueError(f"{path}: unknown config fields {sorted(unknown)}")
        cfg_kw = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()}
        cfg = DynamicsConfig(**cfg_kw)
        template = init_model(jax.random.key(0), int(meta["obs_dim"]), int(meta["act_dim"]), cfg)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template.params)
        stored = {k[len("params/") :] for k in data.files if k.startswith("params/")}
        expected = _named_leaves(template.params)
        problems = [f"missing {k}" for k in expected if k not in stored]
        problems += [f"unexpected {k}" for k in stored if k not in expected]
        problems += [
            f"{k}: shape {data['params/' + k].shape}, expected {v.shape}"
            for k, v in expected.items()
            if k in stored and data["params/" + k].shape != v.shape
        ]
        m, d = cfg.members, template.obs_dim + template.act_dim
        d_out = template.obs_dim + 1
        checks = [("input_mean", (d,)), ("input_std", (d,)), ("elites", (cfg.elites,)), ("val_mse", (m,))]
        targets = {"target_mean": np.asarray(template.target_mean), "target_std": np.asarray(template.target_std)}
        if "target_mean" in data.files or cfg.target_scaling != "none":  # files before target scaling: 0 / 1
            checks += [("target_mean", (d_out,)), ("target_std", (d_out,))]
            targets = {k: data[k] for k in targets if k in data.files}
        for name, shape in checks:
            if name not in data.files or data[name].shape != shape:
                problems.append(f"{name}: expected shape {shape}")
        if problems:
            raise ValueError(f"{path} does not match its config: " + "; ".join(problems))
        names = list(expected)
        params = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(data["params/" + k]) for k in names])
        return template.replace(
            params=params,
            input_mean=jnp.asarray(data["input_mean"]),
            input_std=jnp.asarray(data["input_std"]),
            elites=jnp.asarray(data["elites"], jnp.int32),
            val_mse=jnp.asarray(data["val_mse"]),
            target_mean=jnp.asarray(targets["target_mean"], jnp.float32),
            target_std=jnp.asarray(targets["target_std"], jnp.float32),
        )


# ============================================================================ a run's model


def epoch_progress(
    log: Callable[[str], None],
    max_epochs: int,
    every: int = 25,
    interval_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[int, dict], None]:
    """A ``train(log=...)`` callback that reports an epoch line to ``log``: the first epoch it hears
    of (1, or the one after a resumed fit's stored epoch), every ``every``-th, any epoch whose action
    is not "continue" (stop, lr cut), and any epoch ending ``interval_s`` or more after the last line,
    so a slow fit (a 128-member NeuBay posterior on 40k rows takes 30-40 s an epoch on a 2-core CPU)
    is never silent for long.  Each line gives the seconds per epoch run since the callback was
    made (a resumed fit: over the epochs run in this process only) and the epoch cap (early
    stopping usually ends sooner)."""
    start = last = clock()
    before: Optional[int] = None  # the epoch before the first one heard of: 0, or a resumed fit's stored epoch

    def progress(epoch: int, row: dict) -> None:
        nonlocal last, before
        now = clock()
        first = before is None
        if before is None:
            before = epoch - 1
        action = row.get("action") or ""
        if not (first or epoch % every == 0 or action not in ("", "continue") or now - last >= interval_s):
            return
        last = now
        cap = "no cap" if max_epochs >= NO_EPOCH_CAP else f"cap {max_epochs}"
        log(
            f"  dynamics epoch {epoch} ({cap}; {(now - start) / (epoch - before):.1f} s/epoch): train loss "
            f"{row['train_loss']:.4f}, best validation MSE {np.min(row['best_val_mse']):.5f}"
            + ("" if action in ("", "continue") else f" ({action})")
        )

    return progress


def partial_path(cache_path) -> Path:
    """Where ``load_or_train`` keeps the state of an unfinished fit for ``cache_path``:
    ``x.npz`` -> ``x.partial.npz`` (any other name: ``.partial.npz`` appended)."""
    name = Path(cache_path).name
    stem = name[: -len(".npz")] if name.endswith(".npz") else name
    return Path(cache_path).with_name(stem + ".partial.npz")


def load_or_train(
    key,
    dataset,
    cfg: DynamicsConfig,
    cache_path,
    explicit_path: Optional[str] = None,
    log=print,
    checkpoint_interval_s: float = 60.0,
) -> DynamicsModel:
    """The dynamics model an offline run uses: ``explicit_path`` (``--model``), else the model cached
    at ``cache_path`` (it must have been trained with ``cfg``), else one trained now on the dataset's
    true next observations (``dataset``: an ``envs.datasets.Dataset``, actions in [-1, 1]) and saved
    at ``cache_path``.  Raises SystemExit (a message) for a missing ``--model``, a model of other
    dimensions, or a cached one trained with other settings.

    The fit keeps its state in ``partial_path(cache_path)`` (``train(resume_path=...)``, written at
    most every ``checkpoint_interval_s``): the same call after an interruption resumes it and gives
    the model an uninterrupted fit gives; the file is deleted once the model is saved."""
    path = Path(explicit_path) if explicit_path else Path(cache_path)
    if path.exists():
        log(f"dynamics model: {path}")
        model = load(path)
        if (model.obs_dim, model.act_dim) != (dataset.obs_dim, dataset.act_dim):
            raise SystemExit(
                f"dynamics model {path} is for obs/act dims {model.obs_dim}/{model.act_dim}, the "
                f"dataset has {dataset.obs_dim}/{dataset.act_dim}"
            )
        if not explicit_path and model.cfg != cfg:
            changed = [f.name for f in fields(DynamicsConfig) if getattr(model.cfg, f.name) != getattr(cfg, f.name)]
            raise SystemExit(
                f"the cached dynamics model {path} was trained with other --dynamics settings "
                f"({', '.join(changed)}): delete it to retrain, or pass --model {path} to use it"
            )
        return model
    if explicit_path:
        raise SystemExit(f"--model {path}: no such file")
    log(f"training the dynamics ensemble on {len(dataset)} transitions (cached at {path}) ...")
    t = dataset.transitions(unit_actions=True)
    partial = partial_path(path)
    model, info = train(
        key,
        t.obs,
        t.action,
        t.reward,
        t.next_obs,
        cfg,
        log=epoch_progress(log, cfg.max_epochs),
        resume_path=partial,
        checkpoint_interval_s=checkpoint_interval_s,
        on_resume=lambda epoch: log(f"resuming the dynamics fit from epoch {epoch} ({partial})"),
    )
    save(path, model)
    partial.unlink(missing_ok=True)
    val = np.asarray(info["val_mse"])
    log(
        f"dynamics: {info['epochs']} epochs, validation MSE per member {[float(f'{v:.3g}') for v in val]}, "
        f"elites {np.asarray(info['elites']).tolist()}"
    )
    return model
