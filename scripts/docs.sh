#!/usr/bin/env bash
# Build the documentation site (docs/ -> site/) in strict mode: a broken link, a
# page missing from the navigation or an API reference that does not resolve fails.
# Installs the "docs" extras (mkdocs-material, mkdocstrings[python]) when missing.
# Uses .venv/bin/python when scripts/setup.sh made one, else $PY or python3.
# Extra arguments go to `mkdocs build`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -n "${PY:-}" ]; then :
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
if ! "$PY" -c 'import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python' 2>/dev/null; then
    echo "[docs] installing the docs extras"
    "$PY" -m pip install -q -e ".[docs]"
fi
export NO_MKDOCS_2_WARNING=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m mkdocs build --strict --site-dir site "$@"
