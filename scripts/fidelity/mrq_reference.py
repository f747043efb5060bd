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

For sections 1-3 ``buffer.py`` is not executed: the batch it would sample is supplied in its layout,
``state (B, H, S)``, ``action (B, H, A)``, ``next_state (B, H, S)``, ``reward (B, H, 1)``, ``not_done (B, H, 1)``;
the Q batch is its ``include_intermediate=False`` form, first state and action and the state after H_Q steps.
Sections 4 and 5 run ``MRQ/buffer.py``'s ``ReplayBuffer`` as it stands:

* 4, the replay: the buffer as ``Agent.__init__`` builds it (horizon 5, LAP, initial priority 1; capacity 64,
  batch 8) fed 46 transitions of 8 episodes (terminated, truncated, shorter than the horizon, still running):
  its mask after every add; at 35 and 46 transitions its priorities, maximum, reward scale, one sample of
  each kind (H_enc = 5 with ``include_intermediate=True``, H_Q = 3 without) with ``torch.rand``'s uniform
  numbers recorded, and after the first, ``update_priority`` with fixed priorities;
* 5, the schedule: ``Agent.train`` whole, after each ``add`` (as ``main.py``), with batch 3, buffer 24,
  ``target_update_freq`` 3 and ``buffer_size_before_training`` 18, on one unending 30-step episode (the
  ring wraps): every draw recorded in order (the slots of each ``sample_ind``, the noise of each
  ``torch.randn_like``), the reward scales, priorities and encoder steps after each call, every network and
  target at the end.

Changes made from outside, none touching the reference's code:

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
* the replay (sections 4, 5): ``torch.cuda.mem_get_info`` answers (0, 0) (``ReplayBuffer.__init__`` asks it
  where to store; a CPU-only torch raises), and the ``torch.empty`` priority array is zeroed after
  construction (never-written slots are masked, but 0 x NaN is NaN).  The torch seeds are chosen so that no
  batch whose priorities are updated repeats a slot (which of two writes wins is unspecified, in torch as in
  XLA): 0 for section 4 (asserted), the first from 0 for section 5 (recorded in ``meta``).
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
from snapshot import compile_reference, fixture_path, load_definitions, read_snapshot

FILES = {"models": "MRQ/models.py", "utils": "MRQ/utils.py", "mrq": "MRQ/MRQ.py", "buffer": "MRQ/buffer.py"}
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


# ----------------------------------------------------------------------------- the replay and the schedule
REPLAY_CAP, REPLAY_BATCH = 64, 8  # section 4: buffer.ReplayBuffer alone (no wrap: 46 transitions + 7 final obs)
# episodes of the replay run, (length, ending): every kind of window end (see test_fidelity_mrq.py)
EPISODES = (
    (9, "terminated"),
    (7, "truncated"),
    (3, "terminated"),  # shorter than H_enc = 5 ...
    (2, "truncated"),  # ... followed by a truncation within H - 1 steps of its termination
    (8, "terminated"),
    (10, "truncated"),
    (3, "terminated"),
    (4, None),  # still running at the end
)
SNAPSHOTS = (35, 46)  # transitions stored when the buffer is sampled (the sixth step of episode 5; the end)
REPLAY_SEED = 0  # torch seed of the replay's draws: the Q batch that sets priorities has no repeated window
# section 5: Agent.train with its own ReplayBuffer, one unending episode (no final-observation slots), which wraps
SCHEDULE = dict(batch_size=3, buffer_size=24, target_update_freq=3, buffer_size_before_training=18, min_priority=0.5)
SCHEDULE_STEPS = 30  # trains after adds 19..30: 12 calls, target syncs at the 1st, 4th, 7th and 10th; wraps at 25


@contextlib.contextmanager
def cpu_storage():
    """``ReplayBuffer.__init__`` asks ``torch.cuda.mem_get_info()`` whether its storage fits on the GPU; on a
    CPU-only torch that raises, so it answers (0, 0): the storage stays on the (CPU) device."""
    original = torch.cuda.mem_get_info
    torch.cuda.mem_get_info = lambda *args, **kwargs: (0, 0)
    try:
        yield
    finally:
        torch.cuda.mem_get_info = original


@contextlib.contextmanager
def recording(module, name: str, log: list, tag: str):
    """``module.name`` runs as it stands and each result is appended to ``log`` as ``(tag, result)``."""
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        log.append((tag, result.detach().clone()))
        return result

    setattr(module, name, wrapped)
    try:
        yield
    finally:
        setattr(module, name, original)


def episode_stream(rng, episodes):
    """Transitions of ``episodes``: (state, action, next_state, reward, terminated, truncated) rows."""
    rows = []
    for length, ending in episodes:
        obs = rng.normal(size=(length + 1, OBS_DIM)).astype(np.float32)
        act = rng.uniform(-0.9, 0.9, size=(length, ACT_DIM)).astype(np.float32)
        rew = rng.normal(scale=1.5, size=length).astype(np.float32)
        for t in range(length):
            last = t == length - 1
            rows.append(
                (obs[t], act[t], obs[t + 1], rew[t], last and ending == "terminated", last and ending == "truncated")
            )
    return rows


def stream_arrays(rows) -> dict:
    return {
        "obs": np.stack([r[0] for r in rows]),
        "action": np.stack([r[1] for r in rows]),
        "next_obs": np.stack([r[2] for r in rows]),
        "reward": np.array([r[3] for r in rows], np.float32),
        "terminated": np.array([r[4] for r in rows]),
        "truncated": np.array([r[5] for r in rows]),
    }


def record_sample(out: dict, tag: str, rb, horizon: int, include_intermediate: bool):
    """One ``ReplayBuffer.sample`` call: torch's uniform draws, the slots they pick and the five arrays."""
    log = []
    with recording(torch, "rand", log, "u"):
        batch = rb.sample(horizon, include_intermediate=include_intermediate)
    assert len(log) == 1
    out[f"{tag}/u"], out[f"{tag}/ind"] = arr(log[0][1]), np.asarray(rb.sampled_ind, np.int32)
    for name, x in zip(("state", "action", "next_state", "reward", "not_done"), batch):
        out[f"{tag}/{name}"] = arr(x)


def run_replay(buffer_ns, out: dict):
    """Section 4: ``buffer.ReplayBuffer`` as MR.Q builds it (horizon max(H_enc, H_Q) = 5, LAP, initial priority
    1) fed the episodes one transition at a time; its mask after every add, its priorities, two samples of
    each kind, one priority update and its reward scale at the snapshots."""
    rows = episode_stream(np.random.default_rng(11), EPISODES)
    assert len(rows) == SNAPSHOTS[-1]
    out.update({f"replay/inputs/{k}": v for k, v in stream_arrays(rows).items()})
    with cpu_storage():
        rb = buffer_ns["ReplayBuffer"](
            (OBS_DIM,), ACT_DIM, 1.0, False, torch.device("cpu"), 1, 5, REPLAY_CAP, REPLAY_BATCH, True, 1.0
        )
    rb.priority.zero_()  # torch.empty: never-written slots hold whatever memory held (always masked, 0 * NaN = NaN)
    torch.manual_seed(REPLAY_SEED)
    slots, masks, sizes = [], [], []
    for k, (s, a, s2, r, term, trunc) in enumerate(rows):
        slots.append(rb.ind)
        rb.add(s, a, s2, float(r), bool(term), bool(trunc))
        masks.append(rb.mask.numpy() > 0)
        sizes.append(rb.size)
        if k + 1 not in SNAPSHOTS:
            continue
        tag = f"replay/at{k + 1}"
        out[f"{tag}/priority"], out[f"{tag}/max_priority"] = arr(rb.priority), np.float32(rb.max_priority)
        out[f"{tag}/csum_total"] = arr(torch.cumsum(rb.priority * rb.mask, 0)[-1])
        out[f"{tag}/reward_scale"] = np.float32(rb.reward_scale())
        record_sample(out, f"{tag}/enc", rb, 5, True)
        record_sample(out, f"{tag}/q", rb, 3, False)
        if k + 1 == SNAPSHOTS[0]:  # Agent.train's update_priority on the Q sample, with fixed priorities
            assert len(set(rb.sampled_ind.tolist())) == REPLAY_BATCH, rb.sampled_ind  # no repeated slot
            new = torch.tensor([0.6, 1.7, 0.9, 2.3, 1.2, 0.45, 1.9, 0.75], dtype=torch.float32)
            rb.update_priority(new)
            out[f"{tag}/new_priority"] = arr(new)
            out[f"{tag}/priority_after"], out[f"{tag}/max_after"] = arr(rb.priority), np.float32(rb.max_priority)
    out["replay/slot"] = np.asarray(slots, np.int32)  # the reference's slot of each transition
    out["replay/mask"] = np.stack(masks)  # (transitions, capacity) after each add
    out["replay/size"] = np.asarray(sizes, np.int32)
    assert rb.ind < REPLAY_CAP and not any(rb.mask.numpy()[slot] for slot in set(range(rb.ind)) - set(slots))


def schedule_once(ns, weights: dict, rows, seed: int):
    """``Agent.train`` after each add, torch seeded with ``seed``: (draws in order, per-call logs, agent)."""
    torch.manual_seed(0)
    with cpu_storage():
        agent = ns["Agent"](
            (OBS_DIM,),
            ACT_DIM,
            1.0,
            False,
            False,
            torch.device("cpu"),
            1,
            dict(SIZES, **SCHEDULE, enc_wd=WEIGHT_DECAY, value_wd=WEIGHT_DECAY, policy_wd=WEIGHT_DECAY),
        )
    for name, sd in weights.items():  # sections 1-3's weights; the first target sync copies the online ones
        getattr(agent, name).load_state_dict(sd)
    rb = agent.replay_buffer
    rb.priority.zero_()
    draws, encoder_steps, noise = [], [0], []
    original_sample_ind, original_train_encoder = rb.sample_ind, agent.train_encoder

    def sample_ind():  # the instance's own method, recorded
        ind = original_sample_ind()
        draws.append(("ind", np.asarray(ind, np.int32).copy()))
        return ind

    def train_encoder(*args):
        encoder_steps[0] += 1
        return original_train_encoder(*args)

    rb.sample_ind, agent.train_encoder = sample_ind, train_encoder
    torch.manual_seed(seed)
    log = {k: [] for k in ("trained", "reward_scale", "target_reward_scale", "priority", "max_priority", "encoder")}
    with recording(torch, "randn_like", noise, "noise"):
        for s, a, s2, r, term, trunc in rows:
            rb.add(s, a, s2, float(r), bool(term), bool(trunc))
            before, n_noise = agent.training_steps, len(noise)
            agent.train()
            draws.extend(noise[n_noise:])
            log["trained"].append(agent.training_steps > before)
            log["reward_scale"].append(agent.reward_scale)
            log["target_reward_scale"].append(agent.target_reward_scale)
            log["priority"].append(arr(rb.priority))
            log["max_priority"].append(rb.max_priority)
            log["encoder"].append(encoder_steps[0])
    return draws, log, agent


def run_schedule(ns, weights: dict, out: dict) -> int:
    """Section 5: ``Agent.train`` as it stands, with its own ``ReplayBuffer``, on one unending episode: every
    random draw (the slots of each sample, the target-policy noise) recorded in order, the reward scales, the
    priorities and the encoder steps after each call, and every network (and target) at the end.  The torch
    seed is the first from 0 whose Q batches (those that set priorities) repeat no slot: which of two updates
    of one slot wins is unspecified, in torch's index_put_ as in XLA's scatter.  Returns the seed."""
    rows = episode_stream(np.random.default_rng(12), ((SCHEDULE_STEPS, None),))
    out.update({f"sched/inputs/{k}": v for k, v in stream_arrays(rows).items()})
    for seed in range(100):
        draws, log, agent = schedule_once(ns, weights, rows, seed)
        q_batches = [x for (tag, x), (nxt, _) in zip(draws, draws[1:]) if tag == "ind" and nxt == "noise"]
        if all(len(set(x.tolist())) == len(x) for x in q_batches):
            break
    else:
        raise SystemExit("no seed below 100 gives Q batches without a repeated slot")
    out["sched/draw_kind"] = np.array([0 if tag == "ind" else 1 for tag, _ in draws], np.int8)  # 0 slots, 1 noise
    out["sched/ind"] = np.stack([x for tag, x in draws if tag == "ind"])
    out["sched/noise"] = np.stack([arr(x) for tag, x in draws if tag == "noise"])
    out["sched/trained"] = np.asarray(log["trained"])
    out["sched/encoder_steps"] = np.asarray(log["encoder"], np.int32)
    out["sched/priority"] = np.stack(log["priority"])
    for k in ("reward_scale", "target_reward_scale", "max_priority"):
        out[f"sched/{k}"] = np.asarray(log[k], np.float32)
    for name in weights:
        record_params(out, f"sched/final/{name}", getattr(agent, name))
    return seed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mrq", required=True, help="git dir of the fetched facebookresearch/MRQ snapshot")
    p.add_argument("--out", default=fixture_path("mrq_reference.npz"))
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

    # ------------------------------------------------------------------ 4. the replay, 5. the schedule
    buffer_ns = load_definitions(src["buffer"][0], FILES["buffer"], {"ReplayBuffer"})
    run_replay(buffer_ns, out)
    sched_ns = load_definitions(
        src["mrq"][0],
        FILES["mrq"],
        {"Hyperparameters", "Agent", "TwoHot", "realign", "masked_mse", "multi_step_reward", "maybe_augment_state"},
        {
            "models": SimpleNamespace(**models),
            "utils": SimpleNamespace(**utils),
            "buffer": SimpleNamespace(ReplayBuffer=buffer_ns["ReplayBuffer"]),
        },
    )
    schedule_seed = run_schedule(sched_ns, weights, out)

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
        "replay": {
            "capacity": REPLAY_CAP,
            "batch": REPLAY_BATCH,
            "horizon": 5,
            "initial_priority": 1.0,
            "episodes": [list(e) for e in EPISODES],
            "snapshots": list(SNAPSHOTS),
            "seed": REPLAY_SEED,
        },
        "schedule": {"hp": SCHEDULE, "steps": SCHEDULE_STEPS, "seed": schedule_seed},
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; mrq {commit}")


if __name__ == "__main__":
    main()
