"""The CUDA ring's ordering rules, checked on CPU in CI (these are not GPU tests: no CUDA call runs).

`device.Ring` keeps the pinned ring's bookkeeping free of CUDA calls, and `device.ready_on` is the
consumer's side of a hand-over, so stand-ins for CUDA's events, streams and tensors can drive them
and record the order of waits, writes and uses: slot k is waited on before it is written again, a
batch's own upload is waited on by the stream that uses it, and a pause keeps every write out. The
CUDA calls around them (the copies, torch's caching allocator) are checked by tests/test_cuda_path.py
on a GPU machine.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from dsc.reader.device import Ring, blame, packed_bytes, ready_on, ring_layout


class RecordingEvent:
    """A stand-in for a recorded `torch.cuda.Event`: notes in a shared log when the host waits on it."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(("host waits", self.name))


class RecordingStream:
    """A stand-in for a `torch.cuda.Stream`: notes in the log which event it is made to wait on."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: RecordingEvent) -> None:
        self.log.append((self.name, "waits", event.name))


class RecordingTensor:
    """A stand-in for a device tensor: notes the streams it is recorded as used on."""

    def __init__(self) -> None:
        self.streams: list[str] = []

    def record_stream(self, stream: RecordingStream) -> None:
        self.streams.append(stream.name)


def fill(ring: Ring, log: list, b: int) -> tuple[dict, RecordingEvent]:
    """Batch b through the ring, as `CudaSink.fill` does: write the slot, then the event behind its upload."""
    def write(slot: int) -> tuple[dict, RecordingEvent]:
        log.append(("write", slot, b))
        return {"image": RecordingTensor(), "label": RecordingTensor()}, RecordingEvent(log, f"upload {b}")
    return ring.fill(write)


def test_slot_k_is_written_again_only_after_the_host_waited_on_its_last_upload() -> None:
    log: list = []
    ring = Ring(3)
    for b in range(10):
        fill(ring, log, b)
    expected = []
    for b in range(10):
        if b >= 3:  # batch b reuses batch b-3's slot: that upload must have read it first
            expected.append(("host waits", f"upload {b - 3}"))
        expected.append(("write", b % 3, b))
    assert log == expected


def test_two_producers_never_write_one_slot_at_once() -> None:
    ring, busy, clashes = Ring(2), set(), []

    def write(slot: int) -> tuple[None, RecordingEvent]:
        if slot in busy:
            clashes.append(slot)
        busy.add(slot)
        time.sleep(0.001)
        busy.discard(slot)
        return None, RecordingEvent([], "upload")

    threads = [threading.Thread(target=lambda: [ring.fill(write) for _ in range(20)]) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clashes == []


def test_a_batch_is_used_only_after_its_own_upload_on_the_stream_it_is_handed_to() -> None:
    """The consumer's stream waits on the event recorded behind THIS batch's copy (not its slot's earlier
    one), before the batch is used, and every tensor is recorded on that stream: the given one, whatever
    stream is current (`Loader.iter(stream=s)`)."""
    log: list = []
    ring, step = Ring(2), RecordingStream(log, "step stream")
    made = [fill(ring, log, b) for b in range(2)]
    for b in range(3):
        batch = ready_on(*made.pop(0), step)
        log.append(("use", b))
        assert all(t.streams == ["step stream"] for t in batch.values())
        made.append(fill(ring, log, b + 2))
    for b in range(3):
        assert log.index(("step stream", "waits", f"upload {b}")) < log.index(("use", b))
    assert [entry[2] for entry in log if entry[:2] == ("step stream", "waits")] == ["upload 0", "upload 1", "upload 2"]


def test_a_pause_keeps_every_write_out_until_it_ends() -> None:
    """`Loader.paused()` for a graph capture: a producer that reaches the ring inside waits for the end."""
    log: list = []
    ring = Ring(2)
    fill(ring, log, 0)
    with ring.paused():
        producer = threading.Thread(target=fill, args=(ring, log, 1))
        producer.start()
        time.sleep(0.2)  # ample time for an unpaused write
        log.append(("pause ends",))
    producer.join(timeout=5)
    assert log == [("write", 0, 0), ("pause ends",), ("write", 1, 1)]


def test_the_pinned_ring_is_allocated_at_its_exact_size() -> None:
    """Four slots of 256 records of 224×224×3 are 154 MB; the caching host allocator pinned 256 MB for them."""
    specs = {"label": (np.dtype(np.int64), ()), "index": (np.dtype(np.int64), ()), "size": (np.dtype(np.int64), (2,))}
    image_bytes, small_bytes = 256 * 224 * 224 * 3, packed_bytes(specs, 256)
    images, small, total = ring_layout(4, image_bytes, small_bytes)
    assert total == 4 * (image_bytes + small_bytes) == 154_173_440  # both are whole pages here
    for slots, image_bytes, small_bytes in [(3, 4 * 8 * 8 * 3, 40), (5, 12_345, 4097), (1, 1, 1)]:
        images, small, total = ring_layout(slots, image_bytes, small_bytes)
        spans = sorted([(at, at + image_bytes) for at in images] + [(at, at + small_bytes) for at in small])
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
        assert all(at % 4096 == 0 for at in images + small) and spans[-1][1] <= total
        assert total < spans[-1][1] + 4096 and total < slots * (image_bytes + small_bytes + 2 * 4096)


def test_a_cuda_error_met_by_the_loader_says_it_may_come_from_the_users_kernels() -> None:
    sticky = RuntimeError("CUDA error: device-side assert triggered")
    assert "may come from your own kernels" in str(blame(sticky))
    assert str(blame(sticky)).startswith("CUDA error: device-side assert triggered")
    for other in [RuntimeError("disk on fire"), torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate")]:
        assert blame(other) is other  # not an asynchronous error of someone else's kernel
