"""The layers in the folders, held: which package may import which, no import cycles, flows
never reach a concrete sink, and a module past ~400 lines says why it stays one module.

Read from the source (every import, those under ``TYPE_CHECKING`` and inside functions
included), so a change that adds an arrow up or sideways fails here, not in review.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "batching"
KERNEL = "kernel"
# A layer may import the kernel, itself, and these (nothing else): arrows point down only.
ALLOWED: dict[str, set[str]] = {
    KERNEL: set(),
    "store": set(),
    "ingress": {"store"},
    "policy": set(),
    "plan": set(),
    "model": {"plan"},  # a measured profile is the plan's value type
    "outputs": {"store"},
    "loop": {"policy"},
    "evidence": {"store", "outputs.contract", "outputs.ledger"},  # never a concrete sink
    "metrics": {"store", "ingress", "evidence"},  # the exporter reads the tables
    "compose": {
        "store",
        "ingress",
        "policy",
        "plan",
        "model",
        "outputs",
        "loop",
        "evidence",
        "metrics",
    },
    "api": {"store", "ingress", "outputs"},  # HTTP ingress: the queue, results via the ledger
    "cli": {
        "api",
        "store",
        "ingress",
        "policy",
        "plan",
        "model",
        "outputs",
        "loop",
        "evidence",
        "compose",
        "metrics",
    },
    "testing": set(),
}
CONCRETE_SINKS = ("parquet", "parquet_layout", "sql", "delta", "outbox", "registry")
LONG = 400


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = path
    return found


def layer(module: str) -> str:
    """``batching.outputs.parquet`` -> ``outputs``; a top-level module is the kernel's."""
    parts = module.split(".")
    if len(parts) >= 3 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return "testing" if module == "batching.testing" else KERNEL


def imports(path: Path) -> Iterator[str]:
    """Every ``batching`` module ``path`` imports (modules named, and names that are
    modules)."""
    known = modules()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from batching.outputs import contract``: the module contract, not the package
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
        yield from (n for n in names if n in known and n != "batching")


def allowed(source: str, target: str) -> bool:
    src, dst = layer(source), layer(target)
    if dst in (KERNEL, src):
        return src != KERNEL or dst == KERNEL
    if src == "testing":
        return False
    inner = target.removeprefix("batching.")
    return dst in ALLOWED[src] or inner in ALLOWED[src]


def test_arrows_point_down_only() -> None:
    wrong = [
        f"{source} ({layer(source)}) imports {target} ({layer(target)})"
        for source, path in sorted(modules().items())
        for target in imports(path)
        if not allowed(source, target)
    ]
    assert wrong == []


def test_the_folders_are_the_layers() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ALLOWED) - {KERNEL, "testing"}


def test_no_import_cycles() -> None:
    graph = {name: set(imports(path)) for name, path in modules().items()}
    for name in graph:  # a module never imports its own package's __init__ back
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    cycles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []


@pytest.mark.parametrize("package", ["batching.evidence", "flows"])
def test_reconcile_and_the_flows_never_import_a_concrete_sink(package: str) -> None:
    folder = REPO / package.replace(".", "/")
    offenders = [
        f"{path.relative_to(REPO)} imports {target}"
        for path in folder.rglob("*.py")
        for target in imports(path)
        if target.startswith("batching.outputs.") and target.split(".")[2] in CONCRETE_SINKS
    ]
    assert offenders == []


def test_a_long_module_says_why_it_stays_one_module() -> None:
    unexplained = []
    for name, path in sorted(modules().items()):
        text = path.read_text()
        if text.count("\n") <= LONG:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "stays one module" not in doc:
            unexplained.append(f"{name}: {text.count(chr(10))} lines")
    assert unexplained == []


def test_no_flows_module_is_named_like_a_standard_library_one() -> None:
    """Prefect loads a deployment's entrypoint with its folder (flows/) first on sys.path, and
    the scorer processes a flow run spawns inherit it: flows/secrets.py hid the standard
    library's ``secrets``, pydantic's import of it failed, and every ``workers`` > 1 run from
    a deployment died (found by a review)."""
    import sys

    names = {p.stem for p in (REPO / "flows").glob("*.py")}
    assert names & set(sys.stdlib_module_names) == set()
