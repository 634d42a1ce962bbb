"""Compiling from archives (issue 24): WebDataset tar shards, Parquet files written by Hugging Face
`datasets`, zip archives, each written by the real tool from the real photos of examples/images, give
record for record the folder compile's pixels and labels, sources named ARCHIVE#MEMBER; hostile
archives (truncated, links and devices, bombs, path traversal, a corrupt row group) are skipped or
refused with a reason, never extracted, never a traceback; a killed compile resumes."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dsc import CompileError, compile_folder, storage
from dsc.cli import app
from dsc.compiler.publish import staging_path
from dsc.compiler.sources import expand_braces, resolve_labels
from dsc.reader import MemmapDataset
from dsc.testing import make_image_folder

from archives import write_parquet, write_tar_shards, write_zip
from conftest import pattern, save

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "images"
CLASSES = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
SIZE = 32
runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})


def records(out: Path) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """(pixels, labels, classes, sources relative to the compiled folder) of a dataset."""
    ds = MemmapDataset(out)
    root = Path(ds.manifest.compile["source_root"])
    images = np.stack([ds[i][0].numpy() for i in range(len(ds))])
    return images, ds.labels.copy(), ds.classes, [ds.source(i).relative_to(root).as_posix() for i in range(len(ds))]


def skips(out: Path) -> dict[str, str]:
    return {s["source"]: s["reason"] for s in storage.read_skipped(out, storage.parse_manifest(out))}


def quiet(**options):
    return {"size": SIZE, "workers": 1, "on_skip": lambda source, reason: None, **options}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """The photos as a folder, and as archives written by webdataset, datasets and zipfile; the folder compiled."""
    root = tmp_path_factory.mktemp("archives")
    folder = root / "images"
    shutil.copytree(EXAMPLES, folder)
    compile_folder(folder, root / "folder_out", **quiet())
    return {"root": root, "folder": folder, "reference": records(root / "folder_out"),
            "tar": write_tar_shards(folder, root / "shards", per_shard=7,
                                    extra=lambda c, f: {"txt": c, "json": json.dumps({"label": CLASSES.index(c)})}),
            "parquet": write_parquet(folder, root / "train.parquet", rows_per_group=6),
            "zip": write_zip(folder, root / "images.zip")}


def member_names(sources: list[str]) -> list[str]:
    """The class/file part each source ends with, whatever the archive calls it."""
    return [s.rsplit("#", 1)[-1].removeprefix("images/") for s in sources]


@pytest.mark.parametrize("kind", ["tar", "parquet", "zip"])
def test_each_archive_compiles_to_the_folder_compiles_records(made: dict, kind: str, tmp_path: Path) -> None:
    options = {"classes": CLASSES} if kind == "tar" else {}  # .cls holds indices: the names come from --classes
    compile_folder(made[kind], tmp_path / "out", **quiet(**options))
    images, labels, classes, sources = records(tmp_path / "out")
    ref_images, ref_labels, ref_classes, ref_sources = made["reference"]
    assert classes == ref_classes == CLASSES
    assert np.array_equal(images, ref_images) and np.array_equal(labels, ref_labels)
    assert all("#" in s for s in sources)
    if kind == "parquet":  # named by the image's own path
        assert [s.split("#")[1] for s in sources] == [s.split("/")[1] for s in ref_sources]
        assert sources[0].startswith("train.parquet#")
    else:
        assert [n.rsplit(".", 1)[0] for n in member_names(sources)] == [s.rsplit(".", 1)[0] for s in ref_sources]
    assert skips(tmp_path / "out") == {}


def test_tar_shards_named_every_way_give_the_same_dataset(made: dict, tmp_path: Path) -> None:
    shards = Path(made["tar"]).parent
    compile_folder(made["tar"], tmp_path / "braces", **quiet())
    reference = records(tmp_path / "braces")
    for i, src in enumerate([shards, shards / "train-*.tar"]):
        compile_folder(src, tmp_path / f"other{i}", **quiet())
        other = records(tmp_path / f"other{i}")
        assert all(np.array_equal(a, b) for a, b in zip(reference[:2], other[:2])) and other[2:] == reference[2:]
    assert reference[2] == ["0", "1", "2", "3", "4"]  # integer .cls labels without --classes: stored as given
    assert reference[3][0].startswith("train-00000") and ".tar#" in reference[3][0]
    assert expand_braces("a{08..10}-{x,y}") == ["a08-x", "a08-y", "a09-x", "a09-y", "a10-x", "a10-y"]
    with pytest.raises(CompileError, match=r"range \{0..999999999999\} names more than 1,000,000 archives"):
        compile_folder(shards / "train-{0..999999999999}.tar", tmp_path / "typo", **quiet())


@pytest.mark.parametrize(("key", "classes"), [("txt", CLASSES), ("json:label", ["0", "1", "2", "3", "4"])])
def test_the_label_key_picks_the_member(made: dict, tmp_path: Path, key: str, classes: list[str]) -> None:
    compile_folder(made["tar"], tmp_path / "out", **quiet(label_key=key))
    images, labels, got, _ = records(tmp_path / "out")
    assert got == classes and np.array_equal(labels, made["reference"][1])


def test_the_bytes_are_the_same_for_any_worker_count(made: dict, tmp_path: Path) -> None:
    for kind in ("tar", "parquet", "zip"):
        outs = []
        for workers in (1, 2):
            out = tmp_path / f"{kind}{workers}"
            compile_folder(made[kind], out, **quiet(workers=workers, records_per_shard=8))
            outs.append({p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
        assert outs[0] == outs[1], kind


def test_progress_counts_samples_and_discovery_reads_no_image(made: dict, tmp_path: Path) -> None:
    """Discovery of a shard whose image bytes are all unreadable still lists every sample: it reads
    headers and labels only; the images fail where they are decoded, one skip each."""
    shards = tmp_path / "shards"
    shutil.copytree(Path(made["tar"]).parent, shards)
    for shard in shards.glob("*.tar"):
        with tarfile.open(shard) as tar:
            images = [(m.offset_data, m.size) for m in tar.getmembers() if not m.name.endswith(".cls")
                      and m.name.rsplit(".", 1)[-1] in ("jpg", "png")]
        with open(shard, "r+b") as f:
            for offset, size in images:
                f.seek(offset)
                f.write(b"\0" * size)
    found, total, done = [], [], []
    with pytest.raises(CompileError, match="none of the 20 images"):
        compile_folder(shards, tmp_path / "out", **quiet(on_found=found.append, on_total=total.append,
                                                          progress=done.append))
    assert sum(found) == total[0] == sum(done) == 20


# ------------------------------------------------------------------------------------------------ hostile


def tar_member(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE,
               link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    tar.addfile(info, io.BytesIO(data) if data else None)


def test_a_hostile_tar_is_skipped_member_by_member_and_nothing_is_extracted(made: dict, tmp_path: Path) -> None:
    jpeg = (EXAMPLES / "cat" / "chelsea_0.jpg").read_bytes()
    shard = tmp_path / "in" / "evil.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        tar_member(tar, "good.jpg", jpeg)
        tar_member(tar, "good.cls", b"0")
        tar_member(tar, "../../escape.jpg", jpeg)
        tar_member(tar, "link.jpg", kind=tarfile.SYMTYPE, link="/etc/passwd")
        tar_member(tar, "device.jpg", kind=tarfile.CHRTYPE)
        tar_member(tar, "noimage.cls", b"1")
        tar_member(tar, "notanimage.jpg", b"GIF89a but not really")
        tar_member(tar, "notanimage.cls", b"0")
        tar_member(tar, "nolabel.jpg", jpeg)
        tar_member(tar, "cut.jpg", jpeg)
    data = shard.read_bytes()
    shard.write_bytes(data[:data.rindex(jpeg[:64]) + 1000])  # cut inside the last member
    before = set(tmp_path.parent.rglob("*"))
    result = runner.invoke(app, ["compile", str(shard), str(tmp_path / "out"), "--size", "8", "-j", "1"])
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr and "wrote" in result.stdout
    skipped = skips(tmp_path / "out")
    assert "unsafe member name" in skipped["evil.tar#../../escape.jpg"]
    assert "symbolic link to '/etc/passwd'" in skipped["evil.tar#link.jpg"]
    assert "not a regular file" in skipped["evil.tar#device.jpg"]
    assert "no image member" in skipped["evil.tar#noimage"]
    assert "not a recognised image" in skipped["evil.tar#notanimage.jpg"]
    assert skipped["evil.tar#nolabel.jpg"] == "no label"
    assert "truncated tar" in skipped["evil.tar#cut.jpg"] and "truncated" in skipped["evil.tar"]
    assert records(tmp_path / "out")[3] == ["evil.tar#good.jpg"]
    out = tmp_path / "out"
    assert set(tmp_path.parent.rglob("*")) - before == {out, *out.rglob("*")}  # nothing else was written


def test_a_zip_bomb_a_lying_size_links_and_path_traversal_are_refused(tmp_path: Path) -> None:
    save_path = tmp_path / "small.png"
    save(save_path, pattern(20, 30), "PNG")
    small = save_path.read_bytes()
    archive = tmp_path / "in.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a/ok.png", small)
        z.writestr("a/bomb.png", b"\0" * (40 << 20))  # 40 MiB of zeros, ~40 KB deflated
        z.writestr("a/liar.png", b"\0" * (40 << 20))  # the same, its directory entry to claim 1,000 bytes
        z.writestr("a/../../escape.png", small)
        link = zipfile.ZipInfo("a/link.png")
        link.external_attr = (0o120777 << 16)
        z.writestr(link, "/etc/passwd")
    data = bytearray(archive.read_bytes())
    entry = data.rindex(b"a/liar.png") - 46  # the liar's central directory entry (its name comes last)
    assert data[entry:entry + 4] == b"PK\x01\x02"

    data[entry + 24:entry + 28] = (1000).to_bytes(4, "little")  # uncompressed size
    archive.write_bytes(bytes(data))
    max_pixels = 10_000  # bounds a member at 8 bytes a pixel + 16 MiB: the bombs are over it
    summary = compile_folder(archive, tmp_path / "out", **quiet(max_pixels=max_pixels, size=8))
    skipped = dict(summary.skipped)
    assert summary.kept == 1 and summary.classes == ["a"]
    assert "more than any image within --max-pixels" in skipped["in.zip#a/bomb.png"]
    assert str(40 << 20) in skipped["in.zip#a/bomb.png"]  # refused on its declared size
    assert "more than any image within --max-pixels" in skipped["in.zip#a/liar.png"]  # refused while inflating
    assert "unsafe member name" in skipped["in.zip#a/../../escape.png"], skipped
    assert "symbolic link" in skipped["in.zip#a/link.png"]
    assert not (tmp_path.parent / "escape.png").exists()


def test_a_corrupt_parquet_row_group_is_skipped_whole_and_the_rest_kept(made: dict, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    shutil.copy(made["parquet"], path)
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 4
    chunk = meta.row_group(1).column(0)  # image.bytes of rows 6..11
    assert chunk.path_in_schema == "image.bytes"
    with open(path, "r+b") as f:
        f.seek(chunk.data_page_offset)
        f.write(b"\xff" * 64)  # its page header
    result = runner.invoke(app, ["compile", str(path), str(tmp_path / "out"), "--size", "8", "-j", "2"])
    assert result.exit_code == 0 and "Traceback" not in result.stderr, result.stderr
    skipped = skips(tmp_path / "out")
    assert len(skipped) == 6 and all("row group 1 cannot be read" in r for r in skipped.values())
    kept = records(tmp_path / "out")[3]
    assert len(kept) == 14 and not set(kept) & set(skipped)


def test_without_pyarrow_dsc_imports_and_a_parquet_source_says_what_to_install(made: dict, tmp_path: Path) -> None:
    code = ("import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None\n"
            "import dsc, dsc.cli\nfrom dsc import compile_folder, CompileError\n"
            f"try: compile_folder({str(made['parquet'])!r}, {str(tmp_path / 'out')!r}, size=8, workers=1)\n"
            "except CompileError as e: print('error:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "needs pyarrow: pip install 'dsc-images[parquet]'" in result.stdout
    assert not (tmp_path / "out").exists()


def test_bad_archive_sources_are_one_clear_line(made: dict, tmp_path: Path) -> None:
    missing = str(Path(made["tar"]).parent / "train-{000000..000009}.tar")
    result = runner.invoke(app, ["compile", missing, str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "7 of the 10 files the pattern" in result.stderr and "do not exist" in result.stderr
    result = runner.invoke(app, ["compile", str(tmp_path / "gone.tar"), str(tmp_path / "out")])
    assert result.exit_code == 1 and f"error: source {tmp_path / 'gone.tar'} does not exist" in result.stderr
    result = runner.invoke(app, ["compile", str(made["zip"]), str(tmp_path / "out"), "--label-key", "cls"])
    assert result.exit_code == 1 and "a zip holds an ImageFolder tree" in result.stderr
    result = runner.invoke(app, ["compile", str(made["parquet"]), str(tmp_path / "out"), "--image-column", "nope"])
    assert result.exit_code == 1 and "has no column 'nope' (--image-column)" in result.stderr


# ------------------------------------------------------------------------------------------------ resume


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory) -> tuple[str, dict[str, bytes]]:
    """~2 s of work in tar shards, and its uninterrupted compile's files."""
    root = tmp_path_factory.mktemp("big")
    make_image_folder(root / "src", classes=3, per_class=40, size=(400, 500), formats=("png",))
    src = write_tar_shards(root / "src", root / "shards", per_shard=25)
    compile_folder(src, root / "whole", size=64, workers=2, records_per_shard=16)
    return src, files(root / "whole")


def files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_killed_archive_compile_resumes_to_identical_bytes(big_shards, tmp_path: Path) -> None:
    src, whole = big_shards
    out = tmp_path / "out"
    code = f"import dsc; dsc.compile_folder({src!r}, {str(out)!r}, size=64, workers=2, records_per_shard=16)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    journal, deadline = staging_path(out) / "journal.jsonl", time.monotonic() + 120
    while (not journal.exists() or journal.read_bytes().count(b"\n") < 30) and proc.poll() is None:
        assert time.monotonic() < deadline, "the compile never got that far"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    if out.exists():  # it finished first
        assert files(out) == whole
        return
    summary = compile_folder(src, out, size=64, workers=2, records_per_shard=16, resume=True)
    assert files(out) == whole
    assert 30 <= summary.reused < 120, summary.reused


def test_a_plain_parquet_table_names_its_image_and_label_columns(made: dict, tmp_path: Path) -> None:
    """A table written by pyarrow alone: a binary image column and a column of class names, picked by
    --image-column and --label-key; rows without a path are named row=N."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [(c, f) for c in CLASSES for f in sorted((made["folder"] / c).iterdir())]
    table = pa.table({"jpeg": pa.array([f.read_bytes() for _, f in files], pa.binary()),
                      "thumb": pa.array([b"x"] * len(files), pa.binary()),
                      "species": [c for c, _ in files]})
    pq.write_table(table, tmp_path / "plain.parquet", row_group_size=7)
    with pytest.raises(CompileError, match="more than one image column found .* give --image-column"):
        compile_folder(tmp_path / "plain.parquet", tmp_path / "out", **quiet())
    compile_folder(tmp_path / "plain.parquet", tmp_path / "out", **quiet(image_column="jpeg", label_key="species"))
    images, labels, classes, sources = records(tmp_path / "out")
    assert classes == CLASSES and np.array_equal(labels, made["reference"][1])
    assert np.array_equal(images, made["reference"][0])
    assert sorted(sources) == sorted(f"plain.parquet#row={n}" for n in range(20))


def test_a_given_vocabulary_maps_class_names_and_refuses_or_skips_unknown_ones(made: dict, tmp_path: Path) -> None:
    """--classes wins over a ClassLabel's and a zip's names, class by name, as for a folder."""
    backwards = CLASSES[::-1]
    for kind in ("parquet", "zip"):
        compile_folder(made[kind], tmp_path / kind, **quiet(classes=backwards))
        _, labels, classes, sources = records(tmp_path / kind)
        _, ref_labels, _, ref_sources = made["reference"]
        assert classes == backwards
        named = {Path(s.rsplit("#", 1)[1]).name: classes[k] for s, k in zip(sources, labels)}
        assert named == {Path(s).name: CLASSES[k] for s, k in zip(ref_sources, ref_labels)}
        with pytest.raises(CompileError, match=r"class\(es\) 'texture' are not among the 4 given classes"):
            compile_folder(made[kind], tmp_path / f"{kind}_few", **quiet(classes=CLASSES[:4]))
        summary = compile_folder(made[kind], tmp_path / f"{kind}_few", **quiet(classes=CLASSES[:4],
                                                                               skip_unknown_classes=True))
        assert summary.kept == 16 and all("'texture' is not among" in r for _, r in summary.skipped)


@pytest.mark.parametrize("kind", ["tar", "parquet", "zip"])
def test_verify_decode_reads_the_records_again_from_their_archive_members(made: dict, kind: str,
                                                                           tmp_path: Path) -> None:
    compile_folder(made[kind], tmp_path / "out", **quiet())
    result = runner.invoke(app, ["verify", str(tmp_path / "out"), "--decode", "20"])
    assert result.exit_code == 0, result.stderr
    assert "decoded 20 record(s) again" in result.stdout and ": max 0, mean 0.000" in result.stdout


@pytest.mark.parametrize(("name", "says"), [("x.tar", "not a readable uncompressed tar"),
                                            ("x.zip", "not a readable zip archive"),
                                            ("x.parquet", "not a readable Parquet file")])
def test_a_file_that_is_not_the_archive_it_is_named_is_one_clear_line(tmp_path: Path, name: str, says: str) -> None:
    (tmp_path / name).write_bytes(b"PK\x03\x04 this is no archive at all" * 40)
    result = runner.invoke(app, ["compile", str(tmp_path / name), str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"error: no images found in {tmp_path / name} (1 " in result.stderr and says in result.stderr


def test_samples_without_any_label_compile_unlabeled_and_say_so(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "a.tar", "w") as tar:
        tar_member(tar, "one.jpg", (EXAMPLES / "cat" / "chelsea_0.jpg").read_bytes())
        tar_member(tar, "one.json", b'{"caption": "a cat"}')
    result = runner.invoke(app, ["compile", str(shards), str(tmp_path / "out"), "--size", "8", "-j", "1"])
    assert result.exit_code == 0, result.stderr
    assert f"note: the samples of {shards} have no labels, so the dataset is unlabeled (label -1)" in result.stderr
    _, labels, classes, sources = records(tmp_path / "out")
    assert labels.tolist() == [-1] and classes == [] and sources == ["a.tar#one.jpg"]


def test_a_resume_with_another_image_column_is_refused(made: dict, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    photos = [f.read_bytes() for c in CLASSES for f in sorted((made["folder"] / c).iterdir())]
    pq.write_table(pa.table({"a": pa.array(photos, pa.binary()), "b": pa.array(photos[::-1], pa.binary())}),
                   tmp_path / "two.parquet", row_group_size=5)

    def ctrl_c(n: int) -> None:  # once the first row group is done
        if n:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compile_folder(tmp_path / "two.parquet", tmp_path / "out", **quiet(image_column="a", progress=ctrl_c))
    assert staging_path(tmp_path / "out").exists()
    with pytest.raises(CompileError, match=r"other settings: image_column 'a' \(now 'b'\)"):
        compile_folder(tmp_path / "two.parquet", tmp_path / "out", **quiet(image_column="b", resume=True))
    summary = compile_folder(tmp_path / "two.parquet", tmp_path / "out", **quiet(image_column="a", resume=True))
    assert summary.kept == 20 and summary.reused == 5


def test_parquet_rows_holding_only_a_path_are_skipped_never_followed(made: dict, tmp_path: Path) -> None:
    """`datasets` keeps an Image given as a file path as that path, without bytes: dsc does not open it."""
    from datasets import ClassLabel, Dataset, Features, Image

    files = sorted((made["folder"] / "cat").iterdir())
    Dataset.from_dict({"image": [str(f) for f in files], "label": [0] * len(files)},
                      features=Features({"image": Image(), "label": ClassLabel(names=["cat"])})
                      ).to_parquet(str(tmp_path / "paths.parquet"))
    skipped = []
    with pytest.raises(CompileError, match="none of the 4 images"):
        compile_folder(tmp_path / "paths.parquet", tmp_path / "out", **quiet(on_skip=lambda s, r: skipped.append(r)))
    assert len(skipped) == 4 and all("only as a path to a file elsewhere is not followed" in r for r in skipped)


def test_a_sample_whose_image_suffix_has_a_prefix_is_found(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        tar_member(tar, "k1.input.jpg", (EXAMPLES / "cat" / "chelsea_0.jpg").read_bytes())
        tar_member(tar, "k1.cls", b"0")
    summary = compile_folder(tmp_path / "a.tar", tmp_path / "out", **quiet())
    assert summary.kept == 1 and records(tmp_path / "out")[3] == ["a.tar#k1.input.jpg"]


def test_strict_names_the_first_bad_member_by_its_archive(made: dict, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    with tarfile.open(tmp_path / "in" / "a.tar", "w") as tar:
        tar_member(tar, "k1.jpg", (EXAMPLES / "cat" / "chelsea_0.jpg").read_bytes())
        tar_member(tar, "k2.jpg", b"not an image")
    with pytest.raises(CompileError, match=rf"^{tmp_path}/in/a.tar#k2.jpg: not a recognised image .* nothing written"):
        compile_folder(tmp_path / "in" / "a.tar", tmp_path / "out", **quiet(strict=True))
    with tarfile.open(tmp_path / "in" / "b.tar", "w") as tar:
        tar_member(tar, "k3.jpg", kind=tarfile.SYMTYPE, link="/etc/passwd")
        tar_member(tar, "k4.jpg", (EXAMPLES / "cat" / "chelsea_0.jpg").read_bytes())
    with pytest.raises(CompileError, match=rf"^{tmp_path}/in/b.tar#k3.jpg: not a regular file .* nothing written"):
        compile_folder(tmp_path / "in" / "b.tar", tmp_path / "out", **quiet(strict=True))
    assert not (tmp_path / "out").exists()


def test_labels_as_stored_resolve_by_the_folders_rules() -> None:
    """Integers are kept as given (-1: no label) or index a ClassLabel's names; names index the classes."""
    labels, classes, reasons = resolve_labels([0, 1, 5, -1, None, -3], ["a", "b"], None, False)
    assert (labels, classes) == ([0, 1, -1, -1, -1, -1], ["a", "b"])
    assert reasons == {2: "label 5 is not among the 2 names of its ClassLabel", 4: "no label",
                       5: "label -3 is outside -1..1048575"}
    assert resolve_labels([0, 3, None], None, None, False) == ([0, 3, -1], ["0", "1", "2", "3"], {2: "no label"})
    assert resolve_labels(["y", "x"], None, None, False) == ([1, 0], ["x", "y"], {})
    unknown = {0: "class 'x' is not among the 1 classes"}
    assert resolve_labels(["x", "y"], None, ["y"], True) == ([-1, 0], ["y"], unknown)
    assert resolve_labels([None, None], None, None, False) == ([-1, -1], [], {})
    with pytest.raises(CompileError, match="mix integers and class names"):
        resolve_labels([1, "x"], None, None, False)


def flat_png(value: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (value, value, value)).save(out, "PNG")
    return out.getvalue()


def test_a_repeated_member_name_keeps_the_first_and_says_so(tmp_path: Path) -> None:
    """A record's source names one member: a second member of a name already taken (a tar appended to, a
    repeated zip entry, a sample with two .png) is a recorded skip, and Parquet rows sharing a path are
    named by their row; `verify --decode` then re-reads exactly the member compiled (was: a false
    'differs from its source', or an image dropped with no skip)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for name, data in [("a.png", flat_png(10)), ("a.cls", b"0"), ("b.png", flat_png(100)), ("b.cls", b"1"),
                           ("a.png", flat_png(200)), ("a.cls", b"0"), ("c.png", flat_png(50)), ("c.cls", b"1"),
                           ("c.png", flat_png(250)), ("c.cls", b"1")]:
            tar_member(tar, name, data)
    with zipfile.ZipFile(tmp_path / "z.zip", "w") as z:
        z.writestr("cat/a.png", flat_png(10))
        z.writestr("dog/b.png", flat_png(100))
        with pytest.warns(UserWarning, match="Duplicate name"):
            z.writestr("cat/a.png", flat_png(200))
    pq.write_table(pa.table({"image": [{"bytes": flat_png(v), "path": "image.png"} for v in (10, 200, 100)],
                             "label": [0, 1, 0]}), tmp_path / "p.parquet")
    expected = {"s.tar": ([10, 100, 50], ["a.png (copy 2)", "c.cls (copy 2)", "c.png (copy 2)"]),
                "z.zip": ([10, 100], ["cat/a.png (copy 2)"]),
                "p.parquet": ([10, 200, 100], [])}
    for name, (values, skipped) in expected.items():
        out = tmp_path / f"out-{name}"
        compile_folder(tmp_path / name, out, **quiet(size=16, shuffle=False))
        ds = MemmapDataset(out)
        by_source = {ds.source(i).name: int(ds[i][0].float().mean()) for i in range(len(ds))}
        assert sorted(by_source.values()) == sorted(values), (name, by_source)
        assert sorted(s.split("#", 1)[1] for s in skips(out)) == sorted(skipped), (name, skips(out))
        result = runner.invoke(app, ["verify", str(out), "--decode", str(len(ds))])
        assert result.exit_code == 0, (name, result.output)
        assert ": max 0, mean 0.000" in result.stdout, (name, result.stdout)
    parquet = MemmapDataset(tmp_path / "out-p.parquet")
    assert sorted(parquet.source(i).name for i in range(3)) == ["p.parquet#image.png", "p.parquet#row=1",
                                                                "p.parquet#row=2"]


def test_the_quick_header_walk_lists_what_tarfile_lists_or_hands_over_to_it(made: dict, tmp_path: Path) -> None:
    """The discovery's own header walk (a fifth of tarfile's cost) gives tarfile's members exactly — names, kinds,
    sizes, data offsets, link targets — for webdataset's shards and for every format tarfile writes; what it
    does not know (GNU long names, a damaged header) it leaves to tarfile, so the answer is the same."""
    from dsc.compiler.sources import tar_shards

    def by_tarfile(path: Path) -> list[tuple]:
        with tarfile.open(path) as tar:
            return [(m.name, m.type, m.size, m.offset_data, m.linkname) for m in tar.getmembers()]

    def listed(members) -> list[tuple]:
        return [(m.name, m.type, m.size, m.offset_data, m.linkname) for m in members]

    deep = "d" * 90 + "/" + "e" * 60 + "/photo.jpg"  # past ustar's 100-byte name: a prefix, a pax path or a GNU name
    paths = sorted(Path(made["tar"]).parent.glob("*.tar"))
    for form in (tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT):
        path = tmp_path / f"form{form}.tar"
        with tarfile.open(path, "w", format=form) as tar:
            tar_member(tar, "k1.jpg", (EXAMPLES / "cat" / "chelsea_0.jpg").read_bytes())
            tar_member(tar, "ünïcode/k2.cls", b"1")
            tar_member(tar, deep, b"x" * 700)
            tar_member(tar, "folder/", kind=tarfile.DIRTYPE)
            tar_member(tar, "k3.jpg", kind=tarfile.SYMTYPE, link="../../etc/passwd")
            tar_member(tar, "k4.jpg", kind=tarfile.CHRTYPE)
            tar_member(tar, "k5.png", b"")
        paths.append(path)
    quick = 0
    for path in paths:
        with open(path, "rb") as f:
            walked = tar_shards._quick_walk(f)
            members, problem = tar_shards._walk(f, path.stat().st_size)
        assert problem is None and listed(members) == by_tarfile(path), path.name
        if walked is not None:
            assert listed(walked[0]) == by_tarfile(path), path.name
            quick += 1
    assert quick == len(paths) - 1  # all but GNU's long name went the quick way
    cut = tmp_path / "cut.tar"
    cut.write_bytes(paths[0].read_bytes()[:1536 + 100])  # a header cut short: tarfile's walk and words
    with open(cut, "rb") as f:
        assert tar_shards._quick_walk(f) is None
        assert "truncated or damaged tar" in tar_shards._walk(f, cut.stat().st_size)[1]
