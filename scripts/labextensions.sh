#!/usr/bin/env bash
# Build the JupyterLab extensions in extensions/ (extensions/build.sh) and make a venv's
# JupyterLab load them: an editable install (pip install -e .) skips pyproject.toml's
# [tool.setuptools.data-files], so each built extension is linked where JupyterLab looks for
# prebuilt ones, <venv>/share/jupyter/labextensions/<name> (what `jupyter labextension develop`
# does). A later non-editable `pip install .` into the same venv would write through that link
# into the source tree: remove the link first (scripts/labextensions.sh --unlink VENV).
#
# usage: bash scripts/labextensions.sh [--no-build] [--unlink] [VENV]   (VENV: default ./.venv)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
build=1 unlink=0
while [ $# -gt 0 ]; do
    case "$1" in
        --no-build) build=0; shift ;;
        --unlink) unlink=1; shift ;;
        *) break ;;
    esac
done
VENV="${1:-$ROOT/.venv}"
[ -d "$VENV" ] || { echo "[labext] ERROR: no venv at $VENV (run scripts/setup.sh first)" >&2; exit 2; }
VENV="$(cd "$VENV" && pwd)"
[ "$build" = 1 ] && [ "$unlink" = 0 ] && bash extensions/build.sh
for src in extensions/*/; do
    src="${src%/}"
    [ -f "$src/package.json" ] || continue
    name=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["name"])' "$src/package.json")
    dest="$VENV/share/jupyter/labextensions/$name"
    if [ "$unlink" = 1 ]; then
        [ -L "$dest" ] && rm -f "$dest" && echo "[labext] unlinked $dest"
        continue
    fi
    out="$ROOT/$src/labextension"
    if [ ! -f "$out/package.json" ]; then
        echo "[labext] $src not built (bash extensions/build.sh); not linked"
        continue
    fi
    # install.json names the Python package that ships the extension (as in the wheel).
    cp "$src/install.json" "$out/install.json"
    mkdir -p "$(dirname "$dest")"
    if [ -L "$dest" ] && [ "$(readlink "$dest")" = "$out" ]; then
        continue
    fi
    rm -rf "$dest"
    ln -s "$out" "$dest"
    echo "[labext] linked $dest -> $out"
done
