"""The house rule that imports run one way (DESIGN: "Imports run one way"), read from the source: every
import statement counts, also those inside functions and under `if TYPE_CHECKING:`, since a function-level
import that closes a cycle is a cycle postponed, not removed."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

# Where each installed package's source lives (pyproject's package-dir).
SOURCE_ROOTS = {"tnlg": REPO / "tnlg", "tnlg.modeling": REPO / "modeling", "tnlg.sharding": REPO / "sharding"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, root in SOURCE_ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name `module` imports, relative imports made absolute; `from a import b` gives
    `a.b`, which the caller reads as module `a.b` where that exists, else as module `a`."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a submodule's own name where one is named)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in _imported_names(module, path):
            # `from pkg import sub` names the submodule; `from pkg.mod import func` the module
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (each a set of modules that import one another):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def imports_leaving(package: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """ "module -> target" for every import from inside `package` to a project module outside it,
    except those in `allowed`."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module.startswith(package)
        for target in targets
        if not target.startswith(package) and target not in allowed
    )


def test_modeling_imports_neither_tnlg_nor_sharding():
    offenders = imports_leaving("tnlg.modeling")
    assert not offenders, offenders


# What sharding/ may use of the model package: its model-agnostic helpers (safetensors reading, the
# Transformers-style tensor plan applied to whatever model declares one). Never a model class: pipeline
# stages come from the model's own `split_pipeline` hook.
SHARDING_MAY_USE = ("tnlg.modeling.loading", "tnlg.modeling.tensor_parallel")


def test_sharding_imports_nothing_of_tnlg_above_it_and_no_model_class():
    offenders = imports_leaving("tnlg.sharding", SHARDING_MAY_USE)
    assert not offenders, offenders


def test_the_scan_sees_function_level_and_type_checking_imports(tmp_path):
    # The checks above cannot pass by seeing nothing: a cycle closed only inside a function, and one
    # closed only under TYPE_CHECKING, are both found.
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert cycles(graph) == [["a", "b"]]
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import Y\n"
        "def f():\n    from ..pkg import z\n"
    )
    assert {"tnlg.sub.x.Y", "tnlg.pkg.z"} <= _imported_names("tnlg.sub.m", source)
    assert import_graph()["tnlg.sharding.engine"]  # the real tree is read
