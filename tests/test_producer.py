"""The loader's producer thread and its sinks: one producer per loader, kept across epochs (no gap at
their edges), replaced when an iteration starts over; the wait meter; device resolution. CUDA tests skip
without CUDA (our machines have none); everything else runs on CPU with real threads."""

from __future__ import annotations

import itertools
import sys
import threading
import time

import pytest
import torch

from dsc.errors import LoaderError
from dsc.reader import MemmapDataset
from dsc.reader import producer as producer_module
from dsc.reader.reference import reference_batches

from conftest import tiny_dataset

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> MemmapDataset:
    return tiny_dataset(tmp_path_factory.mktemp("producer"), seed=4, records_per_shard=5)


def producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dsc-loader" and t.is_alive()]


def indices(batches) -> list[int]:
    return [i for b in batches for i in b["index"].tolist()]


def test_one_producer_serves_every_epoch_and_the_next_epoch_is_made_ahead(ds: MemmapDataset) -> None:
    before = len(producers())
    loader = ds.loader(4, order="random", seed=2, prefetch=2)
    seen, threads = [], set()
    for epoch in range(3):
        seen.append(indices(loader))
        threads.update(t.ident for t in producers())
        if epoch == 0:
            deadline = time.monotonic() + 5
            while loader._threads.producer._queue.qsize() < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert loader._threads.producer._queue.qsize() == 2  # epoch 1's first batches wait, made
    assert seen == [indices(reference_batches(ds, 4, order="random", seed=2, epoch=e)) for e in range(3)]
    assert len(producers()) == before + 1 and len(threads - {t.ident for t in producers()[:before]}) == 1
    loader.close()
    assert len(producers()) == before


def test_a_new_iteration_replaces_an_abandoned_one(ds: MemmapDataset) -> None:
    """A notebook keeps the traceback of a failed loop (and so its generator); the next loop must not
    share the producer with it, and the old iterator must not serve anything more."""
    before = len(producers())
    loader = ds.loader(4, order="random", seed=2)
    kept = []
    try:
        for batch in loader:
            kept.append(batch)
            raise ValueError("the user's loop fails")
    except ValueError:
        old = sys.exc_info()[2]  # the traceback holds the suspended generator
    first = iter(loader)  # after an abandoned pass the next one moves on (issue 20; it was epoch 0 again)
    assert indices(itertools.islice(first, 2)) == indices(reference_batches(ds, 4, order="random", seed=2,
                                                                             epoch=1))[:8]
    second = iter(loader)
    assert indices(second) == indices(reference_batches(ds, 4, order="random", seed=2, epoch=2))
    with pytest.raises(LoaderError, match="this iterator was replaced"):
        next(first)
    made_first = iter(loader)  # Lightning's order: iter(), then set_epoch, then the first batch
    loader.set_epoch(4)
    assert indices(made_first) == indices(reference_batches(ds, 4, order="random", seed=2, epoch=4))
    assert len(producers()) <= before + 1
    del old, kept


def test_set_epoch_or_a_loaded_state_restarts_the_producer_on_the_right_batches(ds: MemmapDataset) -> None:
    loader = ds.loader(4, order="random", seed=2)
    indices(loader)  # the producer now makes epoch 1 ahead
    loader.set_epoch(5)
    assert indices(loader) == indices(reference_batches(ds, 4, order="random", seed=2, epoch=5))
    other = ds.loader(4, order="random", seed=2)
    next(iter(other))
    state = other.state_dict()
    loader.load_state_dict(state)
    assert indices(loader) == indices(reference_batches(ds, 4, order="random", seed=2))[4:]


def test_an_iterator_made_but_never_started_does_not_mislead_the_next_one(ds: MemmapDataset) -> None:
    """Found by review: iter() for epoch 3 (never started) replaced the producer making epoch 1 ahead."""
    loader = ds.loader(4, order="random", seed=2)
    indices(loader)  # epoch 0; the producer goes on with epoch 1
    loader.set_epoch(3)
    iter(loader)  # e.g. zip(empty, loader), a framework's "is it iterable" probe
    loader.set_epoch(1)
    assert indices(loader) == indices(reference_batches(ds, 4, order="random", seed=2, epoch=1))


@pytest.mark.parametrize("change", ["set_epoch", "load_state_dict"])
def test_set_epoch_or_load_while_a_pass_is_paused_wins_over_it(ds: MemmapDataset, change: str) -> None:
    loader = ds.loader(4, order="random", seed=2)
    paused = iter(loader)
    next(paused)
    if change == "set_epoch":
        loader.set_epoch(5)
        expected = indices(reference_batches(ds, 4, order="random", seed=2, epoch=5))
    else:
        other = ds.loader(4, order="random", seed=2)
        next(iter(other))
        loader.load_state_dict(other.state_dict())
        expected = indices(reference_batches(ds, 4, order="random", seed=2))[4:]
    with pytest.raises(LoaderError, match="this iterator was replaced"):
        list(paused)  # finishing the old pass would have moved the loader to epoch 1
    assert indices(loader) == expected


def test_a_failed_batch_is_not_counted_as_handed_out(ds: MemmapDataset, monkeypatch) -> None:
    def failing(*args):
        raise OSError("disk on fire")

    monkeypatch.setattr(producer_module, "fill_parallel", failing)
    loader = ds.loader(4)
    with pytest.raises(LoaderError, match="disk on fire"):
        next(iter(loader))
    assert loader.stats().batches == 0


def test_the_wait_meter_tells_a_slow_producer_from_a_slow_consumer(ds: MemmapDataset, monkeypatch) -> None:
    loader = ds.loader(4, order="sequential", prefetch=2, num_threads=1)
    for _ in loader:
        time.sleep(0.02)  # training is the slow part: batches are ready when asked for
    fast = loader.stats(reset=True)
    assert fast.batches == len(loader) and fast.gather_s > 0
    assert fast.wait_fraction < 0.5 and fast.wall_s > 0.02 * (len(loader) - 1)
    real = producer_module.fill_parallel

    def slow(*args):
        time.sleep(0.02)
        return real(*args)

    monkeypatch.setattr(producer_module, "fill_parallel", slow)
    loader.set_epoch(3)
    for _ in loader:
        pass  # data is the slow part
    starved = loader.stats()
    assert starved.batches == len(loader) and starved.wait_fraction > 0.5
    assert starved.gather_s >= 0.02 * len(loader)
    assert "waited" in str(starved) and f"{starved.batches} batches" in str(starved)


def test_cuda_without_cuda_is_refused_where_the_loader_is_made(ds: MemmapDataset) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA.*leave device unset"):
        ds.loader(4, device="cuda")


def test_a_bare_cuda_is_not_bound_where_the_loader_is_made(ds: MemmapDataset, monkeypatch) -> None:
    """A DDP script may make its loader before torch.cuda.set_device(local_rank): "cuda" must follow the
    device current when the first pass starts, not the one current here. Runs on CPU: torch.cuda's
    availability and current device are stand-ins, and no pass starts (the sink is made then)."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    loader = ds.loader(4, device="cuda")  # made while device 0 is current, touching no CUDA
    assert loader.config.device == torch.device("cuda") and loader.device == torch.device("cuda", 0)
    current[0] = 1  # the script's set_device(local_rank)
    assert loader.device == torch.device("cuda", 1) and "device='cuda:1'" in repr(loader)
    assert ds.loader(4, device="cuda:0").device == torch.device("cuda", 0)
    with pytest.raises(AttributeError, match="a loader's device is fixed when it is made"):
        loader.device = "cuda:0"


def test_next_inside_a_pause_is_refused(ds: MemmapDataset) -> None:
    """A batch asked for while the producer is held for a graph capture would wait for ever (or be captured)."""
    loader = ds.loader(4, order="random", seed=2)
    it = iter(loader)
    next(it)
    with loader.paused(), pytest.raises(LoaderError, match=r"next\(\) inside loader.paused\(\)"):
        next(it)
    assert len(next(iter(loader))["index"]) == 4  # the loader serves again once the pause is over


def test_a_stream_is_refused_for_host_batches(ds: MemmapDataset) -> None:
    with pytest.raises(ValueError, match="stream= is for a loader with a CUDA device"):
        ds.loader(4).iter(stream=object())


@cuda
def test_cuda_resolves_to_the_current_device_and_fields_are_contiguous(ds: MemmapDataset) -> None:
    torch.cuda.set_device(0)
    loader = ds.loader(4, device="cuda")
    assert loader.device == torch.device("cuda", 0)
    batch = next(iter(loader))
    assert batch["image"].device == torch.device("cuda", 0)
    assert all(batch[k].is_contiguous() for k in ("label", "index", "size"))


def test_no_producer_outlives_a_dropped_loader(ds: MemmapDataset) -> None:
    before = len(producers())
    for _ in range(3):
        loader = ds.loader(4, order="random")
        indices(loader)
        del loader
    deadline = time.monotonic() + 5
    while len(producers()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(producers()) == before
