"""The off-policy training loop: N vmapped seeds, device-side replay, exact resume.

Per env step the host makes two jitted calls: ``store`` writes the transitions into the replay
(``agent.buffer_add``, the buffer donated), then ``learn_and_act`` runs the
``updates_per_step * num_envs`` gradient steps (``agent.train_block``, one ``lax.scan``) and
returns the next action; everything seed-specific is vmapped over a leading seed axis.  The
iteration (``OffPolicyIteration``) runs inside the one loop driver (``training/driver.py``).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.buffers import replay
from plasticity_zoo.envs import make_vector_env, nonstationary
from plasticity_zoo.networks.runtime import cached_per_config
from plasticity_zoo.plasticity.hooks import Hooks, check_optimizers, static_plasticity
from plasticity_zoo.plasticity.least import LEAST
from plasticity_zoo.training.config import RunConfig
from plasticity_zoo.training.driver import Driver, StepReport
from plasticity_zoo.training.evaluation import run_evaluator
from plasticity_zoo.training.loop import (
    NonFiniteLossError,
    RunTree,
    agent_config,
    check_positive,
    env_resolve,
    finished_episodes,
    run_counts,
)
from plasticity_zoo.training.seeds import add_over_seeds, init_over_seeds, over_seeds

__all__ = [
    "NonFiniteLossError",
    "train",
    "check",
    "resolve",
    "template_tree",
    "last_step",
    "action_mode",
    "init_state",
    "seed_slice",
    "make_step_fn",
    "make_train_block",
    "step_keys",
]


def make_train_block(agent, cfg, num_updates: int):
    """``agent.train_block`` with ``num_updates`` bound:
    ``(state, buffer, key, replay_control=None) -> (state, buffer, metrics)``."""
    return lambda state, buffer, key, replay_control=None: agent.train_block(
        state, buffer, key, num_updates, replay_control
    )


def buffer_fns(agent):
    """(init(capacity, obs_dim, act_dim, cfg), add(buffer, transitions)): the agent's replay."""
    return agent.buffer_init, agent.buffer_add


@cached_per_config
def make_step_fn(agent, cfg, num_updates: int, act_dim: int):
    """Two jitted calls per env step: store transitions, then learn and choose the next actions.

    Cached per (agent, agent config, updates, action width), so runs in one process (a resumed
    run, a sweep's trials, tests) reuse the traced and compiled programs.

    ``sigreg`` (a ``SIGRegSpec``) switches SIGReg on in the agent's regularised losses, ``optim``
    (an ``OptimSpec``) Kron / NE masks in its optimizers; ``replay_control`` (a per-seed
    ``plasticity.expansion.ReplayControl``, or None) switches on NE's experience review and auto batch.
    """
    block = make_train_block(agent, cfg, num_updates)

    # Storing the transition is its own jitted call.  In one program with the updates, XLA fuses
    # the batch gathers with the in-place write of the new row, the gathers then need the old
    # buffer, and XLA copies every buffer array each env step (30 ms per step at 1M rows).
    @partial(jax.jit, donate_argnums=(0,))
    def store(buffer, transition, obs, valid=None):
        seeds, envs = obs.shape[:2]
        flat = jax.tree.map(lambda x: x.reshape(seeds, envs, *x.shape[1:]), transition)
        if valid is None:
            return add_over_seeds(agent.buffer_add)(buffer, flat)
        return add_over_seeds(agent.buffer_add)(buffer, flat, valid.reshape(seeds, envs))

    @partial(jax.jit, static_argnames=("random_actions", "train"), donate_argnums=(0, 1))
    def learn_and_act(state, buffer, obs, key, random_actions: bool, train: bool, replay_control=None):
        seeds, envs = obs.shape[:2]
        k_train, k_act = jax.random.split(key)
        metrics = {}
        if train:
            state, buffer, metrics = over_seeds(block)(state, buffer, jax.random.split(k_train, seeds), replay_control)
        if random_actions:
            action = jax.random.uniform(k_act, (seeds, envs, act_dim), minval=-1.0, maxval=1.0)
        else:
            action = over_seeds(partial(agent.act, explore=True))(state, obs, jax.random.split(k_act, seeds))
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(m)) for m in jax.tree.leaves(metrics)] or [jnp.bool_(True)]))
        return state, buffer, action, metrics, finite

    def step(state, buffer, transition, obs, key, random_actions: bool, train: bool, replay_control=None, valid=None):
        buffer = store(buffer, transition, obs, valid)  # valid: rows to keep (None: all)
        return learn_and_act(
            state, buffer, obs, key, random_actions=random_actions, train=train, replay_control=replay_control
        )

    for name, fn in (("store", store), ("learn_and_act", learn_and_act)):  # for the donation regression test
        setattr(step, name, fn)

    return step


@jax.jit
def step_keys(key):
    """A host step's keys: (the run's next key, this step's key, the key of the plasticity events after
    its updates, ``fold_in(step key, 1)``).  One jitted call: op by op, the split and the fold-in cost
    the host 0.08 and 0.31 ms per env step (2-core CPU), jitted together 0.02 ms; the bits are the same."""
    key, k = jax.random.split(key)
    return key, k, jax.random.fold_in(k, 1)


def init_state(agent, cfg: RunConfig, obs_dim: int, act_dim: int):
    keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 1)
    static = static_plasticity(cfg.plasticity, agent)  # Kron / NE masks, SIGReg: built into the agent
    agent_cfg = agent_config(agent, cfg)  # a multitask agent's config carries the env's task layout
    state = init_over_seeds(agent, keys[1:], obs_dim, act_dim, agent_cfg, cfg.network, static)
    check_optimizers(cfg.plasticity, agent, cfg.agent_name, state)
    buffer = jax.vmap(lambda _: agent.buffer_init(cfg.agent.buffer_size, obs_dim, act_dim, cfg.agent))(
        jnp.arange(cfg.seeds)
    )
    return RunTree(state, buffer, keys[0])


def template_tree(cfg: RunConfig, agent, obs_dim: int, act_dim: int):
    """The device tree a fresh run checkpoints (``OffPolicyIteration.tree()``: the agent states, the
    replays, the key), as ``init_state`` builds it; trace it with ``jax.eval_shape`` for a template."""
    return init_state(agent, cfg, obs_dim, act_dim)


resolve = env_resolve  # the config as given; the sizes of the env (built and closed)


def last_step(cfg: RunConfig, agent) -> int:
    """The step a finished run ends at: ``--total-steps``."""
    return cfg.total_steps


def action_mode(cfg: RunConfig, agent) -> str:
    """How the envs, the evaluation's included, map actions: ``rescale`` (``envs.actions``)."""
    return "rescale"


def seed_slice(tree, j: int):
    """One seed's agent state out of a vmapped one (for evaluation or export)."""
    return jax.tree.map(lambda x: x[j], tree)


def train(cfg: RunConfig, agent, run_dir: Path, resume: bool = False, stop_at: int | None = None, on_eval=None) -> dict:
    """Train (or resume) a run.  ``stop_at`` ends early at that step, as an interruption would.

    Steps count env steps per seed (each loop iteration steps ``num_envs`` envs per seed).
    ``on_eval(step, state, returns)``, if given, runs right after each evaluation with the vmapped
    agent state and the per-seed lists of returns (e.g. to keep policy snapshots); the next step
    donates the state's buffers, so copy what you keep.
    """
    check(cfg)
    iteration = OffPolicyIteration(cfg, agent)
    driver = Driver(cfg, agent, run_dir, iteration.hooks, iteration.evaluator, on_eval=on_eval)
    iteration.begin(driver, resume)
    end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)
    last_eval = driver.run(iteration, end, cfg.total_steps)
    return {"state": iteration.state, "step": driver.step, "last_eval": last_eval, "run_dir": str(run_dir)}


def check(cfg: RunConfig, agent=None, device: bool = False):
    """Settings the off-policy loop cannot run with (a ValueError naming the flag; ``agent`` is not
    needed); ``device``: the device loop's checks (``training/loops/device.py``), which also takes
    ``--updates-per-vector-step``."""
    check_positive(**run_counts(cfg))
    if not device and getattr(cfg.agent, "updates_per_vector_step", None) is not None:
        raise ValueError(
            "--updates-per-vector-step is the device loop's (playground: envs, --loop auto or device); the host "
            "loop runs --updates-per-step x --num-envs updates per vector step"
        )
    pc, batch = cfg.plasticity, getattr(cfg.agent, "batch_size", 2)
    if pc.ne and pc.ne_auto_batch != "off" and batch % 2:
        raise ValueError(
            f"NE's auto batch halves the batch: --batch-size must be even (got {batch}), "
            "or pass --plasticity.ne-auto-batch off"
        )


class OffPolicyIteration:
    """One vector-env step per seed: act in the envs, store the transitions, learn, pick the next actions."""

    def __init__(self, cfg: RunConfig, agent):
        a = cfg.agent
        self.cfg, self.agent = cfg, agent
        self.S, self.E = S, E = cfg.seeds, cfg.num_envs
        self.env = make_vector_env(cfg.env, S * E, cfg.seed * 10_000, cfg.action_repeat, env_impl=cfg.env_impl)
        self.evaluator = run_evaluator(cfg, action_mode(cfg, agent))
        self.obs_dim, self.act_dim = self.env.obs_dim, self.env.act_dim
        self.state, self.buffer, self.key = init_state(agent, cfg, self.obs_dim, self.act_dim)
        self.num_updates = a.updates_per_step * E
        learning_iters = cfg.total_steps // E - max(0, -(-a.learning_starts // E) - 1)  # iterations that learn
        self.hooks = Hooks(
            cfg.plasticity, agent, cfg.agent_name, total_updates=max(1, learning_iters * self.num_updates)
        )
        self.state = self.hooks.start(self.state)
        self.step_fn = make_step_fn(agent, a, self.num_updates, self.act_dim)
        pc = cfg.plasticity
        self.least = (
            LEAST(S, E, pc.least_window, pc.least_max_len, int(pc.least_warmup * cfg.total_steps), coef=pc.least_coef)
            if pc.least
            else None
        )
        self.least_signals = jax.jit(jax.vmap(agent.least_signals)) if pc.least else None
        self.set_noise = jax.jit(jax.vmap(agent.with_exploration_noise)) if pc.least_noise_max > 0 else None
        self.metrics, self.updates_done = None, 0

    def begin(self, driver, resume: bool):
        driver.begin(self, resume)
        counter = getattr(self.env, "step_counter", None)  # ns: envs share one step counter; evaluation follows it
        if counter is not None:
            self.env.steps_per_call = self.E  # the counter counts per-seed env steps, the unit of --total-steps
            nonstationary.follow(self.evaluator.env, counter)

    def fresh(self):
        self.obs = self.env.reset()
        self.key, k0 = jax.random.split(self.key)
        self.action = jax.random.uniform(k0, (self.S, self.E, self.act_dim), minval=-1.0, maxval=1.0)

    def tree(self):
        return RunTree(self.state, self.buffer, self.key)

    def load(self, tree, host):
        (self.state, self.buffer, self.key) = tree
        self.env, self.obs, self.action = host["env"], host["obs"], jnp.asarray(host["action"])
        self.updates_done, self.least = host["updates_done"], host["least"]

    def host(self) -> dict:
        return {
            "env": self.env,
            "obs": self.obs,
            "action": np.asarray(self.action),
            "updates_done": self.updates_done,
            "least": self.least,
        }

    def eval_state(self):
        return self.state

    def step(self, at: int, room: int) -> StepReport:
        """One vector step from env step ``at``: act, store, learn (from ``learning_starts``), next actions."""
        a, S, E, env = self.cfg.agent, self.S, self.E, self.env
        action = np.asarray(self.action).reshape(S * E, self.act_dim)
        new_obs, reward, terminated, truncated, next_obs = env.step(action)
        transition = replay.Transition(self.obs, action, reward, next_obs, terminated, truncated)
        if self.least is not None and at >= a.learning_starts:
            transition, new_obs = _least_step(
                self.least,
                self.least_signals,
                self.state,
                transition,
                new_obs,
                env,
                at,
                jax.random.fold_in(self.key, 2),
                S,
                E,
            )
        step = at + E
        self.obs = new_obs
        self.key, k, k_events = step_keys(self.key)
        learning = step >= a.learning_starts
        self.state, self.buffer, self.action, new_metrics, finite = self.step_fn(
            self.state,
            self.buffer,
            transition,
            self.obs.reshape(S, E, self.obs_dim),
            k,
            random_actions=not learning,
            train=learning,
            replay_control=self.hooks.replay_control,
            valid=getattr(env, "valid", None),  # a playground: env's steps that diverged stay out of the replay
        )
        episodes = finished_episodes(env, S, E)
        if not learning:
            return StepReport(E, E * S, self.metrics, episodes, last_log=self.cfg.total_steps)
        self.metrics = new_metrics
        before, self.updates_done = self.updates_done, self.updates_done + self.num_updates
        return StepReport(
            E,
            E * S,
            self.metrics,
            episodes,
            finite=finite,
            stats=new_metrics,
            updates=(before, self.updates_done),
            data=self.buffer,
            key=k_events,
            last_log=self.cfg.total_steps,
        )

    def log_columns(self):
        """LEAST's columns of a log row (the driver asks only when it writes one); its optional noise
        increase is applied here, at log steps."""
        pc = self.cfg.plasticity
        if self.least is None:
            return None
        rows = [{"plasticity/least_stops": self.least.stops} for _ in range(self.S)]
        if pc.least_noise_max > 0:
            sigma = self.least.noise(self.cfg.agent.exploration_noise, pc.least_noise_max).astype(np.float32)
            self.state = self.set_noise(self.state, jnp.asarray(sigma))
            for j, row in enumerate(rows):
                row["plasticity/least_noise"] = float(sigma[j])
        return rows


def _least_step(least, signals, state, transition, new_obs, env, step, key, S, E):
    """LEAST: stop the episodes the rule flags; their last transition is stored as truncated."""
    per_seed = jax.tree.map(lambda x: jnp.asarray(x).reshape(S, E, *np.shape(x)[1:]), transition)
    q, g = signals(state, per_seed, jax.random.split(key, S))
    done = transition.terminated | transition.truncated
    stop = least.decide(step, np.asarray(q).reshape(-1), np.asarray(g).reshape(-1), done)
    if not stop.any():
        return transition, new_obs
    truncated = transition.truncated | stop
    new_obs = new_obs.copy()
    for i in np.flatnonzero(stop):
        new_obs[i] = env.stop(int(i))
    return transition._replace(truncated=truncated), new_obs
