"""Offline datasets in the D4RL layout: load, validate, save, collect, score (D4RL, Fu et al. 2020; Minari).

"spec N" tags below name topics of the project's offline-data notes: 1.1 HDF5 layout, 1.2 the
``qlearning_dataset`` pitfall, 1.3 normalised scores, 2.1 how D4RL was generated, 2.2 Minari, 2.3 the
regeneration procedure on Gymnasium v5.

A dataset is one flat HDF5 file (spec 1.1)::

    observations [N, obs] float32     actions [N, act] float32 (env units)    rewards [N] float32
    terminals [N] bool                timeouts [N] bool                       next_observations [N, obs] float32
    infos/<k>    arrays with leading N (qpos, qvel, action_log_probs, ...)
    metadata/<k> scalars, strings, arrays and nested groups (e.g. metadata/policy/<layer>/<param>)

``next_observations`` are the *true* successors s_{t+1}, also at episode ends (spec 1.2: never
rebuild them from ``observations[i+1]``, which is the next episode's reset state at an end).
``terminals`` (a real termination) and ``timeouts`` (a time-limit cut) stay separate and are
never both set on a row.  Actions are stored in the env's own action units (D4RL's convention;
the gym-mujoco locomotion bounds are [-1, 1], so agent units and env units coincide there).

Minari datasets reach the offline agents through ``envs/minari_data.py`` (``--dataset minari:<id>``,
converted once with the ``minari`` package); a Minari file given as a path is refused with that hint.

Also here: Minari HDF5 datasets read without the ``minari`` package (spec 2.2), D4RL normalised
scores (spec 1.3) and the project's own references, the dataset cache, and ``collect`` (roll a
policy in a vector env into a dataset; used by scripts/make_dataset.py, spec 2.3).
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

KINDS = ("random", "medium", "medium-replay", "expert", "medium-expert")
KEYS = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")
FLOAT_KEYS = ("observations", "actions", "rewards", "next_observations")
BOOL_KEYS = ("terminals", "timeouts")
# D4RL's REF_MIN_SCORE / REF_MAX_SCORE (d4rl/infos.py; the same for every dataset type, v0-v2; spec 1.3).
D4RL_REF = {"halfcheetah": (-280.178953, 12135.0), "hopper": (-20.272305, 3234.3), "walker2d": (1.629008, 4592.3)}
MAX_EPISODE_STEPS = 1000  # D4RL caps episodes at 1000 steps (spec 2.1)
REF_SEED = 123  # Minari's reference episodes reset from seed 123 (spec 2.2)
FORMAT_VERSION = 1


class DatasetError(ValueError):
    """A dataset file or array that cannot be used; the message names the file and the problem."""


@dataclass
class Dataset:
    """The flat D4RL arrays (spec 1.1) plus ``metadata`` and ``infos``.

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
    """Rows i (not an episode end, i < N-1) where next_observations[i] != observations[i+1] (spec 1.2).

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

    This checks spec 1.2's "(observations[i], next_observations[i]) is a real transition" on any
    row, episode ends included.  Needs a Gymnasium MuJoCo env and the qpos/qvel infos.
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
    ``next_observations`` is refused (spec 1.2 needs the true successors) unless
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
                    f"{path}: has no next_observations; the true next observations are needed (spec 1.2: "
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
# Minari
# ----------------------------------------------------------------------------------------------
def minari_root(root=None) -> Path:
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


def _minari_data_dir(name_or_path, root) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p.parent
    if p.is_dir():
        return p / "data" if (p / "data").is_dir() else p
    base = minari_root(root)
    name = str(name_or_path)
    if not re.search(r"-v\d+$", name):  # no version: the newest one present
        found = sorted(
            base.glob(f"{name}-v*"),
            key=lambda q: int(re.search(r"-v(\d+)$", q.name).group(1)) if re.search(r"-v(\d+)$", q.name) else -1,
        )
        if found:
            return found[-1] / "data"
    return base / name / "data"


def load_minari(name_or_path, root=None) -> Dataset:
    """Read a Minari HDF5 dataset (spec 2.2) without the ``minari`` package, as a flat D4RL dataset.

    ``name_or_path``: a dataset id ``<namespace>/<env>/<name>[-v<k>]`` under ``root`` (default
    ``$MINARI_DATASETS_PATH`` or ``~/.minari/datasets``), or a dataset / data directory, or the
    ``main_data.hdf5`` file.  Each ``episode_<id>`` group's ``observations`` (one longer than the
    other arrays) give observations = obs[:-1] and next_observations = obs[1:]; ``terminations`` /
    ``truncations`` become ``terminals`` / ``timeouts``.  Dataset metadata (``data/metadata.json``
    and the file's root attributes, e.g. ``ref_min_score``/``ref_max_score``) go to ``metadata``;
    ``env_id`` comes from the env spec.
    """
    import h5py

    data = _minari_data_dir(name_or_path, root)
    file = data / "main_data.hdf5"
    meta: dict = {}
    meta_file = data / "metadata.json"
    if meta_file.exists():
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as e:
            raise DatasetError(f"{meta_file}: unreadable Minari metadata ({e})") from e
    fmt = meta.get("data_format", "hdf5")
    if fmt != "hdf5" or not file.exists():
        present = sorted(q.name for q in data.iterdir()) if data.is_dir() else []
        why = (
            f"its data_format is {fmt!r}; only the HDF5 format is readable without the minari package"
            if fmt != "hdf5"
            else "no such file"
        )
        raise DatasetError(
            f"Minari dataset {name_or_path!r}: looked for {file} ({why}); "
            f"{data} holds: {', '.join(present) or 'nothing'}"
        )
    episodes = []
    try:
        with h5py.File(file, "r") as f:
            meta = {**{k: _plain(v) for k, v in f.attrs.items()}, **meta}
            names = sorted((k for k in f if re.fullmatch(r"episode_\d+", k)), key=lambda k: int(k.split("_")[1]))
            if not names:
                raise DatasetError(f"{file}: no episode_<id> groups")
            for name in names:
                g = f[name]
                for k in ("observations", "actions", "rewards", "terminations", "truncations"):
                    if k not in g:
                        raise DatasetError(f"{file}: {name} has no {k}")
                    if not isinstance(g[k], h5py.Dataset):
                        raise DatasetError(f"{file}: {name}/{k} is a group (dict/tuple spaces are not supported)")
                obs = np.asarray(g["observations"][()])
                t = len(g["rewards"])
                if len(obs) != t + 1:
                    raise DatasetError(f"{file}: {name} has {len(obs)} observations for {t} steps, expected {t + 1}")
                ep = {
                    "observations": obs[:-1],
                    "next_observations": obs[1:],
                    "actions": g["actions"][()],
                    "rewards": g["rewards"][()],
                    "terminals": g["terminations"][()],
                    "timeouts": g["truncations"][()],
                }
                ep = {
                    k: _coerce(
                        k,
                        np.asarray(v).reshape(t, -1)
                        if k in ("observations", "next_observations", "actions")
                        else np.asarray(v).reshape(t),
                        f"{file}: {name}",
                    )
                    for k, v in ep.items()
                }
                infos = {}
                if "infos" in g and isinstance(g["infos"], h5py.Group):
                    infos = {
                        k: np.asarray(v)[:t]
                        for k, v in _read_infos(g["infos"]).items()  # T or T+1 long
                        if not isinstance(v, dict) and np.ndim(v) and len(v) >= t
                    }
                episodes.append(Dataset(**ep, infos=infos))
    except DatasetError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as e:
        raise DatasetError(f"{file}: unreadable or corrupt Minari HDF5 file ({e})") from e
    spec = meta.get("env_spec")
    if isinstance(spec, str):
        try:
            meta["env_id"] = json.loads(spec).get("id")
        except ValueError:
            pass
    meta.setdefault("minari_dataset", str(name_or_path))
    ds = concatenate(episodes, metadata=meta)
    return validate(ds, env_id=None, path=file)


# ----------------------------------------------------------------------------------------------
# scores
# ----------------------------------------------------------------------------------------------
def gymnasium_id(name: str) -> str:
    """'hopper' / 'hopper-medium-v2' -> 'Hopper-v5'; Gymnasium ids pass through."""
    short = d4rl_name(name)
    ids = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}
    if short in ids and name.lower().startswith(short):
        return ids[short]
    return name


def d4rl_name(env_id) -> Optional[str]:
    """'halfcheetah' / 'hopper' / 'walker2d' for Gymnasium ids (Hopper-v5), D4RL names (hopper-medium-v2)
    or Minari ids (mujoco/hopper/medium-v0); None otherwise (Control Suite and ns: ids included)."""
    if not isinstance(env_id, str) or ":" in env_id:
        return None
    for part in env_id.split("/"):
        head = re.split(r"[-_]", part.strip().lower())[0]
        if head in D4RL_REF:
            return head
    return None


def normalized_score(returns, env_id=None, metadata=None, reference: str = "d4rl"):
    """100 * (R - min) / (max - min)  (spec 1.3).

    ``reference="d4rl"``: D4RL's constants for ``env_id`` (or ``metadata['env_id']``);
    ``"dataset"``: the dataset's own ``ref_min_score`` / ``ref_max_score`` (uniform-random and
    expert means, spec 2.3).  ``returns``: a number or an array.  A missing reference (absent,
    None or NaN, e.g. a random-only dataset made without a SAC run: ``ref_max_source`` "missing")
    raises a ValueError rather than giving NaN.
    """
    metadata = metadata or {}
    if reference == "d4rl":
        env = env_id if env_id is not None else metadata.get("env_id")
        name = d4rl_name(env)
        if name is None:
            raise ValueError(
                f"no D4RL reference scores for env {env!r}: D4RL has them for "
                f"{', '.join(D4RL_REF)} only; use reference='dataset'"
            )
        lo, hi = D4RL_REF[name]
    elif reference == "dataset":
        if "ref_min_score" not in metadata or "ref_max_score" not in metadata:
            raise ValueError(
                "reference='dataset' needs metadata ref_min_score and ref_max_score "
                f"(this metadata has: {', '.join(sorted(metadata)) or 'nothing'})"
            )
        refs = {k: metadata[k] for k in ("ref_min_score", "ref_max_score")}
        missing = [k for k, v in refs.items() if v is None or not np.isfinite(np.asarray(v, np.float64))]
        if missing:
            sources = ", ".join(f"{k} = {metadata[k]!r}" for k in ("ref_min_source", "ref_max_source") if k in metadata)
            raise ValueError(
                f"the dataset has no usable {' / '.join(missing)} "
                f"({', '.join(f'{k} = {refs[k]!r}' for k in missing)}{'; ' + sources if sources else ''}): "
                "normalised scores against the dataset's references are unavailable"
                + ("; use reference='d4rl'" if d4rl_name(env_id or metadata.get("env_id")) else "")
            )
        lo, hi = float(refs["ref_min_score"]), float(refs["ref_max_score"])
        if hi == lo:
            raise ValueError(f"ref_max_score equals ref_min_score ({hi}); the normalised score is undefined")
    else:
        raise ValueError(f"unknown reference {reference!r}; use 'd4rl' or 'dataset'")
    r = np.asarray(returns, np.float64)
    out = 100.0 * (r - lo) / (hi - lo)
    return float(out) if out.ndim == 0 else out


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


# ----------------------------------------------------------------------------------------------
# collection (spec 2.3)
# ----------------------------------------------------------------------------------------------
def collect(
    env_id: str,
    policy: Callable,
    size: int,
    seed: int,
    num_envs: int = 1,
    max_episode_steps: int = MAX_EPISODE_STEPS,
    record_state: bool = True,
) -> Dataset:
    """Roll ``policy`` in ``num_envs`` parallel envs until ``size`` rows of whole episodes are in, then cut to ``size``.

    ``policy(obs[E, obs_dim]) -> actions[E, act_dim]`` in [-1, 1], or ``(actions, log_probs[E])``.
    Episodes are written one after another in the order they finish (so the last one may be
    partial, as in D4RL), capped at ``max_episode_steps`` (a cap counts as a timeout);
    ``terminals`` = terminated, ``timeouts`` = truncated, ``next_observations`` the true successors.
    ``infos``: ``qpos``/``qvel`` (state before the step; MuJoCo envs, ``record_state``) and
    ``action_log_probs`` when the policy returns them.  Episodes still running at the end are
    discarded, a small bias toward short episodes when ``num_envs`` is large relative to ``size``.
    """
    from plasticity_zoo.envs.make import make_vector_env

    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    venv = make_vector_env(env_id, num_envs, seed)
    sims = [e.unwrapped for e in getattr(venv, "envs", [])]
    record_state = record_state and len(sims) == num_envs and all(hasattr(s, "data") for s in sims)
    cols: dict[str, list] = {k: [] for k in KEYS}
    log_probs, qpos, qvel = [], [], []
    finished: list[tuple[int, int, int]] = []  # (env, first vector step, last vector step)
    start = np.zeros(num_envs, np.int64)
    length = np.zeros(num_envs, np.int64)
    rows, t = 0, 0
    obs = venv.reset()
    try:
        while rows < size:
            out = policy(obs)
            actions, lp = out if isinstance(out, tuple) else (out, None)
            actions = np.asarray(actions, np.float32).reshape(num_envs, -1)
            if record_state:
                qpos.append(np.stack([s.data.qpos.copy() for s in sims]))
                qvel.append(np.stack([s.data.qvel.copy() for s in sims]))
            new_obs, reward, terminated, truncated, next_obs = venv.step(actions)
            length += 1
            capped = (length >= max_episode_steps) & ~(terminated | truncated)
            truncated = truncated | capped
            for i in np.flatnonzero(capped):
                new_obs[i] = venv.stop(int(i))
            for k, v in zip(KEYS, (obs, actions, reward, terminated, truncated, next_obs)):
                cols[k].append(np.asarray(v).copy())
            if lp is not None:
                log_probs.append(np.asarray(lp, np.float32).reshape(num_envs))
            for i in np.flatnonzero(terminated | truncated):
                finished.append((int(i), int(start[i]), t))
                rows += int(length[i])
                start[i], length[i] = t + 1, 0
            obs = new_obs
            t += 1
    finally:
        venv.close()
    stacked = {k: np.stack(v) for k, v in cols.items()}  # (T, E, ...)
    if log_probs:
        stacked["action_log_probs"] = np.stack(log_probs)
    if record_state:
        stacked["qpos"], stacked["qvel"] = np.stack(qpos), np.stack(qvel)
    gathered = {k: np.concatenate([v[s : e + 1, i] for i, s, e in finished])[:size] for k, v in stacked.items()}
    gathered["actions"] = to_env_units(gathered["actions"], env_id)
    infos = {k: gathered.pop(k) for k in ("action_log_probs", "qpos", "qvel") if k in gathered}
    s = env_spaces(env_id)
    ds = Dataset(
        gathered["observations"].astype(np.float32),
        gathered["actions"],
        gathered["rewards"].astype(np.float32),
        gathered["terminals"].astype(bool),
        gathered["timeouts"].astype(bool),
        gathered["next_observations"].astype(np.float32),
        metadata={
            "env_id": env_id,
            "collection_seed": int(seed),
            "num_envs": int(num_envs),
            "max_episode_steps": int(max_episode_steps),
            "action_low": s.action_low.astype(np.float32),
            "action_high": s.action_high.astype(np.float32),
        },
        infos=infos,
    )
    return ds


def evaluate_policy(
    env_id: str, policy: Callable, episodes: int, first_seed: int = REF_SEED, max_episode_steps: int = MAX_EPISODE_STEPS
) -> np.ndarray:
    """Returns of ``episodes`` parallel episodes reset from seeds first_seed, first_seed+1, ... (Minari's
    reference protocol, spec 2.2).  ``policy(obs[E, obs_dim]) -> actions[E, act_dim]`` in [-1, 1]."""
    from plasticity_zoo.envs.make import VectorEnv

    venv = VectorEnv(env_id, episodes, first_seed)
    try:
        obs = venv.reset([first_seed + i for i in range(episodes)])
        returns = np.zeros(episodes)
        done = np.zeros(episodes, bool)
        steps = 0
        while not done.all() and steps < max_episode_steps:
            out = policy(obs)
            actions = out[0] if isinstance(out, tuple) else out
            obs, reward, terminated, truncated, _ = venv.step(np.asarray(actions, np.float32))
            returns += np.where(done, 0.0, reward)
            done |= terminated | truncated
            steps += 1
    finally:
        venv.close()
    return returns
