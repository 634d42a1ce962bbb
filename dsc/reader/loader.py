"""`Loader`: batches of a `MemmapDataset` as TensorDicts, gathered on a background thread.

A pass = this rank's share of (what is left of) an epoch (`progress.remaining_share`), cut into
batches (`order.batch_indices`: in block order, records in a seeded random arrangement).
One producer thread (`producer.py`), kept across epochs, copies each batch out of the maps
(`gather.fill_parallel`, split over a copy pool that lives as long as the loader) into a sink
(`host.HostSink`, or `device.CudaSink` with its pinned ring and side stream) and hands it over
through a bounded queue. The settings are checked once, where the loader is made (`settings.py`).
When an epoch's last batch is handed out, the producer goes on with the next epoch's first
batches, so a loop over many epochs has no gap at their edges; an iteration that asks for
anything else (`set_epoch`, `load_state_dict`, an abandoned pass) gets a new producer. Errors on
that thread reach the consumer as `LoaderError`, naming the batch. The plain single-threaded
`reference.reference_batches` serves identical batches.
`Loader.stats()` says how long the consumer waited for data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from dsc import fits
from dsc.arguments import check_int
from dsc.errors import LoaderError
from dsc.reader import order as orders
from dsc.reader import progress
from dsc.reader import sampling as samplers
from dsc.reader.frameworks import PassTracker
from dsc.reader.host import Batch, HostSink
from dsc.reader.producer import LoaderStats, Meter, Producer, Threads, batch_maker, field_specs
from dsc.reader.settings import (
    LoaderConfig,
    agreed_seed,
    bind_device,
    draw_seed,
    resolve_world,
    sorted_block_warning,
    stored_sorted,
)

STATE_VERSION = 2  # of Loader.state_dict(); version 1 (dsc 0.1: per rank) still loads


def _sink_class(device: torch.device | None) -> type:
    """Host buffers, or the CUDA ring: two implementations of one interface (see `host`)."""
    if device is not None:  # resolve_device lets only CUDA devices through
        from dsc.reader.device import CudaSink

        return CudaSink
    return HostSink


class EpochHook:
    """Where Lightning looks for `set_epoch`: on a DataLoader's `.sampler` (and `.batch_sampler.sampler`).

    Lightning calls it at the start of every training epoch and every validation, which keeps
    a Loader's epoch in step also when Lightning stops an epoch early (`limit_train_batches`,
    the sanity check). It is no sampler: a Loader orders its epochs itself.
    """

    def __init__(self, loader: Loader) -> None:
        self._loader = weakref.ref(loader)  # no cycle: a dropped loader goes at once, with its threads

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        if loader is not None:
            loader.set_epoch(epoch)


def _setting(name: str) -> property:
    """A read-only view of one field of the loader's `LoaderConfig`; setting it says why it cannot be."""
    def refuse(self, value: Any) -> None:
        raise AttributeError(f"a loader's {name} is fixed when it is made (its thread makes batches ahead with it); "
                             f"make a new loader with {name}={value!r}")
    return property(lambda self: getattr(self._config, name), refuse, doc=f"The loader's {name} (read-only).")


class Loader:
    """Iterate to get one epoch of TensorDicts {image uint8 [B,3,H,W] channels_last, label, index, size}.

    `size` is each record's source image's original (height, width), int64 [B, 2]. A dataset with
    fields (format 1.1, from a label table) adds each of them by name, in its own dtype.
    The TensorDict (`host.Batch`) refuses iteration, so ``x, y = batch`` fails naming `as_tuple`;
    ``as_tuple=("image", "label")`` gives tuples of those tensors instead, DataLoader's way.

    Epochs: the next iteration serves the next epoch as soon as the last batch of an epoch has
    been handed out, whether or not the consumer goes on to exhaust the iterator (Lightning,
    `islice` and `zip` stop after `len(loader)` batches). After a pass abandoned earlier (a
    `break`, a step cap, a peek) the next iteration serves the next epoch too, as a DataLoader
    reshuffles at each iter(). `set_epoch(e)` picks an epoch, as with DistributedSampler, and
    `load_state_dict` a position; either one overrides that move.

    Resume: `state_dict()` says which samples of the epoch have been served (`progress`), the
    same on every rank at the same step, so any rank may load rank 0's state, also with another
    world size or batch size: the samples not served yet are split among the new ranks.
    Seed: given, or drawn from torch's generator when the loader is made (a loader made anew orders
    anew; `torch.manual_seed` repeats a run); over several ranks a drawn seed becomes rank 0's when
    an epoch first starts (`agreed_seed`), and `load_state_dict` puts back the state's.
    The world (rank, world_size) is taken from `torch.distributed` each time an epoch starts,
    unless given, so a loader made before `init_process_group` splits the data all the same.
    Batches stay valid as long as you keep them (see `host.HostBuffers` and `device.CudaSink`).
    CUDA: a bare "cuda" is bound when the first pass starts (`bind_device`); a batch is ready on the
    stream current when `next()` returns, or on the one given to `iter(stream=s)` (`device`'s stream
    contract); wrap a CUDA graph capture in `paused()`.
    One consumer thread per loader: iterate it from one thread at a time.
    `locality="shard"` (with order="block") gives each rank its own rotating subset of the shard
    files every epoch instead of a slice of one global order (`order.shard_share`).
    Sampling (`sampling.py`): `indices=`, `weights=` with `replacement=`, `repeats=`, `samples_per_epoch=`
    and `order=` a callable ``(n, seed, epoch) -> indices`` make the epoch's global order a sequence of
    records that may repeat; the state then counts positions of it, so resume stays elastic.
    Its settings are a frozen `LoaderConfig` (`loader.config`), readable as attributes.
    """

    batch_size, order, drop_last = _setting("batch_size"), _setting("order"), _setting("drop_last")
    prefetch, num_threads, locality = _setting("prefetch"), _setting("num_threads"), _setting("locality")

    def __init__(self, dataset, batch_size: int, *, order: str | None = None, seed: int | None = None,
                 drop_last: bool = False, device: str | torch.device | None = None, prefetch: int = 2,
                 num_threads: int | None = None, rank: int | None = None, world_size: int | None = None,
                 locality: str | None = None, shuffle: bool | None = None,
                 as_tuple: tuple[str, ...] | None = None, indices: Any = None, weights: Any = None,
                 replacement: bool | None = None, repeats: int = 1, samples_per_epoch: int | None = None) -> None:
        sampling = {"indices": indices, "weights": weights, "replacement": replacement, "repeats": repeats,
                    "samples_per_epoch": samples_per_epoch}
        self._config = LoaderConfig.checked(batch_size, order=order, seed=seed, drop_last=drop_last, device=device,
                                            prefetch=prefetch, num_threads=num_threads, rank=rank,
                                            world_size=world_size, locality=locality, shuffle=shuffle,
                                            as_tuple=as_tuple, sorted_records=stored_sorted(dataset.manifest),
                                            records=len(dataset), sampling=sampling)
        if self._config.order == "block" and stored_sorted(dataset.manifest):
            warnings.warn(sorted_block_warning(dataset, self._config.batch_size), stacklevel=3)
        specs = field_specs(dataset.opened)
        unknown = [name for name in self._config.as_tuple or () if name != "image" and name not in specs]
        if unknown:
            raise ValueError(f"as_tuple names {unknown}, which batches of {dataset.path} lack; they hold "
                             f"{['image', *specs]}")
        if dataset.opened.records is not None:  # in object storage: its cache must hold what runs ahead
            dataset.opened.records.check_room(self._config.batch_size, self._config.prefetch)
        self._dataset = dataset
        self._seed = draw_seed() if self._config.seed is None else self._config.seed
        self._seed_agreed = self._config.seed is not None  # a drawn one becomes rank 0's (`_agree_seed`)
        self._dataset_id = dataset.manifest.fingerprint
        self._position: tuple[int, list[progress.Round]] = (0, [])  # where the next iteration starts
        self._progress: tuple[int, list[progress.Round]] = (0, [])  # what state_dict() reports
        self._device = self._config.device  # bound, with the sink, when the first pass starts (`_bound_sink`)
        self._sink: Any = None
        self._paused = False
        self._threads = Threads(self.num_threads)
        weakref.finalize(self, self._threads.close)
        self._iteration = 0  # which iteration is the live one: an older iterator refuses to go on
        self._abandoned = False  # a pass began at the position and stopped before its epoch's end (`_run`)
        self._live: int | None = None  # the iteration whose pass is still open (its generator not closed)
        self._meter = self._new_meter()
        self.sampler, self.batch_sampler = EpochHook(self), None  # what Lightning reads (EpochHook)

    @property
    def config(self) -> LoaderConfig:
        return self._config

    def _device_now(self) -> torch.device | None:
        return bind_device(self._device)

    device = property(_device_now, _setting("device").fset,
                      doc="""Where batches go (read-only): None for host memory, else a CUDA device. A bare "cuda" is
                      bound to the current device of the thread that starts the first pass; until then this
                      names the device current now.""")

    def _bound_sink(self) -> Any:
        """Where batches land (`host.HostSink` or `device.CudaSink`), made when the first pass starts: a bare
        "cuda" is bound then, on the consumer's thread, after a training script's `set_device`."""
        if self._sink is None:
            self._device = bind_device(self._device)
            self._sink = _sink_class(self._device)(self._device, self.prefetch + 2, self.batch_size,  # ahead, held,
                                                   self.dataset.record_shape, field_specs(self.dataset.opened))  # gone
        return self._sink

    @property
    def seed(self) -> int:
        """The seed of the epochs' order (read-only): the one given, else drawn from torch's generator when the
        loader was made; rank 0's on every rank once an epoch starts under a process group; a loaded state's."""
        return self._seed

    @seed.setter
    def seed(self, value: Any) -> None:
        _setting("seed").fset(self, value)

    def _use_seed(self, seed: int) -> None:
        """Order the coming epochs with `seed`; a producer already making batches with another one goes."""
        if seed != self._seed:
            self._threads.stop_producer()
            self._seed = seed

    def _agree_seed(self, world_size: int) -> None:
        """Before a drawn seed orders an epoch over several ranks, make it rank 0's on every rank."""
        seeded = self.order != "sequential" or self.sampling is not None  # sequential alone uses no seed
        if not self._seed_agreed and world_size > 1 and seeded:
            self._use_seed(agreed_seed(self._seed, world_size))
            self._seed_agreed = True

    @property
    def dataset(self):
        """The `MemmapDataset` served (read-only, like the settings)."""
        return self._dataset

    @property
    def rank(self) -> int:
        return resolve_world(*self._config.world)[0]

    @property
    def world_size(self) -> int:
        return resolve_world(*self._config.world)[1]

    @property
    def epoch(self) -> int:
        """The epoch being served while a pass is open, else the epoch the next iteration serves (the next
        one after a pass left before its end, see `_run`)."""
        return self._position[0] + (self._abandoned and self._live is None)

    def _split(self) -> progress.Split:
        return progress.Split(self.world_size, self.batch_size, self.drop_last, self.locality)

    def __repr__(self) -> str:
        device = f", device={str(self.device)!r}" if self.device is not None else ""
        return (f"Loader({str(self.dataset.path)!r}, batch_size={self.batch_size}, order={self.order!r}, "
                f"seed={self.seed}, drop_last={self.drop_last}{device}, epoch={self.epoch}, batches={len(self)})")

    @property
    def sampling(self) -> samplers.Sampling | None:
        """The sampling options (indices, weights, repeats, samples_per_epoch, an order callable), or None."""
        return self._config.sampling

    def _epoch_spec(self, epoch: int, seed: int | None = None) -> progress.Epoch:
        return progress.Epoch(len(self.dataset), self.order, self.seed if seed is None else seed, epoch,
                              self.dataset.manifest.records_per_shard, self.sampling)

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank (a resumed epoch serves what it has left)."""
        share = orders.share_length(self._epoch_spec(self.epoch).length(), self.world_size, self.batch_size,
                                    self.drop_last, **self._locality())
        return orders.batch_count(share, self.batch_size)

    def _locality(self) -> dict[str, Any]:
        if self.locality is None:
            return {}
        return {"locality": self.locality, "records_per_shard": self.dataset.manifest.records_per_shard}

    def _planner(self, rank: int) -> progress.Planner:
        return progress.Planner(len(self.dataset), self.order, self.seed, self.dataset.manifest.records_per_shard, rank,
                                self.sampling)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration serve `epoch` from its start, or from where `load_state_dict`
        left it when `epoch` is the epoch being resumed (so a loop that calls set_epoch at the
        top of every epoch resumes mid-epoch, not from its start)."""
        epoch = check_int("epoch", epoch, 0)
        self._iteration += 1  # a paused iterator must not overwrite the epoch chosen here
        self._abandoned = False  # the epoch is chosen here, not moved on from a pass left half-way
        if epoch != self._position[0] or not self._position[1]:
            self._position = self._progress = (epoch, [])

    def state_dict(self) -> dict[str, Any]:
        """Which samples of which epoch have been served (`progress`), and what fixes the order."""
        epoch, rounds = self._progress
        return {"dsc_loader_state": STATE_VERSION, "dataset": self._dataset_id,
                "dataset_version": self.dataset.version, "count": len(self.dataset),
                "order": self.order, "order_version": orders.ORDER_VERSION, "seed": self.seed, "epoch": epoch,
                "rounds": [r.to_dict() for r in rounds], "sampling": self._sampling_id()}

    def _sampling_id(self) -> str | None:
        return None if self.sampling is None else self.sampling.fingerprint()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` (from any rank, any world size or batch size) says the epoch got to; a loader
        made without a seed takes the state's (one given must be the state's)."""
        epoch, rounds = self._parse_state(state)
        seed = self.seed if self._config.seed is not None else check_int("seed", state.get("seed"), 0)
        progress.check_rounds(self._epoch_spec(epoch, seed), rounds)  # before any replay: O(rounds), refuses the absurd
        if self._config.seed is None:
            self._use_seed(seed)
            self._seed_agreed = True  # every rank loads the same state
        self._position = self._progress = (epoch, rounds)
        self._iteration += 1  # a paused iterator must not overwrite the position loaded here
        self._abandoned = False
        if rounds:
            self._warn_cut_off(epoch, rounds)

    def _warn_cut_off(self, epoch: int, rounds: list[progress.Round]) -> None:
        """Warn when a consumer that ends the resumed epoch the way Lightning does would skip samples.

        Lightning reads len(loader) before it loads this state, counts the batches taken before the
        checkpoint (every round's) and ends the epoch after len(loader) batches in all: with a larger
        world or batch size the rest of the epoch needs more batches than that, and no loader can serve
        them inside that count (a loop that iterates the loader to its end gets them all).
        """
        taken, whole = sum(r.batches for r in rounds), len(self)
        if taken >= whole:  # Lightning's count is already reached: it goes on until the pass ends (measured)
            return
        budget, split = whole - taken, self._split()
        if rounds == [progress.Round(split, taken)]:  # the epoch's own split goes on: its rest is `budget` batches
            return
        skipped, left = progress.cut_off(self._epoch_spec(epoch), rounds, split, budget)
        if skipped > 0:
            saved = rounds[-1].split
            warnings.warn(
                f"this loader state was saved on {saved.world_size} rank(s) with batch_size={saved.batch_size} after "
                f"{taken} batches of epoch {epoch}, and is resumed on {split.world_size} rank(s) with batch_size="
                f"{split.batch_size}: Lightning, which ends an epoch after len(loader)={whole} batches counting "
                f"those {taken}, takes {budget} more per rank and will skip {skipped} of the {left} samples epoch "
                f"{epoch} has left (the later epochs are whole). To serve them all, resume with the saved world size "
                "and batch size, or from a checkpoint saved at an epoch's end; a loop that iterates the loader to "
                "its end (torchrun, Accelerate) serves them all and skips nothing", stacklevel=3)

    def _parse_state(self, state: Any) -> tuple[int, list[progress.Round]]:
        if not isinstance(state, dict):
            raise ValueError(f"a loader state is a dict from Loader.state_dict(), got {type(state).__name__}")
        if "rounds" not in state and "batch" in state:  # saved by dsc 0.1: one per rank, no fingerprint
            self._check_same_order(state, ("order", "seed", "count", "sampling"))
            batch = check_int("batch", state.get("batch"), 0)
            fields = {k: state.get(k) for k in ("world_size", "batch_size", "drop_last", "locality")}
            rounds = [progress.Round.from_dict({**fields, "batches": batch})] if batch else []
        elif state.get("dsc_loader_state") == STATE_VERSION:
            self._check_same_version(state)
            self._check_same_order(state, ("order", "seed", "count", "dataset", "sampling"))
            if not isinstance(state.get("rounds"), list):
                raise ValueError(f"a loader state's rounds must be a list, got {state.get('rounds')!r}")
            rounds = [progress.Round.from_dict(r) for r in state["rounds"]]
        else:
            raise ValueError(f"not a dsc loader state of version {STATE_VERSION}: keys {sorted(state)}")
        epoch = check_int("epoch", state.get("epoch"), 0)
        progress.check_order_version(state.get("order_version", 1), self.order, epoch, rounds, self._split())
        for r in rounds:
            try:
                orders.check_locality(self.order, r.split.locality)
            except ValueError as e:
                raise ValueError(f"a round of this loader state cannot be replayed: {e}") from e
        return epoch, rounds

    def _check_same_version(self, state: dict[str, Any]) -> None:
        """A state names the dataset version it read (format 1.3, `dsc append`): resuming on another one is
        refused, saying how to go on, since the epoch's order is a permutation of that version's records."""
        saved, ours = state.get("dataset_version", 1), self.dataset.version
        if saved != ours:
            path = str(self.dataset.path)
            raise ValueError(
                f"this loader state was saved reading version {saved!r} of {path}, and this loader reads version "
                f"{ours}: its epoch's order is of version {saved}'s records. To continue exactly, read that version: "
                f"MemmapDataset({path!r}, version={saved!r}); to train on version {ours}, start its epochs afresh "
                "(do not load this state)")

    def _check_same_order(self, state: dict[str, Any], keys: tuple[str, ...]) -> None:
        ours = {"order": self.order, "seed": self.seed, "count": len(self.dataset), "dataset": self._dataset_id,
                "sampling": self._sampling_id()}
        keys = keys if self._config.seed is not None else tuple(k for k in keys if k != "seed")  # drawn: the state's
        wrong = {k: (state.get(k), ours[k]) for k in keys if state.get(k) != ours[k]}
        if wrong:
            raise ValueError(f"this state belongs to another epoch order, (saved, ours): {wrong}. A resumed epoch "
                             "keeps its dataset, order and seed; world size and batch size may change")

    def __iter__(self) -> Iterator[Batch | tuple[torch.Tensor, ...]]:
        return self._run(None)

    def iter(self, stream: torch.cuda.Stream | None = None) -> Iterator[Batch | tuple[torch.Tensor, ...]]:
        """A pass like `iter(loader)`, whose CUDA batches are ready on `stream` rather than on the stream
        current when `next()` returns: for a step that runs inside `torch.cuda.stream(stream)` while the
        loop itself (and so `next()`) runs on another one. Only the stream a batch is handed to waits for
        its upload and keeps its memory from the next upload (`device.ready_on`)."""
        if stream is not None and self._config.device is None:
            raise ValueError("stream= is for a loader with a CUDA device; this one gives host batches")
        if stream is not None and torch.device(stream.device) != self.device:
            raise ValueError(f"stream= is on {stream.device}, but this loader's batches go to {self.device}")
        return self._run(stream)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Keep the producer thread from making any CUDA call inside this block: wrap a CUDA graph capture in it.

        `torch.cuda.graph` and `make_graphed_callables` capture in CUDA's "global" mode, in which a
        capture-unsafe call on any other thread (an event wait, a cudaMalloc), such as the producer makes
        for every batch, invalidates the capture. The upload in progress finishes first; no batch is handed
        out inside (take the one to capture with before). `torch.cuda.graph(g,
        capture_error_mode="thread_local")` checks the capturing thread only and needs no pause.
        """
        self._paused = True
        try:
            with self._sink.paused() if self._sink is not None else contextlib.nullcontext():
                yield
        finally:
            self._paused = False

    def _start_pass(self) -> tuple[progress.Pass, Producer | None]:
        """The pass the loader's position asks for, and the producer making it: the running one when it
        is already making exactly that (the epoch after the one it finished), else a new one."""
        if self.drop_last and len(self) == 0:  # the epoch still moves on: a training loop must not spin
            samples = self._epoch_spec(self.epoch).length()
            what = (f"the {len(self.dataset)} records" if self.sampling is None else
                    f"epoch {self.epoch}'s {samples} samples (of the sampling options)")
            warnings.warn(f"drop_last=True, but {what} split over {self.world_size} rank(s) give each rank fewer "
                          f"than batch_size={self.batch_size}: this epoch is empty; lower batch_size or keep the "
                          "last partial batch (drop_last=False)", stacklevel=3)
        if self.drop_last and self.locality is not None:  # unequal shard groups: what every epoch leaves out
            dropped = orders.dropped_by_locality(len(self.dataset), self.dataset.manifest.records_per_shard,
                                                 self.world_size, self.batch_size)
            if dropped:
                warnings.warn(dropped, stacklevel=3)
        sink = self._bound_sink()
        split = self._split()
        self._agree_seed(split.world_size)
        epoch, rounds = self._position
        done, start = progress.resume_point(rounds, split)
        planner, threads = self._planner(self.rank), self._threads
        fresh = planner.fresh(epoch, split) if not (done or start) else None
        if fresh is not None and fresh == threads.next_pass and threads.producer is not None \
                and threads.producer.alive:
            threads.next_pass = None
            return fresh, threads.producer
        threads.stop_producer()
        p, share = planner.plan(epoch, done, split, start)
        if p.count > start:  # a pass with nothing to serve needs no producer
            make = batch_maker(sink, self.dataset.opened, threads.pool, self.num_threads, self.batch_size,
                               self.order, self.seed, self.prefetch,
                               following=lambda q: planner.plan(q.epoch + 1, [], q.split, 0)[1])  # as `jobs` goes on
            threads.producer = Producer(make, planner.jobs(p, share), self.prefetch, sink.prepare_thread)
        return p, threads.producer

    def _run(self, stream: torch.cuda.Stream | None) -> Iterator[Batch | tuple[torch.Tensor, ...]]:
        """One pass, bound to the loader's position when it starts (its first batch is asked for, so
        a framework may call set_epoch between iter() and next()); it hands out the batches and keeps
        the state and the epoch in step with them. A later pass, set_epoch or load_state_dict
        replaces it. A pass that starts after one abandoned before its end (a `break`, a step cap, a
        peek) serves the next epoch, as DataLoader(shuffle=True) gives a new order at each iter():
        a loop that stops every epoch early and never calls set_epoch must not train on the same
        first batches forever. set_epoch and load_state_dict say where to go instead (Lightning calls
        set_epoch before every training epoch and validation, so its sanity-check peek eats nothing)."""
        self._iteration += 1
        iteration = self._iteration
        if self._abandoned:
            self._position = (self._position[0] + 1, [])
        p, producer = self._start_pass()
        self._abandoned = True  # until the epoch's last batch is handed out
        self._progress = (p.epoch, [*p.done, *([progress.Round(p.split, p.start)] if p.start else [])])
        finished = p.start >= p.count  # nothing (left) to serve, e.g. drop_last with fewer samples than ranks
        if finished:
            self._position = self._progress = (p.epoch + 1, [])
            self._abandoned = False
        tracker = PassTracker()  # tells Accelerate's gradient accumulation where the epoch ends
        self._live = iteration
        try:
            for b in range(p.start, p.count):
                self._check_live(iteration)
                if self._paused:
                    raise LoaderError("next() inside loader.paused(): no batch is handed out while the producer is "
                                      "held for a graph capture; take the batch before the pause")
                describe = f"batch {b} of epoch {p.epoch} (rank {p.rank}/{p.split.world_size})"
                batch = self._sink.hand_over(producer.take((p, b), describe, self._meter), stream)
                fits.mark(batch, self.dataset.fit)  # for the transforms that need one fit (`dsc.fits`)
                if self._config.as_tuple is not None:
                    batch = tuple(batch[name] for name in self._config.as_tuple)
                if b + 1 < p.count:
                    self._progress = (p.epoch, [*p.done, progress.Round(p.split, b + 1)])
                else:  # the epoch's last batch is out: whatever the consumer does next, the next epoch comes next
                    finished, self._abandoned = True, False
                    self._position = self._progress = (p.epoch + 1, [])
                    self._threads.next_pass = self._planner(p.rank).fresh(p.epoch + 1, p.split)  # producer's next
                    tracker.last_batch()
                yield batch
        finally:
            tracker.end()
            if self._live == iteration:
                self._live = None
            if not finished and self._threads.producer is producer:  # abandoned: what it made is unwanted
                self._threads.stop_producer()

    def _check_live(self, iteration: int) -> None:
        if iteration != self._iteration:
            raise LoaderError("this iterator was replaced: another pass over the loader started, or set_epoch or "
                              "load_state_dict was called, since it began; only the newest pass serves batches")

    def stats(self, reset: bool = False) -> LoaderStats:
        """How long the consumer waited for batches, and what making them cost (`LoaderStats`)."""
        records = self.dataset.opened.records
        stats = self._meter.stats(records.stats if records is not None else None)
        if reset:
            self._meter = self._new_meter()
        return stats

    def _new_meter(self) -> Meter:
        records = self.dataset.opened.records
        return Meter(network=dataclasses.replace(records.stats) if records is not None else None)

    def close(self) -> None:
        """Stop the producer thread and the copy pool now (they also stop when the loader is collected)."""
        self._threads.close()
