"""A Playground task with two-line physics, for the device loop's mechanics tests.

MuJoCo's physics compiles for seconds into every program that steps it on CPU (a device chunk took
7-14 s, a reset 2.4 s), and those compiles were most of ``tests/test_device_loop.py``.  What those
tests check (chunking, resume, the store, the host loop and the device loop agreeing, the replay's
memory) does not depend on the physics, so they run ``playground:ToyPointMass``: the zoo's own
``envs.playground.Playground`` wrapper (action mapping, episode clock, truncation, same-step
autoreset, the host vector env) is the real one, only the MJX env inside it is this toy.  Real
Playground physics stays in the wrapper's own tests and in the learning tests.

``use_toy(monkeypatch)`` makes ``envs.playground`` load the toy for that name (in this process).
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

NAME = "ToyPointMass"
ENV = "playground:" + NAME
EPISODE_LENGTH = 100


@struct.dataclass
class ToyState:
    """The fields of a ``mujoco_playground`` State the wrapper reads (obs, reward, done) and the toy's own."""

    pos: jax.Array
    vel: jax.Array
    obs: jax.Array
    reward: jax.Array
    done: jax.Array


class PointMass:
    """A unit mass on a line, pushed by a force in [-2, 2] (so ``rescale`` and ``clip`` differ):
    observation (position, velocity), reward 1 - min(position^2, 1), never terminates (like the
    Control Suite tasks); starts at a position drawn from U(-0.5, 0.5), at rest."""

    observation_size = 2
    action_size = 1
    mj_model = SimpleNamespace(actuator_ctrlrange=np.array([[-2.0, 2.0]]))

    def reset(self, key):
        pos = jax.random.uniform(key, (), minval=-0.5, maxval=0.5)
        vel = jnp.zeros(())
        return ToyState(pos, vel, jnp.stack([pos, vel]), jnp.zeros(()), jnp.zeros(()))

    def step(self, state, action):
        vel = 0.9 * state.vel + 0.1 * action[0]
        pos = jnp.clip(state.pos + 0.1 * vel, -2.0, 2.0)
        return state.replace(
            pos=pos, vel=vel, obs=jnp.stack([pos, vel]), reward=1.0 - jnp.minimum(pos**2, 1.0), done=jnp.zeros(())
        )


class FallingPointMass(PointMass):
    """``PointMass`` whose episode ends (Playground's ``done``) once the position reaches |1|: episodes of
    different lengths, ended by termination before the limit."""

    def step(self, state, action):
        state = super().step(state, action)
        return state.replace(done=(jnp.abs(state.pos) >= 1.0).astype(jnp.float32))


class ExplodingPointMass(PointMass):
    """``PointMass`` whose physics blows up (position, observation and reward NaN) when pushed with more
    than 1.9 of its force 2 (a rescaled action beyond +-0.9): MJX's non-finite states, made cheap."""

    def step(self, state, action):
        state = super().step(state, action)
        nan = jnp.where(jnp.abs(action[0]) > 1.9, jnp.nan, 0.0)
        return state.replace(pos=state.pos + nan, obs=state.obs + nan, reward=state.reward + nan)


FALLING = "playground:ToyFallingPointMass"
EXPLODING = "playground:ToyExplodingPointMass"
TOYS = {NAME: PointMass, FALLING.split(":")[1]: FallingPointMass, EXPLODING.split(":")[1]: ExplodingPointMass}


def use_toy(monkeypatch):
    """``envs.playground`` loads the toys (``TOYS``) for their ``playground:`` names (every other task as before)."""
    from plasticity_zoo.envs import playground

    real = playground._load

    def load(name, impl):
        return (TOYS[name](), EPISODE_LENGTH) if name in TOYS else real(name, impl)

    monkeypatch.setattr(playground, "_load", load)
