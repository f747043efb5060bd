"""Fixture generator: GraMa scores, ReGraMa masks and resets from the GraMa authors' code.

Runs the GraMa authors' ``GradientReDo`` (Liu et al. 2025, "Measure gradients not activations! Enhancing
neuronal activity in deep reinforcement learning", arXiv 2505.24061) on fixed weights, a fixed batch, a fixed
loss and fixed Adam moments, and writes inputs and outputs to ``tests/fixtures/grama_reference.npz``, which
``tests/test_fidelity_interventions.py`` compares against ``plasticity/metrics.py: grama_scores`` and
``plasticity/resets.py`` (ReGraMa) without torch.

Reference (read from a fetched snapshot, never copied into this repository): github.com/rippl-svg/
grad-based-plasticity-metrics, a fork of torressliu/grad-based-plasticity-metrics whose ``utils/ReDo.py`` is
the first author's (Jiashun Liu, ``torressliu``) last version, unchanged by the fork.  Its ``BaseReDo`` and
``GradientReDo`` classes run as they stand: ``GradientReDo._get_layer_mask`` for the per-layer scores and
masks (its locals ``grad_magnitude`` and ``normalized_grad`` are read as it returns, with
``snapshot.locals_at_return``), in modes ``threshold``, ``percentage`` and ``hybrid``, and
``GradientReDo.step()`` for the reset.  The critic is the reference's own ``SoftQNetwork`` (from ``main.py``,
where nothing else runs), built with width 16 and three hidden layers.

The score in that code is not the paper's Eq. 2: it is ``layer.weight.grad.abs().mean(dim=1)``, the mean over a
unit's inputs of |dL/dW| of the batch loss, i.e. mean_j |sum_b dL/dz_bi x_bj|, where Eq. 2 (and the zoo) take
E_b |dL/dz_bi|.  The generator therefore also records the gradient at every layer's output (dL/dz, torch's
``retain_grad``) and every layer's input, so the test can check each definition on the same backward pass.

Cases:

- ``mlp``: ``SoftQNetwork(env, 'relu', width_multiplier=16/256, depth_multiplier=1.5)``: (5 + 3) -> 16 -> 16
  -> 16 -> 1.  Its Linears are redrawn (numpy seed ``WEIGHT_SEED``: hidden weights He-normal, biases N(0, 0.1^2),
  head N(0, 1/fan_in)), then in every hidden layer unit 1 is made dead (zero row, bias -1), unit 6's outgoing
  weights are scaled by 0.003 and unit 11 is made active on 2 of the 32 samples.  The seed is one where no unit
  dies by chance (no tie at score 0 decides a capped mode's pick) and every score, the reference's and Eq. 2's,
  is at least 1e-3 from each tau.  Loss: MSE of Q(s, a) to fixed targets (``F.mse_loss``, as the reference's
  critic loss).  Adam state: torch's, ``exp_avg`` and ``exp_avg_sq`` fixed multiples of 1/8, step 3.
  Masks: threshold mode at every tau in ``MASK_TAUS``; ``CAPPED_MODES``: percentage (25%), hybrid (tau 0.3, at
  most 12.5% of a layer) and hybrid at the paper's CleanRL SAC setting (tau 0, at most 5%).
  Reset at tau = 0.1: ``GradientReDo(model, tau=TAU, use_lecun_init=True, frequency=1, optimizer=adam).step()``
  (biases to 0: deterministic), and the reference's default ``use_lecun_init=False`` (kaiming-uniform rows and
  biases redrawn) without an optimizer, as its ``main.py`` calls it (which rows changed, the new biases).
- ``ln``: a critic of our own in the same convention with LayerNorm (eps 1e-6, as flax's) after each hidden
  Linear: (5 + 3) -> 16 -> LN -> ReLU -> 16 -> LN -> ReLU -> 1; gains ~ U(0.5, 1.5), biases ~ N(0, 0.1), unit 1
  of each LN dead (gain 0, bias -1).  ``GradientReDo`` treats every LayerNorm as a layer of its own (score
  |dL/dgain|) and resets it with ``use_lecun_init=True`` (gain 1, bias 0; recorded for the LayerNorms only);
  with the default init it raises on the LayerNorm (the message is recorded).
- ``population``: the mlp recipe over 200 other weight seeds: per seed and tau, the hidden units the reference's
  threshold mask flags, those Eq. 2 flags (numpy, same backward pass) and those exactly one of them flags.

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 numpy
    /tmp/refvenv/bin/python scripts/fidelity/grama_reference.py \\
        --repo /work/.mirror/rippl-svg+grad-based-plasticity-metrics/repo

``--repo``: a git directory (bare or work tree) of the fetched snapshot; the files are read at ``HEAD`` with
``git show`` and the commit is recorded in the fixture.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import types

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from snapshot import _git, fixture_path, load_definitions, locals_at_return, read_snapshot

REDO_FILE = "utils/ReDo.py"
MAIN_FILE = "main.py"
OBS_DIM, ACT_DIM, WIDTH, BATCH = 5, 3, 16, 32
WIDTH_MULT, DEPTH_MULT = WIDTH / 256, 1.5  # SoftQNetwork's base 256 x 2 -> 16 x 3 hidden layers
MASK_TAUS = (0.0, 0.01, 0.1, 0.3)  # 0 and 0.01: the paper's settings (CleanRL SAC, BRO); 0.1: the README's example
TAU = 0.1  # the reset's threshold (more units than 0.01 flags, so the reset shows)
PERCENTAGE = 25.0  # percentage mode: the 25% lowest scores (4 of 16)
HYBRID_TAU, MAX_PERCENTAGE = 0.3, 12.5  # hybrid mode: tau, then at most 12.5% of the layer (2 of 16)
SAC_TAU, SAC_MAX_PERCENTAGE = 0.0, 5.0  # hybrid at the paper's CleanRL SAC setting (tau 0, at most 5%)
CAPPED_MODES = (  # (name, GradientReDo mode, its arguments): the rows of masks/capped/<layer>
    ("percentage", "percentage", {"percentage": PERCENTAGE}),
    ("hybrid", "hybrid", {"tau": HYBRID_TAU, "max_percentage": MAX_PERCENTAGE}),
    ("hybrid_sac", "hybrid", {"tau": SAC_TAU, "max_percentage": SAC_MAX_PERCENTAGE}),
)
POPULATION_SEEDS = range(1000, 1200)  # weight draws of the mlp case for the Eq. 2 vs reference measurement
LN_EPS = 1e-6  # flax's LayerNorm epsilon (the zoo's); torch's default is 1e-5
DEAD, SMALL_OUT, RARE = 1, 6, 11  # engineered units of every hidden layer
SEED, WEIGHT_SEED, RESET_SEED = 45, 213, 3


class LNCritic(nn.Module):
    """Our critic with LayerNorm, in SoftQNetwork's convention (inputs concatenated, ``fc_out``)."""

    def __init__(self, in_dim):
        super().__init__()
        self.fc1, self.ln1 = nn.Linear(in_dim, WIDTH), nn.LayerNorm(WIDTH, eps=LN_EPS)
        self.fc2, self.ln2 = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH, eps=LN_EPS)
        self.fc_out = nn.Linear(WIDTH, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], dim=1)
        x = F.relu(self.ln1(self.fc1(x)))
        x = F.relu(self.ln2(self.fc2(x)))
        return self.fc_out(x)


def _layers(model):
    """The layers GradientReDo.step visits, in its order (named_modules, Linear / Conv2d / LayerNorm)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.LayerNorm))]


def _between(z, k):
    """A threshold between the k-th and (k+1)-th largest entries of z (so exactly k are above it)."""
    s = np.sort(z)[::-1]
    return 0.5 * (s[k - 1] + s[k])


def _draw(model, rng):
    """Every Linear redrawn: hidden weights He-normal, N(0, 2 / fan_in), biases N(0, 0.1^2), the head N(0, 1 / fan_in)
    (torch's default U(+-1/sqrt(fan_in)) leaves up to half of a 16-wide third layer dead by chance, and ties at
    score 0 would decide the capped modes' picks)."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                scale = np.sqrt((1.0 if name == "fc_out" else 2.0) / m.in_features)
                m.weight.copy_(torch.from_numpy((rng.normal(size=tuple(m.weight.shape)) * scale).astype(np.float32)))
                m.bias.copy_(torch.from_numpy((rng.normal(size=m.out_features) * 0.1).astype(np.float32)))


def build(case, soft_q, data, weight_seed=None):
    """The case's network with its fixed (engineered) weights."""
    torch.manual_seed(0)
    rng = np.random.default_rng(WEIGHT_SEED if weight_seed is None else weight_seed)
    obs, act = data["obs"], data["act"]
    if case == "mlp":
        env = types.SimpleNamespace(
            single_observation_space=types.SimpleNamespace(shape=(OBS_DIM,)),
            single_action_space=types.SimpleNamespace(shape=(ACT_DIM,)),
        )
        model = soft_q(env, "relu", width_multiplier=WIDTH_MULT, depth_multiplier=DEPTH_MULT)
        hidden = [model.fc1, *model.hidden_layers]
        nxt = [*model.hidden_layers, model.fc_out]
        assert [m.out_features for m in hidden] == [WIDTH] * 3 and model.fc_out.out_features == 1
        _draw(model, rng)
        with torch.no_grad():
            h = torch.cat([obs, act], dim=1)
            for lin, out in zip(hidden, nxt):
                lin.weight[DEAD], lin.bias[DEAD] = 0.0, -1.0
                out.weight[:, SMALL_OUT] *= 0.003
                z = (h @ lin.weight.T + lin.bias)[:, RARE].numpy()
                lin.bias[RARE] -= float(_between(z, 2))  # active on 2 of the 32 samples
                h = F.relu(h @ lin.weight.T + lin.bias)
        return model
    model = LNCritic(OBS_DIM + ACT_DIM)
    _draw(model, rng)
    with torch.no_grad():
        for ln in (model.ln1, model.ln2):
            ln.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, WIDTH).astype(np.float32)))
            ln.bias.copy_(torch.from_numpy((rng.normal(size=WIDTH) * 0.1).astype(np.float32)))
            ln.weight[DEAD], ln.bias[DEAD] = 0.0, -1.0
    return model


def backward(model, data):
    """Forward and backward of the MSE loss; -> (loss, {layer: (input, output with .grad)})."""
    seen, handles = {}, []
    for name, m in _layers(model):

        def hook(mod, inp, out, name=name):
            out.retain_grad()
            seen[name] = (inp[0].detach().clone(), out)

        handles.append(m.register_forward_hook(hook))
    q = model(data["obs"], data["act"]).view(-1)
    loss = F.mse_loss(q, data["y"])
    model.zero_grad()
    loss.backward()
    for h in handles:
        h.remove()
    return loss, seen


def adam_for(model, rng):
    """torch Adam over the model with fixed non-zero moments and step 3 (as after three updates).  The moments are
    multiples of 1/8 (exact in float32, and they compress): exp_avg in [-1, 1], exp_avg_sq in [1/8, 1]."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    for p in model.parameters():
        shape = tuple(p.shape)
        opt.state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.from_numpy((rng.integers(-8, 9, size=shape) / 8).astype(np.float32)),
            "exp_avg_sq": torch.from_numpy((rng.integers(1, 9, size=shape) / 8).astype(np.float32)),
        }
    return opt


def eq2(g):
    """The paper's Eq. 2 on a (batch, units) gradient (numpy): the generator's own gap checks and measurement."""
    m = np.abs(g).mean(0)
    return m / (m.mean() + 1e-9)


def np_(t):
    return t.detach().numpy().copy()


def threshold_masks(ref, model, taus):
    """{layer: (grad_magnitude, normalized_grad, masks (len(taus), units))} from the reference's _get_layer_mask."""
    gdo, out = ref["GradientReDo"](model, mode="threshold", tau=TAU), {}
    for name, m in _layers(model):
        masks = []
        for tau in taus:
            into = {}
            with locals_at_return({"_get_layer_mask"}, into):
                masks.append(np_(gdo._get_layer_mask(m, tau)))
            loc = into["_get_layer_mask"]
        out[name] = (np_(loc["grad_magnitude"]), np_(loc["normalized_grad"]), np.stack(masks))
    return out


def run_case(case, ref, soft_q, data, moments_rng, out):
    p = f"{case}/"
    model = build(case, soft_q, data)
    for name, t in model.state_dict().items():
        out[p + f"inputs/{name}"] = np_(t)
    loss, seen = backward(model, data)
    out[p + "loss"] = np.float32(loss.item())
    layers = _layers(model)
    names = [n for n, _ in layers]
    for name, m in layers:
        x_in, z = seen[name]
        if name != "fc1":  # fc1's input is the batch (s, a)
            out[p + f"layer_inputs/{name}"] = np_(x_in)
        if case == "mlp" or isinstance(m, nn.LayerNorm):  # dL/dz at the layer's output: the zoo's "pre"
            out[p + f"out_grads/{name}"] = np_(z.grad)
        out[p + f"grads/{name}.weight"] = np_(m.weight.grad)
        out[p + f"grads/{name}.bias"] = np_(m.bias.grad)

    # threshold masks (rows: MASK_TAUS), and the score and its normalisation, read from _get_layer_mask's locals
    for name, (gm, normalized, masks) in threshold_masks(ref, model, MASK_TAUS).items():
        out[p + f"grad_magnitude/{name}"], out[p + f"normalized/{name}"] = gm, normalized
        out[p + f"masks/threshold/{name}"] = masks
        for tau in MASK_TAUS[1:]:
            assert np.min(np.abs(normalized - tau)) > 1e-3, (case, name, tau)  # float32 rounding cannot flip a mask
    hidden = [n for n in names if n != "fc_out"]
    taps = [n for n, m in layers if (case == "mlp" and n != "fc_out") or isinstance(m, nn.LayerNorm)]
    for name in taps:  # the zoo's Eq. 2 scores are also off every tau (on the same backward pass)
        s = eq2(np_(seen[name][1].grad))
        for tau in MASK_TAUS[1:]:
            assert np.min(np.abs(s - tau)) > 1e-3, (case, name, tau)
    if case == "mlp":  # rows: CAPPED_MODES
        gdos = [ref["GradientReDo"](model, mode=mode, **kw) for _, mode, kw in CAPPED_MODES]
        for name, m in layers:
            out[p + f"masks/capped/{name}"] = np.stack([np_(g._get_layer_mask(m, g.tau)) for g in gdos])
        for name in hidden:  # the hybrid cap binds (more flagged than kept) and no tie decides a rank
            gm = out[p + f"grad_magnitude/{name}"]
            assert (out[p + f"normalized/{name}"] <= HYBRID_TAU).sum() > int(WIDTH * MAX_PERCENTAGE / 100), name
            assert len(np.unique(gm)) == len(gm), name

    # the reset (LeCun: the flagged rows redrawn, their biases 0), with the Adam moments
    opt = adam_for(model, moments_rng)
    grads = {name: np_(t.grad) for name, t in model.named_parameters()}
    kept = [n for n in names if case == "mlp" or n.startswith("ln")]  # the ln case: only its LayerNorms' reset
    for name, t in model.named_parameters():
        if name.rsplit(".", 1)[0] in kept:
            out[p + f"inputs/adam/{name}/exp_avg"] = np_(opt.state[t]["exp_avg"])
            out[p + f"inputs/adam/{name}/exp_avg_sq"] = np_(opt.state[t]["exp_avg_sq"])
    torch.manual_seed(RESET_SEED)
    stats = ref["GradientReDo"](
        model, mode="threshold", tau=TAU, use_lecun_init=True, frequency=1, optimizer=opt
    ).step()
    out[p + "reset_stats"] = np.array([stats["dormant_count"], stats["total_neurons"]])
    i_tau = MASK_TAUS.index(TAU)
    for name, t in model.named_parameters():
        layer = name.rsplit(".", 1)[0]
        mask = out[p + f"masks/threshold/{layer}"][i_tau]
        # the flagged units' gradients (rows, biases) are zeroed, nothing else (not exercised in the zoo: difference 5)
        assert np.all(np_(t.grad)[mask] == 0) and np.array_equal(np_(t.grad)[~mask], grads[name][~mask]), name
        assert float(opt.state[t]["step"]) == 3.0, name
        if layer in kept:
            out[p + f"reset/{name}"] = np_(t)
            out[p + f"reset/adam/{name}/exp_avg"] = np_(opt.state[t]["exp_avg"])
            out[p + f"reset/adam/{name}/exp_avg_sq"] = np_(opt.state[t]["exp_avg_sq"])
    for name in kept:  # every flagged row (and only those) is new
        mask = out[p + f"masks/threshold/{name}"][i_tau]
        old, new = out[p + f"inputs/{name}.weight"], out[p + f"reset/{name}.weight"]
        assert np.array_equal(old[~mask], new[~mask]), name
        if mask.any() and old.ndim == 2:
            assert np.all(np.any(old[mask] != new[mask], axis=1)), name

    # the reference's default (use_lecun_init=False), as main.py calls it (no optimizer), on a fresh copy:
    # which rows changed, the new biases, and whether anything else changed
    model = build(case, soft_q, data)
    backward(model, data)
    torch.manual_seed(RESET_SEED)
    try:
        ref["GradientReDo"](model, mode="threshold", tau=TAU, frequency=1).step()
        kaiming_error, untouched = None, True
        for name, m in _layers(model):  # the fresh copy's
            old = out[p + f"inputs/{name}.weight"]
            if name == "fc_out":
                untouched = bool(
                    np.array_equal(np_(m.weight), old) and np.array_equal(np_(m.bias), out[p + f"inputs/{name}.bias"])
                )
                continue
            out[p + f"kaiming/rows_changed/{name}"] = np.any(np_(m.weight) != old, axis=1)
            out[p + f"kaiming/{name}.bias"] = np_(m.bias)
        out[p + "kaiming/fc_out_untouched"] = np.array(untouched)
    except ValueError as e:  # a LayerNorm's 1-D weight has no fan-in
        kaiming_error = f"{type(e).__name__}: {e}"
    return names, kaiming_error


def population(ref, soft_q, data, seeds):
    """Over many draws of the mlp case's weights: per seed and tau, the hidden units flagged by the reference's
    threshold mask, by Eq. 2 (numpy, on the same backward pass), and by exactly one of the two."""
    counts = np.zeros((3, len(seeds), len(MASK_TAUS)), np.int16)
    for i, seed in enumerate(seeds):
        model = build("mlp", soft_q, data, seed)
        _, seen = backward(model, data)
        for name, (_, _, masks) in threshold_masks(ref, model, MASK_TAUS).items():
            if name == "fc_out":
                continue
            s = eq2(np_(seen[name][1].grad))
            ours = np.stack([s <= tau for tau in MASK_TAUS])
            counts[:, i] += np.stack([masks.sum(1), ours.sum(1), (masks != ours).sum(1)])
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", required=True, help="git dir of the fetched grad-based-plasticity-metrics snapshot")
    ap.add_argument("--out", default=fixture_path("grama_reference.npz"))
    a = ap.parse_args()
    redo_src, commit = read_snapshot(a.repo, REDO_FILE)
    main_src, _ = read_snapshot(a.repo, MAIN_FILE)
    ref = load_definitions(redo_src, REDO_FILE, {"BaseReDo", "GradientReDo"})
    soft_q = load_definitions(main_src, MAIN_FILE, {"SoftQNetwork"})["SoftQNetwork"]
    last = _git(a.repo, "log", "-1", "--format=%H %an <%ae> %ad", "--", REDO_FILE).strip()

    rng = np.random.default_rng(SEED)
    data = {
        "obs": torch.from_numpy(rng.normal(size=(BATCH, OBS_DIM)).astype(np.float32)),
        "act": torch.from_numpy(rng.uniform(-1, 1, size=(BATCH, ACT_DIM)).astype(np.float32)),
        "y": torch.from_numpy((rng.normal(size=BATCH) * 2.0).astype(np.float32)),
    }
    out = {f"inputs/{k}": v.numpy().copy() for k, v in data.items()}
    layers, errors = {}, {}
    for case in ("mlp", "ln"):
        layers[case], errors[case] = run_case(case, ref, soft_q, data, np.random.default_rng(SEED + 2), out)
    assert errors["mlp"] is None and errors["ln"] is not None, errors
    counts = population(ref, soft_q, data, POPULATION_SEEDS)
    out["population/ref_flagged"], out["population/eq2_flagged"], out["population/disagree"] = counts

    command = "/tmp/refvenv/bin/python scripts/fidelity/grama_reference.py --repo " + shlex.quote(a.repo)
    meta = {
        "generator": "scripts/fidelity/grama_reference.py",
        "command": command,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "reference": {
            "repository": "https://github.com/rippl-svg/grad-based-plasticity-metrics",
            "fork_of": "https://github.com/torressliu/grad-based-plasticity-metrics",
            "commit": commit,
            "files": [REDO_FILE, MAIN_FILE],
            "last_commit_of_redo_file": last,
        },
        "call": (
            "GradientReDo(model, mode=..., tau=...)._get_layer_mask(layer, tau) per layer (locals grad_magnitude, "
            f"normalized_grad); GradientReDo(model, tau={TAU}, use_lecun_init=True, frequency=1, "
            f"optimizer=adam).step(); GradientReDo(model, tau={TAU}, frequency=1).step()"
        ),
        "sizes": {"obs": OBS_DIM, "act": ACT_DIM, "width": WIDTH, "batch": BATCH},
        "mlp_depth": 3,
        "ln_depth": 2,
        "ln_eps": LN_EPS,
        "tau": TAU,
        "mask_taus": list(MASK_TAUS),
        "percentage": PERCENTAGE,
        "hybrid": {"tau": HYBRID_TAU, "max_percentage": MAX_PERCENTAGE},
        "hybrid_sac": {"tau": SAC_TAU, "max_percentage": SAC_MAX_PERCENTAGE},
        "capped_modes": [name for name, _, _ in CAPPED_MODES],
        "population_seeds": [POPULATION_SEEDS.start, POPULATION_SEEDS.stop],
        "weight_seed": WEIGHT_SEED,
        "engineered_units": {"dead": DEAD, "small_outgoing": SMALL_OUT, "rare": RARE},
        "layers": layers,
        "kaiming_error": errors,
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; reference {commit}")
    for case in ("mlp", "ln"):
        for name in layers[case]:
            ref_s, g = out[f"{case}/normalized/{name}"], out.get(f"{case}/out_grads/{name}")
            print(case, name, "reference", np.round(ref_s, 3))
            if g is not None:
                print(case, name, "Eq. 2    ", np.round(eq2(g), 3))
            for i, tau in enumerate(MASK_TAUS):
                m = out[f"{case}/masks/threshold/{name}"][i]
                ours = "" if g is None else f", Eq. 2 {np.flatnonzero(eq2(g) <= tau)}"
                print(f"   tau {tau}: reference {np.flatnonzero(m)}{ours}")
    print("kaiming:", errors)
    for tau, r, e, d in zip(MASK_TAUS, *(c.mean(0) for c in counts)):
        print(
            f"population, tau {tau}: flagged by the reference {r:.2f}, by Eq. 2 {e:.2f}, by one of them {d:.2f} (of 48)"
        )


if __name__ == "__main__":
    main()
