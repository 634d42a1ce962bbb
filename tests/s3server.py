"""A real S3 endpoint on 127.0.0.1 for the object-storage tests: moto's server (HTTP, ranged GETs),
started in a thread of the test process, and uploads made with the client dsc reads with (obstore).

Only loopback: the server listens on 127.0.0.1 at a port the kernel picks, and the environment the
tests set points dsc there and nowhere else."""

from __future__ import annotations

import logging
import socket
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("obstore", reason="the s3 extra is not installed: pip install 'dsc-images[s3]'")
pytest.importorskip("moto.server", reason="moto's server is not installed: pip install 'dsc-images[test]'")
pytest.importorskip("flask_cors", reason="moto's server needs flask-cors: pip install 'dsc-images[test]'")

import obstore  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402
from obstore.store import S3Store  # noqa: E402

HOST = "127.0.0.1"
REGION = "us-east-1"


class S3Server:
    """moto's S3 server on a free loopback port; `env` is what points dsc (and obstore) at it."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
        self.server.start()
        host, self.port = self.server.get_host_and_port()
        assert host == HOST
        self.endpoint = f"http://{HOST}:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": REGION}

    def stop(self) -> None:
        self.server.stop()

    def create_bucket(self, bucket: str) -> None:
        # moto accepts an unsigned CreateBucket; obstore has no bucket verbs
        request = urllib.request.Request(f"{self.endpoint}/{bucket}", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200

    def client(self, bucket: str) -> S3Store:
        return S3Store(bucket, endpoint=self.endpoint, region=REGION, access_key_id="testing",
                       secret_access_key="testing", client_options={"allow_http": True})

    def put(self, bucket: str, key: str, data: bytes) -> None:
        obstore.put(self.client(bucket), key, data)

    def delete(self, bucket: str, key: str) -> None:
        obstore.delete(self.client(bucket), key)

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Every file under `folder` to `s3://bucket/prefix/...`, the manifest last; the dataset's URL."""
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name == "manifest.json")
        for path in files:
            self.put(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
        return f"s3://{bucket}/{prefix}"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released: connecting is refused)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]
