#!/usr/bin/env bash
# Static checks of the package: the import contracts of pyproject.toml, mypy, ruff
# ([tool.importlinter]: layers, no cycles, who may import ipykernel / ipywidgets),
# then the types ([tool.mypy]: any error fails). Exits non-zero when a check fails.
# Usage: scripts/check.sh   (VENV=DIR: the virtual environment to use, default .venv,
# with the `lint` extra installed: pip install -e '.[lint]')
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
for tool in lint-imports mypy ruff; do
    if [ ! -x "$venv/bin/$tool" ]; then
        echo "no $venv/bin/$tool: pip install -e '.[lint]' (or set VENV)" >&2
        exit 2
    fi
done
cd "$root"
status=0

# The tree being checked wins over an editable install of another checkout.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$venv/bin/lint-imports" --no-cache || status=1

# IPython's kernel parts (magics, the interactive shell) belong to monarch_kernel.kernel
# too; import-linter forbids external packages only as a whole, and the worker uses
# IPython's display formatters, so this one is a text check.
if grep -rnE '^\s*(from|import) IPython\.(core\.(magic|interactiveshell|getipython)|kernel)\b' \
        --include='*.py' monarch_kernel | grep -v '^monarch_kernel/kernel/'; then
    echo "IPython's kernel parts are imported outside monarch_kernel.kernel (above)" >&2
    status=1
fi

# Types: the modules and settings are in [tool.mypy] of pyproject.toml.
"$venv/bin/mypy" || status=1
# Lint: the rule set of [tool.ruff.lint] in pyproject.toml.
"$venv/bin/ruff" check . || status=1
exit $status
