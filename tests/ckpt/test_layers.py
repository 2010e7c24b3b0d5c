"""The house matches its map, read from the real import graph (ast, every import statement,
those inside functions included, ``from ckpt import X`` resolved to what ``X`` is).

* ``ckpt``'s packages form floors, bottom up, as its docstring lists them: a module imports
  only from its own package or from a package on a lower floor, never from a higher one
  or from the ``ckpt`` face itself;
* no circle in the import graph of ``ckpt``, ``trainer`` and ``monitoring`` (a package face
  counts as importing each of its modules);
* no module but a package face imports a name only to hand it on (listed in ``__all__``,
  or never used);
* at most 8 modules at ``ckpt``'s top level; no imports of project modules inside
  functions in ``ckpt`` (they hide the graph this test reads);
* ``trainer`` and ``monitoring`` import the ``ckpt`` face for every name it carries, and
  otherwise only the sub-packages ``trainer/__init__.py`` lists (never ``ckpt.cli``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import ckpt

REPO = Path(ckpt.__file__).resolve().parents[1]
PACKAGES = ("ckpt", "trainer", "monitoring")
BASE = ("_version", "errors", "events", "units")  # the floor under every package


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> set[str]:
    """The project modules an import statement imports (a submodule named in ``from P import
    X`` is that submodule; any other name is P itself)."""
    out: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in MODULES:
                out.add(alias.name)
        return out
    if node.level:
        pkg = importer if _is_package(importer) else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{node.module}" if node.module else pkg
    else:
        base = node.module or ""
    if base not in MODULES:
        return out
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.add(sub if sub in MODULES else base)
    return out


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[name] |= _resolve(name, node) - {name}
    return edges


EDGES = _edges()


def _floors() -> list[str]:
    """``ckpt``'s packages in the order its docstring lists them (``- ``name``: ...``)."""
    names = re.findall(r"^- ``(\w+)``", ckpt.__doc__, flags=re.M)
    return [n for n in names if n not in BASE]


def _floor_of(module: str) -> int | None:
    """The floor of a ``ckpt`` module: -1 for the base modules, None for the face."""
    parts = module.split(".")
    if parts[0] != "ckpt" or module in ("ckpt", "ckpt.__main__"):
        return None
    if len(parts) == 2 and parts[1] in BASE:
        return -1
    return _floors().index(parts[1])


def test_the_docstring_lists_every_package_and_base_module():
    top = {p.stem for p in (REPO / "ckpt").glob("*.py")} - {"__init__", "__main__"}
    packages = {p.name for p in (REPO / "ckpt").iterdir() if (p / "__init__.py").exists()}
    assert set(_floors()) == packages
    assert top == set(BASE)


def test_at_most_eight_modules_at_the_top():
    assert len(list((REPO / "ckpt").glob("*.py"))) <= 8


def test_imports_go_down_the_floors():
    wrong = []
    for name, deps in EDGES.items():
        mine = _floor_of(name)
        if mine is None:
            continue
        for dep in deps:
            if not dep.startswith("ckpt"):
                continue
            theirs = _floor_of(dep)
            if dep == "ckpt":
                wrong.append(f"{name} imports the ckpt face")
            elif theirs is not None and theirs > mine:
                wrong.append(f"{name} (floor {mine}) imports {dep} (floor {theirs})")
            elif mine == -1 and theirs == -1 and dep != "ckpt._version" and \
                    name != "ckpt._version" and dep.split(".")[1] != "errors":
                wrong.append(f"base module {name} imports {dep}")
    assert not wrong, wrong


def test_no_circles():
    index, low, stack, on_stack, circles = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(EDGES[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))

    import sys

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    assert not circles, circles


def _names_used(tree: ast.Module) -> set[str]:
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for n in ast.walk(tree):  # quoted annotations
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            used |= set(re.findall(r"[A-Za-z_]\w*", n.value)) if len(n.value) < 200 else set()
    return used


def _declared_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


@pytest.mark.parametrize("package", ("ckpt", "trainer", "monitoring"))
def test_no_module_hands_a_name_on(package):
    handed_on = []
    for name, tree in TREES.items():
        if not name.startswith(package) or _is_package(name):
            continue
        exported, used = set(_declared_all(tree)), _names_used(tree)
        for node in tree.body:
            if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                continue
            for alias in node.names:
                local = alias.asname or alias.name
                if local in exported:
                    handed_on.append(f"{name}: {local} (in __all__)")
                elif local not in used:
                    handed_on.append(f"{name}: {local} (unused)")
    assert not handed_on, handed_on


def test_no_project_imports_inside_functions_in_ckpt():
    inside = []
    for name, tree in TREES.items():
        if not name.startswith("ckpt"):
            continue
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                if any(d.split(".")[0] in PACKAGES for d in _resolve(name, node)):
                    inside.append(f"{name}:{node.lineno}")
    assert not inside, inside


def test_private_modules_are_imported_only_inside_their_package():
    wrong = []
    for name, deps in EDGES.items():
        for dep in deps:
            parts = dep.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_") and p != "__init__"]
            if not private or not dep.startswith("ckpt"):
                continue
            owner = ".".join(parts[:private[0]])
            if not (name == owner or name.startswith(owner + ".")) and dep != "ckpt._version":
                wrong.append(f"{name} imports {dep}")
    assert not wrong, wrong


def _trainer_ckpt_packages() -> set[str]:
    """The ``ckpt`` sub-packages ``trainer`` and ``monitoring`` may import: the ``* ``ckpt.X``:``
    items of ``trainer/__init__.py``'s docstring (the one place they are listed, with why)."""
    doc = ast.get_docstring(TREES["trainer"]) or ""
    return {name for line in doc.splitlines() if line.startswith("* ")
            for name in re.findall(r"``ckpt\.(\w+)``", line.split(":")[0])}


def _beyond_the_face(name: str, tree: ast.Module) -> list[str]:
    """What module ``name`` imports of ``ckpt`` beyond its face and the listed sub-packages,
    and the names it imports from a sub-package although the face carries them."""
    allowed, wrong = _trainer_ckpt_packages(), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for dep in sorted(_resolve(name, node)):
            parts = dep.split(".")
            if parts[0] == "ckpt" and len(parts) > 1 and parts[1] not in allowed:
                wrong.append(f"{name}:{node.lineno} imports {dep} (not listed in "
                             f"trainer/__init__.py)")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckpt."):
            face = [a.name for a in node.names if a.name in ckpt.__all__]
            if face:
                wrong.append(f"{name}:{node.lineno} imports {face} from {node.module}: "
                             f"import them from ckpt")
    return wrong


def test_trainer_and_monitoring_use_the_ckpt_face_and_the_listed_sub_packages():
    allowed = _trainer_ckpt_packages()
    assert allowed and "cli" not in allowed
    assert allowed <= {d.split(".")[1] for d in MODULES if d.startswith("ckpt.")}, allowed
    wrong = [w for name, tree in TREES.items() if name.split(".")[0] in ("trainer", "monitoring")
             for w in _beyond_the_face(name, tree)]
    assert not wrong, wrong
    # What it catches: the CLI, a sub-package not listed, a face name from a sub-package.
    caught = _beyond_the_face("trainer.train", ast.parse(
        "from ckpt.cli import main\nfrom ckpt import storage\n"
        "def f():\n    from ckpt.job import CheckpointManager\n"))
    assert [w.split(" ")[2] for w in caught] == ["ckpt.cli", "ckpt.storage",
                                                 "['CheckpointManager']"]
