"""Fixture generator: TRAC steps from the authors' package, on fixed params and fixed gradient sequences.

Runs the *published* ``trac-optimizer`` package (Muppidi, Zhang, Yang 2024, "Fast TRAC", NeurIPS, arXiv
2405.16642; PyPI ``trac-optimizer``, ``trac_optimizer/trac.py``: ``start_trac(log_file, Base)`` subclasses a
torch optimizer and wraps its ``step``) as installed, never copied: ``start_trac(log, torch.optim.Adam)(params,
lr=LR)`` with the package's defaults (betas 0.9 ... 0.999999, ``s_prev`` 1e-8, eps 1e-8).  Each step sets
every parameter's ``.grad`` to the case's next fixed gradient and calls ``step()``; the params after each
step and the tuner's ``s``, ``sigma`` and ``variance`` (``optimizer.state['_trac']``) are recorded in
``tests/fixtures/trac_reference.npz``, which ``tests/test_fidelity_interventions.py`` compares against
``plasticity/trac.py`` without torch.

Cases (two float32 tensors, a 4 x 3 weight and a 3-vector, with fixed initial values):

- ``drift``: 60 steps of a fixed mean gradient plus fixed noise: <g, Delta> stays negative, so the scale S
  grows from 1e-8 through many orders of magnitude (the tuner's erfi far from 0);
- ``reversal``: 30 steps of that drift, then 30 of three times its opposite: the tuner's scales turn negative and the
  played scale is clipped at 0 (the package's ``max(s_sum, 0.0)``), which resets Delta.

Each case runs twice: as published, and with the module's ``erfi`` (which ``_step`` calls by name)
replaced by the exact function (mpmath's, in float64, returned as float32).  The package's erfi (a port of
Weideman's complex erf) is low by up to about 1% for small arguments (erfi(0.01) = 0.011166 against
0.011284); the zoo computes erfi exactly (its series), so the exact-erfi run is the one the zoo must match
to float32 rounding, and the published run shows the size of that one difference.  The package's erfi and
mpmath's on a grid are recorded too.

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/tracvenv && /tmp/tracvenv/bin/pip install trac-optimizer==0.0.2 torch numpy mpmath
    /tmp/tracvenv/bin/python scripts/fidelity/trac_reference.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from importlib.metadata import version

import mpmath
import numpy as np
import torch
import trac_optimizer.trac as trac_module
from snapshot import fixture_path  # noqa: E402  (scripts/fidelity/snapshot.py, beside this file)
from trac_optimizer import start_trac

LR = 1e-2
STEPS = 60
SHAPES = {"w": (4, 3), "b": (3,)}
# case -> scale of the initial params.  Near 0 (1e-3) theta_ref + S Delta keeps S Delta's digits, so the
# comparison checks the arithmetic; at 0.5 (a network's weights) S Delta below half an ulp of theta_ref is
# absorbed while S is small, Delta is rebuilt from rounded params, and float32 rounding decides the path.
CASES = {"drift": 1e-3, "reversal": 1e-3, "weights": 0.5}
ERFI_GRID = (-3.0, -1.0, -0.1, 0.0, 0.01, 0.1, 0.5, 1.0 / np.sqrt(2.0), 1.0, 2.0, 3.0, 5.0, 8.0)


def exact_erfi(x: torch.Tensor) -> torch.Tensor:
    """erfi by mpmath in float64, elementwise, returned in ``x``'s dtype."""
    flat = [float(mpmath.erfi(float(v))) for v in x.detach().reshape(-1).tolist()]
    return (
        torch.tensor(flat, dtype=torch.float64).reshape(x.shape).to(x.dtype if x.is_floating_point() else torch.float32)
    )


def gradients(rng, case: str):
    """{name: (STEPS, *shape)} float32: a fixed mean direction plus noise (reversed halfway for ``reversal``)."""
    out = {}
    for name, shape in SHAPES.items():
        mean = rng.normal(size=shape)
        noise = 0.5 * rng.normal(size=(STEPS, *shape))
        sign = np.where(np.arange(STEPS) < STEPS // 2, 1.0, -3.0) if case == "reversal" else np.ones(STEPS)
        out[name] = (sign.reshape(-1, *([1] * len(shape))) * mean + noise).astype(np.float32)
    return out


def run(init: dict, grads: dict, erfi) -> dict:
    """The package's TRAC over Adam on ``init`` with the gradient sequence ``grads`` -> per-step records."""
    original = trac_module.erfi
    trac_module.erfi = erfi
    try:
        params = [torch.nn.Parameter(torch.tensor(init[n])) for n in SHAPES]
        with tempfile.TemporaryDirectory() as d:
            opt = start_trac(os.path.join(d, "trac.log"), torch.optim.Adam)(params, lr=LR)
            rec = {f"params/{n}": [] for n in SHAPES} | {"s": [], "sigma": [], "variance": []}
            for t in range(STEPS):
                for p, n in zip(params, SHAPES):
                    p.grad = torch.tensor(grads[n][t])
                opt.step()
                for p, n in zip(params, SHAPES):
                    rec[f"params/{n}"].append(p.detach().numpy().copy())
                state = opt.state["_trac"]
                for k in ("s", "sigma", "variance"):
                    rec[k].append(state[k].detach().numpy().copy())
    finally:
        trac_module.erfi = original
    return {k: np.stack(v).astype(np.float32) for k, v in rec.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=fixture_path("trac_reference.npz"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(48)
    out = {}
    for case, scale in CASES.items():
        init = {n: rng.normal(scale=scale, size=s).astype(np.float32) for n, s in SHAPES.items()}
        out.update({f"{case}/init/{n}": x for n, x in init.items()})
        grads = gradients(rng, case)
        out.update({f"{case}/grads/{n}": g for n, g in grads.items()})
        for mode, erfi in (("published", trac_module.erfi), ("exact_erfi", exact_erfi)):
            rec = run(init, grads, erfi)
            out.update({f"{case}/{mode}/{k}": v for k, v in rec.items()})
            s_sum = rec["s"].sum(axis=1)
            print(f"{case} {mode}: sum s from {s_sum[0]:.3e} to {s_sum[-1]:.3e} (min {s_sum.min():.3e})")
    grid = torch.tensor(ERFI_GRID, dtype=torch.float32)
    out["erfi/x"] = grid.numpy()
    out["erfi/package"] = trac_module.erfi(grid).numpy().astype(np.float32)
    out["erfi/exact"] = np.array([float(mpmath.erfi(float(x))) for x in grid.tolist()], np.float64)
    meta = {
        "generator": "scripts/fidelity/trac_reference.py",
        "command": "/tmp/tracvenv/bin/python scripts/fidelity/trac_reference.py",
        "package": {"name": "trac-optimizer", "version": version("trac-optimizer"), "module": "trac_optimizer/trac.py"},
        "torch": torch.__version__,
        "numpy": np.__version__,
        "mpmath": mpmath.__version__,
        "call": (
            f"start_trac(log_file, torch.optim.Adam)(params, lr={LR}) (package defaults: betas (0.9, 0.99, 0.999, "
            "0.9999, 0.99999, 0.999999), s_prev 1e-8, eps 1e-8); per step: p.grad = g_t for each param, "
            "opt.step(); recorded: params and optimizer.state['_trac'] s, sigma, variance after each step"
        ),
        "modes": {
            "published": "the package as installed",
            "exact_erfi": "trac_optimizer.trac.erfi replaced by mpmath.erfi (float64, cast to float32)",
        },
        "lr": LR,
        "steps": STEPS,
        "shapes": {n: list(s) for n, s in SHAPES.items()},
        "cases": {
            "drift": "params ~ N(0, 1e-3); mean gradient + 0.5 noise",
            "reversal": "params ~ N(0, 1e-3); the drift for 30 steps, then -3 times its mean + noise",
            "weights": "params ~ N(0, 0.5); as drift",
        },
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes")


if __name__ == "__main__":
    main()
