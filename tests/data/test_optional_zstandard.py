"""zstandard is optional: tnlg imports and reads plain / gzip data without it, and `.zst` names it."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tnlg.data.optional import loaded_error_types, require_zstandard

REPO = Path(__file__).resolve().parents[2]

# Makes `zstandard` absent, as on the GPU image: every import finder is wrapped to find no such module
# (a finder that raised instead would also break `importlib.util.find_spec` probes, which absence does not).
# Then, in that interpreter: the modules import, plain and gzip files are read, a `dataset=` split whose
# rows fail with a gzip error is still a DamagedFileError, and a `.zst` file is an ImportError.
_WITHOUT_ZSTANDARD = """
import itertools
import sys
import zlib
from pathlib import Path

class _Hide:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name == "zstandard" or name.startswith("zstandard."):
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.inner, attribute)

sys.meta_path[:] = [_Hide(finder) for finder in sys.meta_path]

import tnlg, tnlg.data, tnlg.data.files, tnlg.data.corpus, tnlg.data.sources
from tnlg.data.files import DamagedFileError
from tnlg.data.sources import DatasetSplit, DocumentReader, SourceConfig, _dataset_records

try:
    import zstandard  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("zstandard is still importable: the test would prove nothing")

def texts(path, count):
    reader = DocumentReader(SourceConfig(name=path.name, paths=(str(path),)))
    return [document.text for document in itertools.islice(reader, count)]

work = Path(sys.argv[1])
print("plain", texts(work / "plain.jsonl", 2))
print("gzip", texts(work / "packed.jsonl.gz", 2))

class _Rows:  # what `datasets` would hand back: rows that fail as a damaged gzip file does
    @staticmethod
    def load_dataset(*args, **kwargs):
        yield {"text": "one row"}
        raise zlib.error("invalid stored block lengths")

tnlg.data.sources.require_datasets = lambda feature: _Rows
try:
    list(_dataset_records(DatasetSplit("local-set", None, "train")))
except DamagedFileError as error:
    print("dataset", error.problem)

try:
    texts(work / "packed.jsonl.zst", 1)
except ImportError as error:
    print("zst", error)
"""


def _records(*texts: str) -> bytes:
    return b"".join(json.dumps({"text": text}).encode() + b"\n" for text in texts)


@pytest.mark.slow  # a fresh interpreter imports tnlg (torch, transformers)
def test_tnlg_reads_plain_and_gzip_data_without_zstandard_and_names_it_for_zst(tmp_path):
    (tmp_path / "plain.jsonl").write_bytes(_records("a plain one", "a plain two"))
    (tmp_path / "packed.jsonl.gz").write_bytes(gzip.compress(_records("a gzip one", "a gzip two")))
    # Any bytes will do past the zstd magic number: the package is asked for before a byte is decoded.
    (tmp_path / "packed.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + _records("never decoded"))
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ZSTANDARD, str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "TNLG_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[:2] == ["plain ['a plain one', 'a plain two']", "gzip ['a gzip one', 'a gzip two']"], lines
    assert lines[2].startswith("dataset a compressed file in it cannot be read (error:"), lines
    assert len(lines) == 4 and lines[3].startswith("zst reading the zstd file "), lines
    assert "packed.jsonl.zst needs the `zstandard` package" in lines[3], lines
    assert lines[3].endswith(": pip install zstandard"), lines


def test_require_zstandard_names_the_feature_and_chains_the_cause(monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # an import of it now fails
    with pytest.raises(
        ImportError, match=r"^writing x needs the `zstandard` package \(.*\): pip install zstandard$"
    ) as caught:
        require_zstandard("writing x")
    assert isinstance(caught.value.__cause__, ImportError)


def test_loaded_error_types_leaves_out_modules_not_imported(monkeypatch):
    zstandard = pytest.importorskip("zstandard")
    assert loaded_error_types(("zstandard", "ZstdError"), ("zlib", "error")) == (
        zstandard.ZstdError,
        zlib.error,
    )
    monkeypatch.setitem(sys.modules, "zstandard", None)
    assert loaded_error_types(("zstandard", "ZstdError"), ("zlib", "error")) == (zlib.error,)
    monkeypatch.delitem(sys.modules, "zstandard")
    assert loaded_error_types(("zstandard", "ZstdError")) == ()
