"""Fixture generator: SAC losses and gradients from CleanRL, SAC-N / EDAC ones from CORL.

Runs the *official* code on fixed weights, a fixed batch and fixed Gaussian draws, and writes inputs,
weights and outputs to ``tests/fixtures/sac_reference.npz``, which ``tests/test_fidelity_sac.py``
compares against ``agents/sac.py`` without torch.

References (read from fetched snapshots, never copied into this repository):

* CleanRL, ``cleanrl/sac_continuous_action.py`` (Huang et al. 2022): its ``Actor`` and ``SoftQNetwork``
  classes, and the statements of its training step (the body of ``if global_step > args.learning_starts``
  inside ``__main__``) executed as they stand, with stand-ins for the replay buffer, the optimizers
  (they record the gradients at ``step()`` and change nothing) and the logger.
* CORL, ``algorithms/offline/edac.py`` (Tarasov et al. 2022): its ``Actor``, ``VectorizedCritic`` and
  ``EDAC`` classes; ``EDAC._alpha_loss``, ``_actor_loss``, ``_critic_loss`` and
  ``_critic_diversity_loss`` are called directly, and their intermediates (the target ``q_target``,
  ``q_values``, ...) are read from the method's frame on return.

Only the definitions are executed (module-level imports that this venv lacks, such as gym, d4rl,
wandb, tyro, are skipped); nothing else of either script runs.  Two changes are made from outside,
neither touching the reference's code:

* width: CleanRL hard-codes 256 hidden units; its classes are executed with an ``nn`` whose ``Linear``
  maps a 256 to 16 (the layer layout is the reference's own).  CORL takes ``hidden_dim=16``.
* noise: ``torch.distributions.Normal.rsample`` is replaced by ``loc + eps * scale`` with ``eps`` taken
  from a fixed queue (torch's own rsample is ``loc + eps * scale`` with eps from the RNG), so the
  sampled actions ``a = tanh(mu + std * eps)`` use the same eps in the zoo's test.

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 numpy
    /tmp/refvenv/bin/python scripts/fidelity/sac_reference.py \\
        --cleanrl /work/.mirror/vwxyzjn+cleanrl/repo --corl /work/.mirror/tinkoff-ai+CORL/repo

``--cleanrl`` / ``--corl``: a git directory (bare or work tree) of the fetched snapshot; the files are
read at ``HEAD`` with ``git show`` and the commit is recorded in the fixture.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import shlex
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
from snapshot import compile_reference, fixture_path, load_definitions, read_snapshot

CLEANRL_FILE = "cleanrl/sac_continuous_action.py"
CORL_FILE = "algorithms/offline/edac.py"
OBS_DIM, ACT_DIM, WIDTH, BATCH = 3, 2, 16, 8
GAMMA, TAU, LOG_ALPHA = 0.99, 0.005, math.log(0.3)  # alpha 0.3, not 1, so alpha's every use shows
CORL_CRITICS, CORL_ETA, CORL_DEPTH = 3, 1.0, 3


# ----------------------------------------------------------------------------- reading the reference
def cleanrl_training_step(source: str, filename: str):
    """The statements of CleanRL's gradient step: the body of ``if global_step > args.learning_starts:``
    inside the ``for global_step in ...`` loop of ``__main__``, compiled as they stand."""
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and ast.unparse(node.test) == "global_step > args.learning_starts"
        ):
            return compile_reference(node.body, filename, lazy_annotations=True)
    raise SystemExit(f"{filename}: training step (global_step > args.learning_starts) not found")


# ----------------------------------------------------------------------------- fixed draws, recorded frames
@contextlib.contextmanager
def fixed_normal_draws(eps_list):
    """``Normal.rsample`` returns ``loc + eps * scale`` with eps popped from ``eps_list`` in order."""
    queue = list(eps_list)
    original = torch.distributions.Normal.rsample

    def rsample(self, sample_shape=torch.Size()):
        eps = queue.pop(0)
        assert tuple(sample_shape) == () and eps.shape == self.loc.shape, (sample_shape, eps.shape, self.loc.shape)
        return self.loc + eps * self.scale

    torch.distributions.Normal.rsample = rsample
    try:
        yield
    finally:
        torch.distributions.Normal.rsample = original
    assert not queue, f"{len(queue)} fixed draws left unused"


@contextlib.contextmanager
def frame_locals(function_name: str, into: dict):
    """Copy the locals of ``function_name``'s frame as it returns (the reference's intermediates)."""

    def profile(frame, event, arg):
        if event == "return" and frame.f_code.co_name == function_name:
            into.update(frame.f_locals)

    sys.setprofile(profile)
    try:
        yield into
    finally:
        sys.setprofile(None)


class RecordingOptimizer:
    """Stands in for ``torch.optim.Adam``: ``step()`` records each parameter's gradient and changes nothing."""

    def __init__(self, params):
        self.params, self.grads = list(params), None

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = [p.grad.detach().clone() for p in self.params]


def narrow_nn(width: int):
    """``torch.nn`` with ``Linear`` building ``width`` where the reference hard-codes 256 units."""

    class Linear(torch.nn.Linear):
        def __init__(self, i, o, *args, **kwargs):
            super().__init__(width if i == 256 else int(i), width if o == 256 else int(o), *args, **kwargs)

    return SimpleNamespace(Module=torch.nn.Module, Linear=Linear)


def arr(t) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


# ----------------------------------------------------------------------------- the two references
def run_cleanrl(source: str, inputs: dict, out: dict):
    ns = load_definitions(
        source,
        CLEANRL_FILE,
        {"SoftQNetwork", "Actor", "LOG_STD_MAX", "LOG_STD_MIN"},
        {"nn": narrow_nn(WIDTH)},
        lazy_annotations=True,
    )
    box = SimpleNamespace(shape=(ACT_DIM,), high=np.ones(ACT_DIM, np.float32), low=-np.ones(ACT_DIM, np.float32))
    env = SimpleNamespace(single_observation_space=SimpleNamespace(shape=(OBS_DIM,)), single_action_space=box)
    torch.manual_seed(0)
    # the order of CleanRL's __main__; the targets are NOT load_state_dict copies of qf1/qf2 here (as they
    # are at step 0 there) so that online and target critics differ, as they do after any Polyak step
    actor, qf1, qf2, qf1_target, qf2_target = (
        ns["Actor"](env),
        ns["SoftQNetwork"](env),
        ns["SoftQNetwork"](env),
        ns["SoftQNetwork"](env),
        ns["SoftQNetwork"](env),
    )
    for name, net in dict(actor=actor, qf1=qf1, qf2=qf2, qf1_target=qf1_target, qf2_target=qf2_target).items():
        for k, v in net.state_dict().items():
            if k not in ("action_scale", "action_bias"):
                out[f"cleanrl/{name}/{k}"] = arr(v)
    assert float(actor.action_scale.min()) == 1.0 and float(actor.action_bias.abs().max()) == 0.0
    log_alpha = torch.tensor([LOG_ALPHA], dtype=torch.float32, requires_grad=True)
    t = {k: torch.as_tensor(v) for k, v in inputs.items()}
    data = SimpleNamespace(
        observations=t["obs"],
        actions=t["actions"],
        rewards=t["rewards"][:, None],
        next_observations=t["next_obs"],
        dones=t["terminated"][:, None],
    )
    run = dict(ns)
    run.update(
        args=SimpleNamespace(
            batch_size=BATCH,
            gamma=GAMMA,
            tau=TAU,
            learning_starts=0,
            autotune=True,
            policy_frequency=1,  # the actor and alpha losses once, on this batch
            target_network_frequency=1,
        ),
        global_step=1,  # > learning_starts, not a multiple of 100 (no logging)
        rb=SimpleNamespace(sample=lambda n: data),
        actor=actor,
        qf1=qf1,
        qf2=qf2,
        qf1_target=qf1_target,
        qf2_target=qf2_target,
        q_optimizer=RecordingOptimizer(list(qf1.parameters()) + list(qf2.parameters())),
        actor_optimizer=RecordingOptimizer(actor.parameters()),
        a_optimizer=RecordingOptimizer([log_alpha]),
        log_alpha=log_alpha,
        alpha=log_alpha.exp().item(),
        target_entropy=-float(ACT_DIM),
        writer=SimpleNamespace(add_scalar=lambda *a, **k: None),
        start_time=time.time(),
        time=time,
    )
    # draws in CleanRL's order: a' ~ pi(.|s') (target), a ~ pi(.|s) (actor loss), a ~ pi(.|s) (alpha loss)
    draws = [torch.as_tensor(inputs[k]) for k in ("eps_next", "eps_actor", "eps_alpha")]
    with fixed_normal_draws(draws):
        exec(cleanrl_training_step(source, CLEANRL_FILE), run)
    out["cleanrl/log_std_bounds"] = np.array([ns["LOG_STD_MIN"], ns["LOG_STD_MAX"]], np.float32)
    out["cleanrl/alpha"] = np.float32(run["alpha"])
    out["cleanrl/log_alpha"] = arr(log_alpha)[0]
    out["cleanrl/next_action"] = arr(run["next_state_actions"])
    out["cleanrl/next_log_prob"] = arr(run["next_state_log_pi"][:, 0])
    out["cleanrl/y"] = arr(run["next_q_value"])
    out["cleanrl/q"] = np.stack([arr(run["qf1_a_values"]), arr(run["qf2_a_values"])])
    out["cleanrl/qf_member_loss"] = np.array([run["qf1_loss"].item(), run["qf2_loss"].item()], np.float32)
    out["cleanrl/qf_loss"] = np.float32(run["qf_loss"].item())
    out["cleanrl/actor_action"] = arr(run["pi"])
    out["cleanrl/actor_min_q"] = arr(run["min_qf_pi"][:, 0])
    out["cleanrl/actor_loss"] = np.float32(run["actor_loss"].item())
    out["cleanrl/alpha_log_prob"] = arr(run["log_pi"][:, 0])  # the alpha step's own draw (no_grad)
    out["cleanrl/alpha_loss"] = np.float32(run["alpha_loss"].item())
    out["cleanrl/grad/log_alpha"] = arr(run["a_optimizer"].grads[0])[0]
    names = [f"qf1/{k}" for k, _ in qf1.named_parameters()] + [f"qf2/{k}" for k, _ in qf2.named_parameters()]
    for name, g in zip(names, run["q_optimizer"].grads):
        out[f"cleanrl/grad/{name}"] = arr(g)
    for (k, _), g in zip(actor.named_parameters(), run["actor_optimizer"].grads):
        out[f"cleanrl/grad/actor/{k}"] = arr(g)


def run_corl(source: str, inputs: dict, out: dict):
    ns = load_definitions(
        source, CORL_FILE, {"VectorizedLinear", "Actor", "VectorizedCritic", "EDAC"}, lazy_annotations=True
    )
    torch.manual_seed(1)
    actor = ns["Actor"](OBS_DIM, ACT_DIM, WIDTH)
    critic = ns["VectorizedCritic"](OBS_DIM, ACT_DIM, WIDTH, CORL_CRITICS)
    target = ns["VectorizedCritic"](OBS_DIM, ACT_DIM, WIDTH, CORL_CRITICS)
    # EDAC's init draws the output layers from U(+-1e-3) / U(+-3e-3): Q ~ 1e-2 and mu ~ 0, too small for a
    # member's min/max or the policy mean to show.  Redraw them with the reference's own reset_parameters
    # (PyTorch's Linear default), hidden layers keeping EDAC's init (biases 0.1).
    actor.mu.reset_parameters(), actor.log_sigma.reset_parameters()
    critic.critic[-1].reset_parameters(), target.critic[-1].reset_parameters()
    edac = ns["EDAC"](actor, None, critic, None, gamma=GAMMA, tau=TAU, eta=CORL_ETA)
    edac.target_critic = target  # distinct from the online critic (as after any Polyak step)
    with torch.no_grad():
        edac.log_alpha.fill_(LOG_ALPHA)
    edac.alpha = edac.log_alpha.exp().detach()
    assert len(actor.trunk) == 2 * CORL_DEPTH
    for name, net in dict(actor=actor, critic=critic, target=target).items():
        for k, v in net.state_dict().items():
            out[f"corl/{name}/{k}"] = arr(v)
    t = {k: torch.as_tensor(v) for k, v in inputs.items()}
    s, a, r, s2, d = t["obs"], t["actions"], t["rewards"][:, None], t["next_obs"], t["terminated"][:, None]
    out["corl/alpha"] = arr(edac.alpha)[0]
    out["corl/log_alpha"] = arr(edac.log_alpha)[0]

    # 1. temperature (EDAC.update's order: alpha, actor, critic)
    frame = {}
    with fixed_normal_draws([t["eps_alpha"]]), frame_locals("_alpha_loss", frame):
        loss = edac._alpha_loss(s)
    out["corl/alpha_log_prob"] = arr(frame["action_log_prob"])
    out["corl/alpha_loss"] = arr(loss)
    out["corl/grad/log_alpha"] = arr(torch.autograd.grad(loss, edac.log_alpha)[0])[0]

    # 2. actor
    frame = {}
    with fixed_normal_draws([t["eps_actor"]]), frame_locals("_actor_loss", frame):
        loss = edac._actor_loss(s)[0]
    out["corl/actor_action"] = arr(frame["action"])
    out["corl/actor_log_prob"] = arr(frame["action_log_prob"])
    out["corl/actor_q"] = arr(frame["q_value_dist"])
    out["corl/actor_loss"] = arr(loss)
    for (k, _), g in zip(actor.named_parameters(), torch.autograd.grad(loss, list(actor.parameters()))):
        out[f"corl/grad/actor/{k}"] = arr(g)

    # 3. critics: squared TD errors summed over members + eta * diversity
    frame = {}
    with fixed_normal_draws([t["eps_next"]]), frame_locals("_critic_loss", frame):
        loss = edac._critic_loss(s, a, r, s2, d)
    out["corl/next_log_prob"] = arr(frame["next_action_log_prob"])
    out["corl/y"] = arr(frame["q_target"][:, 0])
    out["corl/q"] = arr(frame["q_values"])
    out["corl/td_loss"] = arr(frame["critic_loss"])
    out["corl/diversity"] = arr(frame["diversity_loss"])
    out["corl/critic_loss"] = arr(loss)
    for (k, _), g in zip(critic.named_parameters(), torch.autograd.grad(loss, list(critic.parameters()))):
        out[f"corl/grad/critic/{k}"] = arr(g)

    # 4. the diversity term alone and its gradient
    div = edac._critic_diversity_loss(s, a)
    grads = torch.autograd.grad(div, list(critic.parameters()), allow_unused=True)  # the output bias: unused
    for (k, v), g in zip(critic.named_parameters(), grads):
        out[f"corl/grad/diversity/{k}"] = arr(torch.zeros_like(v) if g is None else g)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cleanrl", required=True, help="git dir of the fetched vwxyzjn/cleanrl snapshot")
    p.add_argument("--corl", required=True, help="git dir of the fetched tinkoff-ai/CORL snapshot")
    p.add_argument("--out", default=fixture_path("sac_reference.npz"))
    a = p.parse_args()
    torch.set_num_threads(1)
    cleanrl_src, cleanrl_commit = read_snapshot(a.cleanrl, CLEANRL_FILE)
    corl_src, corl_commit = read_snapshot(a.corl, CORL_FILE)

    rng = np.random.default_rng(45)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    inputs = {
        "obs": f32(rng.normal(size=(BATCH, OBS_DIM))),
        "actions": f32(rng.uniform(-0.9, 0.9, size=(BATCH, ACT_DIM))),
        "rewards": f32(rng.normal(size=BATCH)),
        "next_obs": f32(rng.normal(size=(BATCH, OBS_DIM))),
        "terminated": f32([0, 1, 0, 0, 0, 1, 0, 0]),
        "truncated": f32([0, 0, 1, 0, 0, 0, 0, 1]),  # never enters either reference's loss (nor ours)
        "eps_next": f32(rng.standard_normal((BATCH, ACT_DIM))),
        "eps_actor": f32(rng.standard_normal((BATCH, ACT_DIM))),
        "eps_alpha": f32(rng.standard_normal((BATCH, ACT_DIM))),
    }
    out = {f"inputs/{k}": v for k, v in inputs.items()}
    run_cleanrl(cleanrl_src, inputs, out)
    run_corl(corl_src, inputs, out)
    command = "/tmp/refvenv/bin/python scripts/fidelity/sac_reference.py " + " ".join(
        f"--{k} {shlex.quote(str(v))}" for k, v in (("cleanrl", a.cleanrl), ("corl", a.corl))
    )
    meta = {
        "generator": "scripts/fidelity/sac_reference.py",
        "command": command,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cleanrl": {"repository": "https://github.com/vwxyzjn/cleanrl", "commit": cleanrl_commit, "file": CLEANRL_FILE},
        "corl": {"repository": "https://github.com/tinkoff-ai/CORL", "commit": corl_commit, "file": CORL_FILE},
        "sizes": {
            "obs": OBS_DIM,
            "act": ACT_DIM,
            "width": WIDTH,
            "batch": BATCH,
            "cleanrl_critics": 2,
            "cleanrl_depth": 2,
            "corl_critics": CORL_CRITICS,
            "corl_depth": CORL_DEPTH,
        },
        "gamma": GAMMA,
        "eta": CORL_ETA,
        "log_alpha": LOG_ALPHA,
        "target_entropy": -float(ACT_DIM),
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(
        f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; "
        f"cleanrl {cleanrl_commit}, corl {corl_commit}"
    )


if __name__ == "__main__":
    main()
