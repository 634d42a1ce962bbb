"""Read a compiled dataset back: say what was read and how fast, next to decoding the sources again.

    python examples/read_back.py examples/out
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import torch
from PIL import Image

from dsc import MemmapDataset


def read_epochs(ds: MemmapDataset, order: str, epochs: int, device: str | None) -> tuple[Counter, float]:
    """Labels served and seconds taken over `epochs` epochs of `ds.loader` in `order`."""
    loader = ds.loader(batch_size=8, order=order, seed=0, device=device)
    seen: Counter[int] = Counter()
    start = time.perf_counter()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.update(batch["label"].tolist())
    return seen, time.perf_counter() - start


def decode_sources(ds: MemmapDataset) -> float:
    """Samples/s of the naive way: decode and resize every source file with Pillow, once."""
    h, w, _ = ds.record_shape
    start = time.perf_counter()
    for i in range(len(ds)):
        Image.open(ds.source(i)).convert("RGB").resize((w, h), Image.BILINEAR)
    return len(ds) / (time.perf_counter() - start)


def main(path: str, epochs: int = 100) -> None:
    ds = MemmapDataset(path)
    h, w, c = ds.record_shape
    print(f"{path}: {len(ds)} records of {h}x{w}x{c} uint8, classes {ds.classes}")
    image, label = ds[0]
    print(f"ds[0]: image {tuple(image.shape)} {image.dtype}, label {label} ({ds.classes[label]}), from {ds.source(0)}")
    device = "cuda" if torch.cuda.is_available() else None
    for order in ("sequential", "block", "random"):
        seen, seconds = read_epochs(ds, order, epochs, device)
        served = sum(seen.values())
        print(f"order={order:<10} {epochs} epochs, {served} samples in {seconds:.2f} s: "
              f"{served / seconds:,.0f} samples/s ({served * h * w * c / seconds / 1e9:.2f} GB/s); "
              f"per class {dict(sorted(seen.items()))}")
    print(f"decoding the source files with Pillow instead: {decode_sources(ds):,.0f} samples/s "
          f"(a dataset this small measures mostly per-epoch overhead; see benchmarks/read_bench.py)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "examples/out")
