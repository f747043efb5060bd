"""MuJoCo Playground tasks as ``playground:<Name>`` envs that step on the device (optional extra ``.[mjx]``).

MuJoCo Playground (Zakka et al. 2025, arXiv 2502.08844) ports the DeepMind Control Suite to MJX:
physics that is a pure JAX function, so thousands of envs step under ``jit(vmap(step))`` and a
whole training run can be one jitted program (``training/loops/device.py``).  The zoo takes the
Control Suite ports that ship inside the ``playground`` wheel (``CartpoleBalance``, ``CheetahRun``,
``WalkerWalk``, ``HopperHop``, ...; ``task_names()``); its locomotion and manipulation tasks fetch
model repositories on first load and are not offered.

Semantics, beside the matching ``dmc:`` task:

- **Time.**  One agent step is one Playground control step (``ctrl_dt``, the same control timestep
  as dm_control's task: 0.01 s for cheetah and cartpole, 0.02 s for hopper and finger, 0.025 s for
  walker and humanoid), with ``ctrl_dt / sim_dt`` physics steps inside it.  The default action
  repeat is 1 (Playground's PPO settings), so an episode is ``episode_length`` = 1000 agent steps;
  ``dmc:`` ids default to action repeat 2 (MR.Q's protocol) and 500 agent steps.  Returns over
  an episode sum the same 1000 control-step rewards either way; ``--action-repeat k`` repeats an
  action over k control steps and sums their rewards, as for ``dmc:``.
- **Observations** are Playground's flat vectors (the same quantities as dm_control's, in the
  task's own order); **rewards** are Playground's reimplementation of dm_control's, in [0, 1] per
  control step.  MJX physics is not bit-identical to MuJoCo's C engine, so returns are close to,
  not equal to, ``dmc:``'s.
- **Episode ends.**  ``terminated`` is Playground's ``done`` (a non-finite state for the Control
  Suite tasks); ``truncated`` is the episode limit (``episode_length`` control steps), kept apart,
  and the true final observation of every ended episode is returned for bootstrapping (Brax's
  ``AutoResetWrapper`` drops it: mujoco_playground issue #305).  Ended envs reset in the same step
  with a fresh key, so episodes start from different states.
- **Divergence.**  A step whose observation or reward is not finite (MJX physics that blew up) is
  ``diverged``: the env resets as after a termination (``terminated`` is set, so nothing bootstraps
  from it), its reward reads 0 and its ``next_obs`` the last finite observation, and it is not a
  finished episode (no return or length is reported).  The device loop counts such steps
  (``env/diverged``) and keeps them out of the replay (``training/loops/device.py``).
- **Actions** reach the physics as ``envs/actions.py`` maps them (``rescale`` from [-1, 1] or
  ``clip`` to the actuators' control range, which is [-1, 1] for every offered task).

``--env-impl`` picks Playground's physics backend: ``jax`` (MJX in JAX; the default, and the only
one that runs on CPU) or ``warp`` (MuJoCo Warp, GPU only).

The device API (``Playground``): ``reset(keys) -> EnvState`` and ``step(state, actions) ->
(state, Step)`` over a batch of envs, pure and jittable.  ``PlaygroundVectorEnv`` wraps it in the
host ``VectorEnv`` interface (one jitted call per vector step) so that every agent, the host loops
and the evaluator run on ``playground:`` ids unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.envs.actions import agent_action_space, check_action_mode

PREFIX = "playground:"
EXTRA = "pip install -e '.[mjx]'"
IMPLS = ("jax", "warp")


def is_playground(env_id) -> bool:
    return isinstance(env_id, str) and env_id.startswith(PREFIX)


def _registry():
    try:
        from mujoco_playground import registry
    except ImportError as e:
        raise ValueError(
            f"playground: env ids need MuJoCo Playground, an optional extra: {EXTRA} (import failed: {e})"
        ) from None
    return registry


def task_names() -> tuple[str, ...]:
    """The Control Suite ports that ship inside the ``playground`` wheel."""
    return tuple(_registry().dm_control_suite.ALL_ENVS)


@functools.lru_cache(maxsize=32)
def _load(name: str, impl: str):
    registry = _registry()
    if impl not in IMPLS:
        raise ValueError(f"unknown --env-impl {impl!r}; choose one of {', '.join(IMPLS)}")
    names = tuple(registry.dm_control_suite.ALL_ENVS)
    if name not in names:
        raise ValueError(
            f"unknown Playground task {PREFIX}{name}; the zoo offers the Control Suite ports: "
            + ", ".join(PREFIX + n for n in names)
        )
    if impl == "warp" and jax.default_backend() == "cpu":
        raise ValueError("--env-impl warp (MuJoCo Warp) needs a GPU; on CPU use --env-impl jax")
    try:
        config = registry.get_default_config(name)
        env = registry.load(name, config_overrides={"impl": impl})
    except Exception as e:  # e.g. a task whose model builder does not match the installed MuJoCo
        raise ValueError(f"Playground task {PREFIX}{name} failed to load ({type(e).__name__}: {e})") from None
    return env, int(config.episode_length)


class EnvState(NamedTuple):
    """A batch of envs: Playground's state plus the episode clock, reset keys and episode return."""

    inner: object  # mujoco_playground State, batched (N,)
    t: jax.Array  # (N,) agent steps into the current episode
    key: jax.Array  # (N,) key of each env's next reset
    ep_return: jax.Array  # (N,) return of the current episode so far


class Step(NamedTuple):
    obs: jax.Array  # (N, obs_dim) the observation to act on (a reset one where an episode ended)
    reward: jax.Array  # (N,)
    terminated: jax.Array  # (N,) bool
    truncated: jax.Array  # (N,) bool (episode limit, not terminated)
    next_obs: jax.Array  # (N, obs_dim) the true next observation (the final one where an episode ended)
    ep_return: jax.Array  # (N,) the finished episode's return where it finished (see ``finished``), else 0
    ep_length: jax.Array  # (N,) the finished episode's length where it finished, else 0
    diverged: jax.Array  # (N,) bool: the step's observation or reward was not finite (the env reset)

    @property
    def finished(self) -> jax.Array:
        """(N,) bool: an episode finished (terminated or truncated, not diverged)."""
        return (self.terminated | self.truncated) & ~self.diverged


@dataclass(frozen=True)
class Playground:
    """One Playground task as pure batched functions (hashable: usable as a jit static / closure)."""

    name: str
    impl: str = "jax"
    action_repeat: int = 1
    action_mode: str = "rescale"

    def __post_init__(self):
        check_action_mode(self.action_mode)
        if self.action_repeat < 1:
            raise ValueError(f"action repeat must be >= 1, got {self.action_repeat}")
        _load(self.name, self.impl)  # an unknown or broken task fails here

    @property
    def env(self):
        return _load(self.name, self.impl)[0]

    @property
    def episode_length(self) -> int:
        """Agent steps per episode: Playground's limit in control steps over the action repeat."""
        return -(-_load(self.name, self.impl)[1] // self.action_repeat)

    @property
    def obs_dim(self) -> int:
        return int(np.prod(self.env.observation_size))

    @property
    def act_dim(self) -> int:
        return int(self.env.action_size)

    def bounds(self):
        r = np.asarray(self.env.mj_model.actuator_ctrlrange, np.float32)
        return r[:, 0], r[:, 1]

    def to_env_action(self, action):
        """``envs.actions.to_env_action`` in JAX (float32)."""
        low, high = self.bounds()
        if self.action_mode == "clip":
            return jnp.clip(action, low, high)
        a = jnp.clip(action, -1.0, 1.0)
        return low + (a + 1.0) * 0.5 * (high - low)

    def reset(self, keys) -> EnvState:
        """Fresh episodes for a batch of envs from their keys (N,)."""
        keys = jax.vmap(jax.random.split)(keys)
        inner = _strong(jax.vmap(self.env.reset)(keys[:, 0]))
        n = keys.shape[0]
        return EnvState(inner, jnp.zeros(n, jnp.int32), keys[:, 1], jnp.zeros(n, jnp.float32))

    def _physics(self, inner, action):
        """``action_repeat`` control steps; reward summed, frozen after ``done``."""
        env = self.env
        a = self.to_env_action(action)
        step = jax.vmap(env.step)
        if self.action_repeat == 1:
            inner = step(inner, a)
            return inner, inner.reward

        def repeat(carry, _):
            s, total = carry
            nxt = step(s, a)
            alive = s.done <= 0
            s = jax.tree.map(lambda x, y: jnp.where(_bcast(alive, x), y, x), s, nxt)
            return (s, total + jnp.where(alive, nxt.reward, 0.0)), None

        inner = inner.replace(done=jnp.zeros_like(inner.done))
        (inner, total), _ = jax.lax.scan(repeat, (inner, jnp.zeros_like(inner.reward)), None, self.action_repeat)
        return inner, total

    def step(self, state: EnvState, action) -> tuple[EnvState, Step]:
        """One agent step of every env, with same-step autoreset of those whose episode ended.

        Resets are computed only when some env of the batch ended (``lax.cond`` on the batch), so
        aligned episodes (Control Suite tasks never terminate) pay for a reset once per episode."""
        inner, reward = self._physics(state.inner, action)
        reward = reward.astype(jnp.float32)
        n = reward.shape[0]
        diverged = ~(jnp.all(jnp.isfinite(inner.obs.reshape(n, -1)), axis=1) & jnp.isfinite(reward))
        reward = jnp.where(diverged, 0.0, reward)
        t = state.t + 1
        terminated = (inner.done > 0) | diverged
        truncated = (t >= self.episode_length) & ~terminated
        ended = terminated | truncated
        ep_return = state.ep_return + reward
        next_obs = jnp.where(_bcast(diverged, inner.obs), state.inner.obs, inner.obs)  # the last finite one
        finished = ended & ~diverged

        def with_resets(args):
            inner, key = args
            keys = jax.vmap(jax.random.split)(key)
            fresh = jax.vmap(self.env.reset)(keys[:, 0])
            fresh = fresh.replace(reward=jnp.zeros_like(inner.reward))
            merged = jax.tree.map(lambda x, y: jnp.where(_bcast(ended, x), y, x), inner, fresh)
            return merged, jnp.where(ended, keys[:, 1], key)

        inner, key = jax.lax.cond(jnp.any(ended), with_resets, lambda args: args, (inner, state.key))
        out = Step(
            inner.obs,
            reward,
            terminated,
            truncated,
            next_obs,
            jnp.where(finished, ep_return, 0.0),
            jnp.where(finished, t, 0),
            diverged,
        )
        new = EnvState(inner, jnp.where(ended, 0, t), key, jnp.where(ended, 0.0, ep_return))
        return new, out


def _strong(tree):
    """Every leaf strongly typed.  Playground's reset returns weakly typed constants (e.g. the reward
    0.0) where its step returns float32 arrays; jit keys its cache on weak types, so a program
    compiled on a reset state would compile again on the first stepped one."""

    def one(x):
        x = jnp.asarray(x)
        return x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else jax.lax.convert_element_type(x, x.dtype)

    return jax.tree.map(one, tree)


def _bcast(mask, x):
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def parse(env_id: str) -> str:
    name = env_id[len(PREFIX) :]
    if not name:
        raise ValueError(f"malformed Playground id {env_id!r}: write playground:<Name>, e.g. playground:CheetahRun")
    return name


def make(env_id: str, action_repeat: int | None = None, action_mode: str = "rescale", impl: str = "jax") -> Playground:
    """The device env of a ``playground:`` id (default action repeat 1)."""
    return Playground(parse(env_id), impl, 1 if action_repeat is None else action_repeat, action_mode)


def env_keys(seeds) -> jax.Array:
    """One key per env from integer env seeds (the host vector env's ``reset(seeds)``)."""
    return jax.vmap(jax.random.key)(jnp.asarray(np.asarray(seeds, np.uint32)))


# ----------------------------------------------------------------------------------------------
# Host interface
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def jitted(pg: Playground):
    """(reset, step) of ``pg`` jitted, one pair per env (so every run in a process shares the programs)."""
    return jax.jit(pg.reset), jax.jit(pg.step)


def _to_host(tree):
    """Device arrays -> numpy (typed keys as their raw data, tagged), for pickling."""

    def one(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return ("key", np.asarray(jax.random.key_data(x)))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _from_host(tree):
    def one(x):
        if isinstance(x, tuple) and len(x) == 2 and x[0] == "key":
            return jax.random.wrap_key_data(jnp.asarray(x[1]))
        return jnp.asarray(x)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and x[0] == "key")


class PlaygroundVectorEnv:
    """``envs.vector.VectorEnv``'s interface over a batch of Playground envs on the device.

    Env ``i`` resets from ``jax.random.key(seed + i)`` (or the seeds given to ``reset``); every
    ``step`` is one jitted call.  Pickles exactly (the device state is copied to the host)."""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        seed: int,
        action_repeat: int | None = None,
        action_mode: str = "rescale",
        impl: str = "jax",
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.env_id, self.num_envs, self.seed = env_id, num_envs, seed
        self.pg = make(env_id, action_repeat, action_mode, impl)
        self.obs_dim, self.act_dim = self.pg.obs_dim, self.pg.act_dim
        self.finished: list[tuple[int, float, int]] = []
        self.diverged = 0  # steps whose state was not finite (each reset its env)
        self.valid: np.ndarray | None = None  # after a step with a diverged env: which envs' transitions are valid
        self.state = None

    def reset(self, seeds=None) -> np.ndarray:
        seeds = [self.seed + i for i in range(self.num_envs)] if seeds is None else list(seeds)
        self.state = jitted(self.pg)[0](env_keys(seeds))
        return np.asarray(self.state.inner.obs, np.float32)

    def step(self, actions):
        actions = jnp.asarray(np.asarray(actions, np.float32).reshape(self.num_envs, self.act_dim))
        self.state, out = jitted(self.pg)[1](self.state, actions)
        out = jax.device_get(out)
        self.diverged += int(np.sum(out.diverged))
        self.valid = ~np.asarray(out.diverged) if out.diverged.any() else None  # the rows a replay keeps
        for i in np.nonzero(out.finished)[0]:
            self.finished.append((int(i), float(out.ep_return[i]), int(out.ep_length[i])))
        return (
            np.asarray(out.obs, np.float32),
            np.asarray(out.reward, np.float32),
            np.asarray(out.terminated),
            np.asarray(out.truncated),
            np.asarray(out.next_obs, np.float32),
        )

    def pop_finished(self):
        done, self.finished = self.finished, []
        return done

    def sample_actions(self, rng: np.random.Generator) -> np.ndarray:
        return rng.uniform(-1.0, 1.0, (self.num_envs, self.act_dim)).astype(np.float32)

    def close(self):
        pass

    def __getstate__(self):
        d = dict(self.__dict__)
        d["pg"] = (self.pg.name, self.pg.impl, self.pg.action_repeat, self.pg.action_mode)
        d["state"] = None if self.state is None else _to_host(self.state)
        return d

    def __setstate__(self, d):
        d = dict(d)
        d["pg"] = Playground(*d["pg"])
        d.setdefault("diverged", 0)  # pickled before the count existed
        d.setdefault("valid", None)
        d["state"] = None if d["state"] is None else _from_host(d["state"])
        self.__dict__.update(d)


class PlaygroundGymEnv(gym.Env):
    """One Playground env as a Gymnasium env (for code that builds single envs: checks, tools).

    Ended episodes report ``terminated`` / ``truncated`` and the final observation; the next
    ``step`` would continue from the reset state, as a Gymnasium env after ``reset()``."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        env_id: str,
        seed: int = 0,
        action_repeat: int | None = None,
        action_mode: str = "rescale",
        impl: str = "jax",
    ):
        self.vec = PlaygroundVectorEnv(env_id, 1, seed, action_repeat, action_mode, impl)
        low, high = self.vec.pg.bounds()
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (self.vec.obs_dim,), np.float32)
        self.action_space = agent_action_space(low, high, action_mode)
        self._seed = seed

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.vec.reset([self._seed if seed is None else seed])[0], {}

    def step(self, action):
        _, r, term, trunc, next_obs = self.vec.step(np.asarray(action)[None])
        self.vec.pop_finished()
        return next_obs[0], float(r[0]), bool(term[0]), bool(trunc[0]), {}
