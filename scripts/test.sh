#!/usr/bin/env bash
# Run the whole test suite (lint + tests) in .venv, setting it up first. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check dsc tests benchmarks examples
# Two test processes (pytest-xdist), each taking whole files so a file's fixtures are built once: most tests wait
# on subprocesses, servers and sleeps, so two share the 2 cores of CI (13 min instead of 21 here). DSC_TEST_WORKERS=0
# runs them in this one process.
.venv/bin/python -m pytest -n "${DSC_TEST_WORKERS:-2}" --dist loadfile "$@"
