"""Fixture generator: LeJEPA's SIGReg statistic (sliced Epps-Pulley) and its gradient from the official code.

Runs the *official* LeJEPA library on fixed embeddings and fixed projection directions, and writes inputs
and outputs to ``tests/fixtures/sigreg_reference.npz``, which ``tests/test_fidelity_interventions.py``
compares against ``plasticity/sigreg.py`` (variant ``lejepa``) without torch.

Reference (read from a fetched snapshot, never copied into this repository): rbalestr-lab/lejepa
(Balestriero & LeCun 2025, "LeJEPA", arXiv 2511.08544): ``lejepa/univariate/epps_pulley.py``
(``EppsPulley``: trapezoid quadrature of N |phi_N(t) - e^{-t^2/2}|^2 e^{-t^2/2} on [0, t_max]),
``lejepa/multivariate/slicing.py`` (``SlicingUnivariateTest``: project on ``num_slices`` random unit
directions, average the univariate statistic over slices) and ``lejepa/univariate/base.py``
(``UnivariateTest``).  These three modules run as they stand, loaded as ``lejepa.univariate.base`` etc.
from the snapshot's text under package stubs (the package's own ``__init__`` files import every test,
one of which needs scipy, which this venv does not have and which SIGReg does not use).

Fixed directions: ``SlicingUnivariateTest.forward`` draws ``A = torch.randn((D, num_slices),
generator=g)`` and normalises it (``A /= A.norm(p=2, dim=0)``).  The generator replaces ``torch.randn``
for that call by one that returns a fixed Gaussian matrix G (recorded); the reference's own code then
normalises it.  The zoo's test feeds the same G through the one random call of
``plasticity.sigreg._projections`` (``jax.random.normal``), so the normalisation is checked too.

Gradients: ``torch.autograd`` of the reference's statistic with respect to the embeddings (the
directions are drawn under ``torch.no_grad`` in the reference, as in the zoo they are a constant).
Each case is also run in float64 (same code, ``.double()`` inputs) to measure the float32 reference's
own rounding.

Usage, in a venv of its own with torch (never the project's venv)::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 numpy
    /tmp/refvenv/bin/python scripts/fidelity/sigreg_reference.py --lejepa /work/.mirror/rbalestr-lab+lejepa/repo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import types

import numpy as np
import torch
from snapshot import fixture_path, read_snapshot

FILES = {
    "lejepa.univariate.base": "lejepa/univariate/base.py",
    "lejepa.univariate.epps_pulley": "lejepa/univariate/epps_pulley.py",
    "lejepa.multivariate.slicing": "lejepa/multivariate/slicing.py",
}
# (name, embedding shape (..., N, D), num_slices, n_points): the zoo's lejepa default (17 points on
# [0, 3]), and an ensemble-shaped input (M, N, D) with a 9-point grid
CASES = (("single", (64, 12), 16, 17), ("ensemble", (2, 32, 10), 8, 9))
T_MAX = 3.0  # EppsPulley's default, the zoo's fixed t_max


def load_reference(git_dir: str):
    """The three reference modules, executed as they stand under stub packages; -> (modules, commit)."""
    commit = None
    for pkg in ("lejepa", "lejepa.univariate", "lejepa.multivariate"):
        mod = types.ModuleType(pkg)
        mod.__path__ = []  # a package, so that the modules' relative imports resolve in sys.modules
        sys.modules[pkg] = mod
    mods = {}
    for name, path in FILES.items():
        source, commit = read_snapshot(git_dir, path)
        mod = types.ModuleType(name)
        mod.__package__ = name.rpartition(".")[0]
        mod.__file__ = path
        sys.modules[name] = mod
        exec(compile(source, path, "exec", dont_inherit=True), mod.__dict__)
        mods[name] = mod
    return mods, commit


@contextlib.contextmanager
def fixed_directions(g):
    """``torch.randn(shape, ..., generator=...)`` returns the fixed matrix ``g`` (shape checked)."""
    original = torch.randn
    calls = []

    def randn(*shape, **kwargs):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        assert tuple(shape) == tuple(g.shape) and "generator" in kwargs, (shape, kwargs.keys())
        calls.append(shape)
        return g.clone().to(kwargs.get("device", "cpu"))

    torch.randn = randn
    try:
        yield calls
    finally:
        torch.randn = original


def run_case(mods, z, g, num_slices, n_points, dtype):
    ep = (
        mods["lejepa.univariate.epps_pulley"]
        .EppsPulley(t_max=T_MAX, n_points=n_points, integration="trapezoid")
        .to(dtype)
    )
    slicing = mods["lejepa.multivariate.slicing"].SlicingUnivariateTest
    out = {}
    for reduction in ("mean", None):
        test = slicing(univariate_test=ep, num_slices=num_slices, reduction=reduction)
        x = torch.tensor(z, dtype=dtype, requires_grad=True)
        with fixed_directions(torch.tensor(g, dtype=dtype)) as calls:
            stat = test(x)
        assert len(calls) == 1
        if reduction == "mean":
            (grad,) = torch.autograd.grad(stat, x)
            out["value"], out["grad"] = stat.detach().numpy(), grad.numpy()
        else:
            out["per_slice"] = stat.detach().numpy()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lejepa", required=True, help="git dir of the fetched rbalestr-lab/lejepa snapshot")
    ap.add_argument(
        "--out",
        default=fixture_path("sigreg_reference.npz"),
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    mods, commit = load_reference(a.lejepa)
    rng = np.random.default_rng(11)
    out = {}
    for name, shape, num_slices, n_points in CASES:
        d = shape[-1]
        # not Gaussian, so that the statistic and its gradient are far from 0: anisotropic scales, a shift,
        # a skewed (log-normal) block and two near-collinear columns
        z = rng.normal(size=shape) * rng.uniform(0.3, 2.0, size=d) + rng.normal(size=d) * 0.5
        z[..., : d // 3] = np.exp(0.6 * z[..., : d // 3]) - 1.0
        z[..., -1] = z[..., -2] + 0.05 * rng.normal(size=shape[:-1])
        z = z.astype(np.float32)
        g = rng.normal(size=(d, num_slices)).astype(np.float32)
        out[f"{name}/z"], out[f"{name}/directions"] = z, g
        r32 = run_case(mods, z, g, num_slices, n_points, torch.float32)
        r64 = run_case(mods, z.astype(np.float64), g.astype(np.float64), num_slices, n_points, torch.float64)
        for k in r32:
            out[f"{name}/{k}"], out[f"{name}/{k}_float64"] = r32[k].astype(np.float32), r64[k]
        print(
            f"{name}: value {float(r32['value']):.6f} (float64 {float(r64['value']):.6f}), "
            f"|grad| max {np.abs(r32['grad']).max():.3e}, float32 - float64 grad max "
            f"{np.abs(r32['grad'] - r64['grad']).max():.2e}"
        )
    command = "/tmp/refvenv/bin/python scripts/fidelity/sigreg_reference.py --lejepa " + shlex.quote(a.lejepa)
    meta = {
        "generator": "scripts/fidelity/sigreg_reference.py",
        "command": command,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "lejepa": {
            "repository": "https://github.com/rbalestr-lab/lejepa",
            "commit": commit,
            "files": sorted(FILES.values()),
        },
        "call": (
            "SlicingUnivariateTest(univariate_test=EppsPulley(t_max=3.0, n_points=P, "
            "integration='trapezoid'), num_slices=S, reduction='mean' | None)(z), torch.randn -> fixed "
            "directions; torch.autograd.grad(value, z)"
        ),
        "cases": [{"name": n, "shape": list(s), "num_slices": k, "n_points": p} for n, s, k, p in CASES],
        "t_max": T_MAX,
    }
    out["meta"] = np.array(json.dumps(meta, sort_keys=True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"wrote {os.path.normpath(a.out)}: {len(out)} arrays, {os.path.getsize(a.out)} bytes; lejepa {commit}")


if __name__ == "__main__":
    main()
