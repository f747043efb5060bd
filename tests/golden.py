"""Behaviour fingerprints of short fixed-seed runs, recorded before a refactor and checked after it.

Each case trains through ``training.run.run`` (the path ``scripts/train.py`` takes) for a few hundred
steps with tiny networks, then summarises the final agent state (per-leaf sums, one number per
parameter or optimizer array, in tree order) and the evaluation returns.  A refactor that moves code
must reproduce them; a change meant to alter numbers re-records them with

    python -m tests.golden --write [CASE ...]

and says so in its commit.  Values are compared with a small relative tolerance so that another CPU
(other vector instructions, other summation order in XLA) does not fail the check, while any change
of behaviour (another rng split, another update order, a different initialiser) moves them by far more.
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
RECORD = HERE / "golden_fingerprints.json"


def _run_config(agent_name: str, agent_cfg, network=None, plasticity=None, **run):
    from plasticity_zoo.training.config import NetworkConfig, PlasticityConfig, RunConfig

    base = {
        "env": "Pendulum-v1",
        "total_steps": 400,
        "eval_every": 200,
        "eval_episodes": 2,
        "log_every": 100,
        "checkpoint_every": 400,
        "progress": False,
    }
    return RunConfig(
        **{**base, **run},
        network=network or NetworkConfig(width=16),
        plasticity=plasticity or PlasticityConfig(metrics_every=0),
        agent_name=agent_name,
        agent=agent_cfg,
    )


def _sac(plasticity=None, network=None, **agent):
    from plasticity_zoo.agents.sac import SACConfig

    return _run_config(
        "sac",
        SACConfig(**{"buffer_size": 2000, "batch_size": 32, "learning_starts": 200, **agent}),
        plasticity=plasticity,
        network=network,
    )


def _net(**kw):
    from plasticity_zoo.training.config import NetworkConfig

    return NetworkConfig(**{"width": 16, **kw})


def _plasticity(**kw):
    from plasticity_zoo.training.config import PlasticityConfig

    return PlasticityConfig(**{"metrics_every": 0, **kw})


def _mrq(plasticity=None):
    from plasticity_zoo.agents.mrq import MRQConfig
    from plasticity_zoo.training.config import NetworkConfig

    agent = MRQConfig(batch_size=32, buffer_size=2000, learning_starts=100, target_update_freq=50)
    return _run_config(
        "mrq", agent, network=NetworkConfig(width=64), total_steps=300, eval_every=150, plasticity=plasticity
    )


def _ppo(trust_region: str, action_mode: str = "rescale"):
    from plasticity_zoo.agents.ppo import PPOConfig

    # recorded with actions rescaled from [-1, 1] (PPO's default before the clip mode); Pendulum's
    # bounds are +-2, so the clip mode (the ppo_clip_actions case) takes another path
    agent = PPOConfig(
        num_steps=64, num_minibatches=4, update_epochs=2, trust_region=trust_region, action_mode=action_mode
    )
    return _run_config("ppo", agent, total_steps=512, eval_every=256, log_every=64, checkpoint_every=512)


def _ravl(workdir: Path):
    from plasticity_zoo.agents.dynamics import DynamicsConfig
    from plasticity_zoo.agents.ravl import RAVLConfig
    from plasticity_zoo.envs import datasets
    from plasticity_zoo.envs.collect import collect
    from plasticity_zoo.training.config import NetworkConfig

    path = workdir / "toyreach-random.hdf5"
    if not path.exists():
        import tests.conftest  # noqa: F401  (registers ToyReach-v0 and its termination function)

        rng = np.random.default_rng(0)
        ds = collect(
            "ToyReach-v0", lambda o: rng.uniform(-1, 1, (o.shape[0], 1)), 1000, 0, num_envs=4, record_state=False
        )
        ds.metadata.update({"env_id": "ToyReach-v0", "kind": "random", "ref_min_score": 0.0, "ref_max_score": 30.0})
        datasets.save(path, ds)
    dyn = DynamicsConfig(members=3, elites=2, width=16, depth=2, min_epochs=5, max_epochs=5, batch_size=128)
    agent = RAVLConfig(
        dataset=str(path),
        critics=3,
        eta=1.0,
        rollout_batch=100,
        horizon=3,
        updates_per_epoch=100,
        batch_size=32,
        dataset_ratio=0.25,
        dynamics=dyn,
    )
    return _run_config(
        "ravl",
        agent,
        network=NetworkConfig(width=16),
        total_steps=300,
        eval_every=200,
        log_every=100,
        checkpoint_every=300,
        env=None,
    )  # the dataset's env


CASES = {
    "sac": lambda d: _sac(),
    "sac_n_edac": lambda d: _sac(critics=3, eta=1.0, edac_init=True),
    "mrq_w64": lambda d: _mrq(),
    "ppo_clip": lambda d: _ppo("clip"),
    "ppo_gtr": lambda d: _ppo("gtr"),
    "ppo_clip_actions": lambda d: _ppo("clip", action_mode="clip"),
    # re-recorded after the RAVL fixture's fixes (docs/fidelity.md, RAVL): bootstrap resamples dealt to the
    # members anew each epoch, early stopping from epoch min_epochs + 1
    "ravl_toy": _ravl,
    "sac_redo": lambda d: _sac(_plasticity(redo=True, reset_every=50, reset_batch=32)),
    "sac_sigreg": lambda d: _sac(_plasticity(sigreg_coef=0.2)),
    # recorded with NE's first defaults, now options (the reference's defaults: the sac_ne_reference case);
    # both re-recorded after the fixes the NE fixture found (docs/fidelity.md, Neuroplastic Expansion: ER
    # initial counts n - int(S n), the DST clock from the first DST event, regrown weights kept)
    "sac_ne": lambda d: _sac(
        _plasticity(
            ne=True,
            ne_every=50,
            reset_batch=32,
            ne_schedule="cosine",
            ne_init_space="full",
            ne_prune="redo",
            ne_review=True,
            ne_auto_batch="off",
        )
    ),
    "sac_ne_reference": lambda d: _sac(_plasticity(ne=True, ne_every=20, reset_batch=32)),
    # recorded after the redesign: resets now re-draw MR.Q's weights from its own Xavier-uniform x sqrt(2)
    "mrq_w64_regrama": lambda d: _mrq(_plasticity(regrama=True, reset_every=50, reset_batch=32)),
    # the plasticity baselines (plasticity/perturb.py, plasticity/regularizers.py, networks/blocks.py)
    "sac_shrink_perturb_layer_reset": lambda d: _sac(
        _plasticity(
            shrink_perturb=True,
            sp_every=10,
            sp_shrink=0.9,
            sp_perturb=0.1,
            layer_reset=True,
            layer_reset_every=150,
            layer_reset_layers=1,
        )
    ),
    "sac_crelu_redo": lambda d: _sac(
        _plasticity(redo=True, reset_every=50, reset_batch=32), network=_net(activation="crelu")
    ),
    "sac_fourier_multiskip": lambda d: _sac(network=_net(activation="fourier", block="multiskip")),
    "sac_l2init_parseval_nap": lambda d: _sac(
        _plasticity(l2_init=0.01, parseval=1e-4, nap=True), network=_net(layer_norm=True)
    ),
    # plasticity injection halfway through the 200 updates; TRAC apart (together, TRAC's scale after the
    # injection moved with the last bits of any rounding change: the case guarded nothing)
    "sac_injection": lambda d: _sac(_plasticity(injection_step=100, injection_layers=2)),
    "sac_trac": lambda d: _sac(_plasticity(trac=True)),
}


def fingerprint(name: str, workdir: Path) -> dict:
    """Run case ``name`` in ``workdir`` -> {"leaves": [per-leaf sums], "abs": [...], "eval": [returns]}."""
    import dataclasses

    import jax

    from plasticity_zoo.training.run import run

    cfg = CASES[name](workdir)
    cfg = dataclasses.replace(cfg, run_dir=str(workdir / name))
    out = run(cfg)
    leaves = [
        np.asarray(x, np.float64)
        for x in jax.tree.leaves(out["state"])
        if hasattr(x, "dtype") and np.issubdtype(np.asarray(x).dtype, np.floating)
    ]
    evals = [float(r["return_mean"]) for r in csv.DictReader(open(workdir / name / "eval.csv"))]
    return {"leaves": [float(x.sum()) for x in leaves], "abs": [float(np.abs(x).sum()) for x in leaves], "eval": evals}


def load() -> dict:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def main(argv):
    """Records under the suite's XLA settings (tests/conftest.py: one Eigen thread, no fusion emitters,
    synchronous dispatch), where the tests compare them."""
    from tests.conftest import compile_like_a_test  # sets the environment before JAX makes its CPU client

    compile_like_a_test()  # -O0, as test_golden's cases run (none is marked optimized)

    write = "--write" in argv
    names = [a for a in argv if not a.startswith("-")] or list(CASES)
    record = load()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            fp = fingerprint(name, Path(tmp))
            print(name, "eval", fp["eval"], "sum", sum(fp["leaves"]))
            if write:
                record[name] = fp
    if write:
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {RECORD}")


if __name__ == "__main__":
    main(sys.argv[1:])
