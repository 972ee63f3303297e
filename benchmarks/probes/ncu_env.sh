# Sourced by the Nsight Compute scripts (profile_h200.sh, profile_stalls.sh) on the device:
# installs the carried wheels, sets PYTHONPATH and OUT, and finds ncu (NCU is empty if absent).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
