"""Why an offline actor-critic run works or fails: value and dynamics checks on its last checkpoint.

``scripts/diagnose_offline.py RUN_DIR`` prints these and writes ``RUN_DIR/diagnostics.json``.
A recurrent agent on a world-model posterior (NeuBay) gets its own checks instead
(``diagnose_posterior``: imagination beside the real episodes).
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

from plasticity_zoo import agents
from plasticity_zoo.agents import dynamics as dynamics_lib
from plasticity_zoo.agents import imagination
from plasticity_zoo.analysis.restore import restore_policy
from plasticity_zoo.buffers import replay
from plasticity_zoo.envs import datasets, termination
from plasticity_zoo.envs.make import VectorEnv
from plasticity_zoo.networks.distributions import tanh_gaussian_sample
from plasticity_zoo.training import checkpoint
from plasticity_zoo.training.evaluation import is_recurrent, policy_maker
from plasticity_zoo.training.loop import RunTree
from plasticity_zoo.training.loops.offline import _buffers, initial_state, resolve_dataset
from plasticity_zoo.training.run import load_config


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
    if is_recurrent(agent) and not (hasattr(agent, "history_values") and hasattr(agent, "rollout_policy")):
        raise SystemExit(
            f"{run_dir} is a run of {cfg.agent_name!r}: its critics read whole histories and the "
            "agent has no history_values / rollout_policy to read them along an episode"
        )
    path, dataset, env_id = resolve_dataset(cfg)
    keys = jax.random.split(jax.random.key(cfg.seed), cfg.seeds + 2)
    aux = agent.prepare(keys[0], dataset, path, cfg.agent, cfg.seed, log=lambda *_: None)
    base = {"run_dir": run_dir, "cfg": cfg, "agent": agent, "dataset": dataset, "env_id": env_id, "aux": aux}
    if is_recurrent(agent):  # the agent alone (its tape buffer, up to 40M positions, is not read)
        restored = restore_policy(run_dir)
        return {**base, "state": restored.state, "data": None, "step": restored.step}
    state, data = initial_state(cfg, agent, dataset, keys[2:])
    found = checkpoint.latest(run_dir)
    if found is None:
        raise SystemExit(f"{run_dir} has no checkpoint yet")
    (state, buffers, _), host, _ = checkpoint.load(found, RunTree(state, _buffers(data), keys[1]))
    return {**base, "state": state, "data": buffers._replace(real=data.real), "step": int(host["step"])}


def nearest_distances(points, reference, scale, exclude=None, point_groups=None, chunk: int = 65_536) -> np.ndarray:
    """For each of ``points`` (P, D): the distance to the nearest row of ``reference`` (R, D), both divided
    by ``scale`` (D,) first.  With ``exclude`` (R,) group ids and ``point_groups`` (P,), reference rows of a
    point's own group are skipped (inf where a point has no other group).  Chunked over ``reference``."""
    p = np.asarray(points, np.float64) / scale
    p_sq = (p * p).sum(1)[:, None]
    groups = None if exclude is None else np.asarray(point_groups)[:, None]
    best = np.full(len(p), np.inf)
    for start in range(0, len(reference), chunk):
        r = np.asarray(reference[start : start + chunk], np.float64) / scale
        d2 = p_sq + (r * r).sum(1)[None, :] - 2.0 * p @ r.T  # (P, chunk)
        if groups is not None:
            d2[groups == np.asarray(exclude[start : start + chunk])[None, :]] = np.inf
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
    gain = _q(state, state.target_critic_params, batch.next_obs, next_action).min(0) - _q(
        state, state.critic_params, batch.obs, batch.action
    ).min(0)
    live = ~np.asarray(batch.terminated)
    return float(gain[live].mean()) if live.any() else float("nan")


def _elite_predictions(model, obs, action):
    """The elites' mean (Δs, r) predictions (E, B, O + 1) and their next states obs + Δs (E, B, O), numpy."""
    mean, _ = dynamics_lib.predict(model, jnp.asarray(obs, jnp.float32), jnp.asarray(action, jnp.float32))
    elite = np.asarray(mean)[np.asarray(model.elites)]
    return elite, np.asarray(obs)[None] + elite[..., : model.obs_dim]


def _model_checks(model, obs, action, next_obs) -> dict:
    """The elites' mean one-step error (mean |s'_pred - s'|) and their spread (std over elites of the mean Δs)."""
    elite, _ = _elite_predictions(model, obs, action)
    elite = elite[..., : model.obs_dim]  # (E, B, O)
    pred = np.asarray(obs) + elite.mean(0)
    return {
        "model_error": float(np.abs(pred - np.asarray(next_obs)).mean()),
        "model_spread": float(elite.std(0).mean()),
        "pred_next_obs": pred,
    }


def _real_episodes(policy, env_id, episodes: int, seed: int):
    """Deterministic episodes of ``policy`` (obs (n, O) -> actions (n, A); a recurrent one also has
    ``observe(rewards (n,))``): per episode the (obs, action, reward, next_obs, terminated) arrays."""
    env = VectorEnv(env_id, episodes, seed)
    obs = env.reset()
    rows = [[] for _ in range(episodes)]
    done = np.zeros(episodes, bool)
    while not done.all():
        action = np.asarray(policy(obs))
        new_obs, reward, terminated, truncated, next_obs = env.step(action)
        if hasattr(policy, "observe"):
            policy.observe(reward)
        for i in np.flatnonzero(~done):
            rows[i].append((obs[i], action[i], reward[i], next_obs[i], terminated[i]))
        done |= terminated | truncated
        obs = new_obs
    return [tuple(np.stack(c) for c in zip(*r)) for r in rows]


class _SeedPolicy:
    """Seed ``j``'s deterministic policy (``training.evaluation.policy_maker``: a recurrent agent's
    carries each episode's memory, previous action and reward) on observations (n, O)."""

    def __init__(self, agent, states, j: int):
        self.policy = policy_maker(agent)(jax.tree.map(lambda x: x[j : j + 1], states))

    def __call__(self, obs):
        return np.asarray(self.policy(jnp.asarray(obs, jnp.float32)[None]))[0]

    def observe(self, reward):
        if hasattr(self.policy, "observe"):
            self.policy.observe(jnp.asarray(reward, jnp.float32)[None])


def episode_values(q) -> dict:
    """The critics (N, T) along one episode -> min-Q at its first and last step, its maximum and the
    step where that maximum is, and the mean ensemble spread."""
    q = np.asarray(q)
    q_min = q.min(0)
    return {
        "q_min_first": float(q_min[0]),
        "q_min_max": float(q_min.max()),
        "q_min_max_at": int(np.argmax(q_min)),
        "q_min_last": float(q_min[-1]),
        "q_std": float(q.std(0).mean()),
    }


def diagnose(run_dir, episodes: int = 3, samples: int = 4096, seed: int = 0) -> dict:
    """The checks above for every seed of the run's last checkpoint -> a JSON-ready dict."""
    run = load_run(run_dir)
    if is_recurrent(run["agent"]):
        return diagnose_posterior(run, episodes, samples, seed)
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
    out = {
        "run_dir": str(run_dir),
        "step": run["step"],
        "env_id": run["env_id"],
        "mc_return": float(g[idx].mean()),
        "data_distance": float(
            np.median(nearest_distances(data_obs[ref], data_obs, scale, episode_id, episode_id[ref]))
        ),
        "seeds": [],
    }
    if has_model:
        out["model_on_data"] = {
            k: v for k, v in _model_checks(model, real.obs, real.action, real.next_obs).items() if k != "pred_next_obs"
        }
    for j in range(cfg.seeds):
        state = jax.tree.map(lambda x: x[j], run["state"])
        key = jax.random.fold_in(jax.random.key(seed), j)
        k_pi, k_model, k_drift_model, k_drift_real = jax.random.split(key, 4)
        mean, log_std = state.actor(state.actor_params, jnp.asarray(real.obs))
        policy_action = np.asarray(jnp.tanh(mean))
        random_action = rng.uniform(-1, 1, real.action.shape).astype(np.float32)
        row = {
            "seed": j,
            "data_actions": _spread_stats(_q(state, state.critic_params, real.obs, real.action)),
            "policy_actions": _spread_stats(_q(state, state.critic_params, real.obs, policy_action)),
            "random_actions": _spread_stats(_q(state, state.critic_params, real.obs, random_action)),
            "drift_real": _drift(state, real, k_drift_real),
        }
        buffer = getattr(run["data"], "model", None)
        if buffer is not None and int(np.asarray(buffer.size)[j]) > 0:
            b = replay.sample(jax.tree.map(lambda x: x[j], buffer), k_model, samples)
            row["drift_model"] = _drift(state, b, k_drift_model)
        row["episodes"] = []
        episodes_j = _real_episodes(
            _SeedPolicy(run["agent"], run["state"], j), run["env_id"], episodes, seed * 1000 + 10_000 + 100 * j
        )
        for obs, action, reward, next_obs, terminated in episodes_j:
            q = _q(state, state.critic_params, obs, action)
            ep = {
                "return": float(reward.sum()),
                "length": int(len(reward)),
                "terminated": bool(terminated[-1]),
                **episode_values(q),
                **episode_coverage(nearest_distances(obs, data_obs, scale)),
            }
            if has_model:
                m = _model_checks(model, obs, action, next_obs)
                ep.update(model_error=m["model_error"], model_spread=m["model_spread"])
                if terminated[-1]:
                    ep["model_done_at_terminal"] = bool(np.asarray(done_fn(jnp.asarray(m["pred_next_obs"][-1:])))[0])
            row["episodes"].append(ep)
        out["seeds"].append(row)
    return out


# ----------------------------------------------------------------------------- a world-model posterior (NeuBay)


def first_true(flags) -> np.ndarray:
    """(E, T) booleans -> (E,) the 1-based index of each row's first True, 0 where there is none."""
    flags = np.asarray(flags, bool)
    return np.where(flags.any(1), flags.argmax(1) + 1, 0)


def open_loop_ends(model, obs0, actions, done_fn) -> np.ndarray:
    """Replay a real episode's actions open loop in each elite (its mean prediction, no noise) from the
    episode's first state -> (E,) the step at which the member's termination function first fires
    (1-based), 0 where it never does within the episode's length."""
    elites = model.elites
    rows = jnp.arange(elites.shape[0])

    def one(s, a):
        mean, _ = dynamics_lib.predict(model, s, jnp.broadcast_to(a, (s.shape[0], a.shape[0])))
        s = s + mean[elites, rows, : model.obs_dim]
        return s, done_fn(s)

    s0 = jnp.broadcast_to(jnp.asarray(obs0, jnp.float32), (elites.shape[0], obs0.shape[-1]))
    _, done = jax.lax.scan(one, s0, jnp.asarray(actions, jnp.float32))
    return first_true(np.asarray(done).T)


def _one_step(model, obs, action, reward, next_obs, done_fn) -> dict:
    """Per transition: the elites' mean one-step squared error in the state (mean over dimensions) and the
    reward, the epistemic uncertainty (``dynamics.epistemic_uncertainty``), and the fraction of elites
    whose predicted next state is terminal."""
    elite, pred = _elite_predictions(model, obs, action)  # (E, T, O + 1), (E, T, O)
    obs, action = jnp.asarray(obs, jnp.float32), jnp.asarray(action, jnp.float32)
    return {
        "state_mse": ((pred - np.asarray(next_obs)[None]) ** 2).mean(-1).mean(0),
        "reward_mse": ((elite[..., model.obs_dim] - np.asarray(reward)[None]) ** 2).mean(0),
        "uncertainty": np.asarray(dynamics_lib.epistemic_uncertainty(model, obs, action)),
        "done_fraction": np.asarray(done_fn(jnp.asarray(pred))).mean(0),
    }


def imagination_stats(stats, tape) -> dict:
    """One collection's ``imagination.imagine`` stats -> horizons (mean, p10, p50, p90, max), the imagined
    reward per step and return, and the fractions ended by termination, uncertainty and t = max."""
    h = np.asarray(stats["horizon"])
    imagined = np.asarray(tape.valid) & ~np.asarray(tape.real)
    rewards = float(np.where(imagined, np.asarray(tape.reward), 0.0).sum())
    out = {"horizon_mean": float(h.mean()), "horizon_max": int(h.max())}
    out.update({f"horizon_p{q}": float(np.percentile(h, q)) for q in (10, 50, 90)})
    out.update(
        reward_per_step=rewards / max(int(imagined.sum()), 1),
        imagined_return=float(np.asarray(stats["imagined_return"]).mean()),
        **{k: float(np.asarray(stats[k]).mean()) for k in ("ended_terminated", "ended_uncertainty", "ended_horizon")},
    )
    return out


def diagnose_posterior(run: dict, episodes: int, samples: int, seed: int) -> dict:
    """Why a NeuBay-style run (a recurrent agent on a world-model posterior) does or does not transfer
    to the real env, per seed of its last checkpoint:

    - **imagination** with the deterministic actor from the dataset's start states (an evaluation
      episode as the posterior sees it: compare its return and length with the real ones) and with
      the stochastic actor from real prefixes (the training collections): horizons, reward per
      imagined step, and how the trajectories ended;
    - **the real episodes** (deterministic, with memory): return, length, reward per step; the
      critics' mean Q(h_t, a_t) over heads against the discounted return that followed (a lower
      bound where the episode hit the time limit); along the episode the posterior's one-step error
      and epistemic uncertainty against the same on dataset rows and the truncation threshold
      (the policy's states off the data, with the cut not firing, is where it exploits the model);
      the fraction of elites that predict the real terminal step; and the episode's actions
      replayed open loop in each elite (how long the model keeps the real policy up).
    """
    cfg, dataset, world, agent = run["cfg"], run["dataset"], run["aux"], run["agent"]
    model, a = world.model, cfg.agent
    done_fn = termination.termination_fn(run["env_id"])
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(dataset), min(samples, len(dataset)), replace=False)
    real = jax.tree.map(lambda x: np.asarray(x)[idx], dataset.transitions(unit_actions=True))
    on_data = _one_step(model, real.obs, real.action, real.reward, real.next_obs, done_fn)
    data_mse = float(np.median(on_data["state_mse"]))
    out = {
        "run_dir": str(run["run_dir"]),
        "step": run["step"],
        "env_id": run["env_id"],
        "kind": "posterior",
        "threshold": float(world.threshold),
        "elites": int(model.elites.shape[0]),
        "model_on_data": {
            "state_mse_median": data_mse,
            "reward_mse_median": float(np.median(on_data["reward_mse"])),
            "uncertainty_median": float(np.median(on_data["uncertainty"])),
            "uncertainty_max": float(on_data["uncertainty"].max()),
        },
        "seeds": [],
    }
    for j in range(cfg.seeds):
        state = jax.tree.map(lambda x: x[j], run["state"])
        key = jax.random.fold_in(jax.random.key(seed), j)
        row = {"seed": j, "imagination": {}}
        for name, from_start, explore in (
            ("from_start_deterministic", True, False),
            ("from_prefix_stochastic", False, True),
        ):
            key, k = jax.random.split(key)
            imagine = jax.jit(
                lambda k, fs=from_start, ex=explore: imagination.imagine(
                    model,
                    world.histories,
                    agent.rollout_policy(state, ex),
                    agent.initial_memory(state, a.rollout_batch),
                    k,
                    batch=a.rollout_batch,
                    max_horizon=a.max_horizon,
                    threshold=world.threshold,
                    done_fn=done_fn,
                    from_start=fs,
                )
            )
            tape, stats = imagine(k)
            row["imagination"][name] = imagination_stats(stats, tape)
        row["episodes"] = []
        values = jax.jit(lambda o, ac, r: agent.history_values(state, o, ac, r))
        for obs, action, reward, next_obs, terminated in _real_episodes(
            _SeedPolicy(agent, run["state"], j), run["env_id"], episodes, seed * 1000 + 10_000 + 100 * j
        ):
            n = len(reward)
            ends = np.zeros(n, bool)
            ends[-1] = True
            g = returns_to_go(reward, ends, a.gamma)
            q = np.asarray(values(obs, action, reward))  # (N, T)
            m = _one_step(model, obs, action, reward, next_obs, done_fn)
            replay = open_loop_ends(model, obs[0], action, done_fn)
            ep = {
                "return": float(reward.sum()),
                "length": n,
                "terminated": bool(terminated[-1]),
                "reward_per_step": float(reward.mean()),
                "q_first": float(q[:, 0].mean()),
                "return_to_go_first": float(g[0]),
                "q_minus_return_to_go": float((q.mean(0) - g).mean()),
                "q_std": float(q.std(0).mean()),
                "state_mse_median": float(np.median(m["state_mse"])),
                "state_mse_over_data": float(np.median(m["state_mse"]) / max(data_mse, 1e-12)),
                "uncertainty_median": float(np.median(m["uncertainty"])),
                "uncertainty_max": float(m["uncertainty"].max()),
                "steps_over_threshold": int((m["uncertainty"] > float(world.threshold)).sum()),
                "open_loop_ended": float((replay > 0).mean()),
                "open_loop_end_median": float(np.median(replay[replay > 0])) if (replay > 0).any() else None,
            }
            if terminated[-1]:
                ep["elites_predicting_the_fall"] = float(m["done_fraction"][-1])
            row["episodes"].append(ep)
        out["seeds"].append(row)
    return out


def _report_posterior(d: dict) -> list[str]:
    m = d["model_on_data"]
    lines = [
        f"{d['run_dir']} at update {d['step']} ({d['env_id']}): world-model posterior of {d['elites']} elites; "
        f"on dataset rows one-step state MSE {m['state_mse_median']:.3g} (median), reward MSE "
        f"{m['reward_mse_median']:.3g}, uncertainty {m['uncertainty_median']:.3g} (median), max "
        f"{m['uncertainty_max']:.3g}; truncation threshold {d['threshold']:.3g}"
    ]
    for s in d["seeds"]:
        lines.append(f"  seed {s['seed']}:")
        for name, i in s["imagination"].items():
            lines.append(
                f"    imagined, {name.replace('_', ' ')}: horizon {i['horizon_mean']:.1f} "
                f"(p10 {i['horizon_p10']:.0f}, p50 {i['horizon_p50']:.0f}, p90 {i['horizon_p90']:.0f}, "
                f"max {i['horizon_max']}), return {i['imagined_return']:.1f}, reward per step "
                f"{i['reward_per_step']:.2f}; ended by termination {i['ended_terminated']:.0%}, "
                f"uncertainty {i['ended_uncertainty']:.0%}, horizon {i['ended_horizon']:.0%}"
            )
        for e in s["episodes"]:
            text = (
                f"    real episode: return {e['return']:.1f}, length {e['length']}, reward per step "
                f"{e['reward_per_step']:.2f}; Q first {e['q_first']:.1f} against the return-to-go "
                f"{e['return_to_go_first']:.1f} (mean Q - return-to-go {e['q_minus_return_to_go']:+.1f}, "
                f"head spread {e['q_std']:.2f}); one-step state MSE {e['state_mse_median']:.3g} "
                f"({e['state_mse_over_data']:.1f}x the data's), uncertainty {e['uncertainty_median']:.3g} median, "
                f"max {e['uncertainty_max']:.3g}, {e['steps_over_threshold']} steps over the threshold"
            )
            if "elites_predicting_the_fall" in e:
                text += f"; {e['elites_predicting_the_fall']:.0%} of elites predict the fall"
            end = "" if e["open_loop_end_median"] is None else f", at step {e['open_loop_end_median']:.0f} (median)"
            text += f"; its actions open loop: {e['open_loop_ended']:.0%} of elites end the episode{end}"
            lines.append(text)
    return lines


def report(d: dict) -> str:
    """A short human-readable summary of ``diagnose``'s output."""
    if d.get("kind") == "posterior":
        return "\n".join(_report_posterior(d))
    lines = [
        f"{d['run_dir']} at update {d['step']} ({d['env_id']}): dataset discounted return-to-go "
        f"{d['mc_return']:.1f}; a dataset state's distance to the nearest state of another episode "
        f"{d['data_distance']:.2f} (median)"
    ]
    if "model_on_data" in d:
        m = d["model_on_data"]
        lines.append(
            f"  dynamics on dataset rows: one-step error {m['model_error']:.4f}, elite spread {m['model_spread']:.4f}"
        )
    for s in d["seeds"]:
        lines.append(
            f"  seed {s['seed']}: min-Q (critic spread) at data actions {s['data_actions']['q_min']:.1f} "
            f"({s['data_actions']['q_std']:.2f}), policy {s['policy_actions']['q_min']:.1f} "
            f"({s['policy_actions']['q_std']:.2f}), random {s['random_actions']['q_min']:.1f} "
            f"({s['random_actions']['q_std']:.2f})"
        )
        drift = f"value drift per step: dataset rows {s['drift_real']:+.2f}"
        if "drift_model" in s:
            drift += f", model rows {s['drift_model']:+.2f}"
        lines.append("    " + drift)
        for e in s["episodes"]:
            text = (
                f"    real episode: return {e['return']:.1f}, length {e['length']}, min-Q first {e['q_min_first']:.1f} "
                f"max {e['q_min_max']:.1f} at step {e['q_min_max_at']}, last {e['q_min_last']:.1f} "
                f"(spread {e['q_std']:.2f})"
            )
            text += (
                f"; distance to the data first {e['data_distance_first']:.2f} max {e['data_distance_max']:.2f} "
                f"last {e['data_distance_last']:.2f}"
            )
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
