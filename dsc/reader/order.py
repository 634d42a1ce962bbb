"""In what order an epoch visits the records: plain functions of (n, seed, epoch) → index arrays.

All randomness comes from a numpy Generator seeded with ``(seed, epoch)`` only (plus a group
number under locality="shard"), so every rank and every resumed run computes the same epoch order.

- ``sequential``: 0, 1, …, n-1.
- ``block``: the records are cut into blocks of `BLOCK_RECORDS` contiguous records (block edges
  move by a random shift each epoch), the blocks are shuffled, and each window of `WINDOW_BLOCKS`
  consecutive blocks (2,048 records, ~300 MB at 224×224) is served in a random order of its
  records (`window_keys`, new every epoch). Records were stored shuffled at compile time, so a
  block is already class-mixed; a batch is a random sample of its window, so stored neighbours
  share a batch about as often as batch_size / window records, and a different batch-mate every
  epoch (`cooccurrence_bound`). Reads stay inside one window at a time: a cold disk's read-ahead
  brings a window in with large reads, and its batches then read it from the page cache.
  (Before issue 21, runs of 8 contiguous records stayed together inside a batch, so stored
  neighbours shared a batch 85-92% of the time in every epoch.)
- ``random``: a seeded bijection on [0, n) (`permuted`: a Feistel network over the next power of two,
  cycle-walked back into [0, n)), so any positions of the order are computed on their own, and a rank
  holds only the chunk of its share it is serving (`LazyShare`), never a permutation of every record
  (0.8 GB at 10^8). Before issue 27 (`ORDER_VERSION` 1) it was numpy's ``permutation(n)``: another
  order for the same seed, so a loader state saved mid-epoch by that version is refused (`progress`).

An epoch is then split between ranks (`rank_share`; `epoch_share` computes one rank's part with
`order_slice`, which expands only that part of the order, `CHUNK` positions at a time, so a rank holds
1/world_size of the order, never the whole; the loader's `LazyShare` holds one chunk of it) and cut
into batches (`batch_indices`); inside a batch of block or random order the records take a seeded
random arrangement (`arrange`, fixed by seed, epoch and the records): each shard's records one
contiguous segment in a random order, the segments in a random order, so that pairing samples by
position pairs random same-shard batch-mates, not stored neighbours, and the copy stays one gather
per shard straight into its segment. The batch's ``index`` entry says what is where.

``locality="shard"`` (block order only) splits an epoch between ranks by shard instead
(`shard_share`), so that each rank reads about 1/world_size of the shard files per epoch:

- Units: whole shards; when there are fewer shards than ranks, every shard is cut into `p`
  equal contiguous parts, `p` the smallest number giving at least `world_size` non-empty parts
  (`shard_units`).
- Groups: the units are dealt to `world_size` groups largest first (ties: lower record
  first), each to the group with the fewest records so far (ties: lowest group number)
  (`shard_groups`). With equal shards that is a round robin, shard k to group k % world_size.
  Imbalance rule: the record counts of two groups differ by at most one unit (at most
  `records_per_shard` with whole shards). The groups are fixed for a dataset and world size;
  only who reads which one changes.
- Rotation: in `epoch`, rank r reads group ``(r + seed + epoch) % world_size``
  (`shard_group`): every epoch the groups are a partition of the dataset, and every rank reads
  every group (so every shard) within any `world_size` consecutive epochs. Each epoch a group
  passes from rank r + 1 to rank r, so a node running consecutive ranks r..r+L-1 keeps L-1 of
  its L groups from one epoch to the next (its page cache stays useful).
- Order within a group: `block` over the group's records (its units one after the other, in
  record order) with its own stream
  ``(seed, epoch, group)``. All ranks serve the largest group's count (drop_last=False: a rank
  with fewer records repeats the start of its own order, so it stays on its own shards) or the
  smallest group's count cut to whole batches (drop_last=True).
- Cost: the deal is arithmetic on runs of equal-sized units (`deal`; `shard_units` gives at most
  four sizes), and a rank orders only its own group, so a first batch does not wait on the world
  size. What a first round leaves for a resume on another split (`ShardRest`, `progress`) is
  computed from the groups a rank's share falls in, `ShardRest.SEGMENTS` groups at most per chunk.
"""

from __future__ import annotations

import functools

import numpy as np

from dsc import format as fmt

ORDERS = ("sequential", "block", "random")
LOCALITIES = ("shard",)  # values of the loader's `locality` besides None
BLOCK_RECORDS = 64  # ~10 MB at 224×224: large enough for fast reads from a cold disk
WINDOW_BLOCKS = 32  # blocks whose records are mixed together: a batch of 256 is 1/8 of a window
ORDER_VERSION = 3  # of the orders a seed gives: 2 since random order became `permuted`, 3 since `ShardRest` (issue 27)
FEISTEL_ROUNDS = 6  # Luby-Rackoff: 4 rounds of random functions give a pseudo-random permutation; 2 more of margin
CHUNK = 1 << 20  # positions of an order computed at once (8 MB of int64): a rank's memory does not grow with n
POSITIONS_STREAM = 1 << 32  # `generator` stream of the arrangement within batches (shard groups use 0..world_size-1)
DROPPED_WARN_FRACTION = 0.05  # locality="shard" with drop_last=True warns when it leaves out more


def generator(seed: int, epoch: int, *stream: int) -> np.random.Generator:
    """The only source of randomness of an epoch's order; `stream` separates independent parts of it."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be non-negative, got seed={seed}, epoch={epoch}")
    return np.random.default_rng([seed, epoch, *stream])


def sequential(n: int, seed: int = 0, epoch: int = 0) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def random(n: int, seed: int, epoch: int) -> np.ndarray:
    return order_slice(n, "random", seed, epoch, 0, n)  # in chunks: `permuted`'s temporaries are ~6x its input


@functools.lru_cache(maxsize=8)  # one per epoch in use
def _round_keys(seed: int, epoch: int) -> tuple[np.uint64, ...]:
    return tuple(generator(seed, epoch).integers(2**64, size=FEISTEL_ROUNDS, dtype=np.uint64))


def permuted(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Random order at `positions` (each in [0, n)): a bijection on [0, n) fixed by (seed, epoch), computed
    for any positions on their own, so a rank or a batch needs only its own.

    A Feistel network on the bits of the next power of two >= n (at least 4): the high and low halves
    take turns being xor-ed with `splitmix64` of the other half under a round key, each round a bijection.
    A result >= n is sent through the network again (cycle-walking) until it lands in [0, n): it stays on
    the cycle of its position, so this is a bijection on [0, n) too; the domain is < 2n, so a position
    walks ~2 times at worst on average."""
    bits = max(2, (n - 1).bit_length())
    low_bits = bits // 2
    low_mask, high_mask = np.uint64((1 << low_bits) - 1), np.uint64((1 << (bits - low_bits)) - 1)
    keys = _round_keys(seed, epoch)

    def network(x: np.ndarray) -> np.ndarray:
        high, low = x >> np.uint64(low_bits), x & low_mask
        for k, key in enumerate(keys):
            if k % 2:
                low ^= splitmix64(high, key) & low_mask
            else:
                high ^= splitmix64(low, key) & high_mask
        return (high << np.uint64(low_bits)) | low

    out = network(np.asarray(positions).astype(np.uint64))
    for _ in range(1 << bits):  # bounded: a cycle of the domain's 2^bits values ends back in [0, n)
        outside = np.flatnonzero(out >= np.uint64(n))
        if not len(outside):
            break
        out[outside] = network(out[outside])
    return out.astype(np.int64)


def expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ranges [starts[k], starts[k] + lengths[k]) without a Python loop."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    offset = np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)
    return np.repeat(starts.astype(np.int64), lengths) + offset


def block(n: int, seed: int, epoch: int, block_records: int = BLOCK_RECORDS, window: int = WINDOW_BLOCKS,
          stream: tuple[int, ...] = ()) -> np.ndarray:
    """Shuffled blocks of contiguous records, each window of blocks in a random order of its records
    (module docstring)."""
    return block_slice(n, seed, epoch, 0, n, block_records, window, stream)


@functools.lru_cache(maxsize=4)  # the epoch served and the next one planned; each chunk of a share asks again
def block_windows(n: int, seed: int, epoch: int, block_records: int = BLOCK_RECORDS,
                  stream: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.uint64]:
    """(first record, length, end position in the order) of the epoch's blocks in their shuffled order,
    read-only, and the salt of its `window_keys`: 1/block_records of the order's size (25 MB at 10^8),
    so that a rank expands only its own windows."""
    rng = generator(seed, epoch, *stream)
    shift = int(rng.integers(block_records)) if n > block_records else 0
    edges = np.concatenate([np.zeros(1 if shift else 0, dtype=np.int64),  # sorted and distinct as they stand
                            np.arange(shift, n, block_records, dtype=np.int64), np.array([n], dtype=np.int64)])
    perm = rng.permutation(len(edges) - 1)
    salt = rng.integers(2**64, dtype=np.uint64)
    starts, lengths = edges[:-1][perm], np.diff(edges)[perm]
    ends = np.cumsum(lengths)
    for a in (starts, lengths, ends):
        a.setflags(write=False)
    return starts, lengths, ends, salt


def window_keys(records: np.ndarray, salt: np.uint64) -> np.ndarray:
    """The key that orders records within their window: `splitmix64` of the record, a function of the
    record and the epoch's salt alone, so any window is ordered without the others."""
    return splitmix64(records, salt)


def block_slice(n: int, seed: int, epoch: int, start: int, stop: int, block_records: int = BLOCK_RECORDS,
                window: int = WINDOW_BLOCKS, stream: tuple[int, ...] = ()) -> np.ndarray:
    """Positions [start, stop) of `block`'s order (0 <= start <= stop <= n), expanding only the windows
    that hold them."""
    if stop <= start:
        return np.empty(0, dtype=np.int64)
    starts, lengths, ends, salt = block_windows(n, seed, epoch, block_records, stream)
    first = int(np.searchsorted(ends, start, side="right")) // window * window  # the first block of its window
    last = min(len(lengths), (int(np.searchsorted(ends, stop - 1, side="right")) // window + 1) * window)
    records = expand_runs(starts[first:last], lengths[first:last])
    keys = window_keys(records, salt)  # distinct (splitmix64 is a bijection): the order within a window is total
    cuts = np.r_[0, np.cumsum(lengths[first:last])][::window].tolist() + [len(records)]
    for a, b in zip(cuts[:-1], cuts[1:]):  # window by window: a tenth of one lexsort's time, and its memory
        records[a:b] = records[a:b][np.argsort(keys[a:b])]
    offset = int(ends[first - 1]) if first else 0
    return records[start - offset:stop - offset].copy()  # a copy: the windows' records are freed on return


def wrapped(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """Positions [start, stop) of an order of n repeated end to end, as ranges of the order itself."""
    pieces = []
    while start < stop:
        first = start % n
        last = min(n, first + stop - start)
        pieces.append((first, last))
        start += last - first
    return pieces


_ORDER_FUNCTIONS = {"sequential": sequential, "block": block, "random": random}


def epoch_order(n: int, order: str, seed: int, epoch: int) -> np.ndarray:
    """Every index of [0, n) exactly once, in the epoch's order."""
    if order not in _ORDER_FUNCTIONS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return order_slice(n, order, seed, epoch, 0, n)  # in chunks: the peak is the order and one chunk's temporaries


def rank_shares(order: np.ndarray, world_size: int, batch_size: int, drop_last: bool) -> np.ndarray:
    """Every rank's contiguous slice of the epoch order, as rows [world_size, per_rank] of one array.

    drop_last=False pads like DistributedSampler (the order repeats from its start, so at most
    `world_size - 1` records are served twice); drop_last=True keeps only full batches on every rank.
    A contiguous slice (not DistributedSampler's stride) keeps block order's windows whole.
    """
    per_rank = share_length(len(order), world_size, batch_size, drop_last)
    pad = per_rank * world_size - len(order)
    if pad > 0:
        order = np.concatenate([order, np.resize(order, pad)])
    return order[:per_rank * world_size].reshape(world_size, per_rank)


def rank_share(order: np.ndarray, rank: int, world_size: int, batch_size: int, drop_last: bool) -> np.ndarray:
    """This rank's row of `rank_shares`; every rank gets the same length. A copy of its slice: a view
    would keep the whole epoch order alive as long as the share (0.8 GB per rank at 10^8 records)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    per_rank = share_length(len(order), world_size, batch_size, drop_last)
    pieces = wrapped(rank * per_rank, (rank + 1) * per_rank, len(order))
    return np.concatenate([order[a:b] for a, b in pieces]) if pieces else order[:0].copy()


def _positions(n: int, order: str, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
    """Positions [start, stop) of the epoch's order, 0 <= start <= stop <= n."""
    if order == "sequential":
        return np.arange(start, stop, dtype=np.int64)
    if order == "block":
        return block_slice(n, seed, epoch, start, stop)  # draws the blocks, 1/BLOCK_RECORDS of the order
    return permuted(np.arange(start, stop, dtype=np.int64), n, seed, epoch)


def order_slice(n: int, order: str, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
    """Positions [start, stop) of the epoch's order repeated end to end (`rank_shares`' padding): one
    rank's share, without the whole order, computed `CHUNK` positions at a time (the temporaries of a
    chunk, not of the share, bound the peak)."""
    if order not in _ORDER_FUNCTIONS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    pieces = [(c, min(c + CHUNK, b)) for a, b in (wrapped(start, stop, n) if n else []) for c in range(a, b, CHUNK)]
    if not pieces:
        return np.empty(0, dtype=np.int64)
    if len(pieces) == 1:
        return _positions(n, order, seed, epoch, *pieces[0])
    out = np.empty(stop - start, dtype=np.int64)
    at = 0
    for a, b in pieces:
        out[at:at + b - a] = _positions(n, order, seed, epoch, a, b)
        at += b - a
    return out


class EpochOrder:
    """An epoch's order as a `LazyShare` source: positions [a, b) computed on their own (`order_slice`)."""

    def __init__(self, n: int, order: str, seed: int, epoch: int) -> None:
        if order not in _ORDER_FUNCTIONS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.n, self.order, self.seed, self.epoch = n, order, seed, epoch

    def __len__(self) -> int:
        return self.n

    def slice(self, a: int, b: int) -> np.ndarray:
        return order_slice(self.n, self.order, self.seed, self.epoch, a, b)

    def reach(self, a: int, b: int) -> int:
        """Where a chunk begun at `a` should end, at most `b`: any length costs the same per position."""
        return b


class LazyShare:
    """Positions [start, stop) of a sequence repeated end to end (an `EpochOrder`: `order_slice`; or a
    `ShardRest`), or the runs of its positions `runs` names (what a resumed epoch has left, `progress.Left`),
    computed when sliced, at least `CHUNK` positions at a time (fewer where the source's `reach` says a chunk
    costs more per position), the last chunk kept: what a rank holds while it serves its share is one chunk
    (8 MB), not the share (0.8 GB at 10^8 records on one rank). Batches are sliced in order, so each chunk is
    computed once; slices only (`batch_indices`), step 1."""

    def __init__(self, source: EpochOrder | ShardRest, start: int = 0, stop: int = 0,
                 runs: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.source = source
        if runs is None:  # [start, stop) of the sequence repeated: runs of [0, len(source))
            pieces = wrapped(start, stop, len(source)) if len(source) else []
            runs = (np.array([a for a, _ in pieces], dtype=np.int64), np.array([b for _, b in pieces], dtype=np.int64))
        self._starts, self._ends = runs[0], np.cumsum(runs[1] - runs[0])  # where each run ends in the share
        self._chunk: tuple[int, np.ndarray] = (0, np.empty(0, dtype=np.int64))  # swapped whole: thread-safe

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"a LazyShare is sliced, not indexed with {type(key).__name__}")
        a, b, step = key.indices(len(self))
        if step != 1:
            raise ValueError(f"a LazyShare is sliced with step 1, got {step}")
        b = max(a, b)
        first, chunk = self._chunk
        if not (first <= a and b <= first + len(chunk)):
            first, chunk = a, self._compute(a, b)
            self._chunk = (first, chunk)
        return chunk[a - first:b - first]

    def _compute(self, a: int, b: int) -> np.ndarray:
        """Share positions [a, c) for some c >= b: up to a + CHUNK, or where the source's chunk ends past b."""
        if b <= a:
            return np.empty(0, dtype=np.int64)
        stop = max(b, min(len(self), a + CHUNK))
        pieces, at = [], a
        k = int(np.searchsorted(self._ends, a, side="right"))
        while at < stop:
            shift = int(self._starts[k]) - (int(self._ends[k - 1]) if k else 0)  # sequence position - share position
            run_end = min(stop, int(self._ends[k]))
            end = max(min(b, run_end), min(run_end, self.source.reach(at + shift, run_end + shift) - shift))
            pieces.append(self.source.slice(at + shift, end + shift))
            if end < run_end:  # past b, where the source's chunk ends
                break
            at, k = end, k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def share_length(n: int, world_size: int, batch_size: int, drop_last: bool, *,
                 locality: str | None = None, records_per_shard: int = 0) -> int:
    """How many indices each rank serves per epoch (see `rank_share`, or `shard_share` with locality)."""
    if locality is not None:
        sizes = shard_group_sizes(n, records_per_shard, world_size)
        return int(sizes.min()) // batch_size * batch_size if drop_last else int(sizes.max())
    if drop_last:
        return n // world_size // batch_size * batch_size
    return -(-n // world_size)


def batch_count(share: int, batch_size: int) -> int:
    return -(-share // batch_size)


@functools.lru_cache(maxsize=8)  # one per epoch in use; drawing it costs ~30 µs, a batch's keys ~5 µs
def _position_salt(seed: int, epoch: int) -> np.uint64:
    return generator(seed, epoch, POSITIONS_STREAM).integers(2**64, dtype=np.uint64)


def splitmix64(records: np.ndarray, salt: np.uint64) -> np.ndarray:
    """splitmix64's output for each record's number in a stream started at `salt`: a well-mixed
    pseudo-random uint64 per record, computed for any subset of records on its own."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 wants
        z = salt + (np.asarray(records, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def position_keys(index: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """A pseudo-random key per record, fixed for (seed, epoch) (`splitmix64` with the epoch's salt). A
    function of the record alone (not of its rank, batch number or resume round), so a batch's
    arrangement depends only on which records it holds; new every epoch, so a record's batch-mate at
    the next position changes too."""
    return splitmix64(index, _position_salt(seed, epoch))


def arrange(index: np.ndarray, seed: int, epoch: int, records_per_shard: int) -> np.ndarray:
    """`index` in its seeded arrangement: the records of each shard file take one contiguous segment of
    positions, the segments in a random order (keyed by shard) and the records in each segment in a
    random order (`position_keys`), all fixed by (seed, epoch) and the records alone. The copy then
    writes each segment with one gather from its shard (`gather.fill`), as a sorted batch was copied:
    one copy per byte, one call per shard.

    What a pairing by position meets (torchvision's MixUp/CutMix: k with k - 1): inside a segment, a
    uniformly random batch-mate from the same shard; at the first position of a segment, the last
    record of the segment before it, from another shard. Records are stored in a seeded random
    permutation of the sources at compile time, so a shard is a random sample of them (unless compiled
    with --no-shuffle, whose datasets the loader reads in random order by default)."""
    keys = position_keys(index, seed, epoch)
    shard = index // max(records_per_shard, 1)
    if len(index) == 0 or shard.min() == shard.max():  # one segment: ~10 µs less per batch
        return index[np.argsort(keys)]
    shard_keys = splitmix64(shard, ~_position_salt(seed, epoch))  # a bijection: one key per shard
    return index[np.lexsort((keys, shard_keys))]


def batch_indices(share: np.ndarray, batch: int, batch_size: int, order: str, seed: int, epoch: int,
                  records_per_shard: int) -> np.ndarray:
    """Batch number `batch` of a rank's share. In block order its records take a seeded random
    arrangement, shard by shard (`arrange`): a pairing by position (torchvision's MixUp/CutMix mix
    sample k with k - 1, timm's with B - 1 - k) then pairs random batch-mates, not the stored neighbours
    a sorted batch (dsc before 0.4) put side by side. Random order's batches are random samples of the
    dataset, sorted (their partners are stored neighbours about as rarely as arranged ones', and sorted
    batches read fastest); sequential order keeps the records in order (evaluation writes its outputs
    in record order; it uses no seed), and so does a user's order callable (`sampling.CUSTOM`)."""
    index = share[batch * batch_size:(batch + 1) * batch_size]
    if order == "random":  # a random sample already: sorted, its position partners are rarely neighbours
        return np.sort(index)  # (README, MixUp), and an arrangement cost 4-6% of the read here
    if order == "block":
        return arrange(index, seed, epoch, records_per_shard)
    return index.copy()  # sequential, or a user's order: as given (a copy: a batch must not keep the share alive)


def epoch_share(n: int, order: str, seed: int, epoch: int, rank: int, world_size: int,
                batch_size: int, drop_last: bool, *, locality: str | None = None,
                records_per_shard: int = 0) -> np.ndarray:
    """The indices this rank serves in `epoch`, in order; batch k is `batch_indices(share, k, ...)`."""
    check_locality(order, locality)
    if locality is not None:
        return shard_share(n, records_per_shard, seed, epoch, rank, world_size, batch_size, drop_last)
    return lazy_share(n, order, seed, epoch, rank, world_size, batch_size, drop_last)[:]


def lazy_share(n: int, order: str, seed: int, epoch: int, rank: int, world_size: int, batch_size: int,
               drop_last: bool) -> LazyShare:
    """`epoch_share` (without locality) as a `LazyShare`, = rank_share(epoch_order): the loader's, computed a
    chunk at a time as it is served."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    per_rank = share_length(n, world_size, batch_size, drop_last)
    return LazyShare(EpochOrder(n, order, seed, epoch), rank * per_rank, (rank + 1) * per_rank)


# ----------------------------------------------------------------------------- locality="shard"

def check_locality(order: str, locality: str | None) -> None:
    if locality is None:
        return
    if locality not in LOCALITIES:
        raise ValueError(f"locality must be None or one of {LOCALITIES}, got {locality!r}")
    if order != "block":
        raise ValueError(f"locality={locality!r} works with order='block' only, got order={order!r} "
                         "(sequential and random orders have no shard-affine form)")


def shard_units(n: int, records_per_shard: int, world_size: int) -> np.ndarray:
    """Record edges of the units ranks are given: whole shards, or equal parts of them (module docstring)."""
    if records_per_shard < 1 or world_size < 1:
        raise ValueError(f"need records_per_shard >= 1 and world_size >= 1, got {records_per_shard}, {world_size}")
    shard_edges = np.r_[0, np.cumsum(fmt.shard_records(n, records_per_shard))].astype(np.int64)
    shards = len(shard_edges) - 1
    if shards >= world_size or shards == 0:
        return shard_edges
    sizes = np.diff(shard_edges)[:, None]
    parts = -(-world_size // shards)
    while True:  # the short last shard may give fewer non-empty parts: cut finer (ends at one record a unit)
        cuts = shard_edges[:-1, None] + sizes * np.arange(parts) // parts
        edges = np.append(cuts.ravel(), n)  # non-decreasing already (each shard's cuts inside it): drop repeats
        edges = edges[np.insert(edges[1:] != edges[:-1], 0, True)]
        if len(edges) - 1 >= min(world_size, n):
            return edges
        parts += 1


@functools.lru_cache(maxsize=16)  # len(loader) and every epoch ask again
def shard_groups(n: int, records_per_shard: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(unit edges, group of every unit), read-only: units dealt largest first to the smallest group."""
    units = shard_units(n, records_per_shard, world_size)
    group_of = deal(np.diff(units), world_size)
    units.setflags(write=False)
    group_of.setflags(write=False)
    return units, group_of


def deal(sizes: np.ndarray, groups: int) -> np.ndarray:
    """The group of every unit when the units, largest first (ties: lower unit first), each go to the group with
    the fewest records so far (ties: lowest group), computed a run of equal sizes at a time, not a unit at a time
    (a heap's loop took 2 s at 2^20 groups; `shard_units` gives at most four sizes).

    Units of one size x fill the groups as water: group g offers slots at loads[g], loads[g] + x, ... and the
    k units of the run take the k smallest slots by (value, group), in that order, as the heap would hand
    them out one by one."""
    order = np.argsort(-sizes, kind="stable")
    ordered = sizes[order]
    group_of = np.empty(len(sizes), dtype=np.int64)
    loads = np.zeros(groups, dtype=np.int64)
    runs = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), len(order)]
    for a, b in zip(runs[:-1], runs[1:]):
        x, k = int(ordered[a]), b - a
        levels, counts = np.unique(loads, return_counts=True)
        if len(levels) == 1:  # equal loads: a round robin from group 0
            taken = np.arange(k, dtype=np.int64) % groups
        else:
            last = _kth_slot(levels, counts, x, k)
            below = np.where(loads < last, (last - 1 - loads) // x + 1, 0)  # each group's slots under `last`
            taken = np.repeat(np.arange(groups, dtype=np.int64), below)
            values = loads[taken] + (np.arange(len(taken)) - np.repeat(np.cumsum(below) - below, below)) * x
            at_last = np.flatnonzero((loads <= last) & ((last - loads) % x == 0))[:k - len(taken)]
            taken, values = np.concatenate([taken, at_last]), np.concatenate([values, np.full(len(at_last), last)])
            taken = taken[np.lexsort((taken, values))]
        group_of[order[a:b]] = taken
        loads += np.bincount(taken, minlength=groups) * x
    return group_of


def _kth_slot(levels: np.ndarray, counts: np.ndarray, x: int, k: int) -> int:
    """The value of the k-th smallest slot when `counts[i]` groups hold `levels[i]` records (`deal`)."""
    low, high = int(levels[0]), int(levels[0]) + (k - 1) * x  # the least loaded group alone offers k by `high`
    while low < high:
        mid = (low + high) // 2
        under = levels <= mid
        if int((counts[under] * ((mid - levels[under]) // x + 1)).sum()) >= k:
            high = mid
        else:
            low = mid + 1
    return low


def group_sizes(units: np.ndarray, group_of: np.ndarray, world_size: int) -> np.ndarray:
    """Records per group."""
    return np.bincount(group_of, weights=np.diff(units), minlength=world_size).astype(np.int64)


@functools.lru_cache(maxsize=16)  # len(loader), every epoch and every replay ask again
def shard_group_sizes(n: int, records_per_shard: int, world_size: int) -> np.ndarray:
    """Records per group of `shard_groups`, read-only."""
    sizes = group_sizes(*shard_groups(n, records_per_shard, world_size), world_size)
    sizes.setflags(write=False)
    return sizes


def group_records(units: np.ndarray, group_of: np.ndarray, group: int) -> np.ndarray:
    """The records of `group`, its units one after the other in record order."""
    mine = np.flatnonzero(group_of == group)
    return expand_runs(units[mine], units[mine + 1] - units[mine])


def shard_group(rank: int, world_size: int, seed: int, epoch: int) -> int:
    """The group `rank` reads in `epoch`: a rotation by one group per epoch (module docstring)."""
    return (rank + seed + epoch) % world_size


def dropped_by_locality(n: int, records_per_shard: int, world_size: int, batch_size: int) -> str | None:
    """What locality="shard" with drop_last=True leaves out of every epoch, said when it is more than
    DROPPED_WARN_FRACTION of the records (e.g. 30% of ImageNet in 1 GiB shards at 64 ranks), with the
    --records-per-shard that keeps it under that, or None.

    Every rank serves the smallest group cut to whole batches, and groups differ by at most one unit
    of at most records_per_shard records, so at most world_size * (records_per_shard + batch_size - 1)
    records are left out: a shard of n // (20 * world_size) - batch_size + 1 records keeps that <= 5%."""
    per_rank = share_length(n, world_size, batch_size, True, locality="shard", records_per_shard=records_per_shard)
    dropped = n - per_rank * world_size
    if dropped <= n * DROPPED_WARN_FRACTION:
        return None
    fits = int(n * DROPPED_WARN_FRACTION) // world_size - batch_size + 1
    fix = (f"compile with --records-per-shard {fits} (or fewer) to leave out at most "
           f"{DROPPED_WARN_FRACTION:.0%}, or pass drop_last=False (smaller groups then repeat records instead)"
           if fits >= 1 else
           f"at batch_size={batch_size} no --records-per-shard is sure to keep that under "
           f"{DROPPED_WARN_FRACTION:.0%}: pass drop_last=False (smaller groups then repeat records instead), or a "
           "smaller batch_size")
    return (f"locality='shard' with drop_last=True serves {per_rank * world_size} of the {n} records per epoch "
            f"({dropped / n:.0%} left out): at world_size={world_size} the shards of {records_per_shard} records "
            f"split into groups of unequal size, and every rank serves only the smallest group's count, cut to "
            f"whole batches of {batch_size}; {fix}")


def shard_share(n: int, records_per_shard: int, seed: int, epoch: int, rank: int, world_size: int,
                batch_size: int, drop_last: bool) -> np.ndarray:
    """This rank's indices for `epoch` under locality="shard": block order over its group, padded or cut."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    units, group_of = shard_groups(n, records_per_shard, world_size)
    g = shard_group(rank, world_size, seed, epoch)
    per_rank = share_length(n, world_size, batch_size, drop_last, locality="shard",
                            records_per_shard=records_per_shard)
    return _group_share(group_records(units, group_of, g), g, n, seed, epoch, per_rank)


@functools.lru_cache(maxsize=16)  # every `ShardRest` of a world asks again
def group_index(n: int, records_per_shard: int, world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The units sorted by group once, read-only: (first record of each, its first position in its group's
    records as `group_records` lists them, where each group's units begin [world_size + 1])."""
    units, group_of = shard_groups(n, records_per_shard, world_size)
    by_group = np.argsort(group_of, kind="stable")  # each group's units in record order, as `group_records`
    lengths = units[by_group + 1] - units[by_group]
    bounds = np.searchsorted(group_of[by_group], np.arange(world_size + 1))
    before = np.cumsum(lengths) - lengths
    local = before - np.repeat(before[bounds[:-1]], np.diff(bounds))
    out = (units[by_group], local, bounds)
    for x in out:
        x.setflags(write=False)
    return out


@functools.lru_cache(maxsize=2)  # a load's check for Lightning users and its plan replay the same round
def shard_rest(n: int, records_per_shard: int, seed: int, epoch: int, world_size: int, batch_size: int,
               drop_last: bool, taken: int) -> ShardRest:
    return ShardRest(n, records_per_shard, seed, epoch, world_size, batch_size, drop_last, taken)


class ShardRest:
    """What a first round under locality="shard" leaves once every rank took `taken` samples of its share, in
    the order it comes (`progress`): each rank's untaken part of its group's order (`shard_share` before its
    padding), in rank order, then what drop_last cut from each rank's group, in rank order. A `LazyShare`
    source: positions [a, b) are computed from the groups they fall in (`slice`), never every rank's share
    (16 s at 2^16 ranks before; `ORDER_VERSION` 3 put the drop_last part in rank order, not record order,
    for that)."""

    SEGMENTS = 256  # groups whose order one chunk computes at most (~25 ms): a group is a Python call

    def __init__(self, n: int, records_per_shard: int, seed: int, epoch: int, world_size: int, batch_size: int,
                 drop_last: bool, taken: int) -> None:
        self.n, self.records_per_shard, self.seed, self.epoch = n, records_per_shard, seed, epoch
        self.world_size = world_size
        if n < world_size:  # empty groups pad with the global order (`_group_share`): no run resumes from that
            raise ValueError(f"no first round over {world_size} ranks of {n} records leaves a rest to resume")
        sizes = shard_group_sizes(n, records_per_shard, world_size)
        per_rank = share_length(n, world_size, batch_size, drop_last, locality="shard",
                                records_per_shard=records_per_shard)
        group = (np.arange(world_size, dtype=np.int64) + (seed + epoch) % world_size) % world_size  # `shard_group`
        size = sizes[group]
        served = np.minimum(per_rank, size)  # the group's records its share holds (the rest: padding)
        start, stop = np.concatenate([np.minimum(taken, served), served]), np.concatenate([served, size])
        keep = stop > start
        self._sizes = sizes
        self._group, self._start = np.concatenate([group, group])[keep], start[keep]
        self._ends = np.cumsum(stop[keep] - start[keep])  # where each segment ends in the sequence

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def slice(self, a: int, b: int) -> np.ndarray:
        """Positions [a, b) of the sequence (0 <= a <= b <= len)."""
        if b <= a:
            return np.empty(0, dtype=np.int64)
        first, last = np.searchsorted(self._ends, [a, b - 1], side="right").tolist()
        pieces = []
        for k in range(first, last + 1):
            begins = int(self._ends[k - 1]) if k else 0
            low = int(self._start[k]) + max(a, begins) - begins
            high = low + min(b, int(self._ends[k])) - max(a, begins)
            pieces.append(self._group_slice(int(self._group[k]), low, high))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def reach(self, a: int, b: int) -> int:
        """Where a chunk begun at `a` ends: at most `SEGMENTS` segments on, at most `b`."""
        k = int(np.searchsorted(self._ends, a, side="right")) + self.SEGMENTS - 1
        return b if k >= len(self._ends) else min(b, int(self._ends[k]))

    def _group_slice(self, g: int, low: int, high: int) -> np.ndarray:
        """Records at positions [low, high) of group g's order: `block` over its records (`_group_share`)."""
        firsts, local, bounds = group_index(self.n, self.records_per_shard, self.world_size)
        mine = slice(int(bounds[g]), int(bounds[g + 1]))
        at = block_slice(int(self._sizes[g]), self.seed, self.epoch, low, high, stream=(g,))
        unit = np.searchsorted(local[mine], at, side="right") - 1
        return firsts[mine][unit] + at - local[mine][unit]


def _group_share(records: np.ndarray, g: int, n: int, seed: int, epoch: int, per_rank: int) -> np.ndarray:
    """Block order over group `g`'s records, cut or padded (with its own start) to `per_rank`."""
    own = records[block(len(records), seed, epoch, stream=(g,))] if len(records) else records
    if len(own) >= per_rank:
        return own[:per_rank]
    source = own if len(own) else block(n, seed, epoch)  # an empty group only when n < world_size
    return np.concatenate([own, np.resize(source, per_rank - len(own))])


# ----------------------------------------------------------------------------- measures of the trade-off

def distinct_shards(indices: np.ndarray, records_per_shard: int) -> int:
    """How many shard files `indices` touch."""
    return len(np.unique(fmt.locate(np.asarray(indices), records_per_shard)[0]))


def mean_distinct(labels: np.ndarray, order: np.ndarray, batch_size: int, batches: int = 256) -> float:
    """Mean number of distinct labels in the first `batches` full batches of `order` (one vectorised pass)."""
    k = min(batches, len(order) // batch_size)
    if k == 0:
        return float(len(np.unique(np.asarray(labels)[order])))
    picked = np.sort(np.asarray(labels)[order[:k * batch_size].reshape(k, batch_size)], axis=1)
    return float(1 + (np.diff(picked, axis=1) != 0).sum(axis=1).mean())


def class_mix(labels: np.ndarray, batches: list[np.ndarray]) -> tuple[float, float]:
    """(mean number of distinct classes per batch, mean label entropy per batch in bits)."""
    distinct, entropy = [], []
    for idx in batches:
        _, counts = np.unique(labels[idx], return_counts=True)
        p = counts / counts.sum()
        distinct.append(len(counts))
        entropy.append(float(-(p * np.log2(p)).sum()))
    return float(np.mean(distinct)), float(np.mean(entropy))


def neighbour_cooccurrence(first: np.ndarray, second: np.ndarray, batch_size: int) -> float:
    """Of the stored-neighbour pairs (i, i + 1), the fraction that share a batch in both of two epoch
    orders (each cut into batches of `batch_size` from its start): batch-mates that stay together."""
    together = []
    for order in (first, second):
        batch_of = np.empty(len(order), dtype=np.int64)
        batch_of[order] = np.arange(len(order)) // batch_size
        together.append(batch_of[1:] == batch_of[:-1])
    return float(np.mean(together[0] & together[1])) if len(first) > 1 else 0.0


def cooccurrence_bound(n: int, batch_size: int, block_records: int = BLOCK_RECORDS,
                       window: int = WINDOW_BLOCKS) -> float:
    """An upper bound on the expected `neighbour_cooccurrence` of two consecutive epochs of block order
    (one rank), from its design:

    - an epoch's random shift puts a block edge between i and i + 1 with probability 1/block_records;
      bound what then follows by 1;
    - else they lie in one block, so in one window, whose records come in a random order (`window_keys`):
      their positions are a random pair of the window's W positions, and the batch edges cut those
      into pieces of at most batch_size, so they share a batch with probability at most
      (batch_size - 1) / (W - 1). A whole window holds `window` blocks of which at most two (the
      first and last of the dataset) are partial, so W >= (window - 1) * block_records;
    - the last window may hold fewer blocks (blocks % window of them): its block is there with
      probability (blocks % window) / blocks, the shuffle being uniform; bound that by 1 too.

    So p <= 1/block_records + (batch_size - 1) / ((window - 1) * block_records - 1) + (blocks % window)
    / blocks in every epoch, for every pair; consecutive epochs draw from independent generators, so
    both happen with probability at most p**2."""
    if n <= block_records * window:  # one window: the whole dataset shuffled
        return min(1.0, (batch_size - 1) / max(n - 1, 1)) ** 2
    tail = max((b % window) / b for b in (-(-n // block_records), -(-n // block_records) + 1))
    p = 1 / block_records + (batch_size - 1) / ((window - 1) * block_records - 1) + tail
    return min(1.0, p) ** 2
