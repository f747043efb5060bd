"""Make D4RL-style offline datasets on Gymnasium envs (D4RL's generation procedure, Fu et al. 2020, redone on v5).

    python scripts/make_dataset.py --env Hopper-v5 --kind medium --kind medium-replay
    python scripts/make_dataset.py --env HalfCheetah-v5 --kind expert --size 1000000 --train-steps 3000000
    python scripts/make_dataset.py --env Hopper-v5 --kind random --out hopper-random.hdf5    # seconds, no SAC

Recipe (one SAC training serves every kind but random; a finished training in the run directory is
reused; a request of only --kind random trains nothing, see 6):

1. Train SAC (agents/sac.py, paper defaults, one seed) for --train-steps, evaluating every
   --eval-every steps; each evaluation keeps a snapshot of the actor (``<run>/snapshots/``).
   The replay buffer holds every transition (its capacity is set to --train-steps) and the
   final checkpoint keeps it.  Run directory: --run-dir, else ``<out dir>/runs/<env>-sac-seed<S>``
   (``<out dir>/<env>-sac-seed<S>`` when the out dir is a ``runs`` folder).
2. expert = the snapshot with the best mean evaluation return (--expert final: the last one);
   medium = the first snapshot after step 0 whose return reaches --medium-fraction (1/3) of the
   expert's (for a non-positive expert return: of the way from the random reference to it).
3. random / medium / expert: --size transitions from --num-envs parallel envs with stochastic
   actions (uniform; the SAC policy's samples), episodes capped at --max-episode-steps,
   terminals = terminated, timeouts = truncated, the true next observations, cut to exactly
   --size rows (the last episode may be partial).  infos: qpos, qvel (MuJoCo), action_log_probs.
4. medium-replay: the SAC replay buffer from step 0 up to the medium snapshot's step (--size does
   not apply).  medium-expert: medium cut at its last complete episode, then expert (<= 2 x --size).
5. Metadata: env_id, kind, seed, size, policy_step, policy_return, behaviour_return,
   ref_min_score (uniform-random policy) and ref_max_score (expert, deterministic), both means
   over --ref-episodes episodes reset from seeds 123, 124, ... as Minari does, and where each
   came from (ref_min_source, ref_max_source); the D4RL constants where they apply; the policy
   weights under metadata/policy; version and command.
6. Only --kind random: the uniform policy alone, no SAC (seconds).  ref_min_score as in 5;
   ref_max_score from, in order: --ref-max; a finished SAC run with the same settings in the run
   directory (its expert as in 2 and 5, nothing trained); D4RL's REF_MAX_SCORE for hopper /
   halfcheetah / walker2d (measured on the v2 envs; ref_max_source says so); else NaN with
   ref_max_source "missing" and a warning: normalised scores against the dataset's refs are then
   unavailable (S.normalized_score raises).  Without a SAC run the SAC keys (train_steps,
   algorithm, sac_run_dir, sac_config, network_config, ref_policy_step) are left out.

Output: --out FILE (one kind) or --out DIR, else the dataset cache (--cache, $RLZOO_DATASETS or
~/.cache/rlzoo/datasets) with names like hopper-medium-v5.hdf5.  SAC flags pass through as
--sac.<flag> (e.g. --sac.learning-starts 200 --sac.batch-size 64) and --network.width etc.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

try:
    from plasticity_zoo import envs  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from plasticity_zoo.agents import sac
from plasticity_zoo.envs import collect as C
from plasticity_zoo.envs import datasets as D
from plasticity_zoo.envs import scores as S
from plasticity_zoo.networks.distributions import tanh_gaussian_sample
from plasticity_zoo.training import checkpoint
from plasticity_zoo.training.config import NetworkConfig, RunConfig, to_json

Kind = Literal["random", "medium", "medium-replay", "expert", "medium-expert"]
SAC_KINDS = ("medium", "medium-replay", "expert", "medium-expert")  # the kinds that need a trained SAC
RUN_MARKER = "dataset_run.json"  # written when the SAC training has finished
UNCOMPARED = {"progress", "run_dir", "resume", "label", "tensorboard", "provenance", "resumes"}


@dataclass
class Args:
    """Make D4RL-style datasets; see the module docstring for the recipe."""

    env: str = "Hopper-v5"
    """env id (a Gymnasium id such as Hopper-v5)"""
    kind: tyro.conf.UseAppendAction[tuple[Kind, ...]] = ()
    """dataset kind; repeat the flag for several (one SAC training serves them all)"""
    size: int = 1_000_000
    """rows of random / medium / expert (medium-replay: the buffer up to the medium step; medium-expert: <= 2x)"""
    out: Optional[str] = None
    """output .hdf5 file (one kind) or directory; default: the dataset cache"""
    cache: Optional[str] = None
    """dataset cache directory (default $RLZOO_DATASETS or ~/.cache/rlzoo/datasets)"""
    train_steps: int = 1_000_000
    """SAC env steps"""
    seed: int = 0
    eval_every: int = 10_000
    """SAC evaluation (and policy snapshot) period in env steps"""
    eval_episodes: int = 10
    """deterministic episodes per evaluation"""
    checkpoint_every: int = 100_000
    """SAC checkpoint period (the final checkpoint, with the whole buffer, is always written)"""
    ref_episodes: int = 100
    """episodes behind ref_min_score / ref_max_score"""
    ref_max: Optional[float] = None
    """ref_max_score for a request of only --kind random (default: a finished SAC run's expert, else D4RL's constant)"""
    num_envs: int = 10
    """parallel envs while collecting"""
    max_episode_steps: int = C.MAX_EPISODE_STEPS
    """episode cap while collecting (D4RL: 1000)"""
    medium_fraction: float = 1.0 / 3.0
    """medium = first snapshot reaching this fraction of the expert's return"""
    expert: Literal["best", "final"] = "best"
    """expert snapshot: best mean evaluation return, or the final policy"""
    run_dir: Optional[str] = None
    """SAC run directory (default <out dir>/runs/<env>-sac-seed<S>; in an out dir named runs,
    <out dir>/<env>-sac-seed<S>)"""
    progress: bool = True
    """progress bar while training"""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    sac: sac.SACConfig = field(default_factory=sac.SACConfig)


@dataclass
class Snapshot:
    step: int
    mean_return: float
    params: object  # single-seed actor params (numpy leaves)


def _sanitize(env_id: str) -> str:
    return env_id.replace(":", "_").replace("/", "_")


def default_run_dir(root: Path, env_id: str, seed: int) -> Path:
    """The SAC run's directory without --run-dir: ``<out dir>/runs/<env>-sac-seed<S>``, or
    ``<out dir>/<env>-sac-seed<S>`` when the out dir is itself a ``runs`` folder (not runs/runs/)."""
    runs = root if root.name == "runs" else root / "runs"
    return runs / f"{_sanitize(env_id)}-sac-seed{seed}"


def _comparable(cfg_json: dict) -> dict:
    return json.loads(json.dumps({k: v for k, v in cfg_json.items() if k not in UNCOMPARED}))


def _nested(params) -> dict:
    """Actor params as a nested dict of numpy arrays, e.g. {'trunk': {'layers': {'0': {'kernel': ...}}}}."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = []
        for p in path:
            name = getattr(p, "key", getattr(p, "idx", getattr(p, "name", None)))
            if name == "value" and isinstance(p, jax.tree_util.GetAttrKey):
                continue
            names.append(str(name))
        node = out
        for n in names[:-1]:
            node = node.setdefault(n, {})
        node[names[-1]] = np.asarray(leaf)
    return out


def _version() -> str:
    try:
        from importlib.metadata import version

        v = version("plasticity-zoo")
    except Exception:
        v = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            timeout=5,
        ).stdout.strip()
    except Exception:
        commit = ""
    return f"{v}+{commit}" if commit else v


def run_config(args: Args, run_dir: Path) -> RunConfig:
    """The SAC training's RunConfig (a plain dataclass: nothing is built)."""
    agent_cfg = dataclasses.replace(args.sac, buffer_size=args.train_steps)  # rows [0, T) stay in order
    return RunConfig(
        env=args.env,
        seeds=1,
        seed=args.seed,
        total_steps=args.train_steps,
        num_envs=1,
        eval_every=args.eval_every,
        eval_episodes=args.eval_episodes,
        log_every=min(1_000, args.eval_every),
        checkpoint_every=args.checkpoint_every,
        run_dir=str(run_dir),
        progress=args.progress,
        network=args.network,
        agent_name="sac",
        agent=agent_cfg,
    )


def finished_run(run_dir: Path, cfg: RunConfig) -> Optional[list[str]]:
    """None when ``run_dir`` holds no finished SAC training (no RUN_MARKER); else the comparable
    config keys in which the finished one differs from ``cfg`` (empty: the same training)."""
    marker = run_dir / RUN_MARKER
    if not marker.exists():
        return None
    want, done = _comparable(to_json(cfg)), _comparable(json.loads(marker.read_text())["config"])
    return sorted(k for k in set(want) | set(done) if want.get(k) != done.get(k))


class SacRun:
    """The SAC training behind the datasets: train, resume or reuse; snapshots; policies; the buffer."""

    def __init__(self, args: Args, run_dir: Path):
        self.args, self.run_dir = args, run_dir
        spaces = D.env_spaces(args.env)
        self.obs_dim, self.act_dim = spaces.obs_dim, spaces.act_dim
        self.cfg = run_config(args, run_dir)
        agent_cfg = self.cfg.agent
        # Shapes and the static networks only (no compute): the actor Net and its param structure.
        self.template = jax.eval_shape(
            lambda k: sac.init(k, self.obs_dim, self.act_dim, agent_cfg, args.network), jax.random.key(0)
        )
        self.treedef = jax.tree.structure(self.template.actor_params)
        actor = self.template.actor
        self._sample = jax.jit(lambda p, o, k: tanh_gaussian_sample(k, *actor(p, o)))  # = sac.act(explore=True)
        self._mode = jax.jit(lambda p, o: sac.act(self.template.replace(actor_params=p), o, None, explore=False))

    # -- training ---------------------------------------------------------------------------
    @property
    def snap_dir(self) -> Path:
        return self.run_dir / "snapshots"

    def _on_eval(self, step, state, returns):
        leaves = [np.asarray(x[0]) for x in jax.tree.leaves(state.actor_params)]  # seed 0
        self.snap_dir.mkdir(parents=True, exist_ok=True)
        final = self.snap_dir / f"step_{step:012d}.npz"
        tmp = self.snap_dir / f".tmp_step_{step:012d}.npz"
        with open(tmp, "wb") as f:
            np.savez(
                f,
                step=np.int64(step),
                mean_return=np.float64(np.mean(returns[0])),
                returns=np.asarray(returns[0], np.float64),
                **{f"leaf_{i:05d}": x for i, x in enumerate(leaves)},
            )
        os.replace(tmp, final)

    def ensure_trained(self):
        from plasticity_zoo.training.loops.offpolicy import train

        marker = self.run_dir / RUN_MARKER
        want = _comparable(to_json(self.cfg))
        diff = finished_run(self.run_dir, self.cfg)
        if diff is not None:
            if diff:
                raise SystemExit(
                    f"{self.run_dir} holds a finished SAC run with another config (differs in "
                    f"{', '.join(diff)}); pass another --run-dir or delete it"
                )
            print(f"reusing the finished SAC run in {self.run_dir}")
            return
        last = checkpoint.latest(self.run_dir)
        if last is not None:
            saved = json.loads((self.run_dir / "config.json").read_text())
            if _comparable(saved) != want:
                raise SystemExit(
                    f"{self.run_dir} holds an unfinished SAC run with another config; "
                    "pass another --run-dir or delete it"
                )
            step = json.loads((last / "meta.json").read_text())["step"]
            for p in self.snap_dir.glob("step_*.npz"):  # snapshots past the checkpoint are redone
                if int(p.stem.split("_")[1]) > step:
                    p.unlink()
            print(f"resuming the SAC run in {self.run_dir} from step {step}")
            out = train(self.cfg, sac, self.run_dir, resume=True, on_eval=self._on_eval)
        else:
            for name in ("snapshots", "metrics.csv", "eval.csv", "config.json"):  # leftovers of a crashed start
                p = self.run_dir / name
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            print(f"training SAC on {self.args.env} for {self.args.train_steps} steps in {self.run_dir}")
            out = train(self.cfg, sac, self.run_dir, on_eval=self._on_eval)
        if out["step"] != self.args.train_steps:
            raise SystemExit(f"SAC training stopped at step {out['step']} of {self.args.train_steps}")
        marker.write_text(json.dumps({"train_steps": self.args.train_steps, "config": to_json(self.cfg)}, indent=2))

    def snapshots(self) -> list[Snapshot]:
        out = []
        for p in sorted(self.snap_dir.glob("step_*.npz")):
            with np.load(p) as z:
                leaves = [z[f"leaf_{i:05d}"] for i in range(self.treedef.num_leaves)]
                out.append(Snapshot(int(z["step"]), float(z["mean_return"]), jax.tree.unflatten(self.treedef, leaves)))
        if not out:
            raise SystemExit(f"no policy snapshots in {self.snap_dir}")
        return out

    # -- policies ---------------------------------------------------------------------------
    def stochastic(self, params, seed: int):
        """obs -> (actions, log_probs): SAC's exploration samples, as agents.sac.act(explore=True)."""
        params = jax.tree.map(jnp.asarray, params)
        key = [jax.random.key(seed)]

        def policy(obs):
            key[0], k = jax.random.split(key[0])
            a, lp = self._sample(params, jnp.asarray(obs, jnp.float32), k)
            return np.asarray(a), np.asarray(lp)

        return policy

    def deterministic(self, params):
        params = jax.tree.map(jnp.asarray, params)
        return lambda obs: np.asarray(self._mode(params, jnp.asarray(obs, jnp.float32)))

    # -- replay buffer ----------------------------------------------------------------------
    def replay_rows(self, n: int) -> D.Dataset:
        """The first ``n`` transitions of the SAC replay buffer (seed 0) from the final checkpoint."""
        from plasticity_zoo.training.loops.offpolicy import init_state

        path = checkpoint.latest(self.run_dir)
        if path is None:
            raise SystemExit(f"no checkpoint in {self.run_dir}/ckpt: cannot read the replay buffer")
        template = init_state(sac, self.cfg, self.obs_dim, self.act_dim)
        (_, buffer, _), _, meta = checkpoint.load(path, template)
        if meta["step"] != self.args.train_steps or int(buffer.size[0]) < n:
            raise SystemExit(
                f"checkpoint {path} (step {meta['step']}, {int(buffer.size[0])} buffer rows) does not "
                f"hold the first {n} transitions"
            )
        d = jax.tree.map(lambda x: np.asarray(x[0, :n]), buffer.data)
        s = D.env_spaces(self.args.env)
        return D.Dataset(
            d.obs.astype(np.float32),
            D.to_env_units(d.action, self.args.env),
            d.reward.astype(np.float32),
            d.terminated.astype(bool),
            d.truncated.astype(bool),
            d.next_obs.astype(np.float32),
            metadata={
                "env_id": self.args.env,
                "action_low": s.action_low.astype(np.float32),
                "action_high": s.action_high.astype(np.float32),
            },
        )


def pick_expert(snaps: list[Snapshot], rule: str) -> Snapshot:
    """The best mean evaluation return (``rule="best"``) or the final snapshot."""
    return max(snaps, key=lambda s: s.mean_return) if rule == "best" else max(snaps, key=lambda s: s.step)


def pick_medium(snaps: list[Snapshot], expert: Snapshot, fraction: float, random_ref: float):
    """(medium, threshold): the first snapshot after step 0 reaching ``fraction`` of the expert's return.

    For a non-positive expert return the threshold is ``fraction`` of the way from the random
    reference to the expert.  Falls back to the expert when no snapshot reaches it.
    """
    r = expert.mean_return
    threshold = fraction * r if r > 0 else random_ref + fraction * (r - random_ref)
    candidates = [s for s in snaps if s.step > 0 and s.mean_return >= threshold]
    return (min(candidates, key=lambda s: s.step) if candidates else expert), threshold


def random_reference(env_id: str, episodes: int, max_len: int) -> float:
    """ref_min_score: the uniform-random policy's mean return over ``episodes`` episodes reset from C.REF_SEED on."""
    rng = np.random.default_rng(C.REF_SEED)
    act_dim = D.env_spaces(env_id).act_dim
    rand = C.evaluate_policy(
        env_id, lambda o: rng.uniform(-1, 1, (len(o), act_dim)).astype(np.float32), episodes, C.REF_SEED, max_len
    )
    return float(rand.mean())


def references(run: SacRun, expert: Snapshot, episodes: int, max_len: int) -> dict:
    """ref_min_score / ref_max_score, cached in the run directory for the given expert and episodes."""
    path = run.run_dir / "references.json"
    key = {"episodes": episodes, "expert_step": expert.step, "first_seed": C.REF_SEED, "max_episode_steps": max_len}
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved
    rand = random_reference(run.args.env, episodes, max_len)
    best = C.evaluate_policy(run.args.env, run.deterministic(expert.params), episodes, C.REF_SEED, max_len)
    out = {"key": key, "ref_min_score": rand, "ref_max_score": float(best.mean())}
    path.write_text(json.dumps(out, indent=2))
    return out


def references_without_training(args: Args, run_dir: Path) -> tuple[dict, Optional[SacRun], Optional[Snapshot]]:
    """The refs of a random-only request, training nothing: (refs, the reused SAC run or None, its expert or None).

    ``refs``: ref_min_score, ref_max_score, ref_min_source, ref_max_source (and ref_max_note).
    ref_max_score: --ref-max; else a finished SAC run in ``run_dir`` with the same settings (its
    expert, as for the other kinds); else D4RL's constant; else NaN ("missing", with a warning).
    """
    diff = finished_run(run_dir, run_config(args, run_dir)) if args.ref_max is None else None
    if diff == []:
        print(f"reusing the finished SAC run in {run_dir} for ref_max_score (nothing is trained)")
        run = SacRun(args, run_dir)
        expert = pick_expert(run.snapshots(), args.expert)
        refs = dict(
            references(run, expert, args.ref_episodes, args.max_episode_steps),
            ref_min_source="uniform-random",
            ref_max_source="sac-expert",
        )
        refs.pop("key", None)
        return refs, run, expert
    refs = {
        "ref_min_score": random_reference(args.env, args.ref_episodes, args.max_episode_steps),
        "ref_min_source": "uniform-random",
    }
    name = S.d4rl_name(args.env)
    if diff:
        print(
            f"note: {run_dir} holds a finished SAC run with other settings (differs in {', '.join(diff)}); "
            "not used for ref_max_score"
        )
    if args.ref_max is not None:
        refs.update(ref_max_score=float(args.ref_max), ref_max_source="--ref-max")
    elif name is not None:
        refs.update(
            ref_max_score=float(S.D4RL_REF[name][1]),
            ref_max_source="d4rl",
            ref_max_note=f"D4RL's REF_MAX_SCORE for {name} (d4rl/infos.py), measured on the v2 envs, not on {args.env}",
        )
        print(
            f"ref_max_score: D4RL's REF_MAX_SCORE for {name} ({refs['ref_max_score']:g}; D4RL's constants are "
            f"for the v2 envs); pass --ref-max to set another"
        )
    else:
        refs.update(ref_max_score=float("nan"), ref_max_source="missing")
        print(
            f"warning: no ref_max_score for {args.env} (no --ref-max, no finished SAC run with these settings in "
            f"{run_dir}, no D4RL constants): ref_max_score is NaN and normalised scores against the dataset's "
            "refs are unavailable"
        )
    if np.isfinite(refs["ref_max_score"]) and refs["ref_max_score"] <= refs["ref_min_score"]:
        raise SystemExit(
            f"ref_max_score {refs['ref_max_score']:g} ({refs['ref_max_source']}) is not above "
            f"ref_min_score {refs['ref_min_score']:g} (the uniform-random policy's mean return)"
        )
    return refs, None, None


def output_paths(args: Args, kinds) -> tuple[dict, Path]:
    if args.out is not None and Path(args.out).suffix in (".hdf5", ".h5"):
        if len(kinds) != 1:
            raise SystemExit(f"--out {args.out} is a file: give exactly one --kind, or a directory for several")
        return {kinds[0]: Path(args.out)}, Path(args.out).resolve().parent
    root = Path(args.out) if args.out is not None else D.cache_dir(args.cache)
    return {k: D.cached_path(args.env, k, root) for k in kinds}, root


def _check(args: Args, needs_sac: bool = True):
    for name in (
        "size",
        "train_steps",
        "eval_every",
        "eval_episodes",
        "checkpoint_every",
        "ref_episodes",
        "num_envs",
        "max_episode_steps",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.medium_fraction < 1.0:
        raise SystemExit(f"--medium-fraction must be in (0, 1), got {args.medium_fraction}")
    if args.ref_max is not None and not np.isfinite(args.ref_max):
        raise SystemExit(f"--ref-max must be a finite number, got {args.ref_max}")
    if args.ref_max is not None and needs_sac:
        raise SystemExit(
            "--ref-max applies to a request of only --kind random; with "
            f"{' / '.join(SAC_KINDS)} ref_max_score is the SAC expert's return"
        )
    if needs_sac and args.sac.learning_starts >= args.train_steps:
        raise SystemExit(
            f"--sac.learning-starts ({args.sac.learning_starts}) must be below --train-steps "
            f"({args.train_steps}), or SAC never learns"
        )
    try:
        D.env_spaces(args.env)
    except ValueError as e:
        raise SystemExit(str(e)) from e


def make(args: Args, argv=None) -> dict:
    """Build every requested kind; returns {kind: path}."""
    kinds = list(dict.fromkeys(args.kind))
    if not kinds:
        raise SystemExit(f"give at least one --kind ({', '.join(D.KINDS)})")
    needs_sac = any(k in SAC_KINDS for k in kinds)
    _check(args, needs_sac)
    paths, root = output_paths(args, kinds)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(root, args.env, args.seed)
    act_dim = D.env_spaces(args.env).act_dim
    medium = None
    if needs_sac:
        run = SacRun(args, run_dir)
        run.ensure_trained()
        snaps = run.snapshots()
        expert = pick_expert(snaps, args.expert)
        refs = dict(
            references(run, expert, args.ref_episodes, args.max_episode_steps),
            ref_min_source="uniform-random",
            ref_max_source="sac-expert",
        )
        medium, threshold = pick_medium(snaps, expert, args.medium_fraction, refs["ref_min_score"])
        print(
            f"expert: step {expert.step} (eval return {expert.mean_return:.1f}); medium: step {medium.step} "
            f"(eval return {medium.mean_return:.1f}, threshold {threshold:.1f})"
        )
        if medium.step == expert.step:
            print("warning: no earlier snapshot reached the medium threshold; medium uses the expert policy")
    else:  # only random: the uniform policy, no SAC training (a finished one may give ref_max_score)
        refs, run, expert = references_without_training(args, run_dir)

    common = {
        "env_id": args.env,
        "seed": args.seed,
        "requested_size": args.size,
        "ref_min_score": refs["ref_min_score"],
        "ref_max_score": refs["ref_max_score"],
        "ref_min_source": refs["ref_min_source"],
        "ref_max_source": refs["ref_max_source"],
        "ref_episodes": args.ref_episodes,
        "ref_seed": C.REF_SEED,
        "max_episode_steps": args.max_episode_steps,
        "zoo_version": _version(),
        "command": shlex.join(["python", "scripts/make_dataset.py", *(sys.argv[1:] if argv is None else argv)]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if "ref_max_note" in refs:
        common["ref_max_note"] = refs["ref_max_note"]
    if run is not None:  # the SAC training behind the policies (or, for random only, behind ref_max_score)
        common.update(
            {
                "train_steps": args.train_steps,
                "algorithm": "SAC (agents/sac.py), tanh-Gaussian actor",
                "sac_run_dir": str(run_dir),
                "sac_config": json.dumps(dataclasses.asdict(run.cfg.agent)),
                "network_config": json.dumps(dataclasses.asdict(args.network)),
                "ref_policy_step": expert.step,
            }
        )
    name = S.d4rl_name(args.env)
    if name is not None:
        common["d4rl_name"] = name
        common["d4rl_ref_min_score"], common["d4rl_ref_max_score"] = S.D4RL_REF[name]

    def policy_meta(s: Snapshot, prefix="policy"):
        return {f"{prefix}_step": s.step, f"{prefix}_return": s.mean_return, prefix: _nested(s.params)}

    memo: dict = {}

    def collect(kind: str) -> D.Dataset:
        if kind in memo:
            return memo[kind]
        seed = 10_000 * args.seed + 6_000 + 100 * D.KINDS.index(kind)
        if kind == "random":
            rng = np.random.default_rng(seed)
            pol = lambda o: rng.uniform(-1, 1, (len(o), act_dim)).astype(np.float32)  # noqa: E731
            ds = C.collect(args.env, pol, args.size, seed, args.num_envs, args.max_episode_steps)
            ds.metadata.update(behaviour_policy="uniform", behaviour_sampling="uniform")
        elif kind in ("medium", "expert"):
            snap = medium if kind == "medium" else expert
            ds = C.collect(
                args.env, run.stochastic(snap.params, seed), args.size, seed, args.num_envs, args.max_episode_steps
            )
            ds.metadata.update(behaviour_policy="sac", **policy_meta(snap))
        elif kind == "medium-replay":
            ds = run.replay_rows(medium.step)
            ds.metadata.update(
                behaviour_policy="sac replay buffer (uniform until learning_starts)",
                replay_rows=medium.step,
                **policy_meta(medium),
            )
        else:  # medium-expert
            med, exp = collect("medium"), collect("expert")
            ends = med.episode_ends()
            cut = int(ends[-1]) + 1 if len(ends) else 0
            ds = D.concatenate([med.select(slice(0, cut)), exp], metadata=dict(exp.metadata))
            ds.metadata.update(
                behaviour_policy="sac", medium_rows=cut, **policy_meta(expert), **policy_meta(medium, "medium_policy")
            )
        memo[kind] = ds
        return ds

    made = {}
    for kind in kinds:
        ds = collect(kind)
        returns = ds.episode_returns()
        behaviour = float(returns.mean()) if len(returns) else float("nan")
        ds.metadata = {
            **ds.metadata,
            **common,
            "kind": kind,
            "size": len(ds),
            "episodes": int(len(returns)),
            "behaviour_sampling": ds.metadata.get("behaviour_sampling", "stochastic"),  # random: uniform
            "behaviour_return": behaviour,
        }
        D.validate(ds, args.env, paths[kind])
        D.save(paths[kind], ds)
        made[kind] = paths[kind]
        try:
            scores = [f"dataset refs {S.normalized_score(behaviour, metadata=ds.metadata, reference='dataset'):.1f}"]
        except ValueError:
            scores = ["dataset refs unavailable (no ref_max_score)"]
        if name is not None:
            scores.insert(0, f"D4RL refs {S.normalized_score(behaviour, args.env):.1f}")
        print(
            f"{kind}: {paths[kind]}\n  {len(ds)} rows, {len(returns)} complete episodes, behaviour return "
            f"{behaviour:.1f}; normalised: {', '.join(scores)} (ref_min {refs['ref_min_score']:.1f}, "
            f"ref_max {refs['ref_max_score']:.1f})"
        )
    return made


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = tyro.cli(Args, args=argv, prog="make_dataset.py", description=__doc__)
    return make(args, argv)


if __name__ == "__main__":
    main()
