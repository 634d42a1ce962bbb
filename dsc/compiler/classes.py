"""Class vocabularies shared across splits: the one job of fixing which index each class name gets.

`load_classes` reads a vocabulary from names, a text file of names (one per line), or another
dsc dataset (`--classes-from out/train`), so that every split gives a class the same index,
whatever classes it happens to lack (a dataset's class and multilabel fields too, for a label
table: `reference_fields`); `sibling_class_mismatch` notices splits compiled apart that number a
shared class differently, in the label or in a field.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dsc import format as fmt
from dsc import storage
from dsc.errors import CompileError, DatasetError, quoted
from dsc.files import RefusedFile, TooLarge, read_regular

MAX_CLASSES_FILE_BYTES = 1 << 30  # a list of class names larger than this is another file given by mistake

CLASS_FILE_SUFFIXES = (".txt", ".csv", ".json", ".names")  # a --classes value ending so names a file
SHOW_UNION = 20  # a --classes hint lists at most this many names


def classes_option(value: str) -> Path | list[str]:
    """`--classes` (or `compile_folder(classes="a,b")`) as a path that exists, else comma-separated
    names; a value that looks like a file name must exist, or a typo would become one class."""
    if not value.strip():
        raise CompileError("the classes are empty (give names, a file of names or a dataset)")
    if _is(Path(value), Path.exists):
        return Path(value)
    if "," not in value and ("/" in value or Path(value).suffix.lower() in CLASS_FILE_SUFFIXES):
        raise CompileError(f"classes file {value} does not exist")
    return [name.strip() for name in value.split(",")]


def load_classes(value: str | os.PathLike | Sequence[str], fields_only: bool = False) -> list[str] | None:
    """A class vocabulary from names (a sequence, or text by `classes_option`), a text file (one name
    per line), or a dsc dataset folder. An unlabeled dataset has none to give: an error, unless
    `fields_only` (a label table's compile, which takes the dataset's field vocabularies), then None."""
    if isinstance(value, str):
        value = classes_option(value)
    if isinstance(value, os.PathLike) and Path(value).is_dir():
        try:
            manifest = storage.parse_manifest(value)
        except DatasetError as e:
            raise CompileError(f"cannot take classes from {value}: {e}") from e
        if not manifest.classes and not (fields_only and any(f.classes for f in manifest.fields)):
            raise CompileError(f"cannot take classes from {value}: that dataset is unlabeled")
        return list(manifest.classes) or None
    if isinstance(value, os.PathLike):
        path = Path(value)
        if not _is(path, Path.exists):
            raise CompileError(f"classes file {path} does not exist (give a file of class names, one per line, "
                               "or a dsc dataset folder)")
        try:  # a regular file of bounded size: not a FIFO (blocks), /dev/zero (endless) or a 20 GB tar by mistake
            text = read_regular(path, MAX_CLASSES_FILE_BYTES).decode("utf-8-sig")
        except TooLarge as e:
            raise CompileError(f"classes file {path} is {e.size} bytes, more than {MAX_CLASSES_FILE_BYTES >> 20} "
                               "MiB: not a file of class names") from None
        except RefusedFile as e:
            raise CompileError(f"classes file {path}: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CompileError(f"cannot read classes file {path}: {e}") from e
        names = [line.strip() for line in text.splitlines()]
        return check_classes([n for n in names if n], str(path))
    return check_classes(list(value), "classes")


def _is(path: Path, test: Callable[[Path], bool]) -> bool:
    """`test(path)`, False for a name that cannot be a path at all (too long: one long class name)."""
    try:
        return test(path)
    except OSError:
        return False


def reference_fields(value: Any) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The fields of the dataset `value` names, if it names one ({name: (kind, classes)}): a split
    compiled with `--classes-from` it gives its class and tag columns the same positions."""
    if not isinstance(value, (str, os.PathLike)) or not _is(Path(value), Path.is_dir):
        return {}
    return {f.name: (f.kind, f.classes) for f in storage.parse_manifest(value).fields}


def check_classes(names: list[Any], where: str) -> list[str]:
    if not names:
        raise CompileError(f"{where}: no class names")
    for name in names:
        if not isinstance(name, str) or not name or not name.isprintable():
            raise CompileError(f"{where}: class names must be non-empty printable text, found {quoted(name, 60)}")
    seen = set()
    for name in names:
        if name in seen:
            raise CompileError(f"{where}: class {name!r} is listed twice")
        seen.add(name)
    return names


def sibling_class_mismatch(out: Path, classes: list[str] | None,
                           fields: Sequence[tuple[str, str, Sequence[str]]] = ()) -> list[str]:
    """Messages for each dsc dataset beside OUT (out/val next to out/train) that gives a shared class
    another index: in the label (`classes`; None: not checked) or in a same-named class or multilabel
    field (`fields`: (name, kind, classes) each). Splits compiled apart would disagree silently. A
    split that only lacks or adds classes at the end numbers the rest alike, and is not flagged."""
    messages = []
    try:
        siblings = sorted(p for p in out.parent.iterdir() if p != out and (p / fmt.MANIFEST_FILE).is_file())
    except OSError:
        return []
    for sibling in siblings:
        try:
            manifest = storage.parse_manifest(sibling)
        except (DatasetError, OSError):
            continue
        if classes:
            messages.append(_moved(out, sibling, classes, list(manifest.classes)))
        theirs = {f.name: list(f.classes) for f in manifest.fields if f.classes}
        for name, kind, ours in fields:
            if name in theirs:
                messages.append(_moved(out, sibling, list(ours), theirs[name], (name, kind)))
    return [m for m in messages if m]


def _moved(out: Path, sibling: Path, classes: list[str], theirs: list[str],
           field: tuple[str, str] | None = None) -> str | None:
    """The message for a sibling whose vocabulary (of the label, or of `field`: name, kind) gives a
    class they share another index, else None."""
    position = {c: k for k, c in enumerate(theirs)}
    moved = [(c, i, position[c]) for i, c in enumerate(classes) if position.get(c, i) != i]
    if not moved:
        return None
    ours = set(classes)
    missing, extra = [c for c in theirs if c not in ours], [c for c in classes if c not in position]
    why = "; ".join(filter(None, [missing and f"{out.name} lacks {', '.join(missing[:5])}",
                                  extra and f"{out.name} adds {', '.join(extra[:5])}"])) or "their order differs"
    name, here, there = moved[0]
    more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
    if field is None:
        return (f"the classes of {out.name} differ from those of the dataset beside it, {sibling} ({why}): "
                f"{name!r} is label {here} here and {there} in {sibling}{more}; "
                f"{_renumber_hint(sibling, theirs, extra)}")
    column, kind = field
    noun = "position" if kind == "multilabel" else "index"
    fix = (f"to use {sibling.name}'s, compile with --classes-from {sibling}" if not extra else
           f"--classes-from {sibling} would refuse {', '.join(extra[:5])}: compile {sibling.name} from a table "
           f"that has them too, then this split with --classes-from {sibling}")
    return (f"the classes of field {column!r} of {out.name} differ from those of the dataset beside it, {sibling} "
            f"({why}): {name!r} is {noun} {here} here and {there} in {sibling}{more}; {fix}")


def _renumber_hint(sibling: Path, theirs: list[str], extra: list[str]) -> str:
    """How to give this split the sibling's indices: --classes-from it, unless this split has classes it
    lacks (that would be refused); then --classes with its classes followed by the extra ones."""
    if not extra:
        return f"to use {sibling.name}'s indices, compile with --classes-from {sibling}"
    union = theirs + extra
    if len(union) > SHOW_UNION:
        return (f"to keep {sibling.name}'s indices, compile with --classes FILE listing its {len(theirs)} classes "
                f"in order, then {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}")
    return f"to keep {sibling.name}'s indices, compile with --classes {','.join(union)}"
