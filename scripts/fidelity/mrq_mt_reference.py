"""Fixture generator: multitask MR.Q's networks, losses, gradients and one full update from ScaleMRL's code.

Runs the *official* code on fixed weights, a fixed batch of two-task windows and fixed random draws, and
writes inputs, weights and outputs to ``tests/fixtures/mrq_mt_reference.npz``, which
``tests/test_fidelity_mrq_mt.py`` compares against ``agents/mrq_mt.py`` without torch.

Reference (read from a fetched snapshot, never copied into this repository): johanobandoc/ScaleMRL
(Obando-Ceron et al. 2026).  Executed as they stand:

* ``tdmpc2/mrq.py``: ``MRQModel`` and ``MRQ`` (``MRQ.update`` runs as it stands: ``_encoder_loss``, the
  encoder AdamW step with ``clip_grad_norm_``, ``_value_loss``, the value step, ``_policy_loss`` with the
  RunningScale, the policy step, ``soft_update_targets``), and ``MRQ.forward`` (acting);
* ``tdmpc2/common/layers.py``: ``SimNorm``, ``NormedLinear``, ``mlp``, ``policy``, ``enc``;
  ``tdmpc2/common/math.py``: ``soft_ce``, ``symlog``, ``symexp``, ``two_hot``, ``two_hot_inv``,
  ``discount_heuristic``; ``tdmpc2/common/init.py``: ``weight_init``; ``tdmpc2/common/scale.py``:
  ``RunningScale``; ``tdmpc2/common/__init__.py``: ``MODEL_SIZE``; ``tdmpc2/config.py``: ``Config`` (its
  defaults; the fields ``parse_cfg`` fills at run time are set here as it would set them).

Nothing else of the reference runs (``buffer.py`` is not executed: the batch it would sample is supplied in
its layout, ``obs (H+1, B, S)``, ``action (H, B, A)``, ``reward (H, B, 1)``, ``task (H, B)``).  Changes made
from outside, none touching the reference's code:

* device: the modules' ``torch`` is a stand-in that forwards everything to torch except ``torch.device``
  (CPU where the reference hard-codes ``cuda:{rank}``), ``torch.randperm`` and ``torch.randn_like``.
* random draws: ``torch.randperm`` returns fixed permutations in call order (``Q_target``'s head draw,
  then ``_policy_loss``'s: K = 3 heads, so the policy averages two random heads), ``torch.randn_like``
  returns fixed N(0, 1.6^2) draws (target-policy noise; exploration noise for ``forward``), wide enough
  that both the noise clip and the [-1, 1] clip act on some entries (asserted).
* sizes: model size S scaled to the zoo's ``--network.width 16`` (enc 8, mlp 16, latent 24 = three
  SimNorm groups of 8, encoder layers 2, 3 Q heads), ``mrq_za_dim`` 8, 101 bins, horizon 5 (the README's
  ``horizon=5`` for ``agent=mrq``), two tasks with obs dims (3, 4) and action dims (1, 2), padded to 4 / 2,
  episode lengths (500, 100) -> per-task discounts (0.99, 0.95) by ``discount_heuristic``; fixed task
  embeddings of width 4 (CLIP's 512 in the reference; drawn N(0, 0.5^2)), batch 8 (tasks 0, 1, 0, 1, ...).
* weights: the reference's init (``weight_init``: trunc-normal std 0.02, zero biases; LayerNorms 1 / 0) with
  ``torch.manual_seed(0)``, then every Linear weight redrawn N(0, 1 / fan_in) (at std 0.02 every output is
  near-constant: Q ~ 0, tanh ~ 0, no clip acts; the policy's output layer N(0, 9 / fan_in), so that tanh
  comes near +-1 on some rows and the target action's [-1, 1] clip acts, and the Q heads' output layers
  N(0, 4 / fan_in), so that Q spreads over several units and the RunningScale's max(P95 - P5, 1) is not
  the floor) and every bias / LayerNorm gain / LayerNorm bias set to N(0, 0.1^2) / 1 + N(0, 0.1^2) /
  N(0, 0.1^2); every target network (a deepcopy in ``MRQModel``) is its
  online network plus N(0, 0.05^2) on every parameter, so that a bug using the wrong set shows.
* recording: in the first ``update`` the three optimizers are stand-ins whose ``step()`` records the
  gradients and changes nothing (so every loss is taken at the initial weights; ``clip_grad_norm_``'s total
  norms are below the clip 20, asserted, so the recorded gradients are the raw ones); losses and
  intermediates are read from the methods' frames.  For the one-step check a second ``MRQ`` runs ``update``
  with its own torch AdamW optimizers, whose weight decay is set to 0.5 in their param groups (reference
  1e-4: lr x wd x |p| ~ 1e-8 in one step would be far below float32 resolution); the total norms that its
  two ``clip_grad_norm_`` calls return (the encoder group's; the value's, after the encoder step) are
  recorded (both below 20, asserted).  Every parameter after it is recorded but the Q targets' (the test
  derives those from ``init/_Qs_target`` and ``step/_Qs`` by the reference's ``lerp_``; kept out to keep
  the fixture under 300 KB).
* RunningScale: S starts at 1.3 in both runs (``_q_scale.value``; 1 at the start of training), so that its
  lerp shows; its P95 - P5 here is 5.2, above the floor of 1.
* RunningScale alone: ``update`` / ``_percentile`` on fixed vectors of 8 and 13 values from a scale of 1.3.

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 numpy
    /tmp/refvenv/bin/python scripts/fidelity/mrq_mt_reference.py --scalemrl /work/.mirror/johanobandoc+ScaleMRL/repo

``--scalemrl``: a git directory (bare or work tree) of the fetched snapshot; the files are read at ``HEAD``
with ``git show`` and the commit is recorded in the fixture.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
from types import SimpleNamespace

import numpy as np
import torch
from sac_reference import RecordingOptimizer, arr
from snapshot import fixture_path, load_definitions, locals_at_return, read_snapshot

FILES = {
    "mrq": "tdmpc2/mrq.py",
    "layers": "tdmpc2/common/layers.py",
    "math": "tdmpc2/common/math.py",
    "init": "tdmpc2/common/init.py",
    "scale": "tdmpc2/common/scale.py",
    "common": "tdmpc2/common/__init__.py",
    "config": "tdmpc2/config.py",
}
OBS_DIMS, ACT_DIMS, EPISODE_LENGTHS = (3, 4), (1, 2), (500, 100)
TASK_DIM, BATCH, HORIZON = 4, 8, 5
SIZES = dict(enc_dim=8, mlp_dim=16, latent_dim=24, num_enc_layers=2, num_q=3, mrq_za_dim=8)
WEIGHT_DECAY = 0.5
Q_SCALE = 1.3  # the RunningScale's S before the update (reference: 1 at the start of training)
TARGET_PERM, POLICY_PERM = (2, 0, 1), (1, 2, 0)  # heads {2, 0} for the target min, {1, 2} for the policy
NETS = ("_encoder", "_za", "_zsa", "_dynamics_model", "_pi", "_Qs")
TARGETS = ("_encoder_target", "_za_target", "_zsa_target", "_pi_target", "_Qs_target")


class Draws:
    """Fixed results of ``torch.randperm`` / ``torch.randn_like``, popped in call order."""

    def __init__(self):
        self.perms, self.normals = [], []

    def randperm(self, n, *args, **kwargs):
        perm = self.perms.pop(0)
        assert len(perm) == n, (perm, n)
        return torch.tensor(perm, dtype=torch.long)

    def randn_like(self, x, *args, **kwargs):
        eps = self.normals.pop(0)
        assert tuple(eps.shape) == tuple(x.shape), (eps.shape, x.shape)
        return eps.clone().to(x.dtype)

    @contextlib.contextmanager
    def queued(self, perms, normals):
        self.perms, self.normals = [list(p) for p in perms], list(normals)
        yield
        assert not self.perms and not self.normals, ("fixed draws left unused", self.perms, len(self.normals))


class CpuTorch:
    """The reference's ``torch``: torch itself, except the device (CPU) and the two random calls (``Draws``)."""

    def __init__(self, draws: Draws):
        self._draws = draws

    def __getattr__(self, name):
        return getattr(torch, name)

    def device(self, *args, **kwargs):
        return torch.device("cpu")

    def randperm(self, *args, **kwargs):
        return self._draws.randperm(*args, **kwargs)

    def randn_like(self, *args, **kwargs):
        return self._draws.randn_like(*args, **kwargs)


@contextlib.contextmanager
def recorded_clip_norms(into: list):
    """``torch.nn.utils.clip_grad_norm_`` as it stands, its returned total norm appended to ``into``."""
    original = torch.nn.utils.clip_grad_norm_

    def clip(*args, **kwargs):
        norm = original(*args, **kwargs)
        into.append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = clip
    try:
        yield
    finally:
        torch.nn.utils.clip_grad_norm_ = original


class Recording(RecordingOptimizer):
    """``RecordingOptimizer`` with the ``zero_grad(set_to_none=True)`` signature MRQ calls."""

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad()


class BufferStandIn:
    """``buffer.sample(device)`` -> the fixed batch in the reference's time-major layout."""

    def __init__(self, batch):
        self.batch = batch

    def sample(self, device):
        return tuple(x.clone() for x in self.batch)


def load_reference(src: dict, draws: Draws) -> dict:
    cpu_torch = CpuTorch(draws)
    math_ns = load_definitions(
        src["math"], FILES["math"], {"soft_ce", "symlog", "symexp", "two_hot", "two_hot_inv", "discount_heuristic"}
    )
    layers_ns = load_definitions(src["layers"], FILES["layers"], {"SimNorm", "NormedLinear", "mlp", "policy", "enc"})
    init_ns = load_definitions(src["init"], FILES["init"], {"weight_init"})
    scale_ns = load_definitions(src["scale"], FILES["scale"], {"RunningScale"}, {"torch": cpu_torch})
    common_ns = load_definitions(src["common"], FILES["common"], {"MODEL_SIZE"})
    config_ns = load_definitions(src["config"], FILES["config"], {"Config"})
    mrq_ns = load_definitions(
        src["mrq"],
        FILES["mrq"],
        {"MRQModel", "MRQ"},
        {
            "torch": cpu_torch,
            "layers": SimpleNamespace(**layers_ns),
            "math": SimpleNamespace(**math_ns),
            "init": SimpleNamespace(**init_ns),
            "RunningScale": scale_ns["RunningScale"],
        },
    )
    return {"math": math_ns, "scale": scale_ns, "common": common_ns, "config": config_ns, "mrq": mrq_ns}


def make_cfg(ref: dict, table: np.ndarray):
    """``Config()`` with what ``parse_cfg`` fills at run time, and the sizes above."""
    cfg = ref["config"]["Config"]()
    for k, v in SIZES.items():
        setattr(cfg, k, v)
    cfg.agent, cfg.horizon, cfg.batch_size, cfg.compile, cfg.multitask = "mrq", HORIZON, BATCH, False, True
    cfg.obs, cfg.obs_shape, cfg.action_dim = "state", {"state": (max(OBS_DIMS),)}, max(ACT_DIMS)
    cfg.bin_size = (cfg.vmax - cfg.vmin) / (cfg.num_bins - 1)
    cfg.task_dim, cfg.task_embeddings = TASK_DIM, table.tolist()
    cfg.tasks = ["task-a", "task-b"]
    cfg.num_tasks = len(cfg.tasks)
    cfg.action_dims, cfg.episode_lengths = list(ACT_DIMS), list(EPISODE_LENGTHS)
    cfg.discounts = [ref["math"]["discount_heuristic"](cfg, n) for n in EPISODE_LENGTHS]
    return cfg


def set_weights(model, seed: int, q_init_scale: float):
    """Linear weights N(0, g^2 / fan_in), biases N(0, 0.1^2), LayerNorms 1 + N(0, 0.1^2) / N(0, 0.1^2), with gain
    g = 1 but for the output layers of the policy (3) and of the Q heads (2); targets perturbed by
    N(0, 0.05^2); the RunningScale's S starts at ``q_init_scale``."""
    gains = {id(model._pi[-1]): 3.0, **{id(q[-1]): 2.0 for q in model._Qs}}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in NETS:
            for mod in getattr(model, name).modules():
                if isinstance(mod, torch.nn.LayerNorm):
                    mod.weight.copy_(1.0 + 0.1 * torch.randn(mod.weight.shape, generator=gen))
                    mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=gen))
                elif isinstance(mod, torch.nn.Linear):
                    std = gains.get(id(mod), 1.0) / mod.in_features**0.5
                    mod.weight.copy_(std * torch.randn(mod.weight.shape, generator=gen))
                    mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=gen))
        for name in TARGETS:
            target = getattr(model, name)
            target.load_state_dict(getattr(model, name.removesuffix("_target")).state_dict())
            for v in target.parameters():
                v.add_(0.05 * torch.randn(v.shape, generator=gen))


def record_params(out: dict, prefix: str, model, names=NETS + TARGETS):
    for name in names:
        for k, v in getattr(model, name).state_dict().items():
            out[f"{prefix}/{name}.{k}"] = arr(v)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scalemrl", required=True, help="git dir of the fetched johanobandoc/ScaleMRL snapshot")
    p.add_argument(
        "--out",
        default=fixture_path("mrq_mt_reference.npz"),
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    snap = {k: read_snapshot(a.scalemrl, f) for k, f in FILES.items()}
    commit = snap["mrq"][1]
    assert all(c == commit for _, c in snap.values())
    src = {k: s for k, (s, _) in snap.items()}
    draws = Draws()
    ref = load_reference(src, draws)
    MRQModel, MRQ, math = ref["mrq"]["MRQModel"], ref["mrq"]["MRQ"], SimpleNamespace(**ref["math"])

    # ------------------------------------------------------------------ config, weights, batch
    rng = np.random.default_rng(11)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    table = f32(rng.normal(scale=0.5, size=(len(OBS_DIMS), TASK_DIM)))
    cfg = make_cfg(ref, table)
    torch.manual_seed(0)
    model = MRQModel(cfg)
    assert len(model._Qs) == 3 and cfg.mrq_distributional_q and cfg.mrq_policy_layernorm
    assert cfg.mrq_reward_norm == "newt" and cfg.mrq_enc_horizon == HORIZON
    set_weights(model, 1, Q_SCALE)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    record_params(out, "init", model)
    out["init/task_emb"] = arr(model._task_emb.weight)

    task = np.arange(BATCH) % len(OBS_DIMS)
    obs = f32(rng.normal(size=(BATCH, HORIZON + 1, max(OBS_DIMS))))
    act = f32(rng.uniform(-0.9, 0.9, size=(BATCH, HORIZON, max(ACT_DIMS))))
    for b in range(BATCH):  # padding: the env's zeros beyond each task's own dimensions
        obs[b, :, OBS_DIMS[task[b]] :] = 0.0
        act[b, :, ACT_DIMS[task[b]] :] = 0.0
    inputs = {
        "obs": obs,
        "action": act,
        "reward": f32(rng.normal(scale=2.0, size=(BATCH, HORIZON))),
        "task": task.astype(np.int32),
        "target_noise": f32(rng.standard_normal((BATCH, max(ACT_DIMS))) * 1.6),
        "explore_noise": f32(rng.standard_normal((BATCH, max(ACT_DIMS))) * 1.6),
        "target_perm": np.asarray(TARGET_PERM, np.int32),
        "policy_perm": np.asarray(POLICY_PERM, np.int32),
        "episode_lengths": np.asarray(EPISODE_LENGTHS, np.int32),
    }
    out.update({f"inputs/{k}": v for k, v in inputs.items()})
    t_obs = torch.as_tensor(obs).transpose(0, 1).contiguous()  # (H+1, B, S)
    t_act = torch.as_tensor(act).transpose(0, 1).contiguous()  # (H, B, A)
    t_rew = torch.as_tensor(inputs["reward"]).T.contiguous()[..., None]  # (H, B, 1)
    t_task = torch.as_tensor(task, dtype=torch.long)[None].expand(HORIZON, BATCH).contiguous()  # (H, B)
    buffer = BufferStandIn((t_obs, t_act, t_rew, t_task))
    t_noise, t_explore = torch.as_tensor(inputs["target_noise"]), torch.as_tensor(inputs["explore_noise"])

    # ------------------------------------------------------------------ 1. pieces: networks, two-hot, discounts
    with torch.no_grad():
        zs = model.encode(t_obs[0], t_task[0])
        zsa = model.encode_zsa(zs, t_act[0])
        next_zs, r_logits = model.predict(zs, t_act[0])
        action, pre = model.pi(zs, t_task[0])
        q_logits = torch.stack([q(zsa) for q in model._Qs])
        out.update(
            {
                "fwd/zs": arr(zs),
                "fwd/zsa": arr(zsa),
                "fwd/next_zs": arr(next_zs),
                "fwd/reward_logits": arr(r_logits),
                "fwd/action": arr(action),
                "fwd/pre_activ": arr(pre),
                "fwd/q": arr(math.two_hot_inv(q_logits.reshape(-1, cfg.num_bins), cfg).reshape(3, BATCH)),
                "fwd/target_zs": arr(model.encode_target(t_obs[0], t_task[0])),
                "fwd/target_action": arr(model.pi_target(zs, t_task[0])),
                "fwd/two_hot": arr(math.two_hot(torch.as_tensor(inputs["reward"]).reshape(-1, 1), cfg)),
                "fwd/soft_ce": arr(math.soft_ce(r_logits, t_rew[0], cfg)[:, 0]),
            }
        )
        lengths = [4, 10, 50, 100, 250, 500, 1000, 5000]
        out["discount/lengths"] = np.asarray(lengths, np.int32)
        out["discount/gamma"] = f32([math.discount_heuristic(cfg, n) for n in lengths])
        out["discount/tasks"] = f32(cfg.discounts)
        assert abs(cfg.discounts[0] - 0.99) < 1e-9 and abs(cfg.discounts[1] - 0.95) < 1e-9, cfg.discounts
        for n in (8, 13):  # RunningScale alone: one update from 1.3
            scale = ref["scale"]["RunningScale"](cfg)
            scale.value.fill_(1.3)
            x = torch.as_tensor(f32(rng.normal(scale=2.0, size=(n, 1))))
            scale.update(x)
            out[f"scale/x{n}"], out[f"scale/p{n}"], out[f"scale/value{n}"] = (
                arr(x[:, 0]),
                arr(scale._percentile(x)[:, 0]),
                np.float32(scale.value.item()),
            )
        with draws.queued([], [t_explore]):
            out["act/explore"] = arr(MRQ(model, cfg).forward(t_obs[0], task=t_task[0], eval_mode=False))
        with draws.queued([], []):
            out["act/eval"] = arr(MRQ(model, cfg).forward(t_obs[0], task=t_task[0], eval_mode=True))

    # ------------------------------------------------------------------ 2. one update, recording (nothing moves)
    agent = MRQ(model, cfg)
    agent._q_scale.value.fill_(Q_SCALE)
    agent.encoder_optim = Recording(model.encoder_params())
    agent.value_optim = Recording(model.value_params())
    agent.policy_optim = Recording(model.policy_params())
    frames, norms = {}, []
    with (
        draws.queued([TARGET_PERM, POLICY_PERM], [t_noise]),
        recorded_clip_norms(norms),
        locals_at_return({"_encoder_loss", "_value_loss", "_policy_loss"}, frames),
    ):
        agent.update(buffer)
    assert len(norms) == 2 and max(norms) < cfg.grad_clip_norm, norms  # the clips are inert: raw grads recorded
    enc, val, pol = frames["_encoder_loss"], frames["_value_loss"], frames["_policy_loss"]
    out["enc/loss"], out["enc/dyn"], out["enc/rew"] = (
        np.float32(enc[k].item()) for k in ("enc_loss", "total_dyn", "total_rew")
    )
    out["enc/target_zs"] = arr(torch.stack(enc["target_zs"], 1))
    for name, g in zip(
        [f"{n}.{k}" for n in NETS[:4] for k, _ in getattr(model, n).named_parameters()], agent.encoder_optim.grads
    ):
        out[f"enc/grad/{name}"] = arr(g)
    clipped = (
        int((val["noise"].abs() == cfg.mrq_noise_clip).sum()),
        int(((val["next_action"].abs() == 1) & (model._action_masks[t_task[0]] > 0)).sum()),
    )
    assert min(clipped) > 0, clipped  # both clips of the target action act on some entries
    out["value/next_action"], out["value/q_next"] = arr(val["next_action"]), arr(val["Q_tgt"][:, 0])
    out["value/return"], out["value/bootstrap"] = arr(val["ms_reward"][:, 0]), arr(val["disc_accum"][:, 0])
    out["value/y"], out["value/q"] = arr(val["Q_target"][:, 0]), arr(val["Q"].T)
    out["value/loss"] = np.float32(val["value_loss"].item())
    for (k, _), g in zip(model._Qs.named_parameters(), agent.value_optim.grads):
        out[f"value/grad/_Qs.{k}"] = arr(g)
    out["policy/action"], out["policy/pre_activ"] = arr(pol["pi_action"]), arr(pol["pre_activ"])
    out["policy/q"] = arr(((pol["q_vals"][0] + pol["q_vals"][1]) / 2)[:, 0])
    out["policy/scale"], out["policy/loss"] = (
        np.float32(agent._q_scale.value.item()),
        np.float32(pol["policy_loss"].item()),
    )
    for (k, _), g in zip(model._pi.named_parameters(), agent.policy_optim.grads):
        out[f"policy/grad/_pi.{k}"] = arr(g)

    # ------------------------------------------------------------------ 3. one update with torch's AdamW
    torch.manual_seed(0)
    stepper_model = MRQModel(cfg)
    stepper_model.load_state_dict(initial)
    stepper = MRQ(stepper_model, cfg)
    stepper._q_scale.value.fill_(Q_SCALE)
    for opt in (stepper.encoder_optim, stepper.value_optim, stepper.policy_optim):
        for group in opt.param_groups:
            group["weight_decay"] = WEIGHT_DECAY
    norms = []
    with draws.queued([TARGET_PERM, POLICY_PERM], [t_noise]), recorded_clip_norms(norms):
        stepper.update(buffer)
    assert len(norms) == 2 and max(norms) < cfg.grad_clip_norm, norms
    out["clip/norms"] = f32(norms)  # as this update's clips saw them (the value's after the encoder step)
    # every parameter but the Q targets' (derived in the test from init/_Qs_target and step/_Qs by the
    # reference's lerp_, to keep the fixture small)
    record_params(out, "step", stepper_model, NETS + TARGETS[:-1])
    out["step/q_scale"] = np.float32(stepper._q_scale.value.item())

    command = f"/tmp/refvenv/bin/python scripts/fidelity/mrq_mt_reference.py --scalemrl {shlex.quote(a.scalemrl)}"
    keys = (
        "lr",
        "enc_lr_scale",
        "grad_clip_norm",
        "tau",
        "discount_denom",
        "discount_min",
        "discount_max",
        "num_bins",
        "vmin",
        "vmax",
        "simnorm_dim",
        "batch_size",
        "utd",
        "horizon",
        "task_dim",
        "mrq_za_dim",
        "mrq_exploration_noise",
        "mrq_target_policy_noise",
        "mrq_noise_clip",
        "mrq_pre_activ_weight",
        "mrq_dyn_weight",
        "mrq_reward_weight",
        "mrq_reward_norm",
        "mrq_enc_horizon",
        "mrq_policy_layernorm",
        "mrq_distributional_q",
        "mrq_num_q",
        "mrq_num_q_from_model_size",
    )
    defaults = ref["config"]["Config"]()
    meta = {
        "generator": "scripts/fidelity/mrq_mt_reference.py",
        "command": command,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scalemrl": {
            "repository": "https://github.com/johanobandoc/ScaleMRL",
            "commit": commit,
            "files": list(FILES.values()),
        },
        "sizes": dict(SIZES, obs_dims=OBS_DIMS, act_dims=ACT_DIMS, task_dim=TASK_DIM, batch=BATCH, horizon=HORIZON),
        "hp": {k: getattr(cfg, k) for k in keys},
        "hp_defaults": {k: getattr(defaults, k) for k in keys},
        "model_size": ref["common"]["MODEL_SIZE"],
        "weight_decay": WEIGHT_DECAY,
        "q_scale": Q_SCALE,
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; ScaleMRL {commit}")


if __name__ == "__main__":
    main()
