"""Resume: what a partial build holds, so an interrupted compile continues where it stopped.

The staging folder (`.OUT.dsc-partial`) keeps two files beside the shards, removed before it
is published:

- `plan.json`: the options and a fingerprint of the source listing. A resume with other
  options or a changed SRC is refused: one dataset is never made of two plans.
- `journal.jsonl`: one line per finished slot, appended by the main process after the worker
  wrote the record: `{"slot", "h", "w", "crc"}` (CRC-32 of the record bytes) or
  `{"slot", "reason"}` for a skipped source. A torn last line is ignored.

Nothing in the journal is trusted blindly: on resume every reused record is read back and its
CRC compared, so records lost to a crash (unflushed pages, a half-done compaction or trim) are
simply decoded again. The result is byte-identical to an uninterrupted compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Iterable
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np

from dsc import format as fmt
from dsc.compiler.write import SlotResult, WriteJob
from dsc.errors import CompileError

PLAN_FILE = "plan.json"
JOURNAL_FILE = "journal.jsonl"


def source_fingerprint(src: Path, sources: list[str], labels: np.ndarray, classes: list[str]) -> str:
    """SHA-256 over the ordered listing: path, label, size and mtime of every source."""
    digest = hashlib.sha256(json.dumps(classes).encode())
    for source, label in zip(sources, labels.tolist()):
        try:
            st = os.stat(src / source)
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            stamp = "missing"
        digest.update(os.fsencode(source) + f"\0{label}\0{stamp}\n".encode())
    return digest.hexdigest()


def write_plan(stage: Path, plan: dict[str, Any]) -> None:
    fmt.write_durably(stage / PLAN_FILE, json.dumps(plan, indent=1, sort_keys=True).encode())


def check_plan(stage: Path, plan: dict[str, Any]) -> None:
    """Refuse to resume a partial build made with other options or from another source listing."""
    try:
        saved = json.loads((stage / PLAN_FILE).read_bytes())
    except (OSError, ValueError) as e:
        raise CompileError(f"the partial build at {stage} has no readable {PLAN_FILE} ({e}); "
                           "delete it, or pass --force to discard it") from e
    if not isinstance(saved, dict):
        saved = {}
    changed = [f"{key} {saved.get(key)!r} (now {plan[key]!r})" for key in plan
               if key != "sources" and saved.get(key) != plan[key]]
    if saved.get("sources") != plan["sources"]:
        changed.append("the source listing (files added, removed, renamed or modified)")
    if changed:
        raise CompileError(f"cannot resume {stage}: it was made with other settings: {'; '.join(changed)}. "
                           "Run the original command, or pass --force to start over")


class Journal:
    """The append-only record of finished slots in one staging folder."""

    def __init__(self, stage: Path) -> None:
        self.path = stage / JOURNAL_FILE
        torn = False
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._file = open(self.path, "a", encoding="utf-8")
        if torn:  # a line cut by a crash: end it, so that the next one is not glued onto it
            self._file.write("\n")

    def append(self, results: Iterable[SlotResult]) -> None:
        lines = [json.dumps({"slot": r.slot, "reason": r.reason} if r.reason else
                            {"slot": r.slot, "h": r.height, "w": r.width, "crc": r.crc}) for r in results]
        self._file.write("".join(line + "\n" for line in lines))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _parse(line: str, count: int) -> SlotResult | None:
    try:
        entry = json.loads(line)
        slot = entry["slot"]
        if not (isinstance(slot, int) and 0 <= slot < count):
            return None
        if "reason" in entry:
            return SlotResult(slot, reason=str(entry["reason"]))
        return SlotResult(slot, int(entry["h"]), int(entry["w"]), crc=int(entry["crc"]))
    except (ValueError, KeyError, TypeError):
        return None  # a torn or foreign line: that slot is simply done again


def reusable(stage: Path, job: WriteJob) -> dict[int, SlotResult]:
    """Journalled records whose bytes still have the journalled CRC. Skipped sources are tried
    again (they are few): what failed for a passing reason must not stay lost."""
    try:
        text = (stage / JOURNAL_FILE).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return {}
    done = {r.slot: r for r in (_parse(line, job.count) for line in text.splitlines()) if r is not None and r.ok}
    shape = (job.target.height, job.target.width, fmt.CHANNELS)
    records = fmt.shard_records(job.count, job.records_per_shard)
    good = {}
    for shard, slots in groupby(sorted(done), key=lambda slot: fmt.locate(slot, job.records_per_shard)[0]):
        mapped = fmt.open_shard(stage / fmt.shard_file(shard), records[shard], shape)  # one map at a time
        good.update({s: done[s] for s in slots
                     if zlib.crc32(mapped[fmt.locate(s, job.records_per_shard)[1]]) == done[s].crc})
        del mapped
    return good


def remove(stage: Path) -> None:
    """Drop the resume files before the staging folder becomes the dataset."""
    for name in (PLAN_FILE, JOURNAL_FILE):
        (stage / name).unlink(missing_ok=True)
