#!/usr/bin/env bash
# One device call on the lent H200: doctor, verify, GPU tests, linear + MoE benchmarks.
# Usage (device tool, carry .whl and .peer):  bash benchmarks/run_h200.sh
# Logs and result files go to $OUT (or ./device-out); each step has its own time limit so a slow
# step cannot eat the others' time. Steps that run benchmarks/probes/ scripts re-measure what
# benchmarks/probes/README.md says each found.
set -uo pipefail
DEST=${OUT:-$PWD/device-out}
OUT=/tmp/qd-out  # everything lands here; packed into $DEST/results.tgz after every step, since
mkdir -p "$OUT" "$DEST"  # the device tool returns at most 8 files and a killed call must keep its logs
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
STEPS=${STEPS:-"doctor doctor-json verify wgmma-waits gpu-tests dequant-sweep bench-linear bench-moe"}  # also: whole-model eager-step dequant-overlap selfcheck model-decode decode-profile fp8-logits tp-nccl eager-ab host-overhead fp8-prefill fp8-gemm-sweep fp8-grouped-probe fp8-producers model-prefill fp8-reencode-sweep bench-moe-mx mma-sweep gemv-ablation gemm-sweep stream-small
step() {  # step NAME SECONDS CMD...   (runs only if NAME is in $STEPS)
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
  tail -n "${TAIL:-4}" "$OUT/$name.log"
  tar czf "$DEST/results.tgz" -C "$OUT" .
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
step doctor 60 python3 -m quantdispatch doctor --verbose --format nvfp4 --format fp8 --act-dtype bf16
step doctor-json 60 python3 -m quantdispatch doctor --json
step verify 120 python3 -m quantdispatch verify
TAIL=20 step wgmma-waits 120 python3 benchmarks/probes/wgmma_waits.py  # the device Triton's wgmma waits
# pytest-xdist is on the H200's image: one process per CPU core compiles the Triton kernels in parallel
TAIL=25 step gpu-tests "${GPU_TEST_S:-480}" python3 -m pytest -q -p no:cacheprovider -n "${GPU_WORKERS:-14}" --dist loadfile ${GPU_TESTS:-tests/gpu}
TAIL=30 step selfcheck 90 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_selfcheck_gpu.py
TAIL=40 step model-decode "${DECODE_S:-240}" python3 benchmarks/model_decode.py --out "$OUT" --budget-s "${DECODE_BUDGET:-190}" ${DECODE_ARGS:-}
TAIL=60 step decode-profile "${PROFILE_S:-300}" python3 benchmarks/probes/decode_profile.py --out "$OUT" ${PROFILE_ARGS:-}
TAIL=12 step fp8-logits 120 python3 benchmarks/fp8_logits.py --out "$OUT"
TAIL=20 step tp-nccl "${TP_S:-300}" torchrun --nproc_per_node "${TP_RANKS:-2}" benchmarks/tp_nccl.py --out "$OUT"
step eager-ab 200 python3 benchmarks/probes/eager_dispatch_ab.py --out "$OUT"
TAIL=40 step eager-step "${EAGER_STEP_S:-150}" python3 benchmarks/probes/eager_step.py ${EAGER_STEP_ARGS:-}
TAIL=30 step host-overhead 240 python3 benchmarks/host_overhead.py --out "$OUT"
TAIL=60 step whole-model "${WHOLE_S:-560}" python3 benchmarks/whole_model.py --out "$OUT" --budget-s "${WHOLE_BUDGET:-500}" ${WHOLE_ARGS:-}
TAIL=40 step dequant-sweep 120 python3 benchmarks/probes/dequant_sweep.py ${DEQUANT_SWEEP_ARGS:-}
TAIL=20 step dequant-overlap "${OVERLAP_S:-200}" python3 benchmarks/probes/dequant_overlap.py --out "$OUT" ${OVERLAP_ARGS:-}
TAIL=40 step mma-sweep "${MMA_S:-300}" python3 benchmarks/probes/mma_sweep.py ${MMA_ARGS:-}
TAIL=40 step gemv-ablation "${ABL_S:-150}" python3 benchmarks/probes/gemv_ablation.py ${ABL_ARGS:-}
TAIL=40 step gemm-sweep "${GEMM_S:-300}" python3 benchmarks/probes/gemm_sweep.py ${GEMM_ARGS:-}
step bench-linear "${LINEAR_S:-200}" python3 benchmarks/linear.py --out "$OUT" ${LINEAR_ARGS:-}
step bench-moe "${MOE_S:-150}" python3 benchmarks/moe.py --out "$OUT" ${MOE_ARGS:-}
step bench-moe-mx "${MOE_MX_S:-120}" python3 benchmarks/moe.py --format mxfp4 --out "$OUT" ${MOE_ARGS:-}
TAIL=40 step fp8-gemm-sweep "${SWEEP_S:-300}" python3 benchmarks/probes/fp8_gemm_sweep.py --out "$OUT" ${SWEEP_ARGS:-}
TAIL=40 step fp8-grouped-probe 240 python3 benchmarks/probes/fp8_grouped_probe.py --out "$OUT"
TAIL=70 step fp8-prefill "${PREFILL_S:-260}" python3 benchmarks/fp8_prefill.py --out "$OUT" --budget-s "${PREFILL_BUDGET:-200}" ${PREFILL_ARGS:-}
TAIL=40 step fp8-producers 240 python3 benchmarks/probes/fp8_producers.py --out "$OUT"
TAIL=30 step model-prefill 300 python3 benchmarks/model_prefill.py --out "$OUT" ${MODEL_PREFILL_ARGS:-}
TAIL=20 step fp8-reencode-sweep 200 python3 benchmarks/probes/fp8_reencode_sweep.py --out "$OUT"
step stream-small 90 python3 benchmarks/probes/stream_small.py --out "$OUT"
ls -la "$OUT"
tar czf "$DEST/results.tgz" -C "$OUT" .
