"""`dsc bench s3://...`: the loader over a dataset in object storage, beside the network's own limit.

The limit row is raw ranged GETs of the same client to the same endpoint, of the size and as many at a
time as the cache makes them (its files' `request_bytes`, `cache.FETCH_THREADS`), over the shards in order, with
nothing written. The loader rows read into a new cache folder of their own (removed at the end): a cold
epoch (everything fetched), then warm epochs (everything local, when `cache_bytes` holds the dataset).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dsc.reader import MemmapDataset
from dsc.reader.gather import default_threads
from dsc.storage import cache, s3
from dsc.storage.local import cache_writes
from dsc.tools.bench import BenchReport, Rate, _timed, memory_bytes


def network_limit(url: str, folder: Path, budget_s: float) -> Rate:
    """Ranged GETs of every shard in order, `FETCH_THREADS` at a time, for `budget_s` (at least one round)."""
    store = s3.open_store(url, folder)
    ds = MemmapDataset(url, cache_dir=folder)
    m = ds.manifest
    step = ds.opened.records.files.request_bytes
    pieces = [(s.file, a, min(s.bytes, a + step)) for s in m.shards for a in range(0, s.bytes, step)]
    fetched, start = 0, time.perf_counter()
    with ThreadPoolExecutor(cache.FETCH_THREADS) as pool:
        while True:
            fetched += sum(len(b) for b in pool.map(lambda p: store.get_range(*p), pieces))
            if time.perf_counter() - start > budget_s:
                break
    seconds = time.perf_counter() - start
    return Rate(f"limit: ranged GETs, {cache.FETCH_THREADS} at a time", fetched // m.record_bytes, seconds,
                m.record_bytes)


def loader_epochs(ds: MemmapDataset, order: str, batch_size: int, threads: int, budget_s: float,
                  label: str, warm: bool) -> Rate:
    loader = ds.loader(batch_size, order=order, num_threads=threads)

    def batches():
        for batch in loader:
            yield len(batch["index"])

    samples, seconds = _timed(batches, budget_s, warm)
    stats = loader.stats()
    loader.close()
    return Rate(f"{label}dsc loader, {order}", samples, seconds, ds.manifest.record_bytes, stats)


def run(url: str, batch_size: int = 256, threads: int | None = None, budget_s: float = 5.0, cold: bool = True,
        log: Callable[[str], None] = lambda line: None) -> BenchReport:
    """The network limit, a cold epoch and warm ones of the loader, each in a new cache folder of its own."""
    threads = threads or default_threads()
    parent = s3.default_cache_dir()
    with cache_writes(parent, url):
        parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="dsc-bench-", dir=parent))  # ours: removed at the end
    try:
        log("network limit")
        limit = network_limit(url, folder / "limit", budget_s)
        ds = MemmapDataset(url, cache_dir=folder / "loader")
        report = BenchReport(sum(s.bytes for s in ds.manifest.shards), memory_bytes(), limit, [])
        if cold:
            log("cold block (an empty cache)")
            report.cold.append(loader_epochs(ds, "block", batch_size, threads, budget_s, "cold: ", warm=False))
        for order in ("block", "random"):
            log(f"warm {order}")
            report.warm.append(loader_epochs(ds, order, batch_size, threads, budget_s, "", warm=True))
        fits = ds.opened.records.budget >= ds.opened.records.base_bytes + report.dataset_bytes
        step = ds.opened.records.files.request_bytes
        report.notes.append(
            f"the limit is the endpoint's: ranged GETs of up to {step >> 20} MiB, {cache.FETCH_THREADS} at "
            "a time, nothing written; a cold epoch fetches every record once, into the cache"
            + ("" if fits else f"; cache_bytes ({ds.opened.records.budget} bytes) holds less than the dataset, so "
               "warm epochs fetch too (see loader.stats())"))
        return report
    finally:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["run", "network_limit"]
