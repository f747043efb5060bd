"""Multitask MR.Q as ScaleMRL scales it (Obando-Ceron, Li, Fujimoto, Bacon, Courville, Castro,
"Representation Learning Enables Scalable Multitask Deep RL", arXiv 2606.05555; code
johanobandoc/ScaleMRL ``tdmpc2/mrq.py`` and ``config.py``), with learned task embeddings in place
of frozen CLIP text vectors (the zoo's substitution: results are "learned-embedding MR.Q", not
directly comparable with CLIP-conditioned ScaleMRL runs).

One agent over the tasks of an ``mt:`` env (``envs/multitask.py``): every observation is the task's
observation zero-padded to the widest task, followed by a one-hot task id; actions are padded to the
widest task and multiplied by the task's action mask, so the policy's padded dimensions are always 0
(the env never sends them).  The uniform random actions before ``learning_starts`` are drawn over the
padded dimensions too and stored as drawn, as ScaleMRL's ``rand_act`` does (U(-1, 1) over the padded
action space); only the replayed policy and target actions are masked.

What changes from single-task MR.Q (``agents/mrq.py``, whose action encoder,
MDP predictor layout and policy head this module reuses):

  task e = E[task]                       learned table (T x 96; 512 option), or fixed rows from a file
  f    : [s, e] -> z_s                   TD-MPC2 encoder: (Linear, LN, Mish) x (L - 1), Linear, LN, SimNorm(8)
  g    : [z_s, ELU(W_a a)] -> z_sa       (Linear, LN, Mish) x 2, Linear        (mrq.StateActionEncoder)
  m    : z_sa -> (z_s', 101 reward logits)   linear, no terminal head
  Q_k  : z_sa -> 101 logits, k < K       distributional ensemble, K by model size (S 3, B/L 5, XL 7)
  pi   : [z_s, sg(e)] -> tanh(pre) * mask    (Linear, LN, Mish) x 2, Linear

One training step, on a batch of B = 1024 windows of H = 5 transitions drawn uniformly (no LAP):

(M1) L_enc = sum_{t<H} c_t [ MSE(z~_{t+1}, f'(s_{t+1}, e)) + 0.1 CE(r~_t, twohot(r_t)) ],
     z~_0 = f(s_0, e), (z~_{t+1}, r~_t) = m(g(z~_t, a_t)): the model unrolled in latent space
     (c_t = 1 until the window terminates; ScaleMRL's tasks never terminate, so it has no mask);
     one AdamW step of f, g, m and E (lr 0.3 x 3e-4), gradient norm clipped to 20 jointly.
(M2) y = sum_{i<H} gamma_task^i c_i r_{t+i} + gamma_task^H c_H min(Q'_i, Q'_j)(g'(z', a')),
     z' = f'(s_{t+H}, e), a' = (clip(pi'(z', e) + clip(N(0, 0.2^2), +-0.3), -1, 1)) * mask,
     {i, j} two distinct target heads drawn at random per update (ScaleMRL ``Q_target``).
(M3) L_Q = mean_k CE(Q_k(g(sg f(s_t, e), a_t)), twohot(y)): two-hot of symlog(y) over 101 bins
     linear on [-10, 10] (TD-MPC2's discrete regression); AdamW 3e-4, clip 20.
(M4) Q_pi = mean of two random online heads at (z_s, pi(z_s)) (head 0 alone when K = 2, TD3's
     convention as ScaleMRL keeps it); S <- lerp(S, max(P95 - P5 of Q_pi, 1), tau) (TD-MPC2's
     RunningScale); L_pi = -mean(Q_pi / S) + 1e-5 mean(pre^2); AdamW 3e-4, only pi moves.
(M5) every target network (f', g', pi', Q') <- lerp(target, online, tau = 0.01), every update.

gamma_task is ScaleMRL's per-task heuristic: with L the task's episode length in agent steps,
f = L / 5 and gamma = clip((f - 1) / f, 0.95, 0.995) (``task_discounts``); ``--gamma`` overrides it.
Updates happen at ScaleMRL's rate of ``--utd 0.075`` per env step (one env per task steps together),
kept exactly over time by a fractional credit in the state (``train_block``).

Design notes and the reference's facts this module keeps:
* Initialisation: every Linear kernel N(0, 0.02^2) truncated at +-2 (torch's ``trunc_normal_``),
  biases 0, LayerNorm gains 1 / biases 0 (affine and trained, as torch's); the learned task table
  U(-0.02, 0.02) with rows renormalised to norm <= 1 at lookup (TD-MPC2's ``max_norm=1``).
* AdamW (torch defaults, weight decay 1e-4 on every parameter, as ScaleMRL passes them all).
* The task embedding is trained by L_enc only: the policy reads it under stop-gradient (ScaleMRL's
  CLIP vectors are frozen and its policy optimizer holds only pi).  Targets read the online table.
* The encoder step comes first, then the value step reads the updated encoder, then the policy step
  reads the updated value (ScaleMRL's order); targets then move together.
* ``--plasticity`` works as for MR.Q: the four networks are ``PLASTIC``; SIGReg regularises
  z_s = f(s_0) inside L_enc.  Plasticity event periods count ``updates_per_step x envs`` per env
  step (the loop's unit), not the UTD-scaled updates this agent runs.  LEAST is not supported.
* Replay: the LAP buffer of ``buffers/lap.py`` used uniformly over valid windows (windows never cross
  a truncation), 1M transitions per seed by default (ScaleMRL keeps 10M on a GPU).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import nnx, struct

from plasticity_zoo.agents.api import OffPolicyConfig, check_replay
from plasticity_zoo.agents.mrq import PLASTIC, PLASTIC_TARGETS, StateActionEncoder, _keys, symexp, symlog  # noqa: F401
from plasticity_zoo.buffers import lap
from plasticity_zoo.buffers.lap import Window
from plasticity_zoo.networks import DeterministicPolicyHead, MLPHead, Net, Trunk, TrunkSpec, build
from plasticity_zoo.networks.config import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    RATE,
    UNIT,
    NetworkConfig,
    Range,
    check_ranges,
)
from plasticity_zoo.plasticity import optim as optim_lib
from plasticity_zoo.plasticity.api import StaticPlasticity, declared_nets, declared_params
from plasticity_zoo.plasticity.injection import injectable
from plasticity_zoo.plasticity.sigreg import regularized

# ----------------------------------------------------------------------------- config

# ScaleMRL's model sizes (its tdmpc2/common MODEL_SIZE): encoder width, MLP width, latent, encoder
# layers, Q heads (B and L leave the head count at the config default, 5).
MODEL_SIZES = {
    "S": dict(enc_dim=128, mlp_dim=256, latent_dim=384, enc_layers=2, num_q=3),
    "B": dict(enc_dim=256, mlp_dim=512, latent_dim=512, enc_layers=2, num_q=5),
    "L": dict(enc_dim=1024, mlp_dim=1024, latent_dim=512, enc_layers=3, num_q=5),
    "XL": dict(enc_dim=2048, mlp_dim=2048, latent_dim=704, enc_layers=4, num_q=7),
}


@dataclass(frozen=True)
class MultitaskMRQConfig(OffPolicyConfig):
    """ScaleMRL's multitask MR.Q (its ``config.py`` defaults), sized by ``--model-size``.

    ``--model-size L`` is ScaleMRL's multitask default model (1024 / 1024 / 512, 3 encoder layers,
    5 heads); S suits a CPU.  ``--network.width W`` scales every width of the size by W / mlp width.
    ``learning_starts`` counts env steps per seed over all tasks.  Left unset, the run follows ScaleMRL's
    schedule (``protocol``): 5 random episodes per env, evaluation every 20 episodes per env with 2
    episodes per task.
    """

    batch_size: int = 1024
    learning_starts: Optional[int] = None  # type: ignore[assignment]
    """None: ScaleMRL's seeding, 5 episodes per env (5 x num_envs x the longest task's episode; 52,500 on mt:dmc21)"""
    model_size: Literal["S", "B", "L", "XL"] = "L"
    num_q: Optional[int] = None
    """Q heads (None: the model size's)"""
    utd: float = 0.075
    """gradient updates per env step (ScaleMRL); the loop's --updates-per-step must stay 1"""
    horizon: int = 5
    """H: encoder unroll and multi-step return length"""
    task_dim: int = 96
    """learned task-embedding width (TD-MPC2's 96; 512 keeps ScaleMRL's CLIP input widths)"""
    task_embeddings: Optional[str] = None
    """a .npy (T x D) or .json ({task id: vector} or a list of rows) of fixed per-task embeddings, in the mt:
    id's task order"""
    gamma: Optional[float] = None
    """one discount for every task (None: ScaleMRL's per-task episode-length heuristic)"""
    discount_denom: float = 5.0
    discount_min: float = 0.95
    discount_max: float = 0.995
    lr: float = 3e-4
    enc_lr_scale: float = 0.3
    weight_decay: float = 1e-4
    grad_clip: float = 20.0
    """global gradient-norm clip of the encoder group and of the value ensemble"""
    tau: float = 0.01
    """soft target rate (every update) and RunningScale rate"""
    za_dim: int = 256
    simnorm_dim: int = 8
    num_bins: int = 101
    vmin: float = -10.0
    vmax: float = 10.0
    exploration_noise: float = 0.2
    target_policy_noise: float = 0.2
    noise_clip: float = 0.3
    dyn_weight: float = 1.0
    reward_weight: float = 0.1
    pre_activ_weight: float = 1e-5
    tasks: tyro.conf.Suppress[Any] = None
    """the env's ``envs.multitask.TaskSpec``, bound by the loop (``with_tasks``); never a flag"""

    RANGES = {
        "utd": POSITIVE,
        "horizon": AT_LEAST_ONE,
        "task_dim": AT_LEAST_ONE,
        "gamma": UNIT,
        "discount_denom": POSITIVE,
        "discount_min": UNIT,
        "discount_max": UNIT,
        "lr": POSITIVE,
        "enc_lr_scale": POSITIVE,
        "weight_decay": NON_NEGATIVE,
        "grad_clip": POSITIVE,
        "tau": RATE,
        "za_dim": AT_LEAST_ONE,
        "simnorm_dim": AT_LEAST_ONE,
        "num_bins": Range(2),
        "exploration_noise": NON_NEGATIVE,
        "target_policy_noise": NON_NEGATIVE,
        "noise_clip": NON_NEGATIVE,
        "dyn_weight": NON_NEGATIVE,
        "reward_weight": NON_NEGATIVE,
        "pre_activ_weight": NON_NEGATIVE,
    }


CONFIG = MultitaskMRQConfig
KIND = "offpolicy"
EXPERIENCE_REVIEW = False  # windows of its own replay


SEEDING_EPISODES = 5  # ScaleMRL config.py seeding_coef: random episodes per env before learning
EVAL_INTERVAL_EPISODES = 20  # config.py: eval_freq = 20 * 500 * num_envs (500: its DMC episode length)
EVAL_EPISODES = 2  # config.py eval_episodes: per parallel env, one env per task


def protocol(spec, num_envs: int) -> dict:
    """ScaleMRL's run schedule for ``num_envs`` envs per seed over the tasks of ``spec`` (a ``TaskSpec``),
    in env steps per seed summed over envs, as its ``trainer.py`` counts them: random actions until
    ``seeding_coef x num_envs x episode_length`` (L the longest task's episode), an evaluation every
    ``20 x 500 x num_envs`` steps (500 written for L: every task set it runs has 500-step episodes) with 2
    episodes per env.  On ``mt:dmc21`` (21 tasks, L = 500, one env per task): learning starts at 52,500,
    evaluation every 210,000 steps, 2 episodes per task."""
    length = max(spec.episode_lengths)
    return {
        "learning_starts": SEEDING_EPISODES * num_envs * length,
        "eval_every": EVAL_INTERVAL_EPISODES * num_envs * length,
        "eval_episodes": EVAL_EPISODES,
    }


def with_tasks(cfg: MultitaskMRQConfig, spec) -> MultitaskMRQConfig:
    """The config bound to the env's task layout (``envs.multitask.TaskSpec``); the loops call this
    before ``init`` for an agent that defines it."""
    if spec is None:
        raise ValueError(
            "mrq-mt needs a multitask env id: --env mt:<suite> or mt:<id>,<id>,... (one task: mt:dmc:cartpole-balance)"
        )
    return dataclasses.replace(cfg, tasks=spec)


def task_discounts(cfg: MultitaskMRQConfig, episode_lengths) -> np.ndarray:
    """ScaleMRL's discount heuristic per task: f = L / denom, clip((f - 1) / f, min, max)."""
    if cfg.gamma is not None:
        return np.full(len(episode_lengths), cfg.gamma, np.float32)
    frac = np.asarray(episode_lengths, np.float64) / cfg.discount_denom
    return np.clip((frac - 1.0) / frac, cfg.discount_min, cfg.discount_max).astype(np.float32)


def sizes(cfg: MultitaskMRQConfig, network: NetworkConfig) -> dict:
    """The model size's widths (scaled by ``--network.width`` / mlp width) and head count."""
    size = dict(MODEL_SIZES[cfg.model_size])
    if network.width is not None:
        s = network.width / size["mlp_dim"]
        for k in ("enc_dim", "mlp_dim"):
            size[k] = max(1, int(round(size[k] * s)))
        size["latent_dim"] = max(
            cfg.simnorm_dim, int(round(size["latent_dim"] * s / cfg.simnorm_dim)) * cfg.simnorm_dim
        )
    if cfg.num_q is not None:
        size["num_q"] = cfg.num_q
    return size


# ----------------------------------------------------------------------------- discrete regression (M3)


def two_hot_symlog(x, num_bins: int, vmin: float, vmax: float):
    """(...,) -> (..., n): two-hot of symlog(x) over ``num_bins`` bins linear on [vmin, vmax] (TD-MPC2)."""
    x = jnp.clip(symlog(x), vmin, vmax)
    size = (vmax - vmin) / (num_bins - 1)
    pos = (x - vmin) / size
    i = jnp.clip(jnp.floor(pos), 0, num_bins - 2).astype(jnp.int32)
    w = pos - i
    return (1.0 - w)[..., None] * jax.nn.one_hot(i, num_bins) + w[..., None] * jax.nn.one_hot(i + 1, num_bins)


def two_hot_symlog_decode(logits, num_bins: int, vmin: float, vmax: float):
    """symexp of the expected bin under softmax(logits)."""
    return symexp(jax.nn.softmax(logits, axis=-1) @ jnp.linspace(vmin, vmax, num_bins, dtype=logits.dtype))


def soft_cross_entropy(logits, x, num_bins: int, vmin: float, vmax: float):
    """CE(softmax(logits), twohot(symlog x)) per sample."""
    return -jnp.sum(two_hot_symlog(x, num_bins, vmin, vmax) * jax.nn.log_softmax(logits, axis=-1), axis=-1)


# ----------------------------------------------------------------------------- networks


def simnorm(x, dim: int):
    """Simplicial normalisation (Lavoie et al. 2022): softmax over consecutive groups of ``dim`` units."""
    return jax.nn.softmax(x.reshape(*x.shape[:-1], -1, dim), axis=-1).reshape(x.shape)


class SimNormEncoder(nnx.Module):
    """f: [s, e] -> SimNorm(LN(W_out h)), h the hidden (Linear, LN, Mish) trunk; ``features`` is z_s."""

    def __init__(self, in_dim: int, spec: TrunkSpec, latent_dim: int, simnorm_dim: int, *, rngs: nnx.Rngs):
        self.trunk = Trunk(in_dim, spec, rngs=rngs)
        self.out = nnx.Linear(spec.width, latent_dim, rngs=rngs)
        self.out_norm = nnx.LayerNorm(latent_dim, epsilon=1e-5, rngs=rngs)
        self.simnorm_dim = simnorm_dim

    def __call__(self, x, probes=None):
        h, taps = self.trunk(x, probes)
        zs = simnorm(self.out_norm(self.out(h)), self.simnorm_dim)
        return zs, {**taps, "features": zs}


def initializer(params, key):
    """Kernels N(0, 0.02^2) truncated at +-2 (torch ``trunc_normal_``), biases 0, LayerNorm gains 1."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, (path, x) in zip(keys, leaves):
        leaf = _keys(path)[-1]
        if leaf == "kernel":
            out.append((0.02 * jax.random.truncated_normal(k, -100.0, 100.0, x.shape)).astype(x.dtype))
        elif leaf in ("bias", "scale"):
            out.append(jnp.full(x.shape, 1.0 if leaf == "scale" else 0.0, x.dtype))
        else:
            raise ValueError(f"mrq-mt init: unexpected parameter {jax.tree_util.keystr(path)}")
    return jax.tree_util.tree_unflatten(treedef, out)


def _build(name: str, make_module, key, ensemble: int = 0):
    return build(name, make_module, key, ensemble=ensemble, initializer=initializer)


def _optimizer(name: str, lr: float, cfg: MultitaskMRQConfig, plasticity: StaticPlasticity, ensemble=False):
    """AdamW (torch defaults) from the shared factory, so Kron / NE masks apply as for every agent."""
    make = lambda lr, **_: optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay)  # noqa: E731
    return optim_lib.optimizer(
        lr, name, make=make, ensemble=ensemble, spec=plasticity.optim, weight_decay=cfg.weight_decay
    )


def _optimizers(cfg: MultitaskMRQConfig, plasticity: StaticPlasticity):
    """(state encoder, state-action encoder, task table, value, policy)."""
    enc_lr = cfg.enc_lr_scale * cfg.lr
    return (
        _optimizer("state_encoder", enc_lr, cfg, plasticity),
        _optimizer("sa_encoder", enc_lr, cfg, plasticity),
        optax.adamw(enc_lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay),
        _optimizer("value", cfg.lr, cfg, plasticity, ensemble=True),
        _optimizer("policy", cfg.lr, cfg, plasticity),
    )


def _load_embeddings(path: str, spec) -> np.ndarray:
    """Fixed per-task embeddings (T, D) from a .npy or .json file, in the task order of ``spec``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--task-embeddings {path}: no such file")
    try:
        if p.suffix == ".npy":
            table = np.load(p, allow_pickle=False)
        else:
            data = json.loads(p.read_text())
            if isinstance(data, dict):
                missing = [t for t in spec.tasks if t not in data]
                if missing:
                    raise ValueError(f"no embedding for task(s) {', '.join(missing)}")
                data = [data[t] for t in spec.tasks]
            table = np.asarray(data, np.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"--task-embeddings {path}: not readable as a T x D table ({e})") from e
    if table.ndim != 2 or table.shape[0] != spec.num_tasks or not np.all(np.isfinite(table)):
        raise ValueError(
            f"--task-embeddings {path}: expected a finite {spec.num_tasks} x D table (one row per task "
            f"of {spec.env_id}), got shape {table.shape}"
        )
    return table.astype(np.float32)


# ----------------------------------------------------------------------------- state


@struct.dataclass
class MultitaskMRQState:
    encoder_params: object  # f
    sa_encoder_params: object  # z_a embedding, g and the predictor m
    value_params: object  # K heads (ensemble)
    policy_params: object
    task_params: jax.Array  # (T, task_dim) learned table, or the fixed file rows (never updated then)
    target_encoder_params: object
    target_sa_encoder_params: object
    target_value_params: object
    target_policy_params: object
    encoder_opt: object
    sa_encoder_opt: object
    task_opt: object
    value_opt: object
    policy_opt: object
    q_scale: jax.Array  # RunningScale S of (M4)
    update_credit: jax.Array  # fractional updates owed (UTD), in [0, 1)
    updates: jax.Array
    last_metrics: dict  # the metrics of the last block that ran updates
    exploration_noise: jax.Array
    action_mask: jax.Array  # (T, A)
    discounts: jax.Array  # (T,)
    cfg: MultitaskMRQConfig = struct.field(pytree_node=False)
    state_encoder: Net = struct.field(pytree_node=False)
    sa_encoder: Net = struct.field(pytree_node=False)
    value: Net = struct.field(pytree_node=False)
    policy: Net = struct.field(pytree_node=False)
    latent_dim: int = struct.field(pytree_node=False)
    obs_dim: int = struct.field(pytree_node=False)  # the padded task observation (without the one-hot)
    num_tasks: int = struct.field(pytree_node=False)
    learned_tasks: bool = struct.field(pytree_node=False)
    plasticity: StaticPlasticity = struct.field(pytree_node=False, default=StaticPlasticity())


# PLASTIC: MR.Q's four networks under the same state fields (imported from agents.mrq)

_METRICS = (
    "losses/encoder",
    "losses/dynamics",
    "losses/reward",
    "losses/value",
    "losses/policy",
    "values/q_mean",
    "values/target_mean",
    "charts/q_scale",
)


def init(
    key,
    obs_dim: int,
    act_dim: int,
    cfg: MultitaskMRQConfig,
    network: NetworkConfig = NetworkConfig(),
    plasticity: StaticPlasticity = StaticPlasticity(),
) -> MultitaskMRQState:
    spec = cfg.tasks
    if spec is None:
        with_tasks(cfg, None)  # raises the explanation
    if obs_dim != spec.obs_dim or act_dim != spec.act_dim:
        raise ValueError(
            f"mrq-mt: the env gives obs {obs_dim} / act {act_dim}, its task layout says {spec.obs_dim} / {spec.act_dim}"
        )
    check_ranges(cfg)
    if cfg.updates_per_step != 1:
        raise ValueError("mrq-mt sets its update rate with --utd (updates per env step); leave --updates-per-step at 1")
    check_replay(cfg)
    size = sizes(cfg, network)
    if size["num_q"] < 2:
        raise ValueError(f"--num-q must be >= 2 (the target is the min of two heads), got {size['num_q']}")
    if size["latent_dim"] % cfg.simnorm_dim:
        raise ValueError(f"the latent width {size['latent_dim']} is not a multiple of --simnorm-dim {cfg.simnorm_dim}")
    if cfg.task_embeddings is not None:
        table, learned = jnp.asarray(_load_embeddings(cfg.task_embeddings, spec)), False
    else:
        learned = True
    task_dim = table.shape[1] if not learned else cfg.task_dim
    over = dataclasses.replace(network, width=None)  # widths come from ``sizes``

    def trunk(width, depth):
        return over.trunk(TrunkSpec(width, depth, "mlp", "mish", layer_norm=True))

    d, a, t = spec.max_obs_dim, act_dim, spec.num_tasks
    lat = size["latent_dim"]
    za_spec = TrunkSpec(cfg.za_dim, 1, "mlp", "elu", layer_norm=False)
    k = jax.random.split(key, 5)
    f, f_params = _build(
        "state_encoder",
        lambda r: SimNormEncoder(
            d + task_dim, trunk(size["enc_dim"], max(size["enc_layers"] - 1, 1)), lat, cfg.simnorm_dim, rngs=r
        ),
        k[0],
    )
    g, g_params = _build(
        "sa_encoder",
        lambda r: StateActionEncoder(lat, a, za_spec, trunk(size["mlp_dim"], 2), lat, lat + cfg.num_bins, rngs=r),
        k[1],
    )
    # injectable: the heads plasticity injection may give a residual head (the encoders are the representation)
    value, v_params = injectable(
        *_build(
            "value",
            lambda r: MLPHead(lat, cfg.num_bins, trunk(size["mlp_dim"], 2), rngs=r, squeeze=False),
            k[2],
            ensemble=size["num_q"],
        ),
        plasticity,
    )
    policy, p_params = injectable(
        *_build(
            "policy", lambda r: DeterministicPolicyHead(lat + task_dim, a, trunk(size["mlp_dim"], 2), rngs=r), k[3]
        ),
        plasticity,
    )
    if learned:
        table = jax.random.uniform(k[4], (t, task_dim), jnp.float32, -0.02, 0.02)
    tx_f, tx_g, tx_e, tx_v, tx_p = _optimizers(cfg, plasticity)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731  (distinct buffers: the loop donates state)
    zero = lambda: jnp.zeros((), jnp.float32)  # noqa: E731
    return MultitaskMRQState(
        f_params,
        g_params,
        v_params,
        p_params,
        table,
        copy(f_params),
        copy(g_params),
        copy(v_params),
        copy(p_params),
        tx_f.init(f_params),
        tx_g.init(g_params),
        tx_e.init(table),
        tx_v.init(v_params),
        tx_p.init(p_params),
        q_scale=jnp.ones((), jnp.float32),
        update_credit=zero(),
        updates=jnp.zeros((), jnp.int32),
        last_metrics={m: zero() for m in _METRICS},
        exploration_noise=jnp.asarray(cfg.exploration_noise, jnp.float32),
        action_mask=jnp.asarray(spec.action_mask()),
        discounts=jnp.asarray(task_discounts(cfg, spec.episode_lengths)),
        cfg=cfg,
        state_encoder=f,
        sa_encoder=g,
        value=value,
        policy=policy,
        latent_dim=lat,
        obs_dim=d,
        num_tasks=t,
        learned_tasks=learned,
        plasticity=plasticity,
    )


def param_count(state: MultitaskMRQState) -> dict:
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    return {
        "state_encoder": count(state.encoder_params),
        "sa_encoder": count(state.sa_encoder_params),
        "value": count(state.value_params),
        "policy": count(state.policy_params),
        "task_embedding": count(state.task_params) if state.learned_tasks else 0,
    }


# ----------------------------------------------------------------------------- inputs


def split_obs(state: MultitaskMRQState, obs):
    """mt: observation -> (padded task observation, task index)."""
    return obs[..., : state.obs_dim], jnp.argmax(obs[..., state.obs_dim :], axis=-1)


def embed(state: MultitaskMRQState, table, task):
    """Rows of the task table; learned rows renormalised to norm <= 1 (TD-MPC2's max_norm=1)."""
    e = table[task]
    if state.learned_tasks:
        e = e / jnp.maximum(1.0, jnp.linalg.norm(e, axis=-1, keepdims=True))
    return e


def encode(state: MultitaskMRQState, params, table, obs):
    """z_s = f([s, e]) and the task index of each observation."""
    s, task = split_obs(state, obs)
    return state.state_encoder(params, s, embed(state, table, task)), task


def policy_action(state: MultitaskMRQState, params, zs, task):
    """(pi([z_s, sg e]) * mask, pre-activation)."""
    e = jax.lax.stop_gradient(embed(state, state.task_params, task))
    action, pre = state.policy(params, zs, e)
    return action * state.action_mask[task], pre


def act(state: MultitaskMRQState, obs, key, explore: bool):
    """The masked deterministic action; exploring adds N(0, 0.2^2), clips to [-1, 1] and masks again."""
    zs, task = encode(state, state.encoder_params, state.task_params, obs)
    action, _ = policy_action(state, state.policy_params, zs, task)
    if explore:
        noise = state.exploration_noise * jax.random.normal(key, action.shape, action.dtype)
        action = jnp.clip(action + noise, -1.0, 1.0) * state.action_mask[task]
    return action


def with_exploration_noise(state: MultitaskMRQState, sigma) -> MultitaskMRQState:
    return state.replace(exploration_noise=jnp.asarray(sigma, jnp.float32))


def _bins(state):
    c = state.cfg
    return c.num_bins, c.vmin, c.vmax


def q_values(state: MultitaskMRQState, params, zsa, heads=None):
    """Decoded Q of every head (K, B), or of ``heads`` (indices) only."""
    logits = state.value(params, zsa)
    if heads is not None:
        logits = logits[heads]
    return two_hot_symlog_decode(logits, *_bins(state))


def two_heads(state: MultitaskMRQState, key):
    """Two distinct heads drawn uniformly (ScaleMRL: ``randperm(K)[:2]``)."""
    return jax.random.permutation(key, jax.tree.leaves(state.value_params)[0].shape[0])[:2]


# ----------------------------------------------------------------------------- losses


def encoder_loss(encoder_params, sa_encoder_params, table, state: MultitaskMRQState, win: Window):
    """(M1): the latent unroll of H steps; returns (loss, (dynamics, reward) sums)."""
    c = state.cfg
    b, h = win.reward.shape
    z, task = encode(state, encoder_params, table, win.obs)  # online first (plasticity probes this call)
    e = jax.lax.stop_gradient(embed(state, table, task))
    nxt = win.next_obs.reshape(b * h, -1)[..., : state.obs_dim]
    targets = jax.lax.stop_gradient(
        state.state_encoder(state.target_encoder_params, nxt, jnp.repeat(e, h, axis=0))
    ).reshape(b, h, -1)
    alive = jnp.ones((b,), jnp.float32)
    dyn_sum = rew_sum = jnp.zeros(())
    for t in range(h):
        _, pred = state.sa_encoder(sa_encoder_params, z, win.action[:, t])
        z, r_logits = pred[..., : state.latent_dim], pred[..., state.latent_dim :]
        dyn_sum += jnp.mean((z - targets[:, t]) ** 2 * alive[:, None])
        rew_sum += jnp.mean(soft_cross_entropy(r_logits, win.reward[:, t], *_bins(state)) * alive)
        alive = alive * (1.0 - win.terminated[:, t].astype(jnp.float32))
    return c.dyn_weight * dyn_sum + c.reward_weight * rew_sum, (dyn_sum, rew_sum)


def multistep_return(reward, terminated, gamma):
    """(M2)'s masked H-step return with a per-sample discount ``gamma`` (B,) -> (R, gamma^H c_H)."""
    r, survive = lap.multistep_return(reward, terminated, gamma[:, None])
    return r, gamma ** reward.shape[1] * survive


def value_target(state: MultitaskMRQState, win: Window, key):
    """y of (M2) from the target networks; (B,)."""
    c = state.cfg
    k_noise, k_heads = jax.random.split(key)
    _, task = split_obs(state, win.obs)
    ret, bootstrap = multistep_return(win.reward, win.terminated, state.discounts[task])
    next_zs, _ = encode(state, state.target_encoder_params, state.task_params, win.next_obs[:, -1])
    next_action, _ = policy_action(state, state.target_policy_params, next_zs, task)
    noise = jnp.clip(
        c.target_policy_noise * jax.random.normal(k_noise, next_action.shape, next_action.dtype),
        -c.noise_clip,
        c.noise_clip,
    )
    next_action = jnp.clip(next_action + noise, -1.0, 1.0) * state.action_mask[task]
    next_zsa, _ = state.sa_encoder(state.target_sa_encoder_params, next_zs, next_action)
    next_q = q_values(state, state.target_value_params, next_zsa, two_heads(state, k_heads)).min(axis=0)
    return jax.lax.stop_gradient(ret + bootstrap * next_q)


def value_loss(value_params, state: MultitaskMRQState, zsa, y):
    """(M3): mean over heads of the soft cross-entropy against two-hot(symlog y).  Returns (loss, Q (K, B))."""
    logits = state.value(value_params, zsa)
    ce = soft_cross_entropy(logits, y[None], *_bins(state))
    return ce.mean(), two_hot_symlog_decode(logits, *_bins(state))


def running_scale(scale, q, tau: float):
    """TD-MPC2's RunningScale: lerp towards max(P95 - P5 of q, 1) at rate tau."""
    p5, p95 = jnp.percentile(q, jnp.array([5.0, 95.0]))
    return scale + tau * (jnp.maximum(p95 - p5, 1.0) - scale)


def policy_loss(policy_params, state: MultitaskMRQState, zs, task, value_params, heads):
    """(M4).  Returns (loss, (Q_pi (B,), new scale))."""
    action, pre = policy_action(state, policy_params, zs, task)
    zsa, _ = state.sa_encoder(state.sa_encoder_params, zs, action)
    q = q_values(state, value_params, zsa, heads).mean(axis=0)
    scale = running_scale(state.q_scale, jax.lax.stop_gradient(q), state.cfg.tau)
    loss = -jnp.mean(q / scale) + state.cfg.pre_activ_weight * jnp.mean(pre**2)
    return loss, (q, scale)


def _soft(target, online, tau: float):
    return jax.tree.map(lambda t, o: t + tau * (o - t), target, online)


# ----------------------------------------------------------------------------- one update


def update(state: MultitaskMRQState, win: Window, key):
    """(M1)-(M5) on one batch of H-step windows -> (state, metrics)."""
    c = state.cfg
    tx_f, tx_g, tx_e, tx_v, tx_p = _optimizers(c, state.plasticity)
    k_reg, k_target, k_pi = jax.random.split(key, 3)

    # (M1) encoder group: f, g/m and a learned task table, clipped jointly (fixed rows, like ScaleMRL's frozen
    # CLIP rows, take no gradient and stay out of the clip's norm)
    (enc_loss, (dyn, rew)), grads = jax.value_and_grad(
        regularized(encoder_loss, "state_encoder"), argnums=(0, 1, 2) if state.learned_tasks else (0, 1), has_aux=True
    )(
        state.encoder_params,
        state.sa_encoder_params,
        state.task_params,
        state,
        win,
        reg_key=k_reg,
        sigreg=state.plasticity.sigreg,
    )
    grads, _ = optax.clip_by_global_norm(c.grad_clip).update(grads, optax.EmptyState())
    upd, encoder_opt = tx_f.update(grads[0], state.encoder_opt, state.encoder_params)
    encoder_params = optax.apply_updates(state.encoder_params, upd)
    upd, sa_opt = tx_g.update(grads[1], state.sa_encoder_opt, state.sa_encoder_params)
    sa_params = optax.apply_updates(state.sa_encoder_params, upd)
    task_params, task_opt = state.task_params, state.task_opt
    if state.learned_tasks:
        upd, task_opt = tx_e.update(grads[2], state.task_opt, state.task_params)
        task_params = optax.apply_updates(state.task_params, upd)
    state = state.replace(
        encoder_params=encoder_params,
        encoder_opt=encoder_opt,
        sa_encoder_params=sa_params,
        sa_encoder_opt=sa_opt,
        task_params=task_params,
        task_opt=task_opt,
    )

    # (M2)-(M3) value ensemble on the updated encoder
    y = value_target(state, win, k_target)
    zs, task = encode(state, state.encoder_params, state.task_params, win.obs)
    zs = jax.lax.stop_gradient(zs)
    zsa = jax.lax.stop_gradient(state.sa_encoder(state.sa_encoder_params, zs, win.action[:, 0])[0])
    (v_loss, q), grads = jax.value_and_grad(value_loss, has_aux=True)(state.value_params, state, zsa, y)
    grads, _ = optax.clip_by_global_norm(c.grad_clip).update(grads, optax.EmptyState())
    upd, value_opt = tx_v.update(grads, state.value_opt, state.value_params)
    value_params = optax.apply_updates(state.value_params, upd)

    # (M4) policy on the updated value
    heads = jnp.zeros((1,), jnp.int32) if q.shape[0] == 2 else two_heads(state, k_pi)
    (p_loss, (_, scale)), grads = jax.value_and_grad(policy_loss, has_aux=True)(
        state.policy_params, state, zs, task, value_params, heads
    )
    upd, policy_opt = tx_p.update(grads, state.policy_opt, state.policy_params)
    policy_params = optax.apply_updates(state.policy_params, upd)

    # (M5) soft targets
    state = state.replace(
        value_params=value_params,
        value_opt=value_opt,
        policy_params=policy_params,
        policy_opt=policy_opt,
        q_scale=scale,
        updates=state.updates + 1,
        target_encoder_params=_soft(state.target_encoder_params, state.encoder_params, c.tau),
        target_sa_encoder_params=_soft(state.target_sa_encoder_params, state.sa_encoder_params, c.tau),
        target_value_params=_soft(state.target_value_params, value_params, c.tau),
        target_policy_params=_soft(state.target_policy_params, policy_params, c.tau),
    )
    metrics = {
        "losses/encoder": enc_loss,
        "losses/dynamics": dyn,
        "losses/reward": rew,
        "losses/value": v_loss,
        "losses/policy": p_loss,
        "values/q_mean": q.mean(),
        "values/target_mean": y.mean(),
        "charts/q_scale": scale,
    }
    return state, metrics


# ----------------------------------------------------------------------------- the loop's hooks


def train_block(state: MultitaskMRQState, buffer: lap.LAPBuffer, key, num_updates: int, replay_control=None):
    """The updates owed for ``num_updates`` env steps at ``--utd`` (``num_updates`` = env steps per
    seed of this loop iteration, since ``--updates-per-step`` is 1): credit += utd x steps, then
    floor(credit) updates on uniform H-step windows, as a while-loop -> (state, buffer, metrics)."""
    if replay_control is not None:
        raise ValueError("mrq-mt samples its own windows: NE's experience review and auto batch do not apply")
    c = state.cfg
    if buffer.horizon.shape[-1] != c.horizon:
        raise ValueError(
            f"the replay keeps windows of {buffer.horizon.shape[-1]} transitions, mrq-mt needs "
            f"{c.horizon}: build it with buffer_init(..., cfg)"
        )
    credit = state.update_credit + c.utd * num_updates
    n = jnp.floor(credit).astype(jnp.int32)
    state = state.replace(update_credit=credit - n)

    def body(carry):
        i, state, sums = carry
        k_draw, k_update = jax.random.split(jax.random.fold_in(key, i))
        win = lap.window(buffer, lap.draw_tree(buffer.counts, k_draw, c.batch_size), c.horizon)
        state, metrics = update(state, win, k_update)
        return i + 1, state, jax.tree.map(jnp.add, sums, metrics)

    zeros = {m: jnp.zeros((), jnp.float32) for m in _METRICS}
    _, state, sums = jax.lax.while_loop(lambda carry: carry[0] < n, body, (jnp.zeros((), jnp.int32), state, zeros))
    means = jax.tree.map(lambda s: s / jnp.maximum(n, 1), sums)
    last = jax.tree.map(lambda new, old: jnp.where(n > 0, new, old), means, state.last_metrics)
    state = state.replace(last_metrics=last)
    return (
        state,
        buffer,
        {
            **last,
            "charts/updates": state.updates.astype(jnp.float32),
            "charts/valid_windows": lap.valid_windows(buffer),
        },
    )


def work_per_env_step(state: MultitaskMRQState, batch: Window, key):
    """The average training work of one env step (utd x one update), for FLOP counting."""
    return update(state, batch, key)[0]


def buffer_init(capacity: int, obs_dim: int, act_dim: int, cfg: MultitaskMRQConfig) -> lap.LAPBuffer:
    """Per-env subtrajectory streams with windows of H transitions (sampled uniformly)."""
    return lap.init(capacity, obs_dim, act_dim, horizon=cfg.horizon)


buffer_add = lap.add


def sample_batch(state: MultitaskMRQState, buffer: lap.LAPBuffer, key, batch_size: int) -> Window:
    """Uniform H-step windows (plasticity metrics / resets)."""
    return lap.sample(buffer, key, batch_size, state.cfg.horizon, prioritized=False)[1]


plastic_params = declared_params(PLASTIC)
plastic_nets = declared_nets(PLASTIC)
SIGREG_NETWORKS = ("state_encoder",)


def plastic_losses(state: MultitaskMRQState, batch: Window, key):
    """Per plastic network, its training loss as a function of its params."""
    y = value_target(state, batch, key)
    zs, task = encode(state, state.encoder_params, state.task_params, batch.obs)
    zs = jax.lax.stop_gradient(zs)
    zsa = jax.lax.stop_gradient(state.sa_encoder(state.sa_encoder_params, zs, batch.action[:, 0])[0])
    heads = jnp.arange(2)
    return {
        "state_encoder": lambda p: encoder_loss(p, state.sa_encoder_params, state.task_params, state, batch)[0],
        "sa_encoder": lambda p: encoder_loss(state.encoder_params, p, state.task_params, state, batch)[0],
        "value": lambda p: value_loss(p, state, zsa, y)[0],
        "policy": lambda p: policy_loss(p, state, zs, task, state.value_params, heads)[0],
    }


def task_embedding_grad(state: MultitaskMRQState, win: Window):
    """d L_enc / d E (T, task_dim): nonzero only on the rows of tasks in the batch."""
    return jax.grad(lambda e: encoder_loss(state.encoder_params, state.sa_encoder_params, e, state, win)[0])(
        state.task_params
    )
