"""Minari datasets for the offline agents: ``--dataset minari:<id>`` (docs/offline-data.md).

A dataset present under the Minari data path (``$MINARI_DATASETS_PATH``, else Minari's default
``~/.minari/datasets``) is read through the ``minari`` package (the optional extra
``pip install -e '.[minari]'``) and converted once into the zoo's flat D4RL layout
(``envs/datasets.py``), cached at ``<dataset cache>/minari/<id>.hdf5`` (the cache is
``--dataset-root``, else ``$RLZOO_DATASETS``, else ``~/.cache/rlzoo/datasets``).  Later runs reuse
the conversion while the source is unchanged (same files, sizes and modification times, and the
same converter version); a changed source is converted again, and the files derived from the old
conversion (cached dynamics models, ``<converted file>.*``) are removed.  Nothing is downloaded.

Conversion, per Minari episode of T steps (``observations`` has T + 1 rows, the last being the
final observation):

- ``observations = obs[:T]``, ``next_observations = obs[1:]`` (the true successors, also at the end);
- ``terminals = terminations``; ``timeouts = truncations`` where not terminated (a step that is both,
  a termination on the time limit's last step, is a termination: nothing to bootstrap from);
- an episode whose last step has neither flag (the collection stopped mid-episode) ends in a
  timeout: the data are cut there, and its successor is a real state to bootstrap from;
- ``infos`` leaves of T + 1 rows (Minari records the reset's info first) keep their first T rows,
  aligned with ``observations``; other infos are left out;
- actions stay in the env's units; ``metadata`` gets ``env_id`` (for evaluation: the id of the
  dataset's ``eval_env_spec``, else its ``env_spec``), ``ref_min_score`` / ``ref_max_score`` where
  Minari has them, the action bounds, ``kind`` where the dataset's name is one of the zoo's kinds,
  and the Minari metadata and source (``minari_*`` keys).

Observation and action spaces must be flat ``Box`` spaces (what the offline agents take).

``load_minari`` reads an HDF5 Minari dataset straight into memory without the ``minari`` package
(Minari's episode layout, ``minari/dataset/_storages/hdf5_storage.py``; observations = obs[:-1],
next_observations = obs[1:], terminations / truncations as terminals / timeouts as they are).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from plasticity_zoo.envs import datasets
from plasticity_zoo.envs.datasets import Dataset, DatasetError

PREFIX = "minari:"
CONVERTER_VERSION = 1  # raise it when the conversion changes: cached conversions are then redone
INSTALL = "pip install -e '.[minari]'"
_ID = re.compile(r"[A-Za-z0-9_][-\w.]*(/[-\w.]+)*")


def is_minari(spec) -> bool:
    """Whether a ``--dataset`` value names a Minari dataset (``minari:<id>``)."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def dataset_id(spec: str) -> str:
    """``minari:mujoco/hopper/medium-v0`` -> ``mujoco/hopper/medium-v0`` (a malformed id: DatasetError)."""
    name = spec[len(PREFIX) :] if is_minari(spec) else spec
    if not _ID.fullmatch(name) or ".." in name.split("/"):
        raise DatasetError(
            f"--dataset {spec}: not a Minari dataset id; the form is minari:<namespace>/<name>-v<k>, "
            "e.g. minari:mujoco/hopper/medium-v0"
        )
    return name


def _version(path: Path) -> int:
    m = re.search(r"-v(\d+)$", path.name)
    return int(m.group(1)) if m else -1


def local_ids(root: Path, depth: int = 5) -> list[str]:
    """The ids of the datasets under a Minari data path (folders ``<id>/data`` with a ``metadata.json``;
    ids of at most ``depth`` parts, so that a wrong path to a big tree is not walked whole)."""
    if not root.is_dir():
        return []
    found = (p for n in range(1, depth + 1) for p in root.glob("/".join(["*"] * n) + "/data/metadata.json"))
    return sorted(str(p.parent.parent.relative_to(root)) for p in found)


def locate(name: str, root=None) -> tuple[str, Path]:
    """-> (the id with its version, the dataset's ``data`` folder) under the Minari data path ``root``
    (default: ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``).  An id without ``-v<k>`` takes the
    newest version present.  Absent: a one-line DatasetError naming the path searched and how to get
    it.  Creates nothing."""
    base = datasets.minari_root(root)
    if not re.search(r"-v\d+$", name):
        stem, parent = Path(name).name, (base / name).parent
        found = (
            [
                p
                for p in parent.glob(f"{stem}-v*")
                if re.fullmatch(rf"{re.escape(stem)}-v\d+", p.name) and (p / "data").is_dir()
            ]
            if parent.is_dir()
            else []
        )  # medium: not medium-replay-v0
        if found:
            name = str(Path(name).parent / max(found, key=_version).name)
    data = base / name / "data"
    if not (data / "metadata.json").is_file():
        where = (
            "the given Minari root"
            if root is not None
            else "$MINARI_DATASETS_PATH"
            if os.environ.get("MINARI_DATASETS_PATH")
            else "Minari's default data path"
        )
        present = local_ids(base)
        raise DatasetError(
            f"Minari dataset {name} is not present: looked for {data} ({where} {base}; nothing is "
            f"downloaded here); get it with: minari download {name}"
            + (f" (present: {', '.join(present[:10])}{', ...' if len(present) > 10 else ''})" if present else "")
        )
    return name, data


def source_fingerprint(data: Path) -> str:
    """A digest of the files under a Minari ``data`` folder (relative path, size, modification time)
    and of ``CONVERTER_VERSION``: it changes when the dataset or the conversion does.  Reads no data."""
    entries = [
        [str(p.relative_to(data)), p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(data.rglob("*"))
        if p.is_file()
    ]
    text = json.dumps({"converter": CONVERTER_VERSION, "files": entries})
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_path(name: str, cache_root=None) -> Path:
    """``<dataset cache>/minari/<id>.hdf5``."""
    return datasets.cache_dir(cache_root) / "minari" / f"{name}.hdf5"


def cached_fingerprint(path: Path) -> Optional[str]:
    """The source fingerprint a converted file records (None: no such file, or not readable as one)."""
    import h5py

    if not path.is_file():
        return None
    try:
        with h5py.File(path, "r") as f:
            item = f.get("metadata/minari_source_fingerprint")
            return item.asstr()[()] if item is not None else None
    except (OSError, KeyError, ValueError, TypeError):
        return None


# ----------------------------------------------------------------------------------------------
# one episode, the metadata
# ----------------------------------------------------------------------------------------------
def _flat_infos(infos, prefix="") -> dict:
    out = {}
    for k, v in (infos or {}).items():
        if isinstance(v, dict):
            out.update(_flat_infos(v, f"{prefix}{k}/"))
        else:
            out[prefix + str(k)] = v
    return out


def episode_infos(infos, t: int) -> dict:
    """Numeric info leaves with T + 1 rows -> their first T rows (aligned with the observations), as nested dicts."""
    out: dict = {}
    for name, v in _flat_infos(infos).items():
        arr = np.asarray(v)
        parts = name.split("/")
        if arr.dtype.kind not in "biuf" or arr.ndim == 0 or len(arr) != t + 1 or not all(parts):
            continue
        node = out
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = arr[:t]
    return out


def episode_rows(ep, where: str = "episode") -> tuple[Dataset, bool]:
    """One Minari episode (``observations`` T + 1 rows; ``actions``, ``rewards``, ``terminations``,
    ``truncations`` T rows) -> (its T rows in the zoo's layout, whether it ended without a flag and
    was closed with a timeout).  Array-valued (Box) observations and actions only."""
    obs, act = ep.observations, ep.actions
    if not isinstance(obs, np.ndarray) or not isinstance(act, np.ndarray):
        raise DatasetError(
            f"{where}: observations / actions are {type(obs).__name__} / {type(act).__name__}, "
            "not arrays (Dict or Tuple spaces are not supported)"
        )
    rewards = np.asarray(ep.rewards)
    t = len(rewards)
    if len(obs) != t + 1:
        raise DatasetError(f"{where}: {len(obs)} observations for {t} steps, expected {t + 1} (the last one final)")
    term = np.asarray(ep.terminations, bool).reshape(t)
    trunc = np.asarray(ep.truncations, bool).reshape(t)
    early = np.flatnonzero((term | trunc)[:-1])
    if len(early):
        raise DatasetError(f"{where}: flagged terminated / truncated at step {early[0]} of {t}, before its last step")
    timeouts = trunc & ~term
    cut = not (term[-1] or trunc[-1])
    timeouts[-1] |= cut
    obs = np.asarray(obs).reshape(t + 1, -1)
    rows = Dataset(
        obs[:-1].astype(np.float32),
        np.asarray(act).reshape(t, -1).astype(np.float32),
        rewards.reshape(t).astype(np.float32),
        term,
        timeouts,
        obs[1:].astype(np.float32),
        infos=episode_infos(ep.infos, t),
    )
    return rows, cut


def _spec(text) -> Optional[dict]:
    if not isinstance(text, str):
        return None
    try:
        spec = json.loads(text)
    except ValueError:
        return None
    return spec if isinstance(spec, dict) and isinstance(spec.get("id"), str) else None


def eval_env(raw: dict) -> tuple[Optional[str], Optional[str]]:
    """-> (the env id to evaluate on: the dataset's ``eval_env_spec`` id, else its ``env_spec`` id;
    a note when that spec differs from the id's registration, which the zoo's evaluation builds)."""
    spec = _spec(raw.get("eval_env_spec")) or _spec(raw.get("env_spec"))
    if spec is None:
        return None, None
    env_id = spec["id"]
    import gymnasium as gym

    try:
        registered = gym.spec(env_id)
    except gym.error.Error:
        return env_id, f"{env_id} is not registered with Gymnasium in this process"
    differs = []
    kwargs = {k: v for k, v in (spec.get("kwargs") or {}).items() if k != "render_mode"}
    default = {k: v for k, v in (registered.kwargs or {}).items() if k != "render_mode"}
    changed = {k: v for k, v in kwargs.items() if k not in default or default[k] != v}
    if changed:
        differs.append(f"kwargs {json.dumps(changed, sort_keys=True)}")
    if spec.get("max_episode_steps") not in (None, registered.max_episode_steps):
        differs.append(f"max_episode_steps {spec['max_episode_steps']} (registered: {registered.max_episode_steps})")
    if spec.get("additional_wrappers"):
        differs.append(
            "additional wrappers "
            + ", ".join(str(w.get("name", w)) if isinstance(w, dict) else str(w) for w in spec["additional_wrappers"])
        )
    if not differs:
        return env_id, None
    return (
        env_id,
        f"the dataset's env spec differs from {env_id} as registered ({'; '.join(differs)}): "
        f"the zoo evaluates on {env_id} as registered",
    )


def _finite_float(v) -> Optional[float]:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if np.isfinite(x) else None


def metadata(raw: dict, name: str, data: Path, fingerprint: str, action_space, counts: dict) -> dict:
    """The converted file's metadata from Minari's ``metadata.json`` (``raw``) and the conversion."""
    env_id, note = eval_env(raw)
    meta: dict = {
        "minari_dataset_id": name,
        "minari_source": str(data.absolute()),
        "minari_source_fingerprint": fingerprint,
        "minari_converter_version": CONVERTER_VERSION,
        "minari_metadata": json.dumps(raw, sort_keys=True, default=str),
        **counts,
    }
    if env_id is not None:
        meta["env_id"] = env_id
    if note:
        meta["minari_eval_note"] = note
    for k in ("env_spec", "eval_env_spec", "minari_version", "algorithm_name"):
        if isinstance(raw.get(k), str):
            meta["minari_" + k.removeprefix("minari_")] = raw[k]
    for k in ("ref_min_score", "ref_max_score"):
        x = _finite_float(raw.get(k))
        if x is not None:
            meta[k] = x
            meta[k.replace("_score", "_source")] = "minari"
    low, high = np.asarray(action_space.low, np.float32), np.asarray(action_space.high, np.float32)
    if np.all(np.isfinite(low)) and np.all(np.isfinite(high)):
        meta["action_low"], meta["action_high"] = low.reshape(-1), high.reshape(-1)
    kind = re.sub(r"-v\d+$", "", Path(name).name)
    if kind in datasets.KINDS:
        meta["kind"] = kind
    return meta


# ----------------------------------------------------------------------------------------------
# conversion
# ----------------------------------------------------------------------------------------------
def require_minari():
    """The ``minari`` module, or a one-line DatasetError saying how to install the extra."""
    try:
        import minari
    except ImportError as e:
        raise DatasetError(
            f"Minari datasets (--dataset minari:<id>) need the minari package, which is not "
            f"installed ({e}); install the extra: {INSTALL}"
        ) from None
    return minari


def _check_space(space, what: str, name: str):
    from gymnasium import spaces

    if not isinstance(space, spaces.Box) or len(space.shape) != 1:
        raise DatasetError(
            f"Minari dataset {name}: its {what} space is {space}; the offline agents take flat Box {what}s only"
        )


def to_dataset(source, name: str, data: Path, fingerprint: str) -> Dataset:
    """A ``minari.MinariDataset`` (``source``) as one flat dataset in the zoo's layout (validated)."""
    _check_space(source.observation_space, "observation", name)
    _check_space(source.action_space, "action", name)
    parts, cut, both = [], 0, 0
    for ep in source.iterate_episodes():
        if len(ep.rewards) == 0:
            continue
        rows, was_cut = episode_rows(ep, f"Minari dataset {name}, episode {ep.id}")
        parts.append(rows)
        cut += int(was_cut)
        both += int(np.asarray(ep.terminations, bool)[-1] and np.asarray(ep.truncations, bool)[-1])
    if not parts:
        raise DatasetError(f"Minari dataset {name} ({data}) holds no steps")
    raw = json.loads((data / "metadata.json").read_text())
    counts = {"minari_episodes": len(parts), "minari_cut_episodes": cut, "minari_terminated_and_truncated": both}
    meta = metadata(raw, name, data, fingerprint, source.action_space, counts)
    return datasets.validate(datasets.concatenate(parts, metadata=meta), env_id=None, path=data)


def _read(minari, data: Path, name: str):
    try:
        return minari.MinariDataset(data)
    except ImportError as e:  # e.g. an arrow dataset without pyarrow
        raise DatasetError(
            f"Minari dataset {name} ({data}) needs a package that is not installed ({e}); "
            "arrow / parquet datasets need: pip install 'minari[arrow]'"
        ) from None
    except (ValueError, KeyError, OSError, AssertionError, TypeError) as e:
        raise DatasetError(
            f"Minari dataset {name} ({data}) cannot be read by minari {minari.__version__}: {type(e).__name__}: {e}"
        ) from None


def derived_files(path: Path) -> list[Path]:
    """Files made from a converted dataset beside it (``<file>.dynamics-<seed>.npz``, ``<file>.neubay-<seed>.npz``)."""
    return sorted(p for p in path.parent.glob(f"{path.name}.*") if p.is_file()) if path.parent.is_dir() else []


def convert(spec: str, root=None, cache_root=None, log: Callable = print) -> Path:
    """``--dataset minari:<id>`` -> the path of its conversion to the zoo's layout (made now, or reused).

    ``root``: the Minari data path (default ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``);
    ``cache_root``: the dataset cache (``datasets.cache_dir``).  Raises DatasetError (one line) for a
    malformed or absent id, a missing ``minari`` package, or a dataset the agents cannot take.
    """
    name = dataset_id(spec)
    minari = require_minari()
    name, data = locate(name, root)
    fingerprint = source_fingerprint(data)
    path = cache_path(name, cache_root)
    old = cached_fingerprint(path)
    if old == fingerprint:
        return path
    log(
        f"converting Minari dataset {name} ({data}) to the zoo's layout: {path}"
        + (" (its source changed since the last conversion)" if old is not None else "")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # minari's own notes on missing authors, permalinks, ...
        try:
            ds = to_dataset(_read(minari, data, name), name, data, fingerprint)
        except DatasetError:
            raise
        except (OSError, KeyError, ValueError, RuntimeError, TypeError) as e:  # h5py / minari reading the episodes
            raise DatasetError(
                f"Minari dataset {name} ({data}): unreadable or corrupt ({type(e).__name__}: {e})"
            ) from None
    stale = derived_files(path) if path.exists() else []
    datasets.save(path, ds)
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        log(f"removed {len(stale)} file(s) made from the previous conversion: {', '.join(p.name for p in stale)}")
    if "minari_eval_note" in ds.metadata:
        log(f"note: {ds.metadata['minari_eval_note']}")
    log(
        f"converted {len(ds)} steps in {ds.metadata['minari_episodes']} episodes (env {ds.env_id}); "
        "later runs reuse the conversion while the source is unchanged"
    )
    return path


resolve = convert  # what training/loops/offline.py calls for ``--dataset minari:<id>``


# ----------------------------------------------------------------------------------------------
# reading an HDF5 Minari dataset without the minari package
# ----------------------------------------------------------------------------------------------
def _minari_data_dir(name_or_path, root) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p.parent
    if p.is_dir():
        return p / "data" if (p / "data").is_dir() else p
    base = datasets.minari_root(root)
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
    """Read a Minari HDF5 dataset (Farama-Foundation/Minari's HDF5 storage) without the ``minari``
    package, as a flat D4RL dataset.

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
            meta = {**{k: datasets._plain(v) for k, v in f.attrs.items()}, **meta}
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
                    k: datasets._coerce(
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
                        for k, v in datasets._read_infos(g["infos"]).items()  # T or T+1 long
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
    ds = datasets.concatenate(episodes, metadata=meta)
    return datasets.validate(ds, env_id=None, path=file)
