#!/usr/bin/env bash
# Set up everything, then run the test suite (tests/). Extra arguments go to pytest.
# The exit status is pytest's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
