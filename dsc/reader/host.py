"""Where batches land off the GPU path: recycled host buffers (`HostSink`).

A sink is what the loader's producer thread fills and its consumer hands out; the CUDA one
(`device.CudaSink`) has the same four methods:

- `prepare_thread()`: on the producer thread, before any other call;
- `fill(fields, gather) -> item`: on the producer thread; `fields` are the batch's small
  per-record arrays ({"label": [n], "index": [n], "size": [n, 2]} in int64, then the dataset's
  own fields, as `producer.field_specs` describes them), `gather(host)` copies its records into
  a host array [n, H, W, 3];
- `hand_over(item, stream=None) -> Batch`: on the consumer's thread, the batch as the user gets
  it (on CUDA, ready on `stream`, by default the current one: see `device`'s stream contract);
- `paused()`: a context in which the producer makes no CUDA call (for a graph capture).

Both hand out a `Batch`: a TensorDict that refuses to be iterated (see there).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from tensordict import TensorDict

from dsc import fits


class Batch(TensorDict):
    """A loader batch: a TensorDict {image, label, index, size, and the dataset's fields} whose
    iteration raises, naming what to do instead.

    A TensorDict iterates over its batch dimension, so the DataLoader habit ``x, y = batch`` gave
    two *samples* at batch size 2 (and a bare unpacking error at other sizes) and trained on the
    wrong thing without a word. Everything else is TensorDict's own (``.to``, indexing, ``unbind``);
    the refusal costs nothing per batch.

    `fit` is how the records were compiled (`dsc.fits`): the loader marks each batch's image and
    size with it, and `to` (e.g. a CPU batch copied to the GPU) carries the mark over.
    """

    @property
    def fit(self) -> str | None:
        """The records' `--fit` (center-crop, stretch or pad) as the loader marked it; None if unmarked."""
        return fits.of(self.get("image", None), self.get("size", None))

    def to(self, *args, **kwargs):
        """TensorDict's `to`; the new batch's image and size carry this batch's fit."""
        moved = super().to(*args, **kwargs)
        fit = self.fit
        if fit is not None and isinstance(moved, TensorDict) and moved is not self \
                and all(name in moved.keys() for name in fits.MARKED):
            fits.mark(moved, fit)
        return moved

    def __iter__(self):
        raise TypeError(f"a dsc batch is a TensorDict: take its fields by name (batch['image'], batch['label']; "
                        f"it holds {sorted(self.keys())}), or make the loader with as_tuple=('image', 'label') to "
                        "get tuples of tensors; batch.unbind(0) gives its samples")


class HostBuffers:
    """Host batch buffers [B, H, W, 3], recycled to avoid page-faulting fresh memory every batch.

    HOST BUFFER REUSE RULE: a buffer is refilled only when its refcount shows that nothing but
    this pool refers to it. Every tensor handed out is `torch.from_numpy(buffer)` or a view of
    one, and a torch storage made by from_numpy holds a reference to the array until the last
    tensor, view, storage or `.numpy()` over it dies. So a batch the user keeps (or any piece of
    it) pins its buffer, and is never overwritten; only batches already dropped are recycled.
    """

    def __init__(self, record_shape: tuple[int, int, int], keep: int) -> None:
        self._shape, self._keep = record_shape, keep
        self._pool: list[np.ndarray] = []
        self._lock = threading.Lock()
        probe = [np.empty(0)]
        self._unreferenced = sys.getrefcount(probe[0])  # the same expression as in take()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            for k in range(len(self._pool)):
                if len(self._pool[k]) == n and sys.getrefcount(self._pool[k]) == self._unreferenced:
                    return self._pool[k]
            buf = np.empty((n, *self._shape), dtype=np.uint8)
            if len(self._pool) < self._keep:
                self._pool.append(buf)
            return buf


class HostSink:
    """Batches in host buffers, handed out as they are (`device` is None: the loader refuses other devices)."""

    def __init__(self, device: torch.device | None, slots: int, batch_size: int,
                 record_shape: tuple[int, int, int], field_specs: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
        self._buffers = HostBuffers(record_shape, keep=slots)

    def prepare_thread(self) -> None:
        pass

    def fill(self, fields: dict[str, np.ndarray], gather: Callable[[np.ndarray], None]) -> Batch:
        n = len(fields["index"])
        host = self._buffers.take(n)
        gather(host)
        return Batch(image=torch.from_numpy(host).permute(0, 3, 1, 2),
                     **{k: torch.from_numpy(v) for k, v in fields.items()}, batch_size=[n])

    def hand_over(self, batch: Batch, stream: None = None) -> Batch:
        return batch

    def paused(self) -> AbstractContextManager[None]:
        return nullcontext()  # host batches make no CUDA call
