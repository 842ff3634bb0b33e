#!/usr/bin/env bash
# Set up everything monarch_kernel needs, in ./.venv: CPU torch, the package
# (editable, with the test, lint and docs extras) and the Jupyter kernelspec "monarch".
# Idempotent: a second run with an unchanged pyproject.toml does almost nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.monarch-setup-stamp"
TORCH_SPEC="${MONARCH_TORCH_SPEC:-torch==2.13.0}"

say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

# 1. A Python >= 3.10 to build the venv from.
BASE_PY="${PYTHON:-python3}"
command -v "$BASE_PY" >/dev/null || die "$BASE_PY not found; install Python 3.10 or newer"
"$BASE_PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$("$BASE_PY" --version 2>&1) is too old; Python 3.10 or newer is needed"

# 2. The virtual environment.
if [ ! -x "$PY" ]; then
    say "creating $VENV"
    "$BASE_PY" -m venv "$VENV" || die "could not create a venv (on Debian/Ubuntu: apt-get install python3-venv)"
fi

want_stamp="$(cat pyproject.toml scripts/setup.sh monarch_kernel/kernel/kernelspec.py | sha256sum | cut -d' ' -f1) $PY"
spec_json="$VENV/share/jupyter/kernels/monarch/kernel.json"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] && [ -f "$spec_json" ] \
        && grep -qF "\"$PY\"" "$spec_json"; then
    say "already set up ($VENV); nothing to do"
    exit 0
fi
rm -f "$STAMP"

export PIP_DISABLE_PIP_VERSION_CHECK=1
say "upgrading pip"
"$PY" -m pip install -q --upgrade pip || say "warning: could not upgrade pip; going on with $("$PY" -m pip --version)"

# 3. torch first, the CPU build, so that the package's "torch>=2.1" is already
#    satisfied and pip does not fetch a multi-GB CUDA build.
if "$PY" -c 'import torch' 2>/dev/null; then
    say "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
else
    say "installing $TORCH_SPEC"
    "$PY" -m pip install "$TORCH_SPEC" || die "could not install $TORCH_SPEC.
    This project expects the CPU build of torch 2.13.0 to be installable with plain
    'pip install torch==2.13.0' (a local wheel for Python 3.11 on the project's machines).
    Install a torch >= 2.1 into $VENV yourself, or set MONARCH_TORCH_SPEC, and rerun."
fi

# 4. The package itself, editable, with the test, lint and docs extras.
say "installing monarch-kernel (editable, with [test,lint,docs] extras)"
"$PY" -m pip install -q -e ".[test,lint,docs]" || die "pip install -e .[test,lint,docs] failed"

# 5. The kernelspec, into the venv (found by jupyter/nbclient run from the venv).
say "installing the kernelspec"
"$PY" -m monarch_kernel install --sys-prefix || die "kernelspec install failed"

echo "$want_stamp" > "$STAMP"
say "done: $VENV is ready (kernel 'monarch')"
