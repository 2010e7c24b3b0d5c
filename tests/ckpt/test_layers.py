"""The package docstring's map of ckpt's modules is complete and true: every module is in
exactly one group, and no module imports (at import time) a module of a later group."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ckpt

PKG = Path(ckpt.__file__).resolve().parent


def _modules() -> set[str]:
    names = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    names |= {f"backends.{p.stem}" for p in (PKG / "backends").glob("*.py")}
    return names


def _groups() -> list[set[str]]:
    doc = ckpt.__doc__
    bullets = re.split(r"\n- ", doc.split("\n- ", 1)[1])
    groups = []
    for bullet in bullets:
        names = set(re.findall(r"``([A-Za-z_][\w.]*)``", bullet))
        mods = set()
        for name in names:
            if name == "backends":
                mods |= {m for m in _modules() if m.startswith("backends.")}
            elif name in _modules():
                mods.add(name)
        groups.append(mods)
    return groups


def test_every_module_is_in_exactly_one_group():
    groups = _groups()
    placed = [m for g in groups for m in g]
    assert len(placed) == len(set(placed)), sorted(m for m in placed if placed.count(m) > 1)
    assert set(placed) == _modules(), sorted(_modules() ^ set(placed))


def test_imports_go_one_way():
    where = {m: i for i, g in enumerate(_groups()) for m in g}
    wrong = []
    for mod, group in where.items():
        tree = ast.parse((PKG / (mod.replace(".", "/") + ".py")).read_text())
        for node in tree.body:  # import time only: function-level imports are deliberate
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("ckpt."):
                dep = node.module[len("ckpt."):]
                dep = "backends.__init__" if dep == "backends" else dep
                if dep in where and where[dep] > group:
                    wrong.append(f"{mod} imports {dep}")
    assert not wrong, wrong
