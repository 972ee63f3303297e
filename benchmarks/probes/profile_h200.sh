#!/usr/bin/env bash
# Profile the mma kernels with Nsight Compute where the device has it (device tool, carry .whl):
#   bash benchmarks/probes/profile_h200.sh "mma gate_up 16" "moe - 1" ...   (kernel shape M)
# Writes $OUT/ncu-<kernel>-<shape>-<M>.txt and prints the headline metrics.
set -u
. "$(dirname "$0")/ncu_env.sh"  # wheels, PYTHONPATH, OUT, NCU
for spec in "$@"; do
  set -- $spec
  shape=$2; [ "$shape" = "-" ] && shape=gate_up
  python3 benchmarks/probes/profile_mma.py --kernel "$1" --shape "$shape" --m "$3" 2>&1 | tail -1
  [ -n "$NCU" ] || continue
  f="$OUT/ncu-$1-$shape-$3.txt"
  # NCU_KERNEL / NCU_SKIP / NCU_COUNT: which launches (default: the 4th _mma* kernel)
  timeout 150 "$NCU" --kernel-name "regex:${NCU_KERNEL:-_mma}" --launch-skip "${NCU_SKIP:-3}" \
    --launch-count "${NCU_COUNT:-1}" \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section SchedulerStats \
    python3 benchmarks/probes/profile_mma.py --kernel "$1" --shape "$shape" --m "$3" >"$f" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots|Stall|Hit Rate|ERR|Warp Cycles Per Issued|No Eligible|Active Warps Per|Eligible Warps" "$f" | head -40
done
