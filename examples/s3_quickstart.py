"""Try dsc with object storage on this machine: an S3 server on 127.0.0.1, a compile into a bucket, a read
through the node's cache, an append, all as a user types them.

    python examples/s3_quickstart.py [--images examples/images] [--work /tmp/dsc-s3-quickstart]

The server is moto's (`python -m moto.server`, in the test extra: `pip install '.[s3,test]'`), which keeps
everything in memory and is only for trying things out; point AWS_ENDPOINT_URL at a real endpoint for data
you keep. Nothing but 127.0.0.1 is contacted. Each `dsc` command is printed before it runs, with the
environment it needs, so the same lines work against any S3-compatible endpoint.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from dsc import MemmapDataset
from dsc.testing import make_image_folder

HOST = "127.0.0.1"
BUCKET = "quickstart"
START_S = 60  # the server must answer within this


def start_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free loopback port, and its endpoint, once it answers."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()  # its request log: a pipe nobody reads would fill and stop it
    try:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=log)
    except OSError as e:
        raise SystemExit(f"cannot start moto's server: {e}") from e
    endpoint = f"http://{HOST}:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise SystemExit("moto's server did not start (is the test extra installed? pip install '.[s3,test]'):\n"
                             + log.read().decode(errors="replace")[-800:])
        try:
            urllib.request.urlopen(endpoint, timeout=2)
            return server, endpoint
        except urllib.error.HTTPError:
            return server, endpoint  # it answers
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"moto's server did not answer on {endpoint} within {START_S} s")


def dsc(*args: str) -> None:
    """Run a `dsc` command as a user would, printing it first; stop at the first that fails."""
    print(f"\n$ dsc {shlex.join(args)}", flush=True)
    done = subprocess.run([sys.executable, "-m", "dsc", *args])
    if done.returncode:
        raise SystemExit(f"dsc {args[0]} failed (exit code {done.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, default=Path(__file__).resolve().parent / "images")
    parser.add_argument("--work", type=Path, help="where the node cache and the appended images go [a temporary "
                        "folder]")
    args = parser.parse_args()
    if args.work is not None and args.work.exists() and (not args.work.is_dir() or any(args.work.iterdir())):
        parser.error(f"--work {args.work}: give a new or empty folder (images are written into it)")
    work = args.work or Path(tempfile.mkdtemp(prefix="dsc-s3-quickstart-"))
    server, endpoint = start_server()
    try:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"), timeout=10)  # the bucket
        environment = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                       "DSC_CACHE_DIR": str(work / "cache")}
        os.environ.update(environment)
        print("an S3 server runs on", endpoint, "with the bucket", BUCKET, "; the environment dsc reads:")
        print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in environment.items()))
        url = f"s3://{BUCKET}/datasets/examples"

        dsc("compile", str(args.images), url, "--size", "64")
        dsc("info", url)
        dsc("verify", url)

        print(f'\n>>> ds = MemmapDataset("{url}")  # the index fetched once per node, records as they are read')
        ds = MemmapDataset(url)
        loader = ds.loader(8, order="block", seed=0)
        for epoch in range(2):
            loader.set_epoch(epoch)
            served = sum(len(batch["label"]) for batch in loader)
            print(f"epoch {epoch}: {served} records; {loader.stats(reset=True)}")

        more = make_image_folder(work / "more", classes=1, per_class=6, size=(96, 72))
        dsc("append", url, str(more), "--new-classes")  # its class is new: added at the end, when asked for
        dsc("info", url)
        print(f"\n>>> MemmapDataset(url).version, len(...): {MemmapDataset(url).version}, {len(MemmapDataset(url))}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
