#!/usr/bin/env bash
# Set up everything, then run the main job: execute notebooks/01_quickstart.ipynb
# headless through the real Monarch kernel and print its outputs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/run_notebook.py notebooks/01_quickstart.ipynb "$@"
