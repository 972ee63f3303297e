#!/usr/bin/env bash
# one-off A/B of the DequantGemm slab bound under benchmarks/linear.py (not committed)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
for r in 1 2; do
  for ws in 32 128; do
    python3 - "$ws" "$OUT/ws$ws-r$r" > "$OUT/ws$ws-r$r.log" 2>&1 <<'PY'
import runpy, sys
import quantdispatch.kernels.common.slabs as s
s.WORKSPACE_ELEMENTS = int(sys.argv[1]) * 2**20
out = sys.argv[2]
sys.path.insert(0, "benchmarks")
sys.argv = ["linear.py", "--ms", "1024,2048,4096", "--kernels", "nvfp4_auto,mxfp4_auto,bf16", "--marlin-ms", "none", "--out", out]
runpy.run_path("benchmarks/linear.py", run_name="__main__")
PY
    echo "== ws $ws round $r"; grep "^| [a-z]" "$OUT/ws$ws-r$r.log" | tail -12
  done
done
