#!/usr/bin/env bash
# Where the warps of one kernel launch wait, per SASS instruction (Nsight Compute source
# counters), on the device (device tool, carry .whl):
#   bash benchmarks/probes/profile_stalls.sh "mma gate_up 16" "gemm qkv 256 128x128x128w8s3" ...
#   (kernel shape M [tile or config], as benchmarks/probes/profile_mma.py takes them)
# Writes $OUT/stall-<kernel>-<shape>-<M>.txt (sections, stall reasons per issued instruction,
# tensor pipe use) and -sass.csv (per instruction: stall samples by reason), which
# benchmarks/probes/stall_table.py summarizes.
set -u
. "$(dirname "$0")/ncu_env.sh"  # wheels, PYTHONPATH, OUT, NCU
[ -n "$NCU" ] || exit 1
METRICS="regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"
METRICS="$METRICS,regex:^sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active$"
METRICS="$METRICS,regex:^sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active$"
for spec in "$@"; do
  set -- $spec
  name="stall-$1-$2-$3${4:+-$4}"
  extra=()
  if [ $# -ge 4 ]; then
    if [ "$1" = gemm ]; then extra=(--tile "$4"); else extra=(--config "$4"); fi
  fi
  python3 benchmarks/probes/profile_mma.py --kernel "$1" --shape "$2" --m "$3" "${extra[@]}" 2>&1 | tail -1
  timeout "${NCU_S:-120}" "$NCU" --kernel-name "regex:${NCU_KERNEL:-_mma}" --launch-skip "${NCU_SKIP:-3}" \
    --launch-count 1 --import-source no \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section LaunchStats \
    --metrics "$METRICS" -f -o "/tmp/$name" \
    python3 benchmarks/probes/profile_mma.py --kernel "$1" --shape "$2" --m "$3" "${extra[@]}" \
    >"$OUT/$name.log" 2>&1 || { echo "ncu failed: $(tail -3 "$OUT/$name.log")"; continue; }
  "$NCU" -i "/tmp/$name.ncu-rep" --page details --print-details all >"$OUT/$name.txt" 2>&1
  "$NCU" -i "/tmp/$name.ncu-rep" --page raw --csv --metrics "$METRICS" >"$OUT/$name-raw.csv" 2>&1
  "$NCU" -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/$name-sass.csv" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Issued Warp|Eligible Warps|Warp Cycles Per Issued" "$OUT/$name.txt" | head -8
  wc -c "$OUT/$name-sass.csv"
done
