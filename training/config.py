"""Typed run configuration shared by every agent (parsed by tyro in scripts/train.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from plasticity_zoo.networks.config import NetworkConfig
from plasticity_zoo.plasticity.config import PlasticityConfig


@dataclass
class RunConfig:
    """What to train, for how long, and where the run goes."""

    env: str = "Pendulum-v1"
    """env id: a Gymnasium id (HalfCheetah-v5), dmc:<domain>-<task>, playground:<Name> (extra .[mjx]), a multitask set
    mt:<suite> or mt:<id>,<id>,..., a non-stationary env ns:<mode>:<env id>[:<key>=<value>,...] (modes chain, dynamics,
    obs_permute, reward_flip), or <module>:<id> (an env the module registers with Gymnasium on import)"""
    seeds: int = 1
    """independent agents trained in one process (vmapped), each with its own envs"""
    seed: int = 0
    """base seed; seed index j uses seed + j"""
    total_steps: int = 100_000
    """env steps per seed (agent steps: DMC action repeat is not counted)"""
    num_envs: int = 1
    """envs per seed"""
    action_repeat: Optional[int] = None
    """None: 2 for dmc:, 1 for Gymnasium and playground:"""
    env_impl: Literal["jax", "warp"] = "jax"
    """playground: physics backend: jax (MJX; CPU or GPU) or warp (MuJoCo Warp; GPU only)"""
    loop: Literal["auto", "host", "device"] = "auto"
    """auto: the device loop (chunks of the run jitted whole, envs on the accelerator) for playground: envs
    with PPO, SAC or MR.Q, the host loop otherwise; host: step envs from Python; device: require the device loop"""
    device_chunk: int = 0
    """device loop: at most this many iterations per jitted call (0: run to the next log, evaluation,
    checkpoint or plasticity event)"""
    eval_every: int = 5_000
    eval_episodes: int = 10
    log_every: int = 1_000
    checkpoint_every: int = 50_000
    keep_checkpoints: int = 2
    """checkpoints kept in run_dir/ckpt (the newest N; 2 or more lets resume fall back past a damaged one)"""
    run_dir: Optional[str] = None
    """default: runs/<env>__<agent>__<seed>__<time>"""
    resume: Optional[str] = None
    """continue the run in this directory from its last checkpoint"""
    label: Optional[str] = None
    """name for plots and reports (default: the agent name, followed by the settings in which it differs from
    the other runs plotted with it)"""
    preset: Optional[str] = None
    """the --preset names applied, comma-separated (training/presets.py); set by the command line"""
    tensorboard: bool = False
    """also write TensorBoard events (needs tensorboardX): one run per seed under run_dir/tb"""
    wandb: bool = False
    """also log to Weights & Biases (the wandb extra): one W&B run per seed, grouped, config and git commit included"""
    wandb_project: str = "plasticity-zoo"
    wandb_entity: Optional[str] = None
    wandb_group: Optional[str] = None
    """default: the run directory's name (the seeds of one run side by side)"""
    wandb_tags: tuple[str, ...] = ()
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """offline: written under run_dir/wandb, `wandb sync` uploads it later"""
    progress: bool = True
    """show a progress bar"""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    plasticity: PlasticityConfig = field(default_factory=PlasticityConfig)
    agent_name: str = "sac"
    agent: Any = None


def to_json(cfg: RunConfig) -> dict:
    d = dataclasses.asdict(cfg)
    return d


def from_json(d: dict, agent_cls) -> RunConfig:
    """The flags of a run's ``config.json`` (its ``provenance`` and ``resumes`` records left aside)."""
    d = {k: v for k, v in d.items() if k not in ("provenance", "resumes")}
    net = NetworkConfig(**d.pop("network"))
    plasticity = PlasticityConfig(**d.pop("plasticity", {}))
    agent = agent_cls(**d.pop("agent"))
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"config.json has unknown keys {sorted(unknown)}")
    return RunConfig(**d, network=net, plasticity=plasticity, agent=agent)


def dump(cfg: RunConfig) -> str:
    return json.dumps(to_json(cfg), indent=2, sort_keys=True)


def cli_type(agent_name: str, agent_cls):
    """The run-config dataclass tyro parses for one agent: agent options become top-level flags
    (nested agent options keep their own prefix, e.g. RAVL's ``--dynamics.members``)."""
    from typing import Annotated

    import tyro

    return dataclasses.make_dataclass(
        f"{agent_name.upper()}Run",
        [
            ("agent_name", tyro.conf.Suppress[str], field(default=agent_name)),
            ("preset", tyro.conf.Suppress[Optional[str]], field(default=None)),  # type: ignore[misc]  # tyro's Suppress marker
            ("agent", Annotated[agent_cls, tyro.conf.arg(name="")], field(default_factory=agent_cls)),
        ],
        bases=(RunConfig,),
    )


# What `train.py --resume` may change: none of these alters the training trajectory (the metrics
# hook only reads the state, with keys of its own; the device loop's chunking only decides where
# the host looks in), so an extended or rescued run stays exact.
RESUME_MUTABLE = {
    "total_steps",
    "progress",
    "resume",
    "run_dir",
    "tensorboard",
    "plasticity.metrics_every",
    "keep_checkpoints",
    "device_chunk",
    "wandb",
    "wandb_mode",
    "wandb_tags",
}

# What does not make a run another experiment: the seed, the run's name and label, and where it is
# written, how it is watched and how often it is measured (evaluations step envs of their own with a
# deterministic policy; logs and checkpoints only read the state), besides what --resume may change.
# Plots and reports pool the seeds of runs whose configs differ only in these
# (``analysis.aggregate.run_labels``).
NOT_THE_EXPERIMENT = RESUME_MUTABLE | {
    "seed",
    "seeds",
    "label",
    "preset",
    "eval_every",
    "eval_episodes",
    "log_every",
    "checkpoint_every",
    "wandb_project",
    "wandb_entity",
    "wandb_group",
}
