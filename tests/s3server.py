"""A real S3 endpoint on 127.0.0.1 for the object-storage tests: moto's server (HTTP, ranged GETs),
started in a thread of the test process, and uploads made with the client dsc reads with (obstore).

Only loopback: the server listens on 127.0.0.1 at a port the kernel picks, and the environment the
tests set points dsc there and nowhere else.

Another S3 implementation already running on loopback (Ceph's radosgw: scripts/radosgw_s3_tests.sh)
replaces moto when $DSC_TEST_S3_ENDPOINT names it (an http://127.0.0.1:PORT URL), with
$DSC_TEST_S3_ACCESS_KEY_ID, $DSC_TEST_S3_SECRET_ACCESS_KEY and $DSC_TEST_S3_REGION (default
us-east-1); buckets are then made by a signed request (SigV4), and nothing is stopped at the end."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytest.importorskip("obstore", reason="the s3 extra is not installed: pip install 'dsc-images[s3]'")
pytest.importorskip("moto.server", reason="moto's server is not installed: pip install 'dsc-images[test]'")
pytest.importorskip("flask_cors", reason="moto's server needs flask-cors: pip install 'dsc-images[test]'")

import obstore  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402
from obstore.store import S3Store  # noqa: E402

HOST = "127.0.0.1"
REGION = "us-east-1"
ENDPOINT_ENV = "DSC_TEST_S3_ENDPOINT"


def external() -> dict[str, str] | None:
    """The endpoint and credentials of an S3 server the environment names (loopback only), or None."""
    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    parts = urlsplit(endpoint)
    if parts.scheme != "http" or not ipaddress.ip_address(parts.hostname or "").is_loopback or not parts.port:
        raise ValueError(f"{ENDPOINT_ENV}={endpoint}: the tests use only an http://127.0.0.1:PORT endpoint")
    return {"endpoint": endpoint.rstrip("/"), "key": os.environ.get("DSC_TEST_S3_ACCESS_KEY_ID", "testing"),
            "secret": os.environ.get("DSC_TEST_S3_SECRET_ACCESS_KEY", "testing"),
            "region": os.environ.get("DSC_TEST_S3_REGION", REGION)}


def signed_request(method: str, endpoint: str, path: str, key: str, secret: str, region: str,
                   body: bytes = b"") -> urllib.request.Request:
    """A request (a PUT of `body`, a DELETE) to `endpoint/path` (path style, `path` already percent-encoded)
    signed with AWS Signature Version 4."""
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    host, payload = urlsplit(endpoint).netloc, hashlib.sha256(body).hexdigest()
    signed = "host;x-amz-content-sha256;x-amz-date"
    canonical = (f"{method}\n{path}\n\nhost:{host}\nx-amz-content-sha256:{payload}\nx-amz-date:{stamp}\n\n"
                 f"{signed}\n{payload}")
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    k = f"AWS4{secret}".encode()
    for part in (day, region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers = {"x-amz-date": stamp, "x-amz-content-sha256": payload,
               "Authorization": f"AWS4-HMAC-SHA256 Credential={key}/{scope}, SignedHeaders={signed}, "
                                f"Signature={signature}"}
    return urllib.request.Request(f"{endpoint}{path}", data=body or None, method=method, headers=headers)


class S3Server:
    """moto's S3 server on a free loopback port; `env` is what points dsc (and obstore) at it."""

    def __init__(self) -> None:
        given = external()
        self.server = None
        if given is None:
            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
            self.server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
            self.server.start()
            host, port = self.server.get_host_and_port()
            assert host == HOST
            given = {"endpoint": f"http://{HOST}:{port}", "key": "testing", "secret": "testing", "region": REGION}
        self.endpoint, self.key, self.secret, self.region = (given[k] for k in ("endpoint", "key", "secret", "region"))
        self.port = urlsplit(self.endpoint).port
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key,
                    "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": self.region}

    def point_at(self, monkeypatch, endpoint: str | None = None) -> None:
        """Point dsc (and obstore, and child processes) of this test at the server, or at `endpoint` (a fault
        proxy in front of it), through the standard AWS environment; no S3-only endpoint overrides it."""
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)
        if endpoint is not None:
            monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)

    def stop(self) -> None:
        if self.server is not None:  # an external server is left running, as it was found
            self.server.stop()

    def create_bucket(self, bucket: str) -> None:
        # obstore has no bucket verbs: a signed CreateBucket (moto would take an unsigned one too)
        request = signed_request("PUT", self.endpoint, f"/{bucket}", self.key, self.secret, self.region)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 200
        except urllib.error.HTTPError as e:
            if e.code != 409 or b"BucketAlreadyOwnedByYou" not in e.read():  # a second run on one server
                raise

    def client(self, bucket: str) -> S3Store:
        return S3Store(bucket, endpoint=self.endpoint, region=self.region, access_key_id=self.key,
                       secret_access_key=self.secret, client_options={"allow_http": True})

    def put(self, bucket: str, key: str, data: bytes) -> None:
        obstore.put(self.client(bucket), key, data)

    def put_raw(self, bucket: str, quoted_key: str, data: bytes) -> None:
        """A signed PUT of a key obstore will not write (`..`, `//`, control characters), given percent-encoded."""
        request = signed_request("PUT", self.endpoint, f"/{bucket}/{quoted_key}", self.key, self.secret, self.region,
                                 data)
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200

    def delete_raw(self, bucket: str, quoted_key: str) -> None:
        """A signed DELETE of a key obstore will not name (as `put_raw` writes them)."""
        request = signed_request("DELETE", self.endpoint, f"/{bucket}/{quoted_key}", self.key, self.secret,
                                 self.region)
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 204

    def delete(self, bucket: str, key: str) -> None:
        obstore.delete(self.client(bucket), key)

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Every file under `folder` to `s3://bucket/prefix/...`, the manifest last; the dataset's URL."""
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name == "manifest.json")
        for path in files:
            self.put(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
        return f"s3://{bucket}/{prefix}"


def serving(bucket: str):
    """A module-scoped pytest fixture: a server with `bucket`, stopped after the module's tests."""
    @pytest.fixture(scope="module")
    def server():
        running = S3Server()
        running.create_bucket(bucket)
        yield running
        running.stop()
    return server


_reserved: list[socket.socket] = []  # `closed_port`'s sockets, kept bound for the life of the test process


def closed_port() -> int:
    """A loopback port nothing listens on: bound and never listening, so connecting is refused, and kept bound,
    so that no other process (a test running beside this one, a server it starts) takes it meanwhile."""
    s = socket.socket()
    s.bind((HOST, 0))
    _reserved.append(s)
    return s.getsockname()[1]
