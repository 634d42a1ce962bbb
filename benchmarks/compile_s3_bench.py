"""Compile into a bucket vs compile into a folder: the same corpus, the same machine, one run.

    python benchmarks/compile_s3_bench.py CORPUS [--images 1000] [--size 224] [--workers 2]
                                          [--server ministack|moto | --endpoint URL]

CORPUS is any ImageFolder tree (`python benchmarks/corpus.py /tmp/corpus` makes one). The compile
runs twice, each in a fresh process (so neither inherits the other's imports or S3 client): into a
local folder, then into `s3://dsc-bench/compiled` on a loopback S3 server (MiniStack by default, in a
process of its own: `s3_servers.py`). The second has no local output at all: workers write chunk
objects, then assemble the shards from them, and the driver commits the manifest. Prints both times
and their ratio (target: the bucket compile at >= 0.8x the folder compile's speed), and checks that
every object holds the bytes of the folder's file of the same name.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_bench import link_tree, pick_sources  # noqa: E402
from s3_servers import Server  # noqa: E402

BUCKET = "dsc-bench"
RUN = """
import json, sys, time
from dsc import compile_folder
started = time.perf_counter()
s = compile_folder(sys.argv[1], sys.argv[2], size=int(sys.argv[3]), workers=int(sys.argv[4]),
                   on_skip=lambda source, reason: None)
print(json.dumps({"seconds": time.perf_counter() - started, "kept": s.kept}))
"""


def timed_compile(src: Path, out: str, size: int, workers: int, env: dict[str, str]) -> dict:
    """One compile in a fresh process: its own wall time, from the call to the return (start-up excluded)."""
    run = subprocess.run([sys.executable, "-c", RUN, str(src), out, str(size), str(workers)], env=env,
                         capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"compile into {out} failed: {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def same_bytes(local: Path, url: str) -> int:
    """How many of the folder's files (manifest aside) differ from the object of the same name."""
    from dsc import format as fmt
    from dsc.storage.bucket import Bucket

    bucket = Bucket(url)
    manifest = json.loads(bucket.get(fmt.MANIFEST_FILE)[0])
    index = manifest["segments"][0]["index"]  # (1.5) the compile's one index segment
    base = index["labels"]["file"].rsplit("/", 1)[0] + "/"  # builds/<tag>/ (1.4 lists no shards)
    files = [p for p in local.rglob("*") if p.is_file() and p.name != fmt.MANIFEST_FILE]
    return sum(bucket.get(base + p.relative_to(local).as_posix())[0] != p.read_bytes() for p in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--server", choices=("ministack", "moto"), default="ministack")
    parser.add_argument("--endpoint", help="an S3 endpoint already running on loopback, instead of --server")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("DSC_BENCH_CACHE", "~/.cache/dsc/s3-bench")),
                        help="where MiniStack's environment is kept")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsc-compile-s3-") as tmp:
        work = Path(tmp)
        src = link_tree(args.corpus.resolve(), pick_sources(args.corpus.resolve(), args.images), work / "src")
        server = Server(args.server, args.cache.expanduser(), args.endpoint)
        try:
            os.environ.update(server.env)
            server.create_bucket(BUCKET)
            env = {**os.environ, "DSC_CACHE_DIR": str(work / "cache")}
            folder = timed_compile(src, str(work / "out"), args.size, args.workers, env)
            url = f"s3://{BUCKET}/compiled-{int(time.time())}"
            bucket = timed_compile(src, url, args.size, args.workers, env)
            differ = same_bytes(work / "out", url)
        finally:
            server.stop()
    n = folder["kept"]
    print(f"{n} images of {args.corpus} at {args.size}x{args.size}, {args.workers} workers, S3 server: {server.kind}")
    print(f"into a folder:  {folder['seconds']:6.2f} s ({n / folder['seconds']:6.0f} images/s)")
    print(f"into a bucket:  {bucket['seconds']:6.2f} s ({n / bucket['seconds']:6.0f} images/s)")
    ratio = folder["seconds"] / bucket["seconds"]
    print(f"bucket / folder speed: {ratio:.2f}x (target >= 0.8x): {'met' if ratio >= 0.8 else 'NOT met'}")
    print(f"objects whose bytes differ from the folder's files: {differ}")


if __name__ == "__main__":
    main()
