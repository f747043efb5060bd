"""A small off-policy agent written only to show (and test) what adding an agent takes: this one
file plus a line in ``agents.AGENTS`` (the test registers it as ``example``).

DDPG (Lillicrap et al. 2016, Algorithm 1): a deterministic actor mu(s), a critic Q(s, a) trained on
r + gamma (1 - terminated) Q'(s', mu'(s')), the actor on -Q(s, mu(s)), Polyak-averaged targets, and
Gaussian exploration noise on the action.  Uniform replay comes from ``buffers.replay``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import struct

from plasticity_zoo.agents.api import OffPolicyConfig
from plasticity_zoo.buffers import replay
from plasticity_zoo.networks import DeterministicPolicyHead, MLPHead, Net, TrunkSpec, build
from plasticity_zoo.networks.config import NetworkConfig
from plasticity_zoo.plasticity import optim as optim_lib
from plasticity_zoo.plasticity.api import StaticPlasticity, declared_nets, declared_params


@dataclass(frozen=True)
class ExampleConfig(OffPolicyConfig):
    lr: float = 1e-3
    gamma: float = 0.99
    tau: float = 5e-3
    noise: float = 0.1
    """std of the Gaussian exploration noise"""


@struct.dataclass
class ExampleState:
    actor_params: object
    critic_params: object
    target_actor_params: object
    target_critic_params: object
    actor_opt: object
    critic_opt: object
    cfg: ExampleConfig = struct.field(pytree_node=False)
    actor: Net = struct.field(pytree_node=False)
    critic: Net = struct.field(pytree_node=False)
    plasticity: StaticPlasticity = struct.field(pytree_node=False, default=StaticPlasticity())


CONFIG = ExampleConfig
KIND = "offpolicy"
EXPERIENCE_REVIEW = True
SIGREG_NETWORKS = ()
PLASTIC = {"actor": ("actor_params", "actor_opt"), "critic": ("critic_params", "critic_opt")}
plastic_params = declared_params(PLASTIC)
plastic_nets = declared_nets(PLASTIC)
buffer_add = replay.add


def buffer_init(capacity, obs_dim, act_dim, cfg=None):
    return replay.init(capacity, obs_dim, act_dim)


def _optimizers(cfg: ExampleConfig, plasticity: StaticPlasticity):
    return (
        optim_lib.optimizer(cfg.lr, "actor", spec=plasticity.optim),
        optim_lib.optimizer(cfg.lr, "critic", spec=plasticity.optim),
    )


def init(
    key,
    obs_dim: int,
    act_dim: int,
    cfg: ExampleConfig,
    network: NetworkConfig = NetworkConfig(),
    plasticity: StaticPlasticity = StaticPlasticity(),
):
    spec = network.trunk(TrunkSpec(256, 2))
    k_actor, k_critic = jax.random.split(key)
    actor, actor_params = build("actor", lambda r: DeterministicPolicyHead(obs_dim, act_dim, spec, rngs=r), k_actor)
    critic, critic_params = build("critic", lambda r: MLPHead(obs_dim + act_dim, 1, spec, rngs=r), k_critic)
    tx = _optimizers(cfg, plasticity)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731
    return ExampleState(
        actor_params,
        critic_params,
        copy(actor_params),
        copy(critic_params),
        tx[0].init(actor_params),
        tx[1].init(critic_params),
        cfg,
        actor,
        critic,
        plasticity,
    )


def act(state: ExampleState, obs, key, explore: bool):
    action = state.actor(state.actor_params, obs)[0]
    if explore:
        action = jnp.clip(action + state.cfg.noise * jax.random.normal(key, action.shape), -1.0, 1.0)
    return action


def critic_loss(critic_params, state: ExampleState, batch: replay.Transition):
    next_action = state.actor(state.target_actor_params, batch.next_obs)[0]
    next_q = state.critic(state.target_critic_params, batch.next_obs, next_action)[..., 0]
    y = batch.reward + state.cfg.gamma * (1.0 - batch.terminated) * next_q
    q = state.critic(critic_params, batch.obs, batch.action)[..., 0]
    return jnp.mean((q - jax.lax.stop_gradient(y)) ** 2)


def actor_loss(actor_params, state: ExampleState, obs):
    return -jnp.mean(state.critic(state.critic_params, obs, state.actor(actor_params, obs)[0]))


def update(state: ExampleState, batch: replay.Transition, key):
    del key
    cfg = state.cfg
    tx_actor, tx_critic = _optimizers(cfg, state.plasticity)
    c_loss, c_grads = jax.value_and_grad(critic_loss)(state.critic_params, state, batch)
    c_updates, critic_opt = tx_critic.update(c_grads, state.critic_opt, state.critic_params)
    state = state.replace(critic_params=optax.apply_updates(state.critic_params, c_updates), critic_opt=critic_opt)
    a_loss, a_grads = jax.value_and_grad(actor_loss)(state.actor_params, state, batch.obs)
    a_updates, actor_opt = tx_actor.update(a_grads, state.actor_opt, state.actor_params)
    state = state.replace(actor_params=optax.apply_updates(state.actor_params, a_updates), actor_opt=actor_opt)
    polyak = lambda t, o: jax.tree.map(lambda x, y: (1 - cfg.tau) * x + cfg.tau * y, t, o)  # noqa: E731
    state = state.replace(
        target_actor_params=polyak(state.target_actor_params, state.actor_params),
        target_critic_params=polyak(state.target_critic_params, state.critic_params),
    )
    return state, {"losses/critic": c_loss, "losses/actor": a_loss}


def sample_batch(state: ExampleState, buffer: replay.Buffer, key, batch_size: int):
    return replay.sample(buffer, key, batch_size)


def train_block(state: ExampleState, buffer: replay.Buffer, key, num_updates: int, replay_control=None):
    return replay.scan_updates(update, state, buffer, key, num_updates, state.cfg.batch_size, replay_control)


def plastic_losses(state: ExampleState, batch: replay.Transition, key):
    return {"actor": lambda p: actor_loss(p, state, batch.obs), "critic": lambda p: critic_loss(p, state, batch)}
