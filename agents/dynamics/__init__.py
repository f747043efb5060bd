"""Probabilistic dynamics ensemble for the offline model-based agents (RAVL, MOPO-style, NeuBay-like).

Follows the ensemble of RAVL (Sims et al., NeurIPS 2024; adapted there from MBPO, Janner et al. 2019)
with the variants of Unifloral (Jackson et al., NeurIPS 2025, ``algorithms/dynamics.py``) and NeuBay
(Ni et al., arXiv 2512.04341) as config options; it trains on the dataset's true next observations
(never ``observations[i+1]``, D4RL's ``qlearning_dataset`` pitfall), ends rollouts with Gymnasium
v5's termination rules (``envs/termination.py``) and rolls out as RAVL's and Unifloral's model-based
loops do.  Anything marked "our reading" is not fixed by those papers; most of it follows the RAVL
reference code (anyasims/edge-of-reach, ``dynamics_training/{net,ensemble}.py``,
``train_dynamics_model.py``).

Reading order, one module after the other (each imports only those before it):

- ``config``: ``DynamicsConfig`` (RAVL's defaults), ``unifloral_config``, ``neubay_config``;
- ``ensemble``: network -> loss -> early stopping -> ``train`` -> ``DynamicsModel``;
- ``prediction``: ``predict``, ``epistemic_uncertainty``, ``uncertainty_threshold``, ``step`` -> ``rollout``;
- ``io``: ``save`` / ``load``, and a run's model (``load_or_train``, resuming from ``partial_path``).

Every public name is re-exported here (``from plasticity_zoo.agents import dynamics``, then
``dynamics.train``); private helpers stay in the module that owns them (``ensemble._train_epoch``).
A module global is looked up in its own module: patch ``ensemble.init_model`` or ``prediction.jax``,
not this package's re-export.

Shapes: M = members, B = batch, O = obs dim, A = action dim, D = O + 1 (target (Δs, r)).

    model, info = train(key, obs, actions, rewards, next_obs, DynamicsConfig())
    mean, logvar = predict(model, obs, action)               # (M, B, D) each, raw target units
    next_obs, reward = step(model, obs, action, key)         # (B, O), (B,)
    done_fn = envs.termination.termination_fn("Hopper-v5")   # next_obs (B, O) -> bool (B,)
    batch, valid = rollout(model, policy, start, 5, key, done_fn)   # (H, B, ...) and (H, B)
    save("model.npz", model); model = load("model.npz")
"""

from plasticity_zoo.agents.dynamics.config import (
    ELITE_SAMPLING,
    INITS,
    MBPO_WEIGHT_DECAY,
    NEUBAY_EPOCH_CAPS,
    NO_EPOCH_CAP,
    TARGET_SCALING,
    DynamicsConfig,
    neubay_config,
    unifloral_config,
)
from plasticity_zoo.agents.dynamics.ensemble import (
    DynamicsModel,
    EarlyStopping,
    GaussianDynamics,
    decay_coefficients,
    ensemble_loss,
    gaussian_nll,
    init_model,
    select_elites,
    soft_clamp,
    target_statistics,
    train,
    validation_mse,
    with_elites,
)
from plasticity_zoo.agents.dynamics.io import (
    epoch_progress,
    load,
    load_or_train,
    partial_path,
    save,
)
from plasticity_zoo.agents.dynamics.prediction import (
    dataset_uncertainties,
    elite_params,
    epistemic_uncertainty,
    flatten,
    predict,
    rollout,
    step,
    uncertainty_threshold,
)

__all__ = [
    # config
    "ELITE_SAMPLING",
    "INITS",
    "NEUBAY_EPOCH_CAPS",
    "NO_EPOCH_CAP",
    "MBPO_WEIGHT_DECAY",
    "TARGET_SCALING",
    "DynamicsConfig",
    "neubay_config",
    "unifloral_config",
    # ensemble
    "DynamicsModel",
    "EarlyStopping",
    "GaussianDynamics",
    "decay_coefficients",
    "ensemble_loss",
    "gaussian_nll",
    "init_model",
    "select_elites",
    "soft_clamp",
    "target_statistics",
    "train",
    "validation_mse",
    "with_elites",
    # prediction
    "dataset_uncertainties",
    "elite_params",
    "epistemic_uncertainty",
    "flatten",
    "predict",
    "rollout",
    "step",
    "uncertainty_threshold",
    # io
    "epoch_progress",
    "load",
    "load_or_train",
    "partial_path",
    "save",
]
