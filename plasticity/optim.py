"""The optimizer factory every agent uses: Adam (default), Kron, NE masks, fixed when the agent is built.

An agent builds each plastic network's optimizer with ``optimizer(lr, name, spec=...)`` (``make``
picks the default transformation, Adam unless given), where ``spec`` is the ``OptimSpec`` the
agent was built with (``plasticity.api.StaticPlasticity.optim``, a static field of its state), in
``init`` (which fixes the optimizer-state structure) and in ``update`` (which applies it).  Being
static configuration rather than a context, it is part of every jitted program's cache key.

- ``kron``: PSGD-Kron from ``psgdax`` (Castanyer et al., NeurIPS 2025, arXiv 2506.15544) with
  lr = lr / 3, for every network built here.  ``pip install 'plasticity-zoo[kron]'`` (psgdax 0.1.1;
  psgd-jax 0.2.9 does not import with optax 0.2.8: ``cannot import name 'clipping' from optax._src``).
- ``ne``: the networks listed in ``OptimSpec.ne_networks`` get a ``masked`` transformation
  whose *state* holds their connection masks (Neuroplastic Expansion, Liu et al., ICLR 2025): the
  gradients are masked, and every pruned weight is set to exactly 0 by each step.  The masks
  have static shapes and live in the optimizer state, so checkpoints carry them and growing the
  network never changes a shape or recompiles.  ``plasticity.expansion`` rewrites them.
- ``reg``: L2, L2 Init, Parseval and Normalize-and-Project (``plasticity.regularizers``): the
  regulariser's gradient is added before the transformation above (outside NE's mask, so pruned
  weights get none) and NaP's projection is the last step, ``chain(add_regularizer_grads, tx,
  nap_projection)``; theta_0 and the initial norms live in the optimizer state.
- ``trac``: TRAC (``plasticity.trac``) wraps the base transformation (Adam, or Kron), inside NE's mask
  and the regularisers: ``chain(add_regularizer_grads, masked(trac(adam)), nap_projection)``, so TRAC
  sees the regularised gradient and NaP projects the params TRAC plays.
- ``injection``: plasticity injection's ``frozen_head`` (``plasticity.injection``) wraps all of it, for
  the networks whose params carry a residual head (others are untouched): the head's two trained
  parts each get their own state of the chain above, and frozen params get no update.

With ``spec=None`` (or the default spec) ``optimizer`` returns ``make(lr, **kw)``.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from plasticity_zoo.networks.core import path_names
from plasticity_zoo.plasticity import injection, regularizers
from plasticity_zoo.plasticity import trac as trac_lib
from plasticity_zoo.plasticity.regularizers import RegSpec

KRON_LR_DIVISOR = 3.0  # Kron lr = Adam lr / 3 (Castanyer et al. 2025; roger-creus/stable-deep-rl-at-scale)


@dataclass(frozen=True)
class NESpec:
    """Neuroplastic Expansion settings the optimizer state needs (the schedule lives in the hooks)."""

    initial_sparsity: float = 0.8


@dataclass(frozen=True)
class OptimSpec:
    kron: bool = False
    ne: Optional[NESpec] = None
    ne_networks: Optional[tuple] = None
    """names of the networks NE masks (None: every network built with ``optimizer``)"""
    reg: Optional[RegSpec] = None
    """L2 / L2 Init / Parseval / NaP for every network built with ``optimizer`` (None: none)"""
    trac: Optional[trac_lib.TracSpec] = None
    """TRAC over the base optimizer of every network built with ``optimizer`` (None: off)"""
    injection: bool = False
    """plasticity injection's frozen-head wrapper for networks whose params carry a residual head"""


def optimizer(
    lr: float,
    name: str,
    make: Callable = optax.adam,
    ensemble: bool = False,
    *,
    spec: Optional[OptimSpec] = None,
    post_scaled: bool = False,
    **kw,
) -> optax.GradientTransformation:
    """Network ``name``'s optimizer: ``make(lr, **kw)``, or Kron / NE-masked / regularised as ``spec`` says.

    ``ensemble``: every param carries a leading ensemble-member axis (Kron then keeps one
    preconditioner per member instead of coupling members; the regularisers and NaP work per
    member).  With Kron only ``weight_decay`` of ``kw`` carries over (the rest are Adam's).
    ``post_scaled``: the caller multiplies the returned update by its own learning rate (PPO's
    annealed lr); NaP's projection is then the caller's, through ``constrain`` on its new params.
    """
    spec = spec or OptimSpec()
    tx = kron(lr / KRON_LR_DIVISOR, ensemble, kw.get("weight_decay", 0.0)) if spec.kron else make(lr, **kw)
    if spec.trac is not None:
        tx = trac_lib.trac(tx, spec.trac, post_scaled)
    if spec.ne is not None and (spec.ne_networks is None or name in spec.ne_networks):
        tx = masked(tx, spec.ne.initial_sparsity)
    if spec.reg is not None:
        tx = regularizers.wrap(tx, spec.reg, ensemble, post_scaled)
    if spec.injection:
        tx = injection.frozen_head(tx)
    return tx


# ----------------------------------------------------------------------------- Kron


def require_kron():
    """``--plasticity.kron`` without psgdax: one clear line (a SystemExit with the message, as ``--wandb``
    without wandb); ``kron`` calls it, so a run's preflight (its traced ``init``) stops there before a run
    directory exists."""
    import importlib.util

    if importlib.util.find_spec("psgdax") is None:
        raise SystemExit(
            "--plasticity.kron needs psgdax: pip install 'plasticity-zoo[kron]' (or pip install "
            "'psgdax>=0.1.1,<0.2'; psgd-jax 0.2.9 does not work with optax 0.2.8)"
        )


def kron(lr: float, ensemble: bool = False, weight_decay: float = 0.0) -> optax.GradientTransformation:
    """PSGD-Kron (psgdax defaults, which follow kron_torch's) as an optax transformation (``require_kron``
    first: without psgdax, its message)."""
    require_kron()
    # psgdax.kron's default ``key=jax.random.PRNGKey(42)`` is made when the module is imported: imported
    # first inside a trace (an agent's jitted init), it would be that trace's tracer, leaked to every later use
    with jax.ensure_compile_time_eval():
        import psgdax

    def build(params):
        scanned = jax.tree.map(lambda _: True, params) if ensemble else None
        return psgdax.kron(learning_rate=lr, weight_decay=weight_decay, scanned_layers=scanned)

    def init(params):
        with contextlib.redirect_stdout(io.StringIO()):  # psgdax prints its preconditioner sizes
            return build(params).init(params)

    def update(updates, state, params=None):
        if params is None and ensemble:
            raise ValueError("Kron over an ensemble needs params in update()")
        return build(updates if params is None else params).update(updates, state, params)

    return optax.GradientTransformation(init, update)


# ----------------------------------------------------------------------------- NE masks


class MaskedState(NamedTuple):
    """Connection masks of one network (tuple aligned with the param leaves; None = always active)."""

    masks: tuple
    inner: Any


def maskable(path, leaf) -> bool:
    """Linear kernels (``...['kernel']``, >= 2-D) are masked; biases and LayerNorm never."""
    keys = path_names(path)
    return bool(keys) and keys[-1] == "kernel" and len(leaf.shape) >= 2


def er_densities(shapes: list, sparsity: float) -> list[float]:
    """Erdős–Rényi per-layer densities (Neuroplastic Expansion's, after RigL) with overall sparsity
    ``sparsity`` over these kernels.

    density_l = eps (fan_in + fan_out) / (fan_in fan_out), with eps solving
    sum_l density_l n_l = (1 - sparsity) sum_l n_l.  A layer whose density would exceed 1 is kept
    dense and eps re-solved over the rest (the reference's rule).  ``shapes``: (fan_in, fan_out)
    per kernel (its last two dims).
    """
    n = [i * o for i, o in shapes]
    raw = [(i + o) / (i * o) for i, o in shapes]
    dense: set[int] = set()
    while True:
        rest = [j for j in range(len(n)) if j not in dense]
        if not rest:
            raise ValueError(f"cannot reach sparsity {sparsity} with layers {shapes}")
        budget = (1 - sparsity) * sum(n) - sum(n[j] for j in dense)
        eps = budget / sum(raw[j] * n[j] for j in rest)
        over = [j for j in rest if raw[j] * eps > 1]
        if not over:
            break
        top = max(raw[j] for j in over)
        dense |= {j for j in over if raw[j] == top}
    return [1.0 if j in dense else raw[j] * eps for j in range(len(n))]


def initial_counts(params, sparsity: float) -> list[int]:
    """Active connections per member of each masked kernel at init (static, from shapes only): n - int(S n)
    with S = 1 - density, as the NE reference's ``sparse_set`` keeps them (tests/test_fidelity_ne.py)."""
    kernels = [x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if maskable(p, x)]
    shapes = [tuple(x.shape[-2:]) for x in kernels]
    return [i * o - int((1.0 - d) * i * o) for d, (i, o) in zip(er_densities(shapes, sparsity), shapes)]


def _top_mask(score, k: int):
    """Bool mask of the ``k`` largest entries of each member's flattened kernel (static ``k``)."""
    lead = score.shape[:-2]
    flat = score.reshape(*lead, -1)
    if k >= flat.shape[-1]:
        return jnp.ones(score.shape, bool)
    _, idx = jax.lax.top_k(flat, k)
    mask = jnp.zeros(flat.shape, bool)
    mask = jnp.put_along_axis(mask, idx, True, axis=-1, inplace=False)
    return mask.reshape(score.shape)


def initial_masks(params, sparsity: float) -> tuple:
    """ER-sparse masks keeping each kernel's largest-|w| initial weights (the reference's choice)."""
    counts = iter(initial_counts(params, sparsity))
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        out.append(_top_mask(jnp.abs(x), next(counts)) if maskable(path, x) else None)
    return tuple(out)


def masked(inner: optax.GradientTransformation, initial_sparsity: float = 0.8) -> optax.GradientTransformation:
    """Wrap ``inner`` so that masked-out connections get no gradient and stay exactly 0.

    ``update`` masks the gradients before ``inner`` and returns ``u`` on active weights and
    ``-params`` on inactive ones, so ``apply_updates`` leaves every inactive weight at exactly 0.
    ``init`` cannot change params: apply ``apply_mask`` once to the initial params (the hooks do).
    """

    def init(params):
        return MaskedState(initial_masks(params, initial_sparsity), inner.init(params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("the NE-masked optimizer needs params in update()")
        leaves, treedef = jax.tree.flatten(updates)
        grads = [g if m is None else jnp.where(m, g, 0.0) for g, m in zip(leaves, state.masks)]
        new, inner_state = inner.update(treedef.unflatten(grads), state.inner, params)
        p_leaves = jax.tree.leaves(params)
        out = [u if m is None else jnp.where(m, u, -p) for u, p, m in zip(jax.tree.leaves(new), p_leaves, state.masks)]
        return treedef.unflatten(out), MaskedState(state.masks, inner_state)

    return optax.GradientTransformation(init, update)


def find_masked(opt_state) -> Optional[MaskedState]:
    """The ``MaskedState`` inside an optimizer state, or None."""
    found = [
        n
        for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, MaskedState))
        if isinstance(n, MaskedState)
    ]
    return found[0] if found else None


def replace_masked(opt_state, new: MaskedState):
    return jax.tree.map(
        lambda n: new if isinstance(n, MaskedState) else n, opt_state, is_leaf=lambda n: isinstance(n, MaskedState)
    )


def apply_mask(opt_state, params):
    """``params`` with every weight masked out in ``opt_state`` set to 0 (unchanged without NE).

    Use it for copies that must share the masks, e.g. target networks after a Polyak update.
    """
    state = find_masked(opt_state)
    if state is None:
        return params
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten(
        [x if m is None else jnp.where(m, x, jnp.zeros_like(x)) for x, m in zip(leaves, state.masks)]
    )


def constrain(opt_state, params):
    """``params`` with every constraint ``opt_state`` holds applied: TRAC's scaled iterate, NE's masks
    (pruned weights 0) and NaP's projection of each layer to its initial norm (unchanged without any);
    for a network with a residual head (plasticity injection) each trained part with its own state.

    For callers that scale the optimizer's update themselves after the chain (``optimizer(...,
    post_scaled=True)``: PPO's annealed lr), applied to the params after ``apply_updates``.
    """
    injected = injection.find(opt_state)
    if injected is not None:
        return injection.constrain(injected, params, _constrain)
    return _constrain(opt_state, params)


def _constrain(opt_state, params):
    tracked = trac_lib.find(opt_state)
    if tracked is not None and tracked.anchor:  # TRAC built post_scaled: the caller's base step -> TRAC's
        params = trac_lib.combine(tracked, params)
    params = apply_mask(opt_state, params)
    nap = regularizers.find(opt_state, regularizers.NaPState)
    if nap is None:
        return params
    ensemble = any(n is not None and n.ndim > 0 for n in nap.norms)
    return regularizers.project(params, nap.norms, ensemble)
