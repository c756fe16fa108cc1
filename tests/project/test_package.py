"""Packaging and repository rules: the package-dir mapping, and no pickle loading anywhere."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO


@pytest.mark.slow
@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_modeling_and_sharding_import_as_tnlg_subpackages(where, tmp_path):
    cwd = REPO if where == "repo root" else tmp_path
    code = (
        "import tnlg, tnlg.modeling, tnlg.sharding, tnlg.tools.convert;"
        "print(tnlg.modeling.__file__); print(tnlg.sharding.__file__); print(tnlg.__file__)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    modeling, sharding, package = (Path(line) for line in result.stdout.split())
    assert modeling == REPO / "modeling" / "__init__.py"
    assert sharding == REPO / "sharding" / "__init__.py"
    assert package == REPO / "tnlg" / "__init__.py"


def _python_files():
    for folder in ("tnlg", "modeling", "sharding", "scripts"):
        yield from (REPO / folder).rglob("*.py")


def test_every_torch_load_is_weights_only():
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                if not (
                    weights_only
                    and isinstance(weights_only[0].value, ast.Constant)
                    and weights_only[0].value.value is True
                ):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"torch.load without weights_only=True: {offenders}"
    assert any("weights_only" in p.read_text() for p in _python_files())  # the scan does see the call


def test_no_print_in_library_code():
    offenders = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for folder in ("tnlg", "modeling", "sharding")
        for path in (REPO / folder).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    ]
    assert not offenders, f"library code must log, not print: {offenders}"


def test_every_package_directory_is_listed_for_a_non_editable_install():
    """An editable install finds any subpackage; a wheel holds only the listed ones."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    directories = setuptools["package-dir"]
    listed = set(setuptools["packages"])
    found = set()
    for package, directory in directories.items():
        for module in (REPO / directory).rglob("*.py"):  # namespace packages (no __init__) count too
            relative = module.parent.relative_to(REPO / directory).parts
            name = ".".join((package, *relative))
            if not any(
                name.startswith(f"{other}.") or name == other
                for other in directories
                if other != package and other.startswith(f"{package}.")
            ):
                found.add(name)
    assert found - listed == set(), (
        f"package directories missing from [tool.setuptools] packages: {found - listed}"
    )


def test_kernel_sources_are_package_data():
    """The C++ / CUDA sources are compiled on the user's machine: a wheel must carry them."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["tnlg.sharding.kernels"]
    sources = [
        p for p in (REPO / "sharding" / "kernels" / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h")
    ]
    assert sources
    for source in sources:
        relative = source.relative_to(REPO / "sharding" / "kernels")
        assert any(relative.match(pattern) for pattern in patterns), f"{relative} is not package data"
