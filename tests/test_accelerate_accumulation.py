"""Accelerate's gradient accumulation over a dsc loader, with real Accelerate (one CPU process).

`Accelerator.accumulate()` steps the optimizer every `gradient_accumulation_steps` batches and on
a dataloader's last batch, then counts anew: a loader it has not `prepare`d must tell it where
an epoch ends, as its own DataLoaders do, or an epoch's last batches are accumulated with the
next epoch's first ones (2 epochs of 25 batches with 3 steps: 16 optimizer steps, not 18).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

import dsc
from dsc import MemmapDataset
from dsc.testing import make_image_folder

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

RECORDS, BATCH, STEPS, EPOCHS = 100, 4, 3, 2  # 25 batches an epoch


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> MemmapDataset:
    root = tmp_path_factory.mktemp("accumulate")
    make_image_folder(root / "src", classes=4, per_class=RECORDS // 4, size=(12, 16), seed=3)
    dsc.compile_folder(root / "src", root / "ds", size=(4, 4), workers=1)
    return MemmapDataset(root / "ds")


@pytest.fixture
def accelerator():
    """A fresh single-process Accelerator; its singletons are cleared after the test, as Accelerate's own
    test case does, so no state leaks into other tests."""
    yield accelerate.Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def optimizer_steps(accelerator, epochs: Iterable[Iterable]) -> list[tuple[int, int]]:
    """(epoch, batch) of every real optimizer step a plain `accumulate()` loop makes over `epochs`."""
    net = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    steps, at = [], [(0, 0)]
    optimizer.register_step_post_hook(lambda *_: steps.append(at[0]))  # runs only when Accelerate really steps
    net, optimizer = accelerator.prepare(net, optimizer)
    for epoch, batches in enumerate(epochs):
        for b, _ in enumerate(batches):
            at[0] = (epoch, b)
            with accelerator.accumulate(net):
                accelerator.backward(net(torch.ones(1, 1)).sum())
                optimizer.step()
                optimizer.zero_grad()
    return steps


def test_accumulate_steps_at_each_epoch_end_as_with_a_prepared_dataloader(dataset: MemmapDataset,
                                                                           accelerator) -> None:
    reference = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(RECORDS), batch_size=BATCH))
    want = optimizer_steps(accelerator, [reference] * EPOCHS)
    per_epoch = [*range(STEPS - 1, RECORDS // BATCH, STEPS), RECORDS // BATCH - 1]  # 2, 5, ..., 23, then 24
    assert want == [(e, b) for e in range(EPOCHS) for b in per_epoch] and len(want) == 18
    loader = dataset.loader(BATCH, order="sequential")
    assert accelerator.prepare(loader) is loader  # Accelerate leaves it as it is
    assert optimizer_steps(accelerator, [loader] * EPOCHS) == want
    assert accelerator.gradient_state.active_dataloader is None  # every pass let go when it ended


def test_an_abandoned_pass_lets_go_of_accelerates_state(dataset: MemmapDataset, accelerator) -> None:
    loader = dataset.loader(BATCH, order="sequential")
    for b, _ in enumerate(loader):
        assert not accelerator.gradient_state.end_of_dataloader
        if b == 3:
            break
    assert accelerator.gradient_state.active_dataloader is None
    *_, last = iter(loader)
    assert accelerator.gradient_state.active_dataloader is None


def test_dsc_does_not_import_accelerate(dataset: MemmapDataset) -> None:
    """A process that does not use Accelerate never loads it because of dsc."""
    code = ("import sys; from dsc import MemmapDataset; ds = MemmapDataset(sys.argv[1]); "
            "[b for b in ds.loader(8)]; assert 'accelerate' not in sys.modules, 'dsc imported accelerate'")
    subprocess.run([sys.executable, "-c", code, str(Path(dataset.path))], check=True, timeout=120)
