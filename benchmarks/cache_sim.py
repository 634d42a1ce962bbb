"""What a cache of `capacity` records fetches, simulated offline over a known sequence of reads.

`belady` evicts the record needed furthest in the future (Belady's MIN: for records of one size,
no cache fetches fewer); `lru` evicts the one used least recently (LitData's and MosaicML
Streaming's policy, there by shard). Both count the misses from position `count_from` on (e.g.
the second epoch, the cache warmed by the first). Pure functions over plain sequences.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

NEVER = float("inf")


def belady(reads: Sequence[int], capacity: int, count_from: int = 0) -> int:
    """Misses of an optimal cache of `capacity` records over `reads`, counted from `count_from`."""
    if capacity <= 0:
        return len(reads) - count_from
    next_use, seen = [NEVER] * len(reads), {}
    for i in range(len(reads) - 1, -1, -1):
        next_use[i] = seen.get(reads[i], NEVER)
        seen[reads[i]] = i
    held: dict[int, float] = {}  # record -> the position it is needed next
    furthest: list[tuple[float, int]] = []  # (-next use, record), stale entries skipped lazily
    misses = 0
    for i, record in enumerate(reads):
        if record not in held:
            misses += i >= count_from
            while len(held) >= capacity:
                when, victim = heapq.heappop(furthest)
                if held.get(victim) == -when:
                    del held[victim]
        held[record] = next_use[i]
        heapq.heappush(furthest, (-next_use[i], record))
    return misses


def lru(reads: Sequence[int], capacity: int, count_from: int = 0) -> int:
    """Misses of a least-recently-used cache of `capacity` records over `reads`, counted from `count_from`."""
    held: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for i, record in enumerate(reads):
        if record in held:
            held.move_to_end(record)
            continue
        misses += i >= count_from
        if capacity <= 0:
            continue
        if len(held) >= capacity:
            held.popitem(last=False)
        held[record] = None
    return misses
