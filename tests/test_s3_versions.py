"""Versions (format 1.3) of datasets in a bucket, against a real S3 server on 127.0.0.1 (moto's): older
versions read by LIST of versions/, `dsc append` / `merge` / `prune` on s3:// datasets, two racing appends in
two processes, an append while a reader iterates. Real compiles of real JPEGs and PNGs."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_versions
import torch
from faultproxy import FaultProxy
from torch.utils.data import DataLoader
from typer.testing import CliRunner

from dsc import format as fmt
from dsc import storage
from dsc.cli import app
from dsc.compiler.append import append
from dsc.compiler.pipeline import compile_folder
from dsc.errors import CompileError, DatasetError
from dsc.reader.dataset import MemmapDataset
from dsc.storage.bucket import Bucket

from conftest import make_folder
from s3server import S3Server, serving  # skips this module when the server packages are missing

BUCKET = "dsc-versions"
SIZE = 16

server = serving(BUCKET)
grown = test_versions.grown  # the local tests' dataset: `a` compiled (12 records, 5 a shard), `b` to append
split_folder = test_versions.split_folder
_prefixes = iter(range(1 << 30))


@pytest.fixture
def env(server: S3Server, monkeypatch, tmp_path: Path) -> Path:
    """The AWS environment pointing at the loopback server, and a fresh cache folder (returned)."""
    server.point_at(monkeypatch)
    monkeypatch.setenv("DSC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def prefix() -> str:
    return f"sets/v{next(_prefixes)}"


def renamed_copy(src: Path, dest: Path) -> Path:
    """`src`'s images again under other names: a third set of sources to append."""
    split_folder(src, {"c": dest}, lambda cls, name: "c")
    for image in dest.rglob("*.*"):
        image.rename(image.with_name("c" + image.name))
    return dest


def pixels(ds: MemmapDataset) -> np.ndarray:
    return ds.__getitems__(list(range(len(ds)))).images.numpy()


def test_older_versions_of_a_bucket_dataset_open_by_listing_versions(server: S3Server, env: Path, grown) -> None:
    tmp, _, _, b = grown
    v1 = pixels(MemmapDataset(tmp / "ds"))
    append(tmp / "ds", b, workers=1)
    url = server.upload(tmp / "ds", BUCKET, prefix())
    latest, first = MemmapDataset(url), MemmapDataset(url, version=1)
    assert (latest.version, len(latest), first.version, len(first)) == (2, 21, 1, 12)
    assert np.array_equal(pixels(first), v1)
    assert np.array_equal(pixels(latest), pixels(MemmapDataset(tmp / "ds")))
    assert storage.dataset_versions(url) == [1, 2]
    for ds, want in ((first, v1), (latest, pixels(latest))):  # forked workers: the versions their parent read
        loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork", timeout=120)
        assert np.array_equal(torch.cat([b[0] for b in loader]).numpy(), want)
    runner = CliRunner()
    info = runner.invoke(app, ["info", url, "--version", "1", "--json"])
    assert info.exit_code == 0, info.output
    shown = json.loads(info.stdout)
    assert (shown["version"], shown["records"], shown["versions"]) == (1, 12, [1, 2])
    verify = runner.invoke(app, ["verify", url, "--version", "1"])
    assert verify.exit_code == 0 and "ok: manifest of version 1," in verify.stdout, verify.output
    with pytest.raises(DatasetError, match="has no version 3"):
        MemmapDataset(url, version=3)
    shutil.rmtree(env)


def tag_of(manifest) -> str:
    """The append folder tag of a version's new files (`appends/<tag>/labels.bin`, its last index segment's)."""
    return manifest.index_segments[-1].index["labels"].file.split("/")[1]


def sealed_doc(text: bytes, tag: str, other: str) -> dict:
    doc = json.loads(text.decode("ascii").replace(tag, other))
    doc.pop("manifest_sha256")
    return doc


def test_an_append_to_a_bucket_writes_the_objects_a_local_append_writes(server: S3Server, env: Path, grown,
                                                                        monkeypatch) -> None:
    from dsc.compiler import append_bucket

    monkeypatch.setattr(append_bucket, "SMALL_OBJECT_BYTES", 1024)  # the shards by multipart upload, the rest by PUT
    tmp, _, _, b = grown
    original = (tmp / "ds" / "manifest.json").read_bytes()
    url = server.upload(tmp / "ds", BUCKET, prefix())
    before = {o.name: o.etag for o in Bucket(url).list()}
    summary = append(url, b, workers=1)
    append(tmp / "ds", b, workers=1)
    remote, here = storage.parse_manifest(url), storage.parse_manifest(tmp / "ds")
    assert (summary.version, summary.added, summary.count) == (2, 9, 21) == (remote.dataset_version, 9, remote.count)
    bucket = Bucket(url)
    assert [e.file.replace(tag_of(remote), tag_of(here)) for e in remote.files] == [e.file for e in here.files]
    for mine, theirs in zip(remote.files, here.files):  # object bytes = file bytes
        assert bucket.get(mine.file)[0] == (tmp / "ds" / theirs.file).read_bytes(), mine.file
    v2 = bucket.get("versions/00000002.json")[0]
    assert sealed_doc(v2, tag_of(remote), tag_of(here)) == sealed_doc((tmp / "ds" / "versions/00000002.json")
                                                                      .read_bytes(), "", "")
    assert bucket.get("manifest.json")[0] == v2 and bucket.get("versions/00000001.json")[0] == original
    after = {o.name: o.etag for o in bucket.list()}
    assert {k: v for k, v in after.items() if k in before and k != "manifest.json"} == \
        {k: v for k, v in before.items() if k != "manifest.json"}  # nothing published was rewritten
    assert all(k.startswith(f"appends/{tag_of(remote)}/") for k in set(after) - set(before) - {
        "versions/00000001.json", "versions/00000002.json"})
    with pytest.raises(CompileError, match="version 2 already ends with these 9 images"):  # run again: refused
        append(url, b, workers=1)
    assert storage.parse_manifest(url).dataset_version == 2
    assert np.array_equal(pixels(MemmapDataset(url)), pixels(MemmapDataset(tmp / "ds")))
    storage.verify_checksums(url, remote)


def test_a_reader_of_version_n_in_a_bucket_keeps_it_while_an_append_lands(server: S3Server, env: Path,
                                                                          grown) -> None:
    tmp, _, _, b = grown
    expected = pixels(MemmapDataset(tmp / "ds"))
    url = server.upload(tmp / "ds", BUCKET, prefix())
    ds = MemmapDataset(url)
    it = iter(ds.loader(4, order="sequential", seed=0))
    seen = [next(it)]
    append(url, b, workers=1)  # lands while the pass is half-way
    seen += list(it)
    served = {int(i): img for batch in seen for i, img in zip(batch["index"], batch["image"].numpy())}
    assert sorted(served) == list(range(12)) and all(np.array_equal(served[i], expected[i]) for i in served)
    copy = pickle.loads(pickle.dumps(ds))  # a DataLoader worker's copy opens the same version again
    fresh = MemmapDataset(url, version=1, cache_dir=tmp / "other-cache")  # every record fetched after the append
    for again in (copy, fresh):
        assert (again.version, len(again)) == (1, 12) and np.array_equal(pixels(again), expected)
    assert len(MemmapDataset(url)) == 21  # a new open sees the new version


def _append_process(url: str, src: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dsc", "append", url, str(src), "-j", "1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sources(ds: MemmapDataset) -> list[str]:
    return [ds.opened.source(i) for i in range(len(ds))]


def test_two_racing_appends_to_a_bucket_in_two_processes_both_land(server: S3Server, env: Path,
                                                                   tmp_path: Path) -> None:
    master = make_folder(tmp_path / "master", classes=2, per_class=6)
    parts = {k: tmp_path / k for k in ("a", "b", "c")}
    split_folder(master, parts, lambda cls, name: "abc"[int(name[4]) % 3])
    compile_folder(parts["a"], tmp_path / "ds", size=SIZE, records_per_shard=3, workers=1)
    url = server.upload(tmp_path / "ds", BUCKET, prefix())
    procs = [_append_process(url, parts[k], {**os.environ}) for k in ("b", "c")]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    ds = MemmapDataset(url)
    assert ds.version == 3 and storage.dataset_versions(url) == [1, 2, 3]
    assert len(set(sources(ds))) == len(ds) == 12  # each append whole, once
    assert len(MemmapDataset(url, version=2)) == 8
    storage.verify_checksums(url, ds.manifest)


def test_an_append_that_loses_the_race_builds_again_on_the_winners_version(server: S3Server, env: Path, grown,
                                                                         monkeypatch) -> None:
    tmp, _, _, b = grown
    c = renamed_copy(b, tmp / "c")
    from dsc.compiler import bucket_versions

    url = server.upload(tmp / "ds", BUCKET, prefix())
    real, calls = bucket_versions.commit, []

    def another_writer_first(bucket, manifest, first):  # the other append commits between plan and commit
        calls.append(manifest.dataset_version)
        if len(calls) == 1:
            monkeypatch.setattr(bucket_versions, "commit", real)
            append(url, c, workers=1)
            monkeypatch.setattr(bucket_versions, "commit", another_writer_first)
        return real(bucket, manifest, first)
    monkeypatch.setattr(bucket_versions, "commit", another_writer_first)
    summary = append(url, b, workers=1)
    assert calls == [2, 3] and summary.version == 3  # lost version 2 to the other append, then made 3
    ds = MemmapDataset(url)
    assert (ds.version, len(ds), len(set(sources(ds)))) == (3, 30, 30)
    assert [p.count for p in ds.manifest.record_parts] == [12, 9, 9]
    listed = set().union(*(MemmapDataset(url, version=v).manifest.files for v in (1, 2, 3)))
    stray = [o.name for o in Bucket(url).list("appends") if o.name not in {e.file for e in listed}]
    assert stray == []  # the lost attempt's uploads were deleted
    storage.verify_checksums(url, ds.manifest)


def test_an_append_that_loses_the_race_to_a_force_compile_of_another_fit_adds_nothing(server: S3Server, env: Path,
                                                                                       grown, monkeypatch) -> None:
    """A `compile --force --fit pad` commits version 2 while an append of center-cropped records commits: the
    append does not build again on it (its records would be of another fit than the manifest says), adds
    nothing, names the change and deletes its uploads; run again, it makes them the new way."""
    tmp, _, a, b = grown
    from dsc.compiler import bucket_versions

    url = server.upload(tmp / "ds", BUCKET, prefix())
    real = bucket_versions.commit

    def force_compile_first(bucket, manifest, first):
        monkeypatch.setattr(bucket_versions, "commit", real)
        compile_folder(a, url, size=SIZE, fit="pad", records_per_shard=5, workers=1, force=True)
        return real(bucket, manifest, first)
    monkeypatch.setattr(bucket_versions, "commit", force_compile_first)
    with pytest.raises(CompileError, match=r"its version 2 makes records otherwise .*\(fit center-crop → pad\)"):
        append(url, b, workers=1)
    assert storage.dataset_versions(url) == [1, 2]
    assert [o.name for o in Bucket(url).list("appends")] == []  # the lost attempt's uploads were deleted
    summary = append(url, b, workers=1)
    ds = MemmapDataset(url)
    assert summary.version == ds.version == 3 and {p.compile["fit"] for p in ds.manifest.record_parts} == {"pad"}
    storage.verify_checksums(url, ds.manifest)


def test_an_append_whose_version_is_pruned_while_it_reads_it_builds_again_on_the_latest(server: S3Server, env: Path,
                                                                                        grown, monkeypatch) -> None:
    """Another append commits version 2 and a `prune --keep 1` deletes version 1's partial last shard just as this
    append, built on version 1, is about to read it: this one builds again on version 2 and lands as 3."""
    tmp, _, _, b = grown
    c = renamed_copy(b, tmp / "c")
    from dsc.compiler import bucket_versions, grow

    url = server.upload(tmp / "ds", BUCKET, prefix())
    real, calls = grow.next_version, []

    def pruned_first(stage, folder, base, *args):
        calls.append(base.manifest.dataset_version)
        if len(calls) == 1:
            monkeypatch.setattr(grow, "next_version", real)
            append(url, c, workers=1)
            assert fmt.shard_file(2) in bucket_versions.prune(url, 1).removed_files  # version 1's partial one
            monkeypatch.setattr(grow, "next_version", pruned_first)
        return real(stage, folder, base, *args)
    monkeypatch.setattr(grow, "next_version", pruned_first)
    summary = append(url, b, workers=1)
    assert calls == [1, 2] and summary.version == 3
    ds = MemmapDataset(url)
    assert (ds.version, len(ds), [p.count for p in ds.manifest.record_parts]) == (3, 30, [12, 9, 9])
    storage.verify_checksums(url, ds.manifest)


def test_an_older_versions_records_are_let_go_once_no_process_reads_it(server: S3Server, env: Path,
                                                                        grown) -> None:
    """Each version has a cache folder of its own: once an append made version 2, version 1's records would stay
    on disk beside version 2's (past `cache_bytes`). They are deleted when a process opens version 2's records
    and none reads version 1's any more; while one does, they stay; its manifest and index stay."""
    tmp, _, _, b = grown
    url = server.upload(tmp / "ds", BUCKET, prefix())
    first = MemmapDataset(url)
    v1 = first.opened.local_root
    want = pixels(first)  # every record of version 1 cached

    def records_on_disk() -> int:
        return sum(p.stat().st_blocks * 512 for p in (v1 / "slots").glob("*.bin") if p.name != "state.bin")
    held = records_on_disk()
    assert held > 0
    (v1 / "slots" / "notes.txt").write_text("not dsc's")
    append(url, b, workers=1)
    second = MemmapDataset(url)
    assert (second.version, len(second)) == (2, 21) and second.opened.local_root != v1
    second.__getitems__([0, 20])
    assert records_on_disk() == held and np.array_equal(pixels(first), want)  # read still: kept
    del first
    gc.collect()  # no process reads version 1 now
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "00001.bin").write_bytes(b"not in the cache")
    (v1 / fmt.SHARD_DIR).symlink_to(outside)  # a link where a 1.2 version keeps its shards: never followed
    stuck = v1 / "slots" / "00000.bin"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode == 0:  # it cannot be deleted
        try:
            MemmapDataset(url).__getitems__([0])  # the open goes on; what could not be deleted stays
        finally:
            subprocess.run(["chattr", "-i", str(stuck)], check=True)
        assert stuck.exists()
    MemmapDataset(url).__getitems__([0])
    assert records_on_disk() == 0 and not (v1 / "slots" / "state.bin").exists()
    assert (v1 / "slots" / "notes.txt").read_text() == "not dsc's" and (v1 / fmt.MANIFEST_FILE).is_file()
    assert (outside / "00001.bin").read_bytes() == b"not in the cache"
    v2 = MemmapDataset(url).opened.local_root
    newer = {p: p.stat().st_blocks for p in (v2 / "slots").glob("*.bin")}
    assert np.array_equal(pixels(MemmapDataset(url, version=1)), want)  # fetched again when asked for by number
    assert {p: p.stat().st_blocks for p in (v2 / "slots").glob("*.bin")} == newer  # the newer version's stay


def test_a_damaged_version_manifest_is_named_as_itself(server: S3Server, env: Path, grown) -> None:
    """A version's manifest that is not valid JSON is refused naming `versions/N.json`, not `manifest.json`."""
    tmp, _, _, b = grown
    append(tmp / "ds", b, workers=1)
    url = server.upload(tmp / "ds", BUCKET, prefix())
    Bucket(url).put(fmt.version_file(2), b"{not json")
    with pytest.raises(DatasetError, match=rf"^{url}/{fmt.version_file(2)}: not valid JSON"):
        MemmapDataset(url)
    assert len(MemmapDataset(url, version=1)) == 12


def test_appends_and_force_compiles_refresh_the_manifest_on_a_server_that_takes_only_a_bare_etag(
        server: S3Server, env: Path, grown, monkeypatch) -> None:
    """Ceph's radosgw 16.2 answers 412 to the quoted ETag S3 gives (and HTTP specifies) in a PUT's If-Match,
    and takes it bare. Before, an append there committed version 2 but left manifest.json at version 1 without
    a word (what readers that do not list versions/ read), and a --force compile failed after its commit
    ("other writers kept changing it"). The bare ETag is sent only while the object still has it: a change by
    another writer is still refused."""
    tmp, _, a, b = grown
    url = server.upload(tmp / "ds", BUCKET, prefix())
    proxy = FaultProxy(server.endpoint)
    try:
        proxy.bare_etags = True
        server.point_at(monkeypatch, proxy.endpoint)
        bucket = Bucket(url)
        assert append(url, b, workers=1).version == 2
        assert bucket.get(fmt.MANIFEST_FILE)[0] == bucket.get(fmt.version_file(2))[0]
        assert (MemmapDataset(url).version, len(MemmapDataset(url))) == (2, 21)
        compile_folder(a, url, size=SIZE, records_per_shard=5, workers=1, force=True)  # version 3, a replacement
        assert bucket.get(fmt.MANIFEST_FILE)[0] == bucket.get(fmt.version_file(3))[0]
        assert (MemmapDataset(url).version, len(MemmapDataset(url))) == (3, 12)
        assert proxy.count("PUT", "manifest.json", action="quoted_if_match") == 2  # refused once each, then bare
        etag = bucket.put("notes.json", b"1")
        bucket.put("notes.json", b"2")  # another writer, between this one's read and its PUT
        assert not bucket.replace("notes.json", b"3", etag) and bucket.get("notes.json")[0] == b"2"
    finally:
        proxy.kill()


def test_a_manifest_copy_left_behind_after_lost_compare_and_swaps_is_said(server: S3Server, env: Path, grown,
                                                                        monkeypatch, caplog) -> None:
    """Before, an append whose every If-Match PUT of manifest.json was refused committed its version and said
    nothing, while readers that do not list versions/ went on reading the older version; a --force compile
    committed its version, then exited 1 ("other writers kept changing it"), as if it had failed. Both now
    succeed, and warn."""
    tmp, _, a, b = grown
    url = server.upload(tmp / "ds", BUCKET, prefix())
    proxy = FaultProxy(server.endpoint)
    try:
        server.point_at(monkeypatch, proxy.endpoint)
        proxy.refuse(1000, "manifest.json")  # every PUT of it: as if other writers kept changing it
        bucket = Bucket(url)
        assert append(url, b, workers=1).version == 2
        said = [r.getMessage() for r in caplog.records if "compare-and-swaps" in r.getMessage()]
        assert len(said) == 1 and "does not name committed version 2: 8 compare-and-swaps of it were refused" \
            in said[0], said
        assert bucket.get(fmt.MANIFEST_FILE)[0] == bucket.get(fmt.version_file(1))[0]  # what the warning is about
        assert MemmapDataset(url).version == 2  # dsc lists versions/
        result = CliRunner().invoke(app, ["compile", str(a), url, "--size", str(SIZE), "--workers", "1", "--force"])
        assert result.exit_code == 0, result.output
        assert "does not name committed version 3" in result.output, result.output
        assert bucket.get(fmt.MANIFEST_FILE)[0] == bucket.get(fmt.version_file(1))[0]
        assert (MemmapDataset(url).version, len(MemmapDataset(url))) == (3, 12)
        assert proxy.count("PUT", "manifest.json", action="refuse") >= 2 * 8  # the server refused each swap
    finally:
        proxy.kill()


def test_a_manifest_refresh_the_bucket_fails_or_another_tools_manifest_is_said_and_the_commit_stands(
        server: S3Server, env: Path, grown, monkeypatch) -> None:
    """Was: a PUT of manifest.json that failed after the commit (the server answering 503 to each try) made a
    --force compile exit 1 saying its work was kept for a --resume, with its version already committed; and a
    manifest.json another tool put there was written over. Now both are a warning, the version committed."""
    tmp, _, a, b = grown
    url = server.upload(tmp / "ds", BUCKET, prefix())
    proxy = FaultProxy(server.endpoint)
    try:
        server.point_at(monkeypatch, proxy.endpoint)
        proxy.slow_down(1000, "manifest.json", method="PUT")
        result = CliRunner().invoke(app, ["compile", str(a), url, "--size", str(SIZE), "--workers", "1", "--force"])
        assert result.exit_code == 0, result.output
        assert "does not name committed version 2: " in result.output and "503" in result.output, result.output
        assert proxy.count("PUT", "manifest.json", action="slow_down") >= 1
    finally:
        proxy.kill()
    server.point_at(monkeypatch, server.endpoint)
    bucket = Bucket(url)
    assert (MemmapDataset(url).version, len(MemmapDataset(url))) == (2, 12)
    theirs = b'{"name": "not dsc\'s"}'
    server.put(BUCKET, f"{url.split('/', 3)[3]}/{fmt.MANIFEST_FILE}", theirs)
    result = CliRunner().invoke(app, ["append", url, str(b)])
    assert result.exit_code == 0, result.output
    assert "does not name committed version 3: it is not a dsc manifest" in result.output, result.output
    assert "move it away, and the next append" in result.output
    assert bucket.get(fmt.MANIFEST_FILE)[0] == theirs
    assert MemmapDataset(url, version=3).version == 3


def test_a_merge_inside_one_bucket_refuses_a_damaged_shard_it_would_copy_server_side(server: S3Server, env: Path,
                                                                                      grown) -> None:
    """Was: the server-side copy carried the damaged object into the merged dataset, whose manifest vouched for
    it with the input's SHA-256, and the merge said it wrote it (exit 0; `dsc verify` then failed)."""
    tmp = grown[0]
    where = prefix()
    a_url, b_url = (server.upload(tmp / "ds", BUCKET, f"{where}/{name}") for name in ("A", "B"))
    shard = bytearray((tmp / "ds" / "shards/00000.bin").read_bytes())  # A's first shard: whole in M, copied
    shard[0] ^= 0xFF
    server.put(BUCKET, f"{where}/A/shards/00000.bin", bytes(shard))
    out = f"s3://{BUCKET}/{where}/M"
    result = CliRunner().invoke(app, ["merge", a_url, b_url, out])
    assert result.exit_code == 1, result.output
    assert f"{a_url}/shards/00000.bin: its server-side copy has SHA-256" in result.output, result.output
    assert "committed nothing" in result.output
    assert Bucket(out).list() == []  # its build deleted, nothing committed
    fine = CliRunner().invoke(app, ["merge", b_url, a_url.replace("s3://", "S3://"), out.replace("s3://", "S3://")])
    assert fine.exit_code == 1 and f"{a_url}/shards/00000.bin" in fine.output, fine.output  # (S3:// is a bucket too)
    assert not Path("S3:").exists()


def test_merges_and_appends_across_a_bucket_and_a_folder_keep_each_source_where_it_is(server: S3Server, env: Path,
                                                                                      tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """Was: a relative path from an s3:// root to a folder or back (`os.path.relpath` of a URL): sources such as
    `s3://b/imgs/../../../tmp/...` or `<folder>/../s3:/b/imgs/...`, different in each working directory."""
    from dsc.compiler.merge import merge
    from dsc.tools.recheck import check_against_sources

    make_folder(tmp_path / "a", classes=2, per_class=2)
    make_folder(tmp_path / "b", classes=2, per_class=2, seed=5)
    imgs = f"s3://{BUCKET}/{prefix()}/imgs"
    for image in sorted((tmp_path / "a").rglob("*.*")):
        server.put(BUCKET, f"{imgs.split('/', 3)[3]}/{image.relative_to(tmp_path / 'a').as_posix()}",
                   image.read_bytes())
    compile_folder(imgs, tmp_path / "X", size=SIZE, workers=1)
    compile_folder(tmp_path / "b", tmp_path / "Y", size=SIZE, workers=1)
    in_bucket = {f"{imgs}/{p.relative_to(tmp_path / 'a').as_posix()}" for p in (tmp_path / "a").rglob("*.*")}
    in_folder = {str(p) for p in (tmp_path / "b").rglob("*.*")}
    monkeypatch.chdir(tmp_path / "b")  # the working directory changes nothing
    merge([tmp_path / "X", tmp_path / "Y"], tmp_path / "M1")
    merge([tmp_path / "Y", tmp_path / "X"], tmp_path / "M2")
    append(tmp_path / "X", tmp_path / "b", workers=1)
    for name in ("M1", "M2", "X"):
        ds = MemmapDataset(tmp_path / name)
        assert {str(ds.source(i)) for i in range(len(ds))} == in_bucket | in_folder, name
        check = check_against_sources(tmp_path / name, len(ds))  # dsc verify --decode: each source read again
        assert (check.checked, check.missing, check.worst_max_abs) == (8, [], 0), (name, check)


def test_merge_with_differing_class_sets_into_and_out_of_a_bucket(server: S3Server, env: Path,
                                                                  tmp_path: Path) -> None:
    make_folder(tmp_path / "a", classes=2, per_class=3)
    make_folder(tmp_path / "b", classes=2, per_class=4, seed=7)
    (tmp_path / "b" / "class_0").rename(tmp_path / "b" / "eel")  # b: class_1 (shared, index 0 there), eel
    compile_folder(tmp_path / "a", tmp_path / "A", size=SIZE, records_per_shard=3, workers=1)
    compile_folder(tmp_path / "b", tmp_path / "B", size=SIZE, records_per_shard=3, workers=1)
    where = prefix()
    a_url = server.upload(tmp_path / "A", BUCKET, f"{where}/A")
    runner = CliRunner()
    local = runner.invoke(app, ["merge", str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "M")])
    assert local.exit_code == 0, local.output
    into = runner.invoke(app, ["merge", a_url, str(tmp_path / "B"), f"s3://{BUCKET}/{where}/M"])
    assert into.exit_code == 0, into.output
    # A's 6 records fill 2 shards: copied inside the bucket; B's 3 shards uploaded from their files
    assert "5 shard(s) (5 reused by server-side copy/upload, 0 copied)" in into.stdout, into.stdout
    merged, here = MemmapDataset(f"s3://{BUCKET}/{where}/M"), MemmapDataset(tmp_path / "M")
    assert merged.classes == here.classes == ["class_0", "class_1", "eel"] and len(merged) == 14
    build = merged.manifest.segments[0].index["labels"].file.rsplit("/", 1)[0]  # builds/<tag>: this merge's own
    assert fmt.is_dataset_folder_name(build) and build.startswith(f"{fmt.BUILDS_DIR}/")
    assert [(t.file, t.count) for t in merged.manifest.shard_tables] == [(f"{build}/{fmt.SHARD_TABLE_FILE}", 5)]
    assert np.array_equal(pixels(merged), pixels(here)) and merged.labels.tolist() == here.labels.tolist()
    bucket = Bucket(f"s3://{BUCKET}/{where}/M")
    assert [e.file for e in merged.manifest.files] == [f"{build}/{e.file}" for e in here.manifest.files]
    for entry in here.manifest.files:  # object bytes = the local merge's file bytes
        assert bucket.get(f"{build}/{entry.file}")[0] == (tmp_path / "M" / entry.file).read_bytes(), entry.file
    assert storage.dataset_versions(f"s3://{BUCKET}/{where}/M") == [1]
    storage.verify_checksums(merged.path, merged.manifest)
    # out of a bucket, shifted off the shard boundary (pieces fetched by ranged GETs) into a folder
    make_folder(tmp_path / "a7", classes=1, per_class=7)
    compile_folder(tmp_path / "a7", tmp_path / "A7", size=SIZE, records_per_shard=3, workers=1)
    b_url = server.upload(tmp_path / "B", BUCKET, f"{where}/B")
    out = runner.invoke(app, ["merge", str(tmp_path / "A7"), b_url, str(tmp_path / "M2")])
    assert out.exit_code == 0, out.output
    m2, b = MemmapDataset(tmp_path / "M2"), MemmapDataset(tmp_path / "B")
    assert len(m2) == 15 and np.array_equal(pixels(m2)[7:], pixels(b))
    storage.verify_checksums(m2.path, m2.manifest)
    again = runner.invoke(app, ["merge", a_url, b_url, f"s3://{BUCKET}/{where}/M"])
    assert again.exit_code == 1 and "already holds a dataset" in again.output
    inside = runner.invoke(app, ["merge", a_url, b_url, f"{a_url}/sub"])
    assert inside.exit_code == 1 and "would lie one inside the other" in inside.output, inside.output
    assert not Bucket(f"{a_url}/sub").list()


def test_prune_in_a_bucket_deletes_only_objects_no_kept_version_lists(server: S3Server, env: Path, grown,
                                                                      monkeypatch) -> None:
    from dsc.compiler import bucket_versions

    tmp, _, _, b = grown
    c = renamed_copy(b, tmp / "c")
    url = server.upload(tmp / "ds", BUCKET, prefix())
    append(url, b, workers=1)
    append(url, c, workers=1)
    key = url.split("/", 3)[3]
    foreign = {"notes.txt": b"mine", "shards/readme.md": b"mine", "appends/xyz/labels.bin": b"mine",
               "versions/notes.json": b"mine"}
    uploading = "appends/0123456789abcdef/shards/00009.bin"  # dsc's name, no version lists it: an append's upload?
    for name, data in {**foreign, uploading: b"x"}.items():
        server.put(BUCKET, f"{key}/{name}", data)
    v1_only = {"shards/00002.bin"}  # version 1's partial last shard (1.5: its index is kept, segment 0)
    result = CliRunner().invoke(app, ["prune", url, "--keep", "2"])
    assert result.exit_code == 0, result.output
    assert "removed 1 version" in result.output
    names = {o.name for o in Bucket(url).list()}
    assert storage.dataset_versions(url) == [2, 3] and not names & v1_only
    assert set(foreign) | {uploading, "shards/00000.bin", "labels.bin"} <= names
    for v in (2, 3):
        ds = MemmapDataset(url, version=v)
        storage.verify_checksums(url, ds.manifest)
    with pytest.raises(DatasetError, match="has no version 1 .*versions 2 to 3"):
        MemmapDataset(url, version=1)
    monkeypatch.setattr(bucket_versions.bp, "ABANDONED_AFTER_S", 0.0)  # the upload is now old: abandoned
    bucket_versions.prune(url, 2)
    names = {o.name for o in Bucket(url).list()}
    assert uploading not in names and set(foreign) <= names
    server.put(BUCKET, f"{key}/versions/00000002.json", b"{not json")  # a version that cannot be read
    refused = CliRunner().invoke(app, ["prune", url, "--keep", "1"])
    assert refused.exit_code == 1 and "versions/00000002.json: not a readable dsc manifest" in refused.output
    assert {o.name for o in Bucket(url).list()} == names  # nothing deleted


def test_appends_to_a_1_4_dataset_in_a_bucket_upload_their_shard_tables_and_prune_keeps_every_used_one(
        server: S3Server, env: Path, grown, tmp_path: Path) -> None:
    """Format 1.4's shard tables in a bucket: each append keeps the rows of the shards it keeps in the earlier
    tables (read from the cache, where the open fetched them), uploads a table of its own new shards, and commits a
    manifest naming them (format 1.5 since: its index in segments);
    prune keeps every table a kept version names (each still backs shards of version 3)."""
    tmp, _, _, b = grown
    c = renamed_copy(b, tmp / "c")
    url = server.upload(tmp / "ds", BUCKET, prefix())
    bucket = Bucket(url)
    assert json.loads(bucket.get("manifest.json")[0])["version"] == fmt.FORMAT_VERSION
    append(url, b, workers=1)
    append(url, c, workers=1)
    for v in (2, 3):
        doc = json.loads(bucket.get(f"versions/0000000{v}.json")[0])
        assert doc["version"] == fmt.FORMAT_VERSION and "shards" not in doc and len(doc["segments"]) == v
    v2, v3 = storage.parse_manifest(url, version=2), storage.parse_manifest(url)
    tables = [(t.file, t.first, t.count, t.row) for t in v3.shard_tables]  # 30 records, 5 a shard
    assert tables == [("shard_table.bin", 0, 2, 0), (f"appends/{tag_of(v2)}/shard_table.bin", 2, 2, 0),
                      (f"appends/{tag_of(v3)}/shard_table.bin", 4, 2, 0)]
    for name, first, count, _ in tables:  # each table's rows are the SHA-256s of the shard objects it names
        rows = bucket.get(name)[0]
        assert rows[:32 * count] == b"".join(hashlib.sha256(bucket.get(v3.shards[k].file)[0]).digest()
                                             for k in range(first, first + count))
    result = CliRunner().invoke(app, ["prune", url, "--keep", "1"])
    assert result.exit_code == 0, result.output
    names = {o.name for o in Bucket(url).list()}
    assert {name for name, *_ in tables} <= names and "shards/00002.bin" not in names  # v1's partial shard: gone
    assert storage.dataset_versions(url) == [3]
    ds = MemmapDataset(url, cache_dir=tmp_path / "fresh")
    append(tmp / "ds", b, workers=1)
    append(tmp / "ds", c, workers=1)
    assert len(ds) == 30 and np.array_equal(pixels(ds), pixels(MemmapDataset(tmp / "ds")))
    storage.verify_checksums(url, ds.manifest)


def test_an_append_refuses_a_damaged_shard_object_it_would_copy(server: S3Server, env: Path, grown) -> None:
    tmp, _, _, b = grown
    url = server.upload(tmp / "ds", BUCKET, prefix())
    shard = bytearray((tmp / "ds" / "shards/00002.bin").read_bytes())  # version 1's partial last shard
    shard[-1] ^= 0xFF  # its last record damaged in the bucket, the size unchanged
    server.put(BUCKET, f"{url.split('/', 3)[3]}/shards/00002.bin", bytes(shard))
    result = CliRunner().invoke(app, ["append", url, str(b), "-j", "1"])
    assert result.exit_code == 1, result.output
    assert f"{url}/shards/00002.bin: record 1 of this shard does not match its CRC-32" in result.output
    assert storage.dataset_versions(url) == [1] and not Bucket(url).list("appends")
