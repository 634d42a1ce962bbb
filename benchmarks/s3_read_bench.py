"""dsc reading a dataset from an S3 endpoint on loopback, side by side with the network's limit, local
disk and the peers, in one run (issue 22's figures).

    python benchmarks/s3_read_bench.py [--records 2000] [--size 224] [--records-per-shard 500] [--batch 256]
        [--server ministack|moto] [--endpoint http://127.0.0.1:PORT [--server-pids PID ...]]
        [--fetch-batch 64] [--parallel 8] [--repeat 2] [--peers litdata streaming] [--link 2400mbit]

A dataset of `--records` records is compiled here (copies of dsc.testing's pictures), uploaded to
a server started on 127.0.0.1 (`s3_servers.py`: MiniStack by default, in its own environment;
moto for tiny runs; or a loopback `--endpoint` already running, e.g. radosgw, credentials from
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), and read back; every row is measured in this run:

  raw       plain ranged GETs of the shard objects with obstore (the client dsc uses), 8 MiB pieces,
            1 and --parallel requests in flight on one event loop: bytes/s, and the records/s that is;
            the CPU seconds per GB this process and the server (one started here, or --server-pids) used;
            "written": the same GETs, each piece also written at its offset into a fresh file (removed
            after), the least any node cache does with what it fetches: the bytes land in this node's
            page cache, which a VM may first have to back with memory (on this one ~2 s/GB)
  dsc       per order (sequential, block, random), batch --batch: cold = open + first epoch with an
            empty cache_dir, everything fetched; warm = the best of 10 later epochs, the cache full;
            local = the same dataset read from its folder on local disk (page cache warm), its 10
            epochs alternated with the warm ones; best of --repeat; the fastest cold run's CPU seconds
            per GB, dsc's (its threads) and the server's
  fetches   bytes the server sent in the second epoch (counted by a TCP relay on 127.0.0.1 in front
            of it, HTTP headers included) with cache_bytes = 25% and 50% of the shards, random and
            block order, batch --fetch-batch, against the dataset's bytes and against a Belady
            (optimal) and an LRU cache simulated offline (`cache_sim.py`) over the loader's own
            order of epochs 1-2;
            a checkout whose MemmapDataset has no `cache_bytes` says so; the default cache (no
            cache_bytes given) is measured in every checkout
  peers     LitData StreamingDataset and MosaicML Streaming over the same records written by their
            own writers (optimize / MDSWriter), uploaded to the same endpoint: cold first epoch and
            warm epochs, shuffled, 2 worker processes (their environment: peer_bench.py's)

then the issue's targets as ratios: cold >= 0.8x raw, warm >= 0.9x local disk, second-epoch
fetches <= the optimum + 5%, samples/s >= 2x each peer.

Unshaped, loopback has no network limit: the raw row is as fast as two cores can serve and receive, and a
cold epoch (which also checks, writes and gathers every byte) is bound by the same cores. `--link RATE`
(root, tc) shapes loopback to a network link's rate for the whole run (s3_servers.shaped_loopback): the
raw row is then the link's, and cold/raw says whether dsc keeps that link busy. The CPU columns tell,
unshaped, what each byte costs the client and the server: the raw row's bytes cost less than a cold
epoch's, which does more with them.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from cache_sim import belady, lru
from peer_bench import PeerEnv, run
from s3_servers import MINISTACK, CountingRelay, Server, shaped_loopback

import dsc
from dsc.reader import MemmapDataset
from dsc.testing import make_image_folder

BUCKET = "bench"
PIECE = 8 << 20
ORDERS = ("sequential", "block", "random")
SEED = 0
EPOCHS_PEERS = 3
WARM_EPOCHS = 10  # warm epochs are short (~20 ms at 2,000 records): the best of many
TARGETS = {"cold": 0.8, "warm": 0.9, "fetch": 1.05, "peer": 2.0}


# ----------------------------------------------------------------------------- the dataset

def build(work: Path, records: int, size: int, per_shard: int) -> Path:
    """A dataset of `records` records at size x size: dsc.testing's 32 pictures, linked as often as needed."""
    pictures = sorted(p for p in make_image_folder(work / "pictures", 4, 8, (size, size)).rglob("*") if p.is_file())
    for k in range(records):
        picture = pictures[k % len(pictures)]
        link = work / "images" / picture.parent.name / f"{k:07d}{picture.suffix}"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(picture)
    dsc.compile_folder(work / "images", work / "ds", size=size, records_per_shard=per_shard, workers=os.cpu_count())
    return work / "ds"


def epoch_reads(ds: MemmapDataset, order: str, batch: int, epochs: int) -> list[int]:
    """The records the loader reads, in order, over `epochs` epochs (what the simulators replay)."""
    loader, reads = ds.loader(batch, order=order, seed=SEED), []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for b in loader:
            reads += b["index"].tolist()
    return reads


# ----------------------------------------------------------------------------- measurements

def own_cpu() -> float:
    """CPU time (user + system) of this process so far, all its threads (obstore's runtime, the loader's)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


class CPU:
    """The CPU time this process and the server used between entering and leaving (`client`, `server`; the
    server's None where its processes are unknown)."""

    def __init__(self, server: Server) -> None:
        self.of, self.client, self.server = server, 0.0, None

    def __enter__(self) -> CPU:
        server = self.of.cpu_seconds()  # first: its scan of /proc is not the client's work
        self.started = own_cpu(), server
        return self

    def __exit__(self, *exc) -> None:
        self.client = own_cpu() - self.started[0]
        if self.started[1] is not None:
            self.server = self.of.cpu_seconds() - self.started[1]


def per_gb(seconds: float | None, nbytes: int) -> str:
    return "-" if seconds is None else f"{seconds / (nbytes / 1e9):.2f}"


def raw_rate(server: Server, keys: list[str], parallel: int, into: Path | None = None) -> tuple[float, CPU]:
    """Bytes/s of ranged GETs of every byte of `keys`, `parallel` requests in flight, and the CPU it took;
    `into` a folder: each piece is also written at its offset into a fresh (sparse) file per key there, as a
    node cache must at least do with what it fetches (the files are removed afterwards)."""
    import obstore

    store = server.client(BUCKET)
    sizes = [obstore.head(store, k)["size"] for k in keys]
    files = []
    if into is not None:
        folder = Path(tempfile.mkdtemp(prefix="written-", dir=into))
        for k, n in zip(keys, sizes):
            files.append(os.open(folder / k.replace("/", "_"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            os.ftruncate(files[-1], n)

    async def fetch_all() -> int:
        gate = asyncio.Semaphore(parallel)

        async def one(f: int, key: str, start: int, stop: int) -> int:
            async with gate:
                data = await obstore.get_range_async(store, key, start=start, end=stop)
                if files:
                    await asyncio.to_thread(write_all, files[f], memoryview(data), start)
                return len(data)

        done = await asyncio.gather(*[one(f, k, s, min(n, s + PIECE)) for f, (k, n) in enumerate(zip(keys, sizes))
                                      for s in range(0, n, PIECE)])
        return sum(done)

    try:
        with CPU(server) as used:
            start = time.perf_counter()
            fetched = asyncio.run(fetch_all())
            seconds = time.perf_counter() - start
    finally:
        for f in files:
            os.close(f)
        if into is not None:
            shutil.rmtree(folder)
    return fetched / seconds, used


def write_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        wrote = os.pwrite(fd, data, offset)
        data, offset = data[wrote:], offset + wrote


def epoch_seconds(loader, epoch: int) -> float:
    start = time.perf_counter()
    loader.set_epoch(epoch)
    for _ in loader:
        pass
    return time.perf_counter() - start


def dsc_rows(server: Server, url: str, local: Path, work: Path, batch: int, repeat: int,
             n: int) -> dict[str, dict]:
    """Per order: samples/s cold (open + epoch 0, empty cache) and the CPU of the fastest cold run; warm and
    local (its folder): the best epoch of WARM_EPOCHS each, alternated."""
    rows = {}
    for order in ORDERS:
        cold = warm = at_home = 0.0
        for r in range(repeat):
            cache = Path(tempfile.mkdtemp(prefix=f"cold-{order}-{r}-", dir=work))
            with CPU(server) as used:
                start = time.perf_counter()
                ds = MemmapDataset(url, cache_dir=cache)
                loader = ds.loader(batch, order=order, seed=SEED)
                seconds = time.perf_counter() - start + epoch_seconds(loader, 0)
            if n / seconds > cold:
                cold, cold_cpu = n / seconds, used
            home = MemmapDataset(local).loader(batch, order=order, seed=SEED)
            epoch_seconds(home, 0)
            for e in range(1, 1 + WARM_EPOCHS):  # alternated, so the machine's other load falls on both alike
                warm = max(warm, n / epoch_seconds(loader, e))
                at_home = max(at_home, n / epoch_seconds(home, e))
            loader.close()
            home.close()
            del ds, loader  # its cache folder goes: a later run's pages come from memory freed here, not
            shutil.rmtree(cache)  # from the host (a VM's first touch of fresh memory runs at ~1 GB/s here)
        rows[order] = {"cold": cold, "cold_cpu": cold_cpu, "warm": warm, "local": at_home}
    return rows


def fetch_rows(server: Server, url: str, local: Path, work: Path, batch: int, shard_bytes: int,
               record_bytes: int) -> list[tuple]:
    """(cache, order, (bytes fetched in epochs 1, 2) or why not, Belady, LRU), fetches counted by a relay.
    The simulated caches hold cache_bytes of records; the batches in flight need no room of their own
    there, as they are the records needed soonest, which Belady's cache keeps anyway."""
    bounded = "cache_bytes" in inspect.signature(MemmapDataset.__init__).parameters
    relay, rows = CountingRelay(server.endpoint), []
    os.environ["AWS_ENDPOINT_URL"] = relay.endpoint
    try:
        home = MemmapDataset(local)
        n = len(home)
        for order in ("random", "block"):
            reads = epoch_reads(home, order, batch, 2)
            for share in (0.25, 0.5):
                limit = int(share * shard_bytes)
                capacity = limit // record_bytes
                best, recent = belady(reads, capacity, n) * record_bytes, lru(reads, capacity, n) * record_bytes
                if best > recent or best < (n - capacity) * record_bytes:
                    raise RuntimeError(f"simulator out of bounds: Belady {best}, LRU {recent}, n {n}, C {capacity}")
                fetched = (fetched_by_epoch(url, work, batch, order, relay, limit) if bounded
                           else "not supported by this checkout (MemmapDataset has no cache_bytes)")
                rows.append((f"cache_bytes {share:.0%}", order, fetched, best, recent))
            rows.append(("default", order, fetched_by_epoch(url, work, batch, order, relay, None), None, None))
    finally:
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        relay.close()
    return rows


def fetched_by_epoch(url: str, work: Path, batch: int, order: str, relay: CountingRelay,
                     limit: int | None) -> tuple[int, int] | str:
    """Bytes the server sent for the open and the first epoch, then during the second, from an empty
    cache; or, when dsc refuses the limit (too small for the batches in flight), its message."""
    bound = {} if limit is None else {"cache_bytes": limit}
    relay.reset()
    try:
        ds = MemmapDataset(url, cache_dir=tempfile.mkdtemp(prefix=f"fetch-{order}-", dir=work), **bound)
        loader = ds.loader(batch, order=order, seed=SEED)
        epoch_seconds(loader, 0)
    except ValueError as e:  # dsc's DatasetError is one; a limit refused at open says why
        return f"refused: {e}"
    first = relay.reset()
    epoch_seconds(loader, 1)
    return first, relay.reset()


def peer_rows(args, server: Server, local: Path, work: Path) -> dict[str, dict | str]:
    """Per peer: its report (cold, warm samples/s) or why it did not run."""
    env = PeerEnv(args.peer_cache.expanduser())
    env.ensure(args.peers)
    rows: dict[str, dict | str] = {t: why for t, why in env.missing.items() if t in args.peers}
    todo = [t for t in args.peers if t not in rows]
    if not todo:
        return rows
    npy = export_records(local, work / "records.npy")
    for tool in todo:
        out = work / f"{tool}-out"
        try:
            run(env.python, [tool, "prepare_npy", npy, out, 2], env.env(tool))
            url = server.upload(out, BUCKET, tool)
            rows[tool], _, _ = run(env.python, [tool, "read_s3", url, work / f"{tool}-cache", 2, EPOCHS_PEERS],
                                   {**env.env(tool), **server.env})
        except RuntimeError as e:
            rows[tool] = str(e)
    return rows


def export_records(local: Path, path: Path) -> str:
    """The dataset's records and labels as .npy files, in index order: what the peers' writers store."""
    ds = MemmapDataset(local)
    images, labels = None, np.zeros(len(ds), dtype=np.int64)
    for b in ds.loader(256, order="sequential"):
        if images is None:
            images = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8,
                                               shape=(len(ds), *b["image"].shape[1:]))
        idx = b["index"].numpy()
        images[idx], labels[idx] = b["image"].numpy(), b["label"].numpy()
    images.flush()
    np.save(str(path).replace(".npy", ".labels.npy"), labels)
    return str(path)


# ----------------------------------------------------------------------------- the table

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--records-per-shard", type=int, default=500)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--server", choices=("ministack", "moto"), default="ministack")
    parser.add_argument("--endpoint", help="an S3 endpoint already running on loopback, instead of --server")
    parser.add_argument("--server-pids", type=int, nargs="*", default=(),
                        help="the --endpoint server's process ids, for its CPU time (radosgw_serve.sh: "
                        "$DSC_TEST_S3_SERVER_PIDS)")
    parser.add_argument("--fetch-batch", type=int, default=64,
                        help="batch of the second-epoch rows (a quarter of the dataset holds the batches in flight)")
    parser.add_argument("--parallel", type=int, default=8, help="ranged GETs in flight for the raw row")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--peers", nargs="*", choices=("litdata", "streaming"), default=["litdata", "streaming"],
                        help="peers beside dsc [default: both]; --peers alone: none")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("DSC_BENCH_CACHE", "~/.cache/dsc/s3-bench")),
                        help="where MiniStack's environment is kept")
    parser.add_argument("--link", metavar="RATE", help="shape loopback to this rate for the run (tc's units: "
                        "2400mbit, 5gbit; root only): a network link's limit instead of the CPUs'")
    parser.add_argument("--peer-cache", type=Path, default=Path(os.environ.get("DSC_PEER_CACHE", "~/.cache/dsc/peers")))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsc-s3-bench-") as tmp:
        work = Path(tmp)
        local = build(work, args.records, args.size, args.records_per_shard)
        server = Server(args.server, args.cache.expanduser(), args.endpoint, tuple(args.server_pids))
        try:
            os.environ.update(server.env)
            server.create_bucket(BUCKET)
            with shaped_loopback(args.link):
                report(args, server, local, work)
        finally:
            server.stop()


def report(args, server: Server, local: Path, work: Path) -> None:
    url = server.upload(local, BUCKET, "dsc")
    shards = sorted((local / "shards").iterdir())
    shard_bytes, record_bytes = sum(p.stat().st_size for p in shards), args.size * args.size * 3
    n = len(MemmapDataset(local))
    name = MINISTACK if server.kind == "ministack" else server.kind
    print(f"{n} records of {args.size}x{args.size}x3 ({shard_bytes / 1e6:.1f} MB in {len(shards)} shards), batch "
          f"{args.batch}, {os.cpu_count()} cores, server {name} on {server.endpoint}"
          f"{f', loopback shaped to {args.link}' if args.link else ''}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    keys = [f"dsc/shards/{p.name}" for p in shards]
    raws, written = {}, {}
    for p in sorted({1, args.parallel}):  # alternated, so the machine's other load falls on both alike
        for _ in range(args.repeat):
            for rows_of, into in ((raws, None), (written, work)):
                run = raw_rate(server, keys, p, into)
                if p not in rows_of or run[0] > rows_of[p][0]:
                    rows_of[p] = run
    print(f"\nraw ranged GETs (obstore, {PIECE >> 20} MiB pieces over every shard object, best of {args.repeat}); "
          "CPU seconds per GB of shards, this process's and the server's; written: each piece also written into a "
          "fresh file at its offset (what any node cache does at least with what it fetches)")
    for label, table in (("", raws), (" written", written)):
        for p, (rate, used) in table.items():
            print(f"  {p:>2} in flight{label:<8} {rate / 1e6:8.0f} MB/s = {rate / record_bytes:9,.0f} records/s; "
                  f"CPU/GB {per_gb(used.client, shard_bytes)}, server {per_gb(used.server, shard_bytes)}")
    raw = max(rate for rate, _ in raws.values()) / record_bytes
    kept = max(rate for rate, _ in written.values()) / record_bytes
    rows = dsc_rows(server, url, local, work, args.batch, args.repeat, n)
    print(f"\ndsc (samples/s, best of {args.repeat}; cold = open + first epoch, empty cache; its CPU seconds per GB "
          "of shards; cold/written: against the raw GETs written into files)")
    print(f"  {'order':<11} {'cold':>9} {'cold/raw':>9} {'/written':>9} {'CPU/GB':>7} {'server':>7} {'warm':>10} "
          f"{'local':>10} {'warm/local':>11}")
    for order, r in rows.items():
        used = r["cold_cpu"]
        print(f"  {order:<11} {r['cold']:>9,.0f} {r['cold'] / raw:>8.2f}x {r['cold'] / kept:>8.2f}x "
              f"{per_gb(used.client, shard_bytes):>7} {per_gb(used.server, shard_bytes):>7} {r['warm']:>10,.0f} "
              f"{r['local']:>10,.0f} {r['warm'] / r['local']:>10.2f}x")
    fetches = fetch_rows(server, url, local, work, args.fetch_batch, shard_bytes, record_bytes)
    print_fetches(fetches, shard_bytes, args.fetch_batch)
    peers = peer_rows(args, server, local, work) if args.peers else {}
    if peers:
        print("\npeers from the same endpoint (samples/s, shuffled; cold = first epoch, "
              f"warm = epochs 2-{EPOCHS_PEERS}); dsc: random order")
        print(f"  {'tool':<10} {'cold':>9} {'warm':>10} {'dsc/peer cold':>14} {'dsc/peer warm':>14}  settings")
        for tool, r in peers.items():
            if isinstance(r, str):
                print(f"  {tool:<10} did not run: {r}")
                continue
            print(f"  {tool:<10} {r['cold']:>9,.0f} {r['warm']:>10,.0f} {rows['random']['cold'] / r['cold']:>13.2f}x "
                  f"{rows['random']['warm'] / r['warm']:>13.2f}x  {r['settings']}")
    targets(rows, raw, kept, fetches, peers)


def print_fetches(fetches: list[tuple], shard_bytes: int, batch: int) -> None:
    print(f"\nbytes the server sent (x the shards' {shard_bytes / 1e6:.1f} MB): open + epoch 1, then epoch 2, batch "
          f"{batch}; Belady (optimal) and LRU caches simulated over the loader's own order of epochs 1-2; default: "
          "no cache_bytes given")
    print(f"  {'cache':<16} {'order':<7} {'epoch 1':>8} {'epoch 2':>8} {'Belady':>8} {'LRU':>8} {'epoch 2/Belady':>15}")
    for cache, order, fetched, best, recent in fetches:
        sims = f"{best / shard_bytes:>7.2f}x {recent / shard_bytes:>7.2f}x" if best is not None else f"{'':>17}"
        if isinstance(fetched, str):
            print(f"  {cache:<16} {order:<7} {'-':>8} {'-':>8} {sims}  {fetched}")
            continue
        ratio = f"{fetched[1] / best:>14.2f}x" if best else ""
        print(f"  {cache:<16} {order:<7} {fetched[0] / shard_bytes:>7.2f}x {fetched[1] / shard_bytes:>7.2f}x "
              f"{sims} {ratio}")


def targets(rows: dict, raw: float, kept: float, fetches: list[tuple], peers: dict) -> None:
    def verdict(ratio: float, want: float, most: bool = False) -> str:
        return f"{ratio:6.3f}x  {'ok' if (ratio <= want if most else ratio >= want) else 'MISSED'}"

    print("\ntargets (worst case over the orders)")
    print(f"  {'cold >= 0.8x the raw limit':<46} "
          f"{verdict(min(r['cold'] for r in rows.values()) / raw, TARGETS['cold'])}")
    print(f"  {'  (cold vs the raw GETs written into files)':<46} {min(r['cold'] for r in rows.values()) / kept:6.3f}x")
    print(f"  {'warm >= 0.9x local disk':<46} "
          f"{verdict(min(r['warm'] / r['local'] for r in rows.values()), TARGETS['warm'])}")
    measured = [f[1] / b for _, _, f, b, _ in fetches if b and not isinstance(f, str)]
    print(f"  {'second-epoch fetches <= 1.05x Belady':<46} "
          + (verdict(max(measured), TARGETS["fetch"], most=True) if measured else "not measured: no cache_bytes here"))
    ran = [r for r in peers.values() if isinstance(r, dict)]
    if ran:
        worst = min(min(rows["random"]["cold"] / r["cold"], rows["random"]["warm"] / r["warm"]) for r in ran)
        print(f"  {'samples/s >= 2x each peer (cold and warm)':<46} {verdict(worst, TARGETS['peer'])}")


if __name__ == "__main__":
    main()
