"""A run's policy alone, in the env's units: export it to one ``.npz`` file, load it, act.

    from plasticity_zoo.analysis.export import export_policy, load_policy

    export_policy("runs/<dir>", "policy.npz", seed=0)   # or: python scripts/export.py runs/<dir> --out policy.npz
    pi = load_policy("policy.npz")
    action = pi(obs)          # one observation -> one action in the env's units; (n, obs_dim) -> (n, act_dim)

The file holds the arrays the agent's deterministic action reads (``POLICY_FIELDS``: the actor's
parameters, with an encoder or the observation normaliser's statistics where the agent acts through
them), each named by its path in the agent state (``checkpoint.array_names``: e.g.
``actor_params/trunk/layers/0/kernel/value``), the env's action bounds (``bounds/low``,
``bounds/high``) and ``meta`` (JSON: the agent, its config and network config, observation and
action sizes, the env id, action repeat and action mode, the step and seed it came from).  No
optimizer state, replay or host state.  ``load_policy`` rebuilds the agent's networks from the zoo's
code (``agent.init`` traced abstractly: nothing is initialised) and acts with the agent's own
``act(explore=False)`` on arrays shaped as the run's evaluation shapes them (``SeedPolicy``, over one
seed where the run's program vmaps over all its seeds), so its actions are the run's evaluation's
actions (``RestoredRun.policy``; bit for bit in ``tests/test_export.py``, on CPU), mapped onto the env's
Box as the env does (``EnvActions``: ``rescale``: low + (a + 1) / 2 (high - low) of the action clipped to
[-1, 1]; ``clip``: the action clipped to [low, high]).

``RestoredRun.env_policy(seed)`` (``training/evaluation.py``) is the same policy straight from a
checkpoint.  Recurrent (``neubay``) and multitask (``mrq-mt``) agents are not exported
(``UNSUPPORTED`` says why), nor ``mt:`` / ``playground:`` envs (no single Gymnasium Box to map onto).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from plasticity_zoo.analysis.restore import (
    EnvActions,
    EnvPolicy,
    env_actions,  # noqa: F401
    env_units_supported,
    run_env,
)
from plasticity_zoo.training import checkpoint
from plasticity_zoo.training.evaluation import SeedPolicy, eval_block

FORMAT = 1
KIND = "plasticity_zoo.policy"
# agent name -> the state fields its deterministic ``act`` reads (the rest of the state is zeros when loaded)
POLICY_FIELDS = {
    "sac": ("actor_params",),
    "ravl": ("actor_params",),  # SAC-N / EDAC: sac.act
    "ppo": ("actor_params", "obs_rms"),  # the observation normaliser's statistics (--norm-obs)
    "mrq": ("encoder_params", "policy_params"),  # pi(f(s))
}
UNSUPPORTED = {
    "neubay": "its policy is recurrent (it acts from the episode's history: a memory, the previous action "
    "and reward), which an exported observation -> action function does not carry",
    "mrq-mt": "its policy is conditioned on the task of a multitask (mt:) env, which has no single action Box",
}


def check_exportable(agent_name: str, env_id: str | None = None):
    """ValueError naming the agent (or env) and why, unless a policy of ``agent_name`` on ``env_id``
    can be exported and act in env units."""
    if agent_name in UNSUPPORTED:
        raise ValueError(f"agent {agent_name!r} cannot be exported: {UNSUPPORTED[agent_name]}")
    if agent_name not in POLICY_FIELDS:
        raise ValueError(
            f"agent {agent_name!r} cannot be exported (exportable agents: {', '.join(sorted(POLICY_FIELDS))})"
        )
    if env_id is not None:
        env_units_supported(env_id)


# ----------------------------------------------------------------------------------------------
# Export and load
# ----------------------------------------------------------------------------------------------
def policy_arrays(agent_name: str, state) -> dict:
    """{name: array} of the fields of one seed's agent ``state`` its deterministic action reads, each
    named ``<field>/<path>`` (``checkpoint.array_names``)."""
    tree = {field: getattr(state, field) for field in POLICY_FIELDS[agent_name]}
    return {name: np.asarray(x) for name, x in zip(checkpoint.array_names(tree), jax.tree.leaves(tree))}


def export_policy(run_dir, out, step: int | None = None, seed: int = 0, warn=None) -> Path:
    """Write the policy of seed index ``seed`` of run ``run_dir`` at its newest intact checkpoint (or
    ``step``) to ``out`` (a ``.npz``, written whole or not at all); returns its path (``read_meta``
    describes it).  SystemExit (a message) for a directory that is no run, a missing checkpoint or
    step, a seed out of range or an output inside the run's checkpoints; ValueError for an agent or
    env that cannot be exported."""
    from plasticity_zoo.analysis.restore import restore_policy, run_env_id
    from plasticity_zoo.training.config import to_json
    from plasticity_zoo.training.loops import eval_action_mode
    from plasticity_zoo.training.run import load_config

    run_dir, out = Path(run_dir), Path(out)
    if out.suffix != ".npz":
        raise SystemExit(f"--out {out}: the policy is written as a .npz file; name it <something>.npz")
    if run_dir.is_dir() and (run_dir / "config.json").is_file():  # before restoring: the cheap refusals first
        cfg = load_config(run_dir)
        check_exportable(cfg.agent_name, run_env_id(run_dir, cfg))
        if not 0 <= seed < cfg.seeds:
            raise SystemExit(f"--seed {seed}: the run has {cfg.seeds} seed(s), indices 0..{cfg.seeds - 1}")
        ckpt = (run_dir / "ckpt").resolve()
        if out.resolve() == ckpt or ckpt in out.resolve().parents:
            raise SystemExit(f"--out {out}: inside the run's checkpoint folder {run_dir / 'ckpt'}; choose another path")
    restored = restore_policy(run_dir, step, warn=warn)
    cfg, agent = restored.cfg, restored.agent
    env = run_env(cfg, agent, restored.env_id)
    actions = env.actions
    state = jax.tree.map(lambda x: x[seed], restored.state)
    arrays = policy_arrays(cfg.agent_name, state)
    full, fields = to_json(cfg), POLICY_FIELDS[cfg.agent_name]
    meta = {
        "format": FORMAT,
        "kind": KIND,
        "agent": cfg.agent_name,
        "agent_config": full["agent"],
        "network": full["network"],
        "obs_dim": env.obs_dim,
        "act_dim": env.act_dim,
        "action_shape": list(np.shape(actions.low)),
        "env": restored.env_id,
        "action_repeat": env.action_repeat,
        "action_mode": eval_action_mode(cfg, agent),
        "action_dtype": actions.dtype.name,
        "obs_normalization": "obs_rms" in fields and bool(getattr(cfg.agent, "norm_obs", False)),
        "fields": list(fields),
        "arrays": list(arrays),
        "eval_block": eval_block(cfg),
        "step": restored.step,
        "seed": seed,
        "checkpoint": restored.path.name,
        # plasticity injection builds the networks with residual heads: the loader builds them alike
        "injection_layers": cfg.plasticity.injection_layers if cfg.plasticity.injects else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    members = {
        **{f"params/{k}": v for k, v in arrays.items()},
        "bounds/low": actions.low,
        "bounds/high": actions.high,
        "meta": np.asarray(json.dumps(meta, indent=1, sort_keys=True)),
    }
    tmp = out.with_name(f".tmp_{out.name}")
    try:
        checkpoint.write_npz(tmp, members)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _read(path) -> tuple[dict, dict]:
    """(meta, the other arrays) of an exported policy file; ValueError for a file that is none."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            stored = {k: z[k] for k in z.files}
        meta = json.loads(str(stored.pop("meta")))
        fmt = int(meta.get("format", 0)) if isinstance(meta, dict) else 0
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not an exported policy ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict) or meta.get("kind") != KIND or not 1 <= fmt <= FORMAT:
        raise ValueError(
            f"{path}: not an exported policy of format {FORMAT} (kind "
            f"{meta.get('kind') if isinstance(meta, dict) else None!r})"
        )
    return meta, stored


def read_meta(path) -> dict:
    """The description an exported policy file carries (agent, env, step, seed, sizes, array names, ...)."""
    return _read(path)[0]


class Policy(EnvPolicy):
    """An exported policy (``load_policy``): ``policy(obs)`` -> action in env units (see ``EnvPolicy``);
    ``meta`` the file's description (``env``, ``action_repeat``, ``agent``, ``step``, ``seed``, ...),
    ``state`` the agent state rebuilt around the exported arrays (its other leaves are zeros)."""

    def __init__(self, meta: dict, agent, state, actions: EnvActions):
        self.meta, self.agent, self.state = meta, agent, state
        stacked = jax.tree.map(lambda x: x[None], state)  # one seed, as SeedPolicy takes a vmapped state
        super().__init__(
            SeedPolicy(agent, stacked, [0], block=int(meta["eval_block"])),
            meta["obs_dim"],
            actions,
            meta["action_shape"],
        )

    @property
    def env_id(self) -> str:
        return self.meta["env"]

    @property
    def action_repeat(self) -> int:
        return int(self.meta["action_repeat"])


def load_policy(path) -> Policy:
    """The policy exported to ``path`` (``export_policy``), ready to act; ValueError for a file that
    is not one or does not fit this version of the zoo's networks (naming the first differing path)."""
    from plasticity_zoo import agents
    from plasticity_zoo.networks.config import NetworkConfig
    from plasticity_zoo.plasticity.api import StaticPlasticity
    from plasticity_zoo.plasticity.injection import InjectionSpec

    path = Path(path)
    meta, stored = _read(path)
    name = meta["agent"]
    check_exportable(name)
    agent = agents.get(name)
    agent_cfg = agent.CONFIG(**meta["agent_config"])
    network = NetworkConfig(**meta["network"])
    obs_dim, act_dim = int(meta["obs_dim"]), int(meta["act_dim"])
    layers = meta.get("injection_layers")  # files written before injection existed have no such key
    static = StaticPlasticity(injection=None if layers is None else InjectionSpec(int(layers)))
    abstract = jax.eval_shape(lambda: agent.init(jax.random.key(0), obs_dim, act_dim, agent_cfg, network, static))
    params = {k.removeprefix("params/"): v for k, v in stored.items() if k.startswith("params/")}
    state = fill_state(abstract, POLICY_FIELDS[name], params, str(path))
    actions = EnvActions(stored["bounds/low"], stored["bounds/high"], meta["action_mode"], meta["action_dtype"])
    return Policy(meta, agent, state, actions)


def fill_state(abstract, fields, arrays: dict, where: str):
    """An agent state shaped as ``abstract`` (``jax.eval_shape`` of ``init``) with ``fields`` taken
    from ``arrays`` (named as ``policy_arrays`` names them, shapes and dtypes checked) and zeros elsewhere."""
    tree = {field: getattr(abstract, field) for field in fields}
    names = checkpoint.array_names(tree)
    missing = [n for n in names if n not in arrays]
    unknown = [n for n in arrays if n not in set(names)]
    if missing or unknown:
        raise ValueError(
            f"{where}: the exported arrays do not fit this agent's networks: "
            + "; ".join(
                ([f"no array {missing[0]}"] if missing else [])
                + ([f"array {unknown[0]} has no place"] if unknown else [])
            )
        )
    leaves, treedef = jax.tree.flatten(tree)
    filled = []
    for name, ref in zip(names, leaves):
        x = arrays[name]
        if x.shape != ref.shape or x.dtype != ref.dtype:
            raise ValueError(
                f"{where}: array {name} is {x.dtype}{x.shape}, this agent's networks expect {ref.dtype}{ref.shape}"
            )
        filled.append(x)
    own = jax.tree.unflatten(treedef, filled)

    def zeros(leaf):  # numpy where it can: no device program per shape
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jnp.zeros(leaf.shape, leaf.dtype)
        return np.zeros(leaf.shape, leaf.dtype)

    return jax.tree.map(zeros, abstract).replace(**own)
