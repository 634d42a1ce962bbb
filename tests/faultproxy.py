"""A loopback HTTP proxy with switchable faults, in front of the tests' S3 server: what a flaky
network and an overloaded or dying object store do to a client, made on demand.

It listens on 127.0.0.1 (a port the kernel picks) and forwards each request to one upstream
endpoint, which must be on loopback too. Every request it receives is recorded (method, path, its body's
size, what it did with it and the bytes of the answer's body it sent back), so a test counts retries,
uploaded and downloaded bytes at the server side, not by the client's word.

Faults apply to the next requests of `method` (GET unless told) whose path contains `match` (any
path when empty):
- `slow_down(n)`: answer the next n with 503 SlowDown and an S3 error XML body;
- `drop(n)`: forward, send the headers and half the body, then cut the connection;
- `delay(seconds, n)`: wait that long before answering (the client may give up first);
- `kill_mid_response()`: send half a body, then close the listening socket and every open
  connection (a server killed mid-epoch); `restart()` listens again on the same port;
- `hold(n)`: keep the next n from the server until `release()` (at most HOLD_LIMIT_S): a writer stopped
  at a chosen request while another one goes on;
- `refuse(n)`: answer the next n with 412 Precondition Failed, as to a conditional PUT whose object another
  writer changed meanwhile.
`settle()` waits until no request the proxy has read is still on its way to the server (a held or delayed one,
sent by a client since killed, has landed): what a test looks at next is what that client left.
`bare_etags = True` makes the proxy a server that takes only a bare ETag in a PUT's `If-Match` and answers
412 to a quoted one, as Ceph's radosgw 16.2 does (HTTP and S3 quote it).
Standard library only; every loop is bounded (the handler's keep-alive loop by a socket timeout).
"""

from __future__ import annotations

import http.client
import http.server
import ipaddress
import socket
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

HOST = "127.0.0.1"
IDLE_S = 30  # a kept-alive connection idle this long is closed (its thread ends)
UPSTREAM_TIMEOUT_S = 30
HOLD_LIMIT_S = 60  # a held request goes on after this even if never released
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
PRECONDITION_FAILED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PreconditionFailed</Code>'
                       b"<Message></Message><RequestId>faultproxy</RequestId></Error>")
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><RequestId>faultproxy</RequestId></Error>")


@dataclass
class Fault:
    kind: str  # "slow_down", "drop", "delay", "kill", "hold", "refuse"
    count: int  # requests left to hit
    match: str = ""
    seconds: float = 0.0
    method: str = "GET"


@dataclass
class Seen:
    method: str
    path: str
    action: str  # "forwarded", the fault's kind, or "quoted_if_match" (refused: `bare_etags`)
    sent: int = 0  # bytes of the request's body: what the client uploaded
    served: int = 0  # bytes of the answer's body sent back: what the client downloaded (a cut answer: what went)
    answered: int = 0  # the status of the answer once it was sent whole (0: none, or cut)
    over: bool = False  # the proxy is done with it (forwarded and answered, or given up): nothing of it is in flight


class FaultProxy:
    """A threaded HTTP/1.1 proxy on 127.0.0.1 in front of `upstream` (an http://127.0.0.1:PORT URL)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not ipaddress.ip_address(parts.hostname or "").is_loopback:
            raise ValueError(f"{upstream}: the fault proxy forwards only to a loopback http endpoint")
        self.upstream = (parts.hostname, parts.port)
        self.lock = threading.Lock()
        self.faults: list[Fault] = []
        self.released = threading.Event()
        self.seen: list[Seen] = []
        self.bare_etags = False
        self.connections: set[socket.socket] = set()
        self.port = 0
        self.server: _Server | None = None
        self.thread: threading.Thread | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = _Server((HOST, self.port), Handler, bind_and_activate=False)
        server.allow_reuse_address = True  # restart() binds the port the killed server held
        server.daemon_threads = True
        server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.server_bind()
        server.server_activate()
        self.port = server.server_address[1]
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def kill(self) -> None:
        """Close the listening socket and every open connection at once (the server is gone)."""
        server, self.server = self.server, None
        if server is None:
            return
        server.shutdown()  # ends serve_forever's loop (it polls every 50 ms)
        server.server_close()
        with self.lock:
            open_now = list(self.connections)
        for conn in open_now:
            _cut(conn)
        if self.thread is not None:
            self.thread.join(timeout=5)

    def restart(self) -> None:
        """Listen again on the same port (after `kill`)."""
        self.kill()
        self.start()

    stop = kill

    # ------------------------------------------------------------------ faults

    def slow_down(self, n: int, match: str = "", method: str = "GET") -> None:
        self._add(Fault("slow_down", n, match, method=method))

    def drop(self, n: int, match: str = "", method: str = "GET") -> None:
        self._add(Fault("drop", n, match, method=method))

    def delay(self, seconds: float, n: int, match: str = "", method: str = "GET") -> None:
        self._add(Fault("delay", n, match, seconds, method))

    def kill_mid_response(self, match: str = "", method: str = "GET") -> None:
        self._add(Fault("kill", 1, match, method=method))

    def hold(self, n: int, match: str = "", method: str = "GET") -> None:
        self.released.clear()
        self._add(Fault("hold", n, match, method=method))

    def refuse(self, n: int, match: str = "", method: str = "PUT") -> None:
        self._add(Fault("refuse", n, match, method=method))

    def release(self) -> None:
        """Let the held requests (and any later one a hold catches) go on to the server."""
        self.released.set()

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def count(self, method: str | None = None, contains: str = "", action: str | None = None) -> int:
        """Requests received so far (of `method`, whose path contains `contains`, handled by `action`)."""
        with self.lock:
            return sum(1 for s in self.seen if (method is None or s.method == method) and contains in s.path
                       and (action is None or s.action == action))

    def answered(self, method: str | None = None, contains: str = "") -> int:
        """Requests answered whole with a 2xx status (of `method`, whose path contains `contains`): what a client
        counts as done. One the upstream failed (a server slowed past its limit by a loaded machine) and the
        client tried again counts in `count`, not here."""
        with self.lock:
            return sum(1 for s in self.seen if (method is None or s.method == method) and contains in s.path
                       and 200 <= s.answered < 300)

    def sent(self, method: str | None = None, contains: str = "") -> int:
        """Bytes of the bodies of the requests received so far (of `method`, whose path contains `contains`)."""
        with self.lock:
            return sum(s.sent for s in self.seen if (method is None or s.method == method) and contains in s.path)

    def served(self, method: str | None = None, contains: str = "") -> int:
        """Bytes of the answers' bodies sent back so far (to requests of `method` whose path contains `contains`):
        error answers' (a 503's XML) and cut answers' halves included, so it equals a client's count of what it
        fetched only where no fault was armed."""
        with self.lock:
            return sum(s.served for s in self.seen if (method is None or s.method == method) and contains in s.path)

    def settle(self, timeout: float = UPSTREAM_TIMEOUT_S + HOLD_LIMIT_S) -> None:
        """Wait until no request the proxy has read (recorded in `seen`) is still on its way: a held or delayed
        one forwarded and answered by the server, or given up. (Bytes a client sent that no handler thread has
        read yet are not waited for: a test settles once the client is gone and the proxy has counted what it
        waits on.)"""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(s.over for s in self.seen):
                    return
            time.sleep(0.01)
        raise TimeoutError(f"requests still in flight through the proxy after {timeout} s")

    def _add(self, fault: Fault) -> None:
        if fault.count < 1:
            raise ValueError("a fault hits at least one request")
        with self.lock:
            self.faults.append(fault)

    def _take(self, method: str, path: str, sent: int = 0) -> tuple[Fault | None, Seen]:
        """The fault for this request (its count used up by one), and the request recorded."""
        with self.lock:
            hit = next((f for f in self.faults if f.match in path and f.method == method), None)
            if hit is not None:
                hit.count -= 1
                if hit.count == 0:
                    self.faults.remove(hit)
            self.seen.append(Seen(method, path, hit.kind if hit else "forwarded", sent))
            return hit, self.seen[-1]


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """Quiet about connections the client (or a fault) closed: a late answer to a client that gave
        up is the point of `delay`; anything else is printed as usual."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def _cut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as a real S3 endpoint
    timeout = IDLE_S

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: the proxy records what it saw
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner.lock:
            self.owner.connections.add(self.connection)

    def finish(self) -> None:
        with self.owner.lock:
            self.owner.connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def do_GET(self) -> None:
        self._serve()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _serve(self) -> None:
        self.recorded = None
        try:
            self._handle()
        finally:
            if self.recorded is not None:
                with self.owner.lock:
                    self.recorded.over = True

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.owner.bare_etags and self.command == "PUT" and self.headers.get("If-Match", "").startswith('"'):
            with self.owner.lock:
                self.recorded = Seen(self.command, self.path, "quoted_if_match", len(body))
                self.owner.seen.append(self.recorded)
            self._answer(412, [("Content-Type", "application/xml")], PRECONDITION_FAILED, len(PRECONDITION_FAILED))
            return
        fault, self.recorded = self.owner._take(self.command, self.path, len(body))
        if fault is not None and fault.kind == "slow_down":
            self._answer(503, [("Content-Type", "application/xml")], SLOW_DOWN, len(SLOW_DOWN))
            return
        if fault is not None and fault.kind == "refuse":
            self._answer(412, [("Content-Type", "application/xml")], PRECONDITION_FAILED, len(PRECONDITION_FAILED))
            return
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.seconds)
        if fault is not None and fault.kind == "hold":
            self.owner.released.wait(HOLD_LIMIT_S)
        status, headers, data = self._forward(body)
        if fault is not None and fault.kind in ("drop", "kill"):
            self._answer(status, headers, data[: len(data) // 2], len(data))  # promises all, sends half
            self.wfile.flush()
            self.close_connection = True
            if fault.kind == "kill":
                threading.Thread(target=self.owner.kill, daemon=True).start()  # kill() joins this server's loop
            _cut(self.connection)
            return
        length = len(data)
        if self.command == "HEAD":  # no body, but the object's size as the upstream declared it
            length = int(dict((k.lower(), v) for k, v in headers).get("content-length", 0))
        self._answer(status, headers, data, length)

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=UPSTREAM_TIMEOUT_S)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
            return answer.status, [(k, v) for k, v in answer.getheaders() if k.lower() not in HOP_BY_HOP], data
        finally:
            upstream.close()

    def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes, length: int) -> None:
        self.send_response_only(status)
        for k, v in headers:
            if k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
            with self.owner.lock:
                self.recorded.served += len(data)
        if len(data) == length or self.command == "HEAD":
            with self.owner.lock:
                self.recorded.answered = status
