#!/usr/bin/env bash
# A/B of programmatic dependent launch on the H200 (device tool, carry .whl): linear M <= 16
# (nvfp4 auto vs bf16) and MoE M = 1, 4 with QUANTDISPATCH_PDL=0 and with the default, then
# the whole GPU suite. Results and logs under $OUT/{lin,moe}-{nopdl,pdl}. Only kernels that
# honour QUANTDISPATCH_PDL differ between the halves: since commit "Revert the experiment ..."
# that is the single-pair MoE's down launch (the linear kernel never is a dependent launch).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/lin-nopdl $OUT/lin-pdl $OUT/moe-nopdl $OUT/moe-pdl
K=nvfp4_auto,bf16; MS=1,2,4,8,16
QUANTDISPATCH_PDL=0 timeout 90 python3 benchmarks/linear.py --kernels $K --ms $MS --out $OUT/lin-nopdl > $OUT/lin-nopdl.log 2>&1
timeout 90 python3 benchmarks/linear.py --kernels $K --ms $MS --out $OUT/lin-pdl > $OUT/lin-pdl.log 2>&1
QUANTDISPATCH_PDL=0 timeout 60 python3 benchmarks/moe.py --ms 1,4 --out $OUT/moe-nopdl > $OUT/moe-nopdl.log 2>&1
timeout 60 python3 benchmarks/moe.py --ms 1,4 --out $OUT/moe-pdl > $OUT/moe-pdl.log 2>&1
grep -h "^| " $OUT/lin-nopdl/*.md $OUT/lin-pdl/*.md $OUT/moe-nopdl/*.md $OUT/moe-pdl/*.md | grep -v "\-\-\-|" | cut -c1-160
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu-tests.log 2>&1; tail -5 $OUT/gpu-tests.log
