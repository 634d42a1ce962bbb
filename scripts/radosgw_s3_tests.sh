#!/usr/bin/env bash
# The object-storage tests (tests/test_s3.py, test_s3_faults.py, test_s3_cache.py, test_s3_node_budget.py) against Ceph's radosgw
# instead of moto, on loopback; scripts/radosgw_serve.sh starts it (and says what it needs).
#
#   scripts/radosgw_s3_tests.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/radosgw_serve.sh .venv/bin/python -m pytest -q tests/test_s3.py tests/test_s3_faults.py tests/test_s3_cache.py tests/test_s3_node_budget.py "$@"
