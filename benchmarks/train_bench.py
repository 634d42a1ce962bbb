"""Does training ever wait for data? Real models trained on a GPU from four feeds, side by side in one run.

    python benchmarks/train_bench.py DATASET SRC [--steps 200] [--batch 256] [--workers 8]
        [--models resnet50,resnet18] [--feeds synthetic,dsc,b,c] [--switch-intervals off,0.001]

DATASET is SRC compiled by dsc at 224 (`dsc compile SRC DATASET --size 224`); SRC an ImageFolder
tree. For each model (resnet50 at 224, resnet18 at 160; bf16 autocast, channels_last, SGD) it
trains `--steps` steps after `--warmup` untimed ones, fed by:

  synthetic   uint8 batches already on the GPU, augmented like the others: the ceiling
  dsc         ds.loader(device="cuda") + dsc.transforms on the GPU
  (b)         DataLoader(MemmapDataset, workers, pin_memory) + dsc.transforms on the GPU
  (c)         DataLoader(ImageFolder + torchvision transforms, workers, pin_memory)

and prints samples/s, the ratio to synthetic and the share of the time the training loop spent
waiting for the next batch. Targets (issue 10): dsc >= 0.97x synthetic for resnet50@224, >= 0.9x
for resnet18@160. `--switch-intervals` runs the dsc feed once per value of DSC_SWITCH_INTERVAL
(dsc.reader.turns; "off" leaves the interpreter's 5 ms alone). Needs CUDA and torchvision.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from dsc import MemmapDataset
from dsc import transforms as T
from dsc.reader import turns

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MODELS = {"resnet50": 224, "resnet18": 160}
DSC = "dsc loader + dsc.transforms"


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

    def dsc_loader():
        loader = ds.loader(batch, order="block", device=device, drop_last=True)
        for epoch in itertools.count():
            loader.set_epoch(epoch)
            for b in loader:
                yield augment(b["image"], generator), b["label"]

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

    return {"synthetic": ("synthetic (ceiling)", synthetic), "dsc": (DSC, dsc_loader),
            "b": (f"(b) DataLoader(MemmapDataset), {workers} workers",
                  torch_loader(ds, lambda x: augment(x, generator))),
            "c": (f"(c) DataLoader(ImageFolder + torchvision), {workers} workers", folder_loader)}


def train(model_name: str, classes: int, batches: Iterator, steps: int, warmup: int,
          device: torch.device) -> tuple[float, float]:
    """(samples/s, share of wall time spent waiting for batches) over `steps` timed steps."""
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
    parser.add_argument("--feeds", default="synthetic,dsc,b,c", help="of synthetic,dsc,b,c (synthetic always runs)")
    parser.add_argument("--switch-intervals", default="",
                        help="run the dsc feed once per DSC_SWITCH_INTERVAL value (comma-separated; 'off' = 5 ms)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_bench needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cudnn.benchmark = True
    ds = MemmapDataset(args.dataset)
    print(f"{torch.cuda.get_device_name(device)}; dataset {len(ds)} records of {ds.record_shape}; batch {args.batch}; "
          f"{args.steps} steps after {args.warmup}")
    keys = ["synthetic", *[k for k in args.feeds.split(",") if k != "synthetic"]]
    intervals = [v for v in args.switch_intervals.split(",") if v] or [os.environ.get(turns.ENV, "")]
    for model_name in args.models.split(","):
        size, rows = MODELS[model_name], {}
        made = feeds(ds, args.src, size, args.batch, args.workers, device)
        runs = [(made[k][0], made[k][1], None) for k in keys if k != "dsc"]
        if "dsc" in keys:
            runs[1:1] = [(f"{DSC}" + (f" (DSC_SWITCH_INTERVAL={v})" if v else ""), made["dsc"][1], v)
                         for v in intervals]
        for name, feed, interval in runs:
            if interval is not None:
                os.environ[turns.ENV] = interval
            rows[name] = train(model_name, len(ds.classes), feed(), args.steps, args.warmup, device)
            print(f"  {model_name}@{size} {name}: {rows[name][0]:,.0f} samples/s", flush=True)
        ceiling = rows["synthetic (ceiling)"][0]
        print(f"\n{model_name} @ {size}{'samples/s':>52}{'x synthetic':>13}{'data wait':>11}")
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
