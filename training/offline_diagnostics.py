"""Why an offline actor-critic run works or fails: value and dynamics checks on its last checkpoint.

``scripts/diagnose_offline.py RUN_DIR`` prints these and writes ``RUN_DIR/diagnostics.json``.
For SAC-family offline agents (RAVL: a state with ``critic``, ``critic_params``,
``target_critic_params`` and ``actor``), per seed:

- **values on the dataset**: min-over-critics Q and the ensemble spread (std over critics) at the
  dataset's actions, the policy's actions and uniform random actions, against the discounted
  return-to-go of the dataset's own episodes (``mc_return``; a lower bound where an episode was
  cut by a time limit).  Q far above ``mc_return`` at every action, with a spread of a few units,
  is the overestimation the ensemble's pessimism did not absorb.
- **value drift**: mean of min_i Q'(s', a') - min_i Q(s, a), a' ~ pi, over the model FIFO's
  non-terminal rows and over dataset rows.  About (1 - gamma) Q - r + alpha log pi at a fixed
  point; a large positive drift on model rows means values rise along the rollouts, toward the
  edge-of-reach states that are bootstrapped from but never trained (Sims et al. 2024, sec. 4).
- **the policy in the real env** (deterministic, ``episodes`` episodes): return, length, and along
  its own trajectory the critics' min-Q and spread, the dynamics elites' one-step error and spread
  (against the same on dataset rows: how far off-data the policy goes), and whether the model's
  done function fires on the model's prediction of the real terminal step.
- **coverage**: along each real episode, the distance from the policy's state to the nearest
  dataset state (Euclidean, each observation dimension divided by its dataset std), against the
  same distance for dataset states to the nearest state of *another* dataset episode
  (``data_distance``, the median over sampled rows).  States many times farther than that are
  outside the data's support: no dataset row, and no short model rollout from one, reaches them.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import agents
from agents import dynamics as dynamics_lib
from agents import sac
from envs import datasets, termination
from envs.make import VectorEnv
from networks.distributions import tanh_gaussian_sample
from buffers import replay
from training import checkpoint
from training.offline import initial_state, resolve_dataset, _buffers
from training.run import load_config


def returns_to_go(rewards, ends, gamma: float) -> np.ndarray:
    """G_i = r_i + gamma G_{i+1} within an episode; G_i = r_i where ``ends[i]`` (the episode's last row)."""
    rewards, ends = np.asarray(rewards, np.float64), np.asarray(ends, bool)
    out = np.zeros_like(rewards)
    g = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        g = rewards[i] + (0.0 if ends[i] else gamma * g)
        out[i] = g
    return out


def episode_ends(dataset) -> np.ndarray:
    """Rows that end an episode: terminal, timeout, a break in the observation chain, or the last row."""
    ends = np.asarray(dataset.terminals, bool) | np.asarray(dataset.timeouts, bool)
    ends[datasets.check_continuity(dataset)] = True
    ends[-1] = True
    return ends


def load_run(run_dir):
    """The run's config, agent, dataset, env id, dynamics model (``aux``), last checkpointed state and data."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir)
    agent = agents.get(cfg.agent_name)
    if agent.KIND != "offline":
        raise SystemExit(f"{run_dir} is a run of {cfg.agent_name!r}, not an offline agent")
    from training.evaluation import is_recurrent

    if is_recurrent(agent):
        raise SystemExit(f"{run_dir} is a run of {cfg.agent_name!r}: the diagnostics read Markov critics Q(s, a) "
                         "(RAVL's); a recurrent agent's critics read whole histories")
    path, dataset, env_id = resolve_dataset(cfg)
    keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 2)
    aux = agent.prepare(keys[0], dataset, path, cfg.agent, cfg.seed, log=lambda *_: None)
    state, data = initial_state(cfg, agent, dataset, keys[2:])
    found = checkpoint.latest(run_dir)
    if found is None:
        raise SystemExit(f"{run_dir} has no checkpoint yet")
    (state, buffers, _), host, _ = checkpoint.load(found, (state, _buffers(data), keys[1]))
    return {"cfg": cfg, "agent": agent, "dataset": dataset, "env_id": env_id, "aux": aux,
            "state": state, "data": buffers._replace(real=data.real), "step": int(host["step"])}


def nearest_distances(points, reference, scale, exclude=None, point_groups=None, chunk: int = 65_536) -> np.ndarray:
    """For each of ``points`` (P, D): the distance to the nearest row of ``reference`` (R, D), both divided
    by ``scale`` (D,) first.  With ``exclude`` (R,) group ids and ``point_groups`` (P,), reference rows of a
    point's own group are skipped (inf where a point has no other group).  Chunked over ``reference``."""
    p = np.asarray(points, np.float64) / scale
    p_sq = (p * p).sum(1)[:, None]
    groups = None if exclude is None else np.asarray(point_groups)[:, None]
    best = np.full(len(p), np.inf)
    for start in range(0, len(reference), chunk):
        r = np.asarray(reference[start:start + chunk], np.float64) / scale
        d2 = p_sq + (r * r).sum(1)[None, :] - 2.0 * p @ r.T  # (P, chunk)
        if groups is not None:
            d2[groups == np.asarray(exclude[start:start + chunk])[None, :]] = np.inf
        best = np.minimum(best, d2.min(1))
    return np.sqrt(np.maximum(best, 0.0))


def episode_coverage(distances) -> dict:
    """Nearest-dataset-state distances (T,) along one episode -> at its first and last step, and the largest."""
    d = np.asarray(distances)
    return {"data_distance_first": float(d[0]), "data_distance_max": float(d.max()), "data_distance_last": float(d[-1])}


def _q(state, params, obs, action):
    return np.asarray(state.critic(params, jnp.asarray(obs), jnp.asarray(action)))  # (N, B)


def _spread_stats(q) -> dict:
    return {"q_min": float(q.min(0).mean()), "q_mean": float(q.mean()), "q_std": float(q.std(0).mean())}


def _drift(state, batch, key) -> float:
    """mean over non-terminal rows of min_i Q'(s', a') - min_i Q(s, a), a' ~ pi(s')."""
    mean, log_std = state.actor(state.actor_params, batch.next_obs)
    next_action, _ = tanh_gaussian_sample(key, mean, log_std)
    gain = _q(state, state.target_critic_params, batch.next_obs, next_action).min(0) - \
        _q(state, state.critic_params, batch.obs, batch.action).min(0)
    live = ~np.asarray(batch.terminated)
    return float(gain[live].mean()) if live.any() else float("nan")


def _model_checks(model, obs, action, next_obs) -> dict:
    """The elites' mean one-step error (mean |s'_pred - s'|) and their spread (std over elites of the mean Δs)."""
    mean, _ = dynamics_lib.predict(model, jnp.asarray(obs), jnp.asarray(action))
    elite = np.asarray(mean)[np.asarray(model.elites)][..., : model.obs_dim]  # (E, B, O)
    pred = np.asarray(obs) + elite.mean(0)
    return {"model_error": float(np.abs(pred - np.asarray(next_obs)).mean()),
            "model_spread": float(elite.std(0).mean()), "pred_next_obs": pred}


def _real_episodes(state, env_id, episodes: int, seed: int):
    """Deterministic episodes of the policy: per episode the (obs, action, reward, next_obs, terminated) arrays."""
    env = VectorEnv(env_id, episodes, seed)
    obs = env.reset()
    act = jax.jit(lambda o: sac.act(state, o, None, explore=False))
    rows = [[] for _ in range(episodes)]
    done = np.zeros(episodes, bool)
    while not done.all():
        action = np.asarray(act(jnp.asarray(obs, jnp.float32)))
        new_obs, reward, terminated, truncated, next_obs = env.step(action)
        for i in np.flatnonzero(~done):
            rows[i].append((obs[i], action[i], reward[i], next_obs[i], terminated[i]))
        done |= terminated | truncated
        obs = new_obs
    return [tuple(np.stack(c) for c in zip(*r)) for r in rows]


def episode_values(q) -> dict:
    """The critics (N, T) along one episode -> min-Q at its first and last step, its maximum and the
    step where that maximum is, and the mean ensemble spread."""
    q = np.asarray(q)
    q_min = q.min(0)
    return {"q_min_first": float(q_min[0]), "q_min_max": float(q_min.max()), "q_min_max_at": int(np.argmax(q_min)),
            "q_min_last": float(q_min[-1]), "q_std": float(q.std(0).mean())}


def diagnose(run_dir, episodes: int = 3, samples: int = 4096, seed: int = 0) -> dict:
    """The checks above for every seed of the run's last checkpoint -> a JSON-ready dict."""
    run = load_run(run_dir)
    cfg, dataset, model = run["cfg"], run["dataset"], run["aux"]
    if not hasattr(run["state"], "critic"):
        raise SystemExit(f"diagnostics need a SAC-family state (critics and actor); {cfg.agent_name!r} has none")
    has_model = isinstance(model, dynamics_lib.DynamicsModel)
    done_fn = termination.termination_fn(run["env_id"]) if has_model else None
    rng = np.random.default_rng(seed)
    g = returns_to_go(dataset.rewards, episode_ends(dataset), cfg.agent.gamma)
    idx = rng.choice(len(dataset), min(samples, len(dataset)), replace=False)
    real = jax.tree.map(lambda x: np.asarray(x)[idx], dataset.transitions(unit_actions=True))
    data_obs = np.asarray(dataset.observations)
    scale = np.maximum(data_obs.std(0), 1e-6)
    episode_id = np.concatenate([[0], np.cumsum(episode_ends(dataset))[:-1]])
    ref = idx[:512]
    out = {"run_dir": str(run_dir), "step": run["step"], "env_id": run["env_id"],
           "mc_return": float(g[idx].mean()),
           "data_distance": float(np.median(nearest_distances(data_obs[ref], data_obs, scale, episode_id,
                                                              episode_id[ref]))),
           "seeds": []}
    if has_model:
        out["model_on_data"] = {k: v for k, v in _model_checks(model, real.obs, real.action, real.next_obs).items()
                                if k != "pred_next_obs"}
    for j in range(cfg.seeds):
        state = jax.tree.map(lambda x: x[j], run["state"])
        key = jax.random.fold_in(jax.random.key(seed), j)
        k_pi, k_model, k_drift_model, k_drift_real = jax.random.split(key, 4)
        mean, log_std = state.actor(state.actor_params, jnp.asarray(real.obs))
        policy_action = np.asarray(jnp.tanh(mean))
        random_action = rng.uniform(-1, 1, real.action.shape).astype(np.float32)
        row = {"seed": j,
               "data_actions": _spread_stats(_q(state, state.critic_params, real.obs, real.action)),
               "policy_actions": _spread_stats(_q(state, state.critic_params, real.obs, policy_action)),
               "random_actions": _spread_stats(_q(state, state.critic_params, real.obs, random_action)),
               "drift_real": _drift(state, real, k_drift_real)}
        buffer = getattr(run["data"], "model", None)
        if buffer is not None and int(np.asarray(buffer.size)[j]) > 0:
            b = replay.sample(jax.tree.map(lambda x: x[j], buffer), k_model, samples)
            row["drift_model"] = _drift(state, b, k_drift_model)
        row["episodes"] = []
        for obs, action, reward, next_obs, terminated in _real_episodes(state, run["env_id"], episodes,
                                                                         seed * 1000 + 10_000 + 100 * j):
            q = _q(state, state.critic_params, obs, action)
            ep = {"return": float(reward.sum()), "length": int(len(reward)), "terminated": bool(terminated[-1]),
                  **episode_values(q), **episode_coverage(nearest_distances(obs, data_obs, scale))}
            if has_model:
                m = _model_checks(model, obs, action, next_obs)
                ep.update(model_error=m["model_error"], model_spread=m["model_spread"])
                if terminated[-1]:
                    ep["model_done_at_terminal"] = bool(np.asarray(done_fn(jnp.asarray(m["pred_next_obs"][-1:])))[0])
            row["episodes"].append(ep)
        out["seeds"].append(row)
    return out


def report(d: dict) -> str:
    """A short human-readable summary of ``diagnose``'s output."""
    lines = [f"{d['run_dir']} at update {d['step']} ({d['env_id']}): dataset discounted return-to-go "
             f"{d['mc_return']:.1f}; a dataset state's distance to the nearest state of another episode "
             f"{d['data_distance']:.2f} (median)"]
    if "model_on_data" in d:
        m = d["model_on_data"]
        lines.append(f"  dynamics on dataset rows: one-step error {m['model_error']:.4f}, elite spread "
                     f"{m['model_spread']:.4f}")
    for s in d["seeds"]:
        lines.append(f"  seed {s['seed']}: min-Q (critic spread) at data actions {s['data_actions']['q_min']:.1f} "
                     f"({s['data_actions']['q_std']:.2f}), policy {s['policy_actions']['q_min']:.1f} "
                     f"({s['policy_actions']['q_std']:.2f}), random {s['random_actions']['q_min']:.1f} "
                     f"({s['random_actions']['q_std']:.2f})")
        drift = f"value drift per step: dataset rows {s['drift_real']:+.2f}"
        if "drift_model" in s:
            drift += f", model rows {s['drift_model']:+.2f}"
        lines.append("    " + drift)
        for e in s["episodes"]:
            text = (f"    real episode: return {e['return']:.1f}, length {e['length']}, min-Q first {e['q_min_first']:.1f} "
                    f"max {e['q_min_max']:.1f} at step {e['q_min_max_at']}, last {e['q_min_last']:.1f} "
                    f"(spread {e['q_std']:.2f})")
            text += (f"; distance to the data first {e['data_distance_first']:.2f} max {e['data_distance_max']:.2f} "
                     f"last {e['data_distance_last']:.2f}")
            if "model_error" in e:
                text += f"; dynamics error {e['model_error']:.4f}, elite spread {e['model_spread']:.4f}"
            if "model_done_at_terminal" in e:
                text += f"; model predicts the fall: {e['model_done_at_terminal']}"
            lines.append(text)
    return "\n".join(lines)


def write(run_dir, d: dict) -> Path:
    path = Path(run_dir) / "diagnostics.json"
    path.write_text(json.dumps(d, indent=2))
    return path
