"""Run directory: config.json, metrics.csv, eval.csv, optional TensorBoard events.

``metrics.csv`` has one row per log step per seed; ``eval.csv`` one row per evaluation per
seed (``step,seed,return_mean,return_std,episode_returns``).  A multitask (``mt:``) run's
``eval.csv`` (``step,seed,task,return_mean,return_std,episode_returns,score``) has per evaluation
and seed one row per task (``task``: the member id; that task's episodes; ``score`` = return_mean
over the task's maximum return, empty where none is known) and then one ``task=all`` row (the mean
over tasks of the per-task means and of the per-task scores, all the seed's episodes; see
``task_results``).  Files are append-only; when a new metric name appears the
metrics file is rewritten with the wider header, so no row is ever lost.  ``truncate_after`` drops
the rows a resumed run will write again.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

EVAL_COLUMNS = ["step", "seed", "return_mean", "return_std", "episode_returns"]
MT_EVAL_COLUMNS = ["step", "seed", "task", "return_mean", "return_std", "episode_returns", "score"]  # mt: runs
AGGREGATE_TASK = "all"  # the task column's value on a multitask run's aggregate rows


def _read(path: Path):
    if not path.exists():
        return [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _write(path: Path, header, rows):
    """Write the whole table to a temp file and rename it over ``path``: never over something that is
    not a regular file (a rename over /dev/null, run as root, would replace the device)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise OSError(f"{path}: not a regular file; a CSV log must be written to a file path")
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, header, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


class CSVTable:
    """An append-only CSV whose header grows when new columns appear."""

    def __init__(self, path: Path, base_columns):
        self.path = path
        self.header, _ = _read(path)
        if not self.header:
            self.header = list(base_columns)
            _write(path, self.header, [])

    def append(self, rows: list[dict]):
        new = [k for r in rows for k in r if k not in self.header]
        if new:
            _, old = _read(self.path)
            self.header += list(dict.fromkeys(new))
            _write(self.path, self.header, old)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.header, extrasaction="ignore").writerows(rows)

    def truncate_after(self, step: int, before: int | None = None):
        """Keep the rows at or before ``step`` (and, if given, strictly before ``before``)."""
        header, rows = _read(self.path)
        last = step if before is None else min(step, before - 1)
        _write(self.path, header, [r for r in rows if int(float(r["step"])) <= last])


class RunLogger:
    """``multitask``: the run's env is an ``mt:`` id (eval.csv gets ``MT_EVAL_COLUMNS``, per-task rows)."""

    def __init__(
        self, run_dir: str | Path, tensorboard: bool = False, multitask: bool = False, wandb: dict | None = None
    ):
        """``wandb``: ``wandb.init``'s project / entity / group / tags / mode (``wandb_settings``), or None."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics = CSVTable(self.dir / "metrics.csv", ["step", "seed"])
        self.evals = CSVTable(self.dir / "eval.csv", MT_EVAL_COLUMNS if multitask else EVAL_COLUMNS)
        self.tb: dict | None = None  # seed -> its TensorBoard writer (tb/seed<j>: the seeds overlay as runs)
        self.config: dict | None = None
        self.last_eval: dict[int, float] = {}
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise SystemExit("--tensorboard needs tensorboardX: pip install -e '.[tb]'") from e
            self.tb = _PerSeed(lambda j: SummaryWriter(str(self.dir / "tb" / f"seed{j}")))
        self.provenance: dict | None = None
        self.wb: dict | None = None  # seed -> its W&B run, started on first use (the config is known by then)
        if wandb is not None:
            require_wandb()
            self.wb_settings = wandb
            self.wb = _PerSeed(self._wandb_run)

    def write_config(self, config: dict, provenance: dict | None = None):
        """``config.json``: the run's flags and, when given, where and with what it starts
        (``training/provenance.py``)."""
        self.config, self.provenance = config, provenance
        self._write_json("config.json", config if provenance is None else {**config, "provenance": provenance})

    def record_resume(self, config: dict, step: int, provenance: dict):
        """``config.json`` after a ``--resume`` from ``step``: the flags as they are now (a new
        ``--total-steps``), the start's provenance kept, and this resume appended to ``resumes``."""
        path = self.dir / "config.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        resumes = list(old.get("resumes", [])) + [
            {"step": step, "total_steps": config.get("total_steps"), **provenance}
        ]
        kept = {"provenance": old["provenance"]} if "provenance" in old else {}
        self.config, self.provenance = config, old.get("provenance", provenance)
        self._write_json("config.json", {**config, **kept, "resumes": resumes})

    def _write_json(self, name: str, d: dict):
        tmp = self.dir / f".{name}.tmp"
        with open(tmp, "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)
        os.replace(tmp, self.dir / name)  # whole or not at all: a reader never sees half a file

    def log_metrics(self, step: int, per_seed: list[dict]):
        rows = [{"step": step, "seed": j, **{k: _fmt(v) for k, v in m.items()}} for j, m in enumerate(per_seed)]
        self.metrics.append(rows)
        if self.tb is not None:
            for j, m in enumerate(per_seed):
                for k, v in m.items():
                    self.tb[j].add_scalar(k, float(v), step)
        if self.wb is not None:
            for j, m in enumerate(per_seed):
                self.wb[j].log({k: float(v) for k, v in m.items()}, step=step)

    def log_eval(self, step: int, returns, extra: list[dict] | None = None, tasks=None):
        """``returns``: per seed, the list of evaluation episode returns; ``extra``: per seed, more
        columns (e.g. normalised scores).  ``tasks``: the member ids of an ``mt:`` env, whose episode
        ``k`` ran task ``k % len(tasks)``: per seed one row per task and a ``task=all`` row (which
        gets ``extra``'s columns), as ``task_results`` computes them."""
        import numpy as np

        if tasks is not None:
            return self._log_task_eval(step, returns, extra, tasks)
        rows = []
        for j, r in enumerate(returns):
            r = np.asarray(r, float)
            rows.append(
                {
                    "step": step,
                    "seed": j,
                    "return_mean": _fmt(r.mean()),
                    "return_std": _fmt(r.std()),
                    "episode_returns": " ".join(_fmt(x) for x in r),
                    **{k: _fmt(v) for k, v in (extra[j] if extra else {}).items()},
                }
            )
            self.last_eval[j] = float(r.mean())
            if self.tb is not None:
                self.tb[j].add_scalar("eval/return", float(r.mean()), step)
            if self.wb is not None:
                self.wb[j].log(
                    {
                        "eval/return": float(r.mean()),
                        **{f"eval/{k}": float(v) for k, v in (extra[j] if extra else {}).items()},
                    },
                    step=step,
                )
        self.evals.append(rows)

    def _log_task_eval(self, step: int, returns, extra, tasks):
        rows = []
        for j, r in enumerate(returns):
            for res in task_results(r, tasks):
                aggregate = res["task"] == AGGREGATE_TASK
                rows.append(
                    {
                        "step": step,
                        "seed": j,
                        "task": res["task"],
                        "return_mean": _fmt(res["return_mean"]),
                        "return_std": _fmt(res["return_std"]),
                        "episode_returns": " ".join(_fmt(x) for x in res["returns"]),
                        "score": "" if res["score"] is None else _fmt(res["score"]),
                        **{k: _fmt(v) for k, v in (extra[j] if extra and aggregate else {}).items()},
                    }
                )
                if aggregate:
                    self.last_eval[j] = float(res["return_mean"])
                if self.tb is not None:
                    name = re.sub(r"[^-/.\w]", "_", res["task"])  # a TensorBoard tag: dmc:x-y -> dmc_x-y
                    tag = "eval" if aggregate else f"eval_tasks/{name}"
                    self.tb[j].add_scalar(f"{tag}/return", res["return_mean"], step)
                    if res["score"] is not None:
                        self.tb[j].add_scalar(f"{tag}/score", res["score"], step)
                if self.wb is not None:
                    key = "eval" if aggregate else f"eval_tasks/{res['task']}"
                    self.wb[j].log(
                        {
                            f"{key}/return": res["return_mean"],
                            **({f"{key}/score": res["score"]} if res["score"] is not None else {}),
                        },
                        step=step,
                    )
        self.evals.append(rows)

    def truncate_after(self, step: int, evals_before: int | None = None):
        """Drop metric rows after ``step`` and evaluation rows after it or at/after ``evals_before``
        (the evaluations a resumed run will redo)."""
        self.metrics.truncate_after(step)
        self.evals.truncate_after(step, evals_before)

    def close(self):
        """Close the TensorBoard writers, each with its hyperparameters (the run's scalar flags) and its
        seed's last evaluation return, for TensorBoard's HPARAMS view; finish the W&B runs."""
        for run in (self.wb or {}).values():
            run.finish()
        if self.tb is None:
            return
        for j, writer in self.tb.items():
            if self.config is not None and j in self.last_eval:
                writer.add_hparams(hparams(self.config), {"hparams/last_eval_return": self.last_eval[j]}, name=".")
            writer.close()

    def _wandb_run(self, j: int):
        """Seed ``j``'s W&B run (``wandb_run``), with the run's config and provenance."""
        config = {**(self.config or {}), "seed_index": j, "provenance": self.provenance}
        return wandb_run(self.dir, self.wb_settings, j, config)


def wandb_run(run_dir, settings: dict, j: int, config: dict | None = None):
    """Seed ``j``'s W&B run of ``run_dir``, started or continued: its id is fixed by the run directory
    and the seed, so a ``--resume`` (and ``scripts/evaluate.py --video``) continues it; grouped by the
    run directory's name unless ``--wandb-group`` says otherwise.  ``settings``: ``wandb_settings``."""
    import wandb

    run_dir = Path(run_dir)
    rid = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16] + f"-seed{j}"
    return wandb.init(
        project=settings["project"],
        entity=settings["entity"],
        group=settings["group"] or run_dir.name,
        tags=list(settings["tags"]) or None,
        mode=settings["mode"],
        dir=str(run_dir),
        id=rid,
        name=f"{run_dir.name}/seed{j}",
        resume="allow",
        reinit="create_new",
        config=config,
    )


def wandb_video(run_dir, settings: dict, j: int, path, fps: float, values: dict) -> None:
    """A video of seed ``j``'s policy (``scripts/evaluate.py --video``) into that seed's W&B run, as
    ``eval/video``, with ``values`` (e.g. the episode's return and the checkpoint's step) beside it."""
    import wandb

    run = wandb_run(run_dir, settings, j)
    try:
        video = wandb.Video(str(path), fps=max(1, round(fps)))  # the format from the file's suffix
        run.log({"eval/video": video, **values})
    finally:
        run.finish()


def wandb_settings(cfg) -> dict | None:
    """``RunLogger``'s ``wandb`` argument from a ``RunConfig`` (None without ``--wandb``)."""
    if not cfg.wandb:
        return None
    return {
        "project": cfg.wandb_project,
        "entity": cfg.wandb_entity,
        "group": cfg.wandb_group,
        "tags": tuple(cfg.wandb_tags),
        "mode": cfg.wandb_mode,
    }


def require_wandb():
    """--wandb without the wandb package: one clear line (preflight calls this before a run directory exists)."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise SystemExit("--wandb needs the wandb package: pip install -e '.[wandb]'")


class _PerSeed(dict):
    """seed -> writer, each made on first use by ``make(seed)``."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, j):
        self[j] = self.make(j)
        return self[j]


def hparams(config: dict, prefix: str = "") -> dict:
    """The scalar (and string) flags of a ``config.json`` dict, nested names joined by '.'."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(hparams(v, f"{prefix}{k}."))
        elif isinstance(v, (bool, int, float, str)):
            out[prefix + k] = v
    return out


def _fmt(v) -> str:
    return repr(float(v))


def task_max_return(member_id: str) -> float | None:
    """The largest return an episode of a multitask member can earn, for normalised scores:
    1000 for ``dmc:`` tasks (Control Suite rewards are in [0, 1] per control step over 1000 steps;
    the action repeat sums the rewards of the steps it repeats, so the episode's total is the same);
    None for any other member (no known maximum: its score, and the aggregate's, stay empty)."""
    return 1000.0 if member_id.startswith("dmc:") else None


def task_results(returns, tasks) -> list[dict]:
    """One seed's evaluation of an ``mt:`` env summarised per task, then over tasks.

    ``returns``: the seed's episode returns in episode order (episode ``k`` ran task ``k % T``);
    ``tasks``: the member ids.  -> T + 1 dicts ``{task, returns, return_mean, return_std, score}``:
    one per task (its episodes; ``score`` = return_mean / ``task_max_return``, None without a known
    maximum), then ``task="all"``: ``return_mean`` the mean over tasks of the per-task means,
    ``score`` the mean over tasks of the per-task scores (None if any task has none), and
    ``returns`` / ``return_std`` all the seed's episodes (in episode order) and their std."""
    r, T = np.asarray(returns, float), len(tasks)
    if r.size % T:
        raise ValueError(f"{r.size} evaluation returns do not split over {T} tasks")
    rows = []
    for t, name in enumerate(tasks):
        own, top = r[t::T], task_max_return(name)
        mean = float(own.mean())
        rows.append(
            {
                "task": name,
                "returns": own.tolist(),
                "return_mean": mean,
                "return_std": float(own.std()),
                "score": None if top is None else mean / top,
            }
        )
    scores = [row["score"] for row in rows]
    mean = float(np.mean([row["return_mean"] for row in rows]))
    rows.append(
        {
            "task": AGGREGATE_TASK,
            "returns": r.tolist(),
            "return_mean": mean,
            "return_std": float(r.std()),
            "score": None if None in scores else float(np.mean(scores)),
        }
    )
    return rows
