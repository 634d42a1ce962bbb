"""Archives of an image folder written by the tools users have: webdataset's `ShardWriter` (tar
shards), Hugging Face `datasets` (`Features({"image": Image(), "label": ClassLabel(...)})` →
`to_parquet`) and Python's `zipfile`, each holding the folder's own encoded files, in the folder's
order (by class, then name), so a compile of either gives the folder compile's records. Used by the
tests and by benchmarks/archive_sources.py."""

from __future__ import annotations

import zipfile
from pathlib import Path


def folder_images(root: Path) -> tuple[list[str], list[tuple[str, Path]]]:
    """(class names, [(class, file)]) of an ImageFolder tree, in the order discovery lists them."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return classes, [(c, f) for c in classes for f in sorted((root / c).iterdir()) if f.is_file()]


def write_tar_shards(root: Path, dest: Path, per_shard: int, extra=None) -> str:
    """WebDataset shards `dest/train-000000.tar`...; the brace pattern naming them. Each sample holds the
    image under its own extension, `.cls` (the class index) and whatever `extra(class, file)` adds."""
    import webdataset as wds

    classes, files = folder_images(root)
    dest.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(dest / "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for c, f in files:
            sample = {"__key__": f"{c}/{f.stem}", f.suffix[1:].lower(): f.read_bytes(), "cls": classes.index(c)}
            sink.write({**sample, **(extra(c, f) if extra else {})})
    shards = sorted(dest.glob("train-*.tar"))
    return str(dest / f"train-{{000000..{len(shards) - 1:06d}}}.tar")


def write_parquet(root: Path, path: Path, rows_per_group: int) -> Path:
    """One Parquet file written by `datasets`: an Image column (the files' bytes, named by their file
    names) and a ClassLabel column, `rows_per_group` rows a row group."""
    from datasets import ClassLabel, Dataset, Features, Image, disable_progress_bars

    disable_progress_bars()
    classes, files = folder_images(root)
    features = Features({"image": Image(), "label": ClassLabel(names=classes)})
    data = {"image": [{"bytes": f.read_bytes(), "path": f.name} for _, f in files],
            "label": [classes.index(c) for c, _ in files]}
    Dataset.from_dict(data, features=features).to_parquet(str(path), batch_size=rows_per_group)
    return path


def write_zip(root: Path, path: Path, wrapper: str = "images/", method: int = zipfile.ZIP_DEFLATED) -> Path:
    """`zip -r`'s layout: the tree under one wrapping folder."""
    _, files = folder_images(root)
    with zipfile.ZipFile(path, "w", method) as archive:
        for c, f in files:
            archive.write(f, f"{wrapper}{c}/{f.name}")
    return path
