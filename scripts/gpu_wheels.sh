#!/usr/bin/env bash
# Wheels a GPU image without the package index lacks (the device tool's machines reach
# nothing outside): the runtime dependencies its image does not carry, for its Python,
# downloaded here into .whl/ (git-ignored). scripts/gpu_check.sh installs them from there
# (--no-deps, into a folder on PYTHONPATH) where it finds them; the device tool carries the
# folder with `carry: [".whl"]`.
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]   # default 3.12 (the 2026 GPU image's)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
VER="${1:-3.12}"
# tensorboardX: the run's event files; rocksdict: the spill and sparse_store tests
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$VER" \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$ROOT/.whl" \
  "tensorboardX>=2.6" "rocksdict>=0.3.20"
ls -1 "$ROOT/.whl"
