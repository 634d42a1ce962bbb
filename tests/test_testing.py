"""dsc.testing: the image folder it writes, the Pillow reference, and assert_roundtrip catching damage."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, features
from typer.testing import CliRunner

from dsc import DatasetError, compile_folder, storage
from dsc import format as fmt
from dsc.cli import app
from dsc.testing import MAX_MEAN_ABS_DIFF, assert_roundtrip, make_image_folder, pillow_reference


def folder_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_make_image_folder_writes_the_promised_files(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "src", classes=3, per_class=4, size=(48, 64))
    files = sorted(folder_bytes(root))
    assert len(files) == 12 and {f.split("/")[0] for f in files} == {"class_0", "class_1", "class_2"}
    images = {f: Image.open(root / f) for f in files}
    assert {im.format for im in images.values()} == {"JPEG", "PNG"}
    gray = [f for f, im in images.items() if im.format == "JPEG" and im.mode == "L"]
    rotated = {f: im.getexif().get(0x0112) for f, im in images.items() if im.format == "JPEG"}
    rotated = {f: o for f, o in rotated.items() if o in (6, 8)}
    alpha = [f for f, im in images.items() if im.mode == "RGBA" and np.asarray(im)[..., 3].min() < 255]
    assert gray == ["class_0/img_0_gray.jpg"] and len(rotated) == 1 and len(alpha) == 1
    (name, orientation), = rotated.items()
    assert name == f"class_2/img_3_exif{orientation}.jpg"
    upright = {f: (im.size[0], im.size[1]) if f == name else im.size[::-1] for f, im in images.items()}
    assert len(set(upright.values())) > 6  # varied, around (48, 64), and wider and taller than 3:4
    assert all(36 <= h <= 72 and 48 <= w <= 96 for h, w in upright.values())
    assert {h * 64 > w * 48 for h, w in upright.values()} == {True, False}
    red_corner = np.asarray(pillow_reference(root / name, *upright[name], fit="stretch"))[2, 2]
    assert red_corner[0] > 200 and red_corner[1:].max() < 80  # stored sideways, upright after EXIF


def test_make_image_folder_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = folder_bytes(make_image_folder(tmp_path / "a", seed=3))
    b = folder_bytes(make_image_folder(tmp_path / "b", seed=3))
    c = folder_bytes(make_image_folder(tmp_path / "c", seed=4))
    assert a == b
    assert len(c) == len(a) and len(a.keys() & c.keys()) >= 11  # the rotated file may be _exif6 or _exif8
    assert all(a[k] != c[k] for k in a.keys() & c.keys())


def test_make_image_folder_formats_and_bad_options(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "png", classes=1, per_class=3, formats=("png",))
    assert sorted(folder_bytes(root)) == ["class_0/img_0.png", "class_0/img_1_alpha.png", "class_0/img_2.png"]
    for bad in [{"formats": ("gif",)}, {"formats": "png"}, {"classes": 0}, {"size": (48,)}, {"per_class": True}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_image_folder(tmp_path / "bad", **bad)


@pytest.mark.parametrize("fit", ["center-crop", "stretch", "pad"])
def test_assert_roundtrip_passes_on_a_fresh_compile(tmp_path: Path, fit: str) -> None:
    src = make_image_folder(tmp_path / "src", seed=1)
    result = assert_roundtrip(src, tmp_path / "out", compile_first=True, size=(32, 40), fit=fit,
                              records_per_shard=5)
    assert result.records == 12 and result.worst_abs_diff < MAX_MEAN_ABS_DIFF["faithful"]
    assert storage.open_dataset(tmp_path / "out").manifest.compile["fit"] == fit
    assert assert_roundtrip(src, tmp_path / "out") == result  # an already compiled OUT is checked as it is


def test_assert_roundtrip_in_a_temporary_folder_and_other_formats(tmp_path: Path) -> None:
    formats = ("png", "bmp", "tiff") + (("webp",) if features.check("webp") else ())
    src = make_image_folder(tmp_path / "src", classes=2, per_class=4, formats=formats)
    assert assert_roundtrip(src, compile_first=True, size=24, workers=1).records == 8


def test_assert_roundtrip_covers_unlabeled_folders_and_skipped_files(tmp_path: Path) -> None:
    src = make_image_folder(tmp_path / "src", classes=1)
    for f in (src / "class_0").iterdir():
        f.rename(src / f.name)
    (src / "class_0").rmdir()
    (src / "broken.jpg").write_bytes(b"not a picture")
    assert assert_roundtrip(src, compile_first=True, size=16, on_skip=lambda s, r: None).records == 4


def test_pillow_reference_follows_the_colour_rules_of_formats_md(tmp_path: Path) -> None:
    Image.fromarray(np.full((4, 6), 0x1234, np.uint16)).save(tmp_path / "deep.png")
    Image.fromarray(np.full((4, 6, 4), (200, 100, 50, 128), np.uint8)).save(tmp_path / "alpha.png")
    key = np.full((4, 6, 3), (10, 20, 30), np.uint8)
    key[:, 3:] = (200, 100, 50)
    Image.fromarray(key).save(tmp_path / "key.png", transparency=(10, 20, 30))
    assert (pillow_reference(tmp_path / "deep.png", 2, 3, "stretch") == 0x12).all()
    assert (pillow_reference(tmp_path / "alpha.png", 2, 3, "stretch") == (100, 50, 25)).all()
    keyed = pillow_reference(tmp_path / "key.png", 4, 6, "stretch")
    assert (keyed[:, :3] == 0).all() and (keyed[:, 3:] == (200, 100, 50)).all()
    with pytest.raises(ValueError, match="unknown fit 'zoom'"):
        pillow_reference(tmp_path / "deep.png", 2, 3, "zoom")
    assert assert_roundtrip(tmp_path, compile_first=True, size=(2, 3), fit="stretch").records == 3  # and dsc agrees


def invert_record(out: Path, i: int) -> None:
    m = storage.parse_manifest(out)
    shard, offset = fmt.record_offset(i, m.records_per_shard, m.record_bytes)
    with open(out / m.shards[shard].file, "r+b") as f:
        f.seek(offset)
        record = f.read(m.record_bytes)
        f.seek(offset)
        f.write(bytes(255 - b for b in record))


def relabel(out: Path, i: int) -> None:
    labels = np.fromfile(out / fmt.LABELS_FILE, "<i8")
    labels[i] = (labels[i] + 1) % 3
    labels.tofile(out / fmt.LABELS_FILE)


def resize(out: Path, i: int) -> None:
    sizes = np.fromfile(out / fmt.SIZES_FILE, "<u4").reshape(-1, 2)
    sizes[i] += 1
    sizes.tofile(out / fmt.SIZES_FILE)


@pytest.mark.parametrize(("damage", "says"), [
    (invert_record, r"1 of 12 records differ .*; worst: record 7 \({source}\), mean abs diff \d+\.\d\d "
                    r"> max_mean_abs_diff 2\.5"),
    (relabel, r"record 7 \({source}\): label \d \('class_\d'\), but its folder gives \d \('class_\d'\)"),
    (resize, r"record 7 \({source}\): recorded size \(\d+, \d+\), but the upright source is"),
])
def test_assert_roundtrip_fails_naming_the_altered_record(tmp_path: Path, damage, says: str) -> None:
    src = make_image_folder(tmp_path / "src")
    out = tmp_path / "out"
    assert_roundtrip(src, out, compile_first=True, size=(32, 40), records_per_shard=5)
    damage(out, 7)  # record 7: shard 1, position 2
    source = storage.open_dataset(out).source(7)
    with pytest.raises(AssertionError, match=says.format(source=re.escape(source))) as caught:
        assert_roundtrip(src, out)
    lines = str(caught.value).splitlines()
    assert "SHA-256" in lines[2]  # a heading, the offender, the damaged file's checksum...
    if damage is invert_record:  # ...and (format 1.3) the record whose CRC-32 is wrong
        assert len(lines) == 4 and lines[3].endswith("record(s) 7 do not match their CRC-32 in checksums.bin; the "
                                                     "records are damaged")
    elif damage is relabel:  # ...and (format 1.5) its segment's class counts, which the labels now contradict
        assert len(lines) == 4 and "the class counts say" in lines[3]
    else:
        assert len(lines) == 3


def test_assert_roundtrip_fails_on_a_source_neither_compiled_nor_skipped(tmp_path: Path) -> None:
    src = make_image_folder(tmp_path / "src")
    compile_folder(src, tmp_path / "out", size=16, workers=1)
    (src / "class_1" / "late.png").write_bytes((src / "class_0" / "img_1_alpha.png").read_bytes())
    (src / "class_1" / ".hidden.png").write_bytes(b"ignored, as the compiler ignores it")
    with pytest.raises(AssertionError, match=r"class_1/late.png: found in .* but neither a record nor listed"):
        assert_roundtrip(src, tmp_path / "out")


def test_assert_roundtrip_compiles_only_when_asked(tmp_path: Path) -> None:
    src = make_image_folder(tmp_path / "src", classes=2, per_class=2)
    with pytest.raises(AssertionError, match=r"out does not exist, so there is no dataset to check"):
        assert_roundtrip(src, tmp_path / "out")  # a CI check pointed at a wrong path fails
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"compile options \['size'\] given without compile_first=True"):
        assert_roundtrip(src, tmp_path / "out", size=24)
    with pytest.raises(ValueError, match="no dataset to check"):
        assert_roundtrip(src)
    assert_roundtrip(src, tmp_path / "out", compile_first=True, size=16)
    assert_roundtrip(src, tmp_path / "out", compile_first=True, size=24, force=True)
    assert storage.parse_manifest(tmp_path / "out").record_shape == (24, 24, 3)


def test_assert_roundtrip_never_compiles_over_a_damaged_manifest(tmp_path: Path) -> None:
    src = make_image_folder(tmp_path / "src", classes=2, per_class=2)
    compile_folder(src, tmp_path / "out", size=16, workers=1)
    manifest = tmp_path / "out" / fmt.MANIFEST_FILE
    manifest.write_bytes(manifest.read_bytes()[:-40])
    with pytest.raises(DatasetError, match="manifest.json: not valid JSON"):
        assert_roundtrip(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no build was started beside it


def test_the_default_limit_follows_the_recorded_decode(tmp_path: Path) -> None:
    """A faithful compile is held to formats.md's 2.5, not to the 10 that fast decoding needs:
    a record brightened by 6 passes the one and fails the other."""
    src = make_image_folder(tmp_path / "src", seed=2)
    out = tmp_path / "out"
    fast = assert_roundtrip(src, tmp_path / "fast", compile_first=True, size=32, fast_decode=True, workers=1)
    assert fast.worst_abs_diff < MAX_MEAN_ABS_DIFF["fast"]
    assert assert_roundtrip(src, out, compile_first=True, size=32, workers=1).worst_abs_diff < 1
    m = storage.parse_manifest(out)
    shard, offset = fmt.record_offset(3, m.records_per_shard, m.record_bytes)
    records = np.memmap(out / m.shards[shard].file, np.uint8, "r+")
    records[offset:offset + m.record_bytes] = np.minimum(records[offset:offset + m.record_bytes].astype(int) + 6, 255)
    records.flush()
    with pytest.raises(AssertionError, match=r"1 of 12 records differ .* > max_mean_abs_diff 2\.5"):
        assert_roundtrip(src, out)
    with pytest.raises(AssertionError, match="SHA-256") as caught:
        assert_roundtrip(src, out, max_mean_abs_diff=10)
    assert "differ from pillow_reference" not in str(caught.value)


def test_a_class_renamed_in_the_manifest_fails_verify_and_is_named_once(tmp_path: Path) -> None:
    src = make_image_folder(tmp_path / "src", classes=2, per_class=5)
    out = tmp_path / "out"
    compile_folder(src, out, size=16, workers=1)
    manifest = out / fmt.MANIFEST_FILE
    manifest.write_bytes(manifest.read_bytes().replace(b'"class_1"', b'"class_one"'))
    checked = CliRunner().invoke(app, ["verify", str(out)])
    assert checked.exit_code == 1 and "does not match its own checksum" in checked.stderr, checked.output
    with pytest.raises(AssertionError) as caught:
        assert_roundtrip(src, out)
    lines = str(caught.value).splitlines()[1:]
    assert [line for line in lines if "but its folder gives" in line] == [
        next(line for line in lines if "class_one" in line)]
    assert "(and 4 more records like it)" in lines[0] and "does not match its own checksum" in lines[-1]
