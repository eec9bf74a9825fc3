"""The layout's promises, read from the source: which process's code may import which,
and no import cycles (also none hidden in `importlib.import_module` calls).

The graph counts every import, at module level or inside a function, because a
function-level import is still a dependency (it only moves the failure to run time).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_runner"

# Subpackage -> subpackages/modules it must never import (prefix match on dotted names).
FORBIDDEN = {
    "worker": ("agent", "cli"),
    "agent": ("cli", "worker"),
    "rendezvous": ("agent", "cli", "worker"),
    "etcd": ("agent", "cli", "worker", "rendezvous"),
    "contract": ("agent", "cli", "worker", "rendezvous", "etcd"),
    "events": ("agent", "cli", "worker", "rendezvous", "etcd"),
    "reform": ("agent", "cli", "worker", "rendezvous", "etcd"),
    "files": ("agent", "cli", "worker", "rendezvous", "etcd", "config", "contract"),
    "errors": ("agent", "cli", "worker", "rendezvous", "etcd", "config"),
}
# The worker reaches etcd in exactly one place: the fenced checkpoint record.
WORKER_ETCD_GATE = "worker.checkpoint.etcd_store"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _literal_prefix(node: ast.expr) -> str | None:
    """The constant text of import_module's argument, f-string parts up to the first hole."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                break
            text += part.value
        return text
    return None


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Project modules `path` imports, relative to the package ('' = the package itself)."""
    found: set[str] = set()
    me = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) == "import_module" and node.args):
            prefix = _literal_prefix(node.args[0])
            if prefix is not None and prefix.startswith("elastic_runner."):
                stem = prefix[len("elastic_runner."):]
                # A name chosen at run time: every module it could be.
                names = [f"elastic_runner.{m}" for m in modules if m.startswith(stem)]
        for name in names:
            if name.startswith("elastic_runner."):
                target = name[len("elastic_runner."):]
                if target in modules and target != me:
                    found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {module_name(p) for p in paths} - {""}
    return {module_name(p): imports_of(p, modules) for p in paths if module_name(p)}


def _under(name: str, area: str) -> bool:
    return name == area or name.startswith(area + ".")


def test_each_process_imports_only_what_it_may(graph):
    broken = []
    for module, targets in graph.items():
        for area, banned in FORBIDDEN.items():
            if not _under(module, area):
                continue
            broken += [f"{module} -> {t}" for t in targets
                       if any(_under(t, b) for b in banned)]
    assert broken == []


def test_nothing_outside_cli_imports_cli(graph):
    assert [m for m, ts in graph.items() if not _under(m, "cli") and m != "__main__"
            and any(_under(t, "cli") for t in ts)] == []


def test_the_protocol_imports_nothing_from_the_project(graph):
    # Its members' columns (member_table.py) and the run's spec (job_spec.py) are
    # values too, and import nothing.
    assert graph["rendezvous.protocol"] <= {"rendezvous.member_table", "rendezvous.job_spec"}
    assert graph["rendezvous.member_table"] == set()
    assert graph["rendezvous.job_spec"] == set()
    # The rendezvous's decisions: pure functions over the protocol's values.
    assert graph["rendezvous.decisions"] <= {"rendezvous", "rendezvous.protocol"}
    # Who gets which rank: pure functions over the protocol's values.
    assert graph["rendezvous.ranks"] <= {"rendezvous", "rendezvous.protocol"}


def test_the_worker_reaches_etcd_only_for_the_checkpoint_record(graph):
    reaching = sorted(m for m, ts in graph.items() if _under(m, "worker")
                      and any(_under(t, "etcd") for t in ts))
    assert reaching in ([], [WORKER_ETCD_GATE])


def test_there_are_no_import_cycles(graph):
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_graph_sees_the_dynamic_verb_dispatch(graph):
    """Guards the checker itself: cli.main loads its verbs by name."""
    assert {"cli.status", "cli.notice", "cli.report", "cli.deploy"} <= graph["cli.main"]
