"""Does training ever wait for data? Real models trained on a GPU from four feeds, side by side in one run.

    python benchmarks/train_bench.py DATASET SRC [--steps 200] [--batch 256] [--workers 8]
        [--models resnet50,resnet18] [--feeds synthetic,dsc,b,c]

DATASET is SRC compiled by dsc at 224 (`dsc compile SRC DATASET --size 224`); SRC an ImageFolder
tree. For each model (resnet50 at 224, resnet18 at 160; bf16 autocast, channels_last, SGD) it
trains `--steps` steps after `--warmup` untimed ones, fed by:

  synthetic   uint8 batches already on the GPU, augmented like the others: the ceiling
  dsc         ds.loader(device="cuda") + dsc.transforms on the GPU
  (b)         DataLoader(MemmapDataset, workers, pin_memory) + dsc.transforms on the GPU
  (c)         DataLoader(ImageFolder + torchvision transforms, workers, pin_memory)

and prints samples/s, the ratio to synthetic and the share of the loop's time spent in the feed
(taking the next batch and augmenting it: synthetic's share is the augmentation's alone).
Targets (issue 10): dsc >= 0.97x synthetic for resnet50@224, >= 0.9x for resnet18@160. After each
dsc feed its `loader.stats()` is printed (how long the loop waited in next(), and the producer's
time per batch). Needs CUDA and torchvision.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from dsc import MemmapDataset
from dsc import transforms as T

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MODELS = {"resnet50": 224, "resnet18": 160}
DSC = "dsc loader + dsc.transforms"
FEEDS = ("synthetic", "dsc", "dsc1", "pre", "dsch", "b", "c")  # the keys of `feeds`, for --feeds


def gpu_augment(size: int) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.Normalize(MEAN, STD)])


def feeds(ds: MemmapDataset, src: Path, size: int, batch: int, workers: int, device: torch.device
          ) -> dict[str, tuple[str, Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]]]:
    """Each feed by its key: its row label and a function giving an endless iterator of (float images on
    the GPU, labels on the GPU)."""
    import torchvision
    from torchvision import transforms as tv

    augment, generator = gpu_augment(size), torch.Generator().manual_seed(0)
    classes = len(ds.classes)

    def synthetic():
        images = torch.randint(0, 256, (batch, 3, *ds.record_shape[:2]), dtype=torch.uint8, device=device)
        images = images.contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, classes, (batch,), device=device)
        while True:
            yield augment(images, generator), labels

    def dsc_loader(label, num_threads=None, upload_here=False):
        """dsc's feed, with its row label; `upload_here`: host batches (not pinned), copied to the GPU by the loop."""
        def endless():
            loader = ds.loader(batch, order="block", device=None if upload_here else device, drop_last=True,
                               num_threads=num_threads)
            try:
                for epoch in itertools.count():
                    loader.set_epoch(epoch)
                    for b in loader:
                        images, labels = b["image"], b["label"]
                        if upload_here:
                            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                        yield augment(images, generator), labels
            finally:
                print(f"    ({label}: loader {loader.stats()})")
        return label, endless

    def preloaded():
        """8 batches gathered before the run into pinned memory, uploaded and augmented by the loop: the feed
        with no thread beside the loop (for diagnosis: what a fresh batch costs the loop itself)."""
        loader = ds.loader(batch, order="block", drop_last=True)
        held = [(b["image"].clone().pin_memory(), b["label"].clone().pin_memory())
                for b in itertools.islice(loader, 8)]
        loader.close()
        for images, labels in itertools.cycle(held):
            yield augment(images.to(device, non_blocking=True), generator), labels.to(device, non_blocking=True)

    def torch_loader(dataset, gpu_transform):
        def endless():
            loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, pin_memory=True,
                                drop_last=True, persistent_workers=True)
            while True:
                for images, labels in loader:
                    images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                    yield (gpu_transform(images) if gpu_transform else images), labels
        return endless

    def folder_loader():
        folder = torchvision.datasets.ImageFolder(str(src), transform=tv.Compose([
            tv.RandomResizedCrop(size), tv.RandomHorizontalFlip(), tv.ToTensor(), tv.Normalize(MEAN, STD)]))
        return torch_loader(folder, None)()

    made = {"synthetic": ("synthetic (ceiling)", synthetic), "dsc": dsc_loader(DSC),
            "dsc1": dsc_loader(f"{DSC}, num_threads=1", num_threads=1),
            "pre": ("8 batches preloaded, pinned (no thread)", preloaded),
            "dsch": dsc_loader(f"{DSC}, host batches uploaded by the loop", upload_here=True),
            "b": (f"(b) DataLoader(MemmapDataset), {workers} workers",
                  torch_loader(ds, lambda x: augment(x, generator))),
            "c": (f"(c) DataLoader(ImageFolder + torchvision), {workers} workers", folder_loader)}
    assert tuple(made) == FEEDS
    return made


def train(model_name: str, classes: int, batches: Iterator, steps: int, warmup: int,
          device: torch.device) -> tuple[float, float]:
    """(samples/s, share of wall time spent in the feed: next batch and its augmentation) over `steps` steps."""
    import torchvision

    model = getattr(torchvision.models, model_name)(num_classes=classes).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    waited, samples = 0.0, 0
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize(device)
            start, waited, samples = time.perf_counter(), 0.0, 0
        asked = time.perf_counter()
        images, labels = next(batches)
        waited += time.perf_counter() - asked
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(images.contiguous(memory_format=torch.channels_last)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        samples += len(labels)
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    return samples / wall, waited / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", type=Path)
    parser.add_argument("src", type=Path)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ",".join(MODELS))
    parser.add_argument("--feeds", default="synthetic,dsc,b,c",
                        help="of synthetic,dsc,b,c (synthetic always runs); for diagnosis also dsc1 (one copy "
                        "thread), dsch (host batches, uploaded by the loop), pre (no thread)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_bench needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cudnn.benchmark = True
    ds = MemmapDataset(args.dataset)
    if len(ds) < 4 * args.batch:  # drop_last: fewer than one batch would leave every epoch empty
        raise SystemExit(f"train_bench needs at least 4 batches of {args.batch} records; {args.dataset} has {len(ds)} "
                         "(dsc merge DATASET DATASET ... BIGGER joins copies without decoding)")
    unknown = sorted({*args.models.split(",")} - set(MODELS)) + sorted({*args.feeds.split(",")} - set(FEEDS))
    if unknown:
        raise SystemExit(f"train_bench: unknown --models or --feeds {unknown}")
    print(f"{torch.cuda.get_device_name(device)}; dataset {len(ds)} records of {ds.record_shape}; batch {args.batch}; "
          f"{args.steps} steps after {args.warmup}")
    keys = ["synthetic", *[k for k in args.feeds.split(",") if k != "synthetic"]]
    for model_name in args.models.split(","):
        size, rows = MODELS[model_name], {}
        made = feeds(ds, args.src, size, args.batch, args.workers, device)
        for name, feed in (made[k] for k in keys):
            rows[name] = train(model_name, len(ds.classes), feed(), args.steps, args.warmup, device)
            print(f"  {model_name}@{size} {name}: {rows[name][0]:,.0f} samples/s", flush=True)
        ceiling = rows["synthetic (ceiling)"][0]
        print(f"\n{model_name} @ {size}{'samples/s':>52}{'x synthetic':>13}{'in feed':>11}")
        for name, (rate, wait) in rows.items():
            print(f"{name:<60}{rate:>12,.0f}{rate / ceiling:>13.3f}{wait:>11.1%}")
        target = 0.97 if model_name == "resnet50" else 0.9
        for name, (rate, _) in rows.items():
            if name.startswith(DSC):
                print(f"{name} / synthetic: {rate / ceiling:.3f} (target >= {target}) "
                      f"{'ok' if rate / ceiling >= target else 'MISSED'}")
        print()


if __name__ == "__main__":
    main()
