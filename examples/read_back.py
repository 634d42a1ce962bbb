"""Read a compiled dataset back and say what was read and how fast.

    python examples/read_back.py examples/out
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import torch

from dsc import MemmapDataset


def main(path: str, epochs: int = 3) -> None:
    ds = MemmapDataset(path)
    h, w, c = ds.record_shape
    print(f"{path}: {len(ds)} records of {h}x{w}x{c} uint8, classes {ds.classes}")
    image, label = ds[0]
    print(f"ds[0]: image {tuple(image.shape)} {image.dtype}, label {label} ({ds.classes[label]}), from {ds.source(0)}")
    device = "cuda" if torch.cuda.is_available() else None
    for order in ("sequential", "block", "random"):
        loader = ds.loader(batch_size=8, order=order, seed=0, device=device)
        seen: Counter[int] = Counter()
        start = time.perf_counter()
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                seen.update(batch["label"].tolist())
        seconds = time.perf_counter() - start
        served = sum(seen.values())
        print(f"order={order:<10} {served} samples in {seconds * 1e3:.1f} ms: {served / seconds:,.0f} samples/s, "
              f"{served * h * w * c / seconds / 1e9:.2f} GB/s; per class {dict(sorted(seen.items()))}")
    print(f"first batch of the last epoch: {tuple(batch['image'].shape)} {batch['image'].dtype} "
          f"on {batch['image'].device}, indices {batch['index'].tolist()}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "examples/out")
