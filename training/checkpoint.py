"""Checkpoints that resume a run exactly, verified before they are read.

A checkpoint is a directory ``ckpt/step_<N>/`` holding

- ``arrays.npz``: every leaf of the device pytrees (agent state with optimizer states and
  counters, replay buffer, rng key), each named by its path in the tree (``array_names``: dict
  keys, dataclass / NamedTuple field names and sequence indices joined by ``/``, e.g.
  ``agent/actor_params/trunk/layers/0/kernel/value`` for the agent state of a host loop's
  ``RunTree``) and restored by that path into a template built by the same ``init`` (names, shapes
  and dtypes are checked array by array; a mismatch names the first differing path).  Checkpoints
  of format 2 and older named them ``leaf_00000``, ... by leaf index; they still load, by index.
  A large leaf (at least
  ``TRIM_MIN_BYTES``) is stored without its trailing run of rows, along its longest axis, whose
  elements all hold the bits of its last element: the unfilled rows of a replay buffer (zeros;
  LAP's step array: -1), so a checkpoint grows with the filled rows, not the capacity.  Loading
  refills those rows bit for bit (``meta.json["trimmed"]``: full shape, axis and fill bits);
- ``host.pkl``: host-side state (vector envs with their MuJoCo state and generators, the
  pending observation and action, step counters, episode statistics);
- ``meta.json``: format (``FORMAT``), step, leaf count, the array names in leaf order, the trimmed
  leaves and the config;
- ``manifest.json``, written last: the size and sha256 of each of the three files.

It is written to a temporary directory and renamed, so a crash mid-save never leaves a
half-written ``step_*`` directory; the newest ``keep`` checkpoints are kept (and a checkpoint
newer than the one just written, which resume skipped as damaged, is removed).

``load`` checks every file against the manifest before parsing any, and unpickles ``host.pkl``
only from the very bytes it has hashed; ``load_latest`` walks the checkpoints newest first and
falls back past damaged ones, saying which it skipped and why.  The manifest proves integrity
(no truncation, no flipped bit), not authorship: whoever can write a run directory can write a
matching manifest, and ``host.pkl`` is a pickle, so resume only run directories you trust.

Checkpoints written before manifests existed are refused with a message; ``python -m
training.checkpoint trust PATH`` adds a manifest to them (for run directories you trust).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shutil
import sys
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = 3  # 1: no manifest, full arrays (before verification); 2: manifest.json, trimmed leaves;
#            3: arrays named by their path in the tree (2 and 1: ``leaf_00000``, ... by leaf index)
PATH_NAMES = 3  # the first format whose arrays are named by path
FILES = ("arrays.npz", "host.pkl", "meta.json")  # what the manifest must list
TRIM_MIN_BYTES = 1 << 16  # smaller leaves are stored whole


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (the message names the checkpoint and the file)."""


class Unusable(CheckpointError):
    """A checkpoint ``load_latest`` steps past to an older one: damaged, incomplete or unverifiable."""

    def __init__(self, path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"checkpoint {path} is unreadable: {reason}")


class Damaged(Unusable):
    """Missing, truncated or altered files (a failed manifest check or a parse error)."""


class Unverified(Unusable):
    """Written before manifests (format 1): nothing to verify ``host.pkl`` against."""


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_numpy(leaf):
    return np.asarray(jax.random.key_data(leaf)) if _is_key(leaf) else np.asarray(leaf)


def path_for(run_dir, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (``run_dir/ckpt/step_000000001000``)."""
    return Path(run_dir) / "ckpt" / f"step_{step:012d}"


# ------------------------------------------------------------------------------------------- trimming
def _bits(dtype) -> np.dtype | None:
    return np.dtype(f"u{dtype.itemsize}") if dtype.itemsize in (1, 2, 4, 8) else None


def _head(axis: int, n: int):
    return (slice(None),) * axis + (slice(0, n),)


def trim(x: np.ndarray) -> tuple[np.ndarray, dict | None]:
    """``x`` without its trailing rows (along its longest axis) that hold only the bits of its last
    element, and what ``untrim`` needs to restore it; ``(x, None)`` when nothing is cut."""
    bits = _bits(x.dtype)
    if x.ndim == 0 or x.nbytes < TRIM_MIN_BYTES or bits is None:
        return x, None
    x = np.ascontiguousarray(x)
    axis = int(np.argmax(x.shape))
    u = x.view(bits)
    fill = u.reshape(-1)[-1]
    differs = np.any(u != fill, axis=tuple(i for i in range(x.ndim) if i != axis))
    rows = np.flatnonzero(differs)
    keep = int(rows[-1]) + 1 if rows.size else 0
    if keep == x.shape[axis]:
        return x, None
    info = {"shape": list(x.shape), "axis": axis, "fill": fill.tobytes().hex()}
    return np.ascontiguousarray(x[_head(axis, keep)]), info


def untrim(x: np.ndarray, info: dict | None) -> np.ndarray:
    """Inverse of ``trim``: ``x`` refilled to ``info["shape"]`` with the fill bits."""
    if info is None:
        return x
    shape, axis, bits = tuple(info["shape"]), int(info["axis"]), _bits(x.dtype)
    head = tuple(s if i == axis else shape[i] for i, s in enumerate(x.shape))
    if bits is None or len(shape) != x.ndim or head != x.shape or x.shape[axis] > shape[axis]:
        raise ValueError(f"stored {x.dtype}{x.shape} does not fit the recorded shape {shape} (axis {axis})")
    full = np.empty(shape, x.dtype)
    full.view(bits)[...] = np.frombuffer(bytes.fromhex(info["fill"]), bits)[0]
    full[_head(axis, x.shape[axis])] = x
    return full


# ------------------------------------------------------------------------------------------- array names
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _component(key) -> str:
    """One key-path entry as a name part: a dict key, a field name, a sequence index."""
    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        return str(key.key)
    if isinstance(key, tu.GetAttrKey):
        return key.name
    if isinstance(key, tu.SequenceKey):
        return str(key.idx)
    if isinstance(key, tu.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def escape(part: str) -> str:
    """``part`` with every character outside ``[A-Za-z0-9_.-]`` written as ``%XX`` (its UTF-8 bytes),
    so a name holds no ``/`` of its own and is safe in a file or zip member name; ``.`` and ``..``
    become ``%2E`` and ``%2E%2E``, the empty string ``%`` (which no escaped string is)."""
    if part in ("", ".", ".."):
        return "%" if not part else "%2E" * len(part)
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in part)


def path_name(path) -> str:
    """A key path (``jax.tree_util.tree_flatten_with_path``) as a name: escaped parts joined by ``/``."""
    return "/".join(escape(_component(k)) for k in path) if path else "%"


def array_names(tree) -> list[str]:
    """The name of each leaf of ``tree`` in leaf order: its path (``path_name``); names that still
    coincide (a dict with keys ``1`` and ``"1"``) get ``~2``, ``~3``, ... in leaf order (``~`` is
    escaped in parts, so a suffixed name is no other leaf's)."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = path_name(path)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}~{seen[name]}")
    return names


def _leaf_key(i: int) -> str:
    """An array's name in checkpoints of format 2 and older."""
    return f"leaf_{i:05d}"


def write_npz(file: Path, arrays: dict):
    """``np.savez`` (uncompressed, one ``<name>.npy`` member per array), without its keyword
    arguments, which an array named ``file`` or ``allow_pickle`` would collide with."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, x in arrays.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(x), allow_pickle=False)


def _mismatch(path, want: list[str], have: list[str]) -> str | None:
    """Why checkpoint ``path``, holding the arrays ``have``, does not fit a template whose arrays are
    ``want`` (both in leaf order): the first path of each that the other lacks; None if they hold
    the same names (in any order: arrays are matched by name)."""
    have_set, want_set = set(have), set(want)
    missing = [n for n in want if n not in have_set]
    unknown = [n for n in have if n not in want_set]
    if not missing and not unknown:
        return None
    parts = (
        [f"it has no array {missing[0]}" + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")]
        if missing
        else []
    )
    parts += (
        [
            f"its array {unknown[0]} is not in this config"
            + (f" (nor {len(unknown) - 1} more)" if len(unknown) > 1 else "")
        ]
        if unknown
        else []
    )
    return (
        f"checkpoint {path} does not fit this config: {'; '.join(parts)}: was it written with another "
        "agent or network config?"
    )


# ------------------------------------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(path: Path, step: int, fmt: int = FORMAT, **extra):
    files = {name: {"bytes": (path / name).stat().st_size, "sha256": _sha256(path / name)} for name in FILES}
    with open(path / "manifest.json", "w") as f:
        json.dump({"format": fmt, "step": step, "files": files, **extra}, f, indent=2)


def _read_json(path: Path, name: str) -> dict:
    try:
        d = json.loads((path / name).read_text())
    except (OSError, ValueError) as e:
        raise Damaged(path, f"{name} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(d, dict):
        raise Damaged(path, f"{name} is not a JSON object")
    return d


def verify(path) -> dict:
    """Check every file of checkpoint ``path`` against its ``manifest.json`` (size, then sha256);
    returns the manifest.  Raises ``Damaged`` or ``Unverified`` naming the file and the fault."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        try:
            legacy = "format" not in json.loads((path / "meta.json").read_text())
        except (OSError, ValueError, TypeError):
            legacy = False
        if legacy:
            raise Unverified(
                path,
                "it was written before checkpoints carried a manifest.json, so host.pkl "
                "(a pickle) cannot be verified before it is loaded; if you trust this run "
                f"directory, add one with: python -m plasticity_zoo.training.checkpoint trust {path}",
            )
        raise Damaged(path, "manifest.json missing (an incomplete or damaged checkpoint)")
    manifest = _read_json(path, "manifest.json")
    files = manifest.get("files")
    if not isinstance(files, dict) or any(name not in files for name in FILES):
        raise Damaged(path, f"manifest.json does not list {', '.join(FILES)}")
    for name in FILES:
        want, file = files[name], path / name
        if not file.is_file():
            raise Damaged(path, f"{name} missing")
        size = file.stat().st_size
        if size != want.get("bytes"):
            raise Damaged(
                path, f"{name} is {size} bytes, manifest.json says {want.get('bytes')} (truncated or damaged)"
            )
        if _sha256(file) != want.get("sha256"):
            raise Damaged(path, f"{name} sha256 mismatch (damaged)")
    return manifest


# ------------------------------------------------------------------------------------------- save / load
def save(run_dir, step: int, tree, host: dict, meta: dict | None = None, keep: int = 2) -> Path:
    """Write the checkpoint of ``step`` (``tree``: device pytree, ``host``: picklable dict, ``meta``:
    JSON extras) atomically, then keep the newest ``keep`` checkpoints; returns its path."""
    if keep < 1:
        raise ValueError(f"--keep-checkpoints must be >= 1, got {keep}")
    final = path_for(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp_step_*"):  # left by a save that was killed (one writer per run directory)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp_{final.name}"
    tmp.mkdir()
    leaves, names = jax.tree.leaves(tree), array_names(tree)
    arrays, trimmed = {}, {}
    for name, leaf in zip(names, leaves):
        arrays[name], info = trim(_to_numpy(leaf))
        if info is not None:
            trimmed[name] = info
    write_npz(tmp / "arrays.npz", arrays)
    with open(tmp / "host.pkl", "wb") as f:
        pickle.dump(host, f, protocol=pickle.HIGHEST_PROTOCOL)
    with open(tmp / "meta.json", "w") as f:
        json.dump(
            {
                "format": FORMAT,
                "step": step,
                "leaves": len(leaves),
                "arrays": names,
                "trimmed": trimmed,
                **(meta or {}),
            },
            f,
            indent=2,
        )
    _write_manifest(tmp, step)  # last: a checkpoint with a valid manifest is complete
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    found = sorted(p for p in root.glob("step_*"))
    skipped = [p for p in found if p.name > final.name]  # passed over by a resume (damaged)
    older = [p for p in found if p.name <= final.name]
    for old in skipped + older[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir) -> Path | None:
    """The newest checkpoint directory of ``run_dir`` by step, unverified (``load_latest`` verifies)."""
    found = sorted((Path(run_dir) / "ckpt").glob("step_*"))
    return found[-1] if found else None


def load(path, template):
    """Restore (tree, host, meta) from checkpoint ``path`` into the structure of ``template``.

    Every file is checked against ``manifest.json`` first (``Damaged`` / ``Unverified`` otherwise);
    ``host.pkl`` is unpickled only from the bytes whose sha256 matched.  Arrays are matched to the
    template's leaves by path (format 3), or by leaf index in checkpoints of format 2 and older.  A
    checkpoint of another config raises a plain ``CheckpointError`` naming the first differing path."""
    path = Path(path)
    manifest = verify(path)
    meta = _read_json(path, "meta.json")
    name = "host.pkl"
    try:
        blob = (path / name).read_bytes()
        if hashlib.sha256(blob).hexdigest() != manifest["files"][name]["sha256"]:
            raise Damaged(path, f"{name} changed while it was read")
        host = pickle.loads(blob)
        name = "arrays.npz"
        with np.load(path / name, allow_pickle=False) as z:
            stored = {k: z[k] for k in z.files}
        name = "meta.json"
        by_path = int(meta.get("format", 1)) >= PATH_NAMES
        count, trimmed = int(meta["leaves"]), meta.get("trimmed", {})
        have = [str(n) for n in meta["arrays"]] if by_path else None
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError) as e:
        if isinstance(e, Unusable):
            raise
        raise Damaged(path, f"{name} is unreadable ({type(e).__name__}: {e})") from e
    leaves, treedef = jax.tree.flatten(template)
    names = array_names(template)
    if by_path:
        why = _mismatch(path, names, have)
        if why is not None:
            raise CheckpointError(why)
        keys = names
    elif count != len(leaves):
        raise CheckpointError(
            f"checkpoint {path} (format {meta.get('format', 1)}: arrays by leaf index) holds "
            f"{count} arrays but this config expects {len(leaves)}: was it written with another "
            "agent or network config?"
        )
    else:
        keys = [_leaf_key(i) for i in range(len(leaves))]
    restored = []
    for i, (ref, key, name) in enumerate(zip(leaves, keys, names)):
        if key not in stored:
            raise Damaged(path, f"arrays.npz has no {key}")
        try:
            x = untrim(stored[key], trimmed.get(key))
        except (ValueError, TypeError, KeyError) as e:
            raise Damaged(path, f"arrays.npz {key}: {e}") from e
        ref_np = _to_numpy(ref)
        if x.shape != ref_np.shape or x.dtype != ref_np.dtype:
            where = name if by_path else f"{i} ({name} in this config)"
            raise CheckpointError(
                f"checkpoint {path} array {where} is {x.dtype}{x.shape}, expected "
                f"{ref_np.dtype}{ref_np.shape}: config mismatch"
            )
        restored.append(
            jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(ref)) if _is_key(ref) else jnp.asarray(x)
        )
    return jax.tree.unflatten(treedef, restored), host, meta


def load_latest(run_dir, template, warn=None):
    """Load the newest intact checkpoint of ``run_dir`` -> ``(tree, host, meta, path)``.

    Checkpoints that fail verification are skipped, each with one ``warning: skipping checkpoint
    ...; resuming from ...`` line (``warn``, default: stderr); a checkpoint of another config
    stops the walk.  Raises ``CheckpointError`` listing every fault if none is usable."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    root = Path(run_dir) / "ckpt"
    found = sorted(root.glob("step_*"), reverse=True)
    if not found:
        raise CheckpointError(f"no checkpoint found in {root}")
    skipped = []
    for path in found:
        try:
            tree, host, meta = load(path, template)
        except Unusable as e:
            skipped.append(e)
            continue
        for bad in skipped:
            warn(f"warning: skipping checkpoint {bad.path}: {bad.reason}; resuming from {path}")
        return tree, host, meta, path
    faults = "; ".join(f"{bad.path.name}: {bad.reason}" for bad in skipped)
    raise CheckpointError(f"no usable checkpoint in {root}: {faults}")


# ------------------------------------------------------------------------------------------- trust
def trust(path) -> list[Path]:
    """Add a manifest to the format-1 checkpoints at ``path`` (a checkpoint or a run directory).

    Only for run directories you trust: the manifest records the files as they are now."""
    path = Path(path)
    dirs = [path] if (path / "meta.json").is_file() else sorted((path / "ckpt").glob("step_*"))
    done = []
    for d in dirs:
        if (d / "manifest.json").is_file():
            continue
        meta = _read_json(d, "meta.json")
        if "format" in meta:
            raise Damaged(d, "manifest.json missing from a checkpoint that should have one; not adding one")
        missing = [name for name in FILES if not (d / name).is_file()]
        if missing:
            raise Damaged(d, f"{', '.join(missing)} missing")
        _write_manifest(
            d, int(meta["step"]), fmt=1, trusted="added by `python -m plasticity_zoo.training.checkpoint trust`"
        )
        done.append(d)
    return done


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m plasticity_zoo.training.checkpoint",
        description="Add manifests to checkpoints written before manifests existed.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trust", help="add manifest.json to the old checkpoints of trusted run directories")
    p.add_argument("paths", nargs="+", help="run directories or checkpoint directories")
    args = parser.parse_args(argv)
    for path in args.paths:
        try:
            done = trust(path)
        except CheckpointError as e:
            raise SystemExit(f"error: {e}") from e
        print(f"{path}: added manifest.json to {len(done)} checkpoint(s)" + "".join(f"\n  {d}" for d in done))


if __name__ == "__main__":
    main()
