"""Fixture generator: NeuBay's world model, uncertainty, LRU encoder, one agent update and an imagined rollout
from the official code.

Runs the *official* code (JAX + Equinox) on fixed data, fixed weights and fixed random draws, and writes
inputs, weights and outputs to ``tests/fixtures/neubay_reference.npz``, which ``tests/test_fidelity_neubay.py``
compares against ``agents/neubay.py`` / ``agents/dynamics/`` / ``networks/recurrent.py`` without Equinox.

Reference (read from a fetched snapshot, never copied into this repository): twni2016/neubay (Ni et al.,
arXiv 2512.04341).  Executed as they stand:

* ``offline_world/cont_ensemble.py``: ``LearnedContEnv.train_model`` (the ensemble's AdamW training: one
  epoch, each member its own permutation of the training split), ``LearnedContEnv.load_model_and_data``
  (the saved model reloaded, the elites by holdout MSE, the uncertainty over the dataset, its quantile
  threshold and the penalty's scale), ``LearnedContEnv.step`` (one imagined step of every elite) and
  ``LearnedContEnv.reset`` (the prefixes);
* ``experience/collector.py`` (``ContCollector.__call__``: the actor warmed up on the padded prefixes, then
  stepped in the learned env until every row has ended, the tapes it returns for the buffer),
  ``experience/world_buffer.py`` (``get_history_dataset``, ``HistorySampler``) and ``experience/evaluator.py``
  (``Transition``);
* ``offline_world/modules.py`` (``Scaler``, ``EnsembleContModel``, ``ContModel``, ``ModelBlock``,
  ``soft_clamp``, ``update_selected_members``, ``subselect_members``) and ``offline_world/losses.py``
  (``get_train_loss``, ``get_mse_and_unc``, ``get_nll_and_unc``);
* ``memory/lru.py`` and ``memory/module.py`` (``StackedLRU``); ``online_rl/common.py``,
  ``online_rl/ac_modules.py`` (``RecurrentCritic``, ``RecurrentActor``, ``Alpha``, ``select_critics``) and
  ``online_rl/ac_losses.py`` (``sac_q_loss``, ``sac_pi_loss``, ``sac_alpha_loss``, ``sac_update``);
* from ``offline_cont.py``'s ``main``, the statements that build the agent (from ``key, m1_key, ... =
  random.split(key, 5)`` to ``alpha = Alpha(...)``), its optimizers (``opt_critic_enc = ...`` to the
  ``opt_alpha`` branch) and the update's constants (``gamma`` ... ``backup_entropy``), compiled from the
  reference's source and run with ``configs/d4rl_loco/base.yaml`` (sizes scaled down, below).

Changes made from outside, none touching the reference's code:

* environment and data: ``make_env`` is a stand-in with the shapes (obs 3, action 2 in [-1, 1], episode
  limit 1000); ``world_learning_dataset`` returns a fixed dataset of 60 transitions; ``wandb`` does
  nothing; ``HistorySampler``, ``get_termination_fn`` (never terminating) and ``OracleEnv`` are inert
  (except for the imagination, last).
  ``train_test_split`` is sklearn's, wrapped to also split the row indices with the same ``random_state``
  (recorded, so the test knows the holdout rows).
* sizes: ensemble of 6 members, hidden 8 (4 blocks), batch 16 (48 training rows: 3 whole batches), one
  epoch (``total_epochs=1``) with ``improve_thres=-inf`` (every member keeps its trained params, so the
  saved model is the trained one); 4 elites, ``unc_quantile`` 0.5 (an interpolated quantile, not the max),
  ``penalty_coef`` 1.  Agent: LRU d_model 8, d_hidden 4, 2 layers; heads 2 x 8; 4 critics (2 sampled);
  ``grad_steps`` 100 (the cosine's horizon), ``real_weight`` 0.3, encoder lrs 3e-5; base.yaml's values
  otherwise (gamma 0.99, tau 0.005, head lrs 1e-4, alpha lr 1e-4, clip 1000, init alpha 0.2, target
  entropy -|A|).  base.yaml's ``1e-4``-style values, strings to PyYAML, are read as floats (OmegaConf does).
* target critic: the reference builds it with the online critic's key (identical weights); here it is the
  online critic plus N(0, 0.05^2) on every parameter, so that a bug using the wrong set shows.
* random draws: ``jax.random.normal`` (the policies' distrax samples; the model step's noise) and
  ``jax.random.choice`` (the REDQ target heads) return fixed arrays while ``sac_update`` / ``step`` are
  traced (queued per call, all used: asserted).
* one tape of 12 positions: trajectories at 0-6 and 7-11 (starts at 0 and 7), real prefixes 0-3 and 7-8,
  a termination on transition 10; inputs [s_t, a_{t-1}, r_{t-1}] with zeros at starts (the wrapper's reset).
* a second agent run with ``gradient_scale`` 0.05, where every group's clip acts (the zoo clips encoder
  and head together: a deliberate difference measured by the test), two updates on the same tape.
* the Equinox LayerNorm epsilon is 1e-5 (the zoo's Flax LayerNorms use 1e-6; the test measures it).
* last, ``train_model`` once more with its own stopping rule (``improve_thres`` 0.01, 5 epochs without a member
  improving, no epoch cap), from the same seed (so the same init, asserted): each epoch's holdout MSE per
  member (its ``get_mse_and_unc`` calls, wrapped), the members it improved (``update_selected_members``'
  mask), each epoch's permutation key (the reference's key chain, checked against the last epoch's) and the
  kept ensemble.  It stops at epoch 89; the arrays above are unchanged by it.
* after it, the imagination (``roll/``): ``load_model_and_data`` again with an episode limit of 6 (``make_env``'s
  stand-in), ``unc_quantile`` 0.6, the reference's ``HistorySampler`` over the 60 rows cut into trajectories
  (terminals and timeouts at fixed rows; ``get_dataset`` returns them) and a termination function
  ``next_state[:, 0] > 2.4``; ``ContCollector`` with the initial actor (sampling: ``deterministic=False``) on
  8 rows (2 per elite) from fixed prefixes (``HistorySampler``'s one ``default_rng(...).integers`` draw returns
  their global indices), run eagerly (``jax.disable_jit``: the actor's and ``_step``'s jitted functions would
  keep the first trace's draws) with each step's action noise and model noise queued.  Asserted: the rows
  end every way (a whole-trajectory prefix, termination and the uncertainty cut after more than one step,
  the episode limit), and no uncertainty lies within 0.1% of the threshold nor a state within 1e-3 of the
  termination bound.  Recorded: the tapes, each step's uncertainty, the draws used; the earlier arrays are
  unchanged (its random draws come after theirs).

Usage, in a venv of its own (never the project's venv)::

    python3 -m venv /tmp/neubayvenv && /tmp/neubayvenv/bin/pip install jax==0.5.3 jaxlib==0.5.3 \\
        equinox==0.12.2 distrax==0.1.5 optax==0.2.5 tensorflow-probability==0.25.0 jaxtyping==0.3.2 \\
        chex==0.1.89 numpy==2.2.6 scikit-learn==1.7.0 pyyaml==6.0.2 tqdm
    /tmp/neubayvenv/bin/python scripts/fidelity/neubay_reference.py --neubay /work/.mirror/twni2016+neubay/repo

``--neubay``: a git directory (bare or work tree) of the fetched snapshot; files are read at ``HEAD`` with
``git show`` and the commit is recorded in the fixture.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import json
import math
import os
import re
import shlex
import tempfile
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from sklearn.model_selection import train_test_split
from snapshot import compile_reference, fixture_path, load_definitions, locals_at_return, read_snapshot

jax.config.update("jax_platform_name", "cpu")

FILES = {
    "modules": "offline_world/modules.py",
    "losses": "offline_world/losses.py",
    "ensemble": "offline_world/cont_ensemble.py",
    "memory": "memory/module.py",
    "lru": "memory/lru.py",
    "common": "online_rl/common.py",
    "ac_modules": "online_rl/ac_modules.py",
    "ac_losses": "online_rl/ac_losses.py",
    "main": "offline_cont.py",
    "config": "configs/d4rl_loco/base.yaml",
    "collector": "experience/collector.py",
    "world_buffer": "experience/world_buffer.py",
    "evaluator": "experience/evaluator.py",
}
OBS, ACT, ROWS = 3, 2, 60
WORLD = dict(
    total_size=6,
    hidden_size=8,
    has_ln=True,
    total_epochs=1,
    max_epochs_since_update=5,
    improve_thres=-math.inf,
    batch_size=16,
    lr=1e-3,
)  # weight_decay: base.yaml's
ELITES, QUANTILE, PENALTY, STEP_ROWS = 4, 0.5, 1.0, 2
MEMORY = dict(d_model=8, d_hidden=4, n_layers=2)
HEADS = dict(head_d_hidden=8, head_n_layers=2, num_critics=4)
TRAIN = dict(grad_steps=100, real_weight=0.3, critic_enc_lr=3e-5, actor_enc_lr=3e-5)
T, STARTS, REAL, TERMINATED = 12, (0, 7), (0, 1, 2, 3, 7, 8), (10,)
CLIP_SMALL = 0.05
ACT_BATCH, ACT_STEPS, ACT_RESTART = 3, 3, (2, 1)  # acting: 3 episodes, 3 steps, row 1 restarts at step 2


class Draws:
    """Fixed results of ``jax.random.normal`` / ``jax.random.choice``, popped in call order."""

    def __init__(self):
        self.normals, self.choices = [], []

    def normal(self, key, shape=(), dtype=jnp.float32):
        eps = self.normals.pop(0)
        assert eps.size == math.prod(shape), (eps.shape, shape)
        return jnp.asarray(eps, dtype).reshape(shape)

    def choice(self, key, a, shape=(), replace=True, p=None, axis=0):
        idx = self.choices.pop(0)
        assert not replace and p is None and tuple(shape) == idx.shape and int(a) > idx.max(), (a, shape, replace)
        return jnp.asarray(idx, jnp.int32)

    @contextlib.contextmanager
    def queued(self, normals=(), choices=(), exact=True):
        """``exact``: every queued draw must be used (else the caller counts what is left)."""
        self.normals, self.choices = list(normals), list(choices)
        saved = jax.random.normal, jax.random.choice
        jax.random.normal, jax.random.choice = self.normal, self.choice
        try:
            yield
        finally:
            jax.random.normal, jax.random.choice = saved
        assert not exact or (not self.normals and not self.choices), "fixed draws left unused"


def leaves(tree) -> dict:
    """``{path: array}`` of an Equinox tree's float arrays (paths as ``jax.tree_util.keystr`` writes them)."""
    params = eqx.filter(tree, eqx.is_inexact_array)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def record(out: dict, prefix: str, tree):
    for k, v in leaves(tree).items():
        out[f"{prefix}/{k}"] = v


def floats(tree):
    """base.yaml's values as Hydra's OmegaConf reads them: ``1e-4`` (a string to PyYAML) is a float."""
    if isinstance(tree, dict):
        return {k: floats(v) for k, v in tree.items()}
    if isinstance(tree, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", tree):
        return float(tree)
    return tree


def main_statements(source: str, first: str, last: str):
    """The statements of ``offline_cont.py``'s ``main`` from the one assigning ``first`` to the one
    whose source mentions ``last`` (inclusive)."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    seg = [ast.get_source_segment(source, n) for n in fn.body]
    start = next(i for i, s in enumerate(seg) if s.startswith(first))
    end = next(i for i in range(start, len(seg)) if last in seg[i])
    return fn.body[start : end + 1]


def load_reference(src: dict, stand_ins: dict) -> dict:
    memory_ns = load_definitions(src["memory"], FILES["memory"], {"MemoryModule"})
    lru_ns = load_definitions(
        src["lru"],
        FILES["lru"],
        {
            "parallel_scan",
            "binary_operator_diag",
            "wrapped_associative_update",
            "matrix_init",
            "nu_init",
            "theta_init",
            "gamma_log_init",
            "LRU",
            "SequenceLayer",
            "StackedLRU",
        },
        {"MemoryModule": memory_ns["MemoryModule"]},
    )
    common_ns = load_definitions(
        src["common"],
        FILES["common"],
        {"Block", "default_init", "final_linear", "huber", "soft_update", "get_optimizer"},
    )
    acm_ns = load_definitions(
        src["ac_modules"],
        FILES["ac_modules"],
        {
            "CriticHead",
            "RecurrentCritic",
            "_select_tree",
            "select_critics",
            "TanhNormal",
            "FixedDistrax",
            "ActorHead",
            "RecurrentActor",
            "Alpha",
        },
        {"Block": common_ns["Block"], "final_linear": common_ns["final_linear"]},
    )
    acl_ns = load_definitions(
        src["ac_losses"],
        FILES["ac_losses"],
        {"sac_q_loss", "sac_pi_loss", "sac_alpha_loss", "sac_update"},
        {
            "soft_update": common_ns["soft_update"],
            "huber": common_ns["huber"],
            "select_critics": acm_ns["select_critics"],
        },
    )
    modules_ns = load_definitions(
        src["modules"],
        FILES["modules"],
        {
            "Scaler",
            "update_selected_members",
            "subselect_members",
            "soft_clamp",
            "ModelBlock",
            "ContModel",
            "EnsembleContModel",
        },
    )
    losses_ns = load_definitions(
        src["losses"], FILES["losses"], {"get_nll_and_unc", "get_mse_and_unc", "get_train_loss"}
    )
    world_ns = load_definitions(
        src["ensemble"],
        FILES["ensemble"],
        {"_step", "LearnedContEnv"},
        {
            **{
                k: modules_ns[k]
                for k in ("EnsembleContModel", "update_selected_members", "subselect_members", "Scaler")
            },
            **{k: losses_ns[k] for k in ("get_mse_and_unc", "get_train_loss")},
            **stand_ins,
        },
    )
    return {
        "lru": lru_ns,
        "common": common_ns,
        "ac_modules": acm_ns,
        "ac_losses": acl_ns,
        "modules": modules_ns,
        "losses": losses_ns,
        "world": world_ns,
    }


def load_world(world, save_dir: str, quantile: float):
    """The reference's ``LearnedContEnv.load_model_and_data`` on the fitted stand-in ensemble in ``save_dir``."""
    world.load_model_and_data(
        domain="stand-in",
        dataset_name="toy",
        save_dir=save_dir,
        plot_dir=save_dir,
        model_seed=0,
        ensemble_size=ELITES,
        penalty_coef=PENALTY,
        unc_quantile=quantile,
        unc_type="epi_mean",
    )


def dataset(rng):
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    obs = f32(rng.normal(size=(ROWS, OBS)) * [1.0, 0.5, 2.0] + [0.3, -1.0, 0.0])
    act = f32(rng.uniform(-1, 1, size=(ROWS, ACT)))
    w, v = rng.normal(size=(OBS, OBS)), rng.normal(size=(ACT, OBS))
    delta = 0.3 * np.tanh(obs @ w * 0.5 + act @ v) + 0.05 * rng.normal(size=(ROWS, OBS))
    rew = obs[:, 0] - 0.5 * act[:, 1] ** 2 + 0.1 * rng.normal(size=ROWS)
    return {"observations": obs, "actions": act, "next_observations": f32(obs + delta), "rewards": f32(rew)}


def tape(rng, in_dim):
    """One tape of T positions (the reference's layout: observation (T, S+A+1), ...)."""
    start = np.zeros(T, bool)
    start[list(STARTS)] = True
    obs = rng.normal(size=(T, OBS)).astype(np.float32)
    action = rng.uniform(-0.95, 0.95, size=(T, ACT)).astype(np.float32)
    reward = rng.normal(size=T).astype(np.float32)
    prev_a = np.where(start[:, None], 0.0, np.roll(action, 1, axis=0))
    prev_r = np.where(start, 0.0, np.roll(reward, 1))
    observation = np.concatenate([obs, prev_a, prev_r[:, None]], axis=-1).astype(np.float32)
    assert observation.shape == (T, in_dim)
    real = np.isin(np.arange(T), REAL)
    terminated = np.isin(np.arange(T), TERMINATED)
    return {
        "observation": observation,
        "action": action,
        "next_reward": reward,
        "start": start,
        "next_terminated": terminated,
        "next_truncated": np.zeros(T, bool),
        "real": real,
    }


# the posterior fit to its early stop (after everything above, whose arrays it leaves as they were): the
# reference's own rule (improve_thres 0.01, 5 epochs without a member improving), from the same init
FIT_WORLD = dict(WORLD, total_epochs=None, improve_thres=0.01)  # lr 1e-3 (base.yaml's); stops at epoch 89


def run_fit(ref, world_kw: dict, save_dir: str, created: list, out: dict) -> int:
    """``LearnedContEnv.train_model`` to its early stop: each epoch's holdout MSE per member (its
    ``get_mse_and_unc`` calls on the holdout rows), the members it improved (``update_selected_members``'
    mask), each epoch's permutation key (the reference's key chain: ``PRNGKey(seed)``, split off the model
    key, then the evaluation key, then one per epoch; checked against the last epoch's), the kept ensemble."""
    world_ns = ref["world"]
    calls, masks, logs = [], {}, []
    mse_and_unc, update_members, wandb = (
        world_ns["get_mse_and_unc"],
        world_ns["update_selected_members"],
        world_ns["wandb"],
    )

    def recording_mse(model, x, y):
        result = mse_and_unc(model, x, y)
        calls.append(np.asarray(result[0]))
        return result

    def recording_update(best, current, improved):
        masks[len(logs)] = np.asarray(improved)  # logged epochs so far = this epoch's index
        return update_members(best, current, improved)

    world_ns["get_mse_and_unc"], world_ns["update_selected_members"] = recording_mse, recording_update
    world_ns["wandb"] = SimpleNamespace(init=lambda **k: None, log=lambda row, *a, **k: logs.append(dict(row)))
    first = len(created)
    world, frames = ref["world"]["LearnedContEnv"](), {}
    try:
        with locals_at_return({"train_model"}, frames):
            world.train_model(
                domain="stand-in", dataset_name="fit", seed=0, save_dir=save_dir, plot_dir=save_dir, **world_kw
            )
    finally:
        world_ns["get_mse_and_unc"], world_ns["update_selected_members"], world_ns["wandb"] = (
            mse_and_unc,
            update_members,
            wandb,
        )
    tm = frames["train_model"]
    epochs = int(tm["epoch"])
    # calls: holdout and training subset before the loop, the same pair each epoch, the kept ensemble's holdout
    assert len(calls) == 2 * epochs + 3, (len(calls), epochs)
    out["fit/val_mse"] = np.stack([calls[2 * e] for e in range(epochs + 1)])  # epoch 0 (before training) .. stop
    out["fit/final_val_mse"] = calls[-1]
    out["fit/improved"] = np.stack(
        [np.zeros(world_kw["total_size"], bool)]
        + [masks.get(e, np.zeros(world_kw["total_size"], bool)) for e in range(1, epochs + 1)]
    )
    assert [int(r["num_improved"]) for r in logs[1:]] == out["fit/improved"][1:].sum(1).tolist()
    key = jax.random.PRNGKey(0)
    key, _ = jax.random.split(key)  # the model's key
    key, _ = jax.random.split(key)  # the evaluation rows' key
    perm_keys = []
    for _ in range(epochs):
        key, perm_key = jax.random.split(key)
        perm_keys.append(np.asarray(perm_key))
    assert np.array_equal(perm_keys[-1], np.asarray(tm["perm_key"]))
    out["fit/perm_keys"] = np.stack(perm_keys)
    record(out, "fit/kept", world.ensemble)
    init = leaves(created[first])
    assert all(np.array_equal(v, out[f"wm/init/{k}"]) for k, v in init.items())  # seed 0: the same init as above
    return epochs


# imagination past one step: the dataset's 60 rows cut into trajectories (the rows ending one: terminals and
# timeouts; the env's episode limit ROLL_H cuts the longer ones), 8 rows imagined (2 per elite) from fixed
# prefixes (trajectory, t0) until each ends, the actor sampling its actions
ROLL_H, ROLL_QUANTILE, ROLL_ROWS = 6, 0.6, 8
ROLL_TERMINALS, ROLL_TIMEOUTS = (3, 22, 33), (9, 17, 28, 45)
ROLL_PREFIXES = ((0, 4), (1, 0), (1, 3), (2, 1), (3, 2), (4, 5), (5, 0), (6, 2))
ROLL_TERM_DIM, ROLL_TERM_ABOVE = 0, 2.4  # the termination function: next_state[:, 0] > 2.4


@contextlib.contextmanager
def fixed_integers(values):
    """``np.random.default_rng(seed).integers(high, size)`` returns ``values`` (``HistorySampler.sample``'s one
    draw: the global indices of the prefixes' last states), once."""
    saved, calls = np.random.default_rng, []

    class Fixed:
        def integers(self, high, size=None):
            calls.append(int(high))
            assert size == len(values) and int(np.max(values)) < high, (high, size)
            return np.asarray(values)

    np.random.default_rng = lambda seed=None: Fixed()
    try:
        yield calls
    finally:
        np.random.default_rng = saved
    assert len(calls) == 1, calls


def run_rollout(src: dict, ref: dict, data: dict, pi_network, draws: Draws, rng, save_dir: str, out: dict) -> dict:
    """``ContCollector.__call__`` (the actor's warm-up on the padded prefixes, then ``LearnedContEnv.step``
    until every row has ended) on a ``LearnedContEnv`` loaded as in section 2, with the episode limit
    ``ROLL_H``, the quantile ``ROLL_QUANTILE``, the reference's ``HistorySampler`` over the dataset's rows
    cut into trajectories, fixed prefixes and fixed draws (the actor's samples, each step's model noise)."""
    world_ns = ref["world"]
    evaluator_ns = load_definitions(src["evaluator"], FILES["evaluator"], {"Transition"})
    flags = {
        k: np.isin(np.arange(ROWS), rows) for k, rows in (("terminals", ROLL_TERMINALS), ("timeouts", ROLL_TIMEOUTS))
    }
    history_data = {**data, **flags}
    buffer_ns = load_definitions(
        src["world_buffer"],
        FILES["world_buffer"],
        {"tuple_keys", "get_history_dataset", "HistorySampler"},
        {"Transition": evaluator_ns["Transition"], "get_dataset": lambda domain, env, **kw: dict(history_data)},
    )
    collector_ns = load_definitions(src["collector"], FILES["collector"], {"ContCollector"})
    box = lambda n: SimpleNamespace(shape=(n,), low=-np.ones(n, np.float32), high=np.ones(n, np.float32))  # noqa
    env = SimpleNamespace(_max_episode_steps=ROLL_H, observation_space=box(OBS), action_space=box(ACT))

    def terminate(states, action, next_state):
        return np.asarray(next_state)[:, ROLL_TERM_DIM] > ROLL_TERM_ABOVE

    swapped = {
        "make_env": lambda domain, name: env,
        "HistorySampler": buffer_ns["HistorySampler"],
        "get_termination_fn": lambda name: terminate,
    }
    saved = {k: world_ns[k] for k in swapped}
    world_ns.update(swapped)
    world = world_ns["LearnedContEnv"]()
    try:
        load_world(world, save_dir, ROLL_QUANTILE)
    finally:
        world_ns.update(saved)
    assert world.max_horizon == world.max_rollout_len == ROLL_H
    sampler = world.history_sampler
    firsts = np.r_[0, sampler.cum_lengths[:-1]]
    global_idx = np.array([firsts[k] + t0 for k, t0 in ROLL_PREFIXES])
    lengths = np.diff(np.r_[0, sampler.cum_lengths]) - 1  # transitions per trajectory
    assert all(0 <= t0 <= lengths[k] for k, t0 in ROLL_PREFIXES)

    steps, step = [], world.step

    def recording_step(action, key):
        result = step(action, key)
        steps.append(np.asarray(result[-1]))  # the uncertainty of each row's (s, a)
        return result

    world.step = recording_step
    per = ROLL_ROWS // ELITES
    action_noise = rng.standard_normal((ROLL_H, ROLL_ROWS, ACT)).astype(np.float32)
    model_noise = rng.standard_normal((ROLL_H, ELITES, per, OBS + 1)).astype(np.float32)
    queue = [x for k in range(ROLL_H) for x in (action_noise[k], model_noise[k])]  # warm-up's action first
    # eagerly (no jit): the actor's and the step's jitted functions would keep their first draw
    with fixed_integers(global_idx), jax.disable_jit(), draws.queued(normals=queue, exact=False):
        tapes, metrics = collector_ns["ContCollector"](world)(
            eqx.nn.inference_mode(pi_network),
            deterministic=False,
            start_from_s0=False,
            parallel_size=ROLL_ROWS,
            key=jax.random.PRNGKey(11),
        )
    n_steps = len(steps)
    assert len(draws.normals) == 2 * (ROLL_H - n_steps), (len(draws.normals), n_steps)  # each step: a, noise

    positions = np.array([len(t["observation"]) for t in tapes])  # transitions + 1
    t0 = np.array([t0 for _, t0 in ROLL_PREFIXES])
    assert np.array_equal(np.array([t["real"][:-1].sum() for t in tapes]), t0)
    imagined = positions - 1 - t0  # the reference's first_done_idx
    unc = np.stack(steps)  # (steps, rows)

    def padded(key, width=ROLL_H + 1):
        first = np.asarray(tapes[0][key])
        x = np.zeros((ROLL_ROWS, width) + first.shape[1:], first.dtype)
        for i, t in enumerate(tapes):
            x[i, : len(t[key])] = t[key]
        return x

    for key in ("observation", "start", "action", "next_reward", "next_terminated", "next_truncated", "real"):
        out[f"roll/tape_{key}"] = padded(key)
    out.update(
        {
            "roll/tape_positions": positions.astype(np.int32),
            "roll/terminals": flags["terminals"],
            "roll/timeouts": flags["timeouts"],
            "roll/global_idx": global_idx.astype(np.int32),
            "roll/threshold": np.float32(world.unc_thres),
            "roll/penalty_coef": np.float32(world.penalty_coef),
            "roll/unc": unc,
            "roll/action_noise": action_noise[:n_steps],
            "roll/model_noise": model_noise[:n_steps],
            "roll/data_size": np.int32(metrics["data_size"]),
        }
    )

    # how each row ended, and how far every decision was from its boundary
    thr = float(world.unc_thres)
    ended, margin_unc, margin_term = [], math.inf, math.inf
    for i, tape in enumerate(tapes):
        if imagined[i] == 0:
            ended.append("prefix")
            continue
        last = positions[i] - 2  # the last transition
        term, trunc = bool(tape["next_terminated"][last]), bool(tape["next_truncated"][last])
        u = unc[imagined[i] - 1, i]
        ended.append("terminated" if term else "uncertainty" if u > thr else "horizon")
        assert term or trunc
        for k in range(imagined[i]):
            margin_unc = min(margin_unc, abs(float(unc[k, i]) - thr) / thr)
            s = tape["observation"][t0[i] + 1 + k, ROLL_TERM_DIM]
            margin_term = min(margin_term, abs(float(s) - ROLL_TERM_ABOVE))
    print(
        f"imagination: {n_steps} steps, threshold {thr:.4g}; rows (t0, imagined, end): "
        + ", ".join(f"({a}, {b}, {c})" for a, b, c in zip(t0, imagined, ended))
        + f"; closest uncertainty {margin_unc:.3g} of the threshold, closest termination {margin_term:.3g}"
    )
    assert {"prefix", "terminated", "uncertainty", "horizon"} <= set(ended), ended
    inside = [e for e, n in zip(ended, imagined) if n >= 2]  # ended after its first imagined step
    assert "terminated" in inside and "uncertainty" in inside, list(zip(ended, imagined))
    assert margin_unc > 1e-3 and margin_term > 1e-3, (margin_unc, margin_term)
    return {
        "horizon": ROLL_H,
        "quantile": ROLL_QUANTILE,
        "rows": ROLL_ROWS,
        "penalty": PENALTY,
        "terminals": list(ROLL_TERMINALS),
        "timeouts": list(ROLL_TIMEOUTS),
        "prefixes": [list(p) for p in ROLL_PREFIXES],
        "terminate": {"dim": ROLL_TERM_DIM, "above": ROLL_TERM_ABOVE},
        "steps": n_steps,
        "ended": ended,
        "closest_uncertainty": margin_unc,
        "closest_termination": margin_term,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--neubay", required=True, help="git dir of the fetched twni2016/neubay snapshot")
    p.add_argument(
        "--out",
        default=fixture_path("neubay_reference.npz"),
    )
    a = p.parse_args()
    snap = {k: read_snapshot(a.neubay, f) for k, f in FILES.items()}
    commit = snap["main"][1]
    assert all(c == commit for _, c in snap.values())
    src = {k: s for k, (s, _) in snap.items()}
    config = floats(yaml.safe_load(src["config"]))
    rng = np.random.default_rng(5)
    out = {}

    # ------------------------------------------------------------------ stand-ins for env, data, logging
    data = dataset(rng)
    split_idx = {}

    def split_with_rows(inputs, targets, test_size, random_state):
        rows = np.arange(len(inputs))
        x_tr, x_va, y_tr, y_va, r_tr, r_va = train_test_split(
            inputs, targets, rows, test_size=test_size, random_state=random_state
        )
        split_idx["train"], split_idx["valid"] = r_tr, r_va
        return x_tr, x_va, y_tr, y_va

    box = lambda n: SimpleNamespace(shape=(n,), low=-np.ones(n, np.float32), high=np.ones(n, np.float32))  # noqa
    env = SimpleNamespace(_max_episode_steps=1000, observation_space=box(OBS), action_space=box(ACT))
    created = []
    stand_ins = {
        "make_env": lambda domain, name: env,
        "world_learning_dataset": lambda domain, env: data,
        "wandb": SimpleNamespace(init=lambda **k: None, log=lambda *a, **k: None),
        "HistorySampler": lambda domain, env: None,
        "OracleEnv": lambda name: None,
        "get_termination_fn": lambda name: lambda s, a, ns: np.zeros(len(s), bool),
        "train_test_split": split_with_rows,
    }
    ref = load_reference(src, stand_ins)
    Ensemble = ref["modules"]["EnsembleContModel"]

    def recording_ensemble(*args, **kwargs):
        model = Ensemble(*args, **kwargs)
        created.append(model)
        return model

    ref["world"]["EnsembleContModel"] = recording_ensemble
    LearnedContEnv, losses = ref["world"]["LearnedContEnv"], SimpleNamespace(**ref["losses"])
    out.update({f"data/{k}": v for k, v in data.items()})

    # ------------------------------------------------------------------ 1. world model: one epoch of training
    wm = dict(WORLD, weight_decay=config["ensemble"]["weight_decay"])
    save_dir = tempfile.mkdtemp(prefix="neubay_ref_")
    world, frames = LearnedContEnv(), {}
    with locals_at_return({"train_model"}, frames):
        world.train_model(domain="stand-in", dataset_name="toy", seed=0, save_dir=save_dir, plot_dir=save_dir, **wm)
    tm = frames["train_model"]
    initial = created[0]
    record(out, "wm/init", initial)
    record(out, "wm/trained", world.ensemble)
    out["wm/perm_key"] = np.asarray(tm["perm_key"])
    out["wm/perm"] = np.asarray(tm["perm_heads"]).astype(np.int32)
    out["wm/valid_rows"], out["wm/train_rows"] = (split_idx[k].astype(np.int32) for k in ("valid", "train"))
    out["wm/X_train"], out["wm/Y_train"] = np.asarray(tm["X_train"]), np.asarray(tm["Y_train"])
    out["wm/X_valid"], out["wm/Y_valid"] = np.asarray(tm["X_valid"]), np.asarray(tm["Y_valid"])
    assert tm["num_batches"] * wm["batch_size"] == tm["num_samples"] == 48  # whole batches only (ours drop a tail)
    scaler = world.scaler
    out.update(
        {
            f"wm/scaler_{k}": np.asarray(getattr(scaler, k), np.float32)
            for k in ("input_mean", "input_std", "output_mean", "output_std")
        }
    )
    out["wm/val_mse_epoch1"] = np.asarray(tm["mse_valid"])
    assert bool(np.all(tm["improved"]))

    # predictions of the trained ensemble on the holdout rows, the NLL on one batch at the initial weights
    (mu, sigma), unc = eqx.nn.inference_mode(world.ensemble).forward_same_data(jnp.asarray(tm["X_valid"]))
    out["wm/mu"], out["wm/sigma"] = np.asarray(mu), np.asarray(sigma)
    out["wm/unc_epi_mean"] = np.asarray(unc["epi_mean"])
    nll, _, _ = losses.get_nll_and_unc(
        eqx.nn.inference_mode(world.ensemble), jnp.asarray(tm["X_valid"]), jnp.asarray(tm["Y_valid"])
    )
    out["wm/nll_same_data"] = np.asarray(nll)
    batch = np.asarray(tm["perm_heads"])[:, : wm["batch_size"]]
    xb, yb = jnp.asarray(tm["X_train"])[batch], jnp.asarray(tm["Y_train"])[batch]
    loss, grads = losses.get_train_loss(initial, xb, yb)
    out["wm/first_batch"], out["wm/first_loss"] = batch.astype(np.int32), np.float32(loss)
    record(out, "wm/first_grad", grads)

    # ------------------------------------------------------------------ 2. reload: elites, uncertainty, threshold
    world2, frames = LearnedContEnv(), {}
    with locals_at_return({"load_model_and_data"}, frames):
        load_world(world2, save_dir, QUANTILE)
    lm = frames["load_model_and_data"]
    out["unc/val_mse"], out["unc/elites"] = np.asarray(lm["mse_valid"]), np.asarray(lm["best_idx"]).astype(np.int32)
    out["unc/all_unc"] = np.asarray(lm["all_unc"])  # train rows (in split order), then the holdout rows
    out["unc/threshold"], out["unc/avg"] = np.float32(world2.unc_thres), np.float32(world2.avg_train_unc)
    out["unc/penalty_coef"] = np.float32(world2.penalty_coef)
    assert np.unique(out["unc/all_unc"]).size == ROWS

    # ------------------------------------------------------------------ 3. one imagined step of every elite
    states = rng.normal(size=(ELITES * STEP_ROWS, OBS)) * [1.0, 0.5, 2.0] + [0.3, -1.0, 0.0]
    states = (states * np.where(np.arange(len(states)) % 4 < 2, 1.0, 4.0)[:, None]).astype(np.float32)  # some far out
    actions = rng.uniform(-1, 1, size=(ELITES * STEP_ROWS, ACT)).astype(np.float32)
    noise = rng.standard_normal((ELITES, STEP_ROWS, OBS + 1)).astype(np.float32)
    world2.states = jnp.asarray(states, jnp.float32)
    world2.timesteps = np.array([0, 998] * (ELITES * STEP_ROWS // 2))  # half the rows reach the limit 1000
    world2.terminateds = np.zeros(len(states), bool)
    world2.truncateds = np.zeros(len(states), bool)
    draws = Draws()
    with draws.queued(normals=[noise]):
        next_obs, reward, terminated, truncated, unc = world2.step(jnp.asarray(actions), jax.random.PRNGKey(0))
    out.update(
        {
            "step/states": np.asarray(states, np.float32),
            "step/actions": actions,
            "step/noise": noise,
            "step/timesteps": np.array([0, 998] * (ELITES * STEP_ROWS // 2), np.int32),
            "step/next_obs": np.asarray(next_obs),
            "step/reward": np.asarray(reward),
            "step/truncated": np.asarray(truncated),
            "step/unc": np.asarray(unc),
        }
    )
    assert 0 < int(np.sum(np.asarray(unc) > world2.unc_thres)) < len(states), "the threshold cuts some rows"

    # ------------------------------------------------------------------ 4. the agent, built by main's statements
    cfg = copy.deepcopy(config)
    cfg["model"]["memory"].update(MEMORY)
    cfg["model"].update(HEADS)
    cfg["train"].update(TRAIN)
    obs_shape, act_shape = (OBS + ACT + 1,), (ACT,)
    ns = {
        "random": jax.random,
        "jnp": jnp,
        "np": np,
        "eqx": eqx,
        "optax": optax,
        "config": cfg,
        "obs_shape": obs_shape,
        "act_shape": act_shape,
        "key": jax.random.PRNGKey(3),
        "StackedLRU": ref["lru"]["StackedLRU"],
        "get_optimizer": ref["common"]["get_optimizer"],
        **{k: ref["ac_modules"][k] for k in ("RecurrentCritic", "RecurrentActor", "Alpha")},
    }
    build = main_statements(src["main"], "key, m1_key", "alpha = Alpha(")
    optim = main_statements(src["main"], "opt_critic_enc = ", "opt_alpha = optax.adam")
    consts = main_statements(src["main"], "gamma = jnp.float32", "backup_entropy = ")
    exec(compile_reference(build + optim, FILES["main"]), ns)
    exec(compile_reference(consts, FILES["main"]), ns)
    q_network, pi_network, alpha = ns["q_network"], ns["pi_network"], ns["alpha"]
    # the target: the online critic plus N(0, 0.05^2) on every parameter (the reference's starts equal)
    params, static = eqx.partition(ns["q_target"], eqx.is_inexact_array)
    flat, treedef = jax.tree_util.tree_flatten(params)
    flat = [x + 0.05 * jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in flat]
    q_target = eqx.combine(jax.tree_util.tree_unflatten(treedef, flat), static)
    record(out, "agent/init/q", q_network)
    record(out, "agent/init/q_target", q_target)
    record(out, "agent/init/pi", pi_network)
    out["agent/init/log_alpha"] = np.asarray(alpha.value)
    tp = tape(rng, obs_shape[0])
    out.update({f"tape/{k}": v for k, v in tp.items()})
    data_t = jax.tree.map(jnp.asarray, tp)

    # (c) the encoders' outputs along the tape (pre-block, then the stacked LRU) and their final states
    for name, net in (("q", q_network), ("pi", pi_network)):
        x = net.pre(data_t["observation"], jax.random.split(jax.random.PRNGKey(0), T))
        y, states = net.memory(x=x, state=net.initial_state(), start=data_t["start"], key=None)
        out[f"lru/{name}_pre"], out[f"lru/{name}_y"] = np.asarray(x), np.asarray(y)
        out[f"lru/{name}_state"] = np.stack([np.asarray(s)[0] for s in states])  # (layers, d_hidden) complex

    # acting: the actor's evaluation branch (batched, one step at a time, memory carried), deterministic
    obs_a = rng.normal(size=(ACT_STEPS, ACT_BATCH, OBS)).astype(np.float32)
    prev_a = rng.uniform(-1, 1, size=(ACT_STEPS, ACT_BATCH, ACT)).astype(np.float32)
    prev_r = rng.normal(size=(ACT_STEPS, ACT_BATCH)).astype(np.float32)
    start_a = np.zeros((ACT_STEPS, ACT_BATCH), bool)
    start_a[0] = True
    start_a[ACT_RESTART] = True
    memory = pi_network.initial_state(ACT_BATCH)
    acts, ys = [], []
    for t in range(ACT_STEPS):
        first = start_a[t][:, None]
        x = np.concatenate([obs_a[t], np.where(first, 0.0, prev_a[t]), np.where(first, 0.0, prev_r[t][:, None])], -1)
        action, memory, y = eqx.nn.inference_mode(pi_network)(
            jnp.asarray(x, jnp.float32)[:, None],
            memory,
            jnp.asarray(start_a[t])[:, None],
            jax.random.PRNGKey(t),
            deterministic=True,
        )
        acts.append(np.asarray(action))
        ys.append(np.asarray(y))
    out.update(
        {
            "act/obs": obs_a,
            "act/prev_action": prev_a,
            "act/prev_reward": prev_r,
            "act/start": start_a,
            "act/action": np.stack(acts),
            "act/y": np.stack(ys),
        }
    )

    # (d) one sac_update with fixed draws: a' noise (critic), a noise (actor), the two target heads
    next_noise = rng.standard_normal((T, ACT)).astype(np.float32)
    pi_noise = rng.standard_normal((T, ACT)).astype(np.float32)
    heads = np.array([3, 1], np.int32)
    out.update({"draws/next_noise": next_noise, "draws/pi_noise": pi_noise, "draws/heads": heads})

    def one_update(ns, q_network, pi_network, alpha, q_target, opt_states):
        return ref["ac_losses"]["sac_update"](
            q_network=q_network,
            pi_network=pi_network,
            alpha=alpha,
            q_target=q_target,
            data=data_t,
            opt_q=ns["opt_q"],
            opt_pi=ns["opt_pi"],
            opt_alpha=ns["opt_alpha"],
            opt_state_q=opt_states[0],
            opt_state_pi=opt_states[1],
            opt_state_alpha=opt_states[2],
            gamma=ns["gamma"],
            tau=ns["tau"],
            real_weight=ns["real_weight"],
            backup_entropy=ns["backup_entropy"],
            loss_key=jax.random.PRNGKey(9),
        )

    opt_states = (ns["opt_state_q"], ns["opt_state_pi"], ns["opt_state_alpha"])
    with draws.queued(normals=[next_noise, pi_noise], choices=[heads]):
        q1, pi1, alpha1, qt1, *_, metrics = one_update(ns, q_network, pi_network, alpha, q_target, opt_states)
    for k in (
        "loss_q",
        "loss_q_real",
        "loss_q_imag",
        "loss_pi",
        "loss_pi_real",
        "loss_pi_imag",
        "alpha",
        "real_pi_entropy",
        "imag_pi_entropy",
        "grad_q_norm",
        "grad_pi_norm",
    ):
        out[f"update/{k}"] = np.float32(metrics[k])
    record(out, "update/q", q1)
    record(out, "update/q_target", qt1)
    record(out, "update/pi", pi1)
    out["update/log_alpha"] = np.asarray(alpha1.value)

    # the clip acting: gradient_scale 0.05, two updates on the same tape (the fixed draws serve both)
    cfg_clip = copy.deepcopy(cfg)
    cfg_clip["train"]["gradient_scale"] = CLIP_SMALL
    ns_clip = dict(ns, config=cfg_clip)
    exec(compile_reference(optim, FILES["main"]), ns_clip)
    state = (
        q_network,
        pi_network,
        alpha,
        q_target,
        (ns_clip["opt_state_q"], ns_clip["opt_state_pi"], ns_clip["opt_state_alpha"]),
    )
    with draws.queued(normals=[next_noise, pi_noise], choices=[heads]):
        for i in range(2):
            q_, pi_, al_, qt_, oq, op, oa, m = one_update(ns_clip, *state)
            state = (q_, pi_, al_, qt_, (oq, op, oa))
            assert float(m["grad_q_norm"]) > CLIP_SMALL and float(m["grad_pi_norm"]) > CLIP_SMALL
    record(out, "clip/q", state[0])
    record(out, "clip/pi", state[1])

    # ------------------------------------------------------------------ 5. the posterior fit to its early stop
    fit_world = dict(FIT_WORLD, weight_decay=config["ensemble"]["weight_decay"])
    fit_epochs = run_fit(ref, fit_world, save_dir, created, out)

    # ------------------------------------------------------------------ 6. imagination past one step
    rollout = run_rollout(src, ref, data, pi_network, draws, rng, save_dir, out)

    command = f"/tmp/neubayvenv/bin/python scripts/fidelity/neubay_reference.py --neubay {shlex.quote(a.neubay)}"
    meta = {
        "generator": "scripts/fidelity/neubay_reference.py",
        "command": command,
        "versions": {
            "jax": jax.__version__,
            "equinox": eqx.__version__,
            "optax": optax.__version__,
            "numpy": np.__version__,
        },
        "neubay": {"repository": "https://github.com/twni2016/neubay", "commit": commit, "files": list(FILES.values())},
        "world": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in wm.items()},
        "fit": {**fit_world, "epochs_run": fit_epochs},
        "rollout": rollout,
        "elites": ELITES,
        "quantile": QUANTILE,
        "penalty": PENALTY,
        "config": cfg,
        "clip_small": CLIP_SMALL,
        "sizes": {"obs": OBS, "act": ACT, "rows": ROWS, "tape": T},
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    out = {
        k: (v.astype(np.float32) if v.dtype == np.float64 else v)
        for k, v in ((k, np.asarray(v)) for k, v in out.items())
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; neubay {commit}")


if __name__ == "__main__":
    main()
