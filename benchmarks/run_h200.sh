#!/usr/bin/env bash
# One device call on the lent H200: doctor, verify, GPU tests, linear + MoE benchmarks.
# Usage (device tool, carry .whl):  bash benchmarks/run_h200.sh
# Logs and result files go to $OUT (or ./device-out); each step has its own time limit so a slow
# step cannot eat the others' time.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-4}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
step doctor 60 python3 -m quantdispatch doctor --format nvfp4 --format fp8 --act-dtype bf16
python3 -m quantdispatch doctor --json >"$OUT/doctor.json" 2>/dev/null
step verify 120 python3 -m quantdispatch verify
TAIL=12 step gpu-tests "${GPU_TEST_S:-240}" python3 -m pytest -q -x -p no:cacheprovider tests/gpu
step bench-linear "${LINEAR_S:-200}" python3 benchmarks/linear.py --out "$OUT"
step bench-moe "${MOE_S:-150}" python3 benchmarks/moe.py --out "$OUT"
ls -la "$OUT"
