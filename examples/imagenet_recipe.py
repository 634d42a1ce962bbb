"""torchvision's reference classification recipe on dsc batches (needs ``pip install 'dsc-images[augment]'``).

    python examples/imagenet_recipe.py [--steps 40] [--batch-size 16] [--size 224] [--data examples/out]

The training policy of torchvision's references/classification (its "new recipe" flags
``--auto-augment ta_wide --random-erase 0.1 --label-smoothing 0.1 --mixup-alpha 0.2
--cutmix-alpha 1.0``), every random choice per sample and on the training device:

  RandomResizedCrop(bicubic, antialiased) -> RandomHorizontalFlip -> RandAugment / TrivialAugmentWide
  / AutoAugment (uint8) -> Normalize -> RandomErasing -> MixUp or CutMix -> label-smoothed loss.

What differs from torchvision's, said here so nobody is surprised:
- MixUp/CutMix are kornia's: a random partner per sample (not torchvision's roll by one) and MixUp's
  weight uniform in (0, 1) rather than Beta(0.2, 0.2).
- The recipe's RA sampler (``--ra-sampler``: each image 3 times per epoch, spread across ranks)
  needs repeats from the loader, which dsc's loader does not offer yet: this example runs plain
  epochs.
- Augmentation draws come from a generator seeded by (loader seed, epoch): the same seed gives
  the same crops, operations and mixes on any device; a run resumed mid-epoch does not replay them.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
from torch import nn

import dsc
from dsc import augment as A
from dsc import transforms as T

HERE = Path(__file__).parent
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
POLICIES = {"ra": A.RandAugment, "ta_wide": A.TrivialAugmentWide, "imagenet": A.AutoAugment}


def small_cnn(classes: int) -> nn.Module:
    """A stand-in for ResNet-50: the recipe, not the model, is the point here."""
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(block(3, 32), block(32, 64), block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(128, classes))


def train(data: Path, *, steps: int = 40, batch_size: int = 16, crop: int = 176, policy: str = "ta_wide",
          random_erase: float = 0.1, label_smoothing: float = 0.1, seed: int = 0) -> list[float]:
    """Train `steps` steps with the recipe on the compiled dataset `data`; returns the losses."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ds = dsc.MemmapDataset(data)
    loader = ds.loader(batch_size, order="random", seed=seed, drop_last=True,
                       device=device if device.type == "cuda" else None)
    crop_op = T.RandomResizedCrop(crop, interpolation="bicubic", antialias=True)
    flip, auto, normalize = T.RandomHorizontalFlip(), POLICIES[policy](), T.Normalize(MEAN, STD)
    erase, mix = A.RandomErasing(p=random_erase), A.MixUpCutMix(len(ds.classes))
    model = small_cnn(len(ds.classes)).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=2e-5)
    losses, start = [], time.perf_counter()
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        g = A.epoch_generator(seed, epoch)  # every augmentation draw of this epoch comes from here
        for batch in loader:
            x = flip(crop_op(batch["image"].to(device), g), g)   # uint8 [B, 3, crop, crop]
            x = erase(normalize(auto(x, g)), g)                   # float32, normalised
            x, targets = mix(x, batch["label"].to(device), g)     # soft targets [B, classes]
            loss = nn.functional.cross_entropy(model(x), targets, label_smoothing=label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) % 10 == 0 or len(losses) == steps:
                rate = len(losses) * batch_size / (time.perf_counter() - start)
                print(f"step {len(losses):4d}  epoch {epoch:3d}  loss {loss.item():.3f}  "
                      f"{rate:,.0f} samples/s on {device}")
            if len(losses) == steps:
                return losses
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, default=224, help="record size to compile to")
    parser.add_argument("--crop", type=int, default=176, help="training crop (the recipe's --train-crop-size)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="ta_wide")
    parser.add_argument("--data", type=Path, default=HERE / "out", help="compiled dataset (made if missing)")
    args = parser.parse_args()
    if not (args.data / "manifest.json").exists():
        dsc.compile_folder(HERE / "images", args.data, size=args.size)
    train(args.data, steps=args.steps, batch_size=args.batch_size, crop=args.crop, policy=args.policy)
