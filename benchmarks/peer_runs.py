"""One tool's side of `peer_bench.py` and `s3_read_bench.py`: prepare, read or resume with dsc, LitData
or MosaicML Streaming.

    python benchmarks/peer_runs.py TOOL ACTION ...   (TOOL: dsc | litdata | streaming)

Run by peer_bench.py in a fresh process each time: dsc's in dsc's environment, the peers' in
their own (they never share one). Only this file's tool branch imports its tool. Prints one
JSON object on stdout (read and resume), or nothing (prepare: peer_bench.py times the process).
The peers store what dsc stores: the image as uint8 [S, S, 3] ("raw", decoded and fitted here
the way dsc fits, centre crop, Pillow BILINEAR, EXIF applied) or the file's JPEG bytes ("jpeg"),
with its label and its index (to check a resume). For s3_read_bench.py the peers write given
records instead (`prepare_npy`: a .npy of uint8 [N, S, S, 3] and one of labels, the records of a dsc
dataset) and read them back from an S3 endpoint (`read_s3`: cold first epoch, then warm epochs; the
endpoint from the environment, loopback only).
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

BATCH = 256
SEED = 0


def listed(list_file: str) -> list[tuple[int, str, int]]:
    """(index, path, label) of each line "path<TAB>label" of the list file."""
    rows = [line.split("\t") for line in Path(list_file).read_text().splitlines()]
    return [(i, path, int(label)) for i, (path, label) in enumerate(rows)]


def sample(item: tuple[int, str, int], size: int, mode: str) -> dict:
    """What a peer stores for one image: raw pixels fitted to size x size, or the file's bytes."""
    i, path, label = item
    if mode == "jpeg":
        return {"index": i, "image": Path(path).read_bytes(), "label": label}
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img).convert("RGB")
        pixels = np.asarray(ImageOps.fit(img, (size, size), Image.BILINEAR), dtype=np.uint8)
    return {"index": i, "image": np.ascontiguousarray(pixels), "label": label}


def report(**values) -> None:
    print(json.dumps(values))


def epochs_rate(batches_of, epochs: int) -> tuple[float, int]:
    """Samples/s over epochs 2..`epochs` (the first warms the cache and starts the workers), and the
    samples of one epoch. `batches_of(epoch)` yields (images, indices) per batch."""
    served, start, per_epoch = 0, None, 0
    for epoch in range(epochs):
        if epoch == 1:
            start, served = time.perf_counter(), 0
        count = 0
        for images, _ in batches_of(epoch):
            count += len(images)
        served += count
        per_epoch = count
    return served / (time.perf_counter() - start), per_epoch


def cold_and_warm(batches_of, epochs: int) -> dict:
    """Samples/s of the first epoch (cold: everything fetched) and over epochs 2..`epochs` (warm)."""
    times, count = [], 0
    for epoch in range(epochs):
        start, count = time.perf_counter(), 0
        for images, _ in batches_of(epoch):
            count += len(images)
        times.append(time.perf_counter() - start)
    warm = count * (epochs - 1) / sum(times[1:]) if epochs > 1 else None
    return {"cold": count / times[0], "warm": warm, "samples": count}


def npy_records(npy: str) -> tuple[np.ndarray, np.ndarray]:
    """The records (uint8 [N, S, S, 3], memory-mapped) and labels written beside them (NAME.labels.npy)."""
    return np.load(npy, mmap_mode="r"), np.load(npy.replace(".npy", ".labels.npy"))


def npy_sample(i: int, npy: str) -> dict:
    images, labels = npy_records(npy)
    return {"index": i, "image": np.ascontiguousarray(images[i]), "label": int(labels[i])}


def resume_once(make_loader, stop_after: int) -> None:
    """Take `stop_after` batches, save the loader's state, resume it in a new loader, serve the rest of
    the epoch; report how the samples were covered (missing and repeated ones)."""
    loader, first = make_loader(), []
    for b, batch in enumerate(loader):
        first += batch["index"].tolist()
        if b + 1 == stop_after:
            break
    state, count = loader.state_dict(), len(loader.dataset)
    del loader  # MosaicML Streaming keeps shared memory per live dataset
    resumed = make_loader()
    resumed.load_state_dict(state)
    rest = [i for batch in resumed for i in batch["index"].tolist()]
    seen = np.bincount(np.asarray(first + rest, dtype=np.int64), minlength=count)
    report(served=len(first) + len(rest), missing=int((seen == 0).sum()), repeated=int((seen > 1).sum()))


# ----------------------------------------------------------------------------- dsc

def dsc_read(out: str, workers: int, epochs: int) -> None:
    from dsc import MemmapDataset

    loader = MemmapDataset(out).loader(BATCH, order="random", seed=SEED, num_threads=workers)
    rate, per_epoch = epochs_rate(lambda epoch: ((b["image"], b["index"]) for b in loader), epochs)
    report(samples_per_s=rate, samples=per_epoch, settings=f"loader(order='random', num_threads={workers})")


def dsc_resume(out: str, workers: int, stop_after: int) -> None:
    from dsc import MemmapDataset

    ds = MemmapDataset(out)
    resume_once(lambda: ds.loader(BATCH, order="random", seed=SEED, num_threads=workers), stop_after)


# ----------------------------------------------------------------------------- LitData

def litdata_prepare(list_file: str, out: str, size: int, workers: int, mode: str) -> None:
    from litdata import optimize

    optimize(fn=partial(sample, size=size, mode=mode), inputs=listed(list_file), output_dir=out,
             num_workers=workers, chunk_bytes="64MB", verbose=False)


def _litdata_loader(out: str, workers: int):
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(out, shuffle=True, seed=SEED)
    return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)


def litdata_read(out: str, workers: int, epochs: int) -> None:
    loader = _litdata_loader(out, workers)
    rate, per_epoch = epochs_rate(lambda epoch: ((b["image"], b["index"]) for b in loader), epochs)
    report(samples_per_s=rate, samples=per_epoch,
           settings=f"StreamingDataset(shuffle=True, batch_decode='auto'), StreamingDataLoader(num_workers={workers})")


def litdata_resume(out: str, workers: int, stop_after: int) -> None:
    resume_once(lambda: _litdata_loader(out, workers), stop_after)


def litdata_prepare_npy(npy: str, out: str, workers: int) -> None:
    from litdata import optimize

    optimize(fn=partial(npy_sample, npy=npy), inputs=list(range(len(npy_records(npy)[1]))), output_dir=out,
             num_workers=workers, chunk_bytes="64MB", verbose=False)


def litdata_read_s3(url: str, cache: str, workers: int, epochs: int) -> None:
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    # LitData 0.2.76 fetches chunks with obstore, passing client options without allow_http, so a
    # plain-http endpoint fails ("HTTP error: builder error"); the loopback endpoint needs it.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

    dataset = StreamingDataset(url, cache_dir=cache, shuffle=True, seed=SEED)
    loader = StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)
    report(**cold_and_warm(lambda epoch: ((b["image"], b["index"]) for b in loader), epochs),
           settings=f"StreamingDataset(s3, shuffle=True), StreamingDataLoader(num_workers={workers})")


# ----------------------------------------------------------------------------- MosaicML Streaming

def _streaming_part(part: list, out: str, size: int, mode: str) -> None:
    from streaming import MDSWriter

    image = f"ndarray:uint8:{size},{size},3" if mode == "raw" else "bytes"
    with MDSWriter(out=out, columns={"index": "int", "image": image, "label": "int"}, size_limit="64mb") as writer:
        for item in part:
            writer.write(sample(item, size, mode))


def streaming_prepare(list_file: str, out: str, size: int, workers: int, mode: str) -> None:
    """Its documented parallel pattern: one MDSWriter process per part, then `merge_index`."""
    from multiprocessing import get_context

    from streaming.base.util import merge_index

    items = listed(list_file)
    parts = [items[k::workers] for k in range(workers)]
    with get_context("fork").Pool(workers) as pool:
        pool.starmap(_streaming_part, [(part, os.path.join(out, f"part{k}"), size, mode)
                                       for k, part in enumerate(parts)])
    merge_index([os.path.join(out, f"part{k}", "index.json") for k in range(workers)], out, keep_local=True)


def _streaming_loader(out: str, workers: int):
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    dataset = StreamingDataset(local=out, shuffle=True, shuffle_seed=SEED, batch_size=BATCH)
    return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0)


def streaming_read(out: str, workers: int, epochs: int) -> None:
    loader = _streaming_loader(out, workers)
    rate, per_epoch = epochs_rate(lambda epoch: ((b["image"], b["index"]) for b in loader), epochs)
    report(samples_per_s=rate, samples=per_epoch,
           settings=f"StreamingDataset(shuffle=True, batch_size={BATCH}), StreamingDataLoader(num_workers={workers}, "
                    "persistent_workers=True)")


def streaming_resume(out: str, workers: int, stop_after: int) -> None:
    resume_once(lambda: _streaming_loader(out, workers), stop_after)


def _streaming_npy_part(npy: str, indices: list, out: str) -> None:
    from streaming import MDSWriter

    images, _ = npy_records(npy)
    image = "ndarray:uint8:" + ",".join(map(str, images.shape[1:]))
    with MDSWriter(out=out, columns={"index": "int", "image": image, "label": "int"}, size_limit="64mb") as writer:
        for i in indices:
            writer.write(npy_sample(i, npy))


def streaming_prepare_npy(npy: str, out: str, workers: int) -> None:
    """As streaming_prepare: one MDSWriter process per part, then `merge_index`."""
    from multiprocessing import get_context

    from streaming.base.util import merge_index

    count = len(npy_records(npy)[1])
    with get_context("fork").Pool(workers) as pool:
        pool.starmap(_streaming_npy_part, [(npy, list(range(k, count, workers)), os.path.join(out, f"part{k}"))
                                           for k in range(workers)])
    merge_index([os.path.join(out, f"part{k}", "index.json") for k in range(workers)], out, keep_local=True)


def streaming_read_s3(url: str, cache: str, workers: int, epochs: int) -> None:
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    dataset = StreamingDataset(remote=url, local=cache, shuffle=True, shuffle_seed=SEED, batch_size=BATCH)
    loader = StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0)
    report(**cold_and_warm(lambda epoch: ((b["image"], b["index"]) for b in loader), epochs),
           settings=f"StreamingDataset(remote=s3, shuffle=True, batch_size={BATCH}), "
                    f"StreamingDataLoader(num_workers={workers}, persistent_workers=True)")


def main() -> None:
    tool, action, *args = sys.argv[1:]
    function = globals()[f"{tool}_{action}"]
    function(*[int(a) if a.isdigit() else a for a in args])


if __name__ == "__main__":
    main()
