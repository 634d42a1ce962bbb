"""The CUDA path end to end: the loader's uploads and dsc.transforms in a training step, with torch's
sync debug mode set to raise on any host<->device synchronisation; the stream contract, the ring's
reuse and record_stream under delayed uploads, graph capture beside the producer, device binding.
Skipped without CUDA (our machines and CI have none; a GPU session runs it). Every test counts the
batches it got and compares them with the reference batches, so a loader that yields nothing fails.
The ring's ordering rules are also checked on CPU, in CI, by tests/test_ring.py."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import dsc
from dsc import transforms as T
from dsc.reader import MemmapDataset
from dsc.reader.reference import reference_batches
from dsc.testing import make_image_folder

from conftest import SLEEP_CYCLES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KEYS = ("image", "label", "index", "size")


def assert_same_batches(got: list[dict], ref: list, keys: tuple[str, ...] = KEYS) -> None:
    """Every batch there and equal to the reference, in order (the host copy of each device tensor)."""
    assert len(ref) > 0 and len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        for key in keys:
            assert torch.equal(g[key].cpu(), r[key]), key


@pytest.fixture
def slow_uploads(monkeypatch) -> None:
    """Hold the sink's side stream up before every upload, so a consumer that does not wait for the upload
    reads its tensors before the copy lands, and a slot refilled before its copy ran corrupts a batch."""
    from dsc.reader.device import CudaSink

    real_fill = CudaSink.fill

    def slow_fill(self, fields, gather):
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        return real_fill(self, fields, gather)

    monkeypatch.setattr(CudaSink, "fill", slow_fill)


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> MemmapDataset:
    root = tmp_path_factory.mktemp("cuda")
    make_image_folder(root / "src", classes=3, per_class=8, size=(40, 56), seed=6)
    dsc.compile_folder(root / "src", root / "ds", size=(32, 32), fit="stretch", records_per_shard=5, workers=1)
    return MemmapDataset(root / "ds")


def test_a_training_step_fed_by_the_loader_and_the_transforms_never_syncs(ds: MemmapDataset) -> None:
    augment = T.Compose([T.RandomCrop(28, padding=2), T.RandomHorizontalFlip(), T.Normalize((0.5,) * 3, (0.25,) * 3)])
    crop = T.RandomResizedCrop(24, original_sizes=True)
    net = torch.nn.Conv2d(3, 4, 3).cuda()
    generator = torch.Generator().manual_seed(0)
    loader = ds.loader(4, order="random", device="cuda")
    for epoch in range(2):
        served = []
        torch.cuda.set_sync_debug_mode("error")  # next() and the whole step (process-wide: the producer too; its
        try:  # waits on events are no stream or device syncs)
            for batch in loader:
                x = augment(crop(batch["image"], generator, sizes=batch["size"]), generator)
                net(x).float().mean().backward()
                served.append(batch["index"])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert epoch + 1 == loader.epoch
        assert len(served) == len(loader) > 0 and sorted(torch.cat(served).tolist()) == list(range(len(ds)))
    torch.cuda.synchronize()


def test_the_consumer_stream_waits_for_a_slow_upload_and_the_ring_is_reused_only_after_it(
        ds: MemmapDataset, slow_uploads) -> None:
    """next() on a non-default consumer stream, the batch read there without a sync: only the event wait in
    `hand_over` makes it hold the right data. Batch 2 with prefetch 1 is 12 batches through a 3-slot ring
    per epoch, each slot refilled 3 times an epoch while its last upload may still be held up: only the
    RING REUSE RULE keeps a refill from overwriting a slot before its copy read it."""
    loader = ds.loader(2, order="block", device="cuda", prefetch=1)
    consumer = torch.cuda.Stream()
    for _epoch in range(2):
        ref = list(reference_batches(ds, 2, order="block", seed=loader.seed, epoch=loader.epoch))
        with torch.cuda.stream(consumer):
            copies = [{k: batch[k].clone() for k in KEYS} for batch in loader]
        consumer.synchronize()
        assert len(ref) == 12 > loader.prefetch + 2
        assert_same_batches(copies, ref)


def test_a_batch_is_ready_on_the_stream_given_to_iter(ds: MemmapDataset, slow_uploads) -> None:
    """The issue's loop: next() on the default stream, the step inside torch.cuda.stream(s). With
    loader.iter(stream=s), s (not the default stream) waits for each upload."""
    loader = ds.loader(2, order="block", device="cuda", prefetch=1)
    step = torch.cuda.Stream()
    ref = list(reference_batches(ds, 2, order="block", seed=loader.seed, epoch=0))
    copies = []
    for batch in loader.iter(stream=step):
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        with torch.cuda.stream(step):
            copies.append({k: batch[k].clone() for k in KEYS})
    step.synchronize()
    assert_same_batches(copies, ref)
    other = torch.cuda.Stream(device=torch.device("cuda", torch.cuda.current_device()))
    assert next(iter(loader.iter(stream=other)))["image"].device == loader.device


def test_a_dropped_batch_keeps_its_memory_while_its_stream_still_reads_it(ds: MemmapDataset, monkeypatch) -> None:
    """record_stream: batch 0 is read on the step stream behind a long sleep, then dropped; batch 2's fresh
    device tensors (same size, made on the side stream, whose copy does not wait for the step stream) would
    take batch 0's freed block, and its copy land before the read, were batch 0 not recorded on the step
    stream. The producer is held before batch 2 until batch 0 is gone."""
    from dsc.reader.device import CudaSink

    allowed = threading.Semaphore(2)  # batches 0 and 1 may be made; batch 2 when the test says
    real_fill = CudaSink.fill

    def gated_fill(self, fields, gather):
        assert allowed.acquire(timeout=60)
        return real_fill(self, fields, gather)

    monkeypatch.setattr(CudaSink, "fill", gated_fill)
    loader = ds.loader(4, order="sequential", device="cuda", prefetch=1)
    ref = list(reference_batches(ds, 4, order="sequential"))
    step = torch.cuda.Stream()
    it = loader.iter(stream=step)
    first = next(it)
    with torch.cuda.stream(step):
        torch.cuda._sleep(10 * SLEEP_CYCLES)  # the step stream is busy for a while ...
        late = first["image"].clone()  # ... and reads batch 0 only after that
    del first
    second = next(it)  # the iterator lets go of batch 0 here: it is free but for the step stream's use
    gc.collect()  # and no reference cycle keeps it alive, which would let the test pass without record_stream
    allowed.release(100)  # batch 2 and the rest may be made now
    rest = list(it)
    step.synchronize()
    assert torch.equal(late.cpu(), ref[0]["image"])
    assert_same_batches([second, *rest], ref[1:])


def test_a_graph_captured_in_global_mode_while_the_producer_runs(ds: MemmapDataset, slow_uploads) -> None:
    """torch.cuda.graph and make_graphed_callables capture in "global" mode: a cudaMalloc or an event wait on
    the producer thread would invalidate the capture (intermittently). Inside loader.paused() they succeed,
    with the producer mid-ring (slow uploads, a 3-slot ring), and the batches after are still right."""
    loader = ds.loader(2, order="block", device="cuda", prefetch=1)
    ref = list(reference_batches(ds, 2, order="block", seed=loader.seed, epoch=0))
    static = torch.zeros((2, 3, 32, 32), device="cuda")
    copies, captured = [], 0
    for b, batch in enumerate(loader):
        copies.append({k: batch[k].clone() for k in KEYS})
        if b % 3 == 1:
            net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4)).cuda()  # graphed once
            with loader.paused():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # capture_error_mode="global", torch's default
                    doubled = static * 2
                graphed = torch.cuda.make_graphed_callables(net, (static.clone().requires_grad_(),))
            static.copy_(batch["image"].float())
            graph.replay()
            assert torch.equal(doubled, batch["image"].float() * 2)
            graphed(static.clone().requires_grad_()).sum().backward()
            captured += 1
    torch.cuda.synchronize()
    assert captured == 4
    assert_same_batches(copies, ref)
def test_fields_of_every_dtype_arrive_on_the_device_with_the_batch(tmp_path) -> None:
    """Label-table fields (uint8 multi-hot, float32 vectors, int64) share one packed pinned upload."""
    src = make_image_folder(tmp_path / "src", classes=2, per_class=5, size=(20, 24), seed=2)
    names = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    table = tmp_path / "labels.csv"
    table.write_text("path,label,tags,box,year\n" + "".join(
        f"{n},{n.split('/')[0]},{'a;c' if k % 2 else 'b'},{k / 4};{k};{-k},{2000 + k}\n" for k, n in enumerate(names)))
    dsc.compile_folder(src, tmp_path / "ds", size=8, workers=1, records_per_shard=3, labels=table)
    fielded = MemmapDataset(tmp_path / "ds")
    device = torch.device("cuda", torch.cuda.current_device())
    cpu_batches = list(fielded.loader(4, order="random", seed=3))
    gpu_batches = list(fielded.loader(4, order="random", seed=3, device="cuda"))
    assert len(cpu_batches) == 3
    for cpu, gpu in zip(cpu_batches, gpu_batches, strict=True):
        for key in ("image", "label", "index", "size", "tags", "box", "year"):
            assert gpu[key].device == device and gpu[key].dtype == cpu[key].dtype, key
            assert torch.equal(gpu[key].cpu(), cpu[key]), key


def test_the_ring_is_pinned_at_its_exact_size_outside_the_caching_host_allocator(ds: MemmapDataset) -> None:
    """The caching host allocator rounds each block up to a power of two; the ring is pinned in place."""
    from dsc.reader.device import ring_layout

    before = torch.cuda.host_memory_stats()["active_bytes.current"]  # pinned blocks checked out of that allocator
    loader = ds.loader(4, order="sequential", device="cuda", prefetch=2)
    batches = [{k: b[k].clone() for k in KEYS} for b in loader]  # the first pass makes the ring
    sink = loader._sink
    assert sink.pinned.is_pinned() and all(slot.is_pinned() for slot in sink.images + sink.small)
    assert sink.pinned.numel() == ring_layout(4, 4 * 32 * 32 * 3, 4 * 4 * 8)[2]
    assert torch.cuda.host_memory_stats()["active_bytes.current"] == before
    assert_same_batches(batches, list(reference_batches(ds, 4, order="sequential")))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_bare_cuda_is_bound_when_the_first_pass_starts(ds: MemmapDataset) -> None:
    """A DDP script that makes its loader before set_device(local_rank) gets its batches on its own GPU."""
    torch.cuda.set_device(0)
    try:
        loader = ds.loader(4, order="sequential", device="cuda")
        torch.cuda.set_device(1)  # the script's set_device(local_rank), after the loader is made
        batches = list(loader)
        torch.cuda.set_device(0)
        assert loader.device == torch.device("cuda", 1)  # bound: a later set_device moves nothing
        batches += list(loader)
    finally:
        torch.cuda.set_device(0)
    assert all(b[k].device == torch.device("cuda", 1) for b in batches for k in KEYS)
    assert_same_batches(batches, 2 * list(reference_batches(ds, 4, order="sequential")))


def test_a_sticky_error_from_the_users_kernel_says_it_may_come_from_there(ds: MemmapDataset) -> None:
    """A device-side assert in the user's own step breaks the CUDA context; the loader's next CUDA call
    reports it. In a child process: the context stays broken."""
    script = f"""
import torch
from dsc.reader import MemmapDataset
loader = MemmapDataset({str(ds.path)!r}).loader(4, device="cuda", prefetch=1)
batches = iter(loader)
next(batches)
x = torch.zeros(4, device="cuda")
x[torch.tensor([10], device="cuda")] = 1  # out of bounds: a device-side assert, reported later
try:
    for _ in batches:
        pass
except RuntimeError as e:
    print("raised:", e)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent.parent)
    assert "raised:" in result.stdout, result.stderr
    assert "may come from your own kernels" in result.stdout, result.stdout
