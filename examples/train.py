"""Train a small CNN on the bundled example images with dsc: the code to copy into your project.

    python examples/train.py [--steps 40] [--batch-size 16] [--data examples/out]

Compiles examples/images once (into --data), then trains with uint8 batches from the loader;
augmentation and the uint8 → float conversion run as batched ops on the training device.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
from torch import nn

import dsc
from dsc import transforms as T

HERE = Path(__file__).parent
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def small_cnn(classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(block(3, 32), block(32, 64), block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(128, classes))


def main(steps: int, batch_size: int, data: Path) -> None:
    if not (data / "manifest.json").exists():
        dsc.compile_folder(HERE / "images", data, size=224)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ds = dsc.MemmapDataset(data)
    loader = ds.loader(batch_size, order="block", seed=0, device=device if device.type == "cuda" else None)
    augment = T.Compose([T.RandomResizedCrop(128, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                         T.Normalize(MEAN, STD)])
    generator = torch.Generator().manual_seed(0)  # augmentation draws are reproducible
    model = small_cnn(len(ds.classes)).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step, seen, start = 0, 0, time.perf_counter()
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        for batch in loader:
            x = augment(batch["image"].to(device), generator)  # uint8 [B,3,H,W] → float, on the device
            loss = nn.functional.cross_entropy(model(x), batch["label"].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step, seen = step + 1, seen + len(x)
            if step % 10 == 0 or step == steps:
                rate = seen / (time.perf_counter() - start)
                print(f"step {step:4d}  epoch {epoch:3d}  loss {loss.item():.3f}  {rate:,.0f} samples/s on {device}")
            if step == steps:
                print(f"data: {loader.stats()}")  # did training ever wait for the loader?
                return


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--data", type=Path, default=HERE / "out", help="compiled dataset (made if missing)")
    args = parser.parse_args()
    main(args.steps, args.batch_size, args.data)
