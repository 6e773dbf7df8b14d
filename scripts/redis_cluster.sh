#!/usr/bin/env bash
# A local Redis cluster of 3 masters on loopback, for the HPS tests and benchmarks.
#
#   scripts/redis_cluster.sh start DIR [PASSWORD]   # ports $REDIS_PORT.. (default 7000, 7001, 7002)
#   scripts/redis_cluster.sh stop DIR
#   scripts/redis_cluster.sh node DIR PORT          # (re)start one node from its config (recovery)
#
# Each node keeps its config, cluster state and log in DIR/<port>/; no persistence (RDB/AOF off):
# a restarted node comes back empty and the HPS refills it. Uses Debian's redis-server
# (scripts/setup_services.sh installs it).
set -euo pipefail
cmd="${1:?usage: redis_cluster.sh start|stop|node DIR [PASSWORD|PORT]}"
dir="${2:?usage: redis_cluster.sh start|stop|node DIR [PASSWORD|PORT]}"
base="${REDIS_PORT:-7000}"
ports=("$base" "$((base + 1))" "$((base + 2))")
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

auth_args() {
  local pw
  pw="$(cat "$dir/password" 2>/dev/null || true)"
  if [ -n "$pw" ]; then printf -- "--no-auth-warning -a %s" "$pw"; fi
}

wait_up() {  # port
  for _ in $(seq 1 100); do
    # shellcheck disable=SC2046
    if redis-cli -p "$1" $(auth_args) ping 2>/dev/null | grep -q PONG; then return 0; fi
    sleep 0.05
  done
  echo "redis node on port $1 did not start; see $dir/$1/redis.log" >&2
  return 1
}

start_node() {  # port
  redis-server "$dir/$1/redis.conf"
  wait_up "$1"
}

case "$cmd" in
  start)
    pw="${3:-}"
    printf '%s' "$pw" > "$dir/password"
    for p in "${ports[@]}"; do
      mkdir -p "$dir/$p"
      rm -f "$dir/$p/nodes.conf"
      {
        echo "port $p"
        echo "bind 127.0.0.1"
        echo "dir $dir/$p"
        echo "cluster-enabled yes"
        echo "cluster-config-file nodes.conf"
        echo "cluster-node-timeout 1000"
        echo "cluster-require-full-coverage no"
        echo "save \"\""
        echo "appendonly no"
        echo "daemonize yes"
        echo "pidfile $dir/$p/redis.pid"
        echo "logfile $dir/$p/redis.log"
        if [ -n "$pw" ]; then echo "requirepass $pw"; echo "masterauth $pw"; fi
      } > "$dir/$p/redis.conf"
      start_node "$p"
    done
    # shellcheck disable=SC2046
    redis-cli $(auth_args) --cluster create "${ports[@]/#/127.0.0.1:}" --cluster-replicas 0 \
      --cluster-yes > "$dir/create.log" 2>&1
    # every master must see the cluster as ok: the one asked first may agree before the
    # others do, and a command routed to those would fail with CLUSTERDOWN
    for _ in $(seq 1 400); do
      ok=0
      for p in "${ports[@]}"; do
        # shellcheck disable=SC2046
        if redis-cli -p "$p" $(auth_args) cluster info 2>/dev/null | grep -q "cluster_state:ok"
        then ok=$((ok + 1)); fi
      done
      if [ "$ok" -eq "${#ports[@]}" ]; then
        echo "redis cluster up on 127.0.0.1:${ports[0]},${ports[1]},${ports[2]}"; exit 0
      fi
      sleep 0.05
    done
    echo "redis cluster did not reach state ok; see $dir/create.log" >&2
    exit 1
    ;;
  node)
    start_node "${3:?port}"
    ;;
  stop)
    for p in "${ports[@]}"; do
      if [ -f "$dir/$p/redis.pid" ]; then
        kill "$(cat "$dir/$p/redis.pid")" 2>/dev/null || true
      fi
    done
    ;;
  *)
    echo "usage: redis_cluster.sh start|stop|node DIR [PASSWORD|PORT]" >&2
    exit 2
    ;;
esac
