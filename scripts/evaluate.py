"""Evaluate a run's checkpoint:  python scripts/evaluate.py RUN_DIR [options]

    python scripts/evaluate.py runs/<dir>                          # last checkpoint, every seed
    python scripts/evaluate.py runs/<dir> --step 50000 --seed 1    # that checkpoint, seed index 1
    python scripts/evaluate.py runs/<dir> --episodes 20 --out hopper-eval.csv
    python scripts/evaluate.py runs/<dir> --video cheetah.gif      # also a video of the first episode
    python scripts/evaluate.py runs/<dir> --video cheetah.mp4 --video-size 640x480 --fps 30

Loads the run's newest intact checkpoint (or ``--step N``), runs ``--episodes`` deterministic
episodes per seed (default: the run's ``--eval-episodes``) on the run's env (or ``--env ID``, any
env with the same observation and action shapes) with the evaluation env seeds, action repeat and
action mode of the run's own evaluations, so on the run's env the returns equal the run's
``eval.csv`` at that step (a ``ns:`` run's env follows its schedule to the checkpoint's step, as
the run's evaluations do; offline runs evaluate on their dataset's env).  Seed j's episode k
resets with the env seed the run gives it (``training/evaluation.py: run_evaluator``), so with
more ``--episodes`` the run's own come first.  Prints each seed's mean, std and episode returns
and appends them to ``--out`` (default ``RUN_DIR/evaluate.csv``:
``step,seed,env,return_mean,return_std,episode_returns``); the run's own files (``eval.csv``,
``metrics.csv``, ``config.json``, ``ckpt/``) are never written.  On a multitask (``mt:``) env
``--episodes`` counts episodes per task and seed, and each seed gets, as in the run's ``eval.csv``,
one row per task and a ``task=all`` row (the mean over tasks; columns ``task`` and ``score``, the
return over the task's maximum, ``training/evaluation.py: task_results``).

``--video PATH`` records the first episode of ``--seed`` (default seed 0) again, the same episode
with the same actions, one frame at the reset and one per agent step (with an action repeat of k,
one frame per k steps of the underlying env): ``.gif`` (Pillow) or ``.mp4`` (needs ``imageio`` and
``imageio-ffmpeg``).  ``--fps`` defaults to real time (1 / (control timestep x action repeat)).
Gymnasium MuJoCo envs (from the model's ``track`` camera where it has one, which follows the
body), ``dmc:`` tasks (camera 0) and ``ns:`` variants of them render with MuJoCo's OpenGL: the first
backend that renders here of ``$MUJOCO_GL`` (if set), egl, osmesa and glfw, each tried in a
subprocess, is used and named.  Pendulum-v1 is drawn with numpy (no OpenGL, no pygame); other
Gymnasium envs use their own renderer (classic control and Box2D need pygame).  On a run trained with
``--wandb``, the video also goes to that seed's W&B run (the same run, continued; offline if the run
was), as ``eval/video`` beside ``eval/video_return`` and ``eval/video_step``; ``--no-wandb`` keeps it local.

A mistake (a directory that is no run, a missing checkpoint or step, an env of other shapes, a bad
value) stops with one ``error:`` line and exit status 2; ``--debug`` (or RLZOO_DEBUG=1) shows the
traceback.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as scripts/train.py

try:
    from plasticity_zoo import training  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from plasticity_zoo.training.run import RUN_FILES  # noqa: E402  (imports no MuJoCo: MUJOCO_GL is still open)

OUT_NAME = "evaluate.csv"
OUT_COLUMNS = ["step", "seed", "env", "return_mean", "return_std", "episode_returns"]
MT_OUT_COLUMNS = ["step", "seed", "env", "task", "return_mean", "return_std", "episode_returns", "score"]  # mt: envs
VIDEO_FORMATS = (".gif", ".mp4")
GL_BACKENDS = ("egl", "osmesa", "glfw")
GL_PACKAGES = (
    "EGL: libegl1 with a GPU driver or Mesa (Debian/Ubuntu: apt-get install libegl1 libgl1-mesa-dri); "
    "OSMesa (software): libosmesa6; glfw: a display"
)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python scripts/evaluate.py",
        description=__doc__.strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="a run directory (written by scripts/train.py)")
    p.add_argument(
        "--step", type=int, default=None, help="the checkpoint of this step (default: the newest intact one)"
    )
    p.add_argument("--seed", type=int, default=None, help="evaluate this seed index only (default: every seed)")
    p.add_argument("--episodes", type=int, default=None, help="episodes per seed (default: the run's --eval-episodes)")
    p.add_argument("--env", default=None, help="evaluate on this env id (same observation and action shapes)")
    p.add_argument("--out", default=None, help=f"CSV the results are appended to (default: RUN_DIR/{OUT_NAME})")
    p.add_argument("--video", default=None, help="record the first episode of --seed (or seed 0): a .gif or .mp4")
    p.add_argument("--video-size", default="320x240", help="video frame size WIDTHxHEIGHT (default 320x240)")
    p.add_argument("--fps", type=float, default=None, help="video frames per second (default: real time)")
    p.add_argument(
        "--no-wandb", action="store_true", help="on a run trained with --wandb, do not log the video to its W&B run"
    )
    return p.parse_args(argv)


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--video-size {text!r}: expected WIDTHxHEIGHT, e.g. 320x240") from None
    if not (16 <= w <= 4096 and 16 <= h <= 4096):
        raise SystemExit(f"--video-size {text}: width and height must be in [16, 4096]")
    return w, h


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output(path: Path, run_dir: Path, flag: str):
    """Refuse to write over the run's own files or into its checkpoints."""
    p, rd = path.resolve(), run_dir.resolve()
    if _inside(p, rd / "ckpt"):
        raise SystemExit(f"{flag} {path}: inside the run's checkpoint folder {run_dir / 'ckpt'}; choose another path")
    if p.parent == rd and p.name in RUN_FILES:
        raise SystemExit(f"{flag} {path} is the run's own {p.name}; choose another file")
    if p.exists() and not p.is_file():  # the CSV is rewritten by rename when its header grows
        raise SystemExit(f"{flag} {path} is not a regular file; give a file name")


def check_video(path: Path, size: tuple[int, int]):
    ext = path.suffix.lower()
    if ext not in VIDEO_FORMATS:
        raise SystemExit(f"--video {path}: write a .gif (Pillow) or an .mp4 (imageio with imageio-ffmpeg)")
    if ext == ".mp4":
        missing = [
            m
            for m, pkg in (("imageio", "imageio"), ("imageio_ffmpeg", "imageio-ffmpeg"))
            if importlib.util.find_spec(m) is None
        ]
        if missing:
            raise SystemExit(
                f"--video {path}: MP4 needs imageio and imageio-ffmpeg ({', '.join(missing)} missing): "
                "pip install imageio imageio-ffmpeg (the project's extra: pip install -e '.[video]'), "
                "or write a .gif"
            )
        if size[0] % 2 or size[1] % 2:
            raise SystemExit(f"--video-size {size[0]}x{size[1]}: MP4 (H.264) needs an even width and height")
    elif importlib.util.find_spec("PIL") is None:
        raise SystemExit(f"--video {path}: GIF needs Pillow: pip install pillow")


# ----------------------------------------------------------------------------------------------
# OpenGL for MuJoCo: chosen before MuJoCo is imported
# ----------------------------------------------------------------------------------------------
_PROBE_XML = "<mujoco><worldbody><light pos='0 0 2'/><geom size='0.1'/></worldbody></mujoco>"
PROBES = {
    "mujoco": (
        "import mujoco\n"
        f"m = mujoco.MjModel.from_xml_string({_PROBE_XML!r})\n"
        "d = mujoco.MjData(m)\nmujoco.mj_forward(m, d)\n"
        "r = mujoco.Renderer(m, 16, 16)\nr.update_scene(d)\nr.render()\nr.close()\n"
    ),
    "dm_control": (
        "from dm_control import mujoco\n"
        f"p = mujoco.Physics.from_xml_string({_PROBE_XML!r})\n"
        "p.render(16, 16)\np.free()\n"
    ),
}


def render_needs(env_id: str) -> set[str]:
    """Which MuJoCo renderers an env id's frames need: ``mujoco`` (Gymnasium MuJoCo), ``dm_control``
    (``dmc:``); empty for envs drawn without OpenGL."""
    if env_id.startswith("dmc:"):
        return {"dm_control"}
    if env_id.startswith("ns:"):
        from plasticity_zoo.envs import nonstationary

        return set().union(*(render_needs(b) for b in nonstationary.parse(env_id).bases))
    if env_id.startswith("mt:"):
        from plasticity_zoo.envs.multitask import member_ids

        return set().union(*(render_needs(m) for m in member_ids(env_id)))
    import gymnasium as gym

    spec = gym.registry.get(env_id)
    return {"mujoco"} if spec is not None and "mujoco" in str(spec.entry_point) else set()


def probe_gl(backend: str, needs: set[str]) -> str | None:
    """None if MuJoCo renders with ``MUJOCO_GL=backend`` in a fresh process, else why not (one line)."""
    env = {**os.environ, "MUJOCO_GL": backend}
    for need in sorted(needs):
        try:
            done = subprocess.run(
                [sys.executable, "-c", PROBES[need]], env=env, capture_output=True, text=True, timeout=120
            )
        except subprocess.TimeoutExpired:
            return "timed out"
        if done.returncode != 0:
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            return lines[-1] if lines else f"exit status {done.returncode}"
    return None


def select_gl(needs: set[str]) -> str:
    """Set ``MUJOCO_GL`` to the first backend that renders (``$MUJOCO_GL`` if set, then egl, osmesa,
    glfw) and return it; SystemExit naming what to install if none does."""
    current = os.environ.get("MUJOCO_GL", "").strip().lower()
    if "mujoco" in sys.modules or "dm_control" in sys.modules:  # too late to choose: MuJoCo read it at import
        return f"{current or 'glfw'} (set before MuJoCo was imported in this process)"
    failures = []
    for backend in dict.fromkeys(([current] if current else []) + list(GL_BACKENDS)):
        why = probe_gl(backend, needs)
        if why is None:
            os.environ["MUJOCO_GL"] = backend
            if backend in ("egl", "osmesa") and not os.environ.get("PYOPENGL_PLATFORM"):
                os.environ["PYOPENGL_PLATFORM"] = backend
            if failures:
                print(f"MUJOCO_GL: {'; '.join(failures)}; using {backend}", file=sys.stderr)
            return backend
        failures.append(f"{backend} failed ({why})")
    platform = os.environ.get("PYOPENGL_PLATFORM")
    also = f"; PYOPENGL_PLATFORM={platform} is set, it must name the same backend or be unset" if platform else ""
    raise SystemExit(
        f"--video: MuJoCo cannot render here: no OpenGL backend works (MUJOCO_GL={'; '.join(failures)}"
        f"{also}). Install one: {GL_PACKAGES}; then set MUJOCO_GL to it (or leave it unset to try each)"
    )


# ----------------------------------------------------------------------------------------------
# Frames
# ----------------------------------------------------------------------------------------------
_GRID: dict = {}  # (width, height) -> pixel centres


def pendulum_frame(theta: float, width: int, height: int) -> np.ndarray:
    """Pendulum-v1 drawn as Gymnasium draws it (pivot at the centre, rod of length 1 in a 2.2 x 2.2
    view, upright at theta = 0), with numpy instead of pygame."""
    if (width, height) not in _GRID:
        ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
        _GRID.clear()
        _GRID[(width, height)] = (xs, ys)
    xs, ys = _GRID[(width, height)]
    scale = min(width, height) / 2.2
    cx, cy = width / 2, height / 2
    dx, dy = -math.sin(theta) * scale, -math.cos(theta) * scale  # image rows grow downwards
    t = np.clip(((xs - cx) * dx + (ys - cy) * dy) / (dx * dx + dy * dy), 0.0, 1.0)
    rod = np.hypot(xs - cx - t * dx, ys - cy - t * dy) <= 0.1 * scale
    axle = np.hypot(xs - cx, ys - cy) <= 0.05 * scale
    frame = np.full((height, width, 3), 255, np.uint8)
    frame[rod] = (204, 77, 77)
    frame[axle] = (0, 0, 0)
    return frame


class Renderer:
    """``frame(env)``: the current frame of ``env``'s active base env at ``size`` (width, height)."""

    def __init__(self, env_id: str, size: tuple[int, int]):
        self.env_id, (self.width, self.height) = env_id, size
        self._draw = {}

    def __call__(self, env) -> np.ndarray:
        base = env.unwrapped  # ns: the active task's base env
        if id(base) not in self._draw:
            self._draw[id(base)] = self._setup(base)
        try:
            frame = np.asarray(self._draw[id(base)]())
        except Exception as e:
            raise SystemExit(
                f"--video: rendering {self.env_id} failed ({type(e).__name__}: {e}) with "
                f"MUJOCO_GL={os.environ.get('MUJOCO_GL', '(unset)')}; {GL_PACKAGES}"
            ) from e
        if frame.shape != (self.height, self.width, 3):
            from PIL import Image

            frame = np.asarray(Image.fromarray(frame[..., :3]).resize((self.width, self.height)))
        return frame

    def _setup(self, base):
        from plasticity_zoo.envs.dmc import DMCEnv

        w, h = self.width, self.height
        if isinstance(base, DMCEnv):
            physics = base._env.physics
            glob = physics.model.vis.global_
            glob.offwidth, glob.offheight = max(glob.offwidth, w), max(glob.offheight, h)
            return lambda: physics.render(height=h, width=w, camera_id=0)
        if hasattr(base, "mujoco_renderer"):  # Gymnasium MuJoCo, at this size
            import mujoco

            glob, renderer = base.model.vis.global_, base.mujoco_renderer
            glob.offwidth, glob.offheight = max(glob.offwidth, w), max(glob.offheight, h)
            renderer.width, renderer.height = w, h
            # the model's camera that follows the body (HalfCheetah, Hopper, Walker2d, Ant, Humanoid,
            # Swimmer), where the env's default is Gymnasium's free camera, which does not follow it
            track = mujoco.mj_name2id(base.model, mujoco.mjtObj.mjOBJ_CAMERA, "track")
            if track != -1 and renderer.camera_id in (None, -1):
                renderer.camera_id = track
            base.render_mode = "rgb_array"
            return base.render
        from gymnasium.envs.classic_control.pendulum import PendulumEnv

        if isinstance(base, PendulumEnv):
            return lambda: pendulum_frame(float(base.state[0]), w, h)
        if "rgb_array" not in base.metadata.get("render_modes", []):
            raise SystemExit(f"--video: {self.env_id} cannot render frames (no rgb_array render mode)")
        base.render_mode = "rgb_array"

        def render():
            import gymnasium as gym

            try:
                return base.render()
            except gym.error.DependencyNotInstalled as e:
                raise SystemExit(
                    f"--video: {self.env_id} renders with pygame, which is not installed: pip install pygame"
                ) from e

        return render


def agent_step_seconds(env) -> float | None:
    """Simulated seconds per agent step (the base env's control timestep x the action repeat), if known."""
    from plasticity_zoo.analysis.restore import action_repeat_of
    from plasticity_zoo.envs.dmc import DMCEnv

    repeat = action_repeat_of(env)
    base = env.unwrapped
    if isinstance(base, DMCEnv):
        return float(base._env.control_timestep()) * repeat
    if getattr(base, "dt", None):
        return float(base.dt) * repeat
    fps = base.metadata.get("render_fps")
    return repeat / float(fps) if fps else None


class VideoWriter:
    """Frames into a GIF (Pillow; frames are palettised as they come) or an MP4 (imageio-ffmpeg, streamed)."""

    def __init__(self, path: Path, fps: float):
        self.path, self.fps, self.frames = path, fps, 0
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix.lower() == ".mp4":
            import warnings

            import imageio.v2 as imageio

            # ffmpeg runs in a subprocess (fork and exec at once), which JAX's fork warning does not concern
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)

            self._mp4 = imageio.get_writer(
                str(path), fps=fps, codec="libx264", macro_block_size=1, pixelformat="yuv420p", quality=8
            )
        else:
            self._mp4, self._gif = None, []

    def add(self, frame: np.ndarray):
        self.frames += 1
        if self._mp4 is not None:
            self._mp4.append_data(frame)
        else:
            from PIL import Image

            self._gif.append(Image.fromarray(frame).convert("P", palette=Image.Palette.ADAPTIVE))

    def abort(self):
        """Stop without a video: nothing (or nothing partial) is left at ``path``."""
        if self._mp4 is not None:
            try:
                self._mp4.close()
            finally:
                self.path.unlink(missing_ok=True)

    def close(self):
        if self._mp4 is not None:
            self._mp4.close()
        else:  # durations in ms (GIF keeps centiseconds); identical consecutive frames merge, keeping the time
            self._gif[0].save(
                self.path, save_all=True, append_images=self._gif[1:], duration=max(10, round(1000 / self.fps)), loop=0
            )


def record(
    restored, env_id: str, seed: int, row: int, evaluator, policy, renderer, path: Path, fps: float | None
) -> dict:
    """Replay seed ``seed``'s first evaluation episode in one env, rendering each agent step.

    The env is built and reset as ``evaluator``'s env of that episode, and ``policy`` (a SeedPolicy
    over the evaluated seeds, ``row`` the seed's row) is called on arrays shaped as in the evaluation,
    so the actions, and the return, are the evaluation's own."""
    from plasticity_zoo.envs import make_env, nonstationary
    from plasticity_zoo.training.loops import eval_action_mode

    cfg, episodes = restored.cfg, evaluator.episodes
    env_seed = evaluator.env_seeds[row * episodes]
    env = make_env(env_id, env_seed, cfg.action_repeat, action_mode=eval_action_mode(cfg, restored.agent))
    try:
        if (
            env_id == restored.env_id
            and restored.counter is not None
            and isinstance(env, nonstationary.NonStationaryEnv)
        ):
            env.bind_counter(nonstationary.FollowCounter(restored.counter))
        seconds = agent_step_seconds(env)
        fps = fps or (1.0 / seconds if seconds else 30.0)
        obs, _ = env.reset(seed=env_seed)
        policy.reset()  # a recurrent agent's memory starts with the episode
        writer = VideoWriter(path, fps)
        try:
            writer.add(renderer(env))
            rows = len(policy.seeds)
            total, steps, done = 0.0, 0, False
            while not done:
                batch = np.broadcast_to(np.asarray(obs, np.float32), (rows, episodes, obs.shape[-1]))
                action = np.asarray(policy(batch)[row, 0], np.float32)
                obs, reward, terminated, truncated, _ = env.step(action)
                policy.observe(np.full((rows, episodes), np.float32(reward)))
                total += float(np.float32(reward))  # as VectorEnv stores rewards
                steps += 1
                done = terminated or truncated
                writer.add(renderer(env))
        except BaseException:
            writer.abort()
            raise
        writer.close()
    finally:
        env.close()
    return {"path": str(path), "frames": writer.frames, "steps": steps, "return": total, "fps": fps, "seed": seed}


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------
def _own_eval(run_dir: Path, step: int) -> dict[int, list[float]]:
    """The run's eval.csv returns at ``step``, per seed, in episode order (a multitask run's
    ``task=all`` rows); empty if it has none there."""
    path = run_dir / "eval.csv"
    if not path.is_file():
        return {}
    with open(path, newline="") as f:
        return {
            int(r["seed"]): [float(x) for x in r["episode_returns"].split()]
            for r in csv.DictReader(f)
            if r.get("step") and int(float(r["step"])) == step and r.get("task") in (None, "", "all")
        }


def main(argv=None) -> dict:
    args = parse(argv)
    from plasticity_zoo.networks.runtime import use_persistent_cache

    use_persistent_cache()  # the run's programs, compiled once (networks/runtime.py)
    run_dir = Path(args.run_dir)
    if args.episodes is not None and args.episodes < 1:
        raise SystemExit(f"--episodes must be >= 1, got {args.episodes}")
    if args.fps is not None and not args.fps > 0:
        raise SystemExit(f"--fps must be > 0, got {args.fps}")
    size = _size(args.video_size)
    if not run_dir.is_dir():
        raise SystemExit(f"{run_dir}: no such run directory")
    if not (run_dir / "config.json").is_file():
        raise SystemExit(f"{run_dir}: not a run directory (no config.json)")
    from plasticity_zoo.analysis.restore import restore_policy, run_env_id
    from plasticity_zoo.training.logger import CSVTable
    from plasticity_zoo.training.run import load_config

    cfg = load_config(run_dir)
    if args.seed is not None and not 0 <= args.seed < cfg.seeds:
        raise SystemExit(f"--seed {args.seed}: the run has {cfg.seeds} seed(s), indices 0..{cfg.seeds - 1}")
    out = Path(args.out) if args.out else run_dir / OUT_NAME
    check_output(out, run_dir, "--out")
    video = Path(args.video) if args.video else None
    if video is not None:
        check_output(video, run_dir, "--video")
        check_video(video, size)
        if video.resolve() == out.resolve():
            raise SystemExit("--video and --out name the same file")
    wandb = None  # the run's W&B settings, where the video goes too
    if video is not None and cfg.wandb and not args.no_wandb:
        import importlib.util

        from plasticity_zoo.training.logger import wandb_settings

        if importlib.util.find_spec("wandb") is None:
            raise SystemExit(
                "the run logs to W&B (--wandb), and --video would go there too: pip install -e '.[wandb]', "
                "or pass --no-wandb"
            )
        wandb = wandb_settings(cfg)
    run_env = run_env_id(run_dir, cfg)
    env_id = args.env or run_env
    gl = None
    if video is not None:
        needs = render_needs(env_id)
        if needs:
            gl = select_gl(needs)  # before anything imports MuJoCo (restoring a checkpoint does)

    if args.env is not None and args.env != run_env:
        _check_compatible(args.env, run_env, cfg)
    restored = restore_policy(
        run_dir,
        args.step,  # a damaged newest checkpoint is skipped, saying so
        warn=lambda m: print(m.replace("; resuming from ", "; evaluating "), file=sys.stderr),
    )
    episodes = args.episodes or cfg.eval_episodes
    seeds = list(range(cfg.seeds)) if args.seed is None else [args.seed]
    evaluator = restored.evaluator(args.env, episodes, args.seed)
    policy = restored.policy(args.seed)
    try:
        returns = evaluator(policy)
    finally:
        evaluator.env.close()

    tasks = evaluator.tasks  # an mt: env's member ids: rows per task, then their mean
    print(
        f"{run_dir}: checkpoint {restored.path.name} (step {restored.step}), env {env_id}, "
        f"{episodes} deterministic episode(s) per {'task and ' if tasks else ''}seed"
    )
    rows, means = [], []
    for j, r in zip(seeds, returns):
        r = np.asarray(r, float)
        if tasks is None:
            print(f"  seed {j}: mean {r.mean():.2f}  std {r.std():.2f}  episodes: {' '.join(f'{x:.2f}' for x in r)}")
            rows.append(
                {
                    "step": restored.step,
                    "seed": j,
                    "env": env_id,
                    "return_mean": repr(float(r.mean())),
                    "return_std": repr(float(r.std())),
                    "episode_returns": " ".join(repr(float(x)) for x in r),
                }
            )
            means.append(float(np.mean(r)))
            continue
        from plasticity_zoo.training.logger import task_results

        for res in task_results(r, tasks):
            score = "" if res["score"] is None else f"  score {res['score']:.3f}"
            print(
                f"  seed {j} {res['task']}: mean {res['return_mean']:.2f}  std {res['return_std']:.2f}{score}"
                f"  episodes: {' '.join(f'{x:.2f}' for x in res['returns'])}"
            )
            rows.append(
                {
                    "step": restored.step,
                    "seed": j,
                    "env": env_id,
                    "task": res["task"],
                    "return_mean": repr(res["return_mean"]),
                    "return_std": repr(res["return_std"]),
                    "episode_returns": " ".join(repr(float(x)) for x in res["returns"]),
                    "score": "" if res["score"] is None else repr(res["score"]),
                }
            )
        means.append(res["return_mean"])  # the task=all row
    if len(seeds) > 1:
        print(f"  mean over seeds{' (of the means over tasks)' if tasks else ''}: {float(np.mean(means)):.2f}")
    own = _own_eval(run_dir, restored.step) if env_id == run_env else {}
    if own and all(j in own for j in seeds):  # its episodes are the first ones here
        n = min(episodes, cfg.eval_episodes) * (len(tasks) if tasks else 1)  # episode k ran task k % T
        same = all(own[j][:n] == list(r)[:n] for j, r in zip(seeds, returns))
        common = "" if episodes == cfg.eval_episodes else f" in its first {n} episode(s)"
        print(
            f"  the run's own evaluation at step {restored.step} (eval.csv): "
            + (
                f"the same returns{common}"
                if same
                else f"DIFFERENT returns{common}: "
                + "; ".join(f"seed {j}: {' '.join(f'{x:.2f}' for x in own[j][:n])}" for j in seeds)
            )
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    CSVTable(out, OUT_COLUMNS if tasks is None else MT_OUT_COLUMNS).append(rows)
    print(f"wrote {out}")
    result = {
        "step": restored.step,
        "checkpoint": str(restored.path),
        "env": env_id,
        "seeds": seeds,
        "returns": returns,
        "out": str(out),
        "video": None,
        "gl": gl,
    }
    if video is not None:
        seed = seeds[0]
        v = record(restored, env_id, seed, 0, evaluator, policy, Renderer(env_id, size), video, args.fps)
        same = "" if v["return"] == returns[0][0] else f" (evaluation: {returns[0][0]:.2f})"
        backend = f"; MUJOCO_GL={gl}" if gl else ""
        print(
            f"wrote {video}: seed {seed}, episode 0, {v['steps']} steps, {v['frames']} frames at "
            f"{v['fps']:.4g} fps, {size[0]}x{size[1]}, return {v['return']:.2f}{same}{backend}"
        )
        result["video"] = v
        if wandb is not None:
            from plasticity_zoo.training.logger import wandb_video

            values = {"eval/video_return": v["return"], "eval/video_step": restored.step}
            wandb_video(run_dir, wandb, seed, video, v["fps"], values)
            print(f"logged {video.name} to seed {seed}'s W&B run ({wandb['mode']})")
    return result


def _check_compatible(env_id: str, run_env: str, cfg):
    from plasticity_zoo import agents
    from plasticity_zoo.envs import make_env
    from plasticity_zoo.training.loops import eval_action_mode

    agent = agents.get(cfg.agent_name)

    shapes = []
    for e in (env_id, run_env):
        env = make_env(e, 0, cfg.action_repeat, action_mode=eval_action_mode(cfg, agent))
        shapes.append((env.observation_space.shape, env.action_space.shape))
        env.close()
    if shapes[0] != shapes[1]:
        raise SystemExit(
            f"--env {env_id} does not fit the run: its observations are {shapes[0][0]} and actions "
            f"{shapes[0][1]}, the run's env {run_env} has {shapes[1][0]} and {shapes[1][1]}"
        )


def cli(argv=None):
    """``main`` with a user error reported as one ``error: <message>`` line on stderr and exit status 2;
    ``--debug`` (anywhere in argv) or RLZOO_DEBUG=1 shows the traceback instead."""
    from plasticity_zoo.training.cli import run_script

    return run_script(main, argv)


if __name__ == "__main__":
    cli()
