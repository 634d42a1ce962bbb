"""The CUDA path, all in one place: a ring of pinned host buffers and a side stream for uploads.

The loader's producer thread gathers a batch into a pinned slot, then issues the host→device
copy with ``non_blocking=True`` on a dedicated stream and records an event behind it; the
consumer's current stream waits on that event before the batch is used. uint8 travels;
convert to float on the device.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict


class DeviceFeeder:
    """Pinned ring + side-stream uploads for one CUDA device.

    RING REUSE RULE: slot k is refilled only after the event recorded behind its host→device
    copy has completed (`host_slot` waits on it). The copy lands in a fresh device tensor, so
    the batch the user holds never aliases the ring: it stays valid however long it is kept.
    """

    def __init__(self, device: torch.device, slots: int, batch_size: int, record_shape: tuple[int, int, int]) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.images = [torch.empty((batch_size, *record_shape), dtype=torch.uint8, pin_memory=True)
                       for _ in range(slots)]
        # rows: label, index, original height, original width
        self.ints = [torch.empty((4, batch_size), dtype=torch.int64, pin_memory=True) for _ in range(slots)]
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def host_slot(self, n: int) -> tuple[int, np.ndarray]:
        """The next ring slot, once its previous upload is done, as a numpy [n, H, W, 3] view."""
        slot, self._next = self._next, (self._next + 1) % len(self.images)
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return slot, self.images[slot][:n].numpy()

    def upload(self, slot: int, labels: np.ndarray, idx: np.ndarray,
               sizes: np.ndarray) -> tuple[TensorDict, torch.cuda.Event]:
        """Start copying slot `slot` to the device; the returned event marks the copy's end."""
        n = len(idx)
        ints = self.ints[slot][:, :n]
        ints[0].numpy()[:] = labels
        ints[1].numpy()[:] = idx
        ints[2:].numpy()[:] = sizes.T
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            image = self.images[slot][:n].to(self.device, non_blocking=True)
            small = ints.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[slot] = event
        batch = TensorDict(image=image.permute(0, 3, 1, 2), label=small[0], index=small[1], size=small[2:].T,
                           batch_size=[n], device=self.device)
        return batch, event

    def hand_over(self, item: tuple[TensorDict, torch.cuda.Event]) -> TensorDict:
        """On the consumer's thread: make its current stream wait for the upload, then give the batch."""
        batch, event = item
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for tensor in batch.values():
            tensor.record_stream(stream)  # memory made on the side stream is used on this one
        return batch
