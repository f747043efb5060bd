"""Non-stationary environments: task chains, dynamics shifts, observation permutations, reward flips.

Implements the non-stationary settings GTR is tested on (Liu et al., arXiv 2606.03382), after
C-CHAIN's task chains (Tang et al., ICML 2025) and Slippery Ant's friction shifts (Dohare et al.,
Nature 2024), for every agent, from the command line
(``--env ns:...``) or from Python (``make_env("ns:...")``).

Id grammar
----------
::

    ns:<mode>:<base>[:<key>=<value>[,<key>=<value>...]]

``mode``
    ``chain`` (alias ``task_chain``), ``dynamics``, ``obs_permute`` or ``reward_flip``.
``base``
    an env id of the zoo's scheme (a Gymnasium id or ``dmc:<domain>-<task>``); for ``chain`` two
    or more ids separated by commas, all with identical observation and action shapes.
options
    the last ``:``-separated field when it contains ``=`` (env ids never contain ``=``, so a
    ``dmc:`` id inside the base is never mistaken for options).  Common keys:

    ============  ==========================================================================
    ``every``     env steps between switches (default 1000000, C-CHAIN's steps per task)
    ``switch``    ``lazy`` (default): a switch takes effect at each env's next episode reset;
                  ``hard``: the running episode is cut (``truncated=True``, never
                  ``terminated``) at the step the switch falls on, and the reset applies it
    ``seed``      schedule seed (default 0).  The schedule is a function of (seed, step) only;
                  the env's own seed seeds its episodes, so every member of a vector env and
                  every method sees the same sequence of tasks
    ============  ==========================================================================

    Mode keys: ``chain``: ``eval=current|all`` (default ``current``: evaluations run the task being
    trained; ``all``: every evaluation runs each distinct task of the chain, and ``eval.csv`` gets a
    row per task and their mean, as for ``mt:`` ids, so forgetting and recovery are scored);
    ``dynamics``: ``params=friction+gravity+mass`` (any ``+``-joined subset; default
    all three); ``obs_permute``: ``signs=0|1`` (also flip signs; default 0); ``reward_flip``:
    ``term=forward|all`` (default ``forward``).

Named scenarios
---------------
For ``chain`` the base may be one of Plasticine's continual DM Control sequences (Yuan et al. 2025,
arXiv 2504.17490; the task lists of the authors' ``ContinualDMC`` wrapper): ``plasticine-walker``
(walker stand -> walk -> run), ``plasticine-quadruped`` (quadruped walk -> run -> walk) and
``plasticine-dog`` (dog stand -> walk -> run -> trot).  They default to Plasticine's protocol: 1M
steps per task, ``switch=hard`` (the authors rebuild and reset the env at each switch, so the
running episode ends there) and ``eval=all``; any option given overrides its default, e.g.
``ns:chain:plasticine-walker:every=100000``.

Examples::

    ns:chain:plasticine-walker
    ns:reward_flip:HalfCheetah-v5:every=100000
    ns:chain:dmc:walker-stand,dmc:walker-walk,dmc:walker-run:every=1000000
    ns:dynamics:Ant-v5:every=2000000,params=friction           # Slippery-Ant-like
    ns:obs_permute:Hopper-v5:every=50000,signs=1,switch=hard

Schedule
--------
The phase is ``k = count // every`` where ``count`` is the step counter below.  Phase ``k`` means:

- ``chain``: task ``k mod len(ids)`` (the chain repeats after its last task: our reading, the sources do not fix it);
- ``dynamics``: phase 0 is the nominal model; phase ``k >= 1`` scales, from a generator seeded by
  ``(seed, k)``, friction ``geom_friction[:, 0]`` by one factor ``10**U(-1, 0.5)``, gravity
  ``opt.gravity[2]`` by ``U(0.5, 1.5)`` and each body's mass by its own ``U(0.5, 2)`` (the body's
  inertia is scaled with it; per-body draws are our reading of scaling ``body_mass[:]``);
- ``obs_permute``: phase 0 is the identity; phase ``k >= 1`` a permutation (and optionally signs)
  drawn from ``(seed, k)``; the env returns ``signs * obs[perm]``.  The permutation is applied at the
  env, i.e. *before* any agent-side normaliser: the on-policy loop resets its normaliser statistics
  at each switch (``--ns-reset-norm``, default on), which keeps them valid; our design called
  for the permutation *after* the normaliser, which an env-level wrapper cannot do;
- ``reward_flip``: odd phases flip the sign of the forward-velocity term, i.e. the reward becomes
  ``r - 2 * info["reward_forward"]`` (Gymnasium MuJoCo locomotion envs report that term, summed
  over action repeats here); ``term=all`` flips the whole reward instead (needed for ``dmc:``).

``info["task_id"]`` (the active task: chain index, 0/1 for reward_flip, the phase for the other
modes) and ``info["ns_phase"]`` are set on every reset and step.

The global step counter
-----------------------
Every ``NonStationaryEnv`` reads a ``StepCounter``.  ``count`` is the number of env steps taken so
far *including the one in progress* (0 at the first reset), so with ``every=N`` steps ``1..N`` are
phase 0 and a hard switch truncates step ``N``.

- A standalone env (``make_env``, or the members of a plain ``VectorEnv`` such as the off-policy
  loop builds) owns a private counter that each of its own steps advances by 1.  The members of a
  vector env step in lock-step, so their counters agree and they switch together; the unit is that
  env's own steps (equal to the loop's per-seed steps when ``--num-envs 1``).
- ``make_vector_env(..., backend="sync")`` returns a ``CountingVectorEnv``: one counter object is
  bound to all members, and *the vector env* advances it by ``steps_per_call`` at every
  ``step()`` before stepping the members.  The on-policy loop sets ``steps_per_call = num_envs``
  so the counter counts per-seed env steps, the unit of ``--total-steps``.  The counter pickles
  with the vector env (one shared object, restored shared), so a resumed run keeps its schedule.
- ``follow(vector_env, counter)`` binds an evaluation env to read (never advance) the training
  counter, so evaluations see the current task.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from plasticity_zoo.envs.wrappers import DMC_ACTION_REPEAT, ActionRepeat
from plasticity_zoo.envs.wrappers import make_base_env as make_env

MODES = {
    "chain": "chain",
    "task_chain": "chain",
    "dynamics": "dynamics",
    "obs_permute": "obs_permute",
    "reward_flip": "reward_flip",
}
GRAMMAR = (
    "non-stationary ids read 'ns:<mode>:<base>[:key=value,...]' with mode one of chain, dynamics, "
    "obs_permute, reward_flip, e.g. 'ns:reward_flip:HalfCheetah-v5:every=100000' or "
    "'ns:chain:dmc:walker-stand,dmc:walker-walk:every=1000000'"
)
COMMON_KEYS = {"every", "switch", "seed"}
MODE_KEYS = {"chain": {"eval"}, "dynamics": {"params"}, "obs_permute": {"signs"}, "reward_flip": {"term"}}
DYNAMICS_PARAMS = ("friction", "gravity", "mass")
# Plasticine's continual DM Control sequences (plasticine_envs/dmc_wrappers.py: ContinualDMC) and the
# options of its protocol (1M steps per task, the env rebuilt at each switch)
SCENARIOS = {
    "plasticine-walker": ("dmc:walker-stand", "dmc:walker-walk", "dmc:walker-run"),
    "plasticine-quadruped": ("dmc:quadruped-walk", "dmc:quadruped-run", "dmc:quadruped-walk"),
    "plasticine-dog": ("dmc:dog-stand", "dmc:dog-walk", "dmc:dog-run", "dmc:dog-trot"),
}
SCENARIO_OPTIONS = {"every": "1000000", "switch": "hard", "eval": "all"}


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NSSpec:
    mode: str
    bases: tuple
    every: int = 1_000_000
    switch: str = "lazy"
    seed: int = 0
    params: tuple = DYNAMICS_PARAMS
    signs: bool = False
    term: str = "forward"
    eval: str = "current"
    options: dict = field(default_factory=dict, compare=False)


def _int(key, value, env_id, minimum):
    try:
        v = int(float(value)) if "e" in value.lower() else int(value)
    except ValueError:
        raise ValueError(f"{env_id!r}: option {key}={value!r} must be an integer") from None
    if v < minimum:
        raise ValueError(f"{env_id!r}: option {key} must be >= {minimum}, got {v}")
    return v


def parse(env_id: str) -> NSSpec:
    """``ns:<mode>:<base>[:k=v,...]`` -> NSSpec, with an error naming what is wrong."""
    if not env_id.startswith("ns:"):
        raise ValueError(f"{env_id!r} is not a non-stationary id; {GRAMMAR}")
    rest = env_id[3:]
    if ":" not in rest:
        raise ValueError(f"malformed non-stationary id {env_id!r}: missing the base env; {GRAMMAR}")
    mode_name, rest = rest.split(":", 1)
    if mode_name not in MODES:
        raise ValueError(
            f"unknown non-stationary mode {mode_name!r} in {env_id!r}; modes: {', '.join(sorted(MODES))}; {GRAMMAR}"
        )
    mode = MODES[mode_name]
    options = {}
    head, _, tail = rest.rpartition(":")
    if head and "=" in tail:
        rest = head
        for item in tail.split(","):
            if "=" not in item or not item.split("=", 1)[0]:
                raise ValueError(
                    f"malformed option {item!r} in {env_id!r}: options are key=value pairs "
                    f"separated by commas; {GRAMMAR}"
                )
            k, v = item.split("=", 1)
            if k in options:
                raise ValueError(f"option {k!r} given twice in {env_id!r}")
            options[k] = v
    elif head and tail.split(",")[0] in COMMON_KEYS | MODE_KEYS[mode]:
        raise ValueError(f"malformed option {tail!r} in {env_id!r}: options are key=value pairs; {GRAMMAR}")
    elif "=" in rest:
        raise ValueError(
            f"malformed non-stationary id {env_id!r}: options must come last, after the base env and a ':'; {GRAMMAR}"
        )
    allowed = COMMON_KEYS | MODE_KEYS[mode]
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for mode {mode!r} in {env_id!r}; "
            f"valid options: {', '.join(sorted(allowed))}"
        )
    if mode == "chain" and rest in SCENARIOS:
        bases = SCENARIOS[rest]
        options = {**SCENARIO_OPTIONS, **options}
    elif mode == "chain" and rest.startswith("plasticine-"):
        raise ValueError(f"{env_id!r}: unknown scenario {rest!r}; scenarios: {', '.join(SCENARIOS)}")
    else:
        bases = tuple(b.strip() for b in rest.split(",")) if mode == "chain" else (rest,)
    if not all(bases):
        raise ValueError(f"empty env id in {env_id!r}; {GRAMMAR}")
    if any(b.startswith("ns:") for b in bases):
        raise ValueError(f"{env_id!r}: non-stationary ids cannot be nested")
    if mode == "chain" and len(bases) < 2:
        raise ValueError(f"{env_id!r}: a chain needs at least two env ids separated by commas")
    if mode != "chain" and "," in rest:
        raise ValueError(f"{env_id!r}: only mode 'chain' takes several env ids")
    kw = {}
    if "every" in options:
        kw["every"] = _int("every", options["every"], env_id, 1)
    if "seed" in options:
        kw["seed"] = _int("seed", options["seed"], env_id, 0)
    if "switch" in options:
        if options["switch"] not in ("lazy", "hard"):
            raise ValueError(f"{env_id!r}: switch must be lazy or hard, got {options['switch']!r}")
        kw["switch"] = options["switch"]
    if "params" in options:
        params = tuple(p for p in options["params"].split("+") if p)
        bad = [p for p in params if p not in DYNAMICS_PARAMS]
        if bad or not params:
            raise ValueError(
                f"{env_id!r}: params must be a '+'-joined subset of {'+'.join(DYNAMICS_PARAMS)}, "
                f"got {options['params']!r}"
            )
        kw["params"] = params
    if "signs" in options:
        if options["signs"] not in ("0", "1"):
            raise ValueError(f"{env_id!r}: signs must be 0 or 1, got {options['signs']!r}")
        kw["signs"] = options["signs"] == "1"
    if "term" in options:
        if options["term"] not in ("forward", "all"):
            raise ValueError(f"{env_id!r}: term must be forward or all, got {options['term']!r}")
        kw["term"] = options["term"]
    if "eval" in options:
        if options["eval"] not in ("current", "all"):
            raise ValueError(f"{env_id!r}: eval must be current or all, got {options['eval']!r}")
        kw["eval"] = options["eval"]
    return NSSpec(mode, bases, options=options, **kw)


# ----------------------------------------------------------------------------------------------
# Step counters
# ----------------------------------------------------------------------------------------------
class StepCounter:
    """Env steps so far (including the one in progress).  ``auto``: each bound env's step adds 1."""

    def __init__(self, value: int = 0, auto: bool = True):
        self.value, self.auto = int(value), auto

    def __repr__(self):
        return f"StepCounter(value={self.value}, auto={self.auto})"


class PinnedCounter(StepCounter):
    """A counter that stays at one value: an evaluation env pinned to one task of a chain."""

    def __init__(self, value: int):
        super().__init__(value, auto=False)


class FollowCounter:
    """A read-only view of another counter (evaluation envs follow the training schedule)."""

    auto = False

    def __init__(self, source):
        self.source = source

    @property
    def value(self):
        return self.source.value


# ----------------------------------------------------------------------------------------------
# Schedules: deterministic functions of (schedule seed, phase)
# ----------------------------------------------------------------------------------------------
_SALT = {"dynamics": 1, "obs_permute": 2}


def _rng(spec: NSSpec, phase: int):
    return np.random.default_rng([spec.seed, _SALT[spec.mode], phase])


def dynamics_factors(spec: NSSpec, phase: int, n_bodies: int) -> dict:
    """Multiplicative factors of phase ``phase`` (phase 0: all ones)."""
    out = {"friction": 1.0, "gravity": 1.0, "mass": np.ones(n_bodies)}
    if phase == 0:
        return out
    rng = _rng(spec, phase)
    friction = 10.0 ** rng.uniform(-1.0, 0.5)
    gravity = rng.uniform(0.5, 1.5)
    mass = rng.uniform(0.5, 2.0, n_bodies)
    if "friction" in spec.params:
        out["friction"] = float(friction)
    if "gravity" in spec.params:
        out["gravity"] = float(gravity)
    if "mass" in spec.params:
        out["mass"] = mass
    return out


def permutation(spec: NSSpec, phase: int, dim: int):
    """(perm, signs) of phase ``phase``: the env returns ``signs * obs[perm]`` (phase 0: identity)."""
    if phase == 0:
        return np.arange(dim), np.ones(dim, np.float32)
    rng = _rng(spec, phase)
    perm = rng.permutation(dim)
    signs = rng.choice(np.array([-1.0, 1.0], np.float32), dim) if spec.signs else np.ones(dim, np.float32)
    return perm, signs.astype(np.float32)


def _mj_model(env):
    """(MjModel, MjData) of a Gymnasium MuJoCo env or a dm_control env, else None."""
    u = env.unwrapped
    if hasattr(u, "model") and hasattr(u, "data") and hasattr(u.model, "geom_friction"):
        return u.model, u.data
    physics = getattr(getattr(u, "_env", None), "physics", None)
    if physics is not None:
        return physics.model.ptr, physics.data.ptr
    return None


class _RewardFlip(gym.Wrapper):
    """Inside the action repeat: flips the forward term (or the whole reward) while ``sign`` is -1."""

    def __init__(self, env, term: str, env_id: str):
        super().__init__(env)
        self.sign, self.term, self.env_id = 1.0, term, env_id

    def step(self, action):
        obs, r, terminated, truncated, info = self.env.step(action)
        if self.term == "forward":
            if "reward_forward" not in info:
                raise ValueError(
                    f"reward_flip with term=forward needs an env that reports info['reward_forward'] "
                    f"(Gymnasium MuJoCo locomotion v5: HalfCheetah, Hopper, Walker2d, Ant, Humanoid, "
                    f"Swimmer); {self.env_id!r} does not: use term=all to flip the whole reward"
                )
            if self.sign < 0:
                r = r - 2.0 * float(info["reward_forward"])
        elif self.sign < 0:
            r = -r
        return obs, r, terminated, truncated, info


# ----------------------------------------------------------------------------------------------
# The env
# ----------------------------------------------------------------------------------------------
class NonStationaryEnv(gym.Env):
    """One env whose task follows ``spec``'s schedule of the bound step counter (see module doc)."""

    metadata = {"render_modes": []}

    def __init__(self, env_id: str, seed: int = 0, action_repeat: int | None = None, action_mode: str = "rescale"):
        self.env_id, self.spec_ns = env_id, parse(env_id)
        spec = self.spec_ns
        if spec.mode == "reward_flip":
            base = spec.bases[0]
            repeat = (DMC_ACTION_REPEAT if base.startswith("dmc:") else 1) if action_repeat is None else action_repeat
            inner = _RewardFlip(make_env(base, seed, 1, action_mode=action_mode), spec.term, base)
            self._flip = inner
            self.tasks = [ActionRepeat(inner, repeat) if repeat > 1 else inner]
        else:
            self.tasks = [make_env(b, seed, action_repeat, action_mode=action_mode) for b in spec.bases]
        ref = self.tasks[0]
        for b, t in zip(spec.bases, self.tasks):
            if (
                t.observation_space.shape != ref.observation_space.shape
                or t.action_space.shape != ref.action_space.shape
            ):
                raise ValueError(
                    f"{env_id!r}: a chain needs identical spaces, but {spec.bases[0]!r} has observations "
                    f"{ref.observation_space.shape} and actions {ref.action_space.shape} while {b!r} has "
                    f"{t.observation_space.shape} and {t.action_space.shape}"
                )
        self.observation_space = ref.observation_space
        self.action_space = ref.action_space
        self.counter = StepCounter()
        self.active, self.phase = 0, 0
        self._perm, self._signs = None, None
        self._nominal = None
        if spec.mode == "dynamics":
            mj = _mj_model(ref)
            if mj is None:
                raise ValueError(
                    f"{env_id!r}: mode dynamics needs a MuJoCo env (Gymnasium MuJoCo or dmc:), "
                    f"{spec.bases[0]!r} is not one"
                )
            model = mj[0]
            self._nominal = {
                "friction": np.array(model.geom_friction[:, 0]),
                "gravity": float(model.opt.gravity[2]),
                "mass": np.array(model.body_mass),
                "inertia": np.array(model.body_inertia),
            }
        self._apply(0)

    # -- schedule ---------------------------------------------------------------------------
    def phase_at(self, count: int) -> int:
        return int(count) // self.spec_ns.every

    @property
    def task_id(self) -> int:
        mode = self.spec_ns.mode
        if mode == "chain":
            return self.active
        if mode == "reward_flip":
            return self.phase % 2
        return self.phase

    def bind_counter(self, counter):
        self.counter = counter

    @property
    def unwrapped(self):
        return self.tasks[self.active].unwrapped

    def _apply(self, phase: int):
        spec, self.phase = self.spec_ns, phase
        if spec.mode == "chain":
            self.active = phase % len(self.tasks)
        elif spec.mode == "reward_flip":
            self._flip.sign = -1.0 if phase % 2 else 1.0
        elif spec.mode == "obs_permute":
            self._perm, self._signs = permutation(spec, phase, self.observation_space.shape[0])
        else:
            model, data = _mj_model(self.tasks[0])
            nom = self._nominal
            f = dynamics_factors(spec, phase, len(nom["mass"]))
            model.geom_friction[:, 0] = nom["friction"] * f["friction"]
            model.opt.gravity[2] = nom["gravity"] * f["gravity"]
            model.body_mass[:] = nom["mass"] * f["mass"]
            model.body_inertia[:] = nom["inertia"] * f["mass"][:, None]
            import mujoco

            mujoco.mj_setConst(model, data)

    def _obs(self, obs):
        if self.spec_ns.mode == "obs_permute":
            return (self._signs * obs[self._perm]).astype(np.float32)
        return obs

    def _info(self, info):
        info = dict(info)
        info["task_id"], info["ns_phase"] = self.task_id, self.phase
        return info

    # -- gym API ------------------------------------------------------------------------------
    def reset(self, *, seed=None, options=None):
        phase = self.phase_at(self.counter.value)
        if phase != self.phase:
            self._apply(phase)
        if seed is not None:
            for i, t in enumerate(self.tasks):  # seed every task's episodes, so later switches are reproducible
                if i != self.active:
                    t.reset(seed=seed)
        obs, info = self.tasks[self.active].reset(seed=seed, options=options)
        return self._obs(obs), self._info(info)

    def step(self, action):
        if self.counter.auto:
            self.counter.value += 1
        obs, r, terminated, truncated, info = self.tasks[self.active].step(action)
        if self.spec_ns.switch == "hard" and not terminated and self.phase_at(self.counter.value) != self.phase:
            truncated = True
        return self._obs(obs), r, terminated, truncated, self._info(info)

    def inverse_obs(self, obs):
        """The base env's observation from this env's (obs_permute; identity otherwise)."""
        if self.spec_ns.mode != "obs_permute":
            return obs
        out = np.empty_like(obs)
        out[..., self._perm] = obs / self._signs
        return out

    def render(self):
        return self.tasks[self.active].render()

    def close(self):
        for t in self.tasks:
            t.close()

    # -- pickling: every task's physics state and generator; the model changes re-applied ----------
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_task_states"] = [_physics_state(t) for t in self.tasks]
        return state

    def __setstate__(self, state):
        saved = state.pop("_task_states")
        self.__dict__.update(state)
        if self.spec_ns.mode == "dynamics":
            self._apply(self.phase)  # Gymnasium MuJoCo envs unpickle by re-construction: nominal model
        for t, s in zip(self.tasks, saved):
            if s is not None:
                import mujoco

                model, data = _mj_model(t)
                mujoco.mj_setState(model, data, s[0], mujoco.mjtState.mjSTATE_INTEGRATION)
                mujoco.mj_forward(model, data)
                if s[1] is not None:
                    t.unwrapped.np_random.bit_generator.state = s[1]


def _physics_state(env):
    """(MuJoCo integration state, Gymnasium generator state or None) of a MuJoCo env, else None."""
    mj = _mj_model(env)
    if mj is None:
        return None
    import mujoco

    model, data = mj
    spec = mujoco.mjtState.mjSTATE_INTEGRATION
    out = np.empty(mujoco.mj_stateSize(model, spec))
    mujoco.mj_getState(model, data, out, spec)
    u = env.unwrapped
    rng = u.np_random.bit_generator.state if hasattr(u, "model") else None  # dm_control pickles its own
    return out, rng


def make(
    env_id: str, seed: int = 0, action_repeat: int | None = None, action_mode: str = "rescale"
) -> NonStationaryEnv:
    """The ``make_env`` entry for ``ns:`` ids (a private, self-advancing step counter)."""
    return NonStationaryEnv(env_id, seed, action_repeat, action_mode)


def follow(vector_env, counter) -> None:
    """Make the non-stationary members of ``vector_env`` read (never advance) ``counter``; members
    pinned to a task (``pin_tasks``) stay pinned."""
    for e in getattr(vector_env, "envs", []):
        if isinstance(e, NonStationaryEnv) and not isinstance(e.counter, PinnedCounter):
            e.bind_counter(FollowCounter(counter))


def eval_tasks(env_id: str) -> tuple[str, ...] | None:
    """The distinct tasks every evaluation runs, in chain order, for a ``chain`` id with ``eval=all``;
    None otherwise (evaluations run the task being trained)."""
    if not is_nonstationary(env_id):
        return None
    spec = parse(env_id)
    if spec.mode != "chain" or spec.eval != "all":
        return None
    return tuple(dict.fromkeys(spec.bases))


def pin_tasks(vector_env, tasks) -> None:
    """Pin member ``i`` of ``vector_env`` (a chain's vector env) to task ``tasks[i % len(tasks)]``: its
    counter stays at the first step of that task's first phase, so every episode runs that task."""
    for i, e in enumerate(vector_env.envs):
        spec = e.spec_ns
        e.bind_counter(PinnedCounter(spec.bases.index(tasks[i % len(tasks)]) * spec.every))


def is_nonstationary(env_id: str) -> bool:
    return isinstance(env_id, str) and env_id.startswith("ns:")
