"""Neuroplastic Expansion (Liu et al., ICLR 2025, arXiv 2410.07994; code torressliu/neuroplastic-expansion).

A network starts sparse (Erdős–Rényi per-layer densities, overall sparsity s0 = 0.8) and every
``ne_every`` updates (100, the reference ``train.py``'s delta) its topology changes:

- growth phase (until the target sparsity 0.25): each masked kernel grows
  ``n_grow = int(r * initial empty space)`` connections, the inactive ones with the largest
  |dense gradient| of the network's loss, and prunes ``n_prune = int(0.4 n_grow)`` active ones.
  Defaults are what the reference runs (its ``stl/TD3.py`` builds ``STL_Scheduler`` without
  ``uni``, ``init_method`` or ``tau``, so the scheduler's own defaults apply): r = 0.008 per
  event ("uniform"), the initial empty space ``s0 * n_total - n_ones`` ("reference"; clipped at
  0), pruning by smallest |w| ("magnitude": the reference's ReDo-score lookup never finds its
  activations and falls back to |w|).  A layer then gains 0.6 x 0.008 x (s0 n - n_ones) per
  event, so growth takes about 190 events (~19k updates at delta 100).  Options: r = zeta/2
  (1 + cos(pi t / T)) with zeta = 0.5 ("cosine", dense after 2-3 events), the empty space
  ``n_total - n_ones`` ("full"), and the incoming connections of tau-dormant units first
  ("redo").  The last growth event is clipped so the network lands on the target.
- afterwards plain dynamic sparse training (the reference's scheduler): prune ``int(d * n_active)`` of the
  smallest-|w| connections and regrow as many by gradient, d = 0.2/2 (1 + cos(pi t'/T)), t'
  counting from the first DST event, where t' = 0 (the reference restarts its clock there).
- layers the ER rule keeps dense (density capped at 1) never change (as in the reference).

Grown connections start at exactly 0 (the reference's ``zero`` option; its ``train.py``
defaults to a LeCun truncated normal) and their Adam moments are zero; the moments of pruned
connections are zeroed.  The counts depend only on the schedule and on static shapes, so the host
computes them (``Schedule``) and passes them as traced integers: selection by rank
(``argsort(argsort(.)) < k``) needs no static ``k``, and no event recompiles anything.

Experience review (the reference's ``--recall``, off by default): ``review_probability`` turns the
critic's fraction of active units (FAU) into the probability of drawing a replay index from the
oldest 30% of the buffer.  Auto batch (its ``--auto_batch``, on by default): while the critic's
FAU < 0.9 x 0.4 = 0.36 the updates use half a batch (``half_batch``).  The reference measures the
FAU on a fresh batch before every update; here it is measured at each NE event on the event's
batch and holds until the next one (every 100 updates by default).  The reference also skips the
optimizer step at an event's update; here every update steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.networks.core import path_names
from plasticity_zoo.plasticity import optim as optim_lib
from plasticity_zoo.plasticity import resets
from plasticity_zoo.plasticity.metrics import neuron_scores

ZETA_GROW = 0.5  # cosine growth rate at t = 0 (reference train.py --zeta)
UNIFORM_RATE = 0.008  # the reference's "uniform" growth rate
PRUNE_RATIO = 0.4  # n_prune = 0.4 n_grow
ZETA_DST = 0.2  # drop fraction of dynamic sparse training after the target is reached
AWAKEN = 0.4  # experience review starts when the critic's FAU < awaken
AUTO_BATCH_FAU = 0.9 * AWAKEN  # auto batch halves the batch while the critic's FAU < 0.36
TAMP = 0.9  # g = 1 / (1 + e^(awaken - FAU) * Tamp)
OLD_FRACTION = 0.3  # the oldest 30% of the buffer


# ----------------------------------------------------------------------------- host-side schedule


@dataclass
class Plan:
    """Counts of one network's masked kernels, per ensemble member (all members alike)."""

    n_total: list
    members: list
    n_ones: list
    init_space: list
    dense: list
    growing: bool = True
    dst_start: int | None = None

    @property
    def active(self) -> int:
        return sum(m * n for m, n in zip(self.members, self.n_ones))

    @property
    def total(self) -> int:
        return sum(m * n for m, n in zip(self.members, self.n_total))

    @property
    def sparsity(self) -> float:
        return 1.0 - self.active / self.total


def plan(params, initial_sparsity: float, init_space: str = "reference") -> Plan:
    """The initial counts of a network whose params (or shapes) are ``params`` (one seed).

    ``init_space``: a layer's initial empty space, the base of its growth counts: ``reference``
    = max(0, initial_sparsity x n_total - n_ones) (the reference's ``n_init_space``), ``full`` =
    n_total - n_ones."""
    kernels = [x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if optim_lib.maskable(p, x)]
    if not kernels:
        raise ValueError("NE found no Linear kernels to mask")
    ones = optim_lib.initial_counts(params, initial_sparsity)
    n_total = [int(x.shape[-2] * x.shape[-1]) for x in kernels]
    members = [int(np.prod(x.shape[:-2])) for x in kernels]
    if init_space == "reference":
        space = [max(0.0, initial_sparsity * t - o) for t, o in zip(n_total, ones)]
    elif init_space == "full":
        space = [t - o for t, o in zip(n_total, ones)]
    else:
        raise ValueError(f"unknown NE initial space {init_space!r}; choose reference or full")
    return Plan(n_total, members, list(ones), space, [o >= t for t, o in zip(n_total, ones)])


@dataclass
class Schedule:
    """When and how much each network grows and prunes (host side, deterministic)."""

    plans: dict
    total_updates: int
    target_sparsity: float = 0.25
    kind: str = "uniform"
    prune: str = "magnitude"
    events: int = field(default=0)

    def growth_rate(self, t: int) -> float:
        if self.kind == "uniform":
            return UNIFORM_RATE
        return ZETA_GROW / 2 * (1 + math.cos(math.pi * min(t, self.total_updates) / self.total_updates))

    def drop_fraction(self, t: int) -> float:
        return ZETA_DST / 2 * (1 + math.cos(math.pi * min(t, self.total_updates) / self.total_updates))

    def step(self, t: int) -> dict:
        """Counts of the event at update ``t`` -> {name: (grow (L,), prune (L,), magnitude)}; updates the plans."""
        self.events += 1
        out = {}
        for name, p in self.plans.items():
            if p.growing:
                grow, prune, last = self._grow(p, t)
                magnitude = self.prune == "magnitude"
            else:
                last = False
                p.dst_start = t if p.dst_start is None else p.dst_start  # the first DST event: t' = 0
                d = self.drop_fraction(t - p.dst_start)
                prune = [0 if dense else int(d * n) for dense, n in zip(p.dense, p.n_ones)]
                grow = list(prune)
                magnitude = True
            p.n_ones = [n - q + g for n, q, g in zip(p.n_ones, prune, grow)]
            if p.growing and (last or not self._room(p)):
                p.growing = False
            out[name] = (np.asarray(grow, np.int32), np.asarray(prune, np.int32), np.bool_(magnitude))
        return out

    def _target_active(self, p: Plan) -> int:
        return int(round((1.0 - self.target_sparsity) * p.total))

    def _room(self, p: Plan) -> int:
        return max(0, self._target_active(p) - p.active)

    def _grow(self, p: Plan, t: int):
        r = self.growth_rate(t)
        grow = [0 if dense else int(space * r) for dense, space in zip(p.dense, p.init_space)]
        prune = [min(int(PRUNE_RATIO * g), n) for g, n in zip(grow, p.n_ones)]
        grow = [min(g, total - (n - q)) for g, total, n, q in zip(grow, p.n_total, p.n_ones, prune)]
        room = self._room(p)
        net = sum(m * (g - q) for m, g, q in zip(p.members, grow, prune))
        last = net >= room
        if net > room:  # the last growth event lands on the target
            f = room / net
            grow = [int(g * f) for g in grow]
            prune = [int(PRUNE_RATIO * g) for g in grow]
            while sum(m * (g - q) for m, g, q in zip(p.members, grow, prune)) > room:
                i = int(np.argmax(grow))
                grow[i] -= 1
                prune[i] = int(PRUNE_RATIO * grow[i])
            # any remainder left by rounding: one connection at a time in the layers with space
            for i in range(len(grow)):
                while (
                    not p.dense[i]
                    and room - sum(m * (g - q) for m, g, q in zip(p.members, grow, prune)) >= p.members[i]
                    and p.n_ones[i] - prune[i] + grow[i] < p.n_total[i]
                ):
                    grow[i] += 1
        return grow, prune, last

    def state_dict(self) -> dict:
        return {"events": self.events, "plans": {k: vars(p).copy() for k, p in self.plans.items()}}

    def load_state_dict(self, d: dict):
        self.events = d["events"]
        self.plans = {k: Plan(**v) for k, v in d["plans"].items()}


# ----------------------------------------------------------------------------- device-side topology update


def _rank(x):
    """Ascending rank of each entry along the last axis (0 = smallest)."""
    return jnp.argsort(jnp.argsort(x, axis=-1), axis=-1)


def dormant_units(net, params, acts: dict, tau: float) -> dict:
    """{param-leaf index of a Linear kernel: bool (..., fan_out)}: its output units that are tau-dormant.

    Only kernels that are the incoming layer of an instrumented neuron layer get an entry.
    """
    try:
        layout = resets.neuron_layout(net, params)
    except ValueError:
        return {}
    incoming = {tuple(paths["incoming"]): tap for tap, paths in layout.items()}
    out = {}
    for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        keys = path_names(path)
        if optim_lib.maskable(path, x) and keys[:-1] in incoming and incoming[keys[:-1]] in acts:
            out[i] = neuron_scores(acts[incoming[keys[:-1]]]) <= tau
    return out


def update_topology(params, opt_state, grads, grow, prune, magnitude, dormant: dict | None = None):
    """One NE event on one network -> (params, opt_state, stats).

    ``grow`` / ``prune``: int arrays, one count per masked kernel (per member); ``magnitude``:
    bool (traced) - prune by |w| alone, else the incoming connections of the units in
    ``dormant`` ({leaf index: bool (..., fan_out)}) go first, each group by |w|.  Pruning comes
    first; growth then picks, among the connections inactive after pruning, those with the
    largest |grads|.  Pruned weights are set to 0, grown ones start at 0, and the moments of
    both are zeroed; a connection pruned and regrown at once keeps its weight and moments (as in the
    reference, whose growth candidates include the just-pruned and which zeroes only new connections).
    """
    dormant = dormant or {}
    ms = optim_lib.find_masked(opt_state)
    if ms is None:
        raise ValueError(
            "NE: this optimizer state holds no masks (build the optimizer with "
            "plasticity.optim.optimizer(..., spec=state.plasticity.optim))"
        )
    leaves, treedef = jax.tree.flatten(params)
    g_leaves = jax.tree.leaves(grads)
    new_leaves, new_masks, touched = [], [], []
    n_grown = n_pruned = n_active = n_total = 0
    layer = 0
    for i, (w, g, m) in enumerate(zip(leaves, g_leaves, ms.masks)):
        if m is None:
            new_leaves.append(w)
            new_masks.append(None)
            touched.append(jnp.zeros(w.shape, bool))
            continue
        lead = w.shape[:-2]
        flat = lambda x: x.reshape(*lead, -1)  # noqa: E731  one row per member
        a = jnp.abs(w)
        score = a / (jnp.max(a, axis=(-2, -1), keepdims=True) + 1e-12)  # in [0, 1]
        if i in dormant:  # not dormant: +2, so dormant units' incoming connections rank first
            alive = ~jnp.broadcast_to(dormant[i][..., None, :], w.shape)
            score = jnp.where(magnitude, score, score + 2.0 * alive)
        score = jnp.where(m, score, jnp.inf)
        pruned = m & (_rank(flat(score)).reshape(w.shape) < prune[layer])
        kept = m & ~pruned
        grow_score = jnp.where(kept, -jnp.inf, jnp.abs(g))
        grown = ~kept & (_rank(-flat(grow_score)).reshape(w.shape) < grow[layer])
        new_m = kept | grown
        new_leaves.append(jnp.where(m & new_m, w, jnp.zeros_like(w)))  # a pruned and regrown one keeps w
        new_masks.append(new_m)
        touched.append(m ^ new_m)
        n_grown += grown.sum()
        n_pruned += pruned.sum()
        n_active += new_m.sum()
        n_total += new_m.size
        layer += 1
    new_params = treedef.unflatten(new_leaves)
    inner = resets.zero_moments(ms.inner, params, treedef.unflatten(touched))
    new_opt = optim_lib.replace_masked(opt_state, optim_lib.MaskedState(tuple(new_masks), inner))
    stats = {"sparsity": 1.0 - n_active / n_total, "grown": n_grown / n_total, "pruned": n_pruned / n_total}
    return new_params, new_opt, stats


class ReplayControl(NamedTuple):
    """NE's controls of the uniform sampler for one seed (traced scalars; a None field is off).

    ``review``: probability of drawing each index from the oldest 30% (``buffers.replay.sample_with_review``);
    ``half``: bool, use half a batch (``buffers.replay.half_batch``)."""

    review: Any = None
    half: Any = None


def pooled_active_fraction(acts: dict):
    """FAU pooled over every (sample, unit) entry of all hidden layers."""
    on = sum(jnp.sum(a > 0) for a in acts.values())
    return on / sum(a.size for a in acts.values())


def review_probability(fau, awaken: float = AWAKEN, tamp: float = TAMP):
    """Probability of drawing from the oldest 30% (the reference's ``recall``): 1 - g when FAU < awaken, else 0.

    g = 1 / (1 + e^(awaken - FAU) * Tamp), set to 0.4 when it reaches 0.6 (reference code).
    """
    g = 1.0 / (1.0 + jnp.exp(awaken - fau) * tamp)
    g = jnp.where(g >= 0.6, 0.4, g)
    return jnp.where(fau < awaken, 1.0 - g, 0.0).astype(jnp.float32)
