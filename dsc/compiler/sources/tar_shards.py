"""WebDataset tar shards: members grouped into samples by key, read by offset, never extracted.

Discovery walks the tar headers (`tarfile` seeks past each member's data) and reads only the
small label members; a sample is the consecutive members sharing a key (the name up to the first
dot of its basename, as webdataset groups them), its image the first of IMAGE_SUFFIXES present (else
the first member whose suffix ends in one, as `input.jpg`).
A worker then reads each image at the offset the header gave (`read_at`), in stored order.
A member whose data runs past the end of the file, a header that is damaged or missing before the
end-of-archive marker (a truncated shard) and a member that is not a regular file (a symbolic
link, a device) are skipped, named; the samples before them are kept.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

from dsc.compiler.sources.common import (
    IMAGE_SUFFIXES,
    MAX_LABEL_MEMBER_BYTES,
    Listing,
    Member,
    Sample,
    archive_size,
    open_archive,
    read_at,
    repeated,
    split_key,
    too_large,
    unsafe_name,
)
from dsc.errors import CompileError, ImageError, quoted

END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE  # two zero blocks end a tar


def parse_label_key(label_key: str | None) -> tuple[str, str | None] | None:
    """`--label-key` for tar: `cls` (an integer), `txt` (a class name), `json:FIELD` (either), or any
    member suffix with or without `:FIELD`; None: `.cls` where samples have one."""
    if label_key is None:
        return None
    suffix, _, name = label_key.partition(":")
    if not suffix or (label_key.count(":") and not name):
        raise CompileError(f"--label-key {label_key!r}: give a member suffix (cls, txt) or SUFFIX:FIELD (json:label)")
    return suffix.lower(), name or None


def _label(data: bytes, suffix: str, json_field: str | None) -> int | str:
    """A label member's value: an integer from `.cls`, a name from text, either from a JSON field."""
    text = data.decode("utf-8").strip()
    if json_field is not None:
        document = json.loads(text)
        value = document.get(json_field) if isinstance(document, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
            raise ValueError(f"field {json_field!r} is {quoted(value, 40)}, not an integer or a class name")
        return value
    if suffix == "cls":
        return int(text)
    if not text:
        raise ValueError("it is empty")
    return text


def _not_regular(info: tarfile.TarInfo) -> str:
    if info.issym() or info.islnk():
        return f"not a regular file (a {'symbolic' if info.issym() else 'hard'} link to {quoted(info.linkname, 80)})"
    return "not a regular file (a device, pipe or folder)"


def _group(members: list[tarfile.TarInfo],
           skipped: list[tuple[str, str]]) -> Iterator[tuple[str, dict[str, tarfile.TarInfo]]]:
    """Consecutive members of one key as (key, {suffix: member}); the first of a repeated suffix wins, the
    others are recorded in `skipped`."""
    key, group = None, {}
    for info in members:
        k, suffix = split_key(info.name)
        if k != key and group:
            yield key, group
            group = {}
        key = k
        if suffix in group:
            skipped.append((repeated(info.name, 2), f"sample {quoted(k, 80)} already has a .{suffix} member (the first "
                            "is kept)"))
            continue
        group[suffix] = info
    if group:
        yield key, group


HEADER = 512
PLAIN_TYPES = frozenset(b"01234567\0")  # files, links, devices, FIFOs, folders: nothing that changes the next header
PAX_KEYS = {"path", "linkpath", "size", "mtime", "atime", "ctime", "uid", "gid", "uname", "gname", "comment"}


def _pax(raw: bytes) -> dict[str, str] | None:
    """A pax header's records ("LEN KEY=VALUE\n"), or None for any the quick walk does not know."""
    records, pos = {}, 0
    while pos < len(raw):
        space = raw.index(b" ", pos)
        length = int(raw[pos:space])
        key, _, value = raw[space + 1:pos + length - 1].partition(b"=")
        if length < 5 or raw[pos + length - 1:pos + length] != b"\n" or key.decode() not in PAX_KEYS:
            return None
        records[key.decode()] = value.decode("utf-8")
        pos += length
    return records


def _quick_walk(f) -> tuple[list[tarfile.TarInfo], int] | None:
    """(every member, where the end-of-archive marker must be) of a plain ustar or pax archive, as `tarfile`
    lists them at a fifth of its cost (its per-header Python work was most of a tar compile's discovery);
    None for anything else — GNU long names, global or sparse headers, a damaged or cut header — which
    `tarfile` then walks."""
    members, offset, pax = [], 0, None
    try:
        while True:
            f.seek(offset)
            block = f.read(HEADER)
            if len(block) < HEADER:
                return None
            if not block.strip(b"\0"):
                return members, offset
            if int(block[148:156].strip(b" \0"), 8) != sum(block[:148]) + 256 + sum(block[156:]):
                return None
            kind, size_field = block[156], block[124:136]
            if size_field[0] & 0x80:  # base-256 sizes: tarfile's
                return None
            size = int(size_field.strip(b" \0") or b"0", 8)
            name = block[:100].split(b"\0", 1)[0]
            if block[257:263] == b"ustar\0" and block[345] != 0:
                name = block[345:500].split(b"\0", 1)[0] + b"/" + name
            data = offset + HEADER
            offset = data + -(-size // HEADER) * HEADER
            if kind == ord("x"):
                if pax is not None:
                    return None
                f.seek(data)
                raw = f.read(size)
                pax = _pax(raw) if len(raw) == size else None
                if pax is None:
                    return None
                continue
            if kind not in PLAIN_TYPES:
                return None
            info = tarfile.TarInfo((pax or {}).get("path") or name.decode(tarfile.ENCODING, "surrogateescape"))
            info.type = bytes([kind])
            info.linkname = (pax or {}).get("linkpath") or block[157:257].split(b"\0", 1)[0].decode(
                tarfile.ENCODING, "surrogateescape")
            info.size = int((pax or {}).get("size", size))
            info.offset, info.offset_data = data - HEADER, data
            if info.type == tarfile.AREGTYPE and info.name.endswith("/") or info.isdir():
                info.type, info.name = tarfile.DIRTYPE, info.name.rstrip("/")
            if (pax or {}).get("size") is not None and int(pax["size"]) != size:
                offset = data + -(-info.size // HEADER) * HEADER
            members.append(info)
            pax = None
    except (ValueError, UnicodeDecodeError):
        return None


def _walk(f, size: int) -> tuple[list[tarfile.TarInfo], str | None]:
    """Every member header, and why the walk stopped early (a damaged or truncated archive), or None."""
    quick = _quick_walk(f)
    if quick is not None:
        members, end = quick
        f.seek(end)
        marker = f.read(END_OF_ARCHIVE)
        if len(marker) == END_OF_ARCHIVE and not marker.strip(b"\0"):
            return members, None
    f.seek(0)  # anything unusual: tarfile's walk and its words for what is wrong
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.TarError as e:
        return [], f"not a readable uncompressed tar ({e})"
    members = []
    try:
        while (info := tar.next()) is not None:
            members.append(info)
    except tarfile.TarError as e:
        return members, f"truncated or damaged tar after {len(members)} members ({e})"
    end = tar.offset  # where the end-of-archive marker must be
    f.seek(end)
    marker = f.read(END_OF_ARCHIVE)
    if len(marker) < END_OF_ARCHIVE or marker.strip(b"\0"):
        return members, (f"truncated or damaged tar: no valid header or end-of-archive marker at byte {end} of "
                         f"{size}; the {len(members)} members before it were read")
    return members, None


def list_archive(path: Path, label_key: str | None = None, image_column: str | None = None,
                 fields: tuple[str, ...] = ()) -> Listing:
    """The samples of one shard (headers, label members and the members `fields` names only)."""
    key_spec = parse_label_key(label_key)
    listing = Listing()
    with open_archive(path) as f:
        size = archive_size(f)
        members, broken = _walk(f, size)
        for key, group in _group(members, listing.skipped):
            sample = _sample(f, size, key, group, key_spec, listing.skipped)
            if sample is not None and _field_values(f, sample, group, fields, listing.skipped):
                listing.samples.append(sample)
    if broken:
        listing.skipped.append(("", broken))
    return listing


def _sample(f, size: int, key: str, group: dict[str, tarfile.TarInfo], key_spec: tuple[str, str | None] | None,
            skipped: list[tuple[str, str]]) -> Sample | None:
    """One sample from its members, or None (recorded in `skipped`)."""
    suffix = next((s for s in IMAGE_SUFFIXES if s in group), None) or next(  # else "key.input.jpg"
        (s for s in group if s.rpartition(".")[2] in IMAGE_SUFFIXES), None)
    if suffix is None:
        skipped.append((key, f"no image member (looked for .{', .'.join(IMAGE_SUFFIXES[:4])}, ...)"))
        return None
    info = group[suffix]
    why = unsafe_name(info.name) or (None if info.isreg() else _not_regular(info))
    if why is None and info.offset_data + info.size > size:
        why = (f"truncated tar: the member's data ends at byte {info.offset_data + info.size}, past the end "
               f"of the file ({size} bytes)")
    if why is not None:
        skipped.append((info.name, why))
        return None
    member = Member(0, 0, info.offset_data, info.size)
    label_suffix, json_field = key_spec or ("cls", None)
    label_info = group.get(label_suffix)
    if label_info is None:
        return Sample(info.name, member, None)
    try:
        label = _label(_small_member(f, label_info), label_suffix, json_field)
    except ValueError as e:  # UnicodeDecodeError and json's errors are ValueErrors
        skipped.append((info.name, f"unreadable label member {quoted(label_info.name, 80)}: {e}"))
        return None
    return Sample(info.name, member, label)


def _small_member(f, info: tarfile.TarInfo) -> bytes:
    """A label or field member's bytes; ValueError when it is no regular file, too large or truncated."""
    if not info.isreg() or info.size > MAX_LABEL_MEMBER_BYTES:
        raise ValueError("not a regular file" if not info.isreg() else f"{info.size} bytes")
    data = read_at(f, info.size, info.offset_data)
    if len(data) != info.size:
        raise ValueError("the tar is truncated inside it")
    return data


def _field_values(f, sample: Sample, group: dict[str, tarfile.TarInfo], fields: tuple[str, ...],
                  skipped: list[tuple[str, str]]) -> bool:
    """Fill `sample.values` from the members `fields` names (`txt`: the text of KEY.txt; `json:FIELD`:
    that field of KEY.json), "" where the sample has none (refused by the field's kind as an empty
    table cell is); False (recorded in `skipped`) when such a member cannot be read."""
    for spec in fields:
        suffix, _, json_field = spec.partition(":")
        info = group.get(suffix)
        try:
            text = "" if info is None else _small_member(f, info).decode("utf-8").strip()
            if json_field and text:
                document = json.loads(text)
                value = document.get(json_field) if isinstance(document, dict) else None
                sample.values[spec] = "" if value is None else value
            else:
                sample.values[spec] = text
        except ValueError as e:  # UnicodeDecodeError and json's errors are ValueErrors
            skipped.append((sample.name, f"unreadable member {quoted(info.name, 80)} (--column {spec}): {e}"))
            return False
    return True


def find_member(path: Path, name: str) -> tuple[Member, tuple] | None:
    """The regular member called `name` (headers walked up to it), for re-reading one source."""
    with open_archive(path) as f:
        members, _ = _walk(f, archive_size(f))
    info = next((m for m in members if m.name == name and m.isreg()), None)
    return None if info is None else (Member(0, 0, info.offset_data, info.size), ())


def read_members(path: str, members: list[Member], max_bytes: int, options: tuple = ()) -> Iterator[bytes | ImageError]:
    """Each member's bytes, in the order given (the stored order: a sequential read)."""
    with open_archive(path, until=max(m.position + m.size for m in members)) as f:
        for member in members:
            if member.size > max_bytes:
                yield too_large(member.size, max_bytes)
                continue
            data = read_at(f, member.size, member.position)
            yield data if len(data) == member.size else ImageError(
                f"truncated tar: {len(data)} of the member's {member.size} bytes are in the file")
