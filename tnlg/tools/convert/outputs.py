"""Where a conversion writes: never into its input, never over a model unasked, never half-written.

[Note: conversion outputs]
A conversion writes into a staging directory beside its output and renames it into place only when
every file is written (`staged_output`), so a failed or interrupted conversion leaves either the
previous directory or nothing at the output path, never a mix taken for whole. Replacing an existing
model is explicit (`replace=True`, the script's `--overwrite`) and replaces the whole directory:
weights, config and generation config come from one conversion. An output that is, holds or lies
inside the input is always refused (`refuse_output_overlapping_input`): the input is what a
conversion must never lose. Used by scripts/convert_checkpoint.py and `export_gpt2`.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path


def refuse_a_used_directory(output: Path, remedy: str = "write into a new directory") -> None:
    """FileExistsError unless `output` is absent or an empty directory; `remedy` says what to do."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(
            f"{output} already exists and is not an empty directory: {remedy} (nothing there is replaced)"
        )


def refuse_a_file_in_the_way(output: Path) -> None:
    """FileExistsError when `output` exists and is not a directory (a model directory cannot go there)."""
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{output} is a file, not a directory: name a directory for the output")


def refuse_a_linked_output(output: Path) -> None:
    """ValueError when `output` is a symbolic link: the link, not its target, would be renamed aside and
    replaced (see [Note: conversion outputs]), which a conversion would find only after its work."""
    if output.is_symlink():
        raise ValueError(
            f"--output {output} is a symbolic link: name the directory itself ({output.resolve()})"
        )


def refuse_output_overlapping_input(inputs: Mapping[str, Path | None], output: Path) -> None:
    """ValueError when `output` is one of the `inputs` ({flag: path}; None: not given), lies inside it
    or holds it: writing there (or replacing it with --overwrite) would replace or mix with what the
    conversion reads."""
    target = output.resolve()
    for flag, path in inputs.items():
        if path is not None and (
            target.is_relative_to(path.resolve()) or path.resolve().is_relative_to(target)
        ):
            raise ValueError(
                f"--output {output} overlaps {flag} {path} (the same path, inside it or holding it): write the "
                "converted model to a directory apart from what it reads"
            )


@contextlib.contextmanager
def staged_output(output: Path, replace: bool = False) -> Iterator[Path]:
    """A new directory beside `output` to write into; renamed to `output` when the block ends without
    an error (an existing `output` is replaced whole only with `replace`), removed when it fails.
    See [Note: conversion outputs]."""
    output.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not mkdtemp) so the directory gets the user's usual permissions, not mkdtemp's 0o700.
    staging = output.parent / f".{output.name}.staging-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        yield staging
        _move_into_place(staging, output, replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, output: Path, replace: bool) -> None:
    """`staging` renamed to `output`; the old `output` (checked again: it may have appeared meanwhile)
    moved aside first and removed only once the new one is in place."""
    refuse_a_file_in_the_way(output)
    if output.is_dir() and not any(output.iterdir()):
        output.rmdir()
    if not output.exists():
        staging.rename(output)
        return
    if not replace:
        refuse_a_used_directory(output, "pass --overwrite to replace it, or write into a new directory")
    previous = output.parent / f".{output.name}.replaced-{secrets.token_hex(4)}"
    output.rename(previous)
    staging.rename(output)
    shutil.rmtree(previous)


__all__ = [
    "refuse_a_file_in_the_way",
    "refuse_a_linked_output",
    "refuse_a_used_directory",
    "refuse_output_overlapping_input",
    "staged_output",
]
