"""PPO for continuous control (CleanRL's 1M-step protocol) with an optional Gaussian trust region (GTR).

Defaults: CleanRL's 1M-step MuJoCo protocol (Huang et al. 2022; vwxyzjn/cleanrl ``ppo_continuous_action.py``).  One
iteration collects ``num_steps`` x ``num_envs`` transitions (the loop, ``training/loops/onpolicy.py``), then
``update`` computes GAE and runs ``update_epochs`` x ``num_minibatches`` gradient steps as one
``lax.scan`` (an epoch scan around a minibatch scan):

  ratio  r = pi(a|s) / pi_old(a|s)
  policy L_pi = E[max(-A r, -A clip(r, 1 - eps, 1 + eps))]        (``--no-clip``: E[-A r])
  value  L_V  = 0.5 E[max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)]  (value clipping)
  loss   L_pi - c_ent H + c_V L_V (+ the GTR penalty with ``--trust-region gtr``, ``agents/gtr.py``)
  Adam(eps 1e-5) on actor and critic, lr annealed linearly to 0, one global grad-norm clip (0.5).
  (Built with ``plasticity.optim.optimizer``: ``--plasticity.kron`` / ``--plasticity.ne`` switch it;
  see ``_optimizers``.)

Advantages: GAE(gamma, lambda) with ``terminated`` and ``truncated`` kept apart
(Gymnasium 1.x semantics, unlike PureJaxRL's ``done``): at a termination the next value is 0; at a truncation the
next value is V(true final observation) and the GAE trace is cut there.

Networks: separate 64-64 tanh actor and critic, orthogonal init (hidden sqrt 2, actor head 0.01,
critic head 1.0; applied to the ``mlp`` block, other blocks keep their own init), a state-independent
log-std initialised to 0.

Normalisation (CleanRL's wrappers, with the statistics in the agent state so they are checkpointed):
observations by a running mean/variance (count starts at 1e-4) and clipped to +-10; rewards divided by
the running std of the discounted return ``G <- gamma G (1 - terminated) + r`` (Gymnasium
``NormalizeReward``: the return is reset by terminations only) and clipped to +-10.  Each seed's
statistics are shared by that seed's envs and updated with every vector step's batch (CleanRL keeps
one normaliser per env; with its single env the two agree).  The true final observation of an ended
episode is normalised with the current statistics but does not update them.

GTR (``--trust-region gtr``, arXiv 2606.03382): a Gaussian-kernel penalty on the distance to recent
policies (anchors), added to the actor's loss; its math and our reconstruction of it are
``agents/gtr.py``, its settings the ``gtr_*`` fields of ``PPOConfig``.  Here it is three calls: at the
start of ``update`` the rollout policy joins the anchors and their per-sample statistics are computed
once for the iteration, ``actor_loss`` adds the penalty, and the KL to each anchor is logged.

Diagnostics per iteration: for every run ``diag/update_cosine`` (cosine between consecutive
iteration-level actor-parameter deltas) and ``diag/directional_efficiency`` (net actor-parameter
displacement / path length over the last ``diag_window`` iterations), plus ``charts/approx_kl``,
``charts/clipfrac``, ``charts/explained_variance``; with GTR its own (``gtr/*``, ``agents/gtr.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.flatten_util import ravel_pytree

from plasticity_zoo.agents import gtr
from plasticity_zoo.networks import Net, TrunkSpec, build, distributions, orthogonal
from plasticity_zoo.networks.blocks import Trunk
from plasticity_zoo.networks.config import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, RATE, UNIT, NetworkConfig, check_ranges
from plasticity_zoo.networks.distributions import gaussian_log_prob
from plasticity_zoo.plasticity import optim as optim_lib
from plasticity_zoo.plasticity.api import StaticPlasticity, declared_nets, declared_params
from plasticity_zoo.plasticity.injection import injectable
from plasticity_zoo.plasticity.sigreg import regularized

LOG_2PI_E = math.log(2.0 * math.pi) + 1.0


@dataclass(frozen=True)
class PPOConfig:
    """PPO hyperparameters (defaults: CleanRL ppo_continuous_action, 1M-step MuJoCo protocol)."""

    num_steps: int = 2048
    """rollout length per env (batch = num_steps x num_envs)"""
    num_minibatches: int = 32
    update_epochs: int = 10
    learning_rate: float = 3e-4
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the run"""
    adam_eps: float = 1e-5
    gamma: float = 0.99
    gae_lambda: float = 0.95
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip: bool = True
    """use the clipped surrogate (--no-clip: the plain importance-weighted surrogate)"""
    clip_coef: float = 0.2
    clip_vloss: bool = True
    """value clipping (with clip_coef)"""
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: Optional[float] = None
    """stop an iteration's epochs once an epoch's last approx_kl exceeds this (None: never)"""
    norm_obs: bool = True
    norm_reward: bool = True
    obs_clip: float = 10.0
    reward_clip: float = 10.0
    action_mode: Literal["clip", "rescale"] = "clip"
    """how actions reach the env: clip = the Gaussian sample in the env's units, clipped to its bounds
    (CleanRL's ClipAction); rescale = the sample clipped to [-1, 1] and mapped onto the bounds.  The
    log-probability is of the unclipped sample either way; they differ where bounds are not +-1"""
    backend: Literal["sync", "gymnasium", "async", "envpool"] = "sync"
    """vector-env backend (gymnasium = sync; envpool is optional and Gymnasium ids only)"""
    trust_region: Literal["clip", "gtr"] = "clip"
    """clip: PPO; gtr: add the Gaussian-kernel trust-region penalty (our reconstruction)"""
    gtr_form: Literal["kl", "logratio"] = "kl"
    """kl: kernel on the per-state KL to each anchor; logratio: on the per-sample log-ratio"""
    gtr_beta: float = 0.02
    """penalty bound beta (local KL coefficient = beta / (2 sigma^2))"""
    gtr_sigma2: float = 0.01
    """kernel width sigma^2 in KL units (kl form)"""
    gtr_logratio_sigma: float = 0.2
    """kernel width on the log-ratio (logratio form)"""
    gtr_anchors: int = 4
    """number M of anchor policies (the last M iteration-end policies)"""
    gtr_weights: Literal["recency", "uniform", "ema"] = "recency"
    gtr_decay: float = 0.8
    """recency weights w_k ∝ decay^age"""
    gtr_ema_tau: float = 0.1
    """EMA anchor rate (gtr_weights=ema)"""
    diag_window: int = 16
    """iterations over which directional efficiency is measured"""
    ns_reset_norm: bool = True
    """non-stationary envs: reset the obs/reward normalisers at each switch (C-CHAIN, Plasticine)"""

    RANGES = {
        "num_steps": AT_LEAST_ONE,
        "num_minibatches": AT_LEAST_ONE,
        "update_epochs": AT_LEAST_ONE,
        "learning_rate": POSITIVE,
        "adam_eps": POSITIVE,
        "gamma": UNIT,
        "gae_lambda": UNIT,
        "clip_coef": POSITIVE,
        "ent_coef": NON_NEGATIVE,
        "vf_coef": NON_NEGATIVE,
        "max_grad_norm": POSITIVE,
        "target_kl": POSITIVE,
        "obs_clip": POSITIVE,
        "reward_clip": POSITIVE,
        "gtr_beta": NON_NEGATIVE,
        "gtr_sigma2": POSITIVE,
        "gtr_logratio_sigma": POSITIVE,
        "gtr_anchors": AT_LEAST_ONE,
        "gtr_decay": RATE,
        "gtr_ema_tau": RATE,
        "diag_window": AT_LEAST_ONE,
    }


class RunningMeanStd(NamedTuple):
    mean: jax.Array
    var: jax.Array
    count: jax.Array


def rms_init(shape=()) -> RunningMeanStd:
    return RunningMeanStd(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32), jnp.asarray(1e-4, jnp.float32))


def rms_update(rms: RunningMeanStd, x) -> RunningMeanStd:
    """Merge a batch ``x`` (leading axis = samples) into the running moments (parallel algorithm)."""
    n = x.shape[0]
    b_mean, b_var = x.mean(axis=0), x.var(axis=0)
    delta = b_mean - rms.mean
    total = rms.count + n
    mean = rms.mean + delta * n / total
    m2 = rms.var * rms.count + b_var * n + delta**2 * rms.count * n / total
    return RunningMeanStd(mean, m2 / total, total)


class Rollout(NamedTuple):
    """One seed's iteration of experience, time-major.  Slot ``num_steps`` of ``obs``/``values``
    holds the bootstrap observation s_T and V(s_T) (its ``actions``/``logp`` are unused)."""

    obs: jax.Array  # (T + 1, E, obs_dim), normalised
    actions: jax.Array  # (T + 1, E, act_dim), unclipped Gaussian samples
    logp: jax.Array  # (T + 1, E)
    values: jax.Array  # (T + 1, E)
    rewards: jax.Array  # (T, E), normalised
    terminated: jax.Array  # (T, E)
    truncated: jax.Array  # (T, E)
    final_values: jax.Array  # (T, E): V(true final obs), used where truncated


class Minibatch(NamedTuple):
    obs: jax.Array
    actions: jax.Array
    logp: jax.Array
    values: jax.Array
    advantages: jax.Array
    returns: jax.Array
    anchor_mean: jax.Array = None  # (B, M, A)  kl form
    anchor_log_std: jax.Array = None  # (B, M, A)
    anchor_logp: jax.Array = None  # (B, M)     logratio form


@struct.dataclass
class PPOState:
    actor_params: object
    critic_params: object
    actor_opt: object
    critic_opt: object
    obs_rms: RunningMeanStd
    ret_rms: RunningMeanStd
    anchors: object  # actor params stacked over M anchors (slot 0 newest), None without GTR
    anchor_count: jax.Array
    snapshots: jax.Array  # (diag_window + 1, P) flattened actor params, slot 0 newest
    snapshot_count: jax.Array
    iteration: jax.Array
    num_iterations: jax.Array
    cfg: PPOConfig = struct.field(pytree_node=False)
    actor: Net = struct.field(pytree_node=False)
    critic: Net = struct.field(pytree_node=False)
    act_dim: int = struct.field(pytree_node=False)
    plasticity: StaticPlasticity = struct.field(pytree_node=False, default=StaticPlasticity())


PLASTIC = {"actor": ("actor_params", "actor_opt"), "critic": ("critic_params", "critic_opt")}


# ----------------------------------------------------------------------------------------------
# Networks
# ----------------------------------------------------------------------------------------------
def _orthogonal_trunk(trunk: Trunk, rngs: nnx.Rngs):
    """CleanRL's layer_init: orthogonal(sqrt 2) hidden kernels, zero biases (mlp block only)."""
    if trunk.spec.block != "mlp":
        return
    init = orthogonal(math.sqrt(2.0))
    for layer in trunk.layers:
        layer.kernel[...] = init(rngs.params(), layer.kernel[...].shape)
        layer.bias[...] = jnp.zeros_like(layer.bias[...])


class PPOActor(nnx.Module):
    """Trunk -> mean (orthogonal 0.01 head); log-std a free parameter (state-independent, init 0)."""

    def __init__(self, obs_dim: int, act_dim: int, spec: TrunkSpec, *, rngs: nnx.Rngs):
        self.trunk = Trunk(obs_dim, spec, rngs=rngs)
        _orthogonal_trunk(self.trunk, rngs)
        self.out = nnx.Linear(
            spec.width, act_dim, rngs=rngs, kernel_init=orthogonal(0.01), bias_init=nnx.initializers.zeros
        )
        self.log_std = nnx.Param(jnp.zeros((act_dim,), jnp.float32))

    def __call__(self, x, probes=None):
        h, taps = self.trunk(x, probes)
        mean = self.out(h)
        return (mean, jnp.broadcast_to(self.log_std[...], mean.shape)), {**taps, "features": h}


class PPOCritic(nnx.Module):
    """Trunk -> V(s) (orthogonal 1.0 head)."""

    def __init__(self, obs_dim: int, spec: TrunkSpec, *, rngs: nnx.Rngs):
        self.trunk = Trunk(obs_dim, spec, rngs=rngs)
        _orthogonal_trunk(self.trunk, rngs)
        self.out = nnx.Linear(spec.width, 1, rngs=rngs, kernel_init=orthogonal(1.0), bias_init=nnx.initializers.zeros)

    def __call__(self, x, probes=None):
        h, taps = self.trunk(x, probes)
        return self.out(h)[..., 0], {**taps, "features": h}


def _optimizers(cfg: PPOConfig, plasticity: StaticPlasticity):
    """Actor and critic optimizers from ``plasticity.optim.optimizer`` (Kron / NE when the loop says so).

    Built with learning rate 1 as *descent* directions (Adam: ``scale_by_adam`` then ``scale(-1)``;
    Kron: PSGD-Kron at lr 1/3, i.e. Adam lr / 3 after the scaling below); ``update`` multiplies
    the result by the annealed learning rate itself.  NE's masked transform returns ``-params`` on
    pruned weights so that ``apply_updates`` zeroes them; after the manual lr scaling that no
    longer holds, so ``update`` re-applies the masks to the new params (and masks the gradients
    before the global-norm clip, so pruned weights do not shrink the clip scale).  For the same
    reason NaP (``--plasticity.nap``) projects the new params there (``post_scaled``, ``constrain``).
    """
    make = lambda lr, **_: optax.chain(optax.scale_by_adam(eps=cfg.adam_eps), optax.scale(-lr))  # noqa: E731
    spec = plasticity.optim
    return (
        optim_lib.optimizer(1.0, "actor", make=make, spec=spec, post_scaled=True),
        optim_lib.optimizer(1.0, "critic", make=make, spec=spec, post_scaled=True),
    )


def init(
    key,
    obs_dim: int,
    act_dim: int,
    cfg: PPOConfig,
    network: NetworkConfig = NetworkConfig(),
    plasticity: StaticPlasticity = StaticPlasticity(),
) -> PPOState:
    check_ranges(cfg)
    spec = network.trunk(TrunkSpec(64, 2, activation="tanh"))
    k_actor, k_critic = jax.random.split(key)
    # injectable: the networks plasticity injection may give a residual head (when the run asks for it)
    actor, actor_params = injectable(
        *build("actor", lambda r: PPOActor(obs_dim, act_dim, spec, rngs=r), k_actor), plasticity
    )
    critic, critic_params = injectable(
        *build("critic", lambda r: PPOCritic(obs_dim, spec, rngs=r), k_critic), plasticity
    )
    tx_a, tx_c = _optimizers(cfg, plasticity)
    anchors = gtr.init_anchors(actor_params, cfg.gtr_anchors) if cfg.trust_region == "gtr" else None
    flat = ravel_pytree(actor_params)[0]
    snapshots = jnp.zeros((cfg.diag_window + 1, flat.size), jnp.float32).at[0].set(flat)
    return PPOState(
        actor_params,
        critic_params,
        tx_a.init(actor_params),
        tx_c.init(critic_params),
        rms_init((obs_dim,)),
        rms_init(),
        anchors,
        jnp.zeros((), jnp.int32),
        snapshots,
        jnp.ones((), jnp.int32),
        jnp.zeros((), jnp.int32),
        jnp.ones((), jnp.int32),
        cfg,
        actor,
        critic,
        act_dim,
        plasticity,
    )


# ----------------------------------------------------------------------------------------------
# Normalisation and acting
# ----------------------------------------------------------------------------------------------
def normalize_obs(state: PPOState, obs):
    if not state.cfg.norm_obs:
        return obs
    rms = state.obs_rms
    return jnp.clip((obs - rms.mean) / jnp.sqrt(rms.var + 1e-8), -state.cfg.obs_clip, state.cfg.obs_clip)


def observe(state: PPOState, raw_obs):
    """Update the observation statistics with a batch ``raw_obs`` (E, D); return (state, normalised)."""
    if state.cfg.norm_obs:
        state = state.replace(obs_rms=rms_update(state.obs_rms, raw_obs))
    return state, normalize_obs(state, raw_obs)


def scale_reward(state: PPOState, returns, reward, terminated):
    """Gymnasium NormalizeReward: G <- gamma G (1 - terminated) + r; r / sqrt(Var[G] + 1e-8), clipped.

    Returns (state, returns, scaled reward)."""
    cfg = state.cfg
    returns = returns * cfg.gamma * (1.0 - terminated.astype(returns.dtype)) + reward
    if not cfg.norm_reward:
        return state, returns, reward
    state = state.replace(ret_rms=rms_update(state.ret_rms, returns))
    scaled = jnp.clip(reward / jnp.sqrt(state.ret_rms.var + 1e-8), -cfg.reward_clip, cfg.reward_clip)
    return state, returns, scaled


def reset_normalizers(state: PPOState) -> PPOState:
    return state.replace(obs_rms=rms_init(state.obs_rms.mean.shape), ret_rms=rms_init())


def sample_action(state: PPOState, obs_n, key):
    """On normalised observations: (action, log pi(action), V(obs))."""
    mean, log_std = state.actor(state.actor_params, obs_n)
    action = mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape, mean.dtype)
    return action, gaussian_log_prob(action, mean, log_std), state.critic(state.critic_params, obs_n)


def value(state: PPOState, obs_n):
    return state.critic(state.critic_params, obs_n)


_ROLLOUT_FREE = (
    "actor_params",
    "critic_params",
    "actor_opt",
    "critic_opt",
    "obs_rms",
    "ret_rms",
    "anchors",
    "anchor_count",
    "snapshots",
    "snapshot_count",
    "iteration",
    "num_iterations",
)


def rollout_split(state: PPOState):
    """For the loop's per-step call: (read-only params, updated normalisers, skeleton without arrays).

    Collecting experience reads the actor/critic params and updates only the normaliser statistics."""
    skeleton = state.replace(**{k: None for k in _ROLLOUT_FREE})
    return (state.actor_params, state.critic_params), (state.obs_rms, state.ret_rms), skeleton


def rollout_join(skeleton: PPOState, frozen, mutable) -> PPOState:
    """A state usable by ``observe``/``scale_reward``/``sample_action``/``value`` (optimiser etc. absent)."""
    return skeleton.replace(actor_params=frozen[0], critic_params=frozen[1], obs_rms=mutable[0], ret_rms=mutable[1])


def rollout_merge(state: PPOState, mutable) -> PPOState:
    return state.replace(obs_rms=mutable[0], ret_rms=mutable[1])


def act(state: PPOState, obs, key, explore: bool):
    """Raw observations -> an action (unclipped Gaussian sample when exploring, the mean otherwise).
    The env layer maps it to the env (``action_mode``: clip to the bounds as CleanRL's ClipAction, or
    rescale from [-1, 1]; ``envs/actions.py``); the rollout stores the unclipped sample."""
    mean, log_std = state.actor(state.actor_params, normalize_obs(state, obs))
    if explore:
        return mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape, mean.dtype)
    return mean


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------
def gae(rewards, values, terminated, truncated, final_values, last_value, gamma: float, lam: float):
    """Generalised advantage estimation, time-major (T, ...) -> (advantages, returns).

    Next value of step t: 0 if ``terminated[t]``; ``final_values[t]`` = V(true final obs) if
    ``truncated[t]``; otherwise ``values[t + 1]`` (``last_value`` after the last step).  The trace
    ``A_t = delta_t + gamma lam A_{t+1}`` is cut after every terminated or truncated step.
    """
    next_values = jnp.concatenate([values[1:], last_value[None]], axis=0)
    next_values = jnp.where(terminated, 0.0, jnp.where(truncated, final_values, next_values))
    deltas = rewards + gamma * next_values - values
    carry_on = 1.0 - (terminated | truncated).astype(rewards.dtype)

    def back(adv_next, x):
        delta, cont = x
        adv = delta + gamma * lam * cont * adv_next
        return adv, adv

    _, adv = jax.lax.scan(back, jnp.zeros_like(last_value), (deltas, carry_on), reverse=True)
    return adv, adv + values


def policy_surrogate(ratio, advantages, clip_coef: float, clip: bool = True):
    """E[max(-A r, -A clip(r, 1-eps, 1+eps))], or E[-A r] without the clip."""
    unclipped = -advantages * ratio
    if not clip:
        return unclipped.mean()
    return jnp.maximum(unclipped, -advantages * jnp.clip(ratio, 1.0 - clip_coef, 1.0 + clip_coef)).mean()


def value_loss(new_values, old_values, returns, clip_coef: float, clip_vloss: bool = True):
    """0.5 E[max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)] (or 0.5 E[(V - R)^2])."""
    unclipped = (new_values - returns) ** 2
    if not clip_vloss:
        return 0.5 * unclipped.mean()
    clipped = old_values + jnp.clip(new_values - old_values, -clip_coef, clip_coef)
    return 0.5 * jnp.maximum(unclipped, (clipped - returns) ** 2).mean()


def actor_loss(actor_params, state: PPOState, mb: Minibatch, weights=None):
    """Surrogate - c_ent H (+ GTR penalty).  Returns (loss, aux)."""
    cfg = state.cfg
    mean, log_std = state.actor(actor_params, mb.obs)
    new_logp = gaussian_log_prob(mb.actions, mean, log_std)
    logratio = new_logp - mb.logp
    ratio = jnp.exp(logratio)
    adv = mb.advantages
    if cfg.norm_adv:
        adv = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
    pg = policy_surrogate(ratio, adv, cfg.clip_coef, cfg.clip)
    entropy = jnp.sum(log_std + 0.5 * LOG_2PI_E, axis=-1).mean()
    aux = {
        "losses/policy": pg,
        "losses/entropy": entropy,
        "charts/approx_kl": ((ratio - 1.0) - logratio).mean(),
        "charts/clipfrac": (jnp.abs(ratio - 1.0) > cfg.clip_coef).astype(jnp.float32).mean(),
    }
    loss = pg - cfg.ent_coef * entropy
    if cfg.trust_region == "gtr" and weights is not None:
        penalty, kernel = gtr.actor_penalty(cfg, mb, mean, log_std, new_logp, weights)
        aux["gtr/penalty"], aux["gtr/kernel"] = penalty.mean(), kernel.mean()
        loss = loss + penalty.mean()
    return loss, aux


def critic_loss(critic_params, state: PPOState, mb: Minibatch):
    v = state.critic(critic_params, mb.obs)
    return value_loss(v, mb.values, mb.returns, state.cfg.clip_coef, state.cfg.clip_vloss)


def _loss(params, state: PPOState, mb: Minibatch, weights, key):
    """Actor and critic losses; with --plasticity.sigreg-coef each adds SIGReg of its own features."""
    actor_params, critic_params = params
    k_actor, k_critic = jax.random.split(key)
    sigreg = state.plasticity.sigreg
    a_loss, aux = regularized(actor_loss, "actor")(actor_params, state, mb, weights, reg_key=k_actor, sigreg=sigreg)
    v_loss = regularized(critic_loss, "critic")(critic_params, state, mb, reg_key=k_critic, sigreg=sigreg)
    aux["losses/value"] = v_loss
    return a_loss + state.cfg.vf_coef * v_loss, aux


# ----------------------------------------------------------------------------------------------
# The update
# ----------------------------------------------------------------------------------------------
def learning_rate(state: PPOState):
    cfg = state.cfg
    if not cfg.anneal_lr:
        return jnp.asarray(cfg.learning_rate, jnp.float32)
    frac = 1.0 - state.iteration.astype(jnp.float32) / jnp.maximum(state.num_iterations, 1).astype(jnp.float32)
    return cfg.learning_rate * jnp.clip(frac, 0.0, 1.0)


def _diagnostics(state: PPOState, new_actor_params):
    """Shift the actor snapshot ring; cosine of consecutive deltas and directional efficiency."""
    flat = ravel_pytree(new_actor_params)[0]
    snaps = jnp.concatenate([flat[None], state.snapshots[:-1]], axis=0)
    count = jnp.minimum(state.snapshot_count + 1, snaps.shape[0])
    steps = jnp.linalg.norm(snaps[:-1] - snaps[1:], axis=-1)  # step i: snapshot i+1 -> i
    valid = jnp.arange(steps.shape[0]) < count - 1
    path = jnp.sum(jnp.where(valid, steps, 0.0))
    oldest = snaps[jnp.maximum(count - 1, 0)]
    efficiency = jnp.where(path > 0, jnp.linalg.norm(snaps[0] - oldest) / jnp.maximum(path, 1e-12), jnp.nan)
    d_now, d_prev = snaps[0] - snaps[1], snaps[1] - snaps[2]
    cos = jnp.dot(d_now, d_prev) / (jnp.linalg.norm(d_now) * jnp.linalg.norm(d_prev) + 1e-12)
    cos = jnp.where(count >= 3, cos, jnp.nan)
    metrics = {
        "diag/update_cosine": cos,
        "diag/directional_efficiency": efficiency,
        "diag/update_norm": jnp.where(count >= 2, steps[0], jnp.nan),
    }
    return state.replace(snapshots=snaps, snapshot_count=count), metrics


def flat_samples(cfg: PPOConfig, batch: Rollout) -> dict:
    """GAE over one seed's rollout, flattened to T*E samples (obs, actions, logp, values, advantages, returns)."""
    T, E = batch.rewards.shape
    values = batch.values[:T]
    adv, returns = gae(
        batch.rewards,
        values,
        batch.terminated,
        batch.truncated,
        batch.final_values,
        batch.values[T],
        cfg.gamma,
        cfg.gae_lambda,
    )
    flat = lambda x: x.reshape(T * E, *x.shape[2:])  # noqa: E731
    return {
        "obs": flat(batch.obs[:T]),
        "actions": flat(batch.actions[:T]),
        "logp": flat(batch.logp[:T]),
        "values": flat(values),
        "advantages": flat(adv),
        "returns": flat(returns),
    }


def sample_batch(state: PPOState, batch: Rollout, key, size: int) -> Minibatch:
    """``size`` distinct samples of the latest rollout (for plasticity metrics and resets)."""
    data = flat_samples(state.cfg, batch)
    n = data["obs"].shape[0]
    idx = jax.random.permutation(key, n)[: min(size, n)]
    return Minibatch(**jax.tree.map(lambda x: x[idx], data))


def update(state: PPOState, batch: Rollout, key):
    """One PPO iteration on one seed's rollout: GAE, then epochs x minibatches in one scan."""
    cfg = state.cfg
    T, E = batch.rewards.shape
    n = T * E
    if n % cfg.num_minibatches:
        raise ValueError(f"batch {T} x {E} = {n} is not divisible by num_minibatches={cfg.num_minibatches}")
    mb_size = n // cfg.num_minibatches
    data = flat_samples(cfg, batch)
    weights = None
    use_gtr = cfg.trust_region == "gtr"
    if use_gtr:  # the rollout policy joins the anchors; their statistics once for the iteration
        anchors, anchor_count = gtr.push_anchor(cfg, state.anchors, state.anchor_count, state.actor_params)
        state = state.replace(anchors=anchors, anchor_count=anchor_count)
        data.update(gtr.anchor_stats(cfg, state.actor, state.anchors, data["obs"], data["actions"]))
        weights = gtr.anchor_weights(state.anchor_count, cfg.gtr_anchors, cfg.gtr_weights, cfg.gtr_decay)
    lr = learning_rate(state)
    tx_a, tx_c = _optimizers(cfg, state.plasticity)
    old_actor = state.actor_params

    def minibatch_step(carry, xs):
        idx, k_mb = xs
        params, opts, stopped = carry
        mb = Minibatch(**jax.tree.map(lambda x: x[idx], data))
        (loss, aux), grads = jax.value_and_grad(_loss, has_aux=True)(params, state, mb, weights, k_mb)
        grads = (optim_lib.apply_mask(opts[0], grads[0]), optim_lib.apply_mask(opts[1], grads[1]))  # NE only
        gnorm = optax.global_norm(grads)
        scale = jnp.minimum(1.0, cfg.max_grad_norm / (gnorm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
        ua, oa = tx_a.update(grads[0], opts[0], params[0])
        uc, oc = tx_c.update(grads[1], opts[1], params[1])
        # descent directions scaled by the annealed lr; NE: pruned weights back to exactly 0; NaP: projected
        new = (
            optim_lib.constrain(oa, optax.apply_updates(params[0], jax.tree.map(lambda u: lr * u, ua))),
            optim_lib.constrain(oc, optax.apply_updates(params[1], jax.tree.map(lambda u: lr * u, uc))),
        )
        keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(stopped, x, y), a, b)  # noqa: E731
        params, opts = keep(params, new), keep(opts, (oa, oc))
        aux = {**aux, "losses/total": loss, "charts/grad_norm": gnorm, "executed": 1.0 - stopped.astype(jnp.float32)}
        return (params, opts, stopped), aux

    def epoch(carry, k):
        k_perm, k_mb = jax.random.split(k)
        perm = jax.random.permutation(k_perm, n).reshape(cfg.num_minibatches, mb_size)
        (params, opts, stopped), aux = jax.lax.scan(
            minibatch_step, carry, (perm, jax.random.split(k_mb, cfg.num_minibatches))
        )
        if cfg.target_kl is not None:
            stopped = stopped | (aux["charts/approx_kl"][-1] > cfg.target_kl)
        return (params, opts, stopped), aux

    carry = ((state.actor_params, state.critic_params), (state.actor_opt, state.critic_opt), jnp.bool_(False))
    ((actor_params, critic_params), (actor_opt, critic_opt), _), aux = jax.lax.scan(
        epoch, carry, jax.random.split(key, cfg.update_epochs)
    )
    executed = aux.pop("executed")
    metrics = {k: jnp.sum(v * executed) / jnp.maximum(executed.sum(), 1.0) for k, v in aux.items()}
    metrics["charts/epochs_run"] = executed.sum() / cfg.num_minibatches
    metrics["charts/learning_rate"] = lr
    metrics["charts/log_std"] = actor_params["log_std"][...].mean() if "log_std" in actor_params else jnp.nan
    var_y = jnp.var(data["returns"])
    metrics["charts/explained_variance"] = jnp.where(
        var_y > 0, 1.0 - jnp.var(data["returns"] - data["values"]) / jnp.where(var_y > 0, var_y, 1.0), jnp.nan
    )
    metrics["charts/advantage_std"] = jnp.std(data["advantages"])
    if use_gtr:
        metrics.update(
            gtr.anchor_metrics(cfg, state.actor, state.anchors, state.anchor_count, actor_params, data["obs"], weights)
        )
    kl_old = distributions.gaussian_kl(
        *state.actor(old_actor, data["obs"]), *state.actor(actor_params, data["obs"])
    ).mean()
    metrics["charts/kl_iteration"] = kl_old
    state = state.replace(
        actor_params=actor_params,
        critic_params=critic_params,
        actor_opt=actor_opt,
        critic_opt=critic_opt,
        iteration=state.iteration + 1,
    )
    state, diag = _diagnostics(state, actor_params)
    metrics.update(diag)
    return state, metrics


CONFIG = PPOConfig
KIND = "onpolicy"
EXPERIENCE_REVIEW = False  # no replay
SIGREG_NETWORKS = ("actor", "critic")  # their losses are wrapped with plasticity.sigreg.regularized


plastic_params = declared_params(PLASTIC)
plastic_nets = declared_nets(PLASTIC)


def plastic_losses(state: PPOState, batch: Minibatch, key):
    """Per plastic network, its loss as a function of its params (for metrics/resets).

    ``batch`` is a ``Minibatch`` (flat samples with advantages and returns); the actor's loss is the
    surrogate minus the entropy bonus (the GTR penalty needs the iteration's anchor statistics and is
    left out); the critic's is the (clipped) value loss."""
    del key
    return {"actor": lambda p: actor_loss(p, state, batch)[0], "critic": lambda p: critic_loss(p, state, batch)}
