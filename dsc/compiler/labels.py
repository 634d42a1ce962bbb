"""Labels beyond folder names: label tables (class vocabularies are `classes.py`).

`discover_listed` ends in what `discover` gives the compiler (sources, their labels, fields):
a label table (`--labels labels.csv` or `.jsonl`) names the images to compile (paths relative
to SRC, or absolute inside it) and their values, one row each. Its `label` column (a class)
becomes the dataset's label; every other column becomes a typed per-record field (format 1.1),
of a kind inferred from its values or given (`--column NAME:KIND`):

  ========== ================================== =============================================
  kind       values                             stored as
  ========== ================================== =============================================
  class      a class name                       int64 index into the field's classes
  multilabel ``;``-separated class names        uint8 multi-hot [K] over the field's classes
  float      one or more numbers (``;``)        float32 [] or [k]
  int        one or more integers (``;``)       int64 [] or [k]
  ========== ================================== =============================================

An integer `label` column is stored as given (-1: no label), its classes named "0".."max";
`--column label:class` reads it as class names instead, `--column label:none` says that a table
without a `label` column is unlabeled on purpose.

Every problem in a table (a duplicate path, a path leaving SRC, a malformed row, a bad number, a
key given twice, a header row that is data) is a CompileError naming the file, line and column:
a label is never silently shifted.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import logging
import math
import os
import posixpath
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsc import format as fmt
from dsc.arguments import is_int
from dsc.compiler.discover import Discovery, Tree, check_source_folder, folder_tree, is_image_name
from dsc.errors import CompileError, quoted
from dsc.files import RefusedFile, TooLarge, read_regular

KINDS = tuple(fmt.FIELD_DTYPES)
LABEL_COLUMN = "label"  # the table column that becomes the dataset's label (labels.bin, `classes`)
SEPARATOR = ";"  # between the values of one cell: tags, or the numbers of a vector
MAX_TABLE_BYTES = 1 << 30
JSONL_SUFFIXES = (".jsonl", ".ndjson")  # a label table is JSON Lines by its suffix, else CSV
NO_LABEL = "none"  # `--column label:none`: a table without a label column is unlabeled on purpose
MAX_INTEGER_LABEL = (1 << 20) - 1  # an integer label column's classes are "0".."max": a bounded list
JOINED = ("|", ";", ",")  # in most values of a class column, they suggest several classes per cell

logger = logging.getLogger("dsc")


# ----------------------------------------------------------------------------- label tables

@dataclass
class Table:
    """A label table as read: source paths, and per column its name and one raw value per row."""

    path: Path | str  # a table's file; for an archive's columns, SRC as given (an s3:// URL is no Path)
    sources: list[str]
    lines: list[int]  # the file's line number of each row, for messages
    columns: dict[str, list[Any]]
    path_column: str = "path"  # the header's name of the image path column
    by_source: bool = False  # messages name a row by its source (an archive's samples), not by a line


def _row(table: Table, line: int) -> str:
    """A row as messages name it: its line, or for an archive's samples its source."""
    return f"sample {table.sources[table.lines.index(line)]}" if table.by_source else f"line {line}"


def _problem(table: Table | Path, line: int, what: str, column: str | None = None) -> CompileError:
    where = f"{table.path}, {_row(table, line)}" if isinstance(table, Table) else f"{table}, line {line}"
    return CompileError(where + (f", column {column!r}" if column else "") + f": {what}")


def _clean_source(table_path: Path, line: int, value: Any, roots: tuple[Path, ...] = ()) -> str:
    """A table path as a relative, '/'-separated path that stays inside SRC. An absolute path inside
    SRC (any of its spellings in `roots`) is made relative to it: both spellings of an image are one source."""
    if not isinstance(value, str) or not value.strip():
        raise _problem(table_path, line, f"the image path must be non-empty text, found {quoted(value, 60)}")
    path = value.strip()
    normal = posixpath.normpath(path)
    if path.startswith("/"):
        for base in roots:
            if Path(normal).is_relative_to(base):
                path = normal = Path(normal).relative_to(base).as_posix()
                break
    if path.startswith("/") or normal == ".." or normal.startswith("../") or "\0" in path:
        raise _problem(table_path, line, f"image path {quoted(value, 240)} leaves the source folder (give paths "
                                         "relative to SRC, without '..')")
    return normal


def read_table(path: str | os.PathLike, root: str | os.PathLike | None = None) -> Table:
    """Read a CSV (header row; the first column is the image path) or JSONL (one object per line
    with a "path" key) label table; a malformed row is a CompileError naming its line. Absolute
    paths inside `root` (SRC) are taken relative to it."""
    path = Path(path)
    roots = () if root is None else (Path(os.path.abspath(root)), Path(root).resolve())  # as given; links resolved
    if _is_dir(path):
        raise CompileError(f"{path} is a folder; --labels takes a CSV or JSONL file")
    if path.suffix.lower() == ".json":  # read as CSV, a JSON document would fail at its first '"'
        raise CompileError(f"{path}: only CSV (.csv, header row) and JSON Lines (.jsonl, one object per line) label "
                           "tables are read, not a .json document")
    try:
        text = read_regular(path, MAX_TABLE_BYTES).decode("utf-8-sig")
    except TooLarge:
        raise CompileError(f"{path}: larger than {MAX_TABLE_BYTES >> 20} MiB; not a label table") from None
    except FileNotFoundError:
        raise CompileError(f"label table {path} does not exist") from None
    except (OSError, UnicodeDecodeError, RefusedFile) as e:
        raise CompileError(f"cannot read label table {path}: {e}") from e
    jsonl = path.suffix.lower() in JSONL_SUFFIXES
    path_column, header, body = ("path", *_read_jsonl(path, text)) if jsonl else _read_csv(path, text, roots)
    sources, lines, seen = [], [], {}
    columns: dict[str, list[Any]] = {name: [] for name in header}
    for line, source, values in body:
        source = _clean_source(path, line, source, roots)
        if source in seen:
            raise _problem(path, line, f"image {source!r} is listed twice (first on line {seen[source]})")
        seen[source] = line
        sources.append(source)
        lines.append(line)
        for name, value in zip(header, values):
            columns[name].append(value)
    if not sources:
        raise CompileError(f"{path}: no rows; a label table lists one image per row")
    return Table(path, sources, lines, columns, path_column)


def _read_csv(path: Path, text: str, roots: tuple[Path, ...] = ()) -> tuple[str, list[str],
                                                                            list[tuple[int, Any, list[Any]]]]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)  # not str.splitlines: U+2028 is no line end
    try:
        header = next(reader, None)
        if not header or len(header) < 1:
            raise CompileError(f"{path}: empty; a CSV label table starts with a header row (path, then columns)")
        _check_header_is_names(path, header, roots)
        names = [h.strip() for h in header[1:]]
        _check_column_names(path, names)
        body = []
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # a blank line
            if len(row) != len(header):
                raise _problem(path, reader.line_num, f"{len(row)} values, but the header has {len(header)}")
            body.append((reader.line_num, row[0], [v.strip() for v in row[1:]]))
    except csv.Error as e:
        raise _problem(path, reader.line_num, f"malformed CSV ({e})") from e
    return header[0].strip(), names, body


def _check_header_is_names(path: Path, header: list[str], roots: tuple[Path, ...]) -> None:
    """A CSV whose first row is data (no header row) would lose its first image and, lacking a
    `label` column, label the rest -1: a header cell that is a number or an image path refuses it."""
    for cell in (h.strip() for h in header):
        if _is_number(cell):
            what = "a number"
        elif is_image_name(posixpath.basename(cell)) or (roots and _is_file(roots[0] / cell)):
            what = "an image path"
        else:
            continue
        raise _problem(path, 1, f"the header cell {quoted(cell, 80)} is {what}, so the table seems to have no header "
                       "row; add one as its first line (e.g. 'path,label': the image path column, then names)")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long: reading it says so
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long, or holding NUL
        return False


class _RepeatedKey(ValueError):
    """A JSON object that gives one key twice (json.loads would keep the last value silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen[key] = value
    return seen


def _read_jsonl(path: Path, text: str) -> tuple[list[str], list[tuple[int, Any, list[Any]]]]:
    names: list[str] | None = None
    body = []
    for line, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw, object_pairs_hook=_unique_keys)
        except _RepeatedKey as e:
            raise _problem(path, line, f"key {quoted(e.key, 80)} is given twice in one object; keep one") from None
        except ValueError as e:
            raise _problem(path, line, f"not valid JSON ({e})") from e
        if not isinstance(row, dict) or "path" not in row:
            raise _problem(path, line, 'each line must be a JSON object with a "path" key')
        keys = [k for k in row if k != "path"]
        if names is None:
            names = keys
            _check_column_names(path, names)
        elif set(keys) != set(names):
            differ = sorted(set(keys) ^ set(names))
            raise _problem(path, line, f"keys differ from the first line's: {', '.join(map(repr, differ))}")
        body.append((line, row["path"], [row[k] for k in names]))
    return names or [], body


def _check_column_names(path: Path, names: list[str]) -> None:
    for name in names:
        if name == LABEL_COLUMN:
            continue
        problem = fmt.field_name_problem(name)
        if problem:
            raise CompileError(f"{path}: column {problem}; rename the column")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CompileError(f"{path}: column(s) {', '.join(map(repr, duplicates))} appear twice in the header")


def parse_column_kinds(specs: Sequence[str]) -> dict[str, str]:
    """`--column NAME:KIND` options as {name: kind}; `label:none` says the table has no label column."""
    kinds = {}
    for spec in specs:
        name, sep, kind = spec.rpartition(":")
        if not sep or not name or (kind not in KINDS and (name, kind) != (LABEL_COLUMN, NO_LABEL)):
            raise CompileError(f"--column {spec!r}: expected NAME:KIND with KIND one of {', '.join(KINDS)} (or "
                               f"{LABEL_COLUMN}:{NO_LABEL} for a table without labels)")
        kinds[name] = kind
    return kinds


# ----------------------------------------------------------------------------- column kinds and values

def _items(value: Any) -> list[Any]:
    """The values of one cell: a JSON list as is, text split at ';' (empty parts dropped)."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        return [part.strip() for part in value.split(SEPARATOR) if part.strip()]
    return [value]


INT_TEXT = re.compile(r"[+-]?[0-9]+")
NUMBER_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")  # no nan, inf, 1_000, ٣


def _integer_like(value: Any) -> bool:
    """An integer, or text that spells one (a table cell)."""
    return is_int(value) or isinstance(value, str) and INT_TEXT.fullmatch(value.strip()) is not None


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, str) and NUMBER_TEXT.fullmatch(value.strip()) is not None


def infer_kind(table: Table, name: str) -> str:
    """The kind a column's values suggest (`--column NAME:KIND` overrides it): integers are int
    (in the label column, class indices stored as given), other numbers float, a list or ';' or an empty cell marks
    multilabel tags, and any other text is a class name. A column of numbers with a cell that is
    not one (NA, a typo) is refused, naming the cell: read as names, it would be silently wrong."""
    values = table.columns[name]
    multi = any(isinstance(v, list) or (isinstance(v, str) and SEPARATOR in v) for v in values)
    items = [(line, item) for line, v in zip(table.lines, values) for item in _items(v)]
    numbers = [_is_number(item) for _, item in items]
    if items and all(numbers):
        if all(_integer_like(i) for _, i in items):
            return "class" if name == LABEL_COLUMN and not multi else "int"
        return "float"
    if any(numbers):
        line, item = items[numbers.index(False)]
        raise _problem(table, line, f"{quoted(item, 40)} is not a number, but the column's other values are; fix "
                       f"the cell, or give --column {name}:class (or multilabel) to read the values as names", name)
    if multi or any(isinstance(v, str) and not v.strip() for v in values):
        return "multilabel"
    return "class"


def _class_name(value: Any) -> str | None:
    """A cell as a class name; integers as their plain decimal form ("01" is class "1")."""
    if is_int(value):
        return str(value)
    if isinstance(value, str) and value.strip():
        return str(int(value)) if _integer_like(value) else value.strip()
    return None


def _vocabulary(names: set[str]) -> list[str]:
    """Sorted names. Integer classes 0..K-1 keep their numbers as indices: the vocabulary is every
    integer from 0 to the largest, so a class missing from one split moves no other."""
    if names and all(_integer_like(n) for n in names):
        numbers = [int(n) for n in names]
        if min(numbers) >= 0 and max(numbers) < fmt.MAX_FIELD_VALUES:
            return [str(k) for k in range(max(numbers) + 1)]
        return sorted(names, key=int)
    return sorted(names)


def _numbers(table: Table, name: str, kind: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """A float or int column as [n] (one value per row) or [n, k]."""
    rows = []
    for line, value in zip(table.lines, table.columns[name]):
        items = _items(value)
        numbers = []
        for item in items:
            try:
                if kind == "int":
                    if not _integer_like(item):
                        raise ValueError
                    number = int(item)
                    if not -(1 << 63) <= number < (1 << 63):
                        raise ValueError
                else:
                    if not _is_number(item):
                        raise ValueError
                    number = float(item)
                    if not math.isfinite(number) or abs(number) > float(np.finfo(np.float32).max):
                        raise ValueError
            except (ValueError, OverflowError):
                raise _problem(table, line, f"{quoted(item, 40)} is not a{'n integer' if kind == 'int' else ' finite'}"
                               f" number{' in float32 range' if kind == 'float' else ''}", name) from None
            numbers.append(number)
        if not numbers:
            raise _problem(table, line, "no value", name)
        if rows and len(numbers) != len(rows[0]):
            raise _problem(table, line, f"{len(numbers)} values, but {_row(table, table.lines[0])} has {len(rows[0])}",
                           name)
        rows.append(numbers)
    array = np.asarray(rows, dtype=fmt.FIELD_DTYPES[kind])
    return (array[:, 0], ()) if array.shape[1] == 1 else (array, (array.shape[1],))


def _class_indices(table: Table, name: str, classes: Sequence[str] | None) -> tuple[np.ndarray, list[str], list[int]]:
    """A class column as indices over `classes` (or over its own sorted names); rows whose class is
    not in a given vocabulary are returned apart (their positions), for the caller to refuse or skip."""
    names = []
    for line, value in zip(table.lines, table.columns[name]):
        class_name = _class_name(value)
        if class_name is None:
            raise _problem(table, line, f"a class name or integer is needed, found {quoted(value, 40)}", name)
        names.append(class_name)
    vocabulary = list(classes) if classes is not None else _vocabulary(set(names))
    index = {c: i for i, c in enumerate(vocabulary)}
    unknown = [row for row, n in enumerate(names) if n not in index]
    return np.asarray([index.get(n, -1) for n in names], dtype=np.int64), vocabulary, unknown


def _multi_hot(table: Table, name: str, classes: Sequence[str] | None = None) -> tuple[np.ndarray, list[str]]:
    tags = []
    for line, value in zip(table.lines, table.columns[name]):
        items = _items(value)
        if not all(isinstance(i, str) and i.strip() for i in items):
            raise _problem(table, line, f"tags must be text, found {quoted(value, 60)}", name)
        tags.append({i.strip() for i in items})
    vocabulary = list(classes) if classes is not None else sorted(set().union(*tags))
    if not vocabulary:
        raise CompileError(f"{table.path}: column {name!r} has no tags in any row")
    index = {c: i for i, c in enumerate(vocabulary)}
    for line, names in zip(table.lines, tags):
        unknown = sorted(names - set(index))
        if unknown:
            raise _problem(table, line, f"tag {unknown[0]!r} is not among the {len(vocabulary)} tags of the "
                           "dataset the classes come from", name)
    hot = np.zeros((len(tags), len(vocabulary)), dtype=np.uint8)
    for row, names in enumerate(tags):
        hot[row, [index[n] for n in names]] = 1
    return hot, vocabulary


def _integer_labels(table: Table, classes: Sequence[str] | None) -> tuple[np.ndarray, list[str], list[int]]:
    """An integer label column as given: label v is stored as v, -1 for a record without a label, and
    the classes are named "0".."max" (or are `classes`, which must be such names), so label v is
    classes[v]. A value that cannot be stored so is refused: renumbered, it would be another class."""
    values = []
    for line, cell in zip(table.lines, table.columns[LABEL_COLUMN]):
        value = int(cell)  # an int, or text spelling one ("01" is 1)
        if value < fmt.UNLABELED:
            raise _problem(table, line, f"label {value} is below {fmt.UNLABELED}: integer labels are stored as "
                           f"given, {fmt.UNLABELED} marking a record without a label; fix the cell, or give --column "
                           f"{LABEL_COLUMN}:class to read the labels as class names", LABEL_COLUMN)
        if value > MAX_INTEGER_LABEL:
            raise _problem(table, line, f"label {value} is above {MAX_INTEGER_LABEL}, the largest integer label "
                           "stored as given (its classes are named 0 to the largest); map the labels to 0..K-1, or "
                           f"give --column {LABEL_COLUMN}:class to read them as class names", LABEL_COLUMN)
        values.append(value)
    if classes is not None and list(classes) != [str(k) for k in range(len(classes))]:
        raise CompileError(f"{table.path}: column {LABEL_COLUMN!r} holds integers, stored as given, but the given "
                           f"classes are not named 0 to {len(classes) - 1} (they start {', '.join(classes[:3])}); "
                           f"give --column {LABEL_COLUMN}:class to look the labels up as names among them")
    vocabulary = list(classes) if classes is not None else [str(k) for k in range(max(values) + 1)]
    unknown = [row for row, value in enumerate(values) if value >= len(vocabulary)]
    return np.asarray(values, dtype=np.int64), vocabulary, unknown


def _warn_joined(table: Table, name: str) -> None:
    """Most cells of a class column holding 'cat|dog' (or ';', ',') likely list several classes, yet
    each becomes one class: a warning naming the multilabel kind, whose only separator is ';'."""
    cells = [(line, v.strip()) for line, v in zip(table.lines, table.columns[name]) if isinstance(v, str) and v.strip()]
    for mark in JOINED:
        joined = [(line, v) for line, v in cells if mark in v]
        if len(joined) * 2 <= len(cells):
            continue
        if name == LABEL_COLUMN:
            how = (f"the {LABEL_COLUMN!r} column holds one class per record: for several, name the column "
                   "otherwise (e.g. 'tags'), separate its classes with ';' and give --column tags:multilabel")
        else:
            how = ("if they list several classes, " + ("" if mark == SEPARATOR else "separate them with ';' (the "
                   "multilabel separator) and ") + f"give --column {name}:multilabel")
        line, example = joined[0]
        logger.warning("%s: %d of %d values of column %r hold %r (e.g. %r on %s) and each is read as one class "
                       "name; %s", table.path, len(joined), len(cells), name, mark, example, _row(table, line), how)
        return


def _check_given_kinds(table: Table, kinds: dict[str, str]) -> None:
    """`--column NAME:KIND` names a column of the table other than the path, and gives `label` no kind
    but class (the user asked for it, so "the column holds floats" would be wrong), or `none` for a
    table that has no label column."""
    for name, kind in kinds.items():
        if name == LABEL_COLUMN and kind == NO_LABEL:
            if LABEL_COLUMN in table.columns:
                raise CompileError(f"--column {name}:{kind}: {table.path} has a {LABEL_COLUMN!r} column; drop the "
                                   "option to label the records with it")
            continue
        if name == LABEL_COLUMN and kind != "class":
            raise CompileError(f"--column {name}:{kind}: {LABEL_COLUMN!r} is the class label column; its kind is "
                               "always class; name a numeric target otherwise (e.g. 'target')")
        if name not in table.columns and name == table.path_column:
            raise CompileError(f"--column {name}:{kind}: {name!r} is the image path column of {table.path}; it "
                               "takes no kind")
        if name not in table.columns:
            raise CompileError(f"--column {name}: {table.path} has no column {name!r} "
                               f"(it has {', '.join(map(repr, table.columns)) or 'only the path'})")


def _close_to_label(table: Table) -> str | None:
    """A column whose name is likely a typo of `label` (`lable`, `Label`, `labels`)."""
    return next((n for n in table.columns if difflib.get_close_matches(n.lower(), [LABEL_COLUMN], cutoff=0.7)), None)


def _check_label_column(table: Table, unlabeled: bool) -> None:
    """An empty label is an error (read as an empty tag list it would make the column multilabel). A
    table unlabeled on purpose (`--column label:none`) with a header typo of `label` is warned about."""
    if LABEL_COLUMN not in table.columns:
        close = _close_to_label(table)
        if close and unlabeled:
            logger.warning("%s has no %r column, so the records are unlabeled and %r becomes a field; if %r is the "
                           "class label, rename it to %r", table.path, LABEL_COLUMN, close, close, LABEL_COLUMN)
        return
    for line, value in zip(table.lines, table.columns[LABEL_COLUMN]):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise _problem(table, line, "empty label", LABEL_COLUMN)


def _no_label_column(table: Table) -> CompileError:
    """A table without a `label` column, not said to be unlabeled: a misnamed column, or a header row
    missing, would otherwise give every record label -1."""
    close = _close_to_label(table)
    columns = ", ".join(map(repr, [table.path_column, *table.columns]))
    return CompileError(f"{table.path}: no {LABEL_COLUMN!r} column (its columns: {columns}), so every record "
                        f"would be unlabeled; " + (f"if {close!r} is the class label, rename it to {LABEL_COLUMN!r}"
                                                   if close else f"name the class column {LABEL_COLUMN!r}")
                        + f", or give --column {LABEL_COLUMN}:{NO_LABEL} to compile the images unlabeled")


def _none_found(table: Table, root: Path) -> CompileError:
    """None of the listed images exist: name the first path as looked up, and the likely cause."""
    first, hints = table.sources[0], []
    separator = next((name for c, name in ((";", "';'"), ("\t", "tabs")) if c in table.path_column), None)
    if separator:
        hints.append(f"the header {table.path_column!r} is one column: is the table separated by {separator}? "
                     "A CSV table is read with ','")
    if "\\" in first:
        hints.append("its paths hold '\\': write them with '/'")
    if first.split("/")[0] == root.name:
        hints.append(f"its paths start with {root.name}/, SRC's own name: give them relative to SRC")
    looked_up = Path(os.path.abspath(root)) / first
    return CompileError(f"none of the {len(table.sources)} images listed in {table.path} exist under {root} "
                        f"(the first was looked up as {looked_up})" + "".join(f"; {h}" for h in hints))


def _column_kinds(table: Table, given: dict[str, str], reference: dict[str, tuple[str, tuple[str, ...]]],
                  classes: list[str] | None) -> dict[str, str]:
    """Each column's kind: given, else the reference split's, else inferred from its values."""
    kinds = {name: given.get(name) or (reference.get(name) or (None,))[0] or infer_kind(table, name)
             for name in table.columns}
    if LABEL_COLUMN in kinds and kinds[LABEL_COLUMN] != "class":
        raise CompileError(f"{table.path}: column {LABEL_COLUMN!r} holds {kinds[LABEL_COLUMN]} values, but the "
                           f"{LABEL_COLUMN!r} column is the dataset's class label; name a numeric target otherwise "
                           "(e.g. 'target')")
    if classes is not None and LABEL_COLUMN not in kinds and not reference:
        raise CompileError(f"{table.path}: the given classes are for the {LABEL_COLUMN!r} column, which it lacks")
    return kinds


def table_fields(table: Table, kinds: dict[str, str],
                 reference: dict[str, tuple[str, tuple[str, ...]]]) -> list[tuple[fmt.FieldEntry, np.ndarray]]:
    """Every column but the label as a typed field; `reference` (another split's fields) fixes the
    vocabulary of a class or tag column of the same kind, so a class keeps its position in every split.
    Archive sources make their `--column` values into fields here too, through a Table of their samples."""
    fields = []
    for name, kind in kinds.items():
        if name == LABEL_COLUMN:
            continue
        field_classes: list[str] = []
        fixed = reference[name][1] if name in reference and reference[name][0] == kind else None
        if kind in ("float", "int"):
            values, shape = _numbers(table, name, kind)
        elif kind == "multilabel":
            values, field_classes = _multi_hot(table, name, fixed)
            shape = (len(field_classes),)
        else:
            _warn_joined(table, name)
            values, field_classes, unknown_rows = _class_indices(table, name, fixed)
            if unknown_rows:
                row = unknown_rows[0]
                raise _problem(table, table.lines[row], f"class {_class_name(table.columns[name][row])!r} is "
                               "not among the classes of the dataset the classes come from", name)
            shape = ()
        fields.append((fmt.FieldEntry("", 0, "", name, kind, shape, tuple(field_classes)), values))
    return fields


def discover_listed(src: str | os.PathLike, table_path: str | os.PathLike, kinds: dict[str, str] | None = None,
                    classes: list[str] | None = None, skip_unknown: bool = False,
                    reference: dict[str, tuple[str, tuple[str, ...]]] | None = None,
                    on_found: Callable[[int], None] | None = None, tree: Tree | None = None) -> Discovery:
    """What to compile from a label table: its rows whose image exists under `src` (in `tree`, a bucket's
    objects, when given), their label
    (the `label` column: integers as given, class names over `classes` or their own sorted names)
    and fields (the other columns).

    A listed image that is missing is skipped (recorded like a bad image); images under `src`
    that the table does not list are ignored and counted. `classes` applies to the label;
    `reference` ({name: (kind, classes)}, another split's fields) fixes the kind and vocabulary of
    the columns it names, so that a tag or class has the same position in every split. A table
    without a label column needs `kinds` to say `{"label": "none"}`.
    `on_found(n)`: n more images found under `src` (listed or not), as the walk goes."""
    reference = reference or {}
    if tree is None:
        check_source_folder(Path(src))
        tree = folder_tree(Path(src))
    root = tree.root
    table = read_table(table_path, root if isinstance(root, Path) else None)
    given = kinds or {}
    _check_given_kinds(table, given)
    unlabeled = given.get(LABEL_COLUMN) == NO_LABEL
    _check_label_column(table, unlabeled)
    given = {name: kind for name, kind in given.items() if kind != NO_LABEL}
    kinds = _column_kinds(table, given, reference, classes)
    integer_label = LABEL_COLUMN in kinds and LABEL_COLUMN not in given \
        and all(_integer_like(v) for v in table.columns[LABEL_COLUMN])

    keep = np.ones(len(table.sources), dtype=bool)
    skipped: list[tuple[str, str]] = []
    labels, vocabulary = np.full(len(table.sources), fmt.UNLABELED, dtype=np.int64), []
    if LABEL_COLUMN in kinds:
        if integer_label:
            labels, vocabulary, unknown = _integer_labels(table, classes)
        else:
            _warn_joined(table, LABEL_COLUMN)
            labels, vocabulary, unknown = _class_indices(table, LABEL_COLUMN, classes)
        if unknown and not skip_unknown:
            row = unknown[0]
            raise _problem(table, table.lines[row], f"class {_class_name(table.columns[LABEL_COLUMN][row])!r} "
                           f"is not among the {len(vocabulary)} given classes ({len(unknown)} row(s) like it); "
                           "pass --skip-unknown-classes to leave them out", LABEL_COLUMN)
        for row in unknown:
            keep[row] = False
            skipped.append((table.sources[row], "its class is not among the given classes"))
    fields = table_fields(table, kinds, reference)

    on_disk, on_disk_stamps, walk_skipped = tree.images(on_found)  # one walk, not a stat per row
    found = dict(zip(on_disk, on_disk_stamps))
    walk_reasons = dict(walk_skipped)  # a listed broken link or FIFO: the walk says why, once
    stamps = []
    for row, source in enumerate(table.sources):
        stamp = found.get(source) or tree.stamp(source)  # not walked: hidden, or another suffix
        if keep[row] and stamp is None:
            keep[row] = False
            skipped.append((source, walk_reasons.get(source, f"listed in {table.path.name} but not found")))
        stamps.append(stamp)
    ignored = len(found.keys() - set(table.sources))
    sources = [s for s, k in zip(table.sources, keep) if k]
    if not sources:
        raise _none_found(table, Path(root))
    if LABEL_COLUMN not in kinds and not unlabeled:
        raise _no_label_column(table)
    # the gaps of integer labels are no classes the user named: not listed as classes without images
    empty = [] if integer_label and classes is None else classes_without_records(labels[keep], vocabulary)
    return Discovery(root, sources, labels[keep], vocabulary, sorted(skipped), empty,
                     [s for s, k in zip(stamps, keep) if k], [(spec, values[keep]) for spec, values in fields], ignored)


def classes_without_records(labels: np.ndarray, vocabulary: list[str]) -> list[str]:
    """The classes of `vocabulary` that no label names, in vocabulary order: one count per class in a
    single pass (a per-class scan of the labels took 2.6 s at 2k classes and 1M records, minutes at
    ImageNet-21k). -1 (no label) is no class."""
    counts = np.bincount(labels[labels >= 0], minlength=len(vocabulary))
    return [c for c, n in zip(vocabulary, counts) if n == 0]
