"""NeuBay's agent: a recurrent REDQ-SAC trained on tapes of real prefixes and imagined suffixes.

Ni, Derman, Jain, Taboga, Ravanbakhsh, Bacon, "Long-Horizon Model-Based Offline RL Without
(Explicit) Conservatism" (arXiv 2512.04341), section 4 and its appendix's hyperparameter tables;
the world-model posterior is ``agents/dynamics/config.py: neubay_config`` and the rollouts are
``agents/imagination.py``.  This file holds the learner and the offline run; the config and the
paper's per-task presets are ``agents/neubay_config.py``.

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
layer starts at U(+-0.1 / sqrt(256)) (the reference's ``final_linear``: scale 0.01 on the fan-in
bound's square) with a zero bias; the actor's log-std is clipped to [-5, 2].

The run (NeuBay, section 4, and the reference's main loop ``offline_cont.py``): ``prepare`` fits or
loads the world-model posterior and computes the truncation threshold; each epoch of
``updates_per_epoch`` steps pays the gradient steps its collections owe (ceil(utd x transitions)
each) and collects whenever they are paid (``train_epoch``), tapes going into a FIFO of whole
trajectories (``buffers/tapes.py``) sampled as one tape of ``tape_len`` positions per step.
Evaluation carries the actor's memory (``initial_memory`` / ``act_step``).

Plasticity: the metrics (``--plasticity.metrics-every``) read all four networks, the actor's and the
critic's recurrent encoders (``actor_encoder``, ``critic_encoder``: the pre-block and every LRU
layer, over each tape's positions) and their heads (``actor``, ``critic``), each against its own
training loss (``metric_losses``; ``plasticity.api.MeasuredAgent``).  Interventions are refused:
an encoder and its head share one params field and optimizer (two learning rates), and the LRU's
complex recurrent parameters have no per-neuron reset rule.

The Markov ablation (``--markov``; one of the paper's ablations, as the reference's ``offline_markov.py``):
the same heads on the state alone (the actor on s_t, the critics on [s_t, a_t]) with no encoder
(``networks.recurrent.Memoryless`` in the encoders' place), trained on batches of ``tape_len``
transitions drawn uniformly from the same tape buffer (``tapes.sample_transitions``), not on tapes.
Collection is unchanged (real prefix then imagined suffix, the first imagined action from the
prefix's last state); the encoder lr is unused, every other setting is shared.

Checked against the reference code (twni2016/neubay at 5604bad: ``offline_cont.py``,
``online_rl/ac_*.py``, ``memory/lru.py``, ``experience/{collector,world_buffer,agent_buffer}.py``,
``offline_world/*.py``): the losses, their real/imagined weighting and masks, the optimisers and
their per-part lrs, the heads' and the LRU's layout (and the LRU's init), the tape sampling, the UTD count
(whole tapes, real prefix included), the rollouts' member binding, sampling and cuts, and the world
model's training, elites and threshold agree.  Differences, all deliberate: the world model also
trains on the dataset's timeout transitions (the reference drops them, a ``qlearning_dataset``
habit; their next observations are real here), its holdout is drawn by the run's seed (the
reference's is fixed), the NLL lacks the reference's factor 1/2 (same minimiser and Adam steps),
a NaN loss stops the run (the reference's optimisers zero NaN gradients), termination follows
Gymnasium v5's rules (the same conditions as the reference's D4RL functions for hopper).  Every
Linear layer (pre-blocks, the LRU layers' GLU, heads) starts as the reference's Equinox layers do,
weights and biases U(+-1/sqrt(fan_in)) (``EQUINOX_LINEAR``), the critics' output layer then at
scale 0.01 as above; the LRU's own parameters keep Orvieto et al.'s initialisation, as there.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from plasticity_zoo.agents import dynamics as dynamics_lib
from plasticity_zoo.agents import imagination, neubay_config, sac
from plasticity_zoo.agents.neubay_config import NeuBayConfig, resolved
from plasticity_zoo.buffers import tapes as tapes_lib
from plasticity_zoo.envs import termination
from plasticity_zoo.networks import GaussianPolicyHead, MLPHead, Net, TrunkSpec, build, fan_in_uniform_init
from plasticity_zoo.networks.config import NetworkConfig
from plasticity_zoo.networks.core import path_names, uniform_fan_in
from plasticity_zoo.networks.distributions import tanh_gaussian_mode, tanh_gaussian_sample
from plasticity_zoo.networks.recurrent import Memoryless, RecurrentNet, build_recurrent
from plasticity_zoo.plasticity.api import StaticPlasticity


class TapeBatch(NamedTuple):
    """Training tapes (B, T, ...): position t holds the input x_t = [s_t, a_{t-1}, r_{t-1}], whether
    it starts a trajectory, and transition t's action, reward, termination and real flag.  The last
    position of a trajectory carries its final state and a dummy transition (masked out).  With a
    reward penalty (``--penalty``), ``reward`` is the penalised one the critic learns, while the
    inputs' r_{t-1} stay the rewards the agent saw when acting (the reference's split)."""

    inputs: jax.Array
    start: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    real: jax.Array


def tape_batch(tape: imagination.Tape, penalty=0.0) -> TapeBatch:
    """Imagination's fixed-capacity tapes as training tapes: positions 0 .. length hold the
    trajectory (position ``length`` its final state), later ones are padding marked as starts, so
    ``transition_mask`` drops them and the dummy transition at ``length``.  ``penalty``: the reward
    penalty per unit of uncertainty (``World.penalty``), taken off the rewards learned, not the inputs."""
    inputs = imagination.agent_inputs(tape.obs, tape.action, tape.reward)
    pos = jnp.arange(inputs.shape[1])
    start = (pos[None] == 0) | (pos[None] > tape.length[:, None])

    def pad(x):  # one dummy transition for the last position
        return jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)

    reward = tape.reward - penalty * tape.uncertainty
    return TapeBatch(inputs, start, pad(tape.action), pad(reward), pad(tape.terminated), pad(tape.real))


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
    actor_encoder: RecurrentNet | Memoryless = struct.field(pytree_node=False)
    actor_head: Net = struct.field(pytree_node=False)
    critic_encoder: RecurrentNet | Memoryless = struct.field(pytree_node=False)
    critic_heads: Net = struct.field(pytree_node=False)
    act_dim: int = struct.field(pytree_node=False)


# ----------------------------------------------------------------------------- networks and optimisers


EQUINOX_LINEAR = fan_in_uniform_init  # the reference's Linear layers: Equinox's default init


def _critic_init(params, key):
    """A critic head: every Linear at U(+-1/sqrt(fan_in)) (weights and biases, Equinox's default), the
    output layer then at U(+-sqrt(0.01 / fan_in)) weights and a zero bias (the reference's scale 0.01)."""
    k_all, key = jax.random.split(key)
    params = EQUINOX_LINEAR(params, k_all)

    def put(path, x):
        names = path_names(path)
        if "out" in names and names[-1] == "kernel":
            return uniform_fan_in(key, x.shape, x.shape[0], x.dtype, scale=0.01)
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
    tx = optax.multi_transform(
        {"encoder": optax.adam(lr(cfg.encoder_lr)), heads: optax.adam(lr(cfg.head_lr))},
        lambda params: {k: k for k in params},
    )
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)


def init(
    key,
    obs_dim: int,
    act_dim: int,
    cfg: NeuBayConfig = NeuBayConfig(),
    network: NetworkConfig = NetworkConfig(),
    plasticity: StaticPlasticity = StaticPlasticity(),
) -> NeuBayState:
    """Actor and critic, each its own recurrent encoder over x_t = [s_t, a_{t-1}, r_{t-1}] (``markov``:
    none, the heads read s_t).

    Unset per-run fields take their ``BASE`` values (a run sets them first: ``with_dataset``).  The
    sizes are NeuBay's own flags (--head-width, --d-model, ...): ``--network.*`` flags and plasticity
    interventions are refused."""
    if network != NetworkConfig():
        raise ValueError(
            "--network.* flags do not apply to agent 'neubay': its sizes are --head-width, "
            "--head-depth, --d-model, --d-hidden and --lru-layers"
        )
    if plasticity != StaticPlasticity():
        raise ValueError(f"plasticity interventions do not apply to agent 'neubay': {INTERVENTIONS_REFUSED}")
    cfg = resolved(cfg)
    sac.check_target_entropy(cfg.target_entropy, act_dim)  # its policy is tanh-squashed too
    in_dim = obs_dim + act_dim + 1
    head = TrunkSpec(cfg.head_width, cfg.head_depth, activation="leaky_relu", layer_norm=True)
    k_ae, k_ah, k_ce, k_ch, k_out = jax.random.split(key, 5)
    if cfg.markov:
        (actor_encoder, ae), (critic_encoder, ce) = (
            (Memoryless(n, obs_dim), {}) for n in ("actor_encoder", "critic_encoder")
        )
    else:
        actor_encoder, ae = build_recurrent("actor_encoder", in_dim, cfg.recurrent, k_ae, EQUINOX_LINEAR)
        critic_encoder, ce = build_recurrent("critic_encoder", in_dim, cfg.recurrent, k_ce, EQUINOX_LINEAR)
    feature = obs_dim if cfg.markov else cfg.d_model
    actor_head, ah = build(
        "actor", lambda r: GaussianPolicyHead(feature, act_dim, head, rngs=r), k_ah, initializer=EQUINOX_LINEAR
    )
    critic_heads, ch = build(
        "critic",
        lambda r: MLPHead(feature + act_dim, 1, head, rngs=r),
        k_ch,
        ensemble=cfg.critics,
        initializer=_critic_init,
    )
    actor_params, critic_params = {"encoder": ae, "head": ah}, {"encoder": ce, "heads": ch}
    log_alpha = jnp.log(jnp.asarray(cfg.init_alpha, jnp.float32))
    return NeuBayState(
        actor_params,
        critic_params,
        jax.tree.map(jnp.copy, critic_params),
        log_alpha,
        _optimizer(cfg, True).init(actor_params),
        _optimizer(cfg, False).init(critic_params),
        optax.adam(cfg.alpha_lr).init(log_alpha),
        jnp.zeros((), jnp.int32),
        cfg,
        actor_encoder,
        actor_head,
        critic_encoder,
        critic_heads,
        act_dim,
    )


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
    return jnp.where(jnp.abs(x) < 1.0, 0.5 * x**2, jnp.abs(x) - 0.5)


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
    heads = jax.random.choice(k_heads, cfg.critics, (cfg.sampled_critics,), replace=False)
    drawn = jax.tree.map(lambda p: p[heads], state.target_critic_params["heads"])  # only the M drawn heads run
    next_qs = _q(state, drawn, target_h[:, 1:], next_action[:, 1:])  # (M, B, T-1)
    y = jax.lax.stop_gradient(
        redq_target(
            next_qs,
            jnp.arange(cfg.sampled_critics),
            tape.reward[:, :-1],
            tape.terminated[:, :-1],
            next_log_prob[:, 1:],
            alpha,
            cfg.gamma,
        )
    )
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
        state.critic_params, state, tape, alpha, k_critic
    )
    upd, critic_opt = _optimizer(cfg, False).update(q_grad, state.critic_opt, state.critic_params)
    critic_params = optax.apply_updates(state.critic_params, upd)
    target = optax.incremental_update(critic_params, state.target_critic_params, cfg.tau)

    (pi_loss, entropy), pi_grad = jax.value_and_grad(actor_loss, has_aux=True)(
        state.actor_params, state, critic_params, tape, alpha, k_actor
    )
    upd, actor_opt = _optimizer(cfg, True).update(pi_grad, state.actor_opt, state.actor_params)
    actor_params = optax.apply_updates(state.actor_params, upd)

    target_entropy = -float(state.act_dim) if cfg.target_entropy is None else cfg.target_entropy
    a_loss, a_grad = jax.value_and_grad(alpha_loss)(state.log_alpha, entropy, tape, target_entropy, cfg.real_weight)
    log_alpha, alpha_opt = state.log_alpha, state.alpha_opt
    if not cfg.fixed_alpha:
        upd, alpha_opt = optax.adam(cfg.alpha_lr).update(a_grad, state.alpha_opt, state.log_alpha)
        log_alpha = optax.apply_updates(state.log_alpha, upd)

    mask = transition_mask(tape)
    metrics = {
        "losses/critic": q_loss,
        "losses/critic_real": q_real,
        "losses/critic_imagined": q_imag,
        "losses/actor": pi_loss,
        "losses/alpha": a_loss,
        "charts/alpha": jnp.exp(log_alpha),
        "charts/entropy": (entropy * mask).sum() / jnp.maximum(mask.sum(), 1),
        "values/q_mean": (q.mean(axis=0) * mask).sum() / jnp.maximum(mask.sum(), 1),
    }
    new = state.replace(
        actor_params=actor_params,
        critic_params=critic_params,
        target_critic_params=target,
        log_alpha=log_alpha,
        actor_opt=actor_opt,
        critic_opt=critic_opt,
        alpha_opt=alpha_opt,
        updates=state.updates + 1,
    )
    return new, metrics


# ----------------------------------------------------------------------------- plasticity metrics

INTERVENTIONS_REFUSED = (
    "its networks take plasticity metrics only (each recurrent encoder shares a params "
    "field and optimizer with its head, and the LRU's recurrent parameters have no "
    "per-neuron reset rule)"
)
_PARTS = {
    "actor_encoder": ("actor", "encoder"),
    "actor": ("actor", "head"),
    "critic_encoder": ("critic", "encoder"),
    "critic": ("critic", "heads"),
}


def _measured_parts(state: NeuBayState) -> dict:
    """{metric network: (actor | critic, key in its params)}: the heads, and the encoders unless Markov."""
    return {n: part for n, part in _PARTS.items() if not (state.cfg.markov and n.endswith("_encoder"))}


def metric_params(state: NeuBayState) -> dict:
    """The params of each network the plasticity metrics read, keyed by the network's name."""
    params = {"actor": state.actor_params, "critic": state.critic_params}
    return {n: params[owner][key] for n, (owner, key) in _measured_parts(state).items()}


def metric_losses(state: NeuBayState, tape: TapeBatch, key):
    """Each measured network's training loss as a function of its own params (the rest of its
    owner's params held at their values): the critic loss for the critic's encoder and heads, the
    actor loss (against the current critics) for the actor's."""
    alpha = jnp.exp(state.log_alpha)
    k_critic, k_actor = jax.random.split(key)

    def loss_of(owner: str, part: str):
        def loss(p):
            if owner == "critic":
                return critic_loss({**state.critic_params, part: p}, state, tape, alpha, k_critic)[0]
            return actor_loss({**state.actor_params, part: p}, state, state.critic_params, tape, alpha, k_actor)[0]

        return loss

    return {n: loss_of(owner, part) for n, (owner, part) in _measured_parts(state).items()}


# ----------------------------------------------------------------------------- acting


def initial_memory(state: NeuBayState, batch: int):
    """The actor's zero recurrent state for ``batch`` parallel episodes."""
    return state.actor_encoder.initial_state((batch,))


def act_step(state: NeuBayState, memory, obs, prev_action, prev_reward, start, key, explore: bool):
    """One step of ``batch`` episodes: obs (B, O), the previous step's action (B, A) and reward (B,)
    (ignored where ``start``: an episode's first step), start (B,) -> (action (B, A), memory).
    A sampled action when exploring, tanh(mean) otherwise."""
    first = start[:, None]
    inputs = jnp.concatenate(
        [obs, jnp.where(first, 0.0, prev_action), jnp.where(first, 0.0, prev_reward[:, None])], axis=-1
    )
    y, memory = state.actor_encoder.step(state.actor_params["encoder"], inputs, memory, start)
    mean, log_std = state.actor_head(state.actor_params["head"], y)
    action = tanh_gaussian_sample(key, mean, log_std)[0] if explore else tanh_gaussian_mode(mean)
    return action, memory


def act(state: NeuBayState, obs, key, explore: bool):
    """The contract's memoryless act: the first step of an episode (zero memory, no previous action or
    reward) for every row of obs (B, O).  Evaluation uses ``initial_memory`` / ``act_step`` instead,
    carrying each episode's history (``agents.api.RecurrentAgent``)."""
    b = obs.shape[0]
    action, _ = act_step(
        state,
        initial_memory(state, b),
        obs,
        jnp.zeros((b, state.act_dim), obs.dtype),
        jnp.zeros(b, obs.dtype),
        jnp.ones(b, bool),
        key,
        explore,
    )
    return action


def history_values(state: NeuBayState, obs, action, reward):
    """Every critic head's Q(h_t, a_t) along one episode from its start (diagnostics): obs (T, O),
    action (T, A) and reward (T,) of transitions t = 0 .. T-1 -> (N, T), where h_t reads the
    inputs x_0 .. x_t = [s, a_prev, r_prev] as in training."""
    obs, action, reward = (jnp.asarray(x, jnp.float32) for x in (obs, action, reward))
    inputs = imagination.agent_inputs(obs, action[:-1], reward[:-1])[None]
    start = jnp.arange(inputs.shape[1])[None] == 0
    zeros = jnp.zeros(inputs.shape[:2], bool)
    tape = TapeBatch(inputs, start, action[None], reward[None], zeros, zeros)
    h = _encode(state.critic_encoder, state.critic_params["encoder"], tape)
    return _q(state, state.critic_params["heads"], h, action[None])[:, 0]


def rollout_policy(state: NeuBayState, explore: bool = True):
    """The stochastic actor as ``imagination.imagine`` calls it: (memory, inputs (B, T, I), start (B, T),
    key) -> (the action at the last position, memory)."""

    def policy(memory, inputs, start, key):
        y, memory = state.actor_encoder(state.actor_params["encoder"], inputs, memory, start)
        mean, log_std = state.actor_head(state.actor_params["head"], y[:, -1])
        action = tanh_gaussian_sample(key, mean, log_std)[0] if explore else tanh_gaussian_mode(mean)
        return action, memory

    return policy


# ----------------------------------------------------------------------------- the offline run

KIND = "offline"
CONFIG = NeuBayConfig
with_dataset = neubay_config.with_dataset  # the offline agent's per-run config (agents/api.py: OfflineAgent)
EXPERIENCE_REVIEW = False  # a fixed dataset: no online stream to review
HORIZON_QUANTILES = (0.1, 0.5, 0.9)


class World(NamedTuple):
    """What every seed imagines in (``prepare``, shared, not checkpointed: the model is cached on disk)."""

    model: dynamics_lib.DynamicsModel  # elites cut to the ``planning_members`` best
    histories: imagination.Histories  # the dataset's trajectories, actions in [-1, 1]
    threshold: jax.Array  # the truncation threshold (inf: none)
    penalty: jax.Array  # the reward penalty per unit of uncertainty (cfg.penalty / its dataset mean)


class Data(NamedTuple):
    """What one seed learns from: its tape buffer, the gradient steps it owes its collections, and
    the last collection's statistics.  ``real`` is empty: the dataset lives in ``World``."""

    real: tuple
    tapes: tapes_lib.TapeBuffer
    debt: jax.Array
    last_collection: dict


def tape_capacity(cfg: NeuBayConfig) -> int:
    """Positions the run's tape buffer needs: ``buffer_transitions``, or less when the run cannot
    collect that many (--total-steps / utd transitions, plus one collection of whole tapes on each side)."""
    cfg = resolved(cfg)
    one = cfg.rollout_batch * (cfg.max_horizon + 1)
    reachable = math.ceil(cfg.updates / cfg.utd) + cfg.rollout_batch + 2 * one
    return max(min(cfg.buffer_transitions, reachable), one)


def _collection_stats(stats, tape: imagination.Tape):
    horizon = stats["horizon"].astype(jnp.float32)
    out = {
        "rollout/horizon_mean": horizon.mean(),
        "rollout/horizon_max": horizon.max(),
        "rollout/prefix_mean": stats["prefix"].astype(jnp.float32).mean(),
        "rollout/ended_terminated": stats["ended_terminated"].mean(),
        "rollout/ended_uncertainty": stats["ended_uncertainty"].mean(),
        "rollout/ended_horizon": stats["ended_horizon"].mean(),
        "rollout/imagined_return": stats["imagined_return"].mean(),
        "rollout/uncertainty_mean": stats["uncertainty_mean"],
        "rollout/transitions": tape.length.sum().astype(jnp.float32),
    }
    for q in HORIZON_QUANTILES:
        out[f"rollout/horizon_p{int(q * 100)}"] = jnp.quantile(horizon, q)
    return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _empty_stats():
    names = [
        "horizon_mean",
        "horizon_max",
        "prefix_mean",
        "ended_terminated",
        "ended_uncertainty",
        "ended_horizon",
        "imagined_return",
        "uncertainty_mean",
        "transitions",
    ] + [f"horizon_p{int(q * 100)}" for q in HORIZON_QUANTILES]
    return {f"rollout/{n}": jnp.zeros((), jnp.float32) for n in names}


def data_init(real, cfg: NeuBayConfig) -> Data:
    obs_dim, act_dim = real.obs.shape[-1], real.action.shape[-1]
    buffer = tapes_lib.init(tape_capacity(cfg), obs_dim, act_dim, penalized=cfg.penalty > 0)
    return Data((), buffer, jnp.zeros((), jnp.int32), _empty_stats())


def model_path(dataset_path, seed: int) -> str:
    return f"{dataset_path}.neubay-{seed}.npz"


def prepare(key, dataset, dataset_path, cfg: NeuBayConfig, seed: int, log=print) -> World:
    """Once per run: the world-model posterior (loaded or trained with ``cfg.dynamics``), its
    ``planning_members`` best elites, the dataset's trajectories, the truncation threshold and the
    penalty's scale (sections 7.1-7.2)."""
    cfg = resolved(cfg)
    model = dynamics_lib.load_or_train(key, dataset, cfg.dynamics, model_path(dataset_path, seed), cfg.model, log)
    if cfg.planning_members > model.elites.shape[0]:
        raise SystemExit(
            f"--planning-members {cfg.planning_members}: the world model has only {model.elites.shape[0]} elites"
        )
    model = model.replace(elites=model.elites[: cfg.planning_members])
    t = dataset.transitions(unit_actions=True)
    unc = dynamics_lib.dataset_uncertainties(model, t.obs, t.action)
    threshold = dynamics_lib.uncertainty_threshold(model, t.obs, t.action, cfg.uncertainty_quantile, uncertainties=unc)
    mean_unc = float(np.mean(unc))
    log(
        f"world model: {int(model.elites.shape[0])} members for imagination, validation MSE of the best "
        f"{float(np.asarray(model.val_mse)[int(model.elites[0])]):.4g}; dataset uncertainty mean {mean_unc:.4g}, "
        f"truncation threshold {threshold:.4g} (quantile {cfg.uncertainty_quantile})"
    )
    hist = imagination.histories(t.obs, t.action, t.reward, t.next_obs, t.terminated, t.truncated, cfg.max_horizon)
    return World(
        model, hist, jnp.asarray(threshold, jnp.float32), jnp.asarray(cfg.penalty / max(mean_unc, 1e-12), jnp.float32)
    )


def buffer_tape(tape: tapes_lib.Tape) -> TapeBatch:
    """A tape from the buffer as a training batch of one row: inputs [s_t, a_{t-1}, r_{t-1}] with the
    rewards the agent saw, and the rewards to learn less their penalty (a ``penalized`` buffer)."""
    inputs = jnp.concatenate(
        [tape.obs, tapes_lib.previous(tape.action, tape.start), tapes_lib.previous(tape.reward, tape.start)[:, None]],
        axis=-1,
    )
    reward = tape.reward if tape.penalty is None else tape.reward - tape.penalty
    return TapeBatch(*(x[None] for x in (inputs, tape.start, tape.action, reward, tape.terminated, tape.real)))


def sample_batch(state: NeuBayState, data: Data, key, batch_size: int) -> TapeBatch:
    """One training tape of ``batch_size`` positions from the seed's tape buffer (``markov``:
    ``batch_size`` uniform transitions, each a tape of two positions)."""
    if state.cfg.markov:
        return jax.vmap(lambda t: jax.tree.map(lambda x: x[0], buffer_tape(t)))(
            tapes_lib.sample_transitions(data.tapes, key, batch_size)
        )
    return buffer_tape(tapes_lib.sample(data.tapes, key, batch_size))


def collect(state: NeuBayState, data: Data, world: World, key, cfg: NeuBayConfig, done_fn, active=True) -> Data:
    """One collection (the reference's ``experience/collector.py``): ``rollout_batch`` tapes imagined
    with the stochastic actor, added to the buffer, and ceil(utd x their transitions) gradient steps
    owed.  ``active`` False: none."""
    tape, stats = imagination.imagine(
        world.model,
        world.histories,
        rollout_policy(state, explore=True),
        initial_memory(state, cfg.rollout_batch),
        key,
        batch=cfg.rollout_batch,
        max_horizon=cfg.max_horizon,
        threshold=world.threshold,
        done_fn=done_fn,
        active=active,
    )
    penalty = world.penalty * tape.uncertainty if data.tapes.steps.penalty is not None else None
    tapes = tapes_lib.add(
        data.tapes,
        tape.obs,
        tape.action,
        tape.reward,
        tape.terminated,
        tape.real,
        tape.length,
        keep=jnp.broadcast_to(active, tape.length.shape),
        penalty=penalty,
    )
    owed = jnp.ceil(cfg.utd * tape.length.sum()).astype(jnp.int32)
    last = jax.tree.map(
        lambda new, old: jnp.where(active, new, old), _collection_stats(stats, tape), data.last_collection
    )
    return Data(data.real, tapes, data.debt + jnp.where(active, owed, 0), last)


def train_epoch(state: NeuBayState, data: Data, world: World, key, cfg: NeuBayConfig, done_fn):
    """``updates_per_epoch`` gradient steps for one seed, collecting whenever the owed steps are done
    (the reference's loop: collect, then ceil(utd x new transitions) steps, repeat).  The collection
    is skipped (``active``), not branched on, so the seeds' vmap runs one program."""
    total = cfg.updates_per_epoch
    probe = jax.eval_shape(lambda s, d, k: update(s, sample_batch(s, d, k, cfg.tape_len), k)[1], state, data, key)
    zeros = jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), probe)

    def owing(carry):
        _, data, _, done, _ = carry
        return (data.debt > 0) & (done < total)

    def one_update(carry):
        state, data, key, done, sums = carry
        key, k_sample, k_update = jax.random.split(key, 3)
        state, metrics = update(state, sample_batch(state, data, k_sample, cfg.tape_len), k_update)
        sums = jax.tree.map(jnp.add, sums, metrics)
        return state, data._replace(debt=data.debt - 1), key, done + 1, sums

    def not_done(carry):
        return carry[3] < total

    def pay_then_collect(carry):
        state, data, key, done, sums = jax.lax.while_loop(owing, one_update, carry)
        key, k_collect = jax.random.split(key)
        data = collect(state, data, world, k_collect, cfg, done_fn, active=(data.debt == 0) & (done < total))
        return state, data, key, done, sums

    state, data, _, _, sums = jax.lax.while_loop(
        not_done, pay_then_collect, (state, data, key, jnp.zeros((), jnp.int32), zeros)
    )
    metrics = {
        **jax.tree.map(lambda m: m / total, sums),
        **data.last_collection,
        "rollout/owed_updates": data.debt.astype(jnp.float32),
        "buffer/trajectories": tapes_lib.stored_episodes(data.tapes).astype(jnp.float32),
        "buffer/positions": tapes_lib.stored_positions(data.tapes).astype(jnp.float32),
    }
    return state, data, metrics


def make_epoch(cfg: NeuBayConfig, env_id: str):
    """The loop's per-seed epoch function, with the env's termination function bound."""
    cfg = resolved(cfg)
    done_fn = termination.termination_fn(env_id)
    return lambda state, data, world, key: train_epoch(state, data, world, key, cfg, done_fn)
