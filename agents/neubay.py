"""NeuBay's agent: a recurrent REDQ-SAC trained on tapes of real prefixes and imagined suffixes.

Ni, Derman, Jain, Taboga, Ravanbakhsh, Bacon, "Long-Horizon Model-Based Offline RL Without
(Explicit) Conservatism" (arXiv 2512.04341), section 4 and its appendix's hyperparameter tables;
the world-model posterior is ``agents/dynamics.py: neubay_config`` and the rollouts are
``agents/imagination.py``.  This file holds the learner; see "Status" below for what is wired.

One gradient step on a batch of tapes (positions t = 0 .. T-1; input x_t = [s_t, a_{t-1}, r_{t-1}],
``start`` marks a trajectory's first position, transition t is (x_t, a_t, r_t, terminated_t)):

  1. critic:  h_t = critic encoder (pre-block + 2 LRU layers) over the tape, Q_i(h_t, a_t) for
              10 heads; a'_{t+1} ~ pi(h^pi_{t+1}); two target heads I drawn without replacement,
              y_t = r_t + gamma (1 - terminated_t) (min_{i in I} Q'_i(h'_{t+1}, a'_{t+1})
                                                    - alpha log pi(a'_{t+1}))     (REDQ, Chen et al. 2021)
              loss_t = mean_i Huber(Q_i(h_t, a_t) - y_t); Polyak target (encoder included)
  2. actor:   loss_t = alpha log pi(a_t | h^pi_t) - mean_i Q_i(h_t, a_t), a_t ~ pi (all 10 heads)
  3. alpha:   loss_t = alpha * (H_t - target_entropy), H_t = -log pi(a_t | h^pi_t) (the reference's
              form: its gradient in log alpha is alpha (H - target)); fixed alpha when ``fixed_alpha``
  every loss:  L = real_weight * mean(loss_t over real t) + (1 - real_weight) * mean(over imagined t),
              over transitions t whose next position is not a new trajectory's start.

Optimisers: Adam with gradients clipped at global norm 1000; encoders at a tiny per-task lr
(3e-7 .. 3e-5), heads at 1e-4; the actor's lrs follow a cosine decay to 0 over ``updates`` steps,
the critic's stay constant.  Heads are 2 x 256 (Linear, LayerNorm, leaky-ReLU); the critic's output
layer starts at U(+-0.1 / sqrt(256)) (the reference's scale 0.01 on the fan-in variance, our reading
of "small") with a zero bias; the actor's log-std is clipped to [-5, 2].

Status: the learner, the per-task settings and acting (``act_step``, ``rollout_policy``) are here
and tested; the run around them (collect tapes with ``imagination.imagine`` at UTD 0.05 into a
tape buffer, evaluation episodes carrying the recurrent state, ``train.py neubay``, checkpoints)
is not wired yet, and the agent is not registered in ``agents.AGENTS``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from agents import imagination, sac
from networks import GaussianPolicyHead, MLPHead, Net, TrunkSpec, build
from networks.distributions import tanh_gaussian_mode, tanh_gaussian_sample
from networks.recurrent import RecurrentNet, RecurrentSpec, build_recurrent

# Section 7.4 of our notes (the paper's per-task table): (encoder lr, real_weight) by D4RL task.
TASK_SETTINGS = {
    ("halfcheetah", "random"): (3e-5, 0.8), ("halfcheetah", "medium"): (3e-5, 0.8),
    ("halfcheetah", "medium-replay"): (1e-5, 0.05), ("halfcheetah", "medium-expert"): (3e-5, 0.8),
    ("hopper", "random"): (1e-5, 0.5), ("hopper", "medium"): (1e-6, 0.8),
    ("hopper", "medium-replay"): (3e-7, 0.5), ("hopper", "medium-expert"): (3e-6, 0.5),
    ("walker2d", "random"): (3e-5, 0.5), ("walker2d", "medium"): (3e-6, 0.5),
    ("walker2d", "medium-replay"): (1e-6, 0.5), ("walker2d", "medium-expert"): (1e-6, 0.8),
}
FIXED_ALPHA_ENVS = ("hopper",)  # the paper keeps alpha at 0.2 on hopper


@dataclass(frozen=True)
class NeuBayConfig:
    """The learner's hyperparameters (defaults: the reference's base config for D4RL locomotion)."""

    critics: int = 10
    sampled_critics: int = 2
    """target heads drawn per update (REDQ's M)"""
    head_width: int = 256
    head_depth: int = 2
    d_model: int = 256
    d_hidden: int = 128
    lru_layers: int = 2
    r_max: float = 0.9
    encoder_lr: float = 1e-5
    """the encoders' lr, tuned per task (``TASK_SETTINGS``, 3e-7 .. 3e-5)"""
    head_lr: float = 1e-4
    alpha_lr: float = 1e-4
    actor_lr_final_ratio: float = 0.0
    """the actor's lrs decay by a cosine to this fraction over ``updates`` steps (critic: constant)"""
    updates: int = 2_000_000
    """total gradient steps of a run (the actor's cosine horizon)"""
    grad_clip: float = 1000.0
    gamma: float = 0.99
    tau: float = 0.005
    init_alpha: float = 0.2
    fixed_alpha: bool = False
    """keep alpha at ``init_alpha`` (the paper's setting for hopper)"""
    target_entropy: Optional[float] = None
    """None: -|A|"""
    real_weight: float = 0.05
    """weight of the real-data mean in every loss (``TASK_SETTINGS``)"""
    tape_len: int = 2048
    """transitions per training batch (one tape)"""
    utd: float = 0.05
    """gradient steps per new imagined transition"""
    rollout_batch: int = 100
    """trajectories imagined per collection (one per posterior member)"""
    buffer_transitions: int = 40_000_000
    uncertainty_quantile: Optional[float] = 1.0
    """the truncation threshold's quantile of the dataset's uncertainties (None: no truncation)"""
    penalty: float = 0.0
    """MOPO-style reward penalty on the uncertainty (divided by its dataset mean); NeuBay: 0"""
    planning_members: int = 100
    """elites the imagination draws from (the paper's ablation: 5, 20, 100)"""

    def __post_init__(self):
        if not 1 <= self.sampled_critics <= self.critics:
            raise ValueError(f"need 1 <= --sampled-critics <= --critics, got {self.sampled_critics}, {self.critics}")
        if not 0.0 <= self.real_weight <= 1.0:
            raise ValueError(f"--real-weight must be in [0, 1], got {self.real_weight}")
        for name in ("head_width", "head_depth", "d_model", "d_hidden", "lru_layers", "updates", "tape_len",
                     "rollout_batch", "planning_members"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.tape_len < 2:
            raise ValueError("--tape-len must be >= 2 (a transition needs its next position)")
        if self.uncertainty_quantile is not None and not 0.0 <= self.uncertainty_quantile <= 1.0:
            raise ValueError(f"--uncertainty-quantile must be in [0, 1], got {self.uncertainty_quantile}")

    @property
    def recurrent(self) -> RecurrentSpec:
        return RecurrentSpec(self.d_model, self.d_hidden, self.lru_layers, 0.0, self.r_max)


def task_config(cfg: NeuBayConfig, env: str, kind: str, **overrides) -> NeuBayConfig:
    """``cfg`` with the paper's per-task encoder lr, real_weight and (hopper) fixed alpha; flags the
    user gave (``overrides``) win.  An env / kind outside the table keeps ``cfg``'s values."""
    base = env.split("-")[0].lower()
    kw = {}
    if (base, kind) in TASK_SETTINGS:
        kw["encoder_lr"], kw["real_weight"] = TASK_SETTINGS[(base, kind)]
    if base in FIXED_ALPHA_ENVS:
        kw["fixed_alpha"] = True
    return NeuBayConfig(**{**cfg.__dict__, **kw, **overrides})


class TapeBatch(NamedTuple):
    """Training tapes (B, T, ...): position t holds the input x_t = [s_t, a_{t-1}, r_{t-1}], whether
    it starts a trajectory, and transition t's action, reward, termination and real flag.  The last
    position of a trajectory carries its final state and a dummy transition (masked out)."""

    inputs: jax.Array
    start: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    real: jax.Array


def tape_batch(tape: imagination.Tape) -> TapeBatch:
    """Imagination's fixed-capacity tapes as training tapes: positions 0 .. length hold the
    trajectory (position ``length`` its final state), later ones are padding marked as starts, so
    ``transition_mask`` drops them and the dummy transition at ``length``."""
    inputs = imagination.agent_inputs(tape.obs, tape.action, tape.reward)
    pos = jnp.arange(inputs.shape[1])
    start = (pos[None] == 0) | (pos[None] > tape.length[:, None])

    def pad(x):  # one dummy transition for the last position
        return jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)

    return TapeBatch(inputs, start, pad(tape.action), pad(tape.reward), pad(tape.terminated), pad(tape.real))


@struct.dataclass
class NeuBayState:
    actor_params: object  # {"encoder": ..., "head": ...}
    critic_params: object  # {"encoder": ..., "heads": ...}
    target_critic_params: object
    log_alpha: jax.Array
    actor_opt: object
    critic_opt: object
    alpha_opt: object
    updates: jax.Array
    cfg: NeuBayConfig = struct.field(pytree_node=False)
    actor_encoder: RecurrentNet = struct.field(pytree_node=False)
    actor_head: Net = struct.field(pytree_node=False)
    critic_encoder: RecurrentNet = struct.field(pytree_node=False)
    critic_heads: Net = struct.field(pytree_node=False)
    act_dim: int = struct.field(pytree_node=False)


# ----------------------------------------------------------------------------- networks and optimisers


def _critic_out_init(params, key):
    """The critic heads' output layer: U(+-sqrt(0.01 / fan_in)) weights, zero bias (reference scale 0.01)."""
    def put(path, x):
        names = [getattr(k, "key", None) for k in path]
        if "out" in names and names[-1] == "kernel":
            lim = math.sqrt(0.01 / x.shape[0])
            return jax.random.uniform(key, x.shape, x.dtype, -lim, lim)
        if "out" in names and names[-1] == "bias":
            return jnp.zeros_like(x)
        return x
    return jax.tree_util.tree_map_with_path(put, params)


def _optimizer(cfg: NeuBayConfig, actor: bool):
    """Clip at global norm, then Adam with the encoder's and the heads' lrs (the actor's on a cosine)."""
    def lr(value):
        if actor:
            return optax.cosine_decay_schedule(value, cfg.updates, alpha=cfg.actor_lr_final_ratio)
        return value

    heads = "head" if actor else "heads"
    tx = optax.multi_transform({"encoder": optax.adam(lr(cfg.encoder_lr)), heads: optax.adam(lr(cfg.head_lr))},
                               lambda params: {k: k for k in params})
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)


def init(key, obs_dim: int, act_dim: int, cfg: NeuBayConfig = NeuBayConfig()) -> NeuBayState:
    """Actor and critic, each its own recurrent encoder over x_t = [s_t, a_{t-1}, r_{t-1}]."""
    in_dim = obs_dim + act_dim + 1
    head = TrunkSpec(cfg.head_width, cfg.head_depth, activation="leaky_relu", layer_norm=True)
    k_ae, k_ah, k_ce, k_ch, k_out = jax.random.split(key, 5)
    actor_encoder, ae = build_recurrent("actor_encoder", in_dim, cfg.recurrent, k_ae)
    actor_head, ah = build("actor", lambda r: GaussianPolicyHead(cfg.d_model, act_dim, head, rngs=r), k_ah)
    critic_encoder, ce = build_recurrent("critic_encoder", in_dim, cfg.recurrent, k_ce)
    critic_heads, ch = build("critic", lambda r: MLPHead(cfg.d_model + act_dim, 1, head, rngs=r), k_ch,
                             ensemble=cfg.critics, initializer=_critic_out_init)
    actor_params, critic_params = {"encoder": ae, "head": ah}, {"encoder": ce, "heads": ch}
    log_alpha = jnp.log(jnp.asarray(cfg.init_alpha, jnp.float32))
    return NeuBayState(actor_params, critic_params, jax.tree.map(jnp.copy, critic_params), log_alpha,
                       _optimizer(cfg, True).init(actor_params), _optimizer(cfg, False).init(critic_params),
                       optax.adam(cfg.alpha_lr).init(log_alpha), jnp.zeros((), jnp.int32), cfg,
                       actor_encoder, actor_head, critic_encoder, critic_heads, act_dim)


def _encode(net: RecurrentNet, params, tape: TapeBatch):
    """The encoder's output at every position of the tapes, from a zero state -> (B, T, d_model)."""
    return net(params, tape.inputs, net.initial_state(tape.inputs.shape[:1]), tape.start)[0]


def _policy(state: NeuBayState, actor_params, tape: TapeBatch):
    return state.actor_head(actor_params["head"], _encode(state.actor_encoder, actor_params["encoder"], tape))


def _q(state: NeuBayState, heads_params, h, action):
    """Every head's Q(h, a) -> (N, B, T)."""
    return state.critic_heads(heads_params, h, action)


# ----------------------------------------------------------------------------- losses


def huber(x):
    """0.5 x^2 for |x| < 1, |x| - 0.5 beyond."""
    return jnp.where(jnp.abs(x) < 1.0, 0.5 * x ** 2, jnp.abs(x) - 0.5)


def transition_mask(tape: TapeBatch):
    """Transition t counts iff position t + 1 continues its trajectory -> (B, T - 1)."""
    return ~tape.start[:, 1:]


def real_imagined_mean(loss, mask, real, real_weight):
    """real_weight * mean(loss over masked real steps) + (1 - real_weight) * mean(over masked imagined
    steps); an empty group's mean counts as 0 (its denominator is clipped at 1, as the reference)."""
    mask = mask.astype(loss.dtype)
    real = real.astype(loss.dtype)
    real_mask, imag_mask = mask * real, mask * (1.0 - real)
    real_mean = (loss * real_mask).sum() / jnp.maximum(real_mask.sum(), 1.0)
    imag_mean = (loss * imag_mask).sum() / jnp.maximum(imag_mask.sum(), 1.0)
    return real_weight * real_mean + (1.0 - real_weight) * imag_mean, (real_mean, imag_mean)


def redq_target(next_qs, heads, reward, terminated, next_log_prob, alpha, gamma):
    """y = r + gamma (1 - terminated) (min over the drawn ``heads`` of Q'(h', a') - alpha log pi(a'|h')).

    ``next_qs``: (N, ...) every target head's value; ``heads``: (M,) indices."""
    return sac.td_target(reward, terminated, next_qs[heads].min(axis=0), next_log_prob, alpha, gamma)


def critic_loss(critic_params, state: NeuBayState, tape: TapeBatch, alpha, key):
    cfg = state.cfg
    k_next, k_heads = jax.random.split(key)
    h = _encode(state.critic_encoder, critic_params["encoder"], tape)
    q = _q(state, critic_params["heads"], h[:, :-1], tape.action[:, :-1])  # (N, B, T-1)
    mean, log_std = _policy(state, state.actor_params, tape)
    next_action, next_log_prob = tanh_gaussian_sample(k_next, mean, log_std)
    target_h = _encode(state.critic_encoder, state.target_critic_params["encoder"], tape)
    next_qs = _q(state, state.target_critic_params["heads"], target_h[:, 1:], next_action[:, 1:])
    heads = jax.random.choice(k_heads, cfg.critics, (cfg.sampled_critics,), replace=False)
    y = jax.lax.stop_gradient(redq_target(next_qs, heads, tape.reward[:, :-1], tape.terminated[:, :-1],
                                          next_log_prob[:, 1:], alpha, cfg.gamma))
    per_step = huber(q - y[None]).mean(axis=0)
    loss, (real, imag) = real_imagined_mean(per_step, transition_mask(tape), tape.real[:, :-1], cfg.real_weight)
    return loss, (q, real, imag)


def actor_loss(actor_params, state: NeuBayState, critic_params, tape: TapeBatch, alpha, key):
    cfg = state.cfg
    mean, log_std = _policy(state, actor_params, tape)
    action, log_prob = tanh_gaussian_sample(key, mean, log_std)
    h = jax.lax.stop_gradient(_encode(state.critic_encoder, critic_params["encoder"], tape))
    q = _q(state, critic_params["heads"], h[:, :-1], action[:, :-1]).mean(axis=0)
    per_step = alpha * log_prob[:, :-1] - q
    loss, _ = real_imagined_mean(per_step, transition_mask(tape), tape.real[:, :-1], cfg.real_weight)
    return loss, -log_prob[:, :-1]


def alpha_loss(log_alpha, entropy, tape: TapeBatch, target_entropy, real_weight):
    per_step = jnp.exp(log_alpha) * (jax.lax.stop_gradient(entropy) - target_entropy)
    return real_imagined_mean(per_step, transition_mask(tape), tape.real[:, :-1], real_weight)[0]


def update(state: NeuBayState, tape: TapeBatch, key):
    """One step in the reference's order: critic, Polyak target, actor (on the new critic), alpha."""
    cfg = state.cfg
    k_critic, k_actor = jax.random.split(key)
    alpha = jnp.exp(state.log_alpha)
    (q_loss, (q, q_real, q_imag)), q_grad = jax.value_and_grad(critic_loss, has_aux=True)(
        state.critic_params, state, tape, alpha, k_critic)
    upd, critic_opt = _optimizer(cfg, False).update(q_grad, state.critic_opt, state.critic_params)
    critic_params = optax.apply_updates(state.critic_params, upd)
    target = optax.incremental_update(critic_params, state.target_critic_params, cfg.tau)

    (pi_loss, entropy), pi_grad = jax.value_and_grad(actor_loss, has_aux=True)(
        state.actor_params, state, critic_params, tape, alpha, k_actor)
    upd, actor_opt = _optimizer(cfg, True).update(pi_grad, state.actor_opt, state.actor_params)
    actor_params = optax.apply_updates(state.actor_params, upd)

    target_entropy = -float(state.act_dim) if cfg.target_entropy is None else cfg.target_entropy
    a_loss, a_grad = jax.value_and_grad(alpha_loss)(state.log_alpha, entropy, tape, target_entropy, cfg.real_weight)
    log_alpha, alpha_opt = state.log_alpha, state.alpha_opt
    if not cfg.fixed_alpha:
        upd, alpha_opt = optax.adam(cfg.alpha_lr).update(a_grad, state.alpha_opt, state.log_alpha)
        log_alpha = optax.apply_updates(state.log_alpha, upd)

    mask = transition_mask(tape)
    metrics = {"losses/critic": q_loss, "losses/critic_real": q_real, "losses/critic_imagined": q_imag,
               "losses/actor": pi_loss, "losses/alpha": a_loss, "charts/alpha": jnp.exp(log_alpha),
               "charts/entropy": (entropy * mask).sum() / jnp.maximum(mask.sum(), 1),
               "values/q_mean": (q.mean(axis=0) * mask).sum() / jnp.maximum(mask.sum(), 1)}
    new = state.replace(actor_params=actor_params, critic_params=critic_params, target_critic_params=target,
                        log_alpha=log_alpha, actor_opt=actor_opt, critic_opt=critic_opt, alpha_opt=alpha_opt,
                        updates=state.updates + 1)
    return new, metrics


# ----------------------------------------------------------------------------- acting


def initial_memory(state: NeuBayState, batch: int):
    """The actor's zero recurrent state for ``batch`` parallel episodes."""
    return state.actor_encoder.initial_state((batch,))


def act_step(state: NeuBayState, memory, inputs, start, key, explore: bool):
    """One step of ``batch`` episodes: inputs (B, I) = [s_t, a_{t-1}, r_{t-1}], start (B,) ->
    (action (B, A), memory).  A sampled action when exploring, tanh(mean) otherwise."""
    y, memory = state.actor_encoder.step(state.actor_params["encoder"], inputs, memory, start)
    mean, log_std = state.actor_head(state.actor_params["head"], y)
    action = tanh_gaussian_sample(key, mean, log_std)[0] if explore else tanh_gaussian_mode(mean)
    return action, memory


def rollout_policy(state: NeuBayState, explore: bool = True):
    """The stochastic actor as ``imagination.imagine`` calls it: (memory, inputs (B, T, I), start (B, T),
    key) -> (the action at the last position, memory)."""
    def policy(memory, inputs, start, key):
        y, memory = state.actor_encoder(state.actor_params["encoder"], inputs, memory, start)
        mean, log_std = state.actor_head(state.actor_params["head"], y[:, -1])
        action = tanh_gaussian_sample(key, mean, log_std)[0] if explore else tanh_gaussian_mode(mean)
        return action, memory
    return policy
