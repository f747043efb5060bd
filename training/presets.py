"""Named sets of flags from the papers: ``train.py AGENT --preset NAME`` (``--preset list`` shows them).

A preset is the command-line flags a paper's protocol or an intervention's published setting
amounts to, with its source.  It is applied before the user's own flags, so any flag given on the
command line wins over the preset's value for it; several presets apply in the order given
(``--preset mrq-dmc --preset redo-sokar``).  The run's ``config.json`` stores the resulting
values like any flag's, and the names in its ``preset`` field.

A preset names the agents it is for (``None``: any agent that takes its flags, as the
plasticity presets) and, where the protocol is for one env family, the env ids it fits.
Values below are the papers' own; where a paper leaves one open, the preset leaves it at the
zoo's default and says so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    flags: tuple[str, ...]
    source: str
    """paper and section (or table) the values come from"""
    agents: tuple[str, ...] | None = None
    """agents the preset is for; None: any agent that accepts its flags"""
    env_family: str | None = None
    """'dmc' (dmc: ids), 'gym' (Gymnasium ids), 'playground' (playground: ids) or None (any env)"""
    note: str = ""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # MR.Q's benchmark protocols: one hyperparameter set (the agent's defaults, Table 3); the
        # benchmarks differ in steps, action repeat and evaluation.
        Preset(
            "mrq-gym",
            ("--total-steps", "1000000", "--action-repeat", "1", "--eval-every", "5000", "--eval-episodes", "10"),
            "Fujimoto et al. 2025 (MR.Q, ICLR), the experimental protocol: Gymnasium MuJoCo, 1M env steps, no "
            "preprocessing, "
            "10 deterministic episodes every 5k steps",
            agents=("mrq",),
            env_family="gym",
        ),
        Preset(
            "mrq-dmc",
            ("--total-steps", "500000", "--action-repeat", "2", "--eval-every", "5000", "--eval-episodes", "10"),
            "Fujimoto et al. 2025 (MR.Q, ICLR), the experimental protocol: DMC proprioceptive, action repeat 2, 500k "
            "agent steps "
            "(1M frames), 10 deterministic episodes every 5k agent steps",
            agents=("mrq",),
            env_family="dmc",
        ),
        # Multitask MR.Q: ScaleMRL's README command for agent=mrq (its config.py defaults otherwise).
        Preset(
            "mrq-mt-scalemrl",
            ("--total-steps", "10000000", "--horizon", "5", "--model-size", "L", "--eval-episodes", "2"),
            "Obando-Ceron et al. 2026 (ScaleMRL, arXiv 2606.05555), the code's README command for agent=mrq "
            "(use_demos=false, steps=10000000, horizon=5) and config.py defaults: model size L, batch 1024, "
            "UTD 0.075, one env per task, 2 evaluation episodes per task",
            agents=("mrq-mt",),
            note="learning starts after 5 random episodes per env and evaluation comes every 20 episodes per env "
            "(agents.mrq_mt.protocol; 52,500 and 210,000 steps on mt:dmc21), filled in for the env's tasks; "
            "task embeddings are learned (ScaleMRL conditions on frozen CLIP text vectors)",
        ),
        # PPO: the CleanRL 1M-step MuJoCo protocol (the zoo's defaults, spelled out) and SB3/SBX's defaults.
        Preset(
            "ppo-cleanrl",
            (
                "--total-steps",
                "1000000",
                "--num-envs",
                "1",
                "--num-steps",
                "2048",
                "--num-minibatches",
                "32",
                "--update-epochs",
                "10",
                "--learning-rate",
                "3e-4",
                "--anneal-lr",
                "--gamma",
                "0.99",
                "--gae-lambda",
                "0.95",
                "--clip-coef",
                "0.2",
                "--ent-coef",
                "0.0",
                "--vf-coef",
                "0.5",
                "--max-grad-norm",
                "0.5",
                "--norm-obs",
                "--norm-reward",
                "--action-mode",
                "clip",
            ),
            "Huang et al. 2022 (CleanRL), ppo_continuous_action.py defaults: the 1M-step MuJoCo protocol",
            agents=("ppo",),
        ),
        Preset(
            "ppo-playground",
            (
                "--total-steps",
                "60000000",
                "--num-envs",
                "2048",
                "--num-steps",
                "30",
                "--num-minibatches",
                "32",
                "--update-epochs",
                "16",
                "--learning-rate",
                "1e-3",
                "--gamma",
                "0.995",
                "--ent-coef",
                "0.01",
                "--norm-obs",
                "--eval-every",
                "6000000",
                "--checkpoint-every",
                "6000000",
            ),
            "Zakka et al. 2025 (MuJoCo Playground, arXiv 2502.08844), the DM Control Suite PPO settings "
            "(dm_control_suite_params.py): 60M steps, 2048 envs, unroll 30, 32 minibatches, 16 updates per batch, "
            "lr 1e-3, discount 0.995, entropy cost 1e-2, observation normalisation, 10 evaluations (num_evals)",
            agents=("ppo",),
            env_family="playground",
            note="Brax gathers 16 unrolls of the 2048 envs per update batch (1024 x 32 trajectories of 30 steps); here "
            "one 30-step rollout of 2048 envs is one iteration's batch.  Brax scales rewards by 10, the zoo "
            "normalises them by the return's std.  Brax's networks are not reproduced.  Playground uses "
            "discount 0.95 for BallInCup and FingerSpin and 100M steps for AcrobotSwingup, SwimmerSwimmer6 and "
            "WalkerRun: add --gamma 0.95 / --total-steps 100000000",
        ),
        Preset(
            "ppo-brax",
            (
                "--total-steps",
                "60000000",
                "--num-envs",
                "2048",
                "--num-steps",
                "480",
                "--num-minibatches",
                "32",
                "--update-epochs",
                "16",
                "--learning-rate",
                "1e-3",
                "--no-anneal-lr",
                "--gamma",
                "0.995",
                "--gae-lambda",
                "0.95",
                "--clip-coef",
                "0.3",
                "--no-clip-vloss",
                "--vf-coef",
                "0.5",
                "--ent-coef",
                "0.01",
                "--max-grad-norm",
                "inf",
                "--norm-obs",
                "--no-norm-reward",
                "--network.activation",
                "silu",
                "--eval-every",
                "6000000",
                "--checkpoint-every",
                "6000000",
            ),
            "Zakka et al. 2025 (MuJoCo Playground, arXiv 2502.08844), mujoco_playground/config/"
            "dm_control_suite_params.py brax_ppo_config, as Brax's PPO (brax/training/agents/ppo/train.py, "
            "losses.py, networks.py) runs it: 60M steps, 2048 envs, batch 1024 x 32 minibatches of 30-step unrolls "
            "(16 unrolls of every env per update batch: --num-steps 480), 16 epochs, constant lr 1e-3, discount 0.995, "
            "GAE lambda 0.95, clip 0.3, no value clipping, value loss 0.5 x 0.5 MSE, entropy cost 1e-2, no gradient "
            "clipping (--max-grad-norm inf), observation normalisation, Brax's swish activation; 10 evaluations",
            agents=("ppo",),
            env_family="playground",
            note="not expressed: Brax's networks (policy 4 x 32, value 5 x 256, LeCun-uniform init, tanh-Normal "
            "policy with a learned scale) -- the zoo's PPO keeps one width and depth for both, 64 x 64 orthogonal, "
            "and a Gaussian with a state-independent log-std; reward scaling by 10 (rewards enter unscaled; the "
            "critic has its own Adam, so this mostly rescales the value loss); GAE per 30-step unroll (here over "
            "480 steps) and minibatches of whole unrolls (here of shuffled transitions); the observation statistics' "
            "clip at +-10; stochastic evaluation on 128 envs (the zoo evaluates the deterministic policy); resets per "
            "evaluation.  Per task, Playground uses discount 0.95 for BallInCup and FingerSpin, 100M steps for "
            "AcrobotSwingup, Swimmer* and WalkerRun (add --gamma 0.95 / --total-steps 100000000), and action repeat "
            "4 with 4 epochs for PendulumSwingup",
        ),
        # SAC with many envs and a few large-batch updates per vector step (the device loop).
        Preset(
            "sac-playground",
            (
                "--total-steps",
                "5000000",
                "--num-envs",
                "128",
                "--updates-per-vector-step",
                "8",
                "--batch-size",
                "512",
                "--buffer-size",
                "4194304",
                "--learning-starts",
                "8192",
                "--gamma",
                "0.99",
                "--actor-lr",
                "1e-3",
                "--critic-lr",
                "1e-3",
                "--alpha-lr",
                "3e-4",
                "--tau",
                "0.005",
                "--init-alpha",
                "1.0",
                "--network.layer-norm",
                "--eval-every",
                "500000",
                "--eval-episodes",
                "128",
                "--log-every",
                "50000",
                "--checkpoint-every",
                "500000",
            ),
            "Zakka et al. 2025 (MuJoCo Playground, arXiv 2502.08844), mujoco_playground/config/"
            "dm_control_suite_params.py brax_sac_config, as Brax's SAC (brax/training/agents/sac/train.py) runs it: "
            "5M steps, 128 envs, 8 gradient updates of batch 512 per vector step (grad_updates_per_step), replay "
            "4 x 2^20, 8192 transitions before learning (min_replay_size), discount 0.99, policy and Q lr 1e-3, "
            "temperature lr 3e-4 from alpha 1, tau 0.005, LayerNorm in the Q network, 2 x 256 ReLU networks, "
            "10 evaluations of 128 episodes",
            agents=("sac",),
            env_family="playground",
            note="not expressed: observation normalisation (the zoo's SAC has none); target entropy -|A|/2 (the zoo's "
            "default is -|A|: pass --target-entropy for the task's action width); LayerNorm in the actor too (the "
            "zoo's --network.layer-norm is every network's); Brax fills its first 8192 transitions with the "
            "untrained policy and learns one vector step later, the zoo with uniform actions; Brax evaluates the "
            "stochastic policy.  Playground runs 10M steps for Acrobot*, Swimmer*, Finger*, Hopper*, CheetahRun, "
            "HumanoidWalk, PendulumSwingUp and WalkerRun (add --total-steps 10000000) and action repeat 4 for "
            "PendulumSwingUp",
        ),
        Preset(
            "sac-fastsac",
            (
                "--total-steps",
                "153600000",
                "--num-envs",
                "1024",
                "--updates-per-vector-step",
                "2",
                "--batch-size",
                "32768",
                "--buffer-size",
                "10485760",
                "--learning-starts",
                "12288",
                "--gamma",
                "0.97",
                "--tau",
                "0.1",
                "--actor-lr",
                "3e-4",
                "--critic-lr",
                "3e-4",
                "--alpha-lr",
                "3e-4",
                "--init-alpha",
                "0.001",
                "--eval-every",
                "5120000",
                "--eval-episodes",
                "1024",
                "--log-every",
                "102400",
                "--checkpoint-every",
                "5120000",
            ),
            "Seo et al. 2025 (FastTD3, arXiv 2505.22642) and its FastSAC (younggyoseo/FastTD3 fast_sac/hyperparams.py "
            "MuJoCoPlaygroundArgs / CheetahRunArgs, fast_sac/train.py): 1024 envs, 2 updates of batch 32768 per "
            "vector step, replay 10240 per env, learning after 11 vector steps, 150,000 vector steps, discount 0.97, "
            "tau 0.1, lr 3e-4 for actor, critics and temperature, alpha from 0.001, target entropy -|A|, clipped "
            "double Q; evaluation and checkpoints every 5000 vector steps, 1024 evaluation episodes",
            agents=("sac",),
            env_family="playground",
            note="not expressed: observation normalisation; AdamW with weight decay 0.1; the actor and temperature "
            "updated on every second update only; CheetahRun's 3-step returns; the networks (critic 1024-512-256, "
            "actor 512-256-128, log-std squashed into [-5, 2]; the zoo's SAC keeps 2 x 256); bf16 mixed precision; "
            "batches drawn as batch/num_envs rows from each env (here uniformly from the whole replay)",
        ),
        Preset(
            "ppo-sb3",
            (
                "--num-steps",
                "2048",
                "--num-minibatches",
                "32",
                "--update-epochs",
                "10",
                "--learning-rate",
                "3e-4",
                "--no-anneal-lr",
                "--no-norm-obs",
                "--no-norm-reward",
            ),
            "Raffin et al. 2021 (Stable-Baselines3) PPO defaults: n_steps 2048, batch 64 (32 minibatches of one "
            "env's 2048 steps), 10 epochs, constant lr 3e-4, no VecNormalize",
            agents=("ppo",),
            note="SB3's default network (64-64 tanh, no orthogonal init) is not reproduced: "
            "the zoo's PPO network keeps CleanRL's orthogonal init",
        ),
        # RAVL: the one setting the reference code's README gives (the paper's per-task table is an image).
        Preset(
            "ravl-halfcheetah-medium",
            (
                "--critics",
                "10",
                "--eta",
                "1.0",
                "--horizon",
                "5",
                "--dataset-ratio",
                "0.05",
                "--total-steps",
                "3000000",
                "--updates-per-epoch",
                "1000",
            ),
            "Sims et al. 2024 (RAVL, NeurIPS), the training loop and the reference code's README example for "
            "halfcheetah-medium: "
            "N = 10, eta = 1, k = 5, r = 0.05; 3000 epochs x 1000 updates",
            agents=("ravl",),
            note="the paper's per-task values for the other datasets are published only as "
            "an image and are not transcribed",
        ),
        Preset(
            "ravl-hopper",
            ("--critics", "10", "--eta", "1.0", "--horizon", "20", "--dataset-ratio", "0.05"),
            "the zoo's own measurement, not the paper's: on Hopper-v5 medium and medium-replay, k = 20 reaches the "
            "falls 5-step rollouts miss and beats the behaviour policy on every seed (docs/benchmarks.md)",
            agents=("ravl",),
            note="Sims et al. 2024 tune k per task; their hopper values are not transcribed",
        ),
        # Plasticity interventions at their papers' settings (any agent that takes them).
        Preset(
            "redo-sokar",
            ("--plasticity.redo", "--plasticity.redo-tau", "0.025", "--plasticity.reset-every", "1000"),
            "Sokar et al. 2023 (ReDo, ICML), the default setting: tau = 0.025, recycle every 1000 gradient steps",
        ),
        Preset(
            "regrama-bro",
            ("--plasticity.regrama", "--plasticity.regrama-tau", "0.01", "--plasticity.reset-every", "1000"),
            "Liu et al. 2025 (GraMa / ReGraMa, NeurIPS), App. A: tau = 0.01, reset every 1000 steps (BRO-net on DMC)",
        ),
        Preset(
            "regrama-sac",
            (
                "--plasticity.regrama",
                "--plasticity.regrama-tau",
                "0.0",
                "--plasticity.reset-every",
                "1000",
                "--plasticity.reset-max-fraction",
                "0.05",
            ),
            "Liu et al. 2025 (GraMa / ReGraMa), App. A: CleanRL SAC, tau = 0, every 1000 steps, at most 5% of "
            "neurons per event",
        ),
        Preset(
            "sigreg-rl",
            (
                "--plasticity.sigreg-coef",
                "0.2",
                "--plasticity.sigreg-variant",
                "rl",
                "--plasticity.sigreg-slices",
                "16",
            ),
            "Saheb et al., arXiv 2602.19373 (SIGReg in deep RL), the reference scripts: the RL variant, 16 slices, "
            "lambda = 0.2 (the smaller "
            "of the scripts' two non-zero values)",
        ),
        Preset(
            "ne-reference",
            ("--plasticity.ne",),
            "Liu et al. 2025 (Neuroplastic Expansion, ICLR), the reference code's defaults: an event every 100 "
            "updates, "
            "uniform growth, magnitude pruning, review off, auto batch (the zoo's --plasticity.ne-* defaults)",
        ),
        Preset(
            "sp-plasticine",
            (
                "--plasticity.shrink-perturb",
                "--plasticity.sp-every",
                "1",
                "--plasticity.sp-shrink",
                "0.999999",
                "--plasticity.sp-perturb",
                "0.000001",
            ),
            "Yuan et al. 2025 (Plasticine, arXiv 2504.17490), standard/td3_dmc_snp.py: theta <- 0.999999 theta + 1e-6 "
            "x a fresh initialisation after every (policy) update; the rule is Ash & Adams 2020 (NeurIPS), section 4",
        ),
        Preset(
            "reset-primacy",
            (
                "--plasticity.layer-reset",
                "--plasticity.layer-reset-every",
                "200000",
                "--plasticity.layer-reset-layers",
                "0",
            ),
            "Nikishin et al. 2022 (The primacy bias in deep RL, ICML), section 4 and appendix: SAC on DMC resets every "
            "network (and its targets) every 2e5 updates",
            note="the zoo keeps SAC's temperature across a reset; the paper's agent starts it over too",
        ),
        Preset(
            "l2-init",
            ("--plasticity.l2-init", "0.01"),
            "Kumar, Marklund, Van Roy 2023 (L2 Init, arXiv 2308.11958), section 3: loss + lambda ||theta - theta_0||^2 "
            "over every parameter; lambda = 0.01 is the L2 Init (regen) setting of Chung et al. 2024's DMC and "
            "MetaWorld runs (wechu/parseval_reg main.py) and Plasticine's rr_weight",
            note="the L2 Init paper tunes lambda per (supervised) benchmark and gives no RL value; Chung et al.'s code "
            "divides each tensor's squared distance by its size and Plasticine's uses the unsquared norm, so "
            "0.01 here (the paper's sum) pulls harder per weight: tune it",
        ),
        Preset(
            "parseval",
            ("--plasticity.parseval", "0.0001", "--plasticity.parseval-scale", "2"),
            "Chung, Cherif, Meger, Precup 2024 (Parseval regularization, NeurIPS), section 3 and the authors' code "
            "(wechu/parseval_reg main.py): lambda = 1e-4 on CARL DMC quadruped and LunarLander (1e-3 on gridworld "
            "and MetaWorld), s = 2, lambda scaled by (64 / width)^2 for other widths, hidden layers only",
            note="the paper's MetaWorld runs add diagonal layers after each Parseval layer, which the zoo does not",
        ),
        Preset(
            "nap",
            ("--plasticity.nap", "--network.layer-norm"),
            "Lyle et al. 2024 (Normalization and effective learning rates in RL, NeurIPS), section 4: LayerNorm before "
            "each nonlinearity and every hidden layer projected back to its initial norm after each step",
            note="the paper finds an explicit learning-rate decay helps its Rainbow agents under NaP; the zoo keeps "
            "each agent's own schedule",
        ),
        Preset(
            "injection-nikishin",
            ("--plasticity.injection-at", "0.25", "--plasticity.injection-layers", "2"),
            "Nikishin et al. 2023 (Deep RL with plasticity injection, NeurIPS, arXiv 2305.15555), sec. 3 and its "
            "Atari runs: one injection, a quarter into training (50M of Double DQN's 200M frames), into the head: "
            "the network's two fully connected layers after its convolutional encoder",
            note="the zoo's MLPs have no convolutional encoder: the head is their last two Linear layers (SAC, RAVL: "
            "actor and critics; PPO: actor and critic; MR.Q, mrq-mt: value and policy)",
        ),
        Preset(
            "injection-plasticine",
            ("--plasticity.injection-at", "0.5", "--plasticity.injection-layers", "1"),
            "Yuan et al. 2025 (Plasticine, arXiv 2504.17490), continual/td3_dmc_pi.py: the output layer of the actor "
            "and of each critic injected once, at half the run",
            note="Plasticine detaches the frozen copy's output and never adds the new layer to its optimizer; the "
            "zoo trains theta' (and the encoder through all three heads) as Nikishin et al. describe",
        ),
        Preset(
            "trac",
            ("--plasticity.trac", "--plasticity.trac-s-init", "1e-8"),
            "Muppidi, Zhang, Yang 2024 (Fast TRAC, NeurIPS, arXiv 2405.16642), Algorithm 1 with the authors' "
            "package defaults (trac-optimizer 0.0.2): betas 0.9 ... 0.999999 (six), s_init 1e-8, eps 1e-8, over "
            "Adam at the agent's own learning rate",
            note="MR.Q's and mrq-mt's base is their AdamW, PPO's its Adam at the annealed learning rate "
            "(plasticity.trac.combine); the package's erfi is about 1% low for small arguments, the zoo's is exact",
        ),
    )
}


class PresetError(ValueError):
    pass


def listing() -> str:
    """The table ``--preset list`` prints."""
    lines = ["presets (train.py AGENT --preset NAME; flags given on the command line win):"]
    for p in PRESETS.values():
        who = ", ".join(p.agents) if p.agents else "any agent"
        fam = {"dmc": "dmc: envs", "gym": "Gymnasium envs", "playground": "playground: envs"}.get(
            p.env_family or "", "any env"
        )
        lines.append(
            f"  {p.name}  [{who}; {fam}]\n      {' '.join(p.flags)}\n      source: {p.source}"
            + (f"\n      note: {p.note}" if p.note else "")
        )
    return "\n".join(lines)


def lookup(name: str, agent_name: str) -> Preset:
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)} (--preset list describes them)")
    p = PRESETS[name]
    if p.agents is not None and agent_name not in p.agents:
        raise PresetError(f"preset {name!r} is for {', '.join(p.agents)}, not {agent_name!r}")
    return p


def flags(names: list[str], agent_name: str) -> list[str]:
    """The flags of ``names`` in order (a later preset's value for a flag wins over an earlier one's)."""
    out: list[str] = []
    for name in names:
        out += lookup(name, agent_name).flags
    return out


def check_env(names: list[str], env: str | None):
    """A preset for one env family refuses an env of another (e.g. ``mrq-dmc`` on HalfCheetah-v5)."""
    if env is None:
        return
    is_dmc = env.startswith("dmc:") or (env.startswith("ns:") and ":dmc:" in env)
    for name in names:
        fam = PRESETS[name].env_family
        if fam == "dmc" and not is_dmc:
            raise PresetError(f"preset {name!r} is the DMC protocol; --env {env} is not a dmc: env")
        if fam == "gym" and (is_dmc or env.startswith("playground:")):
            raise PresetError(f"preset {name!r} is the Gymnasium MuJoCo protocol; --env {env} is not a Gymnasium env")
        if fam == "playground" and not env.startswith("playground:"):
            raise PresetError(f"preset {name!r} is MuJoCo Playground's protocol; --env {env} is not a playground: env")
