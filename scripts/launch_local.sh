#!/usr/bin/env bash
# Start N local training processes that form one jax.distributed cluster on 127.0.0.1.
#
#   scripts/launch_local.sh N CONFIG [more python -m jctr.train flags]
#
# Every process runs `python -m jctr.train --config CONFIG ...` (JCTR_LAUNCH_MODULE=jctr.online:
# `python -m jctr.online --config CONFIG ...`, streaming training) with JCTR_COORDINATOR,
# JCTR_NUM_PROCESSES and JCTR_PROCESS_ID set (process 0 hosts the coordinator). The config's
# solver.gpu lists one device list per process, e.g. [[0, 1], [0, 1]]. On CPU give each process
# its devices with XLA_FLAGS=--xla_force_host_platform_device_count=K (default here: 1, so that a config with gpu [0] runs as is).
# Output lines are prefixed with the process id; if one process fails the others are stopped,
# and the exit status is the first failure's.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 N CONFIG [python -m jctr.train flags]" >&2
  exit 2
fi
N=$1; CONFIG=$2; shift 2
case "$N" in ''|*[!0-9]*) echo "N must be a positive integer, got '$N'" >&2; exit 2;; esac
[ -f "$CONFIG" ] || { echo "config file not found: $CONFIG" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
PORT=${JCTR_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export XLA_FLAGS=${XLA_FLAGS:---xla_force_host_platform_device_count=1}
export JCTR_COORDINATOR=127.0.0.1:$PORT JCTR_NUM_PROCESSES=$N

pids=()
for ((i = 0; i < N; i++)); do
  JCTR_PROCESS_ID=$i "$PY" -m "${JCTR_LAUNCH_MODULE:-jctr.train}" --config "$CONFIG" "$@" \
    > >(sed -u "s/^/[p$i] /") 2> >(sed -u "s/^/[p$i] /" >&2) &
  pids+=($!)
done

status=0
live=("${pids[@]}")
while [ ${#live[@]} -gt 0 ]; do
  done_pid=
  wait -n -p done_pid "${live[@]}"
  rc=$?
  [ -n "$done_pid" ] || break
  live=("${live[@]/$done_pid}")
  live=(${live[@]})
  if [ $rc -ne 0 ] && [ $status -eq 0 ]; then
    status=$rc
    echo "[launch] process $done_pid exited with $rc; stopping the others" >&2
    for p in "${live[@]}"; do kill "$p" 2>/dev/null; done
  fi
done
wait
exit $status
