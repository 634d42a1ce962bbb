"""Whom a position pairing meets, per arrangement within a batch: computed from the orders alone (no data read).

    python benchmarks/partner_rates.py [--records 1281167] [--records-per-shard 7000] [--batch 256] [--epochs 3]

torchvision's MixUp/CutMix mix sample k with k - 1 (`torch.roll`: sample 0 with B - 1). For each order
(block, random) and arrangement of a batch's records, over one rank's epochs:

  partner = nbr     the fraction of samples whose partner is a stored neighbour (record i +- 1)
  same partner      the fraction of records whose partner in epoch e is the same record in e + 1
  same shard        the fraction of samples whose partner comes from the same shard file

Arrangements: `sorted` (dsc before issue 21), `uniform` (a uniformly random arrangement, as i21-mix
served: one gather per switch between shards), `shards` (the loader's `order.arrange`: each shard's
records one segment, one gather per shard). The defaults are ImageNet-1k's training set in shards of
~1 GiB at 224x224 (7,000 records of 150 KB).
"""

from __future__ import annotations

import argparse

import numpy as np

from dsc.reader import order as orders


def arranged(name: str, index: np.ndarray, seed: int, epoch: int, records_per_shard: int) -> np.ndarray:
    if name == "sorted":
        return np.sort(index)
    if name == "uniform":
        return index[np.argsort(orders.position_keys(index, seed, epoch), kind="stable")]
    return orders.arrange(index, seed, epoch, records_per_shard)


def rates(n: int, records_per_shard: int, batch: int, epochs: int, order: str, name: str) -> tuple[float, float, float]:
    partners, nbr, shard = [], [], []
    for epoch in range(epochs):
        share = orders.epoch_share(n, order, 0, epoch, 0, 1, batch, True)
        partner = np.full(n, -1, np.int64)
        for k in range(len(share) // batch):
            idx = arranged(name, share[k * batch:(k + 1) * batch], 0, epoch, records_per_shard)
            partner[idx] = np.roll(idx, 1)
        served = partner >= 0
        nbr.append(np.mean(np.abs(partner[served] - np.flatnonzero(served)) == 1))
        shard.append(np.mean(partner[served] // records_per_shard == np.flatnonzero(served) // records_per_shard))
        partners.append(partner)
    same = [np.mean((a == b)[(a >= 0) & (b >= 0)]) for a, b in zip(partners, partners[1:])]
    return float(np.mean(nbr)), float(np.mean(same)), float(np.mean(shard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_281_167)
    parser.add_argument("--records-per-shard", type=int, default=7_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2")
    print(f"{args.records} records, {args.records_per_shard} per shard, batch {args.batch}, {args.epochs} epochs")
    print(f"{'order':<8}{'arrangement':<13}{'partner = nbr':>15}{'same partner':>14}{'same shard':>12}")
    for order in ("block", "random"):
        for name in ("sorted", "uniform", "shards"):
            nbr, same, shard = rates(args.records, args.records_per_shard, args.batch, args.epochs, order, name)
            print(f"{order:<8}{name:<13}{nbr:>15.3%}{same:>14.3%}{shard:>12.1%}", flush=True)


if __name__ == "__main__":
    main()
