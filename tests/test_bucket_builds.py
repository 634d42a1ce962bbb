"""What belongs to a build in a bucket, against a real S3 server on 127.0.0.1 (moto): the folder markers the S3
console creates are no sources; a version prune drops has its build deleted at once; an object under builds/ that
dsc did not write is never deleted."""

from __future__ import annotations

import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from test_s3_image_folder import BUCKET, env, records, runner, server, upload  # noqa: F401 (skips without s3)

from dsc import compile_folder
from dsc.cli import app

from conftest import make_folder


def test_folder_marker_objects_of_the_s3_console_are_passed_over(server, env, tmp_path: Path) -> None:  # noqa: F811
    """The S3 console's "Create folder" makes a zero-byte object whose key ends in '/' (one per folder, the
    prefix's own too): a tree made so compiles as the same tree without them."""
    src = make_folder(tmp_path / "src", classes=2, per_class=3, seed=1)
    url = upload(server, src)
    prefix = url[len(f"s3://{BUCKET}/"):]
    for marker in ("", "class_0/", "class_1/"):
        quoted = urllib.parse.quote(f"{prefix}{marker}", safe="/")
        with urllib.request.urlopen(urllib.request.Request(f"{server.endpoint}/{BUCKET}/{quoted}", data=b"",
                                                           method="PUT"), timeout=10) as answer:
            assert answer.status == 200
    result = runner.invoke(app, ["compile", url, str(tmp_path / "out"), "--size", "16", "--records-per-shard", "5",
                                 "--seed", "3", "--workers", "1"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    compile_folder(src, tmp_path / "local", size=16, records_per_shard=5, seed=3, workers=1)
    assert records(tmp_path / "out") == records(tmp_path / "local")


def test_prune_deletes_at_once_the_build_of_a_version_it_drops(server, env, tmp_path: Path) -> None:  # noqa: F811
    """bucket_versions: "an object only pruned versions list is deleted at once". Version 1 compiled, version 2
    compiled with --force into a build of its own: `prune --keep 1` drops version 1, and its build, which no
    writer can still be writing (a version lists it), goes in the same prune, not a day later."""
    from dsc import format as fmt
    from dsc.compiler import bucket_versions
    from dsc.storage.bucket import Bucket

    src = make_folder(tmp_path / "src", classes=2, per_class=3, seed=1)
    url = f"s3://{BUCKET}/pruned/"
    compile_folder(src, url, size=16, records_per_shard=5, seed=3, workers=1)
    first = {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)}
    compile_folder(src, url, size=16, records_per_shard=5, seed=3, workers=1, force=True)
    second = {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)} - first
    assert first and second
    pruned = bucket_versions.prune(url, 1)
    assert pruned.removed_versions == [1]
    left = {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)}
    assert left == second, sorted(left & first)
    assert set(pruned.removed_files) >= first


def test_prune_leaves_an_object_dsc_did_not_write_under_builds(server, env, tmp_path: Path,  # noqa: F811
                                                                 monkeypatch) -> None:
    """`prune` deletes "only files dsc made": an object of the user's under builds/<16 hex>/ (a notes file
    synced there, say) is not a partial build's, however old, and a compile into the prefix says it is there."""
    from dsc import CompileError
    from dsc.compiler import bucket_publish, bucket_versions
    from dsc.storage.bucket import Bucket

    src = make_folder(tmp_path / "src", classes=2, per_class=3, seed=1)
    url = f"s3://{BUCKET}/notes/"
    compile_folder(src, url, size=16, records_per_shard=5, seed=3, workers=1)
    notes = "builds/0123456789abcdef/notes.txt"
    Bucket(url).put(notes, b"mine")
    monkeypatch.setattr(bucket_publish, "ABANDONED_AFTER_S", 0.0)  # as if every object were a day old
    assert notes not in bucket_versions.prune(url, 1).removed_files
    assert notes in {i.name for i in Bucket(url).list()}
    with pytest.raises(CompileError, match="notes.txt"):
        compile_folder(src, url, size=16, records_per_shard=5, seed=3, workers=1, force=True)
    assert notes in {i.name for i in Bucket(url).list()}
