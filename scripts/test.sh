#!/usr/bin/env bash
# Run the whole test suite (lint + tests) in .venv, setting it up first. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check dsc tests benchmarks examples
.venv/bin/python -m pytest "$@"
