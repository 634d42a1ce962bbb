"""The loader inside real training stacks: a Lightning Trainer (one process and two with DDP), Accelerate
(two processes) and torchrun (two ranks, resumed on three), all on CPU with gloo.

Each runs an example of examples/frameworks (the README's code), stops mid-epoch, resumes from a
checkpoint saved before the stop, and must have trained on exactly the batches an uninterrupted
run serves (the plain reference loader's), rank by rank. The examples record what every rank
trained on (`--record`), one JSON line per step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import dsc
from dsc.reader import MemmapDataset
from dsc.reader.reference import reference_batches
from dsc.testing import make_image_folder

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples" / "frameworks"
BATCH = 4
EPOCHS = 3
JOB_TIMEOUT_S = 120  # each job takes 5-15 s here

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
psutil = pytest.importorskip("psutil")  # an Accelerate dependency


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """40 records: 10 batches an epoch on one rank, 5 on two, 4 (the last one short) on three."""
    root = tmp_path_factory.mktemp("frameworks")
    make_image_folder(root / "src", classes=4, per_class=10, size=(24, 32), seed=5)
    dsc.compile_folder(root / "src", root / "ds", size=(8, 8), records_per_shard=8, workers=1)
    return root / "ds"


def run(command: list[str], env: dict[str, str] | None = None) -> str:
    """Run a training job; one that hangs is stopped with SIGABRT, which makes every Python process of it
    print all its threads' stacks (faulthandler) into the failure message. The job's whole process tree
    is signalled: torchrun starts its workers in sessions of their own."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=EXAMPLES,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
    job = psutil.Process(proc.pid)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        signal_tree(job, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)  # time to print the stacks
        signal_tree(job, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{command[2:6]} hung for {JOB_TIMEOUT_S} s:\n{output[-12000:]}")
    finally:
        signal_tree(job, signal.SIGKILL)  # nothing of a job outlives it
    assert proc.returncode == 0, output[-6000:]
    return output


def signal_tree(process: psutil.Process, signum: int) -> None:
    with contextlib.suppress(psutil.Error):
        for p in [*process.children(recursive=True), process]:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signum)


def lightning(data: Path, out: Path, devices: int, *options: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / "lightning_train.py"), str(data), "--devices", str(devices),
            "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--record", str(out), *options]


def torchrun(script: str, data: Path, out: Path, ranks: int, *options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            str(EXAMPLES / script), str(data), "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
            "--record", str(out), *options]


def recorded(prefix: Path, ranks: int) -> list[list[dict]]:
    return [[json.loads(line) for line in Path(f"{prefix}.rank{r}").read_text().splitlines()] for r in range(ranks)]


def uninterrupted(data: Path, world: int) -> list[list[list[int]]]:
    """Per rank, every batch of EPOCHS epochs, as the plain reference loader serves them."""
    ds = MemmapDataset(data)
    return [[b["index"].tolist() for e in range(EPOCHS)
             for b in reference_batches(ds, BATCH, order="random", seed=0, epoch=e, rank=r, world_size=world)]
            for r in range(world)]


def trained_on(first: list[list[dict]], resumed: list[list[dict]], step: int) -> list[list[list[int]]]:
    """Per rank: the batches of the first run up to the checkpoint at `step`, then those of the resumed run."""
    return [[x["index"] for x in a if x["step"] < step] + [x["index"] for x in b] for a, b in zip(first, resumed)]


def stop_and_resume(job: Callable[..., list[str]], tmp_path: Path, ranks: int, every: int, stop: int,
                    checkpoint: str, env: dict[str, str] | None = None) -> tuple[list[list[dict]], list[list[dict]]]:
    """Run `job(record, *options)` to step `stop` saving a checkpoint every `every` steps, then again from
    `checkpoint`; what each run's ranks trained on."""
    run(job(tmp_path / "first", "--every", str(every), "--max-steps", str(stop), "--checkpoint-dir",
            str(tmp_path / "ck")), env)
    run(job(tmp_path / "resumed", "--resume", str(tmp_path / "ck" / checkpoint), "--checkpoint-dir",
            str(tmp_path / "ck2")), env)
    return recorded(tmp_path / "first", ranks), recorded(tmp_path / "resumed", ranks)


def test_lightning_epochs_differ_and_a_mid_epoch_resume_is_exact(data: Path, tmp_path: Path) -> None:
    first, resumed = stop_and_resume(lambda out, *o: lightning(data, out, 1, *o), tmp_path, 1, 4, 13, "step=12.ckpt")
    assert (resumed[0][0]["epoch"], resumed[0][0]["step"]) == (1, 12)  # 10 batches an epoch: mid-epoch 1
    got = trained_on(first, resumed, 12)
    assert got == uninterrupted(data, 1)
    epochs = [sorted(i for batch in got[0][e * 10:(e + 1) * 10] for i in batch) for e in range(EPOCHS)]
    assert all(e == list(range(40)) for e in epochs)  # every epoch covers the data once
    orders = [[i for batch in got[0][e * 10:(e + 1) * 10] for i in batch] for e in range(EPOCHS)]
    assert orders[0] != orders[1] != orders[2] != orders[0]


def test_lightning_ddp_on_two_processes_resumes_on_every_rank(data: Path, tmp_path: Path) -> None:
    """Lightning saves rank 0's loader state only and loads it on both ranks."""
    first, resumed = stop_and_resume(lambda out, *o: lightning(data, out, 2, *o), tmp_path, 2, 3, 8, "step=6.ckpt")
    assert [(r[0]["epoch"], r[0]["step"]) for r in resumed] == [(1, 6), (1, 6)]  # 5 batches an epoch
    assert trained_on(first, resumed, 6) == uninterrupted(data, 2)


@pytest.mark.parametrize("devices, batch", [(1, 8), (2, 4)])
def test_lightning_resumed_with_another_batch_or_world_size_warns_with_what_it_skips(
        data: Path, tmp_path: Path, devices: int, batch: int) -> None:
    """Lightning reads len(loader) before it loads the state, counts the 3 batches taken before the checkpoint
    and stops epoch 0 after len - 3 more. With batch 8 (or two ranks of 4) the 28 samples left need 4 batches
    (on every rank), len is 5: Lightning takes 2, and 12 of epoch 0's samples are never served. No framework-
    blind loader can serve them inside Lightning's count, so the loader says so when it loads the state, with
    the exact number, and no other epoch is touched."""
    run(lightning(data, tmp_path / "first", 1, "--every", "3", "--max-steps", "3", "--checkpoint-dir",
                  str(tmp_path / "ck")))
    command = lightning(data, tmp_path / "resumed", devices, "--resume", str(tmp_path / "ck" / "step=3.ckpt"),
                        "--checkpoint-dir", str(tmp_path / "ck2"), "--epochs", "2")
    output = run([*command[:command.index("--batch-size") + 1], str(batch),
                  *command[command.index("--batch-size") + 2:]])
    first, resumed = recorded(tmp_path / "first", 1)[0], recorded(tmp_path / "resumed", devices)
    epoch0 = [i for x in first for i in x["index"]] + [i for r in resumed for x in r if x["epoch"] == 0
                                                          for i in x["index"]]
    skipped = 40 - len(set(epoch0))
    assert (len(epoch0), skipped) == (28, 12)  # what Lightning does; the loader cannot change it
    assert len(epoch0) == len(set(epoch0))  # nothing served twice
    assert re.search(r"Lightning.* will skip 12 of the 28 samples epoch 0 has left", " ".join(output.split())), \
        output[-3000:]
    epoch1 = sorted(i for r in resumed for x in r if x["epoch"] == 1 for i in x["index"])
    assert epoch1 == list(range(40))  # the next epoch is whole


def test_lightning_sanity_check_and_limited_epochs_eat_no_epoch(data: Path) -> None:
    """A pass abandoned before its end makes the next one move on to the next epoch (issue 20), so the rule
    must leave Lightning alone: its sanity check peeks at 2 validation batches, and limit_train_batches stops
    every training epoch early; Lightning calls set_epoch before each, and that wins (a real Trainer)."""
    import lightning as L

    sys.path.insert(0, str(EXAMPLES))
    from common import loss_of, small_net

    seen: dict[str, list[tuple[int, list[int]]]] = {"train": [], "val": []}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = small_net(4)

        def train_dataloader(self):
            return MemmapDataset(data).loader(BATCH, order="random", seed=0)

        def val_dataloader(self):
            return MemmapDataset(data).loader(BATCH, order="random", seed=1)

        def training_step(self, batch, batch_idx):
            seen["train"].append((self.current_epoch, batch["index"].tolist()))
            return loss_of(self.net, batch)

        def validation_step(self, batch, batch_idx):
            seen["val"].append((self.current_epoch, batch["index"].tolist()))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(max_epochs=EPOCHS, limit_train_batches=3, num_sanity_val_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    trainer.fit(Module())
    ds = MemmapDataset(data)

    def epoch(seed: int, e: int) -> list[list[int]]:
        return [b["index"].tolist() for b in reference_batches(ds, BATCH, order="random", seed=seed, epoch=e)]

    assert [b for _, b in seen["train"]] == [b for e in range(EPOCHS) for b in epoch(0, e)[:3]]
    assert [b for _, b in seen["val"]] == epoch(1, 0)[:2] + [b for e in range(EPOCHS) for b in epoch(1, e)]


def test_accelerate_on_two_processes_saves_and_loads_the_loader_state(data: Path, tmp_path: Path) -> None:
    first, resumed = stop_and_resume(lambda out, *o: torchrun("accelerate_train.py", data, out, 2, *o), tmp_path,
                                     2, 3, 8, "step=6", env={"ACCELERATE_USE_CPU": "true"})  # else: one world each
    assert [(r[0]["epoch"], r[0]["step"]) for r in resumed] == [(1, 6), (1, 6)]
    assert trained_on(first, resumed, 6) == uninterrupted(data, 2)


def test_torchrun_two_ranks_resumed_on_three_serve_the_rest_of_the_epoch_once(data: Path, tmp_path: Path) -> None:
    """The example makes its loader before init_process_group: the world must still be two ranks."""
    run(torchrun("torchrun_train.py", data, tmp_path / "first", 2, "--every", "3", "--max-steps", "8",
                 "--checkpoint-dir", str(tmp_path / "ck")))
    first = recorded(tmp_path / "first", 2)
    assert [[x["index"] for x in rank] for rank in first] == [r[:8] for r in uninterrupted(data, 2)]
    run(torchrun("torchrun_train.py", data, tmp_path / "resumed", 3, "--resume", str(tmp_path / "ck" / "step=6.pt"),
                 "--checkpoint-dir", str(tmp_path / "ck2")))
    resumed = recorded(tmp_path / "resumed", 3)
    before = [i for rank in first for x in rank if x["step"] < 6 and x["epoch"] == 1 for i in x["index"]]
    after = [i for rank in resumed for x in rank if x["epoch"] == 1 for i in x["index"]]
    assert len(before) == 2 * BATCH  # step 5 was epoch 1's first batch on each of two ranks
    assert sorted(set(before + after)) == list(range(40))  # none lost
    assert len(before) + len(after) == 40 + 1  # 32 left on 3 ranks: 11 each, one sample padded
    later = [[x["index"] for x in rank if x["epoch"] == 2] for rank in resumed]
    assert later == [r[2 * 4:] for r in uninterrupted(data, 3)]  # then plain 3-rank epochs (4 batches each)


def test_the_readme_shows_the_code_the_tests_run() -> None:
    """Every line of the README's framework blocks (bar `...`) is a line of the example it names, in order."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n# (examples/frameworks/\w+\.py)[^\n]*\n(.*?)```", readme, re.S)
    assert {name for name, _ in blocks} == {f"examples/frameworks/{n}_train.py"
                                            for n in ("lightning", "accelerate", "torchrun")}
    for name, block in blocks:
        lines = iter((ROOT / name).read_text().splitlines())
        for line in block.splitlines():
            if line.strip() not in ("", "..."):
                assert any(line == source for source in lines), f"{name} has no line {line!r} here"
