"""Fixture generator: Neuroplastic Expansion's topology schedule and grow/prune events from the official code.

Runs the *official* ``STL_Scheduler`` (Liu et al., ICLR 2025, arXiv 2410.07994) on the reference's own
``MLPActor`` with fixed weights, fixed dense gradients and a fixed stand-in for training between events,
and writes inputs and outputs to ``tests/fixtures/ne_reference.npz``, which ``tests/test_fidelity_ne.py``
compares against ``plasticity/expansion.py`` and ``plasticity/optim.py`` without torch.

Reference (read from a fetched snapshot, never copied into this repository): torressliu/neuroplastic-expansion,
``NE/STL_Scheduler.py`` (``sparse_set``, ``IndexMaskHook``, ``_create_step_wrapper``, ``STL_Scheduler``),
``NE/utils.py`` (``get_weighted_layers``, ``get_W``, ``show_sparsity``) and ``stl/modules_TD3.py``
(``MLPActor``).  The scheduler is built exactly as ``stl/TD3.py`` builds it with ``stl/train.py``'s defaults:
``STL_Scheduler(actor, Adam(lr=3e-4), static_topo=False, sparsity=0.25, T_end=T, delta=100, zeta=0.5,
grad_accumulation_n=1, use_simple_metric=False, initial_stl_sparsity=0.8, complex_prune=False)`` (so
``uni``, ``init_method`` and ``tau`` keep the scheduler's defaults: uniform 0.008, zero init, tau 0).
Each update calls it as ``TD3.train`` does, ``scheduler(end_grow)`` with ``end_grow = show_sparsity(
actor.state_dict()) <= 0.25`` (its ``state`` argument only feeds an unused ``score_drop``).

Fixed inputs, no random draw inside the reference: the initial masks are the top-|w| of the fixed initial
weights (``weight_sparsify``); the dense gradient of an event is fed through the reference's own
``IndexMaskHook`` (called with a fixed gradient at the update before the event, when its
``check_if_backward_hook_should_accumulate_grad`` holds); every weight and gradient is a distinct random
float, so no ``torch.topk`` tie decides anything (asserted).  Between events the generator stands in for
training: every active weight moves by 0.01 N(0, 1) (so grown zeros become non-zero, as Adam makes them
before the next event), then the scheduler's own ``apply_mask_to_weights`` runs.

The reference's per-layer counts ``n_grow`` / ``n_prune`` are locals of ``_dst_step``; they are read with
``sys.settrace`` (no code changed).  Recorded: ER ``S`` and initial mask counts for three actor shapes;
per event of a T_END-update run the counts, the active connections after it, ``end_grow`` and the
rate; for the events
in ``DETAIL`` the weights, masks and gradient before and the weights and masks after; Adam's ``step``
after the first event (the reference resets it, see docs/fidelity.md); and the first events of a 20 ->
256 -> 256 -> 1 actor whose first layer has a negative initial space.

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 numpy
    /tmp/refvenv/bin/python scripts/fidelity/ne_reference.py --ne /work/.mirror/torressliu+neuroplastic-expansion/repo
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import sys

import numpy as np
import torch
from snapshot import fixture_path, load_definitions, read_snapshot

SCHEDULER_FILE = "NE/STL_Scheduler.py"
UTILS_FILE = "NE/utils.py"
MODULES_FILE = "stl/modules_TD3.py"
OBS, ACT, HIDDEN = 4, 2, 32  # the test MLP: 4 -> 32 -> 32 -> 2
T_END = 40_000  # the scheduler's T_end (train.py: max_timesteps - start_timesteps)
DELTA, ZETA, TARGET, INITIAL = 100, 0.5, 0.25, 0.8  # train.py defaults
EVENTS = T_END // DELTA  # every event of a T_END-update run (growth, then DST to the end)
DETAIL = ("first", "last_growth", "first_dst", "second_dst")
ER_SHAPES = ((OBS, ACT, HIDDEN), (17, 6, 256), (20, 1, 256))  # (obs, act, hidden) of MLPActor
NEG_EVENTS = 3  # events of the (20, 1, 256) actor (first layer: negative initial space)


def load_reference(git_dir):
    sched_src, commit = read_snapshot(git_dir, SCHEDULER_FILE)
    utils = load_definitions(
        read_snapshot(git_dir, UTILS_FILE)[0], UTILS_FILE, {"get_weighted_layers", "get_W", "show_sparsity"}
    )
    # ``from NE.utils import get_W`` cannot import here (no NE package): the snapshot's own get_W is given
    ref = load_definitions(
        sched_src,
        SCHEDULER_FILE,
        {"device", "sparse_set", "IndexMaskHook", "_create_step_wrapper", "STL_Scheduler"},
        overrides={"get_W": utils["get_W"]},
        lazy_annotations=True,
    )
    actor = load_definitions(read_snapshot(git_dir, MODULES_FILE)[0], MODULES_FILE, {"MLPActor"})["MLPActor"]
    return ref, utils, actor, commit


@contextlib.contextmanager
def dst_counts(records: list):
    """Append {layer: (n_grow, n_prune)} of every ``_dst_step`` call run inside (read from its locals)."""

    def local(frame, event, arg):
        if event in ("line", "return") and "n_keep" in frame.f_locals:
            loc = frame.f_locals
            if loc["self"].S[loc["l"]] > 0:  # a dense layer's ``continue`` leaves the last layer's locals
                records[-1][int(loc["l"])] = (int(loc.get("n_grow", loc["n_prune"])), int(loc["n_prune"]))
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_name == "_dst_step" and frame.f_code.co_filename == SCHEDULER_FILE:
            records.append({})
            return local
        return None

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(None)


def make_actor(ref, actor_cls, dims, rng):
    obs, act, hidden = dims
    actor = actor_cls(obs, act, 1.0, hidden_dim=hidden)
    with torch.no_grad():
        for layer in (actor.l1, actor.l2, actor.l3):
            w = rng.normal(size=tuple(layer.weight.shape)) / np.sqrt(layer.weight.shape[1])
            layer.weight.copy_(torch.as_tensor(w, dtype=torch.float32))
            layer.bias.copy_(torch.as_tensor(rng.normal(size=layer.bias.shape[0]) * 0.1, dtype=torch.float32))
    optimizer = torch.optim.Adam(actor.parameters(), lr=3e-4)
    # as stl/TD3.py builds it (train.py defaults)
    sched = ref["STL_Scheduler"](
        actor,
        optimizer,
        static_topo=False,
        sparsity=TARGET,
        T_end=T_END,
        delta=DELTA,
        zeta=ZETA,
        grad_accumulation_n=1,
        use_simple_metric=False,
        initial_stl_sparsity=INITIAL,
        complex_prune=False,
    )
    return actor, optimizer, sched


def run_event(sched, utils, actor, grads, records):
    """One event as TD3.train drives it: updates until the scheduler's next event, the dense gradient fed
    through the reference's hooks at the event's update.  -> (end_grow, drop fraction used)."""
    while True:
        end_grow = utils["show_sparsity"](actor.state_dict(), to_print=False) <= TARGET
        if (sched.step + 1) % sched.delta_T == 0:
            assert sched.check_if_backward_hook_should_accumulate_grad()
            for w, hook, g in zip(sched.W, sched.backward_hook_objects, grads):
                if hook is not None:  # what backward does: the hook's masked gradient lands in .grad
                    w.grad = hook(torch.as_tensor(g))
            with dst_counts(records), contextlib.redirect_stdout(io.StringIO()):
                stepped = sched(end_grow)
            assert not stepped  # an event update: TD3 skips the optimizer step
            # the rate the event used (the step counter does not move inside it; DST restarted it at 0)
            drop = sched.cosine_annealing() if end_grow else sched.uniform_annealing()
            return bool(end_grow), float(drop)
        for w, hook in zip(sched.W, sched.backward_hook_objects):
            if hook is not None:  # a plain update's backward: the hooks drop the last event's dense gradient
                hook(torch.zeros_like(w))
                assert hook.dense_grad is None or (sched.step + 1) % sched.delta_T == 0
        assert sched(end_grow)  # a plain update


def train_between(sched, rng):
    """Stand-in for the ~99 optimizer steps between events: every active weight moves, then the masks apply."""
    with torch.no_grad():
        for w, mask, s in zip(sched.W, sched.backward_masks, sched.S):
            if s > 0:
                w.add_(torch.as_tensor(rng.normal(size=tuple(w.shape)) * 0.01, dtype=torch.float32) * mask)
        sched.apply_mask_to_weights()


def distinct(x):
    a = np.abs(np.asarray(x)).ravel()
    a = a[a > 0]
    return np.unique(a).size == a.size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ne", required=True, help="git dir of the fetched torressliu/neuroplastic-expansion snapshot")
    ap.add_argument("--out", default=fixture_path("ne_reference.npz"))
    a = ap.parse_args()
    ref, utils, actor_cls, commit = load_reference(a.ne)
    out = {}

    # ER densities and initial mask counts (weight_sparsify) for three actor shapes
    for i, dims in enumerate(ER_SHAPES):
        _, _, sched = make_actor(ref, actor_cls, dims, np.random.default_rng(100 + i))
        out[f"er/{i}/dims"] = np.asarray(dims)
        out[f"er/{i}/S"] = np.asarray(sched.S, np.float64)
        out[f"er/{i}/n_ones"] = np.asarray([int(m.sum()) for m in sched.backward_masks])

    # the test MLP: initial masks, then every event of a T_END-update run (growth, then DST)
    rng = np.random.default_rng(0)
    actor, optimizer, sched = make_actor(ref, actor_cls, (OBS, ACT, HIDDEN), rng)
    layers = ("l1", "l2", "l3")
    for name, layer, m in zip(layers, (actor.l1, actor.l2, actor.l3), sched.backward_masks):
        out[f"init/{name}.weight"] = layer.weight.detach().numpy().copy()
        out[f"init/{name}.bias"] = layer.bias.detach().numpy().copy()
        out[f"init/{name}.mask"] = m.numpy().copy()
    # Adam state as after 1000 steps, so that the scheduler's changes to it show
    for p in actor.parameters():
        optimizer.state[p] = {
            "step": torch.tensor(1000.0),
            "exp_avg": torch.full_like(p, 0.5),
            "exp_avg_sq": torch.full_like(p, 0.25),
        }
    records, counts, ones, end_grows, drops, events = [], [], [], [], [], 0
    detail_at, growth_end = {"first": 1}, None
    snapshots = {}
    while True:
        events += 1
        grads = [rng.normal(size=tuple(w.shape)).astype(np.float32) for w in sched.W]
        before = ([w.detach().numpy().copy() for w in sched.W], [m.numpy().copy() for m in sched.backward_masks])
        end_grow, drop = run_event(sched, utils, actor, grads, records)
        if end_grow and growth_end is None:
            growth_end = events - 1  # the last growth event
            detail_at.update(last_growth=growth_end, first_dst=events, second_dst=events + 1)
        snapshots[events] = (
            before,
            grads,
            [w.detach().numpy().copy() for w in sched.W],
            [m.numpy().copy() for m in sched.backward_masks],
        )
        rec = records[-1]
        counts.append([rec.get(k, (0, 0)) for k in range(len(sched.W))])
        ones.append([int(m.sum()) for m in sched.backward_masks])
        end_grows.append(end_grow)
        drops.append(drop)
        if events == 1:
            out["adam/step_after_first_event"] = np.asarray(
                [float(optimizer.state[p]["step"]) for p in actor.parameters()]
            )
            out["adam/exp_avg_unchanged"] = np.asarray(
                [bool(torch.all(optimizer.state[p]["exp_avg"] == 0.5)) for p in actor.parameters()]
            )
        if events == EVENTS:
            break
        train_between(sched, rng)
    assert sched.step < T_END
    out["events/counts"] = np.asarray(counts, np.int32)  # (E, L, 2): n_grow, n_prune
    out["events/n_ones"] = np.asarray(ones, np.int32)  # (E, L) after each event
    out["events/end_grow"] = np.asarray(end_grows)
    out["events/drop_fraction"] = np.asarray(drops)
    out["events/n_init_space"] = np.asarray(sched.n_init_space[: len(sched.W)], np.float64)
    for tag in DETAIL:
        e = detail_at[tag]
        (w0, m0), g, w1, m1 = snapshots[e]
        out[f"detail/{tag}/event"] = np.asarray(e)
        for name, a0, b0, gg, a1, b1 in zip(layers, w0, m0, g, w1, m1):
            assert distinct(a0) and distinct(gg), (tag, name)  # no tie for torch.topk to break
            out[f"detail/{tag}/before/{name}.weight"] = a0
            out[f"detail/{tag}/before/{name}.mask"] = b0
            out[f"detail/{tag}/grad/{name}.weight"] = gg
            out[f"detail/{tag}/after/{name}.weight"] = a1
            out[f"detail/{tag}/after/{name}.mask"] = b1
        # how many of the connections the reference pruned (its n_prune smallest |w|) it regrew at once
        regrown = []
        for k, (a0, b0, b1) in enumerate(zip(w0, m0, m1)):
            n_prune = counts[e - 1][k][1]
            order = np.argsort(np.abs(a0[b0]))
            pruned = np.zeros(int(b0.sum()), bool)
            pruned[order[: max(n_prune, 0)]] = True
            regrown.append(int((pruned & b1[b0]).sum()))
        out[f"detail/{tag}/regrown"] = np.asarray(regrown)
    # negative initial space: a (20, 1, 256) actor, whose first layer ER keeps 95% dense
    nrng = np.random.default_rng(1)
    nactor, _, nsched = make_actor(ref, actor_cls, ER_SHAPES[2], nrng)
    nrec, nones = [], [[int(m.sum()) for m in nsched.backward_masks]]
    for _ in range(NEG_EVENTS):
        grads = [nrng.normal(size=tuple(w.shape)).astype(np.float32) for w in nsched.W]
        run_event(nsched, utils, nactor, grads, nrec)
        nones.append([int(m.sum()) for m in nsched.backward_masks])
        train_between(nsched, nrng)
    out["negative/counts"] = np.asarray([[r.get(k, (0, 0)) for k in range(len(nsched.W))] for r in nrec], np.int32)
    out["negative/n_ones"] = np.asarray(nones, np.int32)
    out["negative/n_init_space"] = np.asarray(nsched.n_init_space[: len(nsched.W)], np.float64)

    command = "/tmp/refvenv/bin/python scripts/fidelity/ne_reference.py --ne " + shlex.quote(a.ne)
    meta = {
        "generator": "scripts/fidelity/ne_reference.py",
        "command": command,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "reference": {
            "repository": "https://github.com/torressliu/neuroplastic-expansion",
            "commit": commit,
            "files": [SCHEDULER_FILE, UTILS_FILE, MODULES_FILE],
        },
        "call": (
            f"STL_Scheduler(MLPActor({OBS}, {ACT}, 1.0, hidden_dim={HIDDEN}), Adam(lr=3e-4), static_topo=False, "
            f"sparsity={TARGET}, T_end={T_END}, delta={DELTA}, zeta={ZETA}, grad_accumulation_n=1, "
            f"use_simple_metric=False, initial_stl_sparsity={INITIAL}, complex_prune=False); "
            f"scheduler(show_sparsity(actor.state_dict()) <= {TARGET}) every update"
        ),
        "sizes": {"obs": OBS, "act": ACT, "hidden": HIDDEN},
        "layers": list(layers),
        "t_end": T_END,
        "delta": DELTA,
        "target": TARGET,
        "initial": INITIAL,
        "growth_events": growth_end,
        "events": EVENTS,
        "detail": list(DETAIL),
        "er_shapes": [list(s) for s in ER_SHAPES],
        "negative_events": NEG_EVENTS,
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; reference {commit}")
    print(
        "growth events",
        growth_end,
        "counts first",
        counts[0],
        "last growth",
        counts[growth_end - 1],
        "dst",
        counts[growth_end : growth_end + 3],
        counts[-1],
        "n_ones",
        ones[0],
        ones[growth_end - 1],
        ones[-1],
    )
    print("regrown", {t: out[f"detail/{t}/regrown"].tolist() for t in DETAIL})
    print(
        "adam step",
        out["adam/step_after_first_event"],
        "negative",
        out["negative/counts"].tolist(),
        out["negative/n_ones"].tolist(),
    )


if __name__ == "__main__":
    main()
