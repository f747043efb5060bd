"""L2, L2 Init, Parseval and Normalize-and-Project as transformations of a network's optimizer.

Each plastic network's optimizer comes from ``plasticity.optim.optimizer``; with ``OptimSpec.reg``
set it becomes ``chain(add_regularizer_grads, <base optimizer>, nap_projection)``: the gradient of
the regulariser R is added to the loss gradient *before* the base optimizer (Adam, AdamW, Kron,
NE's masked wrapper), i.e. the network trains on loss + R, and NaP's projection is the chain's
last step.  What a regulariser needs to remember (theta_0, the initial norms) lives in the
optimizer state, so checkpoints carry it and a resumed run continues exactly.  Both are stored as
tuples aligned with the param leaves (as NE's masks are), not as param-shaped trees, so code that
zeroes the Adam moments of reset units (``resets.zero_moments``: ReDo, ReGraMa, NE, layer resets)
leaves them alone.

Which parameters (``layer_groups``): a *Linear layer* is a node holding a ``kernel``; one that sits
directly at the network's root (``out``, MR.Q's ``model`` head) is an *output layer*, every other
one (inside a trunk: ``trunk/layers/i``, MR.Q's ``action`` embedding, SimBa / multi-skip blocks)
a *hidden layer*.  A *LayerNorm* is a node holding a ``scale``.  With an ensemble (``ensemble=True``:
a leading member axis on every leaf) everything is computed per member.

- **L2** (toward 0, in the loss, not decoupled weight decay): R = lambda sum_theta ||theta||^2 over
  every parameter, so g <- g + 2 lambda theta.
- **L2 Init** (Kumar, Marklund, Van Roy 2023, "Maintaining plasticity in continual learning via
  regenerative regularization", arXiv 2308.11958, section 3): L_reg(theta) = L_train(theta) +
  lambda ||theta - theta_0||_2^2 with theta_0 the parameters at initialisation, over all of the
  network's parameters (the paper regularises every parameter, biases included; lambda, not
  lambda / 2, so the gradient is 2 lambda (theta - theta_0)).  theta_0 is the network's params
  when its optimizer state is built (``init``); NE's sparse start, ReDo / ReGraMa resets, Shrink &
  Perturb and layer resets do not move it (the paper's theta_0 is the one initialisation).
- **Parseval** (Chung, Cherif, Meger, Precup 2024, "Parseval regularization for continual
  reinforcement learning", NeurIPS, arXiv 2412.07224, section 3; the authors' code
  wechu/parseval_reg ``agent.py``): R = sum_l lambda_l ||W_l W_l^T - s I||_F^2 over the hidden
  layers (not the output layer), W_l the torch-layout weight (out, in), i.e. W W^T = K^T K for a
  flax kernel K (in, out): the rows of W, the output units' incoming weight vectors, are kept
  orthogonal with squared norm s.  s = 2 in the authors' code (their orthogonal init's gain sqrt 2,
  squared; ``--plasticity.parseval-scale``), and lambda_l = lambda (64 / m_l)^2 with m_l the
  layer's output units, as their code scales the coefficient tuned at width 64 ("the original
  parseval_reg was tuned for width 64").  Biases and LayerNorm params are not regularised.
  dR/dK = 4 lambda_l K (K^T K - s I).
- **Normalize-and-Project** (Lyle, Zheng, Khetarpal, Martens, van Hasselt, Pascanu, Dabney 2024,
  "Normalization and effective learning rates in reinforcement learning", NeurIPS, arXiv
  2407.01800, section 4): with a LayerNorm before each nonlinearity, after every optimizer step
  each layer's weights are rescaled to their initial norm, W_l <- ||W_l^0|| W_l / ||W_l||, per
  layer (Frobenius), which keeps the effective learning rate constant.  Read here as: the hidden
  Linear layer's kernel *and bias* jointly (the affine map the following LayerNorm is invariant to
  rescaling, so the step is a re-parameterisation: the network's function does not change), each
  LayerNorm's scale and offset jointly (for homogeneous activations the next normalisation undoes
  their common scale; this is also Plasticine's NaP), and the output layer left alone (it is not
  followed by a normalisation, so its scale matters).  Layers with no LayerNorm after them (MR.Q's
  one-layer action embedding, SimBa's blocks) are held at their initial norm too.  The update
  returned is proj(theta + u) - theta, so ``apply_updates`` lands on the projected params.

Everything is a pure function of pytrees with static shapes (jit and vmap over seeds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from plasticity_zoo.networks.core import path_names

PARSEVAL_REFERENCE_WIDTH = 64  # the authors' code: lambda scaled by (64 / width)^2


@dataclass(frozen=True)
class RegSpec:
    """The regularisers of the plastic networks' optimizers (all off by default)."""

    l2: float = 0.0
    """lambda of lambda ||theta||^2"""
    l2_init: float = 0.0
    """lambda of lambda ||theta - theta_0||^2"""
    parseval: float = 0.0
    """lambda of lambda (64 / m)^2 ||W W^T - s I||_F^2 per hidden layer"""
    parseval_scale: float = 2.0
    """s"""
    nap: bool = False
    """project hidden layers and LayerNorms to their initial norms after each step"""

    @property
    def adds_gradient(self) -> bool:
        return self.l2 > 0 or self.l2_init > 0 or self.parseval > 0


class RegState(NamedTuple):
    """theta_0 for L2 Init: a tuple aligned with the param leaves (empty when L2 Init is off)."""

    init: tuple


class NaPState(NamedTuple):
    """NaP's target norms: per param leaf its layer's initial norm (per member: shape (N,)), or None."""

    norms: tuple


# ----------------------------------------------------------------------------- which parameters


def _leaves_with_names(tree):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [path_names(p) for p, _ in flat], [x for _, x in flat], treedef


def layer_groups(params) -> list[Optional[tuple]]:
    """Per param leaf, the layer NaP projects it with (its module's path), or None.

    A hidden Linear layer groups its ``kernel`` and ``bias``; a LayerNorm its ``scale`` and
    ``bias``; output layers (Linear nodes at the network's root) and free params (PPO's log-std)
    get None."""
    names, _, _ = _leaves_with_names(params)
    linear = {n[:-1] for n in names if n and n[-1] == "kernel"}
    norm = {n[:-1] for n in names if n and n[-1] == "scale"} - linear
    out = []
    for n in names:
        m = n[:-1]
        if m in linear and len(m) > 1 and n[-1] in ("kernel", "bias"):
            out.append(m)
        elif m in norm and n[-1] in ("scale", "bias"):
            out.append(m)
        else:
            out.append(None)
    return out


def hidden_kernels(params, ensemble: bool = False) -> list[bool]:
    """Per param leaf: whether it is a hidden Linear layer's 2-D kernel (Parseval's W_l)."""
    names, leaves, _ = _leaves_with_names(params)
    groups = layer_groups(params)
    return [g is not None and n[-1] == "kernel" and x.ndim == 2 + ensemble for n, x, g in zip(names, leaves, groups)]


# ----------------------------------------------------------------------------- the regularisers


def parseval_coef(coef: float, kernel) -> float:
    """lambda_l = lambda (64 / m)^2 for a kernel with m output units (its last axis)."""
    return coef * (PARSEVAL_REFERENCE_WIDTH / kernel.shape[-1]) ** 2


def parseval_penalty(kernel, scale: float):
    """||K^T K - s I||_F^2 (= ||W W^T - s I||_F^2, W = K^T), per member for leading axes."""
    gram = jnp.swapaxes(kernel, -1, -2) @ kernel
    eye = jnp.eye(kernel.shape[-1], dtype=kernel.dtype)
    return jnp.sum((gram - scale * eye) ** 2, axis=(-2, -1))


def parseval_grad(kernel, scale: float):
    """d ||K^T K - s I||_F^2 / dK = 4 K (K^T K - s I)."""
    gram = jnp.swapaxes(kernel, -1, -2) @ kernel
    eye = jnp.eye(kernel.shape[-1], dtype=kernel.dtype)
    return 4.0 * kernel @ (gram - scale * eye)


def penalty(spec: RegSpec, params, init: tuple = (), ensemble: bool = False):
    """R(theta) written out (the sum over members for an ensemble): what ``add_regularizer_grads``
    adds the gradient of.  ``init``: theta_0's leaves (needed when L2 Init is on)."""
    leaves = jax.tree.leaves(params)
    total = jnp.zeros((), jnp.float32)
    if spec.l2 > 0:
        total += spec.l2 * sum(jnp.sum(x**2) for x in leaves)
    if spec.l2_init > 0:
        total += spec.l2_init * sum(jnp.sum((x - x0) ** 2) for x, x0 in zip(leaves, init))
    if spec.parseval > 0:
        for x, hidden in zip(leaves, hidden_kernels(params, ensemble)):
            if hidden:
                total += parseval_coef(spec.parseval, x) * jnp.sum(parseval_penalty(x, spec.parseval_scale))
    return total


def penalty_grads(spec: RegSpec, params, init: tuple = (), ensemble: bool = False):
    """dR/dtheta by the hand-derived formulas: 2 lambda theta, 2 lambda (theta - theta_0) and
    4 lambda_l K (K^T K - s I) on hidden kernels."""
    leaves, treedef = jax.tree.flatten(params)
    hidden = hidden_kernels(params, ensemble) if spec.parseval > 0 else [False] * len(leaves)
    init = init if spec.l2_init > 0 else (None,) * len(leaves)
    out = []
    for x, x0, h in zip(leaves, init, hidden):
        g = jnp.zeros_like(x)
        if spec.l2 > 0:
            g = g + 2.0 * spec.l2 * x
        if spec.l2_init > 0:
            g = g + 2.0 * spec.l2_init * (x - x0)
        if h:
            g = g + parseval_coef(spec.parseval, x) * parseval_grad(x, spec.parseval_scale)
        out.append(g)
    return treedef.unflatten(out)


def add_regularizer_grads(spec: RegSpec, ensemble: bool = False) -> optax.GradientTransformation:
    """g <- g + dR/dtheta (L2, L2 Init, Parseval as ``spec`` says); theta_0 kept in the state."""

    def init(params):
        return RegState(tuple(jnp.copy(x) for x in jax.tree.leaves(params)) if spec.l2_init > 0 else ())

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("the L2 / L2 Init / Parseval regularisers need params in update()")
        reg = penalty_grads(spec, params, state.init, ensemble)
        return jax.tree.map(lambda g, r: g + r.astype(g.dtype), updates, reg), state

    return optax.GradientTransformation(init, update)


# ----------------------------------------------------------------------------- Normalize-and-Project


def _group_norms(leaves, groups, ensemble: bool) -> dict:
    """{layer: its Frobenius norm over all of its leaves} (per member: shape (N,))."""
    sq: dict[Any, Any] = {}
    for x, g in zip(leaves, groups):
        if g is not None:
            axes = tuple(range(1 if ensemble else 0, x.ndim))
            sq[g] = sq.get(g, 0.0) + jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axes)
    return {g: jnp.sqrt(s) for g, s in sq.items()}


def initial_norms(params, ensemble: bool = False) -> tuple:
    """Per param leaf its layer's norm (``layer_groups``), None for leaves NaP leaves alone."""
    leaves = jax.tree.leaves(params)
    groups = layer_groups(params)
    norms = _group_norms(leaves, groups, ensemble)
    return tuple(None if g is None else norms[g] for g in groups)


def project(params, norms: tuple, ensemble: bool = False):
    """Every NaP layer of ``params`` rescaled to its norm in ``norms`` (a zero layer stays zero)."""
    leaves, treedef = jax.tree.flatten(params)
    groups = layer_groups(params)
    current = _group_norms(leaves, groups, ensemble)
    out = []
    for x, g, target in zip(leaves, groups, norms):
        if g is None:
            out.append(x)
            continue
        now = current[g]
        factor = jnp.where(now > 0, target / jnp.where(now > 0, now, 1.0), 1.0)
        out.append((x * factor.reshape(factor.shape + (1,) * (x.ndim - factor.ndim))).astype(x.dtype))
    return treedef.unflatten(out)


def nap_projection(ensemble: bool = False, post_scaled: bool = False) -> optax.GradientTransformation:
    """NaP's projection as the last transformation: u <- proj(theta + u) - theta.

    ``post_scaled``: the caller multiplies the update by its own learning rate after the chain (PPO's
    annealed lr), so a projection here would be undone; the update passes through unchanged and the
    caller applies ``project`` to its new params (``plasticity.optim.constrain``)."""

    def init(params):
        return NaPState(initial_norms(params, ensemble))

    def update(updates, state, params=None):
        if post_scaled:
            return updates, state
        if params is None:
            raise ValueError("Normalize-and-Project needs params in update()")
        new = project(optax.apply_updates(params, updates), state.norms, ensemble)
        return jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new, params), state

    return optax.GradientTransformation(init, update)


def wrap(
    tx: optax.GradientTransformation, spec: RegSpec, ensemble: bool = False, post_scaled: bool = False
) -> optax.GradientTransformation:
    """``chain(add_regularizer_grads, tx, nap_projection)``, each part only where ``spec`` asks for it."""
    parts = []
    if spec.adds_gradient:
        parts.append(add_regularizer_grads(spec, ensemble))
    parts.append(tx)
    if spec.nap:
        parts.append(nap_projection(ensemble, post_scaled))
    return parts[0] if len(parts) == 1 else optax.chain(*parts)


def find(opt_state, kind):
    """The first ``RegState`` / ``NaPState`` (``kind``) inside an optimizer state, or None."""
    found = [n for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, kind)) if isinstance(n, kind)]
    return found[0] if found else None
