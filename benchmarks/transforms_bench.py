"""CPU cost of dsc's batched transforms on uint8 records (ms per batch, best of --repeat).

    python benchmarks/transforms_bench.py [--batch 64] [--record 256] [--threads 2]

Random records of --record x --record pixels with random original sizes (as batch["size"] from
a --fit stretch dataset); each transform runs on the whole batch on the CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from dsc.eval_transforms import CenterCrop, OriginalCenterCrop, Resize
from dsc.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop


def best_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--record", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    b, r = args.batch, args.record
    x = torch.randint(0, 256, (b, 3, r, r), dtype=torch.uint8, generator=g)
    x = x.contiguous(memory_format=torch.channels_last)
    sizes = torch.randint(200, 2000, (b, 2), generator=g)
    runs = {
        "RandomResizedCrop(224)": lambda: RandomResizedCrop(224)(x, g),
        "RandomResizedCrop(224, original_sizes=True)": lambda: RandomResizedCrop(224, original_sizes=True)(
            x, g, sizes=sizes),
        "RandomResizedCrop(176, original_sizes=True) + flip": lambda: RandomHorizontalFlip()(
            RandomResizedCrop(176, original_sizes=True)(x, g, sizes=sizes), g),
        "Resize(256) + CenterCrop(224)": lambda: Compose([Resize(256), CenterCrop(224)])(x),
        "OriginalCenterCrop(224, resize=256)": lambda: OriginalCenterCrop(224, 256)(x, sizes=sizes),
    }
    print(f"batch {b} x 3 x {r} x {r} uint8 channels_last, {args.threads} threads, best of {args.repeat}")
    for name, fn in runs.items():
        ms = best_ms(fn, args.repeat)
        print(f"  {name:<52} {ms:8.1f} ms/batch  {ms * 1e3 / b:7.0f} us/sample")


if __name__ == "__main__":
    main()
