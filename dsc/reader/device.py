"""The CUDA path, all in one place: a ring of pinned host buffers and a side stream for uploads.

The loader's producer thread gathers a batch into a pinned slot, then issues the host→device
copy with ``non_blocking=True`` on a dedicated stream and records an event behind it; the
consumer's current stream waits on that event before the batch is used. uint8 travels;
convert to float on the device. Same interface as `host.HostSink` (see there).

Device handling follows torch's pin-memory thread: the loader resolves "cuda" to
``cuda:{current_device()}`` where it is made, and the producer thread sets that device before
any CUDA call, so every stream, event and tensor lives on the device that was current then. That
is the rank's own GPU once the training script has called ``torch.cuda.set_device(local_rank)``
before making the loader (or passes ``device=f"cuda:{local_rank}"``); made earlier, "cuda" means
cuda:0 on every rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from dsc.reader.host import Batch

FIELD_ALIGN = 8  # each field starts at a multiple of this in the small-field slot: any dtype views it


def packed_bytes(field_specs: dict[str, tuple[np.dtype, tuple[int, ...]]], batch_size: int) -> int:
    """Bytes of the small-field slot for a full batch of these fields, each padded to FIELD_ALIGN."""
    return sum(_aligned(batch_size * dtype.itemsize * int(np.prod(shape))) for dtype, shape in field_specs.values())


def _aligned(n: int) -> int:
    return -(-n // FIELD_ALIGN) * FIELD_ALIGN


def pack_fields(fields: dict[str, np.ndarray], slot: np.ndarray) -> list[tuple[str, int, np.ndarray]]:
    """Copy each field's bytes into the uint8 `slot`, one after the other at aligned offsets;
    return (name, offset, field) for `unpack_fields`."""
    layout, at = [], 0
    for name, value in fields.items():
        value = np.ascontiguousarray(value)
        slot[at:at + value.nbytes] = value.reshape(-1).view(np.uint8)
        layout.append((name, at, value))
        at = _aligned(at + value.nbytes)
    return layout


def unpack_fields(packed: torch.Tensor, layout: list[tuple[str, int, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Each field as a view of `packed` (a uint8 copy of the slot, on any device), in its dtype and shape."""
    views = {}
    for name, at, value in layout:
        dtype = torch.from_numpy(value[:0]).dtype
        views[name] = packed[at:at + value.nbytes].view(dtype).view(value.shape)
    return views


class CudaSink:
    """Pinned ring + side-stream uploads for one CUDA device.

    RING REUSE RULE: slot k is refilled only after the event recorded behind its host→device
    copy has completed (`fill` waits on it), under a lock, so two producers can never share a
    slot. The copy lands in fresh device tensors, so the batch the user holds never aliases the
    ring: it stays valid however long it is kept. The small per-record fields (label, index,
    size and the dataset's own fields, whatever their dtypes) travel packed one after the other
    in one contiguous pinned byte slot: one asynchronous copy, each field a view of it on the
    device.
    """

    def __init__(self, device: torch.device, slots: int, batch_size: int, record_shape: tuple[int, int, int],
                 field_specs: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
        self.device = device
        with torch.cuda.device(device):  # no stray context on another GPU, whatever this thread's device
            self.stream = torch.cuda.Stream(device)
            self.images = [torch.empty((batch_size, *record_shape), dtype=torch.uint8, pin_memory=True)
                           for _ in range(slots)]
            self.small = [torch.empty(packed_bytes(field_specs, batch_size), dtype=torch.uint8, pin_memory=True)
                          for _ in range(slots)]
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()

    def prepare_thread(self) -> None:
        torch.cuda.set_device(self.device)  # a new thread starts on device 0

    def fill(self, fields: dict[str, np.ndarray],
             gather: Callable[[np.ndarray], None]) -> tuple[Batch, torch.cuda.Event]:
        """Gather into the next free slot and start its upload; the event marks the copy's end."""
        n = len(fields["index"])
        with self._lock:
            slot, self._next = self._next, (self._next + 1) % len(self.images)
            if self.events[slot] is not None:
                self.events[slot].synchronize()
            gather(self.images[slot][:n].numpy())
            layout = pack_fields(fields, self.small[slot].numpy())
            used = layout[-1][1] + layout[-1][2].nbytes
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                image = self.images[slot][:n].to(self.device, non_blocking=True)
                small = self.small[slot][:used].to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[slot] = event
        return Batch(image=image.permute(0, 3, 1, 2), **unpack_fields(small, layout), batch_size=[n],
                     device=self.device), event

    def hand_over(self, item: tuple[Batch, torch.cuda.Event]) -> Batch:
        """On the consumer's thread: make its current stream wait for the upload, then give the batch."""
        batch, event = item
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for tensor in batch.values():
            tensor.record_stream(stream)  # memory made on the side stream is used on this one
        return batch
