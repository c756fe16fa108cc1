"""Where the elements of one tensor-parallel slice are in another cut of the same tensor.

[Note: slice runs]
A parameter of full shape S cut along dimension d is, row-major, `outer = prod(S[:d])` rows of
`parts` blocks (1, or 3 for a fused [q; k; v]) of `S[d] / parts` indices along d, each block split
into `degree` equal chunks, then `inner = prod(S[d+1:])` elements per index. Rank r's local slice
holds chunk r of every block of every row, in the same order: its flat element
`(row, block, k, i)` is the full tensor's `(row, block, r * chunk + k, i)`. So a slice at one degree
and the slices at another share the rows, and within a row the live chunk `[r*c', (r+1)*c')` meets
saved chunks `[s*c, (s+1)*c)` in contiguous ranges: a flat range of a live slice is a list of runs,
each contiguous in the live slice and in one saved rank's slice. Degree 1 is the whole tensor, so
the same arithmetic assembles a full tensor from saved slices (live degree 1) or cuts a slice out of
a whole saved tensor (saved degree 1). Equal degrees map a slice onto itself: one run.

Only plain Python integers here: no tensors, no files (checkpoint.py reads the runs).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    """How a parameter is cut: along `dim`, in `parts` blocks each split alike (see TensorSlice)."""

    dim: int
    parts: int


def local_shape(full_shape: tuple[int, ...], cut: Cut | None, degree: int) -> tuple[int, ...]:
    """The shape of one rank's slice of a tensor of `full_shape` (the full shape uncut)."""
    if cut is None or degree == 1:
        return tuple(full_shape)
    shape = list(full_shape)
    shape[cut.dim] //= degree
    return tuple(shape)


def divides(full_shape: tuple[int, ...], cut: Cut, degree: int) -> bool:
    return 0 <= cut.dim < len(full_shape) and full_shape[cut.dim] % (cut.parts * degree) == 0


def runs(
    full_shape: tuple[int, ...],
    cut: Cut | None,
    live_degree: int,
    live_rank: int,
    saved_degree: int,
    start: int,
    end: int,
) -> Iterator[tuple[int, int, int, int]]:
    """(saved rank, position in its slice, position from `start`, length) covering the flat elements
    [start, end) of the live rank's slice (see [Note: slice runs]). `cut` None: the tensor is whole
    on both sides (saved rank 0)."""
    if end <= start:
        return
    if cut is None:
        yield 0, start, 0, end - start
        return
    if live_degree == saved_degree:
        yield live_rank, start, 0, end - start
        return
    inner = math.prod(full_shape[cut.dim + 1 :])
    block = full_shape[cut.dim] // cut.parts
    live_chunk, saved_chunk = block // live_degree, block // saved_degree
    live_row, saved_row = live_chunk * inner, saved_chunk * inner  # elements per (row, block)
    pending: list[int] | None = None  # [saved rank, saved position, position from start, length]
    position = start
    while position < end:
        row, within = divmod(position, live_row)
        k, i = divmod(within, inner)
        rank, k_saved = divmod(live_rank * live_chunk + k, saved_chunk)
        length = min(end - position, live_row - within, (saved_chunk - k_saved) * inner - i)
        at = row * saved_row + k_saved * inner + i
        if pending is not None and pending[0] == rank and pending[1] + pending[3] == at:
            pending[3] += length  # contiguous on both sides: one read
        else:
            if pending is not None:
                yield tuple(pending)  # type: ignore[misc]
            pending = [rank, at, position - start, length]
        position += length
    if pending is not None:
        yield tuple(pending)  # type: ignore[misc]
