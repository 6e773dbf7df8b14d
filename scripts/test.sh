#!/usr/bin/env bash
# Set up (venv + dev extras) and run every test, slow ones included, on two pytest-xdist
# workers (JCTR_TEST_WORKERS=1: in one process). A test file stays on one worker (its module
# fixtures are made once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
bash scripts/setup_services.sh
.venv/bin/ruff check jctr tests scripts
workers="${JCTR_TEST_WORKERS:-2}"
if [ "$workers" -gt 1 ]; then
  exec .venv/bin/python -m pytest -q -ra -n "$workers" --dist loadfile tests "$@"
fi
exec .venv/bin/python -m pytest -q -ra tests "$@"
