"""Zip archives holding an ImageFolder tree, read member by member from the central directory.

Discovery reads the central directory only. The tree inside follows the folder rules
(`dsc.compiler.discover`): class folders sorted by name are labels 0..K-1, images are found at any
depth below them, hidden names are ignored, images outside every class folder are skipped, and a
tree without class folders is unlabeled. A wrapping folder (`zip -r images.zip images/`: every
member under `images/`, no image directly in it) is looked through, and the `__MACOSX/` folder
the macOS archiver adds is ignored. A worker reads each member at its local header's offset and
inflates it with a bound: a member whose declared or actual size is larger than any image within
--max-pixels can need (a zip bomb) is refused before or while inflating, never held whole.
"""

from __future__ import annotations

import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from dsc.compiler.discover import is_image_name
from dsc.compiler.sources.common import Listing, Member, Sample, open_archive, read_at, too_large, unsafe_name
from dsc.errors import ImageError

LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra field length (30 bytes)
LOCAL_SIGNATURE = b"PK\x03\x04"
METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
NAME_ROOM = 1024  # what a local header's name and extra field usually take: read ahead with its member
MAC_METADATA = "__MACOSX"  # resource forks the macOS archiver adds: never images


def _ignored(name: str) -> bool:
    parts = name.rstrip("/").split("/")
    return parts[0] == MAC_METADATA or any(p.startswith(".") for p in parts)


def _wrapper(names: list[str]) -> str:
    """The prefix of folders that wrap the whole tree ("images/"), or ""."""
    prefix = ""
    while True:
        rest = [n[len(prefix):] for n in names]
        tops = {r.split("/")[0] for r in rest if r}
        files_at_top = [r for r in rest if r and "/" not in r.rstrip("/") and not r.endswith("/")]
        one_folder = len(tops) == 1 and not files_at_top
        images_in_it = any(r.count("/") == 1 and is_image_name(r.split("/")[1]) for r in rest)
        if not one_folder or images_in_it:
            return prefix
        prefix += tops.pop() + "/"


def _refusal(info: zipfile.ZipInfo) -> str | None:
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        return "not a regular file (a symbolic link)"
    if stat.S_IFMT(mode) and not stat.S_ISREG(mode):
        return "not a regular file (a device, pipe or socket)"
    if info.flag_bits & 0x1:
        return "encrypted member; not read"
    if info.compress_type not in METHODS:
        return f"compression method {info.compress_type} is not supported (only {', '.join(METHODS.values())})"
    return None


def list_archive(path: Path, label_key: str | None = None, image_column: str | None = None) -> Listing:
    """The images of the ImageFolder tree inside one zip (its central directory only)."""
    listing = Listing()
    try:
        with open_archive(path) as f, zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        listing.skipped.append(("", f"not a readable zip archive ({e})"))
        return listing
    listing.skipped += [(i.filename, unsafe_name(i.filename)) for i in infos  # before ".." reads as hidden
                        if unsafe_name(i.filename) and is_image_name(i.filename.rsplit("/", 1)[-1])]
    infos = [i for i in infos if not unsafe_name(i.filename) and not _ignored(i.filename)]
    prefix = _wrapper([i.filename for i in infos])
    tree = [(i, i.filename[len(prefix):]) for i in infos if i.filename.startswith(prefix)]
    folders = sorted({rel.split("/")[0] for _, rel in tree if "/" in rel})
    images = sorted(((i, rel) for i, rel in tree if not i.is_dir() and is_image_name(rel.rsplit("/", 1)[-1])),
                    key=lambda item: item[1].split("/"))  # depth-first, entries by name: the folder's order
    listing.names = folders or None
    for info, rel in images:
        why = _refusal(info) or ("not inside a class folder" if folders and "/" not in rel else None)
        if why is not None:
            listing.skipped.append((info.filename, why))
            continue
        member = Member(0, 0, info.header_offset, info.compress_size, (info.compress_type, info.file_size, info.CRC))
        listing.samples.append(Sample(info.filename, member, rel.split("/")[0] if folders else None))
    return listing


def find_member(path: Path, name: str) -> tuple[Member, tuple] | None:
    """The member called `name` (from the central directory), for re-reading one source."""
    try:
        with open_archive(path) as f, zipfile.ZipFile(f) as archive:
            info = next(i for i in archive.infolist() if i.filename == name)  # the first: getinfo gives the last
    except (StopIteration, zipfile.BadZipFile, ValueError, EOFError):
        return None
    if _refusal(info):
        return None
    return Member(0, 0, info.header_offset, info.compress_size, (info.compress_type, info.file_size, info.CRC)), ()


def _inflate(f, member: Member, max_bytes: int) -> bytes:
    method, size, crc = member.extra
    if size > max_bytes or member.size > max_bytes:
        raise too_large(max(size, member.size), max_bytes)
    header = read_at(f, LOCAL_HEADER.size, member.position)
    if len(header) != LOCAL_HEADER.size or header[:4] != LOCAL_SIGNATURE:
        raise ImageError("corrupt zip: no local file header where the central directory points")
    _, name_length, extra_length = LOCAL_HEADER.unpack(header)
    stored = read_at(f, member.size, member.position + LOCAL_HEADER.size + name_length + extra_length)
    if len(stored) != member.size:
        raise ImageError(f"truncated zip: {len(stored)} of the member's {member.size} stored bytes are in the file")
    if method == zipfile.ZIP_DEFLATED:
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            data = inflater.decompress(stored, max_bytes + 1)  # never more than the bound, whatever it claims
        except zlib.error as e:
            raise ImageError(f"corrupt zip member: cannot inflate ({e})") from e
        if len(data) > max_bytes:
            raise too_large(len(data), max_bytes)
    else:
        data = stored
    if len(data) != size or zlib.crc32(data) != crc:
        raise ImageError(f"corrupt zip member: {len(data)} bytes with CRC-32 {zlib.crc32(data):08x}, the directory "
                         f"says {size} bytes with {crc:08x}")
    return data


def read_members(path: str, members: list[Member], max_bytes: int, options: tuple = ()) -> Iterator[bytes | ImageError]:
    """Each member's bytes (inflated, checked against its CRC-32), in the order given."""
    last = max(members, key=lambda m: m.position)
    with open_archive(path, until=last.position + LOCAL_HEADER.size + NAME_ROOM + last.size) as f:
        for member in members:
            try:
                yield _inflate(f, member, max_bytes)
            except ImageError as e:
                yield e
