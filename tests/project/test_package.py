"""Packaging and repository rules: the package-dir mapping, and no pickle loading anywhere."""

from __future__ import annotations

import ast
import os
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


# Makes `datasets` absent, as on the GPU image: every import finder is wrapped to find no such
# module (a bare ImportError would also break `importlib.util.find_spec` probes, which absence does not).
_HIDE_DATASETS = """
import sys

class _Hide:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name == "datasets" or name.startswith("datasets."):
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.inner, attribute)

sys.meta_path[:] = [_Hide(finder) for finder in sys.meta_path]
"""

# Without datasets: the package imports, the pretraining data paths (embedded corpus files, pre-tokenized
# data) feed a tiny model under a 1-rank ZeRO engine, and what needs datasets names the install command.
_WITHOUT_DATASETS = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import tnlg, tnlg.modeling, tnlg.sharding, tnlg.accelerate, tnlg.trainer, tnlg.run.loop, tnlg.run.pretrain
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.data import PretokenizedCorpus, PretokenizedStream, SourceConfig, StreamConfig, TokenStream
from tnlg.data.corpus import embedded_corpus
from tnlg.data.finetune import load_rows
from tnlg.data.pretokenized import write_pretokenized
from tnlg.data.sources import DocumentReader
from tnlg.data.tokenizer import byte_level_tokenizer
from tnlg.sharding import ZeroConfig, initialize

try:
    import datasets  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("datasets is still importable: the test would prove nothing")

work = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=0, world_size=1)
tokenizer = byte_level_tokenizer()
corpus = embedded_corpus(max_bytes_per_subset=20_000, root=work)
source = SourceConfig(name="embedded", paths=tuple(str(f) for f in corpus.files()))
stream = TokenStream(StreamConfig(sources=(source,), seq_len=16, shuffle_buffer=1), tokenizer, batch_size=2)
write_pretokenized(["a first document", "and a second one, a little longer"], tokenizer, work / "tokens")
tokens = PretokenizedStream([PretokenizedCorpus(work / "tokens", seq_len=16)], [1.0], batch_size=2)
model = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=2))
for batch in (next(iter(stream)), next(iter(tokens))):
    input_ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
    loss = engine(input_ids=input_ids, labels=input_ids).loss
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss), loss
print("trained")

parquet = work / "rows.parquet"
parquet.write_bytes(b"PAR1")
for needs_datasets in (
    lambda: load_rows("embedded:qa", [], "train"),
    lambda: next(iter(DocumentReader(SourceConfig(name="p", paths=(str(parquet),))))),
    lambda: next(iter(DocumentReader(SourceConfig(name="hub", dataset="wikitext")))),
):
    try:
        needs_datasets()
    except ImportError as error:
        print("ImportError:", error)
    else:
        raise SystemExit("a feature that reads through datasets ran without it")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_tnlg_pretrains_without_datasets_and_names_it_where_needed(tmp_path):
    """The GPU image has no `datasets`: importing tnlg and pretraining must not need it."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_HIDE_DATASETS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(REPO)]), "TNLG_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_DATASETS, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "trained", result.stdout
    errors = lines[1:]
    assert len(errors) == 3, result.stdout
    assert all("needs the `datasets` package" in e and e.endswith("pip install datasets") for e in errors)
    assert (
        "embedded set 'embedded:qa'" in errors[0] and "rows.parquet" in errors[1] and "wikitext" in errors[2]
    ), errors
