"""`MemmapDataset`: a compiled dsc dataset as a torch map-style dataset, backed by memory maps.

Everything about the files comes from `dsc.storage.open_dataset`, which validates the manifest and
every file's size before anything is mapped: a damaged dataset fails in the constructor. The index's
values (labels, sizes, fields, source offsets: linear in the records, 2.4 GB at 10^8) are checked as
they are used instead (`storage.OpenedDataset`): a batch, `ds[i]` or `ds.source(i)` whose record has a
value the format forbids fails naming it, so opening costs milliseconds at any size and no wrong value
is ever served.

Shard maps are read-only and shared (`PROT_READ`, `MAP_SHARED`): they cost no commit charge, so
a dataset larger than RAM + swap maps even under strict overcommit. `ds[i]` is therefore a copy
of its one record (cheap beside the per-item Python around it), which may be edited in place
without ever reaching the file; batches are copied out of the maps whole, as before.

Recompiling into the folder (`dsc compile --force`) while readers use it: a `MemmapDataset`
keeps reading the dataset it opened (its maps hold the old files). A new one opens the new
dataset; if the folder is replaced while it is being opened, the open starts again on the new
folder (`_open`). A copy made by pickling (a DataLoader worker) opens the folder again by path,
so it checks that it finds the dataset the original opened, by its manifest's fingerprint,
and raises `DatasetError` instead of serving other records than the original.

A dataset grown by `dsc append` (format 1.3) has versions: a `MemmapDataset` reads the latest
when it is made (or the `version` asked for) and keeps reading exactly that version, copies
included, however many appends land meanwhile (`version` names it).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from dsc import format as fmt
from dsc import storage
from dsc.arguments import check_bool, check_int
from dsc.errors import DatasetError
from dsc.reader.gather import check_indices, fill, out_of_range


class Sample(NamedTuple):
    """One record, as torchvision datasets return it: `image, label = ds[i]`."""

    image: Any  # uint8 [3, H, W], a copy of the record (or what `transform` made of it)
    label: Any  # the target: an int for a class, a float, or a tensor for a vector field


class IndexedSample(NamedTuple):
    """One record with its index (`MemmapDataset(..., return_index=True)`): `image, label, index = ds[i]`."""

    image: Any
    label: Any
    index: int


class GatheredBatch(Sequence):
    """What `__getitems__` returns: a whole batch already copied into tensors.

    It is a sequence of samples for generic code; torch's default collate hands over its
    tensors as ``[images, targets]`` (``[images, targets, indices]`` with `return_index`)
    without touching the records again (see `_collate`).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, indices: np.ndarray,
                 return_index: bool = False) -> None:
        self.images, self.labels, self.indices, self.return_index = images, labels, indices, return_index

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        target = _target_value(self.labels[i])
        if self.return_index:
            return IndexedSample(self.images[i], target, int(self.indices[i]))
        return Sample(self.images[i], target)


def _target_value(value: torch.Tensor | np.ndarray) -> Any:
    """A record's target as torchvision gives it: a Python number for a scalar, else a tensor."""
    if value.ndim == 0:
        return value.item()
    return torch.as_tensor(value)


def _collate(batch, *, collate_fn_map=None) -> list[torch.Tensor]:
    """Default-collate rule for samples: a gathered batch passes through, loose samples are stacked."""
    if isinstance(batch, GatheredBatch):
        return [batch.images, batch.labels] + ([torch.from_numpy(batch.indices)] if batch.return_index else [])
    first = batch[0]
    images = torch.stack([s.image for s in batch])
    if images.dtype == torch.uint8 and images.dim() == 4:
        images = images.contiguous(memory_format=torch.channels_last)
    if isinstance(first.label, torch.Tensor):
        targets = torch.stack([s.label for s in batch])
    else:
        targets = torch.tensor([s.label for s in batch])
    out = [images, targets]
    if isinstance(first, IndexedSample):
        out.append(torch.tensor([s.index for s in batch], dtype=torch.int64))
    return out


def _register_collate() -> None:
    # torch documents extending default_collate by editing this map in place (see
    # torch.utils.data._utils.collate.collate); without it, collate still works, item by item.
    try:
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:
        return
    default_collate_fn_map[Sample] = _collate
    default_collate_fn_map[IndexedSample] = _collate


_register_collate()


def record_index(i: Any, count: int) -> int:
    """`i` as a non-negative record index: an int, numpy integer or 0-d integer tensor, negatives from the end.

    Anything else (a list, slice, float, bool, string) is refused rather than cast, which would
    serve some other record silently; torch map-style datasets take one index at a time too.
    """
    bool_or_array = isinstance(i, (bool, np.bool_)) or (
        isinstance(i, torch.Tensor) and (i.ndim > 0 or i.dtype == torch.bool))  # operator.index takes these
    try:
        k = None if bool_or_array else operator.index(i)
    except TypeError:
        k = None
    if k is None:
        got = type(i).__name__ + (f" of dtype {i.dtype}, shape {tuple(i.shape)}" if hasattr(i, "shape") else "")
        raise TypeError(f"record index must be an integer, got {got}; for many records use "
                        "ds.__getitems__(indices) or ds.loader(...)")
    if not -count <= k < count:
        raise IndexError(out_of_range(k, count))
    return k % count


def _open(root: Path | str, cache_dir: str | None = None, version: int | None = None,
          cache_bytes: int | None = None) -> storage.OpenedDataset:
    """Validate and map the dataset; shards read-only (see the module docstring), its index values checked
    as they are used (`storage.OpenedDataset`)."""
    return storage.open_dataset(root, cache_dir=cache_dir, version=version, cache_bytes=cache_bytes,
                                check_values=False)


def batch_buffer(batch: int, record_shape: tuple[int, int, int], shared: bool) -> torch.Tensor:
    """A fresh uint8 [batch, H, W, 3] tensor; in shared memory when it will cross processes."""
    shape = (batch, *record_shape)
    if not shared:
        return torch.empty(shape, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(int(np.prod(shape)))  # what default_collate does in workers
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


class MemmapDataset(Dataset):
    """A compiled dsc dataset: `len`, `ds[i]`, batched `__getitems__`, `loader(...)`.

    As a torchvision dataset, `ds[i]` is ``(image, target)``: `target` names what the second
    element is, "label" (the class index) or any field of the dataset (`ds.fields`), and
    `transform` / `target_transform` apply to each sample as torchvision's do (the image is a
    uint8 [3, H, W] tensor). `return_index=True` adds the record index: ``(image, target, i)``.
    Without transforms, a DataLoader's batches are copied whole (`__getitems__`).

    Picklable by path: a copy (e.g. in a DataLoader worker) re-opens the maps on first use,
    so no process ever copies the records; it refuses (`DatasetError`) a folder that was
    recompiled into another dataset since the original was opened.

    `path` may be an ``s3://bucket/prefix`` URL: its index is downloaded once per node into
    `cache_dir` (default ``$DSC_CACHE_DIR``, else ``~/.cache/dsc``), and its records are fetched as
    they are read into a cache there of at most `cache_bytes` (README, "Datasets in object storage");
    neither has a meaning for a folder. `ds[i]` of such a dataset is then a copy, not a view.

    `version`: which version of a dataset grown by `dsc append` to read [default: the latest];
    `ds.version` says which one this is, and every copy reads that one.
    """

    def __init__(self, path: str | os.PathLike, *, target: str = "label",
                 transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, return_index: bool = False,
                 cache_dir: str | os.PathLike | None = None, version: int | None = None,
                 cache_bytes: int | None = None) -> None:
        # a folder by absolute path: a spawned worker may start in another directory
        self.path: Path | str = os.fspath(path) if storage.is_url(path) else Path(os.path.abspath(path))
        self.cache_dir = None if cache_dir is None else os.path.abspath(cache_dir)
        self.cache_bytes = None if cache_bytes is None else check_int("cache_bytes", cache_bytes, 1)
        self._data: storage.OpenedDataset | None = _open(self.path, self.cache_dir, version,
                                                         self.cache_bytes)  # validates now, fails here
        self._fingerprint = self._data.manifest.fingerprint
        self.version: int = self._data.manifest.dataset_version
        if target != "label" and target not in self._data.fields:
            raise ValueError(f"target={target!r}: {self.path} has no such field; choose 'label' or one of "
                             f"{sorted(self._data.fields) or 'its fields (it has none)'}")
        self.target, self.transform, self.target_transform = target, transform, target_transform
        self.return_index = check_bool("return_index", return_index)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "cache_dir": self.cache_dir, "cache_bytes": self.cache_bytes,
                "fingerprint": self._fingerprint, "version": self.version, "target": self.target,
                "transform": self.transform, "target_transform": self.target_transform,
                "return_index": self.return_index}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"] if storage.is_url(state["path"]) else Path(state["path"])
        self.cache_dir, self.cache_bytes = state.get("cache_dir"), state.get("cache_bytes")
        self._fingerprint = state["fingerprint"]
        self.version = state.get("version", 1)
        self.target = state.get("target", "label")
        self.transform, self.target_transform = state.get("transform"), state.get("target_transform")
        self.return_index = state.get("return_index", False)
        self._data = None

    @property
    def opened(self) -> storage.OpenedDataset:
        """The validated, mapped dataset (mapped again lazily after unpickling)."""
        if self._data is None:
            data = _open(self.path, self.cache_dir, self.version, self.cache_bytes)
            self._check_same(data.manifest)
            self._data = data
        return self._data

    def _check_same(self, manifest: fmt.Manifest) -> None:
        if manifest.fingerprint != self._fingerprint:
            raise DatasetError(f"{self.path}: the dataset was replaced (recompiled?) after this MemmapDataset was "
                               "opened; a copy of it (e.g. in a DataLoader worker) would read other records than "
                               f"the original, so it refuses to. Open it again: MemmapDataset({str(self.path)!r})")

    def _check_still_there(self) -> None:
        """For what maps the files by path again: the folder must still hold the dataset opened."""
        try:
            manifest = storage.parse_manifest(self.path, self.cache_dir, self.version)
        except DatasetError as e:
            raise DatasetError(f"{self.path}: the dataset was replaced or damaged after this MemmapDataset was "
                               f"opened ({e})") from e
        self._check_same(manifest)

    @property
    def manifest(self) -> fmt.Manifest:
        return self.opened.manifest

    @property
    def fit(self) -> str | None:
        """How the records were made from their sources (`dsc compile --fit`): "center-crop", "stretch" or
        "pad"; None where the manifest does not say. The loader's batches carry it (`dsc.fits`)."""
        fit = self.manifest.compile.get("fit")
        return fit if isinstance(fit, str) else None

    @property
    def record_shape(self) -> tuple[int, int, int]:
        return self.manifest.record_shape

    def __len__(self) -> int:
        return self.manifest.count

    def __repr__(self) -> str:
        m = self.manifest
        return f"MemmapDataset({str(self.path)!r}, count={m.count}, shape={list(m.record_shape)})"

    @property
    def classes(self) -> list[str]:
        return list(self.manifest.classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.manifest.classes)}

    @property
    def labels(self) -> np.ndarray:
        """All labels, int64 [N], read-only (-1 everywhere for an unlabeled dataset): the map of the labels file,
        or for an index in several segments (format 1.5, appended) their joined copy."""
        return _array(self.opened.labels)

    @property
    def fields(self) -> dict[str, np.ndarray]:
        """The dataset's own per-record fields (format 1.1), each read-only [N, *shape], by name (joined copies
        where the index is in several segments, as `labels`)."""
        return {name: _array(values) for name, values in self.opened.fields.items()}

    def field_classes(self, name: str) -> list[str]:
        """The vocabulary of a class or multilabel field: value k (or multi-hot position k) is its k-th name."""
        for entry in self.manifest.fields:
            if entry.name == name:
                return list(entry.classes)
        raise KeyError(f"{self.path} has no field {name!r} (fields: {', '.join(self.opened.fields) or 'none'})")

    def _targets(self, idx: np.ndarray) -> np.ndarray:
        """The targets of records `idx`, checked (`storage.OpenedDataset.take`)."""
        d = self.opened
        return d.take("labels" if self.target == "label" else d.field_key(self.target), idx)

    def source(self, i: int) -> Path | str:
        """The original image file of record `i` (under the folder it was compiled from); for sources that
        were in a bucket, the object's URL as a string (a `Path` would fold `s3://` into `s3:/`)."""
        i = record_index(i, len(self))
        root = self.manifest.compile.get("source_root")
        if not isinstance(root, str):
            raise DatasetError(f"{self.path}/{fmt.MANIFEST_FILE}: 'compile' has no 'source_root' string")
        where = fmt.source_location(root, self.opened.source(i))
        return where if storage.is_url(where) else Path(where)

    def __getitem__(self, i: int) -> Sample | IndexedSample:
        """Record `i` (one integer): a uint8 [3, H, W] copy of the record (the map is read-only) and its
        target, transformed if asked."""
        i = record_index(i, len(self))
        if self.opened.records is not None:  # in object storage: a copy out of the cache
            image = torch.empty((1, *self.record_shape), dtype=torch.uint8)
            self.opened.records.fill(image.numpy(), np.array([i]))
            image = image[0].permute(2, 0, 1)
        else:
            shard, pos = fmt.locate(i, self.manifest.records_per_shard)
            image = torch.from_numpy(np.array(self.opened.shards[shard][pos])).permute(2, 0, 1)
        target = _target_value(self._targets(np.array([i]))[0])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return IndexedSample(image, target, i) if self.return_index else Sample(image, target)

    def __getitems__(self, indices: Sequence[int]) -> GatheredBatch | list[Sample | IndexedSample]:
        """A whole batch with one copy per run or per shard (what DataLoader calls per batch);
        sample by sample when there are transforms to apply. `indices`: a 1-D sequence of integers."""
        idx = check_indices(indices, len(self))
        if self.transform is not None or self.target_transform is not None:
            return [self[i] for i in idx.tolist()]
        d = self.opened
        buf = batch_buffer(len(idx), self.record_shape, shared=get_worker_info() is not None)
        if d.records is not None:
            d.records.fill(buf.numpy(), idx)
        else:
            fill(buf.numpy(), d.shards, idx, self.manifest.records_per_shard)
        targets = torch.from_numpy(self._targets(idx))
        return GatheredBatch(buf.permute(0, 3, 1, 2), targets, idx, self.return_index)

    def as_tensordict(self):
        """The dataset as MemoryMappedTensors over its own files (zero copy), keyed per shard.

        Shards are separate files, which cannot be mapped as one array, so the records are not
        one ``[N]`` tensor. The TensorDict (batch size ``[]``) holds:

        - ``"label"``: int64 ``[N]`` over labels.bin, indexed by record;
        - ``"fields"``: a TensorDict of batch size ``[N]`` with each of the dataset's own fields
          (``[N, *shape]`` over its file), by name;
        - ``"shards"``: a TensorDict with one entry per shard, keyed ``str(s)``: a TensorDict of
          batch size ``[n_s]`` with ``"image"`` (uint8 ``[n_s, H, W, 3]`` as stored, mapping the
          shard file), ``"label"`` (its slice of labels.bin) and each field's slice by name.

        Record ``i`` is ``td["shards", str(s)][j]`` with ``s, j = dsc.format.locate(i, records_per_shard)``.
        Indexing by record at the top (``td[i]``) raises (its batch size is empty), and so does
        ``td["image"]`` (no such key): neither can silently pick the wrong record.
        Its maps are tensordict's copy-on-write ones (mode "r"): writes stay in this process. A dataset in
        object storage has no shard files to map (its records are cached a range at a time): refused.
        """
        if self.opened.records is not None:
            raise DatasetError(f"{self.path}: as_tensordict maps shard files, and a dataset in object storage has "
                               "none locally; read it through ds.loader(...) or ds[i], or copy it to a folder")
        self._check_still_there()  # mapped by path again: before and after, it must be the dataset opened
        try:
            td = self._map_tensordict()
        except RuntimeError:  # tensordict's "unable to open file": say so if the folder was replaced
            self._check_still_there()
            raise
        self._check_still_there()
        return td

    def _map_tensordict(self):
        from tensordict import MemoryMappedTensor, TensorDict

        d, m = self.opened, self.manifest
        if len(m.index_segments) > 1:
            raise DatasetError(f"{self.path}: as_tensordict maps one labels file, and this dataset's index is in "
                               f"{len(m.index_segments)} segments (appended to, format 1.5); read it through "
                               "ds.loader(...) or ds[i], or open a version of one segment (MemmapDataset(path, "
                               "version=N))")
        (one,) = m.index_segments
        _ = d.labels, d.fields  # handed out whole below: each file's values checked whole first
        labels = MemoryMappedTensor.from_filename(d.local_root / one.index["labels"].file, torch.int64, (m.count,),
                                                  mode="r")
        dtypes = {f.name: torch.from_numpy(np.empty(0, f.dtype)).dtype for f in m.fields}
        fields = {f.name: MemoryMappedTensor.from_filename(d.local_root / e.file, dtypes[f.name], (m.count, *f.shape),
                                                           mode="r") for f, e in zip(m.fields, one.fields)}
        shards, first = {}, 0
        for s, (path, records) in enumerate(zip(d.shard_paths(), fmt.shard_records(m.count, m.records_per_shard))):
            image = MemoryMappedTensor.from_filename(path, torch.uint8, (records, *m.record_shape), mode="r")
            shards[str(s)] = TensorDict(image=image, label=labels[first:first + records],
                                        **{k: v[first:first + records] for k, v in fields.items()},
                                        batch_size=[records])
            first += records
        return TensorDict(label=labels, fields=TensorDict(fields, batch_size=[m.count]),
                          shards=TensorDict(shards, batch_size=[]), batch_size=[])

    def loader(self, batch_size: int, *, order: str | None = None, seed: int | None = None, drop_last: bool = False,
               device: str | torch.device | None = None, prefetch: int = 2, num_threads: int | None = None,
               rank: int | None = None, world_size: int | None = None, locality: str | None = None,
               shuffle: bool | None = None, as_tuple: tuple[str, ...] | None = None, indices=None, weights=None,
               replacement: bool | None = None, repeats: int = 1, samples_per_epoch: int | None = None):
        """Batches as TensorDicts {image, label, index, size, and any fields}, fast (`dsc.reader.loader.Loader`).

        order: "block" (default: shuffled windows of contiguous blocks, reads local to a window), "random"
            (a full permutation; the default for a dataset compiled with shuffle off, whose records are
            sorted) or "sequential"; `shuffle=True`/`False` means "random"/"sequential".
        seed: with the epoch, fixes every order [default: drawn from torch's generator, so each new loader
            orders anew and `torch.manual_seed` repeats a run; under a process group every rank takes rank
            0's; ranks given by rank/world_size without one need a seed]. drop_last: drop each rank's last
            partial batch.
        device: e.g. "cuda" or f"cuda:{local_rank}": pinned buffers and side-stream uploads; None or
            "cpu": batches in host memory. Other devices are refused here.
        prefetch: batches made ahead. num_threads: copy threads (default: up to 4 cores).
        rank, world_size: this rank's share [default: from torch.distributed when an epoch starts].
        locality: "shard" (with order="block") gives each rank whole shard files.
        as_tuple: field names, e.g. ("image", "label"): batches are tuples of those tensors, for
            ``x, y = batch``; a TensorDict batch refuses to be unpacked (it would give samples).
        indices, weights + replacement, repeats, samples_per_epoch, order=callable(n, seed, epoch): sampling,
            deterministic and resumable like the built-in orders (`dsc.reader.sampling`; README "Sampling").
        """
        from dsc.reader.loader import Loader

        return Loader(self, batch_size, order=order, seed=seed, drop_last=drop_last, device=device, prefetch=prefetch,
                      num_threads=num_threads, rank=rank, world_size=world_size, locality=locality, shuffle=shuffle,
                      as_tuple=as_tuple, indices=indices, weights=weights, replacement=replacement, repeats=repeats,
                      samples_per_epoch=samples_per_epoch)


def _array(values) -> np.ndarray:
    """A column as a read-only numpy array: a map as it is, a `Column` of several segments' maps joined."""
    if isinstance(values, np.ndarray):
        return values
    joined = np.asarray(values)
    joined.flags.writeable = False
    return joined
