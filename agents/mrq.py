"""MR.Q: Model-based Representations for Q-learning (Fujimoto et al., ICLR 2025, arXiv 2501.16142).

Follows the paper (architecture, losses, update schedule, LAP replay; hyperparameters from its
Table 3 and Appendix B) and the official code facebookresearch/MRQ (``MRQ.py``, ``models.py``,
``buffer.py``), except for the multi-step return, where the reference code masks terminations
wrongly and (E4) is the corrected formula.  Equations below are numbered (E1)-(E8) in this file.

Networks (the reference's ``models.py``; every MLP layer is Linear -> LayerNorm -> act, LN without affine
parameters, Xavier-uniform init with gain sqrt(2), zero biases):

  f    : s -> z_s                      state encoder, LN+ELU after every layer (incl. the last)
  g    : [z_s, ELU(W_a a)] -> z_sa      state-action encoder, LN+ELU on its two hidden layers
  m    : z_sa -> (d, z_s', r-logits)    linear MDP predictor (1 + |z_s| + 65 outputs)
  Q1,2 : z_sa -> R                     twin values, 3 LN+ELU layers
  pi   : z_s -> tanh(pre)              deterministic policy, 2 LN+ReLU layers

One training step (replay ratio 1, after ``learning_starts`` uniform-random env steps):

  if updates % T_target == 0:                                           (paper Sec. 4.2)
      f', g', m', Q', pi' <- f, g, m, Q, pi                              hard target copy
      rbar' <- rbar;  rbar <- mean |r| over the whole buffer             reward scale
      repeat T_target times: one AdamW step on L_enc (E1-E3)            encoder burst
  sample B windows of H_Q = 3 transitions by LAP priority (training/lap.py)
  one AdamW step on the value loss (E4-E6), then on the policy loss (E7)
  priority <- max(max_k |Q_k - y|, 1) ** 0.4                             (E8)

(E1) unroll:  z~_0 = f(s_0);  (d~_t, z~_t, r~_t) = m(g(z~_{t-1}, a_{t-1})),  t = 1..H_enc (= 5)
(E2) per step: 1.0 * MSE(z~_t, f'(s_t)) + 0.1 * CE(r~_t, twohot(r_t)) + 0.1 * MSE(d~_t, d_t),
     each masked once an earlier step of the window terminated; the terminal term only once a
     terminal transition has been stored.  Reward targets are raw (unscaled) rewards.
(E3) L_enc = sum_t (E2)_t,  each MSE / CE a mean over the batch (and latent units).
(E4) R = sum_{i<H} gamma^i c_i r_{t+i},  c_0 = 1, c_i = prod_{j<i} (1 - d_{t+j})   (our fix of ``buffer.py``)
(E5) y = (R + gamma^H c_H rbar' min_k Q'_k(g'(z', a')) ) / rbar,
     z' = f'(s_{t+H}),  a' = clip(pi'(z') + clip(N(0, 0.2^2), -0.3, 0.3), -1, 1)
(E6) L_Q = mean_k Huber_1(Q_k(g(f(s_t), a_t)) - y),  encoder under stop-gradient
(E7) L_pi = -mean_k Q_k(g(z_s, pi(z_s))) + 1e-5 mean(pre^2),  z_s = sg(f(s_t)); only pi moves
(E8) LAP priority of the sampled window starts (no importance weights)

Design notes.

* The schedule is data, not Python: ``train_block`` is one ``lax.scan`` over gradient steps;
  the sync + encoder burst runs inside a ``lax.while_loop`` whose trip count is 1 on sync
  steps and 0 otherwise.  (A ``lax.cond`` would become a ``select`` under the loop's
  ``vmap`` over seeds and run the 250-step burst on *every* step; a while-loop with a
  batched predicate runs only while some seed needs it, and all seeds sync together.)
* The encoder is two plastic networks, ``state_encoder`` (f) and ``sa_encoder`` (z_a
  embedding, g and m), each with its own AdamW state: AdamW is per-parameter and the
  encoder has no gradient clipping, so this equals the reference's single optimizer.
* Hidden layers are ``networks.Trunk`` (instrumented for the plasticity code), whose
  LayerNorms carry scale/bias parameters; the optimizers zero those updates (and exempt them
  from weight decay), so they stay at 1 / 0: exactly the reference's affine-free LayerNorm,
  and the value network's global-norm clip covers the same parameters as the reference.
  Their epsilon is Flax's 1e-6 (PyTorch 1e-5; f's output LayerNorm, built here, uses 1e-5).
* Plasticity hooks: ``PLASTIC`` names four networks; each module reports ``features`` (z_s
  for f, z_sa for g); ``sample_batch`` draws metric / reset batches from the LAP buffer.
  SIGReg (``SIGREG_NETWORKS``) regularises z_s = f(s_0) inside L_enc; LEAST reads
  ``least_signals`` (online min-Q and a 1-step TD proxy, see there); the four optimizers come
  from ``plasticity.optim.optimizer`` (Kron / NE, see ``_optimizers``).  With NE the target
  networks take the masks at each hard sync (they are copies of masked params); between syncs
  they keep the previous topology, like every other part of the lagged target.  NE's experience
  review is refused (MR.Q samples its own LAP replay in ``train_block``): pass
  ``--plasticity.no-ne-review``.
* ``--network.width W`` multiplies every MR.Q width by W / 512 (``MRQConfig`` docstring).
* Vector observations and continuous actions only (the env layer provides nothing else):
  the pixel CNN encoder and the discrete-action Gumbel-softmax policy are not implemented.
* The replay stores each transition's obs and next_obs (frames held twice) in per-env
  streams; see training/lap.py.

Deviations from the reference code (facebookresearch/MRQ), each deliberate:

* Multi-step return: our corrected formula (E4), not the reference's ``buffer.py`` (commit 8a44a7d).
* Priority: the TD error of the *sampled* action, |Q_k(s_t, a_t) - y| (LAP's definition, and
  what the reference ``MRQ.py`` computes at its release).  A pre-release commit of the reference
  (0f0ed0e) returned the Q of the *policy* action, Q(s, pi(s)), from ``train_RL`` because the
  variable is reused for the policy loss, giving |Q(s, pi(s)) - y|: a bug fixed before the
  release.  ``priority_from_policy_q=True`` reproduces that pre-release behaviour, for comparison only.
* A window may be sampled only once all its transitions are stored (the reference can read
  a just-written terminal window before the next episode's first steps exist; masked
  anyway).  The validity mask uses max(H_enc, H_Q) for both samplers, as the reference does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from plasticity_zoo.agents.api import OffPolicyConfig, check_replay
from plasticity_zoo.buffers import lap
from plasticity_zoo.buffers.lap import Window
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.networks import DeterministicPolicyHead, MLPHead, Net, Trunk, TrunkSpec, build
from plasticity_zoo.networks.blocks import ACTIVATIONS, PAIRED_ACTIVATIONS, concat
from plasticity_zoo.networks.config import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    UNIT,
    NetworkConfig,
    Range,
    check_ranges,
)
from plasticity_zoo.plasticity import optim as optim_lib
from plasticity_zoo.plasticity.api import StaticPlasticity, declared_nets, declared_params
from plasticity_zoo.plasticity.injection import injectable
from plasticity_zoo.plasticity.sigreg import regularized

# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class MRQConfig(OffPolicyConfig):
    """MR.Q hyperparameters; defaults are the paper's Table 3 (as in the reference ``MRQ.py``), with the
    inherited batch 256, buffer 1M and replay ratio 1 (``updates_per_step``).

    Width scaling: ``--network.width W`` multiplies every MR.Q width by W / 512 (rounded,
    at least 1): hidden widths 512 -> W, z_s and z_sa 512 -> W, z_a 256 -> W / 2.  The
    paper's model is W = 512 (the default, ``None``; 3.86M parameters on HalfCheetah).
    ``--network.depth D`` sets each trunk's hidden depth (paper: f 2 plus its LN-ELU output
    layer, g 2, Q 3, pi 2); ``--network.activation`` replaces ELU and ReLU alike;
    ``--network.block`` / ``--network.layer-norm`` apply to the hidden trunks of f, g, Q and pi
    (f's output LayerNorm and the action embedding Linear -> ELU stay as they are).
    """

    learning_starts: int = 10_000
    """uniform-random env steps before learning starts"""
    gamma: float = 0.99
    target_update_freq: int = 250
    """T_target: every T_target updates, hard target copy + reward-scale update + T_target encoder steps"""
    exploration_noise: float = 0.2
    target_policy_noise: float = 0.2
    noise_clip: float = 0.3
    dyn_weight: float = 1.0
    reward_weight: float = 0.1
    done_weight: float = 0.1
    pre_activ_weight: float = 1e-5
    enc_horizon: int = 5
    """H_enc: encoder unroll length"""
    q_horizon: int = 3
    """H_Q: multi-step return length (1 = the paper's 1-step ablation)"""
    prioritized: bool = True
    """LAP prioritised sampling (False = the paper's no-LAP ablation: uniform over valid windows)"""
    alpha: float = 0.4
    min_priority: float = 1.0
    priority_from_policy_q: bool = False
    """priority from |Q(s, pi(s)) - y| (a pre-release bug of the reference code) instead of |Q(s, a) - y|"""
    reward_scaling: bool = True
    """divide value targets by the buffer's mean |reward| (False = the no-reward-scaling ablation)"""
    zs_dim: int = 512
    zsa_dim: int = 512
    za_dim: int = 256
    enc_hdim: int = 512
    enc_activ: str = "elu"
    enc_lr: float = 1e-4
    enc_wd: float = 1e-4
    value_hdim: int = 512
    value_activ: str = "elu"
    value_lr: float = 3e-4
    value_wd: float = 1e-4
    value_grad_clip: float = 20.0
    policy_hdim: int = 512
    policy_activ: str = "relu"
    policy_lr: float = 3e-4
    policy_wd: float = 1e-4
    num_bins: int = 65
    bin_lower: float = -10.0
    bin_upper: float = 10.0

    RANGES = {
        "gamma": UNIT,
        "target_update_freq": AT_LEAST_ONE,
        "exploration_noise": NON_NEGATIVE,
        "target_policy_noise": NON_NEGATIVE,
        "noise_clip": NON_NEGATIVE,
        "dyn_weight": NON_NEGATIVE,
        "reward_weight": NON_NEGATIVE,
        "done_weight": NON_NEGATIVE,
        "pre_activ_weight": NON_NEGATIVE,
        "enc_horizon": AT_LEAST_ONE,
        "q_horizon": AT_LEAST_ONE,
        "alpha": NON_NEGATIVE,
        "min_priority": POSITIVE,
        "zs_dim": AT_LEAST_ONE,
        "zsa_dim": AT_LEAST_ONE,
        "za_dim": AT_LEAST_ONE,
        "enc_hdim": AT_LEAST_ONE,
        "enc_lr": POSITIVE,
        "enc_wd": NON_NEGATIVE,
        "value_hdim": AT_LEAST_ONE,
        "value_lr": POSITIVE,
        "value_wd": NON_NEGATIVE,
        "value_grad_clip": POSITIVE,
        "policy_hdim": AT_LEAST_ONE,
        "policy_lr": POSITIVE,
        "policy_wd": NON_NEGATIVE,
        "num_bins": Range(2),
    }


CONFIG = MRQConfig
KIND = "offpolicy"
EXPERIENCE_REVIEW = False  # LAP replay of its own

# ----------------------------------------------------------------------------- two-hot reward (MRQ.py TwoHot)


def symlog(x):
    return jnp.sign(x) * jnp.log1p(jnp.abs(x))


def symexp(x):
    return jnp.sign(x) * jnp.expm1(jnp.abs(x))


def two_hot_bins(num_bins: int = 65, lower: float = -10.0, upper: float = 10.0):
    """Bins spaced linearly on [lower, upper] in symlog space: symexp(linspace(lower, upper, n))."""
    return symexp(jnp.linspace(lower, upper, num_bins, dtype=jnp.float32))


def two_hot(x, bins):
    """(...,) -> (..., n): weight on the two bins around x (x clipped to the bin range)."""
    x = jnp.clip(x, bins[0], bins[-1])
    i = jnp.clip(jnp.searchsorted(bins, x, side="right") - 1, 0, bins.shape[0] - 2)
    lo, hi = bins[i], bins[i + 1]
    w = (x - lo) / (hi - lo)
    n = bins.shape[0]
    return (1.0 - w)[..., None] * jax.nn.one_hot(i, n) + w[..., None] * jax.nn.one_hot(i + 1, n)


def two_hot_decode(probs, bins):
    """Expected value of a distribution over the bins."""
    return probs @ bins


def two_hot_cross_entropy(logits, x, bins):
    """CE(softmax(logits), twohot(x)) per sample."""
    return -jnp.sum(two_hot(x, bins) * jax.nn.log_softmax(logits, axis=-1), axis=-1)


# ----------------------------------------------------------------------------- networks (MRQ/models.py)


class StateEncoder(nnx.Module):
    """f: s -> z_s = ELU(LN(W_out h)), h the hidden LN-ELU trunk (vector observations).

    The output layer's LayerNorm has no parameters (eps 1e-5 as in PyTorch); its output z_s
    is the encoder's representation (``features``).  ``trunk`` + ``out`` is the layout the
    plasticity resets understand (the output layer is never reset).
    """

    def __init__(self, obs_dim: int, spec: TrunkSpec, zs_dim: int, *, rngs: nnx.Rngs):
        self.trunk = Trunk(obs_dim, spec, rngs=rngs)
        # a paired activation (CReLU, Fourier features) gives each unit two features: zs_dim / 2 units
        units = zs_dim // 2 if spec.activation in PAIRED_ACTIVATIONS else zs_dim
        self.out = nnx.Linear(spec.width, units, rngs=rngs)
        self.out_norm = nnx.LayerNorm(units, use_scale=False, use_bias=False, epsilon=1e-5, rngs=rngs)
        self.activation = spec.activation

    def __call__(self, x, probes=None):
        h, taps = self.trunk(x, probes)
        z = self.out_norm(self.out(h))
        pair = PAIRED_ACTIVATIONS.get(self.activation)
        zs = ACTIVATIONS[self.activation](z) if pair is None else concat(pair(z))
        return zs, {**taps, "features": zs}


class StateActionEncoder(nnx.Module):
    """Input [z_s, a] -> (z_sa, m(z_sa)): z_a = ELU(W_a a); z_sa = W_out g([z_s, z_a]); m linear.

    ``features`` is z_sa, the representation the MDP predictor (and the value) reads.
    """

    def __init__(
        self,
        zs_dim: int,
        act_dim: int,
        za_spec: TrunkSpec,
        spec: TrunkSpec,
        zsa_dim: int,
        model_dim: int,
        *,
        rngs: nnx.Rngs,
    ):
        self.zs_dim = zs_dim
        self.action = Trunk(act_dim, za_spec, rngs=rngs)
        self.trunk = Trunk(zs_dim + za_spec.width, spec, rngs=rngs)
        self.out = nnx.Linear(spec.width, zsa_dim, rngs=rngs)
        self.model = nnx.Linear(zsa_dim, model_dim, rngs=rngs)

    def __call__(self, x, probes=None):
        zs, a = x[..., : self.zs_dim], x[..., self.zs_dim :]
        sub = None if probes is None else {k[len("action/") :]: v for k, v in probes.items() if k.startswith("action/")}
        za, a_taps = self.action(a, sub)
        h, taps = self.trunk(jnp.concatenate([zs, za], axis=-1), probes)
        zsa = self.out(h)
        return (zsa, self.model(zsa)), {**{f"action/{k}": v for k, v in a_taps.items()}, **taps, "features": zsa}


def _keys(path) -> list:
    return [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]


def _is_frozen(path) -> bool:
    """LayerNorm scale/bias of an mlp trunk: kept at 1 / 0 (affine-free LN, as in MRQ/models.py)."""
    return "norms" in _keys(path)


def initializer(params, key):
    """MR.Q's initial params for a param tree (arrays or shapes): Xavier-uniform kernels with ReLU
    gain sqrt(2), zero biases, LayerNorm gains 1 (the reference's ``models.py``).

    The network's declared initializer (``build(..., initializer=)``), so ``Net.init`` (ReDo /
    ReGraMa resets) draws from it too.  Only shapes and dtypes are read.  Fans are a kernel's
    last two axes, so a tree with a leading member axis gets the same per-member distribution.
    All kernels come from one uniform draw, which keeps ``init`` cheap to trace, compile and run.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    kernels = [x.size for path, x in leaves if _keys(path)[-1] == "kernel"]
    u = jax.random.uniform(key, (sum(kernels),), jnp.float32, -1.0, 1.0)
    out, offset = [], 0
    for path, x in leaves:
        leaf = _keys(path)[-1]
        if leaf == "kernel":
            limit = math.sqrt(2.0) * math.sqrt(6.0 / (x.shape[-2] + x.shape[-1]))
            out.append(limit * u[offset : offset + x.size].reshape(x.shape).astype(x.dtype))
            offset += x.size
        elif leaf in ("bias", "scale"):
            out.append(jnp.full(x.shape, 1.0 if leaf == "scale" else 0.0, x.dtype))
        else:
            raise ValueError(f"MR.Q init: unexpected parameter {jax.tree_util.keystr(path)}")
    return jax.tree_util.tree_unflatten(treedef, out)


def _build(name: str, make_module, key, ensemble: int = 0):
    """``networks.build`` with ``initializer`` declared, traced abstractly (no default init) -> (Net, params).

    The params are ``initializer`` applied to the whole param tree with ``key`` (for the value
    ensemble: one draw for both members, as MR.Q has always been initialised here); ``Net.init``
    applies the same function member by member.  The distribution is the same either way.
    """
    made = {}

    def abstract(k):
        made["net"], params = build(name, make_module, k, ensemble=ensemble, initializer=initializer)
        return params

    shapes = jax.eval_shape(abstract, key)
    return made["net"], initializer(shapes, key)


def _freeze():
    """Zero the updates of every mlp-trunk LayerNorm scale/bias (affine-free LN, as in MRQ/models.py)."""
    frozen = lambda t: jax.tree_util.tree_map_with_path(lambda p, _: _is_frozen(p), t)  # noqa: E731
    return optax.masked(optax.set_to_zero(), frozen)


def _adamw(lr: float, wd: float, clip: float | None = None):
    """Optional global-norm clip, then AdamW (decoupled weight decay, torch defaults; no decay on LN params)."""
    trainable = lambda t: jax.tree_util.tree_map_with_path(lambda p, _: not _is_frozen(p), t)  # noqa: E731
    chain = [] if clip is None else [optax.clip_by_global_norm(clip)]
    chain.append(optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=wd, mask=trainable))
    return optax.chain(*chain)


def _optimizers(cfg: MRQConfig, plasticity: StaticPlasticity):
    """(state encoder, state-action encoder, value, policy) optimizers (paper Eqs. 14, 19, 20; settings from Table 3).

    Each is ``chain(freeze LN, plasticity.optim.optimizer(...), freeze LN)``: the shared factory
    (so the loop can switch Kron / NE masks on) between two LayerNorm freezes.  By default the
    factory's transformation is ``_adamw`` (the value net's global-norm clip 20 included), so the
    chain equals the reference's AdamW on affine-free LayerNorms.  With ``--plasticity.kron`` it
    is PSGD-Kron (lr / 3, MR.Q's weight decay) and the LayerNorm params still stay at 1 / 0 (the
    outer freezes), but the value net's gradient clip does not apply (it is part of the Adam
    path the factory replaces).  With ``--plasticity.ne`` the factory wraps that transformation
    in the NE mask (gradients masked *before* the clip), and the last freeze only touches
    LayerNorm params, which are never masked, so pruned weights still stay exactly 0.
    """

    def make(name, lr, wd, clip=None):
        tx = optim_lib.optimizer(
            lr,
            name,
            make=lambda lr, **_: _adamw(lr, wd, clip),
            ensemble=name == "value",
            spec=plasticity.optim,
            weight_decay=wd,
        )
        return optax.chain(_freeze(), tx, _freeze())

    return (
        make("state_encoder", cfg.enc_lr, cfg.enc_wd),
        make("sa_encoder", cfg.enc_lr, cfg.enc_wd),
        make("value", cfg.value_lr, cfg.value_wd, cfg.value_grad_clip),
        make("policy", cfg.policy_lr, cfg.policy_wd),
    )


def dims(cfg: MRQConfig, network: NetworkConfig) -> dict:
    """Widths after ``--network.width`` scaling (factor W / 512)."""
    s = 1.0 if network.width is None else network.width / 512
    d = lambda n: max(1, int(round(n * s)))  # noqa: E731
    return {
        "zs": d(cfg.zs_dim),
        "zsa": d(cfg.zsa_dim),
        "za": d(cfg.za_dim),
        "enc": d(cfg.enc_hdim),
        "value": d(cfg.value_hdim),
        "policy": d(cfg.policy_hdim),
    }


# ----------------------------------------------------------------------------- state


@struct.dataclass
class MRQState:
    encoder_params: object  # f
    sa_encoder_params: object  # z_a embedding, g and the MDP predictor m
    value_params: object  # Q1, Q2 (a 2-member ensemble)
    policy_params: object
    target_encoder_params: object
    target_sa_encoder_params: object
    target_value_params: object
    target_policy_params: object
    encoder_opt: object
    sa_encoder_opt: object
    value_opt: object
    policy_opt: object
    reward_scale: jax.Array  # rbar, recomputed at every target sync
    target_reward_scale: jax.Array  # rbar', the previous rbar
    updates: jax.Array  # value/policy steps taken
    syncs: jax.Array  # target syncs (each followed by an encoder burst)
    encoder_updates: jax.Array
    encoder_metrics: dict  # means over the last encoder burst
    exploration_noise: jax.Array  # sigma of the Gaussian exploration noise (cfg value; LEAST may raise it)
    cfg: MRQConfig = struct.field(pytree_node=False)
    state_encoder: Net = struct.field(pytree_node=False)
    sa_encoder: Net = struct.field(pytree_node=False)
    value: Net = struct.field(pytree_node=False)
    policy: Net = struct.field(pytree_node=False)
    zs_dim: int = struct.field(pytree_node=False)
    act_dim: int = struct.field(pytree_node=False)
    plasticity: StaticPlasticity = struct.field(pytree_node=False, default=StaticPlasticity())


PLASTIC = {
    "state_encoder": ("encoder_params", "encoder_opt"),
    "sa_encoder": ("sa_encoder_params", "sa_encoder_opt"),
    "value": ("value_params", "value_opt"),
    "policy": ("policy_params", "policy_opt"),
}
# The target copy of each plastic network (a layer reset re-draws it with the network: plasticity/perturb.py).
PLASTIC_TARGETS = {
    "state_encoder": "target_encoder_params",
    "sa_encoder": "target_sa_encoder_params",
    "value": "target_value_params",
    "policy": "target_policy_params",
}

_ENCODER_METRICS = ("losses/encoder", "losses/dynamics", "losses/reward", "losses/terminal")


def init(
    key,
    obs_dim: int,
    act_dim: int,
    cfg: MRQConfig,
    network: NetworkConfig = NetworkConfig(),
    plasticity: StaticPlasticity = StaticPlasticity(),
) -> MRQState:
    check_ranges(cfg)
    if not cfg.bin_lower < cfg.bin_upper:
        raise ValueError(f"--bin-lower {cfg.bin_lower} must be below --bin-upper {cfg.bin_upper}")
    check_replay(cfg)
    w = dims(cfg, network)
    over = dataclasses.replace(network, width=None)  # widths are scaled by ``dims``, not replaced

    def spec(width, depth, activation):
        return over.trunk(TrunkSpec(width, depth, "mlp", activation, layer_norm=True))

    enc_spec, sa_spec = spec(w["enc"], 2, cfg.enc_activ), spec(w["enc"], 2, cfg.enc_activ)
    za_spec = TrunkSpec(w["za"], 1, "mlp", network.activation or cfg.enc_activ, layer_norm=False)
    value_spec, policy_spec = spec(w["value"], 3, cfg.value_activ), spec(w["policy"], 2, cfg.policy_activ)
    model_dim = 1 + w["zs"] + cfg.num_bins

    k = jax.random.split(key, 4)
    state_encoder, f_params = _build("state_encoder", lambda r: StateEncoder(obs_dim, enc_spec, w["zs"], rngs=r), k[0])
    sa_encoder, g_params = _build(
        "sa_encoder",
        lambda r: StateActionEncoder(w["zs"], act_dim, za_spec, sa_spec, w["zsa"], model_dim, rngs=r),
        k[1],
    )
    # injectable: the heads plasticity injection may give a residual head (the encoders are the representation)
    value, v_params = injectable(
        *_build("value", lambda r: MLPHead(w["zsa"], 1, value_spec, rngs=r), k[2], ensemble=2), plasticity
    )
    policy, p_params = injectable(
        *_build("policy", lambda r: DeterministicPolicyHead(w["zs"], act_dim, policy_spec, rngs=r), k[3]), plasticity
    )
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (distinct buffers: the loop donates state)
    tx_f, tx_g, tx_v, tx_p = _optimizers(cfg, plasticity)
    zero = lambda: jnp.zeros((), jnp.float32)  # noqa: E731  (a fresh buffer per leaf: the loop donates state)
    return MRQState(
        f_params,
        g_params,
        v_params,
        p_params,
        copy(f_params),
        copy(g_params),
        copy(v_params),
        copy(p_params),
        tx_f.init(f_params),
        tx_g.init(g_params),
        tx_v.init(v_params),
        tx_p.init(p_params),
        reward_scale=jnp.ones((), jnp.float32),
        target_reward_scale=zero(),  # reference: 1 and 0 until the first sync
        updates=jnp.zeros((), jnp.int32),
        syncs=jnp.zeros((), jnp.int32),
        encoder_updates=jnp.zeros((), jnp.int32),
        encoder_metrics={m: zero() for m in _ENCODER_METRICS},
        exploration_noise=jnp.asarray(cfg.exploration_noise, jnp.float32),
        cfg=cfg,
        state_encoder=state_encoder,
        sa_encoder=sa_encoder,
        value=value,
        policy=policy,
        zs_dim=w["zs"],
        act_dim=act_dim,
        plasticity=plasticity,
    )


def param_count(state: MRQState) -> dict:
    """Trainable parameters per network (frozen LayerNorm gains/biases excluded)."""

    def count(params):
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        return sum(x.size for path, x in leaves if not _is_frozen(path))

    return {
        "state_encoder": count(state.encoder_params),
        "sa_encoder": count(state.sa_encoder_params),
        "value": count(state.value_params),
        "policy": count(state.policy_params),
    }


# ----------------------------------------------------------------------------- acting (exploration noise, Table 3)


def with_exploration_noise(state: MRQState, sigma) -> MRQState:
    """Set the exploration noise's standard deviation (LEAST's optional noise increase)."""
    return state.replace(exploration_noise=jnp.asarray(sigma, jnp.float32))


def act(state: MRQState, obs, key, explore: bool):
    """pi(f(s)); exploring adds N(0, sigma^2) (sigma = 0.2 unless LEAST raised it) and clips to [-1, 1]."""
    zs = state.state_encoder(state.encoder_params, obs)
    action, _ = state.policy(state.policy_params, zs)
    if explore:
        noise = state.exploration_noise * jax.random.normal(key, action.shape, action.dtype)
        action = jnp.clip(action + noise, -1.0, 1.0)
    return action


# ----------------------------------------------------------------------------- losses


def _split_model(state: MRQState, pred):
    """MDP predictor output -> (terminal (B,), next z_s (B, Z), reward logits (B, bins))."""
    return pred[..., 0], pred[..., 1 : 1 + state.zs_dim], pred[..., 1 + state.zs_dim :]


def encoder_loss(encoder_params, sa_encoder_params, state: MRQState, win: Window, use_terminal):
    """L_enc (E1-E3): the model unrolled H steps in latent space from z~_0 = f(s_0).

    ``use_terminal`` (0/1) switches the terminal term on once a terminal transition is stored.
    Returns (loss, (dynamics, reward, terminal) summed over the unroll, unweighted).
    """
    cfg = state.cfg
    b, h = win.reward.shape
    bins = two_hot_bins(cfg.num_bins, cfg.bin_lower, cfg.bin_upper)
    z = state.state_encoder(encoder_params, win.obs)  # online first (plasticity probes this call)
    targets = jax.lax.stop_gradient(
        state.state_encoder(state.target_encoder_params, win.next_obs.reshape(b * h, -1))
    ).reshape(b, h, -1)
    done = win.terminated.astype(jnp.float32)
    alive = jnp.ones((b,), jnp.float32)  # 0 once an earlier step of the window terminated
    dyn_sum = rew_sum = term_sum = jnp.zeros(())
    for t in range(h):
        _, pred = state.sa_encoder(sa_encoder_params, z, win.action[:, t])
        d_pred, z, r_logits = _split_model(state, pred)
        dyn_sum += jnp.mean((z - targets[:, t]) ** 2 * alive[:, None])
        rew_sum += jnp.mean(two_hot_cross_entropy(r_logits, win.reward[:, t], bins) * alive)
        term_sum += jnp.mean((d_pred - done[:, t]) ** 2 * alive) * use_terminal
        alive = alive * (1.0 - done[:, t])
    loss = cfg.dyn_weight * dyn_sum + cfg.reward_weight * rew_sum + cfg.done_weight * term_sum
    return loss, (dyn_sum, rew_sum, term_sum)


def value_target(state: MRQState, win: Window, key):
    """y of (E4)-(E5) for windows of H transitions, from the target networks; (B,)."""
    cfg = state.cfg
    h = win.reward.shape[1]
    ret, survive = lap.multistep_return(win.reward, win.terminated, cfg.gamma)
    next_zs = state.state_encoder(state.target_encoder_params, win.next_obs[:, -1])
    next_action, _ = state.policy(state.target_policy_params, next_zs)
    noise = jnp.clip(
        cfg.target_policy_noise * jax.random.normal(key, next_action.shape, next_action.dtype),
        -cfg.noise_clip,
        cfg.noise_clip,
    )
    next_action = jnp.clip(next_action + noise, -1.0, 1.0)
    next_zsa, _ = state.sa_encoder(state.target_sa_encoder_params, next_zs, next_action)
    next_q = state.value(state.target_value_params, next_zsa).min(axis=0)
    y = (ret + cfg.gamma**h * survive * state.target_reward_scale * next_q) / state.reward_scale
    return jax.lax.stop_gradient(y)


def value_loss(value_params, state: MRQState, zsa, y):
    """(E6): Huber (delta 1) of both heads against y, averaged.  Returns (loss, Q (2, B))."""
    q = state.value(value_params, zsa)
    return optax.huber_loss(q, y[None], delta=1.0).mean(), q


def policy_loss(policy_params, state: MRQState, zs, value_params):
    """(E7): -mean of both Q heads at pi(z_s) + pre-activation penalty.  Returns (loss, Q (2, B))."""
    action, pre = state.policy(policy_params, zs)
    zsa, _ = state.sa_encoder(state.sa_encoder_params, zs, action)
    q = state.value(value_params, zsa)
    return -q.mean() + state.cfg.pre_activ_weight * jnp.mean(pre**2), q


def _online_embeddings(state: MRQState, win: Window):
    """sg(z_s), sg(z_sa) of the windows' first transitions from the online encoder."""
    zs = state.state_encoder(state.encoder_params, win.obs)
    zsa, _ = state.sa_encoder(state.sa_encoder_params, zs, win.action[:, 0])
    return jax.lax.stop_gradient(zs), jax.lax.stop_gradient(zsa)


# ----------------------------------------------------------------------------- updates


def rl_update(state: MRQState, win: Window, key):
    """One value step then one policy step on windows of H_Q transitions -> (state, priorities, metrics)."""
    cfg = state.cfg
    _, _, tx_v, tx_p = _optimizers(cfg, state.plasticity)
    y = value_target(state, win, key)
    zs, zsa = _online_embeddings(state, win)

    (v_loss, q), grads = jax.value_and_grad(value_loss, has_aux=True)(state.value_params, state, zsa, y)
    upd, value_opt = tx_v.update(grads, state.value_opt, state.value_params)
    value_params = optax.apply_updates(state.value_params, upd)

    (p_loss, q_pi), grads = jax.value_and_grad(policy_loss, has_aux=True)(state.policy_params, state, zs, value_params)
    upd, policy_opt = tx_p.update(grads, state.policy_opt, state.policy_params)
    policy_params = optax.apply_updates(state.policy_params, upd)

    td = jnp.abs((q_pi if cfg.priority_from_policy_q else q) - y[None]).max(axis=0)  # (E8)
    priorities = lap.priority(td, cfg.alpha, cfg.min_priority)
    state = state.replace(
        value_params=value_params,
        value_opt=value_opt,
        policy_params=policy_params,
        policy_opt=policy_opt,
        updates=state.updates + 1,
    )
    metrics = {
        "losses/value": v_loss,
        "losses/policy": p_loss,
        "values/q_mean": q.mean(),
        "values/target_mean": y.mean(),
        "charts/td_abs_mean": td.mean(),
    }
    return state, priorities, metrics


def encoder_update(state: MRQState, win: Window, use_terminal, reg_key=None):
    """One AdamW step of f and g/m on L_enc (E1-E3).

    With ``--plasticity.sigreg-coef`` L_enc adds SIGReg of z_s = f(s_0), the online state
    encoder's output (its first call in ``encoder_loss``): the representation the policy reads
    and g turns into the value's z_sa.  ``reg_key`` draws its random directions.
    """
    tx_f, tx_g, _, _ = _optimizers(state.cfg, state.plasticity)
    (loss, parts), (g_f, g_g) = jax.value_and_grad(
        regularized(encoder_loss, "state_encoder"), argnums=(0, 1), has_aux=True
    )(
        state.encoder_params,
        state.sa_encoder_params,
        state,
        win,
        use_terminal,
        reg_key=reg_key,
        sigreg=state.plasticity.sigreg,
    )
    upd, encoder_opt = tx_f.update(g_f, state.encoder_opt, state.encoder_params)
    encoder_params = optax.apply_updates(state.encoder_params, upd)
    upd, sa_opt = tx_g.update(g_g, state.sa_encoder_opt, state.sa_encoder_params)
    sa_params = optax.apply_updates(state.sa_encoder_params, upd)
    state = state.replace(
        encoder_params=encoder_params,
        encoder_opt=encoder_opt,
        sa_encoder_params=sa_params,
        sa_encoder_opt=sa_opt,
        encoder_updates=state.encoder_updates + 1,
    )
    return state, jnp.stack([loss, *parts])


def sync(state: MRQState, buffer: lap.LAPBuffer) -> MRQState:
    """Hard-copy every network into its target; rbar' <- rbar, rbar <- mean |r| of the buffer."""
    scale = lap.reward_scale(buffer) if state.cfg.reward_scaling else jnp.ones((), jnp.float32)
    return state.replace(
        target_encoder_params=state.encoder_params,
        target_sa_encoder_params=state.sa_encoder_params,
        target_value_params=state.value_params,
        target_policy_params=state.policy_params,
        target_reward_scale=state.reward_scale,
        reward_scale=scale,
        syncs=state.syncs + 1,
    )


def sync_and_train_encoder(state: MRQState, buffer: lap.LAPBuffer, key) -> MRQState:
    """The synchronised block (paper Sec. 4.2): target sync, then T_target encoder steps back to back."""
    cfg = state.cfg
    state = sync(state, buffer)
    tree = buffer.weights if cfg.prioritized else buffer.counts  # priorities do not change during the burst
    use_terminal = buffer.ever_terminated.astype(jnp.float32)

    def step(state, k):
        k_draw, k_reg = jax.random.split(k)
        win = lap.window(buffer, lap.draw_tree(tree, k_draw, cfg.batch_size), cfg.enc_horizon)
        return encoder_update(state, win, use_terminal, k_reg)

    state, logs = jax.lax.scan(step, state, jax.random.split(key, cfg.target_update_freq))
    logs = logs.mean(axis=0)
    return state.replace(encoder_metrics=dict(zip(_ENCODER_METRICS, logs)))


def _run_if(pred, fn, x, operand):
    """``fn(x, operand)`` if ``pred`` else ``x``, as a 0/1-trip while-loop (stays lazy under vmap; see
    module doc).

    ``operand`` (the replay) reaches ``fn`` through an optimisation barrier together with the trip
    counter: otherwise XLA hoists work on it that does not depend on the loop (the O(capacity)
    reward scale of ``sync``) out of the loop, and runs it on every call whether the loop runs or not."""

    def body(carry):
        i, x = carry
        _, operand_now = jax.lax.optimization_barrier((i, operand))
        return i + 1, fn(x, operand_now)

    n = pred.astype(jnp.int32)
    return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.zeros((), jnp.int32), x))[1]


def train_block(state: MRQState, buffer: lap.LAPBuffer, key, num_updates: int, replay_control=None):
    """``num_updates`` MR.Q training steps as one scan -> (state, buffer with new priorities, metrics).

    MR.Q samples its own LAP windows, so NE's replay controls (``replay_control``: experience
    review, auto batch) do not apply (``EXPERIENCE_REVIEW = False``: the plasticity checks refuse
    them before a run starts)."""
    if replay_control is not None:
        raise ValueError("MR.Q samples LAP windows: NE's experience review and auto batch do not apply")
    cfg = state.cfg
    if buffer.horizon.shape[-1] != max(cfg.enc_horizon, cfg.q_horizon):
        raise ValueError(
            f"the LAP buffer keeps windows of {buffer.horizon.shape[-1]} transitions, the config needs "
            f"{max(cfg.enc_horizon, cfg.q_horizon)}: build it with buffer_init(..., cfg)"
        )

    def one(carry, key):
        state, buffer = carry
        k_sync, k_sample, k_rl = jax.random.split(key, 3)
        state = _run_if(
            state.updates % cfg.target_update_freq == 0,
            lambda s, b: sync_and_train_encoder(s, b, k_sync),
            state,
            buffer,
        )
        idx = lap.draw_tree(buffer.weights if cfg.prioritized else buffer.counts, k_sample, cfg.batch_size)
        state, priorities, metrics = rl_update(state, lap.window(buffer, idx, cfg.q_horizon), k_rl)
        if cfg.prioritized:
            buffer = lap.update_priorities(buffer, idx, priorities)
        return (state, buffer), metrics

    (state, buffer), metrics = jax.lax.scan(one, (state, buffer), jax.random.split(key, num_updates))
    metrics = jax.tree.map(lambda m: m.mean(), metrics)
    metrics.update(state.encoder_metrics)
    metrics.update(
        {
            "charts/reward_scale": state.reward_scale,
            "charts/target_reward_scale": state.target_reward_scale,
            "charts/max_priority": buffer.max_priority,
            "charts/valid_windows": lap.valid_windows(buffer),
        }
    )
    return state, buffer, metrics


def update(state: MRQState, batch: Window, key):
    """One value + policy step on a given window batch (no sync, no priorities): ``(state, metrics)``.

    The training loop uses ``train_block``, which also owns the schedule and the replay.
    """
    state, _, metrics = rl_update(state, _first(batch, state.cfg.q_horizon), key)
    return state, metrics


def work_per_env_step(state: MRQState, batch: Window, key):
    """The average training work of one env step, for FLOP counting (scripts/benchmark.py):
    one value + policy update and one encoder step (the 250-step burst runs every 250 steps)."""
    state, _ = update(state, batch, key)
    return encoder_update(state, batch, jnp.ones((), jnp.float32), key)[0]


# ----------------------------------------------------------------------------- replay hooks for the loop


def buffer_init(capacity: int, obs_dim: int, act_dim: int, cfg: MRQConfig) -> lap.LAPBuffer:
    """LAP buffer with per-env subtrajectory streams, its sum trees kept for windows of max(H_enc, H_Q);
    the running max priority starts at the minimum priority (1 by default)."""
    return lap.init(
        capacity, obs_dim, act_dim, initial_priority=cfg.min_priority, horizon=max(cfg.enc_horizon, cfg.q_horizon)
    )


buffer_add = lap.add


def sample_batch(state: MRQState, buffer: lap.LAPBuffer, key, batch_size: int) -> Window:
    """Windows for plasticity metrics / resets: uniform over valid windows of the run's H_enc."""
    h = state.cfg.enc_horizon
    return lap.sample(buffer, key, batch_size, h, prioritized=False, mask_horizon=max(h, state.cfg.q_horizon))[1]


# ----------------------------------------------------------------------------- plasticity hooks


def _first(win: Window, h: int) -> Window:
    """The first ``h`` transitions of each window (windows shorter than h are kept whole)."""
    return win._replace(
        action=win.action[:, :h],
        reward=win.reward[:, :h],
        next_obs=win.next_obs[:, :h],
        terminated=win.terminated[:, :h],
        truncated=win.truncated[:, :h],
    )


plastic_params = declared_params(PLASTIC)
plastic_nets = declared_nets(PLASTIC)


def plastic_losses(state: MRQState, batch: Window, key):
    """Per plastic network, its training loss as a function of its params (``batch``: H_enc windows)."""
    q_win = _first(batch, state.cfg.q_horizon)
    y = value_target(state, q_win, key)
    zs, zsa = _online_embeddings(state, q_win)
    return {
        "state_encoder": lambda p: encoder_loss(p, state.sa_encoder_params, state, batch, 1.0)[0],
        "sa_encoder": lambda p: encoder_loss(state.encoder_params, p, state, batch, 1.0)[0],
        "value": lambda p: value_loss(p, state, zsa, y)[0],
        "policy": lambda p: policy_loss(p, state, zs, state.value_params)[0],
    }


SIGREG_NETWORKS = ("state_encoder",)  # L_enc is wrapped with plasticity.sigreg.regularized (encoder_update)


def least_signals(state: MRQState, transition: Transition, key):
    """LEAST's per-step signals for a batch of single transitions (leading axis: the envs).

    q: the online min_k Q_k(g(f(s), a), the same min over the twin heads that MR.Q's target
    (E5) uses.  td_loss: mean over the two heads of (Q_k - y)^2 against a *1-step* proxy of the
    3-step target (E4-E5): y = (r + gamma (1 - terminated) rbar' min_k Q'_k(g'(f'(s'), a'))) / rbar,
    a' the target policy's noisy action; a single transition has no H_Q-step window.  Both are in
    MR.Q's reward-scaled value units (divided by rbar), as its value net is trained.
    """
    win = Window(
        transition.obs,
        transition.action[:, None],
        transition.reward[:, None],
        transition.next_obs[:, None],
        transition.terminated[:, None],
        transition.truncated[:, None],
    )
    y = value_target(state, win, key)
    zs = state.state_encoder(state.encoder_params, transition.obs)
    zsa, _ = state.sa_encoder(state.sa_encoder_params, zs, transition.action)
    q = state.value(state.value_params, zsa)  # (2, B)
    return q.min(axis=0), ((q - y[None]) ** 2).mean(axis=0)
