"""The zoo from Python, start to finish: train, extend, restore, act in the env's units, export, plot, report.

    .venv/bin/python docs/tutorial.py                 # about 5 minutes on 2 CPU cores: SAC swings Pendulum up
    RLZOO_TUTORIAL_STEPS=400 .venv/bin/python docs/tutorial.py   # a smoke run (the test suite runs this)

Each step is one call of the Python API (docs/python-api.md); the same runs could come from
``scripts/train.py``, and every file written here is read by the command-line tools too.
"""

import os
import tempfile
from pathlib import Path

import gymnasium as gym
import numpy as np

import plasticity_zoo as pz

STEPS = int(os.environ.get("RLZOO_TUTORIAL_STEPS", 12_000))  # env steps per seed
OUT = Path(os.environ.get("RLZOO_TUTORIAL_DIR") or tempfile.mkdtemp(prefix="zoo-tutorial-"))
SMALL = {"width": 64}  # a small backbone for a CPU; the paper's SAC is 256 x 2

# 1. Train SAC with two vmapped seeds, and the same run with ReDo resets: keywords are train.py's flags.
common = dict(
    env="Pendulum-v1",
    seeds=2,
    learning_starts=min(1000, STEPS // 4),
    eval_every=max(STEPS // 4, 100),
    eval_episodes=3,
    network=SMALL,
    progress=False,
)
base = pz.train("sac", total_steps=STEPS // 2, run_dir=str(OUT / "sac"), **common)
redo = pz.train(
    "sac",
    total_steps=STEPS,
    run_dir=str(OUT / "sac-redo"),
    label="sac+redo",
    plasticity={"redo": True, "reset_every": max(STEPS // 8, 50)},
    **common,
)
print(f"SAC: step {base.step}, last evaluation {base.last_eval:.1f}")

# 2. Extend the first run to the full budget: it resumes bit for bit from its checkpoint.
base = pz.resume(base.run_dir, total_steps=STEPS)
print(f"SAC resumed: step {base.step}, last evaluation {base.last_eval:.1f}")

# 3. Restore the run and act: the policy takes one raw observation and returns a torque in [-2, 2].
policy = base.policy(seed=0)
env = gym.make("Pendulum-v1")
obs, _ = env.reset(seed=0)
episode_return = 0.0
for _ in range(200):
    action = policy(obs)
    assert env.action_space.contains(np.asarray(action, np.float32)), action
    obs, reward, terminated, truncated, _ = env.step(action)
    episode_return += float(reward)
    if terminated or truncated:
        break
print(f"one episode with the restored policy: return {episode_return:.1f}")

# 4. Export the policy alone (parameters and what acting needs) and load it back without the training state.
exported = pz.export_policy(base.run_dir, OUT / "policy.npz", seed=0)
loaded = pz.load_policy(exported)
probe = env.observation_space.sample()
assert np.allclose(loaded(probe), policy(probe), atol=1e-6)
print(f"exported {exported} ({exported.stat().st_size / 1e3:.0f} kB); it acts as the restored policy")

# 5. Learning curves (mean and 95% bootstrap interval over seeds) and a report over both runs.
figure = pz.plot.learning_curves([base.run_dir, redo.run_dir])
figure.savefig(OUT / "curves.png")
report = pz.report.write_report([base.run_dir, redo.run_dir], OUT / "report", norm={"Pendulum-v1": (-1600.0, 0.0)})
print(f"wrote {OUT / 'curves.png'}; {report['summary']}")
