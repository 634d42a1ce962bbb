"""Issue 26, points 8 and 9: the same SRC gives the same dataset whichever JPEG decoder runs; what a
decoder warned about is counted per record, shown by `dsc info` and refused by `--strict`; `dsc verify`
refuses a skip list that names a stored source.

The sources are a real photo (tests/data/photos) and three damaged copies: cut inside its scan, its
final end-of-image marker stripped, and bytes of its entropy-coded data flipped. "Without the system
library" is a subprocess with DSC_JPEG_DECODER=pillow: what a pip-only machine does, which decodes
with simplejpeg.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

import dsc
from dsc import format as fmt
from dsc import storage
from dsc.cli import app
from dsc.compiler import decode as dec
from dsc.compiler.decode import DECODER_ENV, turbojpeg_library

from conftest import pattern, rewrite_manifest

PHOTO = Path(__file__).parent / "data" / "photos" / "chelsea.jpg"
runner = CliRunner()


def _scan(data: bytes) -> tuple[int, int]:
    """Where the photo's entropy-coded data starts and ends (its end-of-image marker)."""
    sos = data.index(b"\xff\xda")
    return sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big"), data.rindex(b"\xff\xd9")


def _flipped(data: bytes) -> bytes:
    """A few bytes of the entropy-coded data inverted (never a 0xFF or a byte after one: markers stay)."""
    out = bytearray(data)
    start, end = _scan(data)
    for at in range(start + (end - start) // 3, end - 16, (end - start) // 5):
        if out[at] not in (0x00, 0xFF) and out[at - 1] != 0xFF:
            out[at] ^= 0x5A
    return bytes(out)


def damaged_folder(root: Path) -> Path:
    data = PHOTO.read_bytes()
    start, end = _scan(data)
    assert data.endswith(b"\xff\xd9")
    files = {"cat/whole.jpg": data, "cat/no_eoi.jpg": data[:-2], "dog/cut.jpg": data[:start + (end - start) * 7 // 10],
             "dog/flipped.jpg": _flipped(data), "dog/whole_too.jpg": data}
    for name, payload in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(payload)
    return root


def _outcome(decode, data: bytes, p: dec.Probe, scale: int) -> np.ndarray | str:
    """The pixels, or libjpeg-turbo's words where the binding raised."""
    try:
        return decode(data, p, scale)
    except Exception as e:
        return dec._turbo_message(e)


@pytest.mark.skipif(turbojpeg_library() is None, reason="libturbojpeg.so.0 is not installed here")
@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_simplejpeg_decodes_and_refuses_as_the_system_libjpeg_turbo_does(scale: int) -> None:
    """What the fallback rests on: the same pixels at every DCT scale, the same warning about the same damage."""
    cases = []
    for photo in sorted(PHOTO.parent.glob("*.jpg")):
        data = photo.read_bytes()
        start, end = _scan(data)
        cases += [data, data[:-2], data[:start + (end - start) * 7 // 10], _flipped(data)]
    for h in range(1, 9):  # a few pixels: where a smaller scale than 1/scale could also reach the size
        for w in range(1, 9):
            buf = io.BytesIO()
            Image.fromarray(pattern(h, w, seed=h * 9 + w)).save(buf, "JPEG", quality=90)
            cases.append(buf.getvalue())
    refused = 0
    for data in cases:
        p = dec.probe(data)
        if p.width // scale < 1 or p.height // scale < 1:
            continue
        system, bundled = (_outcome(f, data, p, scale) for f in (dec._decode_jpeg4py, dec._decode_simplejpeg))
        if isinstance(system, str):
            refused += 1
            assert bundled == system
        else:
            assert isinstance(bundled, np.ndarray) and bundled.shape == system.shape
            assert np.array_equal(bundled, system)
    # every copy cut short or missing its EOI, and flipped ones (some flips happen to leave valid code: decoded)
    assert refused > 2 * len(list(PHOTO.parent.glob("*.jpg")))


COMPILE = """
import json, sys
import dsc
from dsc.compiler.decode import decoder_name
summary = dsc.compile_folder(sys.argv[1], sys.argv[2], size=48, workers=1)
print(json.dumps({"decoder": decoder_name(), "skipped": summary.skipped}))
"""


def _env(hide_turbojpeg: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != DECODER_ENV}
    if hide_turbojpeg:
        env[DECODER_ENV] = "pillow"  # what a pip-only machine without libturbojpeg.so.0 does
    return env


def _compile_in_a_process(src: Path, out: Path, hide_turbojpeg: bool) -> dict:
    run = subprocess.run([sys.executable, "-c", COMPILE, str(src), str(out)], capture_output=True, text=True,
                         env=_env(hide_turbojpeg), timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _digests(root: Path, manifest: fmt.Manifest) -> dict[str, str]:
    """Every file the manifest lists (shards, index, skip list, warnings.bin) by its SHA-256."""
    (one,) = manifest.index_segments
    entries = [*manifest.shards, *one.index.values(), *filter(None, [manifest.skipped_list, one.warnings])]
    return {e.file: hashlib.sha256((root / e.file).read_bytes()).hexdigest() for e in entries}


def _manifest_but_its_decoder(root: Path) -> dict:
    """The manifest without what names this process's decoder (and the checksum that covers it)."""
    doc = json.loads((root / fmt.MANIFEST_FILE).read_text())
    doc.pop("manifest_sha256")
    doc["compile"].pop("jpeg_decoder")
    return doc


@pytest.mark.skipif(turbojpeg_library() is None, reason="libturbojpeg.so.0 is not installed here")
def test_the_same_dataset_with_and_without_the_system_libjpeg_turbo(tmp_path: Path) -> None:
    src = damaged_folder(tmp_path / "src")
    turbo = _compile_in_a_process(src, tmp_path / "turbo", hide_turbojpeg=False)
    pillow = _compile_in_a_process(src, tmp_path / "pillow", hide_turbojpeg=True)
    assert turbo["skipped"] == pillow["skipped"] == [["dog/cut.jpg", turbo["skipped"][0][1]]]
    assert turbo["skipped"][0][1].startswith("corrupt or truncated JPEG data")
    a, b = storage.open_dataset(tmp_path / "turbo"), storage.open_dataset(tmp_path / "pillow")
    assert a.manifest.count == b.manifest.count == 4  # the file missing only its EOI is kept by both
    assert [a.source(i) for i in range(4)] == [b.source(i) for i in range(4)]
    assert a.manifest.index_segments[0].warnings is not None and b.manifest.index_segments[0].warnings is not None
    # records, index, skips, warnings: byte for byte; the manifest differs only in naming the decoder
    assert _digests(a.root, a.manifest) == _digests(b.root, b.manifest)
    assert sorted(p.name for p in a.root.iterdir()) == sorted(p.name for p in b.root.iterdir())
    assert _manifest_but_its_decoder(a.root) == _manifest_but_its_decoder(b.root)
    by_source = {b.source(i): n for i, n in enumerate(storage.read_warnings(b.root, b.manifest))}
    assert by_source == {"cat/no_eoi.jpg": 1, "cat/whole.jpg": 0, "dog/flipped.jpg": 1, "dog/whole_too.jpg": 0}
    assert turbo["decoder"].startswith("jpeg4py") and pillow["decoder"].startswith("simplejpeg")


@pytest.mark.skipif(turbojpeg_library() is None, reason="libturbojpeg.so.0 is not installed here")
@pytest.mark.parametrize("hide_turbojpeg", [False, True])
def test_strict_refuses_corrupt_entropy_data_with_and_without_the_system_libjpeg_turbo(
        tmp_path: Path, hide_turbojpeg: bool) -> None:
    src = damaged_folder(tmp_path / "src")
    for name in ("dog/cut.jpg", "cat/no_eoi.jpg"):  # a skip or the missing EOI would stop it first
        (src / name).unlink()
    run = subprocess.run([sys.executable, "-m", "dsc", "compile", str(src), str(tmp_path / "out"), "--size", "48",
                          "-j", "1", "--strict"], capture_output=True, text=True, env=_env(hide_turbojpeg),
                         timeout=300)
    assert run.returncode == 1 and not (tmp_path / "out").exists(), run.stderr
    assert "flipped.jpg: libjpeg-turbo: Corrupt JPEG data" in run.stderr
    assert "--strict refuses a source the decoder warned about" in run.stderr and "Traceback" not in run.stderr


def test_decoder_warnings_are_counted_shown_and_refused_by_strict(tmp_path: Path) -> None:
    src = damaged_folder(tmp_path / "src")
    out = tmp_path / "out"
    dsc.compile_folder(src, out, size=32, workers=1)
    ds = storage.open_dataset(out)
    assert ds.manifest.version == fmt.FORMAT_VERSION and ds.manifest.index_segments[0].warnings is not None
    counts = {ds.source(i): int(n) for i, n in enumerate(storage.read_warnings(out, ds.manifest))}
    assert counts["cat/no_eoi.jpg"] == 1 and counts["cat/whole.jpg"] == counts["dog/whole_too.jpg"] == 0
    assert counts["dog/flipped.jpg"] == 1  # libjpeg-turbo's warning, through jpeg4py or simplejpeg
    info = runner.invoke(app, ["info", str(out)])
    assert info.exit_code == 0, info.stderr
    assert "kept despite decoder warnings" in info.stdout and "cat/no_eoi.jpg: 1 warning(s)" in info.stdout
    warned = json.loads(runner.invoke(app, ["info", str(out), "--json"]).stdout)["warned"]
    assert {w["source"] for w in warned} == {s for s, n in counts.items() if n}
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0

    (src / "dog" / "cut.jpg").unlink()  # --strict: a skip would stop it first
    strict = runner.invoke(app, ["compile", str(src), str(tmp_path / "strict"), "--size", "32", "-j", "1",
                                 "--strict"])
    assert strict.exit_code == 1 and not (tmp_path / "strict").exists()
    assert "--strict refuses a source the decoder warned about" in strict.stderr
    assert "no end-of-image marker" in strict.stderr or "libjpeg-turbo" in strict.stderr
    assert "Traceback" not in strict.stderr


def test_a_dataset_without_warnings_writes_nothing_new(tmp_path: Path) -> None:
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "a.jpg").write_bytes(PHOTO.read_bytes())
    dsc.compile_folder(tmp_path / "src", tmp_path / "out", size=16, workers=1)
    manifest = storage.parse_manifest(tmp_path / "out")
    assert manifest.version == fmt.FORMAT_VERSION and manifest.index_segments[0].warnings is None
    assert not (tmp_path / "out" / fmt.WARNINGS_FILE).exists()
    assert "warnings" not in json.loads((tmp_path / "out" / fmt.MANIFEST_FILE).read_text())


def test_verify_refuses_a_skip_list_that_names_a_stored_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in ("cat/a.jpg", "cat/b.jpg", "dog/c.jpg"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(PHOTO.read_bytes())
    (src / "dog" / "empty.jpg").write_bytes(b"")
    out = tmp_path / "out"
    dsc.compile_folder(src, out, size=16, workers=1)
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0

    # Edit the dataset as a careless tool would, keeping it otherwise valid: the skip list also names
    # a stored source, and the manifest's entry (size, SHA-256, count, first lines) matches the new file.
    skipped = [*storage.read_skipped(out, storage.parse_manifest(out)),
               {"source": "cat/b.jpg", "reason": "not a recognised image file"}]
    payload = fmt.skip_list_payload(skipped)
    (out / fmt.SKIP_LIST_FILE).write_bytes(payload)
    doc = json.loads((out / fmt.MANIFEST_FILE).read_text())
    doc["skipped_list"].update(bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest(), count=len(skipped))
    doc["skipped"] = skipped[:fmt.SKIPPED_IN_MANIFEST]
    rewrite_manifest(out, doc)
    storage.open_dataset(out)  # still opens: only verify looks at both lists

    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1 and "ok:" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'cat/b.jpg' is listed as skipped" in lines[0] and "also stored as record" in lines[0]
    assert np.isin(["cat/b.jpg"], [storage.open_dataset(out).source(i) for i in range(3)]).all()


def test_a_skipped_source_is_found_among_the_stored_ones_by_whole_name() -> None:
    """`storage.stored_and_skipped` against a plain set, on names that are prefixes, suffixes and parts of
    each other (only a whole stored name counts) and of many lengths."""
    rng = np.random.default_rng(5)
    stored = [f"{'ab'[k % 2]}/{'x' * int(rng.integers(0, 6))}{k}.jpg" for k in range(3000)]
    blob = "".join(stored).encode()
    offsets = np.cumsum([0, *(len(s) for s in stored)]).astype(np.uint64)
    sources = np.frombuffer(blob, np.uint8)
    tricky = [s[1:] for s in stored[:50]] + ["x" + s for s in stored[:50]] + [s[:-1] for s in stored[:50]]
    assert storage.stored_and_skipped(sources, offsets, [{"source": s, "reason": "r"} for s in tricky]) is None
    for k in (0, 1234, 2999):
        said = storage.stored_and_skipped(sources, offsets, [{"source": s, "reason": "r"} for s in
                                                              [*tricky, stored[k]]])
        assert said == f"{stored[k]!r} is listed as skipped (r) but is also stored as record {k}"
