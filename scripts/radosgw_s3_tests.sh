#!/usr/bin/env bash
# The object-storage tests (every tests/test_s3*.py, and tests/test_compile_s3.py: reading, compiling,
# appending and merging in a bucket) against Ceph's radosgw instead of moto, on loopback;
# scripts/radosgw_serve.sh starts it (and says what it needs). The OSD may hold up to 4 GiB
# (RADOSGW_MEMSTORE_BYTES) in memory: the compile tests leave their datasets in the bucket.
#
#   scripts/radosgw_s3_tests.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export RADOSGW_MEMSTORE_BYTES="${RADOSGW_MEMSTORE_BYTES:-4294967296}"
exec bash scripts/radosgw_serve.sh .venv/bin/python -m pytest -q tests/test_s3*.py tests/test_compile_s3.py "$@"
