"""The CUDA path, all in one place: a ring of pinned host buffers and a side stream for uploads.

The loader's producer thread gathers a batch into a pinned slot, then issues the host→device
copy with ``non_blocking=True`` on a dedicated stream and records an event behind it. uint8
travels; convert to float on the device. Same interface as `host.HostSink` (see there).

Stream contract: a batch is ready on ONE stream, the one `hand_over` makes wait for its upload
and records on its tensors (so the caching allocator keeps their memory until that stream is
done with them): the stream current on the consumer's thread when ``next()`` returns, or the
stream given to ``Loader.iter(stream=s)``. A step that runs on a stream of its own takes its
batches through ``loader.iter(stream=s)``; a batch used on yet another stream needs torch's rule
for any tensor: ``other.wait_stream(s)`` and ``t.record_stream(other)``.

Device handling follows torch's pin-memory thread: the loader binds a bare "cuda" to the
current device of the thread that starts its first pass (`settings.bind_device`), so a DDP script
that makes its loader before ``torch.cuda.set_device(local_rank)`` still gets its batches on its
own GPU; the producer thread sets that device before any CUDA call (a new thread starts on
device 0), so every stream, event and tensor lives there.

Graph capture: ``torch.cuda.graph`` and ``make_graphed_callables`` capture in CUDA's "global"
mode, where a capture-unsafe call on ANY thread (cudaMalloc, an event wait) invalidates the
capture, and the producer makes such calls for every batch. `Ring.paused` (``loader.paused()``)
holds the producer out of CUDA for the length of a capture; ``capture_error_mode="thread_local"``
checks only the capturing thread and needs no pause.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch

from dsc.errors import LoaderError
from dsc.reader.host import Batch

Made = TypeVar("Made")


FIELD_ALIGN = 8  # each field starts at a multiple of this in the small-field slot: any dtype views it
SLOT_ALIGN = 4096  # each slot starts on a page of its own: DMA reads whole pages, and no two slots share one
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch's own helper asks


def packed_bytes(field_specs: dict[str, tuple[np.dtype, tuple[int, ...]]], batch_size: int) -> int:
    """Bytes of the small-field slot for a full batch of these fields, each padded to FIELD_ALIGN."""
    return sum(_aligned(batch_size * dtype.itemsize * int(np.prod(shape))) for dtype, shape in field_specs.values())


def _aligned(n: int, to: int = FIELD_ALIGN) -> int:
    return -(-n // to) * to


def ring_layout(slots: int, image_bytes: int, small_bytes: int) -> tuple[list[int], list[int], int]:
    """Where each slot's images and small fields start in one pinned block, and the block's size.

    One block of exactly this size, pinned by `pin_exactly`: torch's caching host allocator
    (``pin_memory=True``, ``.pin_memory()``) rounds every allocation up to a power of two, which
    pinned 256 MB for the 154 MB of four slots of 256 records of 224×224×3.
    """
    stride = _aligned(image_bytes, SLOT_ALIGN) + _aligned(small_bytes, SLOT_ALIGN)
    images = [k * stride for k in range(slots)]
    return images, [at + _aligned(image_bytes, SLOT_ALIGN) for at in images], slots * stride


def pin_exactly(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory as a uint8 tensor, pinned in place (cudaHostRegister, as
    torch.distributed's checkpoint stager does) instead of rounded up by the caching host allocator.
    An anonymous map: page-aligned, and no page shared with another allocation (or registration).
    Call `unpin` once no copy reads it any more, before the memory goes."""
    host = torch.from_numpy(np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8))
    code = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(f"pinning the loader's {nbytes}-byte ring failed (cudaHostRegister: cudaError {code}); "
                           "a lower prefetch or batch_size pins less")
    return host


def unpin(ring: Ring, host: torch.Tensor) -> None:
    """Unpin the ring's memory once no upload reads it (it is freed with its last reference, after this)."""
    try:
        ring.drain()
    except RuntimeError:  # a broken CUDA context (a sticky error): no copy runs any more
        pass
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


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


class Ring:
    """Which slot of the pinned ring is written next, and what must complete before it is written
    again. It makes no CUDA call of its own: `CudaSink` hands it CUDA events; a CPU test, stand-ins
    that record the order of waits and writes.

    RING REUSE RULE: slot k is written again only after the event recorded behind its last
    host→device copy has completed: `fill` waits on that event before it calls `write(k)`. One
    lock covers the wait, the write and the issue of the copy, so two producers never share a
    slot, and `paused()`, which holds the lock, keeps every CUDA call of the producer out of a
    CUDA graph capture. (The copy lands in fresh device tensors, so a batch never aliases the ring.)
    """

    def __init__(self, slots: int) -> None:
        self._events: list[Any] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()

    def fill(self, write: Callable[[int], tuple[Made, Any]]) -> tuple[Made, Any]:
        """`write(k)` into the next slot k once its last upload has completed; `write` fills the slot, issues
        its upload and returns what it made with the event recorded behind that upload."""
        with self._lock:
            slot, self._next = self._next, (self._next + 1) % len(self._events)
            if self._events[slot] is not None:
                self._events[slot].synchronize()  # the RING REUSE RULE
            made, event = write(slot)
            self._events[slot] = event
        return made, event

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No `fill` runs inside this block: one in progress finishes first, the next waits for the end."""
        with self._lock:
            yield

    def drain(self) -> None:
        """Wait until no upload reads the ring any more."""
        with self._lock:
            for event in self._events:
                if event is not None:
                    event.synchronize()


def ready_on(batch: Any, event: Any, stream: Any) -> Any:
    """`batch`, safe to use on `stream`: the stream waits (on the device, the host does not) for the
    upload behind `event`, and each tensor is recorded as used by it, so the caching allocator does
    not hand its memory to a later upload while `stream` may still read it. Any mapping of tensors."""
    stream.wait_event(event)
    for tensor in batch.values():
        tensor.record_stream(stream)
    return batch


def blame(e: RuntimeError) -> RuntimeError:
    """A CUDA error met by the loader, with where it may come from: CUDA reports a failure of
    asynchronous work (a device-side assert, an illegal address) at a later call on any thread, and
    the context stays broken, so the loader's next upload often reports the user's own kernel."""
    if isinstance(e, torch.cuda.OutOfMemoryError) or not (
            isinstance(e, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(e)):
        return e
    return RuntimeError(f"{e} [dsc: the loader's CUDA call reported this, but CUDA reports an error of earlier "
                        "asynchronous work at a later call on any thread, so it may come from your own kernels "
                        "(e.g. a device-side assert in the training step); run with CUDA_LAUNCH_BLOCKING=1 to see "
                        "where it is raised]")


class CudaSink:
    """Pinned ring (`Ring`, see its RING REUSE RULE) + side-stream uploads for one CUDA device.

    The copy lands in fresh device tensors, so the batch the user holds never aliases the ring: it
    stays valid however long it is kept. The small per-record fields (label, index, size and the
    dataset's own fields, whatever their dtypes) travel packed one after the other in one
    contiguous pinned byte slot: one asynchronous copy, each field a view of it on the device.
    """

    def __init__(self, device: torch.device, slots: int, batch_size: int, record_shape: tuple[int, int, int],
                 field_specs: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
        self.device = device
        image_bytes = batch_size * int(np.prod(record_shape))
        small_bytes = packed_bytes(field_specs, batch_size)
        images, small, total = ring_layout(slots, image_bytes, small_bytes)
        with torch.cuda.device(device):  # no stray context on another GPU, whatever this thread's device
            self.stream = torch.cuda.Stream(device)
            self.pinned = pin_exactly(total)
        self.images = [self.pinned[at:at + image_bytes].view(batch_size, *record_shape) for at in images]
        self.small = [self.pinned[at:at + small_bytes] for at in small]
        self.ring = Ring(slots)
        weakref.finalize(self, unpin, self.ring, self.pinned).atexit = False  # at exit, the process goes whole

    def prepare_thread(self) -> None:
        with self.ring.paused():  # no CUDA call during a capture, this one included
            torch.cuda.set_device(self.device)  # a new thread starts on device 0

    def fill(self, fields: dict[str, np.ndarray],
             gather: Callable[[np.ndarray], None]) -> tuple[Batch, torch.cuda.Event]:
        """Gather into the next free slot of the ring and start its upload; the event marks the copy's end."""
        n = len(fields["index"])

        def write(slot: int) -> tuple[tuple[torch.Tensor, torch.Tensor, list], torch.cuda.Event]:
            gather(self.images[slot][:n].numpy())
            layout = pack_fields(fields, self.small[slot].numpy())
            used = layout[-1][1] + layout[-1][2].nbytes
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                image = self.images[slot][:n].to(self.device, non_blocking=True)
                small = self.small[slot][:used].to(self.device, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # a wait on it sleeps instead of spinning a core
                event.record(self.stream)
            return (image, small, layout), event

        try:
            (image, small, layout), event = self.ring.fill(write)
        except RuntimeError as e:
            raise blame(e) from e
        return Batch(image=image.permute(0, 3, 1, 2), **unpack_fields(small, layout), batch_size=[n],
                     device=self.device), event

    def hand_over(self, item: tuple[Batch, torch.cuda.Event], stream: torch.cuda.Stream | None = None) -> Batch:
        """On the consumer's thread: the batch, ready on `stream` (default: the current one; see the stream
        contract above). Refused inside a graph capture, which would bake this batch into the graph."""
        batch, event = item
        try:
            if torch.cuda.is_current_stream_capturing():
                raise LoaderError("a batch was asked for during CUDA graph capture: its upload cannot be waited on "
                                  "in a graph (and would be replayed as this batch forever); take batches outside "
                                  "the capture and copy them into the graph's static input")
            return ready_on(batch, event, torch.cuda.current_stream(self.device) if stream is None else stream)
        except LoaderError:
            raise
        except RuntimeError as e:
            raise blame(e) from e

    def paused(self):
        """See `Ring.paused`."""
        return self.ring.paused()
