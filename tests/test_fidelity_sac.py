"""SAC / SAC-N / EDAC against the official code, number by number (docs/fidelity.md).

``tests/fixtures/sac_reference.npz`` holds weights, a batch of 8 transitions, the Gaussian draws eps of
the sampled actions (a = tanh(mu + std * eps), one draw each for s' in the target, s in the actor loss
and s in the temperature loss) and what the reference code computed from them:

* CleanRL ``cleanrl/sac_continuous_action.py`` (SAC, 2 critics, 2 x 16 ReLU): the target y, each Q's
  MSE loss and its gradient, the actor loss and its gradient, the temperature loss and its gradient;
* CORL ``algorithms/offline/edac.py`` (EDAC, N = 3 critics, eta = 1, 3 x 16 ReLU, EDAC's init with the
  output layers redrawn): the same, plus the gradient-diversity term and its gradient.

Repository, commit and the generator's command are in the fixture's ``meta`` field; the generator is
``scripts/fidelity/sac_reference.py`` (torch lives only in its own venv; this test needs none).

Here the weights are mapped into the zoo's parameter tree (torch ``Linear.weight`` is [out, in], a flax
kernel [in, out]; CORL's ``VectorizedLinear`` is already [member, in, out]; an actor's ``mu`` and
``log_sigma`` layers are the two halves of our ``GaussianPolicyHead.out``) and ``agents.sac``'s own
``critic_loss``, ``actor_loss``, ``alpha_loss``, ``diversity_loss`` and ``td_target`` run jitted, wrapped
with ``regularized`` as ``sac.update`` calls them.  The fixed eps enter through the one random call of
``networks.distributions.tanh_gaussian_sample``: its module's ``jax.random.normal`` is swapped for one
that returns the array passed as the key, and the eps array is passed where the loop passes a key.

Tolerances (float32): ``RTOL, ATOL = 1e-5, 1e-6`` on every compared number (np.testing.assert_allclose:
|ours - reference| <= ATOL + RTOL |reference|), after difference 1 below is accounted for exactly.  The
largest measured residual is 0.43 of that bound (log pi(a'|s'), from the reference's float32 rounding of
1 - tanh(u)^2, which our softplus form avoids); most are under 0.1.

Deliberate differences, checked on the quantities defined equally and not papered over:

1. Log-probability: both references use log(1 - tanh(u)^2 + 1e-6); ours is the exact
   2 (log 2 - u - softplus(-2u)) (``networks.distributions.tanh_log_det_jacobian``).  Ours is larger by
   c(u) = sum_d [log(1 - tanh(u_d)^2 + 1e-6) - log(1 - tanh(u_d)^2)] (> 0, ~1e-6 per dimension near
   u = 0, 4e-5 at |u| = 2.5), and d/du of the two log-dets differ by a relative 1e-6 / (1 - tanh(u)^2).
   The test adds c (float64) to the reference's log pi and loss values, gamma (1 - d) alpha c(u') to its
   y, and to its gradients the gradient of those extra terms taken through our networks
   (``grad_actor_eps_term``, ``grad_critic_eps_term``).  Without this the actor gradient differs by up
   to 4e-5 relative (the log-std bias, rows with |u| ~ 2.5).
2. CleanRL's actor squashes log std as LOG_STD_MIN + (MAX - MIN)(tanh(x) + 1) / 2; ours (and CORL's)
   clips x to [-5, 2].  Against CleanRL our head's output is passed through CleanRL's squash by a test
   adapter (``_TanhSquashedLogStd``; valid because the raw outputs lie inside (-5, 2), asserted, so our clip is
   inert).  CORL's parameterisation is ours, compared with no adapter.
3. CleanRL's temperature loss is -alpha (log pi + H) (in alpha = exp(log alpha)); ours, as CORL's
   and An et al.'s, is -log alpha (log pi + H).  Against CleanRL: our gradient times alpha equals its
   gradient, and our value equals its value times log(alpha) / alpha.  Against CORL: equal.
4. Loss scaling: CleanRL's qf_loss = qf1_loss + qf2_loss (sum of per-critic MSEs) and CORL's
   sum over members of the mean squared TD error are both our ``td``; compared directly, member by member.
5. Update schedule (not exercised by a one-batch loss comparison, stated for completeness): ours follows
   CORL's order, temperature -> actor -> critics -> Polyak, the critics' target using the actor just
   updated; CleanRL updates the critics first, then (every ``policy_frequency`` = 2 steps, twice) actor
   and temperature, with q_lr = alpha lr = 1e-3 against our 3e-4.  The generator runs CleanRL's step with
   policy_frequency = 1 so that its actor and temperature losses are computed once on the same batch.
6. Online vs target critics: the fixtures' targets are drawn separately from the online critics (in the
   references they start as copies) so that a bug that uses the wrong one shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import sac
from plasticity_zoo.buffers.replay import Transition
from plasticity_zoo.networks import Net, distributions
from plasticity_zoo.networks.config import NetworkConfig
from plasticity_zoo.plasticity.sigreg import regularized
from tests.fidelity import flat, load_into, torch_linear

FIXTURE = Path(__file__).parent / "fixtures" / "sac_reference.npz"
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def fx():
    with np.load(FIXTURE) as f:
        return {k: f[k] for k in f.files}


# ----------------------------------------------------------------------------- weight mapping


def _gaussian_head(fx, prefix, mean, log_std):
    """Two torch Linear layers (mean, log std) -> our GaussianPolicyHead.out: [mean | log_std]."""
    (km, bm), (ks, bs) = torch_linear(fx, prefix, mean), torch_linear(fx, prefix, log_std)
    return {("out", "kernel"): np.concatenate([km, ks], 1), ("out", "bias"): np.concatenate([bm, bs])}


def cleanrl_actor(fx, prefix="cleanrl/actor"):
    tree = _gaussian_head(fx, prefix, "fc_mean", "fc_logstd")
    for i, name in enumerate(("fc1", "fc2")):
        tree[("trunk", "layers", i, "kernel")], tree[("trunk", "layers", i, "bias")] = torch_linear(fx, prefix, name)
    return tree


def cleanrl_critics(fx, prefixes):
    """CleanRL's separate SoftQNetworks -> one ensemble tree with a leading member axis."""
    layers = {("trunk", "layers", 0): "fc1", ("trunk", "layers", 1): "fc2", ("out",): "fc3"}
    tree = {}
    for path, name in layers.items():
        k, b = zip(*(torch_linear(fx, p, name) for p in prefixes))
        tree[(*path, "kernel")], tree[(*path, "bias")] = np.stack(k), np.stack(b)
    return tree


def corl_actor(fx, prefix="corl/actor"):
    tree = _gaussian_head(fx, prefix, "mu", "log_sigma")
    for i in range(3):  # trunk = Linear, ReLU, Linear, ReLU, Linear, ReLU
        kernel, bias = torch_linear(fx, prefix, f"trunk.{2 * i}")
        tree[("trunk", "layers", i, "kernel")], tree[("trunk", "layers", i, "bias")] = kernel, bias
    return tree


def corl_critic(fx, prefix):
    """CORL's VectorizedLinear: weight [N, in, out] (our layout already), bias [N, 1, out]."""
    layers = {("trunk", "layers", 0): 0, ("trunk", "layers", 1): 2, ("trunk", "layers", 2): 4, ("out",): 6}
    tree = {}
    for path, i in layers.items():
        tree[(*path, "kernel")] = fx[f"{prefix}/critic.{i}.weight"]
        tree[(*path, "bias")] = fx[f"{prefix}/critic.{i}.bias"][:, 0, :]
    return tree


# ----------------------------------------------------------------------------- running our code
@dataclass(frozen=True)
class _TanhSquashedLogStd:
    """Difference 2: CleanRL's log-std parameterisation on top of our actor (used against CleanRL only)."""

    net: Net
    low: float
    high: float

    def __call__(self, params, *inputs):
        mean, log_std = self.net(params, *inputs)
        return mean, self.low + 0.5 * (self.high - self.low) * (jnp.tanh(log_std) + 1.0)


def _fixed_normal(key, shape, dtype=jnp.float32):
    """Stands in for jax.random.normal inside networks.distributions: the 'key' is the eps array itself."""
    assert key.shape == tuple(shape), (key.shape, shape)
    return key.astype(dtype)


def _batch(fx):
    g = lambda k: jnp.asarray(fx[f"inputs/{k}"])  # noqa: E731
    return Transition(g("obs"), g("actions"), g("rewards"), g("next_obs"), g("terminated") > 0.5, g("truncated") > 0.5)


def _tanh_eps_correction(mean, log_std, eps):
    """c(u) of difference 1, in float64 from our (mean, log std) and the fixed eps."""
    u = np.asarray(mean, np.float64) + np.exp(np.asarray(log_std, np.float64)) * np.asarray(eps, np.float64)
    one_minus = 1.0 - np.tanh(u) ** 2
    return np.sum(np.log(one_minus + 1e-6) - np.log(one_minus), axis=-1)


def _tanh_eps_term(mean, log_std, eps):
    """c(u) per row in JAX, for its gradient (1 - tanh(u)^2 by the stable form our log-det uses)."""
    u = mean + jnp.exp(log_std) * eps
    one_minus = jnp.exp(2.0 * (jnp.log(2.0) - u - jax.nn.softplus(-2.0 * u)))
    return jnp.sum(jnp.log(one_minus + 1e-6) - jnp.log(one_minus), axis=-1)


def run_ours(state, fx, ref: str):
    """Our losses / gradients on the fixture's batch and eps (jitted, wrapped as ``sac.update`` wraps them)."""
    batch = _batch(fx)
    alpha, log_alpha = jnp.float32(fx[f"{ref}/alpha"]), jnp.float32(fx[f"{ref}/log_alpha"])
    eps = {k: jnp.asarray(fx[f"inputs/eps_{k}"]) for k in ("next", "actor", "alpha")}
    critic_vg = jax.value_and_grad(regularized(sac.critic_loss, "critic"), has_aux=True)
    actor_vg = jax.value_and_grad(regularized(sac.actor_loss, "actor"), has_aux=True)

    @jax.jit
    def losses(state, batch, alpha, log_alpha, eps):
        out = {}
        # temperature, as in sac.update: log pi from its own draw, then alpha_loss's value and gradient
        mean, log_std = state.actor(state.actor_params, batch.obs)
        _, lp = distributions.tanh_gaussian_sample(eps["alpha"], mean, log_std)
        out["alpha_log_prob"] = lp
        out["alpha_loss"], out["grad_log_alpha"] = jax.value_and_grad(sac.alpha_loss)(
            log_alpha, lp, sac.target_entropy(state)
        )
        (out["actor_loss"], (out["actor_log_prob"], _)), out["grad_actor"] = actor_vg(
            state.actor_params, state, batch.obs, alpha, eps["actor"], reg_key=None, sigreg=state.plasticity.sigreg
        )
        (out["critic_loss"], (out["q"], out["td"], out["div"], _)), out["grad_critic"] = critic_vg(
            state.critic_params,
            state,
            state.actor_params,
            batch,
            alpha,
            eps["next"],
            reg_key=None,
            sigreg=state.plasticity.sigreg,
        )
        # the target's parts, by the functions critic_loss uses, for y and log pi(a'|s') themselves
        mean2, log_std2 = state.actor(state.actor_params, batch.next_obs)
        a2, lp2 = distributions.tanh_gaussian_sample(eps["next"], mean2, log_std2)
        next_q = state.critic(state.target_critic_params, batch.next_obs, a2).min(axis=0)
        out["next_log_prob"] = lp2
        out["y"] = sac.td_target(batch.reward, batch.terminated, next_q, lp2, alpha, state.cfg.gamma)
        out["raw"] = {"s": (mean, log_std), "s2": (mean2, log_std2)}
        # Difference 1 in the gradients, by autodiff of the reference's extra terms through our networks:
        # actor: its loss is ours - alpha mean_s c(u(theta)), u = mu + std * eps_actor;
        # critics: its y is ours + delta, delta = gamma (1 - d) alpha c(u'), so its loss is ours plus
        # sum_i mean_s [(q_i - y - delta)^2 - (q_i - y)^2] = ours - sum_i mean_s 2 delta q_i + const.
        out["grad_actor_eps_term"] = jax.grad(
            lambda p: alpha * _tanh_eps_term(*state.actor(p, batch.obs), eps["actor"]).mean()
        )(state.actor_params)
        delta = (
            state.cfg.gamma
            * (1.0 - batch.terminated.astype(jnp.float32))
            * alpha
            * _tanh_eps_term(mean2, log_std2, eps["next"])
        )
        out["grad_critic_eps_term"] = jax.grad(
            lambda p: (2.0 * delta * state.critic(p, batch.obs, batch.action)).mean(axis=1).sum()
        )(state.critic_params)
        return out

    shim = SimpleNamespace(random=SimpleNamespace(normal=_fixed_normal), nn=jax.nn)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distributions, "jax", shim)
        out = jax.device_get(losses(state, batch, alpha, log_alpha, eps))
        if state.cfg.eta > 0:
            div, g = jax.device_get(
                jax.jit(jax.value_and_grad(sac.diversity_loss, argnums=1), static_argnums=0)(
                    state.critic, state.critic_params, batch.obs, batch.action
                )
            )
            out["diversity"], out["grad_diversity"] = div, g
    return out


def _state(cfg, network, actor, critic, target):
    """``sac.init``'s state with the fixture's weights.  init runs abstractly (jax.eval_shape: its networks'
    structure, no compilation of its eager initialisers); the optimizer states, unused by the losses, are None."""
    shape = jax.eval_shape(lambda k: sac.init(k, 3, 2, cfg, network), jax.random.key(0))
    return shape.replace(
        actor_params=load_into(shape.actor_params, actor),
        critic_params=load_into(shape.critic_params, critic),
        target_critic_params=load_into(shape.target_critic_params, target),
        log_alpha=jnp.zeros(()),
        actor_opt=None,
        critic_opt=None,
        alpha_opt=None,
        updates=jnp.zeros((), jnp.int32),
    )


@pytest.fixture(scope="module")
def cleanrl(fx):
    state = _state(
        sac.SACConfig(critics=2, gamma=0.99),
        NetworkConfig(width=16, depth=2),
        cleanrl_actor(fx),
        cleanrl_critics(fx, ["cleanrl/qf1", "cleanrl/qf2"]),
        cleanrl_critics(fx, ["cleanrl/qf1_target", "cleanrl/qf2_target"]),
    )
    low, high = (float(x) for x in fx["cleanrl/log_std_bounds"])
    state = state.replace(actor=_TanhSquashedLogStd(state.actor, low, high))  # difference 2
    return state, run_ours(state, fx, "cleanrl")


@pytest.fixture(scope="module")
def corl(fx):
    state = _state(
        sac.SACConfig(critics=3, eta=1.0, gamma=0.99, edac_init=True),
        NetworkConfig(width=16, depth=3),
        corl_actor(fx),
        corl_critic(fx, "corl/critic"),
        corl_critic(fx, "corl/target"),
    )
    return state, run_ours(state, fx, "corl")


def close(got, want, what=""):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=RTOL, atol=ATOL, err_msg=what
    )


def close_tree(grads, want: dict, what):
    got = flat(grads)
    assert set(got) == set(want), what
    for name in sorted(want, key=str):
        close(got[name], want[name], f"{what} {name}")


def _plus(tree: dict, params) -> dict:
    extra = flat(params)
    return {k: np.asarray(v, np.float64) + extra[k] for k, v in tree.items()}


# ----------------------------------------------------------------------------- the fixture itself
def test_fixture_records_reference_and_command(fx):
    meta = json.loads(str(fx["meta"]))
    assert meta["cleanrl"]["repository"].endswith("vwxyzjn/cleanrl") and len(meta["cleanrl"]["commit"]) == 40
    assert meta["corl"]["repository"].endswith("tinkoff-ai/CORL") and len(meta["corl"]["commit"]) == 40
    assert "scripts/fidelity/sac_reference.py" in meta["command"]
    assert FIXTURE.stat().st_size < 300_000


# ----------------------------------------------------------------------------- CleanRL: SAC
def test_cleanrl_log_probs_match_up_to_the_reference_epsilon(fx, cleanrl):
    state, ours = cleanrl
    for key, raw, eps in (("next_log_prob", "s2", "next"), ("alpha_log_prob", "s", "alpha")):
        mean, log_std = ours["raw"][raw]
        c = _tanh_eps_correction(mean, log_std, fx[f"inputs/eps_{eps}"])
        close(ours[key], fx[f"cleanrl/{key}"] + c, key)
    # difference 2's adapter is exact only while our clip is inert: raw log std strictly inside the bounds
    for raw in ("s", "s2"):
        x = np.asarray(state.actor.net(state.actor_params, fx["inputs/obs" if raw == "s" else "inputs/next_obs"])[1])
        assert np.all((x > -5.0) & (x < 2.0))


def test_cleanrl_critic_target_and_per_critic_losses(fx, cleanrl):
    state, ours = cleanrl
    close(ours["q"], fx["cleanrl/q"], what="Q(s, a)")
    mean, log_std = ours["raw"]["s2"]
    c = _tanh_eps_correction(mean, log_std, fx["inputs/eps_next"])
    d = fx["inputs/terminated"]
    alpha = float(fx["cleanrl/alpha"])
    y_ref = fx["cleanrl/y"] - 0.99 * (1 - d) * alpha * c  # difference 1: y = ... - alpha log pi
    close(ours["y"], y_ref, "y")
    member = ((ours["q"] - ours["y"][None]) ** 2).mean(axis=1)
    close(member, fx["cleanrl/qf_member_loss"], "per-critic MSE")
    close(ours["td"], fx["cleanrl/qf_loss"], "qf1_loss + qf2_loss = our td")
    close(ours["critic_loss"], fx["cleanrl/qf_loss"], "critic_loss (eta = 0)")


def test_cleanrl_critic_gradients(fx, cleanrl):
    _, ours = cleanrl
    want = cleanrl_critics(fx, ["cleanrl/grad/qf1", "cleanrl/grad/qf2"])  # member i <- qf{i+1}'s own MSE
    want = _plus(want, ours["grad_critic_eps_term"])  # difference 1 (through y)
    close_tree(ours["grad_critic"], want, "d critic_loss / d critic")


def test_cleanrl_actor_loss_and_gradient(fx, cleanrl):
    _, ours = cleanrl
    mean, log_std = ours["raw"]["s"]
    c = _tanh_eps_correction(mean, log_std, fx["inputs/eps_actor"])
    alpha = float(fx["cleanrl/alpha"])
    close(ours["actor_loss"], fx["cleanrl/actor_loss"] + alpha * c.mean(), "actor loss")
    want = _plus(cleanrl_actor(fx, "cleanrl/grad/actor"), ours["grad_actor_eps_term"])  # difference 1
    close_tree(ours["grad_actor"], want, "d actor_loss / d actor")


def test_cleanrl_temperature_loss_relation(fx, cleanrl):
    """Difference 3: CleanRL differentiates -alpha (log pi + H), we -log alpha (log pi + H)."""
    _, ours = cleanrl
    alpha, log_alpha = float(fx["cleanrl/alpha"]), float(fx["cleanrl/log_alpha"])
    mean, log_std = ours["raw"]["s"]
    c = _tanh_eps_correction(mean, log_std, fx["inputs/eps_alpha"])
    # CleanRL's value and gradient are both -alpha mean(log pi + H); ours: -log alpha mean(.) and -mean(.)
    ref_mean = -fx["cleanrl/alpha_loss"] / alpha + c.mean()  # mean(log pi + H), difference 1 applied
    close(ours["grad_log_alpha"], -ref_mean, "d alpha_loss / d log alpha")
    close(
        ours["grad_log_alpha"] * alpha,
        fx["cleanrl/grad/log_alpha"] - alpha * c.mean(),
        "alpha * our gradient = CleanRL's gradient",
    )
    close(ours["alpha_loss"], -log_alpha * ref_mean, "alpha loss")


# ----------------------------------------------------------------------------- CORL: SAC-N / EDAC
def test_corl_temperature_loss_and_gradient(fx, corl):
    _, ours = corl
    mean, log_std = ours["raw"]["s"]
    c = _tanh_eps_correction(mean, log_std, fx["inputs/eps_alpha"])
    close(ours["alpha_log_prob"], fx["corl/alpha_log_prob"] + c, "log pi (temperature draw)")
    log_alpha = float(fx["corl/log_alpha"])
    close(ours["alpha_loss"], fx["corl/alpha_loss"] - log_alpha * c.mean(), "alpha loss")
    close(ours["grad_log_alpha"], fx["corl/grad/log_alpha"] - c.mean(), "d alpha_loss / d log alpha")


def test_corl_actor_loss_and_gradient(fx, corl):
    _, ours = corl
    mean, log_std = ours["raw"]["s"]
    c = _tanh_eps_correction(mean, log_std, fx["inputs/eps_actor"])
    close(ours["actor_log_prob"], fx["corl/actor_log_prob"] + c, "log pi (actor draw)")
    alpha = float(fx["corl/alpha"])
    close(ours["actor_loss"], fx["corl/actor_loss"] + alpha * c.mean(), "actor loss")
    want = _plus(corl_actor(fx, "corl/grad/actor"), ours["grad_actor_eps_term"])  # difference 1
    close_tree(ours["grad_actor"], want, "d actor_loss / d actor")


def test_corl_critic_target_loss_and_gradient(fx, corl):
    _, ours = corl
    close(ours["q"], fx["corl/q"], what="Q(s, a)")
    mean, log_std = ours["raw"]["s2"]
    c = _tanh_eps_correction(mean, log_std, fx["inputs/eps_next"])
    close(ours["next_log_prob"], fx["corl/next_log_prob"] + c, "log pi(a'|s')")
    alpha, d = float(fx["corl/alpha"]), fx["inputs/terminated"]
    close(ours["y"], fx["corl/y"] - 0.99 * (1 - d) * alpha * c, "y")
    close(ours["td"], fx["corl/td_loss"], "sum over members of the MSE")
    close(ours["div"], fx["corl/diversity"], what="diversity inside critic_loss")
    close(ours["critic_loss"], fx["corl/critic_loss"], "td + eta * diversity")
    want = _plus(corl_critic(fx, "corl/grad/critic"), ours["grad_critic_eps_term"])  # difference 1 (through y)
    close_tree(ours["grad_critic"], want, "d critic_loss / d critic")


def test_corl_diversity_value_and_gradient(fx, corl):
    _, ours = corl
    close(ours["diversity"], fx["corl/diversity"], what="EDAC diversity")
    close_tree(ours["grad_diversity"], corl_critic(fx, "corl/grad/diversity"), "d diversity / d critic")
