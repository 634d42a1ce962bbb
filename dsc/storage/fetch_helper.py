"""S3 requests of a process forked after obstore started its runtime, made for it by a helper process.

obstore runs every request on one tokio runtime per process, started by the first request. `fork`
copies only the calling thread: in the child the runtime's threads are gone, and a request — through
the parent's client or a new one, blocking or async — waits forever (obstore 0.12.1; tokio does not
support fork, tokio-rs/tokio#4301). A DataLoader worker started by fork is such a child. So a
forked child (`dsc.storage.s3` decides which process is one) sends its requests to a helper of its
own, started at its first request: a fresh interpreter running this file, whose clients and runtime
are its own. The child's threads send `(id, request)` over one pipe and a reader thread hands each
answer to the thread waiting for it; the helper answers on a pool of threads (obstore releases the
GIL). The helper exits when the child closes the pipe (the child exited). A helper that died is
an error of the request (a connection error, which `s3.retried` retries); the next request starts
a new helper.

This file runs by path, not as a module of the package: it imports only the standard library (and
obstore, in the helper), so a helper starts in a few tens of milliseconds.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Any

THREADS = 16  # requests the helper answers at a time (the record cache has 8 GETs in flight per process)


class Helper:
    """One helper process and the pipes to it; `call` is safe from any thread of the process that made it."""

    def __init__(self) -> None:
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        _widen(answers_w)
        try:
            self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(requests_r),
                                             str(answers_w)], pass_fds=(requests_r, answers_w),
                                            stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (requests_w, answers_r):
                os.close(fd)
            raise
        finally:
            os.close(requests_r)
            os.close(answers_w)
        self._requests = Connection(requests_w, readable=False)
        self._answers = Connection(answers_r, writable=False)
        self._lock = threading.Lock()
        self._waiting: dict[int, Future] = {}
        self._ids = itertools.count()
        self.dead: BaseException | None = None
        threading.Thread(target=self._read_answers, name="dsc-s3-helper", daemon=True).start()

    def call(self, request: tuple, timeout: float) -> Any:
        """The helper's answer to `request` (see `answer`), or the exception it raised there."""
        future: Future = Future()
        with self._lock:
            if self.dead is not None:
                raise self.dead
            number = next(self._ids)
            self._waiting[number] = future
            try:
                self._requests.send((number, request))
            except OSError as e:  # the helper is gone: its reader thread says how
                del self._waiting[number]
                raise ConnectionResetError(f"the S3 helper process {self.process.pid} is gone ({e})") from e
        try:
            return future.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._waiting.pop(number, None)
            raise TimeoutError(f"the S3 helper process {self.process.pid} gave no answer within "
                               f"{timeout:g} s") from None

    def _read_answers(self) -> None:
        try:
            while True:
                number, ok, value = self._answers.recv()
                if ok == BYTES:  # the bytes follow as they are, not pickled (one copy less each way)
                    ok, value = True, self._answers.recv_bytes()
                with self._lock:
                    future = self._waiting.pop(number, None)
                if future is not None:
                    (future.set_result if ok else future.set_exception)(value)
        except (EOFError, OSError) as e:
            status = self.process.wait()
            dead = ConnectionResetError(f"the S3 helper process {self.process.pid} exited (status {status}; {e!r})")
            with self._lock:
                self.dead = dead
                waiting, self._waiting = self._waiting, {}
            for future in waiting.values():
                future.set_exception(dead)


BYTES = "bytes"  # an answer whose bytes come next, in a message of their own
PIPE_BYTES = 1 << 20  # the answers' pipe buffer (Linux's default maximum): records pass in fewer writes


def _widen(fd: int) -> None:
    """A larger pipe buffer where the system allows it (Linux), else the default is kept."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:
        pass


_lock = threading.Lock()
_helper: Helper | None = None


def _forget_parents_helper() -> None:
    """In a child forked from a process with a helper: that helper is its parent's, never this one's."""
    global _lock, _helper
    _lock, _helper = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_parents_helper)


def call(request: tuple, timeout: float) -> Any:
    """`request` answered by this process's helper, started now if it has none alive."""
    global _helper
    with _lock:
        if _helper is None or _helper.dead is not None:
            _helper = Helper()
        helper = _helper
    return helper.call(request, timeout)


def helper_pid() -> int | None:
    """The process id of this process's helper, if it started one."""
    return None if _helper is None else _helper.process.pid


# --------------------------------------------------------------------- the helper's side

def answer(request: tuple, stores: dict) -> Any:
    """("head", bucket, settings, key) -> the object's metadata; ("get_range", bucket, settings, key, start,
    end) -> those bytes. `settings` are obstore S3Store's keyword arguments."""
    import obstore
    from obstore.store import S3Store

    op, bucket, settings, key, *span = request
    name = (bucket, repr(sorted((k, sorted(v.items()) if isinstance(v, dict) else v) for k, v in settings.items())))
    store = stores.get(name)
    if store is None:
        store = stores[name] = S3Store(bucket, **settings)
    if op == "head":
        return dict(obstore.head(store, key))
    if op == "get_range":
        return bytes(obstore.get_range(store, key, start=span[0], end=span[1]))
    raise ValueError(f"unknown request {op!r}")


def _portable(e: Exception) -> Exception:
    """`e` if it survives pickling (obstore's errors do), else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def serve(requests_fd: int, answers_fd: int) -> None:
    """Answer requests until the pipe closes."""
    requests, answers = Connection(requests_fd, writable=False), Connection(answers_fd, readable=False)
    lock, stores = threading.Lock(), {}

    def reply(number: int, request: tuple) -> None:
        try:
            message = (number, True, answer(request, stores))
        except Exception as e:
            message = (number, False, _portable(e))
        with lock:
            try:
                if isinstance(message[2], bytes):
                    answers.send((number, BYTES, None))
                    answers.send_bytes(message[2])
                else:
                    answers.send(message)
            except OSError:
                pass  # the child is gone

    with ThreadPoolExecutor(THREADS, "dsc-s3-helper") as pool:
        while True:
            try:
                number, request = requests.recv()
            except (EOFError, OSError):
                break
            pool.submit(reply, number, request)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
    os._exit(0)  # without waiting on obstore's runtime at exit
