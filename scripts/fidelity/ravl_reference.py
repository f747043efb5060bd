"""Fixture generator: RAVL's dynamics ensemble, model rollouts and SAC-N / EDAC update from the official code.

Runs the *official* code (anyasims/edge-of-reach, Sims et al. 2024) on fixed weights, a fixed dataset and
fixed random draws, and writes inputs, weights and outputs to ``tests/fixtures/ravl_reference.npz``, which
``tests/test_fidelity_ravl.py`` compares against ``agents/dynamics/``, ``agents/ravl.py`` and
``agents/sac.py`` without torch.

Reference (read from a fetched snapshot, never copied into this repository).  Executed as they stand:

* ``dynamics_training/net.py``: ``Net``, ``BayesianNeuralNetwork``, ``GaussianMSELoss``,
  ``reinitialize_fc_layer_`` and its helpers;
* ``dynamics_training/ensemble.py``: ``Ensemble`` (its ``__init__``, ``load_memory``, ``select_elites``,
  ``get_means_logvars``), ``MeanStdevFilter``, ``TransitionDataset``, ``EnsembleTransitionDataset``,
  ``prepare_data``; ``shared/data_buffer.py``: ``DataBuffer``;
* ``train_dynamics_model.py``: the statements of one training epoch's minibatch loop (the
  ``for x_batch, diff_batch, r_batch in transition_loader:`` loop of ``train``), with the ensemble, its
  torch Adam (the reference's param groups, coupled weight decay) and a one-batch loader;
* ``agent_training/rollout_generation.py``: ``DynamicsModel.transition_function_torch``,
  ``RolloutGenerator.generate_rollouts`` (k = 1), ``get_done_func`` / ``hopper_is_done_func``;
* ``agent_training/agent.py``: ``Actor``, ``VectorizedCritic``, ``VectorizedLinear``, ``Agent``,
  ``soft_update``;
* ``train_ravl_agent.py``: the statements of one epoch's update loop (the
  ``for _ in trange(config.updates_per_epoch, ...)`` loop of ``train``: the real / model batch mix at
  ``int(dataset_ratio * batch_size)`` real rows, ``Agent.update`` with real torch Adam optimizers); the
  defaults of its ``TrainConfig`` and of ``train_dynamics_model.py``'s ``EnsembleTrainConfig`` are
  recorded in ``meta``.

After those, two more runs (their arrays are new; the ones above are unchanged):

* ``RolloutGenerator.generate_rollouts`` with k = 3 from 12 dataset states into an empty one-epoch model
  buffer (the updated actor, the elite-sorted ensemble): each step's draws have the survivors' shape and
  are drawn at the call and recorded (model noise N(0, 0.2^2): at N(0, 1) the model's sigma ends every row
  at the first step);
* ``train_dynamics_model.py``'s ``train`` whole (without ``@pyrallis.wrap()``, which parses argv) on the 24
  rows, lr 0.01, min_epochs 46: an lr cut at epoch 46, an early stop at 51 (asserted).  Stand-ins for gym
  (shapes), d4rl (the dataset), the saver, and the datasets' ``.to("cuda:0")`` (``train`` asserts that
  device; the tensors stay on the CPU).  Recorded: the final split, the bootstrap, each epoch's member deal
  and loader order, each epoch's holdout MSEs (``check_validation_losses`` wrapped), the lr cut, the kept
  weights (loaded at the stop, then sorted by ``select_elites``) and the shared bounds.  The buffers'
  ``default_rng()`` is unseeded in the reference; here it is seeded (5).  The log-variance bounds start at
  (20, -30), far from the outputs (see ``FIT_BOUNDS``).

Order, as the reference's scripts run: the dynamics ensemble's holdout losses and elites
(``select_elites``, on a copy of the initial weights), one Adam step of the ensemble on the training
split, then (on the elite-sorted copy) a one-step rollout of the stochastic actor from 8 dataset
states into the model buffer (which already holds 48 earlier model transitions), then one agent update
on a batch of 2 dataset rows and 38 model-buffer rows (r = 0.05, batch 40).

Changes made from outside, none touching the reference's code:

* sizes: obs 3, act 2 (the Hopper done function reads s[0], s[1], s[1:]; any obs >= 2 works), dynamics
  5 members of 4 x 16 SiLU, 3 elites; agent 3 x 16 ReLU, 4 critics; via the reference's own arguments.
* weights: the reference's own init (``torch.manual_seed``); then the dynamics Linear biases are drawn
  N(0, 0.1^2) (zero biases would hide a bias mix-up) and the shared log-variance bounds are set to
  per-dimension values near the raw log-variances (the defaults 0.5 / -10 leave the lower soft clamp inert);
  the agent's output layers are redrawn with ``reset_parameters`` (EDAC's U(+-3e-3) leaves Q ~ 1e-2),
  the target critics are drawn apart from the online ones, and log alpha = log 0.3.
* random draws: ``Normal.rsample`` is ``loc + eps * scale`` with eps from a fixed queue (as in
  ``sac_reference.py``); ``torch.randn_like`` (the model's sample noise), ``torch.randint`` (the elite per
  row), ``np.random.randint`` (the bootstrap indices of ``EnsembleTransitionDataset``) and the buffers'
  ``_rng.choice`` (the batch rows) return fixed arrays; the epoch's member permutation ``perm`` is fixed;
  ``np.random.shuffle`` of ``load_memory``'s holdout split runs under ``np.random.seed(0)`` and the split
  is recorded.
* device: the reference asserts CUDA; on CPU ``Tensor.get_device()`` is -1, which ``.to()`` rejects, so
  during the rollout it returns "cpu" (on CUDA it returns 0 and ``.to(0)`` keeps the tensor where it is).
* ``tqdm.trange`` (not installed) is ``range``; the logger is a stand-in.
* ``shared/utils.py``'s ``set_seed`` runs as it stands inside ``train`` (its ``gym`` annotation unevaluated).

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 numpy
    /tmp/refvenv/bin/python scripts/fidelity/ravl_reference.py --ravl /work/.mirror/anyasims+edge-of-reach/repo

``--ravl``: a git directory (bare or work tree) of the fetched snapshot; the files are read at ``HEAD``
with ``git show`` and the commit is recorded in the fixture.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import json
import math
import os
import shlex
from types import SimpleNamespace

import numpy as np
import torch
from sac_reference import arr, fixed_normal_draws, frame_locals
from snapshot import compile_reference, fixture_path, load_definitions, read_snapshot

FILES = {
    "net": "dynamics_training/net.py",
    "ensemble": "dynamics_training/ensemble.py",
    "buffer": "shared/data_buffer.py",
    "agent": "agent_training/agent.py",
    "rollout": "agent_training/rollout_generation.py",
    "train_dynamics": "train_dynamics_model.py",
    "train_agent": "train_ravl_agent.py",
    "utils": "shared/utils.py",
}
OBS_DIM, ACT_DIM = 3, 2
MEMBERS, ELITES, DYN_WIDTH = 5, 3, 16
N_DATA, VAL_RATIO = 24, 0.25  # 6 holdout rows, 18 training rows (one minibatch: the loader's batch is 256)
CRITICS, WIDTH, ETA, GAMMA, TAU, LR = 4, 16, 1.0, 0.99, 5e-3, 3e-4
LOG_ALPHA = math.log(0.3)
ROLLOUTS, PREFILL = 8, 48  # 8 one-step rollouts join 48 earlier model transitions: a FIFO of 56
BATCH, RATIO = 40, 0.05  # int(0.05 * 40) = 2 dataset rows, 38 model rows
ENV_NAME = "hopper-medium-v2"
MAX_LOGVAR = [-0.5, -1.0, 0.3, -0.2]  # per (delta s, r) dimension, shared by the members (as the reference)
MIN_LOGVAR = [-1.6, -2.5, -1.2, -1.9]


# ----------------------------------------------------------------------------- reading the reference
def loop_statements(source: str, filename: str, header: str):
    """The ``for`` loop of the reference whose header (target ``in`` iterator, unparsed) starts with ``header``."""
    for node in ast.walk(ast.parse(source, filename)):
        target = ast.unparse(node.target).removeprefix("(").removesuffix(")") if isinstance(node, ast.For) else None
        if target is not None and f"{target} in {ast.unparse(node.iter)}".startswith(header):
            return compile_reference([node], filename, lazy_annotations=True)
    raise SystemExit(f"{filename}: loop `for {header}` not found")


def config_defaults(source: str, filename: str, name: str) -> dict:
    ns = load_definitions(source, filename, {name})
    return {
        f.name: f.default
        for f in dataclasses.fields(ns[name])
        if f.default is not dataclasses.MISSING and isinstance(f.default, (int, float, str, bool, type(None)))
    }


def reference(sources: dict) -> dict:
    """The reference's definitions, wired together as its package imports would (those imports fail here)."""
    net = load_definitions(
        sources["net"],
        FILES["net"],
        {
            "device",
            "Net",
            "BayesianNeuralNetwork",
            "reinitialize_fc_layer_",
            "get_trunc_normal_std",
            "get_weight_bias_parameters_with_decays",
            "GaussianMSELoss",
        },
    )
    buf = load_definitions(sources["buffer"], FILES["buffer"], {"device", "DataBuffer"})
    ens = load_definitions(
        sources["ensemble"],
        FILES["ensemble"],
        {
            "device",
            "Transition",
            "Ensemble",
            "TransitionDataset",
            "EnsembleTransitionDataset",
            "MeanStdevFilter",
            "prepare_data",
        },
        {"Net": net["Net"], "DataBuffer": buf["DataBuffer"]},
    )
    agent = load_definitions(
        sources["agent"],
        FILES["agent"],
        {"VectorizedLinear", "Actor", "VectorizedCritic", "soft_update", "Agent"},
        lazy_annotations=True,
    )
    roll = load_definitions(
        sources["rollout"],
        FILES["rollout"],
        {
            "device",
            "DynamicsModel",
            "RolloutGenerator",
            "get_done_func",
            "hopper_is_done_func",
            "walker2d_is_done_func",
            "halfcheetah_is_done_func",
        },
        {
            "Actor": agent["Actor"],
            "Ensemble": ens["Ensemble"],
            "DataBuffer": buf["DataBuffer"],
            "trange": lambda n, **kw: range(n),
        },
        lazy_annotations=True,
    )
    return {"net": net, "buffer": buf, "ensemble": ens, "agent": agent, "rollout": roll}


# ----------------------------------------------------------------------------- fixed draws
@contextlib.contextmanager
def patched(obj, name: str, value):
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


def returning(array, check=None):
    """A stand-in for one random call: returns ``array`` once (``check(*args, **kw)`` asserts the call)."""
    queue = [array]

    def call(*args, **kw):
        if check is not None:
            check(*args, **kw)
        return queue.pop(0)

    return call


class FixedChoice:
    """Stands in for a ``DataBuffer``'s ``_rng``: ``choice(n, size, replace=False)`` returns fixed rows."""

    def __init__(self, rows):
        self.rows = list(rows)

    def choice(self, n, size, replace=True):
        rows = self.rows.pop(0)
        assert not replace and len(rows) == size and rows.max() < n and len(set(rows.tolist())) == size
        return rows


def named(module: torch.nn.Module, prefix: str, out: dict):
    for k, v in module.state_dict().items():
        out[f"{prefix}/{k}"] = arr(v)


# ----------------------------------------------------------------------------- the dynamics ensemble
def build_ensemble(ref, dataset, defaults: dict):
    ens = ref["ensemble"]
    params = dict(
        ob_dim=OBS_DIM,
        ac_dim=ACT_DIM,
        hidden_dim=DYN_WIDTH,
        seed=0,
        l2_reg_multiplier=1.0,
        num_models=MEMBERS,
        num_elites=ELITES,
        train_memory=N_DATA,
        val_memory=N_DATA,
        train_val_ratio=VAL_RATIO,
        env_name=ENV_NAME,
    )
    ensemble = ens["Ensemble"](params)
    defaults["logvar_init"] = [ensemble.max_logvar[0].item(), ensemble.min_logvar[0].item()]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for model in ensemble.networks.values():
            for layer in model.net.layers:
                layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=g))
        ensemble.max_logvar.copy_(torch.tensor(MAX_LOGVAR))
        ensemble.min_logvar.copy_(torch.tensor(MIN_LOGVAR))
    np.random.seed(0)  # load_memory's holdout split (np.random.shuffle); the split is recorded
    ensemble.load_memory(dataset)
    return ensemble


def run_dynamics(ref, sources, ensemble, rng, out):
    ens = ref["ensemble"]
    for i, model in ensemble.networks.items():
        named(model.net, f"dyn/init/{i}", out)
    out["dyn/init/max_logvar"], out["dyn/init/min_logvar"] = arr(ensemble.max_logvar), arr(ensemble.min_logvar)
    s, a = ensemble.state_filter, ensemble.action_filter
    out["dyn/input_mean"] = np.concatenate([s.mean, a.mean]).astype(np.float32)
    out["dyn/input_std"] = np.concatenate([s.stdev, a.stdev]).astype(np.float32)
    train = ens["Transition"](*ensemble.memory.sample_all())
    val = ens["Transition"](*ensemble.memory_val.sample_all())
    for name, t in (("train", train), ("val", val)):
        for field in ("state", "action", "reward", "nextstate"):
            out[f"dyn/{name}/{field}"] = np.asarray(getattr(t, field), np.float32)

    # holdout MSE and elites, as load_ensemble_model runs them, on a copy of the initial weights
    sorted_ensemble = copy.deepcopy(ensemble)
    sorted_ensemble.set_model_logvar_limits()
    original = {id(m): i for i, m in sorted_ensemble.networks.items()}
    loader = torch.utils.data.DataLoader(
        ens["TransitionDataset"](val, s, a),
        sampler=torch.utils.data.SequentialSampler(range(len(val.state))),
        batch_size=256,
    )
    val_losses = sorted_ensemble.select_elites(loader)
    rank = np.array([original[id(m)] for m in sorted_ensemble.networks.values()], np.int32)
    out["dyn/val_mse_sorted"], out["dyn/rank"] = np.asarray(val_losses, np.float32), rank
    out["dyn/elites_idx"] = np.array(sorted_ensemble._elites_idx, np.int32)
    gaps = np.diff(val_losses) / val_losses[1:]
    assert gaps.min() > 1e-3 and not np.array_equal(rank, np.arange(MEMBERS)), (val_losses, rank)

    # one epoch's minibatch loop of train_dynamics_model.train: one minibatch (18 rows < 256)
    n = len(train.state)
    idxs = rng.integers(0, n, size=(MEMBERS, n))
    perm = rng.permutation(MEMBERS)
    check = lambda high, size: assert_equal((high, tuple(size)), (n, (MEMBERS, n)))  # noqa: E731
    with patched(np.random, "randint", returning(idxs, check)):
        data = ens["EnsembleTransitionDataset"](train, s, a, n_models=MEMBERS)
    loader = [(data.data_X.transpose(0, 1), data.data_y.transpose(0, 1), data.data_r.transpose(0, 1))]
    optimizer = torch.optim.Adam(ensemble.weights, lr=1e-3)  # train(): Adam(ensemble.weights, lr=config.model_lr)
    member_loss, grads = {}, {}
    forward = ref["net"]["Net"].train_model_forward

    def recording_forward(self, *args):
        loss = forward(self, *args)
        member_loss[self] = loss.item()
        return loss

    def recording_step(closure=None):
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[id(p)] = arr(p.grad)
        return torch.optim.Adam.step(optimizer, closure)

    optimizer.step = recording_step
    run = {
        "transition_loader": loader,
        "perm": perm,
        "ensemble": ensemble,
        "optimizer": optimizer,
        "loss": 0,
        "step": 0,
        "total_loss": 0,
    }
    with patched(ref["net"]["Net"], "train_model_forward", recording_forward):
        exec(
            loop_statements(
                sources["train_dynamics"], FILES["train_dynamics"], "x_batch, diff_batch, r_batch in transition_loader"
            ),
            run,
        )
    out["dyn/boot"] = idxs[perm].astype(np.int32)  # the training rows member i saw (x_batch[:, perm][:, i])
    out["dyn/nll"] = np.array([member_loss[ensemble.networks[i]] for i in range(MEMBERS)], np.float32)
    out["dyn/total_nll"] = np.float32(run["total_loss"])  # the sum over members, before the bounds' term
    out["dyn/l2"] = np.array([ensemble.networks[i].net.get_l2_reg_loss().item() for i in range(MEMBERS)], np.float32)
    for i, model in ensemble.networks.items():
        for k, p in model.net.named_parameters():
            out[f"dyn/grad/{i}/{k}"] = grads[id(p)]
        named(model.net, f"dyn/step/{i}", out)
    for k in ("max_logvar", "min_logvar"):
        out[f"dyn/grad/{k}"] = grads[id(getattr(ensemble, k))]
        out[f"dyn/step/{k}"] = arr(getattr(ensemble, k))
    return sorted_ensemble


def assert_equal(got, want):
    assert got == want, (got, want)


# ----------------------------------------------------------------------------- the agent
def build_agent(ref, out):
    ns = ref["agent"]
    torch.manual_seed(1)
    actor = ns["Actor"](OBS_DIM, ACT_DIM, WIDTH)
    critic = ns["VectorizedCritic"](OBS_DIM, ACT_DIM, WIDTH, CRITICS)
    target = ns["VectorizedCritic"](OBS_DIM, ACT_DIM, WIDTH, CRITICS)
    actor.mu.reset_parameters(), actor.log_sigma.reset_parameters()
    critic.critic[-1].reset_parameters(), target.critic[-1].reset_parameters()
    agent = ns["Agent"](
        actor=actor,
        actor_optimizer=torch.optim.Adam(actor.parameters(), lr=LR),
        critic=critic,
        critic_optimizer=torch.optim.Adam(critic.parameters(), lr=LR),
        gamma=GAMMA,
        tau=TAU,
        eta=ETA,
        auto_alpha=True,
        alpha_learning_rate=LR,
        target_entropy=None,
        alpha=0.1,
        device="cpu",
    )
    agent.target_critic = target  # distinct from the online critic (as after any Polyak step)
    with torch.no_grad():
        agent.log_alpha.fill_(LOG_ALPHA)
    agent.alpha = agent.log_alpha.exp().detach()
    for name, net in dict(actor=actor, critic=critic, target=target).items():
        named(net, f"agent/init/{name}", out)
    out["agent/init/log_alpha"] = arr(agent.log_alpha)[0]
    return agent


def run_rollout(ref, sorted_ensemble, actor, model_buffer, start, rng, out):
    """RolloutGenerator.generate_rollouts with k = 1 from ``start`` into ``model_buffer``."""
    roll = ref["rollout"]
    model = roll["DynamicsModel"].__new__(roll["DynamicsModel"])  # its __init__ loads a model from disk
    model.env_name, model.state_dim, model.action_dim = ENV_NAME, OBS_DIM, ACT_DIM
    model.ensemble, model.done_func = sorted_ensemble, roll["get_done_func"](ENV_NAME)
    eps_policy = rng.standard_normal((ROLLOUTS, ACT_DIM)).astype(np.float32)
    noise = rng.standard_normal((ROLLOUTS, MEMBERS, OBS_DIM + 1)).astype(np.float32)
    pick = rng.integers(0, ELITES, ROLLOUTS)
    out["rollout/eps_policy"], out["rollout/noise"] = eps_policy, noise
    out["rollout/elite_pick"] = pick.astype(np.int32)
    gen = roll["RolloutGenerator"](model, actor, steps_k=1, num_rollouts=ROLLOUTS, buffer=model_buffer)
    check_randint = lambda lo, hi, size: assert_equal((lo, hi, tuple(size)), (0, ELITES, (ROLLOUTS,)))  # noqa: E731
    check_noise = lambda means: assert_equal(means.shape, noise.shape)  # noqa: E731
    with (
        fixed_normal_draws([torch.as_tensor(eps_policy)]),
        patched(torch, "randn_like", returning(torch.as_tensor(noise), check_noise)),
        patched(torch, "randint", returning(torch.as_tensor(pick), check_randint)),
        patched(torch.Tensor, "get_device", lambda self: "cpu"),
    ):
        info = gen.generate_rollouts(torch.as_tensor(start))
    assert info["rollouts/transitions_added"] == ROLLOUTS
    states, actions, rewards, next_states, dones = (arr(x) for x in model_buffer.sample_all())
    for k, v in dict(
        obs=states, action=actions, reward=rewards[:, 0], next_obs=next_states, terminated=dones[:, 0]
    ).items():
        out[f"rollout/buffer/{k}"] = v
    done = dones[PREFILL:, 0]
    assert 2 <= done.sum() <= ROLLOUTS - 2, done  # both outcomes of the Hopper done function
    out["rollout/mean_reward"] = np.float32(info["rollouts/mean_reward"])


def run_update(sources, agent, real_buffer, model_buffer, rng, out):
    """One update of train_ravl_agent.train's loop: the real / model batch mix and Agent.update."""
    n_real = int(RATIO * BATCH)
    real_rows, model_rows = rng.permutation(N_DATA)[:n_real], rng.permutation(PREFILL + ROLLOUTS)[: BATCH - n_real]
    real_buffer._rng, model_buffer._rng = FixedChoice([real_rows]), FixedChoice([model_rows])
    out["update/real_rows"], out["update/model_rows"] = real_rows.astype(np.int32), model_rows.astype(np.int32)
    eps = {k: rng.standard_normal((BATCH, ACT_DIM)).astype(np.float32) for k in ("alpha", "actor", "next")}
    for k, v in eps.items():
        out[f"update/eps_{k}"] = v
    logged = []
    run = {
        "trange": lambda n, **kw: range(n),
        "epoch": 0,
        "total_updates": 0,
        "agent": agent,
        "config": SimpleNamespace(updates_per_epoch=1, dataset_ratio=RATIO, batch_size=BATCH, log_every=1),
        "modelfree_buffer": real_buffer,
        "modelbased_buffer": model_buffer,
        "torch": torch,
        "wandb": SimpleNamespace(log=logged.append),
    }
    frame = {}
    torch.manual_seed(2)  # torch.rand_like of update()'s q_random_std (a logged diagnostic only; not recorded)
    with (
        fixed_normal_draws([torch.as_tensor(eps[k]) for k in ("alpha", "actor", "next")]),
        frame_locals("_critic_loss", frame),
    ):
        exec(
            loop_statements(sources["train_agent"], FILES["train_agent"], "_ in trange(config.updates_per_epoch,"), run
        )
    for k, v in zip(("obs", "action", "reward", "next_obs", "terminated"), run["batch"]):
        out[f"update/batch/{k}"] = arr(v[:, 0] if v.shape[-1] == 1 and k in ("reward", "terminated") else v)
    info = logged[0]
    for k in ("alpha_loss", "critic_loss", "actor_loss", "batch_entropy", "alpha", "q_policy_std", "q_policy_mean"):
        out[f"update/info/{k}"] = np.float32(info[k])
    out["update/td_loss"] = arr(frame["critic_loss"])
    out["update/diversity"] = arr(frame["diversity_loss"])
    out["update/y"], out["update/q"] = arr(frame["q_target"][:, 0]), arr(frame["q_values"])
    for name, net in dict(actor=agent.actor, critic=agent.critic, target=agent.target_critic).items():
        named(net, f"update/{name}", out)
    out["update/log_alpha"] = arr(agent.log_alpha)[0]
    for name, net, opt in (
        ("actor", agent.actor, agent.actor_optimizer),
        ("critic", agent.critic, agent.critic_optimizer),
    ):
        for k, p in net.named_parameters():
            out[f"update/exp_avg/{name}/{k}"] = arr(opt.state[p]["exp_avg"])  # 0.1 g after one step
    out["update/exp_avg/log_alpha"] = arr(agent.alpha_optimizer.state[agent.log_alpha]["exp_avg"])[0]


# ----------------------------------------------------------------------------- k-step rollouts
ROLLOUTS_K, HORIZON_K = 12, 3  # 12 start states, k = 3: rows leave the batch as they terminate
ROLLOUT_SEED = 21
NOISE_SCALE_K = 0.2  # model noise N(0, 0.2^2): at N(0, 1) the model's sigma ends every row at the first step


def run_rollouts_k(ref, sorted_ensemble, actor, dataset, rng, out):
    """``RolloutGenerator.generate_rollouts`` with k = 3 into an empty model buffer of one epoch (12 x 3 rows).

    Each step's draws have the survivors' shape (the reference drops a terminated row from the batch): they are
    drawn here at the call (``Normal.rsample``'s eps, ``torch.randn_like``'s model noise, ``torch.randint``'s
    elite per row) and recorded, with the rows they belong to, as full (k, 12, ...) arrays (0 where a row has
    left)."""
    roll = ref["rollout"]
    model = roll["DynamicsModel"].__new__(roll["DynamicsModel"])
    model.env_name, model.state_dim, model.action_dim = ENV_NAME, OBS_DIM, ACT_DIM
    model.ensemble, done_func = sorted_ensemble, roll["get_done_func"](ENV_NAME)
    draws = {"eps": [], "noise": [], "pick": [], "done": []}

    def rsample(self, sample_shape=torch.Size()):
        assert tuple(sample_shape) == ()
        draws["eps"].append(rng.standard_normal(tuple(self.loc.shape)).astype(np.float32))
        return self.loc + torch.as_tensor(draws["eps"][-1]) * self.scale

    def randn_like(x, *args, **kw):
        draws["noise"].append((NOISE_SCALE_K * rng.standard_normal(tuple(x.shape))).astype(np.float32))
        return torch.as_tensor(draws["noise"][-1])

    def randint(low, high, size, *args, **kw):
        assert (low, high) == (0, ELITES)
        draws["pick"].append(rng.integers(low, high, size))
        return torch.as_tensor(draws["pick"][-1])

    def done_fn(next_obs):
        done = done_func(next_obs)
        draws["done"].append(done.numpy().copy())
        return done

    model.done_func = done_fn
    start_rows = rng.integers(0, N_DATA, ROLLOUTS_K)
    buffer = ref["buffer"]["DataBuffer"](
        state_dim=OBS_DIM, action_dim=ACT_DIM, buffer_size=ROLLOUTS_K * HORIZON_K, as_numpy=False
    )
    gen = roll["RolloutGenerator"](model, actor, steps_k=HORIZON_K, num_rollouts=ROLLOUTS_K, buffer=buffer)
    with (
        patched(torch.distributions.Normal, "rsample", rsample),
        patched(torch, "randn_like", randn_like),
        patched(torch, "randint", randint),
        patched(torch.Tensor, "get_device", lambda self: "cpu"),
    ):
        info = gen.generate_rollouts(torch.as_tensor(dataset["observations"][start_rows]))
    assert len(draws["done"]) == HORIZON_K, "a rollout step was skipped (all rows terminated)"
    alive = np.zeros((HORIZON_K, ROLLOUTS_K), bool)
    full = {
        "eps": np.zeros((HORIZON_K, ROLLOUTS_K, ACT_DIM), np.float32),
        "noise": np.zeros((HORIZON_K, ROLLOUTS_K, MEMBERS, OBS_DIM + 1), np.float32),
        "pick": np.zeros((HORIZON_K, ROLLOUTS_K), np.int32),
    }
    rows = np.arange(ROLLOUTS_K)
    for t in range(HORIZON_K):
        alive[t, rows] = True
        for k in full:
            full[k][t, rows] = draws[k][t]
        rows = rows[~draws["done"][t]]
    ended = [int((~alive[t + 1] & alive[t]).sum()) if t + 1 < HORIZON_K else 0 for t in range(HORIZON_K)]
    assert min(ended[:-1]) >= 1 and alive[-1].sum() >= 2, (ended, alive.sum(1))  # rows end at each step; some last
    out["rollk/start_rows"] = start_rows.astype(np.int32)
    out["rollk/alive"] = alive
    for k, v in full.items():
        out[f"rollk/{k}"] = v
    states, actions, rewards, next_states, dones = (arr(x) for x in buffer.sample_all())
    for k, v in dict(
        obs=states, action=actions, reward=rewards[:, 0], next_obs=next_states, terminated=dones[:, 0]
    ).items():
        out[f"rollk/buffer/{k}"] = v
    for k in ("transitions_added", "ave_length", "mean_reward"):
        out[f"rollk/{k}"] = np.float32(info[f"rollouts/{k}"])


# ----------------------------------------------------------------------------- the whole dynamics fit
# train_dynamics_model.train on the same 24 rows, to its early stop: one minibatch per epoch (its batch is 256),
# the reference's init, an lr cut before min_epochs and a stop after it (asserted)
# the first stall ends at epoch 46 = min_epochs (an lr cut: the reference stops from i >= min_epochs, 0-based), no
# gain right after the cut, a stop at 51
FIT = dict(epochs=60, min_epochs=46, model_lr=1e-2, seed=0)
# log-variance bounds far from the raw outputs (~0): at the defaults (0.5, -10) the upper soft clamp acts (its
# slope is sigmoid(0.5 - 0) = 0.62) and difference 1 (shared bounds) alone separates the two fits from epoch 8
FIT_BOUNDS = (20.0, -30.0)
FIT_BUFFER_SEED = 5  # DataBuffer's default_rng() is unseeded in the reference: train()'s memory.sample draws here


def fit_function(source: str, filename: str):
    """``train_dynamics_model.train`` as it stands, without ``@pyrallis.wrap()`` (which parses argv)."""
    for node in ast.parse(source, filename).body:
        if isinstance(node, ast.FunctionDef) and node.name == "train":
            node.decorator_list = []
            return compile_reference([node], filename)
    raise SystemExit(f"{filename}: def train not found")


@contextlib.contextmanager
def recorded(obj, name: str, log: list, result=lambda r: r):
    """``obj.name`` runs as it stands; ``result(return value)`` is appended to ``log``."""
    original = getattr(obj, name)

    def call(*args, **kw):
        r = original(*args, **kw)
        log.append(result(r))
        return r

    setattr(obj, name, call)
    try:
        yield
    finally:
        setattr(obj, name, original)


def run_fit(ref, sources, dataset, out):
    """Section (d): ``train_dynamics_model.train`` whole, with stand-ins for gym / d4rl (shapes, the dataset),
    the device moves (``.to("cuda:0")`` keeps the tensor) and the saver; every random draw recorded."""
    ens = ref["ensemble"]
    created, checks, cuts, saved = [], [], [], []

    class Ensemble(ens["Ensemble"]):
        def __init__(self, params):
            super().__init__(params)
            created.append(self)
            self.original = {id(m): i for i, m in self.networks.items()}
            with torch.no_grad():  # in place: the optimizer's param groups and the members hold these tensors
                self.max_logvar.fill_(FIT_BOUNDS[0]), self.min_logvar.fill_(FIT_BOUNDS[1])
            for i, model in self.networks.items():
                named(model.net, f"fit/init/{i}", out)

    class StepLR(torch.optim.lr_scheduler.StepLR):
        def step(self, *args, **kw):
            if hasattr(self, "_h45_ready"):
                cuts.append(len(checks) - 1)  # the epoch (1-based) whose check cut the lr
            super().step(*args, **kw)
            self._h45_ready = True

    def check(loader, ensemble):
        improved, losses = check_validation_losses(loader, ensemble)
        checks.append((improved, np.array(losses), ensemble.current_best_losses.copy()))
        return improved, losses

    utils = load_definitions(sources["utils"], FILES["utils"], {"set_seed"}, lazy_annotations=True)
    env = SimpleNamespace(
        observation_space=SimpleNamespace(shape=(OBS_DIM,)), action_space=SimpleNamespace(shape=(ACT_DIM,))
    )
    ns = load_definitions(
        sources["train_dynamics"],
        FILES["train_dynamics"],
        {"EnsembleTrainConfig", "check_validation_losses"},
        {
            "Ensemble": Ensemble,
            "EnsembleTransitionDataset": ens["EnsembleTransitionDataset"],
            "TransitionDataset": ens["TransitionDataset"],
            "Transition": ens["Transition"],
            "save_ensemble_model": lambda ensemble, path: saved.append(path),
            "set_seed": utils["set_seed"],
            "gym": SimpleNamespace(make=lambda name: env),
            "d4rl": SimpleNamespace(qlearning_dataset=lambda env: dataset),
        },
    )
    check_validation_losses = ns["check_validation_losses"]
    ns["check_validation_losses"] = check
    exec(fit_function(sources["train_dynamics"], FILES["train_dynamics"]), ns)
    config = ns["EnsembleTrainConfig"](
        env_name=ENV_NAME,
        num_models=MEMBERS,
        num_elites=ELITES,
        train_memory=N_DATA,
        val_memory=N_DATA,
        train_val_ratio=VAL_RATIO,
        hidden_dim=DYN_WIDTH,
        save_model=False,
        device="cuda:0",  # train() asserts it; the datasets' .to(device) keep their tensors on the CPU
        **FIT,
    )
    draws = {"permutation": [], "randint": [], "choice": [], "rows": [], "order": []}
    sampler_iter = torch.utils.data.RandomSampler.__iter__

    def sampler_order(self):
        order = list(sampler_iter(self))
        draws["order"].append(np.asarray(order, np.int32))
        return iter(order)

    buffer_rng = ref["buffer"]["default_rng"]
    frame = {}
    with (
        recorded(np.random, "permutation", draws["permutation"], np.copy),
        recorded(np.random, "randint", draws["randint"], np.copy),
        recorded(np.random, "choice", draws["choice"], np.copy),
        patched(torch.utils.data.RandomSampler, "__iter__", sampler_order),
        patched(torch.optim.lr_scheduler, "StepLR", StepLR),
        patched(ens["TransitionDataset"], "to", lambda self, device: self),
        patched(ens["EnsembleTransitionDataset"], "to", lambda self, device: self),
        contextlib.redirect_stdout(open(os.devnull, "w")),
        frame_locals("train", frame),
    ):
        ref["buffer"]["default_rng"] = lambda: np.random.default_rng(FIT_BUFFER_SEED)
        try:
            ns["train"](config)
        finally:
            ref["buffer"]["default_rng"] = buffer_rng
    ensemble = created[0]
    epochs = len(checks) - 1
    # the rows of the final split (train() re-shuffles load_memory's split), as dataset row indices
    rows = {tuple(r): i for i, r in enumerate(dataset["observations"].tolist())}
    for name in ("samples_train", "samples_validate"):
        out[f"fit/{name.split('_')[1]}_rows"] = np.array(
            [rows[tuple(np.asarray(s).tolist())] for s in frame[name].state], np.int32
        )
    out["fit/boot"] = draws["randint"][0].astype(np.int32)  # EnsembleTransitionDataset's bootstrap, over train rows
    out["fit/deal"] = np.stack(draws["choice"]).astype(np.int32)  # perm per epoch: member i trains on resample perm[i]
    out["fit/order"] = np.stack(draws["order"])  # the loader's row order per epoch (one minibatch)
    out["fit/val_mse"] = np.stack([c[1] for c in checks]).astype(np.float32)  # epoch 0 .. stop, original members
    out["fit/improved"] = np.array([c[0] for c in checks])
    out["fit/best"] = np.stack([c[2] for c in checks]).astype(np.float32)
    out["fit/lr_cut_epoch"] = np.int32(cuts[0] if cuts else -1)
    out["fit/input_mean"] = np.concatenate([ensemble.state_filter.mean, ensemble.action_filter.mean]).astype(np.float32)
    out["fit/input_std"] = np.concatenate([ensemble.state_filter.stdev, ensemble.action_filter.stdev]).astype(
        np.float32
    )
    # after the stop: every member's best weights loaded, then select_elites sorted the members by holdout MSE
    out["fit/rank"] = np.array([ensemble.original[id(m)] for m in ensemble.networks.values()], np.int32)
    for j, model in ensemble.networks.items():
        named(model.net, f"fit/final/{j}", out)
    out["fit/final/max_logvar"], out["fit/final/min_logvar"] = arr(ensemble.max_logvar), arr(ensemble.min_logvar)
    out["fit/elites_idx"] = np.array(ensemble._elites_idx, np.int32)
    out["fit/final_val_mse"] = np.array(sorted(ensemble.current_best_losses), np.float32)
    assert not saved  # save_model=False
    assert cuts and FIT["min_epochs"] < epochs < FIT["epochs"], (cuts, epochs)  # an lr cut, then an early stop
    return epochs


# ----------------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ravl", required=True, help="git dir of the fetched anyasims/edge-of-reach snapshot")
    p.add_argument("--out", default=fixture_path("ravl_reference.npz"))
    a = p.parse_args()
    torch.set_num_threads(1)
    sources, commit = {}, None
    for key, path in FILES.items():
        sources[key], commit = read_snapshot(a.ravl, path)
    ref = reference(sources)

    rng = np.random.default_rng(11)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    obs = np.stack([rng.uniform(0.75, 1.2, N_DATA), rng.uniform(-0.15, 0.15, N_DATA), rng.normal(size=N_DATA)], 1)
    dataset = {
        "observations": f32(obs),
        "actions": f32(rng.uniform(-0.9, 0.9, (N_DATA, ACT_DIM))),
        "rewards": f32(rng.normal(1.0, 0.5, N_DATA)),
        "next_observations": f32(obs + rng.normal(0.0, 0.1, (N_DATA, OBS_DIM))),
        "terminals": f32(np.isin(np.arange(N_DATA), [5, 17])),
    }
    out = {f"dataset/{k}": v for k, v in dataset.items()}

    defaults = {}
    ensemble = build_ensemble(ref, dataset, defaults)
    sorted_ensemble = run_dynamics(ref, sources, ensemble, rng, out)

    agent = build_agent(ref, out)
    buf = ref["buffer"]["DataBuffer"]
    real_buffer = buf(state_dim=OBS_DIM, action_dim=ACT_DIM, buffer_size=N_DATA, as_numpy=False)
    real_buffer.load_d4rl_dataset(dataset)
    model_buffer = buf(state_dim=OBS_DIM, action_dim=ACT_DIM, buffer_size=PREFILL + ROLLOUTS, as_numpy=False)
    prefill = {
        "obs": f32(rng.normal(size=(PREFILL, OBS_DIM))),
        "action": f32(rng.uniform(-0.9, 0.9, (PREFILL, ACT_DIM))),
        "reward": f32(rng.normal(size=(PREFILL, 1))),
        "next_obs": f32(rng.normal(size=(PREFILL, OBS_DIM))),
        "terminated": f32(rng.uniform(size=(PREFILL, 1)) < 0.2),
    }
    model_buffer.add_transitions(
        *(torch.as_tensor(prefill[k]) for k in ("obs", "action", "reward", "next_obs", "terminated"))
    )
    start_rows = rng.integers(0, N_DATA, ROLLOUTS)
    out["rollout/start_rows"] = start_rows.astype(np.int32)
    run_rollout(ref, sorted_ensemble, agent.actor, model_buffer, dataset["observations"][start_rows], rng, out)
    run_update(sources, agent, real_buffer, model_buffer, rng, out)
    # after the checks above (their arrays are as before): k = 3 rollouts of the updated actor, the whole fit
    run_rollouts_k(ref, sorted_ensemble, agent.actor, dataset, np.random.default_rng(ROLLOUT_SEED), out)
    fit_epochs = run_fit(ref, sources, dataset, out)

    command = f"/tmp/refvenv/bin/python scripts/fidelity/ravl_reference.py --ravl {shlex.quote(a.ravl)}"
    meta = {
        "generator": "scripts/fidelity/ravl_reference.py",
        "command": command,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "ravl": {
            "repository": "https://github.com/anyasims/edge-of-reach",
            "commit": commit,
            "files": sorted(FILES.values()),
        },
        "sizes": {
            "obs": OBS_DIM,
            "act": ACT_DIM,
            "members": MEMBERS,
            "elites": ELITES,
            "dyn_width": DYN_WIDTH,
            "data": N_DATA,
            "critics": CRITICS,
            "width": WIDTH,
            "rollouts": ROLLOUTS,
            "prefill": PREFILL,
            "batch": BATCH,
        },
        "env_name": ENV_NAME,
        "dataset_ratio": RATIO,
        "gamma": GAMMA,
        "tau": TAU,
        "eta": ETA,
        "lr": LR,
        "log_alpha": LOG_ALPHA,
        "model_lr": 1e-3,
        "rollouts_k": {
            "rollouts": ROLLOUTS_K,
            "horizon": HORIZON_K,
            "seed": ROLLOUT_SEED,
            "noise_scale": NOISE_SCALE_K,
        },
        "fit": {
            **FIT,
            "epochs_run": fit_epochs,
            "buffer_seed": FIT_BUFFER_SEED,
            "batch_size": 256,
            "bounds": FIT_BOUNDS,
        },
        "reference_defaults": {
            "TrainConfig": config_defaults(sources["train_agent"], FILES["train_agent"], "TrainConfig"),
            "EnsembleTrainConfig": config_defaults(
                sources["train_dynamics"], FILES["train_dynamics"], "EnsembleTrainConfig"
            ),
            "decays": ref["net"]["BayesianNeuralNetwork"](1, 1, 1).decays.tolist(),
            **defaults,
        },
    }
    meta["reference_defaults"]["EnsembleTrainConfig"].pop("device", None)
    meta["reference_defaults"]["TrainConfig"].pop("device", None)
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; ravl {commit}")


if __name__ == "__main__":
    main()
