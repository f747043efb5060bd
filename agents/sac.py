"""SAC with automatic temperature, SAC-N (N critics) and EDAC (gradient diversity).

Haarnoja et al. 2018 (arXiv 1812.05905) with the SAC-N / EDAC extensions of An et al. 2021
(arXiv 2110.01548), as RAVL's reference code runs them (Sims et al. 2024; anyasims/edge-of-reach
``agent_training/agent.py``, taken almost unchanged from CORL's ``edac.py``).  One gradient step:

  1. temperature:  J(alpha) = E[-log alpha * (log pi(a|s) + target_entropy)],  a ~ pi(.|s)
  2. actor:        J(pi)    = E[alpha log pi(a|s) - min_i Q_i(s, a)]
  3. critics:      y = r + gamma (1 - terminated) (min_i Q'_i(s', a') - alpha log pi(a'|s'))
                   J(Q)     = sum_i E[(Q_i(s, a) - y)^2]  +  eta * ESS
                   ESS      = E_s[ sum_{i != j} cos(grad_a Q_i, grad_a Q_j) ] / (N - 1)
  4. Polyak:       theta' <- tau theta + (1 - tau) theta'

With ``--plasticity.sigreg-coef`` the actor and critic losses each add SIGReg of their own
network's features (the trunk output feeding the head).  The actor and critic optimizers come
from ``plasticity.optim.optimizer`` (Adam by default; ``--plasticity.kron`` / ``--plasticity.ne``
switch them); with NE the target critic shares the critic's masks.

``truncated`` never enters the target: a transition cut by a time limit bootstraps from its
true final observation, which the replay buffer stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from plasticity_zoo.agents.api import OffPolicyConfig, check_replay
from plasticity_zoo.buffers import replay
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.networks import GaussianPolicyHead, MLPHead, Net, TrunkSpec, build
from plasticity_zoo.networks.config import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, RATE, UNIT, NetworkConfig, check_ranges
from plasticity_zoo.networks.distributions import tanh_gaussian_mode, tanh_gaussian_sample, tanh_max_entropy
from plasticity_zoo.plasticity import optim as optim_lib
from plasticity_zoo.plasticity.api import StaticPlasticity, declared_nets, declared_params
from plasticity_zoo.plasticity.injection import injectable
from plasticity_zoo.plasticity.sigreg import regularized


@dataclass(frozen=True)
class SACHyperparams:
    """SAC's learning hyperparameters (defaults: Haarnoja et al. 2018, with SAC-N / EDAC's ensemble
    options from An et al. 2021); RAVL reuses them."""

    critics: int = 2
    """number of Q networks N (2 = SAC's clipped double Q; >2 = SAC-N)"""
    eta: float = 0.0
    """EDAC gradient-diversity coefficient (0 = SAC-N)"""
    actor_lr: float = 3e-4
    critic_lr: float = 3e-4
    alpha_lr: float = 3e-4
    gamma: float = 0.99
    tau: float = 5e-3
    init_alpha: float = 1.0
    target_entropy: Optional[float] = None
    """None: -|A|; at most |A| log 2 (the uniform's entropy on [-1, 1]^|A|)"""
    edac_init: bool = False
    """EDAC initialisation: hidden biases 0.1, output layers U(+-1e-3) actor / U(+-3e-3) critic"""

    # alpha_lr 0 keeps the temperature at init_alpha; target_entropy is checked against the action's
    # dimension in init (check_target_entropy)
    RANGES = {
        "critics": AT_LEAST_ONE,
        "eta": NON_NEGATIVE,
        "actor_lr": POSITIVE,
        "critic_lr": POSITIVE,
        "alpha_lr": NON_NEGATIVE,
        "gamma": UNIT,
        "tau": RATE,
        "init_alpha": POSITIVE,
    }


@dataclass(frozen=True)
class SACConfig(OffPolicyConfig, SACHyperparams):
    """Online SAC: the hyperparameters plus replay and schedule settings."""


# Paper default: 2 x 256 ReLU for actor and critics (EDAC uses --network.depth 3).
@struct.dataclass
class SACState:
    actor_params: object
    critic_params: object
    target_critic_params: object
    log_alpha: jax.Array
    actor_opt: object
    critic_opt: object
    alpha_opt: object
    updates: jax.Array
    cfg: SACConfig = struct.field(pytree_node=False)
    actor: Net = struct.field(pytree_node=False)
    critic: Net = struct.field(pytree_node=False)
    act_dim: int = struct.field(pytree_node=False)
    plasticity: StaticPlasticity = struct.field(pytree_node=False, default=StaticPlasticity())


# Plastic networks: name -> (params field, optimizer-state field).  Plasticity code acts on these.
PLASTIC = {"actor": ("actor_params", "actor_opt"), "critic": ("critic_params", "critic_opt")}
# The target copy of a plastic network (a layer reset re-draws it with the network: plasticity/perturb.py).
PLASTIC_TARGETS = {"critic": "target_critic_params"}


def _optimizers(cfg: SACConfig, plasticity: StaticPlasticity):
    """Actor, critic (plastic: the shared factory, with the Kron / NE choice built in) and temperature
    (plain Adam) optimizers."""
    spec = plasticity.optim
    return (
        optim_lib.optimizer(cfg.actor_lr, "actor", spec=spec),
        optim_lib.optimizer(cfg.critic_lr, "critic", ensemble=True, spec=spec),
        optax.adam(cfg.alpha_lr),
    )


def init(
    key,
    obs_dim: int,
    act_dim: int,
    cfg: SACConfig,
    network: NetworkConfig = NetworkConfig(),
    plasticity: StaticPlasticity = StaticPlasticity(),
) -> SACState:
    check_ranges(cfg)  # RAVL's too (its config's own table included)
    if cfg.eta > 0 and cfg.critics < 2:
        raise ValueError("EDAC's diversity term (--eta > 0) needs at least 2 critics")
    check_target_entropy(cfg.target_entropy, act_dim)
    if isinstance(cfg, OffPolicyConfig):
        check_replay(cfg)
    spec = network.trunk(TrunkSpec(256, 2, hidden_bias_init=0.1 if cfg.edac_init else 0.0))
    k_actor, k_critic = jax.random.split(key)
    # injectable: the networks plasticity injection may give a residual head (when the run asks for it)
    actor, actor_params = injectable(
        *build(
            "actor",
            lambda r: GaussianPolicyHead(
                obs_dim, act_dim, spec, rngs=r, out_init_scale=1e-3 if cfg.edac_init else None
            ),
            k_actor,
        ),
        plasticity,
    )
    critic, critic_params = injectable(
        *build(
            "critic",
            lambda r: MLPHead(obs_dim + act_dim, 1, spec, rngs=r, out_init_scale=3e-3 if cfg.edac_init else None),
            k_critic,
            ensemble=cfg.critics,
        ),
        plasticity,
    )
    log_alpha = jnp.log(jnp.asarray(cfg.init_alpha, jnp.float32))
    tx_a, tx_c, tx_t = _optimizers(cfg, plasticity)
    target_params = jax.tree.map(jnp.copy, critic_params)  # distinct buffers (the loop donates state)
    return SACState(
        actor_params,
        critic_params,
        target_params,
        log_alpha,
        tx_a.init(actor_params),
        tx_c.init(critic_params),
        tx_t.init(log_alpha),
        jnp.zeros((), jnp.int32),
        cfg,
        actor,
        critic,
        act_dim,
        plasticity,
    )


def act(state: SACState, obs, key, explore: bool):
    """A sampled action when exploring, tanh(mean) otherwise."""
    mean, log_std = state.actor(state.actor_params, obs)
    if explore:
        return tanh_gaussian_sample(key, mean, log_std)[0]
    return tanh_gaussian_mode(mean)


def target_entropy(state: SACState) -> float:
    t = state.cfg.target_entropy
    return -float(state.act_dim) if t is None else t


def check_target_entropy(target: Optional[float], act_dim: int):
    """Refuse an entropy target no tanh-squashed policy reaches: above ``act_dim`` x log 2, the entropy
    of the uniform distribution on [-1, 1]^act_dim (``tanh_max_entropy``), the temperature would only
    grow.  SAC's own target is -act_dim (Haarnoja et al. 2018); any target up to the bound is taken."""
    if target is None:
        return
    most = tanh_max_entropy(act_dim)
    if not target <= most:  # NaN too
        raise ValueError(
            f"--target-entropy must be <= {most:.4g} for a {act_dim}-dimensional action "
            f"({act_dim} x log 2: the entropy of the uniform distribution on [-1, 1]^{act_dim}, the most "
            f"a tanh-squashed policy can have; SAC's default is -{act_dim}), got {target}"
        )


def td_target(reward, terminated, next_q_min, next_log_prob, alpha, gamma):
    """y = r + gamma (1 - terminated) (min_i Q'_i(s', a') - alpha log pi(a'|s'))."""
    return reward + gamma * (1.0 - terminated.astype(reward.dtype)) * (next_q_min - alpha * next_log_prob)


def diversity_loss(critic: Net, critic_params, obs, action):
    """EDAC's ensemble similarity: mean over states of sum_{i!=j} cos(grad_a Q_i, grad_a Q_j) / (N-1)."""
    n = critic.ensemble
    # One backward pass: each member gets its own copy of the actions, so d(sum of all Q)/d(copy i)
    # is grad_a Q_i (a jacrev over members would cost N backward passes through the whole ensemble).
    x = jnp.broadcast_to(
        jnp.concatenate([obs, action], axis=-1), (n, *obs.shape[:-1], obs.shape[-1] + action.shape[-1])
    )
    grads = jax.grad(lambda x: critic.apply(critic_params, x, member_inputs=True)[0].sum())(x)[..., obs.shape[-1] :]
    # ||g|| as sqrt(sum g^2 + 1e-20): jnp.linalg.norm's gradient is NaN at g = 0 (a ReLU critic can
    # have exactly zero action-gradient), torch.norm's is 0; this matches the latter.
    unit = grads / (jnp.sqrt(jnp.sum(grads**2, axis=-1, keepdims=True) + 1e-20) + 1e-10)
    cos = jnp.einsum("nba,mba->bnm", unit, unit)
    off_diagonal = cos.sum(axis=(1, 2)) - jnp.trace(cos, axis1=1, axis2=2)
    return off_diagonal.mean() / (n - 1)


def alpha_loss(log_alpha, log_prob, entropy_target):
    return -(log_alpha * jax.lax.stop_gradient(log_prob + entropy_target)).mean()


def actor_loss(actor_params, state: SACState, obs, alpha, key):
    mean, log_std = state.actor(actor_params, obs)
    action, log_prob = tanh_gaussian_sample(key, mean, log_std)
    q = state.critic(state.critic_params, obs, action)
    return (alpha * log_prob - q.min(axis=0)).mean(), (log_prob, q.std(axis=0).mean())


def critic_loss(critic_params, state: SACState, actor_params, batch: Transition, alpha, key):
    """Squared TD error summed over critics (+ eta * diversity).  The online call comes first."""
    cfg = state.cfg
    q = state.critic(critic_params, batch.obs, batch.action)  # (N, B)
    mean, log_std = state.actor(actor_params, batch.next_obs)
    next_action, next_log_prob = tanh_gaussian_sample(key, mean, log_std)
    next_q = state.critic(state.target_critic_params, batch.next_obs, next_action).min(axis=0)
    y = jax.lax.stop_gradient(td_target(batch.reward, batch.terminated, next_q, next_log_prob, alpha, cfg.gamma))
    td = ((q - y[None]) ** 2).mean(axis=1).sum()
    div = diversity_loss(state.critic, critic_params, batch.obs, batch.action) if cfg.eta > 0 else jnp.zeros(())
    return td + cfg.eta * div, (q, td, div, next_q.mean())


def update(state: SACState, batch: Transition, key):
    """One gradient step in the reference code's order (CORL ``edac.py``): temperature, actor, critics, Polyak."""
    cfg = state.cfg
    tx_a, tx_c, tx_t = _optimizers(cfg, state.plasticity)
    k_alpha, k_actor, k_critic, k_reg_actor, k_reg_critic = jax.random.split(key, 5)

    mean, log_std = state.actor(state.actor_params, batch.obs)
    _, log_prob = tanh_gaussian_sample(k_alpha, mean, log_std)
    a_loss, a_grad = jax.value_and_grad(alpha_loss)(state.log_alpha, log_prob, target_entropy(state))
    upd, alpha_opt = tx_t.update(a_grad, state.alpha_opt, state.log_alpha)
    log_alpha = optax.apply_updates(state.log_alpha, upd)
    alpha = jnp.exp(log_alpha)

    (pi_loss, (log_prob, q_policy_std)), pi_grad = jax.value_and_grad(regularized(actor_loss, "actor"), has_aux=True)(
        state.actor_params, state, batch.obs, alpha, k_actor, reg_key=k_reg_actor, sigreg=state.plasticity.sigreg
    )
    upd, actor_opt = tx_a.update(pi_grad, state.actor_opt, state.actor_params)
    actor_params = optax.apply_updates(state.actor_params, upd)

    (q_loss, (q, td, div, next_q)), q_grad = jax.value_and_grad(regularized(critic_loss, "critic"), has_aux=True)(
        state.critic_params,
        state,
        actor_params,
        batch,
        alpha,
        k_critic,
        reg_key=k_reg_critic,
        sigreg=state.plasticity.sigreg,
    )
    upd, critic_opt = tx_c.update(q_grad, state.critic_opt, state.critic_params)
    critic_params = optax.apply_updates(state.critic_params, upd)
    target = optax.incremental_update(critic_params, state.target_critic_params, cfg.tau)
    target = optim_lib.apply_mask(critic_opt, target)  # NE: target networks share the masks (Liu et al. 2025 code)

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
    metrics = {
        "losses/critic": td,
        "losses/actor": pi_loss,
        "losses/alpha": a_loss,
        "losses/diversity": div,
        "charts/alpha": alpha,
        "charts/entropy": -log_prob.mean(),
        "values/q_mean": q.mean(),
        "values/q_std_ensemble": q.std(axis=0).mean(),
        "values/q_std_policy": q_policy_std,
        "values/q_std_random": _q_std_random(new, batch.obs, key),
        "values/next_q_min": next_q,
    }
    return new, metrics


def _q_std_random(state: SACState, obs, key):
    """Ensemble spread of the updated critics at uniform random actions: the pessimism SAC-N / EDAC
    can apply away from the data (EDAC's diagnostic).  Its own key (fold_in) leaves the update's keys as they were."""
    action = jax.random.uniform(jax.random.fold_in(key, 7), (*obs.shape[:-1], state.act_dim), minval=-1.0, maxval=1.0)
    return jax.lax.stop_gradient(state.critic(state.critic_params, obs, action)).std(axis=0).mean()


# ----------------------------------------------------------------------------- the agent contract (agents/api.py)
CONFIG = SACConfig
KIND = "offpolicy"
EXPERIENCE_REVIEW = True  # uniform replay: NE's experience review applies
SIGREG_NETWORKS = ("actor", "critic")  # their losses are wrapped with plasticity.sigreg.regularized
buffer_add = replay.add


def buffer_init(capacity: int, obs_dim: int, act_dim: int, cfg=None) -> replay.Buffer:
    """The uniform ring buffer (the config is not needed)."""
    return replay.init(capacity, obs_dim, act_dim)


plastic_params = declared_params(PLASTIC)
plastic_nets = declared_nets(PLASTIC)


def sample_batch(state: SACState, buffer: replay.Buffer, key, batch_size: int) -> Transition:
    """A uniform replay batch."""
    return replay.sample(buffer, key, batch_size)


def train_block(state: SACState, buffer: replay.Buffer, key, num_updates: int, replay_control=None):
    """``num_updates`` SAC updates on uniform batches (NE's review and auto batch given ``replay_control``)
    as one scan."""
    return replay.scan_updates(update, state, buffer, key, num_updates, state.cfg.batch_size, replay_control)


def plastic_losses(state: SACState, batch: Transition, key):
    """Per plastic network, its training loss as a function of that network's params (for metrics/resets)."""
    k1, k2 = jax.random.split(key)
    alpha = jnp.exp(state.log_alpha)
    return {
        "actor": lambda p: actor_loss(p, state, batch.obs, alpha, k1)[0],
        "critic": lambda p: critic_loss(p, state, state.actor_params, batch, alpha, k2)[0],
    }


def least_signals(state: SACState, transition: Transition, key):
    """LEAST's per-step signals: online min_i Q_i(s, a) and the critics' mean squared TD error."""
    alpha = jnp.exp(state.log_alpha)
    q = state.critic(state.critic_params, transition.obs, transition.action)
    mean, log_std = state.actor(state.actor_params, transition.next_obs)
    next_action, next_log_prob = tanh_gaussian_sample(key, mean, log_std)
    next_q = state.critic(state.target_critic_params, transition.next_obs, next_action).min(axis=0)
    y = td_target(transition.reward, transition.terminated, next_q, next_log_prob, alpha, state.cfg.gamma)
    return q.min(axis=0), ((q - y[None]) ** 2).mean(axis=0)
