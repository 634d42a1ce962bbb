"""`dsc.storage.bucket`: object writes against a real S3 server on 127.0.0.1 (moto), the conditional
ones (create-only, compare-and-swap) included, and a streaming upload retried through a fault proxy."""

from __future__ import annotations

import pytest

from dsc.errors import DatasetError
from dsc.storage import bucket as bucket_module
from dsc.storage import s3
from dsc.storage.bucket import Bucket

from s3server import S3Server, serving  # skips this module when the server packages are missing

from faultproxy import FaultProxy  # isort: skip (after s3server, which may skip the module)

BUCKET = "dsc-bucket-tests"
server = serving(BUCKET)
_prefixes = iter(range(1 << 30))


@pytest.fixture
def env(server: S3Server, monkeypatch) -> None:
    server.point_at(monkeypatch)


@pytest.fixture
def objects(env) -> Bucket:
    """A fresh prefix of the test bucket."""
    return Bucket(f"s3://{BUCKET}/b{next(_prefixes)}/data")


def test_put_get_head_list_delete_name_objects_relative_to_the_prefix(objects: Bucket, server: S3Server) -> None:
    etag = objects.put("shards/00000.bin", b"records")
    objects.put("labels.bin", b"\0" * 8)
    server.put(BUCKET, objects.key("shards2/x"), b"beside")  # a sibling folder whose name starts alike
    assert objects.get("shards/00000.bin") == (b"records", etag)
    assert objects.get_range("shards/00000.bin", 2, 5) == b"cor"
    assert objects.head("shards/00000.bin") == bucket_module.ObjectInfo("shards/00000.bin", 7, etag)
    assert objects.head("nothing") is None
    assert [i.name for i in objects.list("shards")] == ["shards/00000.bin"]
    assert [i.name for i in objects.list()] == ["labels.bin", "shards/00000.bin", "shards2/x"]
    objects.delete("shards/00000.bin")
    objects.delete("shards/00000.bin")  # gone already: fine
    assert objects.list("shards") == []
    with pytest.raises(DatasetError, match=r"s3://dsc-bucket-tests/b\d+/data/shards/00000.bin: missing"):
        objects.get("shards/00000.bin")


def test_create_writes_once_and_never_replaces_other_bytes(objects: Bucket) -> None:
    assert objects.create("versions/00000001.json", b"first")
    assert not objects.create("versions/00000001.json", b"second")  # 412: another writer's version stays
    assert objects.get("versions/00000001.json")[0] == b"first"
    # a create retried after its answer was lost meets its own object: the same bytes count as written
    assert objects.create("versions/00000001.json", b"first")


def test_replace_is_a_compare_and_swap_on_the_etag(objects: Bucket) -> None:
    old = objects.put("manifest.json", b"v1")
    assert objects.replace("manifest.json", b"v2", old)
    assert objects.replace("manifest.json", b"v2", old)  # a retry of the write that already landed
    assert not objects.replace("manifest.json", b"v3", old)  # stale ETag: someone else's write stays
    assert objects.get("manifest.json")[0] == b"v2"
    assert not objects.replace("gone.json", b"v1", old)


def test_copy_is_server_side_and_whole(objects: Bucket) -> None:
    objects.put("a.bin", b"abc" * 1000)
    objects.copy("a.bin", "b/a.bin")
    assert objects.get("b/a.bin")[0] == b"abc" * 1000


@pytest.fixture
def proxied(server: S3Server, monkeypatch) -> FaultProxy:
    proxy = FaultProxy(server.endpoint)
    server.point_at(monkeypatch, proxy.endpoint)
    yield proxy
    proxy.kill()


def test_a_streaming_upload_is_multipart_and_a_failed_one_is_retried_whole(proxied: FaultProxy,
                                                                           monkeypatch) -> None:
    monkeypatch.setattr(bucket_module, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part: a small test
    monkeypatch.setattr(s3, "BACKOFF_S", 0.01)
    objects = Bucket(f"s3://{BUCKET}/b{next(_prefixes)}")
    pieces = [bytes([k]) * (3 << 20) for k in range(4)]  # 12 MiB: three parts
    calls = []

    def stream():
        calls.append(1)
        return iter(pieces)
    proxied.slow_down(1, match="partNumber=2", method="PUT")  # one part refused: the upload starts over
    etag = objects.upload("shards/00000.bin", stream)
    assert etag.endswith('-3"')  # a multipart ETag: MD5 of the parts' MD5s, then the part count
    assert len(calls) == 2
    assert proxied.count("PUT", "partNumber=2", action="slow_down") == 1
    assert objects.get("shards/00000.bin")[0] == b"".join(pieces)
