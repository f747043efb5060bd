"""LEAST early episode termination (Liu et al., ICML 2025, arXiv 2506.13672).

No reference code is public; the rule is our reconstruction from secondary summaries of the paper
(check it against the paper's Algorithm 1):

  keep B_Q, B_G in R^{K x L}: the online Q(s_i, a_i) and the critic's TD loss at each step i of
  the last K episodes;  at step i (after a warm-up):
      eps_i   = median(B_Q[:, i])                  (threshold; the median beats the mean)
      omega_i = median(B_G[:, i]) / G_i            (G_i: the current TD loss)
      stop if Q_i < c omega_i * eps_i   (eps_i >= 0)   or   Q_i < eps_i / (c omega_i)   (eps_i < 0)

c is the "omega coefficient" of the paper's settings (works in 0.3-0.6; its role is inferred, the
summaries do not fix it): we read it as scaling the weight, which makes the rule lenient; with
c = 1 it stops about half of all episodes at every step (Q below its running median), which cannot
be the paper's behaviour.

An early stop is a truncation, not a termination: the transition is stored with
``truncated=True`` and bootstraps.  The paper's optional exploration-noise increase is
``LEAST.noise`` (for agents with an explicit exploration noise, e.g. MR.Q; SAC explores through its
entropy term and refuses it).  Not implemented: the entropy-aware window growth (the secondary
descriptions of it are too vague to rebuild).
Off-policy agents only: the agent provides ``least_signals(state, transition, key) -> (q, td_loss)``.
"""

from __future__ import annotations

import numpy as np


def should_stop(q: float, g: float, q_hist: np.ndarray, g_hist: np.ndarray, coef: float = 0.5) -> bool:
    """The stop rule at one step given the history column (past episodes' values at this step)."""
    q_hist = q_hist[~np.isnan(q_hist)]
    g_hist = g_hist[~np.isnan(g_hist)]
    if q_hist.size == 0 or g_hist.size == 0 or not np.isfinite(q) or not np.isfinite(g) or g <= 0:
        return False
    eps = float(np.median(q_hist))
    omega = coef * float(np.median(g_hist)) / g
    if omega <= 0:
        return False
    return q < omega * eps if eps >= 0 else q < eps / omega


class History:
    """B_Q and B_G of one agent (seed): the last ``window`` episodes, NaN-padded to ``max_len``."""

    def __init__(self, window: int, max_len: int):
        self.q = np.full((window, max_len), np.nan)
        self.g = np.full((window, max_len), np.nan)
        self.count = 0

    def column(self, i: int):
        if i >= self.q.shape[1]:
            return np.empty(0), np.empty(0)
        return self.q[:, i], self.g[:, i]

    def push(self, q_episode, g_episode):
        row = self.count % self.q.shape[0]
        n = min(len(q_episode), self.q.shape[1])
        self.q[row] = np.nan
        self.g[row] = np.nan
        self.q[row, :n] = q_episode[:n]
        self.g[row, :n] = g_episode[:n]
        self.count += 1


class LEAST:
    """Per-env episode buffers and per-seed histories; ``decide`` returns which envs to stop."""

    def __init__(
        self,
        seeds: int,
        envs_per_seed: int,
        window: int = 250,
        max_len: int = 1000,
        warmup_steps: int = 0,
        min_episodes: int = 5,
        coef: float = 0.5,
    ):
        self.envs_per_seed = envs_per_seed
        self.histories = [History(window, max_len) for _ in range(seeds)]
        self.current = [([], []) for _ in range(seeds * envs_per_seed)]
        # an env joins at its first episode boundary, so step indices always count from episode start
        self.aligned = np.zeros(seeds * envs_per_seed, bool)
        self.warmup_steps, self.min_episodes, self.coef = warmup_steps, min_episodes, coef
        self.stops = 0
        self.ended: list[list[bool]] = [[] for _ in range(seeds)]  # per seed: was each episode stopped early

    def noise(self, base: float, high: float, recent: int = 20, slope: float = 10.0) -> np.ndarray:
        """Per-seed exploration sigma rising from ``base`` toward ``high`` as more of the last ``recent``
        episodes were stopped early: base + (high - base) * sigmoid(slope * (p - 0.5)) (the shape is our
        reading; the paper's summaries do not fix it)."""
        p = np.array([np.mean(e[-recent:]) if e else 0.0 for e in self.ended])
        return base + (high - base) / (1.0 + np.exp(-slope * (p - 0.5)))

    def decide(self, step: int, q: np.ndarray, g: np.ndarray, done: np.ndarray) -> np.ndarray:
        """Record this step's signals; return a bool mask of envs LEAST stops (ended episodes excluded)."""
        stop = np.zeros(len(self.current), bool)
        for i, (qs, gs) in enumerate(self.current):
            if not self.aligned[i]:
                self.aligned[i] = bool(done[i])
                continue
            qs.append(float(q[i]))
            gs.append(float(g[i]))
            hist = self.histories[i // self.envs_per_seed]
            if not done[i] and step >= self.warmup_steps and hist.count >= self.min_episodes:
                stop[i] = should_stop(qs[-1], gs[-1], *hist.column(len(qs) - 1), coef=self.coef)
            if done[i] or stop[i]:
                hist.push(np.asarray(qs), np.asarray(gs))
                self.ended[i // self.envs_per_seed].append(bool(stop[i]))
                self.current[i] = ([], [])
        self.stops += int(stop.sum())
        return stop
