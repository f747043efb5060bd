"""Checkpoints: verified before they are read, falling back past damaged ones, storing only the filled
rows of large buffers, never unpickling unverified bytes, arrays named by their path in the tree, and
checkpoints of the previous format (arrays named by leaf index) still read (training/checkpoint.py)."""

import json
import pickle
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import sac
from plasticity_zoo.buffers import replay
from plasticity_zoo.training import checkpoint
from plasticity_zoo.training.loops.offpolicy import init_state, train


def _bits(tree):
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x).tobytes()
        for x in jax.tree.leaves(tree)
    ]


def _tree(seeds=2, capacity=200_000, filled=300):
    """A seed-batched replay buffer filled ``filled`` rows deep, a -1-initialised int array (LAP's
    step), a -0.0 and a NaN with a payload in the filled part, small leaves and an rng key."""
    buf = jax.vmap(lambda _: replay.init(capacity, 3, 1))(jnp.arange(seeds))
    rng = np.random.default_rng(0)
    obs = np.zeros((seeds, capacity, 3), np.float32)
    obs[:, :filled] = rng.normal(size=(seeds, filled, 3))
    obs[0, filled - 1, 2] = -0.0
    obs[-1, 5, 0] = np.frombuffer(np.uint32(0x7FC01234).tobytes(), np.float32)[0]
    step = np.full((seeds, capacity), -1, np.int32)
    step[:, :filled] = np.arange(filled)
    buf = buf._replace(data=buf.data._replace(obs=jnp.asarray(obs)), size=jnp.full((seeds,), filled, jnp.int32))
    return {"buffer": buf, "step": jnp.asarray(step), "w": jnp.ones((seeds, 4, 4)), "key": jax.random.key(3)}


def _template(seeds=2, capacity=200_000):
    return _tree(seeds, capacity, filled=1)


def as_format2(path: Path) -> Path:
    """Rewrite checkpoint ``path`` (format 3) into the layout format 2 wrote before arrays were named by
    path: ``arrays.npz`` with ``leaf_00000``, ... in leaf order (the same trimmed arrays), ``meta.json``
    without ``arrays`` and ``trimmed`` keyed by those names, a format-2 manifest; ``host.pkl`` unchanged."""
    import hashlib

    meta = json.loads((path / "meta.json").read_text())
    names = meta.pop("arrays")
    with np.load(path / "arrays.npz") as z:
        arrays = {f"leaf_{i:05d}": z[name] for i, name in enumerate(names)}
    trimmed = {f"leaf_{i:05d}": meta["trimmed"][name] for i, name in enumerate(names) if name in meta["trimmed"]}
    np.savez(path / "arrays.npz", **arrays)
    (path / "meta.json").write_text(json.dumps({**meta, "format": 2, "trimmed": trimmed}, indent=2))
    files = {
        n: {"bytes": (path / n).stat().st_size, "sha256": hashlib.sha256((path / n).read_bytes()).hexdigest()}
        for n in checkpoint.FILES
    }
    (path / "manifest.json").write_text(json.dumps({"format": 2, "step": meta["step"], "files": files}, indent=2))
    return path


def _flip(file: Path, offset=None):
    data = bytearray(file.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x10
    file.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------- format
def test_trim_stores_the_filled_rows_and_refills_the_rest_bit_for_bit():
    tree = _tree()
    for x in jax.tree.leaves(
        jax.tree.map(lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a, tree)
    ):
        x = np.asarray(x)
        stored, info = checkpoint.trim(x)
        back = checkpoint.untrim(stored, info)
        assert back.dtype == x.dtype and back.shape == x.shape and back.tobytes() == x.tobytes()
        if x.nbytes >= checkpoint.TRIM_MIN_BYTES and x.ndim >= 2:
            assert stored.shape[1] <= 300  # the capacity axis is cut after the last filled row
    full = np.random.default_rng(1).normal(size=(100_000, 2)).astype(np.float32)
    assert checkpoint.trim(full)[1] is None  # a full buffer is stored whole
    stored, info = checkpoint.trim(np.ones((100_000,), np.float32))  # a constant array: its fill alone
    assert stored.shape == (0,) and info["fill"] == np.float32(1).tobytes().hex()


def test_checkpoint_size_grows_with_the_filled_rows_not_the_capacity(tmp_path):
    capacity = 1_000_000
    full_bytes = 2 * capacity * (3 + 1 + 1 + 3) * 4 + 2 * capacity * (2 + 4)  # the float fields, flags and step
    sizes = {}
    for filled in (1000, 10_000):
        tree = _tree(2, capacity, filled)
        path = checkpoint.save(tmp_path / str(filled), 1, tree, {"step": 1})
        sizes[filled] = (path / "arrays.npz").stat().st_size
        restored, host, meta = checkpoint.load(path, _template(2, capacity))
        assert _bits(restored) == _bits(tree) and host == {"step": 1} and meta["format"] == checkpoint.FORMAT
    assert sizes[10_000] < 400_000 < full_bytes  # 2 seeds x 16 bytes a filled row (obs and step)
    assert 8 < sizes[10_000] / sizes[1000] < 11


def test_keep_checkpoints_prunes_the_oldest_stale_temporaries_and_skipped_newer_ones(tmp_path):
    tree = _tree(1, 1000, 10)
    for step in (1, 2, 3, 4, 5):
        checkpoint.save(tmp_path, step, tree, {"step": step}, keep=3)
    names = lambda: sorted(p.name for p in (tmp_path / "ckpt").iterdir())  # noqa: E731
    assert names() == ["step_000000000003", "step_000000000004", "step_000000000005"]
    (tmp_path / "ckpt" / ".tmp_step_000000000006").mkdir()  # a save killed midway
    (tmp_path / "ckpt" / ".tmp_step_000000000006" / "arrays.npz").write_bytes(b"PK")
    assert checkpoint.load_latest(tmp_path, _template(1, 1000))[3].name == "step_000000000005"
    # resume fell back to 4 (5 damaged); the next save (at 4 again or later) removes 5 and the temporary
    checkpoint.save(tmp_path, 4, tree, {"step": 4}, keep=3)
    assert names() == ["step_000000000003", "step_000000000004"]
    with pytest.raises(ValueError, match="--keep-checkpoints must be >= 1"):
        checkpoint.save(tmp_path, 6, tree, {}, keep=0)


def test_keep_checkpoints_flag_is_checked_and_may_change_on_resume(tiny_sac_config):
    from plasticity_zoo.training import config as config_lib
    from plasticity_zoo.training.loops.offpolicy import check

    with pytest.raises(ValueError, match="--keep-checkpoints must be >= 1"):
        check(tiny_sac_config(keep_checkpoints=0))
    assert "keep_checkpoints" in config_lib.RESUME_MUTABLE


# ------------------------------------------------------------------------------------------- verification
@pytest.mark.parametrize(
    "damage, reason",
    [
        (
            lambda p: (p / "arrays.npz").write_bytes((p / "arrays.npz").read_bytes()[:100]),
            r"arrays.npz is 100 bytes, manifest.json says \d+ \(truncated or damaged\)",
        ),
        (lambda p: _flip(p / "arrays.npz"), r"arrays.npz sha256 mismatch \(damaged\)"),
        (lambda p: _flip(p / "host.pkl"), r"host.pkl sha256 mismatch \(damaged\)"),
        (lambda p: _flip(p / "meta.json", 3), r"meta.json sha256 mismatch \(damaged\)"),
        (lambda p: (p / "manifest.json").unlink(), r"manifest.json missing \(an incomplete or damaged checkpoint\)"),
        (lambda p: (p / "manifest.json").write_text('{"format": 2, "fi'), r"manifest.json is unreadable"),
        (lambda p: (p / "host.pkl").unlink(), r"host.pkl missing"),
    ],
)
def test_damaged_latest_checkpoint_is_skipped_with_a_message_naming_the_file(tmp_path, damage, reason):
    old, new = _tree(filled=100), _tree(filled=200)
    checkpoint.save(tmp_path, 100, old, {"step": 100})
    path = checkpoint.save(tmp_path, 200, new, {"step": 200})
    damage(path)
    with pytest.raises(checkpoint.Damaged, match=f"checkpoint {re.escape(str(path))} is unreadable: {reason}"):
        checkpoint.load(path, _template())
    warnings = []
    tree, host, meta, used = checkpoint.load_latest(tmp_path, _template(), warn=warnings.append)
    assert used == checkpoint.path_for(tmp_path, 100) and host == {"step": 100} and _bits(tree) == _bits(old)
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: skipping checkpoint {path}: ")
    assert warnings[0].endswith(f"; resuming from {used}")
    # with every checkpoint damaged, the error lists each and why
    _flip(used / "arrays.npz")
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"no usable checkpoint in .*ckpt: step_000000000200: .*; "
        r"step_000000000100: arrays.npz sha256 mismatch",
    ):
        checkpoint.load_latest(tmp_path, _template())


def test_a_checkpoint_of_another_config_stops_the_walk(tmp_path):
    checkpoint.save(tmp_path, 1, _tree(), {})
    checkpoint.save(tmp_path, 2, _tree(), {})
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"step_000000000002 array buffer/data/obs is "
        r"float32\(2, 200000, 3\), expected float32\(2, 100000, 3\): "
        r"config mismatch",
    ):
        checkpoint.load_latest(tmp_path, _template(capacity=100_000))


# ------------------------------------------------------------------------------------------- array names
def test_arrays_are_named_by_their_path_in_the_tree(tmp_path):
    """Dict keys, dataclass / NamedTuple fields and sequence indices, joined by ``/``; a key with a ``/``
    or another unsafe character is escaped; the names are the npz members and meta.json's list."""
    from plasticity_zoo.training.config import NetworkConfig, RunConfig

    cfg = RunConfig(network=NetworkConfig(width=16), agent=sac.SACConfig(buffer_size=1000), agent_name="sac")
    rng = np.random.default_rng(0)  # the loop's tree, traced (nothing compiled), its float arrays random

    def fill(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key(7)
        return jnp.asarray(
            rng.normal(size=x.shape).astype(x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else np.zeros(x.shape, x.dtype)
        )

    tree = jax.tree.map(fill, jax.eval_shape(lambda: init_state(sac, cfg, 3, 1)))
    names = checkpoint.array_names(tree)
    assert len(names) == len(set(names)) == len(jax.tree.leaves(tree))
    for name in (
        "agent/actor_params/trunk/layers/0/kernel/value",
        "agent/critic_params/out/bias/value",
        "agent/actor_opt/0/mu/trunk/layers/1/kernel/value",
        "agent/log_alpha",
        "agent/updates",
        "data/data/obs",
        "data/data/terminated",
        "data/size",
        "key",
    ):
        assert name in names
    # the leaf each name stands for: the kernel of the actor's first layer is (seeds, obs_dim, width)
    leaves = dict(zip(names, jax.tree.leaves(tree)))
    assert leaves["agent/actor_params/trunk/layers/0/kernel/value"].shape == (1, 3, 16)
    assert leaves["data/data/obs"].shape == (1, 1000, 3)
    path = checkpoint.save(tmp_path, 5, tree, {"step": 5})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == checkpoint.FORMAT == 3 and meta["arrays"] == names
    with np.load(path / "arrays.npz") as z:
        assert sorted(z.files) == sorted(names)
        np.testing.assert_array_equal(
            z["agent/actor_params/trunk/layers/0/kernel/value"],
            tree[0].actor_params["trunk"]["layers"][0]["kernel"][...],
        )
    assert _bits(checkpoint.load(path, tree)[0]) == _bits(tree)

    odd = {
        "a/b": jnp.ones(2),
        "": jnp.zeros(1),
        "..": jnp.ones(1),
        "x y%": [jnp.ones(1), (jnp.zeros(3),)],
        "file": jnp.full(2, 7.0),
    }  # `file`: np.savez's own argument name
    assert checkpoint.array_names(odd) == ["%", "%2E%2E", "a%2Fb", "file", "x%20y%25/0", "x%20y%25/1/0"]
    path = checkpoint.save(tmp_path / "odd", 1, odd, {})
    back = checkpoint.load(path, jax.tree.map(jnp.zeros_like, odd))[0]
    assert _bits(back) == _bits(odd)
    assert checkpoint.array_names(jnp.ones(3)) == ["%"]  # a tree that is one array


class _Twice:
    """A pytree node whose two children have the same key (names must still be unique)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    _Twice,
    lambda t: (((jax.tree_util.GetAttrKey("w"), t.a), (jax.tree_util.GetAttrKey("w"), t.b)), None),
    lambda _, children: _Twice(*children),
)


class _Pair:
    """A pytree node with children ``a`` then ``b``; ``_PairReversed``: ``b`` then ``a``."""

    ORDER = ("a", "b")

    def __init__(self, first, second):
        setattr(self, self.ORDER[0], first)
        setattr(self, self.ORDER[1], second)


class _PairReversed(_Pair):
    ORDER = ("b", "a")


for _cls in (_Pair, _PairReversed):
    jax.tree_util.register_pytree_with_keys(
        _cls,
        lambda t: (tuple((jax.tree_util.GetAttrKey(n), getattr(t, n)) for n in t.ORDER), None),
        lambda _, children, cls=_cls: cls(*children),
    )


def test_names_that_would_coincide_are_made_unique_in_leaf_order(tmp_path):
    tree = {"t": _Twice(jnp.ones(2), jnp.zeros(3)), "w~2": jnp.full(1, 5.0)}
    assert checkpoint.array_names(tree) == ["t/w", "t/w~2", "w%7E2"]
    path = checkpoint.save(tmp_path, 1, tree, {})
    back = checkpoint.load(path, {"t": _Twice(jnp.zeros(2), jnp.zeros(3)), "w~2": jnp.zeros(1)})[0]
    assert _bits(back) == _bits(tree)


def test_a_template_of_another_structure_is_refused_naming_the_first_differing_path(tmp_path):
    path = checkpoint.save(tmp_path, 1, _tree(1, 1000, 10), {})
    other = {**_template(1, 1000), "v": jnp.ones(3)}
    del other["w"]
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"does not fit this config: it has no array v; its array w "
        r"is not in this config: was it written with another agent",
    ):
        checkpoint.load(path, other)
    bigger = {**_template(1, 1000), "extra": [jnp.ones(1), jnp.ones(1)]}
    with pytest.raises(checkpoint.CheckpointError, match=r"it has no array extra/0 \(nor 1 more\): "):
        checkpoint.load(path, bigger)
    # the same names in another leaf order load by name, not by position
    path = checkpoint.save(tmp_path / "pair", 1, {"p": _Pair(jnp.ones(2), jnp.zeros(3))}, {})
    back = checkpoint.load(path, {"p": _PairReversed(jnp.ones(3), jnp.ones(2))})[0]["p"]
    assert isinstance(back, _PairReversed) and back.b.shape == (3,) and not back.b.any() and back.a.all()


def test_a_checkpoint_of_the_previous_format_loads_by_leaf_index(tmp_path):
    """Format 2 (``leaf_00000``, ... and no ``arrays`` list) is read by position, trimmed leaves, the key and
    the fallback walk included; a mismatch there names this config's path of the array."""
    old, new = _tree(filled=100), _tree(filled=200)
    checkpoint.save(tmp_path, 100, old, {"step": 100})
    path = as_format2(checkpoint.save(tmp_path, 200, new, {"step": 200}))
    with np.load(path / "arrays.npz") as z:
        assert sorted(z.files) == [f"leaf_{i:05d}" for i in range(len(jax.tree.leaves(new)))]
    assert "arrays" not in json.loads((path / "meta.json").read_text())
    tree, host, meta = checkpoint.load(path, _template())
    assert _bits(tree) == _bits(new) and host == {"step": 200} and meta["format"] == 2
    assert jnp.issubdtype(tree["key"].dtype, jax.dtypes.prng_key)
    assert checkpoint.load_latest(tmp_path, _template())[3] == path
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"step_000000000200 array 0 \(buffer/data/obs in this "
        r"config\) is float32\(2, 200000, 3\), expected",
    ):
        checkpoint.load(path, _template(capacity=100_000))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"\(format 2: arrays by leaf index\) holds 11 arrays but "
        r"this config expects 12",
    ):
        checkpoint.load(path, {**_template(), "x": jnp.ones(1)})
    _flip(path / "arrays.npz")  # still verified against its manifest: damaged, skipped
    warnings = []
    assert checkpoint.load_latest(tmp_path, _template(), warn=warnings.append)[1] == {"step": 100}
    assert "arrays.npz sha256 mismatch" in warnings[0]


class _Payload:
    """A pickle that runs code when loaded: it creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_resume_never_unpickles_bytes_the_manifest_does_not_vouch_for(tmp_path, monkeypatch):
    path = checkpoint.save(tmp_path / "r", 1, _tree(), {"step": 1})
    marker = tmp_path / "code-ran"
    (path / "host.pkl").write_bytes(pickle.dumps({"step": 1, "x": _Payload(marker)}))  # swapped in afterwards
    calls = []
    monkeypatch.setattr(checkpoint.pickle, "loads", lambda b: calls.append(b))
    monkeypatch.setattr(checkpoint.pickle, "load", lambda f: calls.append(f))
    with pytest.raises(checkpoint.CheckpointError, match="host.pkl"):
        checkpoint.load_latest(tmp_path / "r", _template())
    assert calls == [] and not marker.exists()


def test_old_checkpoints_without_a_manifest_are_refused_until_trusted(tmp_path, capsys):
    tree = _tree(1, 1000, 10)
    path = as_format2(checkpoint.save(tmp_path, 7, tree, {"step": 7}))
    (path / "manifest.json").unlink()  # what format 1 wrote: leaf_ names, no manifest, meta without format
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("format", "trimmed")}))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"written before checkpoints carried a manifest.json.*"
        r"python -m plasticity_zoo.training.checkpoint trust ",
    ):
        checkpoint.load_latest(tmp_path, _template(1, 1000))
    checkpoint.main(["trust", str(tmp_path)])
    assert "added manifest.json to 1 checkpoint(s)" in capsys.readouterr().out
    restored, host, _ = checkpoint.load(path, _template(1, 1000))
    assert _bits(restored) == _bits(tree) and host == {"step": 7}
    # a current-format checkpoint that lost its manifest is damaged, not old: trust refuses it
    other = checkpoint.save(tmp_path / "b", 1, tree, {})
    (other / "manifest.json").unlink()
    with pytest.raises(SystemExit, match="manifest.json missing from a checkpoint that should have one"):
        checkpoint.main(["trust", str(other)])


# ------------------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_resume_falls_back_past_a_damaged_latest_checkpoint_and_ends_bit_identical(
    tiny_sac_config, tmp_path, capfd, assert_same_logs
):
    """1M-row replay buffer, 400 steps: checkpoints are small; a truncated arrays.npz or a bit-flipped
    host.pkl at step 400 makes resume say so and continue from 200, ending as the uninterrupted run; the
    step-400 checkpoint rewritten in the previous format (arrays by leaf index) resumes to the same end."""
    cfg = tiny_sac_config(total_steps=600, checkpoint_every=200, buffer_size=1_000_000)
    full = train(cfg, sac, tmp_path / "full")
    train(cfg, sac, tmp_path / "part", stop_at=400)
    part = tmp_path / "part" / "ckpt"
    assert sorted(p.name for p in part.iterdir()) == ["step_000000000200", "step_000000000400"]
    size = sum(f.stat().st_size for f in (part / "step_000000000400").iterdir())
    assert size < 300_000  # the whole buffer would be 1M x 10 fields = 34 MB
    saved, _, _ = checkpoint.load(part / "step_000000000400", init_state(sac, cfg, 3, 1))
    assert int(np.asarray(saved[1].size)[0]) == 400 and saved[1].data.obs.shape == (1, 1_000_000, 3)
    assert not np.asarray(saved[1].data.obs)[:, 400:].any() and np.asarray(saved[1].data.obs)[:, 399].any()
    for name, damage in (
        ("truncated", lambda p: (p / "arrays.npz").write_bytes((p / "arrays.npz").read_bytes()[:-50])),
        ("flipped", lambda p: _flip(p / "host.pkl")),
    ):
        run_dir = tmp_path / name
        shutil.copytree(tmp_path / "part", run_dir)
        damage(checkpoint.path_for(run_dir, 400))
        capfd.readouterr()
        resumed = train(cfg, sac, run_dir, resume=True)
        err = capfd.readouterr().err
        assert f"warning: skipping checkpoint {checkpoint.path_for(run_dir, 400)}: " in err
        assert f"; resuming from {checkpoint.path_for(run_dir, 200)}" in err
        assert resumed["step"] == 600
        assert _bits(resumed["state"]) == _bits(full["state"])
        assert_same_logs(tmp_path / "full", run_dir)
        assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["step_000000000400", "step_000000000600"]
        checkpoint.verify(checkpoint.path_for(run_dir, 400))  # rewritten whole by the resumed run
    # a checkpoint of the previous format (arrays named leaf_00000, ... by index) resumes to the same bits
    run_dir = tmp_path / "format2"
    shutil.copytree(tmp_path / "part", run_dir)
    as_format2(checkpoint.path_for(run_dir, 400))
    capfd.readouterr()
    resumed = train(cfg, sac, run_dir, resume=True)
    assert "skipping" not in capfd.readouterr().err  # resumed from step 400, the old checkpoint
    assert resumed["step"] == 600 and _bits(resumed["state"]) == _bits(full["state"])
    assert_same_logs(tmp_path / "full", run_dir)
    assert json.loads((checkpoint.path_for(run_dir, 600) / "meta.json").read_text())["format"] == checkpoint.FORMAT


def test_a_csv_log_is_never_renamed_over_something_that_is_not_a_regular_file(tmp_path):
    """CSVTable rewrites a table by renaming a temp file over it; a path that is a device such as
    /dev/null (here through a link to it, so a failing check renames over the link, not the device)
    is refused instead of replaced."""
    import os
    import stat

    from plasticity_zoo.training.logger import CSVTable

    link = tmp_path / "null.csv"
    link.symlink_to("/dev/null")
    with pytest.raises(OSError, match="not a regular file"):
        CSVTable(link, ["step", "seed"])
    assert link.is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    table = CSVTable(tmp_path / "ok.csv", ["step", "seed"])
    table.append([{"step": 1, "seed": 0, "new": 2.0}])  # a new column rewrites the file: still a regular one
    assert (tmp_path / "ok.csv").read_text().splitlines() == ["step,seed,new", "1,0,2.0"]
