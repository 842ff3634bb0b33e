#!/usr/bin/env bash
# Run the unit and kernel groups of the test suite against the oldest versions of the
# dependencies that pyproject.toml declares (scripts/oldest-constraints.txt), in their
# own venv, ./.venv-oldest (MONARCH_VENV=DIR: another folder), set up first by
# `MONARCH_DEPS=oldest scripts/setup.sh`. Extra arguments go to pytest (a -m of them
# replaces the groups). The exit status is pytest's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export MONARCH_DEPS=oldest
bash scripts/setup.sh
VENV="${MONARCH_VENV:-.venv-oldest}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PY="$VENV/bin/python"

# The kernel tests start the kernelspec "monarch" by name: it must be the one in this venv
# (its python), not one of the newest venv or of the user found earlier on the path.
export JUPYTER_PREFER_ENV_PATH=1
spec_python="$("$PY" -c 'from jupyter_client.kernelspec import KernelSpecManager as M
print(M().get_kernel_spec("monarch").argv[0])')"
if [ "$spec_python" != "$PY" ]; then
    echo "[test_oldest] ERROR: the kernelspec 'monarch' found from $VENV runs $spec_python," \
        "not $PY; unset JUPYTER_PATH (or remove that kernelspec) and rerun" >&2
    exit 2
fi
"$PY" - <<'PY'
from importlib.metadata import version
names = ["ipykernel", "jupyter_client", "pyzmq", "ipywidgets", "cloudpickle", "psutil", "rich",
         "ipython", "traitlets", "tornado", "jupyter_core", "comm", "torch"]
print("[test_oldest] " + ", ".join(f"{n} {version(n)}" for n in names))
PY
exec "$PY" -m pytest -q -p no:cacheprovider -m "unit or kernel" "$@"
