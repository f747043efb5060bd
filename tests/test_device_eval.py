"""Evaluation on the device (``training/evaluation.py``): a memoryless deterministic policy's episodes on a
``playground:`` env run as one jitted program, with the host evaluation's env seeds, resets and sums."""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from tests import device_toy

needs_playground = pytest.mark.skipif(
    importlib.util.find_spec("mujoco_playground") is None, reason="MuJoCo Playground (extra .[mjx]) is not installed"
)
pytestmark = needs_playground


class PurePolicy:
    """A hand-made memoryless policy: ``act(state, obs)`` pure, as ``DeterministicPolicy`` exposes it."""

    def __init__(self, act, state=None):
        self.pure = (act, state)
        self.calls = 0

    def __call__(self, obs):
        self.calls += 1
        return self.pure[0](self.pure[1], jnp.asarray(obs))


def push_away(state, obs):
    """Push the mass away from 0: action clip(2 x position, -1, 1), shaped (seeds, episodes, 1)."""
    return jnp.clip(2.0 * obs[..., :1], -1.0, 1.0)


def numpy_returns(start_pos, steps):
    """``FallingPointMass`` under ``push_away`` in float32 numpy: the rescaled force -2 + (a + 1) x 2, velocity
    0.9 v + 0.1 f, position clipped to [-2, 2], reward 1 - min(p^2, 1), the episode ends at |p| >= 1 or after
    ``steps`` steps."""
    f32 = np.float32
    returns, lengths = [], []
    for p in np.asarray(start_pos, f32):
        v, total = f32(0), 0.0
        for t in range(1, steps + 1):
            a = np.clip(f32(2) * p, f32(-1), f32(1))
            v = f32(0.9) * v + f32(0.1) * (f32(-2) + (a + f32(1)) * f32(2))
            p = np.clip(p + f32(0.1) * v, f32(-2), f32(2))
            total += float(f32(1) - min(p * p, f32(1)))
            if abs(p) >= 1:
                break
        returns.append(total)
        lengths.append(t)
    return np.asarray(returns), np.asarray(lengths)


def test_terminated_episodes_end_their_returns_and_the_device_sums_what_the_host_sums(monkeypatch):
    """Toy episodes that terminate at different steps: the device evaluation gives the host evaluation's
    returns and a float32 numpy rollout's, from the same env seeds, without calling the policy on the host."""
    from plasticity_zoo.envs.playground import env_keys, make
    from plasticity_zoo.training.evaluation import Evaluator

    device_toy.use_toy(monkeypatch)
    ev = Evaluator(device_toy.FALLING, seeds=2, episodes=3, base_seed=40)
    assert ev.on_device
    start = np.asarray(make(device_toy.FALLING).reset(env_keys(ev.env_seeds)).inner.pos)
    expected, lengths = numpy_returns(start, device_toy.EPISODE_LENGTH)
    assert len(set(lengths.tolist())) > 1 and lengths.max() < device_toy.EPISODE_LENGTH  # all terminate, apart

    policy = PurePolicy(push_away)
    on_device = np.asarray(ev(policy))
    assert policy.calls == 0  # nothing stepped on the host
    on_host = np.asarray(ev(lambda obs: policy(obs)))  # a plain callable: the host loop
    assert policy.calls == lengths.max()
    np.testing.assert_allclose(on_device, expected.reshape(2, 3), rtol=1e-5)
    np.testing.assert_array_equal(on_device, on_host)
