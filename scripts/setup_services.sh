#!/usr/bin/env bash
# Install the servers the service tests and benchmarks start themselves: Debian's redis-server
# (with redis-cli and redis-benchmark). Idempotent; does nothing when they are present.
set -euo pipefail
if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends redis-server redis-tools >/dev/null
# the package may start a system-wide server on 6379; the tests start their own cluster
(command -v service >/dev/null && $SUDO service redis-server stop >/dev/null 2>&1) || true
