"""Every recipe in docs/recipes.md runs as written.

A fenced block whose info string holds ``recipe=NAME`` is a recipe; its other ``key=value``
words say how to run it: ``torchrun=N`` (under ``torchrun --standalone`` with N workers,
else plain ``python``; ``bash`` blocks run with bash), ``runs=K`` (run K times in the same
folder: a resume), ``after=NAME`` (first run that recipe in the folder), ``needs=WHAT`` (skip
when WHAT is missing: ``transformers``, ``export-select`` for ``ckpt export --select``,
``schedule-override`` for the trainer's ``training.override_schedule_on_resume``). The
folder is empty but for a link to ``configs/``; ``python`` and ``ckpt`` on the PATH are this
interpreter and this checkout's CLI.

Each recipe runs once per module: a recipe that others follow (``after=NAME``) is run in its
own folder by whichever test needs it first, and every recipe that follows it starts from a
copy of that folder (what the recipe left behind, as docs/recipes.md says).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e._jobs import ROOT, base_env

RECIPES = ROOT / "docs" / "recipes.md"
_FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```\s*$", re.M | re.S)


def _recipes() -> dict[str, dict]:
    out = {}
    for lang, info, body in _FENCE.findall(RECIPES.read_text()):
        tags = dict(word.split("=", 1) for word in info.split() if "=" in word)
        if "recipe" in tags:
            assert tags["recipe"] not in out, f"two recipes named {tags['recipe']}"
            out[tags["recipe"]] = {"lang": lang, "body": body, **tags}
    return out


ALL = _recipes()


def _missing(need: str) -> str | None:
    if need == "transformers":
        return None if importlib.util.find_spec("transformers") else "transformers not installed"
    if need == "export-select":
        out = subprocess.run([sys.executable, "-m", "ckpt.cli", "export", "--help"],
                             env=base_env(), cwd=ROOT, capture_output=True, text=True)
        return None if "--select" in out.stdout else "ckpt export has no --select yet"
    if need == "schedule-override":
        from trainer.config import TrainingConfig

        fields = getattr(TrainingConfig, "__dataclass_fields__", {})
        return None if "override_schedule_on_resume" in fields else \
            "the trainer has no training.override_schedule_on_resume yet"
    raise AssertionError(f"unknown needs={need}")


def _env(bin_dir: Path) -> dict[str, str]:
    bin_dir.mkdir(exist_ok=True)
    # Scripts, not links: a link to a virtualenv's python elsewhere loses the virtualenv.
    for name, args in (("python", ""), ("ckpt", " -m ckpt.cli")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        shim.chmod(0o755)
    env = base_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(name: str, folder: Path, env: dict[str, str]) -> str:
    """Run recipe ``name`` in ``folder`` (which holds what its ``after=`` recipe left behind,
    if it has one) as many times as it says; returns its output."""
    recipe = ALL[name]
    path = folder / f"{name}.{'sh' if recipe['lang'] == 'bash' else 'py'}"
    path.write_text(recipe["body"])
    if recipe["lang"] == "bash":
        argv = ["bash", "-euo", "pipefail", str(path)]
    elif "torchrun" in recipe:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", recipe["torchrun"], str(path)]
    else:
        assert recipe["lang"] == "python", recipe["lang"]
        argv = [sys.executable, str(path)]
    text = ""
    for i in range(int(recipe.get("runs", 1))):
        out = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True,
                             timeout=300)
        text += out.stdout + out.stderr
        assert out.returncode == 0, f"recipe {name} (run {i + 1}) exited {out.returncode}\n" \
            f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return text


class _Ran:
    """The recipes run so far in this module: ``{name: (folder, output)}``. A recipe runs
    once, in a folder of its own; one that follows another (``after=``) runs in a copy of
    that recipe's folder, so the folder it copies stays as the recipe left it."""

    def __init__(self, base: Path):
        self.base, self.done = base, {}

    def get(self, name: str) -> tuple[Path, str]:
        if name not in self.done:
            work = self.base / name
            folder = work / "work"
            after = ALL[name].get("after")
            if after is None:
                folder.mkdir(parents=True)
                (folder / "configs").symlink_to(ROOT / "configs")
            else:
                shutil.copytree(self.get(after)[0], folder, symlinks=True)
            self.done[name] = (folder, _run(name, folder, _env(work / "bin")))
        return self.done[name]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> _Ran:
    return _Ran(tmp_path_factory.mktemp("recipes"))


def test_recipes_are_found():
    assert {"own-loop", "ddp", "fsdp2", "hf", "per-rank", "scheduler-and-data", "partial-load",
            "events", "rollback", "export", "new-lr", "trainer-new-lr", "fine-tune"} <= set(ALL)
    for recipe in ALL.values():
        assert recipe.get("after", "own-loop") in ALL


@pytest.mark.parametrize("name", sorted(ALL))
def test_recipe_runs_as_written(ran, name):
    for need in filter(None, [ALL[name].get("needs")] + ([ALL[ALL[name]["after"]].get("needs")]
                                                         if "after" in ALL[name] else [])):
        reason = _missing(need)
        if reason:
            pytest.skip(reason)
    folder, text = ran.get(name)
    if name == "own-loop":
        assert "starting at step 0" in text and "starting at step 20" in text, text
    if name == "rollback":
        from ckpt.root import CheckpointStore

        rows = CheckpointStore(str(folder / "ckpt")).list()
        assert [r.step for r in rows if r.status == "committed"] == [10, 20], text
