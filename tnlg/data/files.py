"""Data files: which files a configured path names, and their bytes with damage detected.

[Note: literal paths first]
A configured path that exists is that file, even when its name holds glob characters: a directory
`run[v1]` is not the character class `[v1]`. Only a path that does not exist is a glob, and then
its longest leading directory that exists is taken literally too, so `run[v1]/*.jsonl` is the
`.jsonl` files of the directory `run[v1]`.

[Note: damaged files]
A truncated or corrupt compressed file is fatal, whatever the bad-record policy says: a bad record
is one line, counted and skipped, but a damaged stream silently loses every record after the damage
if it is read as far as it goes. gzip keeps a CRC and a length per member, so a cut or a changed
byte in a member is caught; zstd catches a frame that ends early, data it cannot decode, and, when
the writer stored one (`write_checksum`, as the embedded corpus does), a checksum mismatch. Neither
format can tell a file cut exactly between two members / frames from a shorter whole file, and zstd
without a checksum cannot see every changed byte. Only `.zst` files need `zstandard`
([Note: optional datasets] in optional.py).
"""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from .optional import require_zstandard

CHUNK = 1 << 16  # compressed bytes read at a time: bounds one decompressed piece (ratio x 64 KiB)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}


class DamagedFileError(ValueError):
    """A data file that cannot be read whole: truncated, corrupt, or not the format its name says."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path} is damaged: {problem}; re-create or re-download it")

    def __reduce__(self):  # the default would rebuild it from the message alone (distributed ranks pickle it)
        return type(self), (self.path, self.problem)


def expand_path(pattern: str | Path) -> list[Path]:
    """The files `pattern` names, sorted: itself when it exists, else its glob matches (see
    [Note: literal paths first]); empty when nothing matches."""
    literal = Path(pattern)
    if literal.exists():
        return [literal]
    return sorted(Path(match) for match in glob.glob(_escape_existing_prefix(literal), recursive=True))


def file_named_twice(matches: Iterable[tuple[str, Iterable[Path]]]) -> str | None:
    """Which file two of the (pattern, its files) pairs name, and by which patterns, for a message (one
    glob can reach a file twice too, through a link); None when each file is named once.

    [Note: each file once]
    A source, a fine-tuning split or a tokenizing job reads each of its files once per epoch: a file
    that two of its paths name (`a.jsonl` and `*.jsonl`) would give its records twice, so that they
    repeat within an epoch. Files are compared as what they are, not as how they are spelt: `./a.jsonl`,
    a link to it and a hard link are `a.jsonl` too. The way to read a corpus more often than others is
    its weight in the mixture.
    """
    named: dict[tuple[int, int], tuple[Path, str]] = {}  # (device, inode): the file itself, however reached
    for pattern, files in matches:
        for path in files:
            status = path.stat()
            key = (status.st_dev, status.st_ino)
            if key not in named:
                named[key] = (path, pattern)
                continue
            first_path, first_pattern = named[key]
            alias = "" if str(path) in (str(first_path), pattern) else f" (the second time as {path})"
            if pattern == first_pattern:
                return f"{first_path} is named twice by {pattern!r}{alias}"
            return f"{first_path} is named by both {first_pattern!r} and {pattern!r}{alias}"
    return None


def _escape_existing_prefix(pattern: Path) -> str:
    parts = pattern.parts
    for cut in range(len(parts) - 1, 0, -1):
        prefix = Path(*parts[:cut])
        if prefix.is_dir():
            return os.path.join(glob.escape(str(prefix)), *parts[cut:])
    return str(pattern)


def compression_of(path: str | Path) -> str | None:
    """ "gzip" or "zstd" from the file's suffix, else None."""
    return COMPRESSIONS.get(Path(path).suffix)


def read_lines(path: Path) -> Iterator[bytes]:
    """The lines of a (possibly compressed) file without their line ends; DamagedFileError when a
    compressed file is truncated or corrupt."""
    if compression_of(path) is None:
        with open(path, "rb") as raw:
            for line in raw:
                yield line.rstrip(b"\r\n")
        return
    yield from _split_lines(decompressed_chunks(path))


def decompressed_chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of a `.gz` / `.zst` file, in chunks, checked to the end of the stream."""
    kind = compression_of(path)
    if kind is None:
        raise ValueError(f"{path} is not a compressed file ({sorted(COMPRESSIONS)})")
    with open(path, "rb") as raw:
        if os.fstat(raw.fileno()).st_size == 0:
            # Every compressor writes a header even for no data: zero bytes is a cut-off copy.
            raise DamagedFileError(path, f"it is empty (0 bytes), which is not a {kind} stream")
        yield from (_gzip_chunks if kind == "gzip" else _zstd_chunks)(raw, path)


def check_compressed(path: Path) -> int:
    """Decompress the whole file to check it (DamagedFileError if damaged); its decompressed size."""
    return sum(len(chunk) for chunk in decompressed_chunks(path))


def _gzip_chunks(raw: BinaryIO, path: Path) -> Iterator[bytes]:
    try:
        with gzip.GzipFile(fileobj=raw) as stream:
            while chunk := stream.read(CHUNK):
                yield chunk
    except EOFError as error:
        raise DamagedFileError(path, "truncated: the gzip stream ends before its end marker") from error
    except (gzip.BadGzipFile, zlib.error) as error:
        raise DamagedFileError(path, f"corrupt gzip data ({error})") from error


def _zstd_chunks(raw: BinaryIO, path: Path) -> Iterator[bytes]:
    # One decompression object per frame: a file may hold several frames (pzstd, concatenated files),
    # and a frame that has started but not ended when the bytes run out is a truncated file.
    zstandard = require_zstandard(f"reading the zstd file {path}")
    decompressor = zstandard.ZstdDecompressor()
    frame, inside = decompressor.decompressobj(), False
    try:
        while chunk := raw.read(CHUNK):
            while chunk:
                inside = True
                if out := frame.decompress(chunk):
                    yield out
                if not frame.eof:
                    break
                chunk, frame, inside = frame.unused_data, decompressor.decompressobj(), False
    except zstandard.ZstdError as error:
        raise DamagedFileError(path, f"corrupt zstd data ({error})") from error
    if inside:
        raise DamagedFileError(path, "truncated: the file ends inside a zstd frame")


def _split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Lines split at b"\\n" across chunk boundaries, their "\\r" removed (like `for line in file`)."""
    pending: list[bytes] = []  # the current line's pieces from earlier chunks
    for chunk in chunks:
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            pending.append(chunk)
            continue
        lines[0] = b"".join([*pending, lines[0]])
        pending = [lines.pop()]
        for line in lines:
            yield line.rstrip(b"\r")
    tail = b"".join(pending)
    if tail:
        yield tail.rstrip(b"\r")
