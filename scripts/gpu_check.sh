#!/usr/bin/env bash
# The one command a GPU machine runs: kernels and tables on the cuda platform (Pallas/Triton
# compiled, not interpret mode; erase, eviction and growth too), scripts/bench_tables.py,
# scripts/bench_train.py and scripts/bench_ops.py on the GPU, then the synthetic training jobs.
# Figures and logs go to OUT (default ./gpu_check_out) and, as a dated section with the GPU's
# name, to the end of docs/performance.md.
#
#   bash scripts/gpu_check.sh [OUT]                 # everything (about 11 minutes on an H200)
#   GPU_CHECK_STEPS=tests bash scripts/gpu_check.sh # some steps: tests bench train (any of them)
#   GPU_CHECK_QUICK=1 bash scripts/gpu_check.sh     # the same as GPU_CHECK_STEPS="tests train"
#
# A machine that reaches no package index gets the wheels it lacks carried along:
# `bash scripts/gpu_wheels.sh` here, then the device tool's `carry: [".whl"]`.
#
# Where one command may run 10 minutes (the device tool's machines), run it as two:
# GPU_CHECK_STEPS=tests (about 5 minutes) and GPU_CHECK_STEPS="bench train".
# The tests run with XLA's deterministic GPU ops (--xla_gpu_deterministic_ops): XLA:GPU's
# scatter-adds otherwise sum in the order its atomics land, and the tests that compare a resumed
# or grown run with the uninterrupted one bit for bit (as on CPU) then differ in the last bits
# (an H200, 2026-11-26; Adam's updates of rows with gradients near 0 amplify them).
#
# JAX with its CUDA plugin is used as found (a GPU image carries a newer JAX than the CPU
# build); where JAX sees no GPU, the `gpu` extra is installed first (needs the package index).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${1:-${OUT:-$ROOT/gpu_check_out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
[ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && PY="$ROOT/.venv/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the device's memory is XLA's to take as it needs (tests start several processes)
export XLA_PYTHON_CLIENT_PREALLOCATE=false

has_gpu() { "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; }
if ! has_gpu; then
  echo "[gpu_check] JAX sees no GPU with $PY: installing the gpu extra"
  "$PY" -m pip install -q -e ".[gpu]" || { echo "[gpu_check] pip install failed"; exit 2; }
  has_gpu || { echo "[gpu_check] still no GPU for JAX: nothing to check"; exit 2; }
fi

# wheels carried to an image without the package index (scripts/gpu_wheels.sh)
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$OUT/site" \
    "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:$OUT/site"
fi

STEPS="${GPU_CHECK_STEPS:-tests bench train}"
[ -n "${GPU_CHECK_QUICK:-}" ] && STEPS="tests train"
wants() { [[ " $STEPS " == *" $1 "* ]]; }

status=0
step() {  # step NAME SECONDS COMMAND...: run (at most SECONDS), log to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "[gpu_check] $name: $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "[gpu_check] $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1  # 124: ran past its limit
  echo "| $name | $rc | $((SECONDS - t0)) s |" >> "$OUT/steps.md"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__,
jax.devices())'; } | tee "$OUT/machine.txt"
echo "| step | exit | time |" > "$OUT/steps.md"; echo "| --- | --- | --- |" >> "$OUT/steps.md"

# kernel and table tests on the GPU: conftest's 8 forced host devices stay on the CPU backend,
# the default backend (what the tests use) is the GPU; tests on 8 devices need the forced host
# devices as the default backend, so they are left to the CPU. Compiles dominate: with
# pytest-xdist, four to six workers share the GPU (GPU_CHECK_WORKERS sets how many).
if wants tests; then
  workers=()
  # (six on the H200's 16 cores: 184 tests in 177 s, 2026-11-28)
  default_workers=$(( $(nproc) >= 12 ? 6 : 4 ))
  "$PY" -c "import xdist" 2>/dev/null && workers=(-n "${GPU_CHECK_WORKERS:-$default_workers}")
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_deterministic_ops=true" \
  step tests 420 "$PY" -m pytest -q -ra -p no:cacheprovider --timeout 300 --durations 12 "${workers[@]}" \
    -k "not eight_devices" tests/test_pallas_kernels.py tests/test_hash_table.py \
    tests/test_row_optimizers.py tests/test_sparse_memory.py tests/test_layers.py \
    tests/test_eviction.py tests/test_table_growth.py
fi
if wants bench; then
  step bench_tables 120 "$PY" scripts/bench_tables.py
  step bench_train 300 "$PY" scripts/bench_train.py --steps 10 --warmup 2 \
    --json "$OUT/bench_train.json"
  step bench_ops 90 "$PY" scripts/bench_ops.py
fi
if wants train; then
RUNS="$(mktemp -d)"
for model in dlrm deepfm; do
  step "train_$model" 90 "$PY" - "$model" "$RUNS" <<'EOF'
import json, os, subprocess, sys
model, runs = sys.argv[1], sys.argv[2]
cfg = json.load(open(f"configs/{model}_synthetic.json"))
data = cfg["layers"][0]
for key in ("source", "eval_source"):
    data[key] = data[key].replace("./data", os.path.join(runs, "data"))
cfg["solver"]["snapshot_prefix"] = os.path.join(runs, model) + "/"
cfg["solver"]["log_dir"] = os.path.join(runs, model + "_log")
path = os.path.join(runs, f"{model}.json")
json.dump(cfg, open(path, "w"))
sys.exit(subprocess.call([sys.executable, "-m", "jctr.train", "--config", path]))
EOF
done
rm -rf "$RUNS"
fi

{ echo
  echo "## GPU check, $(date -u +%Y-%m-%d) ($(head -1 "$OUT/machine.txt"))"
  echo
  echo "\`bash scripts/gpu_check.sh\`; $(sed -n 2p "$OUT/machine.txt" | cut -c1-120)"
  echo
  cat "$OUT/steps.md"
  echo
  [ -f "$OUT/tests.log" ] && grep -h -E "passed|failed|error" "$OUT/tests.log" | tail -1 | sed 's/^/Tests: /'
  for f in bench_tables bench_train bench_ops; do
    [ -f "$OUT/$f.log" ] || continue
    echo; echo "\`$f\`:"; echo; echo '```'; grep -v -E "^\[gpu_check\]|WARNING" "$OUT/$f.log" | tail -40; echo '```'
  done
} > "$OUT/gpu_check.md"
cat "$OUT/gpu_check.md" >> docs/performance.md
cp docs/performance.md "$OUT/performance.md"
echo "[gpu_check] done: exit $status; section appended to docs/performance.md"
exit $status
