#!/usr/bin/env bash
# The main job on the bundled examples: compile examples/images, read the dataset back, print speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/dsc compile examples/images examples/out --size 224 --force
.venv/bin/python examples/read_back.py examples/out
