"""An ImageFolder tree of objects as SRC (`dsc compile s3://bucket/images/ OUT`), against a real S3 server on
127.0.0.1 (moto): discovered by LIST (every page) in the order a folder walk gives, so the dataset is
byte-identical to the compile of a folder holding the same files; workers GET their own objects, one
too large is never fetched, one changed or deleted after the LIST is a named skip, a 503 is retried;
keys that cannot be paths are one clear line; --resume keys sources by name, size and ETag."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsc import CompileError, MemmapDataset, compile_folder, storage
from dsc.cli import app
from dsc.compiler import bucket_build, pipeline
from dsc.compiler.write import max_file_bytes
from dsc.storage.bucket import Bucket

from conftest import make_folder, pattern, save
from s3server import S3Server, serving  # skips this module when the server packages are missing

from faultproxy import FaultProxy  # isort: skip (after s3server, which may skip the module)
from test_compile_s3 import assert_same_as  # isort: skip

BUCKET = "dsc-image-folders"
MAX_PIXELS = 20_000  # the test images' pixels fit; a file over max_file_bytes of it (~17 MB) is too large
OPTIONS = {"size": 24, "records_per_shard": 5, "seed": 3, "workers": 1}
runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})
server = serving(BUCKET)
_prefixes = iter(range(1 << 30))


def quiet(**options) -> dict:
    return {**OPTIONS, "on_skip": lambda source, reason: None, **options}


def files(out: Path) -> dict[str, bytes]:
    """Every file of a dataset but its manifest (which records where the sources were)."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


def records(out: Path) -> dict[str, bytes]:
    """{source: its record's bytes}."""
    data = storage.open_dataset(out)
    return {data.source(i): data.read_records([i]).tobytes() for i in range(data.manifest.count)}


def upload(server: S3Server, folder: Path) -> str:
    """Every file under `folder` as an object under a new prefix; the prefix's URL (with a trailing slash)."""
    prefix = f"trees/t{next(_prefixes)}"
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        server.put(BUCKET, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
    return f"s3://{BUCKET}/{prefix}/"


@pytest.fixture
def env(server: S3Server, monkeypatch, tmp_path: Path) -> dict[str, str]:
    server.point_at(monkeypatch)
    monkeypatch.setenv("DSC_CACHE_DIR", str(tmp_path / "cache"))
    return {**os.environ}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """Real JPEGs and PNGs in 3 classes, with what a walk must order and pass over as a folder's does: a
    sub-folder `b/` beside `b.png` (a walk lists the folder first: "b" < "b.png", though the key "b.png"
    sorts before "b/x.png"), hidden files and folders, files that are not images, an image beside the class
    folders, a damaged JPEG, names with a space, an accent and a '%', and a class folder with no image."""
    root = make_folder(tmp_path_factory.mktemp("tree") / "src", classes=3, per_class=5, seed=5)
    save(root / "class_0" / "b" / "x.png", pattern(30, 40, seed=1), "PNG")
    save(root / "class_0" / "b.png", pattern(33, 21, seed=2), "PNG")
    save(root / "class_0" / "b" / "deeper" / "y.jpg", pattern(50, 20, seed=3), "JPEG")
    save(root / "class_1" / "sp ace é %2e.png", pattern(25, 25, seed=4), "PNG")
    save(root / "class_1" / ".hidden.png", pattern(25, 25, seed=5), "PNG")
    save(root / ".cache" / "c.png", pattern(25, 25, seed=6), "PNG")
    save(root / "outside.png", pattern(25, 25, seed=7), "PNG")
    (root / "class_2" / "notes.txt").write_text("not an image")
    (root / "class_2" / "img_1.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    (root / "empty_class").mkdir()
    (root / "empty_class" / "README").write_text("no images here")
    return root


@pytest.mark.parametrize("options", [{}, {"classes": ["class_2", "class_0", "missing"], "skip_unknown_classes": True},
                                     {"shuffle": False}])
def test_a_tree_in_a_bucket_compiles_to_the_bytes_of_the_same_folder(tree: Path, server: S3Server, env,
                                                                       tmp_path: Path, options: dict) -> None:
    url = upload(server, tree)
    local = compile_folder(tree, tmp_path / "local", **quiet(**options))
    remote = compile_folder(url, tmp_path / "remote", **quiet(**options))
    assert files(tmp_path / "remote") == files(tmp_path / "local")
    assert (remote.kept, remote.skipped, remote.classes, remote.empty_classes) == \
        (local.kept, local.skipped, local.classes, local.empty_classes)
    sources = storage.open_dataset(tmp_path / "remote")
    assert "class_0/b/x.png" in {sources.source(i) for i in range(remote.kept)}
    if not options:
        assert (remote.kept, remote.built) == (18, 19) and remote.empty_classes == ["empty_class"]
        assert dict(remote.skipped) == {"outside.png": "not inside a class folder",
                                        "class_2/img_1.jpg": dict(local.skipped)["class_2/img_1.jpg"]}
    assert sources.manifest.compile["source_root"] == url.rstrip("/")
    first = sources.source(0)
    assert MemmapDataset(tmp_path / "remote").source(0) == f"{url}{first}"  # the object's URL, not s3:/...


def test_the_walk_order_is_a_folders_not_the_keys(tree: Path, server: S3Server, env) -> None:
    from dsc.compiler.sources import bucket_folder  # (here: the tests of this module fail one by one without it)

    found = bucket_folder.discover(upload(server, tree))
    class_0 = [s for s in found.sources if s.startswith("class_0/")]
    assert class_0.index("class_0/b/deeper/y.jpg") < class_0.index("class_0/b/x.png") < class_0.index("class_0/b.png")
    assert sorted(class_0) != class_0  # the keys' own order would differ: the test can tell
    assert all(s == o.name and stamp == f"{o.size}:{o.etag}" for s, o, stamp in zip(found.sources, found.objects,
                                                                                     found.stamps))


def test_an_unlabeled_flat_prefix_and_a_bucket_out(server: S3Server, env, tmp_path: Path) -> None:
    """Images directly under the prefix: unlabeled, as a flat folder is; compiled into the bucket too."""
    flat = tmp_path / "flat"
    for k in range(7):
        save(flat / f"{k:02d}.png", pattern(20 + k, 30, seed=k), "PNG")
    url = upload(server, flat)
    compile_folder(flat, tmp_path / "local", **quiet())
    summary = compile_folder(url, tmp_path / "remote", **quiet())
    assert summary.kept == 7 and not summary.labeled
    assert files(tmp_path / "remote") == files(tmp_path / "local")
    out = f"s3://{BUCKET}/out/o{next(_prefixes)}"
    compile_folder(url, out, **quiet())
    assert_same_as(tmp_path / "remote", out)  # the manifests agree too: both name the same SRC


def test_a_listing_of_many_pages_finds_every_image_in_order(server: S3Server, env, tmp_path: Path,
                                                            monkeypatch) -> None:
    """1,001 objects sort before the images (a hidden folder and a folder of text files): a LIST answers
    1,000 keys a page, so the images, on the second page, are found only if every page is read; a 503 for
    the second page is retried."""
    src = make_folder(tmp_path / "src", classes=2, per_class=3, seed=9)
    url = upload(server, src)
    prefix = url[len(f"s3://{BUCKET}/"):]
    for k in range(500):
        server.put(BUCKET, f"{prefix}.git/objects/{k:04d}", b"x")
    (src / "a_notes").mkdir()  # the same folder of text only, locally: an empty class
    for k in range(501):
        server.put(BUCKET, f"{prefix}a_notes/{k:04d}.txt", b"x")
        (src / "a_notes" / f"{k:04d}.txt").write_bytes(b"x")
    proxy = FaultProxy(server.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.slow_down(1, match="continuation-token=")
        remote = compile_folder(url, tmp_path / "remote", **quiet())
        pages = proxy.count("GET", "list-type=2", action="forwarded")
        refused = proxy.count("GET", "continuation-token=", action="slow_down")
    finally:
        proxy.kill()
    local = compile_folder(src, tmp_path / "local", **quiet())
    assert remote.kept == local.kept == 6 and remote.empty_classes == ["a_notes"]
    assert files(tmp_path / "remote") == files(tmp_path / "local")
    # the top folder's delimited LIST, then the prefix's two pages, listed again from the first after the 503
    assert (pages, refused) == (1 + 1 + 2, 1)


def test_workers_skip_what_is_too_large_unread_and_retry_a_503(server: S3Server, env, tmp_path: Path,
                                                               monkeypatch) -> None:
    """An object larger than any image within --max-pixels is never fetched; GETs answered 503 are retried;
    the records are the folder compile's, its skip list too."""
    src = make_folder(tmp_path / "src", classes=2, per_class=4, seed=2)
    (src / "class_1" / "huge.jpg").write_bytes(b"\xff" * (max_file_bytes(MAX_PIXELS) + 1))
    url = upload(server, src)
    local = compile_folder(src, tmp_path / "local", **quiet(max_pixels=MAX_PIXELS))
    proxy = FaultProxy(server.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.slow_down(3, match="/class_0/")
        remote = compile_folder(url, tmp_path / "remote", **quiet(max_pixels=MAX_PIXELS))
        huge_gets = proxy.count("GET", "huge.jpg")
        retried = proxy.count("GET", "/class_0/", action="slow_down")
    finally:
        proxy.kill()
    assert huge_gets == 0 and retried == 3
    assert dict(remote.skipped)["class_1/huge.jpg"].startswith(f"file is {max_file_bytes(MAX_PIXELS) + 1} bytes")
    assert remote.skipped == local.skipped
    assert files(tmp_path / "remote") == files(tmp_path / "local")


def test_an_object_changed_or_deleted_after_the_listing_is_a_named_skip(server: S3Server, env,
                                                                       tmp_path: Path) -> None:
    """Between the LIST and the workers' GETs (on_total is called in between) one object is replaced by
    another image and one deleted: neither the new bytes nor a failure, two named skips."""
    src = make_folder(tmp_path / "src", classes=2, per_class=4, seed=4)
    url = upload(server, src)
    prefix = url[len(f"s3://{BUCKET}/"):]
    replacement = tmp_path / "other.png"
    save(replacement, pattern(60, 60, seed=8), "PNG")

    def between(n: int) -> None:
        server.put(BUCKET, f"{prefix}class_0/img_0.jpg", replacement.read_bytes())
        server.delete(BUCKET, f"{prefix}class_1/img_1.jpg")
    summary = compile_folder(url, tmp_path / "remote", on_total=between, **quiet())
    from dsc.compiler.sources import bucket_folder
    assert dict(summary.skipped) == {"class_0/img_0.jpg": bucket_folder.CHANGED,
                                     "class_1/img_1.jpg": bucket_folder.GONE}
    assert summary.kept == 6
    for name in ("class_0/img_0.jpg", "class_1/img_1.jpg"):
        (src / name).unlink()
    compile_folder(src, tmp_path / "local", **quiet())
    assert records(tmp_path / "remote") == records(tmp_path / "local")  # (the order is another: 8 sources shuffled)


@pytest.mark.parametrize("key, says", [("class_0/../up.jpg", "'..'"), ("class_0//twice.jpg", "an empty"),
                                       ("class_0/bell\x07.jpg", "a control character")])
def test_a_key_that_cannot_be_a_path_is_one_clear_line(server: S3Server, env, tmp_path: Path, key: str,
                                                       says: str) -> None:
    import urllib.parse

    src = make_folder(tmp_path / "src", classes=2, per_class=2, seed=1)
    url = upload(server, src)
    prefix = url[len(f"s3://{BUCKET}/"):]
    server.put_raw(BUCKET, urllib.parse.quote(f"{prefix}{key}", safe="/"), b"x")
    result = runner.invoke(app, ["compile", url, str(tmp_path / "out"), "--size", "16"])
    assert result.exit_code == 1, (result.stdout, result.stderr)
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert line.startswith("error: ") and "cannot be read as a path" in line and says in line, line
    assert repr(f"{prefix}{key}") in line, line
    assert not (tmp_path / "out").exists()


def test_keys_with_url_characters_compile_as_the_same_files_in_a_folder(server: S3Server, env,
                                                                        tmp_path: Path) -> None:
    """'#', '?', '%' and '+' are plain characters of an S3 key, as of a file name: the objects are read by their
    keys (never through a URL parser, which would take '#' for a fragment), into the bytes a folder gives."""
    src = make_folder(tmp_path / "src", classes=2, per_class=2, seed=1)
    for k, name in enumerate(("a#b.jpg", "c?d.png", "e%23f.png", "g+h #?.png")):
        save(src / f"class_{k % 2}" / name, pattern(20 + k, 30, seed=k), "JPEG" if name.endswith(".jpg") else "PNG")
    (src / "class_#1").mkdir()
    save(src / "class_#1" / "x?.png", pattern(21, 22, seed=9), "PNG")
    url = upload(server, src)
    local = compile_folder(src, tmp_path / "local", **quiet())
    remote = compile_folder(url, tmp_path / "remote", **quiet())
    assert remote.kept == local.kept == 9 and remote.classes == local.classes
    assert files(tmp_path / "remote") == files(tmp_path / "local")
    assert records(tmp_path / "remote").keys() == records(tmp_path / "local").keys()
    spelled = url.replace(f"s3://{BUCKET}/", f"S3://{BUCKET}//")  # another spelling of the same prefix
    compile_folder(spelled, tmp_path / "spelled", **quiet())
    assert files(tmp_path / "spelled") == files(tmp_path / "local")
    out = f"s3://{BUCKET}/out/o{next(_prefixes)}"
    compile_folder(url, out, **quiet())  # into the bucket, read back by their keys on --resume and verify too
    assert_same_as(tmp_path / "remote", out)
    verified = runner.invoke(app, ["verify", str(tmp_path / "remote"), "--decode", "9"])
    assert verified.exit_code == 0, verified.output
    assert "decoded 9 record(s) again" in verified.stdout and ": max 0, mean 0.000" in verified.stdout


def test_a_prefix_with_no_objects_or_no_images_is_one_clear_line(server: S3Server, env, tmp_path: Path) -> None:
    server.put(BUCKET, "texts/readme.txt", b"not an image")
    for src, says in {f"s3://{BUCKET}/nothing-here/": "holds no objects at all: is the prefix right?",
                      f"s3://{BUCKET}/texts": f"no images found in s3://{BUCKET}/texts"}.items():
        result = runner.invoke(app, ["compile", src, str(tmp_path / "out")])
        assert result.exit_code == 1 and says in result.stderr, (src, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_label_table_over_a_tree_in_a_bucket_gives_the_folders_bytes(tree: Path, server: S3Server, env,
                                                                       tmp_path: Path) -> None:
    """The table's paths are relative to the prefix; a listed image that is no object is a named skip, a
    hidden one listed is compiled (as from a folder), images the table does not list are counted."""
    names = ["class_1/img_0.jpg", "class_0/b/x.png", "class_1/sp ace é %2e.png", "class_1/.hidden.png",
             "class_2/img_1.jpg", "class_0/gone.jpg", "class_2/img_3.png", "class_0/b.png"]
    table = tmp_path / "labels.csv"
    table.write_text("path,label,score\n" + "".join(f"{n},{'cat' if k % 2 else 'dog'},{k / 4}\n"
                                                      for k, n in enumerate(names)), encoding="utf-8")
    url = upload(server, tree)
    local = compile_folder(tree, tmp_path / "local", labels=table, **quiet())
    remote = compile_folder(url, tmp_path / "remote", labels=table, **quiet())
    assert files(tmp_path / "remote") == files(tmp_path / "local")
    assert "fields/score.bin" in files(tmp_path / "remote")
    assert (remote.kept, remote.skipped, remote.ignored, remote.classes) == \
        (local.kept, local.skipped, local.ignored, local.classes)
    assert remote.kept == 6 and remote.ignored == 20 - 6  # the 20 images a walk finds, less the 6 of them listed
    assert dict(remote.skipped)["class_0/gone.jpg"] == "listed in labels.csv but not found"


def test_resume_keys_sources_by_name_size_and_etag(tree: Path, server: S3Server, env, tmp_path: Path,
                                                   monkeypatch) -> None:
    """A compile stopped before it finished (into a folder, into a bucket) is continued by --resume reusing
    every source; an object replaced since makes the resume refuse, naming the sources."""
    url = upload(server, tree)
    compile_folder(tree, tmp_path / "local", **quiet())

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # where a kill between the decoding and the finish would stop
    finish, assemble = pipeline.finish, bucket_build._assemble
    out = f"s3://{BUCKET}/out/r{next(_prefixes)}"
    monkeypatch.setattr(pipeline, "finish", stopped)
    monkeypatch.setattr(bucket_build, "_assemble", stopped)
    for target in (tmp_path / "remote", out):
        with pytest.raises(KeyboardInterrupt):
            compile_folder(url, target, **quiet())
    monkeypatch.setattr(pipeline, "finish", finish)
    monkeypatch.setattr(bucket_build, "_assemble", assemble)
    for target in (tmp_path / "remote", out):
        summary = compile_folder(url, target, resume=True, **quiet())
        assert summary.kept == 18 and summary.reused >= 18  # every record reused (a folder build may retry the bad one)
    assert files(tmp_path / "remote") == files(tmp_path / "local")
    assert_same_as(tmp_path / "remote", out)  # the manifests agree too: both name the same SRC
    monkeypatch.setattr(pipeline, "finish", stopped)
    with pytest.raises(KeyboardInterrupt):
        compile_folder(url, tmp_path / "again", **quiet())
    monkeypatch.setattr(pipeline, "finish", finish)
    prefix = url[len(f"s3://{BUCKET}/"):]
    server.put(BUCKET, f"{prefix}class_0/img_0.jpg", (tree / "class_0" / "img_1.jpg").read_bytes())
    changed = r'cannot resume .*: the sources changed since it began .*img_0.jpg. \(.* bytes, ETag "'
    with pytest.raises(CompileError, match=changed):
        compile_folder(url, tmp_path / "again", resume=True, **quiet())


def test_verify_decode_reads_the_objects_again(tree: Path, server: S3Server, env, tmp_path: Path) -> None:
    url = upload(server, tree)
    compile_folder(url, tmp_path / "out", **quiet())
    result = runner.invoke(app, ["verify", str(tmp_path / "out"), "--decode", "18"])
    assert result.exit_code == 0, result.stderr
    assert "decoded 18 record(s) again" in result.stdout and ": max 0, mean 0.000" in result.stdout


def test_the_cli_with_two_workers_gets_the_objects_in_its_worker_processes(tree: Path, server: S3Server, env,
                                                                           tmp_path: Path) -> None:
    import subprocess
    import sys

    url = upload(server, tree)
    compile_folder(tree, tmp_path / "local", **quiet())
    run = subprocess.run([sys.executable, "-m", "dsc", "compile", url, str(tmp_path / "remote"), "-j", "2",
                          "--size", "24", "--records-per-shard", "5", "--seed", "3"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout and "18 records" in run.stdout
    assert files(tmp_path / "remote") == files(tmp_path / "local")
    shutil.rmtree(tmp_path / "remote")


def test_source_and_output_prefixes_must_not_hold_each_other(tree: Path, server: S3Server, env) -> None:
    url = upload(server, tree).rstrip("/")
    bucket, prefix = url[len("s3://"):].split("/", 1)
    for out, says in {url: "are the same prefix", f"{url}/out": "must not be inside the source prefix",
                      url.rsplit("/", 1)[0]: "must not be inside the output",
                      # other spellings of the same prefixes (were: accepted, OUT then listed as a class of SRC)
                      f"s3://{bucket}//{prefix}/out": "must not be inside the source prefix",
                      f"S3://{bucket}/{prefix}/out": "must not be inside the source prefix"}.items():
        with pytest.raises(CompileError, match=says):
            compile_folder(url + "/", out, **quiet())
        assert Bucket(out).head("manifest.json") is None and Bucket(out).list("builds") == []
