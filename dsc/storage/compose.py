"""One object composed of ranges of objects already in its bucket and of bytes: a multipart upload whose
parts are server-side copies (`UploadPartCopy` with a byte range) or uploaded bytes.

A bucket build assembles each shard from its chunk objects this way (`dsc.compiler.bucket_chunks`): the
records' bytes were uploaded once, by the worker that decoded them, and the server copies them into the
shard; only a piece shorter than S3's smallest part travels again (a run cut short by a skipped source).
The upload appears whole, at completion, or not at all (aborted on any error; a process killed leaves
an unfinished upload, which no reader sees).

obstore 0.12 has no multipart verbs (only one process's streaming writer and a whole-object copy), so
these requests go through botocore, configured from the same settings as obstore's client
(`s3._client_options`: keys, region, endpoint, timeouts); one client per process, never across fork.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dsc.errors import StorageError
from dsc.storage import s3

PART_MIN = 5 << 20  # S3's smallest part, but the last
IN_FLIGHT = 4  # parts sent at a time: a copy of a 64 MiB range takes a real server a while
Part = tuple[str, int, int] | bytes  # (source key, start, stop): a copied range; bytes: uploaded as they are
_clients: dict[tuple, Any] = {}


def client() -> Any:
    """This process's botocore S3 client, for the environment's settings."""
    config, options = s3._client_options()
    key = (os.getpid(), repr(sorted(config.items())), repr(sorted(options.items())))
    if key not in _clients:
        try:
            import botocore.config
            import botocore.session
        except ImportError as e:
            raise StorageError(f"compiling into a bucket needs botocore, which is not installed: {s3.EXTRA}") from e
        settings = botocore.config.Config(
            connect_timeout=5, read_timeout=s3._request_timeout(), retries={"max_attempts": s3.ATTEMPTS,
                                                                         "mode": "standard"},
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if config.get("endpoint") else None)
        _clients[key] = botocore.session.get_session().create_client(
            "s3", region_name=config.get("region") or "us-east-1", endpoint_url=config.get("endpoint"),
            aws_access_key_id=config.get("access_key_id"), aws_secret_access_key=config.get("secret_access_key"),
            aws_session_token=config.get("session_token"), config=settings)
    return _clients[key]


def compose(bucket: str, key: str, parts: Iterable[Part], where: str) -> str:
    """Write object `key` of `bucket` as the concatenation of `parts` (each but the last PART_MIN bytes at
    least; `parts` may raise, which aborts the upload); its ETag. `where` names the object in messages."""
    c = client()
    upload = _call(where, "CreateMultipartUpload", c.create_multipart_upload, Bucket=bucket, Key=key)
    into = {"Bucket": bucket, "Key": key, "UploadId": upload["UploadId"]}

    def send(number: int, part: Part) -> dict:
        if isinstance(part, bytes):
            etag = _call(where, "UploadPart", c.upload_part, **into, PartNumber=number, Body=part)["ETag"]
        else:
            source, start, stop = part
            etag = _call(where, "UploadPartCopy", c.upload_part_copy, **into, PartNumber=number,
                         CopySource={"Bucket": bucket, "Key": source},
                         CopySourceRange=f"bytes={start}-{stop - 1}")["CopyPartResult"]["ETag"]
        return {"PartNumber": number, "ETag": etag}
    done: list[dict] = []
    try:
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            sent: deque = deque()
            for number, part in enumerate(parts, 1):
                sent.append(pool.submit(send, number, part))
                if len(sent) == IN_FLIGHT:
                    done.append(sent.popleft().result())
            done.extend(future.result() for future in sent)
        return _call(where, "CompleteMultipartUpload", c.complete_multipart_upload, **into,
                     MultipartUpload={"Parts": done})["ETag"]
    except BaseException:
        try:
            c.abort_multipart_upload(**into)
        except Exception:  # the upload stays unfinished: invisible, and the error above is the one to report
            pass
        raise


def abort_abandoned(bucket: str, prefix: str, older_than_s: float, mine: Callable[[str], bool],
                    where: str) -> list[str]:
    """Abort the unfinished multipart uploads under `prefix` (keys `mine` accepts, relative to it) started
    `older_than_s` ago or more: a killed writer's (a compose, or an append's upload of a large file). Their
    parts are stored, and billed, though no listing of objects shows them; the keys they were for."""
    c, now, aborted = client(), time.time(), []
    under = f"{prefix.rstrip('/')}/" if prefix else ""
    listed = c.get_paginator("list_multipart_uploads")
    pages = _call(where, "ListMultipartUploads", lambda **a: list(listed.paginate(**a)), Bucket=bucket, Prefix=under)
    for upload in (u for page in pages for u in page.get("Uploads", [])):
        key = upload["Key"]
        if mine(key[len(under):]) and now - upload["Initiated"].timestamp() >= older_than_s:
            _call(where, "AbortMultipartUpload", c.abort_multipart_upload, Bucket=bucket, Key=key,
                  UploadId=upload["UploadId"])
            aborted.append(key[len(under):])
    return aborted


def _call(where: str, what: str, request: Callable[..., Any], **arguments: Any) -> Any:
    """`request(**arguments)` (botocore retries it); its failure as one StorageError line naming `where`."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return request(**arguments)
    except ClientError as e:
        error, status = e.response.get("Error", {}), e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        how = f"failed {s3.ATTEMPTS} times; last" if status >= 500 or status == 429 else "refused"  # retried or not
        raise StorageError(f"{where}: {what} {how}: HTTP {status or '?'} ({error.get('Code', '?')}: "
                           f"{error.get('Message', '')})") from e
    except BotoCoreError as e:
        raise StorageError(f"{where}: {what} failed after {s3.ATTEMPTS} tries; last: {e}") from e
