#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI and the project's own machines have none):
#
#   bash scripts/gpu_checks.sh OUT [SRC]
#
# 1. the CUDA tests (test_cuda_path, test_cuda_transforms, the CUDA cases of test_loader, test_producer
#    and test_cli_tools) and a Lightning Trainer on the GPU stopped and resumed mid-epoch
#    (test_frameworks' one-process cases); it fails if a test skipped for want of CUDA, so a machine
#    without a working GPU cannot pass it;
# 2. SRC (an ImageFolder tree; default the bundled examples/images) compiled at 224, then
#    `dsc bench --device cuda` on it: the pinned host->device copy limit beside the loader's rows;
# 3. benchmarks/train_bench.py on it, merged with itself (`dsc merge`, no decoding) up to 16 times, to
#    4,096 records or more, so that an epoch holds many batches (needs torchvision): does a real
#    model's training wait for data? Its feeds: $TRAIN_FEEDS (default dsc,pre,dsch,b: beside the (b)
#    DataLoader, the ones that tell where a loop's time goes; add c for torchvision's ImageFolder,
#    which takes minutes).
#
# Each step's output goes to OUT (tests.log, bench.log, train.log) as well as the terminal; the exit
# status is the tests'. Run from the repository root with dsc importable (pip install -e . or PYTHONPATH).
set -uo pipefail
out=${1:?usage: bash scripts/gpu_checks.sh OUT [SRC]}
src=${2:-examples/images}
mkdir -p "$out" || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 - <<'EOF' 2>&1 | tee "$out/machine.log"
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"devices {torch.cuda.device_count()}: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
EOF

python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_path.py tests/test_cuda_transforms.py \
    tests/test_loader.py tests/test_producer.py tests/test_cli_tools.py \
    "tests/test_frameworks.py::test_lightning_epochs_differ_and_a_mid_epoch_resume_is_exact" \
    "tests/test_frameworks.py::test_lightning_resumed_with_another_batch_or_world_size_warns_with_what_it_skips[1-8]" \
    2>&1 | tee "$out/tests.log"
status=${PIPESTATUS[0]}
if grep -q "needs CUDA" "$out/tests.log"; then
    echo "gpu_checks: CUDA tests were skipped: this machine's torch sees no CUDA device" | tee -a "$out/tests.log"
    status=1
fi

python3 -m dsc compile "$src" "$work/ds" --size 224 2>&1 | tail -n 3 | tee "$out/compile.log"
python3 -m dsc bench "$work/ds" --device cuda 2>&1 | tee "$out/bench.log"
records=$(python3 -c "import sys, dsc; print(len(dsc.MemmapDataset(sys.argv[1])))" "$work/ds" 2>/dev/null)
if [ -z "$records" ] || [ "$records" -eq 0 ]; then
    echo "gpu_checks: $src gave no dataset to train on (see compile.log)"
    exit 1
fi
copies=$(( (4096 + records - 1) / records )); copies=$(( copies > 16 ? 16 : copies ))
if [ "$copies" -gt 1 ]; then
    python3 -m dsc merge $(for _ in $(seq "$copies"); do printf '%s ' "$work/ds"; done) "$work/train_ds" 2>&1 | tail -n 1
else
    ln -s "$work/ds" "$work/train_ds"
fi
python3 benchmarks/train_bench.py "$work/train_ds" "$src" --steps "${TRAIN_STEPS:-100}" --warmup 20 \
    --feeds "${TRAIN_FEEDS:-dsc,pre,dsch,b}" --workers "$(( $(nproc) > 12 ? 12 : $(nproc) ))" 2>&1 | tee "$out/train.log"
exit "$status"
