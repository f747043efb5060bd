"""PPO against CleanRL's official ``ppo_continuous_action.py``, number by number (docs/fidelity.md).

``tests/fixtures/ppo_reference.npz`` holds CleanRL's ``Agent`` weights (64-64 tanh actor mean and critic,
orthogonal ``layer_init``, ``actor_logstd``), a rollout of 8 steps x 2 envs (observations as the networks
see them, actions, rewards, ``dones`` with three episode ends), the two epochs' minibatch permutations, and
what CleanRL's own statements computed from them in one update (iteration 2 of 4: lr annealed to 0.75 x
0.02, 2 epochs x 2 minibatches of 8, ent_coef 0.01, the other hyperparameters CleanRL's defaults):

* the rollout's log pi(a|s) and V(s), and V of the bootstrap observation;
* GAE advantages and returns;
* per minibatch step: pg_loss, v_loss, entropy_loss, approx_kl, clipfrac, the total loss, the gradient
  norm clip_grad_norm_ returned, the learning rate;
* the first minibatch's gradients before and after ``clip_grad_norm_``, the parameters after the first
  ``optimizer.step()`` and after the whole update;
* the explained variance of the values by the returns.

Repository, commit, CleanRL's ``Args`` and the generator's command are in the fixture's ``meta`` field; the
generator is ``scripts/fidelity/ppo_reference.py`` (torch lives only in its own venv; this test needs none).

Here the weights are mapped into ``ppo.init``'s parameter tree (torch ``Linear.weight`` [out, in] -> flax
kernel [in, out]; ``actor_mean.0/2/4`` -> the actor's ``trunk.layers.0/1`` and ``out``; ``critic.0/2/4``
likewise; ``actor_logstd`` [1, A] -> ``log_std`` [A]) and ``agents.ppo``'s own code runs: ``gae`` and
``flat_samples``; ``_loss`` under ``jax.value_and_grad`` on the first minibatch (as ``update``'s
minibatch step calls it); and ``update`` itself, jitted, on the whole rollout.  The fixed permutations
enter ``update`` through its two random calls: in ``agents.ppo`` the test swaps ``jax`` for a stand-in
whose ``random.permutation`` returns the array passed as the key, and whose ``random.split`` hands a
stack of such arrays out row by row (a single one is copied); the epochs' permutations are passed where
the loop passes a key.  What happens inside ``update``'s scan is observed by two wrappers put in place
of ``ppo._loss`` and ``ppo._optimizers`` for the trace: each calls the zoo's own function and reports
its inputs with ``jax.debug.callback`` (``_loss``: the parameters and the loss terms of every minibatch
step; the optimizers' ``update``: the gradients handed to Adam, i.e. after the clip).  No agent code is
changed.

Tolerances (float32): ``RTOL, ATOL = 1e-5, 1e-6`` (np.testing.assert_allclose: |ours - reference| <=
ATOL + RTOL |reference|) on every compared number, except the parameters after Adam steps:
``ATOL_PARAMS = 4e-6``.  There the float32 reference is itself off its float64 rerun by up to 9e-7
(``--float64-check``: on a near-zero gradient Adam's g / (|g| + eps) turns a 1e-9 rounding of g into
lr x 1e-9 / eps ~ 1e-6), and ours carries the optax effect of the last test below (1e-7 per step).  The
largest measured residuals are in docs/fidelity.md.

Deliberate differences, each accounted for exactly:

1. ``dones``: CleanRL folds terminations and truncations into one ``next_done``, stored as
   ``dones[t + 1]`` (obs[t + 1] starts a new episode), and treats both as terminal (next value 0).  The
   zoo keeps them apart (a truncation bootstraps from V(true final obs)).  The test expresses CleanRL's
   episode ends as terminations: ``terminated[t] = dones[t + 1]`` for t < T - 1 and ``terminated[T - 1] =
   next_done``; ``dones[0]`` (set in the fixture, from the previous iteration) enters no GAE term.  The
   same ends given as truncations with V(final obs) = 0 reproduce CleanRL too (checked).
2. Normalisation: CleanRL's observation / reward normalisation are env-side wrappers, the zoo's statistics
   live in the agent state; neither enters the update.  The fixture's observations and rewards are those
   the networks see (already normalised), ``update`` does not read ``obs_rms`` / ``ret_rms``.
3. Optimisers: CleanRL has one Adam over all parameters; the zoo one per network, built at lr 1 and scaled
   by the annealed lr afterwards, with one global grad-norm clip over both.  Adam being per coordinate,
   the two agree; the parameters after the steps are compared directly.
4. Learning-rate schedule counter: CleanRL's iteration is 1-based (frac = 1 - (iteration - 1) / N), the
   zoo's ``state.iteration`` counts completed updates (frac = 1 - iteration / N): CleanRL's iteration 2
   is ``state.iteration = 1``.

Found (not in agents/ppo.py, not a difference of algorithm): optax's Adam computes its bias corrections
1 - b ** t in float32, torch's in float64, so our Adam steps are shorter than CleanRL's by 6.7e-6
(relative) on the first step and by roughly 4e-6 to 1.4e-5 over the first thousand, fading by t ~ 5000.
Isolated in ``test_found_difference_optax_adam_float32_bias_correction_shortens_steps``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from plasticity_zoo.agents import ppo
from plasticity_zoo.networks.distributions import gaussian_log_prob
from tests.fidelity import flat, load_into, torch_linear

FIXTURE = Path(__file__).parent / "fixtures" / "ppo_reference.npz"
RTOL, ATOL = 1e-5, 1e-6
ATOL_PARAMS = 4e-6  # parameters after Adam steps (see the module docstring)
T, E, OBS_DIM, ACT_DIM = 8, 2, 3, 2


@pytest.fixture(scope="module")
def fx():
    with np.load(FIXTURE) as f:
        return {k: f[k] for k in f.files}


# ----------------------------------------------------------------------------- weight mapping


def cleanrl_actor(fx, prefix):
    """CleanRL's actor_mean (Linear, Tanh, Linear, Tanh, Linear) and actor_logstd -> our PPOActor."""
    tree = {("log_std",): fx[f"{prefix}/actor_logstd"][0]}
    for path, i in ((("trunk", "layers", 0), 0), (("trunk", "layers", 1), 2), (("out",), 4)):
        tree[(*path, "kernel")], tree[(*path, "bias")] = torch_linear(fx, prefix, f"actor_mean.{i}")
    return tree


def cleanrl_critic(fx, prefix):
    tree = {}
    for path, i in ((("trunk", "layers", 0), 0), (("trunk", "layers", 1), 2), (("out",), 4)):
        tree[(*path, "kernel")], tree[(*path, "bias")] = torch_linear(fx, prefix, f"critic.{i}")
    return tree


# ----------------------------------------------------------------------------- the rollout, CleanRL's dones
def terminations(fx):
    """Difference 1: CleanRL's dones[t + 1] (t < T - 1) and next_done -> the zoo's terminated[t]."""
    dones, next_done = fx["inputs/dones"], fx["inputs/next_done"]
    return np.concatenate([dones[1:], next_done[None]], axis=0) > 0.5


def rollout(fx, truncations: bool = False) -> ppo.Rollout:
    """The fixture's rollout in the zoo's layout: slot T of obs / values holds s_T and V(s_T)."""
    ends = terminations(fx)
    no = np.zeros_like(ends)
    return ppo.Rollout(
        obs=jnp.asarray(np.concatenate([fx["inputs/obs"], fx["inputs/next_obs"][None]])),
        actions=jnp.asarray(np.concatenate([fx["inputs/actions"], np.zeros((1, E, ACT_DIM), np.float32)])),
        logp=jnp.asarray(np.concatenate([fx["cleanrl/logprobs"], np.zeros((1, E), np.float32)])),
        values=jnp.asarray(np.concatenate([fx["cleanrl/values"], fx["cleanrl/next_value"][None]])),
        rewards=jnp.asarray(fx["inputs/rewards"]),
        terminated=jnp.asarray(no if truncations else ends),
        truncated=jnp.asarray(ends if truncations else no),
        final_values=jnp.zeros((T, E), jnp.float32),
    )  # V(final obs) of a truncation: 0, as CleanRL takes it


def _config(fx) -> ppo.PPOConfig:
    """CleanRL's Args of the fixture as our PPOConfig (every field the update reads)."""
    a = json.loads(str(fx["meta"]))["args"]
    assert a["target_kl"] is None and a["num_envs"] == E and a["num_steps"] == T
    return ppo.PPOConfig(
        num_steps=a["num_steps"],
        num_minibatches=a["num_minibatches"],
        update_epochs=a["update_epochs"],
        learning_rate=a["learning_rate"],
        anneal_lr=a["anneal_lr"],
        adam_eps=1e-5,
        gamma=a["gamma"],
        gae_lambda=a["gae_lambda"],
        norm_adv=a["norm_adv"],
        clip=True,
        clip_coef=a["clip_coef"],
        clip_vloss=a["clip_vloss"],
        ent_coef=a["ent_coef"],
        vf_coef=a["vf_coef"],
        max_grad_norm=a["max_grad_norm"],
        target_kl=None,
    )


@pytest.fixture(scope="module")
def state(fx):
    """``ppo.init``'s state with CleanRL's weights, fresh Adam states (the zoo's own optimizers) and the
    learning-rate schedule at CleanRL's iteration (difference 4).  init runs abstractly (jax.eval_shape:
    the networks' structure, no compilation of its eager initialisers)."""
    meta = json.loads(str(fx["meta"]))
    cfg = _config(fx)
    shape = jax.eval_shape(lambda k: ppo.init(k, OBS_DIM, ACT_DIM, cfg), jax.random.key(0))
    actor = load_into(shape.actor_params, cleanrl_actor(fx, "cleanrl/init"))
    critic = load_into(shape.critic_params, cleanrl_critic(fx, "cleanrl/init"))
    tx_a, tx_c = ppo._optimizers(cfg, shape.plasticity)
    return shape.replace(
        actor_params=actor,
        critic_params=critic,
        actor_opt=tx_a.init(actor),
        critic_opt=tx_c.init(critic),
        obs_rms=ppo.rms_init((OBS_DIM,)),
        ret_rms=ppo.rms_init(),
        anchors=None,
        anchor_count=jnp.zeros((), jnp.int32),
        snapshots=jnp.zeros(shape.snapshots.shape, jnp.float32),
        snapshot_count=jnp.ones((), jnp.int32),
        iteration=jnp.asarray(meta["iteration"] - 1, jnp.int32),
        num_iterations=jnp.asarray(meta["args"]["num_iterations"], jnp.int32),
    )


def close(got, want, what="", atol=ATOL):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=RTOL, atol=atol, err_msg=what
    )


def close_tree(params, want: dict, what, atol=ATOL):
    got = flat(params)
    assert set(got) == set(want), what
    for name in sorted(want, key=str):
        close(got[name], want[name], f"{what} {name}", atol)


# ----------------------------------------------------------------------------- running our update
def _fixed_split(key, num=2):
    """A 'key' is a permutation: a stack of them is handed out row by row, a single one copied."""
    if key.ndim == 2:
        assert key.shape[0] == num, (key.shape, num)
        return key
    return jnp.broadcast_to(key, (num, *key.shape))


def _fixed_permutation(key, n):
    assert key.shape == (n,), (key.shape, n)
    return key


class _Proxy:
    """A module with some attributes replaced (the rest read from ``base``)."""

    def __init__(self, base, **over):
        self._base, self._over = base, over

    def __getattr__(self, name):
        return self._over[name] if name in self._over else getattr(self._base, name)


@pytest.fixture(scope="module")
def ours(fx, state):
    """``ppo.update`` (jitted) on the fixture's rollout with its permutations; what each minibatch step saw."""
    steps, adam_inputs = [], []
    real_loss, real_optimizers = ppo._loss, ppo._optimizers

    def loss_spy(params, st, mb, weights, key):
        loss, aux = real_loss(params, st, mb, weights, key)
        jax.debug.callback(lambda p, a: steps.append((p, a)), params, {**aux, "losses/total": loss}, ordered=True)
        return loss, aux

    def optimizers_spy(cfg, plasticity):
        def spy(tx, name):
            def update(grads, opt_state, params=None):
                jax.debug.callback(lambda g: adam_inputs.append((name, g)), grads, ordered=True)
                return tx.update(grads, opt_state, params)

            return tx._replace(update=update)

        tx_a, tx_c = real_optimizers(cfg, plasticity)
        return spy(tx_a, "actor"), spy(tx_c, "critic")

    shim = _Proxy(jax, random=_Proxy(jax.random, split=_fixed_split, permutation=_fixed_permutation))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ppo, "jax", shim)
        mp.setattr(ppo, "_loss", loss_spy)
        mp.setattr(ppo, "_optimizers", optimizers_spy)
        new_state, metrics = jax.jit(ppo.update)(state, rollout(fx), jnp.asarray(fx["inputs/permutations"]))
        new_state, metrics = jax.device_get((new_state, metrics))
    jax.effects_barrier()
    return SimpleNamespace(
        state=new_state, metrics=metrics, steps=jax.device_get(steps), adam_inputs=jax.device_get(adam_inputs)
    )


# ----------------------------------------------------------------------------- the fixture itself
def test_fixture_records_reference_and_command(fx):
    meta = json.loads(str(fx["meta"]))
    assert meta["cleanrl"]["repository"].endswith("vwxyzjn/cleanrl") and len(meta["cleanrl"]["commit"]) == 40
    assert meta["cleanrl"]["file"] == "cleanrl/ppo_continuous_action.py"
    assert "scripts/fidelity/ppo_reference.py" in meta["command"]
    # what the update exercises: both clips active on some samples of the later minibatches
    assert fx["cleanrl/minibatch/clipfrac"].max() > 0 and fx["cleanrl/minibatch/vclipfrac"].max() > 0
    assert FIXTURE.stat().st_size < 300_000


SHARED_ARGS = (
    "num_steps",
    "num_minibatches",
    "update_epochs",
    "learning_rate",
    "anneal_lr",
    "gamma",
    "gae_lambda",
    "norm_adv",
    "clip_coef",
    "clip_vloss",
    "ent_coef",
    "vf_coef",
    "max_grad_norm",
    "target_kl",
)


def test_config_matches_cleanrl_args(fx, state):
    """The test's config is CleanRL's Args of the fixture; our defaults are CleanRL's defaults."""
    meta = json.loads(str(fx["meta"]))
    defaults = ppo.PPOConfig()
    for k in SHARED_ARGS:
        assert getattr(state.cfg, k) == meta["args"][k], k
        assert getattr(defaults, k) == meta["args_defaults"][k], k
    # Adam's eps is a literal of CleanRL's optimizer line; CleanRL has neither --no-clip nor GTR
    assert state.cfg.adam_eps == defaults.adam_eps == 1e-5
    assert state.cfg.clip and defaults.clip and state.cfg.trust_region == defaults.trust_region == "clip"


# ----------------------------------------------------------------------------- networks, GAE, schedule
def test_rollout_log_probs_and_values(fx, state):
    obs = jnp.asarray(fx["inputs/obs"])
    mean, log_std = state.actor(state.actor_params, obs)
    close(gaussian_log_prob(jnp.asarray(fx["inputs/actions"]), mean, log_std), fx["cleanrl/logprobs"], "log pi(a|s)")
    close(ppo.value(state, obs), fx["cleanrl/values"], "V(s)")
    close(ppo.value(state, jnp.asarray(fx["inputs/next_obs"])), fx["cleanrl/next_value"], "V(next_obs)")


def test_gae_advantages_and_returns(fx, state):
    batch = rollout(fx)
    adv, ret = ppo.gae(
        batch.rewards,
        batch.values[:T],
        batch.terminated,
        batch.truncated,
        batch.final_values,
        batch.values[T],
        0.99,
        0.95,
    )
    close(adv, fx["cleanrl/advantages"], "advantages")
    close(ret, fx["cleanrl/returns"], "returns")
    data = ppo.flat_samples(state.cfg, batch)  # flattened as CleanRL's reshape(-1): index t * E + e
    close(data["advantages"], fx["cleanrl/advantages"].reshape(-1), "b_advantages")
    close(data["returns"], fx["cleanrl/returns"].reshape(-1), "b_returns")


def test_gae_truncations_with_zero_final_value_match_cleanrl(fx):
    """Difference 1: CleanRL treats a truncation as a termination; ours does too when V(final obs) = 0."""
    batch = rollout(fx, truncations=True)
    adv, ret = ppo.gae(
        batch.rewards,
        batch.values[:T],
        batch.terminated,
        batch.truncated,
        batch.final_values,
        batch.values[T],
        0.99,
        0.95,
    )
    close(adv, fx["cleanrl/advantages"], "advantages")
    close(ret, fx["cleanrl/returns"], "returns")


def test_learning_rate_schedule_at_cleanrl_iteration(fx, state):
    """Difference 4: CleanRL's lrnow at its iteration 2 = ``learning_rate(state)`` at state.iteration 1."""
    close(ppo.learning_rate(state), fx["cleanrl/minibatch/lr"][0], "lr")


# ----------------------------------------------------------------------------- the first minibatch
def test_first_minibatch_losses_and_gradients(fx, state):
    """``_loss`` and its gradient at the initial weights on the first minibatch, before any clip."""
    data = ppo.flat_samples(state.cfg, rollout(fx))
    mb_size = T * E // state.cfg.num_minibatches
    idx = jnp.asarray(fx["inputs/permutations"][0, :mb_size])
    mb = ppo.Minibatch(**jax.tree.map(lambda x: x[idx], data))
    vg = jax.jit(jax.value_and_grad(ppo._loss, has_aux=True))
    (loss, aux), (g_actor, g_critic) = vg((state.actor_params, state.critic_params), state, mb, None, jax.random.key(0))
    ref = {
        k: fx[f"cleanrl/minibatch/{k}"][0]
        for k in ("pg_loss", "v_loss", "entropy_loss", "approx_kl", "clipfrac", "loss")
    }
    for ours_key, ref_key in (
        ("losses/policy", "pg_loss"),
        ("losses/value", "v_loss"),
        ("losses/entropy", "entropy_loss"),
        ("charts/approx_kl", "approx_kl"),
        ("charts/clipfrac", "clipfrac"),
    ):
        close(aux[ours_key], ref[ref_key], ref_key)
    close(loss, ref["loss"], "loss = pg - ent_coef H + vf_coef v")
    close_tree(g_actor, cleanrl_actor(fx, "cleanrl/grad"), "d loss / d actor")
    close_tree(g_critic, cleanrl_critic(fx, "cleanrl/grad"), "d loss / d critic")
    gnorm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves((g_actor, g_critic))))
    close(gnorm, fx["cleanrl/minibatch/grad_norm"][0], "global grad norm")


# ----------------------------------------------------------------------------- the whole update
def test_update_minibatch_losses_every_step(fx, ours):
    """The loss terms of each of the 4 minibatch steps inside ``update`` (epoch-major, as CleanRL's loop)."""
    assert len(ours.steps) == 4
    for i, (_, aux) in enumerate(ours.steps):
        for ours_key, ref_key in (
            ("losses/policy", "pg_loss"),
            ("losses/value", "v_loss"),
            ("losses/entropy", "entropy_loss"),
            ("charts/approx_kl", "approx_kl"),
            ("charts/clipfrac", "clipfrac"),
            ("losses/total", "loss"),
        ):
            close(aux[ours_key], fx[f"cleanrl/minibatch/{ref_key}"][i], f"step {i} {ref_key}")


def test_update_first_step_clipped_gradients(fx, ours):
    """What Adam receives on the first step: the gradient after the global-norm clip (0.5)."""
    assert [name for name, _ in ours.adam_inputs] == ["actor", "critic"] * 4
    close_tree(ours.adam_inputs[0][1], cleanrl_actor(fx, "cleanrl/grad_clipped"), "clipped d loss / d actor")
    close_tree(ours.adam_inputs[1][1], cleanrl_critic(fx, "cleanrl/grad_clipped"), "clipped d loss / d critic")


def test_update_parameters_after_first_step(fx, ours):
    """The parameters the second minibatch step starts from: one clipped Adam step at the annealed lr."""
    actor, critic = ours.steps[1][0]
    close_tree(actor, cleanrl_actor(fx, "cleanrl/after_first_step"), "actor after step 1", ATOL_PARAMS)
    close_tree(critic, cleanrl_critic(fx, "cleanrl/after_first_step"), "critic after step 1", ATOL_PARAMS)


def test_update_parameters_after_update(fx, ours):
    close_tree(
        ours.state.actor_params, cleanrl_actor(fx, "cleanrl/after_update"), "actor after the update", ATOL_PARAMS
    )
    close_tree(
        ours.state.critic_params, cleanrl_critic(fx, "cleanrl/after_update"), "critic after the update", ATOL_PARAMS
    )


def test_update_metrics_are_cleanrl_means(fx, state, ours):
    """``update``'s metrics: the mean over the 4 steps of CleanRL's per-minibatch values, and its lr."""
    m = ours.metrics
    for ours_key, ref_key in (
        ("losses/policy", "pg_loss"),
        ("losses/value", "v_loss"),
        ("losses/entropy", "entropy_loss"),
        ("charts/approx_kl", "approx_kl"),
        ("charts/clipfrac", "clipfrac"),
        ("losses/total", "loss"),
        ("charts/grad_norm", "grad_norm"),
    ):
        close(m[ours_key], np.mean(fx[f"cleanrl/minibatch/{ref_key}"].astype(np.float64)), ref_key)
    close(m["charts/learning_rate"], fx["cleanrl/minibatch/lr"][0], "lr")
    close(m["charts/explained_variance"], fx["cleanrl/explained_var"], "explained variance")
    assert float(m["charts/epochs_run"]) == 2.0
    assert int(ours.state.iteration) == int(state.iteration) + 1
    # difference 2: the normalisers are not touched by the update
    for a, b in zip(
        jax.tree.leaves((ours.state.obs_rms, ours.state.ret_rms)), jax.tree.leaves((state.obs_rms, state.ret_rms))
    ):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- a difference found (optax)
def _vector(fx, prefix, actor_and_critic=None) -> np.ndarray:
    """All parameters (or gradients) as one float64 vector, in a fixed order of (network, path)."""
    if actor_and_critic is None:
        trees = (cleanrl_actor(fx, prefix), cleanrl_critic(fx, prefix))
    else:
        trees = tuple(flat(p) for p in actor_and_critic)
    return np.concatenate([np.ravel(np.asarray(tree[k], np.float64)) for tree in trees for k in sorted(tree, key=str)])


def test_found_difference_optax_adam_float32_bias_correction_shortens_steps(fx, ours):
    """Not in agents/ppo.py: optax's Adam computes its bias corrections 1 - b ** t in float32, torch's Adam
    in float64.

    ``optax.tree_utils.tree_bias_correction`` (optax 0.2.8, ``_tree_math.py``): ``bias_correction_ = 1 -
    decay**count`` with ``count`` an int32 array, so float32: 1 - float32(0.999) = 0.000999987125 (relative
    error -1.29e-5) and 1 - float32(0.9) = 0.100000024 (-2.4e-7).  On the first step sqrt(v_hat) is therefore
    6.4e-6 too large and m_hat 2.4e-7 too small: our first Adam step is 6.7e-6 (relative) shorter than
    CleanRL's where |g| >> eps (later steps: roughly 4e-6 to 1.4e-5 over the first thousand, from the
    float32 rounding of 0.999 ** t; it fades by t ~ 5000).  At lr 0.015 that is 1e-7 per step, about an
    ulp of the parameters, within ATOL_PARAMS.  This test measures it on the first step, on the
    coordinates whose gradient is well above Adam's eps (there the step is ~lr and well resolved)."""
    b1, b2, eps = 0.9, 0.999, 1e-5
    lr = float(fx["cleanrl/minibatch/lr"][0])
    g = _vector(fx, "cleanrl/grad_clipped")
    p0 = _vector(fx, "cleanrl/init")
    d_ref = _vector(fx, "cleanrl/after_first_step") - p0
    d_ours = _vector(fx, None, ours.steps[1][0]) - p0
    keep = np.abs(g) > 1e-4
    assert keep.sum() > 3000
    g, d_ref, d_ours = g[keep], d_ref[keep], d_ours[keep]
    u_torch = g / (np.abs(g) + eps)  # the first step of Adam, bias corrections exact
    bc1, bc2 = float(np.float32(1) - np.float32(b1)), float(np.float32(1) - np.float32(b2))  # optax's, float32
    u_optax = ((1 - b1) * g / bc1) / (np.sqrt((1 - b2) * g**2 / bc2) + eps)
    predicted = np.median(u_optax / u_torch)
    assert 1 - predicted > 6e-6
    # CleanRL's step is the exact formula; ours is shorter by the predicted factor (medians over ~3200
    # coordinates; each ratio carries up to ~4e-6 of float32 rounding of p0 and p1)
    assert abs(np.median(d_ref / (-lr * u_torch)) - 1) < 3e-7
    assert abs(np.median(d_ours / d_ref) - predicted) < 3e-7
