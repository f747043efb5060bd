"""D4RL normalised scores (D4RL, Fu et al. 2020, arXiv 2004.07219, Sec. 5).

``normalized_score`` is 100 * (R - min) / (max - min) against D4RL's reference returns (``D4RL_REF``,
for halfcheetah, hopper and walker2d) or a dataset's own ``ref_min_score`` / ``ref_max_score``;
``d4rl_name`` and ``gymnasium_id`` map between Gymnasium ids, D4RL names and Minari ids.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

# D4RL's REF_MIN_SCORE / REF_MAX_SCORE (d4rl/infos.py; the same for every dataset type, v0-v2).
D4RL_REF = {"halfcheetah": (-280.178953, 12135.0), "hopper": (-20.272305, 3234.3), "walker2d": (1.629008, 4592.3)}


def gymnasium_id(name: str) -> str:
    """'hopper' / 'hopper-medium-v2' -> 'Hopper-v5'; Gymnasium ids pass through."""
    short = d4rl_name(name)
    ids = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}
    if short in ids and name.lower().startswith(short):
        return ids[short]
    return name


def d4rl_name(env_id) -> Optional[str]:
    """'halfcheetah' / 'hopper' / 'walker2d' for Gymnasium ids (Hopper-v5), D4RL names (hopper-medium-v2)
    or Minari ids (mujoco/hopper/medium-v0); None otherwise (Control Suite and ns: ids included)."""
    if not isinstance(env_id, str) or ":" in env_id:
        return None
    for part in env_id.split("/"):
        head = re.split(r"[-_]", part.strip().lower())[0]
        if head in D4RL_REF:
            return head
    return None


def normalized_score(returns, env_id=None, metadata=None, reference: str = "d4rl"):
    """100 * (R - min) / (max - min)  (D4RL, Fu et al. 2020).

    ``reference="d4rl"``: D4RL's constants for ``env_id`` (or ``metadata['env_id']``);
    ``"dataset"``: the dataset's own ``ref_min_score`` / ``ref_max_score`` (uniform-random and
    expert means over 100 episodes, as Minari's ``get_average_reference_score``).  ``returns``: a
    number or an array.  A missing reference (absent, None or NaN, e.g. a random-only dataset made
    without a SAC run: ``ref_max_source`` "missing") raises a ValueError rather than giving NaN.
    """
    metadata = metadata or {}
    if reference == "d4rl":
        env = env_id if env_id is not None else metadata.get("env_id")
        name = d4rl_name(env)
        if name is None:
            raise ValueError(
                f"no D4RL reference scores for env {env!r}: D4RL has them for "
                f"{', '.join(D4RL_REF)} only; use reference='dataset'"
            )
        lo, hi = D4RL_REF[name]
    elif reference == "dataset":
        if "ref_min_score" not in metadata or "ref_max_score" not in metadata:
            raise ValueError(
                "reference='dataset' needs metadata ref_min_score and ref_max_score "
                f"(this metadata has: {', '.join(sorted(metadata)) or 'nothing'})"
            )
        refs = {k: metadata[k] for k in ("ref_min_score", "ref_max_score")}
        missing = [k for k, v in refs.items() if v is None or not np.isfinite(np.asarray(v, np.float64))]
        if missing:
            sources = ", ".join(f"{k} = {metadata[k]!r}" for k in ("ref_min_source", "ref_max_source") if k in metadata)
            raise ValueError(
                f"the dataset has no usable {' / '.join(missing)} "
                f"({', '.join(f'{k} = {refs[k]!r}' for k in missing)}{'; ' + sources if sources else ''}): "
                "normalised scores against the dataset's references are unavailable"
                + ("; use reference='d4rl'" if d4rl_name(env_id or metadata.get("env_id")) else "")
            )
        lo, hi = float(refs["ref_min_score"]), float(refs["ref_max_score"])
        if hi == lo:
            raise ValueError(f"ref_max_score equals ref_min_score ({hi}); the normalised score is undefined")
    else:
        raise ValueError(f"unknown reference {reference!r}; use 'd4rl' or 'dataset'")
    r = np.asarray(returns, np.float64)
    out = 100.0 * (r - lo) / (hi - lo)
    return float(out) if out.ndim == 0 else out
