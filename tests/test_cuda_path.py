"""The CUDA path end to end: the loader's uploads and dsc.transforms in a training step, with torch's
sync debug mode set to raise on any host<->device synchronisation. Skipped without CUDA (our machines
and CI have none; a GPU session runs it)."""

from __future__ import annotations

import pytest
import torch

import dsc
from dsc import transforms as T
from dsc.reader import MemmapDataset
from dsc.reader.reference import reference_batches
from dsc.testing import make_image_folder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
        for batch in loader:
            torch.cuda.set_sync_debug_mode("error")  # the consumer's whole step; the producer may wait on events
            try:
                x = augment(crop(batch["image"], generator, sizes=batch["size"]), generator)
                net(x).float().mean().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert epoch + 1 == loader.epoch
    torch.cuda.synchronize()


def test_the_consumer_stream_waits_for_a_slow_upload(ds: MemmapDataset, monkeypatch) -> None:
    """The sink's side stream is held up before every upload (torch.cuda._sleep); a batch read on a
    non-default consumer stream without a sync must still hold the right data: only the event wait in
    `hand_over` makes it so."""
    from dsc.reader.device import CudaSink

    real_fill = CudaSink.fill

    def slow_fill(self, fields, gather):
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda._sleep(20_000_000)  # tens of milliseconds of GPU time before the copy starts
        return real_fill(self, fields, gather)

    monkeypatch.setattr(CudaSink, "fill", slow_fill)
    loader = ds.loader(4, order="block", device="cuda", prefetch=3)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        copies = [{k: batch[k].clone() for k in ("image", "label", "index", "size")} for batch in loader]
    consumer.synchronize()
    for got, ref in zip(copies, reference_batches(ds, 4, order="block"), strict=True):
        for key in ("image", "label", "index", "size"):
            assert torch.equal(got[key].cpu(), ref[key]), key


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
    for cpu, gpu in zip(fielded.loader(4, order="random", seed=3), fielded.loader(4, order="random", seed=3,
                                                                                   device="cuda")):
        for key in ("image", "label", "index", "size", "tags", "box", "year"):
            assert gpu[key].device == device and gpu[key].dtype == cpu[key].dtype, key
            assert torch.equal(gpu[key].cpu(), cpu[key]), key
