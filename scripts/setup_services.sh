#!/usr/bin/env bash
# Install the programs the tests and benchmarks start themselves, from Debian's packages:
# redis-server (with redis-cli and redis-benchmark) for the HPS service tests, chromium for the
# run-report test. Idempotent; does nothing when they are present.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-benchmark >/dev/null || need+=(redis-tools)
command -v chromium >/dev/null || need+=(chromium)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
# the redis package may start a system-wide server on 6379; the tests start their own cluster
(command -v service >/dev/null && $SUDO service redis-server stop >/dev/null 2>&1) || true
