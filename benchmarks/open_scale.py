"""What opening a large dataset costs: time and memory of `MemmapDataset(path)`, its first batch, and `dsc info`.

    python benchmarks/open_scale.py [--counts 1000000 10000000] [--side 32] [--records-per-shard N] [--dir DIR]
                                    [--versions 1.3 1.4]

For each record count, a dataset is built with the format's own writer (`dsc.format` payloads through
`dsc.compiler.output`), nothing decoded: shard files are sparse (sized, never written; their SHA-256 is
that of zeros), index files real (random labels over 1,000 classes, names like `c123/000000042.jpg`),
1,000 skipped sources. Each figure is measured in a fresh process, page cache warm (the build just wrote
the index):

  manifest       the manifest's size (format 1.4 on: a few KB whatever the shards; 1.3 listed ~150 bytes a shard)
  parse s, MB    `storage.parse_manifest(path)` alone, and the anonymous memory it adds: what the manifest
                 costs every process that opens the dataset (1.3 lists every shard in it: --versions 1.3 1.4)
  open s         `MemmapDataset(path)`: manifest parsed, files mapped (shards past a few thousand: on first use);
                 index values are checked as batches use them
  batch s        then `ds.loader(256, order="block", seed=0)` and its first batch: includes the epoch
                 order's blocks (a permutation of count / 64 blocks)
  anon MB        the process's anonymous memory (RssAnon) after the first batch, less that after
                 `import dsc.reader` alone: what grows with the dataset beyond the maps
  maps           then 20 batches in random order: the most shard files the process held mapped (/proc/self/maps),
                 which `dsc.storage.shard_maps` bounds however many shards there are
  info s, MB     `dsc info PATH` as a user runs it, wall time and peak RSS of the whole process

Targets (issue 27): at 10^8 records, open + first batch <= 1 s and <= 256 MB beyond the maps, info <= 1 s.
The build makes and writes the index 2^20 records at a time (its memory does not grow with the count);
10^8 records need ~4.2 GB of disk for the index (and the shards' sizes, sparse): pass
--counts 100000000 where there is room.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.compiler import output

CLASSES = 1000
SKIPS = 1000

ANON_RSS = """
import json, sys, time
def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
"""  # what each measuring script starts with: the process's anonymous memory, beyond its file maps

MEASURE_OPEN = ANON_RSS + """
from dsc.reader import MemmapDataset
import dsc.reader.loader  # what `import dsc.reader` imported before it imported its names lazily: the baseline
base = anon()
t = time.perf_counter()
ds = MemmapDataset(sys.argv[1])
opened = time.perf_counter() - t
t = time.perf_counter()
batch = next(iter(ds.loader(256, order="block", seed=0)))
first = time.perf_counter() - t
grown = anon() - base
shards, most = f"{ds.opened.local_root.resolve()}/shards/", 0
for k, batch in zip(range(20), ds.loader(256, order="random", seed=0)):
    with open("/proc/self/maps") as f:
        most = max(most, sum(shards in line for line in f))
print(json.dumps({"open": opened, "batch": first, "anon": grown, "maps": most}))
"""

MEASURE_PARSE = ANON_RSS + """
from dsc import storage
base = anon()
t = time.perf_counter()
manifest = storage.parse_manifest(sys.argv[1])
print(json.dumps({"parse": time.perf_counter() - t, "parse_anon": anon() - base}))
"""

MEASURE_INFO = """
import resource, subprocess, sys, time
t = time.perf_counter()
done = subprocess.run([sys.executable, "-m", "dsc", "info", sys.argv[1]], capture_output=True)
assert done.returncode == 0, done.stderr
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def zeros_sha256(size: int) -> str:
    digest, block = hashlib.sha256(), bytes(16 << 20)
    for start in range(0, size, len(block)):
        digest.update(block[:min(len(block), size - start)])
    return digest.hexdigest()


BUILD_CHUNK = 1 << 20  # records made and written at a time: the build's memory does not grow with the count


def build(root: Path, count: int, side: int, records_per_shard: int | None,
          version: str = fmt.FORMAT_VERSION, compile_options: dict | None = None) -> fmt.Manifest:
    """A valid dataset of `count` records with sparse shards, through the format's own writer: the index
    payloads (`fmt.encode_sources`, `fmt.encoded_index_payloads`) made a chunk of records at a time and
    appended to their files, so that building 10^8 records needs no more memory than building 10^6.
    `compile_options`: the manifest's `compile` (a real compile's, for a dataset `dsc append` can grow)."""
    record_bytes = side * side * fmt.CHANNELS
    per_shard = records_per_shard or max(1, (1 << 30) // record_bytes)
    (root / fmt.SHARD_DIR).mkdir(parents=True)
    digests: dict[int, str] = {}
    shards = []
    for i, n in enumerate(fmt.shard_records(count, per_shard)):
        size = n * record_bytes
        with open(root / fmt.shard_file(i), "wb") as f:
            f.truncate(size)  # sparse: sized, never written
        if size not in digests:  # hashed once per size (setdefault hashed 1 GiB of zeros for every shard)
            digests[size] = zeros_sha256(size)
        shards.append(fmt.ShardEntry(fmt.shard_file(i), size, digests[size], n))
    rng = np.random.default_rng(0)
    names_of = {**fmt.INDEX_FILES, "checksums": fmt.CHECKSUMS_FILE}  # every record's CRC-32: that of zeros
    zero_crc = zlib.crc32(bytes(record_bytes))
    files = {key: open(root / name, "wb") for key, name in names_of.items()}
    hashes = {key: hashlib.sha256() for key in files}
    end = 0
    try:
        for first in range(0, count, BUILD_CHUNK):
            labels = rng.integers(0, CLASSES, min(BUILD_CHUNK, count - first))
            sizes = np.full((len(labels), 2), side, np.int64)
            names = [f"c{label}/{i:09d}.jpg" for i, label in enumerate(labels.tolist(), first)]
            offsets, blob = fmt.encode_sources(names)
            offsets = offsets if first == 0 else offsets[1:]  # one offsets file: each chunk's after the previous end
            payloads = fmt.encoded_index_payloads(labels, sizes, offsets + np.uint64(end), blob)
            payloads["checksums"] = ("", np.full(len(labels), zero_crc, fmt.CHECKSUM_DTYPE).tobytes())
            for key, (_, payload) in payloads.items():
                files[key].write(payload)
                hashes[key].update(payload)
            end += len(blob)
    finally:
        for f in files.values():
            f.close()
    index = {key: fmt.FileEntry(name, (root / name).stat().st_size, hashes[key].hexdigest())
             for key, name in names_of.items()}
    checksums = index.pop("checksums")
    skips = [{"source": f"bad/{i:06d}.jpg", "reason": "not a recognised image file"} for i in range(SKIPS)]
    manifest = fmt.Manifest(height=side, width=side, count=count, records_per_shard=per_shard,
                            classes=tuple(f"c{k}" for k in range(CLASSES)), shards=tuple(shards), index=index,
                            compile=compile_options or {"size": [side, side], "fit": "center-crop",
                                                        "source_root": "/nonexistent"},
                            skipped=tuple(skips[:fmt.SKIPPED_IN_MANIFEST]),
                            skipped_list=output.write_skip_list(root, skips), version=version,
                            checksums=checksums if fmt.minor_version(version) >= 3 else None)
    return output.write_manifest(root, manifest)


def measure(path: Path) -> dict:
    def run(script: str) -> str:
        return subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                              check=True).stdout
    parsed = json.loads(run(MEASURE_PARSE))
    info_s, info_rss = run(MEASURE_INFO).split()
    return {**parsed, **json.loads(run(MEASURE_OPEN)), "info": float(info_s), "info_rss": int(info_rss)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--side", type=int, default=32)
    p.add_argument("--records-per-shard", type=int, default=None)
    p.add_argument("--dir", type=Path, default=None, help="where to build [default: a temporary folder]")
    p.add_argument("--versions", nargs="+", default=[fmt.FORMAT_VERSION], choices=["1.3", "1.4", fmt.FORMAT_VERSION],
                   help="format versions to write, side by side (1.3: every shard listed in the manifest; 1.4: "
                        "the index whole, not in segments)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="open_scale_", dir=args.dir))
    print(f"{'records':>12} {'shards':>7} {'format':>6} {'manifest':>9} {'parse s':>7} {'parse MB':>8} {'open s':>7} "
          f"{'batch s':>8} {'anon MB':>8} {'maps':>5} {'info s':>7} {'info MB':>8} {'build s':>8}")
    try:
        for count in args.counts:
            for version in args.versions:
                root = work / f"ds_{count}_{version}"
                t = time.perf_counter()
                manifest = build(root, count, args.side, args.records_per_shard, version)
                built = time.perf_counter() - t
                m = measure(root)
                print(f"{count:>12,} {len(manifest.shards):>7,} {version:>6} "
                      f"{(root / fmt.MANIFEST_FILE).stat().st_size / 1e6:>7.2f}MB {m['parse']:>7.2f} "
                      f"{m['parse_anon'] / 1e6:>8.0f} {m['open']:>7.2f} {m['batch']:>8.2f} {m['anon'] / 1e6:>8.0f} "
                      f"{m['maps']:>5} {m['info']:>7.2f} {m['info_rss'] / 1e6:>8.0f} "
                      f"{built:>8.1f}", flush=True)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
