import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.networks.distributions import (
    gaussian_log_prob,
    tanh_gaussian_log_prob,
    tanh_gaussian_mode,
    tanh_gaussian_sample,
)


def numeric_tanh_gaussian_density(a, mean, std, h=1e-6):
    """p(a) = N(atanh a; mean, std) * |d atanh(a) / da|, derivative by central differences."""
    u = np.arctanh(a)
    du = (np.arctanh(a + h) - np.arctanh(a - h)) / (2 * h)
    normal = np.exp(-0.5 * ((u - mean) / std) ** 2) / (std * np.sqrt(2 * np.pi))
    return normal * du


def test_tanh_gaussian_log_prob_matches_numerical_density():
    mean, log_std = 0.3, np.log(0.7)
    a = np.array([-0.95, -0.5, 0.0, 0.2, 0.8, 0.99])
    got = tanh_gaussian_log_prob(jnp.asarray(a)[:, None], jnp.full((6, 1), mean), jnp.full((6, 1), log_std))
    ref = np.log(numeric_tanh_gaussian_density(a, mean, 0.7))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)


def test_tanh_gaussian_density_integrates_to_one():
    a = np.linspace(-1 + 1e-7, 1 - 1e-7, 400001)
    lp = tanh_gaussian_log_prob(
        jnp.asarray(a)[:, None], jnp.full((a.size, 1), -1.2), jnp.full((a.size, 1), 0.4), eps=1e-9
    )
    p = np.exp(np.asarray(lp, np.float64))
    assert abs(np.trapezoid(p, a) - 1.0) < 2e-3


def test_sample_log_prob_is_consistent_and_multidimensional():
    key = jax.random.key(0)
    mean = jnp.array([[0.1, -0.4, 0.0]])
    log_std = jnp.array([[-0.5, 0.2, -1.0]])
    a, lp = tanh_gaussian_sample(key, mean, log_std)
    assert a.shape == (1, 3) and lp.shape == (1,)
    assert np.all(np.abs(np.asarray(a)) < 1)
    np.testing.assert_allclose(lp, tanh_gaussian_log_prob(a, mean, log_std), rtol=1e-4)
    # independent dimensions: the joint log-prob is the sum of 1-D log-probs
    per_dim = sum(tanh_gaussian_log_prob(a[:, i : i + 1], mean[:, i : i + 1], log_std[:, i : i + 1]) for i in range(3))
    np.testing.assert_allclose(lp, per_dim, rtol=1e-4)
    np.testing.assert_allclose(tanh_gaussian_mode(mean), np.tanh(mean))


def test_gaussian_log_prob_against_numpy():
    x, m, s = np.array([[0.5, -1.0]]), np.array([[0.0, 1.0]]), np.array([[0.5, 2.0]])
    ref = np.sum(-0.5 * ((x - m) / s) ** 2 - np.log(s) - 0.5 * np.log(2 * np.pi), axis=-1)
    np.testing.assert_allclose(
        gaussian_log_prob(jnp.asarray(x), jnp.asarray(m), jnp.log(jnp.asarray(s))), ref, rtol=1e-6
    )
