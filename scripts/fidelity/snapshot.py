"""Reading a reference implementation from a fetched snapshot, for the fixture generators here.

A generator reads the reference's file at the snapshot's ``HEAD`` (``read_snapshot``, which also gives
the commit to record), executes its imports (those the generator's venv has) and only the top-level
definitions it names (``load_definitions``), and compiles statements it picks out of the reference's
``__main__`` (``compile_reference``).  The reference's code is executed as it stands, never copied.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import os
import subprocess
import sys

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures")


def fixture_path(name: str) -> str:
    """A generator's default output: ``tests/fixtures/<name>``, which the fixture tests read."""
    return os.path.join(FIXTURES, name)


def _git(git_dir: str, *args: str) -> str:
    gd = git_dir if os.path.exists(os.path.join(git_dir, "HEAD")) else os.path.join(git_dir, ".git")
    return subprocess.run(["git", f"--git-dir={gd}", *args], check=True, capture_output=True, text=True).stdout


def read_snapshot(git_dir: str, path: str):
    """(source, commit) of ``path`` at the snapshot's HEAD (``git_dir``: a bare git directory or a work tree)."""
    return _git(git_dir, "show", f"HEAD:{path}"), _git(git_dir, "rev-parse", "HEAD").strip()


def compile_reference(nodes, filename: str, lazy_annotations: bool = False):
    """The reference's statements compiled as they stand, with real annotations (a dataclass such as
    CleanRL's ``Args`` needs them), or with ``lazy_annotations`` unevaluated (for definitions whose
    annotations name module-level aliases that are not executed, such as CORL's ``TensorBatch``)."""
    flags = __future__.annotations.compiler_flag if lazy_annotations else 0
    return compile(ast.Module(list(nodes), []), filename, "exec", flags=flags, dont_inherit=True)


def load_definitions(
    source: str, filename: str, names: set, overrides: dict | None = None, lazy_annotations: bool = False
) -> dict:
    """Execute the module's imports (those this venv has) and then only the top-level definitions named
    in ``names`` (classes, functions, ``NAME = ...`` assignments), in file order, in a fresh namespace;
    ``overrides`` are set after the imports."""
    tree = ast.parse(source, filename)
    ns = {"__name__": "reference_" + os.path.basename(filename).removesuffix(".py")}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                exec(compile_reference([node], filename), ns)
            except ImportError:
                pass  # gym(nasium), d4rl, wandb, tyro, tensorboard: not needed by the definitions run
    ns.update(overrides or {})
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            target = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
        else:
            target = None
        if target in names:
            exec(compile_reference([node], filename, lazy_annotations), ns)
            found.add(target)
    missing = names - found
    if missing:
        raise SystemExit(f"{filename}: definitions not found: {sorted(missing)}")
    return ns


@contextlib.contextmanager
def locals_at_return(names, into: dict):
    """Copy the locals of each function in ``names`` as it returns, as ``into[name]``."""

    def profile(frame, event, arg):
        if event == "return" and frame.f_code.co_name in names:
            into[frame.f_code.co_name] = dict(frame.f_locals)

    sys.setprofile(profile)
    try:
        yield into
    finally:
        sys.setprofile(None)
