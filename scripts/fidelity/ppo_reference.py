"""Fixture generator: one PPO update (GAE, losses, gradients, clipped Adam steps) from CleanRL.

Runs the *official* code on fixed weights, a fixed rollout and fixed minibatch permutations, and writes
inputs, weights and outputs to ``tests/fixtures/ppo_reference.npz``, which ``tests/test_fidelity_ppo.py``
compares against ``agents/ppo.py`` without torch.

Reference (read from a fetched snapshot, never copied into this repository): CleanRL,
``cleanrl/ppo_continuous_action.py`` (Huang et al. 2022).  Executed as they stand:

* its ``Args`` dataclass (every hyperparameter not set below keeps CleanRL's default: norm_adv,
  clip_coef 0.2, clip_vloss, vf_coef 0.5, max_grad_norm 0.5, gamma 0.99, gae_lambda 0.95, anneal_lr),
  ``layer_init`` and the ``Agent`` class (64-64 tanh actor mean and critic, orthogonal init, the
  state-independent ``actor_logstd``), at CleanRL's own width 64;
* from ``__main__``: the three ``args.batch_size / minibatch_size / num_iterations`` lines,
  ``agent = Agent(envs).to(device)`` and ``optimizer = optim.Adam(..., eps=1e-5)``;
* the body of ``for iteration in range(1, args.num_iterations + 1):`` without its rollout loop
  (``for step in range(0, args.num_steps):``) and without the logging at its end: the learning-rate
  annealing, the bootstrap and GAE block, the flattening, the epoch / minibatch loop (ratio, approx_kl,
  clipfracs, per-minibatch advantage normalisation, clipped policy loss, clipped value loss, entropy,
  backward, ``nn.utils.clip_grad_norm_``, ``optimizer.step()``) and the explained-variance lines.

Nothing else of the script runs (module-level imports this venv lacks, such as gymnasium, tyro and
tensorboard, are skipped; CleanRL's ``iteration`` is set in the namespace the statements run in).  The rollout the
skipped loop would have collected is supplied: observations (as the agent sees them, i.e. after CleanRL's
env-side normalisation wrappers), actions a = mean + std * eps with fixed eps, rewards and ``dones``;
``logprobs``, ``values`` and ``next_obs``'s value come from the reference ``Agent`` itself.  Changes made
from outside, none touching the reference's code:

* permutation: the script's ``np`` is a stand-in whose ``random.shuffle(b_inds)`` writes the next fixed
  permutation (one per epoch, stored in the fixture) into ``b_inds`` in place; the rest is numpy's.
* recording: ``nn.utils.clip_grad_norm_`` is a stand-in that records the gradients it receives (before
  clipping) and the total norm it returns, then runs torch's own; ``optim.Adam`` is torch's own Adam,
  subclassed so that ``step()`` first records the minibatch's losses from the script's variables and the
  gradients it is about to apply (after clipping), then steps, then records the parameters.
* log std: ``actor_logstd`` (CleanRL: zeros) is set to ``LOG_STD`` after the init, so that std != 1 and
  a std / log-std / variance mix-up shows.
* learning rate: ``LEARNING_RATE`` = 0.02 (CleanRL: 3e-4), so that within the update's four minibatch
  steps some probability ratios leave [0.8, 1.2] and some values move by more than clip_coef: both clips
  are exercised (asserted below).  ``ent_coef`` = 0.01 (CleanRL: 0), so the entropy bonus enters the loss.
* iteration: the update is CleanRL's iteration ``ITERATION`` = 2 of ``num_iterations`` = 4
  (total_timesteps 64), so the annealed lr is 0.75 x 0.02 = 0.015; the optimizer is fresh (no Adam history).

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 numpy
    /tmp/refvenv/bin/python scripts/fidelity/ppo_reference.py --cleanrl /work/.mirror/vwxyzjn+cleanrl/repo

``--cleanrl``: a git directory (bare or work tree) of the fetched snapshot; the file is read at ``HEAD``
with ``git show`` and the commit is recorded in the fixture.  ``--float64-check`` also reruns the update in
float64 from the fixture's float32 weights and inputs and prints how far the float32 reference is from it
(the floor under the test's tolerances; nothing of it is written).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import shlex
from types import SimpleNamespace

import numpy as np
import torch
from snapshot import compile_reference, fixture_path, load_definitions, read_snapshot

CLEANRL_FILE = "cleanrl/ppo_continuous_action.py"
OBS_DIM, ACT_DIM, NUM_ENVS, NUM_STEPS = 3, 2, 2, 8
NUM_MINIBATCHES, UPDATE_EPOCHS = 2, 2
LEARNING_RATE, ENT_COEF = 0.02, 0.01
ITERATION, NUM_ITERATIONS = 2, 4
LOG_STD = (-0.4, 0.2)
TORCH_SEED, INPUT_SEED = 0, 2024
MARGIN = 1e-4  # every clip decision at least this far from its threshold (so float32 cannot flip it)


# ----------------------------------------------------------------------------- reading the reference
def main_statements(source: str, filename: str):
    """(setup, update) code objects from ``if __name__ == "__main__":``.

    setup: the ``args.batch_size / minibatch_size / num_iterations`` lines, ``agent = Agent(envs)...`` and
    ``optimizer = optim.Adam(...)``.  update: the ``for iteration ...`` loop's body up to and including the
    ``for epoch ...`` loop and the explained-variance assignments after it, without the rollout loop
    ``for step ...``."""
    tree = ast.parse(source, filename)
    main = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'")
    prefixes = (
        "args.batch_size =",
        "args.minibatch_size =",
        "args.num_iterations =",
        "agent = Agent(",
        "optimizer = optim.Adam(",
    )
    setup = [n for n in main.body if ast.unparse(n).startswith(prefixes)]
    if len(setup) != len(prefixes):
        raise SystemExit(f"{filename}: set-up statements not found: {[ast.unparse(n) for n in setup]}")
    loop = next((n for n in main.body if isinstance(n, ast.For) and ast.unparse(n.target) == "iteration"), None)
    if loop is None:
        raise SystemExit(f"{filename}: 'for iteration in ...' not found")
    update, seen = [], set()
    for node in loop.body:
        target = ast.unparse(node.target) if isinstance(node, ast.For) else None
        if target == "step":
            seen.add(target)
            continue  # the rollout: supplied from outside
        if "epoch" in seen and not (isinstance(node, ast.Assign) and "writer" not in ast.unparse(node)):
            break  # logging follows the explained-variance assignments
        update.append(node)
        seen.add(target)
    if not {"step", "epoch"} <= seen or "explained_var" not in ast.unparse(ast.Module(update, [])):
        raise SystemExit(f"{filename}: rollout / epoch loops or explained_var not found in the iteration loop")
    return compile_reference(setup, filename), compile_reference(update, filename)


# ----------------------------------------------------------------------------- stand-ins
class Proxy:
    """A module with some attributes replaced (the rest read from ``base``)."""

    def __init__(self, base, **over):
        self._base, self.__dict__["_over"] = base, over

    def __getattr__(self, name):
        return self._over[name] if name in self._over else getattr(self._base, name)


def fixed_shuffle(permutations):
    """``np.random.shuffle`` for ``b_inds``: writes the next fixed permutation in place."""
    queue = [np.asarray(p) for p in permutations]

    def shuffle(x):
        assert isinstance(x, np.ndarray) and x.shape == queue[0].shape, x
        x[:] = queue.pop(0)

    shuffle.queue = queue
    return shuffle


def recording_clip(record: dict):
    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        record.setdefault("grads", [p.grad.detach().clone() for p in parameters])  # the first minibatch's
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, *args, **kwargs)
        record.setdefault("norms", []).append(float(norm))
        return norm

    return clip_grad_norm_


def arr(t) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


class RecordingAdam(torch.optim.Adam):
    """torch's Adam; ``step()`` also records the minibatch's losses (from the script's namespace ``ns``),
    the gradients it applies (first step) and the parameters after the step (first step)."""

    ns: dict = None

    def __init__(self, params, *args, **kwargs):
        self.named = list(params)
        super().__init__(self.named, *args, **kwargs)
        self.steps = []

    def step(self, closure=None):
        ns = self.ns
        rec = {k: ns[k].item() for k in ("pg_loss", "v_loss", "entropy_loss", "approx_kl", "old_approx_kl", "loss")}
        rec["clipfrac"] = ns["clipfracs"][-1]
        rec["mb_inds"] = np.array(ns["mb_inds"])
        rec["lr"] = self.param_groups[0]["lr"]
        # the decisions of both clips, to assert that they are exercised and not on a knife's edge
        with torch.no_grad():
            ratio, newvalue, mb = ns["ratio"], ns["newvalue"], ns["mb_inds"]
            dv = newvalue - ns["b_values"][mb]
            rec["ratio"], rec["dv"] = arr(ratio), arr(dv)
            rec["pg_gap"] = arr((ns["pg_loss1"] - ns["pg_loss2"]).abs())
            rec["v_gap"] = arr((ns["v_loss_unclipped"] - ns["v_loss_clipped"]).abs())
        if not self.steps:
            rec["grads"] = [p.grad.detach().clone() for p in self.named]
        super().step(closure)
        if not self.steps:
            rec["params"] = [p.detach().clone() for p in self.named]
        self.steps.append(rec)


# ----------------------------------------------------------------------------- the reference
def run_cleanrl(source: str, inputs: dict, out: dict, dtype=torch.float32, init: dict | None = None):
    """CleanRL's update on ``inputs``; its numbers go into ``out``.  ``dtype`` / ``init`` (float64 check only):
    the networks and inputs in that dtype, the weights and actions loaded from a float32 run's ``out``."""
    clip_record = {}
    shuffle = fixed_shuffle(inputs["permutations"])
    nn_ = Proxy(torch.nn, utils=Proxy(torch.nn.utils, clip_grad_norm_=recording_clip(clip_record)))
    np_ = Proxy(np, random=Proxy(np.random, shuffle=shuffle))
    ns = load_definitions(
        source,
        CLEANRL_FILE,
        {"Args", "layer_init", "Agent"},
        {"nn": nn_, "np": np_, "optim": Proxy(torch.optim, Adam=RecordingAdam), "__file__": CLEANRL_FILE},
    )
    args = ns["Args"](
        num_envs=NUM_ENVS,
        num_steps=NUM_STEPS,
        num_minibatches=NUM_MINIBATCHES,
        update_epochs=UPDATE_EPOCHS,
        total_timesteps=NUM_ITERATIONS * NUM_ENVS * NUM_STEPS,
        learning_rate=LEARNING_RATE,
        ent_coef=ENT_COEF,
    )
    setup, update = main_statements(source, CLEANRL_FILE)
    box = lambda n: SimpleNamespace(shape=(n,))  # noqa: E731
    envs = SimpleNamespace(single_observation_space=box(OBS_DIM), single_action_space=box(ACT_DIM))
    run = dict(ns, args=args, envs=envs, device=torch.device("cpu"))
    torch.manual_seed(TORCH_SEED)
    exec(setup, run)
    agent, optimizer = run["agent"], run["optimizer"]
    assert args.num_iterations == NUM_ITERATIONS and args.minibatch_size == NUM_STEPS * NUM_ENVS // NUM_MINIBATCHES
    with torch.no_grad():
        agent.actor_logstd.copy_(torch.tensor([LOG_STD]))
    if init is not None:  # in place (the optimizer keeps the same parameters)
        agent.to(dtype).load_state_dict({k: torch.as_tensor(v) for k, v in init.items()})
    for k, v in agent.state_dict().items():
        out[f"cleanrl/init/{k}"] = arr(v)

    # the rollout the skipped loop would have stored (CleanRL's storage layout, (num_steps, num_envs, ...))
    t = {k: torch.as_tensor(v).to(dtype) for k, v in inputs.items() if k != "permutations"}
    with torch.no_grad():
        mean = agent.actor_mean(t["obs"])
        actions = mean + torch.exp(agent.actor_logstd) * t["eps"] if "actions" not in t else t["actions"]
        _, logprob, _, value = agent.get_action_and_value(t["obs"].reshape(-1, OBS_DIM), actions.reshape(-1, ACT_DIM))
    run.update(
        obs=t["obs"],
        actions=actions,
        logprobs=logprob.reshape(NUM_STEPS, NUM_ENVS),
        rewards=t["rewards"],
        dones=t["dones"],
        values=value.reshape(NUM_STEPS, NUM_ENVS),
        next_obs=t["next_obs"],
        next_done=t["next_done"],
        iteration=ITERATION,
    )
    out["inputs/actions"] = arr(actions)
    out["cleanrl/logprobs"], out["cleanrl/values"] = arr(run["logprobs"]), arr(run["values"])

    RecordingAdam.ns = run
    exec(update, run)
    assert not shuffle.queue, "fixed permutations left unused"
    out["cleanrl/next_value"] = arr(run["next_value"][0])
    out["cleanrl/explained_var"] = np.float32(run["explained_var"])
    out["cleanrl/advantages"], out["cleanrl/returns"] = arr(run["advantages"]), arr(run["returns"])
    steps = optimizer.steps
    assert len(steps) == NUM_MINIBATCHES * UPDATE_EPOCHS
    for k in ("pg_loss", "v_loss", "entropy_loss", "approx_kl", "old_approx_kl", "clipfrac", "loss", "lr"):
        out[f"cleanrl/minibatch/{k}"] = np.array([s[k] for s in steps], np.float32)
    out["cleanrl/minibatch/grad_norm"] = np.array(clip_record["norms"], np.float32)
    mb_inds = np.stack([s["mb_inds"] for s in steps])
    assert np.array_equal(mb_inds.reshape(UPDATE_EPOCHS, -1), inputs["permutations"])
    names = [k for k, _ in agent.named_parameters()]
    assert [id(p) for p in agent.parameters()] == [id(p) for p in optimizer.named]
    for name, g0, g1, p1, p in zip(
        names, clip_record["grads"], steps[0]["grads"], steps[0]["params"], agent.parameters()
    ):
        out[f"cleanrl/grad/{name}"] = arr(g0)  # first minibatch, before clip_grad_norm_
        out[f"cleanrl/grad_clipped/{name}"] = arr(g1)  # what the first optimizer.step() applied
        out[f"cleanrl/after_first_step/{name}"] = arr(p1)
        out[f"cleanrl/after_update/{name}"] = arr(p)

    # both clips are exercised, and no decision lies within MARGIN of its threshold
    clip = args.clip_coef
    ratio = np.stack([s["ratio"] for s in steps])
    dv = np.stack([s["dv"] for s in steps])
    assert 0 < np.mean(np.abs(ratio - 1) > clip) < 1, "the policy clip is not exercised"
    assert 0 < np.mean(np.abs(dv) > clip) < 1, "the value clip is not exercised"
    for name, x in (("ratio - 1", ratio - 1), ("V - V_old", dv)):
        gap = np.min(np.abs(np.abs(x) - clip))
        assert gap > MARGIN, f"|{name}| within {gap} of clip_coef"
    pg_gap = np.stack([s["pg_gap"] for s in steps])[np.abs(ratio - 1) > clip]
    v_gap = np.stack([s["v_gap"] for s in steps])[np.abs(dv) > clip]
    assert pg_gap.min() > MARGIN and v_gap.min() > MARGIN, (pg_gap.min(), v_gap.min())
    out["cleanrl/minibatch/vclipfrac"] = np.mean(np.abs(dv) > clip, axis=1).astype(np.float32)
    return args, ns["Args"]()


def float64_check(source: str, inputs: dict, out32: dict, rtol: float = 1e-5, atol: float = 1e-6):
    """The reference's own float32 error: the same update in float64 (same float32 weights, inputs, actions)."""
    init = {
        k.removeprefix("cleanrl/init/"): v.astype(np.float64) for k, v in out32.items() if k.startswith("cleanrl/init/")
    }
    inputs64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in inputs.items()}
    inputs64["actions"] = out32["inputs/actions"].astype(np.float64)
    out64 = {}
    run_cleanrl(source, inputs64, out64, torch.float64, init)
    rows = []
    for k in sorted(set(out64) & set(out32)):
        if k.startswith(("cleanrl/init/", "inputs/")) or k.endswith(("/lr", "/clipfrac", "/vclipfrac")):
            continue
        ref, f32 = np.asarray(out64[k], np.float64), np.asarray(out32[k], np.float64)
        diff = np.abs(f32 - ref)
        rows.append((float(np.max(diff / (atol + rtol * np.abs(ref)))), float(np.max(diff)), k))
    print(f"float32 reference vs its float64 rerun, |f32 - f64| / ({atol:g} + {rtol:g} |f64|), largest first:")
    for ratio, diff, k in sorted(rows, reverse=True)[:12]:
        print(f"  {ratio:6.3f}  (|diff| {diff:.2e})  {k}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cleanrl", required=True, help="git dir of the fetched vwxyzjn/cleanrl snapshot")
    p.add_argument(
        "--float64-check",
        action="store_true",
        help="rerun the reference in float64 from the fixture's float32 weights and inputs and print, per "
        "output, its largest difference from the float32 run in units of the test's bound",
    )
    p.add_argument("--out", default=fixture_path("ppo_reference.npz"))
    a = p.parse_args()
    torch.set_num_threads(1)
    source, commit = read_snapshot(a.cleanrl, CLEANRL_FILE)

    rng = np.random.default_rng(INPUT_SEED)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    n = NUM_STEPS * NUM_ENVS
    # CleanRL's dones[t] = 1: obs[t] is the first observation of a new episode (the previous step ended
    # one); next_done: the last step ended one.  dones[0] comes from the previous iteration and no GAE
    # term reads it (set here to show that).  Episodes end after steps (t, env): (2, 0), (5, 1), (7, 1).
    dones = np.zeros((NUM_STEPS, NUM_ENVS), np.float32)
    dones[0, 0] = dones[3, 0] = dones[6, 1] = 1.0
    inputs = {
        "obs": f32(rng.normal(size=(NUM_STEPS, NUM_ENVS, OBS_DIM))),
        "eps": f32(rng.standard_normal((NUM_STEPS, NUM_ENVS, ACT_DIM))),
        "rewards": f32(rng.normal(size=(NUM_STEPS, NUM_ENVS))),
        "dones": dones,
        "next_obs": f32(rng.normal(size=(NUM_ENVS, OBS_DIM))),
        "next_done": f32([0.0, 1.0]),
        "permutations": np.stack([rng.permutation(n) for _ in range(UPDATE_EPOCHS)]).astype(np.int32),
    }
    out = {f"inputs/{k}": v for k, v in inputs.items()}
    args, defaults = run_cleanrl(source, inputs, out)
    command = f"/tmp/refvenv/bin/python scripts/fidelity/ppo_reference.py --cleanrl {shlex.quote(a.cleanrl)}"
    meta = {
        "generator": "scripts/fidelity/ppo_reference.py",
        "command": command,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cleanrl": {"repository": "https://github.com/vwxyzjn/cleanrl", "commit": commit, "file": CLEANRL_FILE},
        "args": {k: v for k, v in dataclasses.asdict(args).items() if isinstance(v, (int, float, bool)) or v is None},
        "args_defaults": {
            k: v for k, v in dataclasses.asdict(defaults).items() if isinstance(v, (int, float, bool)) or v is None
        },
        "iteration": ITERATION,
        "log_std": list(LOG_STD),
        "width": 64,
        "sizes": {"obs": OBS_DIM, "act": ACT_DIM, "num_envs": NUM_ENVS, "num_steps": NUM_STEPS},
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; cleanrl {commit}")
    if a.float64_check:
        float64_check(source, inputs, out)
    print(
        "clipfrac per minibatch",
        out["cleanrl/minibatch/clipfrac"],
        "value-clip fraction",
        out["cleanrl/minibatch/vclipfrac"],
        "grad norms",
        out["cleanrl/minibatch/grad_norm"],
    )


if __name__ == "__main__":
    main()
