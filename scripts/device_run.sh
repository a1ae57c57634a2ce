#!/usr/bin/env bash
# Second device call (after `bash .device-bundle/p1/stage.sh`, see ../shared/device_notes.md):
# installs the sglang bundle and this package on the H200, then runs the GPU tests and the
# decode benchmark. Logs and result tables go to $OUT.
#   device run: carry [".device-bundle/p2"], command: bash scripts/device_run.sh [tests|bench|all]
set -uo pipefail
what="${1:-all}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if [ -d .device-bundle/p2 ]; then
  # shellcheck disable=SC1091
  source .device-bundle/p2/install.sh > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
elif [ -d /tmp/site/sglang ]; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# pip install -e . fails there (setuptools loads the bundled `kernels` package); use the source tree.
export PYTHONPATH="$PWD/python:${PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python -m pytest -q -m gpu tests -x -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; rc=$?
  tail -30 "$OUT/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python scripts/bench_decode.py --out "$OUT/bench_decode.md" > "$OUT/bench_decode.log" 2>&1 || rc=1
  tail -40 "$OUT/bench_decode.log"
fi
exit $rc
