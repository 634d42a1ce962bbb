"""One per-record column over several files: what a reader sees of an index stored in segments (format 1.5).

A dataset compiled once has one segment, and its columns are the maps themselves (zero-copy, as before).
An appended one has a segment per append; `Column` joins their maps without copying them: an item, a slice
or a gather of records is read from the maps it touches, so opening costs nothing per record and a batch
costs what it reads. Anything numpy cannot do lazily (a ufunc, `np.asarray`) gets the joined copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin


class Column(NDArrayOperatorsMixin):
    """Rows of `pieces` one after the other (each [n_k, *shape], one dtype), piece k's values plus `bases[k]`
    (the source offsets of a segment count from its own sources file)."""

    def __init__(self, pieces: Sequence[np.ndarray], bases: Sequence[int] | None = None) -> None:
        self.pieces = list(pieces)
        self.bases = list(bases) if bases is not None else [0] * len(self.pieces)
        self.starts = np.cumsum([0, *(len(p) for p in self.pieces)])
        self.dtype = self.pieces[0].dtype
        self.shape = (int(self.starts[-1]), *self.pieces[0].shape[1:])

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape)))

    def __len__(self) -> int:
        return self.shape[0]

    def _piece(self, k: int, rows) -> np.ndarray:
        values = self.pieces[k][rows]
        return values + self.dtype.type(self.bases[k]) if self.bases[k] else np.array(values)

    def __getitem__(self, key):
        rest = ()
        if isinstance(key, tuple):
            key, rest = key[0], key[1:]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            out = self._range(start, stop) if step == 1 else self._take(np.arange(start, stop, step))
        elif isinstance(key, (int, np.integer)):
            i = int(key) + len(self) if key < 0 else int(key)
            if not 0 <= i < len(self):
                raise IndexError(f"index {int(key)} is out of bounds for a column of {len(self)}")
            k = int(np.searchsorted(self.starts, i, "right")) - 1
            out = self._piece(k, i - int(self.starts[k]))
        else:
            index = np.asarray(key)
            out = self._take(np.flatnonzero(index) if index.dtype == bool else index)
        if not rest:
            return out
        return out[rest] if isinstance(key, (int, np.integer)) else out[(slice(None), *rest)]

    def _range(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.empty((0, *self.shape[1:]), self.dtype)
        first = int(np.searchsorted(self.starts, start, "right")) - 1
        last = int(np.searchsorted(self.starts, stop - 1, "right")) - 1
        return np.concatenate([self._piece(k, slice(max(start, int(self.starts[k])) - int(self.starts[k]),
                                                     min(stop, int(self.starts[k + 1])) - int(self.starts[k])))
                               for k in range(first, last + 1)])

    def _take(self, index: np.ndarray) -> np.ndarray:
        index = np.where(index < 0, index + len(self), index).astype(np.int64, copy=False)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"an index is out of bounds for a column of {len(self)}")
        which = np.searchsorted(self.starts, index, "right") - 1
        out = np.empty((*index.shape, *self.shape[1:]), self.dtype)
        for k in np.unique(which).tolist():
            at = which == k
            out[at] = self._piece(k, index[at] - int(self.starts[k]))
        return out

    def take(self, indices, axis: int | None = None, out: np.ndarray | None = None, mode: str = "raise") -> np.ndarray:
        """`np.take` calls this (axis None: of the flattened values, the rows themselves for one column)."""
        if mode != "raise" or not (axis == 0 or axis is None and self.ndim == 1):
            return np.take(np.asarray(self), indices, axis, out, mode)
        taken = self._take(np.asarray(indices))
        if out is None:
            return taken
        out[...] = taken
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        joined = self._range(0, len(self))
        return joined if dtype is None else joined.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = [np.asarray(x) if isinstance(x, Column) else x for x in inputs]
        return getattr(ufunc, method)(*inputs, **kwargs)

    def tobytes(self) -> bytes:
        return np.asarray(self).tobytes()

    def __iter__(self):
        for k in range(len(self.pieces)):
            yield from self._piece(k, slice(None))
