"""dsc.transforms, dsc.eval_transforms and dsc.augment on a CUDA batch against the same calls on the CPU.

The README promises that a seed gives the same crops and flips on CPU and GPU (every random number is
drawn on the CPU), that the transforms cost no host sync, and that the policies' and kornia's draws are
the same on any device. Skipped without CUDA (our machines and CI have none; a GPU session runs it, see
scripts/gpu_checks.sh); every case compares a real loader batch moved to the GPU with the CPU's result.

How close is "the same": crops, flips and centre crops copy pixels, so they are equal. Resampling and
Normalize compute in float32, where CPU and CUDA kernels may sum in another order (and fuse a multiply
and an add), so a value that lands next to a half level can round the other way: one level of uint8, or
float32's rounding. A wrong box, axis or filter weight is off by far more than that.
"""

from __future__ import annotations

import time

import pytest
import torch

import dsc
from dsc import eval_transforms as E
from dsc import transforms as T
from dsc.testing import make_image_folder

from conftest import SLEEP_CYCLES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# name -> (the transform, whether it is called with sizes=batch["size"], the largest difference allowed)
CASES = {
    "RandomCrop": (lambda: T.RandomCrop(28, padding=2), False, 0),
    "RandomHorizontalFlip": (lambda: T.RandomHorizontalFlip(), False, 0),
    "RandomResizedCrop": (lambda: T.RandomResizedCrop(24), False, 1),
    "RandomResizedCrop bicubic antialias": (
        lambda: T.RandomResizedCrop(20, interpolation="bicubic", antialias=True), False, 1),
    "RandomResizedCrop original sizes": (lambda: T.RandomResizedCrop(24, original_sizes=True), True, 1),
    "Resize": (lambda: E.Resize(20, allow_stretched=True), False, 1),
    "CenterCrop": (lambda: E.CenterCrop(20, allow_stretched=True), False, 0),
    "OriginalCenterCrop": (lambda: E.OriginalCenterCrop(24, resize=28), True, 1),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict[str, torch.Tensor]:
    """16 real images of varied original sizes, compiled stretched to 32x32: one loader batch, copied out."""
    root = tmp_path_factory.mktemp("cuda_transforms")
    make_image_folder(root / "src", classes=2, per_class=8, size=(40, 72), seed=9)
    dsc.compile_folder(root / "src", root / "ds", size=(32, 32), fit="stretch", workers=1)
    served = next(iter(dsc.MemmapDataset(root / "ds").loader(16, order="sequential")))
    return {key: served[key].clone(memory_format=torch.preserve_format) for key in ("image", "size", "label")}


@pytest.fixture(scope="module")
def cuda_batch(batch) -> dict[str, torch.Tensor]:
    return {key: value.cuda() for key, value in batch.items()}


def run(case: str, images: torch.Tensor, sizes: torch.Tensor, seed: int) -> torch.Tensor:
    make, with_sizes, _ = CASES[case]
    generator = torch.Generator().manual_seed(seed)
    transform = make()
    return transform(images, generator, sizes=sizes) if with_sizes else transform(images, generator)


@pytest.mark.parametrize("case", CASES)
def test_a_seed_gives_the_same_result_on_cuda_as_on_the_cpu(case: str, batch, cuda_batch) -> None:
    tolerance = CASES[case][2]
    for seed in range(3):
        cpu = run(case, batch["image"], batch["size"], seed)
        gpu = run(case, cuda_batch["image"], cuda_batch["size"], seed)
        assert gpu.device == cuda_batch["image"].device and gpu.dtype == cpu.dtype == torch.uint8
        assert gpu.shape == cpu.shape and gpu.is_contiguous(memory_format=torch.channels_last)
        difference = (gpu.cpu().int() - cpu.int()).abs().max().item()
        assert difference <= tolerance, f"{case}, seed {seed}: pixels differ by up to {difference} levels"


def test_normalize_on_cuda_equals_the_cpu_within_float32_rounding(batch, cuda_batch) -> None:
    normalize = T.Normalize(MEAN, STD)
    cpu, gpu = normalize(batch["image"]), normalize(cuda_batch["image"])
    assert gpu.device.type == "cuda" and gpu.dtype == cpu.dtype == torch.float32
    torch.testing.assert_close(gpu.cpu(), cpu)  # torch's float32 tolerances: rtol 1.3e-6, atol 1e-5


@pytest.mark.parametrize("case", CASES)
def test_no_transform_makes_the_host_wait_for_the_gpu(case: str, cuda_batch) -> None:
    """Two checks. torch's sync debug mode "error" raises at any synchronising call it knows; it does not
    know every one (a non_blocking copy from memory that is not pinned waits without being flagged), so the
    host's time for the call is also measured while the GPU is kept busy ahead of it: a call that waits
    for the GPU takes at least what is left of that wait (the sleep, timed on the GPU by events)."""
    images, sizes = cuda_batch["image"], cuda_batch["size"]
    run(case, images, sizes, seed=0)  # first calls: kernels loaded, the pinned-memory cache filled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = T.Normalize(MEAN, STD)(run(case, images, sizes, seed=0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device == images.device and out.dtype == torch.float32
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(10 * SLEEP_CYCLES)
    end.record()
    started = time.perf_counter()
    T.Normalize(MEAN, STD)(run(case, images, sizes, seed=1))
    host_s = time.perf_counter() - started
    torch.cuda.synchronize()
    asleep_s = begin.elapsed_time(end) / 1e3
    assert host_s < asleep_s / 2, f"{case}: the call took {host_s:.3f} s on the host while the GPU slept " \
                                  f"{asleep_s:.3f} s: it waited for the GPU"


def _mixed_draws(policy, shape, A):
    """The policy's draws for the first seed whose batch has rows drawn Identity only and rows that drew an
    operation (searched on the CPU, so the same seed every run): both kinds of row are then checked."""
    for seed in range(1000):
        params = policy.draw(shape, torch.Generator().manual_seed(seed))
        identity_only = (params.ops == A.OPS.index("Identity")).all(1)
        if identity_only.any() and not identity_only.all():
            return params, identity_only
    raise AssertionError(f"no seed below 1000 gives {type(policy).__name__} both kinds of row")


def test_the_policies_run_each_drawn_operation_on_cuda_on_the_rows_that_drew_it(batch, cuda_batch) -> None:
    """RandAugment and friends draw on the CPU (`draw`), then run each operation on the rows that drew it,
    on the batch's device: on CUDA the same rows change as on the CPU, and a row drawn Identity only not at
    all. (Pixels are not compared: kornia's float ops may round otherwise on another device, README.)"""
    A = pytest.importorskip("dsc.augment")
    for policy in (A.RandAugment(), A.TrivialAugmentWide(), A.AutoAugment()):
        who = type(policy).__name__
        params, identity_only = _mixed_draws(policy, batch["image"].shape, A)
        cpu = policy.apply(batch["image"], params)
        gpu = policy.apply(cuda_batch["image"], params)
        assert gpu.device == cuda_batch["image"].device and gpu.dtype == torch.uint8, who
        assert gpu.is_contiguous(memory_format=torch.channels_last) and gpu.shape == cpu.shape, who
        changed_cpu = (cpu != batch["image"]).flatten(1).any(1)
        changed_gpu = (gpu.cpu() != batch["image"]).flatten(1).any(1)
        assert not changed_gpu[identity_only].any(), f"{who} changed a row drawn Identity only on CUDA"
        assert changed_cpu[~identity_only].any(), f"{who}: no drawn operation changed a row (a vacuous case)"
        assert torch.equal(changed_gpu, changed_cpu), f"{who}: rows changed on CUDA {changed_gpu.tolist()}, " \
                                                      f"on the CPU {changed_cpu.tolist()}"


def test_kornia_draws_are_the_same_on_cuda_as_on_the_cpu(batch, cuda_batch) -> None:
    """kornia's parameters (factors, boxes, partners, weights) come from the seed alone, not the device."""
    A = pytest.importorskip("dsc.augment")
    # (the transform, whether it takes the batch after Normalize, as the README's recipe puts it)
    for make, normalized in ((lambda: A.ColorJitter(0.4, 0.4, 0.4, 0.1), False),
                             (lambda: A.RandomErasing(p=1.0), True)):
        cpu_t, gpu_t = make(), make()
        x, y = ((T.Normalize(MEAN, STD)(b["image"]) if normalized else b["image"]) for b in (batch, cuda_batch))
        cpu_t(x, torch.Generator().manual_seed(2))
        out = gpu_t(y, torch.Generator().manual_seed(2))
        assert out.device == y.device and out.dtype == y.dtype
        compare_params(cpu_t.module._params, gpu_t.module._params, repr(cpu_t.module))
    labels = batch["label"].long()
    for seed in range(4):  # MixUp on some seeds, CutMix on the others
        mixer_cpu, mixer_gpu = A.MixUpCutMix(2), A.MixUpCutMix(2)
        images_cpu, targets_cpu = mixer_cpu(T.Normalize(MEAN, STD)(batch["image"]), labels,
                                            torch.Generator().manual_seed(seed))
        images_gpu, targets_gpu = mixer_gpu(T.Normalize(MEAN, STD)(cuda_batch["image"]), labels.cuda(),
                                            torch.Generator().manual_seed(seed))
        assert images_gpu.device.type == targets_gpu.device.type == "cuda"
        torch.testing.assert_close(targets_gpu.cpu(), targets_cpu)


def compare_params(cpu: dict, gpu: dict, who: str) -> None:
    assert cpu.keys() == gpu.keys(), who
    for key, value in cpu.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(gpu[key].cpu(), value, msg=f"{who}: {key} differs")
