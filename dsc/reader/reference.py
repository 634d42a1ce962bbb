"""The plain reference loader: single-threaded, one `ds[i]` per record, no buffers to reason about.

It defines what the fast `Loader` must serve (tests compare them batch by batch) and is the
first thing to read when the fast path is in doubt.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dsc.reader import order as orders
from dsc.reader import progress, sampling


def reference_batches(dataset, batch_size: int, *, order: Any = None, seed: int = 0, epoch: int = 0,
                      drop_last: bool = False, rank: int = 0, world_size: int = 1,
                      locality: str | None = None, **sampling_options: Any) -> Iterator[dict]:
    """Yield {image [B,3,H,W], label [B], index [B], size [B, 2]} for one epoch, exactly as `Loader` should;
    size is each source's original (height, width). `sampling_options`: the loader's indices, weights,
    replacement, repeats and samples_per_epoch (`sampling.checked`)."""
    if order is None:  # the loader's default on a dataset stored shuffled: block, random for weighted draws
        order = "random" if sampling_options.get("replacement") is not None else "block"
    order, sampled = sampling.checked(len(dataset), order, locality=locality, **sampling_options)
    spec = progress.Epoch(len(dataset), order, seed, epoch, dataset.manifest.records_per_shard, sampled)
    share = spec.first_round_share(progress.Split(world_size, batch_size, drop_last, locality), rank)
    for b in range(orders.batch_count(len(share), batch_size)):
        index = orders.batch_indices(share, b, batch_size, order, seed, epoch,
                                      dataset.manifest.records_per_shard)
        samples = [dataset[int(i)] for i in index]
        yield {"image": torch.stack([s.image for s in samples]),
               "label": torch.tensor([s.label for s in samples], dtype=torch.int64),
               "index": torch.from_numpy(index),
               "size": torch.tensor([[int(v) for v in dataset.opened.sizes[i]] for i in index], dtype=torch.int64)}
