"""Compile into a bucket vs compile into a folder: the same corpus, the same machine, one run.

    python benchmarks/compile_s3_bench.py CORPUS [--images 1000] [--size 224] [--workers 2] [--repeat 1]
                                          [--other-dsc CHECKOUT] [--server ministack|moto | --endpoint URL
                                          [--server-pids PID ...]]

CORPUS is any ImageFolder tree (`python benchmarks/corpus.py /tmp/corpus` makes one). The compile
runs in a fresh process each time (so none inherits another's imports or S3 client): into a local
folder, then into `s3://dsc-bench/...` on a loopback S3 server (MiniStack by default, in a process of
its own: `s3_servers.py`), `--repeat` rounds alternating; `--other-dsc` adds, in each round, the bucket
compile of another dsc source tree (an A/B in one session, on one server, under the same load). The
bucket compile has no local output at all: workers write chunk objects, the server composes the shards
from them, and the driver commits the manifest. Prints the best time of each and their ratio (target:
the bucket compile at >= 0.8x the folder compile's speed), the CPU time of each compile (its workers
included) and of the server meanwhile (a server started here, or `--server-pids`), both of the fastest
round, the bytes each bucket compile's client uploaded per record (an untimed run through a counting
relay: independent of the machine's load), and checks that every object holds the bytes of the folder's
file of the same name.

The floors are folder compiles run while this process uploads the first folder compile's files once
and reads them back once (4 requests in flight; a floor's time lasts until both end): the least any
compile into a bucket adds to a compile into a folder (each record must go up once, and a shard's SHA-256
is over all its bytes in order, which no one worker holds, so they come back once), perfectly overlapped.
- "floor, one PUT a file from the call on": each file PUT whole (obstore), from the moment the compile is
  called: a bound even on bytes no compile has yet.
- "floor, parts from decoding on": from the moment the compile starts decoding (no record exists before),
  each shard sent as a multipart upload of PART_BYTES parts, as it must be where several workers decoded
  its records (no worker holds a whole shard), then completed (the server joins the parts). Still a bound:
  it sends bytes before the compile has decoded them. folder / this floor is the most any compile into a
  bucket reaches on this machine.
Their CPU column is the compile's alone; the transfer's server work is in the server's. Tiny runs are
dominated by fixed costs, where a round's noise can put either side ahead.

On a machine whose cores the server shares, the bucket compile's time is also the server's work
(receiving every chunk object, copying each into its shard): the CPU columns tell dsc's own cost apart
from the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_bench import link_tree, pick_sources  # noqa: E402
from s3_servers import CountingRelay, Server  # noqa: E402

BUCKET = "dsc-bench"
READ_PIECE = 8 << 20  # the floor's read-back: ranged GETs of this size
TRANSFERS = 4  # the floor's requests in flight (compose's IN_FLIGHT parts, too)
FLOORS = {"floor": "started", "parts floor": "decoding"}  # the floors, and when their transfer starts
PART_BYTES = 32 << 20  # a multipart floor's parts: what a worker decoded (a bucket build's chunks are 5-64 MiB)
RUN = """
import json, resource, sys, time
from dsc.compiler import decoding

def cpu():  # this process and its (waited-for) descendants: the driver, the engine's host and workers
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                          resource.RUSAGE_CHILDREN)))
def decode_all(*args, **kwargs):  # says when decoding starts (for work the benchmark runs beside it from then on)
    print("decoding", flush=True)
    return decode_each(*args, **kwargs)
decode_each, decoding.decode_all = decoding.decode_all, decode_all  # before the compiler imports it
from dsc import compile_folder

started, cpu_before = time.perf_counter(), cpu()
print("started", flush=True)  # (likewise, from the call on)
s = compile_folder(sys.argv[1], sys.argv[2], size=int(sys.argv[3]), workers=int(sys.argv[4]),
                   on_skip=lambda source, reason: None)
print(json.dumps({"seconds": time.perf_counter() - started, "cpu": cpu() - cpu_before, "kept": s.kept}))
"""


def timed_compile(src: Path, out: str, size: int, workers: int, env: dict[str, str],
                  server: Server | None = None, beside: Callable[[], None] | None = None,
                  beside_from: str = "started") -> dict:
    """One compile in a fresh process: its own wall time and CPU time (its workers' included), from the call
    to the return (start-up excluded), and the CPU time `server` used meanwhile (None where unknown). It
    runs in SRC's parent folder: `python -c` would import a dsc found in the current folder first.
    `beside`: run on a thread of this process from the moment the compile says `beside_from` ("started": the
    call; "decoding": its decoding begins); the time is then until both have ended."""
    server_before = server.cpu_seconds() if server is not None else None
    with tempfile.TemporaryFile("w+") as log:  # its stderr (warnings, skips): a pipe read only at the end could fill
        run = subprocess.Popen([sys.executable, "-c", RUN, str(src), out, str(size), str(workers)], env=env,
                               cwd=src.parent, stdout=subprocess.PIPE, stderr=log, text=True)
        lines: list[str] = []
        ended: list[float] = []  # when `beside` ended (this process's clock)
        for line in run.stdout:
            lines.append(line)
            if line.strip() == "started":
                called = time.perf_counter()  # (the compile's own clock starts just before it says so)
            if line.strip() == beside_from and beside is not None:
                thread = threading.Thread(target=_ended, args=(beside, ended))
                thread.start()
        if run.wait() != 0:
            log.seek(0)
            raise SystemExit(f"compile into {out} failed: {log.read().strip()[-2000:]}")
    done = json.loads(lines[-1])
    if beside is not None:
        thread.join()
        done["seconds"] = max(done["seconds"], *(end - called for end in ended))  # (none: the transfer failed, and
        # its error is printed)
    done["server_cpu"] = None if server_before is None else server.cpu_seconds() - server_before
    return done


def _ended(work: Callable[[], None], ended: list[float]) -> None:
    work()
    ended.append(time.perf_counter())


def transfer(folder: Path, url: str, parts: bool = False) -> Callable[[], None]:
    """What any compile into a bucket does on top of a compile into a folder, at the least: every file of
    `folder` uploaded once (from memory, as a worker holds its records) and read back once (a shard's
    SHA-256 is over all its bytes in order, which no single worker had), under `url`, with obstore. With
    `parts`, a file larger than PART_BYTES goes up as a multipart upload of such parts (botocore, dsc's
    client for those: obstore has no multipart verbs), as it must where several workers decoded its records:
    no worker holds a whole shard, so none can PUT one."""
    import obstore

    from dsc.storage import compose, s3

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    bucket, prefix = s3.parse_url(url)
    store = s3.client(bucket)
    obstore.put(store, f"{prefix}/warm-up", b"")  # the clients and their runtime started before the clock does
    compose.client()

    def put(path: Path, key: str) -> None:
        data = path.read_bytes()
        if parts and len(data) > PART_BYTES:
            pieces = (data[k:k + PART_BYTES] for k in range(0, len(data), PART_BYTES))
            compose.compose(bucket, key, pieces, url)  # compose.IN_FLIGHT parts at a time
        else:
            obstore.put(store, key, data)

    def run() -> None:
        keys = [f"{prefix}/{p.relative_to(folder).as_posix()}" for p in files]
        pieces = [(key, start, min(path.stat().st_size, start + READ_PIECE)) for path, key in zip(files, keys)
                  for start in range(0, path.stat().st_size, READ_PIECE)]
        with ThreadPoolExecutor(TRANSFERS) as pool:  # as several workers would
            list(pool.map(lambda pk: put(*pk), zip(files, keys)))
            list(pool.map(lambda piece: obstore.get_range(store, piece[0], start=piece[1], end=piece[2]), pieces))
    return run


def with_dsc(env: dict[str, str], tree: Path | None) -> dict[str, str]:
    """`env` whose python imports dsc from source tree `tree` (a checkout holding `dsc/`), when given."""
    if tree is None:
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree.resolve()), env.get("PYTHONPATH")]))}


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
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the compiles, alternating; best of each")
    parser.add_argument("--other-dsc", type=Path, help="a dsc source tree (e.g. a checkout of main) whose bucket "
                        "compile runs in each round too, for an A/B in one session")
    parser.add_argument("--server", choices=("ministack", "moto"), default="ministack")
    parser.add_argument("--endpoint", help="an S3 endpoint already running on loopback, instead of --server")
    parser.add_argument("--server-pids", type=int, nargs="*", default=(),
                        help="the --endpoint server's process ids, for its CPU time (radosgw_serve.sh: "
                        "$DSC_TEST_S3_SERVER_PIDS)")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("DSC_BENCH_CACHE", "~/.cache/dsc/s3-bench")),
                        help="where MiniStack's environment is kept")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat: one round at least")
    kinds = ["folder", "floor", "parts floor", "bucket"] + (["other"] if args.other_dsc else [])
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    uploaded: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="dsc-compile-s3-") as tmp:
        work = Path(tmp)
        src = link_tree(args.corpus.resolve(), pick_sources(args.corpus.resolve(), args.images), work / "src")
        server = Server(args.server, args.cache.expanduser(), args.endpoint, tuple(args.server_pids))
        relay = None
        try:
            os.environ.update(server.env)
            server.create_bucket(BUCKET)
            env = {**os.environ, "DSC_CACHE_DIR": str(work / "cache")}
            envs = {"folder": env, "floor": env, "parts floor": env, "bucket": env,
                    "other": with_dsc(env, args.other_dsc)}
            for k in range(args.repeat):
                for kind in kinds:
                    floor = kind in FLOORS
                    out = str(work / f"{kind}{k}".replace(" ", "-")) if floor or kind == "folder" else \
                        f"s3://{BUCKET}/{kind}-{k}-{time.time_ns()}"
                    beside = transfer(work / "folder0", f"s3://{BUCKET}/floor-{k}-{time.time_ns()}",
                                      parts=kind == "parts floor") if floor else None
                    done = timed_compile(src, out, args.size, args.workers, envs[kind], server, beside,
                                         FLOORS.get(kind, "started"))
                    runs[kind].append(done)
                    if kind == "bucket" and k == 0:
                        n, url = done["kept"], out
            differ = same_bytes(work / "folder0", url)
            relay = CountingRelay(server.endpoint)  # untimed runs: what each client sent, counted outside it
            for kind in kinds[3:]:
                relay.uploaded = 0
                timed_compile(src, f"s3://{BUCKET}/counted-{kind}-{time.time_ns()}", args.size, args.workers,
                              {**envs[kind], "AWS_ENDPOINT_URL": relay.endpoint})
                uploaded[kind] = relay.uploaded
        finally:
            if relay is not None:
                relay.close()
            server.stop()
    record = args.size * args.size * 3
    print(f"{n} images of {args.corpus} at {args.size}x{args.size}, {args.workers} workers, S3 server: {server.kind}, "
          f"{args.repeat} round(s), load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    names = {"folder": "into a folder", "floor": "floor, one PUT a file from the call on",
             "parts floor": "floor, parts from decoding on", "bucket": "into a bucket",
             "other": f"bucket, {args.other_dsc}"}
    fastest = {kind: min(runs[kind], key=lambda r: r["seconds"]) for kind in kinds}  # its CPU times with it
    for kind in kinds:
        best, cpu, served = fastest[kind]["seconds"], fastest[kind]["cpu"], fastest[kind]["server_cpu"]
        rounds = " ".join(f"{r['seconds']:.2f}" for r in runs[kind])
        line = f"{names[kind]}: best {best:6.2f} s ({n / best:6.0f} images/s); rounds: {rounds}; CPU {cpu:.2f} s"
        line += f", the server's {served:.2f} s" if served is not None else ""
        if kind in FLOORS:
            line += f"; folder / floor {fastest['folder']['seconds'] / best:.2f}x"
        elif kind != "folder":
            line += (f"; bucket / folder speed {fastest['folder']['seconds'] / best:.2f}x (target >= 0.8x), CPU "
                     f"{cpu / fastest['folder']['cpu']:.2f}x the folder compile's; uploaded "
                     f"{uploaded[kind] / n / record:.2f} records' bytes per record")
        print(line)
    print(f"objects whose bytes differ from the folder's files: {differ}")


if __name__ == "__main__":
    main()
