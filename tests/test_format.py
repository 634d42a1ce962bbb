"""The format contract: golden bytes, a reader without dsc, and validate-before-trust attacks."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from dsc import ChecksumError, DatasetError, MemmapDataset, UnsupportedVersionError, compile_folder, storage
from dsc import format as fmt
from dsc.compiler import output
from dsc.compiler.append import append
from dsc.errors import LoaderError

from conftest import make_folder

RECORD_SHAPE = (2, 3, 3)
TINY_SOURCES = ["a/0.jpg", "a/1.jpg", "b/ünï cödé.png", "a/3.jpg", "b/4.gif"]


TINY_FIELDS = [
    (fmt.FieldEntry("", 0, "", "tags", "multilabel", (3,), ("x", "y", "z")),
     np.array([[1, 0, 0], [0, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 1]])),
    (fmt.FieldEntry("", 0, "", "box", "float", (2,)), np.array([[0.5, -1], [1, 2], [3, 4], [5, 6], [7, 8.25]])),
]


def write_tiny(root: Path, version: str = fmt.FORMAT_VERSION) -> fmt.Manifest:
    """A 5-record dataset of known bytes, written through the format module only (1.0: without fields)."""
    root.mkdir()
    record_bytes = int(np.prod(RECORD_SHAPE))
    output.allocate_shards(root, 5, 2, record_bytes)
    pixels = np.arange(5 * record_bytes, dtype=np.uint8).reshape(5, *RECORD_SHAPE)
    for shard, records in enumerate(fmt.shard_records(5, 2)):
        out = fmt.open_shard(root / fmt.shard_file(shard), records, RECORD_SHAPE, "r+")
        out[:] = pixels[shard * 2: shard * 2 + records]
        out.flush()
    index = output.write_index(root, np.array([0, 0, 1, 0, 1]), np.array([[10, 20], [11, 21], [12, 22], [13, 23],
                                                                        [14, 24]]), TINY_SOURCES)
    fields = output.write_fields(root, TINY_FIELDS) if version != "1.0" else ()
    skipped = ({"source": "b/bad.jpg", "reason": "empty file (0 bytes)"},)
    shards, crcs = output.hash_shards(root, 5, 2, record_bytes)
    checksums = output.write_checksums(root, crcs) if fmt.minor_version(version) >= 3 else None
    manifest = fmt.Manifest(height=2, width=3, count=5, records_per_shard=2, classes=("a", "b"),
                            shards=shards, index=index, skipped=skipped, checksums=checksums,
                            compile={"size": [2, 3], "fit": "center-crop"}, fields=fields, version=version,
                            skipped_list=output.write_skip_list(root, list(skipped)) if version != "1.0" else None)
    output.write_manifest(root, manifest)
    return manifest


# The bytes of every file of the tiny dataset, pinned: a change here is a format change,
# which needs a new version in formats.md, not a new pin.
GOLDEN = {
    "checksums.bin": "2048a0e0ea0719c7bf268f1e439735107f98adcba516cba50ba0a6362331019b",
    "fields/box.bin": "10fdafd06acfb09568faa775cb9d6cd3eecb7bfaa125203ea1abaafe0cb46a0a",
    "fields/tags.bin": "3d8948cc9de9c6b7d11fc57d32d1dd6e14a8728c218628fefe407ac23cf19869",
    "labels.bin": "e767c3048cadc9f414dfb85f7706ab1f32ecc03c54f37168b4f708590881ae72",
    "class_counts.bin": "18433020b92352c3460d1df099af07c0fb20539428b5d409d0f3920c2ba3fa6d",
    "manifest.json": "3a4cd4d554a2353963b73caff0829a79dbca4b8deb731810cf420d2512b5ad20",
    "shard_table.bin": "444fe98c90a3dbf1602386f6918ef0ecfc8aaa7c6f30258deeaf7a367846d560",
    "shards/00000.bin": "5d7e2d9b1dcbc85e7c890036a2cf2f9fe7b66554f2df08cec6aa9c0a25c99c21",
    "shards/00001.bin": "b6bda3532894fe14e260b28b68309d9947fee600de07ed4353412be70dc13b21",
    "shards/00002.bin": "c24577e1b2548f2402de01e22fc3465503b21a5cf00b6b1b76525776b206d81a",
    "sizes.bin": "5cdc1b78b8ee634e6e9c86894f6268a4831da2f379adfbf09277a90e51dbdeb4",
    "skipped.jsonl": "08db8cd844c599b7fcaa524e3ef530cc2a05a7baeaaeb41817b2f4e7bdbd4dd3",
    "source_offsets.bin": "483522e75ed72d00fac2f6e3a20ded926f889cb8cff3d4d766c79f9183936270",
    "sources.bin": "9194c5e233d3775ab5854e88eac9c23da5133244e6470ce8c13ff5b49de11ec0",
}
GOLDEN_1_4_MANIFEST = "2c85afd367fea819d3881172a82762070a2c6cebc97a2774637902cf0e1ef726"  # as dsc wrote 1.4
GOLDEN_1_0_MANIFEST = "4a1301d9fa462a874250d998dd46f94cfde2d0c05381dabdefbced8ce0ea34ff"  # as dsc wrote 1.0
GOLDEN_1_3_MANIFEST = "2377333884749a733c811d67badf92ebcafefe08a7a2b68968c23e36e10b5af7"  # as dsc wrote 1.3
GOLDEN_1_2_MANIFEST = "cc701e24f860ea2f1be8af9834791c91441c07040926da91c1990577bd3c151a"  # as dsc wrote 1.2
GOLDEN_1_1_MANIFEST = "17e2969a271c3792800dc88190ea746d3414938f237b440a925304f2c18c647f"  # as dsc wrote 1.1


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    write_tiny(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_golden_bytes(tiny: Path) -> None:
    assert digests(tiny) == GOLDEN
    assert (tiny / "fields/tags.bin").read_bytes() == bytes([1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1])
    assert (tiny / "fields/box.bin").read_bytes()[:8] == np.float32(0.5).tobytes() + np.float32(-1).tobytes()
    doc = json.loads((tiny / "manifest.json").read_text())
    assert doc["fields"][0] == {"name": "tags", "kind": "multilabel", "dtype": "|u1", "shape": [3],
                                "classes": ["x", "y", "z"]}  # 1.5: what the field is; its files, the segments'
    entry = {name: {"file": name, "bytes": (tiny / name).stat().st_size, "sha256": GOLDEN[name]} for name in GOLDEN}
    assert doc["segments"] == [{  # 1.5: one segment of every record, its files sealed as any file
        "first": 0, "count": 5, "index": {k: entry[f] for k, f in fmt.INDEX_FILES.items()},
        "fields": [entry["fields/tags.bin"], entry["fields/box.bin"]], "checksums": entry["checksums.bin"],
        "class_counts": entry["class_counts.bin"]}]
    assert "index" not in doc and "checksums" not in doc
    # records per label, -1 first: none unlabeled, 3 of class 0 ("a"), 2 of class 1 ("b")
    assert (tiny / "class_counts.bin").read_bytes() == b"".join(v.to_bytes(8, "little") for v in [0, 3, 2])
    # ...and the bytes are the ones formats.md describes, spelled out independently:
    assert (tiny / "labels.bin").read_bytes() == b"".join(v.to_bytes(8, "little", signed=True) for v in [0, 0, 1, 0, 1])
    assert (tiny / "sizes.bin").read_bytes()[:8] == (10).to_bytes(4, "little") + (20).to_bytes(4, "little")
    assert (tiny / "sources.bin").read_bytes() == "".join(TINY_SOURCES).encode()
    assert (tiny / "shards/00002.bin").read_bytes() == bytes(range(72, 90))
    assert (tiny / "skipped.jsonl").read_bytes() == b'{"source": "b/bad.jpg", "reason": "empty file (0 bytes)"}\n'
    manifest = json.loads((tiny / "manifest.json").read_text())
    assert manifest["record"] == {"shape": [2, 3, 3], "dtype": "uint8", "layout": "HWC", "color": "RGB", "bytes": 18}
    text, seal = (tiny / "manifest.json").read_bytes(), manifest["manifest_sha256"]  # 1.2: its own checksum
    assert hashlib.sha256(text.replace(seal.encode(), b"0" * 64)).hexdigest() == seal and text.count(seal.encode()) == 1
    pixels = bytes(range(90))  # 1.3: each record's CRC-32, uint32 little-endian
    assert (tiny / "checksums.bin").read_bytes() == b"".join(
        zlib.crc32(pixels[18 * i:18 * (i + 1)]).to_bytes(4, "little") for i in range(5))
    assert manifest["segments"][0]["checksums"] == {"file": "checksums.bin", "bytes": 20,
                                                    "sha256": GOLDEN["checksums.bin"]}
    # 1.4: no shard in the manifest; each shard's raw SHA-256 in the shard table, in shard order
    assert "shards" not in manifest and manifest["shard_tables"] == [
        {"file": "shard_table.bin", "bytes": 96, "sha256": GOLDEN["shard_table.bin"], "first": 0, "count": 3,
         "row": 0, "folder": "shards"}]
    assert (tiny / "shard_table.bin").read_bytes() == b"".join(
        bytes.fromhex(GOLDEN[f"shards/0000{k}.bin"]) for k in range(3))


def test_a_1_4_dataset_opens_as_written_with_its_index_whole(tmp_path: Path) -> None:
    write_tiny(tmp_path / "old", version="1.4")
    assert digests(tmp_path / "old")["manifest.json"] == GOLDEN_1_4_MANIFEST
    assert "class_counts.bin" not in digests(tmp_path / "old")
    opened = storage.open_dataset(tmp_path / "old")
    assert opened.manifest.segments == () and len(opened.manifest.index_segments) == 1
    assert opened.labels.tolist() == [0, 0, 1, 0, 1] and opened.manifest.has_checksums
    assert fmt.class_counts(opened.manifest, None, tmp_path) is None  # counted from the labels instead
    storage.verify_checksums(tmp_path / "old", opened.manifest)


def test_a_1_3_dataset_opens_as_written_with_its_shards_in_the_manifest(tmp_path: Path) -> None:
    write_tiny(tmp_path / "old", version="1.3")
    assert digests(tmp_path / "old")["manifest.json"] == GOLDEN_1_3_MANIFEST
    assert "shard_table.bin" not in digests(tmp_path / "old")
    opened = storage.open_dataset(tmp_path / "old")
    assert opened.manifest.shard_tables == () and [s.sha256 for s in opened.manifest.shards] == [
        GOLDEN[f"shards/0000{k}.bin"] for k in range(3)]
    storage.verify_checksums(tmp_path / "old", opened.manifest)


def test_a_1_2_dataset_opens_as_written_without_record_checksums(tmp_path: Path) -> None:
    write_tiny(tmp_path / "old", version="1.2")
    assert digests(tmp_path / "old")["manifest.json"] == GOLDEN_1_2_MANIFEST
    opened = storage.open_dataset(tmp_path / "old")
    assert not opened.manifest.has_checksums and "checksums.bin" not in digests(tmp_path / "old")
    storage.verify_checksums(tmp_path / "old", opened.manifest)


def test_a_1_1_dataset_opens_as_written_and_has_no_checksum_of_its_own(tmp_path: Path) -> None:
    write_tiny(tmp_path / "old", version="1.1")
    assert digests(tmp_path / "old")["manifest.json"] == GOLDEN_1_1_MANIFEST
    opened = storage.open_dataset(tmp_path / "old")
    assert opened.manifest.count == 5 and "box" in opened.fields
    storage.verify_checksums(tmp_path / "old", opened.manifest)  # nothing to check the manifest against
    edit_manifest(tmp_path / "old", set_key("manifest_sha256", "0" * 64))
    with pytest.raises(DatasetError, match=r"unknown key\(s\) \['manifest_sha256'\] for version 1.1"):
        storage.open_dataset(tmp_path / "old")


def test_a_manifest_changed_after_it_was_written_fails_its_checksum(tiny: Path) -> None:
    path = tiny / fmt.MANIFEST_FILE
    path.write_bytes(path.read_bytes().replace(b'"a"', b'"A"'))  # a class renamed by hand: still valid
    manifest = storage.open_dataset(tiny).manifest
    assert manifest.classes == ("A", "b")
    with pytest.raises(ChecksumError, match="manifest.json: its content does not match its own checksum"):
        storage.verify_checksums(tiny, manifest)


def test_golden_dataset_reads_back(tiny: Path) -> None:
    ds = storage.open_dataset(tiny)
    assert ds.fields["tags"].tolist() == TINY_FIELDS[0][1].tolist() and ds.fields["box"][4].tolist() == [7, 8.25]
    assert [s.records for s in ds.manifest.shards] == [2, 2, 1]
    assert ds.shards[2][0, 1, 2].tolist() == [87, 88, 89]  # record 4, row 1, column 2
    assert [ds.source(i) for i in range(5)] == TINY_SOURCES
    assert ds.labels.tolist() == [0, 0, 1, 0, 1] and ds.sizes[4].tolist() == [14, 24]


def formats_md_script() -> str:
    """The numpy script of formats.md, "Reading a record without dsc", exactly as published."""
    text = (Path(__file__).parent.parent / "formats.md").read_text()
    section = text[text.index("## Reading a record without dsc"):]
    return section[section.index("```python\n") + 10:section.index("\n```", section.index("```python"))]


@pytest.mark.parametrize("with_fields,appended", [(False, False), (True, False), (False, True)])
def test_the_numpy_script_of_formats_md_reads_records_without_dsc(tmp_path: Path, with_fields: bool,
                                                                  appended: bool) -> None:
    """Also a 1.1 dataset with fields (the 1.x script ignores what it does not know), and (1.5) one appended
    to, whose index is in two segments."""
    src = make_folder(tmp_path / "src", classes=2, per_class=4)
    table = None
    if with_fields:
        table = tmp_path / "labels.csv"
        names = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
        table.write_text("path,label,score\n" + "".join(f"{n},{n.split('/')[0]},{k / 2}\n"
                                                        for k, n in enumerate(names)))
    compile_folder(src, tmp_path / "out", size=(12, 10), records_per_shard=3, workers=1, labels=table)
    if appended:
        append(tmp_path / "out", make_folder(tmp_path / "more", classes=2, per_class=2, seed=5), workers=1)
        assert len(storage.parse_manifest(tmp_path / "out").segments) == 2
    assert bool(storage.open_dataset(tmp_path / "out").fields) == with_fields
    script = formats_md_script()
    assert len(script.splitlines()) <= 30 and "dsc" not in script.replace('"dsc"', "").replace("dsc 1.x", "")
    probe = ("import sys, hashlib\nroot, i = sys.argv[1], int(sys.argv[2])\n" + script.replace('root, i = "out", 5', "")
             + "\nprint(json.dumps([label, source, name, list(image.shape),"
               " hashlib.sha256(image.tobytes()).hexdigest()]))\nassert 'dsc' not in sys.modules\n")
    ds = storage.open_dataset(tmp_path / "out")
    for i in range(ds.manifest.count):
        run = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "out"), str(i)], capture_output=True,
                             text=True, check=True)
        label, source, name, shape, sha = json.loads(run.stdout)
        shard, pos = fmt.locate(i, 3)
        assert (label, source, shape) == (int(ds.labels[i]), ds.source(i), [12, 10, 3])
        assert name == ds.manifest.classes[label]
        assert sha == hashlib.sha256(np.asarray(ds.shards[shard][pos]).tobytes()).hexdigest()


def edit_manifest(root: Path, change) -> None:
    path = root / fmt.MANIFEST_FILE
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def set_key(*keys_and_value):
    *keys, value = keys_and_value

    def change(doc):
        for key in keys[:-1]:
            doc = doc[key]
        doc[keys[-1]] = value
    return change


@pytest.mark.parametrize(("change", "error", "match"), [
    (set_key("version", "2.0"), UnsupportedVersionError, r"version 2.0 is not supported .* reads 1.x"),
    (set_key("version", "one"), DatasetError, "'version' must be 'MAJOR.MINOR'"),
    (set_key("format", "ffcv"), DatasetError, "'format' must be 'dsc'"),
    (set_key("extra", 1), DatasetError, r"unknown key\(s\) \['extra'\]"),
    (lambda d: d.pop("classes"), DatasetError, r"missing key\(s\) \['classes'\]"),
    (set_key("count", 6), DatasetError, r"shards/00002.bin: file is 18 bytes, the manifest says 36"),
    (set_key("count", -1), DatasetError, r"'count' = -1 is outside"),
    (set_key("count", "5"), DatasetError, "'count' must be int, found str"),
    (set_key("count", True), DatasetError, "'count' must be int, found bool"),
    (set_key("records_per_shard", 5), DatasetError, r"shard_tables\[0\]: 'count' = 3 is outside \[1, 1\]"),
    (set_key("record", "shape", [2, 3, 4]), DatasetError, r"'shape' must be \[H, W, 3\]"),
    (set_key("record", "shape", [2, 1 << 40, 3]), DatasetError, r"'shape' must be"),
    (set_key("record", "dtype", "float32"), DatasetError, "'dtype' must be 'uint8'"),
    (set_key("record", "bytes", 17), DatasetError, "'bytes' = 17 but shape"),
    (set_key("shard_tables", 0, "folder", "../tiny/shards"), DatasetError, "without '.' or '..'"),
    (set_key("shard_tables", 0, "folder", "/etc"), DatasetError, "invalid file name"),
    (set_key("shard_tables", 0, "folder", "elsewhere"), DatasetError, "elsewhere/00000.bin"),
    (set_key("shard_tables", 0, "count", 2), DatasetError, r"'shard_tables' cover 2 shard\(s\)"),
    (set_key("shard_tables", 0, "row", 1), DatasetError, r"rows 1 .. 3 of 32 bytes do not fit its 96 bytes"),
    (set_key("shard_tables", 0, "first", 1), DatasetError, "'first' = 1, expected 0"),
    (set_key("shard_tables", 0, "sha256", "0" * 64), DatasetError, "shard table does not match its size and SHA-256"),
    (set_key("shard_tables", 0, "sha256", "xyz"), DatasetError, "64 lowercase hex"),
    (set_key("shard_tables", 0, "file", "shards/00001.bin"), DatasetError, "file is 36 bytes, the manifest says 96"),
    (lambda d: d["segments"][0]["index"]["sources"].update(file="shards/00002.bin", bytes=18), DatasetError,
     r"segments\[0\].index.sources: file 'shards/00002.bin' is also a shard file"),
    (set_key("shard_tables", []), DatasetError, r"'shard_tables' has 0 table\(s\) for 3 shard\(s\)"),
    (set_key("segments", 0, "index", "labels", "bytes", 8), DatasetError, "declares 8 bytes"),
    (set_key("segments", 0, "index", "sizes", "file", "labels.bin"), DatasetError, "declares 40 bytes|also used"),
    # 1.5: the segments cover every record once, in order, each file sized by its segment's records
    (set_key("segments", []), DatasetError, r"'segments' has 0 segment\(s\) for 5 record\(s\)"),
    (set_key("segments", 0, "first", 1), DatasetError, r"segments\[0\]: 'first' = 1, expected 0"),
    (set_key("segments", 0, "count", 4), DatasetError, r"segments\[0\].index.labels: declares 40 bytes, but its "
                                                       "record count needs 32"),
    (set_key("segments", 0, "count", 6), DatasetError, r"segments\[0\]: 'count' = 6 is outside \[1, 5\]"),
    (lambda d: d["segments"].append(d["segments"][0]), DatasetError, r"segments\[1\]: 'first' = 0, expected 5"),
    (lambda d: d["segments"][0]["fields"].pop(), DatasetError, r"'fields' lists 1 file\(s\), the dataset has 2"),
    (set_key("segments", 0, "checksums", None), DatasetError, r"segments\[0\].checksums: +must be a JSON object"),
    (lambda d: d["segments"][0].pop("class_counts"), DatasetError, r"segments\[0\]: missing key\(s\) \['class_cou"),
    (lambda d: d["segments"][0]["class_counts"].update(file="checksums.bin", bytes=20), DatasetError,
     "'checksums.bin' is listed twice"),
    (set_key("segments", 0, "class_counts", "bytes", 20), DatasetError, "file is 24 bytes, the manifest says 20"),
    (lambda d: d.update(index=d["segments"][0]["index"]), DatasetError,
     r"unknown key\(s\) \['index'\] for version 1.5"),
    (lambda d: d["fields"][0].update(file="fields/tags.bin"), DatasetError,
     r"fields\[0\]: unknown key\(s\) \['file'\]"),
    (set_key("classes", ["a", "a"]), DatasetError, "distinct"),
    (set_key("skipped", ["x"]), DatasetError, "'skipped' must be a list of"),
    (set_key("compile", []), DatasetError, "'compile' must be dict"),
    (set_key("count", 2**33), DatasetError, r"'shard_tables' cover 3 shard\(s\), but 8589934592 records"),
    (set_key("records_per_shard", 2**40 + 1), DatasetError, "'records_per_shard' = .* is outside"),
    (set_key("skipped", [{"source": "x", "reason": "y", "extra": 1}]), DatasetError, "'skipped' must be"),
    (set_key("skipped_list", "count", 2), DatasetError,  # found by test_fuzz_dataset: info refused, the reader not
     r"skipped_list: 'count' = 2, but 'skipped' lists 1 \(it must repeat the first min\(count, 100\)\)"),
    (set_key("skipped", []), DatasetError, r"'count' = 1, but 'skipped' lists 0"),
])
def test_a_lying_manifest_is_refused_before_mapping(tiny: Path, change, error, match) -> None:
    edit_manifest(tiny, change)
    with pytest.raises(error, match=match):
        storage.open_dataset(tiny)


@pytest.mark.parametrize(("change", "match"), [
    (set_key("count", 6), r"shards\[2\]: declares 18 bytes, but its record count needs 36"),
    (set_key("records_per_shard", 5), "lists 3 shard"),
    (set_key("count", 2**33), r"'shards' lists 3 shard\(s\), but 8589934592 records"),
    (set_key("shards", 0, "file", "../tiny/shards/00000.bin"), "without '.' or '..'"),
    (set_key("shards", 0, "file", "/etc/passwd"), "invalid file name"),
    (set_key("shards", 1, "file", "shards/00000.bin"), "listed twice"),
    (set_key("shards", 0, "file", "shards/missing.bin"), "missing"),
    (set_key("shards", 0, "records", 1), "declares 18 bytes|'records' = 1"),
    (set_key("shards", 0, "sha256", "xyz"), "64 lowercase hex"),
])
def test_a_lying_1_3_shard_list_is_refused_before_mapping(tmp_path: Path, change, match) -> None:
    write_tiny(tmp_path / "old", version="1.3")
    edit_manifest(tmp_path / "old", change)
    with pytest.raises(DatasetError, match=match):
        storage.open_dataset(tmp_path / "old")


@pytest.mark.parametrize(("extra_rows", "refused"), [(1, False), (2, True)])
def test_a_shard_table_holds_at_most_one_row_beyond_those_used(tiny: Path, extra_rows: int, refused: bool) -> None:
    """One unused row is a replaced last shard's (an append); more would be bytes read at every open for nothing."""
    table = tiny / fmt.SHARD_TABLE_FILE
    table.write_bytes(table.read_bytes() + bytes(32 * extra_rows))
    edit_manifest(tiny, lambda d: d["shard_tables"][0].update(bytes=table.stat().st_size,
                                                             sha256=hashlib.sha256(table.read_bytes()).hexdigest()))
    if refused:
        with pytest.raises(DatasetError, match=r"'shard_table.bin' has 160 bytes, but its entries use 96 \(at most 32"):
            storage.open_dataset(tiny)
    else:
        assert [s.records for s in storage.open_dataset(tiny).manifest.shards] == [2, 2, 1]


def test_a_newer_minor_version_may_add_keys(tiny: Path) -> None:
    edit_manifest(tiny, set_key("version", "1.7"))
    edit_manifest(tiny, set_key("future_key", {"anything": 1}))
    edit_manifest(tiny, set_key("skipped", [{"source": "x", "reason": "y", "stage": "decode"}]))
    manifest = storage.open_dataset(tiny).manifest
    assert manifest.count == 5 and manifest.skipped == ({"source": "x", "reason": "y"},)


def test_a_1_0_dataset_opens_without_fields_and_1_0_keys_are_exact(tmp_path: Path) -> None:
    write_tiny(tmp_path / "old", version="1.0")
    doc = json.loads((tmp_path / "old" / fmt.MANIFEST_FILE).read_text())
    assert doc["version"] == "1.0" and "fields" not in doc
    assert digests(tmp_path / "old")["manifest.json"] == GOLDEN_1_0_MANIFEST
    opened = storage.open_dataset(tmp_path / "old")
    assert opened.fields == {} and opened.manifest.count == 5 and opened.labels.tolist() == [0, 0, 1, 0, 1]
    edit_manifest(tmp_path / "old", set_key("fields", []))
    with pytest.raises(DatasetError, match=r"unknown key\(s\) \['fields'\] for version 1.0"):
        storage.open_dataset(tmp_path / "old")


def write_field(root: Path, name: str, values: np.ndarray) -> None:
    """Overwrite a field file and its manifest entry's hash: only the value checks can catch it."""
    payload = values.tobytes()
    (root / "fields" / f"{name}.bin").write_bytes(payload)
    edit_manifest(root, lambda d: [e.update(sha256=hashlib.sha256(payload).hexdigest())
                                   for f, e in zip(d["fields"], d["segments"][0]["fields"]) if f["name"] == name])


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.pop("fields"), r"missing key\(s\) \['fields'\]"),
    (lambda d: d.pop("manifest_sha256"), r"missing key\(s\) \['manifest_sha256'\]"),
    (set_key("manifest_sha256", "ABC"), "'manifest_sha256' must be 64 lowercase hex digits"),
    (set_key("fields", {}), "'fields' must be list"),
    (set_key("fields", 0, "kind", "image"), "'kind' must be one of class, multilabel, float, int"),
    (set_key("fields", 0, "kind", ["class"]), "'kind' must be one of class, multilabel, float, int"),
    (set_key("fields", 0, "classes", [str(k) for k in range(70000)]), "at most 65536 distinct"),
    (set_key("fields", 0, "dtype", "<f4"), r"'dtype' of a multilabel field must be '\|u1'"),
    (set_key("fields", 0, "shape", [2]), r"multilabel field has shape \[len\(classes\)\] = \[3\]"),
    (set_key("fields", 1, "shape", [3]), r"fields\[1\] \(box\): declares 40 bytes, but its record count needs 60"),
    (set_key("fields", 1, "shape", [1, 2]), r"'shape' must be \[\] or \[k\]"),
    (set_key("fields", 1, "classes", ["q"]), "a float field has no classes"),
    (set_key("fields", 1, "name", "tags"), "field 'tags' is listed twice"),
    (set_key("fields", 1, "name", "label"), "'label' is reserved"),
    (set_key("fields", 1, "name", "../x"), "not a valid field name"),
    (set_key("segments", 0, "fields", 1, "file", "labels.bin"), "declares 80 bytes|also used elsewhere"),
    (set_key("segments", 0, "fields", 0, "file", "fields/gone.bin"), "missing"),
    (set_key("fields", 0, "extra", 1), r"unknown key\(s\) \['extra'\]"),
])
def test_a_lying_field_entry_is_refused(tiny: Path, change, match) -> None:
    edit_manifest(tiny, change)
    with pytest.raises(DatasetError, match=match):
        storage.open_dataset(tiny)


@pytest.mark.parametrize(("name", "values", "match"), [
    ("tags", np.array([[1, 0, 0], [0, 2, 1], [0, 0, 0], [1, 1, 1], [0, 0, 1]], np.uint8), "must be 0 or 1"),
    ("box", np.array([[0.5, -1], [1, np.nan], [3, 4], [5, 6], [7, 8]], "<f4"), "must be finite"),
])
def test_field_values_are_checked_before_they_are_trusted(tiny: Path, name, values, match) -> None:
    write_field(tiny, name, values)
    with pytest.raises(DatasetError, match=rf"fields/{name}.bin: values of field '{name}' {match}"):
        storage.open_dataset(tiny)


def test_a_class_field_out_of_its_vocabulary_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    write_tiny(root)
    entry = output.write_fields(root, [(fmt.FieldEntry("", 0, "", "kind", "class", (), ("p", "q")),
                                     np.array([0, 1, 2, 0, 1]))])[0]
    edit_manifest(root, lambda d: (d["fields"].append({k: v for k, v in entry.to_dict().items()  # (1.5) what it is
                                                       if k not in ("file", "bytes", "sha256")}),
                                   d["segments"][0]["fields"].append(  # and (1.5) the segment's file of it
                                       {"file": entry.file, "bytes": entry.bytes, "sha256": entry.sha256})))
    with pytest.raises(DatasetError, match=r"values of field 'kind' must lie in \[0, 1\], found \[0, 2\]"):
        storage.open_dataset(root)


def test_a_number_too_long_to_parse_is_a_dataset_error(tiny: Path) -> None:
    text = (tiny / fmt.MANIFEST_FILE).read_text().replace('"count": 5', '"count": ' + "9" * 5000)
    (tiny / fmt.MANIFEST_FILE).write_text(text)
    with pytest.raises(DatasetError, match="not valid JSON"):
        storage.open_dataset(tiny)


@pytest.mark.parametrize(("size_change", "word"), [(-1, "truncated"), (1, "extended")])
def test_a_truncated_or_extended_shard_is_refused(tiny: Path, size_change: int, word: str) -> None:
    shard = tiny / fmt.shard_file(1)
    os.truncate(shard, shard.stat().st_size + size_change)
    with pytest.raises(DatasetError, match=rf"00001.bin: file is \d+ bytes, the manifest says 36 \({word}\)"):
        storage.open_dataset(tiny)


def test_a_symlink_out_of_the_folder_is_refused(tiny: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes((tiny / fmt.shard_file(0)).read_bytes())
    (tiny / fmt.shard_file(0)).unlink()
    (tiny / fmt.shard_file(0)).symlink_to(outside)
    with pytest.raises(DatasetError, match="must be a regular file inside the dataset folder"):
        storage.open_dataset(tiny)


@pytest.mark.parametrize(("content", "match"), [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
                                                (b"\xff\xfe", "not valid JSON")])
def test_a_broken_manifest_is_refused(tiny: Path, content: bytes, match: str) -> None:
    (tiny / fmt.MANIFEST_FILE).write_bytes(content)
    with pytest.raises(DatasetError, match=match):
        storage.open_dataset(tiny)


def test_an_oversized_manifest_is_not_parsed(tiny: Path) -> None:
    with open(tiny / fmt.MANIFEST_FILE, "r+b") as f:
        f.truncate(fmt.MAX_MANIFEST_BYTES + 1)
    with pytest.raises(DatasetError, match="more than the .* a manifest may have"):
        storage.open_dataset(tiny)


def test_missing_manifest_and_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        storage.open_dataset(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    with pytest.raises(DatasetError, match="no manifest.json; not a dsc dataset, or its compile never finished"):
        storage.open_dataset(tmp_path / "half")


def test_labels_out_of_range_and_bad_offsets_are_refused(tiny: Path) -> None:
    labels = np.memmap(tiny / fmt.LABELS_FILE, "<i8", "r+")
    labels[3] = 7
    labels.flush()
    with pytest.raises(DatasetError, match=r"labels must lie in \[0, 1\] for 2 classes, found \[0, 7\]"):
        storage.open_dataset(tiny)
    labels[3] = 0
    labels.flush()
    offsets = np.memmap(tiny / fmt.SOURCE_OFFSETS_FILE, "<u8", "r+")
    offsets[2] = 10**6
    offsets.flush()
    with pytest.raises(DatasetError, match="offsets must rise from 0"):
        storage.open_dataset(tiny)


@pytest.mark.parametrize("side", [0, 1])
def test_an_original_size_of_zero_is_refused_naming_sizes_bin(tmp_path: Path, side: int) -> None:
    """sizes.bin was the one index file never range-checked: a 0 side is no image a record came from,
    and a crop drawn over the original size (`original_sizes=True`) turns it into garbage."""
    out = tmp_path / "out"
    compile_folder(make_folder(tmp_path / "src"), out, size=8, workers=1, records_per_shard=5)
    assert storage.open_dataset(out).sizes.min() >= 1  # what a compile writes passes
    sizes = np.memmap(out / fmt.SIZES_FILE, "<u4", "r+").reshape(-1, 2)
    sizes[7, side] = 0
    sizes.flush()
    del sizes
    refusal = (rf"{re.escape(str(out / fmt.SIZES_FILE))}: every original \(height, width\) must be at least 1 "
               r"pixel a side, found sides in \[0, \d+\]")
    with pytest.raises(DatasetError, match=refusal):
        storage.open_dataset(out)
    ds = MemmapDataset(out)  # the reader checks values as it uses them: the whole file when asked for whole,
    with pytest.raises(DatasetError, match=refusal):
        _ = ds.opened.sizes
    with pytest.raises(LoaderError, match=rf"{fmt.SIZES_FILE}: record 7 has \[\d+, \d+\], but every original"):
        list(ds.loader(4, order="sequential"))  # a batch's own values as it takes them


def test_verify_checksums_names_the_damaged_file(tiny: Path) -> None:
    manifest = storage.open_dataset(tiny).manifest
    storage.verify_checksums(tiny, manifest)
    with open(tiny / fmt.shard_file(2), "r+b") as f:
        f.seek(5)
        f.write(b"\x00")
    with pytest.raises(ChecksumError, match=r"shards/00002.bin: SHA-256 is [0-9a-f]{64}, the manifest says"):
        storage.verify_checksums(tiny, manifest)


def test_record_checksums_are_zlibs_crc32_whichever_buffer_holds_the_record(tmp_path: Path) -> None:
    """`record_crc` computes with zlib-ng where it is installed (the s3 extra): the numbers must be zlib's
    (formats.md, "Record checksums") for every kind of buffer the reader and the compiler pass it."""
    records = np.random.default_rng(0).integers(0, 256, (6, 7, 9, 3), dtype=np.uint8)
    want = [zlib.crc32(r.tobytes()) for r in records]
    path = tmp_path / "records.bin"
    path.write_bytes(records.tobytes())
    mapped = np.memmap(path, np.uint8, "r", shape=records.shape)
    raw = records.tobytes()
    rb = records[0].size
    for buffers in ([r for r in records], [r for r in mapped], [memoryview(raw)[k * rb:(k + 1) * rb] for k in range(6)],
                    [bytearray(raw[k * rb:(k + 1) * rb]) for k in range(6)]):
        assert [fmt.record_crc(b) for b in buffers] == want
    assert fmt.record_checksums(raw, rb) == want == fmt.record_checksums(records, rb)
    assert fmt.record_crc(b"") == 0


def test_record_checksums_are_computed_by_zlib_ng_where_it_is_installed() -> None:
    zlib_ng = pytest.importorskip("zlib_ng.zlib_ng", reason="zlib-ng is not installed: pip install 'dsc-images[s3]'")
    assert fmt._crc32 is zlib_ng.crc32
