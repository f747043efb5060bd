"""Entry point shared by scripts/train.py: pick the loop for the agent, set up the run dir."""
from __future__ import annotations

import json
from pathlib import Path

import agents
from training import config as config_lib
from training.config import RunConfig


def load_config(run_dir) -> RunConfig:
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise SystemExit(f"--resume {run_dir}: {path} not found (is this a run directory?)")
    d = json.loads(path.read_text())
    agent = agents.get(d["agent_name"])
    return config_lib.from_json(d, agent.CONFIG)


def run(cfg: RunConfig, stop_at: int | None = None) -> dict:
    agent = agents.get(cfg.agent_name)
    if cfg.resume:
        run_dir, resume = Path(cfg.resume), True
    else:
        from training.loop import default_run_dir

        run_dir, resume = (Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)), False
        if (run_dir / "ckpt").exists():
            raise SystemExit(f"run directory {run_dir} already holds a run; use --resume {run_dir} to continue it")
    if agent.KIND == "offpolicy":
        from training.offpolicy import train
    elif agent.KIND == "onpolicy":
        from training.onpolicy import train
    elif agent.KIND == "offline":
        from training.offline import train
    else:
        raise ValueError(f"agent {cfg.agent_name!r} has unknown kind {agent.KIND!r}")
    print(f"run directory: {run_dir}")
    return train(cfg, agent, run_dir, resume=resume, stop_at=stop_at)
