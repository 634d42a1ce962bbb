"""Resume: what a partial build holds, so an interrupted compile continues where it stopped.

The staging folder (`.OUT.dsc-partial`) keeps four files beside the shards, removed before it
is published:

- `plan.json`: the options and a fingerprint of the source listing. A resume with other
  options or a changed SRC is refused: one dataset is never made of two plans.
- `sources.jsonl`: that listing, so the refusal can name the file that changed.
- `kept.bin`: the kept mask, written before compaction moves records down.
- `journal.jsonl`: one line per finished slot, appended by the main process after the worker
  wrote the record: `{"slot", "h", "w", "crc", "check"}`, with `"warnings": n` for a record the
  decoder warned about (`crc`: CRC-32 of the record bytes; `check`: CRC-32 of "slot:h:w:crc", then
  ":n" with warnings, so an edited size or count is caught too) or `{"slot", "reason"}`
  for a skipped source. A torn or unchecked line is ignored: that slot is decoded again.
  Lines are written unbuffered, so a failed write (a full disk) is never written twice.

Nothing in the journal is trusted blindly: on resume every reused record is read back and its
CRC compared, so records lost to a crash (unflushed pages, a half-done compaction or trim) are
simply decoded again. The result is byte-identical to an uninterrupted compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from collections.abc import Iterable
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np

from dsc import format as fmt
from dsc.compiler.discover import printable
from dsc.compiler.jobs import SlotResult, WriteJob
from dsc.compiler.shard_io import ShardFiles
from dsc.errors import CompileError
from dsc.storage import local

PLAN_FILE = "plan.json"
JOURNAL_FILE = "journal.jsonl"
LISTING_FILE = "sources.jsonl"  # the planned listing, to name what changed
KEPT_FILE = "kept.bin"  # the kept mask, written before compaction moves any record
STATE_FILES = (KEPT_FILE, JOURNAL_FILE, LISTING_FILE, PLAN_FILE)  # removed in this order, the plan last


def source_listing(sources: list[str], labels: np.ndarray, stamps: list[str], classes: list[str]) -> list[str]:
    """The ordered listing a plan is made from: one line per source with its label and its
    "size:mtime" stamp, as discovery's walk saw it (no second stat of every source)."""
    lines = [json.dumps(classes)]
    lines += [json.dumps([printable(source), label, stamp])
              for source, label, stamp in zip(sources, labels.tolist(), stamps)]
    return lines


def listing_digest(listing: list[str]) -> str:
    return hashlib.sha256("\n".join(listing).encode()).hexdigest()


def has_plan(stage: Path) -> bool:
    """Whether the partial build has a whole plan; one that is missing or torn proves nothing
    was built from it (the plan is written, atomically, before anything else)."""
    try:
        return isinstance(json.loads((stage / PLAN_FILE).read_bytes()), dict)
    except (OSError, ValueError):
        return False


def write_plan(stage: Path, plan: dict[str, Any], listing: list[str]) -> None:
    """State "building" begins: the listing first, then the plan (its presence marks the state)."""
    local.write_durably(stage / LISTING_FILE, ("\n".join(listing) + "\n").encode())
    local.write_durably(stage / PLAN_FILE, json.dumps(plan, indent=1, sort_keys=True).encode())


# Options added after plans were first written, with the value a plan without them was made with. A plan
# records them only when they differ (`without_defaults`), so partial builds begun earlier still resume.
PLAN_DEFAULTS = {"alpha": "black"}
ENVIRONMENT_KEYS = ("dsc_version", "decoder", "resize")  # what this machine's dsc is, not an option
INPUT_KEYS = ("sources", "count", "fields")  # fingerprints of the sources and the label table's values


def without_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """The options of PLAN_DEFAULTS that a plan records: those that differ from their default."""
    return {key: value for key, value in options.items() if value != PLAN_DEFAULTS[key]}


def check_plan(stage: Path, plan: dict[str, Any], listing: list[str]) -> None:
    """Refuse to resume a partial build made with other options or from another source listing."""
    saved = json.loads((stage / PLAN_FILE).read_bytes())

    def differ(keys) -> list[str]:
        was, now = {**PLAN_DEFAULTS, **saved}, {**PLAN_DEFAULTS, **plan}
        return [f"{key} {was.get(key)!r} (now {now.get(key)!r})" for key in keys if was.get(key) != now.get(key)
                and not (key == "records_per_shard" and saved.get("size") != plan["size"])]  # follows from --size
    options = differ(k for k in [*plan, *(k for k in saved if k not in plan)] if k not in ENVIRONMENT_KEYS + INPUT_KEYS)
    if options:
        raise CompileError(f"cannot resume {stage}: it was made with other settings: {'; '.join(options)}. Run it "
                           "with its own settings and --resume, or pass --force to start over")
    environment = differ(ENVIRONMENT_KEYS)
    if environment:
        raise CompileError(f"cannot resume {stage}: it was begun by another dsc or decoder ({'; '.join(environment)}), "
                           "and a resume would mix records made two ways; pass --force to start over")
    if saved.get("fields") != plan["fields"]:
        raise CompileError(f"cannot resume {stage}: the label table's values changed since it began, and a resume "
                           "would mix old and new values; pass --force to start over")
    if saved.get("sources") != plan["sources"]:
        raise CompileError(f"cannot resume {stage}: the sources changed since it began ({_changes(stage, listing)}), "
                           "and a resume would mix old and new files; pass --force to start over")


def _changes(stage: Path, listing: list[str]) -> str:
    """Name what was added, removed, modified or relabelled since the plan was made."""
    try:
        saved_lines = (stage / LISTING_FILE).read_text(encoding="utf-8").splitlines()
        if saved_lines[:1] != listing[:1]:  # the first line holds the classes
            return _class_changes(json.loads(saved_lines[0]), json.loads(listing[0]))
        saved, now = _by_name(saved_lines[1:]), _by_name(listing[1:])
    except (OSError, ValueError, TypeError, IndexError):
        return "the saved listing is unreadable"
    both = sorted(saved.keys() & now.keys())
    parts = [_some(sorted(now.keys() - saved.keys()), "added"), _some(sorted(saved.keys() - now.keys()), "removed"),
             _some([name for name in both if saved[name][0] != now[name][0]], "now in another class")]
    modified = [name for name in both if saved[name][1] != now[name][1]]
    if modified:
        parts.append(_some(modified, "modified") + _stamp_change(saved[modified[0]][1], now[modified[0]][1]))
    return "; ".join(filter(None, parts)) or "the same files in another order"


def _some(names: list[str], what: str) -> str:
    """'3 added, e.g. 'a.jpg'', or '' for none."""
    return f"{len(names)} {what}, e.g. {names[0]!r}" if names else ""


def _class_changes(before: list[str], now: list[str]) -> str:
    had, has = set(before), set(now)
    added, removed = [c for c in now if c not in had], [c for c in before if c not in has]
    parts = [f"{what} {', '.join(map(repr, names[:5]))}{', ...' if len(names) > 5 else ''}"
             for what, names in (("classes added:", added), ("classes removed:", removed)) if names]
    return "; ".join(parts) or "the classes are in another order"


def _by_name(lines: list[str]) -> dict[str, tuple]:
    """Listing lines ([source, label, stamp]) by source name."""
    return {entry[0]: tuple(entry[1:]) for entry in map(json.loads, lines)}


def _stamp_change(before: str, now: str) -> str:
    """A stamp ("size:mtime_ns" of a file, "size:ETag" of an object) change in words."""
    def words(stamp: str) -> str:
        if ":" not in stamp:
            return stamp
        size, mtime_ns = stamp.split(":", 1)
        if not mtime_ns.isdigit():  # an object's ETag
            return f"{int(size):,} bytes, ETag {mtime_ns}"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(mtime_ns) / 1e9))
        return f"{int(size):,} bytes, modified {when}"
    return f" ({words(before)} then, {words(now)} now)"


class Journal:
    """The append-only record of finished slots in one staging folder."""

    def __init__(self, stage: Path) -> None:
        self.path = stage / JOURNAL_FILE
        torn = False
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if torn:  # a line cut by a crash: end it, so that the next one is not glued onto it
            os.write(self._fd, b"\n")

    def append(self, results: Iterable[SlotResult]) -> None:
        lines = [json.dumps({"slot": r.slot, "reason": r.reason} if r.reason else
                            {"slot": r.slot, "h": r.height, "w": r.width, "crc": r.crc,
                             **({"warnings": r.warnings} if r.warnings else {}),
                             "check": _line_check(r.slot, r.height, r.width, r.crc, r.warnings)}) for r in results]
        payload = "".join(line + "\n" for line in lines).encode("utf-8")
        while payload:  # unbuffered: nothing is left behind to be written again by close()
            payload = payload[os.write(self._fd, payload):]

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _line_check(slot: int, height: int, width: int, crc: int, warnings: int = 0) -> int:
    return zlib.crc32(f"{slot}:{height}:{width}:{crc}{f':{warnings}' if warnings else ''}".encode())


def _parse(line: str, count: int) -> SlotResult | None:
    try:
        entry = json.loads(line)
        slot = entry["slot"]
        if not (isinstance(slot, int) and 0 <= slot < count):
            return None
        if "reason" in entry:
            return SlotResult(slot, reason=str(entry["reason"]))
        result = SlotResult(slot, int(entry["h"]), int(entry["w"]), crc=int(entry["crc"]),
                            warnings=int(entry.get("warnings", 0)))
        if entry["check"] != _line_check(slot, result.height, result.width, result.crc, result.warnings):
            return None
        return result
    except (ValueError, KeyError, TypeError):
        return None  # a torn or foreign line: that slot is simply done again


def write_kept(stage: Path, ok: np.ndarray) -> None:
    """Record which slots compaction keeps, so a resume can find records it moved down."""
    local.write_durably(stage / KEPT_FILE, np.packbits(ok).tobytes())


def _undo_compaction(stage: Path, job: WriteJob, done: dict[int, SlotResult]) -> None:
    """Move each journalled record that compaction moved down back to its slot (highest slot
    first: a record only ever moved down, so no later move reads a place already written)."""
    try:
        ok = np.unpackbits(np.frombuffer((stage / KEPT_FILE).read_bytes(), np.uint8))[:job.count].astype(bool)
    except FileNotFoundError:
        return
    if len(ok) != job.count:
        return
    position = np.cumsum(ok) - 1  # where compaction puts slot s (when ok[s])
    record_bytes = job.record_bytes
    with ShardFiles(stage, job.records_per_shard, record_bytes) as shards:  # two files open at a time
        for slot in sorted(done, reverse=True):
            at = int(position[slot])
            if not ok[slot] or at == slot or shards.crc(slot) == done[slot].crc:
                continue
            if shards.crc(at) == done[slot].crc:
                shards.move(at, slot, 1)
        shards.sync()
    (stage / KEPT_FILE).unlink()


def reusable(stage: Path, job: WriteJob) -> dict[int, SlotResult]:
    """Journalled records whose bytes still have the journalled CRC (found again where an
    interrupted compaction moved them). Skipped sources are tried again (they are few): what
    failed for a passing reason must not stay lost."""
    try:
        text = (stage / JOURNAL_FILE).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return {}
    done = {r.slot: r for r in (_parse(line, job.count) for line in text.splitlines()) if r is not None and r.ok}
    _undo_compaction(stage, job, done)
    shape = (job.target.height, job.target.width, fmt.CHANNELS)
    records = fmt.shard_records(job.count, job.records_per_shard)
    good = {}
    for shard, slots in groupby(sorted(done), key=lambda slot: fmt.locate(slot, job.records_per_shard)[0]):
        mapped = fmt.open_shard(stage / fmt.shard_file(shard), records[shard], shape)  # one map at a time
        good.update({s: done[s] for s in slots
                     if fmt.record_crc(mapped[fmt.locate(s, job.records_per_shard)[1]]) == done[s].crc})
        del mapped
    return good


def remove(stage: Path) -> None:
    """Drop the resume files before the staging folder becomes the dataset (the plan last:
    while it exists, the folder is a build in progress)."""
    for name in STATE_FILES:
        (stage / name).unlink(missing_ok=True)
