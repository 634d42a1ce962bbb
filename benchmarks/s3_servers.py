"""Loopback S3 endpoints for `s3_read_bench.py`, and a byte-counting relay in front of one.

- `ministack`: MiniStack's S3 (PyPI `ministack`, an ASGI app served by hypercorn), in a process of
  its own from its own virtual environment under the benchmark's cache folder (MiniStack pins a
  botocore that moto's does not match, so it never goes into dsc's environment). Fast enough to
  measure a client: ~1-2.4 GB/s of ranged GETs on this 2-core machine.
- `moto`: moto's server (`python -m moto.server`, dsc's test extra) in a process of its own; its
  ranged GETs are server-bound (~70 MB/s), so it serves the tiny runs only.
- an endpoint already running (e.g. radosgw from scripts/radosgw_s3_tests.sh), given by URL.

Every address is 127.0.0.1 (or the loopback URL given); nothing else is ever contacted.
`shaped_loopback` limits the loopback device's rate for a run (tc's token bucket; root only): a link
slower than this machine's CPUs, so that a row measures what a client does at a network's limit rather
than which of client and server gets the two cores.
`CountingRelay` forwards TCP connections to an endpoint and counts the bytes the server sent
(answers, HTTP headers included): what a cache really fetched, measured outside the client; and the
bytes the clients sent (requests, headers included): what a compile into a bucket really uploaded.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

HOST = "127.0.0.1"
MINISTACK = "ministack==1.5.33"
START_S = 120  # a server that does not answer within this long is an error
RELAY_CHUNK = 1 << 20
RELAY_IDLE_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def check_loopback(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    try:
        loopback = ipaddress.ip_address(parts.hostname or "").is_loopback
    except ValueError:
        loopback = False
    if parts.scheme != "http" or not loopback or not parts.port:
        raise SystemExit(f"--endpoint {endpoint}: only an http://127.0.0.1:PORT endpoint (loopback) is used")
    return endpoint.rstrip("/")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces): [state, ppid, ...]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _cpu_seconds(pid: int) -> float:
    """utime + stime of `pid`, and of its children it has waited for; 0 for a process gone."""
    try:
        fields = _stat(pid)
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _with_descendants(pids: tuple[int, ...]) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(_stat(int(entry))[1])
            except OSError:
                pass
    found, todo = set(pids), list(pids)
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        todo.extend(children)
    return found


class Server:
    """An S3 endpoint on loopback: `endpoint`, credentials, `env` for dsc and the peers; `stop()`."""

    def __init__(self, kind: str, cache: Path, endpoint: str | None = None, pids: tuple[int, ...] = ()) -> None:
        self.kind, self.proc, self.pids = kind, None, tuple(pids)  # pids: a given endpoint's server processes
        self.key = os.environ.get("AWS_ACCESS_KEY_ID", "testing") if endpoint else "testing"
        self.secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "testing") if endpoint else "testing"
        self.region = os.environ.get("AWS_REGION", "us-east-1") if endpoint else "us-east-1"
        if endpoint:
            self.endpoint, self.kind = check_loopback(endpoint), "a given endpoint"
            return
        port = free_port()
        self.endpoint = f"http://{HOST}:{port}"
        if kind == "moto":
            argv, env = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)], dict(os.environ)
        else:
            python = ministack_python(cache)
            argv = [str(python), "-m", "hypercorn", "ministack.app:app", "--bind", f"{HOST}:{port}",
                    "--log-level", "ERROR"]
            env = {**os.environ, "BIND_HOST": HOST, "GATEWAY_PORT": str(port), "S3_PERSIST": "0",
                   "LOG_LEVEL": "ERROR"}
        # its log goes to a file: a pipe nobody reads fills after a few hundred requests (moto logs each one)
        # and the server then blocks in mid-answer
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        self.pids = (self.proc.pid,)
        self._wait()

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) the server's processes and their descendants have used so far; None when
        they are not known (an endpoint given without its process ids)."""
        return sum(map(_cpu_seconds, _with_descendants(self.pids))) if self.pids else None

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": self.region,
                "S3_ENDPOINT_URL": self.endpoint}  # the last for MosaicML Streaming

    def _wait(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"{self.kind} exited at start: {self.log.read().decode(errors='replace')[-500:]}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2)
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer: it serves
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise SystemExit(f"{self.kind} did not answer on {self.endpoint} within {START_S} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self, bucket: str):
        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.endpoint, region=self.region, access_key_id=self.key,
                       secret_access_key=self.secret, client_options={"allow_http": True})

    def create_bucket(self, bucket: str) -> None:
        """A server started here takes an unsigned CreateBucket; another endpoint gets a presigned one."""
        url = f"{self.endpoint}/{bucket}"
        if self.proc is None:
            import obstore

            url = obstore.sign(self.client(bucket), "PUT", "", datetime.timedelta(minutes=5))
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=30)
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists already (ours from an earlier run)
                raise SystemExit(f"{self.kind}: could not create bucket {bucket}: HTTP {e.code}; "
                                 "create it first") from e

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Every file under `folder` to s3://bucket/prefix/..., a manifest or index last; the URL."""
        import obstore

        store = self.client(bucket)
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name in ("manifest.json", "index.json"))
        for path in files:
            obstore.put(store, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
        return f"s3://{bucket}/{prefix}"


def ministack_python(cache: Path) -> Path:
    """The python of MiniStack's own environment under `cache`, made on first use (pip, from PyPI)."""
    python = cache / "ministack-venv" / "bin" / "python"
    if not python.exists():
        for step in ([sys.executable, "-m", "venv", str(python.parent.parent)],
                     [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", MINISTACK]):
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"installing {MINISTACK} into {python.parent.parent} failed: "
                                 f"{(done.stderr.strip().splitlines() or ['?'])[-1]} (--server moto needs no install)")
    return python


@contextlib.contextmanager
def shaped_loopback(rate: str | None):
    """The loopback device limited to `rate` (tc's units: 2400mbit, 5gbit) while the block runs, then as it was;
    nothing when `rate` is None. Every loopback connection of the machine is shaped meanwhile. Needs root and
    tc; a loopback already shaped (a root qdisc other than noqueue) is refused, never replaced."""
    if rate is None:
        yield
        return
    if os.geteuid() != 0 or shutil.which("tc") is None:
        raise SystemExit("--link shapes the loopback device with tc: run as root on Linux, with iproute2's tc")
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    if shown.strip() and "noqueue" not in shown.split("\n")[0]:
        raise SystemExit(f"--link: the loopback device is shaped already ({shown.strip()}); left as it is (one "
                         "a killed run left goes with `tc qdisc del dev lo root`)")
    add = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "2mb", "latency", "100ms"]
    done = subprocess.run(add, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"--link {rate}: {' '.join(add)} failed: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


class CountingRelay:
    """A TCP relay on 127.0.0.1 to an upstream endpoint; `served` counts the bytes upstream sent, `uploaded`
    those the clients sent."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.served, self.uploaded, self._lock = 0, 0, threading.Lock()
        self.listener = socket.create_server((HOST, 0))
        self.endpoint = f"http://{HOST}:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> int:
        with self._lock:
            served, self.served = self.served, 0
        return served

    def close(self) -> None:
        self._stop.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=RELAY_IDLE_S)
            except OSError:  # the server stopped: the client sees its connection closed
                client.close()
                continue
            client.settimeout(RELAY_IDLE_S)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        buf = bytearray(RELAY_CHUNK)
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(memoryview(buf)[:n])
                with self._lock:
                    if count:
                        self.served += n
                    else:
                        self.uploaded += n
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()
