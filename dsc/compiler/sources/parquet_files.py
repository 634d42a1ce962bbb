"""Parquet files (Hugging Face `datasets`' format): one sample a row, one unit of work a row group.

Discovery reads the footer and, per row group, only the label column and the images' `path`
field: never the image bytes. The image is an `Image`-feature struct `{bytes, path}` or a binary
column (`--image-column`, else the Hugging Face `Image` feature, else the only such column); the
label is a `ClassLabel` column, whose names in the file's Hugging Face schema metadata become the
classes, or an integer or string column (`--label-key`, else the `ClassLabel`, else a column named
`label`). A worker streams the image column of one row group in small batches. A row group that
cannot be read is skipped whole, named by its rows; a row whose image holds no bytes (only a path
to a file elsewhere, which dsc does not follow) is skipped. pyarrow is imported only here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from dsc.compiler.sources.common import Listing, Member, Sample, open_archive, too_large, unsafe_name
from dsc.errors import CompileError, ImageError
from dsc.storage.object_file import EXACT_READS

HF_METADATA = b"huggingface"  # the schema metadata key `datasets` writes its features under
LABEL_COLUMN = "label"
NO_BYTES = "the row's image holds no bytes (an image stored only as a path to a file elsewhere is not followed)"
READ_BATCH_ROWS = 64  # image rows decoded from Parquet at a time: a row group is never held whole


def pyarrow_parquet():
    """pyarrow.parquet, or a CompileError saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise CompileError("compiling Parquet files needs pyarrow: pip install 'dsc-images[parquet]'") from e
    return pq


def _features(schema) -> dict:
    try:
        info = json.loads((schema.metadata or {}).get(HF_METADATA, b"{}"))
        features = info.get("info", {}).get("features", {})
        return features if isinstance(features, dict) else {}
    except (ValueError, AttributeError):
        return {}


def _is_binary(pa, kind) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _image_column(pa, schema, features: dict, given: str | None, path: Path) -> str:
    if given is not None:
        if given not in schema.names:
            raise CompileError(f"{path} has no column {given!r} (--image-column); its columns: "
                               f"{', '.join(schema.names)}")
        return given
    tagged = [n for n in schema.names if isinstance(features.get(n), dict) and features[n].get("_type") == "Image"]
    structs = [n for n in schema.names if pa.types.is_struct(schema.field(n).type)
               and schema.field(n).type.get_field_index("bytes") >= 0]
    binary = [n for n in schema.names if _is_binary(pa, schema.field(n).type)]
    candidates = tagged or structs or binary
    if len(candidates) != 1 and not tagged:
        raise CompileError(f"{path}: {'no' if not candidates else 'more than one'} image column found among "
                           f"{', '.join(schema.names)}; give --image-column")
    return candidates[0]


def _label_column(schema, features: dict, given: str | None, path: Path) -> str | None:
    if given is not None:
        if given not in schema.names:
            raise CompileError(f"{path} has no column {given!r} (--label-key); its columns: {', '.join(schema.names)}")
        return given
    tagged = [n for n in schema.names if isinstance(features.get(n), dict) and features[n].get("_type") == "ClassLabel"]
    return tagged[0] if tagged else (LABEL_COLUMN if LABEL_COLUMN in schema.names else None)


def columns(schema, path: str | Path, label_key: str | None,
            image_column: str | None) -> tuple[str, str | None, list[str] | None]:
    """(image column, label column or None, the label's ClassLabel names or None) of one file's schema."""
    import pyarrow as pa

    features = _features(schema)
    image = _image_column(pa, schema, features, image_column, path)
    kind = schema.field(image).type
    if not (_is_binary(pa, kind) or (pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0)):
        raise CompileError(f"{path}: column {image!r} is {kind}, not image bytes (binary, or a struct with 'bytes')")
    label = _label_column(schema, features, label_key, path)
    names = features.get(label, {}).get("names") if label and isinstance(features.get(label), dict) else None
    if label is not None:
        kind = schema.field(label).type
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise CompileError(f"{path}: label column {label!r} is {kind}, not integers or class names")
    return image, label, list(names) if isinstance(names, list) else None


def list_archive(path: str | Path, label_key: str | None = None, image_column: str | None = None,
                 fields: tuple[str, ...] = ()) -> Listing:
    """The rows of one file: names and labels from the metadata, the label column and the images' paths;
    `fields` (`--column` names) are read too, each row's values kept for its fields (a null as "": no value)."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    with open_archive(path, read_ahead=EXACT_READS) as f:
        try:
            parquet = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            return Listing(skipped=[("", f"not a readable Parquet file ({e})")])
        image, label, names = columns(parquet.schema_arrow, path, label_key, image_column)
        for name in fields:
            if name not in parquet.schema_arrow.names or name in (image, label):
                raise CompileError(f"--column {name}: {path} has no column {name!r} other than its image and label "
                                   f"(its columns: {', '.join(parquet.schema_arrow.names)})")
        return _list_rows(pa, parquet, image, label, names, fields)


def _list_rows(pa, parquet, image: str, label: str | None, names: list[str] | None,
               fields: tuple[str, ...] = ()) -> Listing:
    listing = Listing(names=names, options=(image,))
    meta = parquet.metadata
    has_path = pa.types.is_struct(parquet.schema_arrow.field(image).type)
    wanted = ([label] if label else []) + ([f"{image}.path"] if has_path else []) + list(fields)
    first, seen = 0, set()
    for group in range(meta.num_row_groups):
        rows = meta.row_group(group).num_rows
        try:
            table = parquet.read_row_group(group, columns=wanted) if wanted else None
        except (pa.ArrowException, OSError) as e:
            listing.skipped.append((f"row={first}..{first + rows - 1}", f"row group {group} cannot be read ({e})"))
            first += rows
            continue
        labels = table.column(label).to_pylist() if label else [None] * rows
        paths = _paths(table.column(image)) if has_path else [None] * rows
        values = {name: ["" if v is None else v for v in table.column(name).to_pylist()] for name in fields}
        for row, (value, image_path) in enumerate(zip(labels, paths)):
            named = image_path and not unsafe_name(image_path) and image_path not in seen
            name = image_path if named else f"row={first + row}"  # a path met before: the row's own number
            seen.add(name)
            listing.samples.append(Sample(name, Member(0, group, row), value, {k: v[row] for k, v in values.items()}))
        first += rows
    return listing


def find_member(path: str | Path, name: str) -> tuple[Member, tuple] | None:
    """The row `name` names (`row=N`, or the first whose image path it is), for re-reading one source."""
    pq = pyarrow_parquet()
    with open_archive(path, read_ahead=EXACT_READS) as f:
        parquet = pq.ParquetFile(f)
        image, _, _ = columns(parquet.schema_arrow, path, None, None)
        meta, first = parquet.metadata, 0
        row = int(name[4:]) if name.startswith("row=") and name[4:].isdigit() else None
        for group in range(meta.num_row_groups):
            rows = meta.row_group(group).num_rows
            if row is not None and row < first + rows:
                return Member(0, group, row - first), (image,)
            if row is None:
                paths = _paths(parquet.read_row_group(group, columns=[f"{image}.path"]).column(image))
                if name in paths:
                    return Member(0, group, paths.index(name)), (image,)
            first += rows
    return None


def _paths(column) -> list[str | None]:
    """The `path` field of an image struct column read with only that field."""
    structs = column.combine_chunks()
    return structs.field("path").to_pylist() if structs.type.get_field_index("path") >= 0 else [None] * len(structs)


def read_members(path: str, members: list[Member], max_bytes: int, options: tuple = ()) -> Iterator[bytes | ImageError]:
    """The image bytes of these rows of one row group (in row order), streamed in small batches."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    (image,) = options
    group = members[0].unit
    wanted = iter(members)
    member = next(wanted, None)
    f = None
    try:
        f = open_archive(path, read_ahead=EXACT_READS)
        batches = pq.ParquetFile(f).iter_batches(READ_BATCH_ROWS, row_groups=[group], columns=[image])
        first = 0
        for batch in batches:
            values = batch.column(0)
            if pa.types.is_struct(values.type):
                values = values.field("bytes")
            while member is not None and member.position < first + len(batch):
                data = values[member.position - first].as_py()
                yield (ImageError(NO_BYTES) if not data else
                       too_large(len(data), max_bytes) if len(data) > max_bytes else data)
                member = next(wanted, None)
            first += len(batch)
    except (pa.ArrowException, OSError) as e:
        error = ImageError(f"row group {group} cannot be read ({e})")
        while member is not None:
            yield error
            member = next(wanted, None)
    finally:
        if f is not None:
            f.close()
    while member is not None:  # rows the file no longer has
        yield ImageError(f"row group {group} has no row {member.position}")
        member = next(wanted, None)
