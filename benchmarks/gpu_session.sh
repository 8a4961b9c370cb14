#!/usr/bin/env bash
# The command of one GPU session (the device machine runs it in a copy of this checkout, with
# .whl/ carried: benchmarks/gpu_wheels.sh): install the wheels and paged itself into /tmp/site
# (as a package: its bundled plugins register through entry points), then gpu_check.py with
# the given arguments; the log goes to $OUT when it is set.
#
#     bash benchmarks/gpu_session.sh                        # all three sections, ~5 min on an H100
#     bash benchmarks/gpu_session.sh --sections e2e         # one of them
set -o pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
  --target /tmp/site .whl/*.whl . >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
echo "installed in $(( $(date +%s) - start )) s"
log=${OUT:-/tmp}/gpu_check.log
timeout "${GPU_CHECK_TIMEOUT:-450}" "$python" benchmarks/gpu_check.py "$@" 2>&1 | tee "$log"
status=$?
echo "gpu_check exit $status after $(( $(date +%s) - start )) s"
exit $status
