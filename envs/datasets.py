"""Offline datasets in the D4RL layout: the type, validation, HDF5 I/O, the cache (D4RL, Fu et al. 2020).

A dataset is one flat HDF5 file (D4RL's gym-mujoco v2 layout)::

    observations [N, obs] float32     actions [N, act] float32 (env units)    rewards [N] float32
    terminals [N] bool                timeouts [N] bool                       next_observations [N, obs] float32
    infos/<k>    arrays with leading N (qpos, qvel, action_log_probs, ...)
    metadata/<k> scalars, strings, arrays and nested groups (e.g. metadata/policy/<layer>/<param>)

``next_observations`` are the *true* successors s_{t+1}, also at episode ends (never rebuild them
from ``observations[i+1]`` as D4RL's ``qlearning_dataset`` does: at an end that is the next
episode's reset state).
``terminals`` (a real termination) and ``timeouts`` (a time-limit cut) stay separate and are
never both set on a row.  Actions are stored in the env's own action units (D4RL's convention;
the gym-mujoco locomotion bounds are [-1, 1], so agent units and env units coincide there).

Also here: the env's spaces and action units, the dataset cache (``find``), and the hint for a
Minari file given as a path (refused by ``load``; ``minari_file_hint`` and ``minari_root`` stay here
because ``envs/minari_data.py`` imports this module).  Elsewhere in ``envs/``: Minari datasets
(``minari_data.py``: ``--dataset minari:<id>`` converted once with the ``minari`` package, and
``load_minari``), D4RL normalised scores (``scores.py``) and collection
(``collect.py``: a policy rolled in a vector env into a dataset, after D4RL's generation scripts).
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from plasticity_zoo.envs.scores import d4rl_name

KINDS = ("random", "medium", "medium-replay", "expert", "medium-expert")
KEYS = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")
FLOAT_KEYS = ("observations", "actions", "rewards", "next_observations")
BOOL_KEYS = ("terminals", "timeouts")
FORMAT_VERSION = 1


class DatasetError(ValueError):
    """A dataset file or array that cannot be used; the message names the file and the problem."""


@dataclass
class Dataset:
    """The flat D4RL arrays (Fu et al. 2020, arXiv 2004.07219) plus ``metadata`` and ``infos``.

    ``metadata``: str keys; values str / int / float / bool / None / numpy arrays or scalars /
    lists (stored as JSON) / nested dicts of those.  ``infos``: arrays (or nested dicts of arrays)
    with leading axis N, e.g. ``qpos``, ``qvel``, ``action_log_probs``.
    """

    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminals: np.ndarray
    timeouts: np.ndarray
    next_observations: np.ndarray
    metadata: dict = field(default_factory=dict)
    infos: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(np.shape(self.rewards)[0])

    @property
    def obs_dim(self) -> int:
        return int(np.shape(self.observations)[1])

    @property
    def act_dim(self) -> int:
        return int(np.shape(self.actions)[1])

    @property
    def env_id(self) -> Optional[str]:
        return self.metadata.get("env_id")

    def episode_ends(self) -> np.ndarray:
        """Row indices where an episode ends (terminal or timeout)."""
        return np.flatnonzero(np.asarray(self.terminals) | np.asarray(self.timeouts))

    def episode_slices(self) -> list[slice]:
        """The complete episodes as row slices; a trailing partial episode is left out."""
        ends = self.episode_ends()
        starts = np.concatenate([[0], ends[:-1] + 1])
        return [slice(int(s), int(e) + 1) for s, e in zip(starts, ends)]

    def episode_returns(self) -> np.ndarray:
        """Undiscounted returns of the complete episodes (ending at a terminal or a timeout)."""
        ends = self.episode_ends()
        if len(ends) == 0:
            return np.zeros(0)
        csum = np.concatenate([[0.0], np.cumsum(np.asarray(self.rewards, np.float64))])
        starts = np.concatenate([[0], ends[:-1] + 1])
        return csum[ends + 1] - csum[starts]

    def transitions(self, unit_actions: bool = False):
        """The rows as a ``buffers.replay.Transition`` of numpy arrays (terminated / truncated kept apart).

        ``unit_actions``: rescale actions from the env's bounds to the agent's [-1, 1] (bounds from
        ``metadata['action_low'/'action_high']``, else from the env ``env_id`` names).
        """
        from plasticity_zoo.buffers.replay import Transition

        actions = np.asarray(self.actions, np.float32)
        if unit_actions:
            low, high = self.action_bounds()
            actions = (2.0 * (actions - low) / (high - low) - 1.0).astype(np.float32)
        return Transition(
            np.asarray(self.observations, np.float32),
            actions,
            np.asarray(self.rewards, np.float32),
            np.asarray(self.next_observations, np.float32),
            np.asarray(self.terminals, bool),
            np.asarray(self.timeouts, bool),
        )

    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """The env's action bounds the actions are expressed in (metadata first, then the env)."""
        if "action_low" in self.metadata and "action_high" in self.metadata:
            return (
                np.asarray(self.metadata["action_low"], np.float32),
                np.asarray(self.metadata["action_high"], np.float32),
            )
        if self.env_id is None:
            raise DatasetError("dataset has neither metadata action_low/action_high nor env_id: action bounds unknown")
        s = env_spaces(self.env_id)
        return s.action_low.astype(np.float32), s.action_high.astype(np.float32)

    def select(self, rows) -> "Dataset":
        """A new dataset of the given rows (a slice, index array or mask); metadata is copied."""
        pick = lambda x: np.asarray(x)[rows]  # noqa: E731
        return Dataset(
            *(pick(getattr(self, k)) for k in KEYS), metadata=dict(self.metadata), infos=_map_tree(pick, self.infos)
        )


def _map_tree(fn, tree):
    return {k: _map_tree(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}/")
        else:
            yield prefix + k, v


def concatenate(parts: list[Dataset], metadata: Optional[dict] = None) -> Dataset:
    """Rows of several datasets one after another (infos kept where every part has them)."""
    if not parts:
        raise DatasetError("nothing to concatenate")
    arrays = [np.concatenate([np.asarray(getattr(p, k)) for p in parts]) for k in KEYS]
    common = set(dict(_leaves(parts[0].infos)))
    for p in parts[1:]:
        common &= set(dict(_leaves(p.infos)))
    infos: dict = {}
    for name in sorted(common):
        node = infos
        *path, last = name.split("/")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = np.concatenate([np.asarray(dict(_leaves(p.infos))[name]) for p in parts])
    return Dataset(*arrays, metadata=dict(parts[0].metadata if metadata is None else metadata), infos=infos)


# ----------------------------------------------------------------------------------------------
# env spaces
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EnvSpaces:
    obs_dim: int
    act_dim: int
    action_low: np.ndarray  # the env's own action bounds (the units datasets store actions in)
    action_high: np.ndarray


@functools.lru_cache(maxsize=None)
def env_spaces(env_id: str) -> EnvSpaces:
    """Observation / action dims and the env's own action bounds behind ``envs.make_env``'s [-1, 1]."""
    from plasticity_zoo.envs.make import UnitActions, make_env

    env = make_env(env_id)
    try:
        low, high = env.action_space.low, env.action_space.high
        inner = env
        while inner is not None:  # the rescaling wrapper knows the env's own bounds
            if isinstance(inner, UnitActions):
                low, high = inner._low, inner._high
                break
            inner = getattr(inner, "env", None)
        return EnvSpaces(
            int(env.observation_space.shape[0]),
            int(env.action_space.shape[0]),
            np.asarray(low, np.float64).copy(),
            np.asarray(high, np.float64).copy(),
        )
    finally:
        env.close()


def to_env_units(actions, env_id: str) -> np.ndarray:
    """Agent actions in [-1, 1] -> the env's action units (affine, as ``envs.make.UnitActions``)."""
    s = env_spaces(env_id)
    a = np.clip(np.asarray(actions, np.float64), -1.0, 1.0)
    return (s.action_low + (a + 1.0) * 0.5 * (s.action_high - s.action_low)).astype(np.float32)


def _family(env_id: str) -> str:
    """'hopper' for Hopper-v4/-v5/hopper-medium-v2; else the id without its version, lower case."""
    return d4rl_name(env_id) or re.sub(r"-v\d+$", "", env_id).lower()


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def validate(dataset: Dataset, env_id: Optional[str] = None, path=None) -> Dataset:
    """Check structure, dtypes, lengths, finiteness, flags and (with an env id) dims and action bounds.

    ``env_id`` defaults to ``metadata['env_id']``.  Raises ``DatasetError`` naming ``path`` (or
    "dataset") and the problem; returns the dataset unchanged.
    """
    where = str(path) if path is not None else "dataset"
    arrays = {}
    for k in KEYS:
        x = getattr(dataset, k)
        if not isinstance(x, np.ndarray):
            raise DatasetError(f"{where}: {k} is a {type(x).__name__}, expected a numpy array")
        arrays[k] = x
    for k in FLOAT_KEYS:
        if arrays[k].dtype != np.float32:
            raise DatasetError(f"{where}: {k} has dtype {arrays[k].dtype}, expected float32")
    for k in BOOL_KEYS:
        if arrays[k].dtype != np.bool_:
            raise DatasetError(f"{where}: {k} has dtype {arrays[k].dtype}, expected bool")
    for k, nd in (
        ("observations", 2),
        ("actions", 2),
        ("next_observations", 2),
        ("rewards", 1),
        ("terminals", 1),
        ("timeouts", 1),
    ):
        if arrays[k].ndim != nd:
            raise DatasetError(f"{where}: {k} has shape {arrays[k].shape}, expected {nd} dimension(s)")
    lengths = {k: arrays[k].shape[0] for k in KEYS}
    for name, x in _leaves(dataset.infos, "infos/"):
        lengths[name] = np.shape(x)[0] if np.ndim(x) else -1
    if len(set(lengths.values())) != 1:
        raise DatasetError(
            f"{where}: arrays disagree on the number of rows N: " + ", ".join(f"{k}={n}" for k, n in lengths.items())
        )
    n = lengths["rewards"]
    if n == 0:
        raise DatasetError(f"{where}: the dataset is empty (N = 0)")
    if arrays["next_observations"].shape[1] != arrays["observations"].shape[1]:
        raise DatasetError(
            f"{where}: next_observations have dim {arrays['next_observations'].shape[1]} but "
            f"observations have dim {arrays['observations'].shape[1]}"
        )
    for k in FLOAT_KEYS:
        bad = ~np.isfinite(arrays[k])
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            raise DatasetError(f"{where}: {k} has {int(bad.sum())} non-finite value(s), first in row {row}")
    both = arrays["terminals"] & arrays["timeouts"]
    if both.any():
        rows = np.flatnonzero(both)
        raise DatasetError(
            f"{where}: {len(rows)} row(s) have both terminal and timeout set (first: row {rows[0]}); "
            "a row ends its episode either by termination or by time limit"
        )
    meta_env = dataset.metadata.get("env_id") if isinstance(dataset.metadata, dict) else None
    if env_id is not None and isinstance(meta_env, str) and _family(env_id) != _family(meta_env):
        raise DatasetError(f"{where}: the dataset was made on {meta_env!r}, not {env_id!r}")
    env_id = env_id if env_id is not None else meta_env
    if env_id is not None:
        try:
            s = env_spaces(env_id)
        except ValueError as e:
            raise DatasetError(f"{where}: cannot check against env {env_id!r}: {e}") from e
        if dataset.obs_dim != s.obs_dim:
            raise DatasetError(f"{where}: observations have dim {dataset.obs_dim} but {env_id} has obs dim {s.obs_dim}")
        if dataset.act_dim != s.act_dim:
            raise DatasetError(f"{where}: actions have dim {dataset.act_dim} but {env_id} has act dim {s.act_dim}")
        tol = 1e-5 + 1e-5 * np.maximum(np.abs(s.action_low), np.abs(s.action_high))
        out = (arrays["actions"] < s.action_low - tol) | (arrays["actions"] > s.action_high + tol)
        if out.any():
            r, c = (int(i) for i in np.argwhere(out)[0])
            raise DatasetError(
                f"{where}: {int(out.sum())} action value(s) outside {env_id}'s action bounds "
                f"[{s.action_low[c]:g}, {s.action_high[c]:g}] (first: row {r}, dim {c}, value "
                f"{arrays['actions'][r, c]:g}); actions are stored in the env's own units"
            )
    return dataset


_validate = validate  # ``load`` has a parameter named ``validate``


def check_continuity(dataset: Dataset, atol: float = 1e-5) -> np.ndarray:
    """Rows i (not an episode end, i < N-1) where next_observations[i] != observations[i+1].

    An empty result means every within-episode successor is the next row's observation.  Episode
    ends are not covered here (the next row is a reset); ``check_transitions`` replays those.
    """
    obs, nxt = np.asarray(dataset.observations), np.asarray(dataset.next_observations)
    if len(obs) < 2:
        return np.zeros(0, np.int64)
    end = (np.asarray(dataset.terminals) | np.asarray(dataset.timeouts))[:-1]
    close = np.all(np.abs(nxt[:-1] - obs[1:]) <= atol + 1e-5 * np.abs(obs[1:]), axis=1)
    return np.flatnonzero(~end & ~close)


def check_transitions(dataset: Dataset, env_id: Optional[str] = None, rows=None, atol: float = 1e-4) -> np.ndarray:
    """Replay rows in the simulator from ``infos/qpos, qvel``: the rows whose (next obs, reward, terminal) differ.

    This checks that (observations[i], next_observations[i]) is a real transition on any row,
    episode ends included (what D4RL's ``qlearning_dataset`` breaks).  Needs a Gymnasium MuJoCo env
    and the qpos/qvel infos.
    """
    env_id = env_id or dataset.env_id
    if env_id is None:
        raise DatasetError("check_transitions needs an env id (argument or metadata env_id)")
    if "qpos" not in dataset.infos or "qvel" not in dataset.infos:
        raise DatasetError("check_transitions needs infos/qpos and infos/qvel (simulator states)")
    from plasticity_zoo.envs.make import make_env

    env = make_env(env_id)
    sim = env.unwrapped
    if not hasattr(sim, "set_state"):
        env.close()
        raise DatasetError(f"check_transitions: {env_id} is not a MuJoCo env with set_state")
    env.reset(seed=0)
    rows = np.arange(len(dataset)) if rows is None else np.asarray(rows)
    bad = []
    try:
        for i in rows:
            sim.set_state(
                np.asarray(dataset.infos["qpos"][i], np.float64), np.asarray(dataset.infos["qvel"][i], np.float64)
            )
            obs, reward, terminated, _, _ = sim.step(np.asarray(dataset.actions[i], np.float64))
            ok = (
                np.allclose(np.asarray(obs, np.float32), dataset.next_observations[i], atol=atol, rtol=1e-4)
                and np.isclose(reward, dataset.rewards[i], atol=atol, rtol=1e-4)
                and bool(terminated) == bool(dataset.terminals[i])
            )
            if not ok:
                bad.append(int(i))
    finally:
        env.close()
    return np.asarray(bad, np.int64)


# ----------------------------------------------------------------------------------------------
# HDF5 I/O
# ----------------------------------------------------------------------------------------------
def _check_key(k, where):
    if not isinstance(k, str) or not k or "/" in k:
        raise DatasetError(f"{where}: key {k!r} must be a non-empty string without '/'")


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def _write_meta(group, meta: dict, where: str):
    """Write metadata so that a round trip keeps every key and python type (``py_type`` attrs)."""
    import h5py

    for k, v in meta.items():
        _check_key(k, where)
        if isinstance(v, dict):
            _write_meta(group.create_group(k), v, f"{where}/{k}")
        elif isinstance(v, bool):
            group.create_dataset(k, data=np.bool_(v)).attrs["py_type"] = "bool"
        elif isinstance(v, str):
            group.create_dataset(k, data=v, dtype=h5py.string_dtype()).attrs["py_type"] = "str"
        elif isinstance(v, int) and not isinstance(v, bool):
            group.create_dataset(k, data=np.int64(v)).attrs["py_type"] = "int"
        elif isinstance(v, float):
            group.create_dataset(k, data=np.float64(v)).attrs["py_type"] = "float"
        elif v is None or isinstance(v, (list, tuple)):
            try:
                text = json.dumps(v, default=_json_default)
            except TypeError as e:
                raise DatasetError(f"{where}/{k}: cannot store {v!r} ({e})") from e
            group.create_dataset(k, data=text, dtype=h5py.string_dtype()).attrs["py_type"] = "json"
        elif isinstance(v, (np.ndarray, np.generic)):
            arr = np.asarray(v)
            if arr.dtype.kind == "U":
                group.create_dataset(k, data=arr.astype(object), dtype=h5py.string_dtype()).attrs["py_type"] = (
                    "str_array"
                )
            elif arr.dtype.kind in "biufc":
                group.create_dataset(k, data=arr)
            else:
                raise DatasetError(f"{where}/{k}: arrays of dtype {arr.dtype} cannot be stored")
        else:
            raise DatasetError(
                f"{where}/{k}: values of type {type(v).__name__} cannot be stored in metadata "
                "(use str, int, float, bool, None, lists, numpy arrays or dicts)"
            )


def _plain(v):
    """An HDF5 attribute value as a python value (foreign files store metadata as attrs)."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) and v.dtype.kind in "OS":
        return np.array([x.decode() if isinstance(x, bytes) else x for x in v.ravel()]).reshape(v.shape)
    return v


def _read_meta(group) -> dict:
    import h5py

    out = {k: _plain(v) for k, v in group.attrs.items()}
    for k, item in group.items():
        if isinstance(item, h5py.Group):
            out[k] = _read_meta(item)
            continue
        kind = item.attrs.get("py_type")
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind == "str":
            out[k] = item.asstr()[()]
        elif kind == "int":
            out[k] = int(item[()])
        elif kind == "float":
            out[k] = float(item[()])
        elif kind == "bool":
            out[k] = bool(item[()])
        elif kind == "json":
            out[k] = json.loads(item.asstr()[()])
        elif kind == "str_array":
            out[k] = np.asarray(item.asstr()[()], dtype=str)
        elif item.dtype.kind in "OS":  # foreign strings (e.g. D4RL's metadata/algorithm)
            v = item[()]
            out[k] = _plain(v) if item.shape == () else _plain(np.asarray(v))
        else:
            out[k] = item[()]
    return out


def _write_infos(group, infos: dict, where: str):
    for k, v in infos.items():
        _check_key(k, where)
        if isinstance(v, dict):
            _write_infos(group.create_group(k), v, f"{where}/{k}")
        else:
            group.create_dataset(k, data=np.asarray(v))


def _read_infos(group) -> dict:
    import h5py

    return {k: _read_infos(v) if isinstance(v, h5py.Group) else v[()] for k, v in group.items()}


def save(path, dataset: Dataset, compression: Optional[str] = None) -> Path:
    """Write ``dataset`` to ``path`` in the flat D4RL layout, atomically (temp file + rename).

    The dataset is validated first (without an env); metadata keep their python types on a round
    trip (see ``Dataset``).  ``compression``: an h5py filter for the big arrays (e.g. "gzip").
    """
    import h5py

    path = Path(path)
    validate(dataset, env_id=None, path=path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = "d4rl"
            f.attrs["rlzoo_format_version"] = FORMAT_VERSION
            for k in KEYS:
                f.create_dataset(k, data=getattr(dataset, k), compression=compression)
            _write_infos(f.create_group("infos"), dataset.infos, f"{path}: infos")
            _write_meta(f.create_group("metadata"), dataset.metadata, f"{path}: metadata")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _coerce(name: str, x: np.ndarray, where: str) -> np.ndarray:
    """Float keys: any float dtype -> float32.  Bool keys: bool, or 0/1 integers/floats -> bool."""
    if name in FLOAT_KEYS:
        if x.dtype.kind != "f":
            raise DatasetError(f"{where}: {name} has dtype {x.dtype}, expected a float dtype (float32)")
        return x.astype(np.float32, copy=False)
    if x.dtype == np.bool_:
        return x
    if x.dtype.kind in "iuf" and np.all((x == 0) | (x == 1)):
        return x.astype(bool)
    raise DatasetError(f"{where}: {name} has dtype {x.dtype} with values other than 0/1, expected bool")


def load(path, env_id: Optional[str] = None, validate: bool = True, allow_missing_next: bool = False) -> Dataset:
    """Read a D4RL-layout HDF5 file (ours or an original D4RL one).

    ``env_id`` (or ``metadata['env_id']``) enables the dim and action-bound checks.  A file without
    ``next_observations`` is refused (dynamics-model targets need the true successors) unless
    ``allow_missing_next``: then successors are rebuilt as ``observations[i+1]`` within episodes,
    each episode's last row (where the successor is unknown) and the file's last row are dropped,
    and the row before a dropped end is marked as a timeout (a warning says how many rows went).
    """
    import h5py

    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such dataset file")
    minari = [d for d in (path / "data", path) if path.is_dir() and (d / "metadata.json").is_file()]
    if minari:  # a Minari dataset's folder (or its data folder)
        raise DatasetError(minari_file_hint(minari[0] / "main_data.hdf5"))
    arrays: dict = {}
    try:
        with h5py.File(path, "r") as f:
            required = [k for k in KEYS if k != "next_observations" or not allow_missing_next]
            missing = [k for k in required if k not in f]
            if missing == ["next_observations"]:
                raise DatasetError(
                    f"{path}: has no next_observations; the true next observations are needed ("
                    "observations[i+1] is the next episode's reset state at an episode end, which corrupts "
                    "dynamics-model targets). Pass allow_missing_next=True to rebuild them within episodes "
                    "and drop the rows where they are unknown."
                )
            if missing and any(re.fullmatch(r"episode_\d+", k) for k in f):
                raise DatasetError(minari_file_hint(path))
            if missing:
                raise DatasetError(
                    f"{path}: missing key(s) {', '.join(missing)} (the file has: {', '.join(sorted(f))})"
                )
            for k in KEYS:
                if k in f:
                    if not isinstance(f[k], h5py.Dataset):
                        raise DatasetError(f"{path}: {k} is a group, expected an array")
                    arrays[k] = _coerce(k, f[k][()], str(path))
            infos = _read_infos(f["infos"]) if "infos" in f else {}
            metadata = _read_meta(f["metadata"]) if "metadata" in f else {}
    except DatasetError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as e:
        raise DatasetError(f"{path}: unreadable or corrupt HDF5 file ({e})") from e
    if "next_observations" not in arrays:
        ds = _rebuild_next(arrays, infos, metadata, path)
    else:
        ds = Dataset(**arrays, metadata=metadata, infos=infos)
    if validate:
        _validate(ds, env_id=env_id, path=path)
    return ds


def _rebuild_next(arrays, infos, metadata, path) -> Dataset:
    obs = arrays["observations"]
    n = len(obs)
    end = arrays["terminals"] | arrays["timeouts"]
    keep = ~end
    keep[-1] = False
    nxt = np.empty_like(obs)
    nxt[:-1] = obs[1:]
    before_end = np.zeros(n, bool)
    before_end[:-1] = end[1:]
    timeouts = arrays["timeouts"] | (before_end & keep)  # the episode now ends one row earlier
    rows = np.flatnonzero(keep)
    warnings.warn(
        f"{path}: next_observations rebuilt from observations[i+1]; dropped {n - len(rows)} rows "
        f"(episode ends incl. {int(arrays['terminals'].sum())} terminals, and the last row)"
    )
    meta = dict(metadata, next_observations_rebuilt=True, rows_dropped=int(n - len(rows)))
    return Dataset(
        obs[rows],
        arrays["actions"][rows],
        arrays["rewards"][rows],
        arrays["terminals"][rows],
        timeouts[rows],
        nxt[rows],
        metadata=meta,
        infos=_map_tree(lambda x: np.asarray(x)[rows], infos),
    )


# ----------------------------------------------------------------------------------------------
# Minari paths, for ``load``'s hint (reading and converting Minari datasets: envs/minari_data.py)
# ----------------------------------------------------------------------------------------------
def minari_root(root=None) -> Path:
    """``root``, else ``$MINARI_DATASETS_PATH``, else Minari's default ``~/.minari/datasets``."""
    if root is not None:
        return Path(root)
    return Path(os.environ.get("MINARI_DATASETS_PATH") or Path.home() / ".minari" / "datasets")


def minari_file_hint(path) -> str:
    """What to do with a Minari file (``<root>/<id>/data/main_data.hdf5``) or folder given as ``--dataset PATH``:
    train on it as ``--dataset minari:<id>`` (``envs/minari_data.py`` converts it once), with
    ``MINARI_DATASETS_PATH`` pointing at its root where that is not the Minari data path in use."""
    path = Path(path)
    name = None
    try:
        name = json.loads((path.parent / "metadata.json").read_text()).get("dataset_id")
    except (OSError, ValueError, AttributeError):
        pass
    head = f"{path if path.exists() else path.parent}: a Minari dataset, not the zoo's flat D4RL layout"
    data = path.parent.resolve()
    parts = len(Path(name).parts) if isinstance(name, str) else 0
    root = data.parents[parts] if 0 < parts < len(data.parents) else None
    if root is None or data != root / name / "data":
        return (
            f"{head}; train on it with --dataset minari:<id>, its Minari id, with MINARI_DATASETS_PATH set to "
            "the folder holding <id>/data/ (converted once into the dataset cache; docs/offline-data.md)"
        )
    env = "" if root == minari_root().expanduser().resolve() else f" with MINARI_DATASETS_PATH={root}"
    return (
        f"{head}; train on it with --dataset minari:{name}{env} (converted once into the dataset cache; "
        "docs/offline-data.md)"
    )


# ----------------------------------------------------------------------------------------------
# cache
# ----------------------------------------------------------------------------------------------
def cache_dir(root=None) -> Path:
    """``root``, else ``$RLZOO_DATASETS``, else ``~/.cache/rlzoo/datasets``."""
    if root is not None:
        return Path(root)
    return Path(os.environ.get("RLZOO_DATASETS") or Path.home() / ".cache" / "rlzoo" / "datasets")


def dataset_name(env_id: str) -> str:
    """'hopper' for the D4RL envs, else the id without version, lower case, [a-z0-9_] only."""
    return d4rl_name(env_id) or re.sub(r"[^a-z0-9]+", "_", re.sub(r"-v\d+$", "", env_id).lower()).strip("_")


def cached_path(env_id: str, kind: str, root=None) -> Path:
    """``<cache>/<name>-<kind>-v<env version>.hdf5``, e.g. hopper-medium-v5.hdf5 for Hopper-v5."""
    if kind not in KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; kinds: {', '.join(KINDS)}")
    m = re.search(r"-v(\d+)$", env_id)
    version = f"-v{m.group(1)}" if m else ""
    return cache_dir(root) / f"{dataset_name(env_id)}-{kind}{version}.hdf5"


def find(env_id: str, kind: str, root=None) -> Path:
    """The cached dataset file, or a ``DatasetError`` listing the cache and the command that makes it."""
    path = cached_path(env_id, kind, root)
    if path.exists():
        return path
    base = cache_dir(root)
    have = sorted(p.name for p in base.glob("*.hdf5")) if base.is_dir() else []
    cache_flag = f" --cache {base}" if root is not None else ""
    raise DatasetError(
        f"no {kind} dataset for {env_id}: {path} does not exist; the cache {base} holds: "
        f"{', '.join(have) or 'nothing'}. Make it with: python scripts/make_dataset.py "
        f"--env {env_id} --kind {kind}{cache_flag}"
    )
