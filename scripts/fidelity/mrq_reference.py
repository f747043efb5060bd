"""Fixture generator: MR.Q's networks, losses, gradients and one AdamW step from the official code.

Runs the *official* code on fixed weights, a fixed batch of subtrajectories and fixed target-policy
noise, and writes inputs, weights and outputs to ``tests/fixtures/mrq_reference.npz``, which
``tests/test_fidelity_mrq.py`` compares against ``agents/mrq.py`` without torch.

Reference (read from a fetched snapshot, never copied into this repository): facebookresearch/MRQ
(Fujimoto et al. 2025).  Executed as they stand:

* ``MRQ/models.py``: ``weight_init``, ``ln_activ``, ``BaseMLP``, ``Encoder``, ``Policy``, ``Value``
  (their constructors take the sizes: zs 16, za 8, zsa 16, every hidden width 16, 65 reward bins);
* ``MRQ/utils.py``: ``enforce_dataclass_type``, ``set_instance_vars`` (used by ``Hyperparameters`` and
  ``Agent.__init__``);
* ``MRQ/MRQ.py``: ``Hyperparameters``, ``Agent``, ``TwoHot``, ``realign``, ``masked_mse``,
  ``multi_step_reward``.  ``Agent.__init__`` runs as it stands (it builds the networks, the AdamW
  optimizers, the TwoHot bins and the discounts ``gammas``) with a stand-in replay buffer; then
  ``Agent.train_encoder`` and ``Agent.train_rl`` are called on the fixed batch, and the priority block of
  ``Agent.train`` (the body of ``if self.prioritized:``) runs on ``train_rl``'s returned Q and target.

Nothing else of the reference runs (``buffer.py`` is not executed: the batch it would sample is supplied
in its layout, ``state (B, H, S)``, ``action (B, H, A)``, ``next_state (B, H, S)``, ``reward (B, H, 1)``,
``not_done (B, H, 1)``; the Q batch is its ``include_intermediate=False`` form, first state and action
and the state after H_Q steps).  Changes made from outside, none touching the reference's code:

* weights: the reference's own init (Xavier-uniform, gain sqrt 2, zero biases) with ``torch.manual_seed(0)``;
  then every Linear bias is drawn N(0, 0.1^2) (zero biases would hide a bias mix-up) and every target
  network (in ``Agent.__init__`` a deepcopy) is its online network plus N(0, 0.05^2) on every parameter,
  so that a bug using the wrong set shows.
* noise: ``torch.randn_like`` (the one random call of ``train_rl``, the target-policy noise) returns a
  fixed array of N(0, 1.25^2) draws from the fixture (wider than N(0, 1) so that both the noise clip and
  the [-1, 1] clip of the target action act on some rows; asserted).
* recording: ``train_encoder``'s and ``train_rl``'s optimizers are stand-ins whose ``step()`` records the
  gradients (the value's after ``clip_grad_norm_``, whose norm is recorded and asserted below 20, so the
  clip is inert) and changes nothing; the losses and intermediates are read from the method's frame.
  For the one-step check a second ``Agent`` runs the same calls with its own torch AdamW optimizers.
* weight decay: 0.5 for the three AdamW optimizers (reference 1e-4, where the decay lr x wd x |p| ~ 3e-9 of
  one step would be far below float32 resolution of the parameters; at 0.5 it is 1.5e-5 on |p| ~ 0.3).
* reward scales: ``train_rl``'s ``reward_scale`` / ``target_reward_scale`` are 1.7 / 0.6 (in training
  they come from the buffer's mean |reward| at the last two target syncs); ``min_priority`` is 2.5
  (reference 1, below every TD error of this batch): the clamp max(|delta|, min_priority) then holds
  about half of the rows (asserted), so that it shows.
* multi-step return (the zoo's deliberate deviation E4): ``train_rl`` runs twice on the Q batch, once
  with the reference's own ``multi_step_reward`` (run ``asis``; only its target and Q are recorded) and
  once with the corrected return R = sum_i gamma^i c_i r_i, c_i = prod_{j<i} (1 - d_j) computed here
  (run ``fixed``: losses, gradients, priorities and the AdamW step).

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 numpy
    /tmp/refvenv/bin/python scripts/fidelity/mrq_reference.py --mrq /work/.mirror/facebookresearch+MRQ/repo

``--mrq``: a git directory (bare or work tree) of the fetched snapshot; the files are read at ``HEAD``
with ``git show`` and the commit is recorded in the fixture.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import shlex
from types import SimpleNamespace

import numpy as np
import torch
from sac_reference import RecordingOptimizer, arr, frame_locals
from snapshot import compile_reference, load_definitions, read_snapshot

FILES = {"models": "MRQ/models.py", "utils": "MRQ/utils.py", "mrq": "MRQ/MRQ.py"}
OBS_DIM, ACT_DIM, BATCH, WIDTH = 5, 2, 8, 16
SIZES = dict(zs_dim=WIDTH, zsa_dim=WIDTH, za_dim=WIDTH // 2, enc_hdim=WIDTH, value_hdim=WIDTH, policy_hdim=WIDTH)
REWARD_SCALE, TARGET_REWARD_SCALE, MIN_PRIORITY = 1.7, 0.6, 2.5
WEIGHT_DECAY = 0.5  # AdamW's, all three optimizers (reference 1e-4: lr x wd x |p| ~ 3e-9 would not show)
# (row, step) of the terminal transitions: inside the Q window (steps 0..2) and after it (3, 4)
TERMINALS = ((1, 0), (3, 1), (4, 2), (6, 4))


class Recording(RecordingOptimizer):
    """``RecordingOptimizer`` with the ``zero_grad(set_to_none=True)`` signature MR.Q calls."""

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad()


@contextlib.contextmanager
def fixed_randn_like(noise: torch.Tensor):
    """``torch.randn_like(x)`` returns ``noise`` (once)."""
    calls, original = [], torch.randn_like

    def randn_like(x, *args, **kwargs):
        assert x.shape == noise.shape and not calls, (x.shape, noise.shape, calls)
        calls.append(1)
        return noise.clone()

    torch.randn_like = randn_like
    try:
        yield
    finally:
        torch.randn_like = original
    assert calls, "train_rl drew no target-policy noise"


def priority_block(source: str, filename: str):
    """The body of ``if self.prioritized:`` in ``Agent.train``, compiled as it stands."""
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "self.prioritized":
            return compile_reference(node.body, filename)
    raise SystemExit(f"{filename}: priority block (if self.prioritized:) not found")


class ReplayStandIn:
    """What ``Agent.__init__`` / ``Agent.train``'s priority block read of ``buffer.ReplayBuffer``."""

    def __init__(self, obs_shape, action_dim, max_action, pixel_obs, device, history, horizon, *args, **kwargs):
        self.state_shape, self.horizon, self.priority = [obs_shape[0] * history], horizon, None

    def update_priority(self, priority):
        self.priority = priority.detach().clone()


def make_agent(ns, seed: int):
    torch.manual_seed(seed)
    return ns["Agent"](
        (OBS_DIM,),
        ACT_DIM,
        1.0,
        False,
        False,
        torch.device("cpu"),
        1,
        dict(SIZES, min_priority=MIN_PRIORITY, enc_wd=WEIGHT_DECAY, value_wd=WEIGHT_DECAY, policy_wd=WEIGHT_DECAY),
    )


def state_dicts(agent) -> dict:
    return {
        n: {k: v.detach().clone() for k, v in getattr(agent, n).state_dict().items()}
        for n in ("encoder", "policy", "value", "encoder_target", "policy_target", "value_target")
    }


def record_params(out: dict, prefix: str, net):
    for k, v in net.state_dict().items():
        out[f"{prefix}/{k}"] = arr(v)


def multistep_corrected(reward, not_done, gamma: float):
    """E4 (the zoo's corrected return): R = sum_i gamma^i c_i r_i, c_i = prod_{j<i} (1 - d_j); and c_H."""
    c = torch.cumprod(torch.cat([torch.ones_like(not_done[:, :1]), not_done[:, :-1]], 1), 1)
    g = gamma ** torch.arange(reward.shape[1], dtype=torch.float32).reshape(1, -1, 1)
    return (g * c * reward).sum(1), not_done.prod(1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mrq", required=True, help="git dir of the fetched facebookresearch/MRQ snapshot")
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "mrq_reference.npz")
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    src = {k: read_snapshot(a.mrq, f) for k, f in FILES.items()}
    commit = src["mrq"][1]
    assert all(c == commit for _, c in src.values())
    models = load_definitions(
        src["models"][0], FILES["models"], {"weight_init", "ln_activ", "BaseMLP", "Encoder", "Policy", "Value"}
    )
    utils = load_definitions(src["utils"][0], FILES["utils"], {"enforce_dataclass_type", "set_instance_vars"})
    ns = load_definitions(
        src["mrq"][0],
        FILES["mrq"],
        {"Hyperparameters", "Agent", "TwoHot", "realign", "masked_mse", "multi_step_reward"},
        {
            "models": SimpleNamespace(**models),
            "utils": SimpleNamespace(**utils),
            "buffer": SimpleNamespace(ReplayBuffer=ReplayStandIn),
        },
    )

    # ------------------------------------------------------------------ weights (the reference's init, then)
    agent = make_agent(ns, 0)
    assert (agent.zs_dim, agent.za_dim, agent.enc_horizon, agent.Q_horizon, agent.num_bins) == (16, 8, 5, 3, 65)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for net in (agent.encoder, agent.policy, agent.value):
            for k, v in net.named_parameters():
                if k.endswith("bias"):
                    v.copy_(0.1 * torch.randn(v.shape, generator=gen))
        for online, target in (
            (agent.encoder, agent.encoder_target),
            (agent.policy, agent.policy_target),
            (agent.value, agent.value_target),
        ):
            target.load_state_dict(online.state_dict())
            for v in target.parameters():
                v.add_(0.05 * torch.randn(v.shape, generator=gen))
    weights = state_dicts(agent)
    out = {}
    for name in weights:
        record_params(out, name, getattr(agent, name))

    # ------------------------------------------------------------------ the batch
    rng = np.random.default_rng(7)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    h = agent.enc_horizon
    terminated = np.zeros((BATCH, h), np.float32)
    for row, step in TERMINALS:
        terminated[row, step] = 1.0
    inputs = {
        "states": f32(rng.normal(size=(BATCH, h + 1, OBS_DIM))),  # s_0 .. s_H of each subtrajectory
        "actions": f32(rng.uniform(-0.9, 0.9, size=(BATCH, h, ACT_DIM))),
        "rewards": f32(rng.normal(scale=1.5, size=(BATCH, h))),
        "terminated": terminated,  # steps after a terminal one are data the reference reads and masks
        "noise": f32(rng.standard_normal((BATCH, ACT_DIM)) * 1.25),  # target-policy noise draws; some clip
    }
    out.update({f"inputs/{k}": v for k, v in inputs.items()})
    t = {k: torch.as_tensor(v) for k, v in inputs.items()}
    state, next_state = t["states"][:, :-1], t["states"][:, 1:]
    reward, not_done = t["rewards"][..., None], 1.0 - t["terminated"][..., None]
    hq = agent.Q_horizon
    q_batch = (t["states"][:, 0], t["actions"][:, 0], t["states"][:, hq])  # include_intermediate=False layout

    # ------------------------------------------------------------------ 1. forward passes
    with torch.no_grad():
        zs = agent.encoder.zs(t["states"][:, 0])
        zsa = agent.encoder(zs, t["actions"][:, 0])
        d, zs_next, r_logits = agent.encoder.model_all(zs, t["actions"][:, 0])
        action, pre = agent.policy(zs)
        out.update(
            {
                "fwd/zs": arr(zs),
                "fwd/zsa": arr(zsa),
                "fwd/done": arr(d[:, 0]),
                "fwd/next_zs": arr(zs_next),
                "fwd/reward_logits": arr(r_logits),
                "fwd/value": arr(agent.value(zsa).T),
                "fwd/action": arr(action),
                "fwd/pre_activ": arr(pre),
                "fwd/target_zs": arr(agent.encoder_target.zs(t["states"][:, 0])),
                "fwd/bins": arr(agent.two_hot.bins),
                "fwd/two_hot": arr(agent.two_hot.transform(t["rewards"].reshape(-1, 1))),
            }
        )

    # ------------------------------------------------------------------ 2. losses and gradients (recording)
    for terminates in (True, False):
        agent.encoder_optimizer = Recording(agent.encoder.parameters())
        frame = {}
        with frame_locals("train_encoder", frame):
            agent.train_encoder(state, t["actions"], next_state, reward, not_done, terminates)
        tag = "enc" if terminates else "enc_noterm"
        out[f"{tag}/loss"] = np.float32(frame["encoder_loss"].item())
        for (k, _), g in zip(agent.encoder.named_parameters(), agent.encoder_optimizer.grads):
            out[f"{tag}/grad/{k}"] = arr(g)

    r_asis, nd_asis = ns["multi_step_reward"](reward[:, :hq], not_done[:, :hq], agent.gammas)
    r_fixed, nd_fixed = multistep_corrected(reward[:, :hq], not_done[:, :hq], agent.hp.discount)
    assert torch.equal(nd_asis, nd_fixed)
    assert abs(agent.discount - agent.hp.discount**hq) < 1e-12
    for run, (r, nd) in (("asis", (r_asis, nd_asis)), ("fixed", (r_fixed, nd_fixed))):
        agent.value_optimizer = Recording(agent.value.parameters())
        agent.policy_optimizer = Recording(agent.policy.parameters())
        frame = {}
        with fixed_randn_like(t["noise"]), frame_locals("train_rl", frame):
            q, q_target = agent.train_rl(*q_batch[:2], q_batch[2], r, nd, REWARD_SCALE, TARGET_REWARD_SCALE)
        out[f"{run}/return"], out[f"{run}/y"], out[f"{run}/q"] = arr(r[:, 0]), arr(q_target[:, 0]), arr(q.T)
        if run == "asis":
            continue
        clipped = (int((frame["noise"].abs() == agent.noise_clip).sum()), int((frame["next_action"].abs() == 1).sum()))
        assert min(clipped) > 0, clipped  # both clips of the target action act on some draws
        out["rl/value_loss"] = np.float32(frame["value_loss"].item())
        out["rl/policy_loss"] = np.float32(frame["policy_loss"].item())
        out["rl/q_policy"] = arr(frame["Q_policy"].T)
        out["rl/pre_activ"] = arr(frame["pre_activ"])
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in agent.value_optimizer.grads]))
        assert float(norm) < agent.value_grad_clip, float(norm)  # the clip is inert: recorded grads are raw
        out["rl/value_grad_norm"] = np.float32(norm)
        for (k, _), g in zip(agent.value.named_parameters(), agent.value_optimizer.grads):
            out[f"rl/grad/value/{k}"] = arr(g)
        for (k, _), g in zip(agent.policy.named_parameters(), agent.policy_optimizer.grads):
            out[f"rl/grad/policy/{k}"] = arr(g)
        run_ns = dict(ns, self=agent, Q=q, Q_target=q_target)
        agent.replay_buffer.priority = None
        exec(priority_block(src["mrq"][0], FILES["mrq"]), run_ns)
        out["rl/priority"] = arr(agent.replay_buffer.priority)
    clamped = float((out["rl/priority"] == np.float32(MIN_PRIORITY**agent.alpha)).mean())
    assert 0.25 <= clamped <= 0.75, clamped  # the clamp holds some rows, not all

    # ------------------------------------------------------------------ 3. one AdamW step (torch's own)
    stepper = make_agent(ns, 0)  # its own AdamW optimizers (Agent.__init__), loaded with the same weights
    for name, sd in weights.items():
        getattr(stepper, name).load_state_dict(sd)
    stepper.train_encoder(state, t["actions"], next_state, reward, not_done, True)
    record_params(out, "step/encoder", stepper.encoder)
    for name, sd in weights.items():  # the RL step from the same starting weights
        getattr(stepper, name).load_state_dict(sd)
    with fixed_randn_like(t["noise"]):
        stepper.train_rl(*q_batch[:2], q_batch[2], r_fixed, nd_fixed, REWARD_SCALE, TARGET_REWARD_SCALE)
    record_params(out, "step/value", stepper.value)
    record_params(out, "step/policy", stepper.policy)

    command = f"/tmp/refvenv/bin/python scripts/fidelity/mrq_reference.py --mrq {shlex.quote(a.mrq)}"
    keys = (
        "discount",
        "target_policy_noise",
        "noise_clip",
        "dyn_weight",
        "reward_weight",
        "done_weight",
        "alpha",
        "min_priority",
        "enc_horizon",
        "Q_horizon",
        "pre_activ_weight",
        "value_grad_clip",
        "enc_lr",
        "enc_wd",
        "value_lr",
        "value_wd",
        "policy_lr",
        "policy_wd",
        "num_bins",
        "lower",
        "upper",
        "zs_dim",
        "za_dim",
        "zsa_dim",
        "enc_hdim",
        "value_hdim",
        "policy_hdim",
        "target_update_freq",
        "exploration_noise",
    )
    defaults = ns["Hyperparameters"]()
    hp = {k: getattr(agent.hp, k) for k in keys}
    meta = {
        "generator": "scripts/fidelity/mrq_reference.py",
        "command": command,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "mrq": {
            "repository": "https://github.com/facebookresearch/MRQ",
            "commit": commit,
            "files": list(FILES.values()),
        },
        "sizes": dict(SIZES, obs=OBS_DIM, act=ACT_DIM, batch=BATCH),
        "hp": hp,
        "hp_defaults": {k: getattr(defaults, k) for k in keys},
        "reward_scale": REWARD_SCALE,
        "target_reward_scale": TARGET_REWARD_SCALE,
        "min_priority": MIN_PRIORITY,
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; mrq {commit}")


if __name__ == "__main__":
    main()
