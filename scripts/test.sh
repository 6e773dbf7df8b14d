#!/usr/bin/env bash
# Set up (venv + dev extras) and run every test, slow ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
bash scripts/setup_services.sh
.venv/bin/ruff check jctr tests scripts
exec .venv/bin/python -m pytest -q -ra tests "$@"
