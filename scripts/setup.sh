#!/usr/bin/env bash
# Set up everything monarch_kernel needs, in ./.venv: CPU torch, the package
# (editable, with the test, lint and docs extras), the Jupyter kernelspec "monarch" and, when
# extensions/build.sh has built it, a link to the JupyterLab extension.
# Idempotent: a second run with an unchanged pyproject.toml does almost nothing.
#
# MONARCH_DEPS=oldest: the oldest versions the package declares it supports instead
# (scripts/oldest-constraints.txt), with the test extra only, in ./.venv-oldest
# (scripts/test_oldest.sh runs the tests there). MONARCH_VENV=DIR: another venv folder.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
DEPS="${MONARCH_DEPS:-newest}"
case "$DEPS" in
    newest) EXTRAS="test,lint,docs"; CONSTRAINTS=(); DEFAULT_VENV="$ROOT/.venv" ;;
    oldest) EXTRAS="test"; CONSTRAINTS=(-c "$ROOT/scripts/oldest-constraints.txt")
            DEFAULT_VENV="$ROOT/.venv-oldest" ;;
    *) echo "[setup] ERROR: MONARCH_DEPS=$DEPS: give newest or oldest" >&2; exit 2 ;;
esac
VENV="${MONARCH_VENV:-$DEFAULT_VENV}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
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

# The JupyterLab extension, when built (extensions/build.sh; .ci/run builds it first): an
# editable install skips pyproject.toml's data-files, so link it into the venv (cheap, idempotent).
bash "$ROOT/scripts/labextensions.sh" --no-build "$VENV"

stamp_files=(pyproject.toml scripts/setup.sh monarch_kernel/kernel/kernelspec.py)
[ "$DEPS" = oldest ] && stamp_files+=(scripts/oldest-constraints.txt)
want_stamp="$(cat "${stamp_files[@]}" | sha256sum | cut -d' ' -f1) $DEPS $PY"
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

# 4. The package itself, editable, with the test, lint and docs extras (oldest: the
#    test extra, the dependencies held at scripts/oldest-constraints.txt).
say "installing monarch-kernel (editable, with [$EXTRAS] extras, $DEPS dependencies)"
"$PY" -m pip install -q ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} -e ".[$EXTRAS]" \
    || die "pip install -e .[$EXTRAS] ($DEPS dependencies) failed"

# 5. The kernelspec, into the venv (found by jupyter/nbclient run from the venv).
say "installing the kernelspec"
"$PY" -m monarch_kernel install --sys-prefix || die "kernelspec install failed"

echo "$want_stamp" > "$STAMP"
say "done: $VENV is ready (kernel 'monarch', $DEPS dependencies)"
